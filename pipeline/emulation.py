"""Emulated edge testbed: every stage step and every link hop takes the time a device profile models.

Off by default; ``emu.profile=<path or builtin name>`` turns it on (builtins are the JSON files in
``profiles/``, e.g. ``edge_orin_7b`` and ``zero``). The pipeline still computes everything for real, so
outputs stay exact; the emulation only *adds waiting*:

* **stage compute** (ranks 1..N, ``worker.meter``, an :class:`EmuMeter` on the ``stage_forward`` op): after
  the real forward of a segment of ``w`` rows over a KV cache of ``ctx`` slots, sleep until the modeled
  ``t_stage(w, ctx)`` has elapsed since the forward began. When the real work took longer than modeled, that
  is an *overrun* (counted, never hidden).
* **rank 0** (``emu.model_rank0=true`` and the profile has a ``rank0`` section): every draft-head forward and
  every ``lm_head`` application (target verification and draft log-probs) is padded the same way.
* **links** (:class:`LinkSender`): a message to rank ``d`` is handed to ``torch.distributed`` only when the
  modeled link would have delivered it: the link serialises messages (``bytes * 8 / bandwidth``) and adds
  ``latency_s``. A sender thread does the delayed ``isend``; sends on a link keep their order, and the caller
  never blocks (as with a real NIC). Rank 0's direct decision messages to stages 2..N take the same path
  over the modeled link ``0 -> r``.

Per-hop bytes follow the *modeled* deployment: a message carrying hidden states counts
``hidden_bytes_per_token`` per row (e.g. 4096 x 2 B for a 7B model in fp16) instead of the small model's real
payload, and each EAGLE-3 tapped feature riding along counts one more such row; id/parent/keep-index tensors
count their real bytes; every message adds ``header_bytes``.

Fidelity: each rank counts modeled ops, overruns and their seconds, link messages delivered later than
modeled, and sleep overshoot. The counters ride on the meter stack (:class:`EmuMeter` is a counting meter,
:mod:`model.meter`): rank 0 gathers every rank's meter counters with ``Stats`` messages (one right after
prefill, untimed, one after decode) and :meth:`EmuMeter.row_fields` (:func:`fidelity_fields` /
:func:`prefill_fields`) turns them into the ``emu_*`` fields of an output row (decode phase; prefill overruns
separately).

Time dilation (``emu.time_scale=s``): every modeled duration is multiplied by ``s``, so a host slower than
the modeled devices can still keep up (no overruns); throughput in modeled time is then ``s`` times the
measured one (``pipeline.tools.eval`` reports it so). Unmodeled host work (Python, tree bookkeeping, message
encoding) is divided by ``s`` in that view, so keep ``s`` as small as the overruns allow.

The emulation hooks in without changing the transport: :func:`install` gives the ``Comm`` a
:class:`LinkSender` (``comm.link``: its ``send`` hands messages to the link, its ``flush`` drains it first);
whoever builds the stage worker or the engine (``pipeline.build.make_stage_worker`` / ``make_engine``) calls
:func:`instrument_stage` / :func:`instrument_rank0`, which stack meters (:mod:`model.meter`, :class:`EmuMeter`)
on the worker, the engine, its drafter and the draft head: every stage forward, ``lm_head`` application and
draft-head forward runs inside ``meter.op(kind, rows, ctx)``, which pads it to the profile's model (no method is
replaced; the worker and the engine do not know about emulation).

Profiles (JSON, their cost and link models) are read by ``config/profiles.py``.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager

from config.profiles import Profile, load_profile, with_link
from model.meter import MeterStack, vocab_share

# per-rank counters: an EmuMeter's columns of a Stats counter table
COUNTERS = ("ops", "modeled_s", "overrun_ops", "overrun_s", "link_msgs", "link_modeled_s", "link_late_msgs",
            "link_late_s", "oversleep_s")
K = len(COUNTERS)
LATE_TOLERANCE_S = 5e-4   # a message handed over this much after its modeled delivery counts as late


# -- the per-rank emulator ----------------------------------------------------------------------------
class Emulator:
    """One rank's emulation state: padding, link delays and fidelity counters."""

    def __init__(self, profile: Profile, rank: int, world: int, model_rank0: bool = True,
                 flag_threshold: float = 0.05, device: str = "cpu", time_scale: float = 1.0,
                 stage_cost_scale: float = 1.0) -> None:
        self.profile, self.rank, self.world = profile, rank, world
        self.scale = time_scale
        self.stage_cost_scale = stage_cost_scale   # pipeline stages only; a TP group has its own GroupCost
        self.rank0_costs = {"lm_head": profile.lm_head, "draft_forward": profile.draft_forward,
                            "ssm_forward": profile.ssm_forward}
        self.model_rank0 = model_rank0 and profile.models_rank0
        self.flag_threshold = flag_threshold
        self.cuda = str(device).startswith("cuda")
        self.counters = [0.0] * K
        self.lock = threading.Lock()
        self.hidden_size = 0    # the real model's H, set by install_stage: tap columns count as hidden rows
        self.vocab_size = 0     # the target's vocabulary (install_rank0): a reduced-vocabulary lm_head op's share
        self.sender: LinkSender | None = None
        self.group_costs: dict = {}   # TP ranks: op kind -> GroupCost (install_tp_worker)

    # counters
    def _add(self, name: str, value: float = 1.0) -> None:
        with self.lock:
            self.counters[COUNTERS.index(name)] += value

    def take(self) -> list[float]:
        """This rank's counters since the last call (then reset)."""
        with self.lock:
            out, self.counters = self.counters, [0.0] * K
        return out

    def _sync(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def pad(self, t0: float, modeled: float) -> None:
        """The op that began at ``t0`` (perf_counter) finished its real work: wait out the modeled time
        (times ``time_scale``)."""
        modeled *= self.scale
        self._sync()
        now = time.perf_counter()
        real = now - t0
        with self.lock:
            c = self.counters
            c[0] += 1
            c[1] += modeled
            if real > modeled:
                c[2] += 1
                c[3] += real - modeled
        if real < modeled:
            target = t0 + modeled
            time.sleep(target - now)
            self._add("oversleep_s", max(0.0, time.perf_counter() - target))

    def stage_time(self, w: int, ctx: int) -> float:
        return self.profile.stage_model(self.rank).time(w, ctx) * self.stage_cost_scale

    def op_time(self, kind: str, rows: int, ctx: int) -> float | None:
        """Modeled seconds of one metered op (:data:`model.meter.KINDS`); None: the profile does not model it."""
        if kind == "stage_forward":
            return self.stage_time(rows, ctx)
        if kind.startswith("group_"):
            return self.group_costs[kind].time(rows, ctx)
        if not self.model_rank0:    # rank 0's ops run at host speed (emu.model_rank0=false or no rank0 section)
            return None
        cost = self.rank0_costs[kind]
        if cost is None:
            return None
        if kind == "lm_head":   # ctx: vocabulary rows applied (a reduced draft vocabulary), 0 = all
            return cost.time_share(rows, vocab_share(ctx, self.vocab_size))
        return cost.time(rows, ctx)

    # installation
    def install_tp_worker(self, worker, n: int, layers: int, profile_stages: int, real_hidden_bytes: float) -> None:
        """Pad every forward of a TP group rank to the modeled time of the whole group's forward
        (:class:`config.profiles.GroupCost`, the cost model ``pipeline.tools.tp_sim`` predicts with: compute of
        all ``layers`` at ``1/n`` width plus the exposed collectives of the schedule, Megatron or Galaxy). The
        group's real collectives run inside the padded op (localhost: far faster than the modeled link)."""
        from config.profiles import GroupCost, shard_cost
        prof = self.profile
        hb = prof.link.hidden_bytes_per_token or real_hidden_bytes
        shard = shard_cost(prof.stage, profile_stages, n)
        self.group_costs = {f"group_{s}": GroupCost(shard, n, layers, prof.link, hb, s) for s in ("megatron", "galaxy")}
        worker.meter = MeterStack(worker.meter, EmuMeter(self))

    def pad_fanout(self, msg, n: int) -> None:
        """Rank 0's broadcast of ``msg`` to a TP group of ``n`` ranks: the root's link carries ``n`` copies, then
        the link latency (``tp_sim``'s fan-out link). The caller blocks for that time (rank 0 has nothing else to
        do while a tp/galaxy round is in the group); counted as link time."""
        link = self.profile.link_model(0, 1)
        modeled = (link.latency_s + n * link.transfer_s(link.message_bytes(msg))) * self.scale
        self._add("link_msgs")
        self._add("link_modeled_s", modeled)
        if modeled > 0:
            time.sleep(modeled)

    def install_stage(self, worker) -> None:
        """Pad every stage forward of ``worker`` to the profile's stage model (``meter.op("stage_forward")``), and
        count each EAGLE-3 tap column of its messages as one more hidden row on the modeled link."""
        self.hidden_size = int(getattr(getattr(worker.model, "config", None), "hidden_size", 0) or 0)
        worker.meter = MeterStack(worker.meter, EmuMeter(self))

    def install_rank0(self, engine) -> None:
        """Pad rank 0's ``lm_head`` applications, draft-head and small-LM forwards to the profile's rank0 models:
        meters (:mod:`model.meter`) on the engine and on every site of its drafter
        (:func:`draft.protocol.install_meter`). The engine's meter carries rank 0's counters (its link's too) even
        when rank 0 is not modeled (``emu.model_rank0=false``: nothing of rank 0's is padded)."""
        lm_head = getattr(getattr(engine, "model", None), "lm_head", None) or getattr(engine.drafter, "lm_head", None)
        self.vocab_size = int(getattr(lm_head, "out_features", 0) or 0)
        engine.meter = MeterStack(engine.meter, EmuMeter(self))
        if engine.drafter is not None and self.model_rank0:
            from draft.protocol import install_meter
            install_meter(engine.drafter, EmuMeter(self))


class EmuMeter:
    """An :class:`model.meter.OpMeter` that waits out each op's modeled time (the profile's stage model and its
    ``rank0`` models; an op kind the profile does not model is not padded). Stacked after a site's tracing meter
    (:class:`model.meter.MeterStack`), so the pad is traced and counted busy as part of the op.

    A counting meter (:class:`model.meter.CountingMeter`): its counters are its rank's :data:`COUNTERS` (ops,
    pads, overruns and the rank's link), and :meth:`row_fields` turns every rank's into the ``emu_*`` fields."""

    counter_names = COUNTERS

    def __init__(self, emu: Emulator) -> None:
        self.emu = emu

    def take(self) -> list[float]:
        return self.emu.take()

    def row_fields(self, table, phase: str) -> dict:
        """``emu_*`` fields of the decode phase (:func:`fidelity_fields`) or ``emu_prefill_*`` of the prefill."""
        return prefill_fields(table) if phase == "prefill" else fidelity_fields(table, self.emu)

    @contextmanager
    def op(self, kind: str, rows: int, ctx: int = 0):
        modeled = self.emu.op_time(kind, rows, ctx)   # ctx before the op (a stage forward appends to its cache)
        if modeled is None:
            yield
            return
        t0 = time.perf_counter()
        yield
        self.emu.pad(t0, modeled)


class LinkSender:
    """Delivers ``comm.send`` messages when the modeled link would (FIFO per rank, non-blocking caller): the
    comm hands every send to it (``comm.link``), and it posts each with ``comm.post`` at its modeled time."""

    def __init__(self, emu: Emulator, comm) -> None:
        self.emu, self.comm = emu, comm
        self.post = comm.post
        self.link_free: dict[int, float] = {}
        self.queue: deque = deque()
        self.inflight = 0
        self.error: BaseException | None = None
        self.cv = threading.Condition()
        self.send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="flowspec-emu-link")
        self.thread.start()
        comm.link = self

    def send(self, dst: int, msg) -> None:
        from pipeline.messages import decode, encode
        if self.error is not None:
            raise self.error
        link = self.emu.profile.link_model(self.comm.rank, dst)
        now = time.perf_counter()
        scale = self.emu.scale
        start = max(now, self.link_free.get(dst, 0.0))
        done = start + link.transfer_s(link.message_bytes(msg, self.emu.hidden_size)) * scale
        self.link_free[dst] = done
        deliver = done + link.latency_s * scale
        self.emu._add("link_msgs")
        self.emu._add("link_modeled_s", deliver - now)
        with self.cv:
            if self.inflight == 0 and deliver <= now:
                with self.send_lock:
                    self.post(dst, msg)
                return
            # snapshot the tensors now: the caller may reuse them before the delayed send
            msg = decode(*encode(msg))
            self.inflight += 1
            self.queue.append((deliver, dst, msg))
            self.cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                deliver, dst, msg = self.queue.popleft()
            wait = deliver - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            late = time.perf_counter() - deliver
            if late > LATE_TOLERANCE_S:
                self.emu._add("link_late_msgs")
                self.emu._add("link_late_s", late)
            try:
                with self.send_lock:
                    self.post(dst, msg)
            except BaseException as e:  # surfaced on the caller's next send / flush
                self.error = e
            with self.cv:
                self.inflight -= 1
                self.cv.notify_all()

    def pad_fanout(self, msg, n: int) -> None:
        """Rank 0's broadcast to a TP group of ``n`` ranks (:meth:`Emulator.pad_fanout`)."""
        self.emu.pad_fanout(msg, n)

    def drain(self) -> None:
        """Wait until every queued message has been posted (the comm's ``flush`` then waits for the posts)."""
        with self.cv:
            while self.inflight and self.error is None:
                self.cv.wait(0.1)
        if self.error is not None:
            raise self.error


def install(comm, cfg, device: str = "cpu") -> Emulator | None:
    """Turn emulation on for this rank's links when ``cfg.emu.profile`` is set: the comm's link
    (``comm.link``, a :class:`LinkSender`) then holds the rank's :class:`Emulator`, which
    :func:`instrument_stage` / :func:`instrument_rank0` find there."""
    if not cfg.emu.profile:
        return None
    profile = with_link(load_profile(cfg.emu.profile), cfg.emu.bandwidth_mbps or None, None)
    emu = Emulator(profile, comm.rank, comm.world, cfg.emu.model_rank0,
                   cfg.emu.flag_threshold, device, cfg.emu.time_scale, cfg.emu.stage_cost_scale)
    # every comm.send (ring and direct decision links alike) goes through the link model; the link thread must get
    # the GIL soon after its wake-up time, not a 5 ms switch interval later
    sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
    emu.sender = LinkSender(emu, comm)
    return emu


def emulator_of(comm) -> Emulator | None:
    """The rank's emulator: its link's (:func:`install`), None when the testbed is off or the transport has no
    link (the in-process ring)."""
    link = getattr(comm, "link", None)
    return link.emu if isinstance(link, LinkSender) else None


def instrument_stage(worker, comm) -> None:
    """Stack the emulator's meter on a stage worker (:meth:`Emulator.install_stage`) when the testbed is on."""
    emu = emulator_of(comm)
    if emu is not None:
        emu.install_stage(worker)


def instrument_rank0(engine, comm) -> None:
    """Stack the emulator's meters on the engine and its drafter (:meth:`Emulator.install_rank0`) when on."""
    emu = emulator_of(comm)
    if emu is not None:
        emu.install_rank0(engine)


# -- fidelity summary ---------------------------------------------------------------------------------
def fidelity_fields(table, emu: Emulator) -> dict:
    """``emu_*`` row fields of the decode phase from every rank's counters (``table[rank]`` = :data:`COUNTERS`).

    ``emu_overrun_frac``: share of modeled compute ops whose real work took longer than modeled;
    ``emu_overrun_s``: seconds by which real work (compute) and deliveries (links) exceeded the model, all
    ranks; ``emu_overrun_ratio``: those seconds / all modeled seconds (compute + links, all ranks; None =
    infinite, e.g. the zero profile); ``emu_overrun_ratio_worst_rank``: the same for the worst rank alone;
    ``emu_flag``: ``emu_overrun_ratio`` exceeds ``emu.flag_threshold``. Seconds are dilated ones when
    ``emu.time_scale`` != 1.
    """
    rows = [list(map(float, r)) for r in table]
    idx = {n: i for i, n in enumerate(COUNTERS)}
    tot = [sum(r[i] for r in rows) for i in range(K)]
    per_rank_over = [r[idx["overrun_s"]] + r[idx["link_late_s"]] for r in rows]
    per_rank_model = [r[idx["modeled_s"]] + r[idx["link_modeled_s"]] for r in rows]
    def ratio(o, m):
        return o / m if m > 0 else (math.inf if o > 0 else 0.0)
    worst = max((ratio(o, m) for o, m in zip(per_rank_over, per_rank_model)), default=0.0)
    overall = ratio(sum(per_rank_over), sum(per_rank_model))
    ops = tot[idx["ops"]]
    return {
        "emu_profile": emu.profile.name,
        "emu_model_rank0": emu.model_rank0,
        "emu_time_scale": emu.scale,
        "emu_modeled_s": round(tot[idx["modeled_s"]], 6),
        "emu_link_modeled_s": round(tot[idx["link_modeled_s"]], 6),
        "emu_ops": int(ops),
        "emu_overrun_ops": int(tot[idx["overrun_ops"]]),
        "emu_overrun_frac": round(tot[idx["overrun_ops"]] / ops, 4) if ops else 0.0,
        "emu_overrun_s": round(tot[idx["overrun_s"]] + tot[idx["link_late_s"]], 6),
        "emu_link_late_msgs": int(tot[idx["link_late_msgs"]]),
        "emu_oversleep_s": round(tot[idx["oversleep_s"]], 6),
        "emu_overrun_s_per_rank": [round(v, 6) for v in per_rank_over],
        "emu_overrun_ratio": None if math.isinf(overall) else round(overall, 4),
        "emu_overrun_ratio_worst_rank": None if math.isinf(worst) else round(worst, 4),
        "emu_flag": bool(overall > emu.flag_threshold),
    }


def prefill_fields(table) -> dict:
    """Prefill-phase summary (prefill is not part of the decode throughput)."""
    idx = {n: i for i, n in enumerate(COUNTERS)}
    over = sum(r[idx["overrun_s"]] + r[idx["link_late_s"]] for r in table)
    model = sum(r[idx["modeled_s"]] + r[idx["link_modeled_s"]] for r in table)
    return {"emu_prefill_modeled_s": round(model, 6), "emu_prefill_overrun_s": round(over, 6)}
