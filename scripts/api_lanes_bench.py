"""Several requests at once through the Python API: ``FlowSpec.load(..., lanes=N).generate_many`` against one at a
time, side by side in one run (docs/results.md §102).

Example::

    python -m scripts.api_lanes_bench --prompts-file ../shared/data/mt_bench/question.jsonl -n 8 --lanes 1,2,4 \\
        --modes continuous max_new_tokens=64

For each mode and each ``--lanes`` value: one process-local pipeline (``FlowSpec.load``, the ranks' code on threads)
answers the first turns of records ``[0, n)``, all handed to ``generate_many`` at once (``lanes=1``: one at a time),
after one warm-up generation. One Markdown row per (mode, lanes): wall seconds, new tokens, aggregate new tokens per
wall second and its ratio to the mode's first row, the median and slowest answer's own decode seconds, τ pooled over
the answers (tokens committed by verifications per verification: ``ar`` 1), and whether every answer equals the
first row's (greedy: it must; sampled with a seed: it should, §101).
Absolute times are this host's: several lanes share its cores with every stage thread, so on a CPU the rows measure
what batching several lanes' segments into one stage forward saves there, not an edge testbed (the emulated testbed
needs launched ranks: ``scripts/serve_bench.py --clients``, §53).

Prints the table; exit 0, 2 for bad input (one line).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from config.invocation import prog


def bench(stage_dir: str | None, mode: str, lanes: int, prompts: list[str], overrides: list[str]) -> dict:
    """One row's measurements: load, warm up, answer every prompt at once on ``lanes`` lanes."""
    from pipeline.api import FlowSpec
    with FlowSpec.load(stage_dir, f"mode={mode}", *overrides, lanes=lanes) as fs:
        fs.generate(prompts[0], max_new_tokens=8)              # warm-up (first-call allocations)
        fs.forget_requests()
        t0 = time.perf_counter()
        outs = fs.generate_many(prompts)
        wall = time.perf_counter() - t0
    new = sum(o.stats.new_tokens for o in outs)
    verifications = sum(len(o.stats.accept_lengths) for o in outs)
    committed = sum(sum(o.stats.accept_lengths) for o in outs)   # (the prefill's token is no verification's)
    decode = sorted(o.stats.decode_s for o in outs)
    return {"mode": mode, "lanes": lanes, "wall_s": wall, "new_tokens": new, "tok_s": new / wall if wall > 0 else 0.0,
            "median_decode_s": statistics.median(decode), "max_decode_s": decode[-1],
            "tau": committed / verifications if verifications else 1.0, "ids": [o.ids for o in outs]}


def table(rows: list[dict]) -> str:
    lines = ["| mode | lanes | wall s | new tokens | tok/s | x first row | median / slowest answer s | τ | same answers |",
             "|---|---|---|---|---|---|---|---|---|"]
    first: dict[str, dict] = {}
    for r in rows:
        base = first.setdefault(r["mode"], r)
        lines.append(f"| {r['mode']} | {r['lanes']} | {r['wall_s']:.1f} | {r['new_tokens']} | {r['tok_s']:.2f} | "
                     f"{r['tok_s'] / base['tok_s'] if base['tok_s'] else 0:.2f} | "
                     f"{r['median_decode_s']:.1f} / {r['max_decode_s']:.1f} | {r['tau']:.2f} | "
                     f"{'yes' if r['ids'] == base['ids'] else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog("scripts.api_lanes_bench"), description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("Example::")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value run keys for every load (max_new_tokens=64, ...)")
    ap.add_argument("--prompts-file", required=True, help="FastChat question.jsonl (first turns)")
    ap.add_argument("-n", type=int, default=8, help="records [0, n)")
    ap.add_argument("--lanes", default="1,2,4", help="comma-separated lane counts, the first is the baseline")
    ap.add_argument("--modes", default="continuous", help="comma-separated modes")
    ap.add_argument("--stage-dir", default=None, help="a split (default: model.stage_dir, else the default model's)")
    args = ap.parse_args(argv)
    try:
        args.lanes = [int(x) for x in args.lanes.split(",")]
    except ValueError:
        ap.error(f"--lanes takes comma-separated integers, got {args.lanes!r}")
    if args.n < 1 or not args.lanes or any(not 1 <= x <= 64 for x in args.lanes):
        ap.error("-n must be at least 1 and every --lanes value in [1, 64]")
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"overrides take KEY=VALUE, got {bad[0]!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from config.errors import UserError
    from model.prompts import load_questions
    try:
        prompts = [r["turns"][0] for r in load_questions(args.prompts_file, 0, args.n)]
        rows = []
        for mode in args.modes:
            for lanes in args.lanes:
                rows.append(bench(args.stage_dir, mode, lanes, prompts, args.overrides))
                print(f"[api_lanes_bench] {mode}, {lanes} lanes: {rows[-1]['tok_s']:.2f} tok/s", file=sys.stderr,
                      flush=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
