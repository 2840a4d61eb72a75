"""Ranks of a tensor-parallel run (modes ``tp`` and ``galaxy`` on a split written with ``--tp N``).

World = ``N + 1``. Rank 0 is the draft stage exactly as in the pipeline modes (draft head, embeddings,
``lm_head``; :func:`pipeline.run.run_rank0` runs it). Ranks ``1..N`` form the TP group (a
``torch.distributed`` group, gloo or NCCL) and each hold every layer at ``1/N`` width (:mod:`model.tp_model`).

Transport (all ``torch.distributed``, through :class:`pipeline.comm.Comm` for failure detection):

* rank 0 -> group: every message (prefill ``Context``, tree ``Segment`` with the ring-borne commit decision,
  ``Stats``, ``Shutdown``) is one broadcast on the default group (:class:`GroupComm.send_next`);
* group -> rank 0: TP rank 0 (global rank 1) sends the final hidden states (``Comm.send``);
* inside the group: all-reduce (``tp``) or ring all-gather / reduce-scatter (``galaxy``) per layer.

Prefill uses the Megatron schedule in both modes (the answer is the same; only decode is compared).
"""
from __future__ import annotations

import torch

from model.devices import HOST
from model.meter import OpMeter, SpanMeter, take_counters
from model.tp_model import SCHEDULES, DistCollectives, TPShard
from pipeline.messages import Context, Segment, Shutdown, Stats
from pipeline.worker import StageTree, context_inputs


class GroupComm:
    """Rank 0's view of the TP group as one pipeline stage: ``send_next`` broadcasts to the group,
    ``recv_prev`` receives from TP rank 0. ``world`` is the real world size (N + 1). On an emulated link
    (``comm.link``) the broadcast first waits out the modeled fan-out
    (:meth:`pipeline.emulation.LinkSender.pad_fanout`)."""

    def __init__(self, comm) -> None:
        self.comm, self.rank, self.world, self.tracer = comm, comm.rank, comm.world, comm.tracer
        self.link = comm.link

    def send_next(self, msg) -> None:
        if self.link is not None:
            self.link.pad_fanout(msg, self.world - 1)
        self.comm.broadcast(msg)

    def recv_prev(self):
        return self.comm.recv(1)

    def poll_prev(self) -> list:
        """Rank 0 never polls a TP group (its modes wait for each answer): nothing is reported as arrived."""
        return []

    def send_direct(self, msg) -> None:
        """Nothing is ever in flight when tp/galaxy decide: decisions ride on the next segment only."""

    def open_direct_inbox(self) -> None:
        pass

    def poll_direct(self) -> list:
        return []


class TPWorker:
    """The loop of global rank ``1 + t``: take every rank-0 message, compute with the group, and (TP rank 0)
    answer rank 0. Messages are handled as by :class:`pipeline.worker.StageWorker`."""

    def __init__(self, model: TPShard, comm, coll: DistCollectives, max_len: int, dtype, device) -> None:
        self.model, self.comm, self.coll = model, comm, coll
        self.dtype, self.device = dtype, device
        self.cache = model.new_cache(max_len, dtype, device)
        self.tree = StageTree(self.cache)
        self.tracer = comm.tracer
        self.leader = coll.rank == 0
        # every group forward (model.meter): traced as "compute" spans; instrumentation stacks its meters after
        # (pipeline.emulation.install_tp_worker) and the meter stack carries their counters (Stats)
        self.meter: OpMeter = SpanMeter(self.tracer, {f"group_{s}": "compute" for s in SCHEDULES})

    @torch.no_grad()
    def _compute(self, ids: torch.Tensor, positions, mask, schedule: str) -> torch.Tensor | None:
        with self.meter.op(f"group_{schedule}", int(positions.numel()), self.cache.length):
            return self.model(ids.to(self.device), positions, mask, self.cache, self.coll, schedule)

    def _reply(self, msg) -> None:
        if self.leader:
            self.comm.send(0, msg)

    def run(self) -> None:
        while True:
            msg = self.comm.broadcast(None)
            if isinstance(msg, Shutdown):
                self._reply(msg)
                self.comm.flush()
                return
            if isinstance(msg, Stats):   # every group rank's busy seconds and meter counters, in one gather
                table = self.coll.all_gather_vectors([self.tracer.busy_s, *take_counters(self.meter)])
                self.tracer.reset_counters()
                table = torch.tensor(table, dtype=torch.float64, device=HOST)
                msg.busy_s[1:1 + self.coll.size] = table[:, 0]
                if msg.counters is not None and table.shape[1] > 1:
                    msg.counters[1:1 + self.coll.size] = table[:, 1:]
                self._reply(msg)
            elif isinstance(msg, Context):
                pos, mask = context_inputs(self.cache, self.tree, msg, self.dtype)
                out = self._compute(msg.x, pos, mask, "megatron")
                self.cache.commit_forward(msg.x.shape[1], as_context=True)
                self._reply(Context(out, msg.gen, msg.reset))
            elif isinstance(msg, Segment):
                self._segment(msg)

    def _segment(self, seg: Segment) -> None:
        with self.tracer.span("prune"):
            self.tree.offer(seg.decisions())
            self.tree.apply_ready()
            rows, parents = self.tree.admit(seg)   # nothing is in flight: every row is alive
        if seg.tag >= len(SCHEDULES):
            raise RuntimeError(f"segment names unknown TP schedule {seg.tag}")
        schedule = SCHEDULES[seg.tag]
        out = torch.zeros(1, 0, self.model.config.hidden_size, dtype=self.dtype, device=HOST)
        if seg.n:
            pos, mask, anc, depth = self.cache.tree_inputs(parents, self.dtype)
            out = self._compute(seg.x, pos, mask, schedule)
            self.cache.commit_forward(seg.n, as_context=False, anc=anc, depth=depth)
            self.tree.computed(seg.gids.tolist())
        self._reply(Segment(out, seg.parents, seg.gids, seg.gen, seg.epoch, seg.log, seg.tag))


def run_tp_rank(args, cfg, modes, comm, stage_root, dtype, device, run_rank0) -> int:
    """Everything after the process group exists, for every rank of a TP run; returns the exit code."""
    import sys

    import torch.distributed as dist

    from model.stage_format import StageDirError
    from model.stage_model import load_stage
    from model.tp_model import load_tp_shard
    from pipeline.build import SetupError

    n = comm.world - 1
    group = dist.new_group(list(range(1, comm.world)))   # every rank takes part in creating it
    what = "embeddings + lm_head + draft head" if comm.rank == 0 else f"TP shard {comm.rank - 1} of {n}"
    print(f"[rank {comm.rank}] loading {what} ...", file=sys.stderr, flush=True)
    from pipeline import faults
    faults.hit("load")  # test-only fault injection point (FLOWSPEC_FAULT=rank=R,at=load)
    try:
        if comm.rank == 0:
            model = load_stage(stage_root, 0, comm.world, dtype, device, cfg.model.verify_checksums)
        else:
            model = load_tp_shard(stage_root, comm.rank, comm.world, dtype, device, cfg.model.verify_checksums)
    except StageDirError as e:
        raise SetupError(str(e)) from None
    if comm.rank == 0:
        return run_rank0(args, cfg, modes, GroupComm(comm), model, stage_root, dtype, device)
    coll = DistCollectives(group, 1, n, comm.rank - 1, host_staging=cfg.comm.backend != "nccl")
    worker = TPWorker(model, comm, coll, cfg.model.max_seq_len, dtype, device)
    if comm.link is not None:   # the emulated testbed (pipeline.emulation.install): pad the group's forwards
        real_bytes = model.config.hidden_size * torch.finfo(dtype).bits // 8
        comm.link.emu.install_tp_worker(worker, n, cfg.emu.tp_layers, cfg.emu.tp_profile_stages, real_bytes)
    comm.wait_for_rank0()   # rank 0 may load for longer than comm.timeout_s (Comm.wait_for_rank0)
    worker.run()
    return 0
