"""Token recycling (Luo et al. 2024, "Turning Trash into Treasure"): a training-free draft source built from the
target's own top-k next tokens observed at earlier positions. Pure rule functions only: the plain statement of the
rule. The source built on it is :mod:`draft.recycle_source` (``draft.sources=...,recycle``; its array table is tested
against :class:`RecycleTable` and :func:`recycle_tree`), fed through the seam :func:`draft.protocol.target_observer`
(docs/results.md §72).

The table ``M``: for every token ``t`` seen as a verified node, the target's top-``k`` next tokens there, best
first. **Merge rule: newest observation wins** (a row is replaced whole by the latest observation of ``t``; the
paper's rule). Rows are keyed by the single token ``t`` (no context), so a row is a guess about any later ``t``.

Proposal for a node whose token is ``t``: its row of ``M``, the ``r``-th entry (rank 0 best) scored
``rank_logprob(r)`` = ``log_p0 + r * log_step`` (``log_p0 <= 0``, ``log_step <= 0``: a run key's scale, to be
calibrated on records < 30). A tree (:func:`recycle_tree`) is a best-first walk of ``M`` from the root: a node's
score is its parent's plus its own rank's, so scores never increase along a path (what ``draft/protocol.py``
requires), siblings are distinct (a row holds distinct ids), at most ``total`` nodes (root included) and at most
``depth`` levels below the root.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class RecycleTable:
    """``M[token] -> tuple`` of at most ``k`` distinct next tokens, best first (newest observation wins)."""
    k: int
    rows: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def update(self, tokens, top_ids) -> None:
        """Observe rows: ``top_ids[i]`` is the target's top next tokens (best first) after a node of token
        ``tokens[i]``. Later rows of the same call win over earlier ones (they are newer)."""
        if len(tokens) != len(top_ids):
            raise ValueError(f"{len(tokens)} tokens but {len(top_ids)} top-k rows")
        for t, ids in zip(tokens, top_ids):
            row: list[int] = []
            for x in ids:
                x = int(x)
                if x not in row:
                    row.append(x)
                if len(row) == self.k:
                    break
            self.rows[int(t)] = tuple(row)

    def row(self, token: int) -> tuple[int, ...]:
        return self.rows.get(int(token), ())


def rank_logprob(rank: int, log_p0: float, log_step: float) -> float:
    """The score of a proposal of rank ``rank`` (0 = best): non-increasing in rank, never above 0."""
    if log_p0 > 0 or log_step > 0 or rank < 0:
        raise ValueError("log_p0 and log_step must be <= 0, rank >= 0")
    return log_p0 + rank * log_step


def recycle_tree(table: RecycleTable, root: int, total: int, depth: int, log_p0: float,
                 log_step: float) -> tuple[list[int], list[int], list[float]]:
    """The best-first walk of ``table`` (anything with ``row(token)``: a :class:`RecycleTable`, or the source's array
    table, ``draft.recycle_source.ArrayRows``) from ``root``: ``(tokens, parents, scores)``, ancestors first, root at
    index 0 (parent -1, score 0). Each popped node expands its whole row; nodes are popped by score (ties: earlier
    pushed first), so the kept set is the ``total`` best nodes of the (depth-bounded) walk and ancestor-closed."""
    tokens, parents, scores, levels = [int(root)], [-1], [0.0], [0]
    heap: list[tuple[float, int, int, int, int]] = []   # (-score, order, token, parent, level)
    order = 0
    rank_scores: list[float] = []                        # rank_logprob(r), computed once per rank

    def push_children(node: int) -> None:
        nonlocal order
        if levels[node] >= depth:
            return
        for r, x in enumerate(table.row(tokens[node])):
            while len(rank_scores) <= r:
                rank_scores.append(rank_logprob(len(rank_scores), log_p0, log_step))
            heapq.heappush(heap, (-(scores[node] + rank_scores[r]), order, x, node, levels[node] + 1))
            order += 1

    push_children(0)
    while heap and len(tokens) < total:
        neg, _, x, parent, level = heapq.heappop(heap)
        tokens.append(x)
        parents.append(parent)
        scores.append(-neg)
        levels.append(level)
        push_children(len(tokens) - 1)
    return tokens, parents, scores
