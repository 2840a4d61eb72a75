"""The vectorised tree algebra (pointer jumping, index maps) equals the plain per-node loops it replaced, on
random trees, including extensions of an existing tree; a planted bug in the reference is caught."""
import pytest
import torch

from draft.tree import DraftTree, depths_from_parents, keep_indices_for
from model.kv_cache import extend_ancestry
from tests.helpers import ancestor_matrix, remap_parents, select_top_nodes


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


# -- issue 41: the verified step's keep-list and re-root, the KV cache's in-place ancestry, the union top-k and the
# beam's in-place expansion, each against the plain reference it replaced ------------------------------------------

def random_scored_tree(g, n):
    par = torch.full((n,), -1)
    sc = torch.zeros(n, dtype=torch.float64)
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        par[i] = p
        sc[i] = sc[p] - float(torch.rand((), generator=g))
    return DraftTree(torch.arange(n) + 3, par, sc)


@pytest.mark.parametrize("seed", range(20))
def test_subtree_nodes_and_reroot_equal_the_references(seed):
    from draft.tree import reroot, subtree_nodes
    g = torch.Generator().manual_seed(400 + seed)
    n = int(torch.randint(2, 90, (1,), generator=g)) if seed else 70
    tree = random_scored_tree(g, n)
    if seed == 0:                                           # a long chain: the rounds must cover its length
        tree = DraftTree(torch.arange(n) + 3, torch.arange(-1, n - 1), -torch.arange(n).double())
    anc = ref_anc(tree.parents)
    for root in range(n):
        assert subtree_nodes(tree.parents.numpy(), root).tolist() == anc[:, root].nonzero().flatten().tolist()
    r = int(torch.randint(1, n, (1,), generator=g))
    path = anc[int(tree.parents[r])].nonzero().flatten().tolist()   # ancestors-or-self of r's parent, root first
    keep = keep_indices_for(tree, path, r)
    assert keep.tolist() == path + anc[:, r].nonzero().flatten().tolist()
    got = reroot(tree, keep, len(path))
    rest = keep[len(path):]                                  # the reference: remap_parents, scores/depths shifted
    _, want_par = remap_parents(tree.parents[rest], rest, keep, len(path))
    assert got.parents.tolist() == want_par.tolist() and got.tokens.tolist() == tree.tokens[rest].tolist()
    assert torch.equal(got.scores, tree.scores[rest] - tree.scores[rest[0]])
    assert torch.equal(got.depths, depths_from_parents(got.parents))


def test_keep_list_order_is_checked():
    tree = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, 2]), torch.zeros(4))
    with pytest.raises(AssertionError):
        keep_indices_for(tree, [0, 2, 1], None)
    with pytest.raises(AssertionError):
        keep_indices_for(tree, [0, 2], 1)                    # a new root before the path's end


def test_subtree_with_too_few_rounds_is_caught():
    """The planted bug: one round of jumping fewer misses the far end of a chain."""
    from draft.tree import subtree_nodes
    par = torch.arange(-1, 40)
    idx = torch.arange(41)
    up = torch.where(idx > 0, par, idx)
    for _ in range(41 .bit_length() - 1):
        up = up[up]
    assert (up == 0).sum() < 41 and subtree_nodes(par.numpy(), 0).size == 41


@pytest.mark.parametrize("seed", range(12))
def test_kv_cache_ancestry_buffers_equal_the_pure_functions(seed):
    """Staged rows, commits, keep-lists and truncation on the in-place buffers (from capacity 0, growing) give the
    ancestor matrix, depths, mask and positions of the pure functions, segment after segment."""
    from model.kv_cache import KVCache
    g = torch.Generator().manual_seed(500 + seed)
    c = KVCache(1, 1, 2, 400, torch.float32)
    c.commit_forward(5, as_context=True)
    ref_a, ref_d = torch.zeros(0, 0, dtype=torch.bool), torch.zeros(0, dtype=torch.long)
    for step in range(8):
        m = c.num_tree
        kind = int(torch.randint(0, 4, (1,), generator=g))
        n = int(torch.randint(1, 45 if kind == 3 else 12, (1,), generator=g))
        if kind == 0 and m:                                  # one drafted level: every parent cached
            par = torch.randint(0, m, (n,), generator=g)
        elif kind == 1:                                      # roots below the context
            par = torch.full((n,), -1)
        else:                                                # linked segment (some new parents), any size
            par = torch.tensor([int(torch.randint(-1, m + i, (1,), generator=g)) for i in range(n)])
        want_a = ancestor_matrix(par, ref_a if m else None)
        want_d = torch.cat([ref_d, depths_from_parents(par, ref_d)]) if m else depths_from_parents(par)
        if step % 2:
            pos, mask, anc, dep = c.tree_inputs(par, torch.float32)
            assert torch.equal(anc, want_a) and torch.equal(dep, want_d)
            c.commit_forward(n, as_context=False, anc=anc, depth=dep)
        else:
            pos, mask = c.staged_tree_inputs(par, torch.float32)
            c.commit_forward(n, as_context=False)
        assert torch.equal(pos[0], c.context_len + want_d[m:])
        assert torch.equal(mask[0, 0, :, c.context_len:] == 0, want_a[m:])
        assert not bool((mask[0, 0, :, :c.context_len] != 0).any())
        assert torch.equal(c.tree_anc, want_a) and torch.equal(c.tree_depth, want_d)
        ref_a, ref_d = want_a, want_d
        if step % 3 == 2:                                    # a decision: accept a path, keep a subtree
            acc = int(torch.randint(0, 2, (1,), generator=g))
            path = [0] if acc and int(par[0]) == -1 and m == 0 else []
            root = int(torch.randint(len(path), c.num_tree, (1,), generator=g))
            sub = ref_a[:, root].nonzero().flatten().tolist()
            keep = torch.tensor(path + [s for s in sub if s not in path])
            if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
                continue
            c.apply_keep(keep, len(path))
            rest = keep[len(path):]
            ref_a, ref_d = ref_a[rest][:, rest], ref_d[rest] - len(path)
            assert torch.equal(c.tree_anc, ref_a) and torch.equal(c.tree_depth, ref_d)
    c.truncate_tree()
    assert c.num_tree == 0 and c.tree_anc.shape == (0, 0)


def ref_union_top(scores, tokens, k):
    out_s, out_t = [], []
    for s_row, t_row in zip(scores.tolist(), tokens.tolist()):
        order = sorted(range(len(s_row)), key=lambda j: -s_row[j])     # stable
        seen, row = set(), []
        for j in order:
            if t_row[j] in seen or s_row[j] == float("-inf") or t_row[j] < 0:
                continue
            seen.add(t_row[j])
            row.append((s_row[j], t_row[j]))
        out_s.append([a for a, _ in row])
        out_t.append([b for _, b in row])
    kk = min([k] + [len(r) for r in out_s])
    return [r[:kk] for r in out_s], [r[:kk] for r in out_t]


@pytest.mark.parametrize("seed", range(20))
def test_union_top_equals_the_per_row_reference(seed):
    import numpy as np

    from draft.merged import union_top_np
    g = torch.Generator().manual_seed(600 + seed)
    rows, width = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))
    scores = -torch.randint(0, 4, (rows, width), generator=g).double()            # many ties
    tokens = torch.randint(0, 6, (rows, width), generator=g)                      # many duplicates
    empty = torch.rand(rows, width, generator=g) < 0.2
    scores[empty], tokens[empty] = float("-inf"), -1                              # empty slots
    k = int(torch.randint(1, 8, (1,), generator=g))
    s, t = union_top_np(np.concatenate([scores.numpy(), tokens.double().numpy()], -1), width, k)
    ws, wt = ref_union_top(scores, tokens, k)
    assert s.tolist() == ws and t.tolist() == wt


class _Beam:
    """A deterministic stand-in drafter with many score ties: features from tokens, log-probs rounded."""

    def __init__(self, seed, width=4, vocab=9):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(width, vocab, generator=g)
        self.size = 0

    def make(self):
        from draft.drafter import BeamTreeDrafter
        outer = self

        class Stub(BeamTreeDrafter):
            @property
            def tree_size(self):
                return outer.size

            def tree_forward(self, tokens, features, parents):
                outer.size += tokens.numel()
                return torch.tanh(features * 0.7 + tokens[:, None].float() * 0.3)

            def drop_tree(self):
                outer.size = 0

            def logprobs(self, hidden):
                return torch.log_softmax((hidden @ outer.w * 2).round(), -1)
        return Stub()


def top_node_order(cand_scores, total_token):
    """The references' choice of kept candidates: the best ``total_token - 1``, descending score, ties by index."""
    from draft.tree import beam_frontier
    return beam_frontier(cand_scores, max(0, min(total_token - 1, len(cand_scores))))


def ref_extend_tree(d, tree, inputs, root_hidden, levels, top_k, max_new):
    """The beam as it was before issue 41 (per-level lists, repeat_interleave, one cat at the end)."""
    from draft.drafter import to_host
    n = len(tree)
    inputs = inputs.clone()
    inputs[(tree.parents == 0).nonzero().flatten()] = root_hidden
    outs = root_hidden[None]
    if n > 1:
        outs = torch.cat([outs, d.tree_forward(tree.tokens[1:], inputs[1:], tree.parents[1:] - 1)])
    slot = torch.arange(-1, n - 1)
    has_child = torch.zeros(n, dtype=torch.bool)
    has_child[tree.parents[1:]] = True
    leaves = (~has_child).nonzero().flatten()
    k = min(top_k, leaves.numel())
    frontier = leaves[torch.sort(-tree.scores[leaves].double(), stable=True).indices[:k]]
    f_par, f_score, f_dep, f_out, f_slot = frontier, tree.scores[frontier], tree.depths[frontier], outs[frontier], \
        slot[frontier]
    ct_l, cp_l, cs_l, ci_l, cd_l = [], [], [], [], []
    n_cand = 0
    for level in range(levels):
        cs, ct = to_host(*d.top_tokens(f_out, top_k))
        kk = cs.shape[-1]
        cum = (f_score[:, None] + cs).reshape(-1)
        ct_l.append(ct.reshape(-1))
        cp_l.append(f_par.repeat_interleave(kk))
        cs_l.append(cum)
        ci_l.append(f_out.repeat_interleave(kk, dim=0))
        cd_l.append((f_dep + 1).repeat_interleave(kk))
        if level == levels - 1:
            break
        best = torch.sort(-cum.double(), stable=True).indices[:top_k]
        f_dep = cd_l[-1][best]
        start = d.tree_size
        f_out = d.tree_forward(ct.reshape(-1)[best], f_out[best // kk], f_slot[best // kk])
        f_slot = start + torch.arange(best.numel())
        f_par = -(n_cand + best + 2)
        f_score = cum[best]
        n_cand += cum.numel()
    d.drop_tree()
    scores = torch.cat(cs_l)
    chosen = top_node_order(scores, max_new + 1)
    par = torch.cat(cp_l)[chosen]
    inv = torch.full((scores.numel(),), -1, dtype=torch.long)
    inv[chosen] = n + torch.arange(chosen.numel())
    parents = torch.where(par >= 0, par, inv[(-par - 2).clamp(min=0)])
    grown = DraftTree(torch.cat([tree.tokens, torch.cat(ct_l)[chosen]]), torch.cat([tree.parents, parents]),
                      torch.cat([tree.scores, scores[chosen]]), torch.cat([tree.depths, torch.cat(cd_l)[chosen]]))
    return grown, torch.cat([inputs, torch.cat(ci_l)[chosen]])


@pytest.mark.parametrize("seed", range(12))
def test_in_place_beam_equals_the_per_level_reference(seed):
    """extend_tree (candidates in preallocated arrays, rows gathered at the end) drafts exactly the tree and inputs
    of the per-level reference, ties included, for several widths, depths and budgets."""
    from tests.helpers import check_tree
    g = torch.Generator().manual_seed(700 + seed)
    beam = _Beam(seed)
    d = beam.make()
    root = torch.randn(4, generator=g)
    tree, inputs = d.grow_tree_with_inputs(5, root, int(torch.randint(2, 20, (1,), generator=g)),
                                           int(torch.randint(0, 3, (1,), generator=g)), 3)
    for _ in range(3):
        levels, top_k = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        max_new = int(torch.randint(1, 30, (1,), generator=g))
        got = d.extend_tree(tree, inputs, root, levels, top_k, max_new)
        want = ref_extend_tree(d, tree, inputs, root, levels, top_k, max_new)
        check_tree(got[0])
        for a in ("tokens", "parents", "scores", "depths"):
            assert torch.equal(getattr(got[0], a), getattr(want[0], a)), a
        assert torch.equal(got[1], want[1])
        tree, inputs = got


def ref_grow_with_outputs(d, root_token, root_hidden, total_token, depth, top_k):
    """EAGLE-2's first tree as it was before issue 41 (per-level repeat_interleave of ids and features)."""
    from draft.drafter import to_host
    s, t = d.top_tokens(root_hidden, top_k)
    k = s.numel()
    ct_l, cp_l, cs_l, ci_l = [t], [torch.full((k,), -1)], [s], [root_hidden.expand(k, -1)]
    f_ids, f_tok, f_score, f_feat, f_cache = torch.arange(k), t, s, root_hidden.expand(k, -1), torch.full((k,), -1)
    n_cand, expanded = k, []
    for _ in range(depth):
        start = d.tree_size
        out = d.tree_forward(f_tok, f_feat, f_cache)
        expanded.append((f_ids, out))
        cs, ct = d.top_tokens(out, k)
        cum = (f_score[:, None] + cs).reshape(-1)
        ct_l.append(ct.reshape(-1))
        cp_l.append(f_ids.repeat_interleave(k))
        cs_l.append(cum)
        ci_l.append(out.repeat_interleave(k, dim=0))
        best = torch.sort(-cum.double(), stable=True).indices[:k]
        f_ids, n_cand = n_cand + best, n_cand + k * k
        f_tok, f_score, f_feat, f_cache = ct.reshape(-1)[best], cum[best], out[best // k], start + best // k
    d.drop_tree()
    scores, cand_tok, cand_par = to_host(torch.cat(cs_l), torch.cat(ct_l), torch.cat(cp_l))
    levels = torch.arange(1, len(cs_l) + 1).repeat_interleave(torch.tensor([c.numel() for c in cs_l]))
    tree = select_top_nodes(root_token, cand_tok, cand_par, scores, total_token, levels)
    order = top_node_order(scores, total_token)
    inputs = torch.cat([root_hidden[None], torch.cat(ci_l)[order]])
    cand_out, cand_known = inputs.new_zeros((n_cand, inputs.shape[-1])), torch.zeros(n_cand, dtype=torch.bool)
    for ids, out in expanded:
        cand_out[ids], cand_known[ids] = out, True
    return tree, inputs, torch.cat([inputs[:1], cand_out[order]]), torch.cat([torch.ones(1, dtype=torch.bool),
                                                                              cand_known[order]])


@pytest.mark.parametrize("seed", range(10))
def test_first_tree_layout_equals_the_per_level_reference(seed):
    """grow_tree_with_outputs (a candidate's parent, input row and depth from the levels' shapes) drafts the tree,
    inputs, outputs and known flags of the per-level reference, ties included."""
    g = torch.Generator().manual_seed(800 + seed)
    d = _Beam(seed).make()
    root = torch.randn(4, generator=g)
    total, depth, k = (int(torch.randint(2, 60, (1,), generator=g)), int(torch.randint(0, 5, (1,), generator=g)),
                       int(torch.randint(1, 6, (1,), generator=g)))
    got = d.grow_tree_with_outputs(5, root, total, depth, k)
    want = ref_grow_with_outputs(d, 5, root, total, depth, k)
    for a in ("tokens", "parents", "scores", "depths"):
        assert torch.equal(getattr(got[0], a), getattr(want[0], a)), a
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b)
