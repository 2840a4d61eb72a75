"""The project's launcher (instead of torchrun's agent): ``python -m pipeline.tools.launch [options] -m pipeline.run ...``.

One host:        python -m pipeline.tools.launch --standalone --nproc-per-node=3 -m pipeline.run model.stage_dir=DIR
Several hosts:   python -m pipeline.tools.launch --nnodes=3 --node-rank=1 --master-addr=10.0.0.1 --master-port=29500 \\
                     -m pipeline.run model.stage_dir=DIR        (the same command on every host, own --node-rank)
A script:        python -m pipeline.tools.launch --standalone --nproc-per-node=2 path/to/script.py ARGS  (as torchrun)

Options (torchrun's spellings, ``--nproc_per_node`` and ``--nproc-per-node`` alike): ``--standalone``,
``--nnodes N`` (1), ``--node-rank K`` (0), ``--nproc-per-node P`` (1), ``--master-addr A`` (127.0.0.1),
``--master-port PORT`` (29500; a free port with ``--standalone``). Global rank = K * P + local rank.

What the launcher guarantees (invariants the tests in tests/test_launchers.py check):

* Arguments are checked once, before any rank starts (``pipeline.run.check_args``): a bad key, value, mode,
  prompt or stage root / world is one ``[launch] error: ...`` line and exit 2.
* Startup is bounded by ``comm.timeout_s``: node 0's launcher hosts the rendezvous store (a TCPStore; a
  taken port is one line), the others connect to it; every launcher waits for all ``--nnodes`` launchers,
  and gives up naming the node ranks that never joined (exit 3). A foreign program on the port, or no
  node 0, ends in one line on every host too.
* Whichever rank dies (signal, error, frozen), the launcher writes a failure record for it in the store
  (``flowspec/fail/<rank>``, unless the rank wrote its own), so every surviving rank prints one line naming
  it and the cause (pipeline/comm.py); the launcher then prints one summary line. A rank that survivors
  report silent (no heartbeat for ``comm.timeout_s``) but that is still there (frozen) is killed at once;
  the others get a short grace (``max(3 s, min(timeout_s, 10 heartbeats))``) to print and are then
  killed: the launcher returns within ``comm.timeout_s`` + a few seconds of the fault.
* Every process a launcher starts ends when the launcher ends: children run under ``PR_SET_PDEATHSIG``
  = SIGKILL (Linux), so even ``kill -9`` of the launcher takes its ranks along. SIGINT / SIGTERM to the
  launcher are passed on to its ranks, which stop with one line each.
* Node 0's launcher keeps the store up (briefly, bounded) until the other hosts' ranks have read the
  failure records, so a lost rank 0 is named as such on every host.
* Every call to the store (ranks' watchdogs and launchers alike) returns within ``comm.timeout_s``
  (``pipeline.comm.BoundedStore``): a host 0 that is frozen (SIGSTOP), powered off or unplugged makes every
  other process exit within ``comm.timeout_s`` + a few seconds, naming host 0 (rank 0), never a silent hang.
* On one host (``--standalone``, ``--nnodes 1``, or a loopback ``--master-addr``) the store listens on
  127.0.0.1 only (a pre-bound loopback socket handed to TCPStore); on several hosts it listens on every
  interface, unauthenticated: MASTER_PORT must be reachable only from the cluster's hosts. A failure record's
  text is only ever shown quoted (``a record in the store says: "..."``, sanitized, bounded).
* An operator's signal to a launcher is recorded in the store before it is passed on, so every rank reports
  a stop, never a lost rank.

Exit codes: 0 every rank succeeded; 2 bad input (a rank's own ``error:``, or the argument check); 3 a rank
was lost (killed, frozen, lost a peer) or a node never joined; 1 an unexpected exception in a rank;
128+N the launcher was stopped by signal N (130 Ctrl-C, 143 SIGTERM).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from pipeline.tools.ranks import launcher_command

FAIL_PREFIX = "flowspec/fail/"      # shared with pipeline/comm.py
DONE_PREFIX = "flowspec/done/"
NODE_PREFIX = "flowspec/launch/node/"
ABORT_KEY = "flowspec/launch/abort"
STOP_KEY = "flowspec/launch/stop"   # "<node rank>|<signal name>": an operator's stop (shared with pipeline/comm.py)
PR_SET_PDEATHSIG = 1
POLL_S = 0.05


class LaunchError(Exception):
    def __init__(self, text: str, code: int) -> None:
        super().__init__(text)
        self.code = code


# -- arguments ----------------------------------------------------------------------------------------
OPTIONS = {"nnodes": int, "node_rank": int, "nproc_per_node": int, "master_addr": str, "master_port": int}


def is_script(target: str) -> bool:
    """A launch target given as a script path (``path/to/x.py``, as torchrun takes it) rather than ``-m MODULE``."""
    return target.endswith(".py") or os.sep in target


def parse(argv: list[str]) -> tuple[dict, str, list[str]]:
    """``(options, target, args)``; torchrun's option spellings. ``-m MODULE`` or a script path (the first
    argument that is not an option, as torchrun's ``training_script``) ends the options."""
    opts: dict = {"standalone": False, "nnodes": 1, "node_rank": 0, "nproc_per_node": 1,
                  "master_addr": "127.0.0.1", "master_port": None}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            if i + 1 >= len(argv):
                raise LaunchError("-m needs a module (e.g. -m pipeline.run)", 2)
            return opts, argv[i + 1], argv[i + 2:]
        if a == "--standalone":
            opts["standalone"] = True
            i += 1
            continue
        if not a.startswith("--"):
            if not is_script(a) or a.startswith("-"):
                raise LaunchError(f"unexpected argument {a!r} before -m MODULE (or a script path ending in .py)", 2)
            if not os.path.isfile(a):
                raise LaunchError(f"no script {a!r} (give a file path, or -m MODULE)", 2)
            return opts, a, argv[i + 1:]
        name, eq, value = a[2:].partition("=")
        name = name.replace("-", "_")
        if name not in OPTIONS:
            raise LaunchError(f"unknown option {a.split('=')[0]} (see --help)", 2)
        if not eq:
            if i + 1 >= len(argv):
                raise LaunchError(f"{a} needs a value", 2)
            value = argv[i + 1]
            i += 1
        try:
            opts[name] = OPTIONS[name](value)
        except ValueError:
            raise LaunchError(f"--{name.replace('_', '-')} takes {OPTIONS[name].__name__}, got {value!r}", 2) from None
        i += 1
    raise LaunchError("missing -m MODULE or a script path (e.g. -m pipeline.run)", 2)


def check_options(o: dict) -> None:
    if o["nnodes"] < 1 or o["nproc_per_node"] < 1:
        raise LaunchError(f"--nnodes ({o['nnodes']}) and --nproc-per-node ({o['nproc_per_node']}) must be >= 1", 2)
    if not 0 <= o["node_rank"] < o["nnodes"]:
        raise LaunchError(f"--node-rank {o['node_rank']} is not in [0, {o['nnodes']})", 2)
    if o["standalone"] and o["nnodes"] != 1:
        raise LaunchError("--standalone runs on one host: drop it or --nnodes", 2)
    if o["master_port"] is None:
        o["master_port"] = 0 if o["standalone"] else 29500
    if not 0 <= o["master_port"] < 65536 or (o["master_port"] == 0 and o["nnodes"] > 1):
        raise LaunchError(f"--master-port {o['master_port']} must be in [1, 65535]", 2)


# -- child side ----------------------------------------------------------------------------------------
def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` for this process (Linux; False elsewhere or on failure)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except Exception:
        return False


def child(module: str, args: list[str]) -> None:
    """A rank: die with the launcher (parent-death signal, and a check that it is still our parent, since
    it may have died before the signal was armed), then run ``module`` as ``__main__``, or exec ``python SCRIPT``
    for a script path (``PR_SET_PDEATHSIG`` survives ``execve``)."""
    set_parent_death_signal()
    parent = os.environ.get("FLOWSPEC_LAUNCHER_PID")
    if parent and os.getppid() != int(parent):
        os._exit(128 + signal.SIGKILL)
    if is_script(module):   # ``python script.py`` exactly (its folder first on sys.path); the death signal stays
        os.execv(sys.executable, [sys.executable, module, *args])
    import runpy
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# -- store ---------------------------------------------------------------------------------------------
def _bounded(fn, seconds: float):
    """``fn()`` in a daemon thread; ``(result, error)``, or ``(None, TimeoutError)`` after ``seconds``
    (torch's TCPStore client can wait forever on a port that another program holds)."""
    box: dict = {}

    def run() -> None:
        try:
            box["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            box["e"] = e

    t = threading.Thread(target=run, daemon=True, name="flowspec-launch-store")
    t.start()
    t.join(max(0.1, seconds))
    if t.is_alive():
        return None, TimeoutError()
    return box.get("r"), box.get("e")


def loopback_address(o: dict) -> str | None:
    """Where the store listens when the job runs on this host only, else None (several hosts): 127.0.0.1 with
    ``--standalone`` or ``--nnodes 1``; the loopback address ``--master-addr`` names (127.0.0.1, 127.0.1.1,
    ::1, localhost) when every host runs here."""
    if o["standalone"] or o["nnodes"] == 1:
        return "127.0.0.1"
    try:
        import ipaddress
        addrs = [info[4][0] for info in socket.getaddrinfo(o["master_addr"], None, proto=socket.IPPROTO_TCP)]
        if addrs and all(ipaddress.ip_address(a).is_loopback for a in addrs):
            return next((a for a in addrs if ":" not in a), addrs[0])
    except (OSError, ValueError):
        pass
    return None


def loopback_socket(port: int, host: str = "127.0.0.1") -> socket.socket:
    """A listening TCP socket bound to ``host``:``port`` (a loopback address; port 0: a free one), for TCPStore's
    ``master_listen_fd``.

    Why: given a host name, torch's TCPStore server binds the wildcard address (every interface, IPv6 and IPv4)
    whatever the name; an unauthenticated store reachable from the LAN lets anyone write a failure record that
    stops the job. The caller keeps the socket object alive as long as the store."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def open_store(o: dict, timeout_s: float, deadline: float, tag: str):
    """Node 0: the store server (``LaunchError`` if the port is taken), listening on loopback only when the job
    runs on one host (:func:`loopback_address`); others: a client of node 0's. Either is returned wrapped in
    ``pipeline.comm.BoundedStore`` (every call bounded by ``timeout_s``)."""
    import datetime

    from torch.distributed import TCPStore

    from pipeline.comm import BoundedStore
    addr, port = o["master_addr"], o["master_port"]
    td = datetime.timedelta(seconds=timeout_s)
    if o["node_rank"] == 0:
        host = "127.0.0.1" if o["standalone"] else addr
        listen = None
        loop = loopback_address(o)
        if loop is not None:
            host = loop
            try:
                listen = loopback_socket(port, loop)
            except OSError as e:
                if e.errno == 98:   # EADDRINUSE
                    raise LaunchError(f"cannot open the rendezvous on port {port}: it is already in use by another "
                                      f"program or job; choose a free MASTER_PORT", 2) from None
                raise LaunchError(f"cannot open the rendezvous at {loop}:{port}: {e.strerror or e}", 2) from None
            port = listen.getsockname()[1]
        kw = {} if listen is None else {"master_listen_fd": listen.fileno()}
        store, err = _bounded(lambda: TCPStore(host, port, None, True, td, wait_for_workers=False, **kw), timeout_s)
        if err is not None:
            text = str(err)
            if "EADDRINUSE" in text or "in use" in text:
                raise LaunchError(f"cannot open the rendezvous on port {port}: it is already in use by another "
                                  f"program or job; choose a free MASTER_PORT", 2)
            first = next((l.strip() for l in text.splitlines() if l.strip()), type(err).__name__)[:200]
            raise LaunchError(f"cannot open the rendezvous at {host}:{port}: {first}", 2)
        bounded = BoundedStore(store, timeout_s, "the rendezvous store")
        bounded.listen_socket = listen
        return bounded
    left = max(0.5, deadline - time.monotonic())
    store, err = _bounded(lambda: TCPStore(addr, port, None, False, datetime.timedelta(seconds=left),
                                           wait_for_workers=False), left + 1.0)
    if err is not None:
        raise LaunchError(f"no rendezvous at {addr}:{port} within {timeout_s:g}s: node 0 did not answer (not "
                          f"started, unreachable, or another program holds port {port})", 3)
    return BoundedStore(store, timeout_s, "node 0's rendezvous store")


def node_rendezvous(store, o: dict, deadline: float, timeout_s: float) -> None:
    """Every launcher registers and waits for all ``nnodes``; node 0 decides when to give up."""
    k, n = o["node_rank"], o["nnodes"]
    me = f"{n},{o['nproc_per_node']},{socket.gethostname()}"
    if store.add(NODE_PREFIX + f"count/{k}", 1) > 1:
        raise LaunchError(f"node rank {k} joined twice: give every host its own NODE_RANK", 2)
    store.set(NODE_PREFIX + str(k), me)
    keys = [NODE_PREFIX + str(r) for r in range(n)]
    while True:
        present = [r for r in range(n) if store.check([keys[r]])]
        if len(present) == n:
            break
        if k != 0 and store.check([ABORT_KEY]):
            missing = store.get(ABORT_KEY).decode()
            store.set(NODE_PREFIX + f"ack/{k}", "1")
            raise LaunchError(f"node(s) {missing} never joined the rendezvous within {timeout_s:g}s "
                              f"(not started, or cannot reach {o['master_addr']}:{o['master_port']}); giving up", 3)
        if time.monotonic() > deadline + (0 if k == 0 else 2.0):
            missing = ", ".join(str(r) for r in range(n) if r not in present)
            if k == 0:
                store.set(ABORT_KEY, missing)
                _linger(store, [NODE_PREFIX + f"ack/{r}" for r in present if r != 0], 2.0)
            raise LaunchError(f"node(s) {missing} never joined the rendezvous within {timeout_s:g}s "
                              f"(not started, or cannot reach {o['master_addr']}:{o['master_port']}); giving up", 3)
        time.sleep(0.1)
    for r in range(n):
        info = store.get(keys[r]).decode().split(",")
        if info[:2] != me.split(",")[:2]:
            raise LaunchError(f"node {r} ({info[2]}) runs --nnodes {info[0]} --nproc-per-node {info[1]}, this node "
                              f"{n} and {o['nproc_per_node']}: start every host with the same values", 2)


def _linger(store, keys: list[str], seconds: float) -> None:
    """Keep this process (and the store it hosts) up until every key exists, ``seconds`` at most."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if all(store.check([key]) for key in keys):
                return
        except Exception:
            return
        time.sleep(POLL_S)


def read_records(store, world: int) -> dict[int, tuple[int | None, str]]:
    """``{reporter: (root cause rank or None, reason)}`` of the failure records in the store."""
    out = {}
    for r in range(world):
        try:
            if store.check([FAIL_PREFIX + str(r)]):
                root, _, reason = store.get(FAIL_PREFIX + str(r)).decode().partition("|")
                out[r] = (int(root) if root.lstrip("-").isdigit() else None, reason)
        except Exception:
            break
    return out


def root_cause(records: dict[int, tuple[int | None, str]]) -> tuple[int | None, str] | None:
    """The rank really lost: a rank's own failure first (as pipeline.comm does), else the most blamed."""
    own = sorted(r for r, (root, _) in records.items() if root == r)
    interrupted = [r for r in own if "interrupted by SIG" in records[r][1]]
    for r in [r for r in own if r not in interrupted] + interrupted:
        return r, records[r][1]
    blamed = [root for root, _ in records.values() if root is not None]
    if blamed:
        root = max(set(blamed), key=blamed.count)
        return root, next(reason for rt, reason in records.values() if rt == root)
    return None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"its process was killed by {name}"
    return f"its process exited with code {code}"


# -- the launcher --------------------------------------------------------------------------------------
class Launcher:
    def __init__(self, o: dict, module: str, args: list[str], timeout_s: float, heartbeat_s: float,
                 stop_grace_s: float = 0.0) -> None:
        self.o, self.module, self.args = o, module, args
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s
        self.world = o["nnodes"] * o["nproc_per_node"]
        self.first_rank = o["node_rank"] * o["nproc_per_node"]
        self.tag = "[launch]" if o["nnodes"] == 1 else f"[launch node {o['node_rank']}]"
        self.grace = max(3.0, min(timeout_s, 10 * heartbeat_s))  # survivors' time to name a lost rank
        self.stop_grace = stop_grace_s   # a server's graceful stop (SIGTERM): its ranks' time to finish
        self.signals = 0
        self.procs: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, int] = {}
        self.killed: set[int] = set()       # ranks this launcher had to kill
        self.stop_signal: int | None = None
        self.store = None
        self.records: dict = {}

    def _on_signal(self, sig, _frame) -> None:
        self.signals += 1
        if self.stop_signal is None:
            self.stop_signal = sig
            if self.store is not None and self.procs:  # before any rank hears it: a stop, not a lost rank
                try:   # briefly: a frozen host 0 must not delay passing the signal on
                    if not self.store.call("check", [STOP_KEY], wait_s=1.0):
                        self.store.call("set", STOP_KEY, f"{self.o['node_rank']}|{signal.Signals(sig).name}",
                                        wait_s=1.0)
                except Exception:
                    pass
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except OSError:
                    pass

    def run(self) -> int:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        # torch first: its import takes seconds on a loaded host (5-6 s at load 4 here), and counted inside the
        # rendezvous window it left a client 0.5 s to connect ("node(s) 1, 2 never joined within 5s", CI under two
        # test processes): comm.timeout_s bounds the wait for the other hosts, not this launcher's own start
        import torch.distributed  # noqa: F401
        start = time.monotonic()
        deadline = start + self.timeout_s
        self.store = open_store(self.o, self.timeout_s, deadline, self.tag)
        port = self.store.port if self.o["node_rank"] == 0 else self.o["master_port"]
        if self.stop_signal is None:
            from pipeline.comm import StoreUnresponsive
            try:
                node_rendezvous(self.store, self.o, deadline, self.timeout_s)
                if self.o["node_rank"] != 0:
                    self.store.set(NODE_PREFIX + f"ack/{self.o['node_rank']}", "1")
            except StoreUnresponsive as e:
                raise LaunchError(f"lost node 0 during the rendezvous: {e} (host 0 frozen, powered off or "
                                  f"unreachable)", 3) from None
            except (RuntimeError, OSError) as e:
                first = next((l.strip() for l in str(e).splitlines() if l.strip()), type(e).__name__)[:160]
                raise LaunchError(f"lost node 0 during the rendezvous: its store failed ({first})", 3) from None
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        addr = loopback_address(self.o) or self.o["master_addr"]   # where the store listens (open_store)
        env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port),
                   WORLD_SIZE=str(self.world), LOCAL_WORLD_SIZE=str(self.o["nproc_per_node"]),
                   GROUP_RANK=str(self.o["node_rank"]), NODE_RANK=str(self.o["node_rank"]),
                   FLOWSPEC_LAUNCH_STORE="1", FLOWSPEC_LAUNCHER_PID=str(os.getpid()))
        for v in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
            env.pop(v, None)
        for local in range(self.o["nproc_per_node"]):
            rank = self.first_rank + local
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(local))
            self.procs[rank] = subprocess.Popen(
                [*launcher_command(), "--child", self.module, *self.args], env=e)
        return self.watch()

    def _record(self, rank: int, reason: str) -> None:
        """Write ``rank``'s failure record unless the rank wrote its own before exiting."""
        try:
            if not self.store.check([FAIL_PREFIX + str(rank)]):
                self.store.set(FAIL_PREFIX + str(rank), f"{rank}|{reason}")
        except Exception:
            pass

    def watch(self) -> int:
        kill_at: float | None = None
        polls = 0
        while True:
            now = time.monotonic()
            polls += 1
            for rank, p in self.procs.items():
                if rank in self.codes or p.poll() is None:
                    continue
                code = self.codes[rank] = p.returncode
                if code != 0 and self.store is not None:  # read now: node 0's store may not outlive the job
                    self.records = read_records(self.store, self.world) or self.records
                if code != 0:
                    if rank not in self.killed:
                        self._record(rank, describe_exit(code))
                    kill_at = min(kill_at or float("inf"), now + self.grace)
                elif kill_at is None:  # a clean exit: the others follow through close()'s barriers
                    kill_at = now + self.timeout_s + self.grace
            alive = [r for r in self.procs if r not in self.codes]
            if not alive:
                break
            if self.stop_signal is not None and kill_at is None:   # a server's SIGTERM: its stop grace first
                graceful = self.stop_signal == signal.SIGTERM and self.signals == 1 and self.stop_grace > 0
                kill_at = now + self.grace + (self.stop_grace if graceful else 0.0)
            elif self.stop_signal is not None and self.signals > 1:    # a second signal: stop at once
                kill_at = min(kill_at, now + self.grace)
            if kill_at is None and self.store is not None and polls % 10 == 0:
                # a failure on another host: this host's ranks should follow within the grace (and a rank of
                # this host reported silent, e.g. frozen, is stopped below)
                if read_records(self.store, self.world):
                    kill_at = now + self.grace
            if kill_at is not None:
                records = read_records(self.store, self.world) if self.store is not None else {}
                blamed = {root for reporter, (root, why) in records.items()
                          if root != reporter and "no heartbeat" in why}
                for r in alive:  # reported silent but still here: frozen (SIGSTOP, a hung call): stop it now
                    if (r in blamed or now >= kill_at) and r not in self.killed:
                        self.killed.add(r)
                        if r in blamed:
                            self._record(r, records[next(k for k, v in records.items() if v[0] == r)][1])
                        try:
                            self.procs[r].kill()
                        except OSError:
                            pass
            time.sleep(POLL_S)
        return self.finish()

    def _operator_stop(self) -> tuple[str, str] | None:
        """``(node rank, signal name)`` when some launcher recorded an operator's stop."""
        try:
            if self.store is not None and self.store.check([STOP_KEY]):
                node, _, sig = self.store.get(STOP_KEY).decode().partition("|")
                from pipeline.comm import record_text
                return record_text(node, 8), record_text(sig, 8)
        except Exception:
            pass
        return None

    def finish(self) -> int:
        records = read_records(self.store, self.world) if self.store is not None else {}
        records = records or self.records
        store_dead = getattr(self.store, "dead", None)
        stop = self._operator_stop() if self.stop_signal is None and not store_dead else None
        if self.o["nnodes"] > 1 and self.store is not None:
            k = self.o["node_rank"]
            if k != 0:  # tell node 0 this host has read what it needs
                try:
                    self.store.set(NODE_PREFIX + f"end/{k}", "1")
                except Exception:
                    pass
            else:  # hold the store until the other hosts' launchers have read the records (bounded)
                _linger(self.store, [NODE_PREFIX + f"end/{r}" for r in range(1, self.o["nnodes"])], self.grace)
        if self.stop_signal is not None:
            name = signal.Signals(self.stop_signal).name
            print(f"{self.tag} stopped by {name}: every rank of this host ended", file=sys.stderr, flush=True)
            return 128 + self.stop_signal
        local = {r: c for r, c in self.codes.items() if c != 0}
        if store_dead and self.o["node_rank"] != 0:  # host 0 frozen or unreachable: name it, once
            what = f"; rank{'s' if len(local) > 1 else ''} {', '.join(map(str, sorted(local)))} stopped" if local else ""
            code = 3 if local else 0
            print(f"{self.tag} lost rank 0 (host 0): {store_dead} (host 0 frozen, powered off or unreachable)"
                  f"{what}; exit {code}", file=sys.stderr, flush=True)
            return code
        if not any(self.codes.values()):
            return 0
        if stop is not None:
            sig = stop[1] if stop[1] in ("SIGINT", "SIGTERM", "SIGHUP") else "SIGTERM"
            print(f"{self.tag} stopped: the operator stopped node {stop[0]}'s launcher ({sig}); every rank of this "
                  f"host ended", file=sys.stderr, flush=True)
            return 128 + int(getattr(signal, sig))
        cause = root_cause(records)
        if cause is None:  # no store (gone with node 0): what the local exits say
            r, c = min(local.items())
            if c == 3:
                msg = f"{self.tag} rank {r} stopped: it lost a peer rank (its line above names it); exit 3"
                print(msg, file=sys.stderr, flush=True)
                return 3
            cause = (r, describe_exit(c) if c < 0 or c > 3 else f"its process exited with code {c}")
        root, reason = cause
        who = f"rank {root}" if root is not None else "a rank"
        own = root in local and self.codes[root] in (1, 2)
        code = self.codes[root] if own else 3
        others = sorted(r for r in local if r != root)
        tail = f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped" if others else ""
        from pipeline.comm import quoted
        if own:
            msg = f"{self.tag} {who} failed ({quoted(reason)}){tail}; exit {code}"
        else:
            msg = f"{self.tag} lost {who}: {quoted(reason)}{tail}; exit {code}"
        print(msg, file=sys.stderr, flush=True)
        return code


def read_timeouts(module: str, args: list[str], world: int, tag: str,
                  node_rank: int = 0) -> tuple[float, float, float]:
    """``(comm.timeout_s, comm.heartbeat_s, stop grace s)`` of a ``pipeline.run`` or ``pipeline.serve`` command
    line, whose arguments are checked here, once, before any rank starts (:func:`pipeline.run.check_args`
    prints the reason; a bad server flag is one line, never each rank's usage text). The stop grace is the
    server's ``--stop-grace-s`` (0 for a run): how long a SIGTERM leaves its ranks to finish the request in
    flight before the launcher kills them. ``node_rank``: this launcher's node; only node 0's (rank 0's) reads
    ``--prompts-file`` in the check."""
    stop_grace = 0.0
    if module == "pipeline.serve":
        from pipeline.serve import UsageError, parse_args as serve_args, run_argv
        try:
            sargs = serve_args(args, one_line=True)
        except UsageError as e:
            raise LaunchError(f"{e} (see ./run_serve.sh --help)", 2) from None
        module, args, stop_grace = "pipeline.run", run_argv(sargs), float(sargs.stop_grace_s)
    if module != "pipeline.run":
        return 30.0, 0.5, 0.0
    from pipeline.run import check_args, parse_args
    code = check_args(args, world, tag, prompts_file=node_rank == 0)   # rank 0's node reads the prompts
    if code:
        raise LaunchError("", code)
    from config.run_config import DEFAULT, apply_overrides
    cfg = apply_overrides(DEFAULT, parse_args(args).overrides)
    return float(cfg.comm.timeout_s), float(cfg.comm.heartbeat_s), stop_grace


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("FLOWSPEC_DEBUG", "") in ("", "0"):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's C++ warnings carry stack dumps
    if argv and argv[0] == "--child":
        child(argv[1], argv[2:])
        return 0
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    parent = os.environ.pop("FLOWSPEC_PARENT_PID", "")
    if parent:  # started by a driver (pipeline.tools.eval): stop the job (SIGTERM, passed on) when the driver dies
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != int(parent):
            return 128 + signal.SIGTERM
    tag = "[launch]"
    try:
        o, module, args = parse(argv)
        check_options(o)
        tag = "[launch]" if o["nnodes"] == 1 else f"[launch node {o['node_rank']}]"
        if {"-h", "--help", "--print-config"} & set(args):  # nothing to launch: the module answers itself
            os.execv(sys.executable, [sys.executable, *([module] if is_script(module) else ["-m", module]), *args])
        timeout_s, heartbeat_s, stop_grace = read_timeouts(module, args, o["nnodes"] * o["nproc_per_node"], tag,
                                                           o["node_rank"])
        launcher = Launcher(o, module, args, timeout_s, heartbeat_s, stop_grace)
        return launcher.run()
    except LaunchError as e:
        if str(e):
            print(f"{tag} error: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print(f"{tag} interrupted; exiting", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit / TCPStore teardown that could wait on a dead peer
