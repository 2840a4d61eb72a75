"""Capacity-sized trees (issue 41): a DraftTree's arrays are the filled prefix of buffers preallocated at its
capacity, grown in place, and every tree keeps its nodes whatever is grown from it or from its ancestors
(draft/tree.py's capacity invariant). Checked against plain Python lists on random sequences of appends, prefixes,
re-roots and branchings (two trees grown from one), with planted bugs that must be caught."""
import pytest
import torch

import draft.tree as dt
from draft.tree import DraftTree, depths_from_parents, keep_indices_for, merge_trees, reroot
from pipeline.outbox import RankTree
from tests.helpers import check_tree


def as_lists(t: DraftTree) -> tuple:
    return (t.tokens.tolist(), t.parents.tolist(), [round(x, 5) for x in t.scores.tolist()], t.depths.tolist())


def check_live(t: DraftTree, ref: tuple) -> None:
    """``t`` reads exactly its ``len(t)`` live nodes, equal to the reference lists, and its invariants hold."""
    n = len(ref[0])
    assert len(t) == n and t.capacity >= n
    assert all(x.numel() == n for x in (t.tokens, t.parents, t.scores, t.depths))
    got = as_lists(t)
    assert (got[0], got[1], got[3]) == (ref[0], ref[1], ref[3])
    assert all(abs(a - b) < 1e-4 for a, b in zip(got[2], ref[2]))           # float32 scores against Python's
    check_tree(t)
    assert t.depths.tolist() == depths_from_parents(t.parents).tolist()


def random_growth(g, t: DraftTree, k: int):
    """``k`` new nodes below ``t`` (parents existing or earlier new nodes; distinct tokens per parent), as tensors
    and as the reference lists of the grown tree."""
    toks, pars, scos = [], [], []
    n = len(t)
    used = {(p, x) for p, x in zip(t.parents.tolist(), t.tokens.tolist())}
    all_par, all_dep = t.parents.tolist(), t.depths.tolist()
    for i in range(k):
        p = int(torch.randint(0, n + i, (1,), generator=g))
        x = int(torch.randint(0, 1000, (1,), generator=g))
        while (p, x) in used:
            x += 1
        used.add((p, x))
        toks.append(x)
        pars.append(p)
        scos.append(float(torch.tensor(-float(torch.rand(1, generator=g)) * 5, dtype=torch.float32)))
        all_par.append(p)
        all_dep.append(all_dep[p] + 1)
    ref = (t.tokens.tolist() + toks, all_par, [round(x, 5) for x in t.scores.tolist() + scos], all_dep)
    par = torch.tensor(pars)
    return (torch.tensor(toks), par, torch.tensor(scos, dtype=torch.float64), torch.tensor(all_dep[n:])), ref


def run_history(seed: int) -> None:
    """A random history of trees that share buffers; at the end every tree made along the way still reads its own
    nodes (persistence) and the live/capacity invariants hold."""
    g = torch.Generator().manual_seed(seed)
    cap = int(torch.randint(4, 40, (1,), generator=g))
    t0 = DraftTree(torch.tensor([7]), torch.tensor([-1]), torch.zeros(1), capacity=cap)
    made = [(t0, as_lists(t0))]
    for _ in range(25):
        t, _ref = made[int(torch.randint(0, len(made), (1,), generator=g))]   # often not the newest: branching
        op = int(torch.randint(0, 4, (1,), generator=g))
        if op <= 1:
            arrays, ref = random_growth(g, t, int(torch.randint(1, 8, (1,), generator=g)))
            made.append((t.append(*arrays), ref))
        elif op == 2:
            k = int(torch.randint(1, len(t) + 1, (1,), generator=g))
            made.append((t.prefix(k), tuple(x[:k] for x in as_lists(t))))
        elif len(t) > 1:                                      # re-root at a random child of a random path
            node = int(torch.randint(1, len(t), (1,), generator=g))
            path, p = [], t.parents.tolist()
            u = p[node]
            while u >= 0:
                path.append(u)
                u = p[u]
            path = path[::-1]
            keep = keep_indices_for(t, path, node)
            made.append((reroot(t, keep, len(path)), ref_reroot(as_lists(t), keep.tolist(), len(path))))
    for t, ref in made:
        check_live(t, ref)


def ref_reroot(ref: tuple, keep: list[int], accepted: int) -> tuple:
    toks, pars, scos, deps = ref
    rest = keep[accepted:]
    new = {k: i for i, k in enumerate(rest)}
    return ([toks[k] for k in rest], [new.get(pars[k], -1) for k in rest],
            [round(scos[k] - scos[rest[0]], 5) for k in rest], [deps[k] - deps[rest[0]] for k in rest])


@pytest.mark.parametrize("seed", range(30))
def test_trees_keep_their_nodes_whatever_is_grown_beside_them(seed):
    run_history(seed)


def test_planted_in_place_growth_of_a_shorter_tree_is_caught(monkeypatch):
    """Planted bug: growing in place whenever the buffer has room, even a tree that a longer one shares: the
    longer tree's slots past the shorter prefix are overwritten (a stale slot read back). The history test fails."""
    monkeypatch.setattr(dt, "_can_fill_in_place", lambda st, n, k: n + k <= st.capacity)
    with pytest.raises(AssertionError):
        for seed in range(30):
            run_history(seed)


def test_planted_view_past_the_filled_prefix_is_caught(monkeypatch):
    """Planted bug: a tree's arrays view the whole buffer instead of its live prefix (len = capacity, slots never
    written read back). The history test fails."""
    def whole(self, n):
        st = self._store
        self.tokens, self.parents, self.scores, self.depths = st.tokens, st.parents, st.scores, st.depths
    monkeypatch.setattr(DraftTree, "_view", whole)
    g = torch.Generator().manual_seed(0)
    t0 = DraftTree(torch.tensor([7]), torch.tensor([-1]), torch.zeros(1), capacity=16)
    arrays, ref = random_growth(g, DraftTree(torch.tensor([7]), torch.tensor([-1]), torch.zeros(1)), 5)
    with pytest.raises(AssertionError):
        check_live(t0.append(*arrays), ref)


def test_growth_is_in_place_until_the_capacity_and_copies_after():
    t = DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.zeros(1), capacity=4)
    a = t.append(torch.tensor([2, 3]), torch.tensor([0, 0]), torch.tensor([-1.0, -2.0]), torch.tensor([1, 1]))
    assert a.tokens.data_ptr() == t.tokens.data_ptr() and a.capacity == 4 and a.room == 1 and t.room == 0
    b = a.append(torch.tensor([4, 5, 6]), torch.tensor([1, 1, 2]), torch.tensor([-3.0] * 3), torch.tensor([2, 2, 2]))
    assert b.tokens.data_ptr() != a.tokens.data_ptr() and b.capacity == 8 and len(b) == 6
    c = t.append(torch.tensor([9]), torch.tensor([0]), torch.tensor([-0.5]), torch.tensor([1]))   # branch: a copy
    assert c.tokens.data_ptr() != t.tokens.data_ptr()
    assert a.tokens.tolist() == [1, 2, 3] and c.tokens.tolist() == [1, 9] and t.tokens.tolist() == [1]
    assert DraftTree.single(3).capacity == 1 and DraftTree.single(3).with_capacity(5).capacity == 5


def test_reroot_keeps_the_capacity_and_merge_appends_in_place():
    g = torch.Generator().manual_seed(1)
    t = DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.zeros(1), capacity=64)
    arrays, ref = random_growth(g, t, 30)
    t = t.append(*arrays)
    keep = keep_indices_for(t, [0], int(t.parents.tolist().index(0, 1)))
    r = reroot(t, keep, 1)
    assert r.capacity == 64 and r.room == 64 - len(r)
    extra = DraftTree(torch.tensor([int(r.tokens[0]), 999]), torch.tensor([-1, 0]), torch.tensor([0.0, -1.0]))
    m, added = merge_trees(r, extra)
    assert added == 1 and m.tokens.data_ptr() == r.tokens.data_ptr() and m.tokens.tolist()[-1] == 999
    assert m.depths.tolist() == depths_from_parents(m.parents).tolist()


def test_rank_tree_ids_are_a_view_of_a_buffer_at_capacity():
    g = torch.Generator().manual_seed(2)
    t = DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.zeros(1), capacity=16)
    arrays, _ = random_growth(g, t, 5)
    t = t.append(*arrays)
    state = RankTree(t)
    box = type("B", (), {"next_gid": 0, "send": lambda self, tok, pg, tag=0: setattr(self, "next_gid",
                                                                                    self.next_gid + tok.numel())})()
    state.send(box, 4)
    arrays, _ = random_growth(g, t, 6)
    state.set_tree(t.append(*arrays))
    assert state.gids.tolist() == [0, 1, 2, 3] + [-1] * 8 and state._gbuf.numel() == 17 and int(state._gbuf[-1]) == -1
    assert state.gids.data_ptr() == state._gbuf.data_ptr()
    arrays, _ = random_growth(g, state.tree, 9)                          # past the capacity: a bigger buffer
    state.set_tree(state.tree.append(*arrays))
    assert state.gids.tolist() == [0, 1, 2, 3] + [-1] * 17 and state._gbuf.numel() >= 22 and (state._gbuf[21:] == -1).all()
    child = int(state.tree.parents.tolist().index(0, 1))
    keep = keep_indices_for(state.tree, [0], child)
    state.reroot(keep, 1)
    rest = keep[1:].tolist()
    assert state.gids.tolist() == [k if k < 4 else -1 for k in rest]
    assert state.sent == sum(1 for k in rest if k < 4) and (state._gbuf[len(rest):] == -1).all()
