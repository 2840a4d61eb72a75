"""Rank processes forked from a *zygote* that imported torch and transformers once.

A fresh ``python -m pipeline.run`` spends about 4.5 CPU-s of a quiet core (8 on a loaded one) importing torch,
transformers and the stage code before it reads its arguments; a test that launches 3-5 ranks pays that per rank.
The zygote is a separate, single-threaded interpreter that imports what a rank imports and then forks one child per
request. Each child is still its own process: it takes the request's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_PORT``, ``FLOWSPEC_FAULT``, ...) and file descriptors, runs ``pipeline.run.entry`` (the function behind
``python -m pipeline.run``) and leaves through ``pipeline.run.exit_now`` as that command does; ranks talk over gloo
and die by real signals. What a forked rank does not re-check: the interpreter's own start (``python -m`` finding the
module, import-time side effects, a per-process ``PYTHONHASHSEED``: forked ranks share the zygote's, so an order
of a set of strings is the same in every rank and every run; ``random`` and NumPy's global generator are reseeded
from the OS in each child, as a fresh interpreter seeds them). Those stay covered by the tests that exec real
interpreters: ``tests/test_e2e.py::test_plain_torchrun_still_launches_the_ranks``, the launcher, fault (argument
errors, Ctrl-C while importing), serving, bench and eval tests, and ``FLOWSPEC_TEST_EXEC_RANKS=1`` makes
:func:`tests.helpers.launch` exec every rank again.

Protocol: JSON lines in (``{"env", "args", "err", "out"}``), out (``{"pid"}`` per request, ``{"exit": pid, "code",
"t"}`` per finished child; ``t`` = ``time.monotonic()``, system-wide; ``code`` = -N for a child killed by signal N).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ZYGOTE_SRC = r"""
import json, os, select, signal, sys, time, traceback
for m in ("torch", "transformers", "transformers.models.llama.modeling_llama", "safetensors.torch",
          "model.stage_model", "model.layers", "pipeline.comm", "pipeline.worker", "pipeline.engine",
          "pipeline.modes", "model.prompts", "pipeline.emulation", "draft.drafter", "draft.eagle", "pipeline.run",
          "pipeline.build", "pipeline.outputs", "pipeline.tp_run", "draft.eagle3", "draft.load_head"):
    try:
        __import__(m)
    except Exception:
        pass
from transformers import AutoConfig, AutoTokenizer  # resolve the lazy names too
out = os.fdopen(os.dup(1), "w", buffering=1)
out.write(json.dumps({"ready": len(os.listdir("/proc/self/task"))}) + "\n")
children, buf = set(), b""

def child(req):
    code = 1
    try:
        fd = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if req.get("out") else null, 1)
        os.environ.clear()
        os.environ.update(req["env"])
        import random
        random.seed()                                # a fresh interpreter's entropy, not the zygote's state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        from pipeline import run
        run.exit_now(run.entry(req["args"]))        # what `python -m pipeline.run` does
    except SystemExit as e:                          # argparse (--help, bad options), as the interpreter would
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

while True:
    ready, _, _ = select.select([0], [], [], 0.02)
    if ready:
        data = os.read(0, 1 << 16)
        if not data:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                out = None
                child(req)
            children.add(pid)
            out.write(json.dumps({"pid": pid}) + "\n")
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"exit": pid, "code": code, "t": time.monotonic()}) + "\n")
"""


class Zygote:
    """The zygote process; :meth:`spawn` forks a rank, :attr:`exits` maps a finished rank's pid to
    ``(code, monotonic time)`` once :meth:`collect` has read it. Not thread-safe (one test at a time)."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TORCH_CPP_LOG_LEVEL="ERROR")
        env.pop("FLOWSPEC_DEBUG", None)
        self._log = tempfile.TemporaryFile()     # the zygote's own stderr (import warnings), not a test's capture
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE_SRC], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self.exits: dict[int, tuple[int, float]] = {}
        self._buf = b""
        self._replies: list[dict] = []
        self._ready = False  # imports run while the caller does other work

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self) -> None:
        if not self._ready:
            msg = self._next(lambda m: "ready" in m, 300)
            assert msg["ready"] == 1, "the zygote must stay single-threaded to fork safely"
            self._ready = True

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        assert data, "the zygote died"
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            m = json.loads(line)
            if "exit" in m:
                self.exits[m["exit"]] = (m["code"], m["t"])
            else:
                self._replies.append(m)

    def _next(self, pred, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for m in self._replies:
                if pred(m):
                    self._replies.remove(m)
                    return m
            assert time.monotonic() < deadline, "no answer from the zygote"
            self._read(0.1)

    def collect(self, timeout: float) -> None:
        self._read(timeout)

    def spawn(self, env: dict, args: list[str], err: Path, out: Path | None = None) -> int:
        """Fork one rank: ``env`` is its whole environment, ``args`` its ``pipeline.run`` arguments, ``err`` /
        ``out`` the files its stderr / stdout go to (stdout to /dev/null without ``out``). Returns its pid."""
        self.wait_ready()
        req = {"env": env, "args": list(args), "err": str(err), "out": str(out) if out else None}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return self._next(lambda m: "pid" in m, 60)["pid"]

    def close(self) -> None:
        """Close the zygote's stdin: it kills any child still running and exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_shared: Zygote | None = None


def shared_zygote() -> Zygote:
    """One zygote for the whole pytest session (started on first use, closed when the interpreter exits)."""
    global _shared
    if _shared is None or not _shared.alive():
        _shared = Zygote()
        atexit.register(_shared.close)
    return _shared
