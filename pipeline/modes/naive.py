"""``naive`` (the paper's Chunk-PP): one whole EAGLE-2 tree per round, streamed in segments, verified
once it is back; the accepted path reaches every stage as the decision that rides on the next round's first
segment (:class:`pipeline.outbox.Outbox`: nothing is in flight when it is made, so no direct copy is sent)."""
from __future__ import annotations

import torch

from draft.tree import split_sizes
from model.devices import HOST
from pipeline.engine import DecodeResult, Engine, OutputBuffer
from pipeline.messages import Status
from pipeline.outbox import Outbox, RankTree
from pipeline.verify import walk_tree


def naive_decode(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
                 out: OutputBuffer) -> DecodeResult:
    tcfg, drafter = engine.cfg.tree, engine.drafter
    x = engine.sampler.choose(logits)
    out.extend([x])
    with engine.tracer.span("draft"):
        root_hidden = drafter.start(prompt_ids, x, features)
    box = Outbox(engine)
    accepts, steps, rounds = [], 0, 0
    while not out.finished:
        rounds += 1
        with engine.tracer.span("draft"):
            state = RankTree(drafter.grow_tree(x, root_hidden, tcfg.total_token, tcfg.depth, tcfg.top_k))
        sizes = split_sizes(len(state.tree), engine.comm.world, 0)
        for size in sizes:
            state.send(box, size)
        hidden = torch.cat([box.receive().x[0] for _ in sizes])
        steps += len(sizes)
        logits = engine.logits(hidden)
        with engine.tracer.span("verify"):
            path, x, _ = walk_tree(state.tree, len(state.tree), logits, engine.sampler)
        committed = state.tree.tokens[path[1:]].tolist() + [x]
        accepts.append(out.extend(committed))
        box.decide(Status.TRUNCATE, state.gids[path].tolist(), -1, out.finished)
        if not out.finished:
            with engine.tracer.span("draft"):
                root_hidden = drafter.commit(torch.tensor(committed, device=HOST), hidden[path])
    return DecodeResult(rounds, accepts, steps)
