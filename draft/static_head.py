"""The EAGLE head's tree forward (one draft level) on static shapes, and as a CUDA graph (run key ``model.graphs``).

A beam level feeds the frontier (``top_k`` rows; fewer where a tree has fewer leaves) to the head; expansion
re-feeds a whole tree. :class:`StaticHead` pads those rows to a bucket -- the beam widths first, so a level is
padded to the beam width and its shapes repeat exactly, then the stage buckets for the larger re-feeds -- and
runs the head over its KV cache at capacity through :class:`model.graphs.StaticForward` (the padding, mask, slot
and executor rules, and why padding rows cannot change a real row, are in :mod:`model.graphs`).
``draft.drafter.Drafter.tree_forward`` calls it in place of the head; it answers None where a call does not fit
(rows beyond the last bucket, a cache near capacity, or a head other than an EAGLE-1/2 one), and the drafter runs
the head dynamically. The draft trees are the dynamic path's (``tests/test_graphs.py``).

A beam level's math is one pure function, :func:`level_step` (head forward, log-probs, top-k, cumulative scores),
which the dynamic path (:meth:`draft.drafter.BeamTreeDrafter.level`) and the static one (:meth:`StaticHead.level`:
the whole step padded to the bucket, so ``model.graphs=compile`` compiles it as one graph per bucket, and
``on`` / ``replay`` record it as one graph) both run.

The forward is metered here (one ``draft_forward`` op over the real rows, as the head's own forward meters it),
around the replay: a recorded forward does not run the head's Python, so the head cannot meter itself.
"""
from __future__ import annotations

from typing import Callable

import torch

from draft.eagle import EagleHead
from model.graphs import STAGE_BUCKETS, StaticForward, make_executor, static_ok

Tensor = torch.Tensor


def head_buckets(beam_widths=(), buckets: tuple[int, ...] = STAGE_BUCKETS) -> tuple[int, ...]:
    """The head's buckets: the beam widths (``tree.top_k`` and friends) and ``buckets``, sorted, distinct."""
    return tuple(sorted({int(b) for b in (*beam_widths, *buckets) if int(b) >= 1}))


def level_step(forward: Callable[[], Tensor], rank: Callable[[Tensor], tuple[Tensor, Tensor]],
               scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One beam level of EAGLE-2's search, whatever the shapes: ``out = forward()`` (the head over the frontier's
    rows, ``[..., rows, H]``), ``s, t = rank(out)`` (each row's best ``k`` draft log-probs and their target tokens,
    ``[..., rows, k]``, best first) and the candidates' cumulative scores ``scores + s`` (``scores [..., rows, 1]``:
    each frontier row's own cumulative score) -> ``(out, cum, t)``.

    Pure apart from what ``forward`` writes (the rows' keys/values in the head's cache); no host read, no
    data-dependent shape: on static shapes (a padded frontier) it traces into one graph. Padding rows produce
    candidates of their own, which the caller slices off (rows are independent in every op here)."""
    out = forward()
    s, t = rank(out)
    return out, scores + s, t


def target_topk(lm_head: torch.nn.Linear, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The best ``k`` log-probs over the target's whole vocabulary and their ids, per row of ``hidden``: the math of
    ``Drafter.top_tokens`` for an EAGLE-1/2 head without a reduced vocabulary (float32 log-softmax of the shared
    ``lm_head``)."""
    lp = torch.log_softmax(lm_head(hidden.to(lm_head.weight.dtype)).float(), dim=-1)
    return torch.topk(lp, k, dim=-1)


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

    def level(self, bucket: int, tokens: Tensor, features: Tensor, scores: Tensor, positions: Tensor, mask: Tensor,
              cache, lm_head: torch.nn.Linear, k: int, meter) -> tuple[Tensor, Tensor, Tensor]:
        """A whole beam level on static shapes (:func:`level_step` with the head's forward and :func:`target_topk`,
        padded to ``bucket`` as one body): ``tokens [1, n]``, ``features [1, n, H]``, ``scores [1, n, 1]`` (the
        frontier's cumulative scores) -> ``(out [1, n, H], cum [1, n, k], tok [1, n, k])`` for the real rows.
        Metered as the dynamic level is: a ``draft_forward`` op over the rows (it times the whole step) and an
        ``lm_head`` op over the same rows (``meter``: the drafter's; it does no work of its own here)."""
        head, n = self.head, int(tokens.shape[-1])

        def body(tok: Tensor, feat: Tensor, sc: Tensor, pos: Tensor, m: Tensor, c) -> tuple[Tensor, Tensor, Tensor]:
            return level_step(lambda: head.compute(tok, feat, pos, m, c), lambda h: target_topk(lm_head, h, k), sc)
        with head.meter.op("draft_forward", n, int(cache.length)):
            out = self.static.run(bucket, (tokens, features, scores), positions, mask, cache, body=body,
                                  tag=("level", k, id(lm_head)))
        with meter.op("lm_head", n, 0):
            pass
        return out


def static_head(head, executor_kind: str | None, buckets: tuple[int, ...]) -> StaticHead | None:
    """A :class:`StaticHead` for ``head``, or None where drafting keeps dynamic shapes: no executor, a head other
    than :class:`draft.eagle.EagleHead` (EAGLE-3, test drafters), or a layer :func:`model.graphs.static_ok` refuses
    (not lean; a position-dependent rotary scaling under CUDA graphs)."""
    if type(head) is not EagleHead or not static_ok(head.block, executor_kind):
        return None
    return StaticHead(head, make_executor(executor_kind), buckets)
