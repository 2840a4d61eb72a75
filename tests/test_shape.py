"""Confidence-shaped trees (``draft/shape.py``): the width rule, the budget cut, EAGLE-2 as the special case
``cover = 1``, chains where the draft is sure and width where it is not, the gain at equal expansion rows, and a
planted bug that fails."""
from __future__ import annotations

import math

import pytest
import torch

import draft.shape as shape
from draft.shape import budget_cut, frontier_width, next_frontier
from tests.helpers import check_tree, expected_accepted, select_top_nodes, shaped_tree

V = 12


def world(seed: int, temperature: float):
    """A deterministic draft: each path's next-token law is a function of the path (hashed into a random table)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.log_softmax(torch.randn(97, V, generator=g, dtype=torch.float64) / temperature, -1)

    def law(path: tuple) -> torch.Tensor:
        return table[hash(path) % 97]
    return law


def expander(law, root: int, top_k: int, calls: list | None = None):
    def expand(nodes, tokens, parents):
        rows_lp, rows_tok = [], []
        for n in nodes:
            path = []
            while n >= 0:
                path.append(tokens[n])
                n = parents[n]
            lp = law((root, *reversed(path)))
            s, t = torch.topk(lp, top_k)
            rows_lp.append(s)
            rows_tok.append(t)
        if calls is not None:
            calls.append(len(nodes))
        return torch.stack(rows_lp), torch.stack(rows_tok)
    return expand


def eagle2(law, root: int, total: int, levels: int, k: int):
    """EAGLE-2 (draft.drafter.BeamTreeDrafter.grow_tree's rule): beam of the k best by cumulative score per level,
    every beam node's k best children are candidates, the best total - 1 candidates form the tree."""
    expand = expander(law, root, k)
    toks, pars, scores = [], [], []
    frontier, fscore = [-1], torch.zeros(1, dtype=torch.float64)
    for _ in range(levels):
        lp, tk = expand(frontier, toks, pars)
        first = len(toks)
        cum = (fscore[:, None] + lp).reshape(-1)
        toks += tk.reshape(-1).tolist()
        pars += [f for f in frontier for _ in range(k)]
        scores += cum.tolist()
        best = torch.sort(-cum, stable=True).indices[:k]
        frontier = (first + best).tolist()
        fscore = cum[best]
    return select_top_nodes(root, torch.tensor(toks), torch.tensor(pars), torch.tensor(scores, dtype=torch.float64),
                            total)


def test_frontier_width_follows_confidence():
    lg = lambda *p: torch.log(torch.tensor(p, dtype=torch.float64))
    assert frontier_width(lg(0.95, 0.03, 0.02), 0.9, 3) == 1             # sure: a chain
    assert frontier_width(lg(0.5, 0.3, 0.2), 0.75, 3) == 2
    assert frontier_width(lg(0.4, 0.3, 0.3), 0.9, 3) == 3
    assert frontier_width(lg(0.4, 0.3, 0.3), 0.9, 2) == 2                # capped
    assert frontier_width(lg(0.05, 0.03, 0.02), 0.9, 3) == 3             # shares of the level's mass, not absolute
    assert frontier_width(lg(0.9, 0.05, 0.05), 1.0, 3) == 3              # cover >= 1: the EAGLE-2 beam
    assert frontier_width(lg(), 0.9, 3) == 0


def test_budget_cut_and_next_frontier():
    s = torch.tensor([-0.1, -2.0, -0.5, -1.0])
    assert budget_cut(s, 2) == pytest.approx(-0.5) and budget_cut(s, 9) == float("-inf")
    assert next_frontier(s, -0.5, 3).tolist() == [0, 2]
    assert next_frontier(s, float("-inf"), 3).tolist() == [0, 2, 3]


@pytest.mark.parametrize("seed,total,levels,k,temp", [(0, 60, 6, 10, 1.0), (1, 26, 5, 4, 0.5), (2, 12, 3, 3, 2.0),
                                                      (3, 60, 8, 10, 0.3), (4, 2, 3, 3, 1.0)])
def test_cover_one_is_exactly_eagle2(seed, total, levels, k, temp):
    law = world(seed, temp)
    calls = []
    ours = shaped_tree(3, expander(law, 3, k, calls), total, levels, k, cover=1.01)
    ref = eagle2(law, 3, total, levels, k)
    assert ours.tokens.tolist() == ref.tokens.tolist() and ours.parents.tolist() == ref.parents.tolist()
    assert torch.allclose(ours.scores, ref.scores)
    assert sum(calls) <= 1 + (levels - 1) * k                              # never expands more than EAGLE-2
    if seed == 0:
        assert sum(calls) < 1 + (levels - 1) * k                           # the cut saves rows here
    capped = shaped_tree(3, expander(law, 3, k), total, levels, k, cover=1.01, rows=1 + (levels - 1) * k)
    assert capped.tokens.tolist() == ref.tokens.tolist()


def test_confident_draft_becomes_a_chain_and_an_unsure_one_widens():
    sure = lambda path: torch.log_softmax(torch.tensor([6.0] + [0.0] * (V - 1), dtype=torch.float64), -1).roll(
        len(path) % V)
    calls = []
    t = shaped_tree(0, expander(sure, 0, 4, calls), 10, 8, 4, cover=0.9)
    check_tree(t)
    assert calls == [1] * 8                                                 # one row per level: a chain ...
    assert t.depths.max() == 8 and len(t) == 10                             # ... 8 deep, the 9th node beside it
    unsure = lambda path: torch.full((V,), -math.log(V), dtype=torch.float64)
    calls = []
    t = shaped_tree(0, expander(unsure, 0, 4, calls), 10, 8, 4, cover=0.9)
    check_tree(t)
    assert int((t.parents == 0).sum()) == 4 and int(t.depths.max()) <= 2    # wide and shallow
    assert len(t) == 10 and calls[:2] == [1, 4]                             # the whole unsure level expanded


@pytest.mark.parametrize("seed,temp", [(5, 0.3), (6, 0.3), (7, 0.3)])
def test_at_equal_expansion_rows_the_shaped_tree_gains_on_peaked_drafts(seed, temp):
    """EAGLE-2 at 60 nodes, 6 levels, top-10 expands 51 rows; the shaped tree with the same rows (and budget) may
    go 12 deep. On peaked drafts its expected accepted length (under the draft's own law) is higher (docs/suffix.md
    has the sweep: flatter drafts gain nothing, but the cut alone saves rows at no loss)."""
    law = world(seed, temp)
    calls = []
    shaped = shaped_tree(3, expander(law, 3, 10, calls), 60, 12, 10, cover=0.9, rows=51)
    check_tree(shaped)
    assert len(shaped) <= 60 and sum(calls) <= 51
    assert shaped.scores.tolist() == sorted(shaped.scores.tolist(), reverse=True)
    assert expected_accepted(shaped) > expected_accepted(eagle2(law, 3, 60, 6, 10))


def test_planted_bug_fails(monkeypatch):
    """A width rule that expands one row fewer than the cover needs (at least one): the unsure level loses rows."""
    real = shape.frontier_width
    monkeypatch.setattr(shape, "frontier_width", lambda lp, c, w: real(lp, c, w) - (real(lp, c, w) > 1))
    with pytest.raises(AssertionError):
        test_confident_draft_becomes_a_chain_and_an_unsure_one_widens()
