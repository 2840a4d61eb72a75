"""Time to first token of the ``n`` > 1 choices with and without a shared prefill (issue 46; docs/results.md).

Example (the emulated edge testbed):

    .venv/bin/python -m scripts.n_share_bench --prompts-file ../shared/data/mt_bench/question.jsonl -n 6 \\
        emu.profile=edge_orin_7b emu.time_scale=20 max_new_tokens=16

Starts one server per setting (``serve.max_active=--max-active``; ``shared``: the default, ``own``:
``--no-share-prefill``), sends the first turns of records [0, n) one at a time as chat requests with ``n=--choices``,
greedy, and prints one Markdown row per setting: each choice's median / mean server-side TTFT (request submitted
to its first committed token), its median prefill time, how many choices started from a ``Fork``, the median
request wall time, whether every choice's tokens equal choice 0's and the first setting's, and the emulated
testbed's worst overrun ratio; then, per request, the later choices' TTFT minus choice 0's in each setting.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from config.paths import REPO


def _ask(url: str, content: str, mode: str, n: int) -> dict:
    import httpx
    body = {"messages": [{"role": "user", "content": content}], "mode": mode, "n": n, "temperature": 0,
            "return_token_ids": True}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1200)
    r.raise_for_status()
    spec = r.json()["speculative"]
    return {"wall_s": time.perf_counter() - t0, "choices": spec.get("choices") or [spec]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides for the servers (e.g. max_new_tokens=16)")
    p.add_argument("--prompts-file", help="question.jsonl (required unless --tables)")
    p.add_argument("-n", type=int, default=4, help="first turns of records [0, n)")
    p.add_argument("--choices", type=int, default=2, help="n of every request (default 2)")
    p.add_argument("--max-active", type=int, default=2, help="serve.max_active (default 2)")
    p.add_argument("--mode", default="continuous")
    p.add_argument("--settings", default="shared,own", help="shared (default server), own (--no-share-prefill)")
    p.add_argument("--out", default=None, help="write the raw rows as JSON here")
    p.add_argument("--tables", default=None, help="print the tables of an --out file and exit (no server)")
    args = p.parse_args(argv)
    if args.tables:
        with open(args.tables) as f:
            saved = json.load(f)
        print_tables(saved["raw"], saved["mode"], saved["choices"], saved["max_active"])
        return 0
    if not args.prompts_file:
        p.error("--prompts-file is required (unless --tables)")
    from model.default_model import ensure_default_stages
    from model.prompts import load_questions
    from pipeline.tools.ranks import launcher_command
    from scripts.serve_bench import _wait_healthy
    from tests.helpers import free_port
    stage = next((o.split("=", 1)[1] for o in args.overrides if o.split("=", 1)[0] in ("stage_dir", "model.stage_dir")),
                 None) or str(ensure_default_stages())
    nproc = int(subprocess.check_output([sys.executable, "-m", "model.stage_format", stage, "--world"], cwd=REPO,
                                        text=True).split()[-1])
    recs = load_questions(args.prompts_file, 0, args.n)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = [*launcher_command(), "--standalone", f"--nproc_per_node={nproc}"]
    raw: dict[str, list] = {}
    for setting in args.settings.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        extra = ["--no-share-prefill"] if setting == "own" else []
        srv = subprocess.Popen([*launch, "-m", "pipeline.serve", *args.overrides, f"serve.max_active={args.max_active}",
                                "--modes", args.mode, "--warmup", "1", "--port", str(port), *extra],
                               cwd=REPO, env=env, start_new_session=True)
        try:
            _wait_healthy(url, srv, 900)
            raw[setting] = [_ask(url, rec["turns"][0], args.mode, args.choices) for rec in recs]
            print(f"[n_share_bench] {setting}: {len(raw[setting])} requests", file=sys.stderr, flush=True)
        finally:
            os.killpg(srv.pid, signal.SIGINT)
            srv.wait(60)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"choices": args.choices, "max_active": args.max_active, "mode": args.mode, "raw": raw}, f,
                      indent=1)
    print_tables(raw, args.mode, args.choices, args.max_active)
    return 0


def print_tables(raw: dict[str, list], mode: str, choices: int, max_active: int) -> None:
    """The Markdown tables of ``raw`` (setting -> the requests' answers; module docstring)."""
    med, mean = statistics.median, statistics.mean
    first = next(iter(raw.values()))
    print(f"mode `{mode}`, n={choices}, serve.max_active={max_active}, {len(first)} requests, greedy\n")
    head = " | ".join(f"choice {i} TTFT median / mean (s)" for i in range(choices))
    print(f"| setting | {head} | prefill median (s), choice 0 / others | forked choices | request wall median (s) "
          f"| choices equal | equal to `{next(iter(raw))}` | worst overrun |")
    print("|---|" + "---|" * (choices + 6))
    for setting, rows in raw.items():
        ttft = [" / ".join(f"{f(r['choices'][i]['ttft_s'] for r in rows):.2f}" for f in (med, mean))
                for i in range(choices)]
        pre0 = med(r["choices"][0]["prefill_s"] for r in rows)
        pre1 = med(c["prefill_s"] for r in rows for c in r["choices"][1:])
        forked = sum(c.get("prefill_shared", False) for r in rows for c in r["choices"])
        equal = all(all(c["output_ids"] == r["choices"][0]["output_ids"] for c in r["choices"]) for r in rows)
        same = all(c["output_ids"] == d["output_ids"] for r, s in zip(rows, first)
                   for c, d in zip(r["choices"], s["choices"]))
        print(f"| {setting} | {' | '.join(ttft)} | {pre0:.2f} / {pre1:.2f} | {forked} of {len(rows) * (choices - 1)} "
              f"| {med(r['wall_s'] for r in rows):.1f} | {equal} | {same} "
              f"| {max(c.get('emu_overrun_ratio', 0.0) or 0.0 for r in rows for c in r['choices']):.2f} |")
    print("\nper request: prompt tokens, and each setting's later choices' TTFT minus choice 0's (s)\n")
    print("| prompt tokens | " + " | ".join(raw) + " |")
    print("|---|" + "---|" * len(raw))
    for j, r in enumerate(first):
        gaps = [", ".join(f"{c['ttft_s'] - rows[j]['choices'][0]['ttft_s']:.2f}" for c in rows[j]["choices"][1:])
                for rows in raw.values()]
        print(f"| {len(r['choices'][0]['prompt_ids'])} | " + " | ".join(gaps) + " |")


if __name__ == "__main__":
    sys.exit(main())
