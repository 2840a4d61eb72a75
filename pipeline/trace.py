"""Per-rank timeline: timestamped spans (recv, compute, send, verify, prune, draft, broadcast...).

Spans always feed the busy-time counter (the union of this rank's ``BUSY`` spans: nested or overlapping
busy spans count once; see :func:`busy_fraction` for the one definition of "busy" every report uses); the
full event list is kept and written to ``<dir>/trace_rank<r>.json`` only when tracing is enabled.

Event times are seconds since the tracer's ``t0`` (this rank's ``time.perf_counter()`` at start). The dump
also carries clock anchors so that ``pipeline/tools/timeline.py`` can put every rank on one time axis:
``t0_perf`` (the raw ``perf_counter`` value: CLOCK_MONOTONIC, shared by all processes of one host, so
exact on one machine), ``t0_wall`` (``time.time()`` at the same instant: good to NTP accuracy across
hosts) and ``host``. Rank 0 adds zero-length marks around every generation (``gen_begin``,
``decode_begin``, ``gen_end``; see ``pipeline/engine.py``) so a tool can pick a generation's window.
"""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import nullcontext
from pathlib import Path

# span kinds that count as busy; "host" is the simulator's rank-0 tree/verification work (pipeline/tools/simulate/)
BUSY = {"compute", "verify", "draft", "expand", "prune", "lm_head", "host"}


def union_length(intervals) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once; empty ones ignored)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def busy_fraction(spans: dict, lo: float, hi: float, clip=None) -> float:
    """THE definition of a rank's "busy" (pipeline.run rows' ``busy_fraction``, ``pipeline.tools.timeline``'s
    utilization table and Gantt labels, ``pipeline.tools.bench``, ``pipeline.tools.simulate``'s predictions):

        busy = |union of the rank's spans of a BUSY kind, clipped to [lo, hi]| / (hi - lo)

    where [lo, hi] is a generation's *decode window* (rank 0's ``decode_begin`` -> ``gen_end``; prefill is
    excluded) and BUSY = compute, verify, draft, expand, prune, lm_head (and the simulator's ``host``).
    Overlapping or nested busy spans (``lm_head`` inside ``verify``) count once; waiting (recv, broadcast)
    and sending are not busy. ``spans``: kind -> iterable of (start, end); ``clip(intervals, lo, hi)``, when
    given, returns the intervals clipped to [lo, hi] faster (``pipeline.tools.timeline._clipped``). The live counter of
    :class:`Tracer` measures the same quantity without keeping events: the engine restarts every rank's
    counter when decode begins and reads it when the generation ends."""
    if hi <= lo:
        return 0.0
    if clip is None:
        clip = lambda v, lo, hi: [(max(a, lo), min(b, hi)) for a, b in v if b > lo and a < hi]  # noqa: E731
    return union_length([x for k, v in spans.items() if k in BUSY for x in clip(v, lo, hi)]) / (hi - lo)


class Tracer:
    def __init__(self, rank: int, enabled: bool = False) -> None:
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict] = []
        self.busy_s = 0.0
        self._busy_depth, self._busy_start = 0, 0.0   # open busy spans (any thread): union, not sum
        self.t0 = time.perf_counter()
        self.t0_wall = time.time()

    def reset_counters(self) -> None:
        self.busy_s = 0.0
        if self._busy_depth:   # a busy span is open: count only its part after the reset
            self._busy_start = time.perf_counter()

    def span(self, name: str, **meta):
        """Context manager timing one span. With tracing off a non-busy span costs nothing (a shared no-op
        context) and a busy one only feeds the busy counter (no event is kept)."""
        if name in BUSY:
            return _Span(self, name, True, meta)
        if self.enabled:
            return _Span(self, name, False, meta)
        return _NULL

    def mark(self, name: str, **meta) -> None:
        if self.enabled:
            t = time.perf_counter() - self.t0
            self.events.append({"name": name, "start": t, "end": t, **meta})

    def dump(self, out_dir: str | Path, extra: dict | None = None) -> Path | None:
        if not self.enabled:
            return None
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"trace_rank{self.rank}.json"
        head = {"rank": self.rank, "t0_perf": self.t0, "t0_wall": self.t0_wall, "host": socket.gethostname(),
                "pid": os.getpid()}
        path.write_text(json.dumps({**head, "events": self.events, **(extra or {})}))
        return path


_NULL = nullcontext()   # the span of nothing (reusable: it keeps no state)


class _Span:
    """One open span of a :class:`Tracer` (busy spans: union-counted via the tracer's depth counter)."""

    __slots__ = ("tracer", "name", "busy", "meta", "start")

    def __init__(self, tracer: Tracer, name: str, busy: bool, meta: dict) -> None:
        self.tracer, self.name, self.busy, self.meta = tracer, name, busy, meta

    def __enter__(self):
        tr = self.tracer
        self.start = start = time.perf_counter()
        if self.busy:
            if tr._busy_depth == 0:
                tr._busy_start = start
            tr._busy_depth += 1
        return None

    def __exit__(self, *exc) -> bool:
        tr = self.tracer
        end = time.perf_counter()
        if self.busy:
            tr._busy_depth -= 1
            if tr._busy_depth == 0:   # the outermost busy span closed: count the covered time once
                tr.busy_s += end - tr._busy_start
        if tr.enabled:
            tr.events.append({"name": self.name, "start": self.start - tr.t0, "end": end - tr.t0, **self.meta})
        return False
