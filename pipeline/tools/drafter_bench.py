"""Compare drafter combinations (``draft.sources``) on the six evaluation sets: τ per dataset, rank 0's work per
verification round, and a check that every combination's output is token-identical to the first one's (T = 0).

Every configuration runs mode ``naive`` (or ``--mode``) at the same tree budget (the run defaults: 60 nodes,
depth 5, top-k 10) through the in-process ring (:mod:`pipeline.inprocess`: the real stage worker, engine and
modes in one process), on the first turn of records ``[--begin, --end)`` of each dataset. Rows go to
``OUT/rows.jsonl`` as each dataset finishes (one per generation, with ``prompt_ids``/``output_ids``, so
``python -m pipeline.tools.simulate OUT/rows.jsonl --modes naive draft.sources=...`` replays them under an
emulation profile); a rerun skips the (sources, dataset) pairs already there. ``OUT/summary.csv`` and the
markdown table printed at the end hold the per-dataset τ and the ratio to the first configuration.

Example::

    python -m pipeline.tools.drafter_bench --sources eagle --sources eagle,lookup \\
        --sources eagle,lookup,ssm:draft/ssms/SmolLM2-135M-Instruct/ssm_1 --begin 30 --end 50 --out outputs/drafters
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

from config.paths import REPO

SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")


def load_prompts(data: Path, name: str, begin: int, end: int, tok) -> list[list[int]]:
    from model.prompts import chat_prompt_ids
    path = data / name / "question.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (--data points at a folder of <dataset>/question.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [chat_prompt_ids(tok, [r["turns"][0]], [], "", "auto") for r in rows[begin:end]]


def summarize(rows: list[dict], configs: list[str], sets: list[str], check_identity: bool = True) -> list[dict]:
    """One summary row per configuration: τ per dataset (all tokens / all verification steps), the mean over
    datasets, its ratio to the first configuration, rank 0's busy ms per round and whether every output equals
    the first configuration's (T = 0 only: ``check_identity``; None otherwise)."""
    def key(r):
        return r["dataset"], r["record"]
    first = {key(r): r["output_ids"] for r in rows if r["sources"] == configs[0]}
    out = []
    for c in configs:
        mine = [r for r in rows if r["sources"] == c]
        s = {"sources": c}
        for d in sets:
            rs = [r for r in mine if r["dataset"] == d]
            steps = sum(len(r["accept_lengths"]) for r in rs)
            s[d] = round(sum(sum(r["accept_lengths"]) for r in rs) / steps, 3) if steps else None
        taus = [s[d] for d in sets if s[d] is not None]
        s["mean"] = sum(taus) / len(taus) if taus else None
        rounds = sum(r["rounds"] for r in mine)
        s["rank0_ms_per_round"] = round(1000 * sum(r["rank0_busy_s"] for r in mine) / rounds, 1) if rounds else None
        s["identical_to_first"] = (all(first.get(key(r)) == r["output_ids"] for r in mine) if check_identity
                                   else None)
        s["generations"] = len(mine)
        out.append(s)
    base = out[0]["mean"] if out and out[0]["mean"] else None
    for s in out:
        s["x_first"] = round(s["mean"] / base, 3) if base and s["mean"] else None
        s["mean"] = round(s["mean"], 3) if s["mean"] else None
    return out


def markdown(summary: list[dict], sets: list[str]) -> str:
    head = ["sources", *sets, "mean", "× first", "rank 0 ms / round", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        cells = [f"`{s['sources']}`", *(f"{s[d]:.2f}" if s[d] is not None else "-" for d in sets),
                 f"{s['mean']:.2f}" if s["mean"] else "-", f"{s['x_first']:.2f}" if s["x_first"] else "-",
                 f"{s['rank0_ms_per_round']}",
                 {True: "yes", False: "**NO**", None: "(T > 0)"}[s["identical_to_first"]]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> int:
    from config.paths import DEFAULT_HEAD_DIR, DEFAULT_STAGE_DIR
    from model.prompts import stop_token_ids
    from pipeline.build import load_tokenizer
    from pipeline.inprocess import run_threaded
    torch.set_num_threads(args.threads)
    stage_root = Path(args.stage_dir) if args.stage_dir else DEFAULT_STAGE_DIR
    head = args.head_dir or str(DEFAULT_HEAD_DIR)
    from model.stage_format import read_manifest
    world = len(read_manifest(stage_root)["split"])
    tok = load_tokenizer(stage_root)
    stops = stop_token_ids(tok, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    from pipeline.outputs import read_rows
    rows = read_rows(rows_path) if rows_path.is_file() else []
    done = {(r["sources"], r["dataset"]) for r in rows}
    data = Path(args.data)
    prompts = {d: load_prompts(data, d, args.begin, args.end, tok) for d in args.sets}
    for c in args.sources:
        for d in args.sets:
            if (c, d) in done:
                continue
            t0 = time.time()
            sources, *own = c.split()     # "eagle,lookup,ssm:DIR draft.ssm_score_scale=3": its own overrides last
            over = [f"max_new_tokens={args.max_new_tokens}", "dtype=float32", f"draft.sources={sources}",
                    f"temperature={args.temperature}", *args.overrides, *own]
            res = run_threaded(stage_root, prompts[d], [args.mode], over, stops, head, dtype=torch.float32)[args.mode]
            with rows_path.open("a") as f:
                for i, (p, r) in enumerate(zip(prompts[d], res)):
                    row = {"sources": c, "dataset": d, "record": args.begin + i, "mode": args.mode,
                           "prompt_ids": p, "output_ids": r.output_ids, "accept_lengths": r.accept_lengths,
                           "rounds": r.rounds, "decode_s": r.decode_s,
                           "rank0_busy_s": (r.busy_fraction[0] if r.busy_fraction else 0.0) * r.decode_s,
                           "world_size": world, "temperature": args.temperature}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
            taus = [r.tau for r in res]
            print(f"[drafter_bench] {c} {d}: tau {sum(taus) / max(1, len(taus)):.2f} ({len(res)} prompts, "
                  f"{time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    summary = summarize(rows, args.sources, list(args.sets), check_identity=args.temperature == 0)
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    print(markdown(summary, list(args.sets)))
    return 0 if all(s["identical_to_first"] is not False for s in summary) else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline.tools.drafter_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", action="append", required=True,
                    help="a draft.sources value, optionally followed by key=value overrides of this configuration "
                         "alone, e.g. 'eagle,lookup,ssm:DIR draft.ssm_score_scale=3' (repeatable; the first is the "
                         "reference)")
    ap.add_argument("--sets", type=lambda s: s.split(","), default=list(SETS), help="comma-separated datasets")
    ap.add_argument("--begin", type=int, default=30)
    ap.add_argument("--end", type=int, default=50)
    ap.add_argument("--mode", default="naive", help="decoding mode (e.g. sps with draft.sources=ssm:<dir>)")
    ap.add_argument("--temperature", type=float, default=0.0, help="T > 0: no identity check (outputs are draws)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"), help="folder of <dataset>/question.jsonl")
    ap.add_argument("--stage-dir", default=None, help="stage root (default: the SmolLM2 split)")
    ap.add_argument("--head-dir", default=None, help="EAGLE head for the `eagle` source (default: the shipped one)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="output folder (rows.jsonl, summary.csv)")
    ap.add_argument("overrides", nargs="*", help="further key=value run overrides")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except FileNotFoundError as e:
        print(f"[drafter_bench] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
