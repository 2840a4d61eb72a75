"""Starting and stopping a job of pipeline ranks from a tool (bench, eval, quant_report, launch itself).

What this module holds, one copy each:

* :func:`launcher_command`: how a job is started, the project's launcher (``python -m pipeline.tools.launch``,
  torchrun's options without torchrun's agent) under the current interpreter;
* :func:`job_command`: that launcher running ``world`` local ranks of ``python -m pipeline.run ARGS``;
* :func:`free_port`: a free local TCP port outside the kernel's ephemeral range (rendezvous of a one-host job);
* :func:`child_env`: the environment of a job's ranks: this process's, with ``OMP_NUM_THREADS`` defaulting to
  1 (ranks share the host's cores) and the repository first on ``PYTHONPATH`` (so ``-m pipeline.run`` resolves
  from any working directory);
* :func:`run_job`: one job in its own session (process group), its output in a log file that starts with the
  ``$ command`` line, polled until it ends; a timeout or an exception in the caller (Ctrl-C) stops the whole
  group (:func:`stop_job`), so no rank outlives the tool;
* :func:`log_tail`: the last lines of a job's log, for the one failure message a tool prints.

Invariant: every process :func:`run_job` starts has ended (or been sent SIGKILL) when it returns or raises.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from config.paths import REPO


def launcher_command() -> list[str]:
    """The job launcher: ``pipeline.tools.launch`` (torchrun's options; one line per failure, bounded, no
    orphans) under the current interpreter."""
    return [sys.executable, "-m", "pipeline.tools.launch"]


def job_command(world: int, run_args: list[str]) -> list[str]:
    """``world`` ranks of ``python -m pipeline.run *run_args`` on this host, through the launcher."""
    return [*launcher_command(), "--standalone", f"--nproc_per_node={world}", "-m", "pipeline.run", *run_args]


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICK_LOW = 10000      # the lowest port :func:`free_port` picks (above the registered services most hosts run)


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and ``bind(port 0)``, inclusive; Linux's default
    (32768, 60999) where it cannot be read (another OS)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(rng=None) -> int:
    """A TCP port free on 127.0.0.1 right now, picked at random OUTSIDE the kernel's ephemeral range.

    Why not ``bind(0)``: that hands out a port of the ephemeral range, the same range from which every outgoing
    connection on the host takes its local port. Between this pick and the job's own bind, a job's ranks open many
    connections (gloo's full mesh, HTTP clients), and one of them could take the port: the rendezvous or the server
    then fails with "address already in use" (a CI run's serve test did, before its server bound port 0 itself and
    reported the port). A port outside that range is never taken by a connection; only another explicit pick could
    take it, and a random pick among some twenty thousand ports makes that rare. Still checked free by a bind before
    it is returned; ``bind(0)`` only where no port outside the range is free."""
    rng = rng or random.Random()
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((PICK_LOW, low - 1), (high + 1, 65535)) if a <= b]
    for _ in range(64 if spans else 0):
        a, b = rng.choices(spans, weights=[b - a + 1 for a, b in spans])[0]
        port = rng.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a job's ranks: ``os.environ``, ``OMP_NUM_THREADS`` 1 unless set, the repository first on
    ``PYTHONPATH``, then ``extra`` (e.g. ``FLOWSPEC_PARENT_PID``: the launcher stops its job when that process
    dies, even by kill -9)."""
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **extra,
                PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def stop_job(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the job's process group (launcher and ranks), SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_job(cmd: list[str], log_path: Path, env: dict, on_poll: Callable[[], None], poll_s: float,
            grace_s: float = 10.0, timeout_s: float = 0.0, on_timeout: Callable[[], None] | None = None,
            append: bool = False) -> int:
    """Run ``cmd`` in the repository, stdout and stderr to ``log_path`` (after a ``$ cmd`` line; ``append``
    keeps earlier content), calling ``on_poll`` every ``poll_s`` while it runs. Past ``timeout_s`` (0 = never)
    ``on_timeout`` is called once and the job is stopped. Any exception (KeyboardInterrupt included) stops the
    job before it propagates. Returns the job's exit status; ``on_poll`` is not called after the end (the
    caller reads the last rows itself)."""
    t_start = time.time()
    timed_out = False
    with open(log_path, "a" if append else "w", encoding="utf-8") as lf:
        lf.write(f"$ {' '.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(poll_s)
                on_poll()
                if timeout_s and not timed_out and time.time() - t_start > timeout_s:
                    timed_out = True
                    if on_timeout is not None:
                        on_timeout()
                    stop_job(proc, grace_s)
        except BaseException:
            stop_job(proc, grace_s)
            raise
    return proc.returncode


def log_tail(log_path: Path, lines: int) -> str:
    """The last ``lines`` lines of a job's log, each indented under a tool's failure line."""
    tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return "\n    " + "\n    ".join(tail)
