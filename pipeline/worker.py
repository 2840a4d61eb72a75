"""The verification-stage loop (ranks 1..N). It is mode-agnostic: every mode is a rank-0 strategy.

Per received message:
  * ``Context``  -> (reset on a new generation) append committed rows, forward the hidden states;
  * ``Segment``  -> apply the ring-borne ``prior`` decision if any; if this rank is at or past the
    segment's ``decide_from_rank``, take part in one decision broadcast and apply it to the KV cache and
    to this not-yet-computed segment (pruned rows are never computed); on ``TRUNCATE`` drop the segment
    and send nothing (the ring drains); otherwise compute the surviving rows and forward them;
  * ``Stats``    -> add this rank's busy seconds, forward;  ``Shutdown`` -> forward and stop.
"""
from __future__ import annotations

import time

import torch

from draft.tree import remap_parents
from model.devices import HOST
from model.kv_cache import KVCache
from model.stage_model import StageModel
from pipeline.comm import Comm
from pipeline.messages import Context, Decision, Segment, Shutdown, Stats, Status


def apply_decision(cache: KVCache, decision: Decision, seg: Segment | None = None) -> Segment | None:
    """Apply ``decision`` to the cache and to an uncomputed segment whose rows follow the cached nodes."""
    if decision.status == Status.SKIP:
        return seg
    m_before = cache.num_tree
    cache.apply_keep(decision.keep_indices, decision.accepted_len)
    if seg is None or seg.n == 0:
        return seg
    node_ids = torch.arange(m_before, m_before + seg.n, device=HOST)
    rows, parents = remap_parents(seg.parents, node_ids, decision.keep_indices, decision.accepted_len)
    seg.x = seg.x[:, rows]
    seg.parents = parents
    return seg


class StageWorker:
    def __init__(self, model: StageModel, comm: Comm, max_len: int, dtype: torch.dtype, device: str) -> None:
        self.model, self.comm = model, comm
        self.dtype, self.device = dtype, device
        self.rank = comm.rank
        self.cache = model.block.new_cache(max_len, dtype, device) if model.block is not None else None
        self.tracer = comm.tracer
        self.emu = getattr(comm, "emu", None)   # pipeline.emulation.Emulator when emu.profile is set

    @torch.no_grad()
    def _compute(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with self.tracer.span("compute", rows=int(positions.numel())):
            x = x.to(self.device)
            if x.is_floating_point():
                x = x.to(self.dtype)
            if self.emu is None:
                return self.model(x, positions, mask, self.cache)
            ctx, t0 = self.cache.length, time.perf_counter()
            out = self.model(x, positions, mask, self.cache)
            self.emu.pad_stage(t0, int(positions.numel()), ctx)   # wait out the modeled stage time
            return out

    def run(self) -> None:
        comm = self.comm
        while True:
            msg = comm.recv_prev()
            if isinstance(msg, Shutdown):
                comm.send_next(msg)
                return
            if isinstance(msg, Stats):
                if not msg.emu_only:
                    msg.busy_s[self.rank] = self.tracer.busy_s
                    self.tracer.reset_counters()
                if msg.emu is not None and self.emu is not None:
                    msg.emu[self.rank] = torch.tensor(self.emu.take(), dtype=torch.float64, device=HOST)
                comm.send_next(msg)
            elif isinstance(msg, Context):
                if msg.reset:
                    self.cache.reset()
                n = msg.x.shape[1]
                pos, mask = self.cache.context_inputs(n, self.dtype)
                out = self._compute(msg.x, pos, mask)
                self.cache.commit_forward(n, as_context=True)
                comm.send_next(Context(out, msg.round_id, msg.reset))
            elif isinstance(msg, Segment):
                self._segment(msg)

    def _segment(self, seg: Segment) -> None:
        if seg.prior is not None:
            with self.tracer.span("prune"):
                apply_decision(self.cache, seg.prior)
        if self.rank >= seg.decide_from_rank:
            decision = self.comm.broadcast(None)
            with self.tracer.span("prune"):
                seg = apply_decision(self.cache, decision, seg)
            if decision.status == Status.TRUNCATE:
                return
        out = seg.x
        if seg.n:
            pos, mask, anc, depth = self.cache.tree_inputs(seg.parents, self.dtype)
            out = self._compute(seg.x, pos, mask)
            self.cache.commit_forward(seg.n, as_context=False, anc=anc, depth=depth)
        elif out.dim() == 2 and self.rank == 1:  # empty id segment -> empty hidden
            out = torch.zeros(1, 0, self.model.config.hidden_size, dtype=self.dtype, device=HOST)
        self.comm.send_next(Segment(out, seg.parents, seg.round_id, seg.seg_id, seg.decide_from_rank, seg.prior))
