"""The TP what-if model (pipeline/tools/tp_sim.py): the group cost formulas, and a whole prediction on a tiny model."""
import json

import pytest

from config.profiles import CostModel, LinkModel, load_profile
from config.profiles import GroupCost, shard_cost
from pipeline.tools.tp_sim import main
from tests.helpers import hf_greedy, tiny_llama

LINK = LinkModel(latency_s=1e-3, bandwidth_mbps=100.0)
H = 8192.0


def test_shard_cost_scales_streamed_bytes_not_launches():
    stage = load_profile("edge_orin_7b").stage
    assert shard_cost(stage, 4, 4).time(16, 100) == pytest.approx(stage.time(16, 100) - stage.overhead_s
                                                                 + 4 * stage.overhead_s)
    assert shard_cost(stage, 1, 1) == stage


def test_megatron_is_compute_plus_ring_all_reduces():
    shard = CostModel(overhead_s=0.01)
    g = GroupCost(shard, n=4, layers=3, link=LINK, hidden_bytes=H, schedule="megatron")
    per_all_reduce = 2 * 3 * (1e-3 + 8 * H / 4 * 8 / 100e6)
    assert g.parts(8, 0) == pytest.approx((0.01, 7 * per_all_reduce))
    one = GroupCost(shard, n=1, layers=3, link=LINK, hidden_bytes=H, schedule="galaxy")
    assert one.parts(8, 0) == (0.01, 0.0)


def test_galaxy_moves_the_same_bytes_and_hides_compute_behind_the_link():
    free = CostModel()   # zero compute: only the collectives remain
    tp = GroupCost(free, 4, 3, LINK, H, "megatron")
    gx = GroupCost(free, 4, 3, LINK, H, "galaxy")
    assert gx.time(8, 0) == pytest.approx(tp.time(8, 0))   # (4L + 2)(N - 1) = (2L + 1) 2(N - 1) steps of w/N rows
    slow = CostModel(overhead_s=0.001 * 12)   # per phase chunk 1 ms < one 2.3 ms step: hidden behind the link
    gx = GroupCost(slow, 4, 3, LINK, H, "galaxy")
    compute, exposed = gx.parts(8, 0)
    assert compute == pytest.approx(4 * 0.012) and gx.time(8, 0) == pytest.approx(
        12 * (0.001 + 3 * (1e-3 + 2 * H * 8 / 100e6)) + 6 * (1e-3 + 2 * H * 8 / 100e6))


def test_prediction_on_a_tiny_model(tmp_path, capsys):
    from model.split import split_checkpoint
    full = tiny_llama(tmp_path / "full", layers=2)
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False)
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for i, p in enumerate([[1, 5, 9, 13], [1, 7, 3, 30, 31]]):
            f.write(json.dumps({"question_id": i, "mode": "ar", "temperature": 0.0, "prompt_ids": p,
                                "output_ids": hf_greedy(full, p, 12, {2})}) + "\n")
    code = main([str(rows), "--stage-dir", str(stages), "--tp", "2", "--layers", "2", "--profile-stages", "2",
                 "--bandwidth-mbps", "150,1000", "--modes", "naive,continuous", "--out-dir", str(tmp_path / "o")])
    assert code == 0
    got = [json.loads(l) for l in (tmp_path / "o" / "predictions.jsonl").read_text().splitlines()]
    table = {(r["mode"], r["bandwidth_mbps"]): r for r in got if "xi" in r}
    assert set(table) == {(m, b) for m in ("naive", "continuous", "tp", "galaxy") for b in (150.0, 1000.0)}
    for b in (150.0, 1000.0):   # the same trees and verification as naive: the same τ
        assert table["tp", b]["tau"] == table["naive", b]["tau"]
    assert table["tp", 1000.0]["xi"] > table["tp", 150.0]["xi"]
    assert table["tp", 150.0]["group_collectives"] > table["tp", 1000.0]["group_collectives"]
    cross = [r for r in got if "crossover_mbps" in r]
    assert {c["mode"] for c in cross} == {"tp", "galaxy"}
    assert "| tp |" in capsys.readouterr().out


def test_table_times_pipeline_modes_after_direct_decision_passes(tmp_path, monkeypatch):
    """As pipeline.tools.simulate: the table's pipeline rows are timed after --direct-passes replays (stages prune
    in-flight work when rank 0's point-to-point decisions would reach them); the crossover bisection is not."""
    import pipeline.tools.simulate as sim
    from model.split import split_checkpoint
    full = tiny_llama(tmp_path / "full", layers=2)
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question_id": 0, "mode": "ar", "temperature": 0.0, "prompt_ids": [1, 5, 9],
                                "output_ids": hf_greedy(full, [1, 5, 9], 10, {2})}) + "\n")
    calls = []
    real = sim.timed_passes

    def spy(base, tc, passes, replay_with):
        calls.append((base.mode, passes))
        return real(base, tc, passes, replay_with)
    monkeypatch.setattr(sim, "timed_passes", spy)
    args = [str(rows), "--stage-dir", str(stages), "--tp", "2", "--layers", "2", "--profile-stages", "2",
            "--bandwidth-mbps", "150", "--modes", "naive,continuous", "--out-dir", str(tmp_path / "o")]
    assert main(args) == 0
    with_passes = sorted(c for c in calls if c[1] > 0)
    assert with_passes == [("continuous", 1), ("naive", 1)]   # once per table row; the bisection and TP: pass 0
    assert {m for m, k in calls if k == 0} >= {"naive", "continuous", "tp"}
    calls.clear()
    assert main([*args, "--direct-passes", "0"]) == 0 and calls and all(k == 0 for _, k in calls)
