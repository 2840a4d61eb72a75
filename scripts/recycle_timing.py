"""Rank 0's per-call host cost of the ``recycle`` source (docs/results.md §72):
one thread, thread clock, a fully filled table over SmolLM2's 49152-token vocabulary (the worst case for the walk);
min and median of 5 blocks, in microseconds.

    OMP_NUM_THREADS=1 python -m scripts.recycle_timing
"""
from __future__ import annotations

import time

import numpy as np
import torch

from draft.recycle_source import RecycleDrafter

V = 49152


def timed(f, n: int = 200) -> tuple[float, float]:
    blocks = []
    for _ in range(5):
        a = time.thread_time()
        for _ in range(n):
            f()
        blocks.append((time.thread_time() - a) / n * 1e6)
    return min(blocks), sorted(blocks)[2]


def main() -> int:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    d = RecycleDrafter(V, 8)
    d.ids[:] = rng.integers(0, V, size=(V, 8))
    d.start([1, 2, 3], 5, None)
    logits5, logits1 = torch.randn(5, V), torch.randn(1, V)
    toks10, par10 = torch.randint(0, V, (10,)), torch.full((10,), -1)
    toks60, par60 = torch.randint(0, V, (60,)), torch.full((60,), -1)

    def level(tk, pr):
        d.tree_forward(tk, None, pr)
        d.drop_tree()
    states = torch.from_numpy(d.states(toks10.numpy()))
    rows = [("grow_tree, 60 nodes", lambda: d.grow_tree(5, None, 60, 5, 10)),
            ("tree_forward, 10 rows", lambda: level(toks10, par10)),
            ("tree_forward, 60 rows", lambda: level(toks60, par60)),
            ("commit", lambda: d.commit(torch.tensor([7, 8, 9]), None)),
            ("feed, 5 rows (one topk)", lambda: d.observe_target([1, 2, 3, 4, 5], logits5)),
            ("feed, 1 row", lambda: d.observe_target([1], logits1)),
            ("union_candidates, 10 rows", lambda: d.union_candidates(states, 10))]
    print("call\tmin us\tmedian us")
    for name, f in rows:
        lo, med = timed(f, 100)
        print(f"{name}\t{lo:.0f}\t{med:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
