"""The command line: ``python -m pipeline.tools.simulate ROWS.jsonl [options] [key=value ...]``.

:func:`run` replays every recorded row through every requested (mode, stage count) once (:func:`.replayer.replay`),
then for every link bandwidth times it (:func:`.predict.timed_passes`, with the direct-decision passes) and
writes one prediction per generation (``predictions.jsonl``), the summary (``summary.md``/``.csv``), the
paper-style tables of rows that name a dataset, the requested Gantt charts, and how the draft trees met the
target (``tree_stats.md``/``.csv``: acceptance by sibling rank and draft probability, why rounds ended;
:mod:`pipeline.tree_stats`). Bad input (a missing or
malformed rows file, an unknown profile, no rows left after filtering) is one ``error:`` line and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from config.invocation import prog
from config.paths import OUTPUTS
from config.errors import UserError, exit_status
from config.profiles import EmulationError, Profile, load_profile
from pipeline.tools.simulate.predict import calibrate, prediction, timed_passes, with_link
from pipeline.tools.simulate.pricing import resolve as resolve_pricing
from pipeline.tools.simulate.recorded import load_rows, load_target
from pipeline.tools.simulate.replayer import Hooks, replay
from pipeline.tools.simulate.report import (draw_gantt, rank0_turnaround, stage_utilization, summarize, to_timeline,
                                            turnaround_calls,
                                            write_paper_tables, write_summary)
from pipeline.tools.simulate.timing import TimingConfig
from pipeline.tree_stats import TreeStats, write_tree_stats


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce  # each default shown once
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.simulate"),
        description="Predict decode time, throughput (ξ) and speed-ups of recorded generations for other stage "
                    "counts, emulation profiles and links, without running the pipeline: the real schedulers "
                    "are replayed on the recorded answers (exact at T=0) and timed by a discrete-event model "
                    "of the emulated testbed. Rows recorded under the same profile and stage count are "
                    "compared with their measured decode time (the simulator's error).",
        epilog="Extra key=value words are config overrides (tree parameters etc.; use the ones of the recorded "
               "run). Example: python -m pipeline.tools.simulate outputs/eval/edge_orin_7b/rows.jsonl "
               "--stages 2,4,8 --bandwidth-mbps 150,1000 --out-dir outputs/sim",
        formatter_class=DefaultsOnce)
    p.add_argument("rows", nargs="+", help="JSONL rows with prompt_ids and output_ids (pipeline.run --output, "
                   "bench or eval rows), and key=value config overrides")
    p.add_argument("--modes", default="recorded",
                   help="modes to replay every recorded answer with (comma-separated), or 'recorded' (each row "
                        "with its own mode)")
    p.add_argument("--stages", default="recorded",
                   help="comma-separated layer-stage counts, or 'recorded' (each row's world_size - 1)")
    p.add_argument("--profile", default="edge_orin_7b", help="emulation profile (builtin name or JSON path)")
    p.add_argument("--bandwidth-mbps", default="", help="comma-separated link bandwidths overriding the profile's")
    p.add_argument("--latency-s", type=float, default=None, help="one-way link latency overriding the profile's")
    p.add_argument("--stage-cost-scale", default="auto",
                   help="factor on every stage compute time; 'auto' keeps the model's total layers: "
                        "recorded stages / simulated stages")
    p.add_argument("--msg-overhead-s", type=float, default=0.0,
                   help="transport cost added to every received message and broadcast (gloo, wake-ups); 0 = "
                        "ideal transport")
    p.add_argument("--op-overhead-s", type=float, default=0.0, help="cost added to every modeled op")
    p.add_argument("--rank0-cost-scale", type=float, default=1.0, metavar="F",
                   help="factor on all of rank 0's work (lm_head, draft ops, host work); 0 = the what-if of a "
                        "rank 0 that takes no time, i.e. entirely off the critical path")
    p.add_argument("--rank0-cost", default="measured", choices=("measured", "ops", "zero"),
                   help="how rank 0's host work (tree bookkeeping between its modeled ops) is priced: measured = this "
                        "CPU's thread time; ops = the aten operators and host<->device syncs counted on rank 0 in the "
                        "replay x the predicted device's cost per op / per sync (the profile's rank0_host, "
                        "profiles/rank0_host/<profile>.json, or the two flags below; pure Python that dispatches no "
                        "operator is free); zero = free (lm_head and draft head still as profiled)")
    p.add_argument("--rank0-op-us", type=float, default=None, metavar="US",
                   help="with --rank0-cost ops: microseconds per dispatched operator (overrides the profile's)")
    p.add_argument("--rank0-sync-us", type=float, default=None, metavar="US",
                   help="with --rank0-cost ops: microseconds per host<->device sync (overrides the profile's)")
    p.add_argument("--calibrate", default="", metavar="MODE",
                   help="fit one per-event overhead (every modeled op and received message) so that the recorded "
                        "rows of MODE (e.g. ar) are predicted exactly, then use it for everything; validate on "
                        "the other modes")
    p.add_argument("--time-scale", type=float, default=1.0, help="dilate modeled time like emu.time_scale")
    p.add_argument("--no-model-rank0", action="store_true",
                   help="time rank 0's lm_head/draft head at this host's measured speed, not the profile's")
    p.add_argument("--temperature", default="all", help="only rows of this temperature ('all': every row)")
    p.add_argument("--limit", type=int, default=0, help="at most this many rows per input (0 = all)")
    p.add_argument("--stage-dir", default="", help="split checkpoint of the recorded run (default: embedded SmolLM2)")
    p.add_argument("--head-dir", default="", help="EAGLE head of the recorded run (default: the default head)")
    p.add_argument("--out-dir", default=str(OUTPUTS / "sim"),
                   help="predictions.jsonl, summary.md/csv, tree_stats.md/csv")
    p.add_argument("--no-plots", action="store_true", help="skip the paper-style plots")
    p.add_argument("--direct-passes", type=int, default=1, metavar="K",
                   help="replay passes that deliver rank 0's point-to-point decisions on the previous pass's "
                        "timing (ScheduledDirect), so stages prune work in flight as they would; 0 = decisions "
                        "on the ring only (pass 0, the pre-2026-11-23 model)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while replaying: rank 0's host work (Python tree bookkeeping between "
                        "modeled ops) is timed as thread CPU time, which several threads' spin-waits inflate by up "
                        "to 2x on a loaded machine; 1 keeps it reproducible (0 = torch's default)")
    p.add_argument("--gantt", type=int, default=-1, metavar="N",
                   help="draw a Gantt chart of the N-th replayed generation of every mode/stages/bandwidth (-1: none)")
    p.add_argument("--gantt-window", type=float, default=1.5, help="seconds of decode shown in each Gantt chart")
    p.add_argument("--quiet", action="store_true")
    args = parse_rows_args(p, argv)
    if not args.rank0_cost_scale >= 0:
        p.error(f"--rank0-cost-scale {args.rank0_cost_scale} must be >= 0")
    if args.calibrate and args.rank0_cost_scale != 1.0:
        p.error("--calibrate fits the testbed on recorded rows timed as recorded; use it with --rank0-cost-scale 1")
    if args.calibrate and args.rank0_cost != "measured":
        p.error("--calibrate fits the testbed on recorded rows timed as recorded; use it with --rank0-cost measured")
    if (args.rank0_op_us is not None or args.rank0_sync_us is not None) and args.rank0_cost != "ops":
        p.error("--rank0-op-us / --rank0-sync-us price counted operators: use them with --rank0-cost ops")
    return args


def parse_rows_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse ``argv`` with ``p``, whose positional ``rows`` mixes row files and ``key=value`` config overrides
    (a word with ``=`` that is not an existing path is an override): ``args.rows`` are the files,
    ``args.overrides`` the overrides. No row file is a usage error."""
    args = p.parse_intermixed_args(argv)
    args.overrides = [a for a in args.rows if "=" in a and not Path(a).exists()]
    args.rows = [a for a in args.rows if a not in args.overrides]
    if not args.rows:
        p.error("give at least one rows JSONL file")
    return args


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv=None, hooks: Hooks | None = None) -> int:
    """The command line; ``hooks``: what a Python caller adds to every replay (:class:`.replayer.Hooks`)."""
    args = parse_args(argv)
    return exit_status(lambda: run(args, hooks), EmulationError, OSError, UnicodeDecodeError, ValueError, UserError)


def run(args, hooks: Hooks | None = None) -> int:
    """The simulation ``args`` ask for (see the module docstring); returns the exit code."""
    from tqdm import tqdm

    from config.run_config import DEFAULT, apply_overrides
    from pipeline.build import make_drafter

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    profile = load_profile(args.profile)
    pricing = resolve_pricing(args.rank0_cost, profile, args.rank0_op_us, args.rank0_sync_us)
    counting = pricing.mode == "ops"
    print(f"[simulate] rank 0's host work priced: {pricing.label()}", file=sys.stderr)
    rows = load_rows(args.rows, args.temperature, args.limit)
    if not rows:
        print("error: no rows to simulate", file=sys.stderr)
        return 2
    cfg = apply_overrides(DEFAULT, args.overrides)
    sampled = cfg.draft.eagle_sample or (cfg.draft.ssm_sample and "ssm:" in cfg.draft.sources)
    if sampled and any(float(r.get("temperature") or 0) > 0 for r in rows):
        # the stand-in target knows only the recorded token, so a sampled draft x would be accepted iff it equals
        # that token, not with min(1, p(x) / q(x)): its acceptance would be underpriced. Deterministic trees are
        # exact in law (a child is taken iff the target's sample is its token).
        cfg.draft.eagle_sample = cfg.draft.ssm_sample = False
        print("[simulate] note: rows at T > 0 are replayed with deterministic drafts (draft.eagle_sample=false "
              "draft.ssm_sample=false): a replay can price only deterministic trees at T > 0; time sampled drafts "
              "with an emulated run (emu.profile=...)", file=sys.stderr)
    if args.stage_dir:
        cfg.model.stage_dir = args.stage_dir
    if args.head_dir:
        cfg.model.head_dir = args.head_dir
    device = "cuda" if cfg.model.device == "cuda" else "cpu"   # rank 0's drafter; stand-ins stay on the host
    target = load_target(cfg, device)
    recorded_world = target.world

    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        rec_stages = int(r.get("world_size") or recorded_world) - 1
        modes = [r["mode"]] if args.modes == "recorded" else args.modes.split(",")
        stage_list = [rec_stages] if args.stages == "recorded" else ints(args.stages)
        for m in modes:
            for n in stage_list:
                groups.setdefault((m, n), []).append(r)
    if any(m == "sps" for m, _ in groups):     # its small LM runs on rank 0's model, which the replay stands in for
        raise ValueError("the simulator does not replay mode sps (rank 0's small draft LM is not modeled); "
                         "run it emulated instead: emu.profile=... mode=sps")
    drafter = None
    if any(m != "ar" for m, _ in groups):
        drafter = make_drafter(cfg, target.stage_root, target.model0, target.dtype, device)
    bandwidths = [float(b) for b in args.bandwidth_mbps.split(",") if b.strip()] or [None]

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    passes = max(0, args.direct_passes)
    bar = tqdm(total=sum(len(v) * (1 + (passes * len(bandwidths) if m != "ar" else 0)) for (m, _), v in groups.items()),
               desc="replaying", disable=args.quiet)

    def replay_rows(grows: list[dict], mode: str, n: int, upto=None, stats=None):
        return replay(grows, mode, n, cfg, drafter, target.vocab_size, target.features, bar, upto, stats,
                      count_ops=counting, hooks=hooks)

    # the first replay of every (mode, stages) also collects its tree statistics (rank 0 replays the same steps
    # in every later pass, so once is all of them)
    tree_stats: dict[str, TreeStats] = {}
    sessions = []
    for (mode, n), grows in sorted(groups.items()):
        per_temp: dict[str, TreeStats] = {}
        sessions.append((replay_rows(grows, mode, n, stats=per_temp if mode != "ar" else None), grows))
        tree_stats.update({f"{mode}, {n} stages, {t}": s for t, s in sorted(per_temp.items())})

    def timing(n: int, prof: Profile, overhead: float) -> TimingConfig:
        scale = (recorded_world - 1) / n if args.stage_cost_scale == "auto" else float(args.stage_cost_scale)
        return TimingConfig(prof, time_scale=args.time_scale, stage_cost_scale=scale,
                            msg_overhead_s=args.msg_overhead_s + overhead, model_rank0=not args.no_model_rank0,
                            real_hidden_bytes=target.hidden_bytes, op_overhead_s=args.op_overhead_s + overhead,
                            rank0_cost_scale=args.rank0_cost_scale, rank0_pricing=pricing)

    overhead = 0.0
    if args.calibrate:
        overhead = calibrate([s for s, _ in sessions], args.calibrate, profile,
                             lambda n, o: timing(n, profile, o), args)
        print(f"[simulate] calibrated testbed overhead: {overhead * 1e3:.3f} ms per modeled op and per received "
              f"message (fitted on the recorded {args.calibrate} rows)", file=sys.stderr)
    label = profile.name if args.rank0_cost_scale == 1.0 else \
        f"{profile.name}, what-if: rank 0's own work x {args.rank0_cost_scale:g}"
    if pricing.mode != "measured":
        label += f", rank 0's host work: {pricing.mode}"
    preds = []
    for base, grows in sessions:
        for bw in bandwidths:
            prof = with_link(profile, bw, args.latency_s)
            tc = timing(base.stages, prof, overhead)
            session, windows, events, late = timed_passes(
                base, tc, passes, lambda upto: replay_rows(grows, base.mode, base.stages, upto))
            if hooks is not None and hooks.on_timed is not None:
                hooks.on_timed(session, tc)
            tl = to_timeline(events, session.stages + 1)
            util = stage_utilization(tl, windows)
            turns = rank0_turnaround(events, windows, session.stages + 1)
            calls = turnaround_calls(events, windows, session.stages + 1)
            for i, (g, (lo, hi), u, ta, tcalls) in enumerate(zip(session.gens, windows, util, turns, calls)):
                pred = prediction(g, hi - lo, prof, bw, args, tc.stage_cost_scale, overhead)
                pred["busy_fraction"] = u
                pred["turnaround"] = ta
                pred["turnaround_calls"] = tcalls        # what the turnarounds are made of (report.turnaround_calls)
                pred["direct_polls_late"] = list(late)
                pred["rank0_cost"] = pricing.label()
                pred.update(host_counts(session, i) if counting else {})
                preds.append(pred)
            draw_gantt(tl, windows, session, prof, label, args, out_dir)
    bar.close()
    with open(out_dir / "predictions.jsonl", "w", encoding="utf-8") as f:
        for p in preds:
            f.write(json.dumps(p) + "\n")
    table = summarize(preds)
    write_summary(table, out_dir, label, pricing.label())
    paper = write_paper_tables(preds, out_dir, label, args) if any(p.get("dataset") for p in preds) else []
    print((out_dir / "summary.md").read_text())
    print(f"[simulate] rank 0's host work priced: {pricing.label()}", file=sys.stderr)
    if tree_stats:
        print(f"[simulate] draft trees against the target: {write_tree_stats(tree_stats, out_dir)}", file=sys.stderr)
    for path in paper:
        print(f"[simulate] paper-style table: {path}", file=sys.stderr)
    return 0


def host_counts(session, i: int) -> dict:
    """Rank 0's counted operators and syncs inside generation ``i``'s decode window (its ``decode_begin`` to
    ``gen_end`` marks in rank 0's log): ``r0_host_ops``, ``r0_host_syncs``."""
    ops = syncs = 0
    k, inside = -1, False
    for op in session.logs[0].ops:
        if op[0] == "mark" and op[1] == "decode_begin":
            k += 1
            inside = k == i
        elif op[0] == "mark" and op[1] == "gen_end":
            inside = False
        elif inside and op[0] == "host" and len(op) >= 4:
            ops += op[2]
            syncs += op[3]
    return {"r0_host_ops": ops, "r0_host_syncs": syncs}
