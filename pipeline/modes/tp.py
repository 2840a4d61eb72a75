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

from pipeline.engine import DecodeResult, Engine, OutputBuffer
from pipeline.modes.naive import draft_eagle_tree, verify_whole_tree, whole_tree_rounds

SCHEDULE_IDS = {"megatron": 0, "galaxy": 1}
SCHEDULE_OF_MODE = {"tp": "megatron", "galaxy": "galaxy"}


def make_tp_decode(mode: str):
    """The rank-0 decode function of ``mode`` (``tp`` or ``galaxy``)."""
    schedule_id = SCHEDULE_IDS[SCHEDULE_OF_MODE[mode]]

    def tp_decode(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
                  out: OutputBuffer) -> DecodeResult:
        return whole_tree_rounds(engine, logits, features, prompt_ids, out, engine.drafter, draft_eagle_tree(engine),
                                 verify_whole_tree(out.sampler), lambda n: [n], tag=schedule_id)

    tp_decode.__name__ = f"{mode}_decode"
    return tp_decode
