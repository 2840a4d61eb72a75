"""Device profiles of the emulated edge testbed: what a stage step, a rank-0 head forward and a link hop cost.

Pure data and cost models, read by the emulator (``pipeline/emulation.py``), the simulator, the segment-size
planner (``pipeline/budget.py``) and config validation; builtins are ``profiles/*.json``
(``emu.profile=edge_orin_7b``).

Profile JSON (see ``profiles/README.md``)::

    {"name": ..., "description": ...,
     "stage":  COST,                      # default for every layer stage
     "stages": {"3": COST},               # optional per-rank overrides
     "rank0":  {"draft_forward": COST, "lm_head": COST, "ssm_forward": COST},   # optional
     "link":   {"latency_s": 3e-4, "bandwidth_mbps": 150, "hidden_bytes_per_token": 8192, "header_bytes": 384},
     "links":  {"0->1": LINK},            # optional per-hop overrides
     "rank0_host": {"op_us": 20, "sync_us": 40, "derivation": "..."}}   # optional: rank 0's host work per
                                          # dispatched operator / host<->device sync (:class:`HostCost`)
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
from dataclasses import dataclass, field, replace
from pathlib import Path

from config.errors import UserError
from config.paths import PROFILE_DIR

_TEXT_KEYS = {"notes", "derivation", "description", "source"}


class EmulationError(UserError, ValueError):
    pass


def _check_keys(raw, where: str, names) -> None:
    """``raw`` must be a JSON object whose keys are ``names``, prose (:data:`_TEXT_KEYS`) or ``_``-prefixed notes."""
    if not isinstance(raw, dict):
        raise EmulationError(f"{where} must be an object")
    bad = [k for k in raw if k not in names and k not in _TEXT_KEYS and not k.startswith("_")]
    if bad:
        raise EmulationError(f"{where}: unknown keys {bad}; valid: {sorted(names)}")


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

    def time_share(self, w: int, share: float) -> float:
        """An ``lm_head`` applied to ``share`` of its vocabulary rows (a reduced draft vocabulary,
        :mod:`draft.vocab`) over ``w`` rows: weight bytes and per-token flops scale by ``share``, everything else
        (the fixed overhead) does not; a measured table has no such split, so its time is scaled by ``share`` as a
        whole (optimistic where the overhead dominates)."""
        if share >= 1.0:
            return self.time(w)
        if self.model == "table":
            return self.time(w) * share
        return replace(self, weight_bytes=self.weight_bytes * share,
                       flops_per_token=self.flops_per_token * share).time(w)

    @classmethod
    def parse(cls, raw: dict, where: str) -> "CostModel":
        names = set(cls.__dataclass_fields__)
        _check_keys(raw, where, names)
        cm = cls(**{k: v for k, v in raw.items() if k in names})
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

    def message_bytes(self, msg, hidden_size: int = 0) -> float:
        """Modeled bytes of a ring message (see the module docstring); ``hidden_size``: the real model's ``H``,
        so that EAGLE-3 tap columns count as hidden rows (:func:`message_parts`)."""
        if not self.hidden_bytes_per_token:
            return self.header_bytes + sum(t.numel() * t.element_size() for t in msg.tensors())
        rows, other = message_parts(msg, hidden_size)
        return self.header_bytes + rows * self.hidden_bytes_per_token + other

    @classmethod
    def parse(cls, raw: dict, where: str) -> "LinkModel":
        names = set(cls.__dataclass_fields__)
        _check_keys(raw, where, names)
        lm = cls(**{k: v for k, v in raw.items() if k in names})
        for k in ("latency_s", "hidden_bytes_per_token", "header_bytes"):
            if not isinstance(getattr(lm, k), (int, float)) or getattr(lm, k) < 0:
                raise EmulationError(f"{where}.{k} must be a number >= 0")
        if lm.bandwidth_mbps is not None and (not isinstance(lm.bandwidth_mbps, (int, float)) or lm.bandwidth_mbps <= 0):
            raise EmulationError(f"{where}.bandwidth_mbps must be > 0 (or null for unlimited)")
        return lm


@dataclass
class HostCost:
    """What rank 0's host work costs on the modeled device, per unit: ``op_us`` microseconds per dispatched aten
    operator (Python dispatch plus a kernel launch on a GPU) and ``sync_us`` per host<->device synchronisation
    (a ``.item()`` / ``.tolist()`` / device->host copy of a device value: the wait for the queue to drain, on top
    of the operator itself). The simulator's ``--rank0-cost ops`` prices rank 0's host work as the replay's
    counted operators and syncs times these (``pipeline/tools/simulate/pricing.py``); measure them with
    ``python -m pipeline.tools.profile --host-only``. ``source`` says where the numbers come from."""

    op_us: float
    sync_us: float
    source: str = ""

    @classmethod
    def parse(cls, raw: dict, where: str) -> "HostCost":
        known = ("op_us", "sync_us")
        _check_keys(raw, where, {*known, "measured"})
        for k in known:
            v = raw.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise EmulationError(f"{where}.{k} must be a number >= 0 (microseconds)")
        return cls(float(raw["op_us"]), float(raw["sync_us"]),
                   str(raw.get("source") or where))


@dataclass
class Profile:
    name: str
    description: str
    stage: CostModel
    stages: dict = field(default_factory=dict)        # rank -> CostModel
    draft_forward: CostModel | None = None
    lm_head: CostModel | None = None
    ssm_forward: CostModel | None = None            # a small draft LM's forward (draft.ssm), its lm_head apart
    link: LinkModel = field(default_factory=LinkModel)
    links: dict = field(default_factory=dict)         # (src, dst) -> LinkModel
    path: str = ""
    rank0_host: HostCost | None = None                # rank 0's host work per operator / sync (HostCost)

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
        _check_keys(raw, where, {"name", "description", "stage", "stages", "rank0", "link", "links", "measured",
                                 "rank0_host"})
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
        r0_keys = ("draft_forward", "lm_head", "ssm_forward")
        _check_keys(r0, f"{where}.rank0", r0_keys)
        rank0 = {k: CostModel.parse(r0[k], f"{where}.rank0.{k}") for k in r0_keys if k in r0}
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
                   **rank0,
                   link=LinkModel.parse(raw.get("link", {}), f"{where}.link"), links=links, path=path,
                   rank0_host=HostCost.parse(raw["rank0_host"], f"{where}.rank0_host") if "rank0_host" in raw
                   else None)


def with_link(profile: Profile, bandwidth: float | None, latency: float | None) -> Profile:
    """``profile`` with every link's bandwidth and/or latency replaced (``None``: keep the profile's)."""
    if bandwidth is None and latency is None:
        return profile
    def fix(l: LinkModel) -> LinkModel:
        return replace(l, bandwidth_mbps=bandwidth if bandwidth is not None else l.bandwidth_mbps,
                       latency_s=latency if latency is not None else l.latency_s)
    return replace(profile, link=fix(profile.link), links={k: fix(v) for k, v in profile.links.items()})


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json")) if PROFILE_DIR.is_dir() else []


def resolve_profile(spec: str) -> Path:
    p = Path(spec)
    if p.is_file():
        return p
    if "/" not in spec and not spec.endswith(".json") and (PROFILE_DIR / f"{spec}.json").is_file():
        return PROFILE_DIR / f"{spec}.json"
    raise EmulationError(f"emulation profile {spec!r} is neither a file nor a builtin profile "
                         f"(builtins: {', '.join(builtin_profiles()) or 'none'}; write one with python -m pipeline.tools.profile)")


def load_profile(spec: str) -> Profile:
    path = resolve_profile(spec)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise EmulationError(f"cannot read emulation profile {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise EmulationError(f"emulation profile {path} is not valid JSON: {e}") from None
    return Profile.from_dict(raw, str(path))


def message_parts(msg, hidden_size: int = 0) -> tuple[int, int]:
    """(rows of hidden-state tensors ``[1, n, W]``, real bytes of every other tensor) of a ring message.
    With ``hidden_size`` (the real model's ``H``), a row ``W = k * H`` wide counts ``k`` rows: the hidden state
    plus the EAGLE-3 tapped features riding along (:meth:`model.stage_model.StageModel.set_taps`) each cost a
    hidden row on the modeled wire too."""
    rows, other = 0, 0
    for t in msg.tensors():
        if t.is_floating_point() and t.dim() == 3:
            width = int(t.shape[2])
            k = width // hidden_size if hidden_size and width > hidden_size and width % hidden_size == 0 else 1
            rows += int(t.shape[1]) * k
        else:
            other += t.numel() * t.element_size()
    return rows, other


# -- a tensor-parallel group as one stage (modes tp / galaxy: pipeline/tools/tp_sim.py, pipeline/emulation.py) ----
def shard_cost(stage: CostModel, profile_stages: int, n: int) -> CostModel:
    """One TP rank's compute: every layer of the model (``profile_stages`` stages' worth) at ``1/n`` width."""
    k = profile_stages / n
    if stage.model == "table":
        return replace(stage, t_s=[[v * k for v in row] for row in stage.t_s])
    return replace(stage, weight_bytes=stage.weight_bytes * k, kv_bytes_per_ctx=stage.kv_bytes_per_ctx * k,
                   flops_per_token=stage.flops_per_token * k,
                   attn_flops_per_token_ctx=stage.attn_flops_per_token_ctx * k,
                   overhead_s=stage.overhead_s * profile_stages)


@dataclass
class GroupCost:
    """Modeled seconds of one forward of the whole TP group (the ``stage`` of the one-stage replay)."""

    shard: CostModel
    n: int
    layers: int
    link: LinkModel
    hidden_bytes: float      # bytes per hidden row on the wire
    schedule: str            # "megatron" (mode tp) | "galaxy"

    def _xfer(self, nbytes: float) -> float:
        return self.link.latency_s + self.link.transfer_s(nbytes)

    def parts(self, w: int, ctx: int) -> tuple[float, float]:
        """``(compute seconds, exposed communication seconds)`` of one forward."""
        n, L, h = self.n, self.layers, self.hidden_bytes
        if n == 1:
            return self.shard.time(w, ctx), 0.0
        if self.schedule == "megatron":
            all_reduce = 2 * (n - 1) * self._xfer(w * h / n)
            return self.shard.time(w, ctx), (2 * L + 1) * all_reduce
        s = -(-w // n)
        k = self.shard.time(s, ctx) / (4 * L)
        step = self._xfer(s * h)
        phase = k + (n - 1) * max(k, step)
        compute = 4 * L * n * k
        total = 4 * L * phase + 2 * (n - 1) * step
        return compute, total - compute

    def time(self, w: int, ctx: int = 0) -> float:
        c, m = self.parts(w, ctx)
        return c + m
