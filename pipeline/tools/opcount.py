"""Count what one of rank 0's calls dispatches: aten operators, and the reads that would synchronise a GPU.

On a GPU every aten operator on a device tensor is a kernel launch (host overhead of a few microseconds each,
more on a Jetson-class CPU), and every read of a device value into Python (``.item()``, ``int(t)``,
``.tolist()``, ``nonzero``, boolean-mask indexing, a copy to the host) is a host<->device synchronisation: the
host waits for the queue to drain. Both are deterministic for a given call and input, so they can be counted on
a CPU, where timings are noisy, and bounded in tests (``tests/test_rank0_ops.py``).

:class:`OpCounter` (a context manager) counts, while active:

* ``ops``: every aten operator dispatched (``TorchDispatchMode``; views included: on a GPU they cost host
  time, not a launch);
* ``dev_ops``: the operators that touch a *device* tensor (see below): the launches on a GPU;
* ``reads``: operators and methods that bring a tensor's values into Python or size an output by its values:
  ``aten._local_scalar_dense`` (``.item()``, ``int``, ``float``, ``bool``), ``aten.nonzero``,
  ``aten.masked_select``, an ``aten.index`` / ``index_put`` with a boolean index, ``aten.repeat_interleave``
  with a tensor of repeats, ``aten.unique*``, and ``Tensor.tolist``;
* ``model_ops``: the operators dispatched inside the forward of a module given as ``model=`` (the draft head,
  the ``lm_head``): the model's own work, the rest (``ops - model_ops``) is the call's bookkeeping;
* ``syncs``: the reads of a device tensor plus every ``.to(HOST)`` / ``.to('cpu')`` / ``.cpu()`` of one (a
  device->host copy): what would synchronise a GPU.

Which tensors are "device" tensors on a CPU-only run: the ones :meth:`OpCounter.mark` was given (a drafter's
weights and caches, the features a stage returned) and everything computed from one of them; a ``.to(cpu)`` /
``.cpu()`` of one returns a host tensor (a copy on a GPU). A tensor built from Python values on the host
(``torch.tensor(list)``, ``arange``) is a host tensor. Tensors a call creates with ``device=<the head's
device>`` are counted as host tensors on a CPU (an undercount of ``dev_ops``; ``ops`` counts everything).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
READ_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default}
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


@dataclass
class OpCount:
    ops: int = 0
    dev_ops: int = 0
    model_ops: int = 0
    reads: int = 0
    syncs: int = 0
    by_op: dict = field(default_factory=dict)
    sync_sites: dict = field(default_factory=dict)   # "file:line" -> syncs there (OpCounter(sites=True))

    def row(self) -> dict:
        return {"ops": self.ops, "dev_ops": self.dev_ops, "model_ops": self.model_ops,
                "bookkeeping_ops": self.ops - self.model_ops, "reads": self.reads, "syncs": self.syncs}


def _tensors(x) -> list:
    """Every tensor in ``x`` (nested lists, tuples, dicts; ``torch.return_types`` such as sort's too)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _is_host_target(args, kwargs) -> bool:
    """Whether a ``Tensor.to(...)`` call moves a tensor to the host: ``to(HOST)`` (:data:`model.devices.HOST`, the
    object itself) or ``to('cpu')``. On a CPU-only run every device is the CPU, so ``to(self.device)`` (a move to
    the model's device, a no-op or a host->device copy on a GPU) is told apart by identity: the code names the
    host ``HOST`` wherever it means it."""
    from model.devices import HOST
    for a in list(args[1:]) + list(kwargs.values()):
        if a is HOST or (isinstance(a, str) and a == "cpu"):
            return True
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "OpCounter") -> None:
        super().__init__()
        self.owner = owner

    def compiled_call(self, run):
        """A ``torch.compile`` d body's call (:func:`model.graphs.call_compiled`; dynamo cannot run under this mode):
        run outside the counter's modes under the profiler, and count the aten operators the compiled code still
        dispatches (top-level ``aten::`` events: inductor's extern kernels and fallbacks, ``mm``, ``topk``, buffer
        allocation), each on the device; inductor's fused kernels (C++ on a CPU, Triton on CUDA) are not aten
        operators and are not counted. Its outputs are device tensors. No sync: a compiled body reads nothing."""
        return self.owner.compiled_call(run)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.owner.quiet:
            return func(*args, **kwargs)
        c, dev = self.owner.count, self.owner.device
        ins = _tensors((args, kwargs))
        on_dev = any(t in dev for t in ins)
        c.ops += 1
        c.dev_ops += on_dev
        c.model_ops += self.owner.in_model > 0
        name = str(func.overloadpacket.__name__)
        c.by_op[name] = c.by_op.get(name, 0) + 1
        read = func in READ_OPS or (func in INDEX_OPS and any(
            t.dtype == torch.bool for t in _tensors(args[1] if len(args) > 1 else ())))
        if read:
            c.reads += 1
            c.syncs += on_dev
            if on_dev:
                self.owner.site()
        out = func(*args, **kwargs)
        if on_dev:
            for t in _tensors(out):
                dev[t] = True
            if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
                dev[args[0]] = True
        return out


class _Function(TorchFunctionMode):
    def __init__(self, owner: "OpCounter") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c, dev = self.owner.count, self.owner.device
        name = getattr(func, "__name__", "")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "tolist" and src is not None:
            c.reads += 1
            c.syncs += src in dev
            if src in dev:
                self.owner.site()
        if src is not None and src in dev and (name == "cpu" or (name == "to" and _is_host_target(args, kwargs))):
            c.syncs += 1                         # a device->host copy; on a CPU run: a host alias
            self.owner.site()
            out = func(*args, **kwargs)
            if out is src:
                self.owner.quiet = True
                try:
                    out = src.detach()
                finally:
                    self.owner.quiet = False
            dev.pop(out, None)
            return out
        return func(*args, **kwargs)


class OpCounter:
    """``with OpCounter(device_tensors) as c: call()``, then ``c.count`` (an :class:`OpCount`)."""

    def __init__(self, *device, model=(), sites: bool = False) -> None:
        self.sites = sites
        self.device = WeakIdKeyDictionary()
        self.count = OpCount()
        self.quiet = False
        self.in_model = 0
        self.model = [m for m in model if m is not None]
        self.mark(*device)

    def mark(self, *objs) -> None:
        """Treat these tensors (and every parameter/buffer of these modules) as device-resident."""
        for o in objs:
            if o is None:
                continue
            if isinstance(o, torch.nn.Module):
                for t in list(o.parameters()) + list(o.buffers()):
                    self.device[t] = True
            elif isinstance(o, torch.Tensor):
                self.device[o] = True
            elif isinstance(o, (list, tuple)):
                self.mark(*o)

    def site(self) -> None:
        """Record where a sync happened (the innermost frame outside torch and this module)."""
        if not self.sites:
            return
        import traceback
        for fr in reversed(traceback.extract_stack()[:-2]):
            if "torch" not in fr.filename and "opcount" not in fr.filename:
                key = f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}"
                self.count.sync_sites[key] = self.count.sync_sites.get(key, 0) + 1
                return

    def compiled_call(self, run):
        """See :meth:`_Dispatch.compiled_call`."""
        from torch.profiler import ProfilerActivity, profile
        self._d.__exit__(None, None, None)
        self._f.__exit__(None, None, None)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = run()
        finally:
            self._f.__enter__()
            self._d.__enter__()
        c = self.count
        for e in prof.events():
            if not e.name.startswith("aten::"):
                continue
            p = e.cpu_parent
            while p is not None and not p.name.startswith("aten::"):
                p = p.cpu_parent
            if p is None:                                     # a top-level operator of the compiled code
                c.ops += 1
                c.dev_ops += 1
                c.model_ops += self.in_model > 0
                name = e.name[len("aten::"):]
                c.by_op[name] = c.by_op.get(name, 0) + 1
        c.compiled_calls = getattr(c, "compiled_calls", 0) + 1
        for t in _tensors(out):
            self.device[t] = True
        return out

    def _enter_model(self, *_):
        self.in_model += 1

    def _leave_model(self, *_):
        self.in_model -= 1

    def __enter__(self) -> "OpCounter":
        self._hooks = [h for m in self.model for h in (m.register_forward_pre_hook(self._enter_model),
                                                        m.register_forward_hook(self._leave_model))]
        self._f, self._d = _Function(self), _Dispatch(self)
        self._f.__enter__()
        self._d.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._d.__exit__(*exc)
        self._f.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        return False


def count_call(fn, *device, model=()) -> OpCount:
    """Run ``fn()`` once under an :class:`OpCounter` seeded with ``device`` (``model``: modules whose forwards
    are model work); its counts."""
    with OpCounter(*device, model=model) as c:
        fn()
    return c.count
