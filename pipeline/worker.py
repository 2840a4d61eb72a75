"""The verification-stage loop (ranks 1..N). It is mode-agnostic: every mode is a rank-0 strategy.

Per received ring message:
  * ``Context``  -> (reset on a new generation) append committed rows, forward the hidden states;
  * ``Segment``  -> take its decision log, and every decision that already arrived point to point from rank 0,
    and apply them in order (:class:`StageTree`): the accepted path becomes context, dead nodes leave the KV
    cache, and rows of this segment that a decision killed are never computed; compute the surviving rows
    and forward them (an emptied segment still travels on, with its log, so every stage sees every decision);
  * ``Fork``     -> copy another lane's committed prompt prefix into this lane (a shared prefill), forward;
  * ``Stats``    -> add this rank's busy seconds, forward;  ``Shutdown`` -> forward and stop.

Several messages in one forward (:mod:`pipeline.batching`): a stage serving several lanes also takes the messages
that have already arrived (``poll_prev``, never waiting): other lanes' and the same lanes' consecutive segments (a
chain: each prepared after the lane's previous one is staged) and computes them in the same forward; each is
prepared on its own lane's state exactly as in a step of its own and each message's output goes on as its own
message, in arrival order.

A stage never waits for anything but its data source: the decisions a segment depends on travel in its
log (or an earlier segment's); the direct copies only let a stage prune earlier.

Lanes (several requests in flight, ``pipeline/lanes.py``): every message names its lane (``msg.lane``), and the
worker keeps one KV cache and one :class:`StageTree` per lane (:class:`LaneState`). Before handling a message it
selects the message's lane (``self.cache`` / ``self.tree`` are that lane's from then on, so the compute path is
the same for every lane), and every output keeps the lane. Direct decisions are routed to their own lane. A
lane's state is allocated at the first message that needs it and kept for reuse (a pool, at most one per lane
rank 0 uses: ``serve.max_active`` caches of ``model.max_seq_len`` slots): rank 0 starts each request on a lane
with a resetting ``Context``, so nothing of the lane's previous request survives. Lane 0's state exists from
the start, so one request at a time allocates exactly what it did before lanes.
"""
from __future__ import annotations

import os
import sys
from collections import deque

import torch

from config.errors import UserError
from draft.tree import admit_rows, decision_keep
from model.devices import HOST
from model.kv_cache import KVCache
from model.lane_batch import LaneBatch
from model.meter import OpMeter, SpanMeter, take_counters
from model.stage_model import StageModel
from pipeline.batching import CONTEXT, OTHER, SEGMENT, Piece, Work, chain_continues, take_batch
from pipeline.messages import Context, Decision, Fork, Segment, Shutdown, Stats
from pipeline.transport import Transport


class StageTree:
    """A stage's decision state for one generation: which decisions it applied, the node id of every cached
    tree slot (increasing), and a surviving root it has not computed yet.

    Invariant: ``slot_gids`` is aligned with ``cache``'s tree slots; ``applied`` decisions (``1..applied``)
    are reflected in the cache; ``early`` holds decisions received ahead of their turn.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.reset(0)

    def reset(self, gen: int) -> None:
        self.gen, self.applied, self.pending_root = gen, 0, -1
        self.slot_gids: list[int] = []
        self.early: dict[int, Decision] = {}

    def offer(self, decisions: list[Decision]) -> None:
        """Hold decisions of this generation that are not applied yet (duplicates are ignored)."""
        for d in decisions:
            if d.gen == self.gen and d.seq > self.applied:
                self.early.setdefault(d.seq, d)

    def apply_ready(self) -> int:
        """Apply every held decision whose turn has come (consecutive ``seq``); returns how many."""
        n = 0
        while self.applied + 1 in self.early:
            self._apply(self.early.pop(self.applied + 1))
            n += 1
        return n

    def _apply(self, d: Decision) -> None:
        keep, acc, pending = decision_keep(self.slot_gids, self.cache.tree_anc, d.path.tolist(), d.root)
        self.cache.apply_keep(keep, acc)
        self.slot_gids = [self.slot_gids[j] for j in keep[acc:].tolist()]
        self.pending_root = pending
        self.applied = d.seq

    def admit(self, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``seg`` still alive and their parents as tree slots; the caller computes exactly those."""
        if self.applied < seg.epoch:
            raise RuntimeError(f"segment of epoch {seg.epoch} arrived before decision {self.applied + 1}")
        rows, parents, self.pending_root = admit_rows(seg.parents, seg.gids, self.slot_gids, self.pending_root)
        return rows, parents

    def computed(self, gids: list[int]) -> None:
        self.slot_gids += gids


def context_inputs(cache: KVCache, tree: StageTree, msg: Context, dtype: torch.dtype):
    """A prompt chunk (or ``ar``'s one token) on a stage, up to the forward: the first chunk of a generation resets
    the cache and the decision state; returns the chunk's positions and causal mask. The caller computes the rows
    and then ``cache.commit_forward(n, as_context=True)`` (they become committed context). Shared with the TP group
    worker (``pipeline/tp_run.py``)."""
    if msg.reset:
        cache.reset()
        tree.reset(msg.gen)
    return cache.context_inputs(msg.x.shape[1], dtype)


class LaneState:
    """One lane's KV cache and decision state on a stage."""

    def __init__(self, cache: KVCache | None) -> None:
        self.cache = cache
        self.tree = StageTree(cache)


class BusyMarks:
    """Busy seconds per lane: each ``Stats`` trip of lane ``L`` reports the stage's busy time since lane ``L``'s
    previous trip (its decode window), however many other lanes' trips came in between.

    Why: the tracer's busy counter is one per rank and is restarted by every trip; with several lanes in flight
    one lane's trip must not cut another lane's window. With one lane this is exactly the old rule (busy since
    the previous trip)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.mark: dict[int, float] = {}

    def take(self, lane: int, busy_since_last_trip: float) -> float:
        self.total += busy_since_last_trip
        out = self.total - self.mark.get(lane, 0.0)
        self.mark[lane] = self.total
        return out


def write_counters(msg: Stats, row: int, meter) -> None:
    """Row ``row`` of a ``Stats`` message's counter table: what ``meter`` counted since the last trip (nothing
    when the message carries no table or the meter counts nothing)."""
    values = take_counters(meter)
    if msg.counters is not None and values:
        msg.counters[row] = torch.tensor(values, dtype=torch.float64, device=HOST)


class ChainSwitchError(UserError):
    """A malformed ``FLOWSPEC_STAGE_CHAIN``."""


class StageWorker:
    def __init__(self, model: StageModel, comm: Transport, max_len: int, dtype: torch.dtype, device: str) -> None:
        # FLOWSPEC_STAGE_CHAIN=off|alone: the A/B switch of docs/results.md §45 (a measurement switch, not a setting)
        lever = os.environ.get("FLOWSPEC_STAGE_CHAIN", "on")
        if lever not in ("on", "off", "alone"):
            raise ChainSwitchError(f"FLOWSPEC_STAGE_CHAIN={lever!r}: expected on, off or alone")
        self.model, self.comm = model, comm
        self.dtype, self.device = dtype, device
        self.rank = comm.rank
        self.max_len = max_len
        self.static = None   # model.graphs.StaticStage: the forward on static shapes / CUDA graphs (model.graphs)
        self.lanes: dict[int, LaneState] = {}   # every request slot's KV cache and decision state
        self.several = False                    # a second lane was allocated: steps poll for joining messages
        self.select(0)                          # self.cache, self.tree: the current lane's (lane 0 from the start)
        self.busy = BusyMarks()
        # several messages in one forward (pipeline/batching.py): arrived, not yet handled (ring order)
        self.batching = True          # other lanes' waiting messages join a step (once a second lane exists)
        self.chain = lever != "off"   # a lane's consecutive waiting segments join as one piece of work (a chain)
        self.chain_alone = lever == "alone"   # chains while this stage has served one lane only (§45)
        self.backlog: deque = deque()
        # counters (cumulative): stage forwards (segments and prompt chunks), the messages they computed, forwards
        # carrying more than one message, more than one lane (and the lane messages in them), a lane's chain, and
        # chained segments sent back to the queue because a decision was ready (batching.chain_continues)
        self.forwards = self.messages = self.joined_forwards = 0
        self.batched_forwards = self.batched_lanes = 0
        self.chained_forwards = self.chain_stops = 0
        self.report_counters = os.environ.get("FLOWSPEC_STAGE_COUNTERS") == "1"   # one stderr line per Stats trip
        self.tracer = comm.tracer
        # the block's forwards (model.meter): traced as "compute" spans; instrumentation stacks its meters after
        # (pipeline.build.make_stage_worker) and the meter stack carries their counters (Stats)
        self.meter: OpMeter = SpanMeter(self.tracer, {"stage_forward": "compute"})
        comm.open_direct_inbox()                # rank 0's point-to-point decisions (ranks >= 2)

    @torch.no_grad()
    def _compute(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
        cache = self.cache if cache is None else cache
        rows = int(positions.numel())
        with self.meter.op("stage_forward", rows, cache.length):
            x = x.to(self.device)
            if x.is_floating_point():
                x = x.to(self.dtype)
            return (self.static or self.model)(x, positions, mask, cache)

    @torch.no_grad()
    def forward_lanes(self, works: list[Work]) -> list[torch.Tensor]:
        """ONE forward over several lanes' prepared rows (:mod:`pipeline.batching`): the rows concatenated, each
        lane's attention over its own cache with its own mask (:class:`model.lane_batch.LaneBatch`); returns each
        lane's output rows. Metered as ONE ``stage_forward`` op of all the rows over all the lanes' cached slots
        (the forward reads the weights once and every lane's cache once: what a memory-bound stage pays; the
        emulated testbed pads it once, :class:`pipeline.emulation.EmuMeter`)."""
        rows = sum(w.rows for w in works)
        with self.meter.op("stage_forward", rows, sum(w.cache.length for w in works)):
            xs = [w.x.to(self.device) for w in works]
            x = torch.cat([t.to(self.dtype) if t.is_floating_point() else t for t in xs], dim=1)
            pos = torch.cat([w.positions for w in works], dim=1)
            out = self.model(x, pos, None, LaneBatch([w.cache for w in works], [w.mask for w in works]))
        self.batched_forwards += 1
        self.batched_lanes += len(works)
        return list(out.split([w.rows for w in works], dim=1))

    def lane(self, lane: int) -> LaneState:
        """Lane ``lane``'s state, allocated at its first use (a new KV cache of ``max_len`` slots)."""
        st = self.lanes.get(lane)
        if st is None:
            cache = self.model.block.new_cache(self.max_len, self.dtype, self.device) \
                if self.model.block is not None else None
            st = self.lanes[lane] = LaneState(cache)
            self.several = len(self.lanes) > 1
        return st

    def select(self, lane: int) -> None:
        """Make ``lane`` the current one: ``self.cache`` and ``self.tree`` are its state until the next select."""
        st = self.lane(lane)
        self.cache, self.tree = st.cache, st.tree

    def run(self) -> None:
        comm = self.comm
        while True:
            msg = self.backlog.popleft() if self.backlog else comm.recv_prev()
            if isinstance(msg, Shutdown):
                comm.send_next(msg)
                return
            if isinstance(msg, Stats):
                msg.busy_s[self.rank] = self.busy.take(msg.lane, self.tracer.busy_s)
                self.tracer.reset_counters()
                write_counters(msg, self.rank, self.meter)
                if self.report_counters:
                    print(self.counter_line(), file=sys.stderr, flush=True)
                comm.send_next(msg)
            elif isinstance(msg, (Context, Segment)):
                self.step([msg, *self._joining(msg)])
            elif isinstance(msg, Fork):   # a shared prompt prefill: lane src's committed prefix (messages.Fork)
                src = self.lane(msg.src).cache   # every layer stage has a block, hence a cache
                self.select(msg.lane)
                src.copy_prefix_to(self.cache, msg.n)
                self.tree.reset(msg.gen)
                comm.send_next(msg)

    def counter_line(self) -> str:
        """The batching counters as one line (``FLOWSPEC_STAGE_COUNTERS=1``: printed at every ``Stats`` trip)."""
        return (f"[stage {self.rank}] forwards {self.forwards}, messages {self.messages}, with >1 message "
                f"{self.joined_forwards}, >1 lane {self.batched_forwards} ({self.batched_lanes} lane parts), "
                f"a lane's chain {self.chained_forwards}, chain stops {self.chain_stops}")

    def _joining(self, head: Context | Segment) -> list[Context | Segment]:
        """Messages that have already arrived and join ``head``'s forward (:func:`pipeline.batching.take_batch`):
        other lanes' and, with ``chain``, the same lanes' later segments; none while this stage has served one lane
        only (unless ``chain_alone``), on static shapes, or with batching off. The rest stay in ``backlog``, in ring
        order."""
        if not self.batching or self.static is not None:
            return []
        self.lane(head.lane)          # allocated here: a second lane sets `several`
        if not (self.several or (self.chain and self.chain_alone)):
            return []
        self.backlog.extend(self.comm.poll_prev())
        if not self.backlog:
            return []
        waiting = list(self.backlog)
        taken = take_batch(_kind(head), [_kind(m) for m in waiting], chain=self.chain)
        if taken:
            chosen = set(taken)
            self.backlog = deque(m for i, m in enumerate(waiting) if i not in chosen)
        return [waiting[i] for i in taken]

    def step(self, msgs: list[Context | Segment]) -> None:
        """One stage step over ``msgs`` (arrival order; a lane's later messages are its chain): each prepared on its
        lane's state (a chain's later segment after the lane's previous piece is staged, and only while
        :func:`pipeline.batching.chain_continues`: else it and the lane's later ones go back to the front of the
        queue), ONE forward over every row to compute (one message: exactly the single-lane path), every message's
        output sent on as its own message, in arrival order."""
        pieces: list[Piece] = []
        works: dict[int, Work] = {}         # lane -> its rows in this forward (first arrival order)
        last: dict[int, Piece] = {}         # lane -> its latest piece in this step
        back: list = []
        for m in msgs:
            prev = last.get(m.lane)
            if prev is not None:
                if any(b.lane == m.lane for b in back):
                    back.append(m)
                    continue
                if not prev.staged:
                    prev.stage()
                    prev.staged = True
            p = self._prepare(m, chained=prev is not None)
            if p is None:
                back.append(m)
                self.chain_stops += 1
                continue
            pieces.append(p)
            last[m.lane] = p
            if p.x is not None:
                if m.lane not in works:
                    works[m.lane] = Work(m.lane, self.cache, self.cache.length)
                works[m.lane].pieces.append(p)
        self.backlog.extendleft(reversed(back))
        todo = list(works.values())
        outs = self._forward(todo)
        done: dict[int, torch.Tensor] = {}
        for w, out in zip(todo, outs):
            for p, o in zip(w.pieces, out.split([p.rows for p in w.pieces], dim=1)):
                done[id(p)] = o
        for p in pieces:
            if not p.staged:
                p.stage()
                p.staged = True
            self.comm.send_next(p.make(done.get(id(p))))

    def _forward(self, todo: list[Work]) -> list[torch.Tensor]:
        """ONE forward over the works' rows; each lane's output rows. A chain's earlier pieces are already staged
        (the cache's length is past their rows): the forward writes every piece's keys/values from ``start``, so the
        length is set back to ``start`` for the forward and forward again after it."""
        if not todo:
            return []
        n = sum(len(w.pieces) for w in todo)
        self.forwards += 1
        self.messages += n
        self.joined_forwards += n > 1
        self.chained_forwards += any(len(w.pieces) > 1 for w in todo)
        resume = [w.cache.length for w in todo]
        for w in todo:
            w.cache.length = w.start
        try:
            if len(todo) == 1:
                w = todo[0]
                return [self._compute(w.x, w.positions, w.mask, w.cache)]
            return self.forward_lanes(todo)
        finally:
            for w, length in zip(todo, resume):
                w.cache.length = length

    def _prepare(self, msg: Context | Segment, chained: bool = False) -> Piece | None:
        """``msg`` on its lane's state (selected); ``chained``: a later message of its lane in this step (None: it
        waits for the next step, :func:`pipeline.batching.chain_continues`)."""
        self.select(msg.lane)
        if isinstance(msg, Segment):
            return self._prepare_segment(msg, chained)
        if chained:                      # take_batch never chains a Context; kept for a caller that would
            return None
        cache, lane = self.cache, msg.lane
        pos, mask = context_inputs(cache, self.tree, msg, self.dtype)
        n = msg.x.shape[1]
        return Piece(lane, msg.x, pos, mask, lambda: cache.commit_forward(n, as_context=True),
                     lambda out: Context(out, msg.gen, msg.reset, lane))

    def _offer_direct(self) -> None:
        """Every direct decision that has arrived, to its own lane's tree."""
        for d in self.comm.poll_direct():
            if isinstance(d, Decision):
                self.lane(d.lane).tree.offer([d])

    def _prepare_segment(self, seg: Segment, chained: bool = False) -> Piece | None:
        """A segment on its lane's state: decisions applied, dead rows pruned (``StageTree``); the surviving rows'
        inputs, ``stage`` committing them and ``make`` building the outgoing segment (an emptied segment still
        travels on, with its log, so every stage sees every decision). ``chained``: the lane's earlier rows of this
        step are staged without keys/values yet, so no decision may apply: None when one is ready."""
        tree, cache = self.tree, self.cache
        with self.tracer.span("prune"):
            tree.offer(seg.decisions())
            self._offer_direct()
            if chained and not chain_continues(tree.applied, tree.early):
                return None
            tree.apply_ready()
            rows, parents = tree.admit(seg)
        x, gids, parent_gids = seg.x, seg.gids, seg.parents
        if not bool(rows.all()):
            x, gids, parent_gids = x[:, rows.to(x.device)], gids[rows], parent_gids[rows]
        n = int(gids.numel())

        def make(out: torch.Tensor) -> Segment:
            return Segment(out, parent_gids, gids, seg.gen, seg.epoch, seg.log, seg.tag, seg.lane)
        if n:
            pos, mask, anc, depth = cache.tree_inputs(parents, self.dtype)

            def stage() -> None:
                cache.commit_forward(n, as_context=False, anc=anc, depth=depth)
                tree.computed(gids.tolist())
            return Piece(seg.lane, x, pos, mask, stage, make)
        out = x
        if out.dim() == 2 or out.shape[-1] != getattr(self.model, "out_width", out.shape[-1]):
            # nothing computed: forward an empty block of this stage's row width (EAGLE-3 taps widen rows)
            out = torch.zeros(1, 0, getattr(self.model, "out_width", self.model.config.hidden_size),
                              dtype=self.dtype, device=HOST)
        return Piece(seg.lane, None, None, None, lambda: None, lambda _: make(out))


def _kind(msg) -> tuple[str, int]:
    """``(kind, lane)`` of a ring message, as :func:`pipeline.batching.take_batch` reads it."""
    kind = SEGMENT if isinstance(msg, Segment) else CONTEXT if isinstance(msg, Context) else OTHER
    return kind, getattr(msg, "lane", 0)
