"""The lean transport (pipeline/comm.py, pipeline/messages.py, pipeline/trace.py, model/kv_cache.py).

* framing: one gloo frame per message up to FRAME_BYTES, header + payload beyond; every dtype, empty payloads,
  a payload larger than a frame, and more sends than MAX_PENDING before the receiver takes any, through a real
  2-process gloo link (seconds);
* ``poll_prev``: what has arrived, in ring order, never waiting (a read-ahead thread), then ``recv_prev`` goes on;
* the send FIFO stays bounded (the old reap list grew by one entry per message, forever);
* spans cost nothing when tracing is off, and busy spans still feed the busy counter;
* the stage's vectorised tree extension equals draft.tree's reference functions on random trees.
"""
import os
import random

import pytest
import torch

from draft.tree import depths_from_parents
from model.kv_cache import KVCache
from pipeline.comm import FRAME_BYTES, HEADER_BYTES, MAX_PENDING, wire_sizes
from pipeline.trace import Tracer
from tests.helpers import ancestor_matrix, free_port


def test_wire_sizes_rule():
    assert wire_sizes(0) == [HEADER_BYTES]
    assert wire_sizes(FRAME_BYTES - HEADER_BYTES) == [FRAME_BYTES]
    assert wire_sizes(FRAME_BYTES - HEADER_BYTES + 1) == [HEADER_BYTES, FRAME_BYTES - HEADER_BYTES + 1]


def _messages():
    from pipeline.messages import Context, Decision, Segment, Shutdown, Stats, Status, pack_log
    log = pack_log([Decision(1, 2, Status.TRUNCATE, -1, True, torch.tensor([0, 4])),
                    Decision(1, 3, Status.CONTINUE, 9, False, torch.tensor([7]))])
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool):
        x = (torch.arange(15, dtype=torch.float64).reshape(1, 3, 5) - 4).to(dtype)
        out.append(Segment(x, torch.tensor([-1, 0, 1]), torch.tensor([4, 5, 6]), 2, 7, log, 3))
    odd = torch.tensor([[True, False, True]])                      # 3 bytes: the next tensor is misaligned
    out.append(Segment(odd, torch.tensor([-1, 0, 0]), torch.tensor([1, 2, 3]), 1, 1))
    big = torch.arange(FRAME_BYTES // 4 + 100, dtype=torch.float32).reshape(1, 1, -1)   # > one frame
    out += [Context(big, 4, True), Context(torch.zeros(1, 0, 8)), Decision(1, 5, Status.CONTINUE, 3, False,
            torch.tensor([1, 2])), Stats(torch.tensor([0.5, 1.0], dtype=torch.float64)), Shutdown()]
    return out


def _same(a, b) -> bool:
    if type(a) is not type(b) or a.ints() != b.ints():
        return False
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
               for x, y in zip(a.tensors(), b.tensors()))


def _link_worker(rank: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")
    from pipeline.comm import Comm
    from pipeline.messages import Context
    try:
        comm = Comm("gloo", 30.0, 0.5, "cpu")
        msgs = _messages()
        n_burst = MAX_PENDING + 20
        if rank == 0:
            for m in msgs:
                comm.send(1, m)
            for i in range(n_burst):   # more than MAX_PENDING before the receiver takes any
                x = torch.full((1, 2), i)
                comm.send(1, Context(x))
                x.fill_(-1)            # reuse after send must not reach the wire
            pending = sum(len(v) for v in comm._pending.values())
            back = comm.recv(1)
            q.put(("ok", pending <= MAX_PENDING and _same(back, msgs[0])))
        else:
            import time
            time.sleep(1.0)            # let the sender run ahead
            got = [comm.recv(0) for _ in msgs]
            ok = all(_same(a, b) for a, b in zip(got, msgs))
            burst = [int(comm.recv(0).x[0, 0]) for _ in range(n_burst)]
            comm.send(0, got[0])
            q.put(("ok", ok and burst == list(range(n_burst))))
        comm.close()
    except BaseException as e:  # reported to the test
        q.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))



def _two_gloo_ranks(target) -> None:
    """Run ``target(rank, port, queue)`` in two spawned processes (a 2-rank gloo ring) and assert both report
    ``("ok", True)``; the processes are reaped (killed after 30 s) whatever happens."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(r == ("ok", True) for r in results), results

def test_gloo_link_frames_every_message_and_bounds_pending():
    _two_gloo_ranks(_link_worker)


def _poll_worker(rank: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")
    import time

    from pipeline.comm import Comm
    from pipeline.messages import Shutdown, Stats
    try:
        comm = Comm("gloo", 30.0, 0.5, "cpu")
        msgs = _messages()[:-1]                      # every kind but Shutdown, one larger than a frame
        if rank == 0:
            comm.recv(1)                             # nothing is sent before rank 1 has polled once
            for m in msgs:
                comm.send(1, m)
            comm.recv(1)
            comm.send(1, Shutdown())
            q.put(("ok", True))
        else:
            first = comm.poll_prev()                 # nothing has arrived: [] at once
            comm.send(0, Stats(torch.zeros(1, dtype=torch.float64)))
            got, deadline = [], time.monotonic() + 60
            while len(got) < len(msgs) and time.monotonic() < deadline:
                got += comm.poll_prev()              # what the read-ahead received, in ring order
                time.sleep(0.01)
            ok = first == [] and len(got) == len(msgs) and all(_same(a, b) for a, b in zip(got, msgs))
            ok = ok and comm.poll_prev() == []
            comm.send(0, Stats(torch.zeros(1, dtype=torch.float64)))
            ok = ok and isinstance(comm.recv_prev(), Shutdown)   # recv_prev takes the read-ahead's next one
            q.put(("ok", ok))
        comm.close()
    except BaseException as e:  # reported to the test
        q.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def test_gloo_poll_prev_returns_what_arrived_in_order_without_waiting():
    """``Comm.poll_prev`` (a stage computing several lanes in one forward takes what is queued): [] before anything
    was sent, then every message in ring order (a read-ahead thread receives them), and ``recv_prev`` after it
    takes the next one; the read-ahead ends at ``Shutdown`` and the link closes cleanly."""
    _two_gloo_ranks(_poll_worker)


def test_spans_free_when_off_and_busy_still_counted():
    tr = Tracer(0, enabled=False)
    assert tr.span("send") is tr.span("recv")          # the shared no-op context: nothing allocated
    with tr.span("send"):
        pass
    with tr.span("compute"):
        with tr.span("prune"):                          # nested busy spans count once
            pass
    assert tr.events == [] and tr.busy_s > 0 and tr._busy_depth == 0
    on = Tracer(0, enabled=True)
    with on.span("recv", src=1):
        pass
    assert [e["name"] for e in on.events] == ["recv"] and on.events[0]["src"] == 1 and on.busy_s == 0


@pytest.mark.parametrize("seed", range(6))
def test_tree_inputs_extend_the_ancestry_as_the_reference(seed):
    rng = random.Random(seed)
    cache = KVCache(1, 1, 2, 512, torch.float32)
    cache.length = cache.context_len = 7
    for _ in range(4):                                  # grow the cached tree segment by segment
        m, n = cache.num_tree, rng.randint(0, 9)
        parents = torch.tensor([rng.randint(-1, m + i - 1) for i in range(n)], dtype=torch.long)
        ref_anc = ancestor_matrix(parents, cache.tree_anc)
        ref_depth = torch.cat([cache.tree_depth, depths_from_parents(parents, cache.tree_depth)])
        pos, mask, anc, depth = cache.tree_inputs(parents, torch.float32)
        assert torch.equal(anc, ref_anc) and torch.equal(depth, ref_depth)
        assert pos.tolist() == [(7 + ref_depth[m:]).tolist()]
        assert mask.shape == (1, 1, n, cache.length + n)
        cache.commit_forward(n, as_context=False, anc=anc, depth=depth)
    with pytest.raises(ValueError, match="not an earlier node"):
        cache.tree_inputs(torch.tensor([cache.num_tree]), torch.float32)
