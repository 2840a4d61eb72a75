"""How a rank dies, and test-only fault injection. Imports nothing heavy (usable before ``torch``).

Fatal exits
    :func:`fatal` prints one line to stderr, tells the peers (through the hook a live
    :class:`pipeline.comm.Comm` registers: it writes a failure record naming the root cause and, when
    this process hosts the rendezvous store, waits briefly so the peers can read it) and leaves with
    ``os._exit``: no ``atexit`` work, no process-group teardown that could block on a dead peer.
    The first caller wins; a second thread calling it meanwhile just waits for the exit.

Fault injection (tests only)
    ``FLOWSPEC_FAULT="rank=R,at=POINT[,count=N][,sig=KILL]"`` makes rank ``R`` send itself ``SIGKILL``
    (or ``sig=INT`` / ``TERM`` / ``STOP``...) the ``N``-th time (default 1) it reaches ``POINT``;
    ``delay=S`` instead of ``sig`` makes it sleep ``S`` seconds there (a slow rank, alive):

    ``send`` / ``recv``  any ring message sent / received (:mod:`pipeline.comm`)
    ``prefill``          a prompt chunk (``Context``) sent or received
    ``segment``          a tree segment (``Segment``) sent or received (mid-round of a tree mode)
    ``decision``         rank 0 about to send a decision point to point; a stage taking direct decisions
                         from its inbox (the others are left mid-decode)
    ``load``             about to load its stage (the process group exists, the peers are loading too)

    Several faults are separated by ``;``. Unset (the normal case), :func:`hit` is one dict lookup.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, NoReturn

from config.errors import UserError

POINTS = ("send", "recv", "prefill", "segment", "decision", "load")

_exit_lock = threading.Lock()
_peer_hook: Callable[[str, int | None], None] | None = None
_loss_probe: Callable[[], object] | None = None


def set_peer_hook(fn: Callable[[str, int | None], None] | None, probe: Callable[[], object] | None = None) -> None:
    """``fn(reason, lost)`` tells the peers this rank is going away (``lost``: the rank to blame, if not us);
    ``probe()`` returns a peer's recorded failure, if any."""
    global _peer_hook, _loss_probe
    _peer_hook, _loss_probe = fn, probe


_pre_exit: list[Callable[[str], None]] = []


def on_fatal(fn: Callable[[str], None]) -> None:
    """Register ``fn(reason)`` to run in :func:`fatal` before the peers are told and the process exits
    (the server answers its requests in flight with 503). It must return within a few seconds; its errors
    are ignored."""
    _pre_exit.append(fn)


def peer_failed() -> bool:
    """Whether a peer has already recorded a failure of its own (so it has printed the cause itself);
    a peer stopped by a signal does not count."""
    try:
        loss = _loss_probe() if _loss_probe is not None else None
    except Exception:
        return False
    return (loss is not None and "interrupted by SIG" not in str(loss)
            and not getattr(loss, "operator_stop", False))


def fatal(line: str, code: int, reason: str | None = None, lost: int | None = None) -> NoReturn:
    """Print ``line`` (unless empty), tell the peers ``reason`` (default: ``line``), exit with ``code``."""
    if not _exit_lock.acquire(blocking=False):  # another thread is already exiting this process
        while True:
            time.sleep(3600)
    try:
        sys.stdout.flush()
    except Exception:
        pass
    if line:
        try:
            print(line, file=sys.stderr, flush=True)
        except Exception:
            pass
    for fn in list(_pre_exit):
        try:
            fn(reason if reason is not None else line)
        except BaseException:
            pass
    hook = _peer_hook
    if hook is not None:
        try:
            hook(reason if reason is not None else line, lost)
        except BaseException:
            pass
    os._exit(code)


# -- fault injection ----------------------------------------------------------------------------------
class FaultSpecError(UserError, ValueError):
    pass


def parse(spec: str, rank: int) -> dict[str, list]:
    """``{point: [count_left, action]}`` of the faults in ``spec`` that target ``rank`` (``action()``: what the
    rank does the ``count``-th time it reaches ``point``: signal itself, or sleep ``delay`` seconds)."""
    out: dict[str, list] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            kv = dict(item.split("=", 1) for item in part.split(","))
            target, point = int(kv.pop("rank")), kv.pop("at")
            count = int(kv.pop("count", "1"))
            delay = float(kv.pop("delay")) if "delay" in kv and "sig" not in kv else None
            sig = getattr(signal, "SIG" + kv.pop("sig", "KILL").upper().removeprefix("SIG"))
        except (ValueError, KeyError, AttributeError):
            raise FaultSpecError(f"bad FLOWSPEC_FAULT {part!r}: expected "
                                 "rank=R,at=POINT[,count=N][,sig=KILL|,delay=S]") from None
        if kv or point not in POINTS or count < 1:
            raise FaultSpecError(f"bad FLOWSPEC_FAULT {part!r}: unknown key(s) {sorted(kv)} or point "
                                 f"{point!r} (one of {', '.join(POINTS)}) or count < 1")
        if target == rank:
            out[point] = [count, _sleeper(delay) if delay is not None else _signaller(sig)]
    return out


_armed: dict[str, list] = {}


def arm(rank: int) -> None:
    """Read ``FLOWSPEC_FAULT`` for this rank (called once the rank is known)."""
    global _armed
    _armed = parse(os.environ.get("FLOWSPEC_FAULT", ""), rank)


def hit(point: str) -> None:
    f = _armed.get(point) if _armed else None
    if f is None:
        return
    f[0] -= 1
    if f[0] == 0:
        f[1]()


def _signaller(sig) -> Callable[[], None]:
    def send() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)
    return send


def _sleeper(delay: float) -> Callable[[], None]:
    return lambda: time.sleep(delay)   # slow, not dead
