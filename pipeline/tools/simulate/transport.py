"""The simulated transport: the in-process ring with logged sends, and rank 0's direct decisions on a schedule.

A replay runs every rank in a real thread over :class:`pipeline.local_ring.LocalRing` (one FIFO per link,
messages through the real wire codec). :class:`SimComm` is :class:`pipeline.local_ring.LocalComm` with two
changes: every operation is logged (the ring's observer is a :class:`.oplog.Recorder`), and rank 0's
point-to-point decisions reach the stages on a schedule (:class:`ScheduledDirect`) instead of whenever the
threads happen to run, so that a replay's op logs never depend on thread timing.

**Passes.** Whether a decision reached a stage before it computed a segment is only known once a pass has been
timed (:func:`.timing.simulate_timing`). Pass 0 delivers no direct decision (ring-only: the copy riding on the
next segment); the timing of pass ``k`` (:class:`DirectTimes`) gives the delivery schedule of pass ``k + 1``
(:meth:`DirectTimes.schedule`). Invariants: rank 0's operations are the same in every pass (it verifies the
same rows and sends the same segments whatever the stages prune); delivered decisions are never repeated; and
no pass can deadlock (see :class:`ScheduledDirect`).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from config.profiles import message_parts
from pipeline.local_ring import LocalComm, LocalRing
from pipeline.tools.simulate.oplog import Recorder


class ScheduledDirect:
    """Rank 0's point-to-point decisions in a replay, delivered to the stages on a schedule.

    A replay runs every rank in real threads but times them afterwards (:func:`.timing.simulate_timing`), so whether a
    decision reached a stage before it computed a segment is only known after a pass. The simulator therefore
    replays in passes: pass 0 delivers no direct decision (ring-only: the copy riding on the next segment);
    pass ``k + 1`` gives stage ``r``'s ``j``-th poll (one per segment, :meth:`pipeline.worker.StageWorker._segment`)
    exactly the decisions that pass ``k``'s timing says had arrived by then (``upto[r][j]``: how many, in issue
    order). Rank 0's operations do not depend on what the stages prune (it verifies the same rows and sends
    the same segments), so every pass replays the same rank-0 schedule and only the stages' work shrinks.
    No deadlock: waiting for decision ``i`` at poll ``j`` adds a dependency that pass ``k``'s time order
    already satisfies, and the rest of the dependency graph is unchanged.
    """

    def __init__(self, world: int, upto: list[list[int]] | None = None, wait_s: float = 120.0) -> None:
        self.cond = threading.Condition()
        self.issued: list = []
        self.upto = upto
        self.taken = [0] * world
        self.polls = [0] * world
        self.wait_s = wait_s

    def issue(self, msg) -> None:
        with self.cond:
            self.issued.append(msg)
            self.cond.notify_all()

    def take(self, rank: int) -> tuple[list, int]:
        """The decisions stage ``rank`` receives at its next poll, and how many it has received in all."""
        j = self.polls[rank]
        self.polls[rank] += 1
        n = self.taken[rank]
        if self.upto is not None and rank >= 2 and j < len(self.upto[rank]):
            n = max(n, self.upto[rank][j])
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.issued) >= n, timeout=self.wait_s):
                raise RuntimeError(f"replay: stage {rank} waited for direct decision {n} that rank 0 never issued")
            out = self.issued[self.taken[rank]:n]
        self.taken[rank] = n
        return out, n


@dataclass
class DirectTimes:
    """Direct-decision timing of one simulated session: ``arrivals[r][i]`` = when decision ``i`` (issue order)
    reached stage ``r``; ``polls[r][j]`` = ``(time, decisions received so far)`` of stage ``r``'s ``j``-th poll."""

    arrivals: dict = field(default_factory=dict)
    polls: dict = field(default_factory=dict)

    def schedule(self, world: int) -> list[list[int]]:
        """For the next pass: how many decisions had reached stage ``r`` by its ``j``-th poll."""
        return [[bisect.bisect_right(self.arrivals.get(r, []), t) for t, _ in self.polls.get(r, [])]
                for r in range(world)]

    def late(self) -> tuple[int, int]:
        """(polls that received a decision before its modeled arrival, polls that received any): how far this
        pass's delivery is from its own timing (0 for pass 0, which delivers none)."""
        late = total = 0
        for r, polls in self.polls.items():
            arr = self.arrivals.get(r, [])
            prev = 0
            for t, n in polls:
                if n > prev:
                    total += 1
                    late += arr[n - 1] > t + 1e-12
                prev = n
        return late, total


# A replay's ranks are threads of one process: none can be lost, only slow (a long prompt's prefill on a loaded
# shared CPU took over LocalComm's 60 s between two ranks, which ended a 20-answer replay); a deadlock still ends.
REPLAY_TIMEOUT_S = 900.0


class SimComm(LocalComm):
    """A :class:`pipeline.local_ring.LocalComm` whose direct decisions follow ``scheduled``'s schedule and are
    logged: ``("dsend", dst, bytes)`` on rank 0, ``("poll", received so far)`` on a stage. Ring sends and
    receives are logged by ``rec`` (the ring's observer); the ring's own direct delivery is off."""

    def __init__(self, ring: LocalRing, rank: int, rec: Recorder, scheduled: ScheduledDirect, tracer=None) -> None:
        super().__init__(ring, rank, tracer=tracer, observer=rec, direct=False, timeout_s=REPLAY_TIMEOUT_S)
        self.rec, self.scheduled = rec, scheduled

    def send_direct(self, msg) -> None:
        wired = self.wire(msg)
        for r in range(2, self.world):
            self.rec.logs[self.rank].add("dsend", r, message_parts(msg)[1])
        self.scheduled.issue(wired)

    def recv_prev(self):
        msg = super().recv_prev()
        counter = self.rec.logs[self.rank].counter
        if counter is not None:      # a result's hidden states would arrive in device memory
            counter.mark([t for t in msg.tensors() if t.is_floating_point()])
        return msg

    def poll_direct(self) -> list:
        out, n = self.scheduled.take(self.rank)
        self.rec.logs[self.rank].add("poll", n)
        return out
