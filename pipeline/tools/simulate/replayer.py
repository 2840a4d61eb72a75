"""Replay recorded generations through a mode's real code, on any number of stages, in one process.

:func:`replay` runs the *real* code of a mode: its rank-0 scheduler (``pipeline/modes``), the real drafter and
tree operations (:class:`.drafter.ReplayDrafter`), and the real stage loop (``pipeline/worker.py``: decisions,
KV compaction, in-flight pruning) on any number of stages, one thread per rank (:mod:`pipeline.local_ring`,
through :class:`.transport.SimComm`). Only the expensive parts are stand-ins (:mod:`.stand_ins`). Every rank's
ordered operations are recorded (:class:`.oplog.OpLog`): stage forwards (rows, cached slots), lm_head and
draft-head applications, sends (modeled bytes), receives, and the host work in between (the thread
CPU time of the real bookkeeping: tree building, verification, pruning, message encoding).

**Exactness.** At T = 0 the replay reproduces the recorded run's acceptance (τ, steps, rows per segment) for the
recorded stage count, and for another stage count it is what that run would do (greedy output does not depend
on the split). At T > 0 a run with another schedule would sample another text from the same law; a replayed
text is still a valid sample of the mode's behaviour, so predictions are exact in distribution over many
generations. Invariant checked on every generation: the replayed output equals the recorded one
(:class:`AssertionError` otherwise). The op logs do not depend on thread timing: the ring is FIFO per link and
direct decisions follow a fixed schedule (:class:`.transport.ScheduledDirect`); only the measured host times do.

**Counting** (``count_ops=True``, for ``--rank0-cost ops``): rank 0's thread runs under a
:class:`pipeline.tools.opcount.OpCounter` (thread-local: the stages' threads are not counted), its drafter's
modules, the target's features, the stand-in lm_head's logits and the hidden states it receives marked as device
memory, so every host op of rank 0 carries the operators and would-be syncs of that interval
(:meth:`.oplog.OpLog.count`). The counter's own overhead inflates the measured host times of such a replay: its
sessions are marked ``counted`` and priced by their counts only.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from draft.protocol import forget_requests
from pipeline.tools.simulate.drafter import ReplayDrafter, record_drafter
from pipeline.tools.simulate.oplog import MarkTracer, OpLog, Recorder
from pipeline.tools.simulate.recorded import Committed, TargetFeatures
from pipeline.tools.simulate.transport import ScheduledDirect, SimComm
from pipeline.tree_stats import TreeStats


@dataclass
class Hooks:
    """What a caller of the simulator adds to a replay from outside, without patching the code it replays (e.g.
    ``scripts/round_start_bound.py``). ``observers``: extra step observers (:class:`pipeline.engine.StepObserver`)
    fed every verified step of every replay pass, their CPU time left out of rank 0's host work like the tree
    statistics'; ``decoder(mode)``: builds each generation's decoder (default :func:`pipeline.modes.new_decoder`;
    a caller that wraps it sees the decoder's state, e.g. ``ContinuousMode.pre``); ``on_timed(session, tc)``:
    called with every (mode, stages, link)'s final timed session and its :class:`.timing.TimingConfig`."""

    observers: tuple = ()
    decoder: Callable | None = None
    on_timed: Callable | None = None


@dataclass
class Replayed:
    """One replayed generation (its output is ``row["output_ids"]``: the replay checks it). Its operations live
    in the session's logs; the i-th generation of a session is its i-th decode window."""

    row: dict
    mode: str
    stages: int
    accept_lengths: list[int]
    pipeline_steps: int
    rounds: int               # trees drafted from a fresh root (a round ends at every truncation)


@dataclass
class Session:
    """The replay of some rows through one mode on ``stages`` layer stages: one op log per rank (rank 0 first)
    and the generations in replay order."""

    stages: int
    mode: str
    logs: list[OpLog]
    gens: list[Replayed] = field(default_factory=list)
    counted: bool = False     # rank 0's host ops carry operator counts (and counter-inflated times)

    def ops(self) -> list[list[tuple]]:
        """Every rank's op list, rank 0 first: what :func:`.timing.simulate_timing` times."""
        return [log.ops for log in self.logs]


def replay(rows: list[dict], mode: str, stages: int, cfg, drafter, vocab_size: int,
           features: TargetFeatures, progress=None, direct_upto: list[list[int]] | None = None,
           tree_stats: dict | None = None, count_ops: bool = False, hooks: Hooks | None = None) -> Session:
    """Replay ``rows`` (recorded generations) through ``mode`` on ``stages`` layer stages; returns the op logs.
    ``direct_upto``: the direct-decision schedule of a later pass (:class:`ScheduledDirect`); ``None``:
    decisions reach the stages on the ring only (pass 0). ``tree_stats``: a dict that receives one
    :class:`pipeline.tree_stats.TreeStats` per row temperature (``"T=0"``, ``"T=1"``...), fed every verified
    step as a step observer whose CPU time is left out of rank 0's host work. ``count_ops``: rank 0's host ops
    carry operator and sync counts (see the module docstring). ``hooks``: a caller's :class:`Hooks` (observers,
    decoder factory)."""
    from pipeline.engine import GenSettings, timed_generation
    from pipeline.local_ring import LocalRing, stage_threads
    from model.stage_format import even_split, tap_row_factors
    from pipeline.modes import new_decoder
    from pipeline.tools.simulate.stand_ins import ReplayEngine, ReplayStage
    from pipeline.worker import StageWorker

    world = stages + 1
    factors = tap_row_factors(even_split(features.num_layers, stages), features.taps) if features.taps else None
    ring, rec, committed = LocalRing(world), Recorder(world, factors), Committed()
    direct = ScheduledDirect(world, direct_upto)
    session = Session(stages, mode, rec.logs, counted=count_ops)
    max_len = max(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows) + 1024

    def stage(r: int) -> None:
        rec.logs[r].last = time.thread_time()
        StageWorker(ReplayStage(r, committed, rec.logs[r]), SimComm(ring, r, rec, direct),
                    max_len, torch.float64, "cpu").run()

    log0 = rec.logs[0]
    comm0 = SimComm(ring, 0, rec, direct, tracer=MarkTracer(log0))
    rdrafter = None
    if drafter is not None:
        forget_requests(drafter)    # every replay (mode, stages, pass) drafts as the first did (draft/protocol.py)
        rdrafter = ReplayDrafter(drafter, committed, log0)
        record_drafter(drafter, log0, vocab_size)
    engine = ReplayEngine(torch.nn.Linear(1, 1), comm0, rdrafter, set(), cfg)
    # the recorded temperature's plain law (no top-p / top-k), seeded as the run's; per answer only its length
    settings = GenSettings.from_config(cfg.gen, temperature=float(cfg.gen.temperature), top_p=1.0, top_k=0)
    engine.vocab_size, engine.committed, engine.log = vocab_size, committed, log0
    hooks = hooks or Hooks()
    extra = [untimed_observer(o, log0) for o in hooks.observers]
    engine.step_observers = list(extra)
    counter = nullcontext()
    if count_ops:
        from pipeline.tools.opcount import OpCounter
        counter = OpCounter(*device_parts(drafter))
    with stage_threads(world, stage) as errors, counter:
        log0.last = time.thread_time()
        if count_ops:
            log0.count(counter)
        try:
            for row in rows:
                prompt, output = list(row["prompt_ids"]), list(row["output_ids"])
                committed.seq = prompt + output
                with log0.untimed():
                    committed.features = features(committed.seq)
                if count_ops:
                    counter.mark(committed.features)
                # the recorded answer ends where it ended: exactly len(output) tokens, no stop token needed
                if tree_stats is not None:
                    stats = tree_stats.setdefault(f"T={float(row.get('temperature', 0.0)):g}", TreeStats())
                    engine.step_observers = [untimed_observer(stats, log0), *extra]
                res = timed_generation(engine, prompt, (hooks.decoder or new_decoder)(mode),
                                       settings.replace(max_new_tokens=len(output)))
                if res.output_ids != output:
                    raise AssertionError(f"replay of question {row.get('question_id')} diverged from its "
                                         "recorded output")
                session.gens.append(Replayed(row, mode, stages, res.accept_lengths, res.pipeline_steps, res.rounds))
                if progress is not None:
                    progress.update(1)
        finally:
            if not errors:
                engine.shutdown()
    return session


def device_parts(drafter) -> list:
    """What lives in device memory on a GPU rank 0: every module and tensor the drafter and its sources hold
    (heads, lm_head, embeddings, KV caches' tensors), for :class:`pipeline.tools.opcount.OpCounter`."""
    out: list = []
    for s in list(getattr(drafter, "sources", [])) + ([drafter] if drafter is not None else []):
        for v in vars(s).values():
            if isinstance(v, (torch.nn.Module, torch.Tensor)):
                out.append(v)
            elif hasattr(v, "keys") and isinstance(getattr(v, "keys", None), torch.Tensor):   # a KVCache
                out += [v.keys, v.values]
    return out


def untimed_observer(observer, log: OpLog):
    """``observer`` as a step observer whose own CPU time is not rank 0's host work (:meth:`OpLog.untimed`)."""
    def observe(*args) -> None:
        with log.untimed():
            observer(*args)
    return observe
