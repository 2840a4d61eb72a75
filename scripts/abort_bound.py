"""Issue 41's what-if ratio (docs/results.md §93): what could a stage gain by stopping a forward between layers once
its rows are dead?

A stage computes a segment's surviving rows in one forward. Rank 0 may settle, while that forward runs, that none of
its rows can be accepted any more (a truncation: the target's token was none of the drafted children, so every node
in flight is dead). Today the stage finishes the forward and the next stage drops the rows. A stage that looked at
rank 0's direct decisions between its layers (and a stage 1 that received them too: today only stages 2..N do)
could stop after the layer in progress and take the next segment sooner.

This script bounds that gain on recorded answers, without building it: one what-if replay of each mode
(``pipeline.tools.simulate``, rank 0 priced per operator), its op logs timed twice (paired):

* as replayed;
* with every **dead forward** cut short (:func:`cut_dead_forwards`): a forward of stage ``r`` whose message computes no
  row on stage ``r + 1`` (its rows all died in flight) stops at the end of the layer in which a decision that could
  have killed it reached stage ``r`` (one of the decisions stage ``r + 1`` held before its own poll and stage ``r``
  did not hold before its forward; ``--layers`` layers per stage, the cut rounded up to a whole layer). ``bound``
  says which of those decisions: ``first`` (the earliest: optimistic) or ``last`` (the latest to arrive).

It is an upper bound of the lever: the decisions keep their replayed arrival times (a shorter forward does not move
them), the check between layers costs nothing, the last stage's dead results (dropped by rank 0) are not cut, and
on a GPU a stage whose launches run ahead of its kernels would have to wait at each check.

Example::

    python -m scripts.abort_bound whatif20_rows.jsonl --limit 20 --modes continuous,pipedec \\
        --profile ../shared/gpu/profiles/h100_7b_fp16.json --bandwidth-mbps 100000 --out-dir outputs/abort_bound
"""
from __future__ import annotations

import bisect
import sys

LAYERS = 8      # layers per stage of the profiles' 7B split (32 layers on 4 stages)


def messages(log: list[tuple], prev: int) -> list[dict]:
    """Stage ``log``'s ring messages from rank ``prev`` in arrival order: per message, the index of its forward's
    ``compute`` op (None: no row computed) and the decisions received by the stage's poll for it."""
    out: list[dict] = []
    for i, op in enumerate(log):
        if op[0] == "recv" and op[1] == prev:
            out.append({"compute": None, "held": None})
        elif out and op[0] == "poll" and out[-1]["held"] is None:
            out[-1]["held"] = op[1]
        elif out and op[0] == "compute" and out[-1]["compute"] is None:
            out[-1]["compute"] = i
    return out


def cut_dead_forwards(logs: list[list[tuple]], spans: dict, arrivals: dict, seconds, layers: int = LAYERS,
                      bound: str = "first") -> tuple[list[list[tuple]], float]:
    """``logs`` with every dead forward of stages ``1 .. N-1`` cut short (module docstring), and the compute seconds
    cut. ``spans[(r, i)] = (start, end)`` of op ``i`` of rank ``r`` (the replay's timing); ``arrivals[r]``: when each
    direct decision (issue order) reached stage ``r``; ``seconds(r, op)``: a compute op's modeled time. A cut
    forward becomes ``("host", seconds of the layers it computed)`` (a stage's host op is timed as given)."""
    world = len(logs)
    new = [list(log) for log in logs]
    cut = 0.0
    for r in range(1, world - 1):
        here, there = messages(logs[r], r - 1), messages(logs[r + 1], r)
        arr = sorted(arrivals.get(r, []))
        for k, m in enumerate(here):
            i = m["compute"]
            if i is None or k >= len(there) or there[k]["compute"] is not None:
                continue                                   # no forward here, or its rows live on
            start, end = spans[(r, i)]
            lo = (m["held"] or 0) if r >= 2 else bisect.bisect_right(arr, start)   # decisions held before the forward
            hi = there[k]["held"] or 0
            cand = [t for t in arr[lo:hi] if t > start]
            if not cand:
                continue
            t = min(cand) if bound == "first" else max(cand)
            if t >= end:
                continue
            full = seconds(r, logs[r][i])
            done = min(layers, int((t - start) / (end - start) * layers) + 1) / layers
            new[r][i] = ("host", full * done)
            cut += full * (1 - done)
    return new, cut


def main(argv=None) -> int:
    import argparse

    from pipeline.tools.simulate import cli
    from pipeline.tools.simulate.replayer import Hooks
    from pipeline.tools.simulate.timing import decode_windows, simulate_timing
    from pipeline.tools.simulate.transport import DirectTimes
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("Arguments: those of python -m pipeline.tools.simulate (--rank0-cost ops, --quiet and --no-plots are "
              "added), and --layers N (layers per stage, default 8).")
        return 0
    layers = LAYERS
    if "--layers" in argv:
        j = argv.index("--layers")
        layers = int(argv[j + 1])
        argv = argv[:j] + argv[j + 2:]
    got = []
    code = cli.main([*argv, "--rank0-cost", "ops", "--quiet", "--no-plots", "--gantt", "0"],
                    Hooks(on_timed=lambda s, tc: got.append((s, tc))))
    if code:
        return code
    print("\n| mode | decode s, as replayed | bound | decode s, dead forwards cut | ξ gain | stage compute cut, s |")
    print("|---|---|---|---|---|---|")
    for session, tc in got:
        logs = session.ops()
        events, direct = [], DirectTimes()
        base = decode_windows(simulate_timing(logs, tc, events, direct))
        seen: dict[int, int] = {}
        spans = {}
        for r, _op, a, b in events:
            spans[(r, seen.get(r, 0))] = (a, b)
            seen[r] = seen.get(r, 0) + 1
        lat = tc.profile.link.latency_s * tc.time_scale
        arrivals = dict(direct.arrivals)      # stage 1 gets no direct decision today: rank 0's copy to stage 2's time
        arrivals[1] = [b + lat for r, op, _a, b in events if r == 0 and op[0] == "dsend" and op[1] == 2]

        def seconds(r, op):
            return tc.profile.stage_model(r).time(op[1], op[2]) * tc.stage_cost_scale * tc.time_scale \
                + tc.op_overhead_s
        t0 = sum(hi - lo for lo, hi in base)
        for bound in ("first", "last"):
            new, cut = cut_dead_forwards(logs, spans, arrivals, seconds, layers, bound)
            t1 = sum(hi - lo for lo, hi in decode_windows(simulate_timing(new, tc)))
            print(f"| {session.mode} | {t0:.3f} | {bound} | {t1:.3f} | {t0 / t1 - 1:+.1%} | {cut:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
