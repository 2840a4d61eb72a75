"""Operation logs: what every rank did during a replay, in order, and the host time in between.

This is the contract between the replay (:mod:`.replayer`, which writes the logs) and the timing model
(:mod:`.timing`, which reads them). An op is a tuple whose first item names its kind:

* ``("host", s)``: ``s`` seconds of the rank's own bookkeeping (tree building, verification, pruning, message
  encoding), measured as **thread CPU time** between two logged ops; ``("host", s, ops, syncs)`` when the log
  counts operators (:meth:`OpLog.count`: rank 0 under ``--rank0-cost ops``): the aten operators dispatched and
  the would-be host<->device synchronisations in that interval (:mod:`pipeline.tools.opcount`), which
  :mod:`.pricing` prices per device;
* ``("compute", w, ctx)``: a stage forward of ``w`` rows over ``ctx`` cached slots;
* ``("lm_head", rows, share, real_s)``, ``("draft", w, ctx, real_s)``, ``("ssm", w, ctx, real_s)``: rank 0's
  lm_head (over ``share`` of the vocabulary: < 1 for a reduced draft vocabulary) / draft-head / small-draft-LM
  applications, with the CPU time they really took (used when rank 0 is not modeled);
* ``("send", dst, hidden_rows, other_bytes)``, ``("recv", src)``: ring messages (modeled bytes);
* ``("dsend", dst, bytes)`` (rank 0), ``("poll", received so far)`` (a stage): direct decisions
  (:mod:`.transport`);
* ``("mark", name)``: rank 0's generation marks (``decode_begin``, ``gen_end``: the decode windows).

Invariant: an :class:`OpLog` is written only from its own rank's thread, so the thread CPU time between two
ops is that rank's host work and nothing else's (operator counting is thread-local too). A modeled op's own
CPU time and operators are recorded with it (:meth:`OpLog.modeled`), never as host work; neither are untimed
work's (:meth:`OpLog.untimed`).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from config.profiles import message_parts


class OpLog:
    """One rank's ordered operations. Must be used only from that rank's thread (host time is thread CPU time).

    Ops are tuples: ``("host", s)``, ``("compute", w, ctx)``, ``("lm_head", rows, share, real_s)``,
    ``("draft", w, ctx, real_s)``, ``("ssm", w, ctx, real_s)``, ``("send", dst, hidden_rows, other_bytes)``,
    ``("recv", src)``, ``("mark", name)``.
    """

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.last = time.thread_time()
        self.counter = None                 # an active pipeline.tools.opcount.OpCounter (count())
        self.seen = (0, 0)                  # its (ops, syncs) already attributed

    def count(self, counter) -> None:
        """From now on, host ops carry the operators and syncs ``counter`` (an active
        :class:`pipeline.tools.opcount.OpCounter` on this log's thread) counted since the previous op."""
        self.counter = counter
        self.seen = self._counts()

    def _counts(self) -> tuple[int, int]:
        c = self.counter.count
        return c.ops, c.syncs

    def _host(self) -> None:
        now = time.thread_time()
        if self.counter is None:
            if now > self.last:
                self.ops.append(("host", now - self.last))
        else:
            ops, syncs = self._counts()
            d_ops, d_syncs = ops - self.seen[0], syncs - self.seen[1]
            if now > self.last or d_ops or d_syncs:
                self.ops.append(("host", max(0.0, now - self.last), d_ops, d_syncs))
            self.seen = (ops, syncs)
        self.last = now

    def _skip_counts(self) -> None:
        if self.counter is not None:
            self.seen = self._counts()

    def add(self, *op) -> None:
        self._host()
        self.ops.append(op)

    @contextmanager
    def modeled(self, kind: str, *args):
        """A modeled operation: its own CPU time is recorded with it, not as host work."""
        self._host()
        t0 = time.thread_time()
        try:
            yield
        finally:
            now = time.thread_time()
            self.ops.append((kind, *args, now - t0))
            self.last = now
            self._skip_counts()

    @contextmanager
    def untimed(self):
        """Work that is not part of the replayed run (instrumentation such as a step observer): its CPU time
        is left out of the next host op."""
        t0 = time.thread_time()
        if self.counter is not None:
            before, was_quiet = self._counts(), self.counter.quiet
            self.counter.quiet = True       # nothing it dispatches is rank 0's work
        try:
            yield
        finally:
            self.last += time.thread_time() - t0
            if self.counter is not None:
                self.counter.quiet = was_quiet
                self.seen = (self.seen[0] + self._counts()[0] - before[0], self.seen[1] + self._counts()[1] - before[1])


class Recorder:
    """The ring observer: per-rank :class:`OpLog` entries for every send and receive."""

    def __init__(self, world: int, row_factors: list[int] | None = None) -> None:
        self.logs = [OpLog() for _ in range(world)]
        # hidden rows' worth per row each rank sends (EAGLE-3 taps: model.stage_format.tap_row_factors); the
        # replay's stand-in stages send 2-column rows, so the real width is modeled here
        self.row_factors = row_factors or [1] * world

    def on_send(self, rank, dst, msg) -> None:
        rows, other = message_parts(msg)
        self.logs[rank].add("send", dst, rows * self.row_factors[rank], other)

    def on_recv(self, rank, src) -> None:
        self.logs[rank].add("recv", src)


class MarkTracer:
    """Rank 0's tracer: spans are no-ops; generation marks go to the op log (decode window)."""

    def __init__(self, log: OpLog) -> None:
        self.log, self.busy_s, self.rank, self.enabled = log, 0.0, 0, False

    @contextmanager
    def span(self, name, **meta):
        yield

    def mark(self, name, **meta) -> None:
        self.log.add("mark", name)

    def reset_counters(self) -> None:
        pass
