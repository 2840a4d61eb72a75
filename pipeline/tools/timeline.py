"""Per-rank timeline of a traced run: Gantt chart, utilization table and CSV.

``python -m pipeline.tools.timeline TRACE_DIR [--out gantt.png] [--start S --end E | --generation K] [--window W]``
``python -m pipeline.tools.timeline TRACE_DIR --chrome trace.json``   (Chrome / Perfetto trace, see :func:`chrome_trace`)

Reads every ``trace_rank<r>.json`` written by a run with ``comm.trace=true comm.trace_dir=TRACE_DIR``
(see ``pipeline/trace.py``), puts the ranks on one time axis, and

* draws a Gantt chart, one row per rank, coloured by event kind (compute, verify, lm_head, draft,
  expand, prune = busy; recv = waiting for the previous rank, broadcast = waiting for / sending rank 0's
  decision, send), with rank 0's generation marks as vertical lines;
* prints per-rank utilization over the window: busy = union of compute/verify/lm_head/draft/expand/prune
  spans, wait = union of recv/broadcast spans, send = send spans (``isend`` posting and reaping),
  other = time in no span (Python overhead, bookkeeping);
  and writes the same numbers (plus seconds per kind) as CSV.

Clock alignment: each rank's event times are relative to its own ``perf_counter`` start; the dump's
``t0_perf`` anchor (CLOCK_MONOTONIC, common to all processes of one host) aligns ranks exactly on one
machine, ``t0_wall`` (``time.time()``) across machines (to NTP accuracy). Traces without anchors are
drawn unaligned, with a warning. The time axis is seconds since the earliest rank started.

Windows: ``--generation K`` selects the decode phase of rank 0's K-th generation (0-based, warm-ups
included, in launch order); ``--phase all`` includes its prefill; ``--start/--end`` (seconds on the
aligned axis) override either bound; ``--window W`` keeps W seconds centred in what was selected.
Default: the whole run.
"""
from __future__ import annotations

import argparse
import bisect
import csv
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from config.invocation import prog
from pipeline.trace import BUSY, busy_fraction, union_length  # noqa: F401 (union_length: re-exported)

WAIT = {"recv", "broadcast"}
MARKS = ("gen_begin", "decode_begin", "gen_end")
# drawing order = legend order; busy kinds are drawn tall, communication kinds short and light
KINDS = {
    "compute": ("tab:blue", "compute (stage layers)"),
    "verify": ("tab:red", "verify"),
    "lm_head": ("tab:orange", "lm_head"),
    "draft": ("tab:green", "draft"),
    "expand": ("yellowgreen", "expand"),
    "prune": ("tab:purple", "prune"),
    "broadcast": ("gold", "broadcast (decision)"),
    "send": ("dimgray", "send"),
    "recv": ("lightgray", "recv (waiting)"),
}


class TimelineError(RuntimeError):
    pass


@dataclass
class RankTrace:
    rank: int
    offset: float                      # add to this rank's event times to get the common axis
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # kind -> sorted (start, end)
    marks: list[tuple[str, float, dict]] = field(default_factory=list)
    sends: list[tuple[float, int]] = field(default_factory=list)   # (start, destination rank) of each send
    handoffs: list[tuple[float, int]] = field(default_factory=list)  # emulated links: when the caller handed
                                                                      # a message to the link (Comm.send)


@dataclass
class Timeline:
    ranks: dict[int, RankTrace]
    alignment: str                     # "perf" | "wall" | "none"
    warnings: list[str] = field(default_factory=list)

    @property
    def extent(self) -> tuple[float, float]:
        lo, hi = float("inf"), float("-inf")
        for rt in self.ranks.values():
            for iv in rt.spans.values():
                if iv:
                    lo, hi = min(lo, iv[0][0]), max(hi, max(e for _, e in iv))
            for _, t, _ in rt.marks:
                lo, hi = min(lo, t), max(hi, t)
        return (0.0, 0.0) if lo > hi else (lo, hi)

    def generations(self) -> list[dict]:
        """Rank 0's generations from its marks: ``{index, begin, decode_begin, end, new_tokens}``."""
        rt = self.ranks.get(0)
        gens, cur = [], None
        for name, t, meta in (rt.marks if rt else []):
            if name == "gen_begin":
                cur = {"index": len(gens), "begin": t, "decode_begin": None, "end": None,
                       "prompt_tokens": meta.get("prompt_tokens")}
            elif name == "decode_begin" and cur is not None:
                cur["decode_begin"] = t
            elif name == "gen_end" and cur is not None:
                cur["end"], cur["new_tokens"] = t, meta.get("new_tokens")
                if cur["decode_begin"] is None:
                    cur["decode_begin"] = cur["begin"]
                gens.append(cur)
                cur = None
        return gens


# -- loading --------------------------------------------------------------------------------------------
def load(trace_dir: str | Path) -> Timeline:
    trace_dir = Path(trace_dir)
    files = sorted(trace_dir.glob("trace_rank*.json"))
    if not files:
        raise TimelineError(f"no trace_rank*.json in {trace_dir} (run with comm.trace=true comm.trace_dir={trace_dir})")
    raw = {}
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TimelineError(f"cannot read {f}: {e}") from None
        m = re.search(r"trace_rank(\d+)\.json$", f.name)
        r = int(d.get("rank", m.group(1) if m else -1))
        raw[r] = d
    warnings = []
    hosts = {d.get("host") for d in raw.values()}
    if all("t0_perf" in d for d in raw.values()) and len(hosts) == 1 and None not in hosts:
        alignment, key = "perf", "t0_perf"
    elif all("t0_wall" in d for d in raw.values()):
        alignment, key = "wall", "t0_wall"
    else:
        alignment, key = "none", None
        warnings.append("traces carry no clock anchors (t0_perf/t0_wall): ranks are drawn unaligned")
    origin = min(d[key] for d in raw.values()) if key else 0.0
    ranks = {}
    for r, d in sorted(raw.items()):
        off = (d[key] - origin) if key else 0.0
        rt = RankTrace(r, off)
        for ev in d.get("events", []):
            name, s, e = ev.get("name"), float(ev["start"]) + off, float(ev["end"]) + off
            if name in MARKS:
                rt.marks.append((name, s, {k: v for k, v in ev.items() if k not in ("name", "start", "end")}))
            elif name == "handoff":
                rt.handoffs.append((s, int(ev["dst"])))
            else:
                rt.spans.setdefault(name, Spans()).append((s, e))
                if name == "send" and "dst" in ev:
                    rt.sends.append((s, int(ev["dst"])))
        rt.sends.sort()
        rt.handoffs.sort()
        for iv in rt.spans.values():
            iv.finish()
        rt.marks.sort(key=lambda m: m[1])
        ranks[r] = rt
    return Timeline(ranks, alignment, warnings)


# -- windows and utilization ----------------------------------------------------------------------------
def choose_window(tl: Timeline, start: float | None = None, end: float | None = None,
                  generation: int | None = None, window: float | None = None, phase: str = "decode") -> tuple[float, float]:
    if generation is not None:
        gens = tl.generations()
        if not gens:
            raise TimelineError("the trace has no generation marks (rank 0's gen_begin/gen_end); use --start/--end")
        if not -len(gens) <= generation < len(gens):
            raise TimelineError(f"--generation {generation}: the trace has {len(gens)} generation(s) (0..{len(gens) - 1})")
        g = gens[generation]
        lo, hi = (g["decode_begin"] if phase == "decode" else g["begin"]), g["end"]
    else:
        lo, hi = tl.extent
    lo = lo if start is None else start
    hi = hi if end is None else end
    if window is not None and window > 0 and hi - lo > window:
        mid = (lo + hi) / 2
        lo, hi = mid - window / 2, mid + window / 2
    if hi <= lo:
        raise TimelineError(f"empty window [{lo:.6f}, {hi:.6f}] s")
    return lo, hi


class Spans(list):
    """Sorted (start, end) intervals of one kind on one rank, with a start index for fast clipping."""

    def finish(self) -> "Spans":
        self.sort()
        self.starts = [a for a, _ in self]
        self.max_len = max((b - a for a, b in self), default=0.0)
        return self


def clip_intervals(iv, lo: float, hi: float) -> list[tuple[float, float]]:
    """Intervals of ``iv`` (a finished ``Spans`` or any sorted list) intersected with [lo, hi]."""
    if not iv:
        return []
    starts = getattr(iv, "starts", None) or [a for a, _ in iv]
    max_len = getattr(iv, "max_len", None)
    if max_len is None:
        max_len = max(b - a for a, b in iv)
    i = bisect.bisect_left(starts, lo - max_len)
    j = bisect.bisect_left(starts, hi)
    return [(max(a, lo), min(b, hi)) for a, b in iv[i:j] if b > lo]


def utilization(tl: Timeline, windows: list[tuple[float, float]]) -> list[dict]:
    """Per rank over the union of ``windows`` (disjoint): seconds and fractions busy / wait / other, and
    seconds per kind. Busy is :func:`pipeline.trace.busy_fraction` (the one definition of busy)."""
    rows = []
    length = sum(hi - lo for lo, hi in windows)
    for r, rt in sorted(tl.ranks.items()):
        per_kind, busy, wait, anyspan = {}, 0.0, 0.0, 0.0
        for lo, hi in windows:
            clipped = {k: clip_intervals(iv, lo, hi) for k, iv in rt.spans.items()}
            for k, c in clipped.items():
                per_kind[k] = per_kind.get(k, 0.0) + union_length(c)
            busy += busy_fraction(rt.spans, lo, hi, clip_intervals) * (hi - lo)
            wait += union_length([x for k, c in clipped.items() if k in WAIT for x in c])
            anyspan += union_length([x for c in clipped.values() for x in c])
        frac = (lambda v: v / length if length > 0 else 0.0)
        row = {"rank": r, "window_s": length, "busy_s": busy, "busy_frac": frac(busy), "wait_s": wait,
               "wait_frac": frac(wait), "send_frac": frac(per_kind.get("send", 0.0)), "other_s": max(0.0, length - anyspan), "other_frac": frac(max(0.0, length - anyspan))}
        for k in list(KINDS) + sorted(set(per_kind) - set(KINDS)):
            row[f"{k}_s"] = per_kind.get(k, 0.0)
        rows.append(row)
    return rows


def turnaround_sums(recvs: list[tuple[float, float]], sends: list[float], steps: list[float]) -> dict:
    """THE definition of rank 0's turnaround (used for real traces and by the simulator). ``recvs``: rank 0's
    receives of results, ``(start, end)`` sorted by start; ``sends``: start times of rank 0's sends to rank 1,
    sorted; ``steps``: the stages' compute durations. A result's turnaround runs from the end of its receive
    (the result in hand) to the first send that starts after it and no later than the start of rank 0's next
    receive; a result that sends nothing before rank 0 waits again has none (waits are never counted).
    Returns ``{"turnarounds", "turnaround_s", "stage_steps", "stage_step_s"}`` (counts and sums, so that
    means pool over generations)."""
    out = {"turnarounds": 0, "turnaround_s": 0.0, "stage_steps": len(steps), "stage_step_s": float(sum(steps))}
    j = 0
    for i, (_, got) in enumerate(recvs):
        nxt = recvs[i + 1][0] if i + 1 < len(recvs) else float("inf")
        while j < len(sends) and sends[j] < got:
            j += 1
        if j < len(sends) and sends[j] <= nxt:
            out["turnarounds"] += 1
            out["turnaround_s"] += sends[j] - got
    return out


def turnaround(tl: Timeline, windows: list[tuple[float, float]]) -> dict:
    """Rank 0's turnaround in a traced run (:func:`turnaround_sums` over the events inside ``windows``): its
    ``recv`` spans, its sends to rank 1 and the stages' ``compute`` spans. On an emulated link the ``send``
    span is the link thread's delayed post, so the caller's hand-off (``handoff`` marks) is used instead when
    the trace has them."""
    r0 = tl.ranks.get(0)
    if r0 is None:
        return turnaround_sums([], [], [])
    inside = (lambda a, b: any(lo <= a and b <= hi for lo, hi in windows))
    recvs = [(a, b) for a, b in r0.spans.get("recv", []) if inside(a, b)]
    sends = [t for t, dst in (r0.handoffs or r0.sends) if dst == 1 and inside(t, t)]
    steps = [b - a for r, rt in tl.ranks.items() if r != 0 for a, b in rt.spans.get("compute", []) if inside(a, b)]
    return turnaround_sums(recvs, sends, steps)


def turnaround_means(sums: list[dict]) -> tuple[float, float] | None:
    """Pooled over several :func:`turnaround_sums` results (e.g. one per generation): (mean turnaround, mean
    stage step) in seconds, all turnarounds over all stage steps; None when either count is zero."""
    n = sum(d["turnarounds"] for d in sums)
    m = sum(d["stage_steps"] for d in sums)
    if not n or not m:
        return None
    return sum(d["turnaround_s"] for d in sums) / n, sum(d["stage_step_s"] for d in sums) / m


def format_turnaround(ta: dict) -> str:
    """One line: rank 0's mean turnaround against the stages' mean step."""
    means = turnaround_means([ta])
    if means is None:
        return "rank 0 turnaround: no result followed by a send in the window"
    t, step = means
    return (f"rank 0 turnaround (result in hand -> next send to rank 1): {1000 * t:.2f} ms mean over "
            f"{ta['turnarounds']} results; stage step {1000 * step:.2f} ms mean; ratio {t / step:.3f}")


def format_table(rows: list[dict]) -> str:
    kinds = [k for k in KINDS if any(r.get(f"{k}_s", 0) > 0 for r in rows)]
    head = "| rank | busy | wait (recv+broadcast) | send | other | " + " | ".join(f"{k} ms" for k in kinds) + " |"
    lines = [head, "|---" * (5 + len(kinds)) + "|"]
    for r in rows:
        lines.append(f"| {r['rank']} | {r['busy_frac']:.1%} | {r['wait_frac']:.1%} | {r['send_frac']:.1%} | "
                     f"{r['other_frac']:.1%} | "
                     + " | ".join(f"{1000 * r[f'{k}_s']:.1f}" for k in kinds) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = list(extra or {}) + list(rows[0]) if rows else list(extra or {})
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**(extra or {}), **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}})
    return path


# -- drawing --------------------------------------------------------------------------------------------
def gantt(tl: Timeline, lo: float, hi: float, out: str | Path, title: str = "", util: list[dict] | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    util = util if util is not None else utilization(tl, [(lo, hi)])
    by_rank = {u["rank"]: u for u in util}
    ranks = sorted(tl.ranks)
    ms = lambda t: 1000.0 * (t - lo)
    fig, ax = plt.subplots(figsize=(13, 0.9 * len(ranks) + 1.8))
    used = set()
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        rt = tl.ranks[r]
        for kind in list(reversed(KINDS)) + sorted(set(rt.spans) - set(KINDS)):
            color, _ = KINDS.get(kind, ("magenta", kind))
            iv = clip_intervals(rt.spans.get(kind, []), lo, hi)
            if not iv:
                continue
            used.add(kind)
            tall = kind in BUSY or kind not in KINDS
            h = 0.76 if tall else (0.36 if kind != "send" else 0.2)
            ax.broken_barh([(ms(s), max(ms(e) - ms(s), 1e-3)) for s, e in iv], (y - h / 2, h),
                           facecolors=color, edgecolors="none", linewidth=0)
        u = by_rank.get(r)
        if u:
            ax.text(1.005, (y + 0.5) / len(ranks), f"busy {u['busy_frac']:.0%}\nwait {u['wait_frac']:.0%}",
                    transform=ax.transAxes, va="center", fontsize=8)
    marks = tl.ranks[0].marks if 0 in tl.ranks else []
    for name, t, _ in marks:
        if lo <= t <= hi:
            ax.axvline(ms(t), color="k", ls="--" if name != "decode_begin" else ":", lw=0.9)
            ax.text(ms(t), len(ranks) - 0.45, {"gen_begin": " prefill", "decode_begin": " decode",
                                               "gen_end": " end"}[name], fontsize=7, va="bottom")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}\n({'draft+verify' if r == 0 else f'stage {r}'})" for r in reversed(ranks)],
                       fontsize=9)
    ax.set_ylim(-0.6, len(ranks) - 0.2)
    ax.set_xlim(0, ms(hi))
    ax.set_xlabel(f"time (ms) from t = {lo:.3f} s (clocks aligned by {tl.alignment})")
    ax.set_title(title or f"pipeline timeline, window {1000 * (hi - lo):.0f} ms")
    handles = [Patch(facecolor=KINDS[k][0], label=KINDS[k][1]) for k in KINDS if k in used]
    handles += [Patch(facecolor="magenta", label=k) for k in sorted(used - set(KINDS))]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16 - 0.02 * (len(ranks) < 4)),
              ncol=min(len(handles), 5), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def chrome_trace(tl: Timeline, lo: float | None = None, hi: float | None = None) -> dict:
    """The timeline in Chrome's Trace Event Format (loads in Perfetto, chrome://tracing, speedscope):
    ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` with one complete event (``ph: "X"``) per span,
    ``pid`` = rank (named ``rank r (...)`` by ``process_name`` metadata events), ``tid`` 0, ``ts``/``dur`` in
    microseconds on the aligned axis, ``name`` = span name (compute, lm_head, recv, ...), ``cat`` = busy /
    wait / send / other; rank 0's generation marks are instant events (``ph: "i"``). Only what lies in
    [lo, hi] is kept (default: everything), clipped to it."""
    lo0, hi0 = tl.extent
    lo = lo0 if lo is None else lo
    hi = hi0 if hi is None else hi
    us = lambda t: round(1e6 * t, 3)
    events = []
    for r, rt in sorted(tl.ranks.items()):
        label = "draft+verify" if r == 0 else f"stage {r}"
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r} ({label})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for kind, iv in rt.spans.items():
            cat = "busy" if kind in BUSY else "wait" if kind in WAIT else "send" if kind == "send" else "other"
            for a, b in clip_intervals(iv, lo, hi):
                events.append({"name": kind, "cat": cat, "ph": "X", "pid": r, "tid": 0, "ts": us(a),
                               "dur": us(max(0.0, b - a))})
        for name, t, meta in rt.marks:
            if lo <= t <= hi:
                events.append({"name": name, "cat": "mark", "ph": "i", "s": "p", "pid": r, "tid": 0, "ts": us(t),
                               "args": {k: v for k, v in meta.items() if isinstance(v, (int, float, str))}})
    events.sort(key=lambda e: (e.get("ts", -1), e["pid"]))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"alignment": tl.alignment, "window_s": [lo, hi]}}


def write_chrome(tl: Timeline, path: str | Path, lo: float | None = None, hi: float | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(tl, lo, hi)))
    return path


def analyze(trace_dir, out_png=None, out_csv=None, start=None, end=None, generation=None, window=None,
            phase="decode", title="") -> dict:
    """Load, choose the window, compute utilization, write the PNG and CSV (either may be None = skip)."""
    tl = load(trace_dir)
    lo, hi = choose_window(tl, start, end, generation, window, phase)
    util = utilization(tl, [(lo, hi)])
    res = {"timeline": tl, "window": (lo, hi), "utilization": util, "png": None, "csv": None,
           "turnaround": turnaround(tl, [(lo, hi)])}
    if out_csv:
        res["csv"] = write_csv(util, out_csv, {"window_start_s": round(lo, 6), "window_end_s": round(hi, 6)})
    if out_png:
        res["png"] = gantt(tl, lo, hi, out_png, title, util)
    return res


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.timeline"),
        description="Gantt chart and per-rank utilization of a traced pipeline run (trace_rank*.json files "
                    "written with comm.trace=true comm.trace_dir=DIR). Busy = compute/verify/lm_head/draft/"
                    "expand/prune, wait = recv/broadcast, other = outside any span.",
        epilog="Examples: python -m pipeline.tools.timeline traces --generation 1 --window 1.5 --out gantt.png; "
               "python -m pipeline.tools.timeline traces --chrome trace.json (open it in https://ui.perfetto.dev)")
    p.add_argument("trace_dir", help="folder holding trace_rank<r>.json of one run")
    p.add_argument("--out", help="Gantt PNG [TRACE_DIR/gantt.png]")
    p.add_argument("--csv", help="utilization CSV [TRACE_DIR/utilization.csv]")
    p.add_argument("--start", type=float, help="window start, seconds on the aligned axis")
    p.add_argument("--end", type=float, help="window end, seconds on the aligned axis")
    p.add_argument("--generation", type=int, help="window = decode phase of rank 0's K-th generation (0-based, "
                                                  "warm-ups included; negative counts from the end)")
    p.add_argument("--phase", choices=("decode", "all"), default="decode",
                   help="with --generation: decode only, or prefill + decode")
    p.add_argument("--window", type=float, help="keep only this many seconds centred in the selection")
    p.add_argument("--title", default="", help="chart title")
    p.add_argument("--list", action="store_true", help="list rank 0's generations and exit")
    p.add_argument("--chrome", help="write a Chrome/Perfetto trace (JSON) of the window to this path; then the "
                                    "Gantt PNG and CSV are written only when --out/--csv ask for them")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.list:
            tl = load(args.trace_dir)
            for g in tl.generations():
                print(f"generation {g['index']}: prefill {g['begin']:.3f} s, decode {g['decode_begin']:.3f} s .. "
                      f"{g['end']:.3f} s, {g.get('new_tokens')} new tokens")
            return 0
        d = Path(args.trace_dir)
        if args.chrome:
            tl = load(d)
            whole = args.start is None and args.end is None and args.generation is None and args.window is None
            lo, hi = (None, None) if whole else choose_window(tl, args.start, args.end, args.generation,
                                                             args.window, args.phase)
            path = write_chrome(tl, args.chrome, lo, hi)
            print(f"wrote {path} (Chrome trace format: open in https://ui.perfetto.dev or chrome://tracing)")
            if not args.out and not args.csv:
                return 0
        res = analyze(d, args.out or d / "gantt.png", args.csv or d / "utilization.csv", args.start, args.end,
                      args.generation, args.window, args.phase, args.title)
    except TimelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lo, hi = res["window"]
    tl = res["timeline"]
    for w in tl.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"window {lo:.4f} .. {hi:.4f} s ({1000 * (hi - lo):.1f} ms), {len(tl.ranks)} ranks, "
          f"clocks aligned by {tl.alignment}")
    print(format_table(res["utilization"]))
    print(format_turnaround(res["turnaround"]))
    print(f"wrote {res['png']} and {res['csv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
