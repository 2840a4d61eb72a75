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
from tests.helpers import REPO, STORIES, free_port

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
    (["--prompts-file", "/no/such/q.jsonl"], {}, "prompts file /no/such/q.jsonl does not exist"),
    (["--prompts-file", "PROMPTS", "--begin", "5"], {}, "has no records in [5, None)"),
])
def test_bad_input_one_line_before_any_rank(args, env, needle, tmp_path):
    """Shared argument errors: one line from the launcher, exit 2, no rank started (nothing can race it)."""
    from scripts.fault_matrix import make_stages
    stages = make_stages(tmp_path, 3)
    (tmp_path / "q.jsonl").write_text('{"question_id": 1, "turns": ["hi"]}\n')
    args = [str(tmp_path / "q.jsonl") if a == "PROMPTS" else a for a in args]
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


# -- host 0 frozen (issue 42): every call to the store is bounded ----------------------------------------------
def _jetson(work, stages, port: int, k: int, env: dict, args: list[str]):
    import shutil
    root = work / f"host{k}"
    if not root.exists():
        shutil.copytree(stages, root)
    e = dict(env, NODE_RANK=str(k), NNODES="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), STAGE_DIR=str(root))
    log = open(work / f"out{k}.log", "w+")
    return subprocess.Popen([str(REPO / "run_jetson.sh"), *args], cwd=REPO, env=e, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True), log


FROZEN_TIMEOUT_S = TIMEOUT_S   # the cases' 5 s (was 10: before the rendezvous window opened after torch's import)


def _frozen_host0(work, fault: str, stop_launcher_when: str):
    """Three run_jetson.sh launchers on localhost; host 0 (its launcher, which holds the store, and maybe rank 0)
    is frozen with SIGSTOP mid-decode. Returns (exit codes of launchers 1 and 2, their output, seconds from the
    freeze until every process of hosts 1 and 2 is gone, or None). Host 0's processes are SIGCONT'ed and
    SIGKILLed at the end, whatever happens."""
    import signal
    import time

    from scripts.fault_matrix import descendants, is_rank, make_stages, stopped
    stages = make_stages(work, 3)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("FLOWSPEC_DEBUG", None)
    env.pop("FLOWSPEC_FAULT", None)
    if fault:
        env["FLOWSPEC_FAULT"] = fault
    port = free_port()
    args = ["max_new_tokens=400", "mode=continuous", "--prompt-ids", "1,5,9,13,22,7",
            f"comm.timeout_s={FROZEN_TIMEOUT_S:g}", "comm.heartbeat_s=0.2", "--quiet"]
    jobs = [_jetson(work, stages, port, k, env, args) for k in range(3)]
    procs = [p for p, _ in jobs]
    host0 = {procs[0].pid}
    t_freeze = gone = loaded = None
    try:
        start = time.monotonic()
        while time.monotonic() - start < 300 and t_freeze is None:   # a loaded 2-core box starts slowly
            kids = {p for p in descendants(host0) if is_rank(p)}
            ranks_everywhere = [p for p in descendants({q.pid for q in procs}) if is_rank(p)]
            if stop_launcher_when == "rank0-stopped":
                ready = any(stopped(p) for p in kids)
            else:   # every rank has joined the process group (it prints its loading line after), then decodes
                if loaded is None and len(ranks_everywhere) == 3 and all("loading stage" in _read(l) for _, l in jobs):
                    loaded = time.monotonic()
                ready = loaded is not None and time.monotonic() - loaded > 1.5
            if ready:
                host0 |= kids
                os.kill(procs[0].pid, signal.SIGSTOP)   # the launcher holding the store (run_jetson.sh exec'ed it)
                t_freeze = time.monotonic()
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        assert t_freeze is not None, "host 0 never froze:\n" + "".join(_read(l) for _, l in jobs)
        others = {p.pid for p in procs[1:]}
        while time.monotonic() - t_freeze < FROZEN_TIMEOUT_S + 40:
            alive = [p for p in procs[1:] if p.poll() is None] + [p for p in descendants(others)]
            if not alive:
                gone = time.monotonic() - t_freeze
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs[1:]]
        out = "".join(_read(l) for _, l in jobs[1:])
        return codes, out, gone
    finally:
        everyone = descendants({p.pid for p in procs}) | {p.pid for p in procs} | host0
        for pid in everyone:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def _read(log) -> str:
    """The log's text so far, read through its own file (a seek on ``log`` would move the child's offset too)."""
    with open(log.name, errors="replace") as f:
        return f.read()


@pytest.mark.parametrize("case", ["rank0-and-launcher", "launcher-only"])
def test_frozen_host0_every_other_process_exits_naming_it(case, work):
    """Host 0 frozen with its sockets open (SIGSTOP: rank 0 at a segment, then its launcher, which holds the
    rendezvous store; or the launcher alone mid-decode): the store calls of every other rank's watchdog and of
    every other launcher used to hang forever, printing nothing. Now hosts 1 and 2 end within comm.timeout_s +
    slack, each launcher and each rank with one line naming rank 0 / host 0, no traceback, nothing left."""
    fault = "rank=0,at=segment,count=15,sig=STOP" if case == "rank0-and-launcher" else ""
    codes, out, gone = _frozen_host0(work / f"frozen-{case}", fault,
                                     "rank0-stopped" if fault else "decoding")
    print(f"\nhost 0 frozen ({case}): hosts 1 and 2 gone {gone} s after the freeze, exit codes {codes}")
    # the launcher alone may freeze after the answer (then the ranks finish cleanly and only the launchers,
    # which can no longer tell host 0 they are done, name it); otherwise every rank names rank 0 too.
    # Finished, two bounded store calls run one after the other: each rank's done record (Comm.close), then
    # its launcher's (19.7 s measured at bce964b and after, against the single bound's 20 s: 1 run in ~4 failed)
    finished = case == "launcher-only" and codes == [0, 0]
    bound = (2 if finished else 1) * FROZEN_TIMEOUT_S + SLACK_S
    assert gone is not None and gone <= bound, (gone, out[-4000:])
    assert codes == [3, 3] or finished, (codes, out[-4000:])
    assert "Traceback" not in out, out[-4000:]
    lines = [l for l in out.splitlines() if l.strip() and "loading" not in l and "WARNING" not in l]
    for tag in ("[launch node 1]", "[launch node 2]") + (() if finished else ("[rank 1]", "[rank 2]")):
        mine = [l for l in lines if l.startswith(tag)]
        assert len(mine) == 1 and "lost rank 0" in mine[0], (tag, mine, out[-4000:])
    if finished:
        assert not [l for l in lines if l.startswith("[rank 1]") or l.startswith("[rank 2]")], out[-4000:]


# -- the store: bounded calls, loopback only on one host, records quoted (issue 42) ----------------------------
def _store_server(tmp_path):
    """A TCPStore server in a child process (as node 0's launcher holds it): (process, port)."""
    import sys
    import time
    code = ("import datetime, sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)\n"
            "print(s.port, flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    time.sleep(0.1)
    return p, port


def test_bounded_store_call_returns_when_the_server_is_frozen(tmp_path):
    """A live but frozen store server (SIGSTOP) never answers: a raw TCPStore call hangs past its own timeout;
    through BoundedStore it raises StoreUnresponsive within the deadline, and every later call at once.

    The bounded call is one that awaits a reply (``check``): torch's ``set`` only sends, and returns while the
    socket buffer takes it. The raw call has its own client: sharing one, the raw ``check`` held the client's lock
    and the bounded ``set`` timed out on that lock, or took it first and returned (CI: "DID NOT RAISE")."""
    import datetime
    import signal
    import threading
    import time

    from torch.distributed import TCPStore

    from pipeline.comm import BoundedStore, StoreUnresponsive
    p, port = _store_server(tmp_path)
    hung = threading.Event()
    try:
        def client():
            return TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=1), wait_for_workers=False)
        raw, other = client(), client()   # both connected before the freeze (a frozen server accepts nothing)
        store = BoundedStore(raw, 1.0)
        store.set("k", "v")
        assert store.get("k") == b"v" and store.check(["k"]) and store.port == port
        os.kill(p.pid, signal.SIGSTOP)
        # kill() returns before the signal is delivered: on a loaded machine the server could still answer the next
        # call, so wait until the kernel reports it stopped ("T" in /proc/PID/stat)
        deadline = time.monotonic() + 10
        while open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T" \
                and time.monotonic() < deadline:
            time.sleep(0.01)

        def raw_call():   # the old code's call: no deadline of its own for a frozen server
            try:
                other.check(["k"])
            except Exception:
                pass
            hung.set()
        threading.Thread(target=raw_call, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(StoreUnresponsive):
            store.check(["k"])
        took = time.monotonic() - t0
        assert 0.9 <= took < 2.5, took
        t0 = time.monotonic()
        with pytest.raises(StoreUnresponsive):
            store.set("k", "w")
        assert time.monotonic() - t0 < 0.1 and store.dead
        assert not hung.wait(2.0), "a raw TCPStore call returned from a frozen server: the premise changed"
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()
        # the calls left hanging (the raw one, BoundedStore's worker) now fail on the dead socket: let them do it
        # while pytest still captures this test's output, or torch's C++ warning wall lands between tests
        hung.wait(5.0)
        time.sleep(0.5)


def _non_loopback_address() -> str | None:
    import socket
    import ipaddress
    cands = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.77", 9))   # no packet is sent: just the route's source address
            cands.append(s.getsockname()[0])
    except OSError:
        pass
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
        cands += out.split()
    except (OSError, subprocess.SubprocessError):
        pass
    for a in cands:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if ip.version == 4 and not ip.is_loopback and not ip.is_unspecified:
            return a
    return None


def _refused(addr: str, port: int) -> bool:
    import socket
    with socket.socket() as s:
        s.settimeout(3)
        try:
            s.connect((addr, port))
        except OSError:
            return True
    return False


@pytest.mark.parametrize("opts", [
    {"standalone": True, "nnodes": 1, "master_addr": "127.0.0.1"},
    {"standalone": False, "nnodes": 3, "master_addr": "127.0.0.1"},   # run_jetson.sh's hosts all on this machine
    {"standalone": False, "nnodes": 3, "master_addr": "127.0.1.1"},   # Debian's address for the host's own name
])
def test_one_host_store_listens_on_loopback_only(opts):
    """torch's TCPStore server binds every interface whatever host name it is given; on one host the launcher
    hands it a socket bound to 127.0.0.1, so nothing outside this machine can write a failure record."""
    import time

    from pipeline.tools.launch import open_store
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    o = dict(opts, node_rank=0, nproc_per_node=1, master_port=0 if opts["standalone"] else free_port())
    store = open_store(o, 5.0, time.monotonic() + 5, "[launch]")
    port = store.port
    assert not _refused(opts["master_addr"], port), "the store does not listen where its clients connect"
    assert _refused(addr, port), f"the store accepts connections on {addr}:{port}"


def test_script_path_and_loopback_store_through_the_launcher(tmp_path):
    """The launcher takes a script path as torchrun does (was: "unexpected argument"); its ranks see the store on
    127.0.0.1 only."""
    import sys
    addr = _non_loopback_address() or ""
    script = tmp_path / "probe.py"
    script.write_text("import os, socket, sys\n"
                      "port = int(os.environ['MASTER_PORT'])\n"
                      "def refused(a):\n"
                      "    s = socket.socket(); s.settimeout(3)\n"
                      "    try:\n        s.connect((a, port)); return False\n"
                      "    except OSError:\n        return True\n"
                      "line = ' '.join(map(str, ['rank', os.environ['RANK'], 'args', sys.argv[1:], 'addr',\n"
                      "    os.environ['MASTER_ADDR'], 'loopback-open', not refused('127.0.0.1'), 'lan-refused',\n"
                      "    refused(sys.argv[1]) if sys.argv[1] else 'n/a']))\n"
                      # one file per rank: two ranks printing to one pipe interleave (CI saw "rankrank  01 ...")
                      f"open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write(line)\n")
    res = subprocess.run([sys.executable, "-m", "pipeline.tools.launch", "--standalone", "--nproc-per-node=2",
                          str(script), addr, "x=1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [(tmp_path / f"rank{r}").read_text() if (tmp_path / f"rank{r}").exists() else "" for r in (0, 1)]
    want = "True" if addr else "n/a"
    assert lines == [f"rank {r} args {[addr, 'x=1']!r} addr 127.0.0.1 loopback-open True lan-refused {want}"
                     for r in (0, 1)], res.stdout + res.stderr


def test_bad_script_path_is_one_line(tmp_path):
    import sys
    res = subprocess.run([sys.executable, "-m", "pipeline.tools.launch", "--standalone", str(tmp_path / "nope.py")],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert res.stderr.startswith("[launch] error: no script"), res.stderr


def test_record_text_is_quoted_sanitized_bounded():
    """A failure record's text comes from whoever reached the store: shown quoted, one line, bounded."""
    from pipeline.comm import RECORD_CHARS, quoted, record_text
    evil = "pwned\n[rank 0] error: fake line\x1b[31m red \x07" + "x" * 1000
    t = record_text(evil)
    assert "\n" not in t and "\x1b" not in t and "\x07" not in t and len(t) <= RECORD_CHARS and t.endswith("...")
    assert quoted("its process was killed by SIGKILL", 2) == \
        'a record in the store by rank 2 says: "its process was killed by SIGKILL"'


class _DictStore:
    def __init__(self, d):
        self.d = {k: v.encode() for k, v in d.items()}

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, k):
        return self.d[k]


def test_operator_stop_is_not_a_lost_rank():
    """After SIGTERM to the launcher, rank 0's watchdog could read rank 1's record "interrupted by SIGTERM" before
    its own signal handler ran and exit 3 blaming rank 1 (1 run in 6). The launcher records the stop before it
    passes the signal on; a rank that reads a peer's record then reports a stop (exit 143), never a lost rank."""
    from pipeline.comm import FAIL_PREFIX, STOP_KEY, Comm, PeerLost
    c = Comm.__new__(Comm)
    c.rank, c.world = 0, 3
    c.store = _DictStore({FAIL_PREFIX + "1": "1|interrupted by SIGTERM", STOP_KEY: "0|SIGTERM"})
    got = c._reported_loss()
    assert not isinstance(got, PeerLost), got
    assert got.exit_code == 143 and "lost" not in str(got) and "SIGTERM" in str(got), str(got)
    c.store = _DictStore({FAIL_PREFIX + "1": "1|its process was killed by SIGKILL"})   # no stop: a lost rank
    got = c._reported_loss()
    assert isinstance(got, PeerLost) and got.lost == 1 and "a record in the store" in str(got)


def test_sigterm_to_the_launcher_is_a_stop_never_a_lost_rank(work):
    """SIGTERM to run_pipe.sh's launcher mid-decode: every rank says it was interrupted or stopped, the launcher
    exits 143, and no line blames a rank (was: 1 run in 6, rank 0 exited 3 "lost rank 1"; the race itself is
    pinned by test_operator_stop_is_not_a_lost_rank, deterministically). One run, not two (issue 43): a second
    launch only sampled the same 1-in-6 race again, which the pinned test covers every time."""
    import signal
    import time

    from scripts.fault_matrix import FAST, descendants, is_rank, make_stages
    stages = make_stages(work, 3)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("FLOWSPEC_FAULT", None)
    log = work / "sigterm.log"
    with open(log, "w") as f:
        p = subprocess.Popen(["./run_pipe.sh", f"model.stage_dir={stages}", "max_new_tokens=400", "mode=continuous",
                              "--prompt-ids", "1,5,9,13,22,7", *FAST], cwd=REPO, env=env, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start = time.monotonic()
        while time.monotonic() - start < 120 and p.poll() is None:
            text = log.read_text()
            if text.count("loading stage") == 3 and len([q for q in descendants({p.pid}) if is_rank(q)]) == 3:
                break
            time.sleep(0.1)
        time.sleep(1.0)
        os.kill(p.pid, signal.SIGTERM)
        code = p.wait(60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = log.read_text()
    assert code == 143, (code, out[-3000:])
    assert "lost rank" not in out and "Traceback" not in out, out[-3000:]
    assert "[launch] stopped by SIGTERM" in out, out[-3000:]


def test_whole_lines_makes_a_printed_line_one_write():
    """Under ``PYTHONUNBUFFERED`` a text stream writes through: ``print(a, b)`` is one write per piece, and two ranks
    on one pipe interleaved inside a line on CI. :func:`pipeline.run.whole_lines` makes each line one write (planted:
    without it the same print is several writes)."""
    import io
    from pipeline.run import whole_lines

    class Raw(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    def writes(fix: bool) -> list[bytes]:
        raw = Raw()
        stream = io.TextIOWrapper(raw, write_through=True)  # what python -u gives a pipe
        if fix:
            whole_lines([stream])
        print("rank", 0, "args", ["x"], file=stream)
        print("rank", 1, "done", file=stream, flush=True)
        return raw.writes

    assert len(writes(False)) > 2  # the planted case: pieces
    assert writes(True) == [b"rank 0 args ['x']\n", b"rank 1 done\n"]
