"""Rank 0's host work priced per operator (pipeline/tools/simulate/pricing.py, issue 41 item 4): the pure pricing,
its use in the timing model, the op log's counts, where the costs come from, and one counted replay end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config.profiles import EmulationError, HostCost, Profile
from pipeline.tools.simulate import TimingConfig, decode_times, main, simulate_timing
from pipeline.tools.simulate.oplog import OpLog
from pipeline.tools.simulate.pricing import (MEASURED, PricingError, Rank0Pricing, host_cost_for, host_seconds,
                                             resolve)

RAW = {"name": "toy", "stage": {"model": "analytic", "overhead_s": 0.010},
       "rank0": {"lm_head": {"model": "analytic", "overhead_s": 0.002},
                 "draft_forward": {"model": "analytic", "overhead_s": 0.003}},
       "link": {"latency_s": 0.001, "bandwidth_mbps": 8, "hidden_bytes_per_token": 100, "header_bytes": 0}}
PROF = Profile.from_dict(RAW)
OPS = Rank0Pricing("ops", HostCost(op_us=10.0, sync_us=50.0, source="test"))


# -- the pure pricing -----------------------------------------------------------------------------------------
def test_host_seconds_is_counts_times_costs():
    op = ("host", 0.004, 120, 3)
    assert host_seconds(op, MEASURED) == 0.004
    assert host_seconds(op, Rank0Pricing("zero")) == 0.0
    assert host_seconds(op, OPS) == pytest.approx(120 * 10e-6 + 3 * 50e-6, abs=1e-15)
    # a planted wrong count or cost changes the price by exactly its share
    assert host_seconds(("host", 0.004, 121, 3), OPS) - host_seconds(op, OPS) == pytest.approx(10e-6, abs=1e-15)
    assert host_seconds(("host", 0.004, 120, 4), OPS) - host_seconds(op, OPS) == pytest.approx(50e-6, abs=1e-15)
    dearer = Rank0Pricing("ops", HostCost(op_us=11.0, sync_us=50.0))
    assert host_seconds(op, dearer) - host_seconds(op, OPS) == pytest.approx(120e-6, abs=1e-15)
    # measured time never leaks into an op-priced figure, and counts are required
    assert host_seconds(("host", 9.0, 120, 3), OPS) == host_seconds(op, OPS)
    with pytest.raises(PricingError, match="no operator counts"):
        host_seconds(("host", 0.004), OPS)


def test_ops_pricing_needs_costs_and_a_known_mode():
    with pytest.raises(PricingError, match="needs per-operator costs"):
        Rank0Pricing("ops")
    with pytest.raises(PricingError, match="choose one of"):
        Rank0Pricing("free")
    assert "10 us/op, 50 us/sync" in OPS.label() and MEASURED.label().startswith("measured")


# -- the timing model -----------------------------------------------------------------------------------------
def logs_with_counts(r0_ops: int = 200, r0_syncs: int = 2):
    return [
        [("mark", "decode_begin"), ("host", 0.0005, r0_ops, r0_syncs), ("draft", 4, 0, 9.0), ("send", 1, 0, 50),
         ("recv", 2), ("lm_head", 4, 1.0, 9.0), ("mark", "gen_end")],
        [("recv", 0), ("host", 0.0007), ("compute", 4, 10), ("send", 2, 4, 0)],
        [("recv", 1), ("compute", 4, 10), ("send", 0, 4, 0)],
    ]


def test_timing_prices_rank0_host_work_by_its_counts():
    measured = decode_times(simulate_timing(logs_with_counts(), TimingConfig(PROF)))[0]
    ops = decode_times(simulate_timing(logs_with_counts(), TimingConfig(PROF, rank0_pricing=OPS)))[0]
    zero = decode_times(simulate_timing(logs_with_counts(), TimingConfig(PROF, rank0_pricing=Rank0Pricing("zero"))))[0]
    priced = 200 * 10e-6 + 2 * 50e-6
    assert measured - zero == pytest.approx(0.0005, abs=1e-12)      # rank 0's host op is the only difference
    assert ops - zero == pytest.approx(priced, abs=1e-12)
    # the stage's own host op (0.7 ms) stays measured under every pricing: it is in all three
    assert zero == pytest.approx(0.0007 + 0.003 + 50e-6 + 0.001 + 2 * (0.010 + 400e-6 + 0.001) + 0.002, abs=1e-12)
    # a planted wrong count moves the prediction by exactly its price
    more = decode_times(simulate_timing(logs_with_counts(r0_ops=300), TimingConfig(PROF, rank0_pricing=OPS)))[0]
    assert more - ops == pytest.approx(100 * 10e-6, abs=1e-12)
    # --rank0-cost-scale still multiplies the priced host work like every other rank-0 op
    half = decode_times(simulate_timing(logs_with_counts(), TimingConfig(PROF, rank0_pricing=OPS,
                                                                         rank0_cost_scale=0.5)))[0]
    assert ops - half == pytest.approx(0.5 * (priced + 0.003 + 0.002), abs=1e-12)


# -- the op log's counts ---------------------------------------------------------------------------------------
def test_oplog_host_ops_carry_the_operators_between_logged_ops():
    from pipeline.tools.opcount import OpCounter
    w = torch.randn(4, 4)
    log = OpLog()
    with OpCounter(w) as c:
        log.count(c)
        x = (w @ w).sum()            # 2 operators on a device tensor ...
        float(x)                     # ... and a read of it: 1 operator, 1 sync
        log.add("send", 1, 0, 8)
        with log.modeled("draft", 4, 0):
            torch.ones(3) + 1        # model work: priced by the profile, never as host work
        with log.untimed():
            torch.zeros(2) * 3       # instrumentation: neither timed nor counted
        torch.arange(5).tolist()     # 1 operator (tolist reads a host tensor: no operator, no sync)
        log.add("recv", 2)
    hosts = [op for op in log.ops if op[0] == "host"]
    assert all(len(op) == 4 for op in hosts)
    assert [op[2:] for op in hosts if op[2:] != (0, 0)] == [(3, 1), (1, 0)]
    # a planted extra operator shows up in the count
    log2 = OpLog()
    with OpCounter(w) as c:
        log2.count(c)
        x = (w @ w).sum() + 1
        float(x)
        log2.add("send", 1, 0, 8)
    assert [op[2:] for op in log2.ops if op[0] == "host" and op[2:] != (0, 0)] == [(4, 1)]


# -- where the costs come from ---------------------------------------------------------------------------------
def test_profiles_carry_host_costs_and_reject_bad_ones(tmp_path):
    p = Profile.from_dict({**RAW, "rank0_host": {"op_us": 20, "sync_us": 40, "notes": "assumed"}}, "p.json")
    assert (p.rank0_host.op_us, p.rank0_host.sync_us) == (20.0, 40.0)
    for bad in ({"op_us": -1, "sync_us": 4}, {"op_us": 1}, {"op_us": 1, "sync_us": 2, "launch_us": 3},
                {"op_us": True, "sync_us": 2}):
        with pytest.raises(EmulationError, match="rank0_host"):
            Profile.from_dict({**RAW, "rank0_host": bad}, "p.json")


def test_host_costs_come_from_flags_then_the_profile_then_a_named_file(tmp_path):
    (tmp_path / "toy.json").write_text(json.dumps({"op_us": 7, "sync_us": 9, "derivation": "x"}))
    assert host_cost_for(PROF, cost_dir=tmp_path / "none") is None
    filed = host_cost_for(PROF, cost_dir=tmp_path)
    assert (filed.op_us, filed.sync_us) == (7.0, 9.0) and "toy.json" in filed.source
    own = Profile.from_dict({**RAW, "rank0_host": {"op_us": 20, "sync_us": 40}})
    assert host_cost_for(own, cost_dir=tmp_path).op_us == 20.0
    mixed = host_cost_for(own, op_us=5.0, cost_dir=tmp_path)
    assert (mixed.op_us, mixed.sync_us) == (5.0, 40.0) and "--rank0-op-us" in mixed.source
    with pytest.raises(PricingError, match="both"):
        host_cost_for(PROF, op_us=5.0, cost_dir=tmp_path / "none")
    assert resolve("measured", PROF) == MEASURED
    with pytest.raises(PricingError, match="must be >= 0"):
        resolve("ops", PROF, -1.0, 2.0)


def test_shipped_host_costs_load():
    from config.profiles import load_profile
    edge = resolve("ops", load_profile("edge_orin_7b"))
    assert (edge.cost.op_us, edge.cost.sync_us) == (20.0, 40.0)
    h100 = host_cost_for(Profile.from_dict({**RAW, "name": "h100_7b_fp16"}))
    assert h100 is not None and h100.op_us == 10.0


def test_pricing_flags_are_usage_errors_where_they_cannot_apply(capsys):
    with pytest.raises(SystemExit) as e:
        main(["rows.jsonl", "--rank0-op-us", "5"])
    assert e.value.code == 2 and "--rank0-cost ops" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["rows.jsonl", "--calibrate", "ar", "--rank0-cost", "ops"])
    assert e.value.code == 2 and "--calibrate" in capsys.readouterr().err


# -- a counted replay, end to end -------------------------------------------------------------------------------
def test_counted_replay_prices_rank0_by_its_operators(tmp_path, capsys):
    """``--rank0-cost ops`` replays rank 0 under the operator counter: every prediction says how it was priced and
    carries rank 0's counts, which are the same in two replays (deterministic, hence device-independent); a
    profile without host costs is one error line."""
    from model.split import split_checkpoint
    from tests.helpers import read_jsonl, tiny_llama
    full = tiny_llama(tmp_path / "full", layers=2, vocab=96, dtype=torch.float64)
    stages = Path(split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False))
    rows = tmp_path / "rows.jsonl"
    g = torch.Generator().manual_seed(0)
    rows.write_text(json.dumps({"mode": "continuous", "temperature": 0.0, "prompt_ids": [1, 5, 9],
                                "output_ids": torch.randint(3, 96, (10,), generator=g).tolist(),
                                "world_size": 3}) + "\n")
    prof = tmp_path / "toy.json"
    prof.write_text(json.dumps(RAW))
    common = [str(rows), "--modes", "continuous", "--stages", "2", "--no-plots", "--quiet", "--profile", str(prof),
              f"model.stage_dir={stages}", "dtype=float64", "max_new_tokens=10", "draft.sources=eagle"]
    preds = []
    for k in range(2):
        assert main([*common, "--rank0-cost", "ops", "--rank0-op-us", "10", "--rank0-sync-us", "50",
                     "--out-dir", str(tmp_path / f"o{k}")]) == 0
        preds.append(read_jsonl(tmp_path / f"o{k}" / "predictions.jsonl")[0])
    err = capsys.readouterr().err
    assert "rank 0's host work priced: ops (10 us/op, 50 us/sync" in err
    assert preds[0]["rank0_cost"].startswith("ops (10 us/op") and preds[0]["r0_host_ops"] > 0
    assert (preds[0]["r0_host_ops"], preds[0]["r0_host_syncs"]) == (preds[1]["r0_host_ops"], preds[1]["r0_host_syncs"])
    assert "Rank 0's host work priced: ops (10 us/op" in (tmp_path / "o0" / "summary.md").read_text()
    assert main([*common, "--rank0-cost", "ops", "--out-dir", str(tmp_path / "o2")]) == 2
    assert "needs per-operator costs" in capsys.readouterr().err


def test_profile_tool_measures_host_costs(tmp_path):
    """``pipeline.tools.profile --host-only`` writes a rank0_host file the simulator reads; a full profile carries
    the same field."""
    from pipeline.tools.profile import main as profile_main
    out = tmp_path / "rank0_host" / "toy.json"
    assert profile_main(["--host-only", "--device", "cpu", "--host-rounds", "50", "--repeat", "1", "--out", str(out),
                         "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["op_us"] > 0 and doc["sync_us"] >= 0 and doc["measured"]["ops_per_round"] >= 6
    cost = host_cost_for(PROF, cost_dir=out.parent)
    assert cost.op_us == doc["op_us"] and cost.source.startswith("measured by pipeline.tools.profile")
    full = tmp_path / "p.json"
    assert profile_main(["--hidden", "32", "--intermediate", "64", "--heads", "4", "--kv-heads", "2", "--layers", "1",
                         "--vocab", "50", "--w", "1", "--ctx", "0", "--repeat", "1", "--warmup", "0", "--device", "cpu",
                         "--host-rounds", "50", "--out", str(full), "--quiet"]) == 0
    from config.profiles import load_profile
    assert load_profile(str(full)).rank0_host.op_us > 0
