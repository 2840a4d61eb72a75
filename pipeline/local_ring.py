"""The whole ring in one process: one thread per rank, one FIFO queue per link.

:class:`LocalComm` implements exactly the :class:`pipeline.comm.Comm` surface that the engine, the modes and
the stage workers use (``rank``, ``world``, ``tracer``, ``emu``, ``send_next``, ``recv_prev``, ``broadcast``)
with the same ordering guarantees as the real transport: one FIFO per link, broadcasts received in issue
order. Messages go through the real wire codec (``pipeline.messages``), so a message cannot smuggle
anything the real transport would drop.

Used by the protocol tests (``tests/threaded_ring.py``) and by the what-if simulator
(``pipeline/simulate.py``), which passes an ``observer`` to see every send, receive and broadcast.
"""
from __future__ import annotations

import queue
import threading
from contextlib import contextmanager

from pipeline.messages import Message, decode, encode
from pipeline.trace import Tracer

TIMEOUT_S = 60.0


class LocalRing:
    def __init__(self, world: int) -> None:
        self.world = world
        self.links = [queue.Queue() for _ in range(world)]      # links[r]: r -> r+1
        self.bcast = [queue.Queue() for _ in range(world)]      # bcast[r]: decisions for rank r


class LocalComm:
    """Rank ``rank``'s end of a :class:`LocalRing`.

    ``observer`` (optional) has ``on_send(rank, dst, msg)``, ``on_recv(rank, src)``, ``on_bcast_root(msg)``
    and ``on_bcast_recv(rank)``; each is called from the calling rank's own thread, before a send or root
    broadcast and after a receive.
    """

    emu = None

    def __init__(self, ring: LocalRing, rank: int, tracer: Tracer | None = None, observer=None,
                 timeout_s: float = TIMEOUT_S) -> None:
        self.ring, self.rank, self.world = ring, rank, ring.world
        self.tracer = tracer or Tracer(rank, enabled=False)
        self.observer = observer
        self.timeout_s = timeout_s

    @staticmethod
    def _wire(msg: Message) -> Message:
        header, payload = encode(msg)
        return decode(header.clone(), payload.clone())

    def send_next(self, msg: Message) -> None:
        dst = (self.rank + 1) % self.world
        if self.observer is not None:
            self.observer.on_send(self.rank, dst, msg)
        self.ring.links[self.rank].put(self._wire(msg))

    def recv_prev(self) -> Message:
        msg = self.ring.links[(self.rank - 1) % self.world].get(timeout=self.timeout_s)
        if self.observer is not None:
            self.observer.on_recv(self.rank, (self.rank - 1) % self.world)
        return msg

    def broadcast(self, decision):
        if self.rank == 0:
            if self.observer is not None:
                self.observer.on_bcast_root(decision)
            for r in range(1, self.world):
                self.ring.bcast[r].put(self._wire(decision))
            return decision
        got = self.ring.bcast[self.rank].get(timeout=self.timeout_s)
        if self.observer is not None:
            self.observer.on_bcast_recv(self.rank)
        return got


@contextmanager
def stage_threads(world: int, run_stage):
    """Run ``run_stage(r)`` for ranks 1..world-1 in daemon threads for the duration of the block.

    Yields the list that collects the threads' exceptions; the block must end the stages (``Shutdown``) unless
    one failed. On exit the threads are joined and the first stage error, if any, is raised.
    """
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
            t.join(timeout=30)
    if errors:
        raise errors[0]
