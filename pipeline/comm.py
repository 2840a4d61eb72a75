"""Point-to-point ring links and rank 0's direct decision links over ``torch.distributed``, with dead-rank
detection. No collective runs in the decode loop.

* One ordered channel per link: header on tag 0, payload on tag 1, sent with ``isend`` (never blocking
  the sender, so a ring where everyone sends before receiving cannot deadlock) and received in order.
* Direct links rank 0 -> stage r >= 2 carry decisions (and the final ``Shutdown``) the moment rank 0 makes
  them; a stage keeps one receive posted and :meth:`Comm.poll_direct` hands over what arrived without waiting.
* A heartbeat thread bumps a counter in the rendezvous store; a watchdog exits the process with a
  message naming the lost rank when a peer's counter stops moving for ``timeout_s`` or a peer reports
  a failure. Communication errors are turned into :class:`PeerLost` naming the lost rank.
* A rank that goes down on purpose (error, lost peer, signal) writes a failure record naming the root
  cause (``root|reason``), so every survivor names the rank that was really lost, not the neighbour that
  gave up after it. When rank 0 hosts the rendezvous store (plain env launch, not torchrun's agent store)
  it waits (a few seconds at most) until the others have read the record; when that store vanishes,
  rank 0 is the lost rank. Fatal exits go through :func:`pipeline.faults.fatal` (one line, ``os._exit``).
* Rank 0 loads more than a stage (tokenizer, draft head, warm-up), for longer than ``timeout_s`` on a slow disk:
  a stage waits for rank 0's first message in :meth:`Comm.wait_for_rank0` (the store, watched by the
  heartbeats), not in a receive bounded by ``timeout_s``.
* ``dist.init_process_group`` is bounded by ``timeout_s`` (a backstop thread): a rank that never shows up
  or a foreign program on ``MASTER_PORT`` ends in a one-line :class:`RendezvousError`, never a hang.
"""
from __future__ import annotations

import datetime
import os
import queue
import re
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from config.errors import UserError
from pipeline import faults
from pipeline.messages import (HEADER_LEN, MAGIC, Context, Message, Segment, Shutdown, decode, decode_at, encode,
                               layout, payload_size, shapes, write_at)
from pipeline.trace import Tracer

HB_PREFIX = "flowspec/hb/"
FAIL_PREFIX = "flowspec/fail/"
DONE_PREFIX = "flowspec/done/"
READY_KEY = "flowspec/ready/0"   # rank 0 posted its first message (Comm.wait_for_rank0)
STOP_KEY = "flowspec/launch/stop"   # written by pipeline.tools.launch before it passes an operator's signal on
RECORD_CHARS = 200                  # a record's text is shown at most this long (see record_text)
MAX_PENDING = 64   # sends per destination kept in flight before the oldest is waited for (see Comm.send)
HEADER_BYTES = HEADER_LEN * 8
FRAME_BYTES = 256 * 1024   # gloo wire: a message whose header + payload fit travels as one frame (see Comm.send)


def wire_sizes(payload_bytes: int) -> list[int]:
    """Bytes of each gloo message that carries a message of ``payload_bytes`` payload (CPU wire): one frame
    (header then payload) when it fits in :data:`FRAME_BYTES`, else the header (tag 0) and the payload (tag 1).
    Sender and receiver apply the same rule to the header, so no flag is needed."""
    if HEADER_BYTES + payload_bytes <= FRAME_BYTES:
        return [HEADER_BYTES + payload_bytes]
    return [HEADER_BYTES, payload_bytes]


class PeerLost(UserError, RuntimeError):
    """Another rank failed or vanished; ``lost`` is its rank when known."""

    exit_code = 3

    def __init__(self, lost: int | None, detail: str, reason: str | None = None) -> None:
        self.lost = lost
        self.detail = detail
        self.reason = detail if reason is None else reason   # what this rank's own record repeats (unquoted)
        who = f"rank {lost}" if lost is not None else "a peer rank"
        super().__init__(f"lost {who}: {detail}")

    def fault_report(self) -> tuple[int, str, int | None]:
        return self.exit_code, self.reason, (-1 if self.lost is None else self.lost)


class RendezvousError(UserError, RuntimeError):
    """The process group could not be formed (port taken, a rank never joined, unreachable master)."""


class Stopped(UserError, RuntimeError):
    """The operator stopped the job (a signal to a launcher, passed on to every rank): not a lost rank."""

    operator_stop = True   # pipeline.faults.peer_failed / pipeline.run._fail: a stop, not a failure

    def __init__(self, sig: str, node: str) -> None:
        self.sig = sig
        super().__init__(f"stopped: the operator stopped the job ({sig} to the launcher of node {node}); exiting")
        import signal
        self.exit_code = 128 + int(getattr(signal, sig, signal.SIGTERM))

    def fault_report(self) -> tuple[int, str, int | None]:
        return self.exit_code, f"interrupted by {self.sig}", None


def record_text(raw: str, limit: int = RECORD_CHARS) -> str:
    """A failure record's free text as it may be shown: printable characters only (control characters, terminal
    escapes and line breaks become spaces or are dropped), runs of blanks collapsed, at most ``limit`` characters.

    Why: anyone who can reach the rendezvous store can write a record (on several hosts it listens on
    MASTER_ADDR), so every line that shows one quotes it as "a record in the store says: ..." (:func:`quoted`),
    never as the job's own words, and it can neither forge extra lines nor flood the terminal."""
    text = "".join(c if c.isprintable() else " " for c in str(raw))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def quoted(raw: str, reporter: int | None = None) -> str:
    """``a record in the store [by rank R] says: "TEXT"`` (TEXT: :func:`record_text`)."""
    who = "" if reporter is None else f" by rank {reporter}"
    return f'a record in the store{who} says: "{record_text(raw)}"'


class StoreUnresponsive(RuntimeError):
    """A call to the rendezvous store did not return within its deadline (its host frozen or unreachable)."""


class BoundedStore:
    """A store client whose every call returns or raises within ``deadline_s`` of wall time.

    Why: torch's TCPStore client ``timeout`` bounds waiting for a *key*, not a call to a server that is alive but
    does not answer (its host's launcher stopped with SIGSTOP, a frozen host, a pulled cable: TCP keeps the
    connection for about 15 minutes); such a call never returned, so every watchdog and launcher hung silently.
    Here one worker thread makes the calls, in order (the client is one socket); a caller waits for its call at
    most ``deadline_s`` and then gets :class:`StoreUnresponsive`. From then on the store is ``dead`` and every call
    raises at once (the worker may stay blocked in the stuck call: a daemon thread, it cannot hold the process).
    Attributes that are not methods (``port``) are read straight from the client (:meth:`__getattr__`).

    Invariant: no call through this object blocks its caller longer than ``deadline_s`` (+ scheduling)."""

    def __init__(self, store, deadline_s: float, what: str = "the rendezvous store") -> None:
        self.raw, self.deadline_s, self.what = store, float(deadline_s), what
        self.dead: str | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="flowspec-store").start()

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self._jobs.get()
            try:
                box.append(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append(e)
                box.append(None)
            done.set()

    def call(self, name: str, *args, wait_s: float | None = None):
        """``raw.name(*args)``; ``wait_s`` (< ``deadline_s``): give up sooner without declaring the store dead
        (a signal handler that must not wait long)."""
        if self.dead is not None:
            raise StoreUnresponsive(self.dead)
        box: list = []
        done = threading.Event()
        self._jobs.put((getattr(self.raw, name), args, box, done))
        if not done.wait(self.deadline_s if wait_s is None else min(wait_s, self.deadline_s)):
            if wait_s is not None and wait_s < self.deadline_s:
                raise StoreUnresponsive(f"{self.what} did not answer within {wait_s:g}s")
            self.dead = f"{self.what} did not answer within {self.deadline_s:g}s"
            raise StoreUnresponsive(self.dead)
        if len(box) == 2:
            raise box[0]
        return box[0]

    def __getattr__(self, name: str):
        """The client's methods (``set``, ``get``, ``check``, ``add``, ...) bounded through :meth:`call`; its other
        attributes (``port``) as they are."""
        attr = getattr(self.raw, name)
        return (lambda *args: self.call(name, *args)) if callable(attr) else attr


def store_on_rank0() -> bool:
    """True when rank 0 hosts the rendezvous store (env launch); False under pipeline.tools.launch (its node 0
    launcher hosts it) and torchrun's agent store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and not launcher_store()


def launcher_store() -> bool:
    """Launched by :mod:`pipeline.tools.launch`: the store is node 0's launcher's, the ranks are its clients."""
    return os.environ.get("FLOWSPEC_LAUNCH_STORE") == "1"


_store = None  # the raw store client under pipeline.tools.launch (the launcher writes failure records in it)


def _watch_records(store, rank: int, world: int, done: threading.Event, every: float) -> None:
    """Before the process group exists: a rank whose launcher recorded it as failed (it died or exited while
    the others wait to connect) ends the wait at once, naming it; so does a store that stops answering
    (``store`` is a :class:`BoundedStore`: host 0 frozen or unreachable)."""
    while not done.wait(every):
        try:
            for r in range(world):
                if r != rank and store.check([FAIL_PREFIX + str(r)]):
                    root, _, reason = store.get(FAIL_PREFIX + str(r)).decode().partition("|")
                    if done.is_set():
                        return
                    who = f"rank {root}" if root.lstrip("-").isdigit() and int(root) >= 0 else "a peer rank"
                    faults.fatal(f"[rank {rank}] error: lost {who} before the process group formed: "
                                 f"{quoted(reason)}", 3, record_text(reason))
        except Exception as e:
            if done.is_set():
                return
            how = "stopped answering (host 0 frozen or unreachable)" if isinstance(e, StoreUnresponsive) else "is gone"
            faults.fatal(f"[rank {rank}] error: lost rank 0: the rendezvous store of its launcher {how}", 3)


def init_process_group(backend: str, timeout_s: float) -> None:
    """``dist.init_process_group`` that cannot hang: errors and timeouts become :class:`RendezvousError`."""
    rank = int(os.environ.get("RANK", "0"))
    world = os.environ.get("WORLD_SIZE", "?")
    port = os.environ.get("MASTER_PORT", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{port}"
    done = threading.Event()

    def backstop() -> None:  # torch's TCPStore client can wait forever on a port held by another program
        if not done.wait(timeout_s + max(2.0, 0.1 * timeout_s)):
            faults.fatal(f"[rank {rank}] error: no rendezvous of {world} ranks at {where} within {timeout_s:g}s "
                         f"(a rank failed or was never started, or another program holds port {port})", 3)

    threading.Thread(target=backstop, daemon=True, name="flowspec-rendezvous").start()
    try:
        if launcher_store():
            global _store
            td = datetime.timedelta(seconds=timeout_s)
            _store = dist.TCPStore(os.environ["MASTER_ADDR"], int(port), None, False, td, wait_for_workers=False)
            threading.Thread(target=_watch_records, args=(BoundedStore(_store, timeout_s), rank, int(world), done, 0.2),
                             daemon=True, name="flowspec-prejoin").start()
            dist.init_process_group(backend=backend, store=_store, rank=rank, world_size=int(world), timeout=td)
        else:
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        text = str(e)
        first = next((l.strip() for l in text.splitlines() if l.strip()), type(e).__name__)[:200]
        if "EADDRINUSE" in text or "already in use" in text:
            msg = (f"cannot open the rendezvous at {where}: port {port} is already in use by another program or "
                   f"job; choose a free MASTER_PORT")
        elif "imed out" in text or "timeout" in text.lower():
            joined = re.search(r"(\d+)/(\d+) clients joined", text)
            how = f"{joined[1]} of {joined[2]} ranks joined" if joined else f"not all {world} ranks joined"
            msg = (f"rendezvous at {where} timed out after {timeout_s:g}s: {how} (a rank failed before "
                   f"connecting or was never started)")
        else:
            msg = f"rendezvous at {where} failed: {type(e).__name__}: {first}"
        raise RendezvousError(msg) from None
    finally:
        done.set()


class Comm:
    """A rank's torch.distributed connection: the real :class:`pipeline.transport.Transport` (plus the TP
    groups' ``send``/``recv``/``broadcast``), with failure detection (heartbeats, the rendezvous store)."""

    def __init__(self, backend: str = "gloo", timeout_s: float = 30.0, heartbeat_s: float = 0.5,
                 device: str = "cpu", tracer: Tracer | None = None) -> None:
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.wire_device = torch.device(device) if backend == "nccl" else torch.device("cpu")
        if not dist.is_initialized():
            faults.arm(int(os.environ.get("RANK", "0")))  # a malformed FLOWSPEC_FAULT fails before connecting
            init_process_group(backend, timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.next_rank = (self.rank + 1) % self.world
        self.prev_rank = (self.rank - 1) % self.world
        self.tracer = tracer or Tracer(self.rank, enabled=False)
        self.link = None  # pipeline.emulation.install's LinkSender when emu.profile is set: every send then
                          # waits out the modeled link (see send)
        # per destination: (works, send buffer) of sends not waited for yet, oldest first
        self._pending: dict[int, deque] = {}
        # recycled send buffers: (uint8 tensor, its int64 header view as numpy, its address)
        self._free: list[tuple] = []
        self._cpu_wire = self.wire_device.type == "cpu"
        self._rx_frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)  # reused: decoded before the next receive
        self._rx_header = self._rx_frame[:HEADER_BYTES].view(torch.long)
        self._rx_hnp = self._rx_header.numpy()
        self._pg = dist.distributed_c10d._get_default_group()
        self._direct_frame: torch.Tensor | None = None
        self._direct_header: torch.Tensor | None = None
        self._direct_work = None
        self._ahead: deque = deque()           # ring messages the read-ahead thread received (poll_prev)
        self._ahead_cv = threading.Condition()
        self._reader: threading.Thread | None = None
        self._closing = False
        self._failing = False
        raw = _store if _store is not None else dist.distributed_c10d._get_default_store()
        self.store = BoundedStore(raw, timeout_s)   # a frozen store host cannot hang a watchdog (BoundedStore)
        self._hb_count = 0
        self._seen: dict[int, tuple[str, float]] = {}
        self._announced = self.rank != 0   # rank 0: READY_KEY not written yet (post)
        self.store.set(HB_PREFIX + str(self.rank), "0")
        faults.arm(self.rank)
        faults.set_peer_hook(self._going_down, self._reported_loss)
        self._thread = threading.Thread(target=self._watchdog, daemon=True, name="flowspec-watchdog")
        self._thread.start()

    # -- ring ------------------------------------------------------------------------------------
    def send(self, dst: int, msg: Message) -> None:
        """Send ``msg`` to ``dst`` without waiting for it to be received: :meth:`post` it now or, on an emulated
        link (``self.link``, :class:`pipeline.emulation.LinkSender`), hand it to the link, which posts it when
        the modeled link would have delivered it."""
        if self.link is not None:
            if self.tracer.enabled:   # the caller's hand-off; the link thread's later post is the "send" span
                self.tracer.mark("handoff", dst=dst)
            self.link.send(dst, msg)
        else:
            self.post(dst, msg)

    def post(self, dst: int, msg: Message) -> None:
        """Post ``msg`` to ``dst`` now, without waiting for it to be received.

        Lean path (gloo, host wire): header and payload bytes are written into one recycled host buffer (no
        codec tensors, no concatenation) and posted with ``isend`` on the process group directly, as one frame
        when they fit in :data:`FRAME_BYTES` (the receiver posts a frame-sized receive; gloo accepts a shorter
        message), else as header (tag 0) then payload (tag 1): :func:`wire_sizes`. Every gloo message costs a
        rendezvous (a send completes only once the receiver has posted its receive), so one frame per hop
        instead of two halves the wake-ups per hop.

        A gloo send's work object never reports completion before ``wait``, so the sends to each destination
        are kept in a FIFO and the oldest is waited for (its buffer recycled) once more than
        :data:`MAX_PENDING` are outstanding: bounded memory, O(1) per send. That wait blocks only while
        ``dst`` lags ``MAX_PENDING`` messages behind on this link; a ring could deadlock on it only with more
        than ``MAX_PENDING`` unreceived messages on every link at once (rank 0 bounds what it has in flight,
        prefill included: :meth:`pipeline.engine.Engine.prefill`).
        """
        if faults._armed:
            self._fault_point("send", msg)
        self._announce()
        tracer = self.tracer
        if tracer.enabled:
            with tracer.span("send", dst=dst):
                self._send(dst, msg)
        else:
            self._send(dst, msg)

    def _send(self, dst: int, msg: Message) -> None:
        if not self._cpu_wire:   # NCCL: codec tensors moved to the device
            parts = self._device_parts(msg)
            self._queue(dst, [self._guard(lambda: dist.isend(t, dst, tag=tag), dst) for tag, t in enumerate(parts)],
                        parts)
            return
        head, tensors, nbytes = layout(msg)
        total = HEADER_BYTES + nbytes
        slot = self._free.pop() if self._free else None
        if slot is None or slot[0].numel() < total:
            size = max(total, 2 * slot[0].numel()) if slot is not None else max(total, 4096)
            buf = torch.empty(size, dtype=torch.uint8)
            slot = (buf, buf[:HEADER_BYTES].view(torch.long).numpy(), buf.data_ptr())
        buf, hv, address = slot
        hv[len(head):] = 0
        hv[:len(head)] = head
        if nbytes:
            write_at(tensors, address + HEADER_BYTES)
        pg = self._pg
        try:
            if total <= FRAME_BYTES:   # one frame (wire_sizes)
                reqs = [pg.send([buf[:total]], dst, 0)]   # raises at once on a closed link
            else:
                reqs = [pg.send([buf[:HEADER_BYTES]], dst, 0), pg.send([buf[HEADER_BYTES:total]], dst, 1)]
        except Exception as e:
            if self._closing:
                raise
            raise self.diagnose(dst, e) from None
        self._queue(dst, reqs, slot)

    def _queue(self, dst: int, reqs: list, buf) -> None:
        q = self._pending.get(dst)
        if q is None:
            q = self._pending[dst] = deque()
        q.append((reqs, buf))
        if len(q) > MAX_PENDING:
            self._retire(dst, q)

    def _retire(self, dst: int, q: deque) -> None:
        """Wait for the oldest send to ``dst`` (surfacing its error) and recycle its buffers."""
        reqs, buf = q.popleft()
        for r in reqs:
            self._guard(r.wait, dst)
        if self._cpu_wire:
            self._free.append(buf)

    def recv(self, src: int) -> Message:
        get = self._take_ahead if (self._reader is not None and src == self.prev_rank) else self._recv_raw
        tracer = self.tracer
        if tracer.enabled:
            with tracer.span("recv", src=src):
                msg = get(src)
        else:
            msg = get(src)
        if faults._armed:
            self._fault_point("recv", msg)
        return msg

    def poll_prev(self) -> list[Message]:
        """Ring messages from the predecessor that have already arrived, oldest first; never waits
        (:class:`pipeline.transport.Transport`).

        Host wire (gloo): a gloo message lands only in a posted receive, and a send completes only once the receiver
        has posted one (a rendezvous), so "what has arrived" needs a receive posted ahead of the caller. The first
        call starts a read-ahead thread that receives the ring (``recv`` as before, its timeout and diagnosis
        included) into a FIFO until it has received ``Shutdown`` (nothing is left posted at the end); from then on
        ``recv_prev`` takes from that FIFO too, so the ring stays one FIFO. A receive error is queued in order and
        raised by the ``recv_prev`` / ``poll_prev`` that reaches it. Only a rank that polls starts the thread (a
        stage serving several lanes, :mod:`pipeline.batching`). Device wire (NCCL): always ``[]`` (a second
        thread's NCCL calls on the ring's communicator would race the caller's sends), so such a stage computes one
        message per forward."""
        if not self._cpu_wire:
            return []
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_ahead, daemon=True, name="flowspec-read-ahead")
            self._reader.start()
        out: list[Message] = []
        with self._ahead_cv:
            while self._ahead and not isinstance(self._ahead[0], BaseException):
                out.append(self._ahead.popleft())
            if not out and self._ahead:
                raise self._ahead.popleft()
        if faults._armed:
            for msg in out:
                self._fault_point("recv", msg)
        return out

    def _read_ahead(self) -> None:
        src = self.prev_rank
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)   # its own: a receive from another rank may run meanwhile
        while True:
            try:
                msg: Message | BaseException = self._recv_raw(src, frame)
            except BaseException as e:  # noqa: BLE001 - raised by the caller's receive that reaches it
                msg = e
            with self._ahead_cv:
                self._ahead.append(msg)
                self._ahead_cv.notify_all()
            if isinstance(msg, (Shutdown, BaseException)):
                return

    def _take_ahead(self, src: int) -> Message:
        with self._ahead_cv:
            while not self._ahead:
                self._ahead_cv.wait()
            item = self._ahead.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _recv_raw(self, src: int, frame: torch.Tensor | None = None) -> Message:
        """One message from ``src`` (waits); ``frame``: the receive buffer (default: the caller thread's
        ``_rx_frame``; the read-ahead thread has its own)."""
        if not self._cpu_wire:
            return self._device_message(lambda t, tag: dist.recv(t, src, tag=tag), src)
        hnp = self._rx_hnp if frame is None else frame[:HEADER_BYTES].view(torch.long).numpy()
        frame = self._rx_frame if frame is None else frame
        try:
            self._pg.recv([frame], src, 0).wait()
            return self._take_frame(hnp.tolist(), frame, src)
        except Exception as e:
            if self._closing or isinstance(e, ValueError):   # ValueError: a corrupt header
                raise
            raise self.diagnose(src, e) from None

    def _take_frame(self, h: list[int], frame: torch.Tensor, src: int) -> Message:
        """The message whose header ints ``h`` landed in ``frame``: its payload follows in the frame, or
        arrives next on tag 1 (:func:`wire_sizes`). Each tensor is allocated once and filled by one copy."""
        nbytes = shapes(h)[1]
        if HEADER_BYTES + nbytes <= FRAME_BYTES:
            return decode_at(h, frame.data_ptr() + HEADER_BYTES)
        payload = torch.empty(nbytes, dtype=torch.uint8)
        self._pg.recv([payload], src, 1).wait()
        return decode_at(h, payload.data_ptr())

    @staticmethod
    def _fault_point(point: str, msg: Message) -> None:
        if faults._armed:  # test-only injection (FLOWSPEC_FAULT); nothing to do otherwise
            faults.hit(point)
            if isinstance(msg, Context):
                faults.hit("prefill")
            elif isinstance(msg, Segment):
                faults.hit("segment")

    def send_next(self, msg: Message) -> None:
        self.send(self.next_rank, msg)

    def recv_prev(self) -> Message:
        return self.recv(self.prev_rank)

    # -- broadcast (TP groups only: the pipeline modes use no collective in the decode loop) ------------
    def broadcast(self, decision: Message | None) -> Message:
        """Rank 0 passes the message; every other rank passes ``None`` and gets it (modes tp/galaxy)."""
        if faults._armed:
            faults.hit("decision")
        with self.tracer.span("broadcast"):
            if self.rank == 0:
                self._announce()
                for t in self._device_parts(decision):
                    self._guard(lambda: dist.broadcast(t, 0), None)
                return decision
            return self._device_message(lambda t, tag: dist.broadcast(t, 0), 0)

    def _device_parts(self, msg: Message) -> list[torch.Tensor]:
        """``msg`` on the wire device as codec tensors: the header, then the payload unless it is empty."""
        header, payload = encode(msg)
        return [t.to(self.wire_device) for t in (header, payload) if t.numel()]

    def _device_message(self, op, peer: int | None) -> Message:
        """The message that ``op(tensor, tag)`` fills in on the wire device: the header (tag 0), then the payload
        (tag 1) when the header says there is one (the receiving side of :meth:`_device_parts`)."""
        header = torch.empty(HEADER_LEN, dtype=torch.long, device=self.wire_device)
        self._guard(lambda: op(header, 0), peer)
        nbytes = payload_size(header.cpu())
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.wire_device)
        if nbytes:
            self._guard(lambda: op(payload, 1), peer)
        return decode(header.cpu(), payload)

    # -- direct decision links (rank 0 -> stages 2..N) -----------------------------------------------
    def send_direct(self, msg: Message) -> None:
        """Rank 0: send ``msg`` to every stage that is not its ring successor (they get it on the ring)."""
        if faults._armed:
            faults.hit("decision")
        for r in range(2, self.world):
            self.send(r, msg)

    def open_direct_inbox(self) -> None:
        """Stages r >= 2: post the receive for rank 0's next direct message (gloo; with NCCL decisions travel
        on the ring only, see :meth:`poll_direct`)."""
        if self.rank < 2 or self.wire_device.type != "cpu" or self._direct_work is not None:
            return
        self._direct_frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self._direct_header = self._direct_frame[:HEADER_BYTES].view(torch.long)
        self._direct_work = self._guard(lambda: self._pg.recv([self._direct_frame], 0, 0), 0)

    def poll_direct(self) -> list[Message]:
        """Direct messages from rank 0 that have arrived; never waits for one.

        A receive stays posted between calls (a posted gloo receive has no deadline, unlike a blocking one,
        so a quiet link is not an error); the header's magic number, written by gloo when the message lands,
        says it has arrived, and ``wait`` then completes it at once.
        """
        out: list[Message] = []
        while self._direct_work is not None and int(self._direct_header[0]) == MAGIC:
            self._guard(self._direct_work.wait, 0)
            try:
                msg = self._take_frame(self._direct_header.tolist(), self._direct_frame, 0)
            except Exception as e:
                if self._closing or isinstance(e, ValueError):   # ValueError: a corrupt header
                    raise
                raise self.diagnose(0, e) from None
            self._direct_header[0] = 0
            self._direct_work = None
            if not isinstance(msg, Shutdown):
                self._direct_work = self._guard(lambda: self._pg.recv([self._direct_frame], 0, 0), 0)
            out.append(msg)
        if out and faults._armed:
            faults.hit("decision")
        return out

    def _close_direct_inbox(self) -> None:
        """Orderly end: take rank 0's final direct ``Shutdown`` so no receive is left posted."""
        deadline = time.monotonic() + self.timeout_s
        while self._direct_work is not None and time.monotonic() < deadline:
            self.poll_direct()
            time.sleep(0.001)

    # -- lifecycle -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every send (surfacing errors): an emulated link's queue first, then every posted one."""
        if self.link is not None:
            self.link.drain()
        for dst, q in self._pending.items():
            while q:
                self._retire(dst, q)

    def _announce(self) -> None:
        """Rank 0's first message (a ``post`` on the ring, a ``broadcast`` to a TP group) writes ``READY_KEY``."""
        if not self._announced:
            self._announced = True
            self.store.set(READY_KEY, "1")

    def wait_for_rank0(self) -> None:
        """Return once rank 0 has sent its first message (:meth:`_announce`; a TP shard calls this too).

        Why a stage calls this before its first receive: a gloo receive gives up after ``timeout_s``, and rank 0
        loads more than a stage does (tokenizer, draft head or oracle, warm-up: a 7B head from a slow disk takes
        longer than the default 30 s), so a stage that went straight into its receive exited with "lost rank 0"
        while rank 0 was alive and loading (CI's ``test_killed_stage_rank...`` at load 4, ``comm.timeout_s=5``).
        Liveness during the wait is the watchdog's: a rank that dies or stops while loading stops its
        heartbeats and every other rank exits within ``timeout_s``, naming it."""
        try:
            while not self.store.check([READY_KEY]):
                time.sleep(min(0.05, self.heartbeat_s / 4))
        except Exception as e:   # the store went away with its host (rank 0 killed while loading)
            raise self._store_lost(e) from None

    def barrier(self) -> None:
        self._guard(lambda: dist.barrier(), None)

    def close(self) -> None:
        """Orderly end: flush sends, meet everyone, then stop watching."""
        self.flush()
        self._close_direct_inbox()
        self.barrier()
        self._closing = True
        try:
            self.store.set(DONE_PREFIX + str(self.rank), "1")
        except Exception:
            pass
        self.barrier()
        faults.set_peer_hook(None)
        dist.destroy_process_group()

    def report_failure(self, reason: str, lost: int | None = None) -> None:
        """Tell the peers this rank is going down: because of ``reason`` (its own failure) or, with
        ``lost``, because it lost that rank (``reason`` then says how; ``lost < 0``: an unknown rank)."""
        root = self.rank if lost is None else ("?" if lost < 0 else lost)
        try:
            self.store.set(FAIL_PREFIX + str(self.rank), f"{root}|{reason[:500]}")
        except Exception:
            pass

    def _going_down(self, reason: str, lost: int | None) -> None:
        """:func:`pipeline.faults.fatal`'s hook: report, then (store host only) let the peers read it."""
        self._failing = True
        self.report_failure(reason, lost)
        if self.rank != 0 or not store_on_rank0():
            return
        # until every peer has gone down or finished (a killed one never will: bounded wait; a busy peer
        # may not run its watchdog for a while, hence not just a few heartbeats)
        deadline = time.monotonic() + min(self.timeout_s, max(3.0, 10 * self.heartbeat_s))
        while time.monotonic() < deadline:
            try:
                if all(r == lost or self.store.check([FAIL_PREFIX + str(r)])
                       or self.store.check([DONE_PREFIX + str(r)]) for r in range(1, self.world)):
                    return
            except Exception:
                return
            time.sleep(min(0.05, self.heartbeat_s / 4))

    # -- failure detection -----------------------------------------------------------------------
    def _guard(self, fn, peer: int | None):
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError / DistBackendError on closed sockets or timeouts
            if self._closing:
                raise
            raise self.diagnose(peer, e) from None

    def diagnose(self, peer: int | None, err: BaseException | None = None) -> PeerLost:
        """Find which rank is gone: a reported failure (its root cause), else a stale heartbeat (``peer``
        first), else ``peer``."""
        deadline = time.monotonic() + max(3 * self.heartbeat_s, 1.0)
        try:
            while True:
                lost = self._reported_loss()
                if lost is not None:
                    return lost
                stale = self._stale_peers(max(2.5 * self.heartbeat_s, 0.75))
                if peer in stale:
                    return PeerLost(peer, "its process stopped (no heartbeat)")
                if stale or time.monotonic() > deadline:
                    break
                time.sleep(self.heartbeat_s / 2)
        except Exception as e:  # the store itself is gone, or does not answer
            return self._store_lost(e)
        if stale:
            return PeerLost(stale[0], "its process stopped (no heartbeat)")
        text = str(err).strip().splitlines()[0][:160] if err and str(err).strip() else "no response"
        return PeerLost(peer, f"communication failed ({text})")

    def _store_lost(self, err: BaseException | None = None) -> PeerLost:
        how = ("stopped answering for {:g}s (frozen, powered off or unreachable)".format(self.store.deadline_s)
               if isinstance(err, StoreUnresponsive) else "is gone")
        if store_on_rank0() and self.rank != 0:
            return PeerLost(0, f"its process stopped: the rendezvous store it hosted {how}")
        if os.environ.get("GROUP_RANK", "0") != "0":  # node 0's launcher (agent) hosted it: node 0 is gone
            return PeerLost(0, f"host 0 is lost: its launcher's rendezvous store {how}")
        return PeerLost(None, f"the rendezvous store {how}: this host's launcher stopped")

    def _failed_peers(self) -> list[tuple[int, int | None, str]]:
        """``(reporter, root cause rank or None, reason)`` of every peer that reported going down."""
        out = []
        for r in range(self.world):
            if r != self.rank and self.store.check([FAIL_PREFIX + str(r)]):
                root, _, reason = self.store.get(FAIL_PREFIX + str(r)).decode().partition("|")
                root = int(root) if root.lstrip("-").isdigit() else None
                out.append((r, r if root == self.rank else root, reason))  # blamed us: it is the lost one
        return out

    def _reported_loss(self) -> PeerLost | Stopped | None:
        """The root cause among the peers' failure records: a rank's own failure first; :class:`Stopped` when a
        launcher recorded an operator's signal (``STOP_KEY``) before passing it on.

        Why the stop key comes first: the launcher writes it before it signals any rank, so a peer's record
        "interrupted by SIGTERM" that this rank reads can only be part of that stop; reading it as a lost rank
        raced this rank's own signal handler (1 run in 6 blamed rank 1 for the operator's SIGTERM). A record's text
        is shown quoted (:func:`quoted`): anyone who reaches the store can write one."""
        failed = self._failed_peers()
        if not failed:
            return None
        if self.store.check([STOP_KEY]):
            node, _, sig = self.store.get(STOP_KEY).decode().partition("|")
            return Stopped(sig if sig in ("SIGINT", "SIGTERM", "SIGHUP") else "SIGTERM", record_text(node, 8))
        failed.sort(key=lambda f: (f[1] != f[0], f[1] is None))
        reporter, root, reason = failed[0]
        text = record_text(reason)
        if root == reporter:
            return PeerLost(root, quoted(reason), text)
        return PeerLost(root, quoted(reason, reporter), text)

    def _stale_peers(self, max_age: float) -> list[int]:
        now = time.monotonic()
        out = []
        for r in range(self.world):
            if r == self.rank or self.store.check([DONE_PREFIX + str(r)]):
                continue
            val = self.store.get(HB_PREFIX + str(r)).decode() if self.store.check([HB_PREFIX + str(r)]) else ""
            last = self._seen.get(r)
            if last is None or last[0] != val:
                self._seen[r] = (val, now)
            elif now - last[1] > max_age:
                out.append(r)
        return out

    def _watchdog(self) -> None:
        while not (self._closing or self._failing):
            try:
                self._hb_count += 1
                self.store.set(HB_PREFIX + str(self.rank), str(self._hb_count))
                lost = self._reported_loss()
                stale = self._stale_peers(self.timeout_s)
            except Exception as e:
                if self._closing or self._failing:
                    return
                lost, stale = self._store_lost(e), []
            if self._closing or self._failing:
                return
            if lost is None and stale:
                lost = PeerLost(stale[0], f"its process stopped (no heartbeat for {self.timeout_s:g}s)")
            if lost is not None:
                self._die(lost)
            time.sleep(self.heartbeat_s)

    def _die(self, lost: PeerLost | Stopped) -> None:
        if isinstance(lost, Stopped):   # the operator's stop: this rank's own signal line, if it comes first
            faults.fatal(f"[rank {self.rank}] {lost}", lost.exit_code, f"interrupted by {lost.sig}")
        faults.fatal(f"[rank {self.rank}] error: {lost}", 3, lost.reason,
                     -1 if lost.lost is None else lost.lost)
