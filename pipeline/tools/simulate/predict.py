"""Predictions: the timed decode of replayed generations under one profile and link, one row per generation.

* :func:`timed_passes` times a replayed session (:func:`.timing.simulate_timing`), replaying it again with rank
  0's direct decisions delivered on the previous pass's timing (:mod:`.transport`), and returns each
  generation's decode window on rank 0's clock;
* :func:`prediction` is one generation's row of ``predictions.jsonl``: τ, steps and accept lengths (exact,
  from the replay), the predicted decode seconds and tokens/s (in the profile's time: ``n / t x time_scale``),
  and, when the row was recorded by the very run being predicted (:func:`same_run`), its measured decode time
  and the prediction error;
* :func:`calibrate` fits one per-event testbed overhead on recorded rows of one mode. Invariant: the predicted
  total decode time grows with that overhead, so bisection finds the value that matches the measured total;
* :func:`config.profiles.with_link` is a profile with another link bandwidth or latency (every link of the profile).

Not modeled by default: the transport's own per-message cost (gloo, process wake-ups; ``--msg-overhead-s``,
``--op-overhead-s``, or ``--calibrate ar`` to fit one per-event cost on recorded ar rows) and overruns of a real
emulated run (the simulator times every op exactly as the profile says, so it predicts what a host fast enough
for the profile would measure).
"""
from __future__ import annotations

from config.profiles import Profile, with_link  # noqa: F401  (with_link re-exported)
from pipeline.tools.simulate.replayer import Replayed, Session
from pipeline.tools.simulate.timing import TimingConfig, decode_times, decode_windows, simulate_timing
from pipeline.tools.simulate.transport import DirectTimes


def timed_passes(base: Session, tc: TimingConfig, passes: int, replay_with) -> tuple[Session, list, list, tuple]:
    """Time ``base`` under ``tc`` after up to ``passes`` direct-decision passes (none for ``ar``, and none
    once a pass issues no direct decision); ``replay_with(upto)`` replays ``base``'s rows with that delivery
    schedule. Returns ``(the last session, its decode windows, its op timeline, DirectTimes.late() of it)``."""
    session = base
    for _ in range(passes if base.mode != "ar" else 0):
        direct = DirectTimes()
        simulate_timing(session.ops(), tc, None, direct)
        if not direct.arrivals:       # this mode issued no direct decision
            break
        session = replay_with(direct.schedule(base.stages + 1))
    events: list = []
    direct = DirectTimes()
    windows = decode_windows(simulate_timing(session.ops(), tc, events, direct))
    return session, windows, events, direct.late()


def same_run(g: Replayed, prof: Profile, bw, args) -> bool:
    """Was ``g``'s row recorded by the very run being predicted (mode, stages, profile, link, dilation)?"""
    row = g.row
    return (row.get("mode") == g.mode and int(row.get("world_size") or 0) - 1 == g.stages
            and row.get("emu_profile") == prof.name and bw is None and args.latency_s is None
            and float(row.get("emu_time_scale") or 1.0) == args.time_scale
            and args.stage_cost_scale in ("auto", "1", "1.0") and args.rank0_cost_scale == 1.0
            and getattr(args, "rank0_cost", "measured") == "measured"
            and bool(row.get("decode_s")))


def calibrate(sessions: list, mode: str, profile: Profile, make_tc, args) -> float:
    """The per-event testbed overhead ``c`` (added to every modeled op and every received message) with which the
    predicted total decode time of the recorded ``mode`` rows equals their measured total (bisection: the
    prediction grows with ``c``). Validate on the *other* modes."""
    cal = [s for s in sessions if s.mode == mode]
    pairs = [(s, {id(g) for g in s.gens if same_run(g, profile, None, args)}) for s in cal]
    measured = sum(g.row["decode_s"] for s, ids in pairs for g in s.gens if id(g) in ids)
    if not measured:
        raise ValueError(f"--calibrate {mode}: no rows of that mode recorded under profile {profile.name} "
                         f"with the simulated stage count")

    def predicted(c: float) -> float:
        tot = 0.0
        for s, gs in pairs:
            times = decode_times(simulate_timing(s.ops(), make_tc(s.stages, c)))
            tot += sum(t for g, t in zip(s.gens, times) if id(g) in gs)
        return tot

    lo, hi = 0.0, 0.01
    if predicted(lo) >= measured:
        return 0.0
    while predicted(hi) < measured and hi < 1.0:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def prediction(g: Replayed, t: float, prof: Profile, bw, args, stage_scale: float, overhead: float = 0.0) -> dict:
    """One generation's prediction row (see the module docstring); ``t``: its predicted decode seconds."""
    row = g.row
    recorded_here = same_run(g, prof, bw, args)
    n = len(g.row["output_ids"])
    tau = sum(g.accept_lengths) / max(1, len(g.accept_lengths))
    out = {"question_id": row.get("question_id"), "turn": row.get("turn", 0), "dataset": row.get("dataset"),
           "temperature": row.get("temperature", 0.0), "mode": g.mode, "stages": g.stages, "profile": prof.name,
           "bandwidth_mbps": prof.link.bandwidth_mbps, "stage_cost_scale": round(stage_scale, 6),
           "time_scale": args.time_scale, "rank0_cost_scale": args.rank0_cost_scale, "new_tokens": n,
           "tau": round(tau, 4), "steps": len(g.accept_lengths), "pipeline_steps": g.pipeline_steps,
           "rounds": g.rounds, "accept_lengths": g.accept_lengths,
           "pred_decode_s": round(t, 6), "overhead_s": overhead,
           "pred_tokens_per_s": round(n / t * args.time_scale, 3) if t > 0 else None}
    if recorded_here:
        out["recorded_decode_s"] = row["decode_s"]
        out["recorded_tau"] = row.get("tau")
        out["recorded_emu_flag"] = bool(row.get("emu_flag"))
        out["error"] = round(t / row["decode_s"] - 1.0, 4)
    return out
