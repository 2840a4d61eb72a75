"""Preallocated per-stage KV cache with tree segments and keep-list compaction.

Slot layout, the invariant every operation preserves::

    [ committed context (context_len slots) | tree nodes 0..m-1 in tree-index order ]   length = context_len + m

Tree node ``j`` lives at slot ``context_len + j``. The cache also holds the tree's ancestor matrix and
depths, so a stage derives masks and positions for a new segment from its parent pointers alone.
"""
from __future__ import annotations

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
        self.reset()

    # -- state -------------------------------------------------------------------------------
    def reset(self) -> None:
        self.context_len = 0
        self.length = 0
        self._pending = 0
        self.tree_anc = torch.zeros(0, 0, dtype=torch.bool, device=HOST)
        self.tree_depth = torch.zeros(0, dtype=torch.long, device=HOST)

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
        """Positions and additive mask for ``n`` committed tokens (causal). Requires no tree nodes."""
        if self.num_tree:
            raise RuntimeError("context tokens can only be appended when no tree nodes are cached")
        self._check_room(n)
        pos = torch.arange(self.length, self.length + n, device=HOST)
        allowed = torch.ones(n, self.length + n, dtype=torch.bool, device=HOST).tril(self.length)
        return pos[None], _additive(allowed, dtype)

    def tree_inputs(self, parents: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Positions, additive mask and the extended ancestor matrix/depths for a tree segment.

        ``parents`` holds tree indices (``-1`` = the root, attached to the context). The new rows see
        the whole context plus their tree ancestors and themselves, never other nodes, whatever the
        segment length (a one-node segment is masked like any other).
        """
        n = len(parents)
        self._check_room(n)
        anc, depth = self.extend_tree(parents)
        m, c = self.num_tree, self.context_len
        mask = torch.zeros((1, 1, n, c + m + n), dtype=dtype, device=HOST)     # the context: visible to all
        mask[0, 0, :, c:].masked_fill_(~anc[m:], torch.finfo(dtype).min)
        pos = c + depth[m:]
        return pos[None], mask, anc, depth

    def extend_tree(self, parents: Tensor) -> tuple[Tensor, Tensor]:
        """The cached tree's ancestor matrix and depths extended by new nodes ``m..m+n-1`` with ``parents``
        (tree indices; ``-1`` = a child of the context; a parent must be an earlier node). Equal to
        ``ancestor_matrix(parents, tree_anc)`` and ``cat(tree_depth, depths_from_parents(parents, tree_depth))``
        (:mod:`draft.tree`, which calls :func:`extend_ancestry`)."""
        return extend_ancestry(parents, self.tree_anc if self.num_tree else None,
                               self.tree_depth if self.num_tree else None)
    def commit_forward(self, n: int, as_context: bool, anc: Tensor | None = None,
                       depth: Tensor | None = None) -> None:
        """Advance after the layers wrote ``n`` rows."""
        self.length += n
        if as_context:
            self.context_len = self.length
        else:
            self.tree_anc, self.tree_depth = anc, depth

    # -- pruning -------------------------------------------------------------------------------
    def apply_keep(self, keep: Tensor, accepted_len: int) -> None:
        """Apply a decision's keep-list (tree indices, strictly increasing) to the cached tree.

        Cached kept nodes are compacted to the front of the tree area; the first ``accepted_len``
        of them (the accepted path) become committed context without recomputation. Kept indices
        beyond the cached nodes belong to segments this stage has not computed yet and are ignored.
        """
        m = self.num_tree
        cached = keep[keep < m]
        if accepted_len > cached.numel():
            raise RuntimeError("accepted path is not fully cached on this stage")
        compact_slots(self.keys, self.context_len, cached)
        compact_slots(self.values, self.context_len, cached)
        rest = cached[accepted_len:]
        self.tree_anc = self.tree_anc[rest][:, rest]
        self.tree_depth = self.tree_depth[rest] - accepted_len
        self.context_len += accepted_len
        self.length = self.context_len + rest.numel()

    def truncate_tree(self) -> None:
        """Drop every cached tree node (keep the committed context)."""
        self.apply_keep(torch.zeros(0, dtype=torch.long, device=HOST), 0)


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
    idx = torch.arange(n, device=HOST)
    if bool((par >= idx + m).any()):
        i = int((par >= idx + m).nonzero()[0])
        raise ValueError(f"parent {int(par[i])} of node {m + i} is not an earlier node")
    # rows[i]: node i's ancestors-or-self found so far; row n is a zero sentinel that "no new parent" points to
    ext = torch.cat([torch.where(linked, par - m, n), torch.tensor([n], device=HOST)])
    rows = torch.zeros(n + 1, m + n, dtype=torch.bool, device=HOST)
    rows[:n, m:].fill_diagonal_(True)
    if m and base_anc is not None:
        cached = (par >= 0) & ~linked
        rows[:n, :m] = base_anc[par.clamp(0, m - 1)] & cached[:, None]
    while int(ext.min()) < n:                                # pointer jumping: ceil(log2(longest chain)) rounds
        rows = rows | rows[ext]
        ext = ext[ext]
    rows = rows[:n]
    if base_depth is None:
        val = rows.sum(1) - 1                                # depth = ancestors on the path (a root: 0)
    else:                                                    # the chain's topmost new node enters a cached one
        new = rows[:, m:]
        top = par[new.to(torch.int8).argmax(1)]              # its parent (ancestors have lower indices)
        val = new.sum(1) - 1 + (torch.where(top >= 0, base_depth[top.clamp(0, m - 1)] + 1, 0) if m else 0)
    if m == 0:
        return rows, val
    anc = torch.zeros(m + n, m + n, dtype=torch.bool, device=HOST)
    if base_anc is not None:
        anc[:m, :m] = base_anc
    anc[m:] = rows
    return anc, torch.cat([torch.zeros(m, dtype=torch.long, device=HOST) if base_depth is None else base_depth, val])


SMALL_TREE = 32   # up to this many linked new nodes a per-row Python loop beats pointer jumping on a CPU (measured)


def _extend_ancestry_loop(par: Tensor, m: int, base_anc: Tensor | None, base_depth: Tensor | None
                          ) -> tuple[Tensor, Tensor]:
    """:func:`extend_ancestry` for a few new nodes some of whose parents are new: one pass over Python lists
    (each new row is its chain's first cached ancestor's row, gathered at once, plus a small new-by-new block);
    few operators, and on a CPU cheaper than the rounds of pointer jumping below ``SMALL_TREE`` rows."""
    pl = par.tolist()
    n = len(pl)
    base = base_depth.tolist() if (m and base_depth is not None) else [0] * m
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


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=HOST)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
