"""Stand-ins for the target model in a replay: cheap layers and an lm_head that follow the recorded answer.

Only the expensive parts of a run are replaced; the scheduler, drafter, tree operations and stage loop are the
real code (:mod:`.replayer`). A layer stage (:class:`ReplayStage`) computes, per row, whether the row lies on the
committed path and at which position; the lm_head (:class:`ReplayEngine`) puts all mass on the committed token
after an on-path row (``NEG`` elsewhere: softmax gives exactly one-hot in float32). Invariant: a node is on
the committed path iff its token and all its tree ancestors' tokens equal the committed tokens at their
positions, so the verification accepts exactly the recorded answer. Every forward is logged as a modeled op
(``compute`` on a stage, ``lm_head`` on rank 0).

This module imports :mod:`pipeline.engine` at import time; :func:`.replayer.replay` imports it when it runs, so
that importing the simulator (its ``--help``, the timing model) stays light.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from model.devices import HOST
from model.kv_cache import KVCache
from pipeline.engine import Engine
from pipeline.tools.simulate.oplog import OpLog
from pipeline.tools.simulate.recorded import Committed

NEG = -1.0e4      # logit of every token but the committed one: softmax gives exactly one-hot in float32


class ReplayBlock:
    """The stage's block as the stage loop sees it: only its cache factory."""

    @staticmethod
    def new_cache(max_len: int, dtype, device) -> KVCache:
        # one "layer" of one head, width 1: slot value = does this node's token match the committed token there
        return KVCache(1, 1, 1, max_len, torch.float64)


class ReplayStage:
    """A layer stage's stand-in. Its hidden state per row is ``(on_path, position)``: rank 1 computes it from the
    token ids, the tree mask and the per-slot matches it keeps in its KV cache (so the real compaction moves
    them); later ranks pass it on. A node is on the committed path iff it and all its tree ancestors match."""

    def __init__(self, rank: int, committed: Committed, log: OpLog) -> None:
        self.rank, self.committed, self.log = rank, committed, log
        self.block = ReplayBlock()
        self.config = SimpleNamespace(hidden_size=2)

    def __call__(self, x, positions, mask, cache):
        pos = positions.reshape(-1)
        with self.log.modeled("compute", int(pos.numel()), int(cache.length)):
            if self.rank != 1:
                return x
            seq = self.committed.seq
            tok = x.reshape(-1).tolist()
            match = torch.tensor([float(p < len(seq) and seq[p] == t) for p, t in zip(pos.tolist(), tok)],
                                 dtype=torch.float64, device=HOST)
            length, ctx = cache.length, cache.context_len
            cache.update(match.view(1, 1, -1, 1), match.view(1, 1, -1, 1), 0)
            allowed = (mask[0, 0] == 0)[:, ctx:length + len(tok)]       # tree ancestors + self
            slot_match = cache.keys[0, 0, 0, ctx:length + len(tok), 0] > 0.5
            on_path = ~(allowed & ~slot_match).any(dim=1)
            return torch.stack([on_path.double(), pos.double()], dim=-1)[None]


class ReplayEngine(Engine):
    """Rank 0 with the lm_head replaced: an on-path row at position p puts all mass on ``seq[p + 1]``.
    The replay sets ``vocab_size``, ``committed`` and ``log`` after construction."""

    vocab_size = 0
    committed: Committed
    log: OpLog

    def logits(self, hidden):
        rows = hidden.reshape(-1, 2)
        with self.log.modeled("lm_head", int(rows.shape[0]), 1.0):
            out = torch.full((rows.shape[0], self.vocab_size), NEG, dtype=torch.float32, device=HOST)
            seq = self.committed.seq
            for i, (flag, p) in enumerate(rows.tolist()):
                nxt = int(p) + 1
                if flag > 0.5 and nxt < len(seq):
                    out[i, seq[nxt]] = 0.0
        if self.log.counter is not None:         # a real lm_head's logits are in device memory
            self.log.counter.mark(out)
        return out
