"""The ``recycle`` source (``draft/recycle_source.py``) and its feed (the seam ``draft.protocol.target_observer``,
called by ``pipeline.engine.OutputBuffer.extend``):

* the array table, the states and the trees equal ``draft/recycle.py``'s rule (property test, random feeds in random
  batches), and a planted bug (the oldest row of a batch wins) fails it;
* after generations through the in-process ring the table holds exactly the rows the rule says: the target's top-k
  after every committed token (the prompt's last, then every new token but the last), newest wins, kept across
  requests (``draft.recycle_persist``), and only while a source watches (the seam is None otherwise);
* greedy output with ``draft.sources=eagle,lookup,recycle`` equals HF's in every mode (tiny models, stories260K);
* the exact sampling law with the recycle source in the merged tree in every tree mode (the harness of
  ``tests/test_sampling.py``, the feed on), and a planted bug it catches that greedy equality cannot: the source
  calling its fixed guesses draws from its row's scores (proposals with a q), so the verifier's SpecInfer step
  treats them as sampled.
"""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from config.run_config import DEFAULT, ConfigError, SourceError, apply_overrides
from draft.lookup import FLOOR
from draft.merged import MergedDrafter, build_sources
from draft.protocol import TreeDrafter, target_observer
from draft.recycle import RecycleTable, rank_logprob, recycle_tree
from draft.recycle_source import RecycleDrafter
from tests.helpers import DATA, DATASETS, STORIES, check_tree


def table_rows(d: RecycleDrafter) -> dict[int, tuple[int, ...]]:
    """The source's array table as :class:`draft.recycle.RecycleTable` keeps it (observed tokens only)."""
    seen = np.flatnonzero(d.ids[:, 0] >= 0)
    return {int(t): tuple(int(x) for x in d.ids[t] if x >= 0) for t in seen}


def T(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def random_logits(rng: random.Random, n: int, vocab: int) -> torch.Tensor:
    """Rows of distinct values (no ties: the top-k order is unique)."""
    rows = [torch.tensor(rng.sample(range(10 * vocab), vocab), dtype=torch.float32) for _ in range(n)]
    return torch.stack(rows) if rows else torch.empty(0, vocab)


def rule_state(table: RecycleTable, token: int, k: int, log_p0: float, log_step: float) -> list[float]:
    row = list(table.row(token))
    pad = k - len(row)
    return row + [-1] * pad + [rank_logprob(r, log_p0, log_step) for r in range(len(row))] + [FLOOR] * pad


def feed_both(rng, drafter, table, vocab, n_obs):
    """Random observations fed in random batches to the drafter's hook and to the rule."""
    tokens = [rng.randrange(vocab) for _ in range(n_obs)]
    logits = random_logits(rng, n_obs, vocab)
    i = 0
    while i < n_obs:
        j = rng.randint(i + 1, n_obs)
        drafter.observe_target(tokens[i:j], logits[i:j])
        table.update(tokens[i:j], torch.topk(logits[i:j], min(table.k, vocab), dim=-1).indices.tolist())
        i = j


def array_mismatches(cls, seed: int = 0, cases: int = 120) -> list:
    rng = random.Random(seed)
    bad = []
    for case in range(cases):
        vocab, k = rng.randint(3, 9), rng.randint(1, 4)
        log_p0, log_step = -rng.random() * 2, -rng.choice([0.0, 0.5, 1.0, 2.0])
        d = cls(vocab, k, log_p0, log_step)
        table = RecycleTable(k)
        feed_both(rng, d, table, vocab, rng.randint(0, 14))
        if table_rows(d) != table.rows:
            bad.append((case, "table", table_rows(d), table.rows))
            continue
        for t in range(vocab):                                        # the state of a node is its token's row
            if not np.array_equal(d.states([t])[0], np.float32(rule_state(table, t, k, log_p0, log_step))):
                bad.append((case, "state", t))
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        out = d.tree_forward(T(toks), torch.zeros(len(toks), 2 * k), T([-1] * len(toks)))
        if not np.array_equal(out.numpy(), np.float32([rule_state(table, t, k, log_p0, log_step) for t in toks])):
            bad.append((case, "tree_forward"))
        d.drop_tree()
        root, total, depth = rng.randrange(vocab), rng.randint(1, 20), rng.randint(0, 4)
        tree = d.grow_tree(root, None, total, depth, 3)
        check_tree(tree)
        ref = recycle_tree(table, root, total, depth + 1, log_p0, log_step)
        got = (tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist())
        if got[:2] != ref[:2] or got[2] != pytest.approx(ref[2], abs=1e-5):
            bad.append((case, "tree", got, ref))
    return bad


def test_array_table_states_and_trees_equal_the_rule():
    assert array_mismatches(RecycleDrafter) == []


class OldestWins(RecycleDrafter):
    """A planted bug: within one feed call the FIRST row of a repeated token is kept (the rule: the newest)."""

    def observe_target(self, tokens, logits):
        seen = {}
        for i, t in enumerate(tokens):
            seen.setdefault(int(t), i)
        keep = sorted(seen.values())
        super().observe_target([tokens[i] for i in keep], logits[keep])


def test_planted_bug_fails_the_property_check():
    assert array_mismatches(OldestWins) != []


def test_persist_and_reset():
    d = RecycleDrafter(6, 2, persist=True)
    d.observe_target([3], T([[0, 5, 1, 2, 3, 4]], torch.float32))
    d.start([1, 2], 3, None)
    assert table_rows(d) == {3: (1, 5)}                 # kept across a request
    h = d.commit(T([3]), None)
    assert h[:2].tolist() == [1, 5] and h[2:].tolist() == pytest.approx([-1.4, -2.0])
    fresh = RecycleDrafter(6, 2, persist=False)
    fresh.observe_target([3], T([[0, 5, 1, 2, 3, 4]], torch.float32))
    fresh.observe_target([2], T([[0, 1, 5, 2, 3, 4]], torch.float32))   # the new request's first commit
    fresh.start([1, 2], 3, None)
    assert table_rows(fresh) == {2: (2, 5)}              # only the latest feed call's rows survive the start
    from draft.protocol import forget_requests
    forget_requests(d)                                   # a fresh measurement (draft/protocol.py): nothing kept
    d.start([1, 2], 3, None)
    assert table_rows(d) == {}


def test_config_keys_and_build_sources():
    cfg = apply_overrides(DEFAULT, ["draft.sources=lookup,recycle", "draft.recycle_k=4", "draft.recycle_persist=false"])
    m = build_sources(cfg, 100, None, torch.float64, "cpu")
    assert isinstance(m, MergedDrafter) and m.names == ["lookup", "recycle"] and isinstance(m.sources[1], TreeDrafter)
    assert m.sources[1].k == 4 and not m.sources[1].persist
    assert target_observer(m) is not None and m.observes_target
    lookup_only = build_sources(apply_overrides(DEFAULT, ["draft.sources=lookup,suffix"]), 100, None,
                                torch.float64, "cpu")
    assert target_observer(lookup_only) is None       # nothing watches: OutputBuffer.extend does no work for it
    for bad in (["draft.recycle_k=0"], ["draft.recycle_log_p0=0.5"], ["draft.recycle_log_step=1"],
                ["draft.sources=recycle,recycle"]):
        with pytest.raises(ConfigError):
            apply_overrides(DEFAULT, bad)
    with pytest.raises(SourceError, match="recycle_k"):
        RecycleDrafter(10, 0)


def test_merged_top_tokens_and_incremental_expansion():
    from draft.protocol import can_extend
    from tests.test_drafters import V_TINY, _random_eagle
    eagle, rec = _random_eagle(0), RecycleDrafter(V_TINY, 4)
    rng = random.Random(1)
    rec.observe_target(list(range(V_TINY)), random_logits(rng, V_TINY, V_TINY))
    merged = MergedDrafter([eagle, rec], ["eagle", "recycle"])
    g = torch.Generator().manual_seed(0)
    prompt = [1, 5, 9, 13, 22, 7]
    h = merged.start(prompt, 13, torch.randn(len(prompt), 16, generator=g, dtype=torch.float64))
    rows = merged.tree_forward(T([22, 30, 7]), h.expand(3, -1), T([-1, -1, 1]))
    states = torch.cat([h[None], rows])
    merged.drop_tree()
    s, t = merged.top_tokens(states, 5)
    lp = merged.logprobs(states)
    ref_s, _ = torch.topk(lp, 5, dim=-1)
    assert torch.allclose(s, ref_s) and torch.allclose(lp.gather(-1, t), s)
    assert can_extend(merged)
    tree, inputs = merged.grow_tree_with_inputs(13, h, 14, 4, 3)
    check_tree(tree)
    assert int(rec.ids[13, 0]) in {int(x) for x, p in zip(tree.tokens, tree.parents) if p == 0}
    assert torch.allclose(inputs, merged.tree_inputs(tree, h), atol=1e-9)
    grown, _ = merged.extend_tree(tree, inputs, h, 2, 3, 6)
    check_tree(grown)


# ---------------------------------------------------------------------------------------------------------------
# The feed through the in-process ring, and greedy output = HF
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model.split import split_checkpoint
    from tests.helpers import tiny_llama
    root = tmp_path_factory.mktemp("recycle")
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    stages = split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)
    return SimpleNamespace(full=full, stages=stages)


PROMPTS = [[1, 5, 9, 13, 22, 7, 5, 9, 13], [1] + list(range(3, 40)) + list(range(3, 20))]


def run_capturing(monkeypatch, stages, prompts, modes, over, head=None, dtype=torch.float64):
    """``run_threaded``, also returning the drafter it built (the feed's table is read after the run)."""
    import pipeline.inprocess as ip
    from pipeline.inprocess import run_threaded
    built = []
    real = ip.make_drafter

    def capture(*a, **kw):
        built.append(real(*a, **kw))
        return built[-1]
    monkeypatch.setattr(ip, "make_drafter", capture)
    return run_threaded(stages, prompts, modes, over, {2}, head, dtype=dtype), built[0]


def recycle_of(drafter) -> RecycleDrafter:
    return next(s for s in drafter.sources if isinstance(s, RecycleDrafter))


@pytest.mark.parametrize("mode,persist", [("naive", True), ("continuous", True), ("pruned", False)])
def test_feed_holds_the_rule_rows_after_generations(tiny, monkeypatch, mode, persist):
    """Two requests in one process: the table = the rule fed the target's top-k (HF's logits, float64 -> float32 as
    rank 0 reads them) after every committed token of both, in order (newest wins, kept across the requests), or
    of the last request alone with ``draft.recycle_persist=false``."""
    from transformers import AutoModelForCausalLM
    k = 4
    res, drafter = run_capturing(monkeypatch, tiny.stages, PROMPTS, [mode],
                                 ["max_new_tokens=16", "dtype=float64", "draft.sources=eagle,lookup,recycle",
                                  f"draft.recycle_k={k}", f"draft.recycle_persist={str(persist).lower()}"])
    model = AutoModelForCausalLM.from_pretrained(tiny.full, dtype=torch.float64).eval()
    table = RecycleTable(k)
    for p, r in zip(PROMPTS, res[mode]):
        if not persist:
            table = RecycleTable(k)
        seq = p + r.output_ids
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        first, last = len(p) - 1, len(seq) - 1          # committed tokens whose successor was chosen from their row
        table.update(seq[first:last], torch.topk(logits[first:last], k, dim=-1).indices.tolist())
    rec = recycle_of(drafter)
    assert table_rows(rec) == table.rows
    assert rec.observed == sum(len(r.output_ids) for r in res[mode])      # one row per committed token


@pytest.mark.parametrize("sources,head,extra", [("eagle,lookup,recycle", None, []),
                                                ("eagle,lookup,recycle", "oracle", []),
                                                ("recycle", None, ["draft.recycle_k=3"]),
                                                ("eagle,recycle", None, ["draft.recycle_persist=false"])])
def test_every_mode_with_the_recycle_source_equals_hf(tiny, monkeypatch, sources, head, extra):
    from tests.helpers import hf_greedy
    modes = ["ar", "naive", "pruned", "continuous", "pipedec"]
    over = ["max_new_tokens=16", "dtype=float64", f"draft.sources={sources}", *extra]
    prompts = PROMPTS + PROMPTS[:1]
    res, drafter = run_capturing(monkeypatch, tiny.stages, prompts, modes, over,
                                 f"oracle:{tiny.full}" if head else None)
    for mode, rows in res.items():
        for p, r in zip(prompts, rows):
            assert r.output_ids == hf_greedy(tiny.full, p, 16, {2}, torch.float64), (sources, mode)
    rec = drafter if isinstance(drafter, RecycleDrafter) else recycle_of(drafter)
    assert rec.observed > 0


@pytest.mark.skipif(not STORIES.is_dir() or not DATA.is_dir(), reason="../shared is not available")
def test_stories260k_every_mode_with_the_recycle_source_equals_hf(tmp_path, monkeypatch):
    import json

    from transformers import AutoTokenizer

    from model.split import split_checkpoint
    from tests.helpers import hf_greedy
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 1, 1, 1, 2], progress=False)
    tok = AutoTokenizer.from_pretrained(STORIES)
    prompts = []
    for ds in DATASETS[:3]:
        rec = [json.loads(line) for line in (DATA / ds / "question.jsonl").read_text().splitlines() if line.strip()][30]
        prompts.append(tok(rec["turns"][0])["input_ids"][:40])
    modes = ["ar", "naive", "pruned", "continuous", "pipedec"]
    res, drafter = run_capturing(monkeypatch, stages, prompts, modes,
                                 ["max_new_tokens=32", "dtype=float32", "draft.sources=eagle,lookup,recycle"],
                                 dtype=torch.float32)
    for mode, rows in res.items():
        for p, r in zip(prompts, rows):
            assert r.output_ids == hf_greedy(STORIES, p, 32, {2}, torch.float32), mode
    assert len(table_rows(recycle_of(drafter))) > 20


# ---------------------------------------------------------------------------------------------------------------
# The exact sampling law with the recycle source in the merged tree (the feed on: the harness wires the seam)
# ---------------------------------------------------------------------------------------------------------------

def _recycle_world():
    from tests.test_sampling import V
    return RecycleDrafter(V, 2, log_p0=-0.5, log_step=-0.5, persist=False)   # persist off: runs are replayed


LAW_CASES = [
    ("naive", 3, 1.0, 1.0, {"tree.top_k": 2}),
    ("naive", 2, 0.7, 0.9, {"tree.top_k": 1, "tree.total_token": 5}),
    ("pruned", 3, 1.0, 1.0, {"tree.init_topk": 1}),
    ("continuous", 3, 1.0, 0.9, {"tree.init_topk": 1, "tree.expand_topk": 1, "tree.expand_total_token": 3}),
    ("pipedec", 3, 1.0, 1.0, {"tree.pipedec_topk": 2}),
]


def _counting(source, sampler):
    """Wrap ``source.grow_tree`` to count the trees in which it proposed while the sampler could still branch."""
    seen = Counter()
    real = source.grow_tree

    def grow(*a):
        t = real(*a)
        if sampler.live():
            seen[len(t) > 1] += 1
        return t
    source.grow_tree = grow
    return seen


@pytest.mark.parametrize("mode,world,temp,top_p,overrides", LAW_CASES,
                         ids=[f"{c[0]}-w{c[1]}-T{c[2]}-p{c[3]}-{i}" for i, c in enumerate(LAW_CASES)])
def test_exact_law_with_the_recycle_source(mode, world, temp, top_p, overrides):
    from tests.multidraft_common import assert_merged_law
    from tests.test_sampling import BranchingSampler, MarkovDrafter, make_world
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(temp, top_p, 0, 2)
    rec = _recycle_world()
    drafter = MergedDrafter([MarkovDrafter(det), rec], ["eagle", "recycle"])
    seen = _counting(rec, sampler)
    assert_merged_law(mode, world, target, drafter, sampler, overrides)
    assert rec.observed > 0, "the feed never ran"
    if mode != "pipedec":                      # pipedec grows through tree_forward/top_tokens, not grow_tree
        assert seen[True] > 0, f"the recycle source never proposed before the horizon: {seen}"


class ClaimsSampled(RecycleDrafter):
    """A planted bug greedy equality cannot see: the fixed guesses are handed to the verifier as draws from the
    row's scores (a proposal q per child), so the SpecInfer step accepts them with min(1, p / q) and keeps the
    residual p - q, as if they had been drawn. At T = 0 the walk is the argmax walk either way."""

    def grow_tree(self, root_token, root_hidden, total_token, depth, top_k):
        tree = super().grow_tree(root_token, root_hidden, total_token, depth, top_k)
        n, V = len(tree), self.vocab_size
        props = [[] for _ in range(n)]
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        for c in range(1, n):
            q = torch.softmax(self.logprobs(torch.from_numpy(self.states([toks[pars[c]]])))[0], -1).double()
            props[pars[c]].append((c, q))
        from dataclasses import replace
        return replace(tree, proposals=props) if n > 1 else tree


def test_exact_law_with_the_recycle_source_catches_a_planted_bug():
    from tests.multidraft_common import make_merged_runner
    from tests.test_sampling import (BranchingSampler, MarkovDrafter, V, exact_law, make_world, target_law,
                                     total_variation)
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    bad = ClaimsSampled(V, 2, log_p0=-0.5, log_step=-0.5, persist=False)
    drafter = MergedDrafter([MarkovDrafter(det), bad], ["eagle", "recycle"])
    law, _ = exact_law(make_merged_runner("naive", 3, target, drafter, sampler, 2, {"tree.top_k": 2}), sampler)
    assert total_variation(law, target_law(sampler, target, 2)) > 0.02
