"""Emulated edge testbed: every stage step and every link hop takes the time a device profile models.

Off by default; ``emu.profile=<path or builtin name>`` turns it on (builtins are the JSON files in
``profiles/``, e.g. ``edge_orin_7b`` and ``zero``). The pipeline still computes everything for real, so
outputs stay exact; the emulation only *adds waiting*:

* **stage compute** (ranks 1..N, :meth:`Emulator.pad_stage`): after the real forward of a segment of ``w``
  rows over a KV cache of ``ctx`` slots, sleep until the modeled ``t_stage(w, ctx)`` has elapsed since the
  forward began. When the real work took longer than modeled, that is an *overrun* (counted, never hidden).
* **rank 0** (``emu.model_rank0=true`` and the profile has a ``rank0`` section): every draft-head forward and
  every ``lm_head`` application (target verification and draft log-probs) is padded the same way.
* **links** (:class:`LinkSender`): a message to rank ``d`` is handed to ``torch.distributed`` only when the
  modeled link would have delivered it: the link serialises messages (``bytes * 8 / bandwidth``) and adds
  ``latency_s``. A sender thread does the delayed ``isend``; sends on a link keep their order, and the caller
  never blocks (as with a real NIC). Rank 0's direct decision messages to stages 2..N take the same path
  over the modeled link ``0 -> r``.

Per-hop bytes follow the *modeled* deployment: a message carrying hidden states counts
``hidden_bytes_per_token`` per row (e.g. 4096 x 2 B for a 7B model in fp16) instead of the small model's real
payload; id/parent/keep-index tensors count their real bytes; every message adds ``header_bytes``.

Fidelity: each rank counts modeled ops, overruns and their seconds, link messages delivered later than
modeled, and sleep overshoot. Rank 0 gathers every rank's counters with ``Stats`` messages (one right after
prefill, untimed, one after decode) and :func:`fidelity_fields` / :func:`prefill_fields` turn them into the
``emu_*`` fields of an output row (decode phase; prefill overruns separately).

Time dilation (``emu.time_scale=s``): every modeled duration is multiplied by ``s``, so a host slower than
the modeled devices can still keep up (no overruns); throughput in modeled time is then ``s`` times the
measured one (``pipeline.eval`` reports it so). Unmodeled host work (Python, tree bookkeeping, message
encoding) is divided by ``s`` in that view, so keep ``s`` as small as the overruns allow.

The emulation hooks in without changing the transport: :func:`install` wraps the ``Comm`` instance's
``send``/``flush``; the stage worker calls :meth:`Emulator.pad_stage`; the engine calls
:meth:`Emulator.install_rank0` (which wraps the engine's ``logits`` and the drafter's ``logprobs`` and head).

Profile JSON (see ``profiles/README.md``)::

    {"name": ..., "description": ...,
     "stage":  COST,                      # default for every layer stage
     "stages": {"3": COST},               # optional per-rank overrides
     "rank0":  {"draft_forward": COST, "lm_head": COST},   # optional
     "link":   {"latency_s": 3e-4, "bandwidth_mbps": 150, "hidden_bytes_per_token": 8192, "header_bytes": 384},
     "links":  {"0->1": LINK}}            # optional per-hop overrides
    COST = {"model": "analytic", "weight_bytes", "kv_bytes_per_ctx", "mem_bw_Bps", "mem_efficiency",
            "flops_per_token", "attn_flops_per_token_ctx", "peak_flops", "compute_efficiency", "overhead_s"}
         | {"model": "table", "w": [...], "ctx": [...], "t_s": [[t for each ctx] for each w]}

Analytic: ``t = max(bytes / (mem_bw * mem_eff), flops / (peak * comp_eff)) + overhead_s`` with
``bytes = weight_bytes + kv_bytes_per_ctx * (ctx + w)`` and ``flops = w * flops_per_token +
attn_flops_per_token_ctx * w * (ctx + w)`` (a zero bandwidth or peak drops that term). Table: bilinear
interpolation over ``w`` and ``ctx``; below the smallest ``w`` the first row is used, beyond the table the
edge segments are extended linearly (never below zero).
"""
from __future__ import annotations

import bisect
import json
import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROFILE_DIR = REPO / "profiles"

# per-rank counters shipped in Stats.emu[rank]
COUNTERS = ("ops", "modeled_s", "overrun_ops", "overrun_s", "link_msgs", "link_modeled_s", "link_late_msgs",
            "link_late_s", "oversleep_s")
K = len(COUNTERS)
LATE_TOLERANCE_S = 5e-4   # a message handed over this much after its modeled delivery counts as late
_TEXT_KEYS = {"notes", "derivation", "description", "source"}


class EmulationError(ValueError):
    pass


# -- cost models ------------------------------------------------------------------------------------
def interp1(xs: list[float], ys: list[float], x: float, clamp_low: bool = False) -> float:
    """Piecewise-linear ``y(x)``; the edge segments extend beyond the table (``clamp_low``: hold below)."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0] and clamp_low:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    """Modeled seconds of one operation on ``w`` rows over ``ctx`` cached KV slots."""

    model: str = "analytic"
    weight_bytes: float = 0.0
    kv_bytes_per_ctx: float = 0.0
    mem_bw_Bps: float = 0.0
    mem_efficiency: float = 1.0
    flops_per_token: float = 0.0
    attn_flops_per_token_ctx: float = 0.0
    peak_flops: float = 0.0
    compute_efficiency: float = 1.0
    overhead_s: float = 0.0
    w: list = field(default_factory=list)
    ctx: list = field(default_factory=list)
    t_s: list = field(default_factory=list)

    def time(self, w: int, ctx: int = 0) -> float:
        if self.model == "table":
            row = [interp1(self.ctx, r, ctx) for r in self.t_s]
            return max(0.0, interp1(self.w, row, w, clamp_low=True))
        span = ctx + w
        t_mem = t_cmp = 0.0
        if self.mem_bw_Bps > 0:
            t_mem = (self.weight_bytes + self.kv_bytes_per_ctx * span) / (self.mem_bw_Bps * self.mem_efficiency)
        if self.peak_flops > 0:
            flops = w * self.flops_per_token + self.attn_flops_per_token_ctx * w * span
            t_cmp = flops / (self.peak_flops * self.compute_efficiency)
        return max(t_mem, t_cmp) + self.overhead_s

    @classmethod
    def parse(cls, raw: dict, where: str) -> "CostModel":
        if not isinstance(raw, dict):
            raise EmulationError(f"{where} must be an object")
        names = {f for f in cls.__dataclass_fields__}
        bad = [k for k in raw if k not in names and k not in _TEXT_KEYS and not k.startswith("_")]
        if bad:
            raise EmulationError(f"{where}: unknown keys {bad}; valid: {sorted(names)}")
        kw = {k: v for k, v in raw.items() if k in names}
        cm = cls(**kw)
        if cm.model not in ("analytic", "table"):
            raise EmulationError(f"{where}.model must be 'analytic' or 'table', not {cm.model!r}")
        if cm.model == "table":
            try:
                cm.w = [float(v) for v in cm.w]
                cm.ctx = [float(v) for v in cm.ctx] or [0.0]
                cm.t_s = [[float(v) for v in r] for r in cm.t_s]
            except (TypeError, ValueError):
                raise EmulationError(f"{where}: w, ctx and t_s must hold numbers") from None
            if not cm.w or len(cm.t_s) != len(cm.w) or any(len(r) != len(cm.ctx) for r in cm.t_s):
                raise EmulationError(f"{where}: t_s must be a {len(cm.w)} x {len(cm.ctx)} grid (one row per w)")
            for axis, name in ((cm.w, "w"), (cm.ctx, "ctx")):
                if any(b <= a for a, b in zip(axis, axis[1:])):
                    raise EmulationError(f"{where}.{name} must be strictly increasing")
            if any(v < 0 for r in cm.t_s for v in r):
                raise EmulationError(f"{where}.t_s must be >= 0")
        else:
            for k in ("weight_bytes", "kv_bytes_per_ctx", "mem_bw_Bps", "flops_per_token",
                      "attn_flops_per_token_ctx", "peak_flops", "overhead_s"):
                if not isinstance(getattr(cm, k), (int, float)) or getattr(cm, k) < 0:
                    raise EmulationError(f"{where}.{k} must be a number >= 0")
            for k in ("mem_efficiency", "compute_efficiency"):
                if not isinstance(getattr(cm, k), (int, float)) or not 0 < getattr(cm, k) <= 1:
                    raise EmulationError(f"{where}.{k} must be in (0, 1]")
        return cm


@dataclass
class LinkModel:
    latency_s: float = 0.0
    bandwidth_mbps: float | None = None     # None = unlimited
    hidden_bytes_per_token: float = 0.0     # 0 = count the real payload of hidden-state tensors
    header_bytes: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        if not self.bandwidth_mbps:
            return 0.0
        return nbytes * 8.0 / (self.bandwidth_mbps * 1e6)

    def message_bytes(self, msg) -> float:
        """Modeled bytes of a ring message (see the module docstring)."""
        if not self.hidden_bytes_per_token:
            return self.header_bytes + sum(t.numel() * t.element_size() for t in msg.tensors())
        rows, other = message_parts(msg)
        return self.header_bytes + rows * self.hidden_bytes_per_token + other

    @classmethod
    def parse(cls, raw: dict, where: str) -> "LinkModel":
        if not isinstance(raw, dict):
            raise EmulationError(f"{where} must be an object")
        names = set(cls.__dataclass_fields__)
        bad = [k for k in raw if k not in names and k not in _TEXT_KEYS and not k.startswith("_")]
        if bad:
            raise EmulationError(f"{where}: unknown keys {bad}; valid: {sorted(names)}")
        lm = cls(**{k: v for k, v in raw.items() if k in names})
        for k in ("latency_s", "hidden_bytes_per_token", "header_bytes"):
            if not isinstance(getattr(lm, k), (int, float)) or getattr(lm, k) < 0:
                raise EmulationError(f"{where}.{k} must be a number >= 0")
        if lm.bandwidth_mbps is not None and (not isinstance(lm.bandwidth_mbps, (int, float)) or lm.bandwidth_mbps <= 0):
            raise EmulationError(f"{where}.bandwidth_mbps must be > 0 (or null for unlimited)")
        return lm


@dataclass
class Profile:
    name: str
    description: str
    stage: CostModel
    stages: dict = field(default_factory=dict)        # rank -> CostModel
    draft_forward: CostModel | None = None
    lm_head: CostModel | None = None
    link: LinkModel = field(default_factory=LinkModel)
    links: dict = field(default_factory=dict)         # (src, dst) -> LinkModel
    path: str = ""

    def stage_model(self, rank: int) -> CostModel:
        return self.stages.get(rank, self.stage)

    def link_model(self, src: int, dst: int) -> LinkModel:
        return self.links.get((src, dst), self.link)

    @property
    def models_rank0(self) -> bool:
        return self.draft_forward is not None or self.lm_head is not None

    @classmethod
    def from_dict(cls, raw: dict, path: str = "") -> "Profile":
        where = path or "profile"
        if not isinstance(raw, dict):
            raise EmulationError(f"{where}: a profile is a JSON object")
        known = {"name", "description", "stage", "stages", "rank0", "link", "links", "measured"} | _TEXT_KEYS
        bad = [k for k in raw if k not in known and not k.startswith("_")]
        if bad:
            raise EmulationError(f"{where}: unknown keys {bad}; valid: {sorted(known)}")
        if "stage" not in raw:
            raise EmulationError(f"{where}: missing 'stage' (the layer-stage cost model)")
        stages = {}
        for k, v in (raw.get("stages") or {}).items():
            try:
                r = int(k)
            except ValueError:
                raise EmulationError(f"{where}: stages keys are ranks (1..N), not {k!r}") from None
            stages[r] = CostModel.parse(v, f"{where}.stages.{k}")
        r0 = raw.get("rank0") or {}
        bad = [k for k in r0 if k not in ("draft_forward", "lm_head") and k not in _TEXT_KEYS and not k.startswith("_")]
        if bad:
            raise EmulationError(f"{where}.rank0: unknown keys {bad}; valid: draft_forward, lm_head")
        links = {}
        for k, v in (raw.get("links") or {}).items():
            try:
                s, d = (int(p) for p in k.split("->"))
            except ValueError:
                raise EmulationError(f"{where}: links keys look like '0->1', not {k!r}") from None
            links[(s, d)] = LinkModel.parse(v, f"{where}.links.{k}")
        return cls(name=str(raw.get("name") or Path(path).stem or "profile"),
                   description=str(raw.get("description", "")),
                   stage=CostModel.parse(raw["stage"], f"{where}.stage"), stages=stages,
                   draft_forward=CostModel.parse(r0["draft_forward"], f"{where}.rank0.draft_forward")
                   if "draft_forward" in r0 else None,
                   lm_head=CostModel.parse(r0["lm_head"], f"{where}.rank0.lm_head") if "lm_head" in r0 else None,
                   link=LinkModel.parse(raw.get("link", {}), f"{where}.link"), links=links, path=path)


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json")) if PROFILE_DIR.is_dir() else []


def resolve_profile(spec: str) -> Path:
    p = Path(spec)
    if p.is_file():
        return p
    if "/" not in spec and not spec.endswith(".json") and (PROFILE_DIR / f"{spec}.json").is_file():
        return PROFILE_DIR / f"{spec}.json"
    raise EmulationError(f"emulation profile {spec!r} is neither a file nor a builtin profile "
                         f"(builtins: {', '.join(builtin_profiles()) or 'none'}; write one with python -m pipeline.profile)")


def load_profile(spec: str) -> Profile:
    path = resolve_profile(spec)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise EmulationError(f"cannot read emulation profile {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise EmulationError(f"emulation profile {path} is not valid JSON: {e}") from None
    return Profile.from_dict(raw, str(path))


# -- the per-rank emulator ----------------------------------------------------------------------------
class Emulator:
    """One rank's emulation state: padding, link delays and fidelity counters."""

    def __init__(self, profile: Profile, rank: int, world: int, model_rank0: bool = True,
                 flag_threshold: float = 0.05, device: str = "cpu", time_scale: float = 1.0) -> None:
        self.profile, self.rank, self.world = profile, rank, world
        self.scale = time_scale
        self.model_rank0 = model_rank0 and profile.models_rank0
        self.flag_threshold = flag_threshold
        self.cuda = str(device).startswith("cuda")
        self.counters = [0.0] * K
        self.lock = threading.Lock()
        self.sender: LinkSender | None = None

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
        return self.profile.stage_model(self.rank).time(w, ctx)

    def pad_stage(self, t0: float, w: int, ctx: int) -> None:
        self.pad(t0, self.stage_time(w, ctx))

    # installation
    def install_comm(self, comm) -> None:
        """Route ``comm.send`` (ring and direct decision links alike) through the link model."""
        # the link thread must get the GIL soon after its wake-up time, not a 5 ms switch interval later
        sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
        self.sender = LinkSender(self, comm)
        comm.emu = self

    def install_rank0(self, engine) -> None:
        """Pad rank 0's ``lm_head`` applications and draft-head forwards to the profile's rank0 models."""
        if not self.model_rank0:
            return
        emu, prof = self, self.profile
        if prof.lm_head is not None:
            orig_logits = engine.logits

            def logits(hidden):
                t0 = time.perf_counter()
                out = orig_logits(hidden)
                with engine.tracer.span("lm_head", emu_pad=True):
                    emu.pad(t0, prof.lm_head.time(hidden_rows(hidden), 0))
                return out
            engine.logits = logits
        drafter = engine.drafter
        if drafter is None:
            return
        if prof.lm_head is not None and hasattr(drafter, "logprobs"):
            orig_lp = drafter.logprobs

            def logprobs(hidden):
                t0 = time.perf_counter()
                out = orig_lp(hidden)
                emu.pad(t0, prof.lm_head.time(hidden_rows(hidden), 0))
                return out
            drafter.logprobs = logprobs
        head = getattr(drafter, "head", None)
        cache = getattr(drafter, "cache", None)
        if prof.draft_forward is not None and head is not None and cache is not None:
            orig_fwd = head.forward

            def forward(tokens, features, positions, mask, kv):
                ctx = kv.length
                t0 = time.perf_counter()
                out = orig_fwd(tokens, features, positions, mask, kv)
                emu.pad(t0, prof.draft_forward.time(int(tokens.shape[-1]), ctx))
                return out
            head.forward = forward


def message_parts(msg) -> tuple[int, int]:
    """(rows of hidden-state tensors ``[1, n, H]``, real bytes of every other tensor) of a ring message."""
    rows, other = 0, 0
    for t in msg.tensors():
        if t.is_floating_point() and t.dim() == 3:
            rows += int(t.shape[1])
        else:
            other += t.numel() * t.element_size()
    return rows, other


def hidden_rows(hidden) -> int:
    """Rows of a hidden-state tensor (``[H]``, ``[n, H]`` or ``[1, n, H]``): what an lm_head cost is charged on."""
    return 1 if hidden.dim() == 1 else int(hidden.reshape(-1, hidden.shape[-1]).shape[0])


class LinkSender:
    """Delivers ``comm.send`` messages when the modeled link would (FIFO per rank, non-blocking caller)."""

    def __init__(self, emu: Emulator, comm) -> None:
        self.emu, self.comm = emu, comm
        self.orig_send = comm.send
        self.orig_flush = comm.flush
        self.link_free: dict[int, float] = {}
        self.queue: deque = deque()
        self.inflight = 0
        self.error: BaseException | None = None
        self.cv = threading.Condition()
        self.send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="flowspec-emu-link")
        self.thread.start()
        comm.send = self.send
        comm.flush = self.flush

    def send(self, dst: int, msg) -> None:
        from pipeline.messages import decode, encode
        if self.error is not None:
            raise self.error
        link = self.emu.profile.link_model(self.comm.rank, dst)
        now = time.perf_counter()
        scale = self.emu.scale
        start = max(now, self.link_free.get(dst, 0.0))
        done = start + link.transfer_s(link.message_bytes(msg)) * scale
        self.link_free[dst] = done
        deliver = done + link.latency_s * scale
        self.emu._add("link_msgs")
        self.emu._add("link_modeled_s", deliver - now)
        with self.cv:
            if self.inflight == 0 and deliver <= now:
                with self.send_lock:
                    self.orig_send(dst, msg)
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
                    self.orig_send(dst, msg)
            except BaseException as e:  # surfaced on the caller's next send / flush
                self.error = e
            with self.cv:
                self.inflight -= 1
                self.cv.notify_all()

    def flush(self) -> None:
        with self.cv:
            while self.inflight and self.error is None:
                self.cv.wait(0.1)
        if self.error is not None:
            raise self.error
        self.orig_flush()


def install(comm, cfg, device: str = "cpu") -> Emulator | None:
    """Turn emulation on for this rank when ``cfg.emu.profile`` is set (``comm.emu`` is the emulator)."""
    comm.emu = None
    if not cfg.emu.profile:
        return None
    emu = Emulator(load_profile(cfg.emu.profile), comm.rank, comm.world, cfg.emu.model_rank0,
                   cfg.emu.flag_threshold, device, cfg.emu.time_scale)
    emu.install_comm(comm)
    return emu


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
