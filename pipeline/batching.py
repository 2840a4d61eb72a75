"""Several messages in ONE stage forward: which waiting messages join a stage step (the rule), and the step's
pieces of work. Two kinds of joining: segments of several lanes (issue 46, docs/results.md §41), and one lane's
consecutive waiting segments (a chain, §45).

Why: on a memory-bound device (the edge profile: a stage step streams 3.2 GB of weights whether it carries 1 row or
16) a stage's capacity is forwards per second, not rows. With several requests in flight (lanes,
``pipeline/lanes.py``) each lane's segment used to be a forward of its own at every stage (docs/results.md §34:
four clients got 2.03x one client's tokens/s, stage 1 the bottleneck). A stage that finds segments of several lanes
waiting computes them in one forward: every linear / norm / MLP op once over the concatenated rows, attention per
lane over that lane's own KV cache with that lane's mask (:class:`model.lane_batch.LaneBatch`). Measured (§41): at a
saturated stage what waits is mostly the SAME lane's next segments, so a lane's consecutive waiting segments join
too, as one larger piece of that lane's work (a chain).

The step (:meth:`pipeline.worker.StageWorker.run`): the stage takes its next message (waiting for it as before);
when it is a ``Segment`` or ``Context`` and the stage batches (it has served more than one lane, or
``StageWorker.chain_alone``), it also takes what has already arrived (``Transport.poll_prev``: never waits) and
:func:`take_batch` picks the messages that join. Each joining message is prepared exactly as it would be in a step
of its own, in arrival order and on its own lane's state (decisions offered and applied, rows pruned,
``StageTree.admit``, a ``Context``'s reset and causal inputs): a :class:`Piece`. A chain's later message is prepared
after the lane's previous piece is STAGED (its rows committed to the lane's KV-cache bookkeeping and
``StageTree.computed``: exactly the state the next step would start from, except that the keys/values of the
staged rows are written by this step's forward), so its parents, positions and mask see the earlier rows as cached.
A lane's pieces form one :class:`Work`: their rows concatenated, one additive mask (:func:`chain_mask`: piece ``k``'s
rows see what its own mask says and nothing of later pieces), the rows written from the cache length where the
lane's first piece starts. Then ONE forward over every prepared row (the metered ``stage_forward`` op charged
once, for all rows: :meth:`pipeline.worker.StageWorker.forward_lanes`), each lane's cache advanced, and every
message's output sent on as its own message, in arrival order: the next rank receives exactly the messages it
receives when each is a forward of its own.

The rule (:func:`take_batch`, pure), and why each part:

* a lane's FIRST message in the step may be a ``Segment`` or a ``Context``; its later ones join only as a chain
  (``chain=True``) and only as ``Segment``s: a ``Context`` after something of its lane (a new generation's reset
  or a further prompt chunk) waits for the next step (a reset would discard staged rows; a long prefill chunked on
  purpose stays chunked, so a prefill does not hold the other lanes for more than one chunk);
* a lane's message joins only if no earlier message of that lane is still waiting (per-lane FIFO: the ring's
  order is kept within every lane, which is all the protocol relies on: decisions apply in order, a segment of
  epoch ``e`` after decisions ``1..e``, every lane's cache sees its rows in order);
* the scan stops at the first message that is neither a ``Segment`` nor a ``Context`` (``Stats``, ``Fork``,
  ``Shutdown``): they are handled in ring order, after what precedes them;
* nothing else: no size limit, no waiting for more. Messages left out stay queued, in order, for the next step.

The chain's second rule (:func:`chain_continues`, pure, applied by the worker while it prepares; it needs the
lane's decision state): decisions apply before the segment of their epoch, and a decision compacts the lane's
KV cache (``KVCache.apply_keep``), which must not happen while staged rows have no keys/values yet. So a chained
segment joins only when, after its own decision log and the direct decisions that have arrived are OFFERED to its
lane's tree (held, not applied), no decision is ready to apply; otherwise it and the lane's later taken messages go
back to the front of the queue, in order, and the next step applies the decision before preparing it, exactly as
a step of its own would.

Invariants: every lane's messages are handled in ring order, each exactly once; each message's output is computed
from exactly the rows, positions, mask and cache contents it would see in a step of its own (a chained piece sees
the earlier pieces' rows, written in the same forward before any attention reads them, through its own mask), so
its result is its single-request result (up to floating-point reassociation of row-batched matmuls) and every
lane's greedy output is unchanged (``tests/test_lanes.py``, ``tests/test_lanes_batch.py``,
``tests/test_lane_chain.py``).

Where it does not batch (one message per forward, as before): a stage that has served only one lane, unless
``StageWorker.chain_alone`` (docs/results.md §45 measured whether a single request gains); a stage on static
shapes / CUDA graphs (``model.graphs``: one cache per recorded graph); a device wire (NCCL: ``Comm.poll_prev``
returns nothing). The TP group worker (``pipeline/tp_run.py``) serves one request at a time.

Chains need a lane with more than one segment in flight: at the default ``serve.ring_share=1`` four active lanes
keep one or two live segments each, so what chains there is a prompt chunk and its first segments; a request alone, or a
higher share, is where a stage finds a lane's segments queued. A stage's counters (``StageWorker.forwards``,
``messages``, ``joined_forwards``, ``batched_forwards``, ``chained_forwards``, ``chain_stops``) say how often it
happened (``FLOWSPEC_STAGE_COUNTERS=1`` prints them at every ``Stats`` trip); ``FLOWSPEC_STAGE_CHAIN=off|alone``
is the A/B switch docs/results.md §45 measured with (chains off: the §41 rule; ``alone``: chains for one lane too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

SEGMENT, CONTEXT, OTHER = "segment", "context", "other"


def take_batch(head: tuple[str, int], waiting: list[tuple[str, int]], chain: bool = True) -> list[int]:
    """Indices (increasing) of the ``waiting`` messages (``(kind, lane)`` in arrival order; kind
    :data:`SEGMENT`, :data:`CONTEXT` or :data:`OTHER`) that join the forward of ``head`` (``(kind, lane)``, the
    message the step started with). Module docstring: per-lane FIFO; a lane's later messages join only as a chain
    of ``Segment``s (``chain``); stop at the first :data:`OTHER`. Pure."""
    taken: list[int] = []
    lanes = {head[1]}               # lanes with a message in the step
    held: set[int] = set()          # lanes with a message left waiting: their later ones wait too
    for i, (kind, lane) in enumerate(waiting):
        if kind == OTHER:
            break
        if lane in held:
            continue
        if lane in lanes and not (chain and kind == SEGMENT):
            held.add(lane)
            continue
        lanes.add(lane)
        taken.append(i)
    return taken


def chain_continues(applied: int, held: Iterable[int]) -> bool:
    """Whether a lane's next segment may join its chain in this step: no decision the lane's tree holds is ready to
    apply (``applied``: the last applied decision's ``seq``; ``held``: the ``seq`` of every decision offered and
    not yet applied). A ready decision would compact the lane's cache under rows staged in this step (module
    docstring), so the segment waits for the next step, which applies it first. Pure."""
    return applied + 1 not in set(held)


def chain_mask(masks: list[torch.Tensor]) -> torch.Tensor:
    """One additive mask ``[1, 1, N, L + N]`` for a lane's pieces in one forward (``N`` their rows, ``L`` the
    lane's cache length before the first): piece ``k``'s mask ``[1, 1, n_k, L_k + n_k]`` (``L_k = L + n_0 + ... +
    n_{k-1}``: it was made with the earlier pieces staged) fills its rows' first ``L_k + n_k`` columns, and the
    columns of later pieces are masked out (the lowest value of the dtype, as in every additive mask).
    One piece: its own mask. Pure."""
    if len(masks) == 1:
        return masks[0]
    rows = sum(int(m.shape[-2]) for m in masks)
    width = int(masks[-1].shape[-1])
    ref = masks[0]
    out = torch.full((1, 1, rows, width), torch.finfo(ref.dtype).min, dtype=ref.dtype, device=ref.device)
    r = 0
    for m in masks:
        n, w = int(m.shape[-2]), int(m.shape[-1])
        out[:, :, r:r + n, :w] = m
        r += n
    return out


@dataclass
class Piece:
    """One message prepared on its lane's state: ``x`` (``[1, n]`` token ids or ``[1, n, W]`` rows; None: nothing
    to compute), ``positions`` ``[1, n]``, the additive ``mask`` over the lane's slots up to its own rows,
    ``stage()`` (commits its rows to the lane's cache bookkeeping and decision state: after the forward, or before
    preparing the lane's next piece of a chain) and ``make(out)`` (its outgoing message from its output rows)."""

    lane: int
    x: torch.Tensor | None
    positions: torch.Tensor | None
    mask: torch.Tensor | None
    stage: Callable[[], None]
    make: Callable[[torch.Tensor | None], object]
    staged: bool = False

    @property
    def rows(self) -> int:
        return 0 if self.positions is None else int(self.positions.numel())


@dataclass
class Work:
    """One lane's rows in a stage forward: its pieces with rows to compute (arrival order), its ``cache`` and
    ``start``, the cache length where the first piece's rows are written (the later pieces' rows follow)."""

    lane: int
    cache: object
    start: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)

    @property
    def x(self) -> torch.Tensor:
        xs = [p.x for p in self.pieces]
        return xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)

    @property
    def positions(self) -> torch.Tensor:
        ps = [p.positions for p in self.pieces]
        return ps[0] if len(ps) == 1 else torch.cat(ps, dim=1)

    @property
    def mask(self) -> torch.Tensor:
        return chain_mask([p.mask for p in self.pieces])
