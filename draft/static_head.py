"""The EAGLE head's tree forward (one draft level) on static shapes, and as a CUDA graph (run key ``model.graphs``).

A beam level feeds the frontier (``top_k`` rows; fewer where a tree has fewer leaves) to the head; expansion
re-feeds a whole tree. :class:`StaticHead` pads those rows to a bucket -- the beam widths first, so a level is
padded to the beam width and its shapes repeat exactly, then the stage buckets for the larger re-feeds -- and
runs the head over its KV cache at capacity through :class:`model.graphs.StaticForward` (the padding, mask, slot
and executor rules, and why padding rows cannot change a real row, are in :mod:`model.graphs`).
``draft.drafter.Drafter.tree_forward`` calls it in place of the head; it answers None where a call does not fit
(rows beyond the last bucket, a cache near capacity, or a head other than an EAGLE-1/2 one), and the drafter runs
the head dynamically. The draft trees are the dynamic path's (``tests/test_graphs.py``).

The forward is metered here (one ``draft_forward`` op over the real rows, as the head's own forward meters it),
around the replay: a recorded forward does not run the head's Python, so the head cannot meter itself.
"""
from __future__ import annotations

import torch

from draft.eagle import EagleHead
from model.graphs import STAGE_BUCKETS, StaticForward, make_executor, static_ok

Tensor = torch.Tensor


def head_buckets(beam_widths=(), buckets: tuple[int, ...] = STAGE_BUCKETS) -> tuple[int, ...]:
    """The head's buckets: the beam widths (``tree.top_k`` and friends) and ``buckets``, sorted, distinct."""
    return tuple(sorted({int(b) for b in (*beam_widths, *buckets) if int(b) >= 1}))


class StaticHead:
    """``static(tokens, features, positions, mask, cache)`` -> the head's output for the real rows, or None (the
    caller runs the head). ``tokens [1, n]``, ``features [1, n, H]`` on the head's device and dtype."""

    def __init__(self, head: EagleHead, executor, buckets: tuple[int, ...]) -> None:
        self.head = head
        self.static = StaticForward(head.compute, executor, buckets)

    @property
    def stats(self):
        return self.static.stats

    def __call__(self, tokens: Tensor, features: Tensor, positions: Tensor, mask: Tensor, cache) -> Tensor | None:
        n = int(tokens.shape[-1])
        b = self.static.bucket_for(n, cache) if self.head.block.lean else None   # set_lean(head, False): dynamic
        if b is None:
            return None
        with self.head.meter.op("draft_forward", n, int(cache.length)):
            return self.static.run(b, (tokens, features), positions, mask, cache)


def static_head(head, executor_kind: str | None, buckets: tuple[int, ...]) -> StaticHead | None:
    """A :class:`StaticHead` for ``head``, or None where drafting keeps dynamic shapes: no executor, a head other
    than :class:`draft.eagle.EagleHead` (EAGLE-3, test drafters), or a layer :func:`model.graphs.static_ok` refuses
    (not lean; a position-dependent rotary scaling under CUDA graphs)."""
    if type(head) is not EagleHead or not static_ok(head.block, executor_kind):
        return None
    return StaticHead(head, make_executor(executor_kind), buckets)
