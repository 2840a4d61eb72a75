"""Host cost of several lanes' rows in one 8-layer block forward (SmolLM2-135M's layer shapes, random weights):
one forward per lane, one forward whose attention loops over the lanes, one forward whose attention takes the
lanes' caches concatenated under a block-diagonal mask (model/lane_batch.py; docs/results.md §41). Thread CPU time,
one torch thread.

Example:

    .venv/bin/python -m scripts.lane_attention_bench --lanes 4 --rows 4 --ctx 400
"""
from __future__ import annotations

import argparse
import sys

import torch

from model.lane_batch import LaneBatch


def _bench(lanes: int = 4, rows: int = 4, ctx: int = 400, repeat: int = 30) -> None:
    """Host cost of one 8-layer SmolLM2-sized block forward of ``lanes`` lanes, each ``rows`` rows over ``ctx``
    cached slots: one forward per lane, one forward with the loop, one with the block-diagonal mask."""
    import time

    from transformers import LlamaConfig

    from model.layers import LayerBlock
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=8, vocab_size=100)
    block = LayerBlock(cfg, 8).eval()
    caches = [block.new_cache(ctx + rows * (repeat + 5) * 3, torch.float32, "cpu") for _ in range(lanes)]
    for c in caches:
        c.length = c.context_len = ctx
    x = torch.randn(1, lanes * rows, 576)

    def inputs(c):
        pos, mask = c.context_inputs(rows, torch.float32)
        return pos, mask

    def one_per_lane():
        for i, c in enumerate(caches):
            pos, mask = inputs(c)
            block(x[:, i * rows:(i + 1) * rows], pos, mask, c)

    def batched(joint: bool):
        ins = [inputs(c) for c in caches]
        lb = LaneBatch(caches, [m for _, m in ins])
        lb.joint = joint
        block(x, torch.cat([p for p, _ in ins], dim=1), None, lb.to("cpu", torch.float32))

    with torch.no_grad():
        for name, fn in (("one forward per lane", one_per_lane), ("one forward, attention loop", lambda: batched(False)),
                         ("one forward, block-diagonal mask", lambda: batched(True))):
            fn()
            t0 = time.thread_time()
            for _ in range(repeat):
                fn()
            print(f"| {name} | {(time.thread_time() - t0) / repeat * 1000:.2f} ms |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--rows", type=int, default=4, help="rows per lane")
    p.add_argument("--ctx", type=int, default=400, help="cached slots per lane")
    p.add_argument("--repeat", type=int, default=30)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| forward | host time per forward |\n|---|---|")
    _bench(a.lanes, a.rows, a.ctx, a.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
