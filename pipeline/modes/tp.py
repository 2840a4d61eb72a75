"""``tp`` (Megatron-style tensor parallelism) and ``galaxy`` (hybrid TP + sequence parallelism): rank 0 drafts
one EAGLE-2 tree per round exactly as ``naive`` does, sends the *whole* tree as one segment to the
verification group, verifies it once the hidden states are back and commits the accepted path with a decision
that rides on the next round's segment.

The rank-0 side sees the group as one stage (``comm.send_next`` / ``comm.recv_prev``; see
:class:`pipeline.tp_run.GroupComm`), so this loop runs unchanged on an in-process one-stage ring (the
what-if simulator, ``pipeline/tools/tp_sim.py``). ``Segment.tag`` carries the group's schedule
(:data:`SCHEDULE_IDS`); a round has exactly one segment, so the field is otherwise unused.
"""
from __future__ import annotations

import torch

from model.devices import HOST
from pipeline.engine import DecodeResult, Engine, OutputBuffer
from pipeline.messages import Status
from pipeline.outbox import Outbox, RankTree
from pipeline.verify import walk_tree

SCHEDULE_IDS = {"megatron": 0, "galaxy": 1}
SCHEDULE_OF_MODE = {"tp": "megatron", "galaxy": "galaxy"}


def make_tp_decode(mode: str):
    """The rank-0 decode function of ``mode`` (``tp`` or ``galaxy``)."""
    schedule_id = SCHEDULE_IDS[SCHEDULE_OF_MODE[mode]]

    def tp_decode(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
                  out: OutputBuffer) -> DecodeResult:
        tcfg, drafter = engine.cfg.tree, engine.drafter
        x = engine.sampler.choose(logits)
        out.extend([x])
        with engine.tracer.span("draft"):
            root_hidden = drafter.start(prompt_ids, x, features)
        box = Outbox(engine)
        accepts, rounds = [], 0
        while not out.finished:
            rounds += 1
            with engine.tracer.span("draft"):
                tree = drafter.grow_tree(x, root_hidden, tcfg.total_token, tcfg.depth, tcfg.top_k)
            state = RankTree(tree)
            state.send(box, len(tree), tag=schedule_id)
            hidden = box.receive().x[0]
            logits = engine.logits(hidden)
            with engine.tracer.span("verify"):
                path, x, _ = walk_tree(tree, len(tree), logits, engine.sampler)
            committed = tree.tokens[path[1:]].tolist() + [x]
            accepts.append(out.extend(committed))
            box.decide(Status.TRUNCATE, state.gids[path].tolist(), -1, out.finished)
            if not out.finished:
                with engine.tracer.span("draft"):
                    root_hidden = drafter.commit(torch.tensor(committed, device=HOST), hidden[path])
        return DecodeResult(rounds, accepts, rounds)

    tp_decode.__name__ = f"{mode}_decode"
    return tp_decode
