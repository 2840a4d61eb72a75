"""A seeded sampled answer does not depend on the tree a node had when it was verified (issue 46;
``pipeline.verify``'s module docstring, "Draw first").

With continuous expansion a node verified one pipeline step later may have gained children, and how many steps
there are follows the schedule (``serve.ring_share``, the lanes active). The verifier must spend the seeded
generator the same way whatever the node's children: one draw per resolved node, its token a function of the
seed and the node's logits only. A planted version of the old sequential rule (one uniform per tried child, then
the residual draw) fails the same check; tests/test_sampling.py keeps checking that the law is exactly the
target's, and tests/test_prefill_share.py that seeded choices on shared lanes equal their seed alone at
``serve.ring_share`` 0.5 and 1.0.
"""
from __future__ import annotations

import torch

from draft.tree import DraftTree
from pipeline.verify import Sampler, walk_tree

V = 8
LOGITS = torch.tensor([[1.5, 0.2, 1.1, -0.3, 0.9, 0.0, 1.3, -1.0],
                       [0.1, 1.2, -0.5, 0.8, 0.3, 1.0, -0.2, 0.4],
                       [0.7, -0.4, 0.2, 1.4, -0.1, 0.6, 0.9, 0.3]])
# the root's children in each tree (distinct tokens, index order); the root alone, the likely ones, the others
CHILD_SETS = [[], [0], [0, 6], [6, 2, 0], [3, 5], [1, 2, 3, 4, 5, 6, 7, 0]]


def tree_with(children: list[int]) -> DraftTree:
    n = 1 + len(children)
    return DraftTree(torch.tensor([9 % V] + children), torch.tensor([-1] + [0] * len(children)), torch.zeros(n))


def root_draws(walk, children: list[int], seeds, temperature: float = 1.0) -> list[tuple[int, int]]:
    """Per seed: the token the root resolves to (only the root verified) and the generator's next draw after it
    (which says how much of the stream the resolution spent)."""
    out = []
    for seed in seeds:
        s = Sampler(temperature, 1.0, 0, torch.Generator().manual_seed(seed))
        _, token, _ = walk(tree_with(children), 1, LOGITS, s)
        out.append((token, int(torch.randint(1 << 30, (), generator=s.generator))))
    return out


def sequential_walk(tree, n_verified, logits, sampler):
    """Planted: the sequential q = 1 rule walk_tree used before (an accept per tried child, then the residual
    draw); the same law, but its draws depend on the children (the root only: enough for these checks)."""
    p = sampler.probs(logits[0])
    mass = float(p.sum())
    for c in range(1, len(tree)):
        t = int(tree.tokens[c])
        if mass > 0 and sampler.accept(float(p[t]) / mass):
            return [0], t, (c if c >= n_verified else None)
        mass -= float(p[t])
        p[t] = 0.0
    return [0], sampler.draw(p), None


def test_root_token_and_stream_do_not_depend_on_the_children():
    seeds = range(300)
    ref = root_draws(walk_tree, [], seeds)
    for kids in CHILD_SETS[1:]:
        assert root_draws(walk_tree, kids, seeds) == ref, kids
    assert len({t for t, _ in ref}) >= 4        # the draws do vary with the seed


def test_token_is_the_plain_seeded_pick():
    """The root's token is ``Sampler.pick`` of the root's processed law with that seed (one uniform)."""
    for seed in range(50):
        s = Sampler(1.0, 1.0, 0, torch.Generator().manual_seed(seed))
        assert root_draws(walk_tree, [0, 6], [seed])[0][0] == s.pick(s.probs(LOGITS[0]))


class Coins(Sampler):
    def __init__(self, coins):
        super().__init__(1.0, 1.0, 0, None)
        self.coins = list(coins)

    def uniform(self):
        return self.coins.pop(0)


def test_pick_is_the_inverse_cdf_and_skips_zero_mass():
    """Token i owns [c_(i-1), c_i) of the cumulative sum (unnormalised p too): the edges, a zero-mass token (never
    picked, even by a uniform at its edge), and a uniform that rounds up to the total (the last token with mass)."""
    p = torch.tensor([0.25, 0.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    assert [Coins([u]).pick(p) for u in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999)] == [0, 0, 2, 2, 3, 3]
    assert Coins([0.5]).pick(p * 4) == 2
    assert Coins([1.0]).pick(p) == 3
    counts = torch.bincount(torch.tensor([Sampler(1.0, 1.0, 0, torch.Generator().manual_seed(s)).pick(p)
                                          for s in range(4000)]), minlength=5)
    assert counts[1] == counts[4] == 0 and abs(int(counts[2]) - 2000) < 150


def test_a_matching_child_continues_and_a_verified_one_descends():
    for seed in range(100):
        s = Sampler(1.0, 1.0, 0, torch.Generator().manual_seed(seed))
        path, token, new_root = walk_tree(tree_with([0, 6]), 1, LOGITS, s)
        assert path == [0] and new_root == ({0: 1, 6: 2}.get(token))
        s = Sampler(1.0, 1.0, 0, torch.Generator().manual_seed(seed))
        path2, token2, _ = walk_tree(tree_with([0, 6]), 3, LOGITS, s)
        assert path2[:2] == ([0, new_root] if new_root else [0]) and (new_root is not None or token2 == token)


def test_planted_sequential_rule_depends_on_the_children():
    seeds = range(300)
    ref = root_draws(sequential_walk, [], seeds)
    assert any(root_draws(sequential_walk, kids, seeds) != ref for kids in CHILD_SETS[1:])
