"""Cost-aware trees: how many draft nodes to send per pipeline step, and how much to draft per step.

Pure functions and small dataclasses (no ``torch.distributed``, no model code). The FlowSpec step loop
(``mode=continuous``) asks two questions every step; this module answers them from costs, which come from an
emulation profile (:meth:`StepCosts.from_profile`, ``tree.budget``).

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
-------------------
Rank 0 drafts while the stages compute, so its drafting must fit in the time the rest of the ring takes per
step: ``budget = ring_period(w) - verify_time(w) - overhead`` (``ring_period`` = ``period`` without rank 0's
term). Growing ``L`` levels of ``top_k`` rows costs ``expansion_time = draft_level_time(1) + L *
draft_level_time(top_k)`` (the commit of the accepted tokens plus the root's log-probs, then one head forward
and one lm_head call on ``top_k`` rows per level); :func:`affordable_levels` is the most levels that fit. How
many levels are *worth* growing follows the measured per-level acceptance ``alpha`` (:class:`AcceptanceStats`):
a level ``L`` below the root is reached with probability ``alpha ** L`` (:func:`useful_levels`,
:func:`lookahead_levels`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

MIN_PERIOD_S = 1e-9   # floor of a step's time: with all-zero costs every node is free and rates stay finite


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
        k = in_flight or self.n_stages + 1
        key = ("ring", w, k, c)
        t = self._memo.get(key)
        if t is None:
            if len(self._memo) > 8192:        # a caller passing a growing ctx: keep the memo bounded
                self._memo.clear()
            t = self._memo[key] = max(self.stage_time(w, c), (self.link_busy or self.hop_time)(w), self.loop_time(w, c) / k)
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


def useful_levels(alpha: float, min_value: float, max_levels: int) -> int:
    """Tree levels worth drafting: the deepest ``L`` with ``alpha ** L >= min_value``, in ``[1, max_levels]``."""
    if not 0.0 < min_value < 1.0:
        raise ValueError(f"min_value={min_value} must be in (0, 1)")
    if alpha >= 1.0:
        return max_levels
    if alpha <= 0.0:
        return 1
    return max(1, min(max_levels, int(math.floor(math.log(min_value) / math.log(alpha) + 1e-9))))


def affordable_levels(costs: StepCosts, segment_size: int, top_k: int, max_levels: int,
                      in_flight: int | None = None, ctx: int | None = None) -> int:
    """Levels of ``top_k`` rows rank 0 can draft per step while the stages compute: the most ``L`` in
    ``[1, max_levels]`` with ``expansion_time(L, top_k)`` within :meth:`StepCosts.draft_budget` at
    ``segment_size`` rows; at least 1,
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
