"""pipeline/tools/rows.py and ranks.py, the pieces bench, eval and quant_report share: the row tailer sees each
completed line once (a half-written line waits), the T=0 check keys and words its findings per tool, and a
job's ranks get the repository on PYTHONPATH and one OMP thread unless told otherwise, and a picked port lies outside
the kernel's ephemeral range."""
from __future__ import annotations

import json
import os

from config.paths import REPO
from pipeline.tools import ranks
from pipeline.tools.ranks import child_env, ephemeral_range, free_port, job_command
from pipeline.tools.rows import RowTailer, find_mismatches, losslessness_md, mismatch_banner


def test_tailer_returns_each_completed_row_once(tmp_path):
    path = tmp_path / "rows.jsonl"
    tail = RowTailer(path)
    assert tail.poll() == []                                   # no file yet
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"a": ')   # a writer mid-line
    assert tail.poll() == [{"a": 1}]
    assert tail.poll() == []
    with open(path, "a") as f:
        f.write('2}\n\n{"a": 3}\n')
    assert tail.poll() == [{"a": 2}, {"a": 3}]
    assert tail.poll() == []


def _row(mode, out, qid=1, turn=0, prompt=(1, 2), dataset=None, temperature=0.0):
    r = {"mode": mode, "question_id": qid, "turn": turn, "output_ids": list(out), "prompt_ids": list(prompt),
         "temperature": temperature}
    return r if dataset is None else dict(r, dataset=dataset)


def test_mismatches_bench_and_eval_keys_and_words():
    rows = [_row("ar", [5, 6, 7]), _row("naive", [5, 6, 7]), _row("pruned", [5, 6]), _row("pipedec", [5, 6, 7],
            prompt=(9,)), _row("continuous", [5, 9, 7], qid=2), _row("continuous", [1], temperature=1.0)]
    bad, compared, unref = find_mismatches(rows)
    assert (compared, unref) == (3, 1)                          # q2 has no ar row; T=1 rows are not compared
    assert bad == ["question 1: pruned != ar: first difference at token 2 (ar 3 tokens, pruned 2 tokens)",
                   "question 1: pipedec was given another prompt than ar"]
    ev = [_row("naive", [5, 8], turn=1, prompt=(3,), dataset="gsm8k"), _row("ar", [5, 6], turn=1, dataset="gsm8k"),
          _row("continuous", [5, 6, 0], dataset="gsm8k"), _row("ar", [5, 6, 7], dataset="gsm8k"),
          _row("ar", [5, 6, 7], dataset="qa")]
    bad, compared, unref = find_mismatches(ev, by_dataset=True)
    assert (compared, unref) == (2, 0)
    assert bad == ["gsm8k question 1 turn 0: continuous != ar: first difference at token 2 (ar 3 tokens, "
                   "continuous 3 tokens)",                   # key order: turn 0 before turn 1
                   "gsm8k question 1 turn 1: naive != ar: prompt differs (an earlier turn diverged)"]


def test_verdict_text_and_banner():
    assert losslessness_md(([], 4, 0)) == "All 4 generations of the speculative modes equal ar's output token for token.\n"
    assert losslessness_md(([], 0, 2), scope="T=0 ") == ("Nothing compared (needs T=0 rows of ar and another mode).\n"
                                                         "\n2 T=0 generations had no ar row to compare with.\n")
    assert losslessness_md((["x"], 3, 0)).startswith("**MISMATCH: 1 of 3 generations differ from ar:**\n\n- x\n")
    banner = mismatch_banner("eval", ["a", "b"]).splitlines()
    assert banner[0] == banner[-1] == "!" * 78
    assert banner[1:3] == ["[eval] LOSSLESSNESS MISMATCH at T=0: 2 generation(s) differ from ar:", "  a"]


def test_child_env_and_job_command(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env(FLOWSPEC_PARENT_PID="7")
    assert env["OMP_NUM_THREADS"] == "1" and env["FLOWSPEC_PARENT_PID"] == "7"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert child_env()["OMP_NUM_THREADS"] == "4"
    cmd = job_command(3, ["max_new_tokens=8"])
    assert cmd[1:] == ["-m", "pipeline.tools.launch", "--standalone", "--nproc_per_node=3", "-m", "pipeline.run",
                       "max_new_tokens=8"]


def test_free_port_is_outside_the_ephemeral_range_and_bindable(tmp_path, monkeypatch):
    """Every pick lies outside the range outgoing connections take their ports from (why: free_port's docstring),
    is free, and varies; a range file in another format falls back to Linux's default; a range that leaves nothing
    outside falls back to bind(0). The planted bug (bind(0), the old rule) picks inside the range."""
    import random
    import socket
    low, high = ephemeral_range()
    picks = {free_port() for _ in range(40)}
    assert len(picks) > 30 and all(not low <= p <= high and p >= ranks.PICK_LOW for p in picks)
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))                     # free when returned
    f = tmp_path / "range"
    f.write_text("20000\t30000\n")
    assert ephemeral_range(f) == (20000, 30000)
    f.write_text("garbage")
    assert ephemeral_range(f) == (32768, 60999)
    monkeypatch.setattr(ranks, "ephemeral_range", lambda: (20000, 30000))
    rng = random.Random(0)
    assert all(ranks.PICK_LOW <= p < 20000 or 30000 < p <= 65535 for p in (free_port(rng) for _ in range(200)))
    monkeypatch.setattr(ranks, "ephemeral_range", lambda: (1024, 65535))      # nothing outside: the kernel's pick
    assert 1024 <= free_port() <= 65535

    def planted(rng=None):                                     # the old rule
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    monkeypatch.setattr(ranks, "ephemeral_range", lambda: (low, high))
    assert all(low <= planted() <= high for _ in range(5))


# -- results hygiene: the draft head in every summary and title, SR whatever modes ran --------------------------
def _eval_row(mode, ds, xi, head="/x/heads/SmolLM2-135M-Instruct", sha="c1e25e5520385776eea5"):
    return {"mode": mode, "dataset": ds, "question_id": 1, "turn": 0, "temperature": 0.0, "new_tokens": 10,
            "decode_s": 10 / xi, "accept_lengths": [2] * 5, "output_ids": [1] * 10, "prompt_ids": [1],
            "head_dir": "none" if mode == "ar" else head, "head_sha256": None if mode == "ar" else sha}


def test_head_line_names_the_head_and_its_hash_and_flags_an_untrained_one():
    from pipeline.tools.rows import head_line, sr_baseline, untrained
    rows = [_eval_row("ar", "gsm8k", 5.0), _eval_row("continuous", "gsm8k", 10.0)]
    assert head_line(rows) == "draft head: SmolLM2-135M-Instruct (sha256 c1e25e552038)" and not untrained(rows)
    raw = [_eval_row("continuous", "gsm8k", 10.0, head="untrained", sha=None)]
    assert "UNTRAINED" in head_line(raw) and untrained(raw)
    assert head_line(rows[:1]) == "draft head: none (no drafting mode ran)"
    assert [sr_baseline(m) for m in (["ar", "naive", "continuous"], ["continuous", "ar"], ["pipedec"], [])] == \
        ["naive", "ar", "pipedec", None]


def test_eval_summary_and_sr_bars_without_naive():
    """The eval's SR used to need naive: without it every SR cell and bar was empty. Now SR falls back to ar,
    the summary says so, and the summary names the head (and warns, on top, when it is untrained)."""
    from pipeline.tools.eval import aggregate, bar_values, summarize
    from pipeline.tools.rows import UNTRAINED_WARNING
    rows = [_eval_row("ar", d, 5.0) for d in ("gsm8k", "qa")] + [_eval_row("continuous", d, 10.0)
                                                                 for d in ("gsm8k", "qa")]
    meta = {"world": 5, "max_new_tokens": 10, "begin": 0, "end": 1}
    md, csv_text = summarize(rows, ["gsm8k", "qa"], ["ar", "continuous"], [0.0], meta, ([], 0, 0))
    assert "SR against PP-AR (`ar`)" in md and "10.00 (2.00×)" in md and "sha256 c1e25e552038" in md
    assert UNTRAINED_WARNING not in md and ",2.0," in csv_text
    vals, _ = bar_values(aggregate(rows), 0.0, "continuous", "sr", ["gsm8k", "qa"], "ar")
    assert vals == [2.0, 2.0, 2.0]                                      # gsm8k, qa, Mean
    assert bar_values(aggregate(rows), 0.0, "continuous", "sr", ["gsm8k", "qa"], "naive")[0] == [0.0] * 3
    raw = [dict(r, head_dir="untrained", head_sha256=None) if r["mode"] != "ar" else r for r in rows]
    md, _ = summarize(raw, ["gsm8k", "qa"], ["ar", "continuous"], [0.0], meta, ([], 0, 0))
    assert md.splitlines()[2] == f"**{UNTRAINED_WARNING}**"


def test_eval_answer_dir_writes_llm_judge_files_named_by_their_model_id(tmp_path):
    from pipeline.tools.eval import write_answers
    rows = [dict(_eval_row(m, "mt_bench", 5.0), question_id=q, turn=t, text=f" {m} q{q} t{t} ")
            for m in ("ar", "continuous") for q in (81, 82) for t in (0, 1)]
    rows = [r for r in rows if not (r["question_id"] == 82 and r["turn"] == 1 and r["mode"] == "ar")]  # incomplete
    paths = write_answers(rows, tmp_path, "SmolLM2-135M-Instruct")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in paths) == [
        "mt_bench/model_answer/SmolLM2-135M-Instruct-ar-t0.jsonl",
        "mt_bench/model_answer/SmolLM2-135M-Instruct-continuous-t0.jsonl"]
    for p in paths:
        lines = [json.loads(l) for l in p.read_text().splitlines()]
        assert {a["model_id"] for a in lines} == {p.stem}                 # llm_judge's key: the file stem
        assert all(set(a) == {"question_id", "answer_id", "model_id", "choices", "tstamp"} for a in lines)
    ar = [json.loads(l) for l in paths[0].read_text().splitlines()]
    assert [a["question_id"] for a in ar] == [81] and ar[0]["choices"][0]["turns"] == ["ar q81 t0", "ar q81 t1"]
    write_answers(rows, tmp_path, "SmolLM2-135M-Instruct")                  # rerun: nothing written twice
    assert len(paths[1].read_text().splitlines()) == 2
    first = write_answers(rows, tmp_path / "f", "m", first_turn_only=True)
    assert len(first) == 2 and all(len(p.read_text().splitlines()) == 2 for p in first)
