"""Quantized stages vs full precision: greedy agreement, τ, throughput and memory per stage.

``python -m pipeline.tools.quant_report --prompts-file question.jsonl -n 20 --out-dir outputs/quant [key=value ...]``

For each ``--quants`` entry (``none`` first: it is the reference) the script launches one
``python -m pipeline.tools.launch ... -m pipeline.run quant=<q>`` over the first turns of ``-n`` records (rows in
``<out-dir>/<q>.jsonl``; a complete file is reused, so a rerun only does what is missing). Then it reports,
per quantization:

* **greedy exact match**: the fraction of answers whose token ids equal the full-precision run's (all
  runs at T=0), and the mean fraction of each answer generated before the first differing token;
* **τ** (mean tokens committed per verification round, bonus included) and decode tokens/s;
* **memory per stage**: each stage of ``--memory-stage-dir`` (default: the run's stage dir) is loaded in
  this process with the same quantization and its resident weight bytes are counted (parameters + buffers,
  plus bitsandbytes' 4-bit quantization state: absmax and code tables). The draft stage (rank 0: embeddings,
  ``lm_head``, EAGLE head) always stays in full precision.

Writes ``summary.md`` and ``summary.csv`` to ``--out-dir``.
"""
from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import torch

from config.invocation import prog
from config.paths import OUTPUTS, REPO
from pipeline.outputs import read_rows
from pipeline.tools.ranks import child_env, job_command
from pipeline.tools.rows import first_difference


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce  # each default shown once
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.quant_report"),
        description="Run the pipeline with full-precision and bitsandbytes-quantized stages on the same prompts "
                    "and report greedy agreement with full precision, τ, tokens/s and weight memory per stage.",
        epilog="Extra key=value words are config overrides for every run (see config/run_config.py), e.g. "
               "mode=naive max_new_tokens=64 model.stage_dir=DIR. Example: python -m pipeline.tools.quant_report "
               "--prompts-file data/mt_bench/question.jsonl -n 5 --quants none,int8 max_new_tokens=64",
        formatter_class=DefaultsOnce)
    p.add_argument("overrides", nargs="*", help="config overrides key=value for pipeline.run")
    p.add_argument("--prompts-file", required=True, help="FastChat question.jsonl (first turns are asked)")
    p.add_argument("-n", "--num-prompts", type=int, default=20, help="records of --prompts-file to use")
    p.add_argument("--begin", type=int, default=0, help="first record of --prompts-file (0-based)")
    p.add_argument("--quants", default="none,int8,nf4", help="comma-separated; 'none' is the reference")
    p.add_argument("--out-dir", default=str(OUTPUTS / "quant"), help="results folder")
    p.add_argument("--memory-stage-dir", default=None,
                   help="stage root whose stages are weighed (default: the run's model.stage_dir)")
    p.add_argument("--compute-dtype", default="float32", help="compute dtype of the quantized layers (memory "
                   "measurement; runs take quant_compute_dtype from the config)")
    return p.parse_args(argv)


# -- pure helpers --------------------------------------------------------------------------------------
def agreement(ref: list[int], out: list[int]) -> float:
    """Fraction of ``ref`` generated before ``out`` first differs from it (1.0 when identical)."""
    return 1.0 if ref == out else first_difference(ref, out) / max(1, len(ref))


def compare(ref_rows: list[dict], rows: list[dict]) -> dict:
    """Greedy agreement and τ of ``rows`` against the reference rows (matched by question id)."""
    ref = {r["question_id"]: r["output_ids"] for r in ref_rows}
    common = [r for r in rows if r["question_id"] in ref]
    exact = sum(1 for r in common if r["output_ids"] == ref[r["question_id"]])
    acc = [a for r in rows for a in r.get("accept_lengths") or []]
    tokens = sum(r["new_tokens"] for r in rows)
    decode = sum(r["decode_s"] for r in rows)
    return {"answers": len(common), "exact": exact,
            "exact_rate": exact / len(common) if common else 0.0,
            "prefix_agreement": (sum(agreement(ref[r["question_id"]], r["output_ids"]) for r in common)
                                 / len(common)) if common else 0.0,
            "tau": sum(acc) / len(acc) if acc else 0.0,
            "tps": tokens / decode if decode > 0 else 0.0}


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes held by a module's parameters and buffers, including bitsandbytes 4-bit quantization state."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        total += t.numel() * t.element_size()
        qs = getattr(t, "quant_state", None)
        # the 4-bit state and its nested state (double quantization of absmax), each with absmax and code tables
        for state in (qs, getattr(qs, "state2", None)):
            for name in ("absmax", "code"):
                x = getattr(state, name, None)   # None when there is no state
                if isinstance(x, torch.Tensor):
                    total += x.numel() * x.element_size()
        scb = getattr(t, "SCB", None)  # int8 row scales
        if isinstance(scb, torch.Tensor):
            total += scb.numel() * scb.element_size()
    return total


def stage_memory(root: Path, quant: str, compute_dtype: torch.dtype) -> list[int]:
    from model.stage_format import read_manifest
    from model.stage_model import load_stage
    world = len(read_manifest(root)["split"])
    out = []
    for r in range(world):
        m = load_stage(root, r, world, torch.float32, quant=quant, quant_compute_dtype=compute_dtype)
        out.append(weight_bytes(m))
        del m
    return out


# -- driver --------------------------------------------------------------------------------------------
def _stage_dir(overrides: list[str]) -> Path:
    """The run's stage root: ``model.stage_dir`` if given, else the default SmolLM2 split (built if missing)."""
    from config.run_config import RunConfig, apply_overrides
    from model.default_model import resolve_stage_root
    return resolve_stage_root(apply_overrides(RunConfig(), overrides).model.stage_dir)


def run_one(quant: str, args, stage_dir: Path, world: int, out: Path) -> list[dict]:
    rows = read_rows(out)
    if len(rows) >= args.num_prompts:
        print(f"[quant] {quant}: reusing {out} ({len(rows)} rows)", flush=True)
        return rows
    out.unlink(missing_ok=True)
    cmd = job_command(world, [f"model.stage_dir={stage_dir}", *args.overrides, f"quant={quant}", "gen.temperature=0",
                              "--prompts-file", args.prompts_file, "--begin", str(args.begin),
                              "--end", str(args.begin + args.num_prompts), "--first-turn-only", "--output", str(out),
                              "--quiet"])
    print(f"[quant] {quant}: {' '.join(cmd)}", flush=True)
    res = subprocess.run(cmd, cwd=REPO, env=child_env())
    if res.returncode:
        raise SystemExit(f"[quant] error: the {quant} run failed with exit status {res.returncode}")
    return read_rows(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    quants = [q.strip() for q in args.quants.split(",") if q.strip()]
    if not quants or quants[0] != "none":
        quants = ["none"] + [q for q in quants if q != "none"]
    from model.quant import QUANT_MODES
    bad = [q for q in quants if q not in QUANT_MODES]
    if bad:
        print(f"[quant] error: unknown quant {bad}; choose from {QUANT_MODES}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from config.run_config import ConfigError
    from model.stage_format import StageDirError, read_manifest
    try:
        stage_dir = _stage_dir(args.overrides)
        world = len(read_manifest(stage_dir)["split"])
    except (ConfigError, StageDirError) as e:
        print(f"[quant] error: {e}", file=sys.stderr)
        return 2
    overrides = [o for o in args.overrides if not o.split("=", 1)[0].endswith("stage_dir")]
    args.overrides = overrides
    results = {q: run_one(q, args, stage_dir, world, out_dir / f"{q}.jsonl") for q in quants}
    mem_root = Path(args.memory_stage_dir) if args.memory_stage_dir else stage_dir
    cdt = getattr(torch, args.compute_dtype)
    table = []
    for q in quants:
        c = compare(results["none"], results[q])
        mem = stage_memory(mem_root, q, cdt)
        table.append({"quant": q, **c, "stage_mib": [round(b / 2**20, 2) for b in mem],
                      "total_mib": round(sum(mem) / 2**20, 2)})
    mem_world = len(table[0]["stage_mib"])
    lines = [f"Stages run: `{stage_dir}` ({world} ranks); memory of `{mem_root}` ({mem_world} stages, rank 0 = "
             f"draft stage, full precision). Overrides: `{' '.join(args.overrides) or '-'}`; {args.num_prompts} "
             f"first turns of `{args.prompts_file}` from record {args.begin}, T=0.", "",
             "| quant | answers | exact match | mean agreeing prefix | τ | tok/s | "
             + " | ".join(f"stage {r} MiB" for r in range(mem_world)) + " | total MiB |",
             "|---|---|---|---|---|---|" + "---|" * mem_world + "---|"]
    for t in table:
        lines.append(f"| `{t['quant']}` | {t['answers']} | {t['exact']}/{t['answers']} ({100 * t['exact_rate']:.0f}%) "
                     f"| {100 * t['prefix_agreement']:.0f}% | {t['tau']:.2f} | {t['tps']:.2f} | "
                     + " | ".join(f"{m:.1f}" for m in t["stage_mib"]) + f" | {t['total_mib']:.1f} |")
    md = "\n".join(lines) + "\n"
    (out_dir / "summary.md").write_text(md, encoding="utf-8")
    with open(out_dir / "summary.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["quant", "answers", "exact", "exact_rate", "prefix_agreement", "tau", "tokens_per_s",
                    *[f"stage{r}_mib" for r in range(mem_world)], "total_mib"])
        for t in table:
            w.writerow([t["quant"], t["answers"], t["exact"], round(t["exact_rate"], 4),
                        round(t["prefix_agreement"], 4), round(t["tau"], 4), round(t["tps"], 3),
                        *t["stage_mib"], t["total_mib"]])
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
