"""Faults and bad inputs: every rank exits non-zero, fast, with one line and no traceback.

* A real rank process is SIGKILLed (``FLOWSPEC_FAULT``, see pipeline/faults.py) during prefill, mid-round
  of a decode and around rank 0's direct decisions, a stage rank and rank 0 alike: every survivor
  exits within ``comm.timeout_s`` (+ slack) naming the lost rank.
* Ctrl-C (SIGINT to every rank, as a terminal does under torchrun) ends the job at once, quietly.
* Bad inputs: unknown mode / key, bad value, empty prompt, missing / wrong-world / corrupt stage roots,
  checksum mismatch, a draft head for another model, over-long prompts, unreadable and non-UTF-8
  prompt files, a taken MASTER_PORT and a rank that never shows up.

Ranks are real processes on local CPUs with tiny random models and ``comm.timeout_s=5 comm.heartbeat_s=0.2``.
A fresh interpreter spends ~8 CPU-s importing torch and transformers, so most jobs fork their ranks from
a *zygote* that imported them once (:class:`tests.zygote.Zygote`: each rank is still its own process running
``pipeline.run.entry``, the function behind ``python -m pipeline.run``, and is killed with real signals);
the argument checks and Ctrl-C during startup exec ``python -m pipeline.run`` itself.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from model.split import split_checkpoint
from tests.helpers import REPO, free_port, tiny_llama
from tests.zygote import Zygote, shared_zygote

TIMEOUT_S = 5.0
SLACK_S = 10.0          # a busy 2-core box can starve a rank's watchdog for seconds
FAST = ["comm.timeout_s=5", "comm.heartbeat_s=0.2", "--quiet"]


@dataclass
class RankResult:
    code: int
    err: str
    t_exit: float        # seconds since launch when the exit was seen

    @property
    def lines(self) -> list[str]:  # what the user reads, minus the untrained-head notice and the loading line
        return [l for l in self.err.splitlines() if l.strip() and "WARNING" not in l and "loading stage" not in l]


def rank_env(r: int, world: int, port: int, extra: dict | None) -> dict:
    e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
             LOCAL_RANK=str(r), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    e.pop("FLOWSPEC_DEBUG", None)
    e.update(extra or {})
    return e


class Job:
    """``world`` local ranks of ``python -m pipeline.run`` (or only ``ranks`` of them); forked from
    ``zygote`` when one is given."""

    def __init__(self, tmp: Path, world: int, args: list[str], env: dict | None = None, port: int | None = None,
                 ranks: list[int] | None = None, zygote: "Zygote | None" = None) -> None:
        port = port or free_port()
        self.zygote = zygote
        self.procs, self.pids, self.errs = [], [], []
        self.t0 = time.monotonic()
        for r in ranks if ranks is not None else range(world):
            e = rank_env(r, world, port, env)
            err = tmp / f"rank{r}.err"
            self.errs.append(err)
            if zygote is not None:
                self.pids.append(zygote.spawn(e, args, err))
                continue
            with open(err, "w") as ef:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=e,
                                                   stdout=subprocess.DEVNULL, stderr=ef))
                self.pids.append(self.procs[-1].pid)

    def _exit(self, i: int) -> tuple[int, float] | None:
        if self.zygote is not None:
            return self.zygote.exits.get(self.pids[i])
        code = self.procs[i].poll()
        return None if code is None else (code, time.monotonic())

    def running(self) -> bool:
        if self.zygote is not None:
            self.zygote.collect(0)
        return all(self._exit(i) is None for i in range(len(self.pids)))

    def wait(self, timeout: float = 240) -> list[RankResult]:
        ends: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(ends) < len(self.pids) and time.monotonic() < deadline:
                if self.zygote is not None:
                    self.zygote.collect(0.05)
                else:
                    time.sleep(0.05)
                for i in range(len(self.pids)):
                    if i not in ends and (ex := self._exit(i)) is not None:
                        ends[i] = ex
        finally:
            self.kill()
        hung = [i for i in range(len(self.pids)) if i not in ends]
        res = [RankResult(*(ends[i][0], e.read_text(), ends[i][1] - self.t0) if i in ends
                          else (None, e.read_text(), float("inf"))) for i, e in enumerate(self.errs)]
        assert not hung, f"ranks {hung} still running after {timeout}s:\n" + _dump(res)
        return res

    def kill(self) -> None:
        for i, pid in enumerate(self.pids):
            if self.zygote is not None:
                if pid not in self.zygote.exits:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            elif self.procs[i].poll() is None:
                self.procs[i].kill()
                self.procs[i].wait()


def _dump(res: list[RankResult]) -> str:
    return "\n".join(f"--- rank {i}: exit {r.code} at {r.t_exit:.1f}s\n{r.err[-2500:]}" for i, r in enumerate(res))


def assert_clean_failure(res: list[RankResult], max_lines: int = 1) -> None:
    """Non-zero everywhere, no traceback, at most ``max_lines`` lines per rank."""
    info = _dump(res)
    assert all(r.code != 0 for r in res), info
    assert not any("Traceback" in r.err or "frame #" in r.err for r in res), info
    assert all(len(r.lines) <= max_lines for r in res), info


@pytest.fixture(scope="module")
def zygote():
    return shared_zygote()   # the session's (tests/zygote.py): tests.helpers.launch forks from it too


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    full = tiny_llama(root / "full", layers=4)
    return {"full": full,
            2: split_checkpoint(full, root / "s2", [0, 4], progress=False),
            3: split_checkpoint(full, root / "s3", [0, 2, 2], progress=False)}


# -- killed ranks ---------------------------------------------------------------------------------------
PREFILL = ["prefill_chunk=8", "max_new_tokens=4", "--modes", "ar", "--prompt-ids", ",".join(["5"] * 120)]
DECODE = ["max_new_tokens=120", "--modes", "continuous", "--prompt-ids", "1,5,9,13,22,7"]


@pytest.mark.parametrize("victim,point,count,args", [
    (1, "prefill", 3, PREFILL),      # a stage rank while prompt chunks stream through it
    (0, "prefill", 4, PREFILL),      # rank 0 while sending chunks (and hosting the rendezvous store)
    (2, "segment", 7, DECODE),       # mid-round: the last stage while tree segments are in flight
    (0, "segment", 7, DECODE),
    (2, "decision", 4, DECODE),      # a stage taking rank 0's direct decisions
    (0, "decision", 4, DECODE),      # rank 0 about to send one
    (0, "load", 1, DECODE),          # rank 0 while loading: the stages wait in Comm.wait_for_rank0, not a receive
], ids=["stage-prefill", "rank0-prefill", "stage-decode", "rank0-decode", "stage-decision", "rank0-decision",
        "rank0-load"])
def test_killed_rank(zygote, roots, tmp_path, victim, point, count, args):
    job = Job(tmp_path, 3, [f"model.stage_dir={roots[3]}", *FAST, *args],
              env={"FLOWSPEC_FAULT": f"rank={victim},at={point},count={count}"}, zygote=zygote)
    res = job.wait()
    info = _dump(res)
    assert res[victim].code == -signal.SIGKILL, "the fault point was not reached:\n" + info
    for r, rr in enumerate(res):
        if r == victim:
            continue
        assert rr.code not in (0, None) and rr.code > 0, info
        assert rr.t_exit - res[victim].t_exit <= TIMEOUT_S + SLACK_S, info
        assert f"lost rank {victim}" in rr.err, info
    assert_clean_failure([rr for r, rr in enumerate(res) if r != victim])


def test_rank0_loading_past_timeout_is_no_lost_rank(zygote, roots, tmp_path):
    """Rank 0 loads for 3x ``comm.timeout_s`` (``delay=``: slow, alive, as a 7B head from a slow disk): the stages
    wait for its first message (``Comm.wait_for_rank0``) and the job ends well. Without that wait a stage's first
    receive gave up after ``comm.timeout_s`` with "lost rank 0" (this test failed so with the wait removed)."""
    args = [f"model.stage_dir={roots[3]}", "comm.timeout_s=2", "comm.heartbeat_s=0.2", "--quiet",
            "max_new_tokens=4", "--modes", "continuous", "--prompt-ids", "1,5,9"]
    env = {"FLOWSPEC_FAULT": "rank=0,at=load,delay=6"}
    res = Job(tmp_path, 3, args, env=env, zygote=zygote).wait(120)
    assert all(r.code == 0 for r in res), _dump(res)


def _sigint_blocked(pid: int) -> bool:
    """The rank's signal thread is in place (pipeline.run blocks SIGINT in every other thread)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    blk = next(l for l in status.splitlines() if l.startswith("SigBlk:")).split()[1]
    return bool(int(blk, 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.parametrize("world,forked,when", [(3, True, "decoding"), (2, False, "starting")],
                         ids=["forked-world3-decoding", "exec-world2-starting"])
def test_ctrl_c_stops_every_rank_quietly(zygote, roots, tmp_path, world, forked, when):
    """SIGINT to every rank (a terminal's Ctrl-C under torchrun), mid-generation or while still importing."""
    out = tmp_path / "rows.jsonl"
    args = [f"model.stage_dir={roots[world]}", *FAST, "max_new_tokens=100", "--modes", "ar", "--output", str(out)]
    for i in range(40):
        args += ["--prompt-ids", f"1,{5 + i},9"]
    job = Job(tmp_path, world, args, zygote=zygote if forked else None)
    deadline = time.monotonic() + 200
    if when == "decoding":   # the first generation is written: the ring is busy with the next ones
        ready = lambda: out.is_file() and out.read_text().strip()
    else:                    # the signal thread is up; torch is still being imported
        if not Path("/proc/self/status").is_file():
            pytest.skip("needs /proc")
        ready = lambda: all(_sigint_blocked(pid) for pid in job.pids)
    while not ready() and time.monotonic() < deadline:
        assert job.running(), "job ended before Ctrl-C:\n" + _dump(job.wait())
        time.sleep(0.02)
    t_sig = time.monotonic() - job.t0
    for pid in job.pids:
        os.kill(pid, signal.SIGINT)
    res = job.wait(60)
    assert_clean_failure(res)
    assert all(r.t_exit - t_sig <= SLACK_S for r in res), _dump(res)
    assert all(r.code == 128 + signal.SIGINT for r in res) or when == "decoding", _dump(res)
    assert any("interrupted" in r.err for r in res), _dump(res)


# -- bad inputs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    (["--modes", "naive,bogus"], "unknown mode 'bogus'"),
    (["no_such_key=3"], "unknown config key 'no_such_key'"),
    (["max_new_tokens=many"], "bad value 'many' for max_new_tokens"),
    (["--prompt", ""], "is empty"),
    (["--prompt-ids", "1,x,3"], "--prompt-ids takes comma-separated token ids"),
    (["model.stage_dir=/no/such/stages"], "does not exist"),
    (["WRONG_WORLD"], "but the world size is 2"),
], ids=["mode", "key", "value", "empty-prompt", "prompt-ids", "missing-stage-dir", "wrong-world"])
def test_argument_errors_before_connecting(roots, tmp_path, extra, message):
    """Seen alike by every rank before the process group: one line from rank 0, exit 2 everywhere, fast."""
    extra = [f"model.stage_dir={roots[3]}" if e == "WRONG_WORLD" else e for e in extra]
    args = [f"model.stage_dir={roots[2]}", *FAST, "--prompt-ids", "1,2,3", *extra]
    res = Job(tmp_path, 2, args).wait(60)
    assert [r.code for r in res] == [2, 2], _dump(res)
    assert message in res[0].err and res[1].err == "", _dump(res)
    assert_clean_failure(res)
    assert max(r.t_exit for r in res) < 30, _dump(res)  # no torch import, no rendezvous


def _corrupt(root: Path, tmp: Path, how: str) -> Path:
    bad = tmp / "stages"
    shutil.copytree(root, bad)
    st = bad / "stage_model_1" / "model.safetensors"
    if how == "no-weights":
        st.unlink()
    elif how == "garbage-config":
        (bad / "stage_model_1" / "config.json").write_text("{ this is not json")
    elif how == "checksum":
        data = bytearray(st.read_bytes())
        data[-64:] = bytes(255 - b for b in data[-64:])   # same size, different bytes
        st.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("how,message", [
    ("no-weights", "model.safetensors is missing"),
    ("garbage-config", "cannot load stage 1"),
    ("checksum", "does not match its manifest checksum"),
])
def test_corrupt_stage_dir(zygote, roots, tmp_path, how, message):
    bad = _corrupt(roots[2], tmp_path, how)
    res = Job(tmp_path, 2, [f"model.stage_dir={bad}", *FAST, "--prompt-ids", "1,2,3"], zygote=zygote).wait()
    assert_clean_failure(res)
    assert message in res[1].err and "[rank 1] error:" in res[1].err, _dump(res)
    assert "lost rank 1" in res[0].err and message in res[0].err, _dump(res)  # rank 0 says who and why


def _head_for_other_model(tmp: Path) -> Path:
    from transformers import LlamaConfig

    from draft.eagle import init_untrained_head, save_eagle_head
    other = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return save_eagle_head(init_untrained_head(other), tmp / "head")


def _bad_prompt_args(tmp: Path, how: str) -> list[str]:
    if how == "head":
        return [f"head_dir={_head_for_other_model(tmp)}", "--prompt-ids", "1,2,3"]
    if how == "too-long":
        return ["max_new_tokens=16", "--prompt-ids", ",".join(["5"] * 600)]
    if how == "missing-file":
        return ["--prompts-file", str(tmp / "nope.jsonl")]
    if how == "directory":
        return ["--prompts-file", str(tmp)]
    q = tmp / "q.jsonl"
    q.write_bytes(b'{"question_id": 1, "turns": ["caf\xe9 \xff\xfe"]}\n')
    return ["--prompts-file", str(q)]


@pytest.mark.parametrize("how,message", [
    ("head", "has hidden_size 32 but the target has 64"),
    ("too-long", "exceed the model's 512 positions"),
    ("missing-file", "does not exist"),
    ("directory", "cannot read prompts file"),
    ("non-utf8", "is not UTF-8 text"),
])
def test_rank0_input_errors(zygote, roots, tmp_path, how, message):
    """Found by rank 0 once the group exists: its line, and the stage rank exits naming rank 0."""
    res = Job(tmp_path, 2, [f"model.stage_dir={roots[2]}", *FAST, *_bad_prompt_args(tmp_path, how)],
              zygote=zygote).wait()
    assert_clean_failure(res)
    assert message in res[0].err and res[0].code == 2, _dump(res)
    assert "lost rank 0" in res[1].err, _dump(res)
    assert res[1].t_exit - res[0].t_exit <= TIMEOUT_S + SLACK_S, _dump(res)


def test_master_port_in_use(zygote, roots, tmp_path):
    """Another program listens on MASTER_PORT: rank 0 cannot bind it, rank 1 talks to the stranger."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        res = Job(tmp_path, 2, [f"model.stage_dir={roots[2]}", *FAST, "comm.timeout_s=3", "--prompt-ids", "1,2,3"], port=port,
                  zygote=zygote).wait(120)
    assert_clean_failure(res)
    assert "already in use" in res[0].err, _dump(res)
    assert "no rendezvous" in res[1].err, _dump(res)
    assert res[1].t_exit - res[0].t_exit <= TIMEOUT_S + SLACK_S, _dump(res)


def test_rank_never_joins(zygote, roots, tmp_path):
    """World 3, but rank 2 is never started: the others give up after comm.timeout_s."""
    res = Job(tmp_path, 3, [f"model.stage_dir={roots[3]}", *FAST, "comm.timeout_s=3", "--prompt-ids", "1,2,3"], ranks=[0, 1],
              zygote=zygote).wait(120)
    assert_clean_failure(res)
    assert all("rendezvous" in r.err for r in res), _dump(res)
