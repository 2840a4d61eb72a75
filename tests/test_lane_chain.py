"""One lane's consecutive waiting segments in ONE stage forward (a chain: pipeline/batching.py, StageWorker.step).

* the rules: ``take_batch`` (per-lane FIFO, a lane's later messages only as a chain of segments, OTHER stops the
  scan; checked exhaustively against a reference on every short queue), ``chain_continues`` and ``chain_mask``;
* a stage worker handed a lane's prompt chunk and its segments (whose parents are in the earlier segments) computes
  them in one forward and sends every message as its own, equal to a forward per message; on the lean and the
  transformers layers, one lane and two lanes interleaved;
* a chained segment whose decision is ready (in its log, or arrived point to point) goes back to the queue and is
  computed after the decision applies; planted bugs (the decision check skipped, a mask that lets earlier pieces
  see later rows) change the outputs;
* end to end: three requests whose stages chain, and one request alone with ``chain_alone``, answer as HF does.
"""
import itertools

import pytest
import torch

from pipeline import batching
from pipeline.batching import CONTEXT, OTHER, SEGMENT, chain_continues, chain_mask, take_batch
from pipeline.local_ring import LocalComm, LocalRing
from pipeline.messages import Context, Decision, Segment, Shutdown, Stats, Status, pack_log

S, C, O = SEGMENT, CONTEXT, OTHER


# -- the rules ------------------------------------------------------------------------------------------------

def test_take_batch_chains_a_lanes_segments():
    assert take_batch((S, 0), [(S, 0), (S, 0), (S, 1)]) == [0, 1, 2]
    assert take_batch((S, 0), [(S, 0), (S, 0), (S, 1)], chain=False) == [2]
    assert take_batch((C, 0), [(S, 0), (C, 0), (S, 0), (S, 1)]) == [0, 3]   # a Context only starts a chain
    assert take_batch((S, 0), [(C, 1), (S, 1), (C, 1)]) == [0, 1]
    assert take_batch((S, 0), [(S, 1), (S, 0), (O, 1), (S, 1)]) == [0, 1]   # OTHER stops the scan


def reference_take(head, waiting, chain):
    """The rule written another way: walk the queue; a message joins iff nothing of its lane before it (in the
    queue) was left out, no OTHER precedes it, and it is its lane's first message of the step or (chain) a
    Segment."""
    out = []
    for i, (kind, lane) in enumerate(waiting):
        before = waiting[:i]
        if any(k == O for k, _ in before):
            break
        if kind == O:
            continue
        if any(l2 == lane and j not in out for j, (_, l2) in enumerate(before)):
            continue
        first = lane != head[1] and all(l2 != lane for _, l2 in before)
        if first or (chain and kind == S):
            out.append(i)
    return out


def test_take_batch_equals_its_reference_on_every_short_queue():
    items = [(k, lane) for k in (S, C, O) for lane in (0, 1)]
    n = 0
    for length in range(5):
        for waiting in itertools.product(items, repeat=length):
            for head in ((S, 0), (C, 0)):
                for chain in (True, False):
                    taken = take_batch(head, list(waiting), chain)
                    assert taken == reference_take(head, list(waiting), chain), (head, waiting, chain)
                    # per-lane FIFO: what is taken of a lane is a prefix of that lane's waiting messages
                    for lane in (0, 1):
                        mine = [i for i, (k, l2) in enumerate(waiting) if l2 == lane]
                        got = [i for i in taken if waiting[i][1] == lane]
                        assert got == mine[:len(got)]
                    n += 1
    assert n > 5000


def test_planted_rule_bug_fails_the_reference():
    """A rule that lets a lane's Context join its chain (a reset under staged rows) differs from the reference."""
    def buggy(head, waiting, chain=True):
        return [i for i, (k, _) in enumerate(itertools.takewhile(lambda m: m[0] != O, waiting))]
    assert buggy((S, 0), [(C, 0)]) != reference_take((S, 0), [(C, 0)], True)


def test_chain_continues():
    assert chain_continues(0, [])
    assert chain_continues(2, [4, 5])          # held ahead of their turn: nothing applies now
    assert not chain_continues(2, [3])
    assert not chain_continues(0, {1: None})   # a dict of held decisions (StageTree.early) reads the same


def test_chain_mask():
    low = torch.finfo(torch.float64).min
    m1 = torch.zeros(1, 1, 2, 5, dtype=torch.float64)           # 3 cached slots + 2 rows
    m2 = torch.full((1, 1, 3, 8), 7.0, dtype=torch.float64)     # 5 slots (2 staged) + 3 rows
    j = chain_mask([m1, m2])
    assert j.shape == (1, 1, 5, 8)
    assert (j[0, 0, :2, :5] == 0).all() and (j[0, 0, :2, 5:] == low).all() and (j[0, 0, 2:] == 7).all()
    assert chain_mask([m1]) is m1


# -- the stage worker ----------------------------------------------------------------------------------------

from tests.test_lanes_batch import _stage, tiny  # noqa: E402,F401  (the same 2-layer float64 stage and its fixture)


PROMPTS = [[1, 5, 9, 13, 22], [1, 40, 41]]
# (parents, gids) of a lane's segments: later segments hang below the earlier ones' nodes
SEGS = [([-1, 0, 0], [0, 1, 2]), ([1, 2], [3, 4]), ([3], [5])]


def _toks(lane: int, k: int, n: int) -> torch.Tensor:
    return torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(10 * lane + k))


def _lane_msgs(lane: int, decision: bool = False) -> list:
    out = [Context(torch.tensor([PROMPTS[lane]]), 1, True, lane)]
    for k, (par, gids) in enumerate(SEGS):
        out.append(Segment(_toks(lane, k, len(par)), torch.tensor(par), torch.tensor(gids), 1, 0, lane=lane))
    if decision:   # node 0 accepted, node 1's subtree survives (2 and 4 die); then a child of 3 arrives
        d = Decision(1, 1, Status.CONTINUE, 1, False, torch.tensor([0]))
        out.append(Segment(_toks(lane, 9, 1), torch.tensor([3]), torch.tensor([6]), 1, 1, pack_log([d]), lane=lane))
    return out


def _run(model, msgs: list, chain=True, alone=False, direct: dict | None = None):
    """A last stage (world 2) handed ``msgs`` all queued before it starts; what it sent (``Stats`` left out) and
    the worker. ``direct``: ``{k: decision}``, delivered point to point by the worker's ``k``-th direct poll."""
    from pipeline.worker import StageWorker
    ring = LocalRing(2)
    for m in msgs + [Shutdown()]:
        ring.links[0].put(LocalComm.wire(m))
    worker = StageWorker(model, LocalComm(ring, 1), 64, torch.float64, "cpu")
    worker.chain, worker.chain_alone = chain, alone
    if direct is not None:
        polls = iter(range(1, 1000))
        worker.comm.poll_direct = lambda: [d for d in [direct.get(next(polls))] if d is not None]
    worker.run()
    out = []
    while not ring.links[1].empty():
        out.append(ring.links[1].get())
    assert isinstance(out[-1], Shutdown)
    return [m for m in out[:-1] if not isinstance(m, Stats)], worker


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        type(x) is type(y) and x.lane == y.lane and x.ints() == y.ints() and x.x.shape == y.x.shape
        and torch.allclose(x.x, y.x, rtol=0, atol=1e-10) for x, y in zip(a, b))


@pytest.mark.parametrize("lean", [True, False])
def test_one_lane_chain_is_one_forward_with_each_message_its_own(tiny, lean):
    model = _stage(tiny, lean)
    msgs = _lane_msgs(0)
    ref, w0 = _run(model, msgs, chain=False)
    assert w0.forwards == 4 and w0.chained_forwards == 0
    got, w = _run(model, msgs, alone=True)
    assert w.forwards == 1 and w.messages == 4 and w.chained_forwards == 1 and w.joined_forwards == 1
    assert _same(ref, got)
    off, w2 = _run(model, msgs)                   # one lane, chain_alone off: a forward per message, as before
    assert w2.forwards == 4 and _same(ref, off)


@pytest.mark.parametrize("lean", [True, False])
def test_two_lanes_interleaved_chains(tiny, lean):
    model = _stage(tiny, lean)
    a, b = _lane_msgs(0), _lane_msgs(1)
    msgs = [a[0], b[0]] + [m for pair in zip(a[1:], b[1:]) for m in pair]
    got, w = _run(model, msgs)
    # C0 alone (one lane known), then C1 and every segment of both lanes in one forward
    assert w.forwards == 2 and w.batched_forwards == 1 and w.chained_forwards == 1
    assert [(type(m).__name__, m.lane) for m in got] == [(type(m).__name__, m.lane) for m in msgs]
    for lane, mine in ((0, a), (1, b)):
        ref, _ = _run(model, mine, chain=False)
        assert _same(ref, [m for m in got if m.lane == lane])


def test_a_ready_decision_ends_the_chain(tiny):
    model = _stage(tiny, True)
    msgs = _lane_msgs(0, decision=True)
    ref, _ = _run(model, msgs, chain=False)
    assert ref[-1].x.shape[1] == 1                # the last segment's row survives the decision
    got, w = _run(model, msgs, alone=True)
    assert w.chain_stops == 1 and w.forwards == 2
    assert _same(ref, got)


def _direct_case() -> tuple[list, dict]:
    """The lane's prompt and three segments, a ``Stats`` (it ends the scan: they are one step), then two more
    segments sent before decision 1 (epoch 0); the decision overtakes the second of them point to point: the
    worker's 5th direct poll (one per segment prepared) delivers it."""
    msgs = _lane_msgs(0)
    late = [Segment(_toks(0, 7, 1), torch.tensor([3]), torch.tensor([6]), 1, 0, lane=0),
            Segment(_toks(0, 8, 1), torch.tensor([6]), torch.tensor([7]), 1, 0, lane=0)]
    d = Decision(1, 1, Status.CONTINUE, 1, False, torch.tensor([0]))
    return msgs + [Stats(torch.zeros(2, dtype=torch.float64))] + late, {5: d}


def test_a_direct_decision_ends_the_chain(tiny):
    model = _stage(tiny, True)
    msgs, direct = _direct_case()
    ref, w0 = _run(model, msgs, chain=False, direct=direct)
    assert w0.forwards == 6 and w0.lanes[0].tree.applied == 1
    got, w = _run(model, msgs, alone=True, direct=direct)
    assert w.chain_stops == 1 and w.forwards == 3 and w.lanes[0].tree.applied == 1
    assert _same(ref, got)


@pytest.mark.parametrize("bug", ["decision-under-staged-rows", "direct-decision-under-staged-rows",
                                 "earlier-piece-sees-later-rows"])
def test_planted_chain_bugs_change_the_outputs(tiny, monkeypatch, bug):
    model = _stage(tiny, True)
    msgs, direct = _lane_msgs(0, decision=True), None
    if bug == "direct-decision-under-staged-rows":
        msgs, direct = _direct_case()
    ref, _ = _run(model, msgs, chain=False, direct=direct)
    if bug.endswith("decision-under-staged-rows"):
        monkeypatch.setattr("pipeline.worker.chain_continues", lambda applied, held: True)
    else:
        def open_mask(masks):   # the later pieces' columns left visible (0) instead of masked out
            rows, width = sum(int(m.shape[-2]) for m in masks), int(masks[-1].shape[-1])
            out, r = torch.zeros(1, 1, rows, width, dtype=masks[0].dtype), 0
            for m in masks:
                out[:, :, r:r + m.shape[-2], :m.shape[-1]] = m
                r += m.shape[-2]
            return out
        monkeypatch.setattr(batching, "chain_mask", open_mask)
    try:
        got, _ = _run(model, msgs, alone=True, direct=direct)
    except Exception:   # noqa: BLE001 - an error is a failure too
        return
    assert not _same(ref, got)


# -- end to end: several requests (and one alone) through a ring whose stages chain ------------------------------

from tests.test_lanes import COMMON, NEW, PROMPTS as E2E_PROMPTS, tiny_ring  # noqa: E402


@pytest.fixture(scope="module")
def ring4(tmp_path_factory):
    return tiny_ring(tmp_path_factory.mktemp("lane_chain_e2e"))


def _chained(pool) -> int:
    return sum(w.chained_forwards for w in pool.stage_workers)


@pytest.mark.parametrize("mode", ["continuous", "naive", "pipedec", "pruned"])
def test_concurrent_greedy_with_chains_equals_alone(ring4, mode):
    """Three requests on three lanes, each keeping every link busy (``serve.ring_share=3``: at the default share of
    one segment per link a lane has one segment in flight, nothing to chain), stage forwards padded (so segments
    queue up, as on the emulated testbed): stage steps carry a lane's consecutive segments (counted), and every
    answer is its single-request answer."""
    from pipeline.engine import GenSettings
    from tests.helpers import run_concurrent
    from tests.helpers import Pad
    full, stages, refs = ring4
    # continuous: the early sends off (tree.early_level, tree.early_whole: defaults since results §63), so that a
    # verified step sends the several segments whose chaining this test is about (a whole early expansion is one)
    keys = ["tree.early_level=false", "tree.early_whole=0"] if mode == "continuous" else []
    res, pool = run_concurrent(stages, [(p, mode, GenSettings(NEW)) for p in E2E_PROMPTS],
                               [*COMMON, "serve.ring_share=3", *keys], {2}, f"oracle:{full}", lanes=3,
                               stage_meter=lambda r: Pad())
    assert [r.output_ids for r in res] == refs
    assert _chained(pool) > 0, "no stage step carried a lane's consecutive segments"


@pytest.mark.parametrize("mode", ["naive", "pruned"])
def test_one_request_chained_alone_equals_hf(ring4, monkeypatch, mode):
    """One request, ``chain_alone`` (``FLOWSPEC_STAGE_CHAIN=alone``): its stages chain its own waiting segments and
    its answer is still HF's greedy answer. (Modes whose segments queue up on this tiny ring with the oracle
    drafter; ``continuous`` chains in the three-request test above.)"""
    from pipeline.engine import GenSettings
    from tests.helpers import run_concurrent
    from tests.helpers import Pad
    full, stages, refs = ring4
    monkeypatch.setenv("FLOWSPEC_STAGE_CHAIN", "alone")
    res, pool = run_concurrent(stages, [(E2E_PROMPTS[0], mode, GenSettings(NEW))], COMMON, {2}, f"oracle:{full}",
                               lanes=1, stage_meter=lambda r: Pad())
    assert res[0].output_ids == refs[0]
    assert _chained(pool) > 0 and all(not w.several for w in pool.stage_workers)
