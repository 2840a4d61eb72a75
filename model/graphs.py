"""Static-shape block forwards, and CUDA graphs of them (run key ``model.graphs``).

Why: at batch 1 a stage step and a draft-head level are launch-bound on a GPU (docs/gpu_h200: 30-40 ms of drafting
per round start against a ~5 ms stage step). A CUDA graph replays a whole forward as one launch, but only for
fixed shapes and fixed memory. So the forward is given the same shapes every time:

* the rows of a forward (a stage segment, a context chunk, a draft level's frontier) are padded with zero rows to
  the smallest **bucket** that holds them (:func:`pick_bucket`; the stage's ``1, 4, 8, 16, 32, 64``; the draft
  head's also the beam widths, so a level of ``top_k`` rows runs unpadded);
* attention runs over the KV cache **at capacity** (``[.., max_len, ..]``), with an additive mask
  ``[1, 1, bucket, max_len]`` (:func:`static_mask`) that gives every real row exactly the slots the dynamic mask
  gave it (the committed context, its tree ancestors, itself) and every padding row only its own slot;
* keys and values are written at slot indices held in a tensor (:class:`SlotCache`, :func:`static_slots`): real
  row ``i`` at ``length + i`` (where the dynamic path writes it), padding row ``j`` at ``length + j``, ``j >= n``,
  i.e. past the rows the caller then commits (``KVCache.commit_forward(n)``), so they are never committed, and
  every later mask (dynamic or static) hides those slots until a later forward overwrites them.

Hence, invariant (tested in ``tests/test_graphs.py``): a real row's output and the keys/values written for it are
those of the dynamic forward up to floating-point reassociation (the same operations; attention sums over extra
slots of exact-zero weight), and the cache after ``commit_forward(n)`` holds the same committed entries. Padding
rows can influence nothing: no real row's mask admits their slots, and the rows of every other op (linear, norm,
rotary) are independent.

Executors (:func:`resolve_executor`): ``eager`` runs the padded forward directly (the CPU "twin" of a graph);
``cuda`` records it once per (cache, bucket, row layout) as a ``torch.cuda.CUDAGraph`` over static input buffers
(warm-up on a side stream, as PyTorch documents) and afterwards copies the inputs into those buffers, replays, and
copies the output out; ``replay`` does the same on any device with a recorded Python closure instead of a graph, so
the copy-in / replay / copy-out logic runs and is tested on a CPU (a forward that read a stale buffer or returned the
shared output buffer gives wrong answers there too); ``compile`` (:class:`CompileExecutor`) runs the padded forward
through ``torch.compile`` (inductor, ``dynamic=False``: one compiled graph per bucket, compiled lazily at a bucket's
first call; on CUDA ``mode="reduce-overhead"``, i.e. CUDA graphs of the compiled code), its compile time kept apart
from every per-call figure (:attr:`CompileExecutor.compile_s`).

A static body may return one tensor or a tuple of tensors, every one with the rows along dim 1 (a draft level's
:func:`draft.static_head.level_step`: the head's output, the candidates' cumulative scores and their tokens).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from config.run_config import GRAPHS as SETTINGS, ConfigError, parse_graph_buckets as parse_buckets  # noqa: F401

Tensor = torch.Tensor

STAGE_BUCKETS = (1, 4, 8, 16, 32, 64)
# model.graphs=auto turns graphs on for CUDA ranks once scripts/gpu_goals.sh has measured them faster on a GPU;
# not measured yet (no GPU in the session that wrote this), so auto is off everywhere for now.
AUTO_ON_CUDA = False


def resolve_executor(setting: str, device: str) -> str | None:
    """The executor a rank on ``device`` uses for ``model.graphs=setting``: None (dynamic shapes, today's path),
    ``"eager"`` (static shapes run eagerly), ``"cuda"`` (CUDA graphs) or ``"replay"`` (recorded closures).
    ``on``: CUDA graphs on a CUDA device, the eager twin elsewhere; ``auto``: ``on`` for CUDA when
    :data:`AUTO_ON_CUDA`, else off; ``eager`` / ``replay`` / ``compile`` force that executor on any device."""
    if setting not in SETTINGS:
        raise ConfigError(f"model.graphs={setting!r} is not valid; choose one of {', '.join(SETTINGS)}")
    cuda = str(device).startswith("cuda")
    if setting == "off" or (setting == "auto" and not (cuda and AUTO_ON_CUDA)):
        return None
    if setting in ("on", "auto"):
        return "cuda" if cuda else "eager"
    return setting


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket ``>= n`` (None: ``n`` is larger than every bucket, or 0)."""
    if n < 1:
        return None
    return next((b for b in buckets if b >= n), None)


def static_slots(length: int, bucket: int, device) -> Tensor:
    """Cache slots the rows of a static forward write: ``length, ..., length + bucket - 1`` (real rows first)."""
    return torch.arange(length, length + bucket, device=device)


def static_mask(mask: Tensor, n: int, bucket: int, length: int, capacity: int) -> Tensor:
    """The ``[1, 1, bucket, capacity]`` additive mask of a static forward from the dynamic one
    (``mask [1, 1, n, length + n]``, what ``KVCache.context_inputs`` / ``tree_inputs`` give).

    Rows ``< n`` see exactly what the dynamic mask lets them see (slots ``< length + n``) and nothing from
    ``length + n`` on (padding rows' and stale slots); padding row ``j`` sees only its own slot ``length + j`` (so
    its softmax has one finite term: no NaN, whatever the dtype). Needs ``length + bucket <= capacity``."""
    if length + bucket > capacity or n > bucket or tuple(mask.shape[-2:]) != (n, length + n):
        raise ValueError(f"static_mask: {n} rows of mask {tuple(mask.shape)} in bucket {bucket}, {length} cached, "
                         f"capacity {capacity}")
    low = torch.finfo(mask.dtype).min
    out = torch.full((1, 1, bucket, capacity), low, dtype=mask.dtype, device=mask.device)
    out[0, 0, :n, :length + n] = mask.reshape(n, length + n)
    pad = torch.arange(n, bucket, device=mask.device)
    out[0, 0, pad, length + pad] = 0
    return out


def pad_rows(x: Tensor, bucket: int) -> Tensor:
    """``x [1, n, ...]`` with zero rows appended along dim 1 up to ``bucket`` rows (ids, positions or features)."""
    n = x.shape[1]
    if n == bucket:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], bucket - n, *x.shape[2:]))], dim=1)


class SlotCache:
    """What a decoder layer sees of a :class:`model.kv_cache.KVCache` on the static path: ``update`` writes the
    rows' keys/values at the slot indices ``slots`` (a tensor, so a graph replays it for any ``length``) and returns
    the whole buffer ``[1, kv_heads, capacity, head_dim]``; the static mask hides what the rows may not see."""

    def __init__(self, cache, slots: Tensor) -> None:
        self.cache, self.slots = cache, slots

    @property
    def length(self) -> int:       # what model.meter.cache_length reads
        return self.cache.length

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.slots, key.to(keys.dtype))
        values.index_copy_(2, self.slots, value.to(values.dtype))
        return keys, values


# -- executors --------------------------------------------------------------------------------------------------

class EagerExecutor:
    """Runs the padded forward as it is (the CPU twin of a graph: the same shapes, no recording)."""
    kind = "eager"

    def __init__(self) -> None:
        self.stats: Counter = Counter()

    def run(self, key, body: Callable[..., Tensor], inputs: list[Tensor], owner=None) -> Tensor:
        self.stats["eager"] += 1
        return body(*inputs)


@dataclass
class Recording:
    """One recorded forward: its static input buffers, its static output, how to replay it, and the objects whose
    memory it baked in (the KV cache), held so that their ``id`` in the key is never reused."""
    inputs: list[Tensor]
    output: Tensor
    replay: Callable[[], None]
    owner: object = None
    graph: object = field(default=None, repr=False)


def map_out(f: Callable[[Tensor], Tensor], out):
    """``f`` of a body's output: a tensor, or each tensor of a tuple (a draft level's several outputs)."""
    return tuple(f(x) for x in out) if isinstance(out, tuple) else f(out)


def copy_in(buffers: list[Tensor], xs: list[Tensor]) -> None:
    """A call's inputs into a recording's static buffers, in place (a graph reads those addresses, not ``xs``)."""
    for buf, x in zip(buffers, xs, strict=True):
        buf.copy_(x)


def copy_out(output: Tensor) -> Tensor:
    """A fresh copy of a recording's static output: the next replay overwrites the buffer, while a caller may keep
    a result across calls (a draft level's outputs feed the next level and the tree's per-node inputs)."""
    return map_out(torch.clone, output)


_CAPTURE_LOCK = threading.Lock()


class GraphExecutor:
    """Records a forward once per ``key`` on static input buffers, then: copy the inputs in, replay, copy the output
    out (a fresh tensor: the static output is overwritten by the next replay).

    ``capture="cuda"``: a ``torch.cuda.CUDAGraph`` (warm-up iterations on a side stream, then capture, as the
    PyTorch CUDA-graphs notes prescribe); ``capture="replay"``: the body itself, re-run on the static buffers and
    copied into the recorded output in place (runs anywhere: the CPU tests' stand-in for a graph). The body must
    be idempotent given its inputs (a forward that writes its rows' keys/values at slots held in an input is: the
    warm-up and the first replay write the same values)."""

    def __init__(self, capture: str = "cuda", warmup: int = 2) -> None:
        if capture not in ("cuda", "replay"):
            raise ValueError(f"capture={capture!r}")
        self.capture, self.warmup = capture, warmup
        self.kind = capture
        self.recordings: dict = {}
        self.stats: Counter = Counter()

    def run(self, key, body: Callable[..., Tensor], inputs: list[Tensor], owner=None) -> Tensor:
        rec = self.recordings.get(key)
        if rec is None:
            rec = self.recordings[key] = self._record(body, inputs, owner)
            self.stats["recorded"] += 1
        else:
            copy_in(rec.inputs, inputs)
        rec.replay()
        self.stats["replayed"] += 1
        return copy_out(rec.output)

    def _record(self, body, inputs: list[Tensor], owner) -> Recording:
        bufs = [x.clone() for x in inputs]
        if self.capture == "replay":
            out = body(*bufs)

            def replay() -> None:
                new = body(*bufs)
                for o, x in zip(*(((out, new) if isinstance(out, tuple) else ((out,), (new,)))), strict=True):
                    o.copy_(x)
            return Recording(bufs, out, replay, owner)
        with _CAPTURE_LOCK:   # one capture at a time per process (the in-process API runs every rank as a thread)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    body(*bufs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other ranks' threads of the same process may keep launching work while this one captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = body(*bufs)
        return Recording(bufs, out, graph.replay, owner, graph)


def call_compiled(fn: Callable[..., Tensor], body: Callable[..., Tensor], inputs: list[Tensor]):
    """``fn(*inputs)`` (a ``torch.compile`` d body), or, while a Python dispatch mode is active (an instrument:
    dynamo refuses to run under one), what that mode makes of it: a mode with a ``compiled_call(run)`` method
    (``pipeline.tools.opcount``'s counter) runs ``run()`` itself (outside the mode, counting what the compiled code
    dispatches); under any other mode the body runs eagerly (the same operations, uncompiled)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    mode = _get_current_dispatch_mode()
    if mode is None:
        return fn(*inputs)
    hook = getattr(mode, "compiled_call", None)
    return hook(lambda: fn(*inputs)) if hook is not None else body(*inputs)


class CompileExecutor:
    """``torch.compile`` of the padded forward (``model.graphs=compile``): compiled lazily, once per ``key`` (a
    bucket of a cache and row layout, as for the graph executors), with inductor and ``dynamic=False``, so each bucket
    is its own compiled graph of fixed shapes; on CUDA with ``mode="reduce-overhead"`` (inductor's CUDA graphs of the
    compiled code), elsewhere the default mode (fused C++ kernels on a CPU, built with the host's compiler).

    The compiled function is the one built at the key's first call and keeps that call's body: the body must close
    over nothing that changes between calls of one key except through its tensor inputs and the buffers the key
    names (a static forward's body closes over the model and the KV cache, whose buffers it writes in place at the
    slots given as an input: the same for every call of the key, see :class:`StaticForward`).
    ``compile_s`` sums the seconds of the first calls (compilation plus one run), which no per-call figure includes
    (callers warm every bucket first and report this apart); ``stats``: ``compiled`` graphs and ``calls`` after.
    On CUDA the outputs are copied (:func:`copy_out`): reduce-overhead's graphs reuse their output memory."""
    kind = "compile"

    def __init__(self) -> None:
        self.compiled: dict = {}
        self.stats: Counter = Counter()
        self.compile_s = 0.0

    def run(self, key, body: Callable[..., Tensor], inputs: list[Tensor], owner=None) -> Tensor:
        entry = self.compiled.get(key)
        cuda = inputs[0].is_cuda
        if entry is None:
            import torch._dynamo.config as dynamo_config
            # one code object (StaticForward.run's padded body) serves every bucket, cache and head: each compiled
            # key is one more guarded entry of it, more than dynamo's default 8 per code object
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
            dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 1024)
            if cuda:        # reduce-overhead's CUDA graphs may write in place only into static addresses: the cache
                for t in (getattr(owner, "keys", None), getattr(owner, "values", None)):
                    if isinstance(t, torch.Tensor):
                        torch._dynamo.mark_static_address(t)
            fn = torch.compile(body, dynamic=False, fullgraph=True,
                               mode="reduce-overhead" if cuda else None)
            t0 = time.perf_counter()
            out = call_compiled(fn, body, inputs)
            if cuda:
                torch.cuda.synchronize()
            self.compile_s += time.perf_counter() - t0
            self.compiled[key] = (fn, body, owner)
            self.stats["compiled"] += 1
        else:
            out = call_compiled(entry[0], entry[1], inputs)
            self.stats["calls"] += 1
        return copy_out(out) if cuda else out


def make_executor(kind: str | None):
    """An executor for :func:`resolve_executor`'s answer (None for None)."""
    if kind is None:
        return None
    if kind == "eager":
        return EagerExecutor()
    if kind == "compile":
        return CompileExecutor()
    return GraphExecutor(kind)


class StaticForward:
    """A block forward ``body(*rows, positions, mask, cache)`` on static shapes (see the module docstring).

    :meth:`bucket_for` says whether a call fits (a bucket holds its rows and the cache has room for the whole
    bucket); :meth:`run` pads, builds the static mask and slots, and hands the padded inputs to the executor;
    the caller runs the dynamic forward when it does not fit. ``stats`` counts calls per bucket and fallbacks."""

    def __init__(self, body: Callable[..., Tensor], executor, buckets: tuple[int, ...]) -> None:
        self.body, self.executor, self.buckets = body, executor, tuple(buckets)
        self.stats: Counter = Counter()

    def bucket_for(self, n: int, cache) -> int | None:
        b = pick_bucket(n, self.buckets)
        if b is None or cache.length + b > cache.max_len:
            self.stats["dynamic"] += 1
            return None
        return b

    def run(self, bucket: int, rows: tuple[Tensor, ...], positions: Tensor, mask: Tensor, cache, body=None,
            tag=None) -> Tensor:
        """Rows ``[1, n, ...]`` (on the cache's device), ``positions [1, n]``, the dynamic ``mask [1, 1, n, length +
        n]`` -> the forward's output for the ``n`` real rows, ``[1, n, ...]`` (each of a tuple's outputs).
        ``body``: another static body than the forward's (same signature), ``tag`` naming it in the executor's keys
        (a draft level's :func:`draft.static_head.level_step` with its ``k``)."""
        n, length, dev = rows[0].shape[1], cache.length, cache.keys.device
        self.stats[bucket] += 1
        inputs = [pad_rows(x, bucket) for x in rows]
        inputs.append(pad_rows(positions.to(dev), bucket))
        inputs.append(static_mask(mask, n, bucket, length, cache.max_len).to(dev))
        inputs.append(static_slots(length, bucket, dev))
        key = (id(cache), cache.keys.data_ptr(), bucket, tuple((x.dtype, tuple(x.shape[2:])) for x in rows), tag)
        body = self.body if body is None else body

        def padded(*xs: Tensor) -> Tensor:
            *rs, pos, m, slots = xs
            return body(*rs, pos, m, SlotCache(cache, slots))
        with torch.no_grad():     # inference only: a recorded forward must not build an autograd graph
            return map_out(lambda x: x[:, :n], self.executor.run(key, padded, inputs, owner=cache))


def static_ok(block, executor_kind: str | None) -> bool:
    """Whether a :class:`model.layers.LayerBlock` can run on static shapes with ``executor_kind``: an executor, lean
    layers (quantized or other attention layouts keep the transformers path, whose cache access the static path
    does not cover), and for CUDA graphs a rotary embedding that does not resize itself from the positions' values
    (``dynamic`` / ``longrope`` read them on the host: a synchronisation, which a capture refuses; the same for
    ``compile``, whose ``fullgraph`` trace refuses the host read)."""
    if executor_kind is None or block is None or not getattr(block, "lean", False):
        return False
    rope = getattr(getattr(block, "rotary_emb", None), "rope_type", "default")
    return executor_kind not in ("cuda", "compile") or rope not in ("dynamic", "longrope")


def static_stage(model, executor_kind: str | None, buckets: tuple[int, ...] = STAGE_BUCKETS):
    """A stage's static forward (:class:`StaticStage`), or None where the stage keeps dynamic shapes (no decoder
    layers, or :func:`static_ok` says no)."""
    if not static_ok(getattr(model, "block", None), executor_kind):
        return None
    return StaticStage(model, make_executor(executor_kind), buckets)


class StaticStage:
    """``pipeline.worker.StageWorker``'s forward on static shapes: ``stage(x, positions, mask, cache)`` returns
    what ``model(x, positions, mask, cache)`` returns (rows beyond every bucket, or too close to the cache's
    capacity, run it dynamically)."""

    def __init__(self, model, executor, buckets: tuple[int, ...] = STAGE_BUCKETS) -> None:
        self.model = model
        self.static = StaticForward(model, executor, buckets)

    @property
    def stats(self) -> Counter:
        return self.static.stats

    def __call__(self, x: Tensor, positions: Tensor, mask: Tensor, cache) -> Tensor:
        b = self.static.bucket_for(int(positions.numel()), cache) if self.model.block.lean else None
        if b is None:
            return self.model(x, positions, mask, cache)
        return self.static.run(b, (x,), positions, mask, cache)
