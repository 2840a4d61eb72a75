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

Concurrency (``--clients 1,2,4,8``, issue 46): instead of the comparison above, start one server per value of
``--max-active`` (``serve.max_active``: requests in flight at once, ``pipeline/lanes.py``) and drive it with each
number of concurrent clients in turn; every client sends ``--per-client`` streamed greedy chat requests one after
the other (client ``j``'s ``i``-th request asks first turn ``(j * per_client + i) mod n``). One Markdown row per
(max_active, clients): aggregate new tokens/s over the row's wall time (and x ``emu.time_scale``: modeled), the
per-request median / p90 end-to-end latency and time to first token, the stage busy fractions (each request's
``busy_fraction``, weighted by its decode time), τ, the emulated testbed's worst overrun ratio and the host's
1-minute load average when the row started and ended (``serve.ring_share`` and other run keys pass through to the
server). Example (the
emulated edge testbed, docs/results.md §34):

    .venv/bin/python -m scripts.serve_bench --prompts-file ../shared/data/mt_bench/question.jsonl -n 16 \\
        --clients 1,2,4 --max-active 1,4 --per-client 2 --modes continuous \\
        emu.profile=edge_orin_7b emu.time_scale=10 max_new_tokens=32
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
from contextlib import contextmanager
from pathlib import Path

from config.paths import REPO
from pipeline.tools.ranks import free_port, launcher_command


def _setup(args) -> tuple[list[dict], list[str], dict]:
    """``(records [0, n) of --prompts-file, the launcher command for the stage root's ranks, their environment)``."""
    from model.default_model import ensure_default_stages
    from model.prompts import load_questions
    from model.stage_format import read_manifest
    stage = next((o.split("=", 1)[1] for o in args.overrides if o.split("=", 1)[0] in ("stage_dir", "model.stage_dir")),
                 None) or str(ensure_default_stages())
    nproc = args.nproc or len(read_manifest(stage)["split"])
    launch = [*launcher_command(), "--standalone", f"--nproc_per_node={nproc}"]
    return load_questions(args.prompts_file, 0, args.n), launch, dict(os.environ, OMP_NUM_THREADS="1")


@contextmanager
def _server(launch: list[str], serve_args: list[str], env: dict, timeout_s: float):
    """A ``pipeline.serve`` job on a free port, its URL once it answers ``/health`` (it exited or ``timeout_s``
    passed: stop with one line); stopped with SIGINT on the way out."""
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([*launch, "-m", "pipeline.serve", *serve_args, "--port", str(port)], cwd=REPO, env=env,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if srv.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(srv.pid, signal.SIGINT)
        srv.wait(60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides for both (e.g. max_new_tokens=64)")
    p.add_argument("--prompts-file", required=True)
    p.add_argument("-n", type=int, default=4, help="first turns of records [0, n)")
    p.add_argument("--modes", default="naive,continuous")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: from the stage root's manifest)")
    p.add_argument("--out", default=None, help="write the raw rows as JSON here")
    p.add_argument("--clients", default=None, help="concurrency bench: numbers of concurrent clients, e.g. 1,2,4,8")
    p.add_argument("--max-active", default="1,4", help="concurrency bench: serve.max_active of each server (1,4)")
    p.add_argument("--per-client", type=int, default=2, help="concurrency bench: requests per client")
    args = p.parse_args(argv)
    if args.clients:
        return concurrency(args)
    from pipeline.outputs import read_rows
    recs, launch, env = _setup(args)
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        subprocess.run([*launch, "-m", "pipeline.run", *args.overrides, "--modes", args.modes, "--prompts-file",
                        args.prompts_file, "--end", str(args.n), "--first-turn-only", "--warmup", "1", "--quiet",
                        "--output", str(rows_path)], cwd=REPO, env=env, check=True)
        run_rows = read_rows(rows_path)
    served = []
    with _server(launch, [*args.overrides, "--modes", args.modes, "--warmup", "1"], env, 600) as url:
        for mode in modes:
            for rec in recs:
                s = _stream_chat(url, rec["turns"][0], mode, return_token_ids=True)
                served.append({"mode": mode, "question_id": rec.get("question_id"), **s,
                               "client_decode_s": s["t_last"] - s["t0"] - s["ttft_s"], "wall_s": s["t_end"] - s["t0"]})
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


def _stream_chat(url: str, content: str, mode: str, **fields) -> dict:
    """One streamed greedy chat request (``fields``: more request fields): client-side send / first token / last new
    token / end times and the final statistics."""
    import httpx
    body = {"messages": [{"role": "user", "content": content}], "mode": mode, "stream": True, "temperature": 0,
            **fields}
    t0 = time.perf_counter()
    t_first, t_last, last = None, None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"the server answered an error: {ev['error']}")
            spec = ev.get("speculative")
            if spec is None:
                continue
            if spec["new_tokens"] > (last or {}).get("new_tokens", 0):
                t_last = time.perf_counter()
                t_first = t_first or t_last
            last = spec
    t_end = time.perf_counter()
    return {"t0": t0, "ttft_s": (t_first or t_end) - t0, "t_last": t_last or t_end, "t_end": t_end, **last}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def concurrency_row(rows: list[dict], scale: float) -> dict:
    """The table row of one (max_active, clients) run from its requests' records (pure)."""
    wall = max(r["t_end"] for r in rows) - min(r["t0"] for r in rows)
    tokens = sum(r["new_tokens"] for r in rows)
    lat = [r["t_end"] - r["t0"] for r in rows]
    ttft = [r["ttft_s"] for r in rows]
    dec = sum(r["decode_s"] for r in rows)
    world = len(rows[0]["busy_fraction"])
    busy = [sum(r["busy_fraction"][k] * r["decode_s"] for r in rows) / dec for k in range(world)]
    return {"requests": len(rows), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "modeled_tok_s": tokens / wall * scale, "lat_med": statistics.median(lat), "lat_p90": _pct(lat, 0.9),
            "ttft_med": statistics.median(ttft), "ttft_p90": _pct(ttft, 0.9), "busy": busy,
            "tau": sum(r["tau"] * r["steps"] for r in rows) / max(1, sum(r["steps"] for r in rows)),
            "overrun": max((r.get("emu_overrun_ratio") or 0.0) for r in rows)}


def concurrency(args) -> int:
    """``--clients``: the concurrency bench (module docstring)."""
    import concurrent.futures
    recs, launch, env = _setup(args)
    mode = args.modes.split(",")[0]
    scale = next((float(o.split("=", 1)[1]) for o in args.overrides if o.split("=", 1)[0] in
                  ("emu.time_scale", "time_scale")), 1.0)
    clients = [int(c) for c in args.clients.split(",")]
    table, raw = [], []
    for active in [int(a) for a in args.max_active.split(",")]:
        with _server(launch, [*args.overrides, f"serve.max_active={active}", "--modes", mode, "--warmup", "1",
                              "--queue-size", str(max(64, 2 * max(clients)))], env, 900) as url:
            for c in clients:
                def client(j: int) -> list[dict]:
                    return [_stream_chat(url, recs[(j * args.per_client + i) % len(recs)]["turns"][0], mode)
                            for i in range(args.per_client)]
                load0 = os.getloadavg()[0]
                with concurrent.futures.ThreadPoolExecutor(c) as ex:
                    rows = [r for rs in ex.map(client, range(c)) for r in rs]
                row = {"max_active": active, "clients": c, **concurrency_row(rows, scale),
                       "load": (load0, os.getloadavg()[0])}
                table.append(row)
                raw.append({**row, "requests_raw": rows})
                print(f"[bench] max_active={active} clients={c}: {row['tok_s']:.2f} tok/s, latency median "
                      f"{row['lat_med']:.1f} s", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(raw, indent=1))
    base = next((r for r in table if r["max_active"] == 1 and r["clients"] == 1), None)
    print(f"mode `{mode}`, {args.per_client} requests per client, time scale {scale:g} (modeled tok/s = measured x "
          f"{scale:g})\n")
    print("| max_active | clients | requests | agg tok/s (modeled) | x one client | latency median / p90 (s) | "
          "x single | TTFT median / p90 (s) | stage busy | τ | worst overrun | load start / end |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        one = next((x for x in table if x["max_active"] == r["max_active"] and x["clients"] == 1), base)
        x_tok = f"{r['tok_s'] / one['tok_s']:.2f}" if one else "-"
        x_lat = f"{r['lat_med'] / one['lat_med']:.2f}" if one else "-"
        print(f"| {r['max_active']} | {r['clients']} | {r['requests']} | {r['tok_s']:.2f} ({r['modeled_tok_s']:.1f}) "
              f"| {x_tok} | {r['lat_med']:.1f} / {r['lat_p90']:.1f} "
              f"| {x_lat} | {r['ttft_med']:.2f} / {r['ttft_p90']:.2f} "
              f"| {' '.join(f'{b:.2f}' for b in r['busy'][1:])} | {r['tau']:.2f} | {r['overrun']:.2f} "
              f"| {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
