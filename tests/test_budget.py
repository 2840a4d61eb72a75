"""Cost-aware trees (pipeline/budget.py) on synthetic costs and on the edge_orin_7b profile. Pure Python, < 2 s."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from pipeline.budget import (AcceptanceStats, StepCosts, affordable_levels, choose_segment_size, lookahead_levels,
                             path_probs, useful_levels)
from config.profiles import load_profile

MS = 1e-3


def affine(a: float, b: float):
    """``t(rows) = a + b * rows`` (a second argument, the context, is accepted and ignored: a stage time)."""
    return lambda x, ctx=0: a + b * x


def costs(stage=(25 * MS, 0.0), hop=(0.0, 0.0), verify=(0.0, 0.0), level=(0.0, 0.0), n_stages=4,
          overhead=0.0) -> StepCosts:
    return StepCosts(n_stages, affine(*stage), affine(*hop), affine(*level), affine(*verify),
                     rank0_overhead_s=overhead)


def expected_rate(w: int, probs, c: StepCosts, draft_s: float = 0.0) -> float:
    """The oracle: expected tokens per second when each step sends the first ``w`` of ``probs`` (bonus 1)."""
    return (1.0 + sum(probs[:w])) / c.period(w, draft_s)


def random_costs(rng: random.Random) -> StepCosts:
    return costs(stage=(rng.uniform(0, 50) * MS, rng.uniform(0, 3) * MS),
                 hop=(rng.uniform(0, 2) * MS, rng.uniform(0, 2) * MS),
                 verify=(rng.uniform(0, 3) * MS, rng.uniform(0, 0.2) * MS),
                 level=(rng.uniform(0, 5) * MS, rng.uniform(0, 0.5) * MS), n_stages=rng.randint(1, 8))


def sorted_probs(rng: random.Random, n: int) -> list[float]:
    return sorted((rng.random() for _ in range(n)), reverse=True)


@dataclass(frozen=True)
class Steeper(StepCosts):
    """The same costs plus ``delta`` seconds per row on whichever resource binds."""

    delta: float = 0.0

    def period(self, w, draft_s=0.0, in_flight=None, ctx=None):
        return super().period(w, draft_s, in_flight, ctx) + self.delta * w


# -- segment size ---------------------------------------------------------------------------------------
def test_free_rows_and_high_probabilities_send_everything_waiting():
    c = costs(stage=(25 * MS, 0.0), hop=(0.5 * MS, 0.0), verify=(2 * MS, 0.0))
    assert choose_segment_size([0.9] * 50, c) == 50
    assert choose_segment_size([0.9] * 50, c, max_size=16) == 16
    assert choose_segment_size([0.9] * 3, c) == 3          # never more than waits


def test_steep_rows_send_few():
    proportional = costs(stage=(0.0, 1 * MS))               # period = w ms: the first node always wins
    for probs in ([0.9] * 20, [1.0] * 20, [0.5, 0.4, 0.3]):
        assert choose_segment_size(probs, proportional) == 1
    c = costs(stage=(1 * MS, 1 * MS))                        # period (1 + w) ms: w=2 beats 1 iff p2 > (1 + p1) / 2
    assert choose_segment_size([0.9, 0.94, 0.0], c) == 1
    assert choose_segment_size([0.9, 0.96, 0.0], c) == 2
    flat = costs(stage=(25 * MS, 0.0))
    steep = costs(stage=(25 * MS, 2 * MS))
    probs = [0.8 ** (i + 1) for i in range(64)]
    assert choose_segment_size(probs, steep) < choose_segment_size(probs, flat)


def test_zero_probability_nodes_only_when_the_ring_would_idle():
    linky = costs(stage=(25 * MS, 0.0), hop=(0.0, 0.1 * MS), n_stages=2)
    assert choose_segment_size([0.9, 0.8] + [0.0] * 20, linky) == 2
    flat = costs(stage=(25 * MS, 0.0))                       # zero marginal cost: a tie goes to the smaller w
    assert choose_segment_size([0.9, 0.8] + [0.0] * 20, flat) == 2
    assert choose_segment_size([0.0] * 10, linky) == 1       # something waits: never an idle step
    assert choose_segment_size([0.0] * 10, flat, bonus=0.0) == 1
    assert choose_segment_size([], flat) == 0
    free = costs(stage=(0.0, 0.0))                           # the zero profile: every row free, rates finite
    assert choose_segment_size([0.5, 0.2, 0.0, 0.0], free) == 2
    with pytest.raises(ValueError):
        choose_segment_size([0.5, 1.5], flat)
    with pytest.raises(ValueError):
        choose_segment_size([0.5, float("nan")], flat)


def test_probabilities_from_tree_scores():
    scores = torch.tensor([0.0, math.log(0.5), math.log(0.25)])
    assert path_probs(scores) == pytest.approx([1.0, 0.5, 0.25])
    c = costs(stage=(25 * MS, 0.0), hop=(0.0, 0.2 * MS))
    assert choose_segment_size(torch.tensor(path_probs(scores)), c) == choose_segment_size([1.0, 0.5, 0.25], c)


def test_choice_is_the_argmax_of_the_expected_rate():
    rng = random.Random(1)
    for _ in range(300):
        c = random_costs(rng)
        probs = sorted_probs(rng, rng.randint(1, 30))
        draft = rng.uniform(0, 40) * MS
        w = choose_segment_size(probs, c, draft_s=draft)
        rates = [expected_rate(v, probs, c, draft) for v in range(1, len(probs) + 1)]
        assert rates[w - 1] == pytest.approx(max(rates), rel=1e-9)
        assert all(r < rates[w - 1] * (1 + 1e-9) for r in rates[: w - 1])   # smallest maximiser
        # the marginal rule: the last node sent pays for the time it adds at the chosen rate
        if w > 1:
            assert probs[w - 1] >= rates[w - 1] * (c.period(w, draft) - c.period(w - 1, draft)) - 1e-12


def test_higher_per_row_cost_never_increases_w():
    rng = random.Random(2)
    for _ in range(300):                  # one affine resource binds at every size (a one-stage ring, free links)
        a, b = rng.uniform(0, 50) * MS, rng.uniform(0, 3) * MS
        probs = sorted_probs(rng, rng.randint(1, 40))
        w = choose_segment_size(probs, costs(stage=(a, b), n_stages=1))
        w2 = choose_segment_size(probs, costs(stage=(a, b * rng.uniform(1, 4)), n_stages=1))
        assert w2 <= w
    for _ in range(300):                  # any costs, a per-row extra on the binding resource
        c = random_costs(rng)
        probs = sorted_probs(rng, rng.randint(1, 40))
        draft = rng.uniform(0, 30) * MS
        w = choose_segment_size(probs, c, draft_s=draft)
        steeper = Steeper(c.n_stages, c.stage_time, c.hop_time, c.draft_level_time, c.verify_time,
                          delta=rng.uniform(0, 2) * MS)
        assert choose_segment_size(probs, steeper, draft_s=draft) <= w


def test_steepening_a_resource_that_binds_only_sometimes_can_raise_w():
    """The documented exception (module docstring): the stage binds at 2 rows, the loop at 3."""
    probs = [0.9, 0.7, 0.7, 0.4, 0.1, 0.1]
    before = costs(stage=(10 * MS, 1 * MS), hop=(0.0, 3 * MS), n_stages=1)
    after = costs(stage=(10 * MS, 2 * MS), hop=(0.0, 3 * MS), n_stages=1)
    assert after.period(2) == pytest.approx(14 * MS) and after.period(3) == pytest.approx(17 * MS)
    assert (choose_segment_size(probs, before), choose_segment_size(probs, after)) == (2, 3)


def test_higher_probabilities_never_decrease_w():
    rng = random.Random(3)
    for _ in range(300):
        c = random_costs(rng)
        n = rng.randint(1, 40)
        probs = sorted_probs(rng, n)
        draft = rng.uniform(0, 30) * MS
        w = choose_segment_size(probs, c, draft_s=draft)
        scale = rng.uniform(0, 1)
        assert choose_segment_size([p * scale for p in probs], c, draft_s=draft) <= w
        depths = sorted(rng.randint(1, 8) for _ in range(n))            # shallow nodes go out first
        lo = rng.random()
        hi = lo + (1 - lo) * rng.random()
        assert (choose_segment_size([hi ** d for d in depths], c, draft_s=draft)
                >= choose_segment_size([lo ** d for d in depths], c, draft_s=draft))


def test_raising_only_the_first_node_can_lower_w():
    """The documented exception: the rate that later nodes must pay for goes up."""
    c = costs(stage=(0.7, 0.3), n_stages=1)                  # period(1) = 1 s, period(2) = 1.3 s
    assert choose_segment_size([0.5, 0.5], c) == 2           # 2 / 1.3 > 1.5 / 1
    assert choose_segment_size([1.0, 0.5], c) == 1           # 2.5 / 1.3 < 2 / 1


def test_rank0_drafting_counts_when_rank0_binds():
    """Verification costs 1 ms per row: alone it binds beyond 25 rows (rate 23.5 / 25 ms at w = 25 beats
    58.6 / 64 ms at w = 64); with 20 ms of drafting rank 0 binds from 5 rows and the fixed cost is amortised
    over every waiting node (58.6 / 84 ms beats 23.5 / 45 ms)."""
    c = costs(stage=(25 * MS, 0.0), verify=(0.0, 1 * MS))
    probs = [0.9] * 64
    assert c.period(4, draft_s=30 * MS) == pytest.approx(34 * MS)
    assert choose_segment_size(probs, c) == 25
    assert choose_segment_size(probs, c, draft_s=20 * MS) == 64


def test_acceptance_stats_estimate_alpha_with_censoring():
    rng = random.Random(7)
    st = AcceptanceStats(half_life=1e9)
    for _ in range(3000):
        g = 0
        while rng.random() < 0.7:
            g += 1
        st.record(min(g, 5), rejected=g < 5)                  # paths that reach the last verified level: censored
    assert abs(st.alpha - 0.7) < 0.03
    assert AcceptanceStats().alpha == pytest.approx(0.6)      # the prior before any step


def test_lookahead_grows_what_the_tree_lacks_up_to_the_cap():
    assert useful_levels(0.5, 0.05, 9) == 4 and useful_levels(0.2, 0.05, 9) == 1 and useful_levels(1.0, 0.05, 9) == 9
    # alpha 0.5, min_prob 0.05: useful lookahead floor(log .05 / log .5) = 4 levels below the root
    assert lookahead_levels(0.5, 0, 0.05, 8) == 4
    assert lookahead_levels(0.5, 3, 0.05, 8) == 1
    assert lookahead_levels(0.5, 4, 0.05, 8) == 0             # deep enough: nothing to draft this step
    assert lookahead_levels(0.5, 9, 0.05, 8) == 0
    assert lookahead_levels(0.5, 0, 0.05, 2) == 2             # the per-step cap
    assert lookahead_levels(1.0, 5, 0.05, 3, max_depth=6) == 1  # a perfect draft: up to max_depth
    assert lookahead_levels(0.0, 0, 0.05, 3) == 1             # never below one useful level
    rng = random.Random(11)
    for _ in range(500):
        a, d, m, cap = rng.random(), rng.randint(0, 12), rng.uniform(0.001, 0.5), rng.randint(0, 6)
        n = lookahead_levels(a, d, m, cap)
        assert 0 <= n <= cap
        assert lookahead_levels(min(1.0, a + rng.random() * (1 - a)), d, m, cap) >= n   # monotone in alpha
        assert lookahead_levels(a, d + rng.randint(0, 3), m, cap) <= n                 # and in the depth
        assert lookahead_levels(a, d, min(0.99, m * (1 + rng.random())), cap) <= n     # and in min_prob
    with pytest.raises(ValueError):
        lookahead_levels(0.5, -1, 0.05, 2)
    with pytest.raises(ValueError):
        lookahead_levels(0.5, 0, 0.0, 2)


def test_affordable_levels_fit_the_ring_step():
    slow = costs(stage=(25 * MS, 0.0), level=(6 * MS, 0.0))       # 6 + 6 L <= 25 ms -> L <= 3
    assert affordable_levels(slow, 8, 10, 8) == 3
    assert affordable_levels(slow, 8, 10, 2) == 2                 # the caller's cap
    per_row = costs(stage=(25 * MS, 0.0), level=(0.0, 1 * MS))   # 1 + 10 L <= 25 -> L <= 2 at k = 10
    assert affordable_levels(per_row, 8, 10, 8) == 2
    assert affordable_levels(per_row, 8, 4, 8) == 6              # a narrower beam affords more levels
    hopeless = costs(stage=(25 * MS, 0.0), level=(30 * MS, 0.0))
    assert affordable_levels(hopeless, 8, 10, 8) == 1             # at least one level: the tree keeps growing
    rng = random.Random(12)
    for _ in range(300):
        c, w, k, cap = random_costs(rng), rng.randint(1, 40), rng.randint(1, 10), rng.randint(1, 8)
        n = affordable_levels(c, w, k, cap)
        budget = c.ring_period(w) - c.verify_time(w) - c.rank0_overhead_s
        assert 1 <= n <= cap
        assert n == 1 or c.expansion_time(n, k) <= budget
        assert n == cap or c.expansion_time(n + 1, k) > budget
    with pytest.raises(ValueError):
        affordable_levels(slow, 8, 10, 0)


# -- the edge_orin_7b profile -----------------------------------------------------------------------------
def test_from_profile_edge_orin_7b():
    prof = load_profile("edge_orin_7b")
    c = StepCosts.from_profile(prof, world=5, ctx=512)
    link = prof.link
    for w in (1, 16, 64):
        assert c.stage_time(w, 512) == pytest.approx(prof.stage.time(w, 512))
        assert c.hop_time(w) == pytest.approx((384 + w * (8192 + 8)) * 8 / 150e6 + link.latency_s)
        assert c.verify_time(w) == pytest.approx(prof.lm_head.time(w))
    assert 20 * MS < c.stage_time(16, 512) < 30 * MS and 6 * MS < c.hop_time(16) < 9 * MS
    assert c.draft_level_time(10) == pytest.approx(prof.draft_forward.time(10, 512) + prof.lm_head.time(10))
    chain = {a: [a ** (i + 1) for i in range(128)] for a in (0.5, 0.7, 0.9)}
    ws = {a: choose_segment_size(p, c) for a, p in chain.items()}
    assert 4 <= ws[0.5] <= ws[0.7] <= ws[0.9] <= 64
    for a, w in ws.items():   # drafting one level of 10 rows hides behind the stages: rank 0 does not set the step
        levels = affordable_levels(c, w, 10, 8)
        assert levels >= 1 and c.expansion_time(levels, 10) + c.verify_time(w) <= c.ring_period(w)
    with pytest.raises(ValueError):
        StepCosts.from_profile(prof, world=1)


def test_from_profile_needs_hidden_bytes_when_the_profile_counts_real_payloads():
    from config.profiles import Profile
    prof = Profile.from_dict({"name": "real", "stage": {"overhead_s": 0.01},
                              "link": {"bandwidth_mbps": 100, "latency_s": 0.001}})
    with pytest.raises(ValueError, match="hidden_bytes_per_token"):
        StepCosts.from_profile(prof, world=3)
    c = StepCosts.from_profile(prof, world=3, hidden_bytes_per_token=1152)
    assert c.hop_time(10) == pytest.approx(10 * 1160 * 8 / 100e6 + 0.001)
    assert c.verify_time(10) == 0 and c.draft_level_time(10) == 0   # no rank0 section: rank 0 is free
