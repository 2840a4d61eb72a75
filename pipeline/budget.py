"""Cost-aware trees: how many draft nodes to send per pipeline step, and how much to draft per step.

Pure functions and small dataclasses (no ``torch.distributed``, no model code). The FlowSpec step loop
(``mode=continuous``) asks two questions every step; this module answers them from costs, which come from an
emulation profile (:meth:`StepCosts.from_profile`) or from timings measured on the fly
(:meth:`StepCosts.from_measurements`, :class:`OnlineCosts`).

The steady-state model
----------------------
Ranks 1..N (the verification stages) and rank 0 form a ring; ``in_flight`` segments (default ``N + 1``, one
per ring link, as the fill sends them) circulate in it. When every segment carries ``w`` tree nodes, one
pipeline step -- the time between two segments returning to rank 0 -- lasts

    period(w) = max( stage_time(w, ctx),                      # the slowest stage computes one segment
                     link_busy(w),                             # the busiest link carries one segment
                     verify_time(w) + draft_s + overhead,      # rank 0: lm_head on w rows, drafting, bookkeeping
                     round_trip(w) / in_flight )               # one segment's loop, shared by in_flight segments
    round_trip(w) = ring_time(w) + verify_time(w) + overhead   # N stage steps + N+1 hops + rank 0's receive->send

Every resource handles one segment per step, so the slowest one sets the step (the first three terms); and a
segment cannot come back faster than its own loop, which ``in_flight`` segments share (the last term).
Drafting is not in ``round_trip``: rank 0 sends the next segment first and drafts while the stages compute.
``link_busy`` is the transfer time alone (latency does not occupy the link); ``hop_time`` adds the latency.

The rule (segment size)
-----------------------
A waiting node is worth its **path probability under the draft**, ``p = exp(score)`` (``score`` = cumulative
draft log-prob from the root): if the draft is calibrated, that is the chance the target accepts the node's whole
path, so a segment's expected accepted draft tokens are the sum of its nodes' ``p`` (linearity of expectation).
Every verified segment also yields one token from the target itself (``bonus``, the token after the accepted
path). Sending ``w`` nodes therefore yields ``V(w) = bonus + p_1 + ... + p_w`` expected tokens per step and
costs ``period(w)`` seconds of the bottleneck, and :func:`choose_segment_size` sends the prefix of the waiting
nodes (in send order; ancestors first, so every prefix is sendable) that maximises the throughput

    rate(w) = V(w) / period(w)        over 1 <= w <= min(waiting, max_size).

At the chosen ``w`` the last node pays for the time it adds at the rate achieved,
``p_w >= rate(w) * (period(w) - period(w - 1))`` (the same inequality as ``rate(w) >= rate(w - 1)``). A node
whose row is free on the bottleneck (flat stage cost, link not limiting) is sent whenever ``p > 0``; a
zero-probability node is never worth a positive extra time.

Edge cases: nothing waiting -> 0; never more than what waits (nor ``max_size``); at least 1 when something waits
(an empty segment idles the ring for a whole step while a one-node segment still returns the bonus token);
ties go to the smaller segment (a node that adds no rate is not sent).

Properties (tested in ``tests/test_budget.py``):
  * a steeper per-row cost never increases ``w`` when it steepens the step as a whole: an extra ``delta * w``
    on whichever resource binds, or a larger slope of the one affine resource that binds at every size.
    (Proof sketch: ``w2 > w1`` wins iff ``V(w2) / V(w1) >= period(w2) / period(w1)``; those changes only raise
    the right side, because ``period(w) / w`` never increases for a max of affine costs with ``a >= 0``.)
    Steepening one resource that binds only at some sizes can raise ``w``, because it changes which resource
    binds. Example (a test): one stage, stage ``10 + 1 w`` ms, hops ``3 w`` ms, rank 0 free, probabilities
    ``0.9, 0.7, 0.7, 0.4, 0.1, 0.1`` -> 2 nodes; with the stage at ``10 + 2 w`` ms the stage binds at 2 rows
    (14 ms instead of 12) but the loop still binds at 3 rows (17 ms instead of 15.5), so 3 rows now win;
  * raising the probabilities by factors that do not decrease along the send order (a uniform scale, or a
    higher per-level acceptance ``alpha`` when ``p = alpha ** depth`` and nodes go out shallow first) never
    decreases ``w``. An increase concentrated on the *first* nodes can decrease ``w``: it raises the rate
    that every further node has to pay for (the optimum is a rate, not a total).

The rule (expansion)
--------------------
Rank 0 drafts while the stages compute, so its drafting must fit in the time the rest of the ring takes per
step: ``budget = ring_period(w) - verify_time(w) - overhead`` (``ring_period`` = ``period`` without rank 0's
term). One EAGLE expansion of ``depth`` levels with beam width ``top_k`` (``Drafter.grow_tree``) costs
``expansion_time = draft_level_time(1) + depth * draft_level_time(top_k)`` (the commit of the accepted tokens
plus the root's log-probs, then one head forward and one lm_head call on ``top_k`` rows per level). With a
measured per-level acceptance ``alpha`` (the chance the target accepts the next draft token given the path so
far), a tree level ``L`` is reached with probability ``alpha ** L``; levels are worth drafting while that is at
least ``min_value``, so the useful number of levels is ``floor(log(min_value) / log(alpha))`` (deeper when
acceptance is high), clamped to ``[1, max_depth + 1]``. :func:`choose_expansion` takes the useful depth with
the widest beam (``top_k <= max_top_k``) that fits the budget; if even the narrowest beam cannot reach it, the
deepest affordable tree (at least one level, so the tree keeps growing). ``total_nodes`` keeps the best
``top_k + depth * top_k**2`` candidates, capped at what the ring can take before the next re-root
(``in_flight * w``), plus the root.

For incremental expansion (growing the kept frontier instead of re-drafting from the root), ``depth`` is the
number of levels added per step; the frontier keeps its lookahead when that matches the expected advance of
the root per step, ``1 + alpha / (1 - alpha)`` tokens for a deep tree (:meth:`AcceptanceStats.alpha_from_tau`).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Sequence

KINDS = ("stage", "hop", "draft_level", "verify")
MIN_PERIOD_S = 1e-9   # floor of a step's time: with all-zero costs every node is free and rates stay finite


# -- affine fits ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Affine:
    """``t(x) = a + b * x`` seconds (``a, b >= 0``); ``x`` = rows of the operation."""

    a: float
    b: float

    def __call__(self, x: float, ctx: int = 0) -> float:   # ctx accepted (and ignored) to serve as a stage time
        return self.a + self.b * x


def _check_points(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float]) -> None:
    if not xs:
        raise ValueError("no observations to fit")
    if not (len(xs) == len(ys) == len(weights)):
        raise ValueError("xs, ys and weights must have the same length")
    for x, y, wt in zip(xs, ys, weights):
        if not (math.isfinite(x) and math.isfinite(y) and math.isfinite(wt)) or x < 0 or y < 0 or wt < 0:
            raise ValueError(f"observation (rows={x}, seconds={y}, weight={wt}) must be finite and >= 0")
    if sum(weights) <= 0:
        raise ValueError("observation weights sum to zero")


def _weighted_affine(xs, ys, ws, prior_slope: float | None) -> Affine:
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    vx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs)) / sw
    if vx <= 1e-12 * max(1.0, mx * mx):          # one distinct row count: the slope is not identified
        b = max(0.0, prior_slope or 0.0)
    else:
        b = max(0.0, sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sw / vx)
    a = my - b * mx
    if a < 0:                                    # refit through the origin (still b >= 0: x, y >= 0)
        sxx = sum(w * x * x for w, x in zip(ws, xs))
        a, b = 0.0, (sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sxx if sxx > 0 else 0.0)
    return Affine(a, b)


def fit_affine(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None,
               prior_slope: float | None = None, robust: bool = True, iterations: int = 5) -> Affine:
    """Fit ``seconds = a + b * rows`` with ``a, b >= 0`` to observed ``(rows, seconds)`` pairs.

    Weighted least squares, the slope clamped at 0 (a negative slope is noise: more rows never cost less) and,
    when the intercept would be negative, a fit through the origin. With ``robust`` a few rounds of Huber
    re-weighting (threshold 1.345 robust standard deviations, scale from the median absolute residual) keep
    rare long stalls (GC pauses, a busy core) from dragging the line. With a single distinct row count the
    slope is not identified: ``prior_slope`` (or 0) is used and ``a`` fits the mean.
    """
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    ws = [1.0] * len(xs) if weights is None else [float(w) for w in weights]
    _check_points(xs, ys, ws)
    fit = _weighted_affine(xs, ys, ws, prior_slope)
    if not robust or len(xs) < 3:
        return fit
    for _ in range(iterations):
        res = [y - fit(x) for x, y in zip(xs, ys)]
        scale = 1.4826 * sorted(abs(r) for r in res)[len(res) // 2]
        if scale <= 0:
            break
        k = 1.345 * scale
        hub = [w * (1.0 if abs(r) <= k else k / abs(r)) for w, r in zip(ws, res)]
        new = _weighted_affine(xs, ys, hub, prior_slope)
        if abs(new.a - fit.a) <= 1e-12 + 1e-9 * abs(fit.a) and abs(new.b - fit.b) <= 1e-12 + 1e-9 * abs(fit.b):
            return new
        fit = new
    return fit


class OnlineCosts:
    """Costs measured on the fly: recent observations per operation, exponentially weighted by age.

    ``observe(kind, rows, seconds)`` records one timing (``kind`` in :data:`KINDS`: ``stage`` = one stage's
    forward of a segment, ``hop`` = one link hop send -> receive, ``draft_level`` = one draft-head forward plus
    its lm_head call at ``rows`` beam rows, ``verify`` = the target lm_head at ``rows`` rows). The newest
    ``window`` observations of a kind are kept; an observation ``age`` observations old weighs
    ``0.5 ** (age / half_life)`` (an exponential moving average of the fit), and :func:`fit_affine` (robust) turns
    them into ``a + b * rows``. ``prior`` (e.g. :meth:`StepCosts.from_profile`) answers for kinds not observed
    yet and supplies the slope while every observation has the same row count.
    """

    def __init__(self, n_stages: int, half_life: float = 32.0, window: int = 128, prior: "StepCosts | None" = None,
                 rank0_overhead_s: float = 0.0) -> None:
        if n_stages < 1:
            raise ValueError(f"n_stages={n_stages} must be >= 1")
        if not half_life > 0 or window < 1:
            raise ValueError("half_life must be > 0 and window >= 1")
        self.n_stages, self.half_life, self.prior = n_stages, float(half_life), prior
        self.rank0_overhead_s = rank0_overhead_s
        self.obs: dict[str, deque] = {k: deque(maxlen=window) for k in KINDS}

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        if kind not in self.obs:
            raise ValueError(f"unknown cost kind {kind!r}; valid: {', '.join(KINDS)}")
        if not (math.isfinite(seconds) and seconds >= 0 and rows >= 0):
            raise ValueError(f"observation rows={rows} seconds={seconds} must be finite and >= 0")
        self.obs[kind].append((float(rows), float(seconds)))

    def count(self, kind: str) -> int:
        return len(self.obs[kind])

    def _prior_fn(self, kind: str) -> Callable[[float], float] | None:
        p = self.prior
        if p is None:
            return None
        return {"stage": lambda w: p.stage_time(w, p.ctx), "hop": p.hop_time,
                "draft_level": p.draft_level_time, "verify": p.verify_time}[kind]

    def fit(self, kind: str) -> Affine:
        """Current ``a + b * rows`` of ``kind`` (raises ``ValueError`` if never observed and no prior)."""
        pts = list(self.obs[kind])
        prior = self._prior_fn(kind)
        if not pts:
            if prior is None:
                raise ValueError(f"no {kind} timings observed yet and no prior costs")
            return Affine(prior(0), max(0.0, prior(64) - prior(0)) / 64)  # the prior's chord over 0..64 rows
        n = len(pts)
        weights = [0.5 ** ((n - 1 - i) / self.half_life) for i in range(n)]
        slope = None
        if prior is not None:
            x0 = sum(x for x, _ in pts) / n
            slope = max(0.0, (prior(x0 + 8) - prior(max(0.0, x0 - 8))) / (x0 + 8 - max(0.0, x0 - 8)))
        return fit_affine([x for x, _ in pts], [y for _, y in pts], weights, prior_slope=slope)

    def costs(self, ctx: int = 0) -> "StepCosts":
        """A :class:`StepCosts` from the current fits (the stage fit ignores ``ctx``: it tracks it by forgetting)."""
        f = {k: self.fit(k) for k in KINDS}
        return StepCosts.from_measurements(f["stage"], f["hop"], f["draft_level"], f["verify"], self.n_stages,
                                           ctx=ctx, rank0_overhead_s=self.rank0_overhead_s)


# -- the cost record --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCosts:
    """Seconds of every operation of one pipeline step, as functions of the rows they handle.

    ``stage_time(w, ctx)``: the slowest verification stage's forward of a ``w``-row segment over ``ctx`` cached
    slots. ``hop_time(w)``: the slowest ring hop for a ``w``-row segment, transfer plus latency.
    ``link_busy(w)``: how long the busiest link is occupied by one segment (transfer only; default
    ``hop_time``). ``ring_time(w, ctx)``: one segment's way through all N stages and N+1 hops (default
    ``N * stage_time + (N + 1) * hop_time``). Rank 0: ``draft_level_time(k)`` = one draft-head forward plus one
    draft lm_head call at ``k`` rows; ``verify_time(w)`` = the target lm_head at ``w`` rows;
    ``rank0_overhead_s`` = unmodeled bookkeeping per step (tree walk, pruning, message encoding).
    """

    n_stages: int
    stage_time: Callable[[int, int], float]
    hop_time: Callable[[int], float]
    draft_level_time: Callable[[int], float]
    verify_time: Callable[[int], float]
    ctx: int = 0
    link_busy: Callable[[int], float] | None = None
    ring_time: Callable[[int, int], float] | None = None
    rank0_overhead_s: float = 0.0
    source: str = ""
    _memo: dict = field(default_factory=dict, repr=False, compare=False)   # (what, w, ...) -> seconds

    def __post_init__(self) -> None:
        if self.n_stages < 1:
            raise ValueError(f"n_stages={self.n_stages} must be >= 1")
        if self.rank0_overhead_s < 0:
            raise ValueError("rank0_overhead_s must be >= 0")

    # -- derived times ----------------------------------------------------------------------------------
    def in_flight_default(self) -> int:
        return self.n_stages + 1

    def busy_link(self, w: int) -> float:
        return (self.link_busy or self.hop_time)(w)

    def loop_time(self, w: int, ctx: int | None = None) -> float:
        """``round_trip(w)``: stages and hops (``ring_time``) plus rank 0 from receiving to sending."""
        c = self.ctx if ctx is None else ctx
        ring = (self.ring_time(w, c) if self.ring_time is not None
                else self.n_stages * self.stage_time(w, c) + (self.n_stages + 1) * self.hop_time(w))
        return ring + self.verify_time(w) + self.rank0_overhead_s

    def ring_period(self, w: int, in_flight: int | None = None, ctx: int | None = None) -> float:
        """Step time that everything but rank 0's busy time imposes (see the module docstring). Memoised per
        ``(w, in_flight, ctx)``: the cost callables must not change once a ``StepCosts`` is built."""
        c = self.ctx if ctx is None else ctx
        k = in_flight or self.in_flight_default()
        key = ("ring", w, k, c)
        t = self._memo.get(key)
        if t is None:
            if len(self._memo) > 8192:        # a caller passing a growing ctx: keep the memo bounded
                self._memo.clear()
            t = self._memo[key] = max(self.stage_time(w, c), self.busy_link(w), self.loop_time(w, c) / k)
        return t

    def rank0_time(self, w: int, draft_s: float = 0.0) -> float:
        key = ("verify", w)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self.verify_time(w)
        return t + draft_s + self.rank0_overhead_s

    def period(self, w: int, draft_s: float = 0.0, in_flight: int | None = None, ctx: int | None = None) -> float:
        """Seconds per pipeline step when every segment carries ``w`` nodes and rank 0 drafts ``draft_s``
        (at least :data:`MIN_PERIOD_S`)."""
        return max(self.ring_period(w, in_flight, ctx), self.rank0_time(w, draft_s), MIN_PERIOD_S)

    def draft_budget(self, w: int, in_flight: int | None = None, ctx: int | None = None) -> float:
        """Seconds rank 0 can draft per step while the stages compute a ``w``-row segment: the step the ring
        imposes less the verification and the bookkeeping (the module docstring's expansion rule)."""
        return self.ring_period(w, in_flight, ctx) - self.verify_time(w) - self.rank0_overhead_s

    def expansion_time(self, depth: int, top_k: int) -> float:
        """Rank 0's drafting per step: commit + root log-probs, then ``depth`` levels of ``top_k`` rows."""
        return self.draft_level_time(1) + depth * self.draft_level_time(top_k)

    # -- constructors -------------------------------------------------------------------------------------
    @classmethod
    def from_profile(cls, profile, world: int, ctx: int = 0, hidden_bytes_per_token: float | None = None,
                     rank0_overhead_s: float = 0.0) -> "StepCosts":
        """Costs of a ``world``-rank ring (rank 0 + ``world - 1`` stages) under a ``config.profiles.Profile``.

        Bytes per hop follow the emulation's accounting: the 0->1 hop carries token ids and parents (two int64
        per row), every other hop hidden states (``hidden_bytes_per_token`` per row, from the profile's link
        unless given) plus the parents; each message adds ``header_bytes``. Pruning keep-lists riding on
        segments are left out (a few int64s). Without a ``rank0`` section rank 0's operations cost nothing.
        """
        if world < 2:
            raise ValueError(f"world={world} must be >= 2 (rank 0 and at least one stage)")
        if ctx < 0:
            raise ValueError(f"ctx={ctx} must be >= 0")
        n = world - 1
        stages = [profile.stage_model(r) for r in range(1, world)]
        links = [(s, (s + 1) % world, profile.link_model(s, (s + 1) % world)) for s in range(world)]
        for s, d, lm in links:
            if s != 0 and not (hidden_bytes_per_token or lm.hidden_bytes_per_token):
                raise ValueError(f"link {s}->{d} of profile {profile.name!r} counts real payload bytes "
                                 "(hidden_bytes_per_token = 0): pass hidden_bytes_per_token (CLI: --hidden-bytes)")

        def row_bytes(src: int, lm) -> float:
            return 16.0 if src == 0 else (hidden_bytes_per_token or lm.hidden_bytes_per_token) + 8.0

        def transfer(src: int, lm, w: int) -> float:
            return lm.transfer_s(lm.header_bytes + w * row_bytes(src, lm))

        def stage_time(w: int, c: int) -> float:
            return max(m.time(w, c) for m in stages)

        def hop_time(w: int) -> float:
            return max(transfer(s, lm, w) + lm.latency_s for s, _, lm in links)

        def link_busy(w: int) -> float:
            return max(transfer(s, lm, w) for s, _, lm in links)

        def ring_time(w: int, c: int) -> float:
            return sum(m.time(w, c) for m in stages) + sum(transfer(s, lm, w) + lm.latency_s for s, _, lm in links)

        head, lmh = profile.draft_forward, profile.lm_head

        def draft_level_time(k: int) -> float:
            return (head.time(k, ctx) if head else 0.0) + (lmh.time(k) if lmh else 0.0)

        def verify_time(w: int) -> float:
            return lmh.time(w) if lmh else 0.0

        return cls(n, stage_time, hop_time, draft_level_time, verify_time, ctx=ctx, link_busy=link_busy,
                   ring_time=ring_time, rank0_overhead_s=rank0_overhead_s, source=f"profile {profile.name}")

    @classmethod
    def from_measurements(cls, stage, hop, draft_level, verify, n_stages: int, ctx: int = 0,
                          rank0_overhead_s: float = 0.0) -> "StepCosts":
        """Costs from timings: each of ``stage``, ``hop``, ``draft_level``, ``verify`` is a list of observed
        ``(rows, seconds)`` pairs (fitted with :func:`fit_affine`) or an :class:`Affine` already fitted.

        Measured hops include latency and are all charged as link occupancy (``link_busy = hop_time``, the
        conservative choice); measured stage times do not depend on ``ctx`` (refit as the context grows,
        :class:`OnlineCosts` does that by forgetting old observations).
        """
        def as_affine(obs, name: str) -> Affine:
            if isinstance(obs, Affine):
                return obs
            pts = list(obs)
            if not pts:
                raise ValueError(f"no {name} observations")
            try:
                xs, ys = zip(*pts)
            except (TypeError, ValueError):
                raise ValueError(f"{name} observations must be (rows, seconds) pairs") from None
            return fit_affine(xs, ys)

        st, hp = as_affine(stage, "stage"), as_affine(hop, "hop")
        dl, vf = as_affine(draft_level, "draft_level"), as_affine(verify, "verify")
        return cls(n_stages, st, hp, dl, vf, ctx=ctx, rank0_overhead_s=rank0_overhead_s, source="measured")


# -- the choices ------------------------------------------------------------------------------------
def path_probs(scores: Iterable[float]) -> list[float]:
    """``exp(score)`` of cumulative draft log-probs (``DraftTree.scores``): each node's value."""
    vals = scores.tolist() if hasattr(scores, "tolist") else list(scores)
    return [math.exp(min(0.0, float(s))) for s in vals]


def _as_probs(probs: Iterable[float]) -> list[float]:
    vals = probs.tolist() if hasattr(probs, "tolist") else list(probs)
    out = [float(p) for p in vals]
    for p in out:
        if not (0.0 <= p <= 1.0):
            raise ValueError(f"path probabilities must lie in [0, 1], got {p}")
    return out


def expected_rate(w: int, probs: Sequence[float], costs: StepCosts, draft_s: float = 0.0,
                  in_flight: int | None = None, bonus: float = 1.0, ctx: int | None = None) -> float:
    """Expected tokens per second when each step sends the first ``w`` of ``probs`` (0 for ``w == 0``)."""
    if w <= 0:
        return 0.0
    return (bonus + sum(probs[:w])) / costs.period(w, draft_s, in_flight, ctx)


def choose_segment_size(path_probs_in_send_order: Iterable[float], costs: StepCosts, draft_s: float = 0.0,
                        in_flight: int | None = None, max_size: int | None = None, bonus: float = 1.0,
                        ctx: int | None = None) -> int:
    """How many of the waiting nodes to send this step: ``argmax_w V(w) / period(w)`` (module docstring).

    ``path_probs_in_send_order``: ``exp(score)`` of each waiting node in the order they would be sent.
    ``draft_s``: rank 0's drafting time per step (it counts if rank 0 is the bottleneck). Returns 0 iff nothing
    waits, else ``1 <= w <= min(waiting, max_size)``; ties go to the smaller ``w``.
    """
    probs = _as_probs(path_probs_in_send_order)
    if bonus < 0 or draft_s < 0:
        raise ValueError("bonus and draft_s must be >= 0")
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size={max_size} must be >= 1 (or None)")
    limit = len(probs) if max_size is None else min(len(probs), max_size)
    if limit == 0:
        return 0
    best_w, best_rate, value = 1, -1.0, bonus
    for w in range(1, limit + 1):
        value += probs[w - 1]
        rate = value / costs.period(w, draft_s, in_flight, ctx)
        if rate > best_rate * (1.0 + 1e-12):
            best_w, best_rate = w, rate
    return best_w


class Expansion(NamedTuple):
    total_nodes: int   # Drafter.grow_tree(total_token=...): nodes kept, root included
    depth: int         # grow_tree(depth=...): expansions after the first level (the tree has depth + 1 levels)
    top_k: int         # grow_tree(top_k=...): beam width


@dataclass
class AcceptanceStats:
    """Per-level acceptance ``alpha``, measured: every verified draft token is a success, the level where the
    target disagreed with every verified child a failure (``record(accepted, rejected)``). A path that stopped
    only because its children were not verified yet is censored (``rejected=False``: no failure). Counts decay
    with ``half_life`` steps (an exponential moving average); ``prior_alpha`` with ``prior_weight`` pseudo-trials
    answers before enough steps are seen.
    """

    half_life: float = 32.0
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    successes: float = 0.0
    trials: float = 0.0
    steps: int = field(default=0)

    def record(self, accepted: int, rejected: bool = True) -> None:
        if accepted < 0:
            raise ValueError(f"accepted={accepted} must be >= 0")
        decay = 0.5 ** (1.0 / self.half_life)
        self.successes = self.successes * decay + accepted
        self.trials = self.trials * decay + accepted + (1 if rejected else 0)
        self.steps += 1

    @property
    def alpha(self) -> float:
        return ((self.successes + self.prior_alpha * self.prior_weight)
                / (self.trials + self.prior_weight))

    @staticmethod
    def alpha_from_tau(tau: float) -> float:
        """``alpha`` of a geometric acceptance with mean ``tau`` accepted draft tokens per verification
        (unbounded tree): ``tau = alpha / (1 - alpha)``."""
        if tau < 0:
            raise ValueError(f"tau={tau} must be >= 0")
        return tau / (1.0 + tau)


def useful_levels(alpha: float, min_value: float, max_levels: int) -> int:
    """Tree levels worth drafting: the deepest ``L`` with ``alpha ** L >= min_value``, in ``[1, max_levels]``."""
    if not 0.0 < min_value < 1.0:
        raise ValueError(f"min_value={min_value} must be in (0, 1)")
    if alpha >= 1.0:
        return max_levels
    if alpha <= 0.0:
        return 1
    return max(1, min(max_levels, int(math.floor(math.log(min_value) / math.log(alpha) + 1e-9))))


def choose_expansion(costs: StepCosts, acceptance: "AcceptanceStats | float", segment_size: int,
                     in_flight: int | None = None, max_depth: int = 8, max_top_k: int = 10,
                     min_value: float = 0.05, max_nodes: int | None = None, ctx: int | None = None) -> Expansion:
    """How much rank 0 drafts per step so that drafting fits in one ring step (module docstring).

    ``acceptance``: :class:`AcceptanceStats` or a per-level acceptance ``alpha`` in [0, 1]. ``segment_size``: the
    nodes per segment (e.g. the last :func:`choose_segment_size`). Returns ``(total_nodes, depth, top_k)`` for
    ``Drafter.grow_tree``; ``depth`` in ``[1, max_depth]``, ``top_k`` in ``[1, max_top_k]``; ``total_nodes``
    is at most ``1 + min(top_k + depth * top_k**2, max_nodes or in_flight * segment_size)`` and at least 2.
    """
    alpha = acceptance.alpha if isinstance(acceptance, AcceptanceStats) else float(acceptance)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance alpha={alpha} must be in [0, 1]")
    if max_depth < 1 or max_top_k < 1 or segment_size < 0:
        raise ValueError("max_depth and max_top_k must be >= 1, segment_size >= 0")
    w = max(1, segment_size)
    k_flight = in_flight or costs.in_flight_default()
    budget = costs.draft_budget(w, k_flight, ctx)
    want = useful_levels(alpha, min_value, max_depth + 1) - 1          # grow_tree depth for that many levels
    want = max(1, want)

    def fits(depth: int, k: int) -> bool:
        return costs.expansion_time(depth, k) <= budget

    depth, top_k = 1, 1
    for k in range(max_top_k, 0, -1):                                   # widest beam reaching the useful depth
        if fits(want, k):
            depth, top_k = want, k
            break
    else:                                                               # deepest affordable, then widest
        for d in range(want - 1, 0, -1):
            ks = [k for k in range(max_top_k, 0, -1) if fits(d, k)]
            if ks:
                depth, top_k = d, ks[0]
                break
    cap = max_nodes if max_nodes is not None else k_flight * w
    total = 1 + max(1, min(top_k + depth * top_k * top_k, cap))
    return Expansion(total, depth, top_k)


def affordable_levels(costs: StepCosts, segment_size: int, top_k: int, max_levels: int,
                      in_flight: int | None = None, ctx: int | None = None) -> int:
    """Levels of ``top_k`` rows rank 0 can draft per step while the stages compute: the most ``L`` in
    ``[1, max_levels]`` with ``expansion_time(L, top_k)`` within :meth:`StepCosts.draft_budget` at
    ``segment_size`` rows (as :func:`choose_expansion`); at least 1,
    so the tree keeps growing when even one level overruns (the step then waits for rank 0)."""
    if max_levels < 1 or top_k < 1:
        raise ValueError(f"max_levels={max_levels} and top_k={top_k} must be >= 1")
    budget = costs.draft_budget(max(1, segment_size), in_flight, ctx)
    for levels in range(max_levels, 0, -1):
        if costs.expansion_time(levels, top_k) <= budget:
            return levels
    return 1


def lookahead_levels(alpha: float, depth_below_root: int, min_prob: float, max_per_step: int,
                     max_depth: int = 32) -> int:
    """Levels to grow below a tree whose deepest node lies ``depth_below_root`` levels under the root, so that
    the tree reaches the *useful lookahead* ``D = useful_levels(alpha, min_prob, max_depth)`` (the deepest level
    the target's path reaches with probability ``alpha ** D >= min_prob``): ``clamp(D - depth_below_root, 0,
    max_per_step)``.

    Why a lookahead and not a fixed number of levels per step: the root advances by the accepted tokens of every
    verified step, on average ``1 / (1 - alpha)`` for a deep enough tree, so a fixed growth of ``g`` levels per
    step caps the advance at ``g`` whatever the draft (the tree runs out below the path and the round ends),
    while growing more than the advance drafts levels nobody reaches. Keeping the tree ``D`` levels deep grows
    exactly what the last step consumed, up to the per-step drafting cap (:func:`affordable_levels`), and
    drafts nothing when the tree is deep enough (rank 0 sends at once).

    Properties (``tests/test_budget.py``): 0 when the tree already reaches ``D``; never more than
    ``max_per_step``; non-decreasing in ``alpha`` and non-increasing in ``depth_below_root`` and ``min_prob``.
    """
    if max_per_step < 0 or depth_below_root < 0:
        raise ValueError(f"max_per_step={max_per_step} and depth_below_root={depth_below_root} must be >= 0")
    target = useful_levels(alpha, min_prob, max_depth)
    return max(0, min(max_per_step, target - depth_below_root))


class StepPlan(NamedTuple):
    segment_size: int
    expansion: Expansion
    draft_s: float
    period_s: float
    tokens_per_step: float
    tokens_per_s: float


def plan_step(path_probs_in_send_order: Iterable[float], costs: StepCosts, acceptance: "AcceptanceStats | float",
              in_flight: int | None = None, max_size: int | None = None, bonus: float = 1.0,
              **expansion_kw) -> StepPlan:
    """Both choices, consistently: size the segment with drafting unknown, fit the expansion to that step,
    then resize the segment charging rank 0 the expansion's drafting time."""
    probs = _as_probs(path_probs_in_send_order)
    w0 = choose_segment_size(probs, costs, 0.0, in_flight, max_size, bonus)
    exp = choose_expansion(costs, acceptance, w0, in_flight, **expansion_kw)
    draft_s = costs.expansion_time(exp.depth, exp.top_k)
    w = choose_segment_size(probs, costs, draft_s, in_flight, max_size, bonus)
    if w == 0:
        return StepPlan(0, exp, draft_s, costs.period(1, draft_s, in_flight), 0.0, 0.0)
    period = costs.period(w, draft_s, in_flight)
    tokens = bonus + sum(probs[:w])
    return StepPlan(w, exp, draft_s, period, tokens, tokens / period)


# -- command line ---------------------------------------------------------------------------------------
def patterns(n: int, alphas: Sequence[float]) -> list[tuple[str, list[float]]]:
    """Synthetic waiting lists (path probabilities in send order) for the CLI table."""
    out = []
    for a in alphas:
        out.append((f"chain alpha={a:g}", [a ** (i + 1) for i in range(n)]))
    for a in alphas:   # a beam of 4 per level: shares 0.6/0.2/0.1/0.05 of the level's mass alpha**depth
        shares = (0.6, 0.2, 0.1, 0.05)
        tree = [a ** (d + 1) * s for d in range(n) for s in shares][:n]
        out.append((f"beam4 alpha={a:g}", tree))
    out.append(("flat p=0.9", [0.9] * n))
    out.append(("two good, rest 0", [0.9, 0.8] + [0.0] * (n - 2)))
    out.append(("all 0", [0.0] * n))
    return out


def main(argv=None) -> int:
    from pipeline.cli import DefaultsOnce
    p = argparse.ArgumentParser(
        prog="python -m pipeline.budget",
        description="Cost-aware FlowSpec trees: print a profile's per-step costs and, for a few synthetic "
                    "waiting lists (path probabilities in send order), the segment size and the expansion "
                    "(total nodes, depth, top-k) that pipeline.budget chooses, with the expected throughput.",
        epilog="Example: python -m pipeline.budget --profile edge_orin_7b --world 5 --ctx 512 --alpha 0.5 0.8",
        formatter_class=DefaultsOnce)
    p.add_argument("--profile", required=True, help="emulation profile: builtin name (profiles/*.json) or path")
    p.add_argument("--world", type=int, default=5, help="ranks in the ring (rank 0 + verification stages)")
    p.add_argument("--ctx", type=int, default=512, help="cached KV slots per stage")
    p.add_argument("--alpha", type=float, nargs="+", default=[0.5, 0.7, 0.9],
                   help="per-level acceptance rates of the synthetic patterns and of their expansion (the "
                        "flat / zero patterns are expanded with the largest)")
    p.add_argument("--waiting", type=int, default=128, help="nodes waiting on rank 0 in each pattern")
    p.add_argument("--max-size", type=int, default=None, help="cap on nodes per segment (default: no cap)")
    p.add_argument("--hidden-bytes", type=float, default=None,
                   help="bytes per hidden-state row on a hop, for profiles that count real payloads (e.g. zero)")
    p.add_argument("--rank0-overhead-ms", type=float, default=0.0, help="unmodeled rank-0 time per step")
    args = p.parse_args(argv)
    try:
        from config.profiles import EmulationError, load_profile
        if args.world < 2:
            raise ValueError(f"--world {args.world} must be >= 2")
        if args.waiting < 2 or args.ctx < 0 or args.rank0_overhead_ms < 0 or (args.hidden_bytes or 0) < 0:
            raise ValueError("--waiting must be >= 2; --ctx, --hidden-bytes and --rank0-overhead-ms >= 0")
        if args.max_size is not None and args.max_size < 1:
            raise ValueError(f"--max-size {args.max_size} must be >= 1")
        if any(not 0.0 <= a <= 1.0 for a in args.alpha):
            raise ValueError("--alpha values must be in [0, 1]")
        costs = StepCosts.from_profile(load_profile(args.profile), args.world, args.ctx,
                                       hidden_bytes_per_token=args.hidden_bytes,
                                       rank0_overhead_s=args.rank0_overhead_ms / 1e3)
        print(f"{costs.source}: {costs.n_stages} stages, ctx {costs.ctx}, {costs.n_stages + 1} segments in flight")
        print(f"{'rows':>5} {'stage ms':>9} {'link ms':>8} {'hop ms':>7} {'verify ms':>9} {'level ms':>9} "
              f"{'loop/inflight':>13} {'period ms':>9}")
        for w in (1, 4, 8, 16, 32, 64, 128):
            print(f"{w:5d} {costs.stage_time(w, costs.ctx) * 1e3:9.2f} {costs.busy_link(w) * 1e3:8.2f} "
                  f"{costs.hop_time(w) * 1e3:7.2f} {costs.verify_time(w) * 1e3:9.2f} "
                  f"{costs.draft_level_time(min(w, 10)) * 1e3:9.2f} "
                  f"{costs.loop_time(w) / costs.in_flight_default() * 1e3:13.2f} {costs.period(w) * 1e3:9.2f}")
        print("(level ms: one draft-head forward + draft lm_head at min(rows, 10) beam rows)")
        print()
        print(f"{'pattern':<20} {'alpha':>5} {'w':>4} {'total':>5} {'depth':>5} {'top_k':>5} {'draft ms':>8} "
              f"{'period ms':>9} {'tok/step':>8} {'tok/s':>7}")
        for name, probs in patterns(args.waiting, args.alpha):
            a = float(name.split("=")[1]) if "alpha=" in name else max(args.alpha)
            plan = plan_step(probs, costs, a, max_size=args.max_size)
            e = plan.expansion
            rate = f"{plan.tokens_per_s:7.1f}" if plan.period_s > MIN_PERIOD_S else "    inf"
            print(f"{name:<20} {a:5.2f} {plan.segment_size:4d} {e.total_nodes:5d} {e.depth:5d} {e.top_k:5d} "
                  f"{plan.draft_s * 1e3:8.2f} {plan.period_s * 1e3:9.2f} {plan.tokens_per_step:8.2f} {rate}")
        return 0
    except (EmulationError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
