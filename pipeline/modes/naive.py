"""``naive`` (the paper's Chunk-PP): one whole EAGLE-2 tree per round, streamed in segments, verified
once it is back; the accepted path is committed on every stage by a decision that rides on the next
round's first segment (it reaches each stage exactly when that segment does)."""
from __future__ import annotations

import torch

from draft.tree import split_sizes
from model.devices import HOST
from pipeline.engine import Engine, OutputBuffer
from pipeline.messages import Decision, Segment, Status
from pipeline.verify import walk_tree

NEVER = 1 << 30


def naive_decode(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
                 out: OutputBuffer) -> tuple[int, list[int], int]:
    comm, tcfg, drafter = engine.comm, engine.cfg.tree, engine.drafter
    x = engine.sampler.choose(logits)
    out.extend([x])
    with engine.tracer.span("draft"):
        root_hidden = drafter.start(prompt_ids, x, features)
    prior, accepts, steps, rounds = None, [], 0, 0
    while not out.finished:
        rounds += 1
        with engine.tracer.span("draft"):
            tree = drafter.grow_tree(x, root_hidden, tcfg.total_token, tcfg.depth, tcfg.top_k)
        start = 0
        sizes = split_sizes(len(tree), comm.world, 0)
        for j, size in enumerate(sizes):
            sl = slice(start, start + size)
            comm.send_next(Segment(tree.tokens[sl][None], tree.parents[sl], rounds, j, NEVER,
                                   prior if j == 0 else None))
            start += size
        hidden = torch.cat([comm.recv_prev().x[0] for _ in sizes])
        steps += len(sizes)
        logits = engine.logits(hidden)
        with engine.tracer.span("verify"):
            path, x, _ = walk_tree(tree, len(tree), logits, engine.sampler)
        committed = tree.tokens[path[1:]].tolist() + [x]
        accepts.append(out.extend(committed))
        prior = Decision(rounds, 0, Status.TRUNCATE, len(path), x, out.finished, torch.tensor(path, device=HOST))
        if not out.finished:
            with engine.tracer.span("draft"):
                root_hidden = drafter.commit(torch.tensor(committed, device=HOST), hidden[path])
    return rounds, accepts, steps
