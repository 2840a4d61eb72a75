"""Tensor-parallel baselines (modes ``tp`` and ``galaxy``): the ``--tp N`` split, the shard forward against the
unsplit model in one process, and real multi-process runs (gloo) against HF ``generate``.

SmolLM2 (9 query / 3 key-value heads) through N = 1 and 3 takes about a minute on two cores: it runs with
FLOWSPEC_SLOW=1 (its N = 2 refusal always runs).
"""
import json
import os
import queue
import subprocess
import sys
import threading
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import Tensor

from model.stage_format import read_manifest, verify_stage_file
from model.tp_model import load_tp_shard
from model.tp_split import check_tp, ffn_range, kv_heads_for, split_checkpoint_tp
from tests.helpers import REPO, STORIES, hf_greedy, launch, read_jsonl

MODES = "tp,galaxy"


class ThreadCollectives:
    """``size`` shards in one process, one thread each: sums in shard order, ring links as queues."""

    class Board:
        def __init__(self, size: int) -> None:
            self.size = size
            self.barrier = threading.Barrier(size, timeout=60)
            self.slots: list[Tensor | None] = [None] * size
            self.links = [queue.Queue() for _ in range(size)]   # links[t]: into shard t

    def __init__(self, board: "ThreadCollectives.Board", rank: int) -> None:
        self.board, self.size, self.rank = board, board.size, rank

    def all_reduce(self, t: Tensor) -> Tensor:
        b = self.board
        b.slots[self.rank] = t.clone()
        b.barrier.wait()
        total = b.slots[0].clone()
        for s in b.slots[1:]:
            total += s
        b.barrier.wait()
        t.copy_(total)
        return t

    def ring_start(self, send: Tensor, recv: Tensor):
        b = self.board
        b.links[(self.rank + 1) % self.size].put(send.clone())
        return _QueueRecv(b.links[self.rank], recv)

    def gather_to_first(self, t: Tensor, rows: list[int]) -> Tensor | None:
        b = self.board
        b.slots[self.rank] = t.clone()
        b.barrier.wait()
        out = torch.cat(list(b.slots), dim=1) if self.rank == 0 else None
        b.barrier.wait()
        return out


class _QueueRecv:
    def __init__(self, q: queue.Queue, into: Tensor) -> None:
        self.q, self.into = q, into

    def wait(self) -> None:
        self.into.copy_(self.q.get(timeout=60))


def tiny_gqa(path: Path, heads: int = 6, kv: int = 2, inter: int = 100, bias: bool = False,
             dtype=torch.float64) -> Path:
    """A random LLaMA whose heads allow N = 1, 2, 3 (and 6); the FFN width 100 does not divide by 3."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=8 * heads, intermediate_size=inter, num_hidden_layers=3,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512,
                      tie_word_embeddings=False, attention_bias=bias, mlp_bias=bias, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)   # sharp logits: stable greedy choices
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    full = tiny_gqa(root / "full")
    return full, {n: split_checkpoint_tp(full, root / f"tp{n}", n, progress=False) for n in (1, 2, 3)}


# -- split --------------------------------------------------------------------------------------------
def test_kv_heads_divided_replicated_or_per_query_head():
    assert [kv_heads_for(t, 2, 8, 4) for t in range(2)] == [[0, 1], [2, 3]]       # N divides the kv heads
    assert [kv_heads_for(t, 3, 9, 3) for t in range(3)] == [[0], [1], [2]]        # SmolLM2 at N = 3
    assert [kv_heads_for(t, 4, 8, 2) for t in range(4)] == [[0], [0], [1], [1]]   # replicated (kv < N)
    assert [kv_heads_for(t, 3, 6, 2) for t in range(3)] == [[0], [0, 1], [1]]     # straddling: one per q head
    assert [ffn_range(100, 3, t) for t in range(3)] == [(0, 34), (34, 67), (67, 100)]


def test_split_writes_checksummed_shards(tiny):
    full, roots = tiny
    m = read_manifest(roots[3])
    assert m["tp"] == 3 and m["split"] == [0, 3, 3, 3] and len(m["files"]) == 4
    for r in range(4):
        verify_stage_file(roots[3], m, r)
    cfg = json.loads((roots[3] / "stage_model_2" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]) == (2, 2, 33)
    assert cfg["tp_kv_heads"] == [0, 1] and cfg["tp_vocab_range"] == [33, 66]


def test_split_refuses_n_not_dividing_heads(tmp_path):
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads; choose one of 1, 2, 3, 6"):
        check_tp({"num_attention_heads": 6, "intermediate_size": 100}, 4)
    cfg = json.loads((REPO / "checkpoints" / "SmolLM2-135M-Instruct" / "config.json").read_text()) \
        if (REPO / "checkpoints" / "SmolLM2-135M-Instruct" / "config.json").is_file() else None
    if cfg is not None:   # SmolLM2: 9 heads, N = 2 is refused by the command line with one line
        res = subprocess.run([sys.executable, "split_and_save_models.py", "--model", "checkpoints/SmolLM2-135M-Instruct",
                              "--tp", "2", "--out", str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True)
        assert res.returncode == 2
        assert res.stderr.strip().splitlines() == ["error: --tp 2 does not divide the model's 9 attention heads; "
                                                   "choose one of 1, 3, 9"]


# -- in-process forward against the unsplit model ---------------------------------------------------------
def _run_shards(shards, schedule, chunks, guard=nullcontext):
    """Every shard in its own thread; returns shard 0's hidden states of each chunk (prefill rows, then a
    tree segment whose rows see the context and their ancestors only). ``guard()`` is entered by every thread
    around its forwards (``torch.device("meta")``: the device-placement guard of tests/test_device_guard.py)."""
    n = len(shards)
    board, outs, errors = ThreadCollectives.Board(n), [None] * n, []

    def run(t):
        try:
            sh = shards[t]
            cache = sh.new_cache(64, torch.float64, "cpu")
            got = []
            with guard():
                for ids, parents in chunks:
                    if parents is None:
                        pos, mask = cache.context_inputs(ids.shape[1], torch.float64)
                        got.append(sh(ids, pos, mask, cache, ThreadCollectives(board, t), schedule))
                        cache.commit_forward(ids.shape[1], as_context=True)
                    else:
                        pos, mask, anc, depth = cache.tree_inputs(parents, torch.float64)
                        got.append(sh(ids, pos, mask, cache, ThreadCollectives(board, t), schedule))
                        cache.commit_forward(ids.shape[1], as_context=False, anc=anc, depth=depth)
            outs[t] = got
        except BaseException as e:
            errors.append(e)
            board.barrier.abort()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return outs[0]


@pytest.mark.parametrize("bias", [False, True])
def test_shards_equal_unsplit_model_in_process(tmp_path, bias):
    from transformers import AutoModelForCausalLM
    full = tiny_gqa(tmp_path / "full", bias=bias)
    ref_model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float64).eval()
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    tree_tokens = torch.tensor([[40, 41, 42, 43, 44]])
    parents = torch.tensor([-1, 0, 0, 1, 3])         # a root, two children, a chain under the first
    with torch.no_grad():
        ref_ctx = ref_model.model(ids).last_hidden_state
        ref_tree = []
        for j in range(5):   # each node = the unsplit model on context + its own path
            path = [j]
            while parents[path[-1]] >= 0:
                path.append(int(parents[path[-1]]))
            seq = torch.cat([ids, tree_tokens[:, path[::-1]]], dim=1)
            ref_tree.append(ref_model.model(seq).last_hidden_state[0, -1])
    for n in (1, 2, 3, 6):
        root = split_checkpoint_tp(full, tmp_path / f"tp{n}", n, progress=False)
        shards = [load_tp_shard(root, r, n + 1, torch.float64) for r in range(1, n + 1)]
        for schedule in ("megatron", "galaxy"):
            guard = (lambda: torch.device("meta")) if n == 3 else nullcontext   # no tensor on a default device
            ctx, tree = _run_shards(shards, schedule, [(ids, None), (tree_tokens, parents)], guard)
            torch.testing.assert_close(ctx, ref_ctx, rtol=0, atol=1e-12, msg=f"N={n} {schedule} prefill")
            torch.testing.assert_close(tree[0], torch.stack(ref_tree), rtol=0, atol=1e-12,
                                       msg=f"N={n} {schedule} tree")


# -- real ranks (gloo) against HF generate -------------------------------------------------------------
def _launch(n, root, out, prompts, max_new, extra=(), dtype="float64", modes=MODES, check=True):
    args = [f"model.stage_dir={root}", f"dtype={dtype}", f"max_new_tokens={max_new}", "comm.timeout_s=60",
            "--modes", modes, "--output", str(out), "--quiet", *extra]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return launch(n + 1, args, timeout=300, check=check)


@pytest.mark.parametrize("n,drafter", [(1, "untrained"), (2, "oracle"), (3, "oracle")])
def test_tiny_tp_and_galaxy_equal_hf(tiny, tmp_path, n, drafter):
    full, roots = tiny
    head = () if drafter == "untrained" else (f"head_dir=oracle:{full}",)
    prompts = [[1, 5, 9, 13, 22, 7], [1] + list(range(3, 80))]   # the long one needs chunked prefill
    _launch(n, roots[n], tmp_path / "out.jsonl", prompts, 16, head)
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(r["mode"] for r in rows) == ["galaxy", "galaxy", "tp", "tp"]
    for row in rows:
        assert row["output_ids"] == hf_greedy(full, row["prompt_ids"], 16, {2}, torch.float64), (n, row["mode"])
        assert row["world_size"] == n + 1 and len(row["busy_fraction"]) == n + 1
    if drafter == "oracle":
        assert max(r["tau"] for r in rows) > 2.0


def test_rank0_loading_past_timeout_is_no_lost_rank_tp(tiny, tmp_path):
    """Rank 0 loads for 3x ``comm.timeout_s`` (slow, alive): the TP shards wait for its first broadcast
    (``Comm.wait_for_rank0``, as a ring stage does) and the job ends well; without that wait a shard's first
    broadcast receive gave up after ``comm.timeout_s`` with "lost rank 0" (this test failed so with it removed)."""
    full, roots = tiny
    args = [f"model.stage_dir={roots[2]}", "dtype=float64", "max_new_tokens=4", "comm.timeout_s=2",
            "comm.heartbeat_s=0.2", "--modes", "tp", "--quiet", "--prompt-ids", "1,5,9"]
    res = launch(3, args, timeout=120, env={"FLOWSPEC_FAULT": "rank=0,at=load,delay=6"}, check=False)
    assert res.returncode == 0 and "lost rank" not in res.stderr, res.stderr[-2000:]


def test_modes_and_split_kinds_must_match(tiny, tmp_path, capsys):
    """pipeline.tools.launch's one pre-check of every rank's arguments (pipeline.run.check_args) refuses mismatches."""
    from pipeline.run import check_args
    from model.split import split_checkpoint
    full, roots = tiny
    pipe = split_checkpoint(full, tmp_path / "pipe", [0, 2, 1], progress=False)
    for root, extra, line in [
            (roots[2], ["mode=naive"], "mode naive needs a pipeline split, but this stage root is a tensor-parallel "
                                       "split (--tp 2); run modes tp or galaxy on it"),
            (pipe, ["mode=tp"], "mode tp needs a tensor-parallel split: python split_and_save_models.py"),
            (roots[2], ["mode=galaxy", "emu.profile=edge_orin_7b"], None),      # emulated TP runs are modeled
            (roots[2], ["mode=tp"], None)]:
        code = check_args([f"model.stage_dir={root}", *extra, "--prompt-ids", "1,5"], 3)
        err = capsys.readouterr().err
        if line is None:
            assert code == 0, err
        else:
            assert code == 2 and err.startswith("[launch] error: " + line), err


@pytest.mark.skipif(not STORIES.is_dir(), reason="../shared is not available")
def test_stories260k_tp2_equal_hf(tmp_path):
    root = split_checkpoint_tp(STORIES, tmp_path / "tp2", 2, progress=False)
    _launch(2, root, tmp_path / "out.jsonl", [[1, 403, 407, 261, 378, 9], [1, 320, 333, 285]], 32,
            (f"head_dir=oracle:{STORIES}",), dtype="float32")
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert len(rows) == 4
    for row in rows:
        assert row["output_ids"] == hf_greedy(STORIES, row["prompt_ids"], 32, {2}, torch.float32), row["mode"]


SMOL = REPO / "checkpoints" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(os.environ.get("FLOWSPEC_SLOW") != "1" or not (SMOL / "config.json").is_file(),
                    reason="slow (about a minute): set FLOWSPEC_SLOW=1")
@pytest.mark.parametrize("n", [1, 3])
def test_smollm2_tp_equal_hf(tmp_path, n):
    from transformers import AutoTokenizer
    from model.prompts import chat_prompt_ids, stop_token_ids
    root = split_checkpoint_tp(SMOL, tmp_path / f"tp{n}", n, progress=False)
    tok = AutoTokenizer.from_pretrained(SMOL)
    prompt = chat_prompt_ids(tok, ["Name three rivers in Europe and one fact about each."], [])
    stop = stop_token_ids(tok, json.loads((SMOL / "generation_config.json").read_text()))
    _launch(n, root, tmp_path / "out.jsonl", [prompt], 20, ("head_dir=draft/heads/SmolLM2-135M-Instruct",
                                                             "comm.timeout_s=120"), dtype="float32")
    for row in read_jsonl(tmp_path / "out.jsonl"):
        assert row["output_ids"] == hf_greedy(SMOL, row["prompt_ids"], 20, stop, torch.float32), row["mode"]


def test_sampling_follows_naive_path_by_path(tiny, tmp_path):
    """At T > 0 rank 0 draws exactly as in naive (same trees, same walk, same generator), so with the same seed
    tp, galaxy and naive sample the same tokens: the tested law of naive carries over."""
    from model.split import split_checkpoint
    from pipeline.inprocess import run_threaded
    full, roots = tiny
    pipe = split_checkpoint(full, tmp_path / "pipe", [0, 2, 1], progress=False)
    extra = ("temperature=1.0", "seed=7", "tree.total_token=20", "tree.depth=3")
    prompts = [[1, 5, 9, 13, 22, 7]]
    naive = run_threaded(pipe, prompts, ["naive"], [*extra, "max_new_tokens=16"], {2}, f"oracle:{full}")
    ref = naive["naive"][0].output_ids
    _launch(2, roots[2], tmp_path / "tp.jsonl", prompts, 16, (*extra, f"head_dir=oracle:{full}"))
    assert ref != hf_greedy(full, prompts[0], 16, {2}, torch.float64)   # it did sample
    assert [r["output_ids"] for r in read_jsonl(tmp_path / "tp.jsonl")] == [ref, ref]


def test_rank0_schedule_on_a_one_stage_ring_under_the_device_guard(tiny, tmp_path):
    """Rank 0's tp/galaxy loop sees the group as one stage: on an in-process one-stage pipeline ring it equals
    HF, and under torch.device("meta") (tests/test_device_guard.py) it creates no tensor on a default device."""
    from model.split import split_checkpoint
    from pipeline.inprocess import run_threaded
    full, _ = tiny
    one = split_checkpoint(full, tmp_path / "one", [0, 3], progress=False)
    prompts = [[1, 5, 9, 13, 22, 7]]
    for extra in (["temperature=0"], ["temperature=0.8", "seed=3"]):
        over = ["max_new_tokens=10", "dtype=float64", *extra]
        plain = run_threaded(one, prompts, ["tp", "galaxy"], over, {2}, f"oracle:{full}")
        guarded = run_threaded(one, prompts, ["tp", "galaxy"], over, {2}, f"oracle:{full}",
                               guard=lambda: torch.device("meta"))
        for mode in ("tp", "galaxy"):
            assert [r.output_ids for r in guarded[mode]] == [r.output_ids for r in plain[mode]], mode
    ref = hf_greedy(full, prompts[0], 10, {2}, torch.float64)
    assert run_threaded(one, prompts, ["tp"], ["max_new_tokens=10"], {2}, f"oracle:{full}")["tp"][0].output_ids == ref


def test_emulated_tp_and_galaxy_runs_take_the_group_cost_model(tiny, tmp_path):
    """emu.profile on a TP split: every group rank pads each forward to config.profiles.GroupCost (the cost
    model pipeline.tools.tp_sim predicts with), rank 0 pads its fan-out, the leader's reply goes through the
    link model; output stays exact and the decode time follows the modeled rounds."""
    from config.profiles import GroupCost, Profile, shard_cost
    full, roots = tiny
    raw = {"name": "tp_toy", "stage": {"model": "analytic", "overhead_s": 0.02},
           "link": {"latency_s": 0.004, "bandwidth_mbps": None, "hidden_bytes_per_token": 0, "header_bytes": 0}}
    (tmp_path / "toy.json").write_text(json.dumps(raw))
    prof = Profile.from_dict(raw)
    layers, n = 2, 2
    group = {s: GroupCost(shard_cost(prof.stage, 1, n), n, layers, prof.link, 8.0, s).time(60, 0)
             for s in ("megatron", "galaxy")}
    assert group["megatron"] == pytest.approx(0.02 + 5 * 2 * 0.004) and group["galaxy"] > 0.02
    prompts = [[1, 5, 9, 13, 22, 7], [1, 40, 41]]
    _launch(n, roots[n], tmp_path / "out.jsonl", prompts, 10,
            (f"head_dir=oracle:{full}", f"emu.profile={tmp_path / 'toy.json'}", f"emu.tp_layers={layers}",
             "emu.tp_profile_stages=1", "emu.model_rank0=false"))
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(r["mode"] for r in rows) == ["galaxy", "galaxy", "tp", "tp"]
    for r in rows:
        assert r["output_ids"] == hf_greedy(full, r["prompt_ids"], 10, {2}, torch.float64), r["mode"]
        t = group["megatron" if r["mode"] == "tp" else "galaxy"]
        assert r["emu_profile"] == "tp_toy" and r["emu_ops"] >= n * r["rounds"]
        per_round = t + 2 * 0.004                       # the group's forward + fan-out and reply latencies
        assert 0.9 * r["rounds"] * t <= r["decode_s"] <= 1.5 * r["rounds"] * per_round + 0.5, r
