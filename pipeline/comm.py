"""Point-to-point ring links and rank-0 broadcasts over ``torch.distributed``, with dead-rank detection.

* One ordered channel per link: header on tag 0, payload on tag 1, sent with ``isend`` (never blocking
  the sender, so a ring where everyone sends before receiving cannot deadlock) and received in order.
* Broadcasts (decisions) are issued from the main thread only, in the same order on every rank.
* A heartbeat thread bumps a counter in the rendezvous store; a watchdog exits the process with a
  message naming the lost rank when a peer's counter stops moving for ``timeout_s`` or a peer reports
  a failure. Communication errors are turned into :class:`PeerLost` naming the lost rank.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from pipeline.messages import HEADER_LEN, Decision, Message, decode, encode, payload_size
from pipeline.trace import Tracer

HB_PREFIX = "flowspec/hb/"
FAIL_PREFIX = "flowspec/fail/"
DONE_PREFIX = "flowspec/done/"


class PeerLost(RuntimeError):
    def __init__(self, lost: int | None, detail: str) -> None:
        self.lost = lost
        who = f"rank {lost}" if lost is not None else "a peer rank"
        super().__init__(f"lost {who}: {detail}")


class Comm:
    def __init__(self, backend: str = "gloo", timeout_s: float = 30.0, heartbeat_s: float = 0.5,
                 device: str = "cpu", tracer: Tracer | None = None) -> None:
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.wire_device = torch.device(device) if backend == "nccl" else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.next_rank = (self.rank + 1) % self.world
        self.prev_rank = (self.rank - 1) % self.world
        self.tracer = tracer or Tracer(self.rank, enabled=False)
        self._pending: list = []
        self._closing = False
        self.store = dist.distributed_c10d._get_default_store()
        self._hb_count = 0
        self._seen: dict[int, tuple[str, float]] = {}
        self.store.set(HB_PREFIX + str(self.rank), "0")
        self._thread = threading.Thread(target=self._watchdog, daemon=True, name="flowspec-watchdog")
        self._thread.start()

    # -- ring ------------------------------------------------------------------------------------
    def send(self, dst: int, msg: Message) -> None:
        header, payload = encode(msg)
        with self.tracer.span("send", dst=dst, bytes=int(payload.numel())):
            self._reap()
            header = header.to(self.wire_device)
            reqs = [dist.isend(header, dst, tag=0)]
            if payload.numel():
                payload = payload.to(self.wire_device)
                reqs.append(dist.isend(payload, dst, tag=1))
            self._pending.append((dst, reqs, header, payload))

    def recv(self, src: int) -> Message:
        with self.tracer.span("recv", src=src):
            header = torch.empty(HEADER_LEN, dtype=torch.long, device=self.wire_device)
            self._guard(lambda: dist.recv(header, src, tag=0), src)
            nbytes = payload_size(header.cpu())
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.wire_device)
            if nbytes:
                self._guard(lambda: dist.recv(payload, src, tag=1), src)
        return decode(header.cpu(), payload)

    def send_next(self, msg: Message) -> None:
        self.send(self.next_rank, msg)

    def recv_prev(self) -> Message:
        return self.recv(self.prev_rank)

    # -- broadcast -------------------------------------------------------------------------------
    def broadcast(self, decision: Decision | None) -> Decision:
        """Rank 0 passes the decision; every other rank passes ``None`` and gets it."""
        with self.tracer.span("broadcast"):
            if self.rank == 0:
                header, payload = encode(decision)
                header = header.to(self.wire_device)
                self._guard(lambda: dist.broadcast(header, 0), None)
                if payload.numel():
                    self._guard(lambda: dist.broadcast(payload.to(self.wire_device), 0), None)
                return decision
            header = torch.empty(HEADER_LEN, dtype=torch.long, device=self.wire_device)
            self._guard(lambda: dist.broadcast(header, 0), 0)
            nbytes = payload_size(header.cpu())
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.wire_device)
            if nbytes:
                self._guard(lambda: dist.broadcast(payload, 0), 0)
            return decode(header.cpu(), payload)

    # -- lifecycle -------------------------------------------------------------------------------
    def _reap(self) -> None:
        """Wait for completed sends (surfacing their errors) and drop them."""
        still = []
        for item in self._pending:
            dst, reqs = item[0], item[1]
            if all(r.is_completed() for r in reqs):
                for r in reqs:
                    self._guard(r.wait, dst)
            else:
                still.append(item)
        self._pending = still

    def flush(self) -> None:
        for dst, reqs, *_ in self._pending:
            for r in reqs:
                self._guard(r.wait, dst)
        self._pending = []

    def barrier(self) -> None:
        self._guard(lambda: dist.barrier(), None)

    def close(self) -> None:
        """Orderly end: flush sends, meet everyone, then stop watching."""
        self.flush()
        self.barrier()
        self._closing = True
        try:
            self.store.set(DONE_PREFIX + str(self.rank), "1")
        except Exception:
            pass
        self.barrier()
        dist.destroy_process_group()

    def report_failure(self, reason: str) -> None:
        try:
            self.store.set(FAIL_PREFIX + str(self.rank), reason[:500])
        except Exception:
            pass

    # -- failure detection -----------------------------------------------------------------------
    def _guard(self, fn, peer: int | None):
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError / DistBackendError on closed sockets or timeouts
            if self._closing:
                raise
            raise self.diagnose(peer, e) from None

    def diagnose(self, peer: int | None, err: BaseException | None = None) -> PeerLost:
        """Find which rank is gone: a reported failure, else a stale heartbeat, else ``peer``."""
        deadline = time.monotonic() + max(3 * self.heartbeat_s, 1.0)
        while True:
            failed = self._failed_peers()
            if failed:
                r, reason = failed[0]
                return PeerLost(r, f"it failed ({reason})")
            stale = self._stale_peers(max(2.5 * self.heartbeat_s, 0.75))
            if stale or time.monotonic() > deadline:
                break
            time.sleep(self.heartbeat_s / 2)
        if stale:
            return PeerLost(stale[0], "its process stopped (no heartbeat)")
        text = str(err).splitlines()[0][:160] if err else "no response"
        return PeerLost(peer, f"communication failed ({text})")

    def _failed_peers(self) -> list[tuple[int, str]]:
        out = []
        for r in range(self.world):
            if r != self.rank and self.store.check([FAIL_PREFIX + str(r)]):
                out.append((r, self.store.get(FAIL_PREFIX + str(r)).decode()))
        return out

    def _stale_peers(self, max_age: float) -> list[int]:
        now = time.monotonic()
        out = []
        for r in range(self.world):
            if r == self.rank or self.store.check([DONE_PREFIX + str(r)]):
                continue
            val = self.store.get(HB_PREFIX + str(r)).decode() if self.store.check([HB_PREFIX + str(r)]) else ""
            last = self._seen.get(r)
            if last is None or last[0] != val:
                self._seen[r] = (val, now)
            elif now - last[1] > max_age:
                out.append(r)
        return out

    def _watchdog(self) -> None:
        while not self._closing:
            try:
                self._hb_count += 1
                self.store.set(HB_PREFIX + str(self.rank), str(self._hb_count))
                failed = self._failed_peers()
                stale = self._stale_peers(self.timeout_s)
            except Exception:
                if self._closing:
                    return
                _die(self.rank, "lost the rendezvous store (its host, rank 0 or the launcher, is gone)")
            if self._closing:
                return
            if failed:
                _die(self.rank, f"rank {failed[0][0]} failed ({failed[0][1]})")
            if stale:
                _die(self.rank, f"lost rank {stale[0]}: no heartbeat for {self.timeout_s:.0f}s")
            time.sleep(self.heartbeat_s)


def _die(rank: int, text: str) -> None:
    print(f"[rank {rank}] error: {text}; exiting", file=sys.stderr, flush=True)
    os._exit(3)
