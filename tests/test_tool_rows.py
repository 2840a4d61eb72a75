"""pipeline/tools/rows.py and ranks.py, the pieces bench, eval and quant_report share: the row tailer sees each
completed line once (a half-written line waits), the T=0 check keys and words its findings per tool, and a
job's ranks get the repository on PYTHONPATH and one OMP thread unless told otherwise."""
from __future__ import annotations

import json
import os

from config.paths import REPO
from pipeline.tools.ranks import child_env, job_command
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
