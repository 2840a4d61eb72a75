"""What pipeline.run writes, on a real 2-rank stories260K run: provenance on every --output row, resuming
an --output of the same configuration and refusing one of another, FastChat llm_judge answer files, and
the Chrome/Perfetto trace export of pipeline.tools.timeline."""
import json

import pytest

from tests.helpers import DATA, STORIES, launch, read_jsonl

pytestmark = pytest.mark.skipif(not STORIES.is_dir() or not DATA.is_dir(), reason="../shared is not available")

QUESTIONS = DATA / "mt_bench" / "question.jsonl"
PROVENANCE = ("stage_dir", "stage_manifest_sha256", "head_dir", "head_sha256", "config", "config_hash", "git_commit",
              "hostname", "torch_version", "transformers_version")


def _args(stages, out, end, *extra):
    return [f"model.stage_dir={stages}", "max_new_tokens=6", "--modes", "ar,naive", "--prompts-file",
            str(QUESTIONS), "--begin", "0", "--end", str(end), "--template", "raw", "--quiet", "--output", str(out),
            "--answer-file", str(out.parent / "answers_{mode}.jsonl"), *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One traced run on record 0 (both turns, ar + naive), then the same command resumed on records [0, 2)."""
    from model.split import split_checkpoint
    root = tmp_path_factory.mktemp("outputs")
    stages = split_checkpoint(STORIES, root / "stages", [0, 5], progress=False)
    out = root / "rows.jsonl"
    first = launch(2, _args(stages, out, 1, "comm.trace=true", f"comm.trace_dir={root / 'traces'}"), timeout=300)
    rows_first = read_jsonl(out)
    answers_first = read_jsonl(root / "answers_naive.jsonl")
    second = launch(2, _args(stages, out, 2), timeout=300)
    return {"root": root, "stages": stages, "out": out, "first": first, "second": second,
            "rows_first": rows_first, "answers_first": answers_first}


def test_every_row_carries_provenance(run):
    rows = read_jsonl(run["out"])
    for row in rows:
        for k in PROVENANCE:
            assert k in row, k
        for k in ("question_id", "turn", "mode", "output_ids", "text", "tau", "busy_fraction", "world_size"):
            assert k in row  # the older fields are unchanged
    row = rows[0]
    assert row["stage_dir"] == str(run["stages"].resolve())
    assert len(row["stage_manifest_sha256"]) == 64 and row["head_dir"] == "untrained"
    assert row["config"]["tree.top_k"] == 10 and row["config"]["gen.max_new_tokens"] == 6
    assert row["config"]["world_size"] == 2 and "gen.mode" not in row["config"]
    assert len({r["config_hash"] for r in rows}) == 1
    # the draft vocabulary as resolved (model.draft_vocab=-1 is "auto" in the config): the untrained head drafts
    # over stories260K's whole 512-token vocabulary; ar has no drafter
    assert {r.get("draft_vocab_size") for r in rows if r["mode"] == "naive"} == {512}
    assert all("draft_vocab_size" not in r for r in rows if r["mode"] == "ar")
    assert row["git_commit"] == "unknown" or len(row["git_commit"]) == 40
    # the loading line: one per rank, nothing else from the worker rank on success
    err = run["first"].stderr
    assert "[rank 1] loading stage 1 (layers 0-4, " in err and "[rank 0] loading stage 0 (" in err
    assert [l for l in err.splitlines() if l.startswith("[rank 1]")] == [l for l in err.splitlines()
                                                                          if l.startswith("[rank 1] loading")]


def test_output_resumes_without_duplicates(run):
    first, rows = run["rows_first"], read_jsonl(run["out"])
    assert len(first) == 2 * 2  # record 0: two turns x two modes
    assert rows[:len(first)] == first
    keys = [(r["question_id"], r["turn"], r["mode"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * 2 * 2  # record 1 added, record 0 not generated again
    assert "resuming" in run["second"].stderr and "4 generation(s) already there" in run["second"].stderr


def test_output_of_another_configuration_is_refused(run, tmp_path):
    out = tmp_path / "rows.jsonl"
    out.write_text(run["out"].read_text())
    before = out.read_text()
    res = launch(2, _args(run["stages"], out, 2, "tree.top_k=4"), timeout=300, check=False)
    assert res.codes[0] == 2
    lines = [l for l in res.stderr.splitlines() if "error" in l]
    assert len(lines) >= 1 and "another configuration" in lines[0] and "tree.top_k: 10 vs 4" in lines[0]
    assert out.read_text() == before


def test_answer_file_is_fastchat_llm_judge_format(run):
    questions = [json.loads(l) for l in QUESTIONS.read_text().splitlines()[:2]]
    for mode in ("ar", "naive"):
        lines = read_jsonl(run["root"] / f"answers_{mode}.jsonl")
        assert [a["question_id"] for a in lines] == [q["question_id"] for q in questions]  # resumed: no duplicate
        rows = {(r["question_id"], r["turn"]): r for r in read_jsonl(run["out"]) if r["mode"] == mode}
        for a, q in zip(lines, questions):
            assert set(a) == {"question_id", "answer_id", "model_id", "choices", "tstamp"}
            assert isinstance(a["answer_id"], str) and len(a["answer_id"]) >= 16
            assert a["model_id"] == f"answers_{mode}"                # llm_judge: model_id = file stem
            assert isinstance(a["tstamp"], float)
            (choice,) = a["choices"]
            assert choice["index"] == 0 and len(choice["turns"]) == len(q["turns"]) == 2
            assert choice["turns"] == [rows[(q["question_id"], t)]["text"].strip() for t in range(2)]
    assert run["answers_first"] == read_jsonl(run["root"] / "answers_naive.jsonl")[:1]


def test_chrome_trace_export(run, tmp_path):
    from pipeline.tools.timeline import main
    path = tmp_path / "trace.json"
    assert main([str(run["root"] / "traces"), "--chrome", str(path)]) == 0
    assert not (run["root"] / "traces" / "gantt.png").exists()  # --chrome alone writes only the trace
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names = {(e["pid"], e["name"]) for e in spans}
    assert (1, "compute") in names and (0, "lm_head") in names and (0, "draft") in names
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] == 0 for e in spans)
    meta = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert meta == {0: "rank 0 (draft+verify)", 1: "rank 1 (stage 1)"}
    marks = [e for e in events if e["ph"] == "i" and e["name"] == "gen_begin"]
    assert len(marks) == 4 and all(e["pid"] == 0 for e in marks)  # one per generation of the traced run
    # a window keeps only what lies in it
    part = tmp_path / "gen1.json"
    assert main([str(run["root"] / "traces"), "--chrome", str(part), "--generation", "1"]) == 0
    win = [e for e in json.loads(part.read_text())["traceEvents"] if e["ph"] == "X"]
    assert 0 < len(win) < len(spans)


def test_one_definition_of_busy_row_equals_trace(run):
    """A row's busy_fraction (live counters) equals the timeline's busy over that generation's decode window
    (traces), both being pipeline.trace.busy_fraction."""
    from pipeline.tools.timeline import load, utilization
    tl = load(run["root"] / "traces")
    gens = tl.generations()
    rows = run["rows_first"]
    assert len(gens) == len(rows)
    for g, row in zip(gens, rows):
        util = utilization(tl, [(g["decode_begin"], g["end"])])
        for r, u in enumerate(util):
            assert abs(u["busy_frac"] - row["busy_fraction"][r]) < 0.03, (r, u["busy_frac"], row["busy_fraction"])


def test_busy_fraction_counts_nested_spans_once(monkeypatch):
    from pipeline.tools.simulate import stage_utilization
    from pipeline.tools.timeline import RankTrace, Timeline
    from pipeline.trace import Tracer, busy_fraction
    spans = {"verify": [(1.0, 3.0)], "lm_head": [(1.5, 2.0)], "recv": [(3.0, 4.0)], "compute": [(3.5, 4.5)]}
    assert busy_fraction(spans, 0.0, 4.0) == pytest.approx(2.5 / 4.0)
    assert busy_fraction(spans, 2.0, 2.0) == 0.0
    tl = Timeline({0: RankTrace(0, 0.0, spans=spans)}, "none")
    assert stage_utilization(tl, [(0.0, 4.0)]) == [[round(2.5 / 4.0, 4)]]
    import pipeline.trace as trace_mod
    import itertools
    clock = itertools.count(0.0, 1.0)
    monkeypatch.setattr(trace_mod.time, "perf_counter", lambda: next(clock))
    tr = Tracer(0)                       # t0 = 0
    with tr.span("verify"):              # 1 .. 4
        with tr.span("lm_head"):         # 2 .. 3
            pass
    with tr.span("recv"):                # 5 .. 6: not busy
        pass
    assert tr.busy_s == 3.0  # the nested lm_head is not counted twice


def test_plots_and_tables_mark_rows_the_emulation_flagged(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pipeline.tools import bench, eval as ev
    rows = [{"dataset": ds, "mode": m, "temperature": 0.0, "question_id": 1, "turn": 0, "new_tokens": 10,
             "decode_s": 1.0, "accept_lengths": [2] * 5, "emu_flag": m == "continuous" and ds == "gsm8k"}
            for ds in ("mt_bench", "gsm8k") for m in ("ar", "naive", "continuous")]  # simulate-style: no emu_profile
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    ev.plot(rows, ["mt_bench", "gsm8k"], ["ar", "naive", "continuous"], [0.0], tmp_path)
    xi = figs[0].axes[0]
    hatched = [p for p in xi.patches if p.get_hatch()]
    assert len(hatched) == 2  # gsm8k and Mean of continuous, nothing else
    assert any("flagged" in t.get_text() for t in xi.get_legend().get_texts())
    agg = bench.aggregate(rows, ["ar", "continuous"])
    assert agg["continuous"]["flagged"] == 1 and agg["ar"]["flagged"] == 0


def test_drafted_vocab_looks_through_wrappers_and_merged_sources():
    """The resolved size is found behind an OSD wrapper (``inner``) and in a merged drafter's EAGLE source; sources
    without a vocabulary (lookup) give None; a reduced vocabulary's ids win over the lm_head's rows."""
    from types import SimpleNamespace as NS

    import torch

    from pipeline.outputs import drafted_vocab, drafter_fields
    lm = NS(weight=torch.zeros(49152, 4))
    whole = NS(dvocab=None, vocab_map=None, lm_head=lm)
    reduced = NS(dvocab=NS(ids=torch.arange(16384)), vocab_map=None, lm_head=lm)
    lookup = NS()
    assert drafted_vocab(whole) == 49152 and drafted_vocab(reduced) == 16384
    assert drafted_vocab(NS(sources=[lookup, reduced])) == 16384
    assert drafted_vocab(NS(inner=NS(sources=[lookup, whole]))) == 49152
    assert drafted_vocab(NS(sources=[lookup])) is None and drafted_vocab(lookup) is None
    assert drafter_fields(NS(sources=[reduced])) == {"drafter_version": 0, "draft_vocab_size": 16384}
    assert drafter_fields(None) == {"drafter_version": None}
