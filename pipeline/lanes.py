"""Several requests in flight through one ring: **lanes**.

A lane is a request slot. Every message names its lane (``msg.lane``, :mod:`pipeline.messages`); each stage keeps
one KV cache and one decision state per lane (:class:`pipeline.worker.LaneState`); rank 0 runs each request's
*unchanged* decode loop (:func:`pipeline.engine.timed_generation` with the request's mode) in its own thread on its
own lane, through a virtual transport that stamps the lane on what it sends and receives only its lane's
results. Nothing in the modes, the outbox or the verification knows about lanes: a lane is a whole pipeline as
far as its decode loop can see.

* :class:`LaneMux` splits rank 0's :class:`pipeline.transport.Transport` into per-lane transports
  (:class:`LaneTransport`). Sends from every lane go through one lock (the transport is not thread-safe) in the
  order the lane threads make them: the ring's FIFO order is the schedule (each lane sends the moment it is
  ready, a link that one lane leaves idle carries another's segment). One receiver thread reads the ring
  (``recv_prev``) and hands each message to its lane's queue. It receives only while messages are outstanding
  (every ring message rank 0 sends comes back exactly once), so an idle server never waits in a receive that
  could time out; a receive error reaches every lane.
* :func:`lane_engine` builds a lane's :class:`pipeline.engine.Engine`: the shared model (embedding, ``lm_head``),
  its own drafter (:func:`fork_drafter`: the head's weights shared, its draft KV cache, generator and other
  per-generation state its own), its own generation counter and tracer (busy counters per lane), and the
  emulated testbed's meters when it is on. Rank 0's model work (``lm_head``, draft head, small LM) runs one
  op at a time across lanes (:class:`DeviceLock`): rank 0 is one device, so two lanes' ops must not overlap
  (nor their emulated pads); the target ``lm_head`` calls (verification, draft log-probs) of lanes that wait for
  the device at once run as ONE op over their rows, charged once (:mod:`pipeline.coalesce`).
* :class:`SharedPrefill`: the ``n`` choices of one request (``pipeline.serve``'s ``submit_n``) prefill the prompt
  once; every other choice starts from a :class:`pipeline.messages.Fork` of a lane that holds it.
* :class:`LanePool` is what a server holds: ``n`` lane engines, a free list, a control lane for the idle
  keep-alive, and the global :meth:`LanePool.shutdown`.

Protocol rules with several lanes (the *why* is in the module docstrings named):

* exactness: a lane's messages are exactly those its request would send alone (same ``gen``, node ids,
  decisions, epochs) and a stage applies them to that lane's state only, so every request's output is
  token-identical to its single-request output, and sampling keeps each request's law with its own generator
  (``GenSettings.new_sampler``, the drafter's own);
* ``Stats``: per lane: a lane's trip reports each stage's busy seconds since that lane's previous trip
  (:class:`pipeline.worker.BusyMarks`), i.e. over its own decode window, other lanes' work included;
  meter counters (the testbed's fidelity counters) go to whichever lane's trip collects them;
* ``Fork`` (a shared prompt prefill, :class:`SharedPrefill`): the one message that reads another lane's state (a
  holder lane's committed prefix, only read, never changed); it is sent while that lane's generation runs, so the
  ring's FIFO order brings it to every stage after the holder's prefill and before anything that resets it;
* ``Shutdown``: global (:meth:`LaneMux.shutdown`), after every lane's generation has ended;
* stage memory: a stage allocates a lane's KV cache at the lane's first message and keeps it for reuse, so a
  server with ``serve.max_active = n`` holds at most ``n`` caches of ``model.max_seq_len`` slots per stage.
"""
from __future__ import annotations

import copy
import math
import queue
import sys
import threading
from contextlib import contextmanager

import torch

from config.errors import UserError
from draft.protocol import install_meter, meter_sites
from model.meter import MeterStack
from pipeline.coalesce import CoalescingMeter, OpBatcher
from pipeline.messages import Fork, Message, Shutdown, Stats
from pipeline.trace import Tracer


class LaneError(UserError, RuntimeError):
    """Several lanes cannot be set up (e.g. a drafter that cannot be forked per request)."""


class LaneTransport:
    """Lane ``lane``'s view of rank 0's transport (the :class:`pipeline.transport.Transport` surface): sends are
    stamped with the lane, receives are this lane's messages only, in ring order. ``link``: the real
    transport's emulated link, so the testbed's meters find their emulator (``pipeline.emulation.emulator_of``)."""

    def __init__(self, mux: "LaneMux", lane: int, timeout_s: float | None = None) -> None:
        self.mux, self.lane, self.timeout_s = mux, lane, timeout_s
        self.rank, self.world = mux.comm.rank, mux.comm.world
        self.tracer = Tracer(self.rank, enabled=False)   # busy counters of this lane's rank-0 work
        self.link = getattr(mux.comm, "link", None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()

    def send_next(self, msg: Message) -> None:
        self.mux.send(self.lane, msg, direct=False)

    def recv_prev(self) -> Message:
        try:
            item = self._inbox.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"lane {self.lane}: no message for {self.timeout_s:g}s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def poll_prev(self) -> list[Message]:
        """This lane's results already received, oldest first; never waits (a receive error: raised)."""
        out: list[Message] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, BaseException):
                if out:          # the messages before it first; the error stays for the next receive
                    self._inbox.put(item)
                    return out
                raise item
            out.append(item)

    def send_direct(self, msg: Message) -> None:
        self.mux.send(self.lane, msg, direct=True)

    def open_direct_inbox(self) -> None:
        pass

    def poll_direct(self) -> list[Message]:
        return []


class LaneMux:
    """Rank 0's transport split into ``lanes`` lane transports (module docstring). Invariant: ``outstanding`` =
    ring messages sent and not yet received back; the receiver thread receives only while it is positive.
    ``timeout_s``: how long a lane's receive waits (None: as long as it takes; the real transport's watchdog
    ends a job whose peer is lost, ``pipeline.comm``); ``switches`` counts ring sends whose lane differs from the
    previous send's (how much the lanes interleaved)."""

    def __init__(self, comm, lanes: int, timeout_s: float | None = None) -> None:
        if rank := getattr(comm, "rank", 0):
            raise ValueError(f"lanes are rank 0's: this transport is rank {rank}'s")
        self.comm = comm
        self.lanes = [LaneTransport(self, i, timeout_s) for i in range(lanes)]
        self.switches, self._last_lane = 0, None
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self.outstanding = 0
        self.error: BaseException | None = None
        self._closing = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True, name="flowspec-lanes")
        self._thread.start()

    def transport(self, lane: int) -> LaneTransport:
        return self.lanes[lane]

    def send(self, lane: int, msg: Message, direct: bool) -> None:
        if isinstance(msg, Shutdown):
            raise ValueError("Shutdown is global: LaneMux.shutdown, not a lane's send")
        if self.error is not None:
            raise self.error
        msg.lane = lane
        with self._send_lock:
            if direct:
                self.comm.send_direct(msg)
                return
            with self._cv:
                self.outstanding += 1
                self._cv.notify_all()
            self.switches += self._last_lane is not None and lane != self._last_lane
            self._last_lane = lane
            self.comm.send_next(msg)

    def _receive(self) -> None:
        while True:
            with self._cv:
                while self.outstanding == 0 and not self._closing:
                    self._cv.wait()
                if self.outstanding == 0:
                    break
            try:
                msg = self.comm.recv_prev()
            except BaseException as e:   # a lost peer, a timeout: every lane's next receive raises it
                self._fail(e)
                return
            with self._cv:
                self.outstanding -= 1
            if isinstance(msg, Shutdown):
                break
            if not 0 <= msg.lane < len(self.lanes):
                self._fail(RuntimeError(f"a message of lane {msg.lane} came back; rank 0 runs lanes "
                                        f"0..{len(self.lanes) - 1}"))
                return
            self.lanes[msg.lane]._inbox.put(msg)
        self._done.set()

    def _fail(self, e: BaseException) -> None:
        self.error = e
        for t in self.lanes:
            t._inbox.put(e)
        self._done.set()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """End every stage (``Shutdown`` on the direct links and the ring) and the receiver thread; call it
        after every lane's generation has ended."""
        with self._send_lock:
            self.comm.send_direct(Shutdown())   # ends the stages' direct-decision inboxes
            with self._cv:
                self.outstanding += 1
                self._closing = True
                self._cv.notify_all()
            self.comm.send_next(Shutdown())
        self._done.wait(timeout_s)

    def close(self) -> None:
        """Stop the receiver thread without ending the stages (nothing may be outstanding)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(5)


class DeviceLock(OpBatcher):
    """Rank 0's one device shared by the lanes: an :class:`pipeline.coalesce.OpBatcher`. Every rank-0 model op of
    a lane holds it (:meth:`OpBatcher.hold`: one op at a time, as on one device, so the emulated testbed's pads do
    not overlap either, which would model a rank 0 with several devices; re-entrant within a thread), and the
    row-wise ``lm_head`` ops of lanes that wait for it at once run as ONE op over their rows
    (:meth:`OpBatcher.run`, through :class:`pipeline.coalesce.CoalescingMeter` on every lane site)."""


def _is_meter(obj) -> bool:
    return callable(getattr(obj, "op", None)) and not isinstance(obj, torch.nn.Module)


def _shared(obj, memo: dict, seen: set, depth: int = 0) -> None:
    """Put every module, parameter, meter and tracer reachable from ``obj`` into ``memo`` (deepcopy then keeps
    them shared instead of copying them)."""
    if id(obj) in seen or depth > 12 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.nn.Module, torch.nn.Parameter, Tracer)) or _is_meter(obj):
        memo[id(obj)] = obj
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for x in obj:
            _shared(x, memo, seen, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            _shared(x, memo, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for x in vars(obj).values():
            _shared(x, memo, seen, depth + 1)


def fork_drafter(drafter):
    """A drafter for another lane: a deep copy of ``drafter`` that shares its modules (the draft head's and the
    target's weights), meters and tracers, and owns everything else (the draft KV cache, a reduced vocabulary's
    context set, the sampling generator, lookup/suffix state). None stays None. A drafter that cannot be copied
    (one that runs threads, e.g. online learning) is a :class:`LaneError`."""
    if drafter is None:
        return None
    if getattr(drafter, "slots", None) is not None and hasattr(drafter, "inner"):
        raise LaneError("serve.max_active > 1 cannot fork an online-learning drafter (osd.enabled): "
                        "use serve.max_active=1 with osd")
    memo: dict = {}
    _shared(drafter, memo, set())
    try:
        return copy.deepcopy(drafter, memo)
    except (TypeError, copy.Error, RuntimeError) as e:
        raise LaneError(f"serve.max_active > 1: the drafter {type(drafter).__name__} cannot be forked per request "
                        f"({str(e).splitlines()[0][:120]}); use serve.max_active=1") from None


def _lock_sites(drafter, lock: DeviceLock) -> None:
    """Put ``lock`` outermost on every metered site of ``drafter`` (:func:`draft.protocol.meter_sites`: a
    :class:`pipeline.coalesce.CoalescingMeter` over the site's meter); a site already on ``lock`` is left alone."""
    for site in meter_sites(drafter):
        m = getattr(site, "meter", None)
        if m is None or (isinstance(m, CoalescingMeter) and m.batcher is lock):
            continue
        site.meter = CoalescingMeter(lock, m)


def lane_engine(base, transport: LaneTransport, lock: DeviceLock, rank0_meter=None):
    """Lane ``transport.lane``'s engine (module docstring): ``base``'s model, configuration, stop ids and
    observers; its own drafter fork (and small LM fork for ``sps``), generation counter and tracer; the emulated
    testbed's meters when ``base``'s transport has an emulated link (``rank0_meter()``: another meter stacked the
    same way, on the engine and every drafter site, e.g. a test's pad); ``lock`` over every rank-0 model op."""
    from pipeline.emulation import instrument_rank0
    from pipeline.engine import Engine
    drafter = fork_drafter(base.drafter)
    sps = drafter if base.sps_drafter is not None and base.sps_drafter is base.drafter \
        else fork_drafter(base.sps_drafter)
    engine = Engine(base.model, transport, drafter, base.stop_ids, base.cfg, sps)
    instrument_rank0(engine, transport)
    if rank0_meter is not None:
        engine.meter = MeterStack(engine.meter, rank0_meter())
        if drafter is not None:
            install_meter(drafter, rank0_meter())
    if sps is not None and sps is not drafter and hasattr(sps, "meter"):
        sps.meter = engine.meter   # as pipeline.build.make_sps_drafter: metered like the engine's own work
    engine.meter = CoalescingMeter(lock, engine.meter)
    _lock_sites(drafter, lock)
    if sps is not drafter:
        _lock_sites(sps, lock)
    engine.step_observers = list(base.step_observers)
    # generation numbers continue from the base engine's: a stage drops a late direct decision only by its
    # generation (StageTree.offer), so a number the base engine used on lane 0 (a server's warm-up) must not return
    engine.gen = base.gen
    return engine


def prefix_source(holders: list[int], lane: int) -> int | None:
    """The lane a choice on ``lane`` copies the shared prompt prefix from: the first of ``holders`` (lanes whose
    committed prefix holds the prompt, oldest first) other than ``lane`` itself; None when there is none (then the
    choice prefills the prompt itself). Pure."""
    return next((h for h in holders if h != lane), None)


class SharedPrefill:
    """One prompt's prefill shared by the ``n`` choices of a request (OpenAI's ``n``; ``pipeline.serve``'s
    ``submit_n``): the first choice to start prefills the prompt as usual; every later one, on another lane,
    sends one :class:`pipeline.messages.Fork` round the ring instead, so each stage copies a holder lane's first
    ``len(prompt)`` committed KV slots into its own lane (:meth:`model.kv_cache.KVCache.copy_prefix_to`), and
    starts decoding with the prefill's rank-0 results: the target's logits of the last prompt position and every
    prompt position's features (copied; the drafter's prompt pass then runs from them in the mode, as after any
    prefill, so the drafter's KV cache and its committed tokens are exactly what its own prefill would give).

    What is copied is exactly what a prefill of the same tokens computes (the same chunks through the same
    forwards on the same stages, deterministic), so a forked choice's state equals its own prefill's bit for bit
    (``tests/test_prefill_share.py``), its output is its ``n = 1`` answer (greedy: the single answer; sampled: its
    own seed's draws) and nothing in the modes changes.

    Invariants (the :class:`pipeline.messages.Fork` sender's): ``holders`` are lanes whose generation of this
    prompt is running (their prefill is complete); a lane leaves ``holders`` (:meth:`drop`) before it is released
    to the pool, i.e. before any resetting ``Context`` of another request can be sent on it; a ``Fork`` is sent
    under the same lock, so its source is still a holder when the message enters the ring, and the ring's FIFO
    order brings it to every stage before anything that could reset the source. A choice that finds no holder and
    no prefill in progress prefills itself (e.g. ``n`` > ``serve.max_active``: choice 0 ended before choice 2
    started); while one choice's prefill is in flight the others wait for it rather than prefill the same prompt
    next to it. On an engine that is not a lane's (``serve.max_active = 1``: one KV cache per stage, reset by
    every generation) :meth:`prefill` is the engine's own prefill (today's behaviour)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self._cv = threading.Condition()
        self.result = None                  # (logits, features) of the first completed prefill
        self.holders: list[int] = []
        self.prefilling = False
        self.forks = 0                      # choices that started from a Fork (no prefill of their own)

    def hook(self, on_fork=None):
        """:meth:`prefill` as ``timed_generation``'s ``prefill`` argument; ``on_fork()`` is called when the
        generation starts from a ``Fork`` (no prefill of its own)."""
        return lambda engine, prompt_ids: self.prefill(engine, prompt_ids, on_fork)

    def prefill(self, engine, prompt_ids: list[int], on_fork=None):
        """``timed_generation``'s prefill hook: ``(logits, features)`` of the prompt on ``engine``'s lane."""
        if list(prompt_ids) != self.prompt_ids:
            raise ValueError("SharedPrefill: another prompt than the one shared")
        comm = engine.comm
        if not isinstance(comm, LaneTransport):
            return engine.prefill(prompt_ids)
        lane = comm.lane
        with self._cv:
            while True:
                src = prefix_source(self.holders, lane) if self.result is not None else None
                if src is not None or not self.prefilling:
                    break
                self._cv.wait()
            if src is None:
                self.prefilling = True
            else:   # sent under the lock: the source cannot leave (drop) before the Fork is in the ring
                engine.gen += 1
                comm.send_next(Fork(engine.gen, src, len(prompt_ids)))
                self.holders.append(lane)
        if src is None:
            try:
                logits, features = engine.prefill(prompt_ids)
            finally:
                with self._cv:
                    self.prefilling = False
                    self._cv.notify_all()
            with self._cv:
                if self.result is None:
                    self.result = (logits, features)
                self.holders.append(lane)
                self._cv.notify_all()
            return logits, features
        back = comm.recv_prev()
        if not isinstance(back, Fork):
            raise RuntimeError(f"lane {lane}: expected the Fork back, got {type(back).__name__}")
        self.forks += 1
        if on_fork is not None:
            on_fork()
        logits, features = self.result
        return logits.clone(), features.clone()

    def drop(self, lane: int) -> None:
        """``lane``'s generation has ended: it is no longer a source (call before the lane is released)."""
        with self._cv:
            if lane in self.holders:
                self.holders.remove(lane)
            self._cv.notify_all()


def ring_share(world: int, active: int, per_link: float = 1.0) -> int:
    """Live segments each of ``active`` requests keeps in flight on a ring of ``world`` links: all of them alone,
    else a share of ``per_link`` segments per link rounded up (``ceil(per_link * world / active)``, between one and
    ``world``; pure; ``per_link`` is ``serve.ring_share``).

    Why: a stage forward costs about the same for 1 or 16 rows (weight streaming), so a stage's capacity is
    forwards, not rows. Alone, a FlowSpec request keeps every link busy with speculative segments (its stage 1 is
    about 75% busy on the edge profile), and several requests each doing so only queue behind each other; with
    equal shares the ring carries about as many segments as alone, each lane's less speculative, and the
    forwards go to the segments most likely to be accepted (each lane's best nodes first). Since a stage step
    carries every lane's waiting segment in one forward (:mod:`pipeline.batching`), more segments in flight cost
    more rows per forward rather than more forwards: docs/results.md §41 measures ``per_link`` again.

    ``serve.ring_share=0.5`` (docs/results.md, §53 ("Four clients"), with ``serve.lane_rows``): at four active
    requests on four stages one live segment each instead of two. A lane's second segment is sent before the
    first one's verification, and at about two tokens per step with frequent round ends (a bonus token the tree
    lacks) the decision that arrives before it mostly kills it; stage 1 learns decisions only on the ring, so it
    computes those rows anyway. Measured: four clients 2.57x one client's tokens/s at 1.32x its latency (stages
    61% busy) against 2.31x / 1.52x: the default since. It had made a seeded sampled
    ``continuous`` choice differ from its seed alone (tests/test_prefill_share.py): a node verified at another
    step had other children, and the verifier's draws depended on them; ``pipeline.verify`` now draws first
    ("Draw first"), so a seeded answer does not depend on the share."""
    if active <= 1:
        return world
    return max(1, min(world, math.ceil(per_link * world / active - 1e-9)))


def lane_rows(active: int, rows: int) -> int | None:
    """Most nodes one segment of a request carries while ``active`` requests share the ring: ``rows``
    (``serve.lane_rows``) when several are active, None (no limit: the mode's own sizes) alone or with ``rows`` 0
    (off; the default is 16, ``serve.lane_rows``). Pure.

    Why: after a verified step a FlowSpec request sends every waiting node in one segment
    (``tree.expand_subseq_token = -1``): on the edge testbed four active requests sent 42 nodes per verified step
    for one accepted draft token (docs/results.md, §53 ("Four clients")). Alone that is free: its ring is not full.
    Shared, every row is paid on every hop (a hidden state per row on each link: 0.44 ms per row per hop at 150
    Mbps, so 42 rows cost 18 ms per hop against a 25 ms stage forward) and the links and stages are queues that
    every lane's segments wait in. The rows the target accepts are the tree's best nodes, which a segment carries first
    (score order), so a cap keeps almost every accepted token while the rest of the tree stays on rank 0, waiting
    for the next segment (still sent, and still verified in score order: only the schedule changes, never what
    is verified or the output). A request alone is unchanged (same trees, same segments)."""
    if active <= 1 or rows <= 0:
        return None
    return rows


AUTO_MAX_ACTIVE = 4   # serve.max_active=0 (the default): docs/results.md, §53 ("Four clients") measured 1, 2 and 4


def auto_max_active(setting: int, osd_enabled: bool) -> int:
    """Requests a server keeps in flight: ``setting`` (``serve.max_active``) when it is > 0; 0 (auto, the default):
    :data:`AUTO_MAX_ACTIVE`, or 1 with online learning (``osd.enabled``: one request at a time, draft/osd.py
    "Lanes"). Pure.

    Why 4 (docs/results.md §34, §53 ("Four clients")): four clients get 2.0-2.3x one client's tokens/s on four lanes
    against 0.9x one at a time (and wait 1.4-1.7x a lone request's latency instead of 4.2x), one client alone is as
    fast on either, and two lanes give four clients less than four do; each lane costs every stage one KV cache of
    ``model.max_seq_len`` slots, allocated only when a lane is first used."""
    if setting > 0:
        return setting
    return 1 if osd_enabled else AUTO_MAX_ACTIVE


class LanePool:
    """``lanes`` lane engines over ``base``'s transport (module docstring), a free list of lanes and the control
    lane (``lanes``: the idle keep-alive's ``Stats`` trips, no KV cache on any stage).

    ``acquire`` gives a free lane (None after ``timeout``), ``release`` returns it; a lane's prefill keeps
    :data:`pipeline.engine.PREFILL_WINDOW` chunks in flight when it starts alone and one chunk at a time when
    other lanes are busy (their segments then wait behind at most one chunk of it per stage)."""

    def __init__(self, base, lanes: int, timeout_s: float | None = None, rank0_meter=None,
                 report_idle: bool = True) -> None:
        """``base``: the engine built on rank 0's transport; from here on the pool owns that transport's receive
        side, so ``base`` must not generate again (its generation numbers continue in the lane engines).
        ``rank0_meter``: :func:`lane_engine`'s. ``report_idle``: :meth:`report` whenever the last active lane is
        released (a server's log line per busy period; the Python API reports at :meth:`shutdown` only)."""
        if lanes < 1:
            raise ValueError("a lane pool needs at least one lane")
        self.base = base
        self.mux = LaneMux(base.comm, lanes + 1, timeout_s)
        self.lock = DeviceLock()    # rank 0's device: its ops one at a time, lm_heads coalesced (pipeline.coalesce)
        self.engines = [lane_engine(base, self.mux.transport(i), self.lock, rank0_meter) for i in range(lanes)]
        self.control = self.mux.transport(lanes)
        self._free = list(range(lanes))
        self._reported: dict | None = None   # the op counts of the last report()
        self._cv = threading.Condition()
        self.active = 0
        self.report_idle = report_idle
        world = base.comm.world
        per_link = float(getattr(getattr(getattr(base, "cfg", None), "serve", None), "ring_share", 0.5))
        rows = int(getattr(getattr(getattr(base, "cfg", None), "serve", None), "lane_rows", 0))
        for e in self.engines:
            e.ring_share = lambda: ring_share(world, self.active, per_link)
            e.lane_rows = lambda: lane_rows(self.active, rows)

    @property
    def size(self) -> int:
        return len(self.engines)

    @property
    def busy(self) -> int:
        with self._cv:
            return self.size - len(self._free)

    def acquire(self, timeout: float | None = None) -> int | None:
        from pipeline.engine import PREFILL_WINDOW
        with self._cv:
            if not self._cv.wait_for(lambda: self._free, timeout):
                return None
            lane = self._free.pop(0)
            self.active = self.size - len(self._free)
            alone = self.active == 1
        self.engines[lane].prefill_window = PREFILL_WINDOW if alone else 1
        return lane

    def wait_free(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``) until a lane is free, without taking it (a server then takes a request from
        its queue and :meth:`acquire` s the lane: a lane held while waiting for a request would count as active
        and shrink the others' :func:`ring_share`)."""
        with self._cv:
            return bool(self._cv.wait_for(lambda: self._free, timeout))

    def release(self, lane: int) -> None:
        with self._cv:
            if lane in self._free:
                raise ValueError(f"lane {lane} released twice")
            self._free.append(lane)
            self._free.sort()
            self.active = self.size - len(self._free)
            idle = self.active == 0
            self._cv.notify_all()
        if idle and self.report_idle:
            self.report()

    def report(self) -> None:
        """One stderr line of rank 0's op counts since the pool started (:meth:`OpBatcher.summary`: how many ops
        were coalesced), when they changed since the last line; the pool calls it whenever its last active lane
        is released (a server logs it once per busy period) and at :meth:`shutdown`."""
        counts = dict(self.lock.counts)
        if counts != self._reported:
            self._reported = counts
            print(f"[rank 0] {self.lock.summary()}", file=sys.stderr, flush=True)

    def keepalive(self) -> None:
        """One ``Stats`` trip on the control lane (keeps idle stages' receives alive)."""
        self.control.send_next(Stats(torch.zeros(self.base.comm.world, dtype=torch.float64)))
        self.control.recv_prev()

    def shutdown(self) -> None:
        self.mux.shutdown()
        self.report()
