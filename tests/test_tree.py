"""Pure tree operations: building, ordering, masks, segmenting, keep-lists, re-rooting, merging."""
import torch
import pytest

from draft.tree import (DraftTree, depths_from_parents, keep_indices_for,
                        merge_trees, reroot, split_sizes)
from tests.helpers import ancestor_matrix, check_tree, remap_parents, select_top_nodes


def tree_of(parents, tokens=None, scores=None):
    n = len(parents)
    return DraftTree(torch.tensor(tokens or list(range(100, 100 + n))), torch.tensor(parents),
                     torch.tensor(scores or [-float(i) for i in range(n)]))


def test_ancestor_matrix_and_depths():
    par = torch.tensor([-1, 0, 0, 1, 3, 2])
    anc = ancestor_matrix(par)
    assert anc[4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert anc[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert depths_from_parents(par).tolist() == [0, 1, 1, 2, 3, 2]
    # extending an existing matrix equals building at once
    ext = ancestor_matrix(par[4:], ancestor_matrix(par[:4]))
    assert torch.equal(ext, anc)
    assert depths_from_parents(par[4:], depths_from_parents(par[:4])).tolist() == [3, 2]


def test_select_top_nodes_is_ancestor_closed_with_ties_and_score_ordered():
    # candidates: two root children with equal scores, children with log-prob 0 (ties with parent)
    tokens = torch.tensor([5, 6, 7, 8, 9])
    parents = torch.tensor([-1, -1, 0, 0, 1])
    scores = torch.tensor([-1.0, -1.0, -1.0, -3.0, -1.0])
    tree = select_top_nodes(42, tokens, parents, scores, total_token=4)
    check_tree(tree)
    assert tree.tokens.tolist() == [42, 5, 6, 7]      # stable tie-break by candidate index
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    for k in range(1, 6):  # every cut is a valid tree
        check_tree(select_top_nodes(42, tokens, parents, scores, total_token=k))
    s = select_top_nodes(42, tokens, parents, scores, 6).scores[1:]
    assert bool((s[:-1] >= s[1:]).all())


def test_select_random_candidates_always_valid():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = 40
        parents = torch.full((n,), -1)
        scores = torch.zeros(n)
        for i in range(n):
            p = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
            parents[i] = p
            step = -float(torch.rand((), generator=g)) * (torch.rand((), generator=g) > 0.3).float()
            scores[i] = (scores[p] if p >= 0 else 0.0) + step
        tree = select_top_nodes(1, torch.arange(n) + 10, parents, scores, int(torch.randint(1, n + 2, (1,), generator=g)))
        check_tree(tree)


def test_split_sizes():
    assert split_sizes(81, 5, 16) == [16, 16, 16, 16, 17][:0] + [16] * 5  # more nodes than fit: 5 caps, rest waits
    assert split_sizes(80, 5, 16) == [16] * 5
    assert split_sizes(7, 5, 16) == [1, 1, 1, 2, 2]
    assert split_sizes(3, 5, 16) == [1, 1, 1]
    assert split_sizes(1, 5, 16) == [1]
    assert split_sizes(0, 5, 16) == []
    assert split_sizes(100, 2, 0) == [50, 50]
    assert sum(split_sizes(200, 3, 16)) == 48  # a tree needing more segments than links


def test_keep_indices_and_reroot():
    #        0
    #      1   2
    #     3 4   5
    #     6
    t = tree_of([-1, 0, 0, 1, 1, 2, 3])
    keep = keep_indices_for(t, [0, 1], new_root=3)
    assert keep.tolist() == [0, 1, 3, 6]
    r = reroot(t, keep, 2)
    assert r.tokens.tolist() == [103, 106] and r.parents.tolist() == [-1, 0]
    assert r.depths.tolist() == [0, 1]
    assert keep_indices_for(t, [0, 2], None).tolist() == [0, 2]  # truncate keeps the path only


def test_remap_parents_for_uncomputed_segment():
    t = tree_of([-1, 0, 0, 1, 1, 2, 3])
    keep = keep_indices_for(t, [0, 1], new_root=3)   # [0,1,3,6]
    rows, par = remap_parents(t.parents[4:], torch.arange(4, 7), keep, 2)
    assert rows.tolist() == [False, False, True] and par.tolist() == [0]
    # a one-node segment holding the new root itself
    rows, par = remap_parents(t.parents[3:4], torch.tensor([3]), keep, 2)
    assert rows.tolist() == [True] and par.tolist() == [-1]
    # empty segment
    rows, par = remap_parents(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), keep, 2)
    assert rows.numel() == 0 and par.numel() == 0


def test_merge_appends_only_new_nodes_and_keeps_indices():
    t = DraftTree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0., -1, -2, -3]))
    extra = DraftTree(torch.tensor([9, 1, 4, 3, 5]), torch.tensor([-1, 0, 0, 1, 3]),
                      torch.tensor([0., -1, -1.5, -2, -2.5]))
    merged, n_new = merge_trees(t, extra)
    check_tree(merged)
    assert n_new == 2
    assert merged.tokens[:4].tolist() == [9, 1, 2, 3] and merged.parents[:4].tolist() == [-1, 0, 0, 1]
    assert merged.tokens[4:].tolist() == [4, 5] and merged.parents[4:].tolist() == [0, 3]
    same, n0 = merge_trees(t, t)
    assert n0 == 0 and same is t
    with pytest.raises(ValueError):
        merge_trees(t, DraftTree.single(8))


def test_check_tree_rejects_bad_trees():
    with pytest.raises(ValueError):
        check_tree(tree_of([-1, 2, 0]))
    with pytest.raises(ValueError):
        check_tree(DraftTree(torch.tensor([1, 5, 5]), torch.tensor([-1, 0, 0]), torch.zeros(3)))
