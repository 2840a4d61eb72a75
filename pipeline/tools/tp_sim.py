"""What-if prediction of the tensor-parallel baselines (``tp``, ``galaxy``) next to the pipeline modes.

::

    python -m pipeline.tools.tp_sim rows.jsonl --profile edge_orin_7b --tp 4 --bandwidth-mbps 150,1000

**Schedule.** ``tp`` and ``galaxy`` share rank 0's schedule (``pipeline/modes/tp.py``: one EAGLE-2 tree per
round, sent whole to the group, verified when its hidden states are back), and the group answers like one
pipeline stage. So the recorded answers are replayed (:func:`pipeline.tools.simulate.replay`, the real rank-0 code
and drafter) through mode ``tp`` on *one* stage, and that stage's forwards are timed by :class:`GroupCost`, the
modeled time of the whole TP group; the pipeline modes are replayed on ``N`` stages as by
``pipeline.tools.simulate``. Both are timed by the same discrete-event model (:func:`pipeline.tools.simulate.simulate_timing`).

**Cost model of one group forward** of ``w`` rows over ``ctx`` cached slots (``L`` layers, ``N`` ranks, link
latency ``a``, bandwidth ``b``, ``h`` bytes per hidden row; the profile's stage cost ``t(w, ctx)`` is for
``L/P`` layers, ``P`` = ``--profile-stages``):

* per-rank compute ``c(w, ctx)``: all ``L`` layers at ``1/N`` width, i.e. the profile's analytic model with
  weight bytes, KV bytes and FLOPs times ``P/N`` and the launch overhead times ``P`` (every rank launches every
  layer's kernels); a table profile is scaled by ``P/N``;
* ``tp`` (Megatron, no overlap): ``c(w, ctx) + (2L + 1) * AR(w*h)`` with the ring all-reduce
  ``AR(B) = 2(N-1) * (a + B/(N b))`` (two per layer, one for the vocab-parallel embedding);
* ``galaxy``: each layer has four ring phases (all-gather before q/k/v and gate/up, reduce-scatter after o_proj
  and down_proj), each ``N`` steps of one sequence slice of ``s = ceil(w/N)`` rows: compute ``k = c(s, ctx)/(4L)``
  overlapped with one transfer ``a + s h / b``, so a phase takes ``k + (N-1) * max(k, a + s h / b)``; plus the
  embedding's reduce-scatter and the final gather to TP rank 0 (``N-1`` transfers each). At batch 1 a slice's
  GEMM still streams the whole weight matrix, so the per-slice compute does not shrink by ``N``: overlap can
  hide the link, not the memory traffic.

Rank 0 -> group is a broadcast (the root sends ``N`` copies: the link runs at ``b/N``); group -> rank 0 is one
message. Rank-0 costs (draft head, lm_head) and host work are those of ``pipeline.tools.simulate``.

The crossover bandwidth is where ``tp`` (or ``galaxy``) reaches the best pipeline mode's ξ (bisection over the
bandwidth; link latency held at the profile's or ``--latency-s``).
"""
from __future__ import annotations

from config.invocation import prog
from config.paths import OUTPUTS
import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from config.modes import TP_MODES
from config.errors import UserError, exit_status
from config.profiles import EmulationError, GroupCost, Profile, load_profile, shard_cost



def tp_profile(profile: Profile, n: int, layers: int, profile_stages: int, mode: str,
               hidden_bytes: float) -> Profile:
    """``profile`` with its one stage replaced by the TP group of ``mode`` (tp or galaxy) and the rank-0 link by
    the broadcast to ``n`` ranks."""
    from pipeline.modes.tp import SCHEDULE_OF_MODE
    link = profile.link
    group = GroupCost(shard_cost(profile.stage, profile_stages, n), n, layers, link, hidden_bytes,
                      SCHEDULE_OF_MODE[mode])
    fan_out = replace(link, bandwidth_mbps=link.bandwidth_mbps / n if link.bandwidth_mbps else None)
    return replace(profile, stage=group, stages={}, links={(0, 1): fan_out, (1, 0): link})


# -- evaluation -----------------------------------------------------------------------------------------
@dataclass
class Sessions:
    """Replayed op logs: ``pipeline[mode]`` on ``n`` stages, ``group`` = mode ``tp`` on one stage."""

    pipeline: dict
    group: object
    n: int
    real_hidden_bytes: float
    replay_with: Callable                 # (mode, direct-decision schedule) -> the pipeline mode replayed with it
    passes: int = 0                       # direct-decision passes for the table (as pipeline.tools.simulate)


def decode_stats(session, tc, group: GroupCost | None = None, passes: int = 0, replay_with=None) -> dict:
    """Timed decode of a replayed session after ``passes`` direct-decision passes
    (:func:`pipeline.tools.simulate.timed_passes`; 0: the session as replayed): ξ, τ and where the time goes
    (shares of the decode time)."""
    from pipeline.tools.simulate import timed_passes
    session, windows, events, _ = timed_passes(session, tc, passes, replay_with)
    total = sum(hi - lo for lo, hi in windows)
    tokens = sum(len(g.row["output_ids"]) for g in session.gens)
    steps = sum(len(g.accept_lengths) for g in session.gens)
    busy = {r: 0.0 for r in range(len(session.logs))}
    comm = 0.0
    for r, op, a, b in events:
        if op[0] in ("compute", "lm_head", "draft", "ssm", "host") and any(lo <= a < hi for lo, hi in windows):
            busy[r] += b - a
            if group is not None and op[0] == "compute":
                comm += group.parts(op[1], op[2])[1]
    stages = [busy[r] for r in busy if r > 0]
    out = {"xi": tokens / total if total else None, "tau": sum(sum(g.accept_lengths) for g in session.gens) / max(1, steps),
           "decode_s": total, "rank0_busy": busy[0] / total if total else None}
    if group is None:
        out["stage_busy"] = sum(stages) / len(stages) / total if total else None
    else:
        out["group_compute"] = (stages[0] - comm) / total if total else None
        out["group_collectives"] = comm / total if total else None
    return out


def evaluate(s: Sessions, profile: Profile, bw: float | None, latency: float | None, args,
             modes: tuple[str, ...] | None = None, passes: bool = True) -> list[dict]:
    """One row per mode (``modes``: a subset of the pipeline modes and ``TP_MODES``; default all) at one link.
    ``passes``: time the pipeline modes after ``s.passes`` direct-decision passes (as ``pipeline.tools.simulate``
    does: stages prune in-flight work when rank 0's decisions would really reach them); else pass 0 only."""
    from pipeline.tools.simulate import TimingConfig, with_link
    prof = with_link(profile, bw, latency)
    rows = []
    for mode, session in s.pipeline.items():
        if modes is None or mode in modes:
            tc = TimingConfig(prof, stage_cost_scale=args.profile_stages / s.n, real_hidden_bytes=s.real_hidden_bytes)
            rows.append({"mode": mode, **decode_stats(session, tc, None, s.passes if passes else 0,
                                                      lambda upto, m=mode: s.replay_with(m, upto))})
    hb = prof.link.hidden_bytes_per_token or s.real_hidden_bytes
    for mode in TP_MODES:
        if modes is None or mode in modes:
            tprof = tp_profile(prof, s.n, args.layers, args.profile_stages, mode, hb)
            tc = TimingConfig(tprof, real_hidden_bytes=s.real_hidden_bytes)
            rows.append({"mode": mode, **decode_stats(s.group, tc, tprof.stage)})
    naive = next((r["xi"] for r in rows if r["mode"] == "naive"), None)
    for r in rows:
        r.update(n=s.n, bandwidth_mbps=prof.link.bandwidth_mbps, latency_s=prof.link.latency_s,
                 sr_vs_naive=r["xi"] / naive if naive and r["xi"] else None)
    return rows


def crossover(s: Sessions, profile: Profile, latency: float | None, mode: str, args,
              lo: float = 1.0, hi: float = 1e6) -> float | None:
    """Smallest bandwidth (Mbit/s, within 1%) in ``[lo, hi]`` at which ``mode`` reaches the best pipeline mode's
    ξ, or None when it never does (ξ of every mode grows with the bandwidth). The pipeline modes are timed at pass
    0 here (no direct-decision passes: the bisection would replay them at every probe), which under-states them
    by up to 10% (docs/tp.md), so the crossover found is, if anything, too low: it favours TP."""
    def gap(bw: float) -> float:   # pass 0 only (one replay per mode): a lower bound on the pipeline modes' ξ
        rows = evaluate(s, profile, bw, latency, args, (*s.pipeline, mode), passes=False)
        best = max(r["xi"] for r in rows if r["mode"] not in TP_MODES)
        return next(r["xi"] for r in rows if r["mode"] == mode) - best
    if gap(hi) < 0:
        return None
    if gap(lo) >= 0:
        return lo
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if gap(mid) >= 0 else (mid, hi)
    return hi


# -- command line ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.tp_sim"),
        description="Predict the decode throughput (ξ) of the tensor-parallel baselines tp (Megatron) and galaxy "
                    "next to the pipeline modes for recorded answers, under an emulation profile's devices and "
                    "links, and the crossover bandwidth above which TP beats the pipeline.",
        epilog="Example: python -m pipeline.tools.tp_sim outputs/bench_t0/rows.jsonl --profile edge_orin_7b --tp 4 "
               "--bandwidth-mbps 150,1000 --out-dir outputs/tp_sim")
    p.add_argument("rows", nargs="+", help="JSONL rows with prompt_ids and output_ids (pipeline.run --output), "
                                           "plus key=value config overrides of the recorded run")
    p.add_argument("--profile", default="edge_orin_7b", help="emulation profile (builtin name or JSON path)")
    p.add_argument("--tp", type=int, default=4, help="ranks of the TP group = layer stages of the pipeline modes")
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the modeled model (LLaMA-7B: 32)")
    p.add_argument("--profile-stages", type=int, default=4,
                   help="how many stages the profile's stage cost splits the model into (edge_orin_7b: 4 x 8 layers)")
    p.add_argument("--modes", default="naive,pipedec,continuous", help="pipeline modes to compare with")
    p.add_argument("--bandwidth-mbps", default="150,1000", help="comma-separated link bandwidths")
    p.add_argument("--latency-s", default="", help="comma-separated one-way latencies (default: the profile's)")
    p.add_argument("--limit", type=int, default=0, help="at most this many rows (0 = all)")
    p.add_argument("--direct-passes", type=int, default=1, metavar="K",
                   help="replay passes of the pipeline modes with rank 0's point-to-point decisions delivered on the "
                        "previous pass's timing (as pipeline.tools.simulate); 0 = decisions on the ring only")
    p.add_argument("--stage-dir", default="", help="split checkpoint of the recorded run (default: embedded SmolLM2)")
    p.add_argument("--head-dir", default="", help="EAGLE head of the recorded run (default: the default head)")
    p.add_argument("--out-dir", default=str(OUTPUTS / "tp_sim"), help="predictions.jsonl and summary.md")
    from pipeline.tools.simulate import parse_rows_args
    args = parse_rows_args(p, argv)
    if args.tp < 1 or args.layers < 1 or args.profile_stages < 1:
        p.error("--tp, --layers and --profile-stages must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return exit_status(lambda: _main(args), EmulationError, OSError, ValueError, UserError)


def _main(args) -> int:
    from config.run_config import DEFAULT, apply_overrides
    from pipeline.build import make_drafter
    from pipeline.tools.simulate import load_rows, load_target, replay

    profile = load_profile(args.profile)
    rows = load_rows(args.rows, "all", args.limit)
    if not rows:
        raise ValueError("no rows to simulate")
    cfg = apply_overrides(DEFAULT, args.overrides)
    cfg.model.stage_dir = args.stage_dir or cfg.model.stage_dir
    cfg.model.head_dir = args.head_dir or cfg.model.head_dir
    target = load_target(cfg)
    drafter = make_drafter(cfg, target.stage_root, target.model0, target.dtype, "cpu")
    vocab, features = target.vocab_size, target.features
    modes = [m for m in args.modes.split(",") if m]
    sessions = Sessions({m: replay(rows, m, args.tp, cfg, drafter, vocab, features) for m in modes},
                        replay(rows, "tp", 1, cfg, drafter, vocab, features), args.tp, target.hidden_bytes,
                        lambda m, upto: replay(rows, m, args.tp, cfg, drafter, vocab, features, None, upto),
                        max(0, args.direct_passes))
    bandwidths = [float(b) for b in args.bandwidth_mbps.split(",") if b.strip()]
    latencies = [float(v) for v in args.latency_s.split(",") if v.strip()] or [None]
    table = [r for lat in latencies for bw in bandwidths for r in evaluate(sessions, profile, bw, lat, args)]
    cross = [{"latency_s": lat if lat is not None else profile.link.latency_s, "mode": m,
              "crossover_mbps": crossover(sessions, profile, lat, m, args)} for lat in latencies for m in TP_MODES]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as f:
        for r in table + cross:
            f.write(json.dumps(r) + "\n")
    text = summary_md(table, cross, profile.name, args, len(rows), sum(len(r["output_ids"]) for r in rows))
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


def summary_md(table: list[dict], cross: list[dict], profile: str, args, gens: int, tokens: int) -> str:
    def f(v, fmt="{:.3g}"):
        return "" if v is None else fmt.format(v)
    lines = [f"# Tensor parallel vs pipeline (simulated; profile `{profile}`, N = {args.tp}, {args.layers} layers, "
             f"{gens} answers, {tokens} tokens)", "",
             "ξ = decode tokens/s; SR = ξ / ξ(naive); shares are of the decode time: rank 0 busy (draft head, lm_head, "
             "tree work), per layer-stage busy (pipeline modes) or the TP group's compute and exposed collectives.", "",
             "| latency ms | Mbit/s | mode | ξ | SR vs naive | τ | rank 0 busy | stage busy | group compute | "
             "group collectives |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['latency_s'] * 1e3:g} | {r['bandwidth_mbps']:g} | {r['mode']} | {f(r['xi'])} | "
                     f"{f(r['sr_vs_naive'])} | {f(r['tau'])} | {f(r['rank0_busy'], '{:.0%}')} | "
                     f"{f(r.get('stage_busy'), '{:.0%}')} | {f(r.get('group_compute'), '{:.0%}')} | "
                     f"{f(r.get('group_collectives'), '{:.0%}')} |")
    lines += ["", "Crossover: the bandwidth above which the mode beats the best pipeline mode "
              "(searched in 1 Mbit/s .. 1 Tbit/s).", "", "| latency ms | mode | crossover Mbit/s |", "|---|---|---|"]
    for c in cross:
        lines.append(f"| {c['latency_s'] * 1e3:g} | {c['mode']} | "
                     f"{f(c['crossover_mbps'], '{:.0f}') or 'none (the pipeline stays faster)'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
