"""Several lanes' rows in one block forward: a stand-in for the KV cache that keeps every lane's attention its own.

A stage serving several requests (lanes, ``pipeline/lanes.py``) may compute the segments of several lanes in ONE
forward (``pipeline/batching.py``): the rows of all lanes are concatenated, every linear / norm / MLP / rotary op
runs once over all of them (on a memory-bound device the weights are read once), and only attention is per lane:
lane ``i``'s rows (``bounds[i]:bounds[i + 1]``) write their keys and values into lane ``i``'s own
:class:`model.kv_cache.KVCache` and attend over that cache alone with lane ``i``'s own additive mask.

Two ways to keep the lanes apart inside attention, both here:

* :meth:`LaneBatch.attend` (the lean layers, :func:`model.lean_layer.lean_forward`): a loop over the lanes, one
  ``scaled_dot_product_attention`` per lane over its own cache;
* :meth:`LaneBatch.update` + :meth:`LaneBatch.joint_mask` (transformers' own decoder layers, which call
  ``cache.update`` and then attend once with the mask they were given): ``update`` returns the lanes' keys/values
  concatenated and the mask is block-diagonal (lane ``i``'s rows see lane ``i``'s slots through its own mask,
  every other lane's slots are masked out).

Why the loop for the lean path (measured, docs/results.md §41 on this host;
its command there times both): the block-diagonal form concatenates every lane's whole cache on every layer (a copy of all lanes' keys
and values per layer) and attends over ``lanes x`` more slots, nearly all of them masked; the loop pays one
attention call per lane instead. The transformers layers cannot take the loop (their attention is inside the
module), so they take the block-diagonal form: correct, at that copy's cost.

Invariant (``tests/test_lanes_batch.py``): each lane's output rows and the keys/values written into its cache
equal those of its own forward alone (up to floating-point reassociation of the row-batched matmuls), on both
paths; no lane's rows can see another lane's slots (the loop never hands them over; the joint mask blocks them).
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor


class LaneBatch:
    """``caches[i]`` and ``masks[i]`` (``[1, 1, n_i, caches[i].length + n_i]``, additive) of the lanes whose rows
    a forward carries, in row order. Passed where a block forward takes its cache (``mask=None``)."""

    joint = False    # True: the lean path too attends once over the block-diagonal mask (measurement only)

    def __init__(self, caches: list, masks: list[Tensor]) -> None:
        if len(caches) != len(masks) or not caches:
            raise ValueError("a lane batch needs one mask per cache, at least one lane")
        self.caches, self.masks = list(caches), list(masks)
        self.sizes = [int(m.shape[-2]) for m in self.masks]
        self.bounds = [0]
        for n in self.sizes:
            self.bounds.append(self.bounds[-1] + n)
        self.rows = self.bounds[-1]
        self._joint: Tensor | None = None

    def to(self, device, dtype) -> "LaneBatch":
        """The masks on ``device`` in ``dtype`` (once per forward)."""
        self.masks = [m.to(device=device, dtype=dtype) for m in self.masks]
        self._joint = None
        return self

    def _lanes(self):
        for i, cache in enumerate(self.caches):
            yield cache, self.bounds[i], self.bounds[i + 1], self.masks[i]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer_idx: int, attention) -> Tensor:
        """One layer's attention for every lane (``q``, ``k``, ``v``: ``[1, heads, rows, d]`` after rotation):
        lane ``i``'s new keys/values go into its cache, its queries attend over that cache with its mask
        (``attention(q, k, v, mask)``: the layer's own attention call); returns ``[1, heads, rows, d]``."""
        if self.joint:
            k, v = self.update(k, v, layer_idx)
            return attention(q, k, v, self.joint_mask())
        outs = []
        for cache, a, b, mask in self._lanes():
            kc, vc = cache.update(k[:, :, a:b], v[:, :, a:b], layer_idx)
            outs.append(attention(q[:, :, a:b], kc, vc, mask))
        return torch.cat(outs, dim=2)

    # -- transformers' Cache protocol (its layers call update, then attend with joint_mask) ------------------
    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Each lane's rows into its own cache; returns every lane's slots (up to its new rows), concatenated in
        lane order: the key axis :meth:`joint_mask` describes."""
        ks, vs = [], []
        for cache, a, b, _ in self._lanes():
            kc, vc = cache.update(key[:, :, a:b], value[:, :, a:b], layer_idx)
            ks.append(kc)
            vs.append(vc)
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def joint_mask(self) -> Tensor:
        """The block-diagonal additive mask ``[1, 1, rows, sum_i (length_i + n_i)]``: lane ``i``'s rows see lane
        ``i``'s slots as its own mask says, and nothing of another lane (built once per forward)."""
        if self._joint is None:
            widths = [int(m.shape[-1]) for m in self.masks]
            ref = self.masks[0]
            out = torch.full((1, 1, self.rows, sum(widths)), torch.finfo(ref.dtype).min, dtype=ref.dtype,
                             device=ref.device)
            col = 0
            for (_, a, b, mask), w in zip(self._lanes(), widths):
                out[:, :, a:b, col:col + w] = mask
                col += w
            self._joint = out
        return self._joint

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("a lane batch has one length per lane: pass explicit positions and masks")

