"""Overhead of the HTTP server against ``pipeline.run`` on the same prompts (time to first token, tok/s, τ).

Example:

    .venv/bin/python -m scripts.serve_bench --prompts-file ../shared/data/mt_bench/question.jsonl -n 4 \\
        --modes naive,continuous max_new_tokens=64

Runs ``pipeline.run`` (first turns of records [0, n), one warm-up generation per mode) and then a server with
the same configuration (one warm-up per mode), sends the same first turns as streamed chat requests one at a
time and prints a Markdown table per mode:

* TTFT: ``pipeline.run``'s prefill time vs the client's time from sending the request to the first streamed
  token (includes HTTP, JSON, queueing and detokenization);
* tok/s: ``new_tokens / decode_s`` of ``pipeline.run`` vs the server's own ``decode_s`` and the client's rate
  from first to last streamed token;
* τ and whether the greedy outputs are identical;
* overhead: client TTFT minus the server's own prefill time (HTTP, JSON, chat template, queue, first chunk);
  per request, client wall time minus the server's prefill + decode time (adds the busy-statistics ring trip
  and the final chunks); per token, the client's streamed decode time minus the server's, per token.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from config.paths import REPO


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides for both (e.g. max_new_tokens=64)")
    p.add_argument("--prompts-file", required=True)
    p.add_argument("-n", type=int, default=4, help="first turns of records [0, n)")
    p.add_argument("--modes", default="naive,continuous")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: from the stage root's manifest)")
    p.add_argument("--out", default=None, help="write the raw rows as JSON here")
    args = p.parse_args(argv)
    import httpx

    from model.default_model import ensure_default_stages
    from model.prompts import load_questions
    from tests.helpers import free_port, read_jsonl
    stage = next((o.split("=", 1)[1] for o in args.overrides if o.split("=", 1)[0] in ("stage_dir", "model.stage_dir")),
                 None) or str(ensure_default_stages())
    nproc = args.nproc or int(subprocess.check_output([sys.executable, "-m", "model.stage_format", stage, "--world"],
                                                      cwd=REPO, text=True).split()[-1])
    recs = load_questions(args.prompts_file, 0, args.n)
    modes = args.modes.split(",")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from pipeline.tools.ranks import launcher_command
    launch = [*launcher_command(), "--standalone", f"--nproc_per_node={nproc}"]
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        subprocess.run([*launch, "-m", "pipeline.run", *args.overrides, "--modes", args.modes, "--prompts-file",
                        args.prompts_file, "--end", str(args.n), "--first-turn-only", "--warmup", "1", "--quiet",
                        "--output", str(rows_path)], cwd=REPO, env=env, check=True)
        run_rows = read_jsonl(rows_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([*launch, "-m", "pipeline.serve", *args.overrides, "--modes", args.modes, "--warmup", "1",
                            "--port", str(port)], cwd=REPO, env=env, start_new_session=True)
    served = []
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if srv.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        for mode in modes:
            for rec in recs:
                body = {"messages": [{"role": "user", "content": rec["turns"][0]}], "mode": mode, "stream": True,
                        "return_token_ids": True, "temperature": 0}
                t0 = time.perf_counter()
                t_first = t_last = None
                last = None
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                    r.raise_for_status()
                    seen = 0
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        n = ev["speculative"]["new_tokens"]
                        if n > seen:
                            now = time.perf_counter()
                            t_first = t_first or now
                            t_last, seen = now, n
                        last = ev["speculative"]
                t_end = time.perf_counter()
                served.append({"mode": mode, "question_id": rec.get("question_id"), "ttft_s": t_first - t0,
                               "client_decode_s": t_last - t_first, "wall_s": t_end - t0, **last})
    finally:
        os.killpg(srv.pid, signal.SIGINT)
        srv.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps({"run": run_rows, "serve": served}, indent=1))
    mean = statistics.mean
    print("| mode | TTFT run (prefill) | TTFT server (client) | tok/s run | tok/s server (own decode_s) | "
          "tok/s server (client stream) | τ run | τ server | same tokens | TTFT − server prefill | overhead / request "
          "| overhead / token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        rr = [r for r in run_rows if r["mode"] == mode]
        ss = [s for s in served if s["mode"] == mode]
        same = sum(r["output_ids"] == s["output_ids"] for r, s in zip(rr, ss))
        tps_run = sum(r["new_tokens"] for r in rr) / sum(r["decode_s"] for r in rr)
        tps_srv = sum(s["new_tokens"] for s in ss) / sum(s["decode_s"] for s in ss)
        tps_cli = sum(s["new_tokens"] - 1 for s in ss) / sum(s["client_decode_s"] for s in ss)
        over = [s["wall_s"] - s["prefill_s"] - s["decode_s"] for s in ss]
        per_tok = sum(s["client_decode_s"] - s["decode_s"] for s in ss) / sum(s["new_tokens"] for s in ss)
        print(f"| `{mode}` | {mean(r['prefill_s'] for r in rr) * 1000:.0f} ms | {mean(s['ttft_s'] for s in ss) * 1000:.0f} ms "
              f"| {tps_run:.2f} | {tps_srv:.2f} | {tps_cli:.2f} | {mean(r['tau'] for r in rr):.2f} "
              f"| {mean(s['tau'] for s in ss):.2f} | {same}/{len(rr)} "
              f"| {mean(s['ttft_s'] - s['prefill_s'] for s in ss) * 1000:.0f} ms | {mean(over) * 1000:.0f} ms "
              f"| {per_tok * 1000:+.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
