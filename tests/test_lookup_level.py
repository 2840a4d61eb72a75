"""Prompt lookup's vectorised level (issue 41 item 2: ``draft/lookup.py`` ``level_matches``, ``pack_states``, the
drafter's path table): the same states as the per-node rule (``tests.helpers.find_continuations`` then
``tests.helpers.state_row``) on random contexts and trees, and a planted bug in the rule that these tests catch."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from draft import lookup as L
from draft.lookup import LookupDrafter
from tests.helpers import find_continuations, state_row


def _reference(seq: list[int], lo: int, hi: int, m: int, lp: float) -> list[float]:
    return state_row(find_continuations(seq, hi, lo, m, 1), 2 * m, lp)


def _random_case(rng: random.Random):
    alpha = rng.choice([2, 3, 5, 40])
    ctx = [rng.randrange(alpha) for _ in range(rng.randrange(1, 40))]
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 4)
    m = rng.randint(1, 6)
    # a random tree in ancestors-first order, fed in one or several calls (levels, or the whole tree at once)
    n = rng.randrange(1, 25)
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    tokens = [rng.randrange(alpha) for _ in range(n)]
    return ctx, lo, hi, m, parents, tokens


def _path(parents, tokens, i):
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


@pytest.mark.parametrize("vector_rows", [0, 10 ** 9], ids=["vectorised", "per-node"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_forward_equals_per_node_rule(seed, vector_rows, monkeypatch):
    """Every node's state from ``tree_forward`` (fed in random chunks, ancestors first, parents in earlier chunks or
    the same one) equals the per-node rule on context + its path, bit for bit, on both of its paths (the vectorised
    pass, the per-node one); so does ``state`` and a commit's."""
    monkeypatch.setattr(LookupDrafter, "vector_rows", vector_rows)
    rng = random.Random(seed)
    lp = math.log(rng.choice([0.6, 0.3]))
    for _ in range(150):
        ctx, lo, hi, m, parents, tokens = _random_case(rng)
        d = LookupDrafter(64, hi, lo, m, lp)
        d.start(ctx[:-1], ctx[-1], None)
        got, at = [], 0
        while at < len(tokens):
            step = rng.randint(1, len(tokens) - at)
            out = d.tree_forward(torch.tensor(tokens[at:at + step]), torch.zeros(step, 1),
                                 torch.tensor(parents[at:at + step]))
            assert out.shape == (step, 2 * m) and out.dtype == torch.float32
            got += out.tolist()
            at += step
        assert d.tree_size == len(tokens)
        want = torch.tensor([_reference(ctx + _path(parents, tokens, i), lo, hi, m, lp) for i in range(len(tokens))],
                            dtype=torch.float32).tolist()
        assert got == want, (ctx, lo, hi, m, parents, tokens)
        assert d.state([]).tolist() == torch.tensor(_reference(ctx, lo, hi, m, lp), dtype=torch.float32).tolist()
        d.drop_tree()
        assert d.tree_size == 0
        extra = [rng.randrange(5) for _ in range(rng.randint(1, 4))]
        h = d.commit(torch.tensor(extra), None)
        assert h.tolist() == torch.tensor(_reference(ctx + extra, lo, hi, m, lp), dtype=torch.float32).tolist()


@pytest.mark.parametrize("seed", range(3))
def test_tree_forward_across_trees_and_mixed_paths(seed, monkeypatch):
    """The per-node rule's kept paths (``LookupDrafter._tree_paths``) never go stale: one drafter feeds several trees
    (``drop_tree`` between them, a commit now and then), each in random chunks that take either path (a threshold of
    3 rows: the vectorised pass's entries get their paths filled in later); every state equals the rule's. A planted
    bug (the paths kept across ``drop_tree``) fails it."""
    monkeypatch.setattr(LookupDrafter, "vector_rows", 3)
    rng = random.Random(100 + seed)
    lp = math.log(0.6)
    for _ in range(40):
        ctx, lo, hi, m, _, _ = _random_case(rng)
        d = LookupDrafter(64, hi, lo, m, lp)
        d.start(ctx[:-1], ctx[-1], None)
        for _ in range(4):
            _, _, _, _, parents, tokens = _random_case(rng)
            tokens = [t % 5 for t in tokens]
            got, at = [], 0
            while at < len(tokens):
                step = rng.randint(1, min(5, len(tokens) - at))
                got += d.tree_forward(torch.tensor(tokens[at:at + step]), torch.zeros(step, 1),
                                      torch.tensor(parents[at:at + step])).tolist()
                at += step
            want = torch.tensor([_reference(ctx + _path(parents, tokens, i), lo, hi, m, lp)
                                 for i in range(len(tokens))], dtype=torch.float32).tolist()
            assert got == want
            d.drop_tree()
            if rng.random() < 0.3:
                extra = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
                d.commit(torch.tensor(extra), None)
                ctx = ctx + extra


def test_continuations_equal_find_continuations():
    """The drafter's ``continuations`` (what its own trie is built from) equal the plain scan, any length, path
    given or not."""
    rng = random.Random(7)
    for _ in range(400):
        ctx, lo, hi, m, _, _ = _random_case(rng)
        d = LookupDrafter(64, hi, lo, m)
        d.start(ctx[:-1], ctx[-1], None)
        path = [rng.randrange(5) for _ in range(rng.randrange(0, 4))]
        n = rng.randint(1, 6)
        assert d.continuations(path, n) == find_continuations(ctx + path, hi, lo, m, n), (ctx, path)


def test_context_index_keys_and_restart():
    ix = L.ContextIndex(2)
    seq = [3, 1, 3]
    ix.sync(seq)
    seq += [1, 1]
    ix.sync(seq)
    assert ix.keys.tolist() == sorted((t << 32) | p for p, t in enumerate(seq[:-1]))   # positions with a next
    assert ix.padded[2:2 + 5].tolist() == seq and len(set(ix.padded[:2].tolist())) == 2 and ix.padded[:2].max() < -1
    ix.sync([5])                                                   # a new list starts over
    assert ix.length == 1 and ix.keys.tolist() == []


def test_bad_parents_are_refused():
    d = LookupDrafter(10)
    d.start([1, 2], 3, None)
    with pytest.raises(ValueError):
        d.tree_forward(torch.tensor([1, 2]), torch.zeros(2, 1), torch.tensor([-1, 1]))   # its own index


@pytest.mark.parametrize("bug", ["min_ngram ignored", "least recent first"])
def test_planted_bug_is_caught(monkeypatch, bug):
    """Plausible slips in the vectorised rule make the equality test fail: the shortest n-gram length not applied,
    or the occurrences taken oldest first (the per-row order of the flat candidates reversed)."""
    orig = L.level_matches

    def buggy(padded, keys, lc, paths, depth, max_ngram, min_ngram, max_matches):
        if bug == "min_ngram ignored":
            return orig(padded, keys, lc, paths, depth, max_ngram, 1, max_matches)
        every = orig(padded, keys, lc, paths, depth, max_ngram, min_ngram, 64)   # every match, newest first
        out = np.full((len(every), max_matches), -1)
        for r, row in enumerate(every):
            old = row[row >= 0][::-1][:max_matches]
            out[r, :old.size] = old
        return out
    monkeypatch.setattr(L, "level_matches", buggy)
    with pytest.raises(AssertionError):
        test_tree_forward_equals_per_node_rule(0, 0, monkeypatch)


def test_ngram_next_tokens_equal_find_continuations():
    """NgramIndex.next_tokens (the per-node rule's query) equals the first tokens of the plain scan's continuations,
    for every split between context and path, n-gram ranges and match limits."""
    rng = random.Random(11)
    for _ in range(2000):
        seq = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        cut = rng.randint(0, len(seq))
        index = L.NgramIndex(lo, hi)
        ctx = seq[:cut]
        index.sync(ctx)
        m = rng.randint(1, 5)
        want = [c[0] for c in find_continuations(seq, hi, lo, m, 1)]
        assert index.next_tokens(seq[cut:], m) == want, (seq, cut, lo, hi, m)


def test_planted_bug_in_the_per_node_rule_is_caught(monkeypatch):
    """The per-node rule with a plausible slip (a node's path cut to its last token, so occurrences spanning the
    path are lost) makes the per-node equality test fail."""
    orig = L.NgramIndex.next_tokens
    monkeypatch.setattr(L.NgramIndex, "next_tokens", lambda self, path, m: orig(self, list(path[-1:]), m))
    with pytest.raises(AssertionError):
        test_tree_forward_equals_per_node_rule(1, 10 ** 9, monkeypatch)
