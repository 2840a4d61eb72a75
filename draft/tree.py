"""Draft token trees as parent-pointer arrays, and the pure operations every mode shares.

A tree is four aligned 1-D arrays: ``tokens``, ``parents`` (``-1`` for the root), ``scores``
(cumulative draft log-prob relative to the root) and derived ``depths``.

Invariants (checked by ``tests.helpers.check_tree``):
  * node 0 is the root and is the only node with parent ``-1``;
  * ``parents[i] < i`` for every non-root node ("ancestors first"), so every prefix
    ``[0, k)`` of the node list is a connected subtree containing the root;
  * siblings carry distinct tokens (a node is identified by its token path).

Nothing here ships dense masks between ranks: every rank derives attention masks and
positions from ``parents`` (see :func:`model.kv_cache.extend_ancestry`, :func:`depths_from_parents`).

Capacity (issue 41): a tree's four arrays are the first ``len(tree)`` slots of buffers preallocated at its
``capacity`` (its node budget) and filled in place; ``len(tree)`` is the number of live nodes and every array
attribute is a view of exactly that filled prefix, so consumers read a tree as before. Growing a tree
(:meth:`DraftTree.append`) writes the new nodes into the slots after the prefix and returns the grown tree
on the same buffers. Trees are still values (the pure-function style of this module): several trees may share
buffers (a tree and the trees grown from it), and the store's invariant keeps each one's nodes fixed:

  * a buffer slot is written once per store: ``append`` writes only slots ``>= filled`` (the store's filled
    count) and only when the tree it grows is the store's longest (``len(tree) == filled``), then advances
    ``filled``; growing any shorter tree, or past the capacity, copies into a new store (copy on write);
  * so slots ``[0, len(t))`` of every tree ``t`` on a store never change after ``t`` is made, and slots
    ``>= len(t)`` are never visible through ``t`` (a stale slot past the prefix is never read back).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from model.devices import HOST
from model.kv_cache import extend_ancestry

Tensor = torch.Tensor


def depths_from_parents(parents: Tensor, base_depths: Tensor | None = None) -> Tensor:
    """Depth of each node (root = 0). ``parents[i] < i`` or ``-1``.

    ``base_depths`` gives depths of nodes referenced by index but not in ``parents`` (used when
    ``parents`` describes new nodes appended after ``len(base_depths)`` existing ones).
    Vectorised (pointer jumping, :func:`model.kv_cache.extend_ancestry`).
    """
    if base_depths is None:
        return extend_ancestry(parents)[1]
    return extend_ancestry(parents, None, base_depths.to(torch.long))[1][len(base_depths):]


class _Store:
    """The buffers of one or more trees (see the module docstring's capacity invariant): ``filled`` slots written."""

    __slots__ = ("tokens", "parents", "scores", "depths", "filled", "_np")

    def __init__(self, tokens: Tensor, parents: Tensor, scores: Tensor, depths: Tensor, filled: int) -> None:
        self.tokens, self.parents, self.scores, self.depths, self.filled = tokens, parents, scores, depths, filled
        self._np = None

    def numpy(self) -> tuple:
        """NumPy views of the four buffers (the same memory; taken once per store, host buffers only): the drafter's
        host bookkeeping reads and writes a tree's slots through them without a dispatched operator per access."""
        if self._np is None:
            self._np = tuple(x.numpy() for x in (self.tokens, self.parents, self.scores, self.depths))
        return self._np

    @property
    def capacity(self) -> int:
        return int(self.tokens.numel())


def _can_fill_in_place(store: _Store, n: int, k: int) -> bool:
    """Whether a tree of ``n`` nodes on ``store`` may grow by ``k`` nodes in place: it is the store's longest tree
    (nothing was written after its prefix) and the new nodes fit. Otherwise :meth:`DraftTree.append` copies."""
    return store.filled == n and n + k <= store.capacity


@dataclass
class DraftTree:
    """A draft tree on rank 0. See the module docstring for the invariants (the tree's and its buffers').

    ``capacity`` (optional, at least ``len``): slots preallocated for the tree and the trees grown from it by
    :meth:`append`; 0 (the default) = exactly its nodes, the given arrays used as they are (no copy)."""

    tokens: Tensor
    parents: Tensor
    scores: Tensor
    depths: Tensor = field(default=None)  # type: ignore[assignment]
    # Sampled drafts only (``None`` = every node is a deterministic proposal, verified by ``walk_tree``'s
    # q = 1 rule in child index order). Otherwise ``proposals[u]`` is node ``u``'s ordered list of
    # ``(child, q)``: ``child`` a node whose parent is ``u``, ``q`` the [V] float64 distribution the child's
    # token was drawn from, or ``None`` for a deterministic proposal. Every child of ``u`` appears at least
    # once; a token drawn twice appears twice (one node). The list order is the try order
    # (``pipeline.verify.walk_proposals``), and no step may reorder or filter it by drawn values.
    proposals: list | None = None
    capacity: int = 0

    def __post_init__(self) -> None:
        self.tokens = _flat(self.tokens.to(torch.long))
        self.parents = _flat(self.parents.to(torch.long))
        self.scores = _flat(self.scores.to(torch.float32))
        if self.depths is None:
            self.depths = depths_from_parents(self.parents)
        else:
            self.depths = _flat(self.depths.to(torch.long))
        n = int(self.tokens.numel())
        if self.capacity <= n:                     # the arrays are the buffers: full, nothing to copy
            self.capacity = n
            self._store = _Store(self.tokens, self.parents, self.scores, self.depths, n)
            return
        bufs = []
        for x in (self.tokens, self.parents, self.scores, self.depths):
            b = torch.empty(self.capacity, dtype=x.dtype, device=x.device)
            b[:n] = x
            bufs.append(b)
        self._store = _Store(*bufs, n)
        self._view(n)

    def _view(self, n: int) -> None:
        """The array attributes as views of the store's first ``n`` slots (the live nodes)."""
        st = self._store
        self.tokens, self.parents, self.scores, self.depths = (st.tokens[:n], st.parents[:n], st.scores[:n],
                                                               st.depths[:n])

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def room(self) -> int:
        """Nodes :meth:`append` can still write in place (0 when a longer tree shares the buffers)."""
        st = self._store
        return st.capacity - len(self) if st.filled == len(self) else 0

    def append(self, tokens: Tensor, parents: Tensor, scores: Tensor, depths: Tensor) -> "DraftTree":
        """The tree grown by ``k`` nodes appended after the existing ones (``parents`` index existing or earlier
        new nodes; ``depths`` theirs; ``tokens``/``scores`` any integer/float dtype, cast on write). In place on
        the buffers when :func:`_can_fill_in_place`, else on new buffers of ``max(capacity, 2 * capacity, n + k)``
        slots (copy on write); ``self`` is unchanged either way (module docstring). Proposals are not carried:
        appending is for deterministic trees (``proposals`` must be None)."""
        grown, slots = self.append_slots(int(tokens.numel()))
        for slot, x in zip(slots, (tokens, parents, scores, depths)):
            slot.copy_(_flat(x))
        return grown

    def append_slots(self, k: int) -> tuple["DraftTree", tuple[Tensor, Tensor, Tensor, Tensor]]:
        """:meth:`append` for a caller that writes the new nodes itself (with ``out=`` ops: no separate copy):
        returns the grown tree and the four views of its new slots ``[len, len + k)`` (tokens, parents, scores,
        depths), which the caller must fill before the grown tree is read. The same buffers rule as ``append``."""
        st, n, end = self._grow_store(k)
        return DraftTree._on_store(st, end), (st.tokens[n:end], st.parents[n:end], st.scores[n:end],
                                              st.depths[n:end])

    def append_slots_numpy(self, k: int) -> tuple["DraftTree", tuple]:
        """:meth:`append_slots` with the new slots as NumPy views of the buffers (host trees; the drafter's beam
        writes them: issue 41, no dispatched operator per slot array). The same buffers rule."""
        st, n, end = self._grow_store(k)
        return DraftTree._on_store(st, end), tuple(x[n:end] for x in st.numpy())

    def host_numpy(self) -> tuple:
        """``(tokens, parents, scores, depths)`` of the live nodes as NumPy views of the buffers (host trees; read
        only by convention: slots ``[0, len)`` never change)."""
        n = len(self)
        return tuple(x[:n] for x in self._store.numpy())

    def _grow_store(self, k: int) -> tuple[_Store, int, int]:
        """The store a tree grown by ``k`` nodes lives on (this one's in place, else a copy: :meth:`append`'s rule),
        marked filled up to ``len + k``; returns ``(store, len, len + k)``."""
        if self.proposals is not None:
            raise ValueError("append grows deterministic trees only (proposals would need their lists)")
        n = len(self)
        st = self._store
        if not _can_fill_in_place(st, n, k):
            cap = max(st.capacity, n + k) if k <= st.capacity - n else max(2 * st.capacity, n + k)
            st = DraftTree(self.tokens, self.parents, self.scores, self.depths, capacity=cap)._store
        end = n + k
        st.filled = end
        return st, n, end

    @staticmethod
    def _on_store(store: _Store, n: int, proposals: list | None = None, views: tuple | None = None) -> "DraftTree":
        """The tree of the first ``n`` slots of ``store`` (already written). ``views``: the four prefix views when
        the caller already holds them (the ``out=`` of the ops that wrote them), else they are taken here."""
        out = DraftTree.__new__(DraftTree)
        out.proposals, out.capacity, out._store = proposals, store.capacity, store
        if views is None:
            out._view(n)
        else:
            out.tokens, out.parents, out.scores, out.depths = views
        return out

    @staticmethod
    def of_arrays(arrays: tuple, proposals: list | None = None) -> "DraftTree":
        """The tree on ``arrays`` = (tokens, parents, scores, depths): flat host tensors already in the tree's dtypes
        (int64, int64, float32, int64), used as its buffers with no copy, cast or depth recomputation (issue 41: the
        host-built trees of :func:`top_nodes_tree` and :func:`merge_sources`); the caller hands them over."""
        n = arrays[0].numel()
        return DraftTree._on_store(_Store(*arrays, n), n, proposals, views=arrays)

    def prefix(self, k: int) -> "DraftTree":
        """The tree of the first ``k`` nodes (ancestors-first, so a tree), on the same buffers: views, no copy
        (slots ``[0, k)`` never change; growing it later copies unless it is the store's longest tree)."""
        if not 1 <= k <= len(self):
            raise ValueError(f"prefix of {k} nodes of a {len(self)}-node tree")
        if k == len(self):
            return self
        props = None if self.proposals is None else [[(c, q) for c, q in lst if c < k] for lst in self.proposals[:k]]
        return DraftTree._on_store(self._store, k, props)

    def with_capacity(self, capacity: int) -> "DraftTree":
        """This tree on buffers of at least ``capacity`` slots (itself when it already has the room)."""
        if capacity <= len(self) + self.room:
            return self
        return DraftTree(self.tokens, self.parents, self.scores, self.depths, self.proposals, capacity=capacity)

    @staticmethod
    def single(token: int) -> "DraftTree":
        """The one-node tree (its depth given: no recomputation from the parents, issue 41)."""
        return DraftTree(torch.tensor([token], device=HOST), torch.tensor([-1], device=HOST),
                         torch.zeros(1, device=HOST), torch.zeros(1, dtype=torch.long, device=HOST))


def _flat(x: Tensor) -> Tensor:
    """``x`` as a 1-D tensor (itself when it is one: no operator)."""
    return x if x.dim() == 1 else x.reshape(-1)


def top_nodes_tree(root_token: int, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, order: np.ndarray,
                   depths: np.ndarray | None = None) -> DraftTree:
    """EAGLE-2 re-ranking on host NumPy candidates: the root, then the kept candidates best first, candidate
    ``order[i]`` as node ``i + 1`` (``order``: :func:`best_first` of ``scores``, cut to the node budget less the
    root; a caller that reads the order for its own gathers too sorts once, issue 41). Candidates are listed in
    generation order; ``parents[i]`` is ``-1`` (a child of the root) or an *earlier* candidate. Because a child's
    score never exceeds its parent's and a parent always has the smaller index, every kept node's parent is kept and
    earlier, even on ties (ancestor-closed; raises otherwise), and the tree is ancestors-first. Scores as float32;
    ``depths`` (each candidate's depth below the root, 1 for a child of the root, when the caller knows them: a beam
    knows its levels) are gathered, else recomputed from the parents."""
    k = order.size
    inv = np.full(scores.size + 1, -1, dtype=np.int64)        # candidate -> tree index (-1: cut); a parent -1 (the
    inv[-1] = 0                                               # root) reads the last slot: node 0
    inv[order] = np.arange(1, k + 1)
    tok, par, dep = np.empty(k + 1, dtype=np.int64), np.empty(k + 1, dtype=np.int64), np.empty(k + 1, dtype=np.int64)
    sc = np.empty(k + 1, dtype=np.float32)
    tok[0], par[0], sc[0], dep[0] = root_token, -1, 0.0, 0
    tok[1:] = tokens[order]                                   # the casts of astype(int64 / float32), on assignment
    par[1:] = inv[parents[order]]
    if (par[1:] < 0).any():
        raise AssertionError("selected set is not ancestor-closed")  # impossible by construction
    sc[1:] = scores[order]
    if depths is None:
        return DraftTree(torch.from_numpy(tok), torch.from_numpy(par), torch.from_numpy(sc))
    dep[1:] = depths[order]
    return DraftTree.of_arrays(tuple(torch.from_numpy(x) for x in (tok, par, sc, dep)))


def beam_frontier(scores: Tensor, width: int) -> Tensor:
    """Indices of the best ``width`` of ``scores`` (1-D): descending score, ties by index (a stable sort; equal to
    sorting ``-scores`` in float64, as the EAGLE-2 beam did, for any non-NaN scores). The per-level choice of a
    beam's next frontier (:meth:`draft.drafter.BeamTreeDrafter.extend_tree`): two operators, whatever the width."""
    return torch.sort(scores, descending=True, stable=True).indices[:width]


@functools.lru_cache(maxsize=64)
def below_mask(n: int) -> np.ndarray:
    """``[n, n]`` strictly-lower-triangular mask (cached, read only): ``[i, j]`` true iff ``j < i`` (an earlier
    slot of the same row: the "a copy came earlier" test of prompt lookup's states and the merged union)."""
    out = np.tri(n, n, -1, dtype=bool)
    out.flags.writeable = False
    return out


def best_first(scores: np.ndarray, width: int) -> np.ndarray:
    """:func:`beam_frontier` in NumPy, for the host bookkeeping (issue 41): indices of the best ``width`` of
    ``scores`` (1-D), descending, ties by index (a stable sort of the negated scores: negation is exact, so the
    order is the torch one's). The one NumPy home of the rule (the beam's frontier and kept candidates,
    :func:`top_nodes_tree`)."""
    return np.argsort(-scores, kind="stable")[:width]


def split_sizes(n_nodes: int, n_parts: int, cap: int) -> list[int]:
    """Cut ``n_nodes`` into at most ``n_parts`` near-equal parts of at most ``cap`` nodes.

    Returns the sizes of the parts that go out now (smaller parts first); the remaining
    ``n_nodes - sum(sizes)`` nodes wait on rank 0. ``cap <= 0`` means unlimited.
    """
    if n_nodes <= 0 or n_parts <= 0:
        return []
    if cap > 0 and n_nodes > n_parts * cap:
        return [cap] * n_parts
    parts = min(n_parts, n_nodes)
    base, extra = divmod(n_nodes, parts)
    return [base] * (parts - extra) + [base + 1] * extra


def keep_indices_for(tree: DraftTree, accepted: list[int], new_root: int | None) -> Tensor:
    """Strictly increasing keep-list after a verification.

    ``accepted`` is the accepted path (root first). If ``new_root`` (an existing child of the last
    accepted node) continues the tree, its whole subtree is kept after the path; otherwise only
    the path is kept (truncate).

    Vectorised (issue 41): the subtree is :func:`subtree_nodes` (pointer jumping in NumPy), and
    strictness is checked on the path list (``accepted`` increasing, ``new_root`` after its last node: then the
    subtree, whose nodes all follow ``new_root``, continues it in order).
    """
    acc = list(accepted)
    if any(b <= a for a, b in zip(acc, acc[1:])) or (new_root is not None and acc and new_root <= acc[-1]):
        raise AssertionError("keep-list must be strictly increasing")
    keep = np.asarray(acc, dtype=np.int64)
    if new_root is not None:
        keep = np.concatenate([keep, subtree_nodes(tree.parents.numpy(), new_root)])
    return torch.from_numpy(keep)


def subtree_nodes(parents: np.ndarray, root: int) -> np.ndarray:
    """The nodes of ``root``'s subtree (``root`` first), increasing, in an ancestors-first tree (``parents[i] < i``;
    a NumPy array: int64 node ids, increasing).

    Pointer jumping with the nodes up to ``root`` as fixed points: ``up[i]`` starts as ``parents[i]`` for
    ``i > root`` and ``i`` otherwise; ``up = up[up]`` doubles every jump, so after ``bit_length(n - root)`` rounds
    (a chain from ``i`` down to ``root`` has fewer than ``n - root`` links) ``up[i]`` is the first node ``<= root``
    on ``i``'s path, and ``i`` is in the subtree iff that is ``root``. In NumPy on the host tree's memory (issue 41:
    the same ``log2(n) + 5`` steps were as many dispatched operators on the verified step's chain)."""
    n = parents.size
    idx = np.arange(n, dtype=np.int64)
    up = np.where(idx > root, parents, idx).astype(np.int64, copy=False)
    for _ in range((n - root).bit_length()):
        up = up[up]
    return np.flatnonzero(up == root).astype(np.int64, copy=False)


def reroot(tree: DraftTree, keep: Tensor, accepted_len: int) -> DraftTree:
    """The subtree that survives a continue decision, renumbered, with the new root at 0."""
    rest = keep[accepted_len:]
    if rest.numel() == 0:
        raise ValueError("reroot needs a surviving subtree")
    # ``rest`` is the new root's subtree (keep_indices_for: increasing), so every kept node's parent is kept except
    # the new root's, which is on the accepted path.
    r = rest.numel()
    props = None
    if tree.proposals is not None:   # the kept subtree is closed under children: lists map one to one
        new_of = {int(k): i for i, k in enumerate(rest.tolist())}
        props = [[(new_of[c], q) for c, q in tree.proposals[int(k)]] for k in rest.tolist()]
    # the surviving tree keeps the tree's capacity: each array gathered straight into its new buffer's prefix
    cap = max(tree.capacity, r) if props is None else r
    # In NumPy on the host arrays' memory (issue 41: about 22 dispatched operators on the verified step's chain
    # became 13: a view per array in, a buffer per array out and its prefix view; the same values and dtypes)
    rest_np = rest.numpy()
    tok, par, sc, dep = (x.numpy() for x in (tree.tokens, tree.parents, tree.scores, tree.depths))
    bufs = [np.empty(cap, dtype=x.dtype) for x in (tok, par, sc, dep)]
    bufs[0][:r] = tok[rest_np]
    # old index -> new: a kept node's rank in ``rest`` (increasing); the new root's parent, on the accepted path
    # before rest[0], ranks -1: a root's parent
    bufs[1][:r] = np.searchsorted(rest_np, par[rest_np], side="right") - 1
    s_r, d_r = sc[rest_np], dep[rest_np]
    bufs[2][:r] = s_r - s_r[0]
    bufs[3][:r] = d_r - d_r[0]                                                  # the new root (rest[0]) at depth 0
    st = _Store(*(torch.from_numpy(b) for b in bufs), r)
    return DraftTree._on_store(st, r, props)


def merge_trees(tree: DraftTree, extra: DraftTree) -> tuple[DraftTree, int]:
    """Merge ``extra`` (same root token) into ``tree`` by (parent, token).

    Existing node indices never change; nodes of ``extra`` that are new are appended in ``extra``'s
    order (ancestors first), so the result keeps ``parents[i] < i``. Returns ``(merged, n_appended)``.

    Proposals (sampled drafts, see :class:`DraftTree`): when either tree has them, every proposal of
    ``extra`` is appended, mapped, after the existing proposals of its parent, *also when its token hit an
    existing node* (a drawn token is never dropped because of its value); existing lists keep their order.
    """
    if int(extra.tokens[0]) != int(tree.tokens[0]):
        raise ValueError("merge needs trees with the same root token")
    index = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}
    mapped = {0: 0}
    tokens, parents, scores = [], [], []
    n = len(tree)
    for j in range(1, len(extra)):
        p = mapped[int(extra.parents[j])]
        t = int(extra.tokens[j])
        hit = index.get((p, t))
        if hit is None:
            hit = n + len(tokens)
            index[(p, t)] = hit
            tokens.append(t)
            parents.append(p)
            scores.append(float(extra.scores[j]))
        mapped[j] = hit
    props = None
    if tree.proposals is not None or extra.proposals is not None:
        props = [list(l) for l in proposal_lists(tree)] + [[] for _ in tokens]
        for u, lst in enumerate(proposal_lists(extra)):
            props[mapped[u]] += [(mapped[c], q) for c, q in lst]
    if not tokens:
        if props is None:
            return tree, 0
        return DraftTree(tree.tokens, tree.parents, tree.scores, tree.depths, proposals=props), 0
    if props is None:                # deterministic trees: the new nodes appended into the tree's buffers
        par = torch.tensor(parents, device=HOST)
        return tree.append(torch.tensor(tokens, device=HOST), par, torch.tensor(scores, device=HOST),
                           depths_from_parents(par, tree.depths)), len(tokens)
    merged = DraftTree(torch.cat([tree.tokens, torch.tensor(tokens, device=HOST)]),
                       torch.cat([tree.parents, torch.tensor(parents, device=HOST)]),
                       torch.cat([tree.scores, torch.tensor(scores, device=HOST)]), proposals=props)
    return merged, len(tokens)


# -- a stage's view of the tree: node ids and decisions (the asynchronous protocol) ---------------------------
#
# Rank 0 numbers tree nodes with node ids (gids) in the order it sends them; a stage caches the nodes it has
# computed in arrival order, so ``slot_gids[j]`` (the id at tree slot ``j`` of its KV cache) is increasing. A
# decision names the accepted path and the surviving root by id, so a stage can apply it whatever it has
# computed so far, and rows that arrive later are judged by their parent alone (:func:`admit_rows`).
#
# Why a parent test suffices (the protocol's invariant): rank 0 kills a node only in a decision issued after
# verifying a result, and every stage computed that result's nodes before rank 0 received it. So when a stage
# applies decision ``s``: (a) the accepted path is already cached; (b) a node is alive after ``s`` iff it is
# the surviving root or descends from it, and since the surviving root's parent is on the accepted path, a
# row arriving later is alive iff it is the pending root, its parent is an alive cached node or an alive
# earlier row, or its parent is ``-1`` (a fresh root: rank 0 sends one only with every decision it depends
# on already in the log of that or an earlier segment).

def decision_keep(slot_gids: list[int], anc: Tensor, path: list[int], root: int) -> tuple[Tensor, int, int]:
    """Keep-list (tree slots, strictly increasing) of a decision on a stage's cached tree.

    ``slot_gids``: node id per cached tree slot; ``anc``: the cache's ancestor matrix over those slots;
    ``path``: accepted node ids (root first, all cached: raises otherwise); ``root``: surviving root id or -1.
    Returns ``(keep, accepted_len, pending_root)``: ``keep[:accepted_len]`` are the path's slots (they become
    context), then the cached subtree of ``root``; ``pending_root`` is ``root`` when it is not cached yet
    (it will arrive later and must be admitted), else -1.
    """
    slot_of = {g: j for j, g in enumerate(slot_gids)}
    try:
        keep = [slot_of[g] for g in path]
    except KeyError:
        raise RuntimeError("accepted path is not fully cached on this stage") from None
    pending = -1
    if root >= 0:
        r = slot_of.get(root)
        if r is None:
            pending = root
        else:
            keep += anc[:, r].nonzero().flatten().tolist()
    out = torch.tensor(keep, dtype=torch.long, device=HOST)
    if len(keep) > 1 and not bool((out[1:] > out[:-1]).all()):
        raise AssertionError("keep-list must be strictly increasing")
    return out, len(path), pending


def admit_rows(parents: Tensor, gids: Tensor, slot_gids: list[int], pending_root: int) -> tuple[Tensor, Tensor, int]:
    """Which rows of an arriving segment are alive, and their parents as tree slots (-1 = the context).

    New rows take slots ``len(slot_gids), ...`` in order. Returns ``(row_mask, parent_slots, pending_root)``
    (``pending_root`` becomes -1 once the pending root is admitted). See the section comment for the rule.
    """
    slot_of = {g: j for j, g in enumerate(slot_gids)}
    nxt = len(slot_gids)
    rows, par = [], []
    for p, g in zip(parents.tolist(), gids.tolist()):
        if g == pending_root:
            slot_p, pending_root = -1, -1
        elif p < 0:
            slot_p = -1
        else:
            slot_p = slot_of.get(p)
        alive = slot_p is not None
        rows.append(alive)
        if alive:
            par.append(slot_p)
            slot_of[g] = nxt
            nxt += 1
    return (torch.tensor(rows, dtype=torch.bool, device=HOST), torch.tensor(par, dtype=torch.long, device=HOST),
            pending_root)


def proposal_lists(tree: DraftTree) -> list:
    """``tree.proposals``, or for a deterministic tree the equivalent lists: each node's children in index
    order, each with ``q = None``."""
    if tree.proposals is not None:
        return tree.proposals
    out: list = [[] for _ in range(len(tree))]
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0:
            out[p].append((i, None))
    return out


def merge_sources(trees: list[DraftTree], total_token: int) -> DraftTree:
    """Several drafters' trees (same root token) as one tree of at most ``total_token`` nodes (root included).

    Nodes are identified by their token path (merged by (parent, token)). Which nodes survive:
      * every node that carries a *sampled* proposal survives, with all its sampled proposals: they were
        drawn at random, and keeping or dropping one by its value would bias the verifier
        (``walk_proposals`` needs each drawn token to be a fresh draw from its q). Their number is fixed by
        the sampling shape, so they take a value-independent share of the budget: ``total_token - 1`` minus
        the *number of sampled proposals* (not of distinct nodes) is left for deterministic nodes;
      * deterministic nodes compete for the rest by their **best deterministic score**: the maximum over
        the sources that proposed the node of that source's cumulative draft log-score (EAGLE/SSM
        log-probabilities, lookup's match score). Within one source a child never scores above its
        parent, so the maximum keeps that property and the best-``n`` set (ties by union order, ancestors
        first) is ancestor-closed. A node kept only as sampled keeps no deterministic proposal.
    The output is ordered by best score over all sources (ties: union order), which keeps parents before
    children; ``scores`` hold that best score. Sibling tokens stay distinct. ``proposals`` is ``None`` when
    no source sampled (a plain deterministic tree, verified by ``walk_tree`` as before); otherwise each
    node's list holds the surviving proposals, sources in the given order, each source's own order kept.
    """
    if not trees:
        raise ValueError("merge_sources needs at least one tree")
    firsts = [t.tokens.tolist()[0] for t in trees]            # host reads, no operator (issue 41)
    root = firsts[0]
    if any(f != root for f in firsts):
        raise ValueError("merge needs trees with the same root token")
    live = [t for t in trees if len(t) > 1]
    if len(live) <= 1 and all(t.proposals is None for t in trees):
        # One source proposed anything (say lookup found no match): the rule below keeps that tree as it is
        # when it fits the budget and its scores never rise with the index (a top_nodes_tree tree).
        t = live[0] if live else trees[0]
        if len(t) <= total_token and (len(t) < 3 or bool((t.scores[2:] <= t.scores[1:-1]).all())):
            scores = t.scores.clone()
            scores[0] = 0.0
            return DraftTree(t.tokens, t.parents, scores, t.depths)
    nodes, parents, best_det, sampled, maps, n_sampled = _union(trees, root)
    n = len(nodes)
    budget = max(0, total_token - 1 - n_sampled)
    ninf = float("-inf")
    det_order = sorted((u for u in range(1, n) if best_det[u] > ninf), key=lambda u: (-best_det[u], u))
    if all(t.proposals is None for t in trees):
        # every non-root node is exactly one deterministic proposal of its parent: a node's best deterministic score
        # IS its best score (the same max over the same values), nothing is sampled, and the kept nodes sorted by
        # (-best, index) are det_order's first ``budget`` already (the general tail below would sort them again)
        return _merged_tree(nodes, parents, [0] + det_order[:budget], None)
    det_kept = set(det_order[:budget])
    kept = [u for u in range(1, n) if sampled[u] or u in det_kept]
    order = [0] + sorted(kept, key=lambda u: (-nodes[u][1], u))
    out_props = None
    if n_sampled:
        props: list[list] = [[] for _ in range(n)]   # per union node: (child, q), sources in order, each's order kept
        for tree, mapped in zip(trees, maps):
            for j, lst in enumerate(proposal_lists(tree)):
                props[mapped[j]] += [(mapped[c], q) for c, q in lst]
        new = {u: i for i, u in enumerate(order)}
        out_props = [[(new[c], q) for c, q in props[u]
                      if c in new and (q is not None or c in det_kept)] for u in order]
    return _merged_tree(nodes, parents, order, out_props)


def _union(trees: list[DraftTree], root: int) -> tuple[list, list, list, list, list, int]:
    """:func:`merge_sources`' union of the trees by token path, in one pass per tree (issue 41: the round start's host
    time; one implementation for deterministic and sampled trees): the union nodes ``(token, best score over all
    sources)``, their union parents, each node's best *deterministic* score (``-inf``: none), whether it carries a
    sampled proposal, each tree's node -> union node map, and the number of sampled proposals. In a tree without
    proposal lists every non-root node is one deterministic proposal of its parent (:func:`proposal_lists`), so its
    score enters the node's best deterministic score in the same pass; a tree with lists contributes through them.
    ``max`` keeps the first of equal scores (the same value either way)."""
    ninf = float("-inf")
    index: dict[tuple[int, int], int] = {}
    nodes, parents, best_det, sampled = [(root, 0.0)], [-1], [0.0], [False]
    maps, n_sampled = [], 0
    for tree in trees:
        det = tree.proposals is None
        tp, tt, ts = tree.parents.tolist(), tree.tokens.tolist(), tree.scores.tolist()
        mapped = [0] * len(tt)
        for j in range(1, len(tt)):
            key = (mapped[tp[j]], tt[j])
            u = index.get(key)
            if u is None:
                u = index[key] = len(nodes)
                nodes.append((tt[j], ts[j]))
                parents.append(key[0])
                best_det.append(ts[j] if det else ninf)
                sampled.append(False)
            else:
                if ts[j] > nodes[u][1]:
                    nodes[u] = (tt[j], ts[j])
                if det and ts[j] > best_det[u]:
                    best_det[u] = ts[j]
            mapped[j] = u
        maps.append(mapped)
        if not det:
            for lst in tree.proposals:
                for c, q in lst:
                    u = mapped[c]
                    if q is None:
                        if ts[c] > best_det[u]:
                            best_det[u] = ts[c]
                    else:
                        sampled[u] = True
                        n_sampled += 1
    return nodes, parents, best_det, sampled, maps, n_sampled


def _merged_tree(nodes: list, parents: list, order: list, proposals: list | None) -> DraftTree:
    """The merged tree of union ``nodes`` ``(token, best score)`` with union ``parents``, kept in ``order`` (root
    first, ancestor-closed: raises otherwise), depths in one pass (ancestors first)."""
    new = {u: i for i, u in enumerate(order)}
    out_parents = [-1] + [new[parents[u]] for u in order[1:]]
    if any(p >= i for i, p in enumerate(out_parents) if i):
        raise AssertionError("merged selection is not ancestor-closed")  # impossible by construction
    out_depths = [0] * len(order)                                # ancestors first: one pass (no recomputation)
    for i in range(1, len(order)):
        out_depths[i] = out_depths[out_parents[i]] + 1
    # NumPy arrays in the tree's dtypes (a Python float rounds to float32 as torch.tensor's default dtype does)
    return DraftTree.of_arrays(tuple(torch.from_numpy(np.array(x, dtype=d)) for x, d in (
        ([nodes[u][0] for u in order], np.int64), (out_parents, np.int64), ([nodes[u][1] for u in order], np.float32),
        (out_depths, np.int64))), proposals)
