"""Token recycling's rule functions (draft/recycle.py): the table's newest-wins update against a brute-force
replay, the tree's invariants (ancestors first, distinct siblings, scores non-increasing along paths, budget and
depth, the best ``total`` nodes of the walk), and planted bugs the checks catch."""
from __future__ import annotations

import itertools
import random

import pytest

from draft.recycle import RecycleTable, rank_logprob, recycle_tree


def brute_rows(observations, k):
    """The table by replay: the last observation of each token, deduplicated, cut to ``k``."""
    rows = {}
    for t, ids in observations:
        row = []
        for x in ids:
            if x not in row:
                row.append(x)
        rows[t] = tuple(row[:k])
    return rows


def random_observations(rng, n, vocab=6, width=5):
    return [(rng.randrange(vocab), [rng.randrange(vocab) for _ in range(width)]) for _ in range(n)]


def test_table_matches_replay():
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 4)
        obs = random_observations(rng, rng.randint(0, 12))
        table = RecycleTable(k)
        # fed in random batches: batching must not change the result
        i = 0
        while i < len(obs):
            j = rng.randint(i + 1, len(obs))
            table.update([t for t, _ in obs[i:j]], [ids for _, ids in obs[i:j]])
            i = j
        assert table.rows == brute_rows(obs, k)


class StaleTable(RecycleTable):
    """Planted bug: the first observation of a token wins (stale rows)."""
    def update(self, tokens, top_ids):
        for t, ids in zip(tokens, top_ids):
            if int(t) not in self.rows:
                super().update([t], [ids])


def test_planted_stale_rows_fail():
    rng = random.Random(1)
    caught = False
    for _ in range(50):
        obs = random_observations(rng, 10)
        table = StaleTable(3)
        table.update([t for t, _ in obs], [ids for _, ids in obs])
        caught |= table.rows != brute_rows(obs, 3)
    assert caught


def test_update_rejects_misaligned():
    with pytest.raises(ValueError):
        RecycleTable(2).update([1, 2], [[3]])


def check_recycle_tree(table, root, total, depth, tokens, parents, scores, log_p0, log_step):
    assert tokens[0] == root and parents[0] == -1 and scores[0] == 0.0
    assert len(tokens) == len(parents) == len(scores) <= total
    level = [0]
    for i in range(1, len(tokens)):
        p = parents[i]
        assert 0 <= p < i                                   # ancestors first
        level.append(level[p] + 1)
        assert level[i] <= depth
        assert scores[i] <= scores[p]                       # never increase along a path
        row = table.row(tokens[p])
        assert tokens[i] in row                             # a child is in its parent's row...
        assert scores[i] == pytest.approx(scores[p] + rank_logprob(row.index(tokens[i]), log_p0, log_step))
    for p in set(parents):                                  # ...and siblings are distinct
        kids = [tokens[i] for i in range(len(tokens)) if parents[i] == p]
        assert len(kids) == len(set(kids))


def all_walk_scores(table, root, depth, log_p0, log_step):
    """Brute force: the scores of every node of the depth-bounded walk."""
    out, frontier = [], [(root, 0.0)]
    for _ in range(depth):
        nxt = []
        for t, s in frontier:
            for r, x in enumerate(table.row(t)):
                nxt.append((x, s + rank_logprob(r, log_p0, log_step)))
        out += [s for _, s in nxt]
        frontier = nxt
    return sorted(out, reverse=True)


@pytest.mark.parametrize("seed", range(30))
def test_tree_invariants_and_best_nodes(seed):
    rng = random.Random(seed)
    table = RecycleTable(rng.randint(1, 3))
    obs = random_observations(rng, 15)
    table.update([t for t, _ in obs], [ids for _, ids in obs])
    total, depth = rng.randint(1, 12), rng.randint(0, 4)
    log_p0, log_step = -rng.random(), -rng.random() - 0.1
    root = rng.randrange(6)
    tokens, parents, scores = recycle_tree(table, root, total, depth, log_p0, log_step)
    check_recycle_tree(table, root, total, depth, tokens, parents, scores, log_p0, log_step)
    best = all_walk_scores(table, root, depth, log_p0, log_step)[:total - 1]
    assert sorted(scores[1:], reverse=True) == pytest.approx(best)    # the total best nodes of the walk


def test_planted_score_order_fails():
    """A rank score that rises with rank (the bug) breaks the checks."""
    table = RecycleTable(3)
    table.update([1, 2, 3], [[2, 3, 4], [3, 1, 4], [1, 2, 4]])
    tokens, parents, scores = recycle_tree(table, 1, 10, 3, 0.0, -0.5)
    bad = [0.0] + [s + 0.3 * i for i, s in enumerate(scores[1:], 1)]   # scores raised along the order
    with pytest.raises(AssertionError):
        check_recycle_tree(table, 1, 10, 3, tokens, parents, bad, 0.0, -0.5)


def test_rank_logprob_rejects_positive():
    for bad in [(0, 0.1, -1.0), (0, -1.0, 0.1), (-1, -1.0, -1.0)]:
        with pytest.raises(ValueError):
            rank_logprob(*bad)
    assert all(a >= b for a, b in itertools.pairwise(rank_logprob(r, -0.2, -0.7) for r in range(5)))
