"""``ar``: plain pipeline-parallel autoregression, one token per ring trip."""
from __future__ import annotations

import torch

from model.devices import HOST
from pipeline.engine import DecodeResult, Engine, OutputBuffer
from pipeline.messages import Context


def ar_decode(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
              out: OutputBuffer) -> DecodeResult:
    x = out.sampler.choose(logits)
    out.extend([x], logits[None])
    accepts = []
    while not out.finished:
        engine.comm.send_next(Context(torch.tensor([[x]], device=HOST)))
        hidden = engine.comm.recv_prev().x[0]
        row = engine.logits(hidden)[-1:]
        x = out.sampler.choose(row[0])
        accepts.append(out.extend([x], row))
    return DecodeResult(len(accepts), accepts, len(accepts))
