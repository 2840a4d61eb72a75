"""Reports of the predictions: the op timeline (Gantt charts, per-rank busy fractions), ``summary.md``/``.csv``
and the evaluation sweep's paper-style tables.

* :func:`to_timeline` turns a timed session (:func:`.timing.simulate_timing`'s ``(rank, op, start, end)``
  list) into a :class:`pipeline.tools.timeline.Timeline`; rank 0's host work is the span kind ``host``, which
  counts as busy (:func:`pipeline.trace.busy_fraction`, THE definition of busy);
* :func:`rank0_turnaround` measures rank 0's time from a received result to its next ring send, and the stages'
  mean step, per generation;
* :func:`summarize` aggregates prediction rows per (temperature, stages, bandwidth, dataset, mode). Invariants:
  ξ is all tokens over all decode seconds (never a mean of per-generation rates); busy fractions are
  time-weighted over the generations; SR compares modes only within the same temperature, stages, bandwidth and
  dataset; measured figures and errors appear only for rows recorded by the very run predicted;
* :func:`write_summary`, :func:`write_paper_tables`, :func:`draw_gantt` write the files.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

from config.modes import COMPARED_MODES
from config.profiles import Profile
from pipeline.tools.simulate.replayer import Session

SPAN_KIND = {"compute": "compute", "lm_head": "lm_head", "draft": "draft", "ssm": "draft", "recv": "recv",
             "host": "host"}


def to_timeline(timeline: list, world: int):
    """The simulated op timeline as a :class:`pipeline.tools.timeline.Timeline` (Gantt charts, utilization). Rank-0 host
    work (tree building, verification, pruning) is the span kind ``host``."""
    from pipeline.tools.timeline import RankTrace, Timeline
    ranks = {r: RankTrace(r, 0.0) for r in range(world)}
    for r, op, a, b in timeline:
        kind = SPAN_KIND.get(op[0])
        if op[0] == "mark":
            ranks[r].marks.append((op[1], a, {}))
        elif kind is not None and b > a:
            ranks[r].spans.setdefault(kind, []).append((a, b))
    return Timeline(ranks, "simulated")


def stage_utilization(tl, windows: list[tuple[float, float]]) -> list[list[float]]:
    """Per generation (decode) window: each rank's busy fraction, :func:`pipeline.trace.busy_fraction` (rank 0:
    lm_head, draft head and ``host`` work; stages: their layer computations)."""
    from pipeline.tools.timeline import clip_intervals
    from pipeline.trace import busy_fraction
    return [[round(busy_fraction(tl.ranks[r].spans, lo, hi, clip_intervals), 4) for r in sorted(tl.ranks)] for lo, hi in windows]


def rank0_turnaround(timeline: list, windows: list[tuple[float, float]], world: int) -> list[dict]:
    """Per generation (decode) window: rank 0's turnaround against the stages' step, the issue's "rank 0 off the
    critical path" measure, by :func:`pipeline.tools.timeline.turnaround_sums` (THE definition, also used on
    real traces): rank 0's ``recv`` ops from the last stage, its ring ``send`` ops to rank 1 (their start: the
    hand-off) and the layer stages' ``compute`` ops inside the window."""
    from bisect import bisect_right
    from pipeline.tools.timeline import turnaround_sums
    last, starts = world - 1, [lo for lo, _ in windows]
    per = [([], [], []) for _ in windows]              # (recvs, sends, steps) per window
    for r, op, a, b in timeline:                        # each rank's ops appear in that rank's order
        w = bisect_right(starts, a) - 1
        if w < 0 or b > windows[w][1]:
            continue
        recvs, sends, steps = per[w]
        if r == 0 and op[0] == "recv" and op[1] == last:
            recvs.append((a, b))
        elif r == 0 and op[0] == "send" and op[1] == 1 % world:
            sends.append(a)
        elif r != 0 and op[0] == "compute":
            steps.append(b - a)
    return [turnaround_sums(sorted(rv), sorted(sd), st) for rv, sd, st in per]


def turnaround_calls(timeline: list, windows: list[tuple[float, float]], world: int) -> list[dict]:
    """Per generation window, what rank 0's turnarounds (:func:`rank0_turnaround`'s: a result in hand -> the next
    ring send, none when rank 0 receives again first) are made of: ``{call: seconds}`` summed over the window's
    turnarounds, plus ``"turnarounds"`` (their number). A call is a rank-0 op kind (``host``, ``lm_head``,
    ``draft``, ``ssm``, ...); the first ``lm_head`` after a result is named ``lm_head (verify)`` (the
    result's logits), later ones ``lm_head (draft)`` (draft log-probs). Divide by ``turnarounds`` for the mean."""
    from bisect import bisect_right
    last, starts = world - 1, [lo for lo, _ in windows]
    out = [{"turnarounds": 0} for _ in windows]
    open_: list = [None] * len(windows)                 # per window: the calls since the result in hand, or None
    for r, op, a, b in sorted((e for e in timeline if e[0] == 0), key=lambda e: (e[2], e[3])):
        w = bisect_right(starts, a) - 1
        if w < 0 or b > windows[w][1]:
            continue
        kind = op[0]
        if kind == "recv" and op[1] == last:
            open_[w] = {}                               # a later result restarts (an unsent one has none)
        elif kind == "send" and op[1] == 1 % world and open_[w] is not None:
            for k, v in open_[w].items():
                out[w][k] = out[w].get(k, 0.0) + v
            out[w]["turnarounds"] += 1
            open_[w] = None
        elif open_[w] is not None and b > a:
            if kind == "lm_head":
                kind = "lm_head (draft)" if any(k.startswith("lm_head") for k in open_[w]) else "lm_head (verify)"
            open_[w][kind] = open_[w].get(kind, 0.0) + (b - a)
    return out


def draw_gantt(tl, windows: list[tuple[float, float]], session: Session, prof: Profile, profile_name: str, args,
               out_dir: Path) -> Path | None:
    """``--gantt N``: the Gantt chart of the ``N``-th generation's first ``--gantt-window`` seconds of decode
    (``gantt_<mode>_s<stages>_bw<mbps>.png``); None when no chart is asked for or there is no such generation."""
    if not (args.gantt >= 0 and args.gantt < len(windows)):
        return None
    from pipeline.tools.timeline import gantt
    lo, hi = windows[args.gantt]
    hi = min(hi, lo + args.gantt_window * args.time_scale)
    name = f"gantt_{session.mode}_s{session.stages}_bw{prof.link.bandwidth_mbps or 0:g}.png"
    gantt(tl, lo, hi, out_dir / name, title=f"simulated {session.mode}: {session.stages} stages, "
          f"{profile_name}, {prof.link.bandwidth_mbps or 0:g} Mbit/s (generation {args.gantt})")
    return out_dir / name


def summarize(preds: list[dict]) -> list[dict]:
    """Per (temperature, stages, bandwidth, mode): tokens, τ, predicted ξ (all tokens / all decode seconds), SR vs
    naive and ar of the same group, and the error against recorded runs where there are some."""
    from pipeline.tools.timeline import turnaround_means
    groups: dict[tuple, list[dict]] = {}
    for p in preds:
        groups.setdefault((p["temperature"], p["stages"], p["bandwidth_mbps"], p.get("dataset") or "",
                           p["mode"]), []).append(p)
    table = []
    for (temp, st, bw, ds, mode), ps in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3], MODE_ORDER.get(kv[0][4], 9))):
        toks = sum(p["new_tokens"] for p in ps)
        secs = sum(p["pred_decode_s"] for p in ps)
        scale = ps[0]["time_scale"]
        rec = [p for p in ps if "recorded_decode_s" in p]
        row = {"temperature": temp, "stages": st, "bandwidth_mbps": bw, "dataset": ds, "mode": mode,
               "generations": len(ps),
               "new_tokens": toks, "tau": round(sum(p["tau"] * p["steps"] for p in ps) / max(1, sum(p["steps"] for p in ps)), 3),
               "pred_xi": round(toks / secs * scale, 3) if secs else None}
        rounds = sum(p.get("rounds") or 0 for p in ps)
        if rounds:    # tokens the rounds committed (the first token comes from the prefill, in no round)
            row["tokens_per_round"] = round(sum(sum(p["accept_lengths"]) for p in ps) / rounds, 3)
        if all(p.get("busy_fraction") for p in ps):   # time-weighted over the generations
            fr = [sum(p["busy_fraction"][r] * p["pred_decode_s"] for p in ps) / secs
                  for r in range(len(ps[0]["busy_fraction"]))] if secs else []
            row["rank0_busy"] = round(fr[0], 3) if fr else None
            row["stage_busy_mean"] = round(sum(fr[1:]) / max(1, len(fr) - 1), 3) if fr else None
            row["stage_busy_min"] = round(min(fr[1:]), 3) if len(fr) > 1 else None
        means = turnaround_means([p["turnaround"] for p in ps]) if all("turnaround" in p for p in ps) else None
        if means is not None:
            ta, step = means
            row["r0_turnaround_ms"] = round(ta * 1e3 / scale, 3)
            row["stage_step_ms"] = round(step * 1e3 / scale, 3)
            row["turnaround_vs_step"] = round(ta / step, 3) if step else None
        if all("r0_host_ops" in p for p in ps):     # --rank0-cost ops: what was priced, per committed token
            row["r0_ops_per_token"] = round(sum(p["r0_host_ops"] for p in ps) / max(1, toks), 1)
            row["r0_syncs_per_token"] = round(sum(p["r0_host_syncs"] for p in ps) / max(1, toks), 2)
        if rec:
            rs = sum(p["recorded_decode_s"] for p in rec)
            ps_ = sum(p["pred_decode_s"] for p in rec)
            row["recorded_xi"] = round(sum(p["new_tokens"] for p in rec) / rs * scale, 3)
            row["error_total"] = round(ps_ / rs - 1.0, 4)
            row["error_mean_abs"] = round(sum(abs(p["error"]) for p in rec) / len(rec), 4)
            row["recorded_tau"] = round(sum(float(p["recorded_tau"] or 0) for p in rec) / len(rec), 3)
            row["flagged"] = sum(p["recorded_emu_flag"] for p in rec)
        table.append(row)
    for row in table:
        for base in ("naive", "ar"):
            ref = next((r for r in table if r["mode"] == base and r["temperature"] == row["temperature"]
                        and r["stages"] == row["stages"] and r["bandwidth_mbps"] == row["bandwidth_mbps"]
                        and r["dataset"] == row["dataset"]), None)
            if ref and ref["pred_xi"] and row["pred_xi"]:
                row[f"sr_vs_{base}"] = round(row["pred_xi"] / ref["pred_xi"], 3)
    return table


MODE_ORDER = {m: i for i, m in enumerate(COMPARED_MODES)}   # ar, naive, pruned, pipedec, continuous; others last
COLUMNS = ["temperature", "stages", "bandwidth_mbps", "dataset", "mode", "generations", "new_tokens", "tau", "pred_xi",
           "sr_vs_naive", "sr_vs_ar", "rank0_busy", "stage_busy_mean", "stage_busy_min", "r0_turnaround_ms",
           "stage_step_ms", "turnaround_vs_step", "recorded_xi", "error_total", "error_mean_abs", "recorded_tau",
           "flagged", "tokens_per_round", "r0_ops_per_token", "r0_syncs_per_token"]


def write_summary(table: list[dict], out_dir: Path, profile: str, rank0_cost: str = "") -> None:
    with open(out_dir / "summary.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in table:
            w.writerow({k: row.get(k, "") for k in COLUMNS})
    lines = [f"# Simulated decode throughput (profile `{profile}`)", ""]
    if rank0_cost:
        lines += [f"Rank 0's host work priced: {rank0_cost}. r0_ops_per_token / r0_syncs_per_token (with "
                  "`--rank0-cost ops`): rank 0's counted operators and would-be syncs outside its modeled ops, per "
                  "committed token.", ""]
    lines += [
             "ξ = predicted decode tokens/s (all tokens / all decode seconds); SR = ξ / ξ(naive) of the same "
             "temperature, stages, bandwidth and dataset; τ = tokens per verification step incl. bonus (replayed); "
             "busy = share of decode time a rank computes (rank 0: lm_head, draft head, tree work; stages: "
             "layers), time-weighted over generations; turnaround = rank 0's mean time from holding a returned result "
             "to starting the next ring send, against the stages' mean step (stage_step_ms; both in the profile's "
             "time); tokens_per_round = tokens per tree drafted from a fresh root (a round ends at each "
             "truncation: the next useful result is then a full ring trip away). "
             "Where rows were recorded by the very run predicted (same profile, stage count, link and dilation; "
             "not for what-ifs such as a scaled rank 0): their measured ξ, the total "
             "prediction error (predicted / measured decode seconds − 1), the mean per-generation |error|, "
             "and how many of them the emulation flagged for overruns.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in table:
        lines.append("| " + " | ".join(fmt(row.get(k)) for k in COLUMNS) + " |")
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_paper_tables(preds: list[dict], out_dir: Path, profile: str, args) -> list[Path]:
    """The evaluation sweep's paper-style summary (ξ, SR vs naive, τ per dataset, plots) of the predictions, one
    folder per (stages, bandwidth): ``paper_s<stages>_bw<mbps>/``."""
    from config.paths import DATASETS
    from pipeline.tools.eval import plot, summarize as eval_summary
    groups: dict[tuple, list[dict]] = {}
    for p in preds:
        if p.get("dataset"):
            groups.setdefault((p["stages"], p["bandwidth_mbps"]), []).append(p)
    written = []
    for (stages, bw), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        rows = [{"dataset": p["dataset"], "mode": p["mode"], "temperature": p["temperature"],
                 "question_id": p["question_id"], "turn": p["turn"], "new_tokens": p["new_tokens"],
                 "decode_s": p["pred_decode_s"], "emu_time_scale": p["time_scale"],
                 "accept_lengths": p["accept_lengths"],
                 "emu_flag": bool(p.get("recorded_emu_flag"))} for p in ps]   # plots mark flagged recordings
        datasets = [d for d in DATASETS if any(r["dataset"] == d for r in rows)]
        datasets += sorted({r["dataset"] for r in rows} - set(datasets))
        modes = [m for m in COMPARED_MODES if any(r["mode"] == m for r in rows)]
        temps = sorted({float(r["temperature"]) for r in rows})
        meta = {"profile": f"{profile} (simulated: {stages} layer stages, {bw:g} Mbit/s)" if bw else profile,
                "time_scale": args.time_scale, "world": stages + 1, "overrides": args.overrides,
                "max_new_tokens": max(r["new_tokens"] for r in rows), "stage_dir": args.stage_dir or None,
                "begin": "recorded", "end": "recorded"}
        md, csv_text = eval_summary(rows, datasets, modes, temps, meta, ([], 0, 0))
        d = out_dir / f"paper_s{stages}_bw{bw:g}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "summary.md").write_text(md, encoding="utf-8")
        (d / "summary.csv").write_text(csv_text, encoding="utf-8")
        if not args.no_plots:
            plot(rows, datasets, modes, temps, d)
        written.append(d / "summary.md")
    return written


def fmt(v) -> str:
    """A table cell: empty for None and NaN, floats to 4 significant digits."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if not math.isnan(v) else ""
    return str(v)
