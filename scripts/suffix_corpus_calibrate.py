"""How often the suffix source's best copied token is right, by match length, for a match in the request's own text
against a match in other requests' answers (what ``draft.suffix_threshold`` and ``draft.suffix_other_threshold`` are
set from; docs/suffix.md "Other texts' threshold").

The data are self-distilled conversations (``python -m draft.train_eagle data``: ``input_ids`` and ``loss_mask``),
never ``drafter_bench``'s held-out records. The last ``--queries`` greedy conversations (``"sampled": false``) in file
order are the queries; every answer of every other conversation is the corpus (``draft.train.corpus.answer_spans``,
as ``python -m draft.train.corpus`` writes it), so no query finds itself there. The queries are decoded in order, and
each one's whole text joins a store after it (as ``draft.suffix_history_tokens`` keeps earlier requests in serving).
At every answer token of a query, each automaton's proposal match (the longest suffix of the text so far that
occurred followed by a token) proposes its most frequent next token; the table counts how often that is the token
the target emitted, by match length, for the query's own text, the store and the corpus.

Example::

    python -m draft.train_eagle data --device cpu --self-prompts 640 --temperature 0.8 --sample-frac 0.5 \\
        --out outputs/replay.jsonl
    python -m scripts.suffix_corpus_calibrate outputs/replay.jsonl --queries 120
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from draft.suffix import SuffixAutomaton, advance, children, with_continuation
from draft.train.corpus import answer_spans
from scripts.suffix_replay import bucket      # the match-length buckets of suffix_replay's table

BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


def split(records: list[dict], queries: int) -> tuple[list[dict], list[dict]]:
    """(queries, corpus records): the last ``queries`` greedy records, and every other record."""
    greedy = [i for i, r in enumerate(records) if not r.get("sampled")]
    q = set(greedy[-queries:]) if queries > 0 else set()
    return [records[i] for i in sorted(q)], [r for i, r in enumerate(records) if i not in q]


def accuracy(queries: list[dict], corpus: SuffixAutomaton) -> dict:
    """``{(automaton, bucket): [right, tried]}`` over the answer tokens of ``queries`` (automaton: own, store,
    corpus; the store holds the queries before this one)."""
    acc: dict = defaultdict(lambda: [0, 0])
    store = SuffixAutomaton()
    for r in queries:
        own = SuffixAutomaton()
        others = {"store": (store, 0, 0), "corpus": (corpus, 0, 0)}
        for j, t in enumerate(r["input_ids"]):
            if j > 0 and r["loss_mask"][j]:
                for name, sam, st, ln in (("own", own, own.last, own.length[own.last]),
                                          *((k, *v) for k, v in others.items())):
                    st, ln = with_continuation(sam, st, ln)
                    if st > 0:
                        (best, _) = children(sam, st, 1)
                        acc[(name, bucket(ln))][0] += best[0][1] == t
                        acc[(name, bucket(ln))][1] += 1
            own.extend(t)
            others = {k: (sam, *advance(sam, st, ln, t)) for k, (sam, st, ln) in others.items()}
        store.add_document(r["input_ids"])
    return acc


def table(acc: dict) -> str:
    head = "| match length | " + " | ".join(f"{b}" if b < 8 else f"{b}+" for b in BUCKETS) + " |"
    lines = [head, "|---" * (len(BUCKETS) + 1) + "|"]
    for name in ("own", "store", "corpus"):
        cells = [f"{acc[(name, b)][0] / acc[(name, b)][1]:.2f} ({acc[(name, b)][1]})" if acc[(name, b)][1] else "-"
                 for b in BUCKETS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.suffix_corpus_calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="+", help="JSONL files from `python -m draft.train_eagle data`")
    ap.add_argument("--queries", type=int, default=120, help="greedy conversations held out as queries")
    args = ap.parse_args(argv)
    records = []
    for path in args.data:
        try:
            with open(path) as f:
                records += [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            print(f"suffix_corpus_calibrate: cannot read {path}: {e}", file=sys.stderr)
            return 2
    if any("input_ids" not in r or "loss_mask" not in r for r in records):
        print("suffix_corpus_calibrate: every record needs input_ids and loss_mask (draft.train_eagle data)",
              file=sys.stderr)
        return 2
    queries, rest = split(records, args.queries)
    if not queries:
        print("suffix_corpus_calibrate: no greedy (\"sampled\": false) record to hold out", file=sys.stderr)
        return 2
    corpus = SuffixAutomaton()
    tokens = 0
    for r in rest:
        for span in answer_spans(r["input_ids"], r["loss_mask"]):
            corpus.add_document(span)
            tokens += len(span)
    print(f"{len(queries)} query conversations; corpus: {len(rest)} conversations, {tokens} answer tokens\n")
    print("copied token right (tried), by the proposal match's length\n")
    print(table(accuracy(queries, corpus)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
