"""Replay recorded greedy generations through the retrieval drafters, without a model (the target's tokens are
known): how often a copied token is right by match length (what ``draft.suffix_threshold`` and the two priors
are set from), how many draft tokens the retrieval tree alone would have accepted per position (prompt lookup
against suffix retrieval, with and without the process store, at the tree's depth and deeper), and the host
milliseconds per drafter call.

The rows are ``drafter_bench``'s ``rows.jsonl`` (``prompt_ids``/``output_ids``; greedy outputs are the same for
every configuration, the first configuration's rows are used). One drafter per kind serves every row in file order,
so the suffix store holds the earlier rows, as in serving. Timings are this host's, under its load.

Example::

    python -m pipeline.tools.drafter_bench --sources eagle,lookup --begin 26 --end 30 --max-new-tokens 64 \\
        --out outputs/calib
    python -m scripts.suffix_replay outputs/calib/rows.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from draft.lookup import LookupDrafter
from draft.suffix import SuffixDrafter, SuffixStore, corpus_automaton

V = 2 ** 24 - 1      # any id fits; the drafters never build vocabulary-sized tensors here


def walk(tree, cont: list[int]) -> int:
    """Draft tokens of ``tree`` accepted along the known continuation ``cont`` (greedy verification)."""
    kids: dict[int, dict[int, int]] = defaultdict(dict)
    for i in range(1, len(tree)):
        kids[int(tree.parents[i])][int(tree.tokens[i])] = i
    node = n = 0
    for t in cont:
        node = kids[node].get(t)
        if node is None:
            break
        n += 1
    return n


def bucket(length: int) -> int:
    return length if length < 8 else (8 if length < 12 else (12 if length < 16 else 16))


def replay(rows: list[dict], total: int, depth: int, deep: int, corpus=None) -> dict:
    """``corpus``: a static corpus automaton (``draft.suffix_corpus``); with it a fourth drafter, the suffix source
    with the process store and the corpus, is replayed too (its own store, filled as the others')."""
    store = SuffixStore(32768)
    suffix = SuffixDrafter(V, store=store, threshold=10 ** 6, other_threshold=10 ** 6)   # one prior: counts alone
    plain = SuffixDrafter(V)
    with_corpus = SuffixDrafter(V, store=SuffixStore(32768), corpus=corpus, threshold=10 ** 6,
                                other_threshold=10 ** 6) if corpus else None
    by_len = defaultdict(lambda: [0, 0])
    accepted = defaultdict(lambda: [0, 0])
    times = defaultdict(list)
    for r in rows:
        p, out, ds = r["prompt_ids"], r["output_ids"], r["dataset"]
        look = LookupDrafter(V)
        drafters = {"lookup": look, "suffix": suffix, "suffix (no store)": plain}
        if corpus is not None:
            drafters["suffix + corpus"] = with_corpus
        for name, d in drafters.items():
            t0 = time.perf_counter()
            d.start(p, out[0], None)
            times[(name, "start (prompt)")].append(time.perf_counter() - t0)
        for i in range(1, len(out)):
            lengths = suffix.match_lengths()
            for name, d in drafters.items():
                t0 = time.perf_counter()
                tree = d.grow_tree(out[i - 1], None, total, depth, 10)
                times[(name, f"grow_tree {total}/{depth}")].append(time.perf_counter() - t0)
                accepted[(name, ds)][0] += walk(tree, out[i:])
                accepted[(name, ds)][1] += 1
                if name != "lookup":
                    tree = d.grow_tree(out[i - 1], None, total, deep - 1, 10)
                    accepted[(f"{name}, {deep} deep", ds)][0] += walk(tree, out[i:])
                    accepted[(f"{name}, {deep} deep", ds)][1] += 1
            if max(lengths) > 0:                                         # the best chain, token by token
                tree = suffix.grow_tree(out[i - 1], None, total, depth, 10)
                node, j, k = 0, i, 0
                while j < len(out):
                    kids = [c for c in range(len(tree)) if int(tree.parents[c]) == node]
                    if not kids:
                        break
                    best = max(kids, key=lambda c: float(tree.scores[c]))
                    right = int(tree.tokens[best]) == out[j]
                    by_len[bucket(max(lengths) + k)][0] += right
                    by_len[bucket(max(lengths) + k)][1] += 1
                    if not right:
                        break
                    node, j, k = best, j + 1, k + 1
            for name, d in drafters.items():
                t0 = time.perf_counter()
                d.commit(torch.tensor([out[i]]), None)
                times[(name, "commit 1 token")].append(time.perf_counter() - t0)
    return {"by_len": by_len, "accepted": accepted, "times": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.suffix_replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="drafter_bench rows.jsonl files")
    ap.add_argument("--total", type=int, default=60, help="tree budget (nodes, root included)")
    ap.add_argument("--depth", type=int, default=5, help="the tree's depth (trie levels: depth + 1)")
    ap.add_argument("--deep", type=int, default=12, help="trie levels of the deeper variant")
    ap.add_argument("--corpus", default=None, help="a draft.suffix_corpus file of token_ids records: also replay the "
                                                   "suffix source with it")
    args = ap.parse_args(argv)
    rows = []
    for f in args.rows:
        try:
            rows += [json.loads(line) for line in Path(f).read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as e:
            print(f"suffix_replay: error: {f}: {e}", file=sys.stderr)
            return 2
    if not rows:
        print("suffix_replay: error: no rows", file=sys.stderr)
        return 2
    rows = [r for r in rows if r.get("sources") == rows[0].get("sources")]
    corpus = None
    if args.corpus:
        try:
            corpus = corpus_automaton(args.corpus, lambda text: [])   # token_ids records need no tokenizer
        except ValueError as e:                                        # SourceError: one line
            print(f"suffix_replay: error: {e}", file=sys.stderr)
            return 2
    res = replay(rows, args.total, args.depth, args.deep, corpus)
    print("| match length | copied token right / tried |\n|---|---|")
    for b in sorted(res["by_len"]):
        ok, n = res["by_len"][b]
        print(f"| {b}{'+' if b >= 8 else ''} | {ok}/{n} = {ok / n:.2f} |")
    sets = sorted({k[1] for k in res["accepted"]})
    names = sorted({k[0] for k in res["accepted"]})
    print("\n| retrieval tree alone: accepted per position | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{res['accepted'][(n, s)][0] / max(1, res['accepted'][(n, s)][1]):.3f}"
                                       for s in sets) + " |")
    print("\n| drafter call | median ms |\n|---|---|")
    for (name, call), v in sorted(res["times"].items()):
        print(f"| {name}: {call} | {statistics.median(v) * 1e3:.3f} |")
    print(f"\n{len(rows)} generations, {sum(len(r['output_ids']) for r in rows)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
