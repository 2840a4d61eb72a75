"""Issue 41's "show it": rank 0's host work priced two ways, on fast hardware and on the edge, in one table.

Runs the what-if simulator (``pipeline.tools.simulate``) on the same recorded answers for every (part, pricing):

* ``whatif``: the fast-hardware what-if: the H100 7B-stage profile (``--h100-profile``), 4 stages, 100 Gbit/s;
* ``edge``: the edge profile ``edge_orin_7b``, 4 stages, its 150 Mbit/s links;

each with ``--rank0-cost measured`` (rank 0's host work at this CPU's thread time) and ``--rank0-cost ops``
(rank 0's counted operators and syncs x the profile's per-op / per-sync cost), modes ``ar,pipedec,continuous``,
a Gantt chart of the first answer per mode, then prints and writes (``<out-dir>/whatif_rank0.md``) one table:
ξ per mode, ``continuous``'s speed-up over ``ar`` and ``pipedec``, rank 0's turnaround against a stage step, rank
0's operators and syncs per token, against issue 41's goals, with the wall time of every run. Rerun it after
a change to rank 0's drafting (the counts move; the costs stay).

Rows: ``--rows FILE`` (any recorded rows at T = 0), or, by default, recorded here with ``hf_generate``: the first
turns of records [30, 34) of the six sets in ``--data-dir`` (24 answers of 64 tokens; ``--limit`` keeps the first
N). The runs go ``--jobs`` at a time (each is one process with one torch thread).

Example::

    python -m scripts.whatif_rank0 --data-dir ../shared/data --limit 20 --edge-limit 8 --out-dir outputs/whatif_rank0
"""
from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

from config.paths import DATASETS, OUTPUTS, REPO

MODES = "ar,pipedec,continuous"
GOALS = {"whatif": "continuous >= 2.5x ar and >= 1.3x pipedec; rank 0's turnaround <= 0.5 of a stage step",
         "edge": "rank 0's turnaround <= 0.4 of a stage step (0.86 on the 140 answers of results.md section 3)"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.whatif_rank0", description=__doc__.split("\n\n")[0],
                                epilog="Example: python -m scripts.whatif_rank0 --data-dir ../shared/data --limit 20 "
                                       "--edge-limit 8 --out-dir outputs/whatif_rank0")
    p.add_argument("--rows", default="", help="recorded rows (T = 0); default: record them into <out-dir>/rows.jsonl")
    p.add_argument("--data-dir", default="data", help="<set>/question.jsonl for recording the rows")
    p.add_argument("--limit", type=int, default=20, help="answers for the fast-hardware what-if (>= 20: issue 41)")
    p.add_argument("--edge-limit", type=int, default=20, help="answers for the edge table")
    p.add_argument("--parts", default="whatif,edge", help="whatif, edge, or both")
    p.add_argument("--pricings", default="measured,ops", help="--rank0-cost values to compare")
    p.add_argument("--h100-profile", default=str(REPO.parent / "shared" / "gpu" / "profiles" / "h100_7b_fp16.json"),
                   help="the fast-hardware profile (the H100 7B-stage profile measured on a lent H100)")
    p.add_argument("--jobs", type=int, default=2, help="simulator runs at a time")
    p.add_argument("--out-dir", default=str(OUTPUTS / "whatif_rank0"))
    return p.parse_args(argv)


def record(rows: Path, data_dir: Path) -> None:
    for s in DATASETS:
        q = data_dir / s / "question.jsonl"
        if not q.is_file():
            raise SystemExit(f"error: {q} not found (give --data-dir, or --rows)")
        subprocess.run([sys.executable, "-m", "pipeline.tools.hf_generate", "--prompts-file", str(q), "--begin", "30",
                        "--end", "34", "--output", str(rows), "--quiet", "max_new_tokens=64"], check=True, cwd=REPO)


def command(part: str, pricing: str, rows: Path, limit: int, out: Path, h100: str) -> list[str]:
    cmd = [sys.executable, "-m", "pipeline.tools.simulate", str(rows), "--limit", str(limit), "--stages", "4",
           "--modes", MODES, "--rank0-cost", pricing, "--gantt", "0", "--out-dir", str(out)]
    if part == "whatif":
        cmd += ["--profile", h100, "--bandwidth-mbps", "100000", "--gantt-window", "0.1"]
    else:
        cmd += ["--profile", "edge_orin_7b", "--gantt-window", "1.0"]
    return cmd + ["max_new_tokens=64"]


def read_summary(path: Path) -> dict[str, dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return {r["mode"]: r for r in csv.DictReader(f)}


def num(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def table(results: dict, parts: list[str], pricings: list[str], limits: dict) -> str:
    lines = []
    for part in parts:
        lines += [f"**{part}** ({limits[part]} answers; goal: {GOALS[part]})", "",
                  "| rank 0's host work | ξ ar | ξ pipedec | ξ continuous | c / ar | c / pipedec | turnaround / "
                  "stage step (continuous) | (pipedec) | rank 0 ops / token (c) | syncs / token (c) | run (s) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for pr in pricings:
            got = results.get((part, pr))
            if got is None:
                continue
            s, secs = got
            ar, pd, c = (num(s.get(m, {}).get("pred_xi")) for m in ("ar", "pipedec", "continuous"))
            ta = s.get("continuous", {}).get("turnaround_vs_step", "")
            tp = s.get("pipedec", {}).get("turnaround_vs_step", "")
            step = s.get("continuous", {}).get("stage_step_ms", "")
            tams = s.get("continuous", {}).get("r0_turnaround_ms", "")
            lines.append(f"| {pr} | {ar} | {pd} | {c} | {c / ar:.2f} | {c / pd:.2f} | {ta} ({tams} of {step} ms) | "
                         f"{tp} | {s.get('continuous', {}).get('r0_ops_per_token', '')} | "
                         f"{s.get('continuous', {}).get('r0_syncs_per_token', '')} | {secs:.0f} |"
                         if ar and pd and c else f"| {pr} | incomplete | | | | | | | | | {secs:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = Path(args.rows) if args.rows else out / "rows.jsonl"
    t0 = time.perf_counter()
    if not rows.is_file():
        record(rows, Path(args.data_dir))
    parts = [p for p in args.parts.split(",") if p]
    pricings = [p for p in args.pricings.split(",") if p]
    if any(p not in GOALS for p in parts):
        raise SystemExit(f"error: --parts takes {', '.join(GOALS)}")
    limits = {"whatif": args.limit, "edge": args.edge_limit}
    todo = [(part, pr) for part in parts for pr in pricings]
    running: dict = {}
    results: dict = {}
    while todo or running:
        while todo and len(running) < max(1, args.jobs):
            part, pr = todo.pop(0)
            d = out / f"{part}_{pr}"
            cmd = command(part, pr, rows, limits[part], d, args.h100_profile)
            print("+ " + " ".join(cmd[1:]), flush=True)
            d.mkdir(parents=True, exist_ok=True)
            log = open(d / "run.log", "w", encoding="utf-8")
            running[(part, pr)] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT),
                                   time.perf_counter(), log)
        time.sleep(2)
        for key, (proc, start, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[key]
            secs = time.perf_counter() - start
            if proc.returncode != 0:
                print(f"error: {key} exited {proc.returncode}; see {out / f'{key[0]}_{key[1]}' / 'run.log'}",
                      file=sys.stderr)
                continue
            results[key] = (read_summary(out / f"{key[0]}_{key[1]}" / "summary.csv"), secs)
            print(f"done {key[0]} {key[1]} in {secs:.0f} s", flush=True)
    text = table(results, parts, pricings, limits)
    text += f"\nWall time of the whole script: {time.perf_counter() - t0:.0f} s ({args.jobs} runs at a time).\n"
    (out / "whatif_rank0.md").write_text(text, encoding="utf-8")
    print(text)
    return 0 if len(results) == len(parts) * len(pricings) else 1


if __name__ == "__main__":
    sys.exit(main())
