"""Side-by-side benchmark of every decoding mode (issue 4): throughput, τ, utilization and timelines.

``python -m pipeline.tools.bench --prompts-file question.jsonl -n 20 --out-dir outputs/bench [key=value ...]``

Runs ``ar``, ``naive``, ``pruned``, ``pipedec`` and ``continuous`` on the same first turns, each in its own
``python -m pipeline.tools.launch ... -m pipeline.run`` launch (fresh processes, same settings, tracing on, one trace folder per
mode; ``--launch single`` runs all modes in one launch instead and attributes rank 0's generation marks to
modes in order), one untimed warm-up generation per mode. Then it writes to ``--out-dir``:

* ``rows.jsonl``: every generation's row (``pipeline/run.py``'s fields);
* ``summary.md`` / ``summary.csv``: per mode generations, new tokens, decode throughput (Σ new tokens /
  Σ decode s, prefill excluded), speed-up over ``naive`` and ``ar``, τ (mean tokens committed per
  verification incl. the bonus token), tokens per pipeline step (Σ new tokens / Σ pipeline steps), each
  rank's mean busy fraction (as measured by the run), and from the traces each rank's busy / wait share
  over all decode phases;
* ``gantt_<mode>.png`` + ``timeline_<mode>.csv``: a Gantt window (``--gantt-window`` s in the middle of
  the decode of recorded generation ``--gantt-generation``) drawn by ``pipeline/tools/timeline.py``;
* ``traces/<mode>/trace_rank<r>.json`` and ``logs/<mode>.log``.

``--hf-generate`` adds the single-device baseline: one-process HF ``generate`` of the unsplit model on the same
prompts, device, dtype and clock (:mod:`pipeline.tools.hf_generate`), as mode ``hf_generate`` with a ``× HF``
column (refused with an emulated testbed, whose times it would not share).

At temperature 0 every mode's ``output_ids`` (and HF ``generate``'s) must equal ``ar``'s for the same prompt: mismatches are
printed loudly and the exit status is 3 (2 when a launch failed).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from config.errors import UserError
from config.invocation import prog
from config.modes import COMPARED_MODES, label
from config.paths import OUTPUTS
from pipeline.outputs import read_rows
from pipeline.tools.ranks import child_env, job_command, log_tail, run_job
from pipeline.tools.rows import (UNTRAINED_WARNING, RowTailer, find_mismatches, head_line, losslessness_md,
                                 mismatch_banner, untrained)


class BenchError(UserError, RuntimeError):
    """Bad input to the bench; ``main`` prints it, like every other :class:`UserError` (a bad override, stage root
    or question file), as one line and exits 2."""


HF = "hf_generate"  # pipeline.tools.hf_generate's rows: one-process HF generate, the single-device baseline


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce  # each default shown once
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.bench"),
        description="Run every decoding mode side by side on the same prompts through the pipeline (one pipeline.tools.launch "
                    "launch per mode, tracing on) and report decode throughput, speed-ups over naive and ar, τ, "
                    "accepted tokens per pipeline step, per-rank utilization and a Gantt chart per mode. At T=0 "
                    "every mode's output must equal ar's.",
        epilog="Extra key=value words are config overrides passed to every launch (see config/run_config.py), "
               "e.g. max_new_tokens=64 tree.subseq_token=8 model.stage_dir=DIR. Example: python -m pipeline.tools.bench "
               "--prompts-file data/mt_bench/question.jsonl -n 20 --out-dir outputs/bench_mtbench max_new_tokens=128",
        formatter_class=DefaultsOnce)
    p.add_argument("overrides", nargs="*", help="config overrides key=value for pipeline.run")
    p.add_argument("--prompts-file", help="FastChat question.jsonl (first turns are asked), e.g. MT-bench's")
    p.add_argument("-n", "--num-prompts", type=int, default=20, help="records of --prompts-file to use")
    p.add_argument("--begin", type=int, default=0, help="first record of --prompts-file (0-based)")
    p.add_argument("--prompt-ids", action="append", default=[],
                   help="instead of a file: a raw prompt as comma-separated token ids (repeatable)")
    p.add_argument("--modes", default=",".join(COMPARED_MODES), help="comma-separated modes")
    p.add_argument("--out-dir", default=str(OUTPUTS / "bench"), help="results folder (its previous "
                   "rows, traces and charts are replaced)")
    p.add_argument("--world", type=int, default=0, help="ranks (default: from the stage manifest)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per mode")
    p.add_argument("--launch", choices=("per-mode", "single"), default="per-mode",
                   help="one launch per mode, or all modes in one launch")
    p.add_argument("--gantt-window", type=float, default=1.5, help="seconds of decode shown in each Gantt chart")
    p.add_argument("--gantt-generation", type=int, default=0,
                   help="which recorded generation of each mode the Gantt window is taken from (0-based)")
    p.add_argument("--no-gantt", action="store_true", help="skip the Gantt PNGs (utilization is still computed)")
    p.add_argument("--timeout", type=float, default=0, help="seconds per launch before it is killed (0 = none)")
    p.add_argument("--quiet", action="store_true", help="no per-generation progress lines")
    p.add_argument("--hf-generate", action="store_true",
                   help="also time one-process HF generate of the unsplit model on the same prompts, device and "
                        "dtype (pipeline.tools.hf_generate; mode hf_generate, one device, no pipeline) and report "
                        "every mode's speed-up over it")
    p.add_argument("--summarize-only", action="store_true",
                   help="launch nothing: redo the summary and charts from --out-dir's rows.jsonl and traces")
    return p.parse_intermixed_args(argv)


# -- aggregation (pure functions on rows) ---------------------------------------------------------------
def aggregate(rows: list[dict], modes: list[str]) -> dict[str, dict]:
    """mode -> generations, new_tokens, decode_s, tps, tau, tokens_per_step, busy (mean per rank),
    speedup_naive, speedup_ar."""
    out = {}
    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        if not rs:
            continue
        tokens = sum(r["new_tokens"] for r in rs)
        decode = sum(r["decode_s"] / float(r.get("emu_time_scale") or 1.0) for r in rs)
        acc = [a for r in rs for a in (r.get("accept_lengths") or [])]
        steps = sum(r.get("pipeline_steps") or 0 for r in rs)
        world = max(len(r.get("busy_fraction") or []) for r in rs)
        busy = [sum(r["busy_fraction"][i] for r in rs if len(r.get("busy_fraction") or []) > i)
                / max(1, sum(1 for r in rs if len(r.get("busy_fraction") or []) > i)) for i in range(world)]
        out[m] = {"generations": len(rs), "new_tokens": tokens, "decode_s": decode,
                  "tps": tokens / decode if decode > 0 else 0.0,
                  "tau": sum(acc) / len(acc) if acc else 0.0,
                  "tokens_per_step": tokens / steps if steps else 0.0, "busy": busy,
                  "prefill_s": sum(r.get("prefill_s") or 0.0 for r in rs),
                  "flagged": sum(bool(r.get("emu_flag")) for r in rs)}
    for m, a in out.items():
        for base in ("naive", "ar", HF):
            b = out.get(base)
            a[f"speedup_{base}"] = a["tps"] / b["tps"] if b and b["tps"] > 0 else None
    return out


def _f(v, fmt="{:.2f}", none="–"):
    return none if v is None else fmt.format(v)


def summarize(agg: dict, trace_util: dict, mismatch: tuple, meta: dict, gantts: dict,
              rows: list[dict] | None = None) -> tuple[str, str]:
    """Markdown and CSV text. ``trace_util``: mode -> {"decode": [per-rank rows], "window": [...], ...}."""
    md = io.StringIO()
    w = md.write
    world = max((len(a["busy"]) for a in agg.values()), default=0)
    w("# Benchmark: decoding modes side by side\n\n")
    if rows is not None and untrained(rows):
        w(f"**{UNTRAINED_WARNING}**\n\n")
    w(f"- model: `{meta['stage_dir']}`, draft head: `{meta['head_dir']}`, world {meta['world']} ranks"
      + (f"; {head_line(rows)}" if rows is not None else "") + "\n")
    w(f"- prompts: {meta['prompts']}; max_new_tokens {meta['max_new_tokens']}, temperature {meta['temperature']:g}, "
      f"{meta['warmup']} untimed warm-up generation(s) per mode, "
      + ("one launch per mode" if meta["launch"] == "per-mode" else "all modes in one launch") + "\n")
    if meta.get("overrides"):
        w(f"- overrides: `{' '.join(meta['overrides'])}`\n")
    w(f"- host: {meta['cpus']} CPU core(s) for {meta['world']} ranks (absolute speed reflects that contention)\n")
    w("- tok/s = Σ new tokens / Σ decode s (prefill excluded); × naive / × ar = speed-up of that throughput; "
      "τ = mean tokens committed per verification incl. the bonus token; tok/step = Σ new tokens / Σ pipeline "
      "steps (messages rank 0 received during decode); busy r = mean fraction of each generation rank r spent in "
      "compute/verify/draft/expand/prune/lm_head during decode (pipeline.trace.busy_fraction; run's own "
      "counters)" + ("; * = some of the mode's rows were flagged by the emulation for overruns (the host did not "
                     "keep the modeled times: that tok/s is not the testbed's)" if any(a.get("flagged") for a in
                                                                                      agg.values()) else "")
      + ("; `hf_generate` = one-process HF `generate` of the unsplit model on one device (no pipeline), × HF = "
         "speed-up over it" if HF in agg else "") + "\n\n")
    busy_cols = "".join(f" busy r{i} |" for i in range(world))
    hf = HF in agg
    w("| mode | method | generations | new tokens | decode s | tok/s | × naive | × ar |" + (" × HF |" if hf else "")
      + " τ | tok/step |" + busy_cols + "\n")
    w("|---" * (10 + hf + world) + "|\n")
    for m, a in agg.items():
        w(f"| `{m}` | {label(m)} | {a['generations']} | {a['new_tokens']} | {a['decode_s']:.2f} | "
          f"{a['tps']:.2f}{' *' if a.get('flagged') else ''} | {_f(a['speedup_naive'])} | {_f(a['speedup_ar'])} | "
          + (f"{_f(a['speedup_hf_generate'])} | " if hf else "") +
          f"{_f(a['tau']) if m not in ('ar', HF) else '1.00'} | {_f(a['tokens_per_step'] or None)} |"
          + "".join(f" {b:.0%} |" for b in a["busy"]) + " – |" * (world - len(a["busy"])) + "\n")
    if any(trace_util.get(m, {}).get("decode") for m in agg):
        w("\nFrom the traces, over every recorded generation's decode phase: busy / wait share per rank "
          "(wait = blocked in recv or broadcast; the rest is send and untraced Python)\n\n")
        w("| mode |" + "".join(f" rank {i} busy / wait |" for i in range(world)) + " Gantt |\n")
        w("|---" * (world + 2) + "|\n")
        for m in agg:
            u = trace_util.get(m, {}).get("decode") or []
            cells = "".join(f" {x['busy_frac']:.0%} / {x['wait_frac']:.0%} |" for x in u)
            cells += " – |" * (world - len(u))
            g = gantts.get(m)
            w(f"| `{m}` |{cells} {f'[{Path(g).name}]({Path(g).name})' if g else '–'} |\n")
    notes = [f"- `{m}`: {n}" for m in agg for n in trace_util.get(m, {}).get("notes", [])]
    if notes:
        w("\nTrace notes:\n\n" + "\n".join(notes) + "\n")
    w("\n## Losslessness at T = 0\n\n")
    # at T > 0 no row is compared: the run's rows all carry that temperature
    w("Not checked: temperature > 0.\n" if meta["temperature"] != 0 else losslessness_md(mismatch))

    buf = io.StringIO()
    cw = csv.writer(buf)
    cw.writerow(["mode", "method", "generations", "new_tokens", "decode_s", "prefill_s", "tokens_per_s",
                 "speedup_vs_naive", "speedup_vs_ar", "speedup_vs_hf_generate", "tau", "tokens_per_pipeline_step"]
                + [f"busy_r{i}" for i in range(world)] + [f"trace_busy_r{i}" for i in range(world)]
                + [f"trace_wait_r{i}" for i in range(world)])
    for m, a in agg.items():
        u = trace_util.get(m, {}).get("decode") or []
        pad = [""] * (world - len(u))
        cw.writerow([m, label(m), a["generations"], a["new_tokens"], round(a["decode_s"], 6),
                     round(a["prefill_s"], 6), round(a["tps"], 4),
                     "" if a["speedup_naive"] is None else round(a["speedup_naive"], 4),
                     "" if a["speedup_ar"] is None else round(a["speedup_ar"], 4),
                     "" if a["speedup_hf_generate"] is None else round(a["speedup_hf_generate"], 4), round(a["tau"], 4),
                     round(a["tokens_per_step"], 4)] + [round(b, 4) for b in a["busy"]] + [""] * (world - len(a["busy"]))
                    + [round(x["busy_frac"], 4) for x in u] + pad + [round(x["wait_frac"], 4) for x in u] + pad)
    return md.getvalue(), buf.getvalue()


# -- traces ---------------------------------------------------------------------------------------------
def analyze_traces(trace_dir: Path, mode: str, mode_index: int, n_modes: int, n_rows: int, warmup: int,
                   args, out_dir: Path, tps: float | None, heads: str = "") -> dict:
    """Decode-phase utilization of one mode and its Gantt window (PNG + CSV). ``mode_index`` / ``n_modes``: the
    mode's place among the modes the pipeline ran (with ``--launch single`` one trace holds them all, in order);
    ``heads``: the draft-head line for the chart's title."""
    from pipeline.tools import timeline as T
    res = {"decode": [], "window": [], "png": None, "notes": []}
    try:
        tl = T.load(trace_dir)
    except T.TimelineError as e:
        res["notes"].append(f"no timeline: {e}")
        return res
    gens = tl.generations()
    if args.launch == "single":  # all modes in one trace: rank 0's generations in launch order
        per = len(gens) // n_modes if n_modes else 0
        gens = gens[mode_index * per:(mode_index + 1) * per]
    recorded = gens[warmup:]
    if len(recorded) != n_rows:
        res["notes"].append(f"trace holds {len(recorded)} recorded generations, rows {n_rows}")
    if not recorded:
        return res
    res["decode"] = T.utilization(tl, [(g["decode_begin"], g["end"]) for g in recorded])
    k = min(max(args.gantt_generation, 0), len(recorded) - 1)
    g = recorded[k]
    lo, hi = g["decode_begin"], g["end"]
    if args.gantt_window > 0 and hi - lo > args.gantt_window:
        mid = (lo + hi) / 2
        lo, hi = mid - args.gantt_window / 2, mid + args.gantt_window / 2
    res["window"] = T.utilization(tl, [(lo, hi)])
    T.write_csv(res["window"], out_dir / f"timeline_{mode}.csv",
                {"mode": mode, "window_start_s": round(lo, 6), "window_end_s": round(hi, 6)})
    if not args.no_gantt:
        title = (f"{label(mode)} ({mode}): {1000 * (hi - lo):.0f} ms of recorded generation {k}'s decode "
                 f"({g.get('new_tokens')} tokens in {g['end'] - g['decode_begin']:.2f} s)"
                 + (f"; mode average {tps:.1f} tok/s" if tps else "") + (f"\n{heads}" if heads else ""))
        res["png"] = T.gantt(tl, lo, hi, out_dir / f"gantt_{mode}.png", title, res["window"])
    return res


# -- launching ------------------------------------------------------------------------------------------
def run_tagged(tag: str, make_cmd, intro: str, out_dir: Path, rows_path: Path, n_expected: int, args, log) -> int:
    """Run the job ``make_cmd(rows file)`` (log ``logs/<tag>.log``), moving the rows it writes into ``rows_path`` as
    they come (a progress line per row unless ``--quiet``); its exit status, with the log's tail when it failed."""
    part = out_dir / "tmp" / f"{tag}.rows.jsonl"
    logf = out_dir / "logs" / f"{tag}.log"
    for d in (part.parent, logf.parent):
        d.mkdir(parents=True, exist_ok=True)
    part.unlink(missing_ok=True)
    tailer, seen, t_start = RowTailer(part), 0, time.time()

    def transfer() -> None:
        nonlocal seen
        if not part.is_file():
            return
        with open(rows_path, "a", encoding="utf-8") as out:
            for row in tailer.poll():
                out.write(json.dumps(row) + "\n")
                seen += 1
                if not args.quiet:
                    tps = row.get("tokens_per_s") or 0.0
                    log(f"[bench] {row['mode']:>10} q{row['question_id']}: {row['new_tokens']} tokens, {tps:.1f} tok/s, "
                        f"tau {row['tau']:.2f}  ({seen}/{n_expected}, {time.time() - t_start:.0f} s)")

    log(f"[bench] {tag}: {intro} (log {logf})")
    rc = run_job(make_cmd(part), logf, child_env(), transfer, poll_s=0.5, grace_s=30.0, timeout_s=args.timeout,
                 on_timeout=lambda: log(f"[bench] {tag}: over --timeout {args.timeout:g} s; stopping it"))
    transfer()
    if rc:
        log(f"[bench] {tag}: exited {rc}; last log lines:{log_tail(logf, 12)}")
    elif seen != n_expected:
        log(f"[bench] {tag}: expected {n_expected} rows, got {seen}")
    log(f"[bench] {tag}: done in {time.time() - t_start:.0f} s")
    return rc


def launch(tag: str, modes: list[str], run_args: list[str], world: int, out_dir: Path, rows_path: Path,
           n_expected: int, args, log) -> int:
    """One pipeline launch of ``modes`` on ``world`` ranks."""
    return run_tagged(tag, lambda part: job_command(world, [*run_args, "--modes", ",".join(modes), "--output", str(part),
                                                            "--quiet", "--warmup", str(args.warmup)]),
                      f"launch of {world} ranks, modes {','.join(modes)}", out_dir, rows_path, n_expected, args, log)


def run_hf_generate(prompt_args: list[str], args, out_dir: Path, rows_path: Path, n_prompts: int, log) -> int:
    """One-process HF ``generate`` on the same prompts and overrides (``pipeline.tools.hf_generate``), its rows
    appended to ``rows_path``."""
    ask = [a for a in prompt_args if a != "--first-turn-only"]  # hf_generate asks first turns only
    return run_tagged(HF, lambda part: [sys.executable, "-m", "pipeline.tools.hf_generate", *args.overrides, *ask,
                                        "--output", str(part), "--warmup", str(args.warmup), "--quiet"],
                      "one process, HF generate of the unsplit model", out_dir, rows_path, n_prompts, args, log)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    # Ctrl-C and SIGTERM stop the running launch (its whole process group) and the bench, also when the
    # bench was started in the background (where SIGINT is inherited as ignored)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _main(args, log)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[bench] interrupted", file=sys.stderr)
        return 130


def _main(args, log) -> int:
    from config.modes import MODES as VALID, canonical_mode
    from config.run_config import DEFAULT, apply_overrides
    modes = [canonical_mode(m) for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in VALID for m in modes):
        raise BenchError(f"--modes {args.modes!r}: choose from {', '.join(VALID)}")
    if len(set(modes)) != len(modes):
        raise BenchError("--modes lists a mode twice")
    for o in args.overrides:
        if o.split("=", 1)[0].strip() in ("trace", "comm.trace", "trace_dir", "comm.trace_dir", "mode", "gen.mode"):
            raise BenchError(f"override {o!r} is set by the bench itself")
    cfg = apply_overrides(DEFAULT, args.overrides)

    if args.hf_generate and cfg.emu.profile:
        raise BenchError("--hf-generate times real HF generate: it cannot be compared with an emulated testbed "
                         f"(emu.profile={cfg.emu.profile}); drop one of the two")
    # prompts
    if args.prompt_ids and args.prompts_file:
        raise BenchError("give --prompts-file or --prompt-ids, not both")
    if args.summarize_only:
        prompt_args, n_prompts, prompts_desc = [], 0, ""
    elif args.prompt_ids:
        prompt_args = [a for p in args.prompt_ids for a in ("--prompt-ids", p)]
        n_prompts = len(args.prompt_ids)
        prompts_desc = f"{n_prompts} raw token-id prompt(s)"
    elif args.prompts_file:
        from model.prompts import load_questions
        if args.num_prompts < 1 or args.begin < 0:
            raise BenchError("-n must be >= 1 and --begin >= 0")
        recs = load_questions(args.prompts_file, args.begin, args.begin + args.num_prompts)
        if not recs:
            raise BenchError(f"{args.prompts_file} has no records from {args.begin}")
        n_prompts = len(recs)
        if n_prompts < args.num_prompts:
            log(f"[bench] {args.prompts_file} has only {n_prompts} records from {args.begin}")
        prompt_args = ["--prompts-file", str(Path(args.prompts_file).resolve()), "--begin", str(args.begin),
                       "--end", str(args.begin + n_prompts), "--first-turn-only"]
        prompts_desc = f"first turns of records [{args.begin}, {args.begin + n_prompts}) of `{args.prompts_file}`"
    else:
        raise BenchError("no prompts: pass --prompts-file FILE (FastChat question.jsonl, e.g. MT-bench's) or --prompt-ids")

    # world
    from model.stage_format import read_manifest
    from config.paths import DEFAULT_HEAD_DIR, DEFAULT_STAGE_DIR
    if args.summarize_only:
        stage_root = Path(cfg.model.stage_dir) if cfg.model.stage_dir else DEFAULT_STAGE_DIR
    else:
        from model.default_model import resolve_stage_root
        stage_root = resolve_stage_root(cfg.model.stage_dir)
    world = args.world
    if not world and not args.summarize_only:
        world = len(read_manifest(stage_root)["split"])
    head = cfg.model.head_dir or (str(DEFAULT_HEAD_DIR) if stage_root.resolve() == DEFAULT_STAGE_DIR.resolve()
                                  else "untrained random head")

    out_dir = Path(args.out_dir)
    rows_path = out_dir / "rows.jsonl"
    meta = {"stage_dir": str(stage_root), "head_dir": head, "world": world, "prompts": prompts_desc,
            "max_new_tokens": cfg.gen.max_new_tokens, "temperature": cfg.gen.temperature, "warmup": args.warmup,
            "launch": args.launch, "modes": modes, "overrides": args.overrides, "cpus": os.cpu_count()}
    if args.summarize_only:
        if not (out_dir / "meta.json").is_file():
            raise BenchError(f"{out_dir} holds no bench results (meta.json)")
        meta = json.loads((out_dir / "meta.json").read_text())
        args.launch, args.warmup = meta["launch"], meta["warmup"]
        modes = [m for m in modes if m in meta["modes"]]
        for old in list(out_dir.glob("gantt_*.png")) + list(out_dir.glob("timeline_*.csv")):
            old.unlink()
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        rows_path.unlink(missing_ok=True)
        for old in (out_dir / "traces", out_dir / "tmp"):
            shutil.rmtree(old, ignore_errors=True)
        for old in list(out_dir.glob("gantt_*.png")) + list(out_dir.glob("timeline_*.csv")):
            old.unlink()
        (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))

    groups = [(m, [m]) for m in modes] if args.launch == "per-mode" else [("all", modes)]
    failures = []
    t0 = time.time()
    for i, (tag, ms) in enumerate([] if args.summarize_only else groups, 1):
        tdir = out_dir / "traces" / tag
        run_args = [*args.overrides, "comm.trace=true", f"comm.trace_dir={tdir.resolve()}", *prompt_args]
        log(f"[bench] ({i}/{len(groups)})")
        rc = launch(tag, ms, run_args, world, out_dir, rows_path, n_prompts * len(ms), args, log)
        if rc:
            failures.append(f"{tag} (exit {rc})")
    if args.hf_generate and not args.summarize_only:
        rc = run_hf_generate(prompt_args, args, out_dir, rows_path, n_prompts, log)
        if rc:
            failures.append(f"{HF} (exit {rc})")
    shutil.rmtree(out_dir / "tmp", ignore_errors=True)

    rows = read_rows(rows_path)
    if any(r["mode"] == HF for r in rows) and HF not in modes:
        modes = [*modes, HF]
    agg = aggregate(rows, modes)
    trace_util, gantts = {}, {}
    traced = [m for m in modes if m != HF]   # hf_generate runs outside the pipeline: no trace, not a launch mode
    heads = head_line(rows)
    for mi, m in enumerate(traced):
        if m not in agg:
            continue
        tdir = out_dir / "traces" / (m if args.launch == "per-mode" else "all")
        trace_util[m] = analyze_traces(tdir, m, mi, len(traced), agg[m]["generations"], args.warmup, args, out_dir,
                                       agg[m]["tps"], heads)
        if trace_util[m]["png"]:
            gantts[m] = trace_util[m]["png"]
    mismatch = find_mismatches(rows)
    md, csv_text = summarize(agg, trace_util, mismatch, meta, gantts, rows)
    (out_dir / "summary.md").write_text(md, encoding="utf-8")
    (out_dir / "summary.csv").write_text(csv_text, encoding="utf-8")
    print(md)
    if untrained(rows):
        print(UNTRAINED_WARNING, flush=True)
    log(f"[bench] {len(rows)} rows in {time.time() - t0:.0f} s -> {out_dir}/summary.md, summary.csv, rows.jsonl"
        + (f", {len(gantts)} Gantt chart(s)" if gantts else ""))
    code = 0
    if failures or any(m not in agg for m in modes):
        missing = [m for m in modes if m not in agg]
        log("[bench] FAILED launches: " + ", ".join(failures) + (f"; modes without rows: {', '.join(missing)}" if missing else ""))
        code = 2
    if mismatch[0] and cfg.gen.temperature == 0:
        log(mismatch_banner("bench", mismatch[0]))
        code = 3
    return code


if __name__ == "__main__":
    sys.exit(main())
