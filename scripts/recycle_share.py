"""Where the ``recycle`` source's nodes go in the merged tree (a diagnostic of docs/results.md §72): ``naive`` 60/5/10
with ``draft.sources=eagle,lookup,recycle`` through the in-process ring, and
per round each source's own tree recorded (``MergedDrafter.grow_tree``), so every merged node and every accepted
draft token is attributed to the sources whose own trees hold its token path: recycle alone, recycle and another,
the others only. Prints, per set, the merged nodes and the accepted draft tokens by attribution.

    python -m scripts.recycle_share --sets six,broad --begin 30 --end 32 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch


def paths(tree) -> set[tuple[int, ...]]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out, memo = set(), {0: ()}
    for i in range(1, len(toks)):
        memo[i] = memo[pars[i]] + (toks[i],)
        out.add(memo[i])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.recycle_share", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--sets", default="six,broad")
    p.add_argument("--begin", type=int, default=30)
    p.add_argument("--end", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args(argv)
    from config.paths import DEFAULT_HEAD_DIR, DEFAULT_STAGE_DIR
    from draft.merged import MergedDrafter
    from draft.recycle_source import RecycleDrafter
    from model.prompts import stop_token_ids
    from pipeline.build import load_tokenizer
    from pipeline.inprocess import run_threaded
    from pipeline.tools.drafter_bench import expand_sets, load_prompts
    tok = load_tokenizer(DEFAULT_STAGE_DIR)
    stops = stop_token_ids(tok, None)
    real = MergedDrafter.grow_tree
    last: dict = {}

    def grow(self, root_token, root_hidden, total_token, depth, top_k):
        trees = []
        for s, h in zip(self.sources, self._split(root_hidden)):
            trees.append((isinstance(s, RecycleDrafter), paths(s.grow_tree(root_token, h, total_token, depth, top_k))))
        last["own"] = trees
        return real(self, root_token, root_hidden, total_token, depth, top_k)
    MergedDrafter.grow_tree = grow
    try:
        sets = expand_sets(a.sets.split(","))
        prompts = {name: load_prompts(Path(a.data), name, a.begin, a.end, tok) for name in sets}
    except (OSError, ValueError) as e:           # an unknown set or a missing question file: one line
        print(f"recycle_share: error: {e}", file=sys.stderr)
        return 2
    print("set\trounds\tnodes: recycle only / both / others only\taccepted: recycle only / both / others only")
    for name in sets:
        count = Counter()

        def observe(tree, path, token, finished):
            own = last.get("own", [])
            rec = set().union(*[ps for r, ps in own if r]) if own else set()
            oth = set().union(*[ps for r, ps in own if not r]) if own else set()
            count["rounds"] += 1

            def kind(pth):
                return "rec" if pth in rec and pth not in oth else ("both" if pth in rec else "oth")
            for pth in paths(tree):
                count["n_" + kind(pth)] += 1
            toks = tree.tokens.tolist()
            acc = tuple(toks[i] for i in path[1:])
            for j in range(1, len(acc) + 1):
                count["a_" + kind(acc[:j])] += 1
        run_threaded(DEFAULT_STAGE_DIR, prompts[name], ["naive"], [f"max_new_tokens={a.max_new_tokens}", "dtype=float32",
                                                             "draft.sources=eagle,lookup,recycle"],
                     stops, str(DEFAULT_HEAD_DIR), dtype=torch.float32, step_observers=[observe])
        c = count
        print(f"{name}\t{c['rounds']}\t{c['n_rec']} / {c['n_both']} / {c['n_oth']}\t"
              f"{c['a_rec']} / {c['a_both']} / {c['a_oth']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
