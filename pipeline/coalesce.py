"""Rank 0's model ops of several lanes coalesced: one op over every waiting lane's rows (issue 46).

With several requests in flight (:mod:`pipeline.lanes`), rank 0 runs each lane's model work on one device, one op
at a time. On a memory-bound device an op's cost is its weight stream whatever its rows, so two lanes' target
``lm_head`` calls (verification logits, draft log-probs) in ONE op cost about one. :class:`OpBatcher` is that
device, shared by the lanes: it holds the device lock every rank-0 op runs under (what ``DeviceLock`` was), and an
op that is *row-wise* (each output row a function of its input row only: ``lm_head``) may be handed to it with a
``key`` (:func:`model.meter.run_rows`); ops of one key that wait for the device at the same time run as one op over
their concatenated rows, and each caller gets its own slice (then its own ``post``). The EAGLE head's forward is
coalesced too, as a *joint* call (:class:`Call`): the lanes' drafters share the head's weights but each has its
own draft KV cache, so the group's op concatenates the rows and attends per lane over each lane's own cache
(``draft.eagle.EagleHead.compute_lanes`` through :class:`model.lane_batch.LaneBatch`, as a stage forward of
several lanes does).

The rule (flat combining, no timer): a caller never waits for another caller that is not already waiting.

* the device is free: the caller takes it at once (one non-blocking acquire: exactly the lock round trip of a
  lone op before) and runs its op, together with every op of its key that is already waiting (none with one lane
  in flight: that op is the lone op of before, same rows, same meter calls);
* the device is busy: the caller registers its op and waits. Whoever takes the device next serves itself and
  every waiting op of its own key in one op (:func:`take_group`), so a waiting op is either served by another
  caller's op or runs itself as soon as it gets the device -- never later than it would have run alone, except
  by the extra rows of an op that serves it (its own op's modeled cost at the group's rows).

Charging (the meter seam, :mod:`model.meter`): a coalesced op enters its leader's site meter ONCE with the
group's total rows (``meter.op(kind, sum(rows), ctx)``), so the emulated testbed pads it once, as a real device
computes it: one weight pass for every lane's rows. The followers' site meters see nothing (their rows were in
the leader's op; a follower lane's busy counter does not count it).

Results: the group's op computes ``fn(cat(xs))`` (``fn`` the leader's; one key = one function: the same module
with the same weights), so a follower's rows are those of one matrix product over more rows. On this CPU (MKL)
that is **not bit-identical** to the product over its rows alone: the kernel's blocking depends on the row count,
so a row's dot products may be summed in another order, a float reassociation (measured: |Δ| <= 2e-6 on a
random float32 ``Linear`` of SmolLM2's ``lm_head`` shape, 576 x 49152; ``tests/test_coalesce.py`` bounds it and
checks the argmax). It is the same kind of difference a verification step over more or fewer tree nodes already makes (the stages and the
``lm_head`` see varying row counts in every mode), and the exactness tests (greedy = HF ``generate``, sampling
law) hold with coalescing on (``tests/test_coalesce.py``, ``tests/test_lanes.py``).

Counters (:attr:`OpBatcher.counts`): ops run under the device (``ops``), row-wise ops offered (``offered``),
ops that carried several callers' rows (``coalesced_ops``) and the callers they served (``coalesced_calls``),
per kind; :meth:`OpBatcher.summary` is one line (``pipeline.lanes.LanePool.shutdown`` prints it).
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from model.meter import hidden_rows


@dataclass(eq=False)
class Call:
    """One caller's op: ``fn(x)`` then ``post``, an op of ``kind`` over ``rows`` rows with ``ctx`` (the meter's
    arguments); ``key`` names ``fn`` (calls of one :attr:`group_key` compute the same function).

    Row-wise (``joint`` None): ``x`` is a tensor ``[..., H]`` whose rows ``fn`` maps one by one (an ``lm_head``);
    ``ctx`` is part of the function (an ``lm_head``'s vocabulary rows). Joint (``joint`` given): ``x`` is any
    payload and ``joint([x, ...])`` computes several callers' payloads in one op and returns each one's output (a
    draft-head forward over every lane's rows, each lane's attention over its own cache:
    ``draft.eagle.EagleHead.compute_lanes``); ``ctx`` is the caller's cached entries, and a group is charged
    their sum (as a stage forward of several lanes is, ``model/meter.py``)."""

    kind: str
    ctx: int
    key: Any
    x: Any
    fn: Callable[[Any], Any]
    post: Callable[[Any], Any] | None = None
    joint: Callable[[list], list] | None = None
    rows: int = -1
    done: bool = False
    result: Any = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        if self.rows < 0:
            self.rows = hidden_rows(self.x)

    @property
    def group_key(self) -> tuple:
        if self.joint is not None:
            return (self.kind, "joint", self.key)
        return (self.kind, self.ctx, self.key, self.x.dtype, self.x.device, self.x.shape[-1])


def charge(group: list[Call]) -> tuple[int, int]:
    """``(rows, ctx)`` of the ONE meter op that runs ``group`` (one group key): every call's rows; a row-wise op's
    ``ctx`` (its function's), a joint op's every call's cached entries summed. Pure."""
    rows = sum(c.rows for c in group)
    return rows, (sum(c.ctx for c in group) if group[0].joint is not None else group[0].ctx)


def take_group(waiting: list[Call], leader: Call) -> tuple[list[Call], list[Call]]:
    """The calls the ``leader``'s op serves and the calls still waiting after it. Pure.

    Invariants: the group holds ``leader`` and exactly the calls of ``waiting`` with the leader's
    :attr:`Call.group_key` (``kind``, ``key``; row-wise also ``ctx`` and the rows' dtype, device and width: one
    function over rows that concatenate without a conversion, one meter charge), each once, in arrival order (``waiting``'s order; the
    leader at its own place, or first when it was not waiting); ``rest`` is every other call of ``waiting`` in its
    order (nothing is lost or served twice)."""
    k = leader.group_key
    group = [c for c in waiting if c is leader or c.group_key == k]
    if leader not in group:
        group.insert(0, leader)
    rest = [c for c in waiting if c is not leader and c.group_key != k]
    return group, rest


def split_rows(y: torch.Tensor, calls: list[Call]) -> list[torch.Tensor]:
    """``y``'s rows (the op over the calls' concatenated rows, ``[sum rows, ...]``) cut back into each call's
    output, in its input's leading shape (``x [..., H]`` -> ``[..., V]``). Pure."""
    total = sum(c.rows for c in calls)
    if total != y.shape[0]:
        raise ValueError(f"split_rows: {y.shape[0]} output rows for calls of {total} rows")
    out, at = [], 0
    for c in calls:
        out.append(y[at:at + c.rows].reshape(*c.x.shape[:-1], *y.shape[1:]))
        at += c.rows
    return out


class OpBatcher:
    """Rank 0's one device, shared by the lanes (module docstring): :meth:`hold` an op (any op: one at a time, as on
    one device; re-entrant within a thread) or :meth:`run` a row-wise :class:`Call`, coalesced with the waiting
    calls of its key. ``counts``: a :class:`collections.Counter` of ``(name, kind)`` pairs."""

    def __init__(self) -> None:
        self.device = threading.RLock()
        self._cv = threading.Condition(threading.Lock())
        self._waiting: list[Call] = []
        self._released = 0          # device releases seen while calls were waiting (their wake-up signal)
        self.counts: Counter = Counter()

    # -- the device ------------------------------------------------------------------------------------------
    def _release(self) -> None:
        self.device.release()
        if self._waiting:   # a lock-free read: a caller that registers after it retries the device itself
            with self._cv:
                self._released += 1
                self._cv.notify_all()

    @contextmanager
    def hold(self, kind: str = ""):
        """Hold the device over an op that is not coalesced (a draft-head forward, a small LM's, a reduced
        vocabulary's ``lm_head``): the lock round trip of before, plus waking waiting callers when there are any."""
        self.device.acquire()
        try:
            self.counts["ops", kind] += 1
            yield
        finally:
            self._release()

    # -- coalesced calls ---------------------------------------------------------------------------------------
    def run(self, call: Call, meter) -> Any:
        """``call``'s result: ``post(fn(x))``, computed in an op of ``meter`` (the caller's site meter, below the
        device) alone or with other callers' calls of its key (module docstring)."""
        if self.device.acquire(blocking=False):   # free (or held by this thread: a nested op): run at once
            try:
                self._lead(call, meter)
            finally:
                self._release()
            return self._answer(call)
        with self._cv:
            self._waiting.append(call)
            seen = self._released
        while True:
            if self.device.acquire(blocking=False):
                try:
                    if not call.done:
                        self._lead(call, meter)
                finally:
                    self._release()
                return self._answer(call)
            with self._cv:
                # the holder's release bumps _released (it sees this call waiting); a serving leader sets done
                self._cv.wait_for(lambda: call.done or self._released != seen)
                if call.done:
                    return self._answer(call)
                seen = self._released

    @staticmethod
    def _answer(call: Call) -> Any:
        if call.error is not None:
            raise call.error
        return call.result

    def _lead(self, call: Call, meter) -> None:
        """With the device held: run ``call`` and every waiting call of its key as one op of ``meter``."""
        if self._waiting:
            with self._cv:
                group, self._waiting = take_group(self._waiting, call)
        else:
            group = [call]
        self.counts["ops", call.kind] += 1
        self.counts["offered", call.kind] += len(group)
        try:
            if len(group) == 1:   # exactly the lone op: fn over the caller's own tensor
                with meter.op(call.kind, call.rows, call.ctx):
                    y = call.fn(call.x)
                    call.result = y if call.post is None else call.post(y)
            else:
                self.counts["coalesced_ops", call.kind] += 1
                self.counts["coalesced_calls", call.kind] += len(group)
                with meter.op(call.kind, *charge(group)):
                    if call.joint is not None:
                        ys = call.joint([c.x for c in group])
                    else:
                        ys = split_rows(call.fn(torch.cat([c.x.reshape(-1, c.x.shape[-1]) for c in group])), group)
                    for c, y in zip(group, ys):
                        c.result = y if c.post is None else c.post(y)
        except BaseException as e:   # every caller of the group sees the op's error
            for c in group:
                c.error = e
        if len(group) > 1 or self._waiting:
            with self._cv:
                for c in group:
                    c.done = True
                self._cv.notify_all()
        else:
            call.done = True

    def summary(self) -> str:
        """One line per kind: the calls, the ops they ran in (one call each, or several in a coalesced op) and the
        coalesced ops with the calls they carried."""
        c = self.counts
        kinds = sorted({k for _, k in c if k})
        parts = [f"{k}: {c['ops', k] - c['coalesced_ops', k] + c['coalesced_calls', k]} calls in {c['ops', k]} ops, "
                 f"{c['coalesced_ops', k]} of them coalesced ({c['coalesced_calls', k]} calls)" for k in kinds]
        return "rank-0 ops: " + ("; ".join(parts) if parts else "none")


class CoalescingMeter:
    """A lane site's meter (:class:`model.meter.OpMeter`) over ``inner`` (the site's own meters): every op holds the
    batcher's device (:meth:`OpBatcher.hold`), and a row-wise op offered through :func:`model.meter.run_rows`
    (``coalesce``) goes to :meth:`OpBatcher.run` with ``inner`` as the meter it is charged on. Counters are
    ``inner``'s."""

    def __init__(self, batcher: OpBatcher, inner) -> None:
        self.batcher, self.inner = batcher, inner
        self.counter_names = tuple(getattr(inner, "counter_names", ()))

    @contextmanager
    def op(self, kind: str, rows: int, ctx: int = 0):
        with self.batcher.hold(kind), self.inner.op(kind, rows, ctx):
            yield

    def coalesce(self, kind: str, x, fn, ctx: int, key, post=None, joint=None, rows: int = -1):
        return self.batcher.run(Call(kind, ctx, key, x, fn, post, joint, rows), self.inner)

    def take(self) -> list[float]:
        return self.inner.take()

    def row_fields(self, table, phase: str) -> dict:
        return self.inner.row_fields(table, phase)
