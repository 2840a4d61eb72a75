"""Rank 0's calls stay few operators: each call's aten operator count and would-be GPU synchronisations
(:mod:`pipeline.tools.opcount`, through ``python -m pipeline.tools.layerbench --count-only``) stay within
``pipeline.tools.layerbench.OP_BOUNDS`` on stories260K (split 0+1+1+1+2, default run keys). Counts are
deterministic, so this is a test, not a benchmark; a planted per-node loop proves the bound can fail."""
import pytest
import torch

from tests.helpers import STORIES

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260K")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    from config.run_config import DEFAULT, apply_overrides
    from model.split import split_checkpoint
    from pipeline.tools import layerbench as lb
    root = split_checkpoint(STORIES, tmp_path_factory.mktemp("s260") / "stages", [0, 1, 1, 1, 2], progress=False)
    args = lb.parse_args([f"model.stage_dir={root}", "--count-only"])
    cfg = apply_overrides(DEFAULT, args.overrides)
    torch.set_num_threads(1)
    calls, blocks, device = lb._calls(args, cfg, root)
    return lb, calls, blocks, device


def test_every_call_within_its_bounds(bench):
    lb, calls, blocks, device = bench
    rows = lb.count(calls, blocks, device)
    names = [r["call"] for r in rows]
    for prefix in lb.OP_BOUNDS:                      # every bounded call was counted
        assert any(n.startswith(prefix) for n in names), prefix
    assert lb.over_bounds(rows) == [], lb.table(rows, "counts")
    again = lb.count(calls, blocks, device)          # deterministic: the same call counts the same
    assert [(r["ops"], r["syncs"]) for r in again] == [(r["ops"], r["syncs"]) for r in rows]
    draft = [r for r in rows if r["levels"]]
    assert all(r["syncs"] <= r["levels"] for r in draft)       # at most one device->host copy per drafted level


def test_a_planted_per_node_loop_breaks_the_bound(bench):
    """A round start that reads every node's token one by one (the per-node Python this issue removed) costs two
    operators and, on a GPU, a synchronisation per node: the bound catches it."""
    lb, calls, blocks, device = bench
    name, first, setup, levels = next(c for c in calls if c[0].startswith("first tree"))

    def planted():
        tree, inputs = first()
        return [int(t) for t in inputs[:, 0]]       # a device value read per node

    rows = lb.count([(name, planted, setup, levels)], blocks, device)
    bad = lb.over_bounds(rows)
    assert bad and any("syncs" in b for b in bad), rows


def test_the_lean_head_path_breaks_the_fused_heads_bound(bench):
    """The draft head's bound holds only with its fused forward (draft/fused_head.py): the lean layer path it
    replaces (``EagleHead.fused`` off, a regression to it) dispatches ~120 operators per forward over 10 rows."""
    lb, calls, blocks, device = bench
    heads = [m for m in device[1] if hasattr(m, "fused")]
    head_call = [c for c in calls if c[0].startswith("draft head forward")]
    assert heads and head_call
    try:
        for h in heads:
            h.fused = False
        bad = lb.over_bounds(lb.count(head_call, blocks, device))
    finally:
        for h in heads:
            h.fused = True
    assert any("draft head forward" in b and "ops" in b for b in bad), bad
    assert lb.over_bounds(lb.count(head_call, blocks, device)) == []


def test_layerbench_times_the_fused_head_against_the_lean_one(bench):
    """``--fused-head``: both settings timed in alternating blocks (lean layers on throughout), the heads left fused."""
    lb, calls, blocks, device = bench
    heads = [m for m in device[1] if hasattr(m, "fused")]
    args = lb.parse_args(["--fused-head", "--blocks", "1", "--repeat", "1", "--clock", "thread"])
    head_call = [c for c in calls if c[0].startswith("draft head forward")]
    rows = lb.measure(args, head_call, blocks, heads)
    assert rows[0]["lean_ms"] > 0 and rows[0]["transformers_ms"] > 0
    assert all(h.fused for h in heads) and all(b.lean for b in blocks)
    assert "fused head, ms" in lb.table(rows, "t", fused=True)


def test_the_counter_sees_a_compiled_call_as_its_dispatched_operators():
    """Under ``model.graphs=compile`` the counter (a dispatch mode, under which dynamo cannot run) hands the compiled
    call to the profiler (:meth:`pipeline.tools.opcount.OpCounter.compiled_call`): it counts the aten operators the
    compiled code still dispatches (the extern ``mm``), not the pointwise ops inductor fused into one C++ kernel.
    Planted: a dispatch mode without ``compiled_call`` makes the body run eagerly, every op counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.graphs import CompileExecutor
    from pipeline.tools.opcount import count_call
    w = torch.randn(8, 8)

    def body(x):
        return torch.relu(x @ w).sin().cos() + 1
    x = torch.randn(4, 8)
    ex = CompileExecutor()
    torch.testing.assert_close(ex.run("k", body, [x]), body(x))                 # compiled at the first call
    eager = count_call(lambda: body(x), w)
    c = count_call(lambda: ex.run("k", body, [x]), w)
    assert ex.stats["compiled"] == 1 and ex.stats["calls"] == 1 and ex.compile_s > 0
    assert c.syncs == 0 and "sin" not in c.by_op and "cos" not in c.by_op and eager.by_op["sin"] == 1
    assert 1 <= c.by_op.get("mm", 0) + c.by_op.get("addmm", 0) and c.ops < eager.ops, (c.by_op, eager.by_op)

    class Plain(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Plain.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    with Plain():
        out = ex.run("k", body, [x])
    torch.testing.assert_close(out, body(x))
    assert "sin" in Plain.seen                                                 # ran eagerly, op by op


def test_layerbench_compares_graph_executors_side_by_side(tmp_path, capsys):
    """``--graphs off,eager``: one table, both settings' counts per call; the eager static twin pads and builds a
    static mask, so its head forward dispatches more operators than dynamic shapes (no compile: fast)."""
    import json

    from model.split import split_checkpoint
    from pipeline.tools import layerbench as lb
    root = split_checkpoint(STORIES, tmp_path / "stages", [0, 1, 1, 1, 2], progress=False)
    assert lb.main(["--count-only", "--graphs", "off,eager", "--json", str(tmp_path / "g.json"), "--rows", "16",
                    f"model.stage_dir={root}"]) == 0
    out = capsys.readouterr().out
    assert "off: ops" in out and "eager: ops" in out and "Compile cost" in out
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    head = {g: next(r for r in rows[g] if r["call"].startswith("draft head")) for g in ("off", "eager")}
    assert head["eager"]["ops"] > head["off"]["ops"] and head["eager"]["syncs"] == head["off"]["syncs"] == 0
    with pytest.raises(SystemExit):
        lb.parse_args(["--graphs", "off,off"])
