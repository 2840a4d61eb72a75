"""Preallocated per-stage KV cache with tree segments and keep-list compaction.

Slot layout, the invariant every operation preserves::

    [ committed context (context_len slots) | tree nodes 0..m-1 in tree-index order ]   length = context_len + m

Tree node ``j`` lives at slot ``context_len + j``. The cache also holds the tree's ancestor matrix and
depths, so a stage derives masks and positions for a new segment from its parent pointers alone. Both live in
host buffers preallocated at a capacity that doubles when a tree outgrows it, filled in place (issue 41: a
drafted level below cached nodes costs a fixed dozen operators, no concatenation); invariant: for every cached
tree node ``i``, row ``i`` of the ancestor buffer is its ancestor-or-self row over *all* columns (zero beyond
column ``i``), so a new node's row is its parent's row plus its own bit.

The buffers are torch tensors with NumPy views of the same memory (``_anc_np``, ``_dep_np``). A level below
cached nodes (:meth:`KVCache.staged_tree_inputs`, every drafted level and most stage segments) is staged in NumPy:
a parent-row gather, the diagonal, the depths, the additive mask and the positions are a handful of host
integers and booleans, which NumPy handles in about a microsecond per call where each torch operator costs a
dispatch (issue 41; docs/results.md §58: 19 -> 2 dispatched operators per
drafted level). The mask and positions come back as fresh host tensors over NumPy arrays (``torch.from_numpy``):
the same values, dtypes and shapes as before; a dtype NumPy lacks (bfloat16) builds its mask with torch ops.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from model.devices import HOST

Tensor = torch.Tensor


def compact_slots(buf: Tensor, start: int, keep: Tensor) -> None:
    """In place: move slots ``start + keep[i]`` to ``start + i`` along dim 3 of ``buf``.

    ``keep`` must be strictly increasing, so destinations never overtake sources.
    """
    if keep.numel() == 0:
        return
    src = keep.to(buf.device) + start
    buf[:, :, :, start:start + keep.numel()] = buf.index_select(3, src)


class KVCache:
    """Keys/values for ``num_layers`` layers, batch 1: ``[layers, 1, kv_heads, max_len, head_dim]``.

    Implements the one method transformers' attention modules call (``update``) so that the family's
    own decoder layers run on it.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, 1, kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._set_buffers(torch.zeros(0, 0, dtype=torch.bool, device=HOST),   # ancestor rows, [cap, cap] (module doc)
                          torch.zeros(0, dtype=torch.long, device=HOST))       # depths, [cap]
        self._staged = None                                             # tree_inputs' (anc, depth) views
        self.reset()

    # -- state -------------------------------------------------------------------------------
    def reset(self) -> None:
        self.context_len = 0
        self.length = 0
        self._pending = 0

    @property
    def tree_anc(self) -> Tensor:
        """The cached tree's ancestor matrix ``[m, m]`` (a view of the buffer: read, do not keep across updates)."""
        m = self.num_tree
        return self._anc[:m, :m]

    @property
    def tree_depth(self) -> Tensor:
        """The cached tree's depths ``[m]`` (a view of the buffer)."""
        return self._dep[:self.num_tree]

    def _reserve(self, total: int) -> None:
        """Room for ``total`` tree nodes in the ancestry buffers (capacity doubles; cached rows are kept)."""
        cap = self._dep.numel()
        if total <= cap:
            return
        new = max(total, 2 * cap, 64)
        m = self.num_tree
        anc = torch.zeros(new, new, dtype=torch.bool, device=HOST)
        dep = torch.zeros(new, dtype=torch.long, device=HOST)
        anc[:m, :cap] = self._anc[:m]
        dep[:m] = self._dep[:m]
        self._set_buffers(anc, dep)

    def _set_buffers(self, anc: Tensor, dep: Tensor) -> None:
        """The ancestry and depth buffers, and their NumPy views (the same memory: module docstring)."""
        self._anc, self._dep = anc, dep
        self._anc_np, self._dep_np = anc.numpy(), dep.numpy()

    @property
    def num_tree(self) -> int:
        return self.length - self.context_len

    # -- transformers Cache protocol -----------------------------------------------------------
    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        n = key.shape[-2]
        end = self.length + n
        self.keys[layer_idx, :, :, self.length:end] = key
        self.values[layer_idx, :, :, self.length:end] = value
        return self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # -- inputs for a forward -------------------------------------------------------------------
    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise RuntimeError(f"KV cache full: {self.length} + {n} > {self.max_len} slots "
                               "(raise max_seq_len or shorten the prompt)")

    def context_inputs(self, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Positions and additive mask for ``n`` committed tokens (causal). Requires no tree nodes.

        Up to ``CAUSAL_ROWS`` rows (a commit of accepted tokens, an ``ar`` step) both are **views** of tables
        shared by every cache of this ``max_len`` and dtype (:func:`_causal_tables`): read them, never write into
        them (nothing in the project does: a forward only reads its mask and positions). Why (issue 41, the
        commit's host time; docs/results.md §62): no allocation and
        no NumPy per commit, 3 slicing operators; the commit with its head forward measured 30-60 us faster than
        with the per-call NumPy mask and positions (where inside torch the gain arises is not isolated). Longer
        chunks (a prompt) build fresh tensors as before."""
        if self.num_tree:
            raise RuntimeError("context tokens can only be appended when no tree nodes are cached")
        self._check_room(n)
        c = self.length
        if n <= CAUSAL_ROWS:                              # a commit / an ar step: views of shared tables
            pos, rows = _causal_tables(self.max_len, dtype)
            return pos[:, c:c + n], rows[n][..., self.max_len - c:self.max_len + n]
        # row i sees slots j <= length + i: 0 there, the dtype's lowest above (the additive form of the tril'd
        # allowed matrix, bitwise; issue 41: 5 operators instead of 9 per commit, 2 in NumPy)
        pos = torch.from_numpy(np.arange(c, c + n, dtype=np.int64).reshape(1, n))
        npd = _NUMPY_DTYPES.get(dtype)
        if npd is None:                                   # no NumPy twin of the dtype (bfloat16): torch ops
            mask = torch.full((n, c + n), torch.finfo(dtype).min, dtype=dtype, device=HOST)
            return pos, mask.triu_(c + 1).view(1, 1, n, c + n)
        above = np.arange(c + n) > np.arange(c, c + n)[:, None]                # slot j > length + i: masked
        return pos, torch.from_numpy(np.where(above, npd(np.finfo(npd).min), npd(0)).reshape(1, 1, n, c + n))

    def tree_inputs(self, parents: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Positions, additive mask and the extended ancestor matrix/depths for a tree segment.

        ``parents`` holds tree indices (``-1`` = the root, attached to the context). The new rows see
        the whole context plus their tree ancestors and themselves, never other nodes, whatever the
        segment length (a one-node segment is masked like any other).
        """
        pos, mask = self.staged_tree_inputs(parents, dtype)
        m = self.num_tree + len(parents)
        self._staged = (self._anc[:m, :m], self._dep[:m])
        return pos, mask, *self._staged

    def staged_tree_inputs(self, parents: Tensor | np.ndarray, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """:meth:`tree_inputs` without the extended ancestor matrix and depths: the new rows are staged in the
        cache's buffers and :meth:`commit_forward` (``anc=None``) takes them (a drafted level: fewer operators).
        ``parents`` may be a host NumPy integer array (the drafter's beam keeps its slots in NumPy: no conversion).
        Staged and masked in NumPy (module docstring): two dispatched operators (the returned tensors) for a level
        below cached nodes."""
        n = len(parents)
        self._check_room(n)
        m, c = self.num_tree, self.context_len
        if isinstance(parents, np.ndarray):
            par = parents.astype(np.int64, copy=False).reshape(-1)
        else:
            par = parents.to(torch.long).to(HOST)
            par = (par if par.dim() == 1 else par.reshape(-1)).numpy()
        self._stage_rows(par, m)
        rows = self._anc_np[m:m + n, :m + n]
        npd = _NUMPY_DTYPES.get(dtype)
        pos = torch.from_numpy((self._dep_np[m:m + n] + c).reshape(1, n))
        if npd is None:                                   # no NumPy twin of the dtype (bfloat16): torch ops
            mask = torch.zeros((n, c + m + n), dtype=dtype, device=HOST)       # the context: visible to all
            mask[:, c:].masked_fill_(~torch.from_numpy(rows), torch.finfo(dtype).min)
            return pos, mask.view(1, 1, n, c + m + n)
        mask = np.zeros((1, 1, n, c + m + n), dtype=npd)                       # the context: visible to all
        np.copyto(mask[0, 0, :, c:], _NUMPY_MIN[npd], where=~rows)             # torch.finfo(dtype).min, bitwise
        return pos, torch.from_numpy(mask)

    def _stage_rows(self, par: np.ndarray, m: int) -> None:
        """Write the ancestor rows and depths of new nodes ``m..m+n-1`` (``par``: their parents, a NumPy int64 array)
        into the buffers (rows past the cached tree: scratch until :meth:`commit_forward`).
        One level below cached nodes (every parent cached, or every one ``-1``): a parent row gather, the diagonal
        and the depths, in NumPy on the buffers' views; otherwise :func:`extend_ancestry` (which validates the
        parents) or, for a few linked nodes, :func:`_stage_rows_loop`."""
        n = par.size
        self._reserve(m + n)
        anc, dep = self._anc_np, self._dep_np
        if n > SMALL_TREE:
            lo, hi = int(par.min()), int(par.max())
        else:                                             # a level: two Python reductions beat two NumPy ones
            pl = par.tolist()
            lo, hi = (min(pl), max(pl)) if n else (0, -1)
        if n and ((0 <= lo and hi < m) or lo == hi == -1):
            if lo >= 0:
                anc[m:m + n] = anc[par]                   # the parents' whole rows: zero beyond their own column
                np.add(dep[par], 1, out=dep[m:m + n])
            else:                                         # n roots below the context
                anc[m:m + n] = False
                dep[m:m + n] = 0
            new = np.arange(m, m + n)
            anc[new, new] = True                          # each new node is its own
        elif n <= SMALL_TREE:                             # a few linked nodes (a stage's segment): one list pass
            _stage_rows_loop(pl, m, anc, dep)
        else:                                             # many linked nodes (a re-fed tree): pointer jumping
            _stage_rows_jump(par, m, anc, dep)

    def commit_forward(self, n: int, as_context: bool, anc: Tensor | None = None,
                       depth: Tensor | None = None) -> None:
        """Advance after the layers wrote ``n`` rows. Tree rows: ``anc``/``depth`` as :meth:`tree_inputs` returned them
        (or None after :meth:`staged_tree_inputs`: the staged rows); other matrices are written into the buffers."""
        m = self.num_tree
        if not as_context and anc is not None and (self._staged is None or anc is not self._staged[0]):
            self._reserve(m + n)                          # not what tree_inputs staged: write it in
            self._anc[m:m + n] = False
            self._anc[m:m + n, :m + n] = anc[m:m + n, :m + n]
            self._dep[m:m + n] = depth[m:m + n]
        self._staged = None
        self.length += n
        if as_context:
            self.context_len = self.length

    # -- pruning -------------------------------------------------------------------------------
    def apply_keep(self, keep: Tensor, accepted_len: int) -> None:
        """Apply a decision's keep-list (tree indices, strictly increasing) to the cached tree.

        Cached kept nodes are compacted to the front of the tree area; the first ``accepted_len``
        of them (the accepted path) become committed context without recomputation. Kept indices
        beyond the cached nodes belong to segments this stage has not computed yet and are ignored.
        """
        self._staged = None
        if keep.numel() == 0:                             # drop the whole tree: nothing to move
            if accepted_len:
                raise RuntimeError("accepted path is not fully cached on this stage")
            self.length = self.context_len
            return
        m = self.num_tree
        cached = keep[keep < m]
        if accepted_len > cached.numel():
            raise RuntimeError("accepted path is not fully cached on this stage")
        compact_slots(self.keys, self.context_len, cached)
        compact_slots(self.values, self.context_len, cached)
        rest = cached[accepted_len:]
        r = rest.numel()
        if r:
            sub = self._anc[rest][:, rest]
            self._anc[:r] = False                         # rows stay zero beyond their own column
            self._anc[:r, :r] = sub
            self._dep[:r] = self._dep[rest] - accepted_len
        self.context_len += accepted_len
        self.length = self.context_len + r

    def copy_prefix_to(self, other: "KVCache", n: int) -> None:
        """Make ``other`` hold exactly this cache's first ``n`` committed slots (the prompt's prefill shared by
        another lane: :class:`pipeline.messages.Fork`): every layer's keys and values of slots ``[0, n)`` copied,
        ``other``'s context length ``n``, no tree nodes. This cache is only read.

        Invariants: ``n <= context_len`` (committed rows only: tree rows are speculative and their slots move under
        compaction; ``ValueError`` otherwise); ``other`` has the same layers, heads, head size and dtype and room for
        ``n`` slots; afterwards ``other`` equals, bit for bit over its ``n`` slots, a cache that computed those rows
        itself with the same forwards (the copy moves the very values those forwards wrote), and slots ``>= n`` of
        ``other`` are never read before being written (every read is bounded by ``length``)."""
        if not 0 <= n <= self.context_len:
            raise ValueError(f"copy_prefix_to: {n} slots asked for, {self.context_len} committed")
        if other is self:
            raise ValueError("copy_prefix_to: a cache cannot be its own copy")
        if other.keys.shape[:3] != self.keys.shape[:3] or other.keys.shape[4] != self.keys.shape[4] \
                or other.keys.dtype != self.keys.dtype or n > other.max_len:
            raise ValueError("copy_prefix_to: caches of different shapes")
        other.reset()
        other._staged = None
        other.keys[:, :, :, :n] = self.keys[:, :, :, :n]
        other.values[:, :, :, :n] = self.values[:, :, :, :n]
        other.length = other.context_len = n

    def truncate_tree(self) -> None:
        """Drop every cached tree node (keep the committed context): :meth:`apply_keep` of an empty keep-list,
        without building one (nothing moves)."""
        self._staged = None
        self.length = self.context_len


def extend_ancestry(parents: Tensor, base_anc: Tensor | None = None,
                    base_depth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Ancestor matrix (``A[i, j]``: ``j`` is ``i`` or an ancestor of ``i``) and depths of a tree of ``m`` nodes
    (``base_anc`` ``[m, m]``, ``base_depth`` ``[m]``; None: ``m = 0``) extended by ``n`` new nodes ``m..m+n-1``
    with ``parents`` (``-1``: a root, depth 0; else an earlier node, cached or new). Returns the ``[m+n, m+n]``
    matrix and the ``m+n`` depths (a base left out counts as zeros: pass the one whose result you read).

    Vectorised by pointer jumping (list ranking) over the new nodes' links to new parents: a new row starts as
    itself plus, when its parent is cached, the parent's cached row; each round ORs in the row of the node its
    link points to and doubles the link, so ``ceil(log2(longest new chain))`` rounds of a few host tensor ops
    finish it (none when every parent is cached, as for one drafted level); up to ``SMALL_TREE`` new nodes a
    Python loop over lists does it (:func:`_extend_ancestry_loop`). Raises ``ValueError`` for a parent that is
    not an earlier node."""
    par = parents.to(torch.long).reshape(-1).to(HOST)
    n = par.numel()
    m = int(base_depth.numel()) if base_depth is not None else (0 if base_anc is None else int(base_anc.shape[0]))
    if n == 0:
        return (base_anc if base_anc is not None else torch.zeros(m, m, dtype=torch.bool, device=HOST),
                base_depth if base_depth is not None else torch.zeros(m, dtype=torch.long, device=HOST))
    linked = par >= m                                        # a parent among the new nodes (or a bad one)
    if not bool(linked.any()):                   # one drafted level: every parent cached or -1
        anc = torch.zeros(m + n, m + n, dtype=torch.bool, device=HOST)
        anc[m:, m:].fill_diagonal_(True)
        if m == 0:                               # n roots
            return anc, torch.zeros(n, dtype=torch.long, device=HOST)
        cached = par >= 0
        pc = par.clamp(min=0)
        if base_anc is not None:
            anc[:m, :m] = base_anc
            anc[m:, :m] = base_anc[pc] & cached[:, None]
        base = base_depth if base_depth is not None else torch.zeros(m, dtype=torch.long, device=HOST)
        return anc, torch.cat([base, torch.where(cached, base[pc] + 1, 0)])
    if n <= SMALL_TREE:
        return _extend_ancestry_loop(par, m, base_anc, base_depth)
    rows, val = (torch.from_numpy(x) for x in _pointer_jump(
        par.numpy(), m, None if base_anc is None else base_anc.numpy(),
        None if base_depth is None else base_depth.to(torch.long).numpy()))
    if m == 0:
        return rows, val
    anc = torch.zeros(m + n, m + n, dtype=torch.bool, device=HOST)
    if base_anc is not None:
        anc[:m, :m] = base_anc
    anc[m:] = rows
    return anc, torch.cat([torch.zeros(m, dtype=torch.long, device=HOST) if base_depth is None else base_depth, val])


CAUSAL_ROWS = 32   # context_inputs: up to this many rows, views of the shared causal tables


@functools.lru_cache(maxsize=16)
def _causal_tables(max_len: int, dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
    """The shared read-only tables of :meth:`KVCache.context_inputs` for caches of ``max_len`` slots: positions
    ``P = arange(max_len)[None]`` and the additive mask ``M [1, 1, CAUSAL_ROWS, max_len + CAUSAL_ROWS]`` with
    ``M[i, j] = finfo(dtype).min`` iff ``j > max_len + i`` (``full(min).triu_(max_len + 1)``), else 0, as its
    first-``n``-rows views ``rows[n] = M[:, :, :n]`` (``n = 0 .. CAUSAL_ROWS``: a call slices columns only).
    Invariant (why a view is the commit's mask): for ``n <= CAUSAL_ROWS`` rows after ``c`` cached slots,
    ``M[:n, max_len - c:max_len + n][i, j] = M[i, j + max_len - c]`` is ``min`` iff ``j > c + i``: exactly
    ``full((n, c + n), min).triu_(c + 1)``, bitwise (the same constant, the same zeros); and
    ``P[:, c:c + n] = [[c, ..., c + n - 1]]``. ``tests/test_level_ops.py`` checks both against that
    construction in every dtype. Host tensors (as the masks built per call were)."""
    pos = torch.arange(max_len, device=HOST)[None]
    mask = torch.full((CAUSAL_ROWS, max_len + CAUSAL_ROWS), torch.finfo(dtype).min, dtype=dtype, device=HOST)
    mask = mask.triu_(max_len + 1)[None, None]
    return pos, [mask[:, :, :n] for n in range(CAUSAL_ROWS + 1)]


# torch dtype -> NumPy dtype of the additive masks staged_tree_inputs builds in NumPy (finfo(min) equal bitwise)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
# each NumPy twin's lowest value (torch.finfo(dtype).min, bitwise), looked up once: np.finfo is a Python-level call
_NUMPY_MIN = {npd: npd(np.finfo(npd).min) for npd in _NUMPY_DTYPES.values()}

SMALL_TREE = 32   # up to this many linked new nodes a per-row Python loop beats pointer jumping on a CPU (measured)


def _chain_rows(pl: list[int], m: int, base: list[int]) -> tuple[list[int], list[int], list[list[bool]]]:
    """The small-tree rule shared by :func:`_extend_ancestry_loop` and :func:`_stage_rows_loop`: for new nodes
    ``m..m+n-1`` with parents ``pl`` (earlier nodes; ``-1`` none) and the cached nodes' depths ``base``, each new
    node's first cached ancestor (``anchor``, -1 none), its depth, and the new-by-new ancestry block (row ``i``:
    node ``m+i``'s new ancestors, itself included). One pass over Python lists."""
    n = len(pl)
    anchor, new_depth = [0] * n, [0] * n
    block = [[False] * n for _ in range(n)]
    for i, p in enumerate(pl):
        row = block[i]
        if p < 0:
            anchor[i] = -1
        elif p < m:
            anchor[i], new_depth[i] = p, base[p] + 1
        elif p < m + i:
            j = p - m
            anchor[i], new_depth[i] = anchor[j], new_depth[j] + 1
            row[:i] = block[j][:i]
        else:
            raise ValueError(f"parent {p} of node {m + i} is not an earlier node")
        row[i] = True
    return anchor, new_depth, block


def _extend_ancestry_loop(par: Tensor, m: int, base_anc: Tensor | None, base_depth: Tensor | None
                          ) -> tuple[Tensor, Tensor]:
    """:func:`extend_ancestry` for a few new nodes some of whose parents are new: one pass over Python lists
    (each new row is its chain's first cached ancestor's row, gathered at once, plus a small new-by-new block);
    few operators, and on a CPU cheaper than the rounds of pointer jumping below ``SMALL_TREE`` rows."""
    pl = par.tolist()
    n = len(pl)
    base = base_depth.tolist() if (m and base_depth is not None) else [0] * m
    anchor, new_depth, block = _chain_rows(pl, m, base)
    anc = torch.zeros(m + n, m + n, dtype=torch.bool, device=HOST)
    if m and base_anc is not None:
        anc[:m, :m] = base_anc
        if any(a >= 0 for a in anchor):
            rows = base_anc.index_select(0, torch.tensor([max(a, 0) for a in anchor], dtype=torch.long,
                                                         device=HOST))
            if min(anchor) < 0:
                rows[torch.tensor([a < 0 for a in anchor], device=HOST)] = False
            anc[m:, :m] = rows
    anc[m:, m:] = torch.tensor(block, dtype=torch.bool, device=HOST)
    return anc, torch.tensor(base + new_depth, dtype=torch.long, device=HOST)


def _stage_rows_loop(pl: list[int], m: int, anc: np.ndarray, dep: np.ndarray) -> None:
    """:meth:`KVCache._stage_rows` for up to ``SMALL_TREE`` new nodes with linked parents, written in place into the
    buffers' NumPy views ``anc``/``dep`` (rows ``m..m+n-1``): the rule of :func:`_extend_ancestry_loop` (each new row
    is its chain's first cached ancestor's row plus a small new-by-new block), one pass over Python lists."""
    n = len(pl)
    base = dep[:m].tolist() if m else []
    anchor, new_depth, block = _chain_rows(pl, m, base)
    rows = anc[m:m + n]
    if m and any(a >= 0 for a in anchor):
        rows[:] = anc[[max(a, 0) for a in anchor]]
        if min(anchor) < 0:
            rows[np.array([a < 0 for a in anchor])] = False
    else:
        rows[:] = False
    rows[:, m:m + n] = block
    dep[m:m + n] = new_depth


def _pointer_jump(par: np.ndarray, m: int, base_anc: np.ndarray | None,
                  base_depth: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The pointer jumping (list ranking) of :func:`extend_ancestry`, in NumPy: for ``n`` new nodes ``m..m+n-1``
    with parents ``par`` (int64; ``-1`` a root, else an earlier node), their ancestor rows ``[n, m+n]`` and depths
    ``[n]``. A new row starts as itself plus, when its parent is cached, that parent's row of ``base_anc``; each
    round ORs in the row its link (a new parent) points to and doubles the link: ``ceil(log2(longest new chain))``
    rounds. Depths: ancestors on the path (``base_depth`` None), else the new ancestors plus the depth below the
    cached node the chain's topmost new node enters. Raises ``ValueError`` for a parent that is not an earlier
    node. The one home of the rule: :func:`extend_ancestry` (torch in, torch out) and the KV cache's staging
    (:func:`_stage_rows_jump`, on its buffers' views) both call it."""
    n = par.size
    idx = np.arange(n)
    bad = np.flatnonzero(par >= idx + m)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"parent {int(par[i])} of node {m + i} is not an earlier node")
    linked = par >= m
    rows = np.zeros((n + 1, m + n), dtype=bool)       # row n: the zero sentinel "no new parent" points to
    rows[idx, m + idx] = True
    if m and base_anc is not None:
        cached = (par >= 0) & ~linked
        rows[:n, :m] = base_anc[np.clip(par, 0, m - 1), :m] & cached[:, None]
    ext = np.append(np.where(linked, par - m, n), n)
    while ext.min() < n:                              # ceil(log2(longest new chain)) rounds
        rows |= rows[ext]
        ext = ext[ext]
    rows = rows[:n]
    if base_depth is None:
        return rows, rows.sum(1, dtype=np.int64) - 1
    new = rows[:, m:]
    val = new.sum(1, dtype=np.int64) - 1              # new ancestors above each node
    if m:                                             # the chain's topmost new node enters a cached one (or -1)
        top = par[new.argmax(1)]
        val += np.where(top >= 0, base_depth[np.clip(top, 0, m - 1)] + 1, 0)
    return rows, val


def _stage_rows_jump(par: np.ndarray, m: int, anc: np.ndarray, dep: np.ndarray) -> None:
    """:meth:`KVCache._stage_rows` for more than ``SMALL_TREE`` new nodes some of whose parents are new (a re-fed
    tree): :func:`_pointer_jump` on the buffers' views, written into rows ``m..m+n-1`` (issue 41: about 50
    dispatched operators as torch ops, none here)."""
    n = par.size
    rows, val = _pointer_jump(par, m, anc, dep[:m])
    anc[m:m + n] = False
    anc[m:m + n, :m + n] = rows
    dep[m:m + n] = val
