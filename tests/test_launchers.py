"""Faults through the real launchers (``./run_pipe.sh``, ``./run_jetson.sh`` with one launcher per NODE_RANK on
localhost), stories260K split in 3 stages, ``comm.timeout_s=5``: a sparse slice of scripts/fault_matrix.py.

Each case asserts: every surviving rank and every launcher prints a line naming the lost rank (or the
missing node / the taken port), no "Traceback" anywhere, the documented exit code, and every process the
launchers started gone within ``comm.timeout_s`` + slack of the fault (pids from /proc; no leftovers).
"""
from __future__ import annotations

import os
import subprocess

import pytest

from scripts.fault_matrix import BY_NAME, TIMEOUT_S, run_case
from tests.helpers import REPO, STORIES

SLACK_S = 10.0   # a loaded 2-core box can starve a watchdog for seconds

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260K")

EXPECTED = {  # case -> exit code of each launcher
    "pipe-kill-r1-decode": [3],
    "pipe-term-r0-decode": [3],
    "pipe-frozen-r2-decode": [3],
    "pipe-kill-r2-prefill": [3],
    "pipe-kill-launcher": [-9],
    "jetson-kill-r0-decode": [3, 3, 3],
    "jetson-missing-host": [3, 3],
    "jetson-taken-port": [2, 3, 3],
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("launchers")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fault_through_launcher(name, work):
    r = run_case(BY_NAME[name], work / f"case-{name}")
    detail = f"\n{r.row()}\n{r.out[-4000:]}"
    assert r.codes == EXPECTED[name], detail
    assert r.named, detail
    assert not r.traceback, detail
    assert r.leftovers == 0, detail
    assert r.gone_after_fault is not None and r.gone_after_fault <= TIMEOUT_S + SLACK_S, detail
    if BY_NAME[name].lost is not None and BY_NAME[name].missing_node is None:  # one line per survivor
        for rank in range(BY_NAME[name].world):
            if rank != BY_NAME[name].lost:
                assert sum(1 for l in r.out.splitlines() if f"[rank {rank}]" in l and "loading" not in l
                           and "WARNING" not in l) == 1, detail


@pytest.mark.parametrize("args,env,needle", [
    (["comm.timeout_s=nan"], {}, "comm.timeout_s=nan must be a finite number"),
    (["comm.heartbeat_s=0"], {}, "heartbeat_s=0.0 must be > 0"),
    (["--prompt-ids", "1,2"], {"NPROC": "4"}, "the world size is 4"),
])
def test_bad_input_one_line_before_any_rank(args, env, needle, tmp_path):
    """Shared argument errors: one line from the launcher, exit 2, no rank started (nothing can race it)."""
    from scripts.fault_matrix import make_stages
    stages = make_stages(tmp_path, 3)
    res = subprocess.run(["./run_pipe.sh", f"model.stage_dir={stages}", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, **env))
    lines = [l for l in res.stderr.splitlines() if l.strip() and "Requirement already" not in l]
    assert res.returncode == 2, res.stderr
    assert any(needle in l and l.startswith("[launch] error:") for l in lines), res.stderr
    assert not any(l.startswith("[rank") for l in lines), res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_prompt_file_turn_types(tmp_path):
    """A turn that is not a string is one PromptError naming the line and the turn (was a raw TypeError)."""
    from model.prompts import PromptError, load_questions
    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": 1, "turns": ["fine"]}\n{"question_id": 2, "turns": ["ok", 42]}\n')
    with pytest.raises(PromptError, match=r"q.jsonl:2: turn 2 is int 42, expected a string"):
        load_questions(f)
