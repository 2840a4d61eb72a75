"""Timeline (pipeline/tools/timeline.py) and benchmark (pipeline/tools/bench.py).

* synthetic traces: clock alignment, exact utilization numbers, windows, CSV and PNG output;
* bench aggregation and the T=0 losslessness check on synthetic rows;
* one real bench run (tiny random model, 3 ranks, 2 prompts, 8 new tokens, all modes in one launch, with
  ``--hf-generate``): tables, CSV, Gantt charts, every mode equal to ar and to HF generate, the
  summary naming the head. That run also holds the claim of the former ``tests/test_bench.py`` (a second launch of
  the same bench on stories260K, issue 43): hf_generate is no mode of the trace, every pipeline mode keeps its Gantt
  chart.
"""
import csv
import json

import pytest
import torch

from config.modes import COMPARED_MODES, MODE_LABELS
from pipeline.tools import bench, timeline
from pipeline.tools.rows import find_mismatches
from tests.helpers import hf_greedy, read_jsonl, tiny_llama


def _write(d, rank, events, t0_perf=None, t0_wall=None, host="h"):
    d.mkdir(parents=True, exist_ok=True)
    obj = {"rank": rank, "events": [{"name": n, "start": s, "end": e, **m} for n, s, e, *rest in events
                                    for m in [rest[0] if rest else {}]]}
    if t0_perf is not None:
        obj.update(t0_perf=t0_perf, t0_wall=t0_wall if t0_wall is not None else 1000.0 + t0_perf, host=host)
    (d / f"trace_rank{rank}.json").write_text(json.dumps(obj))


def _synthetic(d, host1="h"):
    # rank 0 starts at perf 100.0, rank 1 at 100.5: rank 1's local times are 0.5 s behind the common axis
    _write(d, 0, [("gen_begin", 0.0, 0.0, {"prompt_tokens": 7}), ("compute", 0.0, 0.2), ("decode_begin", 0.5, 0.5),
                  ("draft", 0.0, 1.0), ("recv", 1.0, 3.0), ("verify", 3.0, 3.5), ("lm_head", 3.2, 3.4),
                  ("send", 3.5, 3.6), ("gen_end", 4.0, 4.0, {"new_tokens": 9})], t0_perf=100.0)
    _write(d, 1, [("compute", 0.5, 1.5), ("recv", 1.5, 3.5), ("prune", 3.5, 3.55)], t0_perf=100.5, host=host1)


def test_turnaround_of_a_synthetic_trace(tmp_path):
    """Rank 0's turnaround on a real trace's events: recv end -> next send to rank 1 (sends to other ranks, e.g.
    direct decisions, do not count; a result followed by no send before the next recv has none)."""
    _write(tmp_path, 0, [("gen_begin", 0.0, 0.0), ("decode_begin", 0.0, 0.0), ("recv", 0.0, 1.0),
                         ("send", 1.1, 1.12, {"dst": 2}), ("send", 1.3, 1.31, {"dst": 1}), ("recv", 1.4, 2.0), ("recv", 2.0, 3.0),
                         ("send", 3.05, 3.06, {"dst": 1}), ("gen_end", 4.0, 4.0, {"new_tokens": 3})], t0_perf=0.0)
    _write(tmp_path, 1, [("compute", 1.4, 1.6), ("compute", 3.1, 3.5)], t0_perf=0.0)
    tl = timeline.load(tmp_path)
    ta = timeline.turnaround(tl, [timeline.choose_window(tl, generation=0)])
    assert ta["turnarounds"] == 2 and ta["turnaround_s"] == pytest.approx(0.3 + 0.05)
    assert ta["stage_steps"] == 2 and ta["stage_step_s"] == pytest.approx(0.6)
    assert "175.00 ms" in timeline.format_turnaround(ta)
    # an emulated link posts later than the caller hands over: the caller's hand-off marks count instead
    _write(tmp_path, 0, [("gen_begin", 0.0, 0.0), ("decode_begin", 0.0, 0.0), ("recv", 0.0, 1.0),
                         ("handoff", 1.02, 1.02, {"dst": 1}), ("recv", 1.03, 2.0), ("send", 1.3, 1.31, {"dst": 1}),
                         ("gen_end", 4.0, 4.0, {"new_tokens": 3})], t0_perf=0.0)
    ta = timeline.turnaround(timeline.load(tmp_path), [(0.0, 4.0)])
    assert ta["turnarounds"] == 1 and ta["turnaround_s"] == pytest.approx(0.02)


def test_synthetic_utilization_is_exact(tmp_path):
    _synthetic(tmp_path)
    tl = timeline.load(tmp_path)
    assert tl.alignment == "perf"
    gens = tl.generations()
    assert len(gens) == 1 and gens[0]["decode_begin"] == 0.5 and gens[0]["end"] == 4.0 and gens[0]["new_tokens"] == 9
    lo, hi = timeline.choose_window(tl, generation=0)
    assert (lo, hi) == (0.5, 4.0)
    u = {r["rank"]: r for r in timeline.utilization(tl, [(lo, hi)])}
    # rank 0 in [0.5, 4]: draft 0.5 + verify 0.5 (lm_head nested inside: counted once); recv 2.0; send 0.1
    assert u[0]["busy_s"] == pytest.approx(1.0, abs=1e-12)
    assert u[0]["busy_frac"] == pytest.approx(1.0 / 3.5, abs=1e-12)
    assert u[0]["wait_frac"] == pytest.approx(2.0 / 3.5, abs=1e-12)
    assert u[0]["send_frac"] == pytest.approx(0.1 / 3.5, abs=1e-12)
    assert u[0]["other_s"] == pytest.approx(0.4, abs=1e-12)
    assert u[0]["lm_head_s"] == pytest.approx(0.2, abs=1e-12) and u[0]["compute_s"] == 0.0
    # rank 1 shifted by +0.5 s: compute [1, 2], recv [2, 4], prune [4, 4.05] (outside)
    assert u[1]["busy_s"] == pytest.approx(1.0, abs=1e-12)
    assert u[1]["wait_s"] == pytest.approx(2.0, abs=1e-12)
    assert u[1]["prune_s"] == 0.0 and u[1]["other_s"] == pytest.approx(0.5, abs=1e-12)
    # a centred window and explicit bounds
    assert timeline.choose_window(tl, generation=0, window=1.0) == pytest.approx((1.75, 2.75))
    u2 = {r["rank"]: r for r in timeline.utilization(tl, [(1.5, 2.5)])}
    assert u2[0]["busy_frac"] == 0.0 and u2[0]["wait_frac"] == pytest.approx(1.0)
    assert u2[1]["busy_frac"] == pytest.approx(0.5) and u2[1]["wait_frac"] == pytest.approx(0.5)
    # two windows add up
    u3 = {r["rank"]: r for r in timeline.utilization(tl, [(0.0, 1.0), (3.0, 4.0)])}
    assert u3[0]["busy_s"] == pytest.approx(1.0 + 0.5) and u3[0]["window_s"] == pytest.approx(2.0)


def test_alignment_fallbacks(tmp_path):
    _synthetic(tmp_path / "two_hosts", host1="other")
    tl = timeline.load(tmp_path / "two_hosts")
    assert tl.alignment == "wall"   # wall anchors are 1000 + perf anchors: the same 0.5 s shift
    assert tl.ranks[1].offset == pytest.approx(0.5)
    _write(tmp_path / "bare", 0, [("compute", 0.0, 1.0)])
    _write(tmp_path / "bare", 1, [("compute", 0.5, 1.0)])
    tl = timeline.load(tmp_path / "bare")
    assert tl.alignment == "none" and tl.warnings and tl.ranks[1].offset == 0.0
    with pytest.raises(timeline.TimelineError):
        timeline.load(tmp_path / "missing")
    with pytest.raises(timeline.TimelineError):
        timeline.choose_window(tl, generation=0)   # no generation marks


def test_cli_writes_png_and_csv(tmp_path, capsys):
    _synthetic(tmp_path / "tr")
    png, out_csv = tmp_path / "g.png", tmp_path / "u.csv"
    assert timeline.main([str(tmp_path / "tr"), "--out", str(png), "--csv", str(out_csv), "--generation", "0"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["rank"] for r in rows] == ["0", "1"]
    assert float(rows[0]["busy_frac"]) == pytest.approx(1 / 3.5, abs=1e-6)
    assert float(rows[1]["wait_s"]) == pytest.approx(2.0, abs=1e-6)
    assert float(rows[0]["window_start_s"]) == 0.5 and float(rows[0]["window_end_s"]) == 4.0
    out = capsys.readouterr().out
    assert "| 0 | 28.6% | 57.1% |" in out
    assert timeline.main([str(tmp_path / "tr"), "--start", "2", "--end", "1"]) == 2
    with pytest.raises(SystemExit) as e:
        timeline.main(["--help"])
    assert e.value.code == 0


def _row(mode, qid, out, decode_s, acc, steps, busy, prompt=(1, 2)):
    return {"question_id": qid, "turn": 0, "mode": mode, "temperature": 0.0, "prompt_ids": list(prompt),
            "output_ids": list(out), "new_tokens": len(out), "decode_s": decode_s, "prefill_s": 0.1,
            "accept_lengths": acc, "pipeline_steps": steps, "busy_fraction": busy, "tau": 0}


def test_bench_aggregate_and_mismatch():
    rows = [_row("ar", 0, [5, 6, 7, 8], 2.0, [1, 1, 1], 3, [0.1, 0.5]),
            _row("ar", 1, [9, 9], 2.0, [1], 1, [0.3, 0.7]),
            _row("naive", 0, [5, 6, 7, 8], 1.0, [2, 1], 4, [0.5, 0.2]),
            _row("naive", 1, [9, 9], 0.5, [1], 2, [0.1, 0.4]),
            _row("continuous", 0, [5, 6, 7, 9], 0.5, [3], 2, [0.9, 0.9]),
            _row("continuous", 1, [9], 0.25, [1], 1, [0.9, 0.9])]
    agg = bench.aggregate(rows, ["ar", "naive", "continuous", "pipedec"])
    assert "pipedec" not in agg
    assert agg["ar"]["tps"] == pytest.approx(6 / 4.0) and agg["naive"]["tps"] == pytest.approx(6 / 1.5)
    assert agg["naive"]["speedup_ar"] == pytest.approx((6 / 1.5) / (6 / 4.0))
    assert agg["continuous"]["speedup_naive"] == pytest.approx((5 / 0.75) / (6 / 1.5))
    assert agg["naive"]["tau"] == pytest.approx(4 / 3) and agg["naive"]["tokens_per_step"] == pytest.approx(1.0)
    assert agg["ar"]["busy"] == pytest.approx([0.2, 0.6])
    bad, compared, unref = find_mismatches(rows)
    assert compared == 4 and unref == 0 and len(bad) == 2
    assert "question 0: continuous != ar: first difference at token 3" in bad[0]
    assert "question 1: continuous != ar" in bad[1]
    assert find_mismatches(rows[:4])[0] == []
    meta = {"stage_dir": "s", "head_dir": "h", "world": 2, "prompts": "p", "max_new_tokens": 4, "temperature": 0.0,
            "warmup": 0, "launch": "per-mode", "cpus": 2}
    md, text = bench.summarize(agg, {}, (bad, compared, unref), meta, {})
    assert "| `naive` | Chunk-PP | 2 | 6 | 1.50 | 4.00 | 1.00 | 2.67 | 1.33 | 1.00 | 30% | 30% |" in md
    assert "MISMATCH: 2 of 4" in md
    rows_csv = list(csv.DictReader(text.splitlines()))
    assert [r["mode"] for r in rows_csv] == ["ar", "naive", "continuous"]
    assert float(rows_csv[2]["tokens_per_s"]) == pytest.approx(5 / 0.75, abs=1e-4)


@pytest.fixture(scope="module")
def tiny_stages(tmp_path_factory):
    from model.split import split_checkpoint
    root = tmp_path_factory.mktemp("tiny_bench")
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    return full, split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)


PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 3]]


def _bench_main(argv: list[str]) -> int:
    """``pipeline.tools.bench.main`` in this process (one interpreter and torch import fewer than a subprocess,
    issue 43); the signal handlers it installs for its launches are put back after."""
    import signal
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return bench.main(argv)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_bench_tiny_model_end_to_end(tiny_stages, tmp_path, capsys):
    """All modes in one launch (``--launch single``) with ``--hf-generate``: every output equals HF greedy, every
    pipeline mode keeps its Gantt chart and trace shares (counting hf_generate as one more mode of the trace, the
    bug of tests/test_bench.py's former launch, gave each mode too few generations: the bench fails or a chart is
    missing), hf_generate gets none, and the summary names the draft head."""
    full, stages = tiny_stages
    out = tmp_path / "bench"
    argv = [f"model.stage_dir={stages}", "dtype=float64", "max_new_tokens=8",
            "comm.timeout_s=60", "--launch", "single", "--warmup", "1", "--out-dir", str(out), "--gantt-window", "0.05",
            "--hf-generate", "--quiet"]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    code = _bench_main(argv)
    assert code == 0, capsys.readouterr().err[-4000:]
    rows = read_jsonl(out / "rows.jsonl")
    assert sorted((r["mode"], r["question_id"]) for r in rows) == sorted(
        (m, q) for m in (*COMPARED_MODES, bench.HF) for q in range(len(PROMPTS)))
    ref = {q: hf_greedy(full, p, 8, {2}, torch.float64) for q, p in enumerate(PROMPTS)}
    for r in rows:
        assert r["output_ids"] == ref[r["question_id"]], f"{r['mode']} q{r['question_id']} differs from HF"
    md = (out / "summary.md").read_text()
    assert "All 10 generations of the speculative modes equal ar's" in md   # hf_generate's 2 included
    for m in COMPARED_MODES:
        assert f"| `{m}` | {MODE_LABELS[m]} | 2 | 16 |" in md
        png = out / f"gantt_{m}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
        win = list(csv.DictReader((out / f"timeline_{m}.csv").open()))
        # the window is --gantt-window wide, or the whole decode when that is shorter (fast hosts)
        width = float(win[0]["window_end_s"]) - float(win[0]["window_start_s"])
        assert len(win) == 3 and 0 < width <= 0.05 + 1e-5
    assert not (out / f"gantt_{bench.HF}.png").exists()   # no pipeline, no trace: no chart
    assert "draft head: `untrained random head`" in md
    assert "Trace notes" not in md, md   # each mode's slice of the one trace holds exactly its generations
    table = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["mode"] for r in table] == [*COMPARED_MODES, bench.HF]
    hf = table.pop()   # one-process HF generate: no pipeline, no trace; every mode's speed-up over it
    assert int(hf["new_tokens"]) == 16 and float(hf["speedup_vs_hf_generate"]) == pytest.approx(1.0)
    assert f"| `{bench.HF}` | {bench.HF} | 2 | 16 |" in md and "× HF" in md
    for r in table:
        assert float(r["speedup_vs_hf_generate"]) == pytest.approx(float(r["tokens_per_s"]) / float(hf["tokens_per_s"]),
                                                               rel=1e-3)
        assert int(r["new_tokens"]) == 16 and float(r["tokens_per_s"]) > 0
        for i in range(3):   # trace-based shares over the decode phases: every rank computes, waits, and
            b, w = float(r[f"trace_busy_r{i}"]), float(r[f"trace_wait_r{i}"])   # never both at once
            assert 0 < b < 1 and 0 < w < 1 and b + w <= 1 + 1e-9, r
    assert float(table[0]["speedup_vs_ar"]) == pytest.approx(1.0)
    assert float(table[1]["speedup_vs_naive"]) == pytest.approx(1.0)
    # the summary can be redone from the results folder alone
    (out / "summary.md").unlink()
    assert _bench_main(["--summarize-only", "--out-dir", str(out)]) == 0, capsys.readouterr().err[-3000:]
    assert (out / "summary.md").read_text() == md
