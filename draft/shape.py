"""Confidence-shaped draft trees (Talon-style, issue 45 item 2): within one node budget, the tree's width and depth
follow the draft's confidence, so a confident stretch becomes a chain and an uncertain level gets more rows.
Pure functions over a level's numbers (the whole rule as one driver over an ``expand`` callback, the tests'
reference tree, is ``tests/helpers.py: shaped_tree``). Wired into the EAGLE-2 search of
:class:`draft.drafter.BeamTreeDrafter` by the run key ``draft.tree_shape=confidence`` (:class:`TreeShape`): the
drafter asks :func:`pick_frontier` per level which candidates to expand next; ``eagle2`` (the default) keeps the
fixed beam.

Why this shape of rule: choosing the ``total_token - 1`` nodes of largest path probability among the candidates
(EAGLE-2's re-ranking, :func:`draft.tree.top_nodes_tree`) is already the best ancestor-closed set for the
expected accepted length under the draft's own law, and a candidate costs nothing (it is one of the top-k of a
distribution already computed). What costs is **expanding** a node (a draft forward row), and EAGLE-2 spends that
as a fixed beam: ``top_k`` rows per level for ``depth`` levels, whatever the draft's confidence. Here the rows
follow the confidence instead, per level of the search:
  1. **Only nodes that can still enter the tree are expanded** (:func:`budget_cut`): a candidate below the
     ``budget``-th best candidate score seen so far is out for good (a child never scores above its parent and the
     cut only rises as candidates arrive), and so are its descendants.
  2. **Width follows confidence** (:func:`frontier_width`): of the level's new candidates above the cut, best first,
     the fewest whose path probability reaches ``cover`` of the level's candidate mass are expanded (at least 1,
     at most ``width``): one row where the draft is sure (a chain), up to ``width`` where it hesitates.
  3. **Depth follows confidence**: levels continue while expansion rows remain (``rows``) and up to ``max_depth``,
     so the rows a confident stretch does not need go deeper than EAGLE-2's fixed depth.
  4. **The tree**: the ``total_token - 1`` best candidates by cumulative score (:func:`draft.tree.top_nodes_tree`).
Invariant (tested): with ``cover >= 1``, ``width = top_k``, ``max_depth`` = EAGLE-2's levels and rows unbounded the
tree is exactly EAGLE-2's (the cut prunes only candidates that cannot be selected). The sources' agreement enters
through the probabilities given (a merged drafter's level scores are the maximum over its sources).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def frontier_width(new_logp: Tensor, cover: float, width: int) -> int:
    """How many of a level's new candidates to expand: ``new_logp`` their cumulative log-probabilities, best first
    (those that can still enter the tree); the fewest whose probability mass reaches ``cover`` of the total (at
    least 1 when there is any candidate, at most ``width``; all of them, up to ``width``, when ``cover >= 1``)."""
    n = int(new_logp.numel())
    if n == 0 or width <= 0:
        return 0
    if cover >= 1:
        return min(n, width)
    p = (new_logp.double() - new_logp.double().max()).exp()
    mass = p.cumsum(0) / p.sum()
    c = int((mass < cover).sum()) + 1          # the first index whose cumulative share reaches cover, plus one
    return max(1, min(c, n, width))


def budget_cut(scores: Tensor, budget: int) -> float:
    """The ``budget``-th best of ``scores`` (``-inf`` when there are fewer): a candidate strictly below it cannot be
    among the ``budget`` best, now or after more candidates arrive."""
    if budget <= 0:
        return float("inf")
    if scores.numel() < budget:
        return float("-inf")
    return float(torch.topk(scores.double(), budget).values[-1])


def next_frontier(new_scores: Tensor, cut: float, width: int) -> Tensor:
    """Indices (into ``new_scores``) of the candidates to expand next: score ``>= cut``, best first (stable), at most
    ``width``."""
    order = torch.sort(-new_scores.double(), stable=True).indices
    keep = order[new_scores.double()[order] >= cut]
    return keep[:width]


def pick_frontier(level_scores: Tensor, all_scores: Tensor, budget: int, width: int, cover: float,
                  rows_left: float = math.inf) -> Tensor:
    """The next frontier of a confidence-shaped search: indices into ``level_scores`` (the level's new candidates'
    cumulative log-probabilities), best first (stable): those that can still enter a tree of ``budget`` drafted
    nodes given ``all_scores`` (every candidate so far, this level's included; :func:`budget_cut`), then the fewest
    of them covering ``cover`` of their mass (:func:`frontier_width`), at most ``width`` and ``rows_left``.
    Empty when nothing may be expanded: the search stops. On the scores' device (one host read of the cut)."""
    alive = next_frontier(level_scores, budget_cut(all_scores, budget), width)
    n = min(frontier_width(level_scores[alive], cover, width), width, int(max(0, min(rows_left, width))))
    return alive[:max(0, n)]


@dataclass(frozen=True)
class TreeShape:
    """How the EAGLE-2 search spends its expansion rows (run keys ``draft.tree_shape`` and ``draft.shape_*``).

    ``kind`` ``eagle2``: the fixed beam (``top_k`` rows per level for ``depth`` levels after the first);
    ``confidence``: :func:`pick_frontier` per level, within the same node budget (``total_token``) and at most
    ``rows`` head rows (0: EAGLE-2's ``depth * top_k`` for the call), for at most ``max_depth`` levels (0: twice
    the call's ``depth + 1``). With ``cover >= 1``, ``max_depth = depth + 1`` and unbounded rows the tree equals
    EAGLE-2's (tested)."""
    kind: str = "eagle2"
    cover: float = 0.9
    max_depth: int = 0
    rows: int = 0

    @property
    def shaped(self) -> bool:
        return self.kind == "confidence"

    def levels(self, depth: int) -> int:
        """Levels of a call's tree (the root's children are level 1): ``depth + 1`` for EAGLE-2."""
        if not self.shaped:
            return depth + 1
        return self.max_depth if self.max_depth > 0 else 2 * (depth + 1)

    def row_budget(self, depth: int, top_k: int) -> float:
        """Head rows (tree-forward rows) a call may spend; EAGLE-2 spends ``depth * top_k``."""
        if not self.shaped:
            return math.inf
        return self.rows if self.rows > 0 else depth * top_k

    @classmethod
    def from_config(cls, d) -> "TreeShape":
        """From a :class:`config.run_config.DraftConfig` (validated there)."""
        return cls(d.tree_shape, d.shape_cover, d.shape_max_depth, d.shape_rows)


EAGLE2 = TreeShape()


def install_shape(drafter, shape: TreeShape) -> None:
    """Give ``drafter`` and its sources (a merged drafter's, an online drafter's inner one) the tree shape: every
    :class:`draft.drafter.BeamTreeDrafter` search among them reads its ``tree_shape``."""
    seen: set[int] = set()
    todo = [drafter]
    while todo:
        d = todo.pop()
        if d is None or id(d) in seen:
            continue
        seen.add(id(d))
        if hasattr(d, "grow_tree"):
            try:
                d.tree_shape = shape
            except AttributeError:
                pass
        todo += list(getattr(d, "sources", []) or []) + [getattr(d, "inner", None)]
