"""Why rounds end, per category, from recorded greedy generations: the target's own certainty along its answer, the
draft head's first-level recall of the target's tokens, and where (at which depth) the rounds ended.

For each ``drafter_bench`` row (``prompt_ids``, ``output_ids``, ``accept_lengths``; T = 0, ``naive``) the target
(the unsplit HF model) and the EAGLE head are run teacher-forced over prompt + answer, once:

  * **target top-1 probability** ``p1`` of each answer token (the greedy token is the target's argmax; a low ``p1``
    means the target itself hesitates there, so any draft is a guess);
  * **head recall at the first level**: the head's entry ``(x_{t+1}, f_t)`` predicts ``x_{t+2}`` (what the tree's
    first level below the root drafts); top-1 and top-k recall of the target's token, with the true features (an
    upper bound for deeper levels, which see the head's own features);
  * **round ends** (:func:`round_marks`): each round commits ``a`` tokens, the last of them the target's own token
    where the tree had no matching child (its depth below the round's root is ``a``); those tokens' ``p1`` and head
    recall against the accepted (drafted) ones'.

Example::

    python -m pipeline.tools.drafter_bench --sources eagle,lookup --sets six,broad --begin 30 --end 33 \\
        --max-new-tokens 64 --out outputs/base
    python -m scripts.round_ends outputs/base/rows.jsonl --out outputs/base/round_ends.md
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch


def round_marks(accept_lengths: list[int], n_out: int) -> list[tuple[int, int, bool]]:
    """``(depth, round, is_end)`` for answer tokens ``1..n_out-1`` (token 0 comes from the prefill).

    Round ``r`` commits ``accept_lengths[r]`` tokens: the first ``a - 1`` were drafted and accepted (depths
    ``1..a-1`` below the round's root), the ``a``-th is the target's own token where the tree had no matching child
    (``is_end``; its depth ``a``). Invariants: one mark per committed token after the first, ``sum(a) == n_out - 1``
    (else ValueError: the row is not a complete greedy ``naive`` record), and exactly one ``is_end`` per round.
    """
    if sum(accept_lengths) != n_out - 1 or any(a < 1 for a in accept_lengths):
        raise ValueError(f"accept lengths {accept_lengths} do not cover {n_out - 1} committed tokens")
    marks = []
    for r, a in enumerate(accept_lengths):
        marks.extend((d, r, d == a) for d in range(1, a + 1))
    return marks


def summarize(points: list[dict], k: int) -> dict:
    """Per category means of the teacher-forced measures (``points``: one dict per answer token with ``p1``,
    ``head_rank``, ``is_end``, ``depth``); pure."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")
    ends = [p for p in points if p["is_end"]]
    acc = [p for p in points if not p["is_end"]]
    return {"tokens": len(points), "rounds": len(ends), "tau": len(points) / max(1, len(ends)),
            "p1": mean([p["p1"] for p in points]),
            "p1_lt_05": mean([float(p["p1"] < 0.5) for p in points]),
            "head_top1": mean([float(p["head_rank"] == 0) for p in points]),
            f"head_top{k}": mean([float(p["head_rank"] < k) for p in points]),
            "end_p1": mean([p["p1"] for p in ends]), "acc_p1": mean([p["p1"] for p in acc]),
            "end_head_top1": mean([float(p["head_rank"] == 0) for p in ends]),
            f"end_head_top{k}": mean([float(p["head_rank"] < k) for p in ends]),
            "end_depth1": mean([float(p["depth"] == 1) for p in ends]),
            "p1_ge_08": mean([float(p["p1"] >= 0.8) for p in points]),
            "head_top1_if_p1_ge_08": mean([float(p["head_rank"] == 0) for p in points if p["p1"] >= 0.8]),
            "head_top1_if_p1_lt_08": mean([float(p["head_rank"] == 0) for p in points if p["p1"] < 0.8])}


@torch.no_grad()
def measure_row(model, head, lm_head, row: dict) -> list[dict]:
    """The teacher-forced measures of one row's answer tokens ``1..n-1`` (see the module docstring)."""
    from draft.train.objective import head_forward
    prompt, out = list(row["prompt_ids"]), list(row["output_ids"])
    ids = torch.tensor([prompt + out])
    h = model.model(input_ids=ids).last_hidden_state             # f_t, [1, L, H]
    probs = torch.softmax(model.lm_head(h).float(), dim=-1)[0]  # target law at t+1
    pred = head_forward(head, ids[:, 1:], h[:, :-1])            # entry t -> f_{t+1} -> x_{t+2}
    hlog = lm_head(pred)[0]                                     # [L-1, V]: row t predicts ids[t+2]
    marks = round_marks(row["accept_lengths"], len(out))
    pts = []
    for j, (depth, _r, is_end) in enumerate(marks, start=1):
        pos = len(prompt) + j                   # absolute index of answer token j
        tok = ids[0, pos]
        p1 = float(probs[pos - 1, tok])
        score = hlog[pos - 2]
        rank = int((score > score[tok]).sum())
        pts.append({"p1": p1, "head_rank": rank, "is_end": is_end, "depth": depth})
    return pts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.round_ends", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="drafter_bench rows.jsonl files (T = 0, naive)")
    ap.add_argument("--sources", default=None, help="only rows of this draft.sources label (default: the first)")
    ap.add_argument("--head-dir", default="draft/heads/SmolLM2-135M-Instruct")
    ap.add_argument("--k", type=int, default=10, help="top-k of the head's recall (the tree's top_k)")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--sets", default=None, help="only these datasets (comma-separated)")
    args = ap.parse_args(argv)
    from draft.eagle import load_eagle_head
    from draft.train.target import default_target, load_target, read_target_embeddings
    try:
        rows = [json.loads(line) for f in args.rows for line in Path(f).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        print(f"round_ends: error: {e}", file=sys.stderr)
        return 2
    label = args.sources or (rows[0]["sources"] if rows else None)
    rows = [r for r in rows if r["sources"] == label and r.get("temperature", 0) == 0]
    seen: set = set()
    rows = [r for r in rows if not ((r["dataset"], tuple(r["prompt_ids"])) in seen
                                    or seen.add((r["dataset"], tuple(r["prompt_ids"]))))]   # a prompt counts once
    if args.sets:
        rows = [r for r in rows if r["dataset"] in args.sets.split(",")]
    if not rows:
        print("round_ends: no T = 0 rows of that configuration", file=sys.stderr)
        return 2
    tdir = default_target()
    model = load_target(tdir, "cpu")
    emb_w, lm_w = read_target_embeddings(tdir)
    head = load_eagle_head(args.head_dir, model.config, target_embed=emb_w.float()).float().eval()
    lm_head = torch.nn.Linear(lm_w.shape[1], lm_w.shape[0], bias=False)
    lm_head.weight.data.copy_(lm_w.float())
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_cat[r["dataset"]].extend(measure_row(model, head, lm_head, r))
    k = args.k
    cols = ["tokens", "rounds", "tau", "p1", "p1_lt_05", "head_top1", f"head_top{k}", "acc_p1", "end_p1",
            "end_head_top1", f"end_head_top{k}", "end_depth1", "p1_ge_08", "head_top1_if_p1_ge_08",
            "head_top1_if_p1_lt_08"]
    lines = [f"rows: {label}, head {args.head_dir}", "", "| category | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for cat in sorted(by_cat):
        s = summarize(by_cat[cat], k)
        lines.append(f"| {cat} | " + " | ".join(f"{s[c]:.3f}" if isinstance(s[c], float) else str(s[c])
                                                 for c in cols) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
