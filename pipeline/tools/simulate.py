"""What-if simulator: predict the decode time of recorded generations for other stage counts, profiles and links.

Plan a deployment before buying it: record generations once (any mode, any timing: rows of
``pipeline.run --output``, ``pipeline.tools.bench`` or ``run_eval.sh``), then ask how long the same answers would take
with 8 or 16 stages, another device profile or a faster link, in seconds on one machine::

    python -m pipeline.tools.simulate outputs/eval/edge_orin_7b/rows.jsonl --stages 2,4,8 --bandwidth-mbps 150,1000

**Why a recorded answer fixes the schedule.** Given the committed text (``prompt_ids`` + ``output_ids``):

* a drafted child is accepted iff its token is the next committed token: at T = 0 by definition, and at T > 0
  because the multi-candidate rule removes a rejected child's token from the residual (``pipeline/verify.py``),
  so a committed token that equals a drafted child was that child's acceptance;
* the draft trees depend only on committed tokens and the target's features at them, which one forward of the
  target over prompt + output provides.

**Replay** (:func:`replay`) therefore runs the *real* code of a mode: its rank-0 scheduler (``pipeline/modes``),
the real drafter and tree operations, and the real stage loop (``pipeline/worker.py``: decisions, KV compaction,
in-flight pruning) on any number of stages, in one process (:mod:`pipeline.local_ring`). Only the expensive
parts are stand-ins: a stage's "layers" (:class:`ReplayStage`) track whether a row lies on the committed path and
at which position, and the lm_head (:class:`ReplayEngine`) puts all mass on the committed token. Every rank's
ordered operations are recorded (:class:`OpLog`): stage forwards (rows, cached slots), lm_head and draft-head
applications, sends (modeled bytes), receives, broadcasts, and the host work in between (the thread CPU time of
the real bookkeeping: tree building, verification, pruning, message encoding).

**Timing** (:func:`simulate_timing`) runs those operation lists through a discrete-event model with the
emulated testbed's semantics (``pipeline/emulation.py``): a compute op takes the profile's modeled time, a
message serialises on its link (bytes / bandwidth) and arrives ``latency_s`` later without blocking the
sender, a receive waits for its message, rank 0 issues a decision broadcast after ``latency + (N-1) x
transfer``, a stage takes it no earlier, and (as with gloo) the broadcast returns on rank 0 only once every
stage has entered it; host work takes its measured time. Predictions are in the
profile's time (``time_scale`` dilates modeled durations like ``emu.time_scale``).

**Exactness.** At T = 0 the replay reproduces the recorded run's acceptance (τ, steps, rows per segment) for the
recorded stage count, and for another stage count it is what that run would do (greedy output does not depend
on the split). At T > 0 a run with another schedule would sample another text from the same law; a replayed
text is still a valid sample of the mode's behaviour, so predictions are exact in distribution over many
generations. Feature values come from one full forward rather than the pipeline's tree forwards, so a draft
near-tie can rarely flip (the summary shows the recorded τ beside the replayed one).
Not modeled by default: the transport's own per-message cost (gloo, process wake-ups; ``--msg-overhead-s``,
``--op-overhead-s``, or ``--calibrate ar`` to fit one per-event cost on recorded ar rows) and overruns of a real
emulated run (the simulator times every op exactly as the profile says, so it predicts what a host fast enough
for the profile would measure).
"""
from __future__ import annotations

from config.paths import REPO
import argparse
import csv
import json
import math
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from model.devices import HOST
from model.kv_cache import KVCache
from config.profiles import EmulationError, LinkModel, Profile, load_profile, message_parts
from pipeline.emulation import hidden_rows

NEG = -1.0e4      # logit of every token but the committed one: softmax gives exactly one-hot in float32


# -- operation logs ---------------------------------------------------------------------------------
class OpLog:
    """One rank's ordered operations. Must be used only from that rank's thread (host time is thread CPU time).

    Ops are tuples: ``("host", s)``, ``("compute", w, ctx)``, ``("lm_head", rows, real_s)``,
    ``("draft", w, ctx, real_s)``, ``("send", dst, hidden_rows, other_bytes)``, ``("recv", src)``,
    ``("bcast", other_bytes)`` (rank 0), ``("bcast_recv",)``, ``("mark", name)``.
    """

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.last = time.thread_time()

    def _host(self) -> None:
        now = time.thread_time()
        if now > self.last:
            self.ops.append(("host", now - self.last))
        self.last = now

    def add(self, *op) -> None:
        self._host()
        self.ops.append(op)

    @contextmanager
    def modeled(self, kind: str, *args):
        """A modeled operation: its own CPU time is recorded with it, not as host work."""
        self._host()
        t0 = time.thread_time()
        try:
            yield
        finally:
            now = time.thread_time()
            self.ops.append((kind, *args, now - t0))
            self.last = now


class Recorder:
    """The ring observer: per-rank :class:`OpLog` entries for every send, receive and broadcast."""

    def __init__(self, world: int) -> None:
        self.logs = [OpLog() for _ in range(world)]

    def on_send(self, rank, dst, msg) -> None:
        self.logs[rank].add("send", dst, *message_parts(msg))

    def on_recv(self, rank, src) -> None:
        self.logs[rank].add("recv", src)

    def on_bcast_root(self, msg) -> None:
        self.logs[0].add("bcast", message_parts(msg)[1])

    def on_bcast_recv(self, rank) -> None:
        self.logs[rank].add("bcast_recv")


class _MarkTracer:
    """Rank 0's tracer: spans are no-ops; generation marks go to the op log (decode window)."""

    def __init__(self, log: OpLog) -> None:
        self.log, self.busy_s, self.rank, self.enabled = log, 0.0, 0, False

    @contextmanager
    def span(self, name, **meta):
        yield

    def mark(self, name, **meta) -> None:
        self.log.add("mark", name)

    def reset_counters(self) -> None:
        pass


class ScheduledDirect:
    """Rank 0's point-to-point decisions in a replay, delivered to the stages on a schedule.

    A replay runs every rank in real threads but times them afterwards (:func:`simulate_timing`), so whether a
    decision reached a stage before it computed a segment is only known after a pass. The simulator therefore
    replays in passes: pass 0 delivers no direct decision (ring-only: the copy riding on the next segment);
    pass ``k + 1`` gives stage ``r``'s ``j``-th poll (one per segment, :meth:`pipeline.worker.StageWorker._segment`)
    exactly the decisions that pass ``k``'s timing says had arrived by then (``upto[r][j]``: how many, in issue
    order). Rank 0's operations do not depend on what the stages prune (it verifies the same rows and sends
    the same segments), so every pass replays the same rank-0 schedule and only the stages' work shrinks.
    No deadlock: waiting for decision ``i`` at poll ``j`` adds a dependency that pass ``k``'s time order
    already satisfies, and the rest of the dependency graph is unchanged.
    """

    def __init__(self, world: int, upto: list[list[int]] | None = None, wait_s: float = 120.0) -> None:
        self.cond = threading.Condition()
        self.issued: list = []
        self.upto = upto
        self.taken = [0] * world
        self.polls = [0] * world
        self.wait_s = wait_s

    def issue(self, msg) -> None:
        with self.cond:
            self.issued.append(msg)
            self.cond.notify_all()

    def take(self, rank: int) -> tuple[list, int]:
        """The decisions stage ``rank`` receives at its next poll, and how many it has received in all."""
        j = self.polls[rank]
        self.polls[rank] += 1
        n = self.taken[rank]
        if self.upto is not None and rank >= 2 and j < len(self.upto[rank]):
            n = max(n, self.upto[rank][j])
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.issued) >= n, timeout=self.wait_s):
                raise RuntimeError(f"replay: stage {rank} waited for direct decision {n} that rank 0 never issued")
            out = self.issued[self.taken[rank]:n]
        self.taken[rank] = n
        return out, n


def _sim_comm(ring, rank: int, rec: "Recorder", direct: ScheduledDirect, tracer=None):
    """A :class:`pipeline.local_ring.LocalComm` whose direct decisions follow ``direct``'s schedule and are
    logged: ``("dsend", dst, bytes)`` on rank 0, ``("poll", received so far)`` on a stage."""
    from pipeline.local_ring import LocalComm

    class SimComm(LocalComm):
        def send_direct(self, msg) -> None:
            wired = self._wire(msg)
            for r in range(2, self.world):
                rec.logs[self.rank].add("dsend", r, message_parts(msg)[1])
            direct.issue(wired)

        def poll_direct(self) -> list:
            out, n = direct.take(self.rank)
            rec.logs[self.rank].add("poll", n)
            return out

    return SimComm(ring, rank, tracer=tracer, observer=rec, direct=False)


# -- stand-ins for the target ------------------------------------------------------------------------
class Committed:
    """The generation being replayed: ``seq`` = prompt + output ids, ``features[p]`` = the target's feature at p."""

    seq: list[int] = []
    features: torch.Tensor | None = None


class _ReplayBlock:
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
        self.block = _ReplayBlock()
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


class ReplayDrafter:
    """The real drafter, fed the target's features at the positions the replay rows name."""

    def __init__(self, drafter, committed: Committed) -> None:
        self.inner, self.committed = drafter, committed

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _features(self, rows: torch.Tensor) -> torch.Tensor:
        if not bool((rows[:, 0] > 0.5).all()):
            raise AssertionError("replay: a committed row is off the committed path")
        return self.committed.features[rows[:, 1].long()]

    def start(self, prompt_ids, first_token, features):
        return self.inner.start(prompt_ids, first_token, self._features(features))

    def commit(self, tokens, features):
        return self.inner.commit(tokens, self._features(features))


def _make_replay_engine():
    from pipeline.engine import Engine

    class ReplayEngine(Engine):
        """Rank 0 with the lm_head replaced: an on-path row at position p puts all mass on ``seq[p + 1]``."""

        vocab_size = 0
        committed: Committed
        log: OpLog

        def logits(self, hidden):
            rows = hidden.reshape(-1, 2)
            with self.log.modeled("lm_head", int(rows.shape[0])):
                out = torch.full((rows.shape[0], self.vocab_size), NEG, dtype=torch.float32, device=HOST)
                seq = self.committed.seq
                for i, (flag, p) in enumerate(rows.tolist()):
                    nxt = int(p) + 1
                    if flag > 0.5 and nxt < len(seq):
                        out[i, seq[nxt]] = 0.0
                return out

    return ReplayEngine


# -- replay -------------------------------------------------------------------------------------------
@dataclass
class Replayed:
    """One replayed generation (its output is ``row["output_ids"]``: the replay checks it). Its operations live
    in the session's logs; the i-th generation of a session is its i-th decode window."""

    row: dict
    mode: str
    stages: int
    accept_lengths: list[int]
    pipeline_steps: int


@dataclass
class Session:
    stages: int
    mode: str
    logs: list[OpLog]
    gens: list[Replayed] = field(default_factory=list)


class TargetFeatures:
    """The unsplit target's final normalized hidden states (EAGLE's features), from the stage checkpoints."""

    def __init__(self, stage_root: Path, dtype=torch.float32) -> None:
        from model.stage_format import read_manifest
        from model.stage_model import load_stage
        world = len(read_manifest(stage_root)["split"])
        self.stages = [load_stage(stage_root, r, world, dtype) for r in range(1, world)]   # layer stages
        self.dtype = dtype

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids])
        for m in self.stages:
            cache = m.block.new_cache(len(ids), self.dtype, "cpu") if m.block is not None else None
            pos, mask = (cache.context_inputs(len(ids), self.dtype) if cache is not None else
                         (torch.arange(len(ids))[None], None))
            x = m(x, pos, mask, cache)
        return x[0]


def replay(rows: list[dict], mode: str, stages: int, cfg, drafter, vocab_size: int,
           features: TargetFeatures, progress=None, direct_upto: list[list[int]] | None = None) -> Session:
    """Replay ``rows`` (recorded generations) through ``mode`` on ``stages`` layer stages; returns the op logs.
    ``direct_upto``: the direct-decision schedule of a later pass (:class:`ScheduledDirect`); ``None``:
    decisions reach the stages on the ring only (pass 0)."""
    from pipeline.engine import timed_generation
    from pipeline.local_ring import LocalRing, stage_threads
    from pipeline.modes import DECODERS
    from pipeline.verify import Sampler
    from pipeline.worker import StageWorker

    world = stages + 1
    ring, rec, committed = LocalRing(world), Recorder(world), Committed()
    direct = ScheduledDirect(world, direct_upto)
    session = Session(stages, mode, rec.logs)
    max_len = max(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows) + 1024

    def stage(r: int) -> None:
        rec.logs[r].last = time.thread_time()
        StageWorker(ReplayStage(r, committed, rec.logs[r]), _sim_comm(ring, r, rec, direct),
                    max_len, torch.float64, "cpu").run()

    log0 = rec.logs[0]
    comm0 = _sim_comm(ring, 0, rec, direct, tracer=_MarkTracer(log0))
    rdrafter = None
    if drafter is not None:
        rdrafter = ReplayDrafter(drafter, committed)
        _record_drafter(drafter, log0)
    engine = _make_replay_engine()(torch.nn.Linear(1, 1), comm0, rdrafter,
                                   Sampler(float(cfg.gen.temperature), 1.0, 0, torch.Generator()), set(), cfg)
    engine.vocab_size, engine.committed, engine.log = vocab_size, committed, log0
    with stage_threads(world, stage) as errors:
        log0.last = time.thread_time()
        try:
            for row in rows:
                prompt, output = list(row["prompt_ids"]), list(row["output_ids"])
                committed.seq = prompt + output
                committed.features = features(committed.seq)
                # the recorded answer ends where it ended: exactly len(output) tokens, no stop token needed
                engine.cfg = replace(cfg, gen=replace(cfg.gen, max_new_tokens=len(output)))
                res = timed_generation(engine, prompt, DECODERS[mode])
                if res.output_ids != output:
                    raise AssertionError(f"replay of question {row.get('question_id')} diverged from its "
                                         "recorded output")
                session.gens.append(Replayed(row, mode, stages, res.accept_lengths, res.pipeline_steps))
                if progress is not None:
                    progress.update(1)
        finally:
            if not errors:
                engine.shutdown()
    return session


def _record_drafter(drafter, log: OpLog) -> None:
    """Log the drafter's head forwards and draft log-prob (lm_head) calls as modeled rank-0 ops."""
    if getattr(drafter, "_sim_recorded", False):
        drafter._sim_log[0] = log
        return
    holder = [log]
    drafter._sim_recorded, drafter._sim_log = True, holder
    orig_lp = drafter.logprobs

    def logprobs(hidden):
        with holder[0].modeled("lm_head", hidden_rows(hidden)):
            return orig_lp(hidden)
    drafter.logprobs = logprobs
    head = getattr(drafter, "head", None)
    if head is not None and getattr(drafter, "cache", None) is not None:
        orig_fwd = head.forward

        def forward(tokens, feats, positions, mask, kv):
            with holder[0].modeled("draft", int(tokens.shape[-1]), int(kv.length)):
                return orig_fwd(tokens, feats, positions, mask, kv)
        head.forward = forward


# -- timing -------------------------------------------------------------------------------------------
@dataclass
class TimingConfig:
    """How a session's ops are timed. ``stage_cost_scale`` multiplies every stage compute time (e.g. the same
    model on twice as many stages: 0.5); ``hidden_bytes_per_token`` overrides the profile's (needed when the
    profile counts real payloads); ``model_rank0=False`` times rank 0's lm_head/draft ops at their recorded
    CPU time instead of the profile's model."""

    profile: Profile
    time_scale: float = 1.0
    stage_cost_scale: float = 1.0
    msg_overhead_s: float = 0.0         # transport cost per received message or broadcast (every rank)
    model_rank0: bool = True
    real_hidden_bytes: float = 0.0      # bytes per hidden row of the real model (profiles that count payloads)
    op_overhead_s: float = 0.0          # added to every modeled op (e.g. the testbed's padding overhead)


class Deadlock(RuntimeError):
    pass


@dataclass
class DirectTimes:
    """Direct-decision timing of one simulated session: ``arrivals[r][i]`` = when decision ``i`` (issue order)
    reached stage ``r``; ``polls[r][j]`` = ``(time, decisions received so far)`` of stage ``r``'s ``j``-th poll."""

    arrivals: dict = field(default_factory=dict)
    polls: dict = field(default_factory=dict)

    def schedule(self, world: int) -> list[list[int]]:
        """For the next pass: how many decisions had reached stage ``r`` by its ``j``-th poll."""
        import bisect
        return [[bisect.bisect_right(self.arrivals.get(r, []), t) for t, _ in self.polls.get(r, [])]
                for r in range(world)]

    def late(self) -> tuple[int, int]:
        """(polls that received a decision before its modeled arrival, polls that received any): how far this
        pass's delivery is from its own timing (0 for pass 0, which delivers none)."""
        late = total = 0
        for r, polls in self.polls.items():
            arr = self.arrivals.get(r, [])
            prev = 0
            for t, n in polls:
                if n > prev:
                    total += 1
                    late += arr[n - 1] > t + 1e-12
                prev = n
        return late, total


def simulate_timing(logs: list[list[tuple]], tc: TimingConfig,
                    timeline: list | None = None, direct: "DirectTimes | None" = None) -> list[tuple[str, float]]:
    """Discrete-event timing of per-rank op lists; returns the ``(mark, time)`` list (rank 0 writes the marks).
    ``timeline``, when given, receives ``(rank, op, start, end)`` for every op (waits end at the arrival);
    ``direct``, when given, receives when each direct decision reached each stage and when each stage polled."""
    prof, s = tc.profile, tc.time_scale
    world = len(logs)
    idx, clock = [0] * world, [0.0] * world
    chan: dict[tuple[int, int], list[float]] = {}
    read: dict[tuple[int, int], int] = {}
    link_free: dict[tuple[int, int], float] = {}
    issued: list[float] = []              # k-th broadcast: when rank 0 issued it
    done_bcasts: list[float] = []         # ... and when it returned on rank 0
    joins: dict[int, dict[int, float]] = {}   # k -> {stage rank: when it entered the k-th broadcast}
    bread = [0] * world
    marks: list[tuple[str, float]] = []
    r0_lm = prof.lm_head if (tc.model_rank0 and prof.lm_head is not None) else None
    r0_draft = prof.draft_forward if (tc.model_rank0 and prof.draft_forward is not None) else None

    def nbytes(link: LinkModel, hidden_rows: int, other: int) -> float:
        per_row = link.hidden_bytes_per_token or tc.real_hidden_bytes
        return link.header_bytes + hidden_rows * per_row + other

    remaining = sum(len(l) for l in logs)
    while remaining:
        progressed = False
        for r in range(world):
            ops = logs[r]
            while idx[r] < len(ops):
                t = clock[r]
                op = ops[idx[r]]
                kind = op[0]
                if kind == "recv":
                    key = (op[1], r)
                    k = read.get(key, 0)
                    q = chan.get(key)
                    if q is None or k >= len(q):
                        break
                    t = max(t, q[k]) + tc.msg_overhead_s
                    read[key] = k + 1
                elif kind == "bcast_recv":
                    k = bread[r]
                    joins.setdefault(k, {}).setdefault(r, t)      # this rank is in the collective from now on
                    if k >= len(issued):
                        break
                    t = max(t, issued[k]) + tc.msg_overhead_s
                    bread[r] += 1
                elif kind == "host":
                    t += op[1]
                elif kind == "compute":
                    t += prof.stage_model(r).time(op[1], op[2]) * tc.stage_cost_scale * s + tc.op_overhead_s
                elif kind == "lm_head":
                    t += (r0_lm.time(op[1], 0) * s if r0_lm is not None else op[2]) + tc.op_overhead_s
                elif kind == "draft":
                    t += (r0_draft.time(op[1], op[2]) * s if r0_draft is not None else op[3]) + tc.op_overhead_s
                elif kind == "send":
                    dst = op[1]
                    link = prof.link_model(r, dst)
                    start = max(t, link_free.get((r, dst), 0.0))
                    done = start + link.transfer_s(nbytes(link, op[2], op[3])) * s
                    link_free[(r, dst)] = done
                    chan.setdefault((r, dst), []).append(done + link.latency_s * s)
                elif kind == "bcast":
                    k = len(done_bcasts)
                    if k == len(issued):   # rank 0 waits out the modeled delay, then issues the collective
                        link = prof.link_model(0, 1 % world)
                        issued.append(t + (link.latency_s + (world - 1) * link.transfer_s(nbytes(link, 0, op[1]))) * s)
                    if len(joins.get(k, {})) < world - 1:
                        break             # a gloo broadcast returns on the root once every stage has joined
                    t = max(issued[k], max(joins[k].values(), default=0.0))
                    done_bcasts.append(t)
                elif kind == "dsend":     # a direct decision: its own link, does not block rank 0
                    dst = op[1]
                    link = prof.link_model(r, dst)
                    start = max(t, link_free.get((r, dst), 0.0))
                    done = start + link.transfer_s(nbytes(link, 0, op[2])) * s
                    link_free[(r, dst)] = done
                    if direct is not None:
                        direct.arrivals.setdefault(dst, []).append(done + link.latency_s * s)
                elif kind == "poll":      # a stage looks at the direct decisions it holds (no time)
                    if direct is not None:
                        direct.polls.setdefault(r, []).append((t, op[1]))
                elif kind == "mark":
                    marks.append((op[1], t))
                else:
                    raise ValueError(f"unknown op {op!r}")
                if timeline is not None:
                    timeline.append((r, op, clock[r], t))
                clock[r] = t
                idx[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: logs[r][idx[r]] for r in range(world) if idx[r] < len(logs[r])}
            raise Deadlock(f"op logs cannot make progress: {stuck}")
    return marks


SPAN_KIND = {"compute": "compute", "lm_head": "lm_head", "draft": "draft", "recv": "recv", "bcast_recv": "broadcast",
             "bcast": "broadcast", "host": "host"}


def to_timeline(timeline: list, world: int):
    """The simulated op timeline as a :class:`pipeline.tools.timeline.Timeline` (Gantt charts, utilization). Rank-0 host
    work (tree building, verification, pruning) is the span kind ``host``."""
    from pipeline.tools.timeline import RankTrace, Timeline
    ranks = {r: RankTrace(r, 0.0) for r in range(world)}
    for r, op, a, b in timeline:
        kind = SPAN_KIND.get(op[0])
        if op[0] == "mark":
            ranks[r].marks.append((op[1], a, {}))
        elif kind is not None and b > a:
            ranks[r].spans.setdefault(kind, []).append((a, b))
    for rt in ranks.values():
        rt.n_events = sum(len(v) for v in rt.spans.values())
    return Timeline(ranks, "simulated")


def stage_utilization(tl, windows: list[tuple[float, float]]) -> list[list[float]]:
    """Per generation (decode) window: each rank's busy fraction, :func:`pipeline.trace.busy_fraction` (rank 0:
    lm_head, draft head and ``host`` work; stages: their layer computations)."""
    from pipeline.tools.timeline import _clipped
    from pipeline.trace import busy_fraction
    return [[round(busy_fraction(tl.ranks[r].spans, lo, hi, _clipped), 4) for r in sorted(tl.ranks)] for lo, hi in windows]


def decode_windows(marks: list[tuple[str, float]]) -> list[tuple[float, float]]:
    """Each generation's decode window ``(decode_begin, gen_end)`` on rank 0's clock."""
    out, begin = [], None
    for name, t in marks:
        if name == "decode_begin":
            begin = t
        elif name == "gen_end" and begin is not None:
            out.append((begin, t))
            begin = None
    return out


def decode_times(marks: list[tuple[str, float]]) -> list[float]:
    """Decode seconds of each generation: from its ``decode_begin`` mark to its ``gen_end`` mark."""
    return [hi - lo for lo, hi in decode_windows(marks)]


# -- CLI ------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce  # each default shown once
    p = argparse.ArgumentParser(
        prog="python -m pipeline.tools.simulate",
        description="Predict decode time, throughput (ξ) and speed-ups of recorded generations for other stage "
                    "counts, emulation profiles and links, without running the pipeline: the real schedulers "
                    "are replayed on the recorded answers (exact at T=0) and timed by a discrete-event model "
                    "of the emulated testbed. Rows recorded under the same profile and stage count are "
                    "compared with their measured decode time (the simulator's error).",
        epilog="Extra key=value words are config overrides (tree parameters etc.; use the ones of the recorded "
               "run). Example: python -m pipeline.tools.simulate outputs/eval/edge_orin_7b/rows.jsonl "
               "--stages 2,4,8 --bandwidth-mbps 150,1000 --out-dir outputs/sim",
        formatter_class=DefaultsOnce)
    p.add_argument("rows", nargs="+", help="JSONL rows with prompt_ids and output_ids (pipeline.run --output, "
                   "bench or eval rows), and key=value config overrides")
    p.add_argument("--modes", default="recorded",
                   help="modes to replay every recorded answer with (comma-separated), or 'recorded' (each row "
                        "with its own mode)")
    p.add_argument("--stages", default="recorded",
                   help="comma-separated layer-stage counts, or 'recorded' (each row's world_size - 1)")
    p.add_argument("--profile", default="edge_orin_7b", help="emulation profile (builtin name or JSON path)")
    p.add_argument("--bandwidth-mbps", default="", help="comma-separated link bandwidths overriding the profile's")
    p.add_argument("--latency-s", type=float, default=None, help="one-way link latency overriding the profile's")
    p.add_argument("--stage-cost-scale", default="auto",
                   help="factor on every stage compute time; 'auto' keeps the model's total layers: "
                        "recorded stages / simulated stages")
    p.add_argument("--msg-overhead-s", type=float, default=0.0,
                   help="transport cost added to every received message and broadcast (gloo, wake-ups); 0 = "
                        "ideal transport")
    p.add_argument("--op-overhead-s", type=float, default=0.0, help="cost added to every modeled op")
    p.add_argument("--calibrate", default="", metavar="MODE",
                   help="fit one per-event overhead (every modeled op and received message) so that the recorded "
                        "rows of MODE (e.g. ar) are predicted exactly, then use it for everything; validate on "
                        "the other modes")
    p.add_argument("--time-scale", type=float, default=1.0, help="dilate modeled time like emu.time_scale")
    p.add_argument("--no-model-rank0", action="store_true",
                   help="time rank 0's lm_head/draft head at this host's measured speed, not the profile's")
    p.add_argument("--temperature", default="all", help="only rows of this temperature ('all': every row)")
    p.add_argument("--limit", type=int, default=0, help="at most this many rows per input (0 = all)")
    p.add_argument("--stage-dir", default="", help="split checkpoint of the recorded run (default: embedded SmolLM2)")
    p.add_argument("--head-dir", default="", help="EAGLE head of the recorded run (default: the default head)")
    p.add_argument("--out-dir", default=str(REPO / "outputs" / "sim"), help="predictions.jsonl, summary.md/csv")
    p.add_argument("--no-plots", action="store_true", help="skip the paper-style plots")
    p.add_argument("--direct-passes", type=int, default=1, metavar="K",
                   help="replay passes that deliver rank 0's point-to-point decisions on the previous pass's "
                        "timing (ScheduledDirect), so stages prune work in flight as they would; 0 = decisions "
                        "on the ring only (pass 0, the pre-2026-11-23 model)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while replaying: rank 0's host work (Python tree bookkeeping between "
                        "modeled ops) is timed as thread CPU time, which several threads' spin-waits inflate by up "
                        "to 2x on a loaded machine; 1 keeps it reproducible (0 = torch's default)")
    p.add_argument("--gantt", type=int, default=-1, metavar="N",
                   help="draw a Gantt chart of the N-th replayed generation of every mode/stages/bandwidth (-1: none)")
    p.add_argument("--gantt-window", type=float, default=1.5, help="seconds of decode shown in each Gantt chart")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_intermixed_args(argv)
    args.overrides = [a for a in args.rows if "=" in a and not Path(a).exists()]
    args.rows = [a for a in args.rows if a not in args.overrides]
    if not args.rows:
        p.error("give at least one rows JSONL file")
    return args


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def load_rows(paths: list[str], temperature: str, limit: int) -> list[dict]:
    rows = []
    for path in paths:
        got = []
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    continue        # a torn last line of an interrupted sweep
                raise ValueError(f"{path}:{i + 1} is not a JSON line") from None
            if "prompt_ids" not in r or "output_ids" not in r:
                raise ValueError(f"{path}:{i + 1} has no prompt_ids/output_ids (not a pipeline row)")
            if temperature != "all" and float(r.get("temperature", 0)) != float(temperature):
                continue
            got.append(r)
            if limit and len(got) >= limit:
                break
        rows += got
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    except (EmulationError, OSError, UnicodeDecodeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    from tqdm import tqdm

    from config.run_config import DEFAULT, apply_overrides
    from model.stage_format import read_manifest
    from model.stage_model import DTYPES, load_stage
    from config.paths import DEFAULT_STAGE_DIR
    from pipeline.build import make_drafter

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    profile = load_profile(args.profile)
    rows = load_rows(args.rows, args.temperature, args.limit)
    if not rows:
        print("error: no rows to simulate", file=sys.stderr)
        return 2
    cfg = apply_overrides(DEFAULT, args.overrides)
    if args.stage_dir:
        cfg.model.stage_dir = args.stage_dir
    if args.head_dir:
        cfg.model.head_dir = args.head_dir
    stage_root = Path(cfg.model.stage_dir or DEFAULT_STAGE_DIR)
    recorded_world = len(read_manifest(stage_root)["split"])
    dtype = DTYPES[cfg.model.dtype]
    device = "cuda" if cfg.model.device == "cuda" else "cpu"   # rank 0's drafter; stand-ins stay on the host
    if device == "cuda" and not torch.cuda.is_available():
        print("error: device=cuda but CUDA is not available", file=sys.stderr)
        return 2
    model0 = load_stage(stage_root, 0, recorded_world, dtype, device)
    features = TargetFeatures(stage_root, dtype)
    real_hidden_bytes = model0.config.hidden_size * torch.empty(0, dtype=dtype).element_size()

    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        rec_stages = int(r.get("world_size") or recorded_world) - 1
        modes = [r["mode"]] if args.modes == "recorded" else args.modes.split(",")
        stage_list = [rec_stages] if args.stages == "recorded" else _ints(args.stages)
        for m in modes:
            for n in stage_list:
                groups.setdefault((m, n), []).append(r)
    drafter = None
    if any(m != "ar" for m, _ in groups):
        drafter = make_drafter(cfg, stage_root, model0, dtype, device)
    bandwidths = [float(b) for b in args.bandwidth_mbps.split(",") if b.strip()] or [None]

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    passes = max(0, args.direct_passes)
    bar = tqdm(total=sum(len(v) * (1 + (passes * len(bandwidths) if m != "ar" else 0)) for (m, _), v in groups.items()),
               desc="replaying", disable=args.quiet)
    sessions = [(replay(grows, mode, n, cfg, drafter, model0.config.vocab_size, features, bar), grows)
                for (mode, n), grows in sorted(groups.items())]

    def timing(n: int, prof: Profile, overhead: float) -> TimingConfig:
        scale = (recorded_world - 1) / n if args.stage_cost_scale == "auto" else float(args.stage_cost_scale)
        return TimingConfig(prof, time_scale=args.time_scale, stage_cost_scale=scale,
                            msg_overhead_s=args.msg_overhead_s + overhead, model_rank0=not args.no_model_rank0,
                            real_hidden_bytes=real_hidden_bytes, op_overhead_s=args.op_overhead_s + overhead)

    overhead = 0.0
    if args.calibrate:
        overhead = calibrate([s for s, _ in sessions], args.calibrate, profile,
                             lambda n, o: timing(n, profile, o), args)
        print(f"[simulate] calibrated testbed overhead: {overhead * 1e3:.3f} ms per modeled op and per received "
              f"message (fitted on the recorded {args.calibrate} rows)", file=sys.stderr)
    preds = []
    for base, grows in sessions:
        for bw in bandwidths:
            prof = _with_link(profile, bw, args.latency_s)
            tc = timing(base.stages, prof, overhead)
            session, late = base, None
            for _ in range(passes if base.mode != "ar" else 0):
                direct = DirectTimes()
                simulate_timing([l.ops for l in session.logs], tc, None, direct)
                if not direct.arrivals:       # this mode issued no direct decision
                    break
                session = replay(grows, base.mode, base.stages, cfg, drafter, model0.config.vocab_size, features,
                                 bar, direct.schedule(base.stages + 1))
            events: list = []
            direct = DirectTimes()
            windows = decode_windows(simulate_timing([l.ops for l in session.logs], tc, events, direct))
            late = direct.late()
            tl = to_timeline(events, session.stages + 1)
            util = stage_utilization(tl, windows)
            for g, (lo, hi), u in zip(session.gens, windows, util):
                pred = _prediction(g, hi - lo, prof, bw, args, tc.stage_cost_scale, overhead)
                pred["busy_fraction"] = u
                pred["direct_polls_late"] = list(late)
                preds.append(pred)
            if args.gantt >= 0 and args.gantt < len(windows):
                from pipeline.tools.timeline import gantt
                lo, hi = windows[args.gantt]
                hi = min(hi, lo + args.gantt_window * args.time_scale)
                name = f"gantt_{session.mode}_s{session.stages}_bw{prof.link.bandwidth_mbps or 0:g}.png"
                gantt(tl, lo, hi, out_dir / name, title=f"simulated {session.mode}: {session.stages} stages, "
                      f"{profile.name}, {prof.link.bandwidth_mbps or 0:g} Mbit/s (generation {args.gantt})")
    bar.close()
    with open(out_dir / "predictions.jsonl", "w", encoding="utf-8") as f:
        for p in preds:
            f.write(json.dumps(p) + "\n")
    table = summarize(preds)
    write_summary(table, out_dir, profile.name)
    paper = write_paper_tables(preds, out_dir, profile.name, args) if any(p.get("dataset") for p in preds) else []
    print((out_dir / "summary.md").read_text())
    for path in paper:
        print(f"[simulate] paper-style table: {path}", file=sys.stderr)
    return 0


def _with_link(profile: Profile, bandwidth: float | None, latency: float | None) -> Profile:
    if bandwidth is None and latency is None:
        return profile
    def fix(l: LinkModel) -> LinkModel:
        return replace(l, bandwidth_mbps=bandwidth if bandwidth is not None else l.bandwidth_mbps,
                       latency_s=latency if latency is not None else l.latency_s)
    return replace(profile, link=fix(profile.link), links={k: fix(v) for k, v in profile.links.items()})


def _same_run(g: "Replayed", prof: Profile, bw, args) -> bool:
    """Was ``g``'s row recorded by the very run being predicted (mode, stages, profile, link, dilation)?"""
    row = g.row
    return (row.get("mode") == g.mode and int(row.get("world_size") or 0) - 1 == g.stages
            and row.get("emu_profile") == prof.name and bw is None and args.latency_s is None
            and float(row.get("emu_time_scale") or 1.0) == args.time_scale
            and args.stage_cost_scale in ("auto", "1", "1.0") and bool(row.get("decode_s")))


def calibrate(sessions: list, mode: str, profile: Profile, make_tc, args) -> float:
    """The per-event testbed overhead ``c`` (added to every modeled op and every received message) with which the
    predicted total decode time of the recorded ``mode`` rows equals their measured total (bisection: the
    prediction grows with ``c``). Validate on the *other* modes."""
    cal = [s for s in sessions if s.mode == mode]
    pairs = [(s, {id(g) for g in s.gens if _same_run(g, profile, None, args)}) for s in cal]
    measured = sum(g.row["decode_s"] for s, ids in pairs for g in s.gens if id(g) in ids)
    if not measured:
        raise ValueError(f"--calibrate {mode}: no rows of that mode recorded under profile {profile.name} "
                         f"with the simulated stage count")

    def predicted(c: float) -> float:
        tot = 0.0
        for s, gs in pairs:
            times = decode_times(simulate_timing([l.ops for l in s.logs], make_tc(s.stages, c)))
            tot += sum(t for g, t in zip(s.gens, times) if id(g) in gs)
        return tot

    lo, hi = 0.0, 0.01
    if predicted(lo) >= measured:
        return 0.0
    while predicted(hi) < measured and hi < 1.0:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def _prediction(g: Replayed, t: float, prof: Profile, bw, args, stage_scale: float, overhead: float = 0.0) -> dict:
    row = g.row
    same_run = _same_run(g, prof, bw, args)
    n = len(g.row["output_ids"])
    tau = sum(g.accept_lengths) / max(1, len(g.accept_lengths))
    out = {"question_id": row.get("question_id"), "turn": row.get("turn", 0), "dataset": row.get("dataset"),
           "temperature": row.get("temperature", 0.0), "mode": g.mode, "stages": g.stages, "profile": prof.name,
           "bandwidth_mbps": prof.link.bandwidth_mbps, "stage_cost_scale": round(stage_scale, 6),
           "time_scale": args.time_scale, "new_tokens": n, "tau": round(tau, 4),
           "steps": len(g.accept_lengths), "pipeline_steps": g.pipeline_steps, "accept_lengths": g.accept_lengths,
           "pred_decode_s": round(t, 6), "overhead_s": overhead,
           "pred_tokens_per_s": round(n / t * args.time_scale, 3) if t > 0 else None}
    if same_run:
        out["recorded_decode_s"] = row["decode_s"]
        out["recorded_tau"] = row.get("tau")
        out["recorded_emu_flag"] = bool(row.get("emu_flag"))
        out["error"] = round(t / row["decode_s"] - 1.0, 4)
    return out


def summarize(preds: list[dict]) -> list[dict]:
    """Per (temperature, stages, bandwidth, mode): tokens, τ, predicted ξ (all tokens / all decode seconds), SR vs
    naive and ar of the same group, and the error against recorded runs where there are some."""
    groups: dict[tuple, list[dict]] = {}
    for p in preds:
        groups.setdefault((p["temperature"], p["stages"], p["bandwidth_mbps"], p.get("dataset") or "",
                           p["mode"]), []).append(p)
    table = []
    for (temp, st, bw, ds, mode), ps in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3], _MODE_ORDER.get(kv[0][4], 9))):
        toks = sum(p["new_tokens"] for p in ps)
        secs = sum(p["pred_decode_s"] for p in ps)
        scale = ps[0]["time_scale"]
        rec = [p for p in ps if "recorded_decode_s" in p]
        row = {"temperature": temp, "stages": st, "bandwidth_mbps": bw, "dataset": ds, "mode": mode,
               "generations": len(ps),
               "new_tokens": toks, "tau": round(sum(p["tau"] * p["steps"] for p in ps) / max(1, sum(p["steps"] for p in ps)), 3),
               "pred_xi": round(toks / secs * scale, 3) if secs else None}
        if all(p.get("busy_fraction") for p in ps):   # time-weighted over the generations
            fr = [sum(p["busy_fraction"][r] * p["pred_decode_s"] for p in ps) / secs
                  for r in range(len(ps[0]["busy_fraction"]))] if secs else []
            row["rank0_busy"] = round(fr[0], 3) if fr else None
            row["stage_busy_mean"] = round(sum(fr[1:]) / max(1, len(fr) - 1), 3) if fr else None
            row["stage_busy_min"] = round(min(fr[1:]), 3) if len(fr) > 1 else None
        if rec:
            rs = sum(p["recorded_decode_s"] for p in rec)
            ps_ = sum(p["pred_decode_s"] for p in rec)
            row["recorded_xi"] = round(sum(p["new_tokens"] for p in rec) / rs * scale, 3)
            row["error_total"] = round(ps_ / rs - 1.0, 4)
            row["error_mean_abs"] = round(sum(abs(p["error"]) for p in rec) / len(rec), 4)
            row["recorded_tau"] = round(sum(float(p["recorded_tau"] or 0) for p in rec) / len(rec), 3)
            row["flagged"] = sum(p["recorded_emu_flag"] for p in rec)
        table.append(row)
    for row in table:
        for base in ("naive", "ar"):
            ref = next((r for r in table if r["mode"] == base and r["temperature"] == row["temperature"]
                        and r["stages"] == row["stages"] and r["bandwidth_mbps"] == row["bandwidth_mbps"]
                        and r["dataset"] == row["dataset"]), None)
            if ref and ref["pred_xi"] and row["pred_xi"]:
                row[f"sr_vs_{base}"] = round(row["pred_xi"] / ref["pred_xi"], 3)
    return table


_MODE_ORDER = {"ar": 0, "naive": 1, "pruned": 2, "pipedec": 3, "continuous": 4}
COLUMNS = ["temperature", "stages", "bandwidth_mbps", "dataset", "mode", "generations", "new_tokens", "tau", "pred_xi",
           "sr_vs_naive", "sr_vs_ar", "rank0_busy", "stage_busy_mean", "stage_busy_min", "recorded_xi", "error_total", "error_mean_abs", "recorded_tau", "flagged"]


def write_summary(table: list[dict], out_dir: Path, profile: str) -> None:
    with open(out_dir / "summary.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in table:
            w.writerow({k: row.get(k, "") for k in COLUMNS})
    lines = [f"# Simulated decode throughput (profile `{profile}`)", "",
             "ξ = predicted decode tokens/s (all tokens / all decode seconds); SR = ξ / ξ(naive) of the same "
             "temperature, stages, bandwidth and dataset; τ = tokens per verification step incl. bonus (replayed); "
             "busy = share of decode time a rank computes (rank 0: lm_head, draft head, tree work; stages: "
             "layers), time-weighted over generations. "
             "Where rows were recorded under the same profile and stage count: their measured ξ, the total "
             "prediction error (predicted / measured decode seconds − 1), the mean per-generation |error|, "
             "and how many of them the emulation flagged for overruns.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in table:
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k in COLUMNS) + " |")
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_paper_tables(preds: list[dict], out_dir: Path, profile: str, args) -> list[Path]:
    """The evaluation sweep's paper-style summary (ξ, SR vs naive, τ per dataset, plots) of the predictions, one
    folder per (stages, bandwidth): ``paper_s<stages>_bw<mbps>/``."""
    from pipeline.tools.eval import DATASETS, MODES, plot, summarize as eval_summary
    groups: dict[tuple, list[dict]] = {}
    for p in preds:
        if p.get("dataset"):
            groups.setdefault((p["stages"], p["bandwidth_mbps"]), []).append(p)
    written = []
    for (stages, bw), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        rows = [{"dataset": p["dataset"], "mode": p["mode"], "temperature": p["temperature"],
                 "question_id": p["question_id"], "turn": p["turn"], "new_tokens": p["new_tokens"],
                 "decode_s": p["pred_decode_s"], "emu_time_scale": p["time_scale"],
                 "accept_lengths": p["accept_lengths"],
                 "emu_flag": bool(p.get("recorded_emu_flag"))} for p in ps]   # plots mark flagged recordings
        datasets = [d for d in DATASETS if any(r["dataset"] == d for r in rows)]
        datasets += sorted({r["dataset"] for r in rows} - set(datasets))
        modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
        temps = sorted({float(r["temperature"]) for r in rows})
        meta = {"profile": f"{profile} (simulated: {stages} layer stages, {bw:g} Mbit/s)" if bw else profile,
                "time_scale": args.time_scale, "world": stages + 1, "overrides": args.overrides,
                "max_new_tokens": max(r["new_tokens"] for r in rows), "stage_dir": args.stage_dir or None,
                "begin": "recorded", "end": "recorded"}
        md, csv_text = eval_summary(rows, datasets, modes, temps, meta, ([], 0, 0))
        d = out_dir / f"paper_s{stages}_bw{bw:g}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "summary.md").write_text(md, encoding="utf-8")
        (d / "summary.csv").write_text(csv_text, encoding="utf-8")
        if not args.no_plots:
            plot(rows, datasets, modes, temps, d)
        written.append(d / "summary.md")
    return written


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if not math.isnan(v) else ""
    return str(v)


if __name__ == "__main__":
    raise SystemExit(main())
