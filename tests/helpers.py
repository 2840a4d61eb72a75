"""Test helpers: tiny checkpoints, HF reference decoding, and a local multi-process launcher."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from config.paths import DATASETS  # noqa: F401  (re-exported for the tests)
from draft.lookup import FLOOR
from pipeline.tools.ranks import free_port  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
DATA = SHARED / "data"


def tiny_llama(path: Path, seed: int = 0, layers: int = 4, vocab: int = 96, hidden: int = 64,
               tie: bool = False, dtype=torch.float32) -> Path:
    """A random LLaMA with GQA saved with save_pretrained, plus a copied tokenizer-less config."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(dtype)
    # sharper random logits so that greedy choices are stable
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def launch(world: int, args: list[str], timeout: float = 300, env: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run ``pipeline.run`` on ``world`` local CPU ranks (what torchrun does, minus the agent): every rank its own
    process, forked from the session's zygote (:mod:`tests.zygote`: torch and transformers imported once, about
    4.5 CPU-s saved per rank), or exec'd as ``python -m pipeline.run`` when ``FLOWSPEC_TEST_EXEC_RANKS=1``.
    Returns rank 0's exit code and stdout, every rank's stderr (rank order) and ``codes``; all ranks together
    get ``timeout`` seconds (then they are killed and ``subprocess.TimeoutExpired`` is raised)."""
    from tests.zygote import shared_zygote
    port = free_port()
    zygote = None if os.environ.get("FLOWSPEC_TEST_EXEC_RANKS", "") not in ("", "0") else shared_zygote()
    tmp = Path(tempfile.mkdtemp(prefix="launch-"))
    procs, pids, files = [], [], []
    try:
        for r in range(world):
            e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(r), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
            out, err = tmp / f"rank{r}.out", tmp / f"rank{r}.err"
            files.append((out, err))
            if zygote is not None:
                pids.append(zygote.spawn(e, args, err, out))
                continue
            with open(out, "w") as of, open(err, "w") as ef:
                procs.append(subprocess.Popen([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=e,
                                              stdout=of, stderr=ef))
        codes = _wait_ranks(zygote, procs, pids, time.monotonic() + timeout)
        if codes is None:
            raise subprocess.TimeoutExpired([sys.executable, "-m", "pipeline.run", *args], timeout)
        outs = [(c, o.read_text(errors="replace"), e.read_text(errors="replace")) for c, (o, e) in zip(codes, files)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for pid in pids:
            if pid not in zygote.exits:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(tmp, ignore_errors=True)
    res = subprocess.CompletedProcess(args, outs[0][0], outs[0][1], "".join(o[2] for o in outs))
    res.codes = [o[0] for o in outs]
    if check and any(res.codes):
        raise AssertionError(f"ranks exited {res.codes}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-5000:]}")
    return res


def _wait_ranks(zygote, procs, pids, deadline: float) -> list[int] | None:
    """Every rank's exit code (-N: killed by signal N), or None at the deadline."""
    while True:
        if zygote is not None:
            zygote.collect(0.05)
            codes = [zygote.exits[p][0] if p in zygote.exits else None for p in pids]
        else:
            codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if time.monotonic() > deadline:
            return None
        if zygote is None:
            time.sleep(0.05)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, stop_ids, dtype=torch.float32) -> list[int]:
    """HF ``generate(do_sample=False)`` on the unsplit model: the reference every mode must equal. Memoized per
    (model, dtype, prompt, max tokens, stop ids) for the session: a test that checks five modes' rows of one
    prompt compares them with one reference decode (greedy decoding is deterministic; a copy is returned)."""
    from transformers import AutoModelForCausalLM
    key = (str(model_dir), dtype, tuple(prompt_ids), max_new_tokens, tuple(sorted(stop_ids)))
    if key in _greedy_cache:
        return list(_greedy_cache[key])
    model = _hf_cache.get((str(model_dir), dtype))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        _hf_cache[(str(model_dir), dtype)] = model
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(stop_ids),
                             pad_token_id=sorted(stop_ids)[0])
    _greedy_cache[key] = out[0, len(prompt_ids):].tolist()
    return list(_greedy_cache[key])


_hf_cache: dict = {}
_greedy_cache: dict = {}


def step2_batch(tokens, pred):
    """Inputs that check the head's second drafting step under teacher forcing.

    Rows ``[context entries e_0..e_{N-1}; draft entries d_0..d_{N-1}]`` where ``d_t`` pairs ``token[t+1]``
    with the head's *own* prediction ``pred[t-1]`` of ``f_t`` and sees ``e_0..e_{t-1}`` and itself (as a
    tree node does at inference). Returns ``(tokens2, positions, attn_mask, d_features)``.
    """
    b, n = tokens.shape
    dev = tokens.device
    i = torch.arange(n, device=dev)
    causal = i[:, None] >= i[None, :]
    strict = i[:, None] > i[None, :]
    top = torch.cat([causal, torch.zeros(n, n, dtype=torch.bool, device=dev)], 1)
    bottom = torch.cat([strict, torch.eye(n, dtype=torch.bool, device=dev)], 1)
    mask = torch.cat([top, bottom], 0)[None, None].expand(b, 1, 2 * n, 2 * n)
    pos = torch.cat([i, i])[None].expand(b, 2 * n)
    dfeat = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], 1)
    return torch.cat([tokens, tokens], 1), pos, mask, dfeat


# Reference implementations the tests compare the package against (test oracles; nothing outside the tests uses
# them, so they live here: issue 43 item 5).

def shaped_tree(root_token: int, expand, total_token: int, max_depth: int, top_k: int, cover: float,
                width: int | None = None, rows: int | None = None) -> "DraftTree":
    """The confidence-shaped tree (``draft/shape.py``'s module docstring; the wired search, ``draft.tree_shape=confidence``, must build
    exactly this tree). ``expand(nodes, tokens, parents)`` is called once per level
    with the nodes to expand (candidate ids; ``-1`` is the root) and all candidates so far (``tokens``/``parents``
    lists, candidate ``i``'s parent a candidate id or ``-1``); it returns ``(logp [m, top_k], tokens [m, top_k])``:
    each node's best children, best first (log-probabilities local to the node; ``-inf`` for absent ones).
    ``max_depth`` levels at most (the root's children are level 1); ``width`` (default ``top_k``) nodes expanded per
    level at most; ``rows`` (default unbounded) nodes expanded in all at most, the root included (EAGLE-2 spends
    ``1 + (depth - 1) * top_k``)."""
    from draft.shape import pick_frontier
    from draft.tree import DraftTree
    from model.devices import HOST
    width = top_k if width is None else width
    rows_left = float("inf") if rows is None else rows
    if total_token <= 1 or max_depth < 1 or rows_left < 1:
        return DraftTree.single(root_token)
    budget = total_token - 1
    tokens: list[int] = []
    parents: list[int] = []
    scores = torch.empty(0, dtype=torch.float64)
    frontier = [-1]
    front_scores = torch.zeros(1, dtype=torch.float64)
    for _ in range(max_depth):
        rows_left -= len(frontier)
        logp, toks = expand(frontier, list(tokens), list(parents))
        logp, toks = logp.double().to(HOST), toks.to(HOST)
        cum = (front_scores[:, None] + logp).reshape(-1)
        ok = (cum > float("-inf")).nonzero().flatten()
        first = len(tokens)
        tokens += toks.reshape(-1)[ok].tolist()
        parents += [frontier[i // logp.shape[1]] for i in ok.tolist()]
        new_scores = cum[ok]
        scores = torch.cat([scores, new_scores])
        pick = pick_frontier(new_scores, scores, budget, width, cover, rows_left)
        if pick.numel() == 0:
            break
        frontier = (first + pick).tolist()
        front_scores = new_scores[pick]
    if not tokens:
        return DraftTree.single(root_token)
    return select_top_nodes(root_token, torch.tensor(tokens, device=HOST), torch.tensor(parents, device=HOST),
                            scores, total_token)


def expected_accepted(tree) -> float:
    """The expected number of draft tokens a round accepts if the draft's law were the target's (greedy target
    drawn from it): the sum over nodes of the path probability ``exp(score)`` (root excluded). The figure of merit
    the shape maximises under a fixed node budget."""
    return float(tree.scores[1:].double().exp().sum())



def remap_parents(parents, node_ids, keep, accepted_len: int):
    """Apply a keep-list to some nodes (e.g. a not-yet-computed segment).

    ``node_ids`` are the nodes' indices in the old index space and ``parents`` their old parents.
    After the decision the accepted path (``keep[:accepted_len]``) leaves the tree and the other kept
    nodes are renumbered ``0..`` in order. Returns ``(row_keep, new_parents)``: a boolean row mask and
    the new parents of kept rows (``-1`` for the new root, whose parent became context).
    """
    from model.devices import HOST
    node_ids, parents, keep = node_ids.to(HOST).long(), parents.to(HOST).long(), keep.to(HOST).long()
    size = 1 + max(int(node_ids.max()) if node_ids.numel() else 0, int(parents.max()) if parents.numel() else 0,
                   int(keep.max()) if keep.numel() else 0)
    new = torch.full((size,), -1, dtype=torch.long, device=HOST)        # old id -> new index (-1: not kept/path)
    new[keep] = torch.arange(keep.numel(), device=HOST) - accepted_len
    new = new.clamp(min=-1)                                             # the accepted path leaves the tree
    rows = new[node_ids] >= 0
    mapped = torch.where(parents >= 0, new[parents.clamp(min=0)], -1)
    return rows, mapped[rows]



def trees_match_up_to_ties(ref, got, tol: float) -> str | None:
    """The exactness rule for draft trees drafted through compiled code (``model.graphs=compile``) against the
    dynamic path's: None when they match, else why not (one line).

    A compiled graph may fuse and reorder float math (inductor; the rotary angles are float32 whatever the model's
    dtype), so a candidate's cumulative score may differ in its last bits, and two candidates whose scores *tie*
    within that error may swap ranks; from that node on the two searches legitimately diverge. So: node by node in
    tree order, tokens and parents equal and scores within ``tol``, up to the first node where they differ; there
    both trees' scores must lie within ``tol`` of each other (a near-tie decided the other way) -- anything else
    (a different token or parent with a clearly different score, or a score off by more than ``tol``) is a bug.
    Trees of different sizes match only through such a tie before the shorter one ends."""
    n = min(len(ref), len(got))
    for i in range(n):
        a, b = float(ref.scores[i]), float(got.scores[i])
        same = int(ref.tokens[i]) == int(got.tokens[i]) and int(ref.parents[i]) == int(got.parents[i])
        if abs(a - b) > tol:
            return f"node {i}: scores {a!r} vs {b!r} differ by more than {tol}"
        if not same:
            return None        # a near-tie decided the other way (scores within tol): the searches diverge here
    return None if len(ref) == len(got) else f"sizes {len(ref)} vs {len(got)} with no tie before node {n}"



def run_concurrent(stage_root: Path, jobs: list[tuple[list[int], str, object]], overrides: list[str],
                   stop_ids: set[int], drafter: str | None = None, lanes: int = 2, dtype=torch.float64,
                   lane_timeout_s: float | None = 60.0, started=None, warmup: list | None = None,
                   after_warmup=None, stage_meter=None, rank0_meter=None):
    """Run ``jobs`` (``(prompt ids, mode, GenSettings or None)``) concurrently on ``lanes`` lanes of one ring
    (:mod:`pipeline.lanes`): every job starts at once in its own thread and waits for a free lane; returns
    ``(results in job order, the LanePool)``. A job's exception is re-raised (the first one). ``started``:
    optional ``started(job index, lane)`` hook, called when a job gets its lane. ``warmup``: ``(prompt ids, mode)``
    generations run first, one at a time, by the engine the pool is then built on (as a server's warm-up);
    ``after_warmup(ring, engine)``: a test hook called then (e.g. to deliver a late direct message).
    ``stage_meter(rank)``: a meter for stage ``rank``'s forwards (e.g. one that pads them, as the emulated testbed
    does); ``rank0_meter()``: one for rank 0's model ops on every lane (``pipeline.lanes.lane_engine``). The pool's
    ``stage_workers`` are the stages' workers."""
    import threading

    from config.run_config import DEFAULT, apply_overrides
    from model.layers import set_lean
    from model.stage_format import read_manifest
    from model.stage_model import load_stage
    from pipeline.build import make_drafter, make_engine
    from pipeline.engine import timed_generation
    from pipeline.inprocess import _wait_s
    from pipeline.lanes import LanePool
    from pipeline.local_ring import LocalComm, LocalRing, stage_threads
    from pipeline.modes import new_decoder
    from pipeline.worker import StageWorker
    world = len(read_manifest(stage_root)["split"])
    cfg = apply_overrides(DEFAULT, overrides)
    ring = LocalRing(world)
    models = [load_stage(stage_root, r, world, dtype) for r in range(world)]
    for m in models:
        set_lean(m, cfg.model.lean_layers)     # model.lean_layers=false: the transformers layers, as pipeline.build
    modes = sorted({m for _, m, _ in jobs})
    if drafter is not None:
        cfg.model.head_dir = drafter
    d = make_drafter(cfg, stage_root, models[0], dtype, "cpu") if any(m != "ar" for m in modes) else None
    engine = make_engine(cfg, LocalComm(ring, 0, timeout_s=_wait_s(cfg)), models[0], stage_root, modes, stop_ids, dtype,
                         "cpu", drafter=d)
    results: list = [None] * len(jobs)
    failures: list[BaseException] = []
    workers: list[StageWorker] = []      # the stages' workers (tests read their batched-forward counters)

    def stage(r: int) -> None:
        worker = StageWorker(models[r], LocalComm(ring, r, timeout_s=_wait_s(cfg)), cfg.model.max_seq_len, dtype,
                             "cpu")
        if stage_meter is not None:
            worker.meter = stage_meter(r)
        workers.append(worker)
        worker.run()

    with stage_threads(world, stage, ring) as errors:
        for prompt, mode in warmup or []:
            timed_generation(engine, prompt, new_decoder(mode))
        if after_warmup is not None:
            after_warmup(ring, engine)
        pool = LanePool(engine, lanes, timeout_s=lane_timeout_s, rank0_meter=rank0_meter)
        pool.stage_workers = workers

        def job(i: int) -> None:
            lane = pool.acquire()
            try:
                if started is not None:
                    started(i, lane)
                prompt, mode, settings = jobs[i]
                results[i] = timed_generation(pool.engines[lane], prompt, new_decoder(mode), settings)
            except BaseException as e:   # re-raised by the caller's thread
                failures.append(e)
            finally:
                pool.release(lane)

        threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not errors:
            pool.shutdown()
    if failures:
        raise failures[0]
    return results, pool



def state_row(conts: list[list[int]], width: int, token_logp: float) -> list[float]:
    """Prompt lookup's compact state (``draft/lookup.py``'s docstring) of the next tokens of ``conts``, the rule's
    plain statement that the tests check :meth:`draft.lookup.LookupDrafter._state_row` and the vectorised level
    against: ``width // 2`` id slots then as many score slots, ids in order of first appearance, unused slots id
    ``-1`` and score ``FLOOR``, a token that followed ``c`` of ``n`` continuations ``log(c / n) + token_logp``."""
    slots = width // 2
    counts: dict[int, int] = {}
    for c in conts:
        if c:
            counts[c[0]] = counts.get(c[0], 0) + 1
    n = sum(counts.values())
    ids = list(counts)[:slots]
    return ids + [-1] * (slots - len(ids)) + [math.log(counts[t] / n) + token_logp for t in ids] + \
        [FLOOR] * (slots - len(ids))


def find_continuations(seq: list[int], max_ngram: int, min_ngram: int, max_matches: int,
                       length: int) -> list[list[int]]:
    """Prompt lookup's matching rule in plain Python (``draft/lookup.py``'s docstring), which the tests check
    :class:`draft.lookup.NgramIndex` and the vectorised level against: the continuations (each up to ``length``
    tokens) of the most recent earlier occurrences of the longest suffix n-gram of ``seq`` (``min_ngram <= n <=
    max_ngram``) that occurs earlier; most recent first. An occurrence counts when at least one token follows it
    inside ``seq`` (so never the suffix itself)."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = seq[L - n:]
        out = []
        for i in range(L - n - 1, -1, -1):      # start of an earlier occurrence, most recent first
            if seq[i:i + n] == suffix:
                out.append(seq[i + n:i + n + length])
                if len(out) >= max_matches:
                    break
        if out:
            return out
    return []


def check_tree(tree: "DraftTree") -> None:
    """Raise ``ValueError`` unless ``tree`` satisfies :mod:`draft.tree`'s invariants: node 0 is the root (parent
    -1), every other node's parent is earlier, siblings carry distinct tokens."""
    from model.devices import HOST
    n = len(tree)
    if n == 0 or int(tree.parents[0]) != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    idx = torch.arange(n, device=HOST)
    if n > 1 and not bool(((tree.parents[1:] >= 0) & (tree.parents[1:] < idx[1:])).all()):
        raise ValueError("every non-root node needs an earlier parent")
    pairs = set()
    for p, t in zip(tree.parents.tolist(), tree.tokens.tolist()):
        if (p, t) in pairs:
            raise ValueError(f"duplicate sibling token {t} under node {p}")
        pairs.add((p, t))


def select_top_nodes(root_token: int, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
                     cand_scores: torch.Tensor, total_token: int,
                     cand_depths: torch.Tensor | None = None) -> "DraftTree":
    """EAGLE-2 re-ranking on tensors: keep the best ``total_token - 1`` candidates plus the root (the rule as the
    tests state it; the drafters call its NumPy core, ``draft.tree.top_nodes_tree`` of ``best_first``).

    Candidates are listed in generation order; ``cand_parents[i]`` is ``-1`` (child of the root)
    or the index of an *earlier* candidate. Order = descending score, ties broken by candidate
    index (stable). Because a child's score never exceeds its parent's and a parent always has
    the smaller index, every selected node's parent is selected too, even on ties (ancestor-closed),
    and the output is ordered ancestors-first. ``cand_depths`` (optional): each candidate's depth below the
    root (1 for a child of the root), when the caller knows them (a beam knows its levels): the tree's depths
    are then gathered instead of recomputed from the parents.
    """
    from draft.tree import best_first, top_nodes_tree
    from model.devices import HOST
    sc = cand_scores.to(HOST).numpy()
    order = best_first(sc, max(0, min(total_token - 1, sc.size)))              # the kept candidates
    return top_nodes_tree(root_token, cand_tokens.to(HOST).numpy(), cand_parents.to(HOST).numpy(), sc, order,
                          None if cand_depths is None else cand_depths.to(HOST).numpy())


def ancestor_matrix(parents: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean matrix ``A[i, j] = j is an ancestor of i or j == i`` (``model.kv_cache.extend_ancestry``'s first
    half). With ``base`` (the matrix of ``m`` existing nodes), ``parents`` describes ``n`` new nodes ``m..m+n-1``;
    returns the ``[m+n, m+n]`` matrix. Raises ``ValueError`` for a parent that is not an earlier node."""
    from model.kv_cache import extend_ancestry
    return extend_ancestry(parents, base)[0]


class Pad:
    """A stage meter that makes every stage forward last ``s`` seconds at least (as the emulated testbed pads
    them): the lanes' segments then queue up at the stages, so stage steps carry several lanes
    (pipeline/batching.py) in every run, not only when the threads happen to interleave so."""

    counter_names = ()

    def __init__(self, s: float = 0.004) -> None:
        self.s = s

    @contextmanager
    def op(self, kind, rows, ctx=0):
        t0 = time.perf_counter()
        yield
        time.sleep(max(0.0, self.s - (time.perf_counter() - t0)))


def batched(pool) -> int:
    """Stage forwards that carried more than one lane, all stages."""
    return sum(w.batched_forwards for w in pool.stage_workers)


def run_batched(check, *args, attempts: int = 3, covered=None, what: str = "a stage step carried several lanes",
                **kw):
    """``run_concurrent(*args, **kw)`` until ``covered(pool)`` (default: a stage step carried several lanes),
    ``check``-ing the outputs of EVERY run. Why: whether the lanes' segments meet at a stage (or their rank-0 calls
    at the device) is timing (the ``Pad`` meters make it likely, a host at load 20 can still serialise the threads);
    the claim tested is the outputs', the meeting only its coverage."""
    covered = covered or (lambda pool: batched(pool) > 0)
    for _ in range(attempts):
        res, pool = run_concurrent(*args, **kw)
        check(res)
        if covered(pool):
            return res, pool
    pytest.fail(f"not once in {attempts} runs: {what} ({pool.lock.summary()})")
