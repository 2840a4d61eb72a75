"""Sampled trees of a beam drafter (``draft.eagle_sample``: the EAGLE head's own law, SpecInfer chains): exact law
and planted bugs.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from draft.drafter import BeamTreeDrafter
from draft.merged import MergedDrafter
from draft.protocol import can_extend
from tests.helpers import check_tree
from tests.test_sampling import (BranchingSampler, MarkovDrafter, ROOT, V, exact_law, make_world, target_law,
                                 total_variation)
from tests.multidraft_common import assert_merged_law, draft_draws, make_merged_runner, sparse_draft


class SampledBeam(MarkovDrafter):
    """The real ``BeamTreeDrafter`` with sampling on, over a Markov table: ``grow_tree`` draws
    :meth:`draft.drafter.BeamTreeDrafter.sampled_tree`, as the EAGLE head does with ``draft.eagle_sample=true``."""

    def __init__(self, draft_logits: torch.Tensor, draw=None, temperature: float = 1.0, chains: int = 0) -> None:
        super().__init__(draft_logits)
        self.set_sampling(True, temperature, 0, chains)
        self.levels = 0                  # tree_forward calls since drop_tree: the next draw's depth - 1
        if draw is not None:
            self.draw = lambda q: draw(q, self.levels + 1)

    def tree_forward(self, tokens, features, parents):
        self.levels += 1                 # sampled_tree: one call per level
        return super().tree_forward(tokens, features, parents)

    def drop_tree(self):
        self.levels = 0
        super().drop_tree()

    def grow_tree(self, root_token, root_hidden, total_token, depth, top_k):
        self.levels = 0
        return BeamTreeDrafter.grow_tree(self, root_token, root_hidden, total_token, depth, top_k)   # no memo


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
    """Every random branch (the verifier's and the drafter's draws; a draw that can decide only tokens past the
    horizon pinned, :meth:`tests.test_sampling.BranchingSampler.drafted`) enumerated: the law of the first two tokens
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
    assert_merged_law(mode, world, target, drafter, sampler, overrides, max_runs=60000)
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


PIN_CASES = [   # cheap enough to enumerate every draw too; each pins some draws
    ("beam", "naive", 2, {"tree.top_k": 2, "tree.total_token": 5}),                # 2 distinct chains x 2 draws
    ("beam", "continuous", 3, {"tree.init_topk": 2, "tree.init_total_token": 5, "tree.expand_topk": 1,
                               "tree.expand_total_token": 3}),                     # re-roots, redrafts from the root
    ("ssm", "pruned", 3, {"tree.init_topk": 1, "tree.init_total_token": 4}),       # i.i.d. chains (a small LM's)
    ("ssm", "sps", 3, {"sps.gamma": 2, "sps.variant": "deepmind"}),                # sps' draft_chain
]


@pytest.mark.parametrize("kind,mode,world,overrides", PIN_CASES, ids=[f"{c[0]}-{c[1]}" for c in PIN_CASES])
def test_pinned_draws_give_the_fully_enumerated_law(kind, mode, world, overrides):
    """The exact-law tests pin a drafter's draws that can decide only tokens past the horizon
    (:meth:`tests.test_sampling.BranchingSampler.drafted`): with every draw enumerated instead, the law is the same
    (to float rounding), and the pinned enumeration is the smaller one."""
    from tests.multidraft_common import MarkovSSM
    laws, runs = {}, {}
    for pin in (True, False):
        target, _ = make_world(11, "random", 1.5)
        sampler = BranchingSampler(1.0, 1.0, 0, 2, pin_past_horizon=pin)
        if kind == "beam":
            drafter = SampledBeam(sparse_draft(21, support=2), draft_draws(sampler))
        else:
            drafter = MarkovSSM(sparse_draft(21, support=2), draw=draft_draws(sampler))
        laws[pin], runs[pin] = exact_law(make_merged_runner(mode, world, target, drafter, sampler, 2, overrides),
                                         sampler, max_runs=60000)
        assert (sampler.pinned > 0) == pin
    assert max(abs(laws[True].get(k, 0.0) - laws[False].get(k, 0.0)) for k in set(laws[True]) | set(laws[False])) < 1e-12
    assert runs[True] < runs[False], runs
