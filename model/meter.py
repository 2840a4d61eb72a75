"""Metered model work on every rank: the one seam through which instrumentation sees what a rank computes.

Five kinds of operation are metered, each run inside ``meter.op(kind, rows, ctx)``:

* ``"stage_forward"``: a verification stage's decoder block over ``rows`` new positions with ``ctx`` cached
  ones (``pipeline.worker.StageWorker``; ranks 1..N); a forward that carries several lanes' rows
  (``pipeline/batching.py``) is ONE op of all its rows over all those lanes' cached slots (the weights are read
  once, every lane's cache once: a cost model's memory term is exact, its attention-flop term ``rows x ctx`` an
  upper bound, since each lane's rows attend over its own cache only);
* ``"group_megatron"`` / ``"group_galaxy"``: one forward of a tensor-parallel group (modes ``tp`` / ``galaxy``,
  ``pipeline.tp_run.TPWorker``; every rank of the group) over ``rows`` new positions, ``ctx`` cached;
* ``"lm_head"``: ``rows`` hidden states through the target's ``lm_head`` (``Engine.logits``; a drafter's
  ``logprobs``); ``ctx`` is the number of vocabulary rows applied when that is not the whole vocabulary (a
  reduced draft vocabulary, :mod:`draft.vocab` / EAGLE-3's ``d2t``), 0 otherwise;
* ``"draft_forward"``: a draft-head forward of ``rows`` entries over ``ctx`` cached ones (``EagleHead`` /
  ``Eagle3Head``);
* ``"ssm_forward"``: a small draft LM's forward (``draft.ssm.SmallLMDrafter``) of ``rows`` new tokens (all the
  paths of one batch together) over ``ctx`` cached ones; its logits count as a separate ``lm_head`` op.

:data:`NULL_METER` (every object's default) does nothing. The emulated testbed's meter pads each operation to
the profile's modeled time (``pipeline/emulation.py``: ``EmuMeter``, installed on every stage worker and on rank
0); the simulator's logs it for its timing model
(``pipeline/tools/simulate/drafter.py``). Instrumentation installs a meter on the object whose work it wants to
see (``worker.meter``, ``engine.meter``; a drafter's sites through :func:`draft.protocol.install_meter`),
stacked after what is there
(:class:`MeterStack`); the stage worker and the engine start with a :class:`SpanMeter` (their tracer's
``compute`` / ``lm_head`` spans). Nothing replaces a method.

Counters ride on the meters too: a meter may count (``counter_names``, ``take()`` = its counters since the last
call, ``row_fields(table, phase)`` = output-row fields of every rank's counters). A rank's ``meter`` answers for
the whole stack (:class:`MeterStack` concatenates its meters' counters), so the stage worker and the engine hand
the ``Stats`` message whatever their meter counts without knowing who counts (the emulator's ``EmuMeter`` does).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Protocol

import torch

KINDS = ("stage_forward", "group_megatron", "group_galaxy", "lm_head", "draft_forward", "ssm_forward")


class OpMeter(Protocol):
    def op(self, kind: str, rows: int, ctx: int = 0) -> AbstractContextManager:
        """A context manager around one operation of ``kind`` (:data:`KINDS`)."""


class CountingMeter(OpMeter, Protocol):
    """A meter that also counts: ``counter_names`` fixed, ``take()`` returns that many floats (since the last
    call, then resets) and ``row_fields(table, phase)`` turns every rank's counters (``table[rank]``, the same
    columns) of a generation's ``phase`` (``"prefill"`` or ``"decode"``) into output-row fields."""

    counter_names: tuple[str, ...]

    def take(self) -> list[float]: ...

    def row_fields(self, table: list[list[float]], phase: str) -> dict: ...


class NullMeter:
    _nothing = nullcontext()
    counter_names: tuple[str, ...] = ()

    def op(self, kind: str, rows: int, ctx: int = 0) -> AbstractContextManager:
        return self._nothing


NULL_METER = NullMeter()


class SpanMeter:
    """Traces ops as spans: ``tracer.span(names[kind], rows=rows)`` (any object with ``span(name, **fields)``,
    e.g. ``pipeline.trace.Tracer``); kinds not in ``names`` pass untraced. This is how a rank's timeline and
    busy counter see its model work: through the same seam as every other instrument."""

    counter_names: tuple[str, ...] = ()

    def __init__(self, tracer, names: dict[str, str]) -> None:
        self.tracer, self.names = tracer, names
        self._nothing = nullcontext()

    def op(self, kind: str, rows: int, ctx: int = 0) -> AbstractContextManager:
        name = self.names.get(kind)
        return self._nothing if name is None else self.tracer.span(name, rows=rows)


class MeterStack:
    """Several meters on one site: ``op`` enters them in order (the first one outermost, so a tracing meter
    first sees the whole op including what later meters add, e.g. an emulation pad)."""

    def __init__(self, *meters: OpMeter) -> None:
        self.meters = meters
        self.counting = [m for m in meters if getattr(m, "counter_names", ())]
        self.counter_names = tuple(n for m in self.counting for n in m.counter_names)

    @contextmanager
    def op(self, kind: str, rows: int, ctx: int = 0):
        with ExitStack() as stack:
            for m in self.meters:
                stack.enter_context(m.op(kind, rows, ctx))
            yield

    def take(self) -> list[float]:
        """Every counting meter's counters since the last call, concatenated in stack order."""
        return [v for m in self.counting for v in m.take()]

    def row_fields(self, table: list[list[float]], phase: str) -> dict:
        """Each counting meter's row fields from its own columns of ``table``."""
        out, col = {}, 0
        for m in self.counting:
            k = len(m.counter_names)
            out.update(m.row_fields([row[col:col + k] for row in table], phase))
            col += k
        return out


def run_rows(meter, kind: str, x: torch.Tensor, fn, ctx: int = 0, key=None, post=None):
    """``post(fn(x))`` (``fn(x)`` without ``post``) as one metered op of ``kind`` over ``x``'s rows
    (:func:`hidden_rows`): ``with meter.op(kind, rows, ctx)`` around it, exactly as a site that meters itself.

    ``fn`` must be row-wise (each output row a function of its input row only, e.g. a ``Linear``) and ``post`` too;
    ``key`` names ``fn`` (the module). Given a ``key``, a meter that coalesces (it has ``coalesce(kind, x, fn, ctx,
    key, post)``: ``pipeline.coalesce.CoalescingMeter``, rank 0's with several lanes) may run it in ONE op with
    other callers' rows of the same key, charged once at their total rows; the caller gets its own rows' result
    (see that module for its exactness: within float reassociation)."""
    co = getattr(meter, "coalesce", None) if key is not None else None
    if co is not None:
        return co(kind, x, fn, ctx, key, post)
    with meter.op(kind, hidden_rows(x), ctx):
        y = fn(x)
        return y if post is None else post(y)


def run_joint(meter, kind: str, x, rows: int, ctx: int, fn, joint, key=None):
    """``fn(x)`` as one metered op of ``kind`` over ``rows`` rows with ``ctx`` cached entries (``with
    meter.op(kind, rows, ctx)`` around it). Given a ``key``, a meter that coalesces (:func:`run_rows`) may instead
    run several callers' payloads of the same key through ``joint([x, ...]) -> [output, ...]`` in ONE op charged
    at their total rows and total ``ctx`` (e.g. a draft-head forward of several lanes, each lane's attention over
    its own cache: ``draft.eagle.EagleHead.compute_lanes``)."""
    co = getattr(meter, "coalesce", None) if key is not None else None
    if co is not None:
        return co(kind, x, fn, ctx, key, joint=joint, rows=rows)
    with meter.op(kind, rows, ctx):
        return fn(x)


def take_counters(meter) -> list[float]:
    """``meter``'s counters since the last call ([] for a meter that counts nothing)."""
    return meter.take() if getattr(meter, "counter_names", ()) else []


def counter_fields(meter, table: list[list[float]], phase: str) -> dict:
    """Output-row fields of a gathered counter table ({} for a meter that counts nothing)."""
    return meter.row_fields(table, phase) if getattr(meter, "counter_names", ()) else {}


def vocab_share(ctx: int, vocab_size: int) -> float:
    """The share of the vocabulary an ``lm_head`` op applies: its ``ctx`` rows of ``vocab_size`` (1 when ``ctx``
    is 0, the whole vocabulary, or the vocabulary is unknown)."""
    return min(1.0, ctx / vocab_size) if ctx and vocab_size else 1.0


def hidden_rows(hidden: torch.Tensor) -> int:
    """Rows of a hidden-state tensor (``[H]``, ``[n, H]`` or ``[1, n, H]``): what an lm_head op is charged on."""
    return 1 if hidden.dim() == 1 else hidden.numel() // hidden.shape[-1]


def cache_length(cache) -> int:
    """Entries already in a draft cache (``KVCache.length``; 0 without one, e.g. in training)."""
    return int(getattr(cache, "length", 0)) if cache is not None else 0
