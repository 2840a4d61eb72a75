"""The what-if simulator (pipeline/tools/simulate/): timing math, replay exactness across stage counts, and
agreement with a real emulated multi-process run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from config.profiles import Profile
from pipeline.tools.simulate import (Deadlock, DirectTimes, ScheduledDirect, TimingConfig, decode_times, main,
                               simulate_timing)
from model.split import split_checkpoint
from tests.helpers import REPO, hf_greedy, launch, read_jsonl, tiny_llama

PROF = Profile.from_dict({
    "name": "toy", "stage": {"model": "analytic", "overhead_s": 0.010},
    "rank0": {"lm_head": {"model": "analytic", "overhead_s": 0.002},
              "draft_forward": {"model": "analytic", "overhead_s": 0.003}},
    "link": {"latency_s": 0.001, "bandwidth_mbps": 8, "hidden_bytes_per_token": 100, "header_bytes": 0}})


# -- timing math ------------------------------------------------------------------------------------------
def test_timing_of_one_round_by_hand():
    # 1 us per byte on the links (8 Mbit/s), 1 ms latency, 10 ms per stage op, 2 ms lm_head, 3 ms draft forward
    logs = [
        [("mark", "decode_begin"), ("host", 0.0005), ("draft", 4, 0, 9.0), ("send", 1, 0, 50), ("recv", 2),
         ("lm_head", 4, 1.0, 9.0), ("mark", "gen_end")],
        [("recv", 0), ("compute", 4, 10), ("send", 2, 4, 0)],
        [("recv", 1), ("compute", 4, 10), ("send", 0, 4, 0)],
    ]
    marks = simulate_timing(logs, TimingConfig(PROF))
    t_send0 = 0.0005 + 0.003 + 50e-6 + 0.001          # host, draft, 50 B, latency
    t_r1 = t_send0 + 0.010 + 400e-6 + 0.001            # compute, 4 rows x 100 B, latency
    t_r2 = t_r1 + 0.010 + 400e-6 + 0.001
    end = t_r2 + 0.002                                 # lm_head
    assert decode_times(marks) == [pytest.approx(end, abs=1e-12)]
    # dilation scales modeled work and links but not measured host work
    marks2 = simulate_timing(logs, TimingConfig(PROF, time_scale=2.0))
    assert decode_times(marks2)[0] == pytest.approx(0.0005 + 2 * (end - 0.0005), abs=1e-12)
    # rank 0 at its recorded CPU time instead of the profile (9 s per op recorded above)
    marks3 = simulate_timing(logs, TimingConfig(PROF, model_rank0=False))
    assert decode_times(marks3)[0] == pytest.approx(end - 0.005 + 18.0, abs=1e-9)

    # the what-if of a free rank 0: its host, draft and lm_head work take no time; stages and links unchanged
    marks4 = simulate_timing(logs, TimingConfig(PROF, rank0_cost_scale=0.0))
    assert decode_times(marks4)[0] == pytest.approx(end - 0.0005 - 0.003 - 0.002, abs=1e-12)
    marks5 = simulate_timing(logs, TimingConfig(PROF, rank0_cost_scale=2.0, op_overhead_s=0.001))
    # rank 0's two modeled ops and its host work double (with their overhead); the two stage ops gain 1 ms each
    assert decode_times(marks5)[0] == pytest.approx(end + 0.0005 + 0.003 + 0.002 + 2 * 2 * 0.001 + 2 * 0.001,
                                                    abs=1e-12)


def test_links_serialise_and_receivers_wait():
    # two 1000-byte messages back to back: the second leaves when the first is on the wire (1 ms each)
    logs = [[("send", 1, 0, 1000), ("send", 1, 0, 1000), ("mark", "sent")],
            [("host", 0.0001), ("recv", 0), ("mark", "first"), ("recv", 0), ("mark", "second"),
             ("compute", 1, 0), ("mark", "computed")]]
    marks = dict(simulate_timing(logs, TimingConfig(PROF)))
    assert marks["sent"] == 0.0                          # sends never block the sender
    assert marks["first"] == pytest.approx(0.001 + 0.001)
    assert marks["second"] == pytest.approx(0.002 + 0.001)
    assert marks["computed"] == pytest.approx(0.003 + 0.010)


def test_rank0_turnaround_by_hand():
    """Rank 0's turnaround: result in hand (end of its recv from the last stage) -> start of its next ring send;
    a result followed by no send has none; stage step = mean stage compute; windows are kept apart."""
    from pipeline.tools.simulate.report import rank0_turnaround
    tl = [(0, ("send", 1, 4, 0), 0.000, 0.000),
          (1, ("compute", 4, 0), 0.001, 0.011), (2, ("compute", 4, 0), 0.012, 0.022),
          (0, ("recv", 2), 0.000, 0.023),                  # result in hand at 23 ms
          (0, ("lm_head", 4, 1.0, 0.0), 0.023, 0.025),
          (0, ("dsend", 1, 16), 0.025, 0.025),             # a direct decision is not the next segment
          (0, ("send", 1, 4, 0), 0.026, 0.026),            # turnaround 3 ms
          (0, ("recv", 2), 0.026, 0.050),                  # a result that sends nothing: no turnaround
          (0, ("recv", 2), 0.050, 0.060),
          (0, ("send", 1, 4, 0), 0.061, 0.061),            # 1 ms
          (1, ("compute", 4, 0), 0.030, 0.050),
          (0, ("recv", 2), 0.200, 0.210),                  # second window
          (0, ("send", 1, 4, 0), 0.215, 0.215),
          (1, ("compute", 4, 0), 0.220, 0.226)]
    a, b = rank0_turnaround(tl, [(0.0, 0.1), (0.2, 0.3)], 3)
    assert (a["turnarounds"], b["turnarounds"]) == (2, 1)
    assert a["turnaround_s"] == pytest.approx(0.004) and b["turnaround_s"] == pytest.approx(0.005)
    assert (a["stage_steps"], b["stage_steps"]) == (3, 1)
    assert a["stage_step_s"] == pytest.approx(0.040) and b["stage_step_s"] == pytest.approx(0.006)


def test_turnaround_calls_by_hand():
    """The calls inside rank 0's turnarounds, summed per window: the first lm_head after a result is the verify, a
    result that sends nothing before the next one counts nothing, a direct decision's send is not the ring send."""
    from pipeline.tools.simulate.report import rank0_turnaround, turnaround_calls
    tl = [(0, ("recv", 2), 0.000, 0.010),
          (0, ("host", 0.001), 0.010, 0.011),
          (0, ("lm_head", 4, 1.0, 0.0), 0.011, 0.013),
          (0, ("dsend", 1, 16), 0.013, 0.013),
          (0, ("draft", 3, 10, 0.0), 0.013, 0.016),
          (0, ("lm_head", 4, 1.0, 0.0), 0.016, 0.018),
          (0, ("send", 1, 4, 0), 0.018, 0.018),            # turnaround 8 ms: 1 host + 2 verify + 3 draft + 2 draft lm
          (0, ("recv", 2), 0.020, 0.030),
          (0, ("lm_head", 4, 1.0, 0.0), 0.030, 0.031),     # nothing sent before the next result: not counted
          (0, ("recv", 2), 0.040, 0.050),
          (0, ("lm_head", 4, 1.0, 0.0), 0.050, 0.052),
          (0, ("send", 1, 4, 0), 0.052, 0.052)]            # 2 ms of verify
    (c,) = turnaround_calls(tl, [(0.0, 0.1)], 3)
    (ta,) = rank0_turnaround(tl, [(0.0, 0.1)], 3)
    assert c["turnarounds"] == ta["turnarounds"] == 2
    assert c["lm_head (verify)"] == pytest.approx(0.004) and c["lm_head (draft)"] == pytest.approx(0.002)
    assert c["host"] == pytest.approx(0.001) and c["draft"] == pytest.approx(0.003)
    assert sum(v for k, v in c.items() if k != "turnarounds") == pytest.approx(ta["turnaround_s"])


def test_deadlock_is_reported():
    with pytest.raises(Deadlock, match="recv"):
        simulate_timing([[("recv", 1)], [("recv", 0)]], TimingConfig(PROF))


def test_direct_decisions_timing_and_schedule():
    # rank 0 issues two direct decisions to stage 2 (100 B each: 100 us on the 8 Mbit/s link, 1 ms latency) at
    # t = 0 and t = 5 ms; stage 2 polls at 0.5 ms, 3 ms and 7 ms
    logs = [[("dsend", 2, 100), ("host", 0.005), ("dsend", 2, 100), ("mark", "decode_begin")],
            [],
            [("host", 0.0005), ("poll", 0), ("host", 0.0025), ("poll", 1), ("host", 0.004), ("poll", 2)]]
    d = DirectTimes()
    simulate_timing(logs, TimingConfig(PROF), None, d)
    assert d.arrivals[2] == [pytest.approx(0.0011), pytest.approx(0.0061)]
    assert [t for t, _ in d.polls[2]] == [pytest.approx(0.0005), pytest.approx(0.003), pytest.approx(0.007)]
    assert d.schedule(3) == [[], [], [0, 1, 2]]     # what had arrived by each poll: the next pass's delivery
    assert d.late() == (0, 2)                        # decisions 1 and 2 were received after their arrival
    early = DirectTimes()
    simulate_timing([logs[0], [], [("poll", 1), ("host", 0.01), ("poll", 2)]], TimingConfig(PROF), None, early)
    assert early.late() == (1, 2)                    # the first poll took decision 1 before it could arrive


def test_scheduled_direct_delivers_on_schedule():
    sd = ScheduledDirect(4, upto=[[], [], [0, 2, 2], [1]], wait_s=0.2)
    sd.issue("d1")
    sd.issue("d2")
    assert sd.take(2) == ([], 0)
    assert sd.take(2) == (["d1", "d2"], 2)
    assert sd.take(2) == ([], 2)                      # nothing new: delivered decisions are never repeated
    assert sd.take(2) == ([], 2)                      # beyond the schedule: nothing more (ring copies only)
    assert sd.take(1) == ([], 0)                      # stage 1 gets every decision on the ring
    sd3 = ScheduledDirect(4, upto=[[], [], [], [3]], wait_s=0.2)
    with pytest.raises(RuntimeError, match="never issued"):
        sd3.take(3)


# -- replay exactness on the default model ------------------------------------------------------------------
DEFAULT_ROOT = REPO / "checkpoints" / "SmolLM2-135M-Instruct"
STAGES_5 = DEFAULT_ROOT / "stages_0+8+8+7+7"
HEAD = REPO / "draft" / "heads" / "SmolLM2-135M-Instruct"
MODES = ["naive", "pruned", "pipedec", "continuous"]


@pytest.mark.skipif(not STAGES_5.is_dir(), reason="default model not converted (run_tests.sh converts it)")
def test_replay_equals_a_real_run_with_the_trained_head(tmp_path):
    """Replay one recorded answer on 4 layer stages: every mode's accepted tokens per step equal those of a real
    (threaded) run with 4 stages, with the trained head (partial acceptance). Replays on another stage count (2) are
    compared with real runs by test_simulator_reproduces_an_emulated_run (each mode's tau from the replay equals the
    recorded 2-stage rows'); a second real SmolLM2 run on 2 stages here was dropped in issue 43's suite cut
    (docs/results.md §79: about 40% of this test's time)."""
    from transformers import AutoTokenizer

    from config.run_config import DEFAULT, apply_overrides
    from model.stage_model import load_stage
    from model.prompts import chat_prompt_ids
    from pipeline.build import make_drafter
    from config.profiles import load_profile
    from pipeline.tools.simulate import TargetFeatures, replay
    from pipeline.inprocess import run_threaded

    tok = AutoTokenizer.from_pretrained(STAGES_5 / "stage_model_0")
    prompt = chat_prompt_ids(tok, ["List three uses of copper."], [])
    over = ["max_new_tokens=20", "dtype=float32"]
    real = run_threaded(STAGES_5, [prompt], MODES, over, set(), str(HEAD), torch.float32)
    output = real["naive"][0].output_ids
    row = {"prompt_ids": prompt, "output_ids": output, "mode": "naive", "world_size": 5}

    cfg = apply_overrides(DEFAULT, over)
    model0 = load_stage(STAGES_5, 0, 5)
    drafter = make_drafter(cfg, STAGES_5, model0, torch.float32, "cpu")
    feats = TargetFeatures(STAGES_5)
    pruned_rows = 0
    stages = 4
    for mode in MODES:
        got = real[mode][0]
        assert got.output_ids == output
        s = replay([row], mode, stages, cfg, drafter, model0.config.vocab_size, feats)
        (g,) = s.gens
        assert g.accept_lengths == got.accept_lengths, mode
        assert g.pipeline_steps == got.pipeline_steps, mode
        if mode in ("continuous", "pipedec"):
            # a direct-decision pass: stages prune work in flight, rank 0's schedule is unchanged
            d = DirectTimes()
            simulate_timing([log.ops for log in s.logs], TimingConfig(load_profile("edge_orin_7b")), None, d)
            s2 = replay([row], mode, stages, cfg, drafter, model0.config.vocab_size, feats, None,
                        d.schedule(stages + 1))
            assert s2.gens[0].accept_lengths == got.accept_lengths
            rows = [sum(op[1] for op in log.ops if op[0] == "compute") for log in (s.logs[2], s2.logs[2])]
            assert rows[1] <= rows[0], (mode, rows)
            pruned_rows += rows[0] - rows[1]
    assert max(r[0].tau for r in real.values()) > 1.5        # the head really drafts (not a trivial case)
    assert pruned_rows > 0                                   # direct decisions spared stage 2 some rows


# -- agreement with a real emulated run -----------------------------------------------------------------------
# edge-like magnitudes (edge_orin_7b: ~25 ms per stage step, ~2-4 ms per rank-0 op, 150 Mbit/s, 8 KiB per row);
# the stage time depends on rows and context so that pruning and segment sizes matter
SIM_PROFILE = {
    "name": "sim_check",
    "stage": {"model": "analytic", "overhead_s": 0.030, "flops_per_token": 1e6, "peak_flops": 1e9},
    "rank0": {"lm_head": {"model": "analytic", "overhead_s": 0.003},
              "draft_forward": {"model": "analytic", "overhead_s": 0.004}},
    "link": {"latency_s": 0.0005, "bandwidth_mbps": 150, "hidden_bytes_per_token": 8192, "header_bytes": 384}}


# The emulated run is dilated 2x (emu.time_scale, and the simulator's --time-scale to match): the profile's sleeps
# then outweigh this host's per-event overhead (gloo, wake-ups), which grows with the suite's load and is what the
# ar-fitted calibration cannot follow mode by mode. Measured at load ~7 (3 benches beside it), largest |error|:
# scale 1 raw 0.189, calibrated 0.059; scale 2 raw 0.089, calibrated 0.032 (+16 s of test time); pipedec reached
# -0.103 calibrated at scale 1 in a full-suite run (docs/results.md §88). The 10% bound is unchanged.
# Scale 3 since 2026-11-30: two CI runs in a row at scale 2 missed the bound in the full suite (pruned calibrated
# 0.116 and 0.102, the ar-fitted overhead 2.25 ms per event, 5x what the test measures beside one other job:
# 0.4-0.6 ms); alone, or beside one job, scale 2 and 3 both stay under 0.01 calibrated (+20 s of test time).
SIM_TIME_SCALE = float(os.environ.get("SIM_TIME_SCALE", "3"))


def test_simulator_reproduces_an_emulated_run(tmp_path):
    """Real 3-rank emulated run (processes, gloo, sleeping to the profile) vs the simulator's prediction of the
    same rows: total decode time of every mode within 10%."""
    full = tiny_llama(tmp_path / "full", layers=4, vocab=320, dtype=torch.float64)
    stages = Path(split_checkpoint(full, tmp_path / "stages", [0, 2, 2], progress=False))
    prof = tmp_path / "sim_check.json"
    prof.write_text(json.dumps(SIM_PROFILE))
    rows_path = tmp_path / "rows.jsonl"
    modes = ["ar", "naive", "pruned", "pipedec", "continuous"]
    common = [f"model.stage_dir={stages}", "dtype=float64", "max_new_tokens=20", "tree.total_token=24",
              "tree.init_total_token=24", "tree.expand_total_token=16"]
    args = [*common, "comm.timeout_s=60", f"emu.profile={prof}", f"emu.time_scale={SIM_TIME_SCALE}",
            "--modes", ",".join(modes), "--output", str(rows_path), "--quiet"]
    for p in ([1, 5, 9, 13, 22, 7], [1, 40, 41, 42]):
        args += ["--prompt-ids", ",".join(map(str, p))]
    launch(3, args, timeout=400)
    rows = read_jsonl(rows_path)
    assert len(rows) == 2 * len(modes)
    assert rows[0]["output_ids"] == hf_greedy(full, rows[0]["prompt_ids"], 20, {2}, torch.float64)

    # raw: ideal transport (what a host fast enough for the profile would measure); calibrated: one per-event
    # overhead of this host's testbed fitted on the ar rows, validated on the four other modes
    out = tmp_path / "sim"
    dilated = ["--profile", str(prof), "--time-scale", str(SIM_TIME_SCALE)]
    assert main([str(rows_path), *common, *dilated, "--out-dir", str(out), "--quiet"]) == 0
    assert len(read_jsonl(out / "predictions.jsonl")) == len(rows)
    raw = {r["mode"]: r for r in _csv(out / "summary.csv")}
    assert set(raw) == set(modes)
    # how the trees met the target: one block per tree mode (pipeline/tree_stats.py), none for ar
    assert {r["label"] for r in _csv(out / "tree_stats.csv")} == {f"{m}, 2 stages, T=0" for m in modes if m != "ar"}
    assert "coverage" in (out / "tree_stats.md").read_text()
    out_c = tmp_path / "sim_cal"
    assert main([str(rows_path), *common, *dilated, "--calibrate", "ar", "--out-dir", str(out_c),
                 "--quiet"]) == 0
    cal = {r["mode"]: r for r in _csv(out_c / "summary.csv")}
    overhead = read_jsonl(out_c / "predictions.jsonl")[0]["overhead_s"]
    print("raw errors", {m: raw[m]["error_total"] for m in modes}, "calibrated", {m: cal[m]["error_total"] for m in modes},
          "overhead", overhead)
    assert 0 <= overhead < 0.003                 # a plausible per-event cost, not a fudge factor
    for mode in modes:
        r = raw[mode]
        assert float(r["tau"]) == pytest.approx(
            sum(sum(x["accept_lengths"]) for x in rows if x["mode"] == mode)
            / sum(len(x["accept_lengths"]) for x in rows if x["mode"] == mode), abs=1e-3), mode
        assert -0.25 < float(r["error_total"]) < 0.05, (mode, r)     # ideal transport: never much slower
        assert abs(float(cal[mode]["error_total"])) < 0.10, (mode, cal[mode])
    # what-if: a faster link and twice the stages never make the same answers slower to decode in ar
    out2 = tmp_path / "sim2"
    assert main([str(rows_path), *common, "--profile", str(prof), "--modes", "ar,naive", "--stages", "2,4",
                 "--bandwidth-mbps", "150,1000", "--gantt", "0", "--out-dir", str(out2), "--quiet"]) == 0
    t2 = _csv(out2 / "summary.csv")
    assert len(t2) == 2 * 2 * 2
    assert (out2 / "gantt_naive_s4_bw1000.png").stat().st_size > 10_000
    for r in t2:
        assert 0 < float(r["stage_busy_min"]) <= float(r["stage_busy_mean"]) <= 1.0, r
        assert 0 < float(r["rank0_busy"]) <= 1.0, r
        assert 0 <= float(r["r0_turnaround_ms"]) and float(r["stage_step_ms"]) > 0, r
        assert float(r["turnaround_vs_step"]) == pytest.approx(
            float(r["r0_turnaround_ms"]) / float(r["stage_step_ms"]), rel=0.01, abs=1e-3), r
    xi = {(int(r["stages"]), float(r["bandwidth_mbps"]), r["mode"]): float(r["pred_xi"]) for r in t2}
    assert xi[(2, 1000.0, "ar")] >= xi[(2, 150.0, "ar")]
    for r in t2:   # ar: every token is a round; naive: every verification ends its round (one tree per step)
        assert float(r["tokens_per_round"]) == pytest.approx(1.0 if r["mode"] == "ar" else float(r["tau"]),
                                                             abs=1e-3), r
    # what-if: a rank 0 that takes no time is never slower, and is never busy
    out3 = tmp_path / "sim3"
    assert main([str(rows_path), *common, "--profile", str(prof), "--modes", "ar,naive", "--stages", "2",
                 "--bandwidth-mbps", "150", "--rank0-cost-scale", "0", "--out-dir", str(out3), "--quiet"]) == 0
    for r in _csv(out3 / "summary.csv"):
        assert float(r["rank0_busy"]) == 0.0, r
        assert float(r["pred_xi"]) > xi[(2, 150.0, r["mode"])], r


def _csv(path: Path) -> list[dict]:
    import csv
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_mode_sps_is_refused_with_one_line(tmp_path, capsys):
    import json
    from pipeline.tools.simulate import main
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"mode": "sps", "prompt_ids": [1, 5], "output_ids": [7, 2], "world_size": 5}) + "\n")
    assert main([str(rows), "--modes", "sps", "--stages", "4", "--no-plots", "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "does not replay mode sps" in err and "Traceback" not in err


def test_negative_rank0_cost_scale_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["rows.jsonl", "--rank0-cost-scale", "-1"])
    assert e.value.code == 2 and "--rank0-cost-scale -1.0 must be >= 0" in capsys.readouterr().err


def test_calibrating_a_what_if_rank0_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["rows.jsonl", "--calibrate", "ar", "--rank0-cost-scale", "0"])
    assert e.value.code == 2 and "--calibrate" in capsys.readouterr().err


def test_sampled_drafts_are_replayed_deterministic_at_t_above_0(tmp_path, capsys):
    """The stand-in target knows only the recorded token, so it cannot price a sampled draft's acceptance: rows at
    T > 0 are replayed with deterministic drafts, and the simulator says so (rows at T = 0 need no note)."""
    full = tiny_llama(tmp_path / "full", layers=2, vocab=96, dtype=torch.float64)
    stages = Path(split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False))
    rows = tmp_path / "rows.jsonl"
    g = torch.Generator().manual_seed(0)
    out_ids = torch.randint(3, 96, (12,), generator=g).tolist()
    rows.write_text(json.dumps({"mode": "naive", "temperature": 1.0, "prompt_ids": [1, 5, 9], "output_ids": out_ids,
                                "world_size": 3}) + "\n")
    common = [str(rows), "--modes", "naive,continuous", "--stages", "2", "--no-plots", "--quiet",
              f"model.stage_dir={stages}", "dtype=float64", "max_new_tokens=12", "temperature=1.0",
              "draft.sources=eagle", "draft.eagle_sample=true"]
    assert main([*common, "--out-dir", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "replayed with deterministic drafts" in err and "Traceback" not in err
    assert len(read_jsonl(tmp_path / "o" / "predictions.jsonl")) == 2


def _tiny_rows(tmp_path, n_out=16, temperature=0.0, vocab=96):
    """A 2-stage tiny model and one recorded answer (random tokens: the stand-in target emits what was recorded)."""
    full = tiny_llama(tmp_path / "full", layers=2, vocab=vocab, dtype=torch.float64)
    stages = Path(split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False))
    rows = tmp_path / "rows.jsonl"
    g = torch.Generator().manual_seed(0)
    out_ids = torch.randint(3, vocab, (n_out,), generator=g).tolist()
    rows.write_text(json.dumps({"mode": "naive", "temperature": temperature, "prompt_ids": [1, 5, 9],
                                "output_ids": out_ids, "world_size": 3}) + "\n")
    return rows, stages


def test_hooks_see_every_pass_and_every_timed_session(tmp_path):
    """A Python caller's :class:`Hooks` (what scripts/round_start_bound.py uses instead of patching the replayed
    code): the observers see every verified step of every replay pass, the decoder factory builds every
    generation's decoder, and ``on_timed`` gets each (mode, stages, link)'s final session."""
    from pipeline.modes import new_decoder
    from pipeline.tools.simulate.replayer import Hooks
    rows, stages = _tiny_rows(tmp_path)
    steps, built, timed = [], [], []
    hooks = Hooks(observers=(lambda tree, path, token, finished: steps.append((len(path), finished)),),
                  decoder=lambda mode: built.append(mode) or new_decoder(mode),
                  on_timed=lambda session, tc: timed.append((session.mode, session.stages, len(session.ops()))))
    out = tmp_path / "o"
    assert main([str(rows), "--modes", "naive,continuous", "--stages", "2", "--bandwidth-mbps", "150,1000",
                 "--no-plots", "--quiet", f"model.stage_dir={stages}", "dtype=float64", "max_new_tokens=16",
                 "--out-dir", str(out)], hooks) == 0
    preds = read_jsonl(out / "predictions.jsonl")
    assert sorted(timed) == sorted([(m, 2, 3) for m in ("naive", "continuous") for _ in range(2)])
    # every pass replays the generation again: the first pass and one direct-decision pass per link (continuous)
    passes = {m: built.count(m) for m in ("naive", "continuous")}
    assert passes["naive"] >= 1 and passes["continuous"] >= 1 and len(built) == sum(passes.values())
    per_pass = {m: len(next(p for p in preds if p["mode"] == m)["accept_lengths"]) for m in passes}
    assert len(steps) == sum(per_pass[m] * passes[m] for m in passes), (len(steps), per_pass, passes)
    assert sum(f for _, f in steps) == len(built)        # each generation's last step finishes it


def test_each_replay_drafts_as_the_first(tmp_path, monkeypatch):
    """The simulator replays the same answers once per mode and pass; a drafter with memory of earlier requests
    (the suffix source's store) would copy the earlier replays' answers into the later ones (docs/results.md §89:
    the what-if's `continuous` τ 1.86 -> 2.46). Each replay forgets them (draft.protocol.forget_requests): `naive`
    replayed after `pruned` accepts exactly what it accepts alone; with the forgetting removed (planted) it accepts
    more per step."""
    import pipeline.tools.simulate.replayer as replayer
    rows, stages = _tiny_rows(tmp_path)
    common = ["--stages", "2", "--no-plots", "--quiet", "--gantt", "0", f"model.stage_dir={stages}", "dtype=float64",
              "max_new_tokens=16", "draft.sources=suffix", "draft.suffix_threshold=1"]

    def naive_accepts(modes: str, out: str) -> list:
        assert main([str(rows), "--modes", modes, *common, "--out-dir", str(tmp_path / out)]) == 0
        return [p["accept_lengths"] for p in read_jsonl(tmp_path / out / "predictions.jsonl") if p["mode"] == "naive"]
    alone = naive_accepts("naive", "alone")
    assert naive_accepts("pruned,naive", "after") == alone
    monkeypatch.setattr(replayer, "forget_requests", lambda d: None)
    leaked = naive_accepts("pruned,naive", "leaked")
    assert len(leaked[0]) < len(alone[0]), (leaked, alone)
