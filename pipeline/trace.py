"""Per-rank timeline: timestamped spans (recv, compute, send, verify, prune, draft, broadcast...).

Spans always feed the busy-time counter (a rank's busy fraction = time in ``BUSY`` spans / wall time);
the full event list is kept and written to ``<dir>/trace_rank<r>.json`` only when tracing is enabled.

Event times are seconds since the tracer's ``t0`` (this rank's ``time.perf_counter()`` at start). The dump
also carries clock anchors so that ``pipeline/timeline.py`` can put every rank on one time axis:
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
from contextlib import contextmanager
from pathlib import Path

BUSY = {"compute", "verify", "draft", "expand", "prune", "lm_head"}


class Tracer:
    def __init__(self, rank: int, enabled: bool = False) -> None:
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict] = []
        self.busy_s = 0.0
        self.t0 = time.perf_counter()
        self.t0_wall = time.time()

    def reset_counters(self) -> None:
        self.busy_s = 0.0

    @contextmanager
    def span(self, name: str, **meta):
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if name in BUSY:
                self.busy_s += end - start
            if self.enabled:
                self.events.append({"name": name, "start": start - self.t0, "end": end - self.t0, **meta})

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
