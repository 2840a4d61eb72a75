"""A static corpus for the suffix source (``draft.suffix_corpus``, :mod:`draft.suffix`) from a self-distilled
``data`` file: the target's own answers, as the token ids it produced in context.

``python -m draft.train_eagle data ... --temperature 0`` writes conversations with ``input_ids`` and a
``loss_mask`` (1 on the assistant's tokens, :func:`draft.train.generate.build_conversations`); every maximal run of
masked tokens is one answer. :func:`answer_spans` cuts them out and :func:`write_corpus` writes one
``{"token_ids": [...]}`` line per answer, which :func:`draft.suffix.read_corpus` indexes as they are (no
re-tokenisation: the ids are exactly what the target emitted after its chat template).

Only answers go in, not prompts: a retrieval match is worth proposing when what follows it is something the target
says. The prompts must be *training* prompts (for the measurements in docs/results.md: the six sets' records below
30 and the broad training kinds of :mod:`draft.train.broad_prompts`, never the held-out records 30.. that
``drafter_bench`` measures: ``data --exclude FILE:30:1000`` for each set).

Example::

    python -m draft.train_eagle data --device cpu --temperature 0 --max-new-tokens 128 --broad 160 \\
        --prompts ../shared/data/gsm8k/question.jsonl --exclude ../shared/data/gsm8k/question.jsonl:30:1000 \\
        --out outputs/corpus_raw.jsonl
    python -m draft.train.corpus outputs/corpus_raw.jsonl --out outputs/corpus.jsonl
    python -m pipeline.run draft.sources=eagle,suffix draft.suffix_max_depth=12 draft.suffix_corpus=outputs/corpus.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def answer_spans(input_ids: list[int], loss_mask: list[int], stop_ids=(), min_len: int = 1) -> list[list[int]]:
    """The maximal runs of ``input_ids`` where ``loss_mask`` is 1, each with the ids in ``stop_ids`` removed at its
    end (an end-of-turn token is not a continuation worth copying across documents); runs shorter than
    ``min_len`` after that are dropped. Pure. Invariants: the spans are disjoint, in order, every one a contiguous
    slice of ``input_ids`` under mask 1, and their concatenation with the trailing stops is every masked token."""
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"input_ids ({len(input_ids)}) and loss_mask ({len(loss_mask)}) differ in length")
    spans, cur = [], []
    for t, m in zip(input_ids, loss_mask):
        if m:
            cur.append(int(t))
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    stops = set(stop_ids)
    out = []
    for s in spans:
        while s and s[-1] in stops:
            s = s[:-1]
        if len(s) >= min_len:
            out.append(s)
    return out


def write_corpus(records: list[dict], out: str | Path, stop_ids=(), min_len: int = 4) -> tuple[int, int]:
    """Write every record's answers (:func:`answer_spans`) as ``{"token_ids": [...]}`` lines; returns
    ``(answers, tokens)`` written."""
    n = tokens = 0
    with open(out, "w", encoding="utf-8") as f:
        for r in records:
            for s in answer_spans(r["input_ids"], r["loss_mask"], stop_ids, min_len):
                f.write(json.dumps({"token_ids": s}) + "\n")
                n += 1
                tokens += len(s)
    return n, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft.train.corpus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="+", help="JSONL files from `python -m draft.train_eagle data`")
    ap.add_argument("--out", required=True, help="corpus JSONL to write (draft.suffix_corpus=OUT)")
    ap.add_argument("--stop-ids", default="1,2", help="ids stripped from the end of an answer (SmolLM2: "
                                                      "<|im_start|>=1, <|im_end|>=2)")
    ap.add_argument("--min-len", type=int, default=4, help="shortest answer kept (tokens)")
    args = ap.parse_args(argv)
    try:
        stops = [int(x) for x in args.stop_ids.split(",") if x.strip()]
        records = [json.loads(line) for p in args.data for line in Path(p).read_text(encoding="utf-8").splitlines()
                   if line.strip()]
        n, tokens = write_corpus(records, args.out, stops, args.min_len)
    except (OSError, ValueError, KeyError) as e:
        print(f"corpus: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"corpus: {n} answers, {tokens} tokens -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
