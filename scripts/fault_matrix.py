"""Faults as users meet them, through the real launchers: ``./run_pipe.sh`` (one host) and ``./run_jetson.sh``
(several launchers on localhost, one per NODE_RANK, each with its own copy of the stage root).

    .venv/bin/python -m scripts.fault_matrix                 # every case, prints the table of docs/failures.md
    .venv/bin/python -m scripts.fault_matrix --cases pipe-kill-r1-decode,jetson-missing-host

Each case starts the launcher(s) in their own process group, injects the fault (``FLOWSPEC_FAULT``: a rank
signals itself at load / prefill / decode; or a taken port, a host never started, ``kill -9`` of the launcher)
and records: the launchers' exit codes, every line they printed, whether a line names the lost rank (or the
missing node), whether any "Traceback" appeared, and the seconds from the fault until every process the
launchers started is gone (pids collected from /proc while the case runs); processes still alive
``comm.timeout_s`` + 15 s after the fault are the case's *leftovers* (then killed). tests/test_launchers.py
runs a few cases of this matrix with assertions; this script is the longer sweep behind docs/failures.md's table.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from config.paths import REPO
from pipeline.tools.ranks import free_port

STORIES = REPO.parent / "shared" / "models" / "stories260K"
TIMEOUT_S = 5.0
FAST = [f"comm.timeout_s={TIMEOUT_S:g}", "comm.heartbeat_s=0.2", "--quiet"]
DECODE = ["max_new_tokens=300", "mode=continuous", "--prompt-ids", "1,5,9,13,22,7"]
PREFILL = ["prefill_chunk=8", "max_new_tokens=8", "--modes", "ar", "--prompt-ids", ",".join(["5"] * 60)]


@dataclass
class Case:
    name: str
    launcher: str                 # pipe | jetson
    lost: int | None              # the rank (pipe) or node (jetson) the messages must name; None: no rank lost
    fault: str = ""               # FLOWSPEC_FAULT
    args: list[str] = field(default_factory=lambda: list(DECODE))
    world: int = 3
    code: int = 3                 # expected exit code of every launcher
    missing_node: int | None = None   # jetson: this NODE_RANK is never started
    taken_port: bool = False      # jetson: a foreign program listens on MASTER_PORT
    kill_launcher_after: float | None = None  # kill -9 the (first) launcher this long after start
    env: dict = field(default_factory=dict)


CASES = [
    Case("pipe-kill-r0-load", "pipe", 0, "rank=0,at=load"),
    Case("pipe-kill-r1-load", "pipe", 1, "rank=1,at=load"),
    Case("pipe-kill-r1-prefill", "pipe", 1, "rank=1,at=prefill,count=2", args=list(PREFILL)),
    Case("pipe-kill-r2-prefill", "pipe", 2, "rank=2,at=prefill", args=list(PREFILL)),
    Case("pipe-kill-r0-decode", "pipe", 0, "rank=0,at=segment,count=10"),
    Case("pipe-kill-r1-decode", "pipe", 1, "rank=1,at=segment,count=15"),
    Case("pipe-kill-r2-decode", "pipe", 2, "rank=2,at=segment,count=15"),
    Case("pipe-kill-r2-decision", "pipe", 2, "rank=2,at=decision,count=5"),
    Case("pipe-term-r1-decode", "pipe", 1, "rank=1,at=segment,count=15,sig=TERM"),
    Case("pipe-term-r0-decode", "pipe", 0, "rank=0,at=segment,count=10,sig=TERM"),
    Case("pipe-frozen-r2-decode", "pipe", 2, "rank=2,at=segment,count=15,sig=STOP"),
    Case("pipe-frozen-r0-decode", "pipe", 0, "rank=0,at=segment,count=10,sig=STOP"),
    # four prompts: still decoding when the launcher dies at 12 s however fast this host runs one
    Case("pipe-kill-launcher", "pipe", None, kill_launcher_after=12.0, code=-9,
          args=[*DECODE, "--prompt-ids", "1,40,41,42", "--prompt-ids", "2,3,4,5", "--prompt-ids", "7,8,9"]),
    Case("jetson-kill-r0-decode", "jetson", 0, "rank=0,at=segment,count=10"),
    Case("jetson-kill-r1-decode", "jetson", 1, "rank=1,at=segment,count=15"),
    Case("jetson-kill-r2-prefill", "jetson", 2, "rank=2,at=prefill", args=list(PREFILL)),
    Case("jetson-frozen-r1-decode", "jetson", 1, "rank=1,at=segment,count=15,sig=STOP"),
    Case("jetson-missing-host", "jetson", 2, missing_node=2),
    Case("jetson-taken-port", "jetson", None, taken_port=True, code=-1),
]
BY_NAME = {c.name: c for c in CASES}


# -- processes --------------------------------------------------------------------------------------------
def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then the parent's pid); [] when the
    process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else None


def descendants(roots: set[int]) -> set[int]:
    """Every live process whose parent chain reaches ``roots`` (read from /proc)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            pp = _ppid(int(d))
            if pp is not None:
                parents[int(d)] = pp
    out, frontier = set(), set(roots)
    while frontier:
        nxt = {p for p, pp in parents.items() if pp in frontier and p not in out}
        out |= nxt
        frontier = nxt
    return out


def alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    return _stat(pid)[:1] not in ([], ["Z"])


def is_rank(pid: int) -> bool:
    """A rank process started by pipeline.tools.launch (``python -m pipeline.tools.launch --child MODULE ...``)."""
    try:
        return b"pipeline.tools.launch\0--child" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def stopped(pid: int) -> bool:
    return _stat(pid)[:1] in (["T"], ["t"])


def make_stages(work: Path, world: int = 3) -> Path:
    """stories260K split into ``world`` stages (rank 0 = embeddings + lm_head), cached under ``work``."""
    root = work / f"stories_s{world}"
    if not (root / "manifest.json").is_file():
        from model.split import split_checkpoint
        split = {2: [0, 5], 3: [0, 2, 3], 4: [0, 2, 2, 1]}[world]
        split_checkpoint(STORIES, root, split, progress=False)
    return root


# -- one case ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    case: Case
    codes: list[int]
    out: str
    t_fault: float | None         # seconds after start when the fault was seen (a rank vanished/stopped; with a
                                  # taken port, node 0's launcher exited)
    t_gone: float | None          # seconds after start when every process was gone
    leftovers: int
    named: bool
    traceback: bool

    @property
    def gone_after_fault(self) -> float | None:
        if self.t_gone is None:
            return None
        return self.t_gone - (self.t_fault if self.t_fault is not None else 0.0)

    def row(self) -> str:
        g = self.gone_after_fault
        lines = [l for l in self.out.splitlines() if l.strip() and "loading stage" not in l and "WARNING" not in l]
        shown = next((l for l in lines if "[launch" in l), lines[-1] if lines else "")
        return (f"| {self.case.name} | {','.join(map(str, self.codes))} | "
                f"{'-' if g is None else f'{g:.1f}'} | {'yes' if self.named else 'NO'} | "
                f"{'YES' if self.traceback else 'no'} | {self.leftovers} | `{shown[:110]}` |")


def run_case(case: Case, work: Path, timeout_s: float = TIMEOUT_S) -> Result:
    work.mkdir(parents=True, exist_ok=True)
    stages = make_stages(work.parent if work.name.startswith("case-") else work, case.world)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("FLOWSPEC_DEBUG", None)
    env.pop("FLOWSPEC_FAULT", None)
    if case.fault:
        env["FLOWSPEC_FAULT"] = case.fault
    env.update(case.env)
    args = [*case.args, *FAST]
    logs, procs, blocker = [], [], None
    start = time.monotonic()
    if case.launcher == "pipe":
        cmd = ["./run_pipe.sh", f"model.stage_dir={stages}", *args]
        f = open(work / "out.log", "w+")
        logs.append(f)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    else:
        port = free_port()
        if case.taken_port:
            blocker = socket.socket()
            blocker.bind(("0.0.0.0", port))
            blocker.listen()
        for k in range(case.world):
            if k == case.missing_node:
                continue
            node_stages = work / f"host{k}"
            if not node_stages.exists():
                shutil.copytree(stages, node_stages)
            e = dict(env, NODE_RANK=str(k), NNODES=str(case.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     STAGE_DIR=str(node_stages))
            f = open(work / f"out{k}.log", "w+")
            logs.append(f)
            procs.append(subprocess.Popen(["./run_jetson.sh", *args], cwd=REPO, env=e, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    roots = {p.pid for p in procs}
    seen: set[int] = set()
    seen_ranks: set[int] = set()
    t_fault = None
    t_gone = None
    leftovers = 0
    killed_launcher = False
    hard_end = None
    while True:
        now = time.monotonic() - start
        cur = {p for p in descendants(roots) | {p.pid for p in procs if p.poll() is None} if alive(p)}
        ranks = {p for p in cur if is_rank(p)}
        if t_fault is None and case.lost is not None and case.missing_node is None and (
                any(p not in ranks for p in seen_ranks) or any(stopped(p) for p in ranks)):
            t_fault = now
        if t_fault is None and case.taken_port and procs[0].poll() is not None:
            # the fault is node 0 giving up on its taken port, after its own start-up (importing torch: seconds on
            # a loaded host); the other launchers' rendezvous windows open after theirs, so their bound counts
            # from here, not from the launch (docs/failures.md)
            t_fault = now
        seen_ranks |= ranks
        if case.kill_launcher_after is not None and not killed_launcher and now >= case.kill_launcher_after:
            os.kill(procs[0].pid, signal.SIGKILL)
            killed_launcher, t_fault = True, now
        seen |= cur
        for p in procs:
            p.poll()
        if not cur and all(p.returncode is not None for p in procs):
            t_gone = now
            break
        if hard_end is None and (t_fault is not None or case.lost is None or case.missing_node is not None):
            hard_end = (t_fault or 0.0) + timeout_s + (15.0 if t_fault is not None else 60.0)
        if (hard_end is not None and now > hard_end) or now > 240:
            leftovers = len(cur)
            for pid in cur | {p.pid for p in procs}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for p in procs:
                p.wait()
            break
        time.sleep(0.1)
    if blocker is not None:
        blocker.close()
    out = ""
    for k, f in enumerate(logs):
        f.seek(0)
        text = f.read()
        f.close()
        out += "".join(f"[{'pipe' if case.launcher == 'pipe' else f'host{k}'}] {l}\n" for l in text.splitlines())
    if case.missing_node is not None:
        named = out.count(f"node(s) {case.missing_node} never joined") >= case.world - 1
    elif case.lost is not None:
        named = _names_everywhere(case, out)
    elif case.taken_port:
        named = "already in use" in out and out.count("did not answer") >= case.world - 1
    else:
        named = True
    return Result(case, [p.returncode for p in procs], out, t_fault, t_gone, leftovers, named,
                  "Traceback" in out)


def _names_everywhere(case: Case, out: str) -> bool:
    """Every surviving rank and every launcher printed a line naming the lost rank."""
    want = f"lost rank {case.lost}"
    ranks = [r for r in range(case.world) if r != case.lost]
    sig_stop = "sig=STOP" in case.fault
    ok_ranks = all(any(l.startswith(f"[rank {r}]") and want in l for l in _lines(out)) for r in ranks)
    launchers = [l for l in _lines(out) if l.startswith("[launch")]
    ok_launch = bool(launchers) and all(want in l or f"rank {case.lost} failed" in l for l in launchers
                                        if "error:" not in l or sig_stop)
    return ok_ranks and ok_launch


def _lines(out: str) -> list[str]:
    return [l.split("] ", 1)[1] if l.startswith("[pipe]") or l.startswith("[host") else l for l in out.splitlines()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example: .venv/bin/python -m scripts.fault_matrix --cases pipe-kill-r1-decode")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all): " +
                   ", ".join(BY_NAME))
    p.add_argument("--work", default="", help="scratch folder (default: a temporary one)")
    a = p.parse_args(argv)
    names = [n for n in a.cases.split(",") if n] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}")
    work = Path(a.work or tempfile.mkdtemp(prefix="fault_matrix_"))
    print("| case | exit codes | s from fault until every process is gone | lost rank named by every survivor "
          "and launcher | traceback | leftovers | launcher's line |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for n in names:
        r = run_case(BY_NAME[n], work / f"case-{n}")
        print(r.row(), flush=True)
        bad += (not r.named) or r.traceback or r.leftovers > 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
