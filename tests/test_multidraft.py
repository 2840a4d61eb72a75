"""Several drafters in one tree (SpecInfer), sampled proposals, prompt lookup, the small-LM drafter and ``sps``.

1. Pure tree functions: ``merge_sources`` (union by token path, best-score budget, sampled proposals kept
   whole), ``merge_trees``/``reroot`` carrying proposals.
2. Prompt lookup (``draft/lookup.py``) and the small-LM drafter's KV cache against a plain forward.
3. Lossless sampling with merged trees: the exact-law harness of ``tests/test_sampling.py`` (every random
   branch of the real mode code enumerated, the verifier's *and* the sampled drafter's draws) on merged trees
   of a deterministic Markov drafter + a sampling Markov "small LM" (the real ``SmallLMDrafter.sampled_tree``
   and ``MergedDrafter``), in every mode and in ``sps`` (both variants); planted bugs must fail: a residual that
   ignores q, a merge that drops a duplicate draw, an sps resample from p; chi-square with the real generator.
4. End to end on the in-process ring: every mode with ``draft.sources`` and ``sps`` equal HF greedy.
"""
from __future__ import annotations

import math
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from config.run_config import DEFAULT, ConfigError, apply_overrides
from draft.lookup import FLOOR, LookupDrafter, NgramIndex, continuation_trie, find_continuations
from draft.merged import MergedDrafter, SourceError, parse_sources
from draft.protocol import can_extend, is_tree_drafter, top_tokens
from draft.drafter import BeamTreeDrafter
from draft.ssm import SmallLMDrafter
from draft.tree import DraftTree, check_tree, keep_indices_for, merge_sources, merge_trees, proposal_lists, reroot
from pipeline.engine import OutputBuffer
from pipeline.modes.flowspec import ContinuousMode, PrunedMode
from pipeline.modes.naive import naive_decode
from pipeline.modes.pipedec import PipeDecMode
from pipeline.modes.sps import sps_decode
from pipeline.verify import Sampler
from tests.test_sampling import (ALPHA, ROOT, TREE, V, BranchingSampler, FakeRing, MarkovDrafter,
                                 chi2_isf, chi_square_bins, chi_square_pvalue, exact_law, make_world, ncx2_sf,
                                 target_law, total_variation)


def T(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def tree(tokens, parents, scores, proposals=None):
    return DraftTree(T(tokens), T(parents), T(scores, torch.float32), proposals=proposals)


# ---------------------------------------------------------------------------------------------------------------
# 1. Pure tree functions
# ---------------------------------------------------------------------------------------------------------------

def test_merge_sources_union_best_score_and_budget():
    a = tree([5, 1, 2, 3], [-1, 0, 0, 1], [0, -0.1, -0.5, -0.3])          # 5 -> 1 -> 3, 5 -> 2
    b = tree([5, 2, 4, 7], [-1, 0, 1, 0], [0, -0.2, -0.4, -2.0])          # 5 -> 2 -> 4, 5 -> 7
    m = merge_sources([a, b], 10)
    check_tree(m)
    paths = {tuple(m.tokens[m.path_to(i)].tolist()): float(m.scores[i]) for i in range(len(m))}
    assert set(paths) == {(5,), (5, 1), (5, 2), (5, 1, 3), (5, 2, 4), (5, 7)}
    assert paths[(5, 2)] == pytest.approx(-0.2)             # best of -0.5 (a) and -0.2 (b)
    assert m.proposals is None                              # deterministic sources: a plain tree
    assert m.scores.tolist() == sorted(m.scores.tolist(), reverse=True)
    cut = merge_sources([a, b], 4)                          # root + the 3 best: 1, 2, 1->3
    assert {tuple(cut.tokens[cut.path_to(i)].tolist()) for i in range(len(cut))} == {(5,), (5, 1), (5, 2), (5, 1, 3)}
    check_tree(cut)
    with pytest.raises(ValueError):
        merge_sources([a, tree([6], [-1], [0])], 10)


def test_score_scale_calibrates_a_source_before_the_merge():
    """draft.ssm_score_scale: a source's log-scores times c > 0 keep its own order and the path monotonicity, and
    change only which source's nodes win the shared budget."""
    from draft.merged import scale_scores
    eagle = tree([5, 1, 3], [-1, 0, 1], [0, -0.7, -1.0])                 # 5 -> 1 -> 3
    ssm = tree([5, 2, 4], [-1, 0, 1], [0, -0.3, -0.6])                   # 5 -> 2 -> 4 (over-confident)
    paths = lambda m: {tuple(m.tokens[m.path_to(i)].tolist()) for i in range(len(m))}
    assert paths(merge_sources([eagle, ssm], 3)) == {(5,), (5, 2), (5, 2, 4)}
    scaled = scale_scores(ssm, 3.0)
    assert scaled.scores.tolist() == pytest.approx([0, -0.9, -1.8]) and scaled.tokens.tolist() == ssm.tokens.tolist()
    assert paths(merge_sources([eagle, scaled], 3)) == {(5,), (5, 1), (5, 2)}
    assert scale_scores(ssm, 1.0) is ssm
    with pytest.raises(ConfigError):
        apply_overrides(DEFAULT, ["draft.ssm_score_scale=0"])
    with pytest.raises(SourceError):
        MergedDrafter([LookupDrafter(10)], score_scales=[1.0, 2.0])


def test_a_students_own_calibration_is_the_default_scale(tmp_path):
    """draft.ssm_score_scale=-1 (default) takes merge_score_scale from the student's config.json; a value given
    on the command line wins; a bad stored value is one clear error."""
    import json
    from draft.merged import build_sources
    from tests.helpers import tiny_llama
    path = tiny_llama(tmp_path / "ssm", seed=4, layers=1, dtype=torch.float64)
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "merge_score_scale": 2.5}))

    def scales(over):
        cfg = apply_overrides(DEFAULT, [f"draft.sources=lookup,ssm:{path}", *over])
        return build_sources(cfg, 100, None, torch.float64, "cpu", False).score_scales
    assert scales([]) == [1.0, 2.5]
    assert scales(["draft.ssm_score_scale=3"]) == [1.0, 3.0]
    (path / "config.json").write_text(json.dumps({**conf, "merge_score_scale": "high"}))
    with pytest.raises(SourceError, match="merge_score_scale"):
        scales([])


def test_merge_sources_keeps_every_sampled_draw_and_reserves_their_budget():
    q1, q2 = torch.full((8,), 1 / 8, dtype=torch.float64), torch.full((8,), 1 / 8, dtype=torch.float64)
    det = tree([5, 1, 2, 3, 4], [-1, 0, 0, 0, 0], [0, -0.1, -0.2, -0.3, -0.4])
    # a sampled source that drew token 1 twice and token 6 once (one node per token, three proposals)
    smp = tree([5, 1, 6], [-1, 0, 0], [0, -5.0, -6.0], proposals=[[(1, q1), (2, q2), (1, q2)], [], []])
    m = merge_sources([det, smp], 5)                        # budget 4 = 3 sampled proposals + 1 deterministic
    check_tree(m)
    toks = m.tokens.tolist()
    assert sorted(toks[1:]) == [1, 6]                       # 2,3,4 lose to the reservation, 6 survives anyway
    root_list = m.proposals[0]
    assert [toks[c] for c, q in root_list] == [1, 1, 6, 1]  # det first (source order), then draws in order
    assert [q is None for _, q in root_list] == [True, False, False, False]
    # the same draws always take the same budget, whatever their values (value-independent selection)
    smp2 = tree([5, 7, 0, 3], [-1, 0, 0, 0], [0, -1.0, -1.0, -1.0], proposals=[[(1, q1), (2, q1), (3, q1)], [], [], []])
    assert len(merge_sources([det, smp2], 5)) - 1 == 4


def test_merge_trees_and_reroot_carry_proposals():
    q = torch.full((8,), 1 / 8, dtype=torch.float64)
    t = tree([5, 1, 2, 3], [-1, 0, 1, 1], [0, -1, -2, -2], proposals=[[(1, q)], [(2, q), (3, None)], [], []])
    extra = tree([1, 2, 4], [-1, 0, 0], [0, -1, -1])                           # rooted at node 1's token
    r = reroot(t, keep_indices_for(t, [0], 1), 1)
    assert r.tokens.tolist() == [1, 2, 3] and r.proposals == [[(1, q), (2, None)], [], []]
    m, n_new = merge_trees(r, extra)
    assert n_new == 1 and m.tokens.tolist() == [1, 2, 3, 4]
    assert m.proposals[0] == [(1, q), (2, None), (1, None), (3, None)]          # appended, duplicate kept
    assert proposal_lists(extra) == [[(1, None), (2, None)], [], []]
    plain, _ = merge_trees(tree([1, 2], [-1, 0], [0, -1]), extra)
    assert plain.proposals is None


# ---------------------------------------------------------------------------------------------------------------
# 2. Prompt lookup and the small-LM drafter
# ---------------------------------------------------------------------------------------------------------------

def test_find_continuations_longest_ngram_most_recent_first():
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    assert find_continuations(seq, 3, 1, 8, 2) == [[5, 7], [4, 9]]            # "2 3" occurs twice before
    assert find_continuations(seq, 3, 1, 1, 2) == [[5, 7]]
    assert find_continuations([1, 2, 3], 3, 1, 8, 2) == []
    assert find_continuations([4, 4, 4], 2, 2, 8, 3) == [[4]]                  # overlaps allowed, not the suffix


def test_lookup_tree_scores_and_drafter():
    t = continuation_trie(3, [[5, 7], [5, 8], [6]], math.log(0.5), 10)
    check_tree(t)
    by_path = {tuple(t.tokens[t.path_to(i)].tolist()): float(t.scores[i]) for i in range(len(t))}
    assert by_path[(3, 5)] == pytest.approx(math.log(2 / 3) + math.log(0.5))
    assert by_path[(3, 5, 7)] == pytest.approx(math.log(1 / 3) + 2 * math.log(0.5))
    d = LookupDrafter(vocab_size=20, max_ngram=2, max_matches=4, token_logp=math.log(0.5))
    h = d.start([1, 2, 3, 4, 9, 2], 3, None)                                   # context ... 2 3: copies "4 9"
    assert h.shape == (8,)                                                     # compact: 4 id slots, 4 scores
    lp = d.logprobs(h)
    assert lp.shape == (20,) and int(torch.argmax(lp)) == 4 and float(lp[4]) == pytest.approx(math.log(0.5))
    assert float(lp[5]) == FLOOR
    assert [x.tolist() for x in d.supported_tokens(h, 2)] == [[pytest.approx(math.log(0.5)), float("-inf")], [4, -1]]
    s, t = top_tokens(d, h, 3)                                                 # alone: real tokens, floor after
    assert t[0] == 4 and len(set(t.tolist())) == 3 and (t >= 0).all() and float(s[1]) == FLOOR
    g = d.grow_tree(3, h, 10, 2, 4)
    assert g.tokens.tolist()[:3] == [3, 4, 9]
    assert float(g.scores[1]) == pytest.approx(float(lp[4]))                  # the state is the trie's first level
    out = d.tree_forward(T([4]), h[None], T([-1]))                            # after ... 2 3 4: "9" followed
    assert int(torch.argmax(d.logprobs(out[0]))) == 9
    d.drop_tree()
    assert is_tree_drafter(d)
    h = d.commit(T([7, 2, 3]), None)                                           # ... 2 3 4 9 2 3 7 2 3: two matches
    lp = d.logprobs(h)
    assert float(lp[4]) == pytest.approx(float(lp[7])) == pytest.approx(math.log(0.5) + math.log(0.5))


def test_ngram_index_equals_find_continuations():
    """The indexed query (context indexed as it grows, the tree path scanned) returns exactly what the plain
    scan of the whole sequence returns, for every split between context and path."""
    import random
    rng = random.Random(0)
    for _ in range(1500):
        seq = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        index, ctx = NgramIndex(lo, hi), []
        cut = rng.randint(0, len(seq))
        for t in seq[:cut]:
            ctx.append(t)
            if rng.random() < 0.3:
                index.sync(ctx)
        index.sync(ctx)
        m, n = rng.randint(1, 5), rng.randint(1, 6)
        assert index.continuations(seq[cut:], m, n) == find_continuations(seq, hi, lo, m, n), (seq, cut, lo, hi)
    index = NgramIndex(1, 2)
    index.sync([1, 2, 1])
    index.sync([5, 5])                                                         # a new list starts over
    assert index.continuations([], 8, 2) == [[5]] and index.continuations([2], 8, 2) == []


def _random_eagle(seed: int = 0):
    """A real :class:`draft.drafter.Drafter` on a random EAGLE head (states depend on the whole path)."""
    from transformers import LlamaConfig

    from draft.drafter import Drafter
    from draft.eagle import init_untrained_head
    cfg = LlamaConfig(vocab_size=V_TINY, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      num_key_value_heads=2, num_hidden_layers=1)
    head = init_untrained_head(cfg, seed=seed).double().eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5)
    return Drafter(head, torch.nn.Linear(16, V_TINY, bias=False).double(), 128)


V_TINY = 40


def _eagle_lookup(seed: int = 0, scale: float = 1.0):
    eagle, look = _random_eagle(seed), LookupDrafter(V_TINY, max_matches=4)
    merged = MergedDrafter([eagle, look], ["eagle", "lookup"], [1.0, scale])
    g = torch.Generator().manual_seed(seed)
    prompt = [1, 5, 9, 13, 22, 7, 5, 9, 13, 30, 5, 9]
    h = merged.start(prompt, 13, torch.randn(len(prompt), 16, generator=g, dtype=torch.float64))
    return merged, h


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_merged_top_tokens_is_the_topk_of_the_maximum(scale):
    """The union of the sources' own top-k, best score per token, is the top-k of the elementwise maximum
    (``logprobs``), with no vocabulary-sized work in the lookup source; empty lookup slots never win."""
    merged, h = _eagle_lookup(scale=scale)
    rows = merged.tree_forward(T([22, 30, 7]), h.expand(3, -1), T([-1, -1, 1]))
    states = torch.cat([h[None], rows])
    merged.drop_tree()
    s, t = merged.top_tokens(states, 5)
    ref_s, ref_t = torch.topk(merged.logprobs(states), 5, dim=-1)
    assert torch.equal(t, ref_t) and torch.allclose(s, ref_s)
    assert (t >= 0).all()


def test_merged_drafter_expands_incrementally_and_exactly():
    """eagle + lookup supports incremental expansion: ``tree_inputs`` gives each node its parent's merged state
    (checked against feeding the path alone), ``extend_tree`` appends ancestors-first below the tree, and the
    committed state is untouched by all of it."""
    merged, h = _eagle_lookup()
    assert can_extend(merged)
    tree, inputs = merged.grow_tree_with_inputs(13, h, 14, 4, 3)
    check_tree(tree)
    assert len(tree) == 14 and inputs.shape == (14, h.numel()) and merged.tree_size == 0
    for i in range(1, len(tree)):
        path = tree.path_to(int(tree.parents[i]))[1:]                           # the parent's path below the root
        if not path:
            assert torch.equal(inputs[i], h)
            continue
        feats, state = h, None
        for j, node in enumerate(path):                                         # feed the path as a chain
            state = merged.tree_forward(tree.tokens[node:node + 1], feats[None], T([j - 1]))[0]
            feats = state
        merged.drop_tree()
        assert torch.allclose(inputs[i], state, atol=1e-9), i
    grown, grown_inputs = merged.extend_tree(tree, inputs, h, 2, 3, 6)
    check_tree(grown)
    assert len(grown) == 20 and torch.equal(grown.tokens[:14], tree.tokens)
    assert torch.equal(grown_inputs[:14], inputs) and merged.tree_size == 0
    assert torch.allclose(merged.commit(T([22]), torch.zeros(1, 16, dtype=torch.float64)),
                          _eagle_lookup()[0].commit(T([22]), torch.zeros(1, 16, dtype=torch.float64)))
    sampling = MergedDrafter([_random_eagle(), SimpleNamespace(samples=True)])
    assert not can_extend(sampling)                                             # sampled draws: redraft instead


def _count_forwards(drafter) -> list[int]:
    """Record the rows of every ``tree_forward`` call of ``drafter`` (a list that grows as it is called)."""
    calls, real = [], drafter.tree_forward

    def counted(tokens, features, parents):
        calls.append(int(tokens.numel()))
        return real(tokens, features, parents)
    drafter.tree_forward = counted
    return calls


@pytest.mark.parametrize("seed,total,depth,top_k", [(0, 14, 4, 3), (1, 30, 5, 4), (2, 60, 5, 10), (3, 17, 1, 10)])
def test_merged_tree_inputs_reuse_the_search_outputs(seed, total, depth, top_k):
    """The EAGLE source's own search outputs give its slice of the merged inputs: the same states as feeding every
    inner node again (``tree_inputs`` without them), with EAGLE forwards beyond the search's ``depth`` levels only
    for the parents lookup alone proposed (and their paths): fewer rows than feeding every inner node."""
    merged, h = _eagle_lookup(seed)
    calls = _count_forwards(merged.sources[0])
    tree, inputs = merged.grow_tree_with_inputs(13, h, total, depth, top_k)
    extra = calls[depth:]                                               # after the beam's own levels
    calls.clear()
    ref = merged.tree_inputs(tree, h)                                   # every inner node fed again
    assert torch.allclose(inputs, ref, atol=1e-9) and merged.tree_size == 0
    assert sum(extra) < sum(calls) and len(extra) <= len(calls)


def test_merged_tree_inputs_cost_no_forward_when_lookup_adds_nothing():
    """With no earlier occurrence to copy, the merged tree is EAGLE's and its inputs come from the search alone."""
    eagle, look = _random_eagle(5), LookupDrafter(V_TINY, max_matches=4)
    merged = MergedDrafter([eagle, look], ["eagle", "lookup"])
    prompt = [1, 2, 3, 4, 5, 6]
    h = merged.start(prompt, 13, torch.randn(len(prompt), 16, generator=torch.Generator().manual_seed(5),
                                             dtype=torch.float64))
    calls = _count_forwards(eagle)
    tree, inputs = merged.grow_tree_with_inputs(13, h, 30, 4, 4)
    assert calls == [4] * 4                                             # the beam's levels, nothing more
    assert torch.equal(tree.tokens, eagle.grow_tree(13, h[:16], 30, 4, 4).tokens)
    assert torch.allclose(inputs, merged.tree_inputs(tree, h), atol=1e-9)


def test_small_lm_drafter_cache_equals_plain_forward(tmp_path):
    from transformers import AutoModelForCausalLM
    from tests.helpers import tiny_llama
    path = tiny_llama(tmp_path / "ssm", seed=4, layers=2, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    d = SmallLMDrafter(path, vocab_size=100, dtype=torch.float64)             # model vocab 96: padded to 100
    assert is_tree_drafter(d)
    ctx = [1, 5, 9, 13]
    h = d.start(ctx[:-1], ctx[-1], None)
    h = d.commit(T([7, 8]), None)
    ctx += [7, 8]

    def plain(seq):
        with torch.no_grad():
            return torch.log_softmax(ref(T([seq])).logits[0, -1].double(), -1)
    assert torch.allclose(h[:96], plain(ctx), atol=1e-9) and float(h[96:].max()) < -1e3
    out = d.tree_forward(T([3, 4, 6]), h.expand(3, -1), T([-1, -1, 0]))       # 3, 4 below the root, 6 below 3
    for row, path in zip(out, ([3], [4], [3, 6])):
        assert torch.allclose(row[:96], plain(ctx + path), atol=1e-9)
    d.drop_tree()
    t = d.grow_tree(8, h, 8, 2, 3)                                            # deterministic: EAGLE-2 beam
    check_tree(t)
    assert t.proposals is None and len(t) == 8
    assert torch.allclose(d.commit(T([2]), None)[:96], plain(ctx + [2]), atol=1e-9)


def test_sources_config_errors_are_one_line():
    assert parse_sources("eagle, lookup,ssm:/x") == [("eagle", ""), ("lookup", ""), ("ssm", "/x")]
    for bad in ("medusa", "ssm", "lookup,lookup", "eagle:/x", ","):
        with pytest.raises(SourceError):
            parse_sources(bad)
    with pytest.raises(ConfigError, match="unknown source"):
        apply_overrides(DEFAULT, ["draft.sources=eagle,medusa"])
    with pytest.raises(ConfigError, match="sps.variant"):
        apply_overrides(DEFAULT, ["sps.variant=meta"])
    with pytest.raises(ConfigError, match="gamma"):
        apply_overrides(DEFAULT, ["sps.gamma=0"])
    with pytest.raises(ConfigError, match="ssm_temperature"):
        apply_overrides(DEFAULT, ["draft.ssm_temperature=0"])


# ---------------------------------------------------------------------------------------------------------------
# 3. Lossless sampling with several drafters: exact law, planted bugs, chi-square
# ---------------------------------------------------------------------------------------------------------------

def sparse_draft(seed: int, support: int = 3) -> torch.Tensor:
    """Draft logits whose law lives on ``support`` random tokens per row (small supports keep enumeration cheap)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((V, V), -1e4)
    for r in range(V):
        idx = torch.randperm(V, generator=g)[:support]
        out[r, idx] = torch.randn(support, generator=g) * 1.5
    return out


class MarkovSSM(SmallLMDrafter):
    """The real ``SmallLMDrafter`` (deterministic beam and ``sampled_tree``) on a Markov table instead of a model."""

    def __init__(self, draft_logits: torch.Tensor, sample: bool = True, temperature: float = 1.0, draw=None,
                 seed: int = 0) -> None:
        self.table = torch.log_softmax(draft_logits.double(), dim=-1)
        self.vocab_size, self.sample, self.temperature, self.seed = V, sample, temperature, seed
        self.generator = torch.Generator().manual_seed(seed)
        if draw is not None:
            self.draw = draw                      # an enumerating draw; else BeamTreeDrafter.draw
        self.tree_paths = []

    def start(self, prompt_ids, first_token, features):
        self.tree_paths = []
        self.generator.manual_seed(self.seed)
        return self.table[first_token]

    def commit(self, tokens, features):
        self.drop_tree()
        return self.table[int(tokens.reshape(-1)[-1])]

    def _paths_logprobs(self, paths):
        return torch.stack([self.table[p[-1]] for p in paths])


def draft_draws(sampler: BranchingSampler):
    """A drafter's draw that branches like the verifier's (weighted by q) but commits no token."""
    def draw(q: torch.Tensor) -> int:
        q = (q.double() / q.double().sum()).tolist()
        return sampler._branch([(i, w) for i, w in enumerate(q) if w > 0])
    return draw


MERGED_MODES = {"naive": (naive_decode, False), "pruned": (PrunedMode().decode, True),
                "continuous": (ContinuousMode().decode, True), "pipedec": (PipeDecMode().decode, True),
                "sps": (sps_decode, False)}


def make_merged_runner(mode, world, target, drafter, sampler, horizon, overrides):
    """``run() -> first horizon tokens`` through the mode's real rank-0 code with ``drafter`` (cf. test_sampling)."""
    decode, lockstep = MERGED_MODES[mode]
    ring = FakeRing(world, lockstep, getattr(sampler, "live", lambda: True))
    from pipeline.build import make_sps_drafter
    cfg = apply_overrides(DEFAULT, {**TREE, **overrides})
    engine = SimpleNamespace(comm=ring, gen=1, cfg=cfg, drafter=drafter,
                             sps_drafter=make_sps_drafter(cfg, drafter, None, None, None) if mode == "sps" else None,
                             tracer=SimpleNamespace(span=lambda *a, **k: nullcontext()),
                             observe_step=lambda *a: None, logits=lambda hidden: target[hidden[:, 0].long()])
    first = torch.full((V,), -1e9)
    first[ROOT] = 0.0

    def run():
        ring.reset()
        out = OutputBuffer(set(), horizon + 1, sampler=sampler)
        decode(engine, first, None, [ROOT], out)
        assert out.finished and out.ids[0] == ROOT and not ring.inflight
        return tuple(out.ids[1:])
    run.ring = ring
    return run


def merged_drafter(det_logits, ssm_logits, draw, sample=True, with_det=True):
    ssm = MarkovSSM(ssm_logits, sample=sample, draw=draw)
    return MergedDrafter([MarkovDrafter(det_logits), ssm]) if with_det else ssm


# (mode, world, T, top_p, horizon, overrides, ssm kind); the sampling source gets 1 + 6 // 2 = 4 nodes
MERGED_CASES = [
    ("naive", 3, 1.0, 1.0, 2, {"tree.top_k": 2}, "sparse"),             # 2 chains x 1 draw + beam
    ("naive", 2, 0.7, 0.9, 2, {"tree.top_k": 1}, "sparse"),             # 1 chain x 3 draws: deep sampled paths
    ("pruned", 3, 1.0, 1.0, 2, {"tree.init_topk": 1}, "sparse"),
    ("continuous", 3, 1.0, 1.0, 2, {"tree.init_topk": 1, "tree.expand_topk": 1,
                                    "tree.expand_total_token": 3}, "sparse"),
    ("pipedec", 3, 1.0, 1.0, 2, {"tree.pipedec_topk": 2}, "sparse"),
    ("naive", 3, 1.0, 1.0, 2, {"tree.top_k": 1, "tree.total_token": 3}, "target"),  # q = p: always accepted
    ("sps", 3, 1.0, 1.0, 2, {"sps.gamma": 2, "sps.variant": "deepmind"}, "sparse"),
    ("sps", 2, 0.7, 1.0, 2, {"sps.gamma": 3, "sps.variant": "deepmind"}, "sparse"),
    ("sps", 3, 1.0, 0.8, 2, {"sps.gamma": 1, "sps.variant": "deepmind"}, "target"),    # q = p before top-p
]


def _ssm_logits(kind, target):
    return sparse_draft(21) if kind == "sparse" else target.clone()


@pytest.mark.parametrize("mode,world,temp,top_p,horizon,overrides,kind", MERGED_CASES,
                         ids=[f"{c[0]}-w{c[1]}-T{c[2]}-p{c[3]}-K{c[4]}-{c[6]}-{i}" for i, c in enumerate(MERGED_CASES)])
def test_exact_law_merged_trees(mode, world, temp, top_p, horizon, overrides, kind):
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(temp, top_p, 0, horizon)
    drafter = merged_drafter(det, _ssm_logits(kind, target), draft_draws(sampler), with_det=(mode != "sps"))
    seen = Counter()
    if mode != "sps":   # record that merged trees really mix sampled and deterministic proposals
        grow = drafter.grow_tree

        def counting_grow(*a):
            t = grow(*a)
            if sampler.live() and t.proposals is not None:
                kinds = {q is None for lst in t.proposals for _, q in lst}
                seen["mixed" if kinds == {True, False} else "one kind"] += 1
            return t
        drafter.grow_tree = counting_grow
    law, runs = exact_law(make_merged_runner(mode, world, target, drafter, sampler, horizon, overrides), sampler,
                          max_runs=60000)
    ref = target_law(sampler, target, horizon)
    assert abs(sum(law.values()) - 1.0) < 1e-6
    assert set(law) <= set(ref), "a zero-probability sequence was emitted"
    worst = max(abs(law.get(k, 0.0) - w) for k, w in ref.items())
    assert worst < 1e-6, f"{mode}: |law - target| up to {worst:.3g} (TV {total_variation(law, ref):.3g})"
    if mode not in ("sps", "pipedec"):
        assert seen["mixed"] > 0, seen


class ScriptedSampler(Sampler):
    """The real sampler fed a fixed list of uniforms (``accept`` reads ``uniform``); draws are argmax."""

    def __init__(self, coins):
        super().__init__(1.0, 1.0, 0, None)
        self.coins, self.used = list(coins), 0

    def uniform(self):
        self.used += 1
        return self.coins.pop(0)

    def draw(self, p):
        return int(torch.argmax(p))


def test_sps_google_reads_the_same_coins_as_deepmind():
    """The google variant (all gamma uniforms up front) is enumerated through the deepmind one: fed the same
    uniforms it accepts the same prefix and resamples from the same residual; only the number of coins it
    consumes differs (gamma instead of n + 1). With the exact law of deepmind (above), google's law is exact."""
    from pipeline.modes.sps import verify_chain
    g = torch.Generator().manual_seed(3)
    gamma = 4
    for trial in range(200):
        logits = torch.randn(gamma + 1, V, generator=g) * 2
        qs = [torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1) for _ in range(gamma)]
        tokens = [0] + [int(torch.multinomial(q, 1, generator=g)) for q in qs]
        coins = torch.rand(gamma, generator=g, dtype=torch.float64).tolist()
        a, b = ScriptedSampler(coins), ScriptedSampler(coins)
        ng, xg = verify_chain(tokens, qs, logits, a, "google")
        nd, xd = verify_chain(tokens, qs, logits, b, "deepmind")
        assert (ng, xg) == (nd, xd) and a.used == gamma and b.used == min(gamma, nd + 1)


def _broken_walk_proposals(rule: str):
    """``walk_proposals`` with one classic mistake: ``keep_residual`` leaves r unchanged after a sampled
    proposal is rejected (no max(0, r - q)); ``ratio_unnormalised`` compares q with the unnormalised residual."""
    def walk(tree, n_verified, logits, sampler):
        if n_verified <= 0:
            return [], None, None
        path, cur, tokens = [0], 0, tree.tokens.tolist()
        while True:
            r, child = sampler.probs(logits[cur]), None
            for c, q in tree.proposals[cur]:
                t = tokens[c]
                if q is None:
                    if sampler.accept(float(r[t] / r.sum())):
                        child = c
                        break
                    r[t] = 0.0
                else:
                    rn = r / r.sum() if rule != "ratio_unnormalised" else r
                    if sampler.accept(min(1.0, float(rn[t]) / float(q[t]))):
                        child = c
                        break
                    if rule != "keep_residual":
                        r = torch.clamp(r / r.sum() - q, min=0.0)
            if child is None:
                return path, sampler.draw(r), None
            if child >= n_verified:
                return path, tokens[child], child
            path.append(child)
            cur = child
    return walk


def _dedup_merge(trees, total_token):
    """``merge_sources`` that keeps one proposal per (parent, child, source): a drawn token seen twice counts once."""
    m = merge_sources(trees, total_token)
    if m.proposals is not None:
        for lst in m.proposals:
            seen, kept = set(), []
            for c, q in lst:
                key = (c, None if q is None else id(q))
                if key not in seen:
                    seen.add(key)
                    kept.append((c, q))
            lst[:] = kept
    return m


@pytest.mark.parametrize("bug", ["keep_residual", "ratio_unnormalised", "dedup_merge", "sps_resample_from_p"])
def test_planted_bugs_fail_exact_law(monkeypatch, bug):
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    mode, overrides = "naive", {"tree.top_k": 2}
    ssm_logits = sparse_draft(21)
    if bug in ("keep_residual", "ratio_unnormalised"):
        monkeypatch.setattr("pipeline.verify.walk_proposals", _broken_walk_proposals(bug))
    elif bug == "dedup_merge":
        monkeypatch.setattr("draft.merged.merge_sources", _dedup_merge)
        ssm_logits = sparse_draft(21, support=2)   # two draws from two tokens: duplicates are frequent
    else:
        mode, overrides = "sps", {"sps.gamma": 2, "sps.variant": "deepmind"}
        import pipeline.modes.sps as sps

        def resample_from_p(tokens, qs, logits, s, variant):
            n, x = real(tokens, qs, logits, s, variant)
            if n < len(tokens) - 1:                                  # the bug: ignore q in the residual
                x = s.draw(s.probs(logits[n]))
            return n, x
        real = sps.verify_chain
        monkeypatch.setattr(sps, "verify_chain", resample_from_p)
    drafter = merged_drafter(det, ssm_logits, draft_draws(sampler), with_det=(mode != "sps"))
    law, _ = exact_law(make_merged_runner(mode, 3, target, drafter, sampler, 2, overrides), sampler, max_runs=60000)
    assert total_variation(law, target_law(sampler, target, 2)) > 0.005


def power_against_tv(law: dict, n: int, d: float) -> float:
    """Power at ALPHA against moving ``d`` of the mass between the two largest bins (the least detectable
    deviation of total variation ``d``; cf. test_sampling.power_against_one_percent_tv). The exact-law tests
    above are the proof-grade check; this one runs the real generator end to end."""
    bins = chi_square_bins(law, n)
    probs = sorted((sum(law[k] for k in cell) for cell in bins), reverse=True)
    lam = n * d ** 2 * (1 / probs[0] + 1 / probs[1])
    dof = len(bins) - 1
    return ncx2_sf(chi2_isf(ALPHA, dof), dof, lam)


def monte_carlo_merged(mode, target, det, ssm_logits, sampler, n, horizon, overrides, with_det=True):
    counts = Counter()
    drafter = merged_drafter(det, ssm_logits, None, with_det=with_det)
    ssm = drafter.sources[1] if with_det else drafter
    ssm.generator = sampler.generator           # one stream: every generation draws fresh drafts
    ssm.start = lambda p, f, feats, _s=ssm: _s.table[f]   # do not reseed per generation
    run = make_merged_runner(mode, 3, target, drafter, sampler, horizon, overrides)
    for _ in range(n):
        counts[run()] += 1
    return counts


# (mode, T, top_p, overrides, with the deterministic source, n)
MC_CASES = [("naive", 1.0, 1.0, {"tree.top_k": 2}, True, 6000),
            ("continuous", 2.0, 0.9, {"tree.init_topk": 1, "tree.expand_topk": 1}, True, 6000),
            ("sps", 1.0, 1.0, {"sps.gamma": 3, "sps.variant": "google"}, False, 6000),
            ("sps", 1.5, 1.0, {"sps.gamma": 2, "sps.variant": "deepmind"}, False, 6000)]


@pytest.mark.parametrize("mode,temp,top_p,overrides,with_det,n", MC_CASES)
def test_chi_square_merged_real_generator(mode, temp, top_p, overrides, with_det, n):
    target, det = make_world(5, "random", 0.5)
    sampler = Sampler(temp, top_p, 0, torch.Generator().manual_seed(4321))
    law = target_law(sampler, target, 2)
    assert power_against_tv(law, n, 0.03) > 0.9, "too few samples to detect a 3% deviation"
    counts = monte_carlo_merged(mode, target, det, sparse_draft(21), sampler, n, 2, overrides, with_det)
    pval = chi_square_pvalue(counts, law, n)
    assert pval > ALPHA, f"chi-square p = {pval:.3g}"


def test_chi_square_catches_planted_bug(monkeypatch):
    monkeypatch.setattr("pipeline.verify.walk_proposals", _broken_walk_proposals("keep_residual"))
    target, det = make_world(5, "random", 0.5)
    sampler = Sampler(1.0, 1.0, 0, torch.Generator().manual_seed(99))
    law = target_law(sampler, target, 2)
    counts = monte_carlo_merged("naive", target, det, sparse_draft(21), sampler, 6000, 2, {"tree.top_k": 2})
    assert chi_square_pvalue(counts, law, 6000) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# 3b. Sampled trees of a beam drafter (draft.eagle_sample: the EAGLE head's own law, SpecInfer chains)
# ---------------------------------------------------------------------------------------------------------------

class SampledBeam(MarkovDrafter):
    """The real ``BeamTreeDrafter`` with sampling on, over a Markov table: ``grow_tree`` draws
    :meth:`draft.drafter.BeamTreeDrafter.sampled_tree`, as the EAGLE head does with ``draft.eagle_sample=true``."""

    def __init__(self, draft_logits: torch.Tensor, draw=None, temperature: float = 1.0, chains: int = 0) -> None:
        super().__init__(draft_logits)
        self.set_sampling(True, temperature, 0, chains)
        if draw is not None:
            self.draw = draw

    def grow_tree(self, root_token, root_hidden, total_token, depth, top_k):
        return BeamTreeDrafter.grow_tree(self, root_token, root_hidden, total_token, depth, top_k)   # no memo


# (mode, world, T, top_p, overrides, with a deterministic source merged in)
SAMPLED_BEAM_CASES = [
    ("naive", 3, 1.0, 1.0, {"tree.top_k": 2}, False),                 # 2 chains x 3 draws: joins and deep paths
    ("naive", 2, 0.7, 0.9, {"tree.top_k": 1}, False),                 # one chain, q at T = 0.7 against top-p
    ("pruned", 3, 1.0, 1.0, {"tree.init_topk": 2}, False),
    ("continuous", 3, 1.0, 1.0, {"tree.init_topk": 2, "tree.expand_topk": 1, "tree.expand_total_token": 3}, False),
    ("continuous", 3, 1.3, 1.0, {"tree.init_topk": 1, "tree.expand_topk": 1}, True),   # + a deterministic beam
    ("pipedec", 3, 1.0, 1.0, {"tree.pipedec_topk": 2}, False),         # pipedec grows its own (top-k) layers
]


def sampled_beam(det, draft_logits, draw, with_det, temperature=1.0):
    s = SampledBeam(draft_logits, draw, temperature)
    return MergedDrafter([MarkovDrafter(det), s]) if with_det else s


@pytest.mark.parametrize("mode,world,temp,top_p,overrides,with_det", SAMPLED_BEAM_CASES,
                         ids=[f"{c[0]}-w{c[1]}-T{c[2]}-p{c[3]}-{'merged' if c[5] else 'alone'}-{i}"
                              for i, c in enumerate(SAMPLED_BEAM_CASES)])
def test_exact_law_sampled_beam_trees(mode, world, temp, top_p, overrides, with_det):
    """Every random branch (the verifier's and the drafter's draws) enumerated: the law of the first two tokens
    equals the target's, in every tree mode, with the beam drafter's sampled chains (and merged with a
    deterministic beam); the trees really carry sampled proposals, and chains that meet draw distinct children."""
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(temp, top_p, 0, 2)
    drafter = sampled_beam(det, sparse_draft(21, support=2), draft_draws(sampler), with_det, temp)
    seen = Counter()
    grow = drafter.grow_tree

    def counting_grow(*a):
        t = grow(*a)
        if sampler.live() and t.proposals is not None:
            seen["sampled"] += 1
            seen["several"] += any(len(lst) > 1 for lst in t.proposals)         # chains met: distinct children
            assert all(len(lst) == len({c for c, _ in lst}) for lst in t.proposals), "a child drawn twice"
        return t
    drafter.grow_tree = counting_grow
    law, _ = exact_law(make_merged_runner(mode, world, target, drafter, sampler, 2, overrides), sampler,
                       max_runs=60000)
    ref = target_law(sampler, target, 2)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and set(law) <= set(ref)
    worst = max(abs(law.get(k, 0.0) - w) for k, w in ref.items())
    assert worst < 1e-6, f"{mode}: |law - target| up to {worst:.3g}"
    if mode != "pipedec":
        assert seen["sampled"] > 0 and (seen["several"] > 0 or overrides.get("tree.top_k") == 1), seen


@pytest.mark.parametrize("bug", ["first_q_for_every_draw", "best_draw_first"])
def test_planted_bugs_in_sampled_beam_trees_fail(bug):
    """Two ways to spoil a sampled tree that the exact law must catch: recording q(u) itself for every draw at a
    node, although the later chains drew without the earlier tokens (the verifier then prices them with the wrong
    q), and trying a node's draws best-q first (a list reordered by drawn values)."""
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    drafter = SampledBeam(sparse_draft(21, support=2), draft_draws(sampler))
    real = drafter.sampled_tree

    def spoiled(*a):
        t = real(*a)
        for lst in t.proposals:
            if bug == "first_q_for_every_draw":
                lst[:] = [(c, lst[0][1]) for c, _ in lst]
            else:
                lst.sort(key=lambda cq: -float(cq[1][int(t.tokens[cq[0]])]))
        return t
    drafter.sampled_tree = spoiled
    law, _ = exact_law(make_merged_runner("naive", 3, target, drafter, sampler, 2, {"tree.top_k": 2}), sampler,
                       max_runs=60000)
    assert total_variation(law, target_law(sampler, target, 2)) > 0.005


def test_sampled_tree_shape_and_scores():
    """The chains' shape is fixed (width x length draws), every draw is a proposal in draw order, scores are the
    best chain log-q (never above a parent's), and a drafter with sampling off, or at T = 0, keeps its beam."""
    g = torch.Generator().manual_seed(3)
    d = SampledBeam(torch.randn(V, V, generator=g), chains=3)
    d.generator.manual_seed(1)
    t = d.grow_tree(ROOT, torch.tensor([float(ROOT)]), 10, 4, 2)     # 3 chains x min(5, 9 // 3) = 3 levels
    check_tree(t)
    assert sum(len(lst) for lst in t.proposals) == 9 == len(t) - 1 and int(t.depths.max()) == 3   # one node a draw
    assert all(float(t.scores[i]) <= float(t.scores[int(t.parents[i])]) + 1e-6 for i in range(1, len(t)))
    for u, lst in enumerate(t.proposals):
        assert all(int(t.parents[c]) == u and q is not None and abs(float(q.sum()) - 1) < 1e-9 for c, q in lst)
    assert not d.supports_extend and not can_extend(d)
    d.set_sampling(True, 0.0, 0)
    assert not d.samples and d.supports_extend and d.grow_tree(ROOT, torch.tensor([float(ROOT)]), 10, 4, 2).proposals is None


# ---------------------------------------------------------------------------------------------------------------
# 4. End to end on the in-process ring (greedy = HF generate), and seeded T > 0 reproducibility
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model.split import split_checkpoint
    from tests.helpers import tiny_llama
    root = tmp_path_factory.mktemp("multidraft")
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    ssm = tiny_llama(root / "ssm", seed=3, layers=1, dtype=torch.float64)
    stages = split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)
    return SimpleNamespace(full=full, ssm=ssm, stages=stages)


E2E_PROMPTS = [[1, 5, 9, 13, 22, 7, 5, 9, 13], [1] + list(range(3, 40)) + list(range(3, 20))]  # lookup hits
ALL = ["naive", "pruned", "continuous", "pipedec", "sps"]


@pytest.mark.parametrize("sources,head", [("eagle,lookup,ssm:SSM", None), ("lookup,ssm:FULL", None),
                                          ("eagle,lookup", "oracle"), ("lookup", None)])
def test_every_mode_with_merged_sources_equals_hf(tiny, sources, head):
    from tests.helpers import hf_greedy
    from pipeline.inprocess import run_threaded
    src = sources.replace("SSM", str(tiny.ssm)).replace("FULL", str(tiny.full))
    modes = ALL if "ssm" in sources else ALL[:-1]
    res = run_threaded(tiny.stages, E2E_PROMPTS, modes, ["max_new_tokens=16", "dtype=float64", f"draft.sources={src}"],
                       {2}, f"oracle:{tiny.full}" if head else None)
    for mode, rows in res.items():
        for p, r in zip(E2E_PROMPTS, rows):
            assert r.output_ids == hf_greedy(tiny.full, p, 16, {2}, torch.float64), (sources, mode)
    if "FULL" in sources:       # a perfect small LM: long chains accepted
        assert min(r.tau for r in res["sps"]) > 3 and min(r.tau for r in res["naive"]) > 2


def test_every_drafter_has_the_protocol(tiny):
    from draft.oracle import OracleDrafter
    eagle_like = MarkovDrafter(torch.zeros(V, V))                  # a draft.drafter.Drafter
    for d in (eagle_like, OracleDrafter(str(tiny.full), adversarial=True), LookupDrafter(V),
              MergedDrafter([eagle_like, LookupDrafter(V)]), MarkovSSM(torch.zeros(V, V))):
        assert is_tree_drafter(d), type(d).__name__
    assert not is_tree_drafter(object())


def test_sampled_merged_runs_are_seeded(tiny):
    from pipeline.inprocess import run_threaded
    args = ["max_new_tokens=12", "dtype=float64", "temperature=1.0", f"draft.sources=lookup,ssm:{tiny.ssm}"]
    outs = [run_threaded(tiny.stages, E2E_PROMPTS[:1], ["naive", "continuous", "sps"], [*args, f"seed={s}"], {2})
            for s in (5, 5, 6)]
    ids = [{m: r[0].output_ids for m, r in o.items()} for o in outs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_sampled_eagle_drafts_through_the_ring(tiny):
    """``draft.eagle_sample=true`` end to end on the in-process ring with the oracle drafter (q = the target's own
    law): seeded runs repeat and another seed differs; every sampled chain is accepted (q = p: min(1, p/q) = 1), so
    τ is long; at T = 0 the key changes nothing (greedy output = HF generate)."""
    from pipeline.inprocess import run_threaded
    from tests.helpers import hf_greedy
    head = f"oracle:{tiny.full}"
    args = ["max_new_tokens=12", "dtype=float64", "draft.sources=eagle", "draft.eagle_sample=true",
            "draft.sample_chains=2", "tree.total_token=9", "tree.depth=3"]
    outs = [run_threaded(tiny.stages, E2E_PROMPTS[:1], ["naive", "continuous"], [*args, "temperature=1.0",
                                                                                   f"seed={s}"], {2}, head)
            for s in (5, 5, 6)]
    ids = [{m: r[0].output_ids for m, r in o.items()} for o in outs]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert min(r[0].tau for r in outs[0].values()) > 2.5, {m: r[0].tau for m, r in outs[0].items()}
    greedy = run_threaded(tiny.stages, E2E_PROMPTS[:1], ["naive", "continuous"], args, {2}, head)
    for mode, rows in greedy.items():
        assert rows[0].output_ids == hf_greedy(tiny.full, E2E_PROMPTS[0], 12, {2}, torch.float64), mode


def test_eagle_sampling_keys():
    from pipeline.build import _eagle_sampling
    with pytest.raises(ConfigError, match="sample_chains"):
        apply_overrides(DEFAULT, ["draft.sample_chains=-1"])
    on = apply_overrides(DEFAULT, ["draft.eagle_sample=true", "temperature=0.8", "seed=4", "draft.sample_chains=3"])
    assert _eagle_sampling(on) == (True, 0.8, 4, 3)
    assert _eagle_sampling(apply_overrides(DEFAULT, ["draft.eagle_sample=true"]))[0] is False      # T = 0: beam
    assert _eagle_sampling(apply_overrides(DEFAULT, ["temperature=1.0"]))[0] is False             # off by default


# ---------------------------------------------------------------------------------------------------------------
# 5. draft.train_ssm: the recipe on a tiny model (boost weights, outputs, the student drafts through the ring)
# ---------------------------------------------------------------------------------------------------------------

def test_boost_weights_target_what_earlier_students_miss():
    from draft.train_ssm import boost_weights
    masks, labels = [[0, 1, 1, 1]], [[5, 6, 7, 8]]
    earlier = [[[5, 6, 0, 0]], [[0, 0, 7, 0]]]             # student 1 gets t=1, student 2 gets t=2
    assert boost_weights(masks, labels, earlier, 0.0) == [[0.0, 0.0, 0.0, 1.0]]
    assert boost_weights(masks, labels, earlier[:1], 0.25) == [[0.0, 0.25, 1.0, 1.0]]


def test_train_ssm_recipe_on_a_tiny_model(tiny, tmp_path, capsys):
    import json
    from draft.train_ssm import main
    out = tmp_path / "ssm"
    assert main(["--target", str(tiny.full), "--out", str(out), "--random-prompts", "6", "--gen-tokens", "6",
                 "--layers", "1", "--models", "2", "--boost", "--steps", "2", "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [m["k"] for m in metrics["models"]] == [1, 2]
    for m in metrics["models"]:
        assert 0 <= m["alpha"] <= 1 and 1 <= m["sps_tokens_per_round"] <= 5 and m["positions"] > 0
    assert metrics["models"][1]["coverage"] >= metrics["models"][0]["coverage"]
    assert "alpha" in (out / "MODEL_CARD.md").read_text()
    from transformers import AutoModelForCausalLM
    student = AutoModelForCausalLM.from_pretrained(out / "ssm_2")
    assert student.config.num_hidden_layers == 1
    assert main(["--target", str(tmp_path / "nope"), "--out", str(out), "--random-prompts", "2"]) == 2
    assert "no config.json" in capsys.readouterr().err
    from tests.helpers import hf_greedy
    from pipeline.inprocess import run_threaded
    res = run_threaded(tiny.stages, E2E_PROMPTS[:1], ["sps"], ["max_new_tokens=10", "dtype=float64",
                       f"sps.draft_dir={out / 'ssm_1'}", "sps.gamma=3"], {2})
    assert res["sps"][0].output_ids == hf_greedy(tiny.full, E2E_PROMPTS[0], 10, {2}, torch.float64)


def test_sps_without_a_small_lm_fails_before_launch():
    import subprocess
    import sys
    from tests.helpers import REPO
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--print-config", "mode=sps"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "mode sps needs a small draft LM" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_merged_and_sps_decode_paths_create_no_tensor_on_the_default_device(tiny):
    """The device-placement guard of tests/test_device_guard.py (rank 0 and the stages under
    ``torch.device("meta")``) with every source merged and with sps, at T = 0 and T > 0."""
    from pipeline.inprocess import run_threaded
    modes = ["naive", "pruned", "continuous", "pipedec", "sps"]
    for extra in (["temperature=0"], ["temperature=0.8", "seed=3"]):
        over = ["max_new_tokens=8", "dtype=float64", f"draft.sources=eagle,lookup,ssm:{tiny.ssm}", *extra]
        plain = run_threaded(tiny.stages, E2E_PROMPTS[:1], modes, over, {2})
        guarded = run_threaded(tiny.stages, E2E_PROMPTS[:1], modes, over, {2}, guard=lambda: torch.device("meta"))
        for m in modes:
            assert guarded[m][0].output_ids == plain[m][0].output_ids, (m, extra)


def test_shared_vocabulary_students_borrow_rank0s_embedding_and_lm_head(tiny, tmp_path):
    """``draft.ssm.ship_student`` drops the (frozen) embedding and lm_head; ``load_small_lm`` takes them from
    rank 0's stage and computes exactly what the full student computes; misuse is one clear error."""
    from model.stage_model import load_stage
    from draft.ssm import SmallLMError, load_small_lm, ship_student
    from draft.train_ssm import freeze_vocab, student_from_target
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(tiny.full, dtype=torch.float64)
    student = student_from_target(target, 2)
    freeze_vocab(student)
    with torch.no_grad():                      # a "trained" student: layers moved, vocabulary untouched
        for name, p in student.named_parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)),
                                          dtype=p.dtype))
    ship_student(student, tmp_path / "s", dtype=torch.float64)
    names = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "s/model.safetensors"))
    assert not any("embed_tokens" in k or k.startswith("lm_head") for k in names)
    rank0 = load_stage(tiny.stages, 0, 3, torch.float64)
    shared = load_small_lm(tmp_path / "s", torch.float64, "cpu", rank0)
    assert shared.lm_head.weight.data_ptr() == rank0.lm_head.weight.data_ptr()    # lent, not copied
    ids = torch.tensor([E2E_PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(shared(ids).logits, student(ids).logits)
    with pytest.raises(SmallLMError, match="shares its target's embedding"):
        load_small_lm(tmp_path / "s", torch.float64, "cpu", None)
    other = SimpleNamespace(embed_tokens=torch.nn.Embedding(7, 3), lm_head=torch.nn.Linear(3, 7))
    with pytest.raises(SmallLMError, match="does not fit"):
        load_small_lm(tmp_path / "s", torch.float64, "cpu", other)


def test_train_ssm_shared_vocab_layout_drafts_through_the_ring(tiny, tmp_path):
    from tests.helpers import hf_greedy
    from draft.train_ssm import main
    from pipeline.inprocess import run_threaded
    out = tmp_path / "ssm"
    assert main(["--target", str(tiny.full), "--out", str(out), "--random-prompts", "6", "--gen-tokens", "6",
                 "--layers", "1", "--steps", "2", "--shared-vocab", "--quiet"]) == 0
    assert (out / "ssm_1" / "config.json").is_file()
    for over in ([f"sps.draft_dir={out / 'ssm_1'}", "sps.gamma=3"], [f"draft.sources=eagle,ssm:{out / 'ssm_1'}"]):
        mode = "sps" if "sps.gamma=3" in over else "continuous"
        res = run_threaded(tiny.stages, E2E_PROMPTS[:1], [mode], ["max_new_tokens=10", "dtype=float64", *over], {2})
        assert res[mode][0].output_ids == hf_greedy(tiny.full, E2E_PROMPTS[0], 10, {2}, torch.float64), mode


SHIPPED_SSM = Path(__file__).resolve().parents[1] / "draft" / "ssms" / "SmolLM2-135M-Instruct" / "ssm_1"


@pytest.mark.skipif(not SHIPPED_SSM.is_dir(), reason="no shipped small draft LM")
def test_shipped_smollm2_student_drafts_exactly(tmp_path):
    """The shipped SmolLM2 student (shared vocabulary) in sps and in a merged tree: output equals HF greedy."""
    import json
    from transformers import AutoTokenizer
    from model.default_model import ensure_default_checkpoint, ensure_default_stages
    from model.prompts import chat_prompt_ids, stop_token_ids
    from pipeline.inprocess import run_threaded
    from tests.helpers import hf_greedy
    full, stages = ensure_default_checkpoint(), ensure_default_stages()
    tok = AutoTokenizer.from_pretrained(full)
    stop = stop_token_ids(tok, json.loads((Path(full) / "generation_config.json").read_text()))
    prompts = [chat_prompt_ids(tok, ["Summarize: the cat sat on the mat and the dog sat on the log."], [])]
    res = run_threaded(stages, prompts, ["sps", "naive"], ["max_new_tokens=16", "dtype=float32",
                       f"draft.sources=eagle,lookup,ssm:{SHIPPED_SSM}", "sps.gamma=3"], stop,
                       str(Path(__file__).resolve().parents[1] / "draft" / "heads" / "SmolLM2-135M-Instruct"),
                       dtype=torch.float32)
    ref = hf_greedy(full, prompts[0], 16, stop, torch.float32)
    assert res["sps"][0].output_ids == ref and res["naive"][0].output_ids == ref


@pytest.mark.parametrize("empty_from_level", [0, 1])
def test_extend_tree_stops_where_no_source_proposes_a_token(empty_from_level):
    """A merged top-k can be empty below some frontier node (no source proposes a valid token there: the union
    keeps ``min`` valid entries over rows). Incremental expansion then stops at that level instead of feeding
    the head zero rows (a reshape error seen in the simulator under load); what was found before stays."""
    from draft.drafter import BeamTreeDrafter
    from draft.tree import DraftTree, check_tree

    class Stub(BeamTreeDrafter):
        def __init__(self):
            self.calls, self.fed = 0, []

        tree_size = 0

        def tree_forward(self, tokens, features, parents):
            assert tokens.numel() > 0, "fed zero rows"
            self.fed.append(tokens.numel())
            return torch.zeros(tokens.numel(), 4)

        def drop_tree(self):
            pass

        def top_tokens(self, hidden, k):
            level, self.calls = self.calls, self.calls + 1
            if level >= empty_from_level:
                return torch.zeros(hidden.shape[0], 0), torch.zeros(hidden.shape[0], 0, dtype=torch.long)
            return (torch.full((hidden.shape[0], 2), -1.0),
                    torch.arange(2).repeat(hidden.shape[0], 1) + 10)

    tree = DraftTree(torch.tensor([5, 6]), torch.tensor([-1, 0]), torch.tensor([0.0, -0.5]))
    grown, inputs = Stub().extend_tree(tree, torch.zeros(2, 4), torch.zeros(4), 3, 2, 8)
    check_tree(grown)
    assert len(grown) == len(inputs) == 2 + (0 if empty_from_level == 0 else 2)
