"""The transport interface: what the engine, the modes and the stage workers use of a rank's connection.

Three implementations: :class:`pipeline.comm.Comm` (torch.distributed point-to-point over gloo or NCCL, the real
one), :class:`pipeline.local_ring.LocalComm` (the whole ring in one process, for tests and the simulator) and
:class:`pipeline.tp_run.GroupComm` (rank 0's view of a tensor-parallel group as one stage). The decode path is
written against :class:`Transport` only, so each mode runs unchanged on all three.

Ordering guarantees every implementation keeps (the protocol's correctness rests on them):

* **ring FIFO**: messages on the link ``r -> r+1`` arrive in the order they were sent (``send_next`` /
  ``recv_prev``);
* **polling keeps the ring FIFO**: ``poll_prev`` hands over, without waiting, the ring messages that have already
  arrived, oldest first, and the next ``recv_prev`` returns the one after the last it handed over (a stage that
  computes several lanes' segments in one forward takes what is queued: :mod:`pipeline.batching`);
* **direct FIFO**: rank 0's direct messages (``send_direct``; to every stage that is not its ring successor)
  are seen by each stage in issue order (``poll_direct``), and ``poll_direct`` never waits;
* a message crosses the wire codec (:mod:`pipeline.messages`): what arrives is what the codec can carry.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from pipeline.messages import Message
from pipeline.trace import Tracer


@runtime_checkable
class Transport(Protocol):
    rank: int
    world: int
    tracer: Tracer

    def send_next(self, msg: Message) -> None:
        """Send to the ring successor ``(rank + 1) % world``; never waits for the receiver to take it."""

    def recv_prev(self) -> Message:
        """The next message from the ring predecessor (waits; a lost peer raises)."""

    def poll_prev(self) -> list[Message]:
        """Ring messages from the predecessor that have already arrived, oldest first; never waits (an empty list
        is always a correct answer: nothing is known to have arrived). They are not received again by
        ``recv_prev``."""

    def send_direct(self, msg: Message) -> None:
        """Rank 0: ``msg`` to every stage ``2..world-1`` (stage 1 gets it on the ring)."""

    def open_direct_inbox(self) -> None:
        """Stages ``r >= 2``: be ready to take rank 0's direct messages (a no-op where not needed)."""

    def poll_direct(self) -> list[Message]:
        """Direct messages from rank 0 that have arrived, oldest first; never waits."""
