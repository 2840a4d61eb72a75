"""How rank 0's host work is priced when a replay is timed: measured here, counted operators, or free.

Rank 0's host work is everything it runs between two modeled ops (tree building, top-k, verification walk,
decisions, re-rooting, segment packing): the ``("host", s[, ops, syncs])`` ops of its log (:mod:`.oplog`). Three
prices (``--rank0-cost``):

* ``measured`` (the default): ``s``, this CPU's thread time for that Python. Right when the predicted device's
  host runs Python as fast as this one and launches nothing; it cannot see a GPU's per-kernel launch cost or its
  synchronisations, and it carries this CPU's load.
* ``ops``: ``ops x op_us + syncs x sync_us``: the aten operators and host<->device synchronisations the replay
  counted in that interval (:class:`pipeline.tools.opcount.OpCounter` on rank 0's thread: counts are a
  deterministic function of the calls, the same on any device) times the predicted device's per-operator and
  per-sync costs (:class:`config.profiles.HostCost`: the profile's ``rank0_host``, a
  ``profiles/rank0_host/<profile name>.json`` file for profiles kept elsewhere, or ``--rank0-op-us`` /
  ``--rank0-sync-us``). Python that dispatches no operator (lists, dicts, message headers, and the NumPy host
  bookkeeping of the beam, the merged top-k and the re-root: issue 41; docs/results.md, §52 ("Fewer operators on
  the chain")) is priced at
  zero: the op count is a floor on that device's host work, exact only where every step is a tensor op; what
  that Python costs is in ``measured``.
* ``zero``: 0 (host work off the critical path; rank 0's lm_head and draft head are still priced by the
  profile: unlike ``--rank0-cost-scale 0``, which frees everything rank 0 runs).

Only rank 0's host work is repriced; the stages' host work stays measured (their model work is the profile's).
``--rank0-cost-scale`` multiplies the result like every other rank-0 op. Invariant: :func:`host_seconds` is a
pure function of the op and the pricing, so a prediction changes exactly when a count or a cost does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from config.errors import UserError
from config.paths import PROFILE_DIR
from config.profiles import EmulationError, HostCost, Profile

PRICINGS = ("measured", "ops", "zero")
HOST_COST_DIR = PROFILE_DIR / "rank0_host"   # <profile name>.json: rank0_host of profiles kept outside the repo


class PricingError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Rank0Pricing:
    """One way to price rank 0's host ops: ``mode`` in :data:`PRICINGS`; ``cost`` (``ops`` only) per op/sync."""

    mode: str = "measured"
    cost: HostCost | None = None

    def __post_init__(self) -> None:
        if self.mode not in PRICINGS:
            raise PricingError(f"--rank0-cost {self.mode!r}: choose one of {', '.join(PRICINGS)}")
        if self.mode == "ops" and self.cost is None:
            raise PricingError("--rank0-cost ops needs per-operator costs (a profile's rank0_host, "
                               "profiles/rank0_host/<profile>.json, or --rank0-op-us and --rank0-sync-us)")

    def label(self) -> str:
        """What every run prints and stores with its predictions (``rank0_cost``)."""
        if self.mode == "measured":
            return "measured (rank 0's host work at this CPU's thread time)"
        if self.mode == "zero":
            return "zero (rank 0's host work free; its lm_head and draft head as profiled)"
        c = self.cost
        return f"ops ({c.op_us:g} us/op, {c.sync_us:g} us/sync: {c.source})"


MEASURED = Rank0Pricing()


def host_seconds(op: tuple, pricing: Rank0Pricing) -> float:
    """Seconds of one ``("host", s[, ops, syncs])`` op under ``pricing`` (pure). ``ops`` pricing needs the
    counts (a replay run with ``count_ops``): a host op without them is an error, never silently measured."""
    if pricing.mode == "measured":
        return op[1]
    if pricing.mode == "zero":
        return 0.0
    if len(op) < 4:
        raise PricingError("rank 0's host ops carry no operator counts: replay with count_ops=True for "
                           "--rank0-cost ops")
    return op[2] * pricing.cost.op_us * 1e-6 + op[3] * pricing.cost.sync_us * 1e-6


def host_cost_for(profile: Profile, op_us: float | None = None, sync_us: float | None = None,
                  cost_dir: Path = HOST_COST_DIR) -> HostCost | None:
    """The per-op / per-sync cost for ``profile``: the flags (both, or one over the profile's), else the profile's
    own ``rank0_host``, else ``cost_dir/<profile.name>.json`` (profiles kept read-only elsewhere, e.g. measured
    on a lent GPU); None when none is known."""
    base = profile.rank0_host
    if base is None:
        f = cost_dir / f"{profile.name}.json"
        if f.is_file():
            import json
            try:
                raw = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise EmulationError(f"cannot read {f}: {e}") from None
            base = HostCost.parse(raw, f"{cost_dir.parent.name}/{cost_dir.name}/{f.name}")
    if op_us is None and sync_us is None:
        return base
    if base is None and (op_us is None or sync_us is None):
        raise PricingError(f"profile {profile.name} has no rank0_host: give both --rank0-op-us and --rank0-sync-us")
    return HostCost(op_us if op_us is not None else base.op_us, sync_us if sync_us is not None else base.sync_us,
                    "--rank0-op-us/--rank0-sync-us" + (f" over {base.source}" if base is not None else ""))


def resolve(mode: str, profile: Profile, op_us: float | None = None, sync_us: float | None = None) -> Rank0Pricing:
    """The pricing ``--rank0-cost mode`` asks for under ``profile`` (costs looked up by :func:`host_cost_for`)."""
    for v, name in ((op_us, "--rank0-op-us"), (sync_us, "--rank0-sync-us")):
        if v is not None and not v >= 0:
            raise PricingError(f"{name} {v} must be >= 0")
    if mode not in PRICINGS:
        raise PricingError(f"--rank0-cost {mode!r}: choose one of {', '.join(PRICINGS)}")
    return Rank0Pricing(mode, host_cost_for(profile, op_us, sync_us) if mode == "ops" else None)
