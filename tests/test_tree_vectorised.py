"""The vectorised tree algebra (pointer jumping, index maps) equals the plain per-node loops it replaced, on
random trees, including extensions of an existing tree; a planted bug in the reference is caught."""
import pytest
import torch

from draft.tree import (DraftTree, ancestor_matrix, depths_from_parents, keep_indices_for, remap_parents,
                        select_top_nodes)
from model.kv_cache import extend_ancestry


def ref_depths(parents, base=None):
    d = ([] if base is None else base.tolist()) + [0] * len(parents)
    off = 0 if base is None else len(base)
    for i, p in enumerate(parents.tolist()):
        d[off + i] = 0 if p < 0 else d[p] + 1
    return torch.tensor(d[off:], dtype=torch.long)


def ref_anc(parents, base=None):
    m = 0 if base is None else base.shape[0]
    n = len(parents)
    out = torch.zeros(m + n, m + n, dtype=torch.bool)
    if m:
        out[:m, :m] = base
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            out[m + i] = out[p]
        out[m + i, m + i] = True
    return out


def random_parents(g, n, roots=1):
    par = []
    for i in range(n):
        par.append(-1 if i < roots else int(torch.randint(-1 if roots > 1 else 0, i, (1,), generator=g)))
    return torch.tensor(par, dtype=torch.long)


@pytest.mark.parametrize("seed", range(20))
def test_depths_and_ancestors_equal_the_loops(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g))
    par = random_parents(g, n, roots=1 + seed % 3)
    assert torch.equal(depths_from_parents(par), ref_depths(par))
    assert torch.equal(ancestor_matrix(par), ref_anc(par))
    cut = int(torch.randint(0, n, (1,), generator=g))      # an extension of the first ``cut`` nodes
    if cut:
        base_a, base_d = ref_anc(par[:cut]), ref_depths(par[:cut])
        assert torch.equal(ancestor_matrix(par[cut:], base_a), ref_anc(par))
        assert torch.equal(depths_from_parents(par[cut:], base_d), ref_depths(par)[cut:])
        anc, dep = extend_ancestry(par[cut:], base_a, base_d)
        assert torch.equal(anc, ref_anc(par)) and torch.equal(dep, ref_depths(par))


def test_bad_parent_raises():
    with pytest.raises(ValueError):
        ancestor_matrix(torch.tensor([-1, 1]))
    with pytest.raises(ValueError):
        ancestor_matrix(torch.tensor([2]), torch.ones(2, 2, dtype=torch.bool))


def test_a_planted_bug_is_caught():
    par = torch.tensor([-1, 0, 1, 2, 0])
    wrong = ref_depths(par).clone()
    wrong[3] += 1                                        # an off-by-one at the chain's end
    assert not torch.equal(depths_from_parents(par), wrong)


def ref_select(root_token, cand_tokens, cand_parents, cand_scores, total_token):
    n_keep = max(0, min(total_token - 1, len(cand_scores)))
    order = torch.sort(-cand_scores.to(torch.float64), stable=True).indices[:n_keep].tolist()
    new_index = {c: i + 1 for i, c in enumerate(order)}
    parents = [-1] + [0 if int(cand_parents[c]) < 0 else new_index[int(cand_parents[c])] for c in order]
    return ([root_token] + cand_tokens[order].tolist(), parents, [0.0] + cand_scores[order].tolist())


@pytest.mark.parametrize("seed", range(20))
def test_select_keep_and_remap_equal_the_loops(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 50, (1,), generator=g))
    par = torch.full((n,), -1)
    sc = torch.zeros(n, dtype=torch.float64)
    for i in range(1, n):
        p = int(torch.randint(-1, i, (1,), generator=g))
        par[i] = p
        sc[i] = (sc[p] if p >= 0 else 0.0) - float(torch.rand((), generator=g)) * (seed % 2)   # ties when seed even
    total = int(torch.randint(1, n + 3, (1,), generator=g))
    tree = select_top_nodes(7, torch.arange(n) + 10, par, sc, total)
    tok, p, s = ref_select(7, torch.arange(n) + 10, par, sc, total)
    assert tree.tokens.tolist() == tok and tree.parents.tolist() == p
    assert torch.equal(tree.scores, torch.tensor(s, dtype=torch.float32))
    if len(tree) < 3:
        return
    path = [0]
    while True:                                          # a first-child path
        kids = (tree.parents == path[-1]).nonzero().flatten().tolist()
        if len(kids) < 2:
            break
        path.append(kids[0])
    kids = (tree.parents == path[-1]).nonzero().flatten().tolist()
    new_root = kids[-1] if kids else None
    keep = keep_indices_for(tree, path, new_root)
    anc = ref_anc(tree.parents)
    want = path + (anc[:, new_root].nonzero().flatten().tolist() if new_root is not None else [])
    assert keep.tolist() == want
    ids = torch.arange(len(tree))
    rows, newp = remap_parents(tree.parents, ids, keep, len(path))
    o2n = {k: i - len(path) for i, k in enumerate(keep.tolist())}
    want_rows = [o2n.get(i, -1) >= 0 for i in range(len(tree))]
    want_par = [(o2n.get(p, -1) if p >= 0 and o2n.get(p, -1) >= 0 else -1)
                for i, p in enumerate(tree.parents.tolist()) if want_rows[i]]
    assert rows.tolist() == want_rows and newp.tolist() == want_par



@pytest.mark.parametrize("seed", range(10))
def test_merge_sources_single_source_shortcut_equals_the_general_rule(seed):
    """When one source proposes nodes and the others only the root, merge_sources returns that tree unchanged; the
    general rule (forced by a duplicate of the tree as a second source) gives the same tree."""
    from draft.tree import merge_sources
    g = torch.Generator().manual_seed(200 + seed)
    n = int(torch.randint(2, 40, (1,), generator=g))
    par = torch.full((n,), -1)
    sc = torch.zeros(n, dtype=torch.float64)
    for i in range(1, n):
        p = int(torch.randint(-1, i, (1,), generator=g))
        par[i] = p
        sc[i] = (sc[p] if p >= 0 else 0.0) - float(torch.rand((), generator=g)) * (seed % 2)
    total = int(torch.randint(2, n + 3, (1,), generator=g))
    tree = select_top_nodes(7, torch.arange(n) + 10, par, sc, total)
    fast = merge_sources([tree, DraftTree.single(7)], total)
    general = merge_sources([tree, tree], total)           # two sources: the general path, same union
    for a in ("tokens", "parents", "scores", "depths"):
        assert torch.equal(getattr(fast, a), getattr(general, a)), a


@pytest.mark.parametrize("seed", range(12))
def test_small_and_large_paths_agree(seed):
    """Both of extend_ancestry's paths (the list loop up to SMALL_TREE new nodes, pointer jumping above) equal the
    reference on the same trees, with and without a cached base."""
    import model.kv_cache as kv
    g = torch.Generator().manual_seed(300 + seed)
    n = kv.SMALL_TREE + 8
    par = random_parents(g, n, roots=1 + seed % 2)
    cut = int(torch.randint(0, 8, (1,), generator=g))
    base_a, base_d = (ref_anc(par[:cut]), ref_depths(par[:cut])) if cut else (None, None)
    big = kv.extend_ancestry(par[cut:], base_a, base_d)                           # > SMALL_TREE: jumping
    small = kv._extend_ancestry_loop(par[cut:], cut, base_a, base_d)
    for got in (big, small):
        assert torch.equal(got[0], ref_anc(par)) and torch.equal(got[1], ref_depths(par))
