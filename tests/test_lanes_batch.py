"""Several lanes' segments in one stage forward (pipeline/batching.py, model/lane_batch.py, StageWorker.step).

* the rule (``take_batch``, without chains): one message per lane, per-lane FIFO, stop at Stats/Shutdown (a lane's
  consecutive segments in one forward: tests/test_lane_chain.py);
* a block forward of several lanes equals each lane's forward alone (outputs and the keys/values written), on the
  lean layers (attention loop) and the transformers layers (block-diagonal mask);
* a stage worker handed several lanes' queued messages computes them in fewer forwards, charges its meter ONE op
  per forward (all rows, all lanes' cached slots), and sends every lane's outputs, in arrival order, equal to what
  that lane gets alone; planted bugs (one lane's rows attending to another lane's cache, outputs routed to the wrong
  lane) give other outputs;
* ``poll_prev`` on the in-process ring and a lane transport (the gloo one: tests/test_transport.py).
"""
from contextlib import contextmanager

import pytest
import torch

from model.lane_batch import LaneBatch
from model.split import split_checkpoint
from pipeline.batching import CONTEXT, OTHER, SEGMENT, take_batch
from pipeline.local_ring import LocalComm, LocalRing
from pipeline.messages import Context, Segment, Shutdown, Stats
from tests.helpers import tiny_llama

S, C, O = SEGMENT, CONTEXT, OTHER


def test_take_batch_rule():
    """Without chains (``chain=False``): one message per lane (a lane's chains: tests/test_lane_chain.py)."""
    def take(lane, waiting):
        return take_batch((S, lane), waiting, chain=False)
    assert take(0, []) == []
    assert take(0, [(S, 1), (S, 2), (C, 3)]) == [0, 1, 2]
    assert take(0, [(S, 0), (S, 1)]) == [1]                    # the head's lane waits for the next step
    assert take(0, [(S, 1), (S, 1), (S, 2)]) == [0, 2]          # one per lane
    assert take(0, [(S, 1), (S, 2), (S, 1), (S, 2), (S, 3)]) == [0, 1, 4]
    assert take(0, [(S, 1), (O, 2), (S, 3)]) == [0]             # Stats / Shutdown: handled in ring order
    assert take(0, [(S, 0), (S, 0), (S, 1)]) == [2]
    # per-lane FIFO: a lane whose earlier message is left waiting never has a later one taken
    for waiting in ([(S, 1), (S, 1), (S, 1)], [(S, 0), (C, 1), (S, 0), (S, 2)]):
        taken = take(0, waiting)
        for i in taken:
            assert waiting[i][1] != 0 and all(lane != waiting[i][1] for _, lane in waiting[:i])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lanes_batch")
    full = tiny_llama(root / "full", layers=2, dtype=torch.float64)
    return split_checkpoint(full, root / "stages", [0, 2], progress=False)


def _stage(stages, lean: bool):
    from model.layers import set_lean
    from model.stage_model import load_stage
    model = load_stage(stages, 1, 2, torch.float64)
    set_lean(model, lean)
    return model


@pytest.mark.parametrize("lean", [True, False])
def test_block_forward_of_several_lanes_equals_each_alone(tiny, lean):
    model = _stage(tiny, lean)
    block = model.block
    torch.manual_seed(1)
    prompts = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45], [1, 7]]
    parents = [torch.tensor([-1, 0, 0]), torch.tensor([-1]), torch.tensor([-1, 0, 1, 1])]
    alone, batch = [], []
    for copy in (alone, batch):
        for p in prompts:
            cache = block.new_cache(64, torch.float64, "cpu")
            pos, mask = cache.context_inputs(len(p), torch.float64)
            model(torch.tensor([p]), pos, mask, cache)
            cache.commit_forward(len(p), as_context=True)
            copy.append(cache)
    toks = [torch.randint(3, 90, (1, len(par))) for par in parents]
    outs = []
    for cache, par, t in zip(alone, parents, toks):
        pos, mask, _, _ = cache.tree_inputs(par, torch.float64)
        outs.append(model(t, pos, mask, cache))
    ins = [c.tree_inputs(par, torch.float64) for c, par in zip(batch, parents)]
    lb = LaneBatch(batch, [m for _, m, _, _ in ins])
    out = model(torch.cat(toks, dim=1), torch.cat([p for p, _, _, _ in ins], dim=1), None, lb)
    for a, b in zip(outs, out.split([len(par) for par in parents], dim=1)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for a, b in zip(alone, batch):      # the keys/values each lane's new rows wrote into its own cache
        end = a.length + 4
        torch.testing.assert_close(a.keys[..., :end, :], b.keys[..., :end, :], rtol=0, atol=1e-10)
        torch.testing.assert_close(a.values[..., :end, :], b.values[..., :end, :], rtol=0, atol=1e-10)


def test_joint_mask_is_block_diagonal():
    m1 = torch.zeros(1, 1, 2, 3)
    m2 = torch.full((1, 1, 1, 4), 5.0)
    lb = LaneBatch([None, None], [m1, m2])
    j = lb.joint_mask()
    low = torch.finfo(j.dtype).min
    assert j.shape == (1, 1, 3, 7)
    assert (j[0, 0, :2, :3] == 0).all() and (j[0, 0, 2, 3:] == 5).all()
    assert (j[0, 0, :2, 3:] == low).all() and (j[0, 0, 2, :3] == low).all()


def crossed_attend(self, q, k, v, layer_idx, attention):
    """Planted bug for :meth:`LaneBatch.attend`: lane ``i``'s rows attend over lane ``i + 1``'s cache."""
    outs = []
    for i, (_, a, b, _) in enumerate(self._lanes()):
        other = self.caches[(i + 1) % len(self.caches)]
        kc, vc = other.update(k[:, :, a:b], v[:, :, a:b], layer_idx)
        outs.append(attention(q[:, :, a:b], kc, vc, torch.zeros(1, 1, b - a, kc.shape[2], dtype=q.dtype)))
    return torch.cat(outs, dim=2)


# -- the stage worker ----------------------------------------------------------------------------------------

class RecordingMeter:
    counter_names = ()

    def __init__(self) -> None:
        self.ops: list[tuple[str, int, int]] = []

    @contextmanager
    def op(self, kind, rows, ctx=0):
        self.ops.append((kind, rows, ctx))
        yield


PROMPTS = [[1, 5, 9, 13, 22], [1, 40, 41], [1, 7, 7, 8, 9, 10, 11]]
SEGS = [([-1, 0, 0], [0, 1, 2]), ([-1, 0], [0, 1]), ([-1], [0])]


def _messages(lanes: list[int]) -> list:
    ctx = [Context(torch.tensor([PROMPTS[lane]]), 1, True, lane) for lane in lanes]
    segs = []
    for lane in lanes:
        par, gids = SEGS[lane]
        toks = torch.randint(3, 90, (1, len(par)), generator=torch.Generator().manual_seed(lane))
        segs.append(Segment(toks, torch.tensor(par), torch.tensor(gids), 1, 0,
                            lane=lane))
    return ctx + segs


def _run_worker(model, msgs: list, chain: bool = True) -> tuple[list, "StageWorker"]:
    """A last stage (world 2) handed ``msgs`` all queued before it starts; returns what it sent and the worker."""
    from pipeline.worker import StageWorker
    ring = LocalRing(2)
    for m in msgs + [Shutdown()]:
        ring.links[0].put(LocalComm.wire(m))
    worker = StageWorker(model, LocalComm(ring, 1), 64, torch.float64, "cpu")
    worker.meter = RecordingMeter()
    worker.chain = chain
    worker.run()
    out = []
    while not ring.links[1].empty():
        out.append(ring.links[1].get())
    assert isinstance(out[-1], Shutdown)
    return out[:-1], worker


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("lean", [True, False])
def test_worker_batches_queued_lanes_and_each_lane_gets_its_own_result(tiny, lean, chain):
    model = _stage(tiny, lean)
    lanes = [0, 1, 2]
    sent, worker = _run_worker(model, _messages(lanes), chain)
    assert [(type(m).__name__, m.lane) for m in sent] == [("Context", 0), ("Context", 1), ("Context", 2),
                                                          ("Segment", 0), ("Segment", 1), ("Segment", 2)]
    p, s = [len(x) for x in PROMPTS], [len(x[0]) for x in SEGS]
    if not chain:
        # lane 0's prefill arrives first, alone (one lane known: no poll); then C1 + C2 + S0 in one forward, S1 + S2
        assert worker.batched_forwards == 2 and worker.batched_lanes == 5
        assert worker.meter.ops == [("stage_forward", p[0], 0),                              # one op per forward:
                                    ("stage_forward", p[1] + p[2] + s[0], p[0]),              # all rows, all lanes'
                                    ("stage_forward", s[1] + s[2], p[1] + p[2])]              # cached slots
    else:
        # then C1 + C2 + S0 + S1 + S2 in one forward: lanes 1 and 2 each chain their prompt and their segment
        assert worker.batched_forwards == 1 and worker.batched_lanes == 3 and worker.chained_forwards == 1
        assert worker.meter.ops == [("stage_forward", p[0], 0),
                                    ("stage_forward", p[1] + p[2] + sum(s), p[0])]
    for lane in lanes:
        alone, w1 = _run_worker(model, _messages([lane]), chain=False)     # a forward per message
        assert w1.batched_forwards == 0 and w1.forwards == 2
        mine = [m for m in sent if m.lane == lane]
        assert len(mine) == len(alone) == 2
        for a, b in zip(alone, mine):
            assert a.ints() == b.ints()
            torch.testing.assert_close(a.x, b.x, rtol=0, atol=1e-10)


@pytest.mark.parametrize("bug", ["attends-to-another-lane", "outputs-to-another-lane"])
def test_planted_batching_bugs_change_the_outputs(tiny, monkeypatch, bug):
    from pipeline.worker import StageWorker
    model = _stage(tiny, True)
    alone = {lane: _run_worker(model, _messages([lane]))[0] for lane in (0, 1, 2)}
    if bug == "attends-to-another-lane":
        monkeypatch.setattr(LaneBatch, "attend", crossed_attend)
    else:
        real_fwd = StageWorker.forward_lanes
        monkeypatch.setattr(StageWorker, "forward_lanes", lambda self, works: real_fwd(self, works)[::-1])
    try:
        sent, _ = _run_worker(model, _messages([0, 1, 2]))
    except Exception:   # noqa: BLE001 - a shape error is a failure too
        return
    same = all(a.ints() == b.ints() and a.x.shape == b.x.shape and torch.allclose(a.x, b.x)
               for lane in (0, 1, 2) for a, b in zip(alone[lane], [m for m in sent if m.lane == lane]))
    assert not same


def test_static_shapes_and_batching_off_compute_one_message_per_forward(tiny):
    model = _stage(tiny, True)
    from pipeline.worker import StageWorker
    real_init = StageWorker.__init__

    def off(self, *a, **k):
        real_init(self, *a, **k)
        self.batching = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StageWorker, "__init__", off)
        sent, worker = _run_worker(model, _messages([0, 1, 2]))
    assert worker.batched_forwards == 0 and len(worker.meter.ops) == 6 and len(sent) == 6


# -- poll_prev ------------------------------------------------------------------------------------------------

def test_local_ring_poll_prev_keeps_ring_fifo():
    ring = LocalRing(3)
    a, b = LocalComm(ring, 0), LocalComm(ring, 1)
    assert b.poll_prev() == []
    for i in range(4):
        a.send_next(Stats(torch.tensor([float(i)], dtype=torch.float64)))
    first = b.recv_prev()
    got = b.poll_prev()
    assert [float(m.busy_s[0]) for m in [first] + got] == [0.0, 1.0, 2.0, 3.0]
    assert b.poll_prev() == []
    a.send_next(Stats(torch.tensor([4.0], dtype=torch.float64)))
    assert float(b.recv_prev().busy_s[0]) == 4.0


def test_lane_transport_poll_prev():
    from pipeline.lanes import LaneMux
    ring = LocalRing(2)
    mux = LaneMux(LocalComm(ring, 0), 2, timeout_s=5)
    t0 = mux.transport(0)
    assert t0.poll_prev() == []
    for i in range(3):
        t0.send_next(Context(torch.tensor([[i]]), 1, False))
    stage = LocalComm(ring, 1)
    for _ in range(3):
        stage.send_next(stage.recv_prev())
    first = t0.recv_prev()
    got = [first]
    while len(got) < 3:
        got += t0.poll_prev()
    assert [int(m.x[0, 0]) for m in got] == [0, 1, 2] and all(m.lane == 0 for m in got)
    assert mux.transport(1).poll_prev() == []
    mux.close()
