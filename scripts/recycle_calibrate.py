"""The ``recycle`` source's score scale (``draft.recycle_log_p0``, ``draft.recycle_log_step``), measured on
calibration records (< 30): greedy-generate with the unsplit target (HF, fp32), teacher-force it for its top-k at
every position, feed a table online as the source's commit-time feed does (the target's top-k after every committed
position before the current one; one table kept across the prompts, as a serving process keeps it), and count, at
every generated position whose previous token has a row, the rank at which the row holds the target's next token.
``log(hits at rank r / positions with a row)`` is the score a rank-``r`` child deserves (its chance of acceptance
given its parent's); the line ``log_p0 + r * log_step`` is fitted to the first ranks by least squares.

    python -m scripts.recycle_calibrate --sets mt_bench,gsm8k,qa,sum,alpaca,humaneval --begin 20 --end 25
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from draft.recycle import RecycleTable


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.recycle_calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--sets", default="mt_bench,gsm8k,qa,sum,alpaca,humaneval")
    p.add_argument("--begin", type=int, default=20)
    p.add_argument("--end", type=int, default=25)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--fit-ranks", type=int, default=4, help="ranks the line is fitted to")
    a = p.parse_args(argv)
    if a.end > 30:
        print("recycle_calibrate: error: --end must be <= 30 (records >= 30 are held out)", file=sys.stderr)
        return 2
    try:
        return _run(a)
    except (OSError, ValueError) as e:
        print(f"recycle_calibrate: error: {e}", file=sys.stderr)
        return 2


def _run(a) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.tools.drafter_bench import expand_sets, load_prompts
    if not (Path(a.model) / "config.json").is_file():
        raise ValueError(f"--model {a.model}: no config.json there (an unsplit Hugging Face model directory)")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    table = RecycleTable(a.k)
    hits, rows, positions = [0] * a.k, 0, 0
    for name in expand_sets(a.sets.split(",")):
        for ids in load_prompts(Path(a.data), name, a.begin, a.end, tok):
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False)[0]
                logits = model(out[None]).logits[0]
            seq = out.tolist()
            top = torch.topk(logits, a.k, dim=-1).indices.tolist()
            for i in range(len(ids) - 1, len(seq) - 1):     # position i: its next token seq[i + 1] is generated
                positions += 1
                row = table.row(seq[i])
                if row:
                    rows += 1
                    if seq[i + 1] in row:
                        hits[row.index(seq[i + 1])] += 1
                table.update([seq[i]], [top[i]])            # committed: its row is known from now on
    print(f"positions={positions} with_row={rows} ({rows / max(positions, 1):.3f})")
    pts = []
    for r, h in enumerate(hits):
        rate = h / max(rows, 1)
        print(f"rank {r}: hits={h} rate={rate:.4f} log={math.log(rate) if rate > 0 else float('-inf'):.3f}")
        if r < a.fit_ranks and rate > 0:
            pts.append((r, math.log(rate)))
    n = len(pts)
    if n >= 2:
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        step = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        print(f"fit over ranks < {a.fit_ranks}: log_p0={my - step * mx:.3f} log_step={step:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
