"""Several lanes' segments in ONE stage forward: which waiting messages join a stage step (the rule), and the step's
pieces of work.

Why: on a memory-bound device (the edge profile: a stage step streams 3.2 GB of weights whether it carries 1 row or
16) a stage's capacity is forwards per second, not rows. With several requests in flight (lanes,
``pipeline/lanes.py``) each lane's segment used to be a forward of its own at every stage (docs/results.md §34:
four clients got 2.03x one client's tokens/s, stage 1 the bottleneck). A stage that finds segments of several lanes
waiting computes them in one forward: every linear / norm / MLP op once over the concatenated rows, attention per
lane over that lane's own KV cache with that lane's mask (:class:`model.lane_batch.LaneBatch`).

The step (:meth:`pipeline.worker.StageWorker.run`): the stage takes its next message (waiting for it as before);
when it is a ``Segment`` or ``Context`` and the stage serves more than one lane, it also takes what has already
arrived (``Transport.poll_prev``: never waits, so one lane alone is never slowed down) and :func:`take_batch`
picks the messages that join. Each joining message is prepared exactly as alone, in arrival order and on its own
lane's state (decisions offered and applied, rows pruned, ``StageTree.admit``, a ``Context``'s reset and causal
inputs): that is :class:`Work`. Then ONE forward over every prepared row (the metered ``stage_forward`` op charged
once, for all rows: :meth:`pipeline.worker.StageWorker.forward_lanes`), each lane's cache advanced, and each lane's
output sent on as that lane's own message, in arrival order.

The rule (:func:`take_batch`, pure), and why each part:

* at most ONE message per lane: a lane's next segment depends on the previous one's cache entries and decisions
  (its rows' parents, ``StageTree.admit``), so it waits for the next step;
* a lane's message joins only if no earlier message of that lane is still waiting (per-lane FIFO: the ring's
  order is kept within every lane, which is all the protocol relies on: decisions apply in order, a segment of
  epoch ``e`` after decisions ``1..e``, every lane's cache sees its rows in order);
* the scan stops at the first message that is neither a ``Segment`` nor a ``Context`` (``Stats``, ``Shutdown``):
  they are handled in ring order, after what precedes them;
* nothing else: no size limit, no waiting for more. Messages left out stay queued, in order, for the next step.

Invariants: every lane's messages are handled in ring order, each exactly once; a lane's output is computed from
exactly the rows, positions, mask and cache it would be alone, so its result is its single-request result (up to
floating-point reassociation of row-batched matmuls) and every lane's greedy output is unchanged
(``tests/test_lanes.py``, ``tests/test_lanes_batch.py``).

Where it does not batch (one message per forward, as before): a stage that has served only one lane (a single
request pays nothing, not even a poll); a stage on static shapes / CUDA graphs (``model.graphs``: one cache per
recorded graph); a device wire (NCCL: ``Comm.poll_prev`` returns nothing). The TP group worker
(``pipeline/tp_run.py``) serves one request at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

SEGMENT, CONTEXT, OTHER = "segment", "context", "other"


def take_batch(head_lane: int, waiting: list[tuple[str, int]]) -> list[int]:
    """Indices (increasing) of the ``waiting`` messages (``(kind, lane)`` in arrival order; kind
    :data:`SEGMENT`, :data:`CONTEXT` or :data:`OTHER`) that join the forward of a message of lane ``head_lane``
    (module docstring: one per lane, per-lane FIFO, stop at the first :data:`OTHER`). Pure."""
    taken: list[int] = []
    lanes = {head_lane}
    held: set[int] = set()          # lanes with a message left waiting: their later ones wait too
    for i, (kind, lane) in enumerate(waiting):
        if kind == OTHER:
            break
        if lane in lanes or lane in held:
            held.add(lane)
            continue
        lanes.add(lane)
        taken.append(i)
    return taken


@dataclass
class Work:
    """One lane's part of a stage step, prepared on its own state: ``x`` (``[1, n]`` token ids or ``[1, n, W]``
    rows; None: nothing to compute), ``positions`` ``[1, n]``, the additive ``mask`` over ``cache``'s slots, and
    ``finish(out)``: advances the lane's cache by the computed rows and returns the lane's outgoing message."""

    lane: int
    x: torch.Tensor | None
    positions: torch.Tensor | None
    mask: torch.Tensor | None
    cache: object
    finish: Callable[[torch.Tensor | None], object]

    @property
    def rows(self) -> int:
        return 0 if self.positions is None else int(self.positions.numel())
