"""The whole ring in one process: one thread per rank, one FIFO queue per link.

:class:`LocalComm` implements exactly the :class:`pipeline.comm.Comm` surface that the engine, the modes and
the stage workers use (``rank``, ``world``, ``tracer``, ``send_next``, ``recv_prev``, ``poll_prev``, ``send_direct``,
``open_direct_inbox``, ``poll_direct``) with the same ordering guarantees as the real transport: one FIFO per
link, direct messages from rank 0 received in issue order. Messages go through the real wire codec (``pipeline.messages``), so a message cannot smuggle
anything the real transport would drop.

Used by the protocol tests (``pipeline/inprocess.py``) and by the what-if simulator
(``pipeline/tools/simulate/``), which passes an ``observer`` to see every send and receive, and turns direct
decision delivery off (``direct=False``: decisions then reach the stages on the ring only, a schedule that
does not depend on thread timing).
"""
from __future__ import annotations

import queue
import threading
from contextlib import contextmanager

from pipeline.messages import Message, Shutdown, decode, encode
from pipeline.trace import Tracer

TIMEOUT_S = 60.0


class LocalRing:
    def __init__(self, world: int) -> None:
        self.world = world
        self.links = [queue.Queue() for _ in range(world)]      # links[r]: r -> r+1
        self.direct = [queue.Queue() for _ in range(world)]     # direct[r]: rank 0's direct messages to r


class LocalComm:
    """Rank ``rank``'s end of a :class:`LocalRing`.

    ``observer`` (optional) has ``on_send(rank, dst, msg)`` and ``on_recv(rank, src)``; each is called from
    the calling rank's own thread, before a send and after a receive.
    """

    def __init__(self, ring: LocalRing, rank: int, tracer: Tracer | None = None, observer=None,
                 timeout_s: float = TIMEOUT_S, direct: bool = True) -> None:
        self.ring, self.rank, self.world = ring, rank, ring.world
        self.direct = direct
        self.tracer = tracer or Tracer(rank, enabled=False)
        self.observer = observer
        self.timeout_s = timeout_s

    @staticmethod
    def wire(msg: Message) -> Message:
        header, payload = encode(msg)   # fresh tensors: the decoded message may own them (no copy)
        return decode(header, payload, share=True)

    def send_next(self, msg: Message) -> None:
        dst = (self.rank + 1) % self.world
        if self.observer is not None:
            self.observer.on_send(self.rank, dst, msg)
        self.ring.links[self.rank].put(self.wire(msg))

    def recv_prev(self) -> Message:
        prev = (self.rank - 1) % self.world
        try:
            msg = self.ring.links[prev].get(timeout=self.timeout_s)
        except queue.Empty:   # (a bare queue.Empty said nothing of who waited for whom)
            raise TimeoutError(f"rank {self.rank}: no message from rank {prev} for {self.timeout_s:g} s "
                               f"(comm.timeout_s sets how long the in-process ring waits, at least 60 s)") from None
        if self.observer is not None:
            self.observer.on_recv(self.rank, (self.rank - 1) % self.world)
        return msg

    def poll_prev(self) -> list[Message]:
        """Ring messages already queued on the link from the predecessor, oldest first; never waits."""
        link = self.ring.links[(self.rank - 1) % self.world]
        out = []
        while True:
            try:
                out.append(link.get_nowait())
            except queue.Empty:
                return out
            if self.observer is not None:
                self.observer.on_recv(self.rank, (self.rank - 1) % self.world)

    def send_direct(self, msg: Message) -> None:
        if not self.direct:
            return
        for r in range(2, self.world):
            if self.observer is not None:
                self.observer.on_send(self.rank, r, msg)
            self.ring.direct[r].put(self.wire(msg))

    def open_direct_inbox(self) -> None:
        pass

    def poll_direct(self) -> list[Message]:
        out = []
        while True:
            try:
                out.append(self.ring.direct[self.rank].get_nowait())
            except queue.Empty:
                return out


@contextmanager
def stage_threads(world: int, run_stage, ring: LocalRing | None = None):
    """Run ``run_stage(r)`` for ranks 1..world-1 in daemon threads for the duration of the block.

    Yields the list that collects the threads' exceptions; the block must end the stages (``Shutdown``) unless
    one failed. On exit the threads are joined and the first stage error, if any, is raised. With ``ring``, a stage
    still waiting a second after the block (the block failed, or lost a message: a planted bug, a lane's
    timeout) is handed a ``Shutdown`` on every link instead of being waited for until its receive times out
    (FIFO links: behind whatever is still queued, so an orderly end is unchanged)."""
    errors: list[BaseException] = []

    def guarded(r: int) -> None:
        try:
            run_stage(r)
        except BaseException as e:  # surfaced by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in range(1, world)]
    for t in threads:
        t.start()
    try:
        yield errors
    finally:
        for t in threads:
            t.join(timeout=30 if ring is None else 1)
        if ring is not None and any(t.is_alive() for t in threads):
            for link in ring.links:
                link.put(Shutdown())
            for t in threads:
                t.join(timeout=30)
    if errors:
        raise errors[0]
