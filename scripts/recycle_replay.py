"""Model-side replay of token recycling (draft/recycle.py) alone: greedy-generate with the unsplit target (HF), then
simulate rounds online: at a round whose root is committed position ``i``, the table holds the target's top-k after
every committed position ``< i`` (the commit-time feed: committed rows only), the recycle tree (``total`` nodes,
``depth`` levels) is walked along the known greedy continuation, and the round commits accepted + 1 tokens. Prints
tokens per round (τ of a recycle-only tree) per set. Scores: rank r scores ``r * log_step`` (a fixed a-priori scale,
not calibrated: alone, only the order matters).

    python -m scripts.recycle_replay --sets translation,sum --begin 30 --end 32 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from draft.recycle import RecycleTable, recycle_tree


def accepted(tokens, parents, cont):
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, len(tokens)):
        kids.setdefault(parents[i], {})[tokens[i]] = i
    node = n = 0
    while n < len(cont) and cont[n] in kids.get(node, {}):
        node = kids[node][cont[n]]
        n += 1
    return n


def replay(seq: list[int], top: list[list[int]], start: int, k: int, total: int, depth: int,
           table: RecycleTable | None = None) -> tuple[int, int]:
    """``seq``: prompt + output; ``top[j]``: the target's top ids after position j; ``table``: one kept across
    prompts (earlier requests of the process), else a fresh one. Returns (rounds, tokens)."""
    table = RecycleTable(k) if table is None else table
    table.update(seq[:start], top[:start])          # the prefill's rows (prompt positions before the root)
    i, rounds, toks = start, 0, 0                   # position i = the root (last committed token)
    fed = start
    while i < len(seq) - 1:
        table.update(seq[fed:i], top[fed:i])
        fed = i
        tokens, parents, _ = recycle_tree(table, seq[i], total, depth, 0.0, -1.0)
        a = accepted(tokens, parents, seq[i + 1:])
        a = min(a, len(seq) - 1 - i - 1)
        rounds += 1
        toks += a + 1
        i += a + 1
    return rounds, toks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.recycle_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--sets", default="translation,sum")
    p.add_argument("--begin", type=int, default=30)
    p.add_argument("--end", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", default="4,8")
    p.add_argument("--total", type=int, default=60)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--persist", action="store_true", help="one table per k kept across all prompts, in order")
    a = p.parse_args(argv)
    try:
        return _run(a)
    except (OSError, ValueError) as e:             # a missing model or question file, a bad --k or --sets: one line
        print(f"recycle_replay: error: {e}", file=sys.stderr)
        return 2


def _run(a) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.tools.drafter_bench import expand_sets, load_prompts
    if not (Path(a.model) / "config.json").is_file():
        raise ValueError(f"--model {a.model}: no config.json there (an unsplit Hugging Face model directory)")
    ks = [int(x) for x in a.k.split(",")]
    if not ks or min(ks) < 1:
        raise ValueError(f"--k {a.k}: comma-separated table widths >= 1")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tables = {k: RecycleTable(k) for k in ks}
    for name in expand_sets(a.sets.split(",")):
        res = {k: [0, 0] for k in ks}
        for ids in load_prompts(Path(a.data), name, a.begin, a.end, tok):
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False)[0]
                logits = model(out[None]).logits[0]
            seq = out.tolist()
            top = torch.topk(logits, max(ks), dim=-1).indices.tolist()
            for k in ks:
                r, t = replay(seq, top, len(ids) - 1, k, a.total, a.depth, tables[k] if a.persist else None)
                res[k][0] += r
                res[k][1] += t
        for k in ks:
            r, t = res[k]
            print(f"{name}\tk={k}\trounds={r}\ttokens={t}\ttau={t / max(r, 1):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
