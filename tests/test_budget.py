"""Cost-aware trees (pipeline/budget.py) on synthetic costs and on the edge_orin_7b profile. Pure Python, < 2 s."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from pipeline.budget import (AcceptanceStats, Affine, Expansion, OnlineCosts, StepCosts, affordable_levels,
                             choose_expansion, choose_segment_size, expected_rate, fit_affine, lookahead_levels,
                             main, path_probs, plan_step, useful_levels)
from config.profiles import load_profile

MS = 1e-3


def costs(stage=(25 * MS, 0.0), hop=(0.0, 0.0), verify=(0.0, 0.0), level=(0.0, 0.0), n_stages=4,
          overhead=0.0) -> StepCosts:
    return StepCosts.from_measurements(Affine(*stage), Affine(*hop), Affine(*level), Affine(*verify), n_stages,
                                       rank0_overhead_s=overhead)


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


# -- fitting --------------------------------------------------------------------------------------------
def noisy(rng, a, b, n, spike_frac=0.1):
    xs = [rng.randint(1, 64) for _ in range(n)]
    ys = [max(0.0, a + b * x + rng.gauss(0, 0.3 * MS) + (rng.uniform(5, 30) * MS if rng.random() < spike_frac else 0))
          for x in xs]
    return xs, ys


def test_fit_recovers_a_plus_bw_from_noisy_timings():
    rng = random.Random(4)
    a, b = 25 * MS, 0.4 * MS
    xs, ys = noisy(rng, a, b, 400)
    fit = fit_affine(xs, ys)
    assert abs(fit.a - a) < 0.5 * MS and abs(fit.b - b) < 0.05 * b
    plain = fit_affine(xs, ys, robust=False)                 # the stalls drag plain least squares
    assert abs(plain.a - a) > 3 * abs(fit.a - a)
    c = StepCosts.from_measurements(list(zip(xs, ys)), [(16, 7 * MS), (32, 14 * MS), (8, 3.5 * MS)],
                                    [(10, 5 * MS)], [(16, 2 * MS)], n_stages=4)
    assert c.stage_time(32, 0) == pytest.approx(fit(32))
    assert c.hop_time(16) == pytest.approx(7 * MS) and c.draft_level_time(10) == pytest.approx(5 * MS)


def test_fit_edge_cases():
    dec = fit_affine([1, 2, 3, 4], [4.0, 3.0, 2.0, 1.0])       # more rows never cost less: slope 0
    assert dec.b == 0 and dec.a == pytest.approx(2.5)
    one_w = fit_affine([16, 16, 16], [1.0, 1.2, 1.1], prior_slope=0.01)
    assert one_w.b == 0.01 and one_w(16) == pytest.approx(1.1)
    origin = fit_affine([10, 20], [0.5, 2.0], robust=False)   # LS intercept < 0: fit through the origin
    assert origin.a == 0 and origin.b > 0
    for bad in (([], []), ([1, 2], [1.0, -1.0]), ([1], [float("inf")])):
        with pytest.raises(ValueError):
            fit_affine(*bad)
    with pytest.raises(ValueError):
        StepCosts.from_measurements([(1, 2, 3)], [(1, 1.0)], [(1, 1.0)], [(1, 1.0)], 4)


def test_online_costs_track_drift_and_fall_back_to_the_prior():
    rng = random.Random(5)
    oc = OnlineCosts(n_stages=4, half_life=16)
    with pytest.raises(ValueError, match="stage"):
        oc.costs()
    for a in (20 * MS, 30 * MS):                             # the context grows: the intercept moves
        for x, y in zip(*noisy(rng, a, 0.2 * MS, 120, spike_frac=0.05)):
            oc.observe("stage", x, y)
    assert abs(oc.fit("stage").a - 30 * MS) < 1 * MS
    with pytest.raises(ValueError, match="unknown cost kind"):
        oc.observe("lm", 1, 1.0)
    prior = StepCosts.from_profile(load_profile("edge_orin_7b"), world=5, ctx=256)
    op = OnlineCosts(n_stages=4, prior=prior)
    for _ in range(20):
        op.observe("hop", 16, 9 * MS)                        # one row count only: the prior supplies the slope
    hop = op.fit("hop")
    assert hop(16) == pytest.approx(9 * MS)
    assert hop.b == pytest.approx((prior.hop_time(24) - prior.hop_time(8)) / 16)
    c = op.costs()
    assert c.verify_time(16) == pytest.approx(prior.verify_time(16), rel=0.05)


# -- expansion ------------------------------------------------------------------------------------------
def test_expansion_fits_rank0_budget():
    rng = random.Random(6)
    for _ in range(300):
        c = random_costs(rng)
        w = rng.randint(1, 40)
        alpha = rng.random()
        e = choose_expansion(c, alpha, w)
        budget = c.ring_period(w) - c.verify_time(w) - c.rank0_overhead_s
        assert 1 <= e.depth <= 8 and 1 <= e.top_k <= 10
        assert 2 <= e.total_nodes <= 1 + min(e.top_k + e.depth * e.top_k ** 2, (c.n_stages + 1) * w)
        if c.expansion_time(1, 1) <= budget:
            assert c.expansion_time(e.depth, e.top_k) <= budget
        else:
            assert (e.depth, e.top_k) == (1, 1)
        higher = choose_expansion(c, alpha + (1 - alpha) * rng.random(), w)
        assert higher.depth >= e.depth                        # deeper when acceptance is higher


def test_expansion_depth_follows_acceptance_and_width_follows_cost():
    free = costs(stage=(25 * MS, 0.0))
    assert useful_levels(0.5, 0.05, 9) == 4 and useful_levels(0.2, 0.05, 9) == 1 and useful_levels(1.0, 0.05, 9) == 9
    assert choose_expansion(free, 0.5, 8)[1:] == (3, 10)
    assert choose_expansion(free, 0.9, 8)[1:] == (8, 10)
    assert choose_expansion(free, 0.1, 8)[1:] == (1, 10)
    per_row = costs(stage=(25 * MS, 0.0), level=(0.0, 1 * MS))   # 1 + 3 k ms <= 25 ms -> k <= 8
    assert choose_expansion(per_row, 0.5, 8) == Expansion(1 + min(8 + 3 * 64, 5 * 8), 3, 8)
    slow = costs(stage=(25 * MS, 0.0), level=(6 * MS, 0.0))      # 6 + 6 d <= 25 -> d <= 3
    assert choose_expansion(slow, 0.9, 8)[1:] == (3, 10)
    hopeless = costs(stage=(25 * MS, 0.0), level=(30 * MS, 0.0))
    assert choose_expansion(hopeless, 0.9, 8)[1:] == (1, 1)
    assert choose_expansion(free, 0.5, 4, max_nodes=7).total_nodes == 8
    with pytest.raises(ValueError):
        choose_expansion(free, 1.5, 4)


def test_acceptance_stats_estimate_alpha_with_censoring():
    rng = random.Random(7)
    st = AcceptanceStats(half_life=1e9)
    for _ in range(3000):
        g = 0
        while rng.random() < 0.7:
            g += 1
        st.record(min(g, 5), rejected=g < 5)                  # paths that reach the last verified level: censored
    assert abs(st.alpha - 0.7) < 0.03
    assert AcceptanceStats.alpha_from_tau(0.7 / 0.3) == pytest.approx(0.7)
    assert AcceptanceStats().alpha == pytest.approx(0.6)      # the prior before any step


def test_lookahead_grows_what_the_tree_lacks_up_to_the_cap():
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
    ws = {a: plan_step(p, c, a) for a, p in chain.items()}
    print("\nedge_orin_7b, 4 stages, ctx 512: chain of path probabilities alpha**i")
    print(f"{'alpha':>5} {'w':>4} {'depth':>5} {'top_k':>5} {'draft ms':>8} {'period ms':>9} {'tok/s':>6}")
    for a, plan in ws.items():
        print(f"{a:5.2f} {plan.segment_size:4d} {plan.expansion.depth:5d} {plan.expansion.top_k:5d} "
              f"{plan.draft_s / MS:8.2f} {plan.period_s / MS:9.2f} {plan.tokens_per_s:6.1f}")
        # drafting hides behind the stages: rank 0 is not what sets the step
        assert plan.draft_s + c.verify_time(plan.segment_size) <= c.ring_period(plan.segment_size)
        assert plan.tokens_per_s == pytest.approx(expected_rate(plan.segment_size, chain[a], c, plan.draft_s))
    assert 4 <= ws[0.5].segment_size <= ws[0.7].segment_size <= ws[0.9].segment_size <= 64
    assert ws[0.5].expansion.depth <= ws[0.9].expansion.depth
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


# -- command line -----------------------------------------------------------------------------------------
def test_cli(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "Example: python -m pipeline.budget" in capsys.readouterr().out
    assert main(["--profile", "edge_orin_7b", "--world", "3", "--alpha", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "chain alpha=0.6" in out and "all 0" in out
    assert main(["--profile", "no_such_profile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert main(["--profile", "edge_orin_7b", "--alpha", "1.5"]) == 2
    assert main(["--profile", "edge_orin_7b", "--world", "1"]) == 2
    assert main(["--profile", "zero"]) == 2 and "--hidden-bytes" in capsys.readouterr().err
    assert main(["--profile", "zero", "--hidden-bytes", "1152", "--waiting", "8"]) == 0
    assert "inf" in capsys.readouterr().out
