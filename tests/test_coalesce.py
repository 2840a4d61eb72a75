"""Rank 0's row-wise ops of several lanes coalesced into one op (pipeline/coalesce.py).

The grouping rule is pure and checked against its invariants (planted rules that merge other keys, drop or
duplicate a call, or reorder must fail the check); the batcher runs a lone call exactly as the lone op of before
(same tensor, same meter call, no waiting) and the calls that wait for a busy device as ONE op of its leader's
meter at their total rows, each caller getting its own rows (within float reassociation of its own op: bounded
here; not bit-identical on this CPU) or the op's error; the draft head's forward of several lanes (each over its
own cache) equals each lane's own and is charged once at the total rows and cached entries; end to end, lanes whose
rank-0 ops are padded (as on the emulated testbed) coalesce their ``lm_head`` calls and draft-head forwards and every
greedy answer is still HF's, every sampled answer its own alone; planted slicing / crossing bugs fail.
"""
import random
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from model.meter import run_rows
from pipeline import coalesce
from pipeline.coalesce import Call, CoalescingMeter, OpBatcher, split_rows, take_group
from pipeline.engine import GenSettings
from pipeline.inprocess import run_threaded
from tests.helpers import run_concurrent
from tests.helpers import Pad, run_batched
from tests.test_lanes import COMMON, NEW, PROMPTS, tiny  # noqa: F401 - tiny: the module's fixture


# -- the grouping rule (pure) ------------------------------------------------------------------------------------
def _call(key, rows=1, kind="lm_head", ctx=0, width=4) -> Call:
    return Call(kind, ctx, key, torch.zeros(rows, width), lambda x: x)


def check_group(waiting: list[Call], leader: Call, group: list[Call], rest: list[Call]) -> list[str]:
    """What is wrong with ``take_group(waiting, leader) == (group, rest)`` (its docstring's invariants)."""
    problems = []
    if group.count(leader) != 1:
        problems.append("the leader is not in its group exactly once")
    if any(c.group_key != leader.group_key for c in group):
        problems.append("a call of another key in the group")
    if any(c.group_key == leader.group_key for c in rest):
        problems.append("a waiting call of the leader's key left waiting")
    served = [c for c in group if c is not leader or leader in waiting]
    if sorted(map(id, served + rest)) != sorted(map(id, waiting)):
        problems.append("a waiting call lost or served twice")
    order = {id(c): i for i, c in enumerate(waiting)}
    if [order[id(c)] for c in served] != sorted(order[id(c)] for c in served) or \
            [order[id(c)] for c in rest] != sorted(order[id(c)] for c in rest):
        problems.append("arrival order not kept")
    if leader not in waiting and group and group[0] is not leader:
        problems.append("a leader that was not waiting is not first")
    return problems


def _cases(n: int = 300):
    rnd = random.Random(5)
    for _ in range(n):
        keys = ["a", "b", "c"]
        waiting = [_call(rnd.choice(keys), rnd.randint(1, 3), ctx=rnd.choice([0, 0, 7])) for _ in range(rnd.randint(0, 7))]
        if waiting and rnd.random() < 0.6:
            leader = rnd.choice(waiting)
        else:
            leader = _call(rnd.choice(keys), ctx=rnd.choice([0, 7]))
        yield waiting, leader


def test_take_group_keeps_its_invariants():
    for waiting, leader in _cases():
        group, rest = take_group(list(waiting), leader)
        assert check_group(waiting, leader, group, rest) == []


def _ignores_ctx(waiting, leader):
    group = [c for c in waiting if c is leader or c.key == leader.key]
    return group if leader in group else [leader, *group], [c for c in waiting if c.key != leader.key]


def _drops_rest_of_other_keys(waiting, leader):
    group, rest = take_group(waiting, leader)
    return group, rest[1:]


def _leader_twice(waiting, leader):
    group, rest = take_group(waiting, leader)
    return [leader, *group] if leader in waiting else group, rest


def _newest_first(waiting, leader):
    group, rest = take_group(waiting, leader)
    return group[::-1], rest


@pytest.mark.parametrize("planted", [_ignores_ctx, _drops_rest_of_other_keys, _leader_twice, _newest_first])
def test_planted_grouping_rules_fail_the_check(planted):
    assert any(check_group(w, lead, *planted(list(w), lead)) for w, lead in _cases())


def test_group_key_separates_what_cannot_share_an_op():
    """Another kind, ``ctx`` (vocabulary rows), function, dtype or row width: never one op."""
    base = Call("lm_head", 0, "k", torch.zeros(2, 4), None)
    others = [Call("draft_forward", 0, "k", torch.zeros(2, 4), None), Call("lm_head", 5, "k", torch.zeros(2, 4), None),
              Call("lm_head", 0, "j", torch.zeros(2, 4), None),
              Call("lm_head", 0, "k", torch.zeros(2, 4, dtype=torch.float64), None),
              Call("lm_head", 0, "k", torch.zeros(2, 3), None)]
    group, rest = take_group([base, *others, Call("lm_head", 0, "k", torch.zeros(1, 1, 4), None)], base)
    assert len(group) == 2 and rest == others


def test_split_rows_cuts_each_call_its_shape():
    calls = [Call("lm_head", 0, "k", torch.zeros(4), None), Call("lm_head", 0, "k", torch.zeros(1, 3, 4), None),
             Call("lm_head", 0, "k", torch.zeros(2, 4), None)]
    y = torch.arange(6 * 5.0).reshape(6, 5)
    a, b, c = split_rows(y, calls)
    assert a.shape == (5,) and b.shape == (1, 3, 5) and c.shape == (2, 5)
    assert torch.equal(torch.cat([a[None], b[0], c]), y)
    with pytest.raises(ValueError):
        split_rows(y[:5], calls)


# -- the batcher ------------------------------------------------------------------------------------------------
class Rec:
    """A site meter that records its ops (and can make each last ``s`` seconds, as an emulated pad)."""

    counter_names = ()

    def __init__(self, s: float = 0.0) -> None:
        self.ops: list[tuple] = []
        self.s = s

    @contextmanager
    def op(self, kind, rows, ctx=0):
        self.ops.append((kind, rows, ctx))
        yield
        time.sleep(self.s)


def test_a_lone_call_is_the_lone_op():
    """The device free: the call runs at once on the caller's own tensor, one meter op of its rows, nothing
    registered as waiting, nothing coalesced; the result is bit for bit ``post(fn(x))``."""
    b = OpBatcher()
    lin = torch.nn.Linear(8, 6)
    seen = []
    meter = CoalescingMeter(b, Rec())
    x = torch.randn(3, 8)
    got = run_rows(meter, "lm_head", x, lambda t: seen.append(t) or lin(t), ctx=0, key=lin,
                   post=lambda y: torch.log_softmax(y, -1))
    assert seen[0] is x and meter.inner.ops == [("lm_head", 3, 0)]
    assert torch.equal(got, torch.log_softmax(lin(x), -1))
    assert b._released == 0 and not b._waiting and b.counts["coalesced_ops", "lm_head"] == 0
    # no key (a function that is not row-wise, or not shared): held like any other op, never coalesced
    run_rows(meter, "lm_head", x, lin)
    assert meter.inner.ops[-1] == ("lm_head", 3, 0) and b.counts["ops", "lm_head"] == 2


def _contended(lin, sizes, keys, split=split_rows, fn_error=None):
    """Hold the device while one thread per ``sizes`` entry offers its call (key ``keys[i]``), release it once every
    call waits; returns (results, the threads' meters, the batcher, errors)."""
    b = OpBatcher()
    meters = [CoalescingMeter(b, Rec()) for _ in sizes]
    xs = [torch.randn(n, lin.in_features, dtype=torch.float64) for n in sizes]
    out: list = [None] * len(sizes)
    errs: list = [None] * len(sizes)

    def fn(t):
        if fn_error is not None:
            raise fn_error
        return lin(t)

    def go(i):
        try:
            out[i] = run_rows(meters[i], "lm_head", xs[i], fn, key=keys[i], post=lambda y: y * 1.0)
        except Exception as e:   # noqa: BLE001 - compared below
            errs[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(sizes))]
    orig = coalesce.split_rows
    coalesce.split_rows = split
    try:
        with b.hold("draft_forward"):
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while len(b._waiting) < len(sizes) and time.monotonic() < deadline:
                time.sleep(0.002)
            assert len(b._waiting) == len(sizes)
        for t in threads:
            t.join(30)
    finally:
        coalesce.split_rows = orig
    return xs, out, meters, b, errs


def _check_coalesced(lin, xs, out, meters, sizes) -> list[str]:
    problems = []
    ops = [op for m in meters for op in m.inner.ops]
    if ops != [("lm_head", sum(sizes), 0)]:
        problems.append(f"not one op charged at the total rows: {ops}")
    for x, y in zip(xs, out):
        if y is None or y.shape != lin(x).shape:
            problems.append("a caller got no result or another shape")
        elif not torch.allclose(y, lin(x), rtol=1e-12, atol=1e-12):
            problems.append("a caller's rows are not its own")
    return problems


def test_waiting_calls_run_as_one_op_charged_once():
    """Four calls of one key waiting for a busy device: ONE op of the leader's meter at their total rows; each
    caller gets its own rows (float64 here: within 1e-12 of its own op)."""
    lin = torch.nn.Linear(16, 10).double()
    sizes = [1, 3, 2, 5]
    xs, out, meters, b, errs = _contended(lin, sizes, [lin] * 4)
    assert errs == [None] * 4
    assert _check_coalesced(lin, xs, out, meters, sizes) == []
    assert b.counts["coalesced_ops", "lm_head"] == 1 and b.counts["coalesced_calls", "lm_head"] == 4
    assert "lm_head: 4 calls in 1 ops, 1 of them coalesced (4 calls)" in b.summary()


def test_planted_crossed_slices_fail_the_check():
    lin = torch.nn.Linear(16, 10).double()
    sizes = [2, 2, 2]
    xs, out, meters, _, _ = _contended(lin, sizes, [lin] * 3, split=lambda y, calls: split_rows(y, calls)[::-1])
    assert _check_coalesced(lin, xs, out, meters, sizes)


def test_other_keys_wait_for_their_own_op():
    lin = torch.nn.Linear(16, 10).double()
    xs, out, meters, b, errs = _contended(lin, [2, 1, 3], [lin, "other", lin])
    ops = sorted(op for m in meters for op in m.inner.ops)
    assert ops == [("lm_head", 1, 0), ("lm_head", 5, 0)] and errs == [None] * 3
    assert all(torch.allclose(y, lin(x)) for x, y in zip(xs, out))


def test_an_error_reaches_every_caller_of_the_op():
    lin = torch.nn.Linear(16, 10).double()
    _, out, _, b, errs = _contended(lin, [1, 2, 1], [lin] * 3, fn_error=RuntimeError("device lost"))
    assert all(isinstance(e, RuntimeError) for e in errs) and out == [None] * 3
    assert not b._waiting and b.device.acquire(blocking=False)   # nothing left waiting, the device free


def test_float32_rows_within_reassociation_of_their_own_op():
    """What one op over more rows changes in a caller's float32 rows on this CPU: a reassociation (bounded), the
    argmax of every row unchanged here; not asserted bit-identical (it is not, in general: module docstring)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 4096, bias=False)
    xs = [torch.randn(n, 576) for n in (1, 3, 7, 12)]
    ys = split_rows(lin(torch.cat(xs)), [Call("lm_head", 0, lin, x, lin) for x in xs])
    for x, y in zip(xs, ys):
        alone = lin(x)
        assert (y - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()
        assert torch.equal(y.argmax(-1), alone.argmax(-1))


# -- end to end: lanes -------------------------------------------------------------------------------------------
def _rank0_pad():
    return Pad(0.01)


def _coalesced(*kinds):
    """Coverage of the end-to-end tests: an op of each of ``kinds`` served several lanes' calls (timing: whether
    the lanes' calls meet at the device; ``run_batched`` retries, checking the outputs of every run)."""
    return lambda pool: all(pool.lock.counts["coalesced_ops", k] > 0 for k in kinds)


@pytest.mark.parametrize("mode,drafter", [("continuous", "default"), ("naive", "default"), ("continuous", "oracle"),
                                          ("ar", "oracle")])
def test_coalesced_lanes_greedy_equals_alone(tiny, mode, drafter):   # noqa: F811 - the fixture
    """Three requests at once whose rank-0 ops take 10 ms (as the emulated testbed pads them): their ``lm_head``
    calls (verification; ``default``: the untrained EAGLE head's draft log-probs too) coalesce, and every answer
    is still HF's greedy answer."""
    full, stages, refs = tiny
    d = f"oracle:{full}" if drafter == "oracle" else None
    kinds = ["lm_head", "draft_forward"] if drafter == "default" and mode == "continuous" else ["lm_head"]

    def check(res):
        assert [r.output_ids for r in res] == refs
    run_batched(check, stages, [(p, mode, GenSettings(NEW)) for p in PROMPTS], COMMON, {2}, d, lanes=3,
                stage_meter=lambda r: Pad(), rank0_meter=_rank0_pad, covered=_coalesced(*kinds),
                what=f"{' and '.join(kinds)} calls of several lanes coalesced")


@pytest.mark.parametrize("mode", ["continuous", "naive"])
def test_coalesced_lanes_sampling_equals_alone(tiny, mode):   # noqa: F811
    """T = 1, three seeded requests interleaved with coalesced ``lm_head`` ops: each answer is the request's own
    answer alone (its own draws; the law is then the single-request law, exact by tests/test_sampling.py)."""
    full, stages, _ = tiny
    seeds = [3, 4, 5]
    alone = [run_threaded(stages, [p], [mode], [*COMMON, "temperature=1.0", f"seed={s}"], {2}, f"oracle:{full}")
             [mode][0].output_ids for p, s in zip(PROMPTS, seeds)]
    jobs = [(p, mode, GenSettings(NEW, temperature=1.0, seed=s)) for p, s in zip(PROMPTS, seeds)]
    def check(res):
        assert [r.output_ids for r in res] == alone
    run_batched(check, stages, jobs, COMMON, {2}, f"oracle:{full}", lanes=3, stage_meter=lambda r: Pad(),
                rank0_meter=_rank0_pad, covered=_coalesced("lm_head"), what="lm_head calls of several lanes coalesced")


def test_planted_crossed_slices_fail_end_to_end(tiny, monkeypatch):   # noqa: F811
    """Planted bug: a coalesced op hands each caller another caller's rows: an error or wrong answers."""
    full, stages, refs = tiny
    monkeypatch.setattr(coalesce, "split_rows", lambda y, calls: [
        y[:c.rows].reshape(*c.x.shape[:-1], *y.shape[1:]) for c in calls])   # every caller gets the first rows
    try:
        res, pool = run_concurrent(stages, [(p, "continuous", GenSettings(NEW)) for p in PROMPTS], COMMON, {2},
                                   f"oracle:{full}", lanes=3, lane_timeout_s=8, stage_meter=lambda r: Pad(),
                                   rank0_meter=_rank0_pad)
    except Exception:   # noqa: BLE001 - a shape error or a lane's timeout
        return
    assert pool.lock.counts["coalesced_ops", "lm_head"] > 0
    assert [r.output_ids for r in res] != refs


# -- the draft head's forward of several lanes (joint calls) ----------------------------------------------------
def _head_and_lanes(n_lanes=3):
    from transformers import LlamaConfig

    from draft.eagle import init_untrained_head
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128)
    head = init_untrained_head(cfg, seed=1).double().eval()
    g = torch.Generator().manual_seed(2)
    lanes = []
    for i in range(n_lanes):   # each lane: a committed context of its own length, then a tree level to draft
        cache = head.block.new_cache(64, torch.float64, "cpu")
        c = 3 + 2 * i
        pos, mask = cache.context_inputs(c, torch.float64)
        with torch.no_grad():
            head.compute(torch.randint(0, 50, (1, c), generator=g), torch.randn(1, c, 32, generator=g,
                         dtype=torch.float64), pos, mask, cache)
        cache.commit_forward(c, as_context=True)
        n = 1 + i
        pos, mask = cache.staged_tree_inputs(torch.full((n,), -1), torch.float64)
        lanes.append((torch.randint(0, 50, (1, n), generator=g), torch.randn(1, n, 32, generator=g, dtype=torch.float64),
                      pos, mask, cache))
    return head, lanes


def _lane_outputs(head, lanes, joint: bool):
    import copy
    calls = [(t, f, p, m, copy.deepcopy(c)) for t, f, p, m, c in lanes]
    with torch.no_grad():
        outs = head.compute_lanes(calls) if joint else [head.compute(*a) for a in calls]
    return outs, [a[4] for a in calls]


def _joint_problems(head, lanes, joint_outs, joint_caches) -> list[str]:
    solo, solo_caches = _lane_outputs(head, lanes, joint=False)
    problems = []
    for i, (a, b) in enumerate(zip(joint_outs, solo)):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-10, atol=1e-12):
            problems.append(f"lane {i}: output differs from its own forward")
    for i, (a, b) in enumerate(zip(joint_caches, solo_caches)):
        n = lanes[i][0].shape[-1]
        for layer in range(len(head.block.layers)):
            ka, va = a.update(torch.zeros(1, 2, 0, 8, dtype=torch.float64), torch.zeros(1, 2, 0, 8, dtype=torch.float64),
                              layer)
            kb, vb = b.update(torch.zeros(1, 2, 0, 8, dtype=torch.float64), torch.zeros(1, 2, 0, 8, dtype=torch.float64),
                              layer)
            if ka.shape != kb.shape or not (torch.allclose(ka, kb, atol=1e-12) and torch.allclose(va, vb, atol=1e-12)):
                problems.append(f"lane {i}: cache of layer {layer} differs ({n} rows)")
    return problems


def test_head_forward_of_several_lanes_equals_each_lanes_own():
    """``EagleHead.compute_lanes``: every lane's output rows and the keys/values written into its own cache equal
    its own forward's (float64: within 1e-12)."""
    head, lanes = _head_and_lanes()
    outs, caches = _lane_outputs(head, lanes, joint=True)
    assert _joint_problems(head, lanes, outs, caches) == []


def test_planted_crossed_lane_caches_fail_the_check():
    head, lanes = _head_and_lanes()
    outs, caches = _lane_outputs(head, lanes, joint=True)
    assert _joint_problems(head, lanes, outs[::-1], caches)            # outputs handed to the wrong lanes
    crossed = [(t, f, p, m, c) for (t, f, p, m, _), (_, _, _, _, c) in zip(lanes, lanes[1:] + lanes[:1])]
    with pytest.raises(Exception):   # a lane's mask over another lane's cache: the shapes do not match
        _lane_outputs(head, crossed, joint=True)


def test_joint_calls_charge_total_rows_and_cached_entries():
    """Draft-head forwards of three lanes waiting at once: ONE ``draft_forward`` op at their total rows over their
    total cached entries (a stage forward of several lanes is charged so too)."""
    head, lanes = _head_and_lanes()
    b = OpBatcher()
    head.meter = CoalescingMeter(b, Rec())   # one head module shared by the lanes' drafters: one site meter
    out: list = [None] * len(lanes)
    import copy
    lanes = [(t, f, p, m, copy.deepcopy(c)) for t, f, p, m, c in lanes]

    def go(i):
        with torch.no_grad():
            out[i] = head(*lanes[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(lanes))]
    with b.hold("lm_head"):
        for t in threads:
            t.start()
        while len(b._waiting) < len(lanes):
            time.sleep(0.002)
    for t in threads:
        t.join(30)
    ops = head.meter.inner.ops
    assert ops == [("draft_forward", sum(t.shape[-1] for t, *_ in lanes), sum(c.length for *_, c in lanes))]
    assert b.counts["coalesced_calls", "draft_forward"] == 3
