"""Typed messages of the pipeline protocol and their wire codec.

Every message travels as a fixed-size int64 header followed (when non-empty) by one uint8 payload
holding its tensors' raw bytes, so every dtype (bf16, fp16, fp32, fp64, int32, int64, bool) and empty
tensors round-trip exactly.

Ring messages (rank r -> r+1, last -> 0):
  * :class:`Context`  committed tokens (prefill chunks, ``ar`` tokens); ``reset`` starts generation ``gen``.
  * :class:`Segment`  draft-tree nodes named by *node ids* (``gids``: numbered by rank 0 in send order, never
    reused within a generation) with their parents' node ids (``-1``: a child of the committed context).
    It carries the decision log: every :class:`Decision` rank 0 issued since its previous segment, so a
    stage always holds every decision a segment depends on when the segment arrives from its data source.
  * :class:`Stats` collects every rank's busy time after a generation.
  * :class:`Fork` starts generation ``gen`` on its lane with lane ``src``'s first ``n`` committed KV slots (the
    prompt's prefill shared by the ``n`` choices of one request: ``pipeline/lanes.py``, :class:`SharedPrefill`).
  * :class:`Shutdown` ends the worker loop (every lane: it is global).

**Lanes** (several requests in flight, ``pipeline/lanes.py``): every message but :class:`Shutdown` names the
request slot it belongs to, ``lane`` (0 by default: a single request never sets it, so everything single-request
is unchanged). A stage keeps a KV cache and a :class:`pipeline.worker.StageTree` per lane; a result goes back to
rank 0 on the lane it came on; a decision applies to its own lane only (a logged decision belongs to the lane of
the segment that carries it). The lane travels in the header's kind word (``kind + lane * LANE_SHIFT``), so the
messages' own int fields and the decision log's packing are untouched.
Direct messages (rank 0 -> each stage r >= 2, point to point): the same :class:`Decision` objects, sent the
moment they are made, so a stage can prune work it has not computed yet before the copy on the ring
reaches it. No collective is used in the decode loop.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from model.devices import HOST

Tensor = torch.Tensor

HEADER_LEN = 48
MAGIC = 0x5F10_5EC0
MAX_TENSORS = 4
LANE_SHIFT = 256        # header word 1 = kind + lane * LANE_SHIFT (kinds < 256)
MAX_LANES = 4096        # lanes 0..MAX_LANES-1 (a header naming another is corrupt)
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.bool,
           torch.uint8, torch.int8]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


class Kind(IntEnum):
    CONTEXT = 1
    SEGMENT = 2
    SHUTDOWN = 3
    DECISION = 4
    STATS = 5
    FORK = 6


class Status(IntEnum):
    CONTINUE = 1   # accepted path -> context, subtree of the new root survives
    TRUNCATE = 2   # accepted path -> context, everything else dropped; a fresh tree follows at once


class Wire:
    """A message's wire form, from its class's field lists: ``INTS``, ``(name, type)`` of the fields that travel
    as header ints, in order (a ``bool`` or enum field travels as its int and is rebuilt by ``type``), and
    ``TENSORS``, the names of its tensor fields, in order (a None tensor is not sent: only a last, optional one may
    be None). ``lane`` travels in the header's kind word (:func:`kind_word`), never here."""

    INTS: tuple = ()
    TENSORS: tuple = ()

    def ints(self) -> list[int]:
        return [int(getattr(self, name)) for name, _ in self.INTS]

    def tensors(self) -> list[Tensor]:
        return [t for t in (getattr(self, name) for name in self.TENSORS) if t is not None]

    @classmethod
    def build(cls, ints: list[int], tensors: list[Tensor]):
        return cls(**{name: kind(v) for (name, kind), v in zip(cls.INTS, ints)}, **dict(zip(cls.TENSORS, tensors)))


@dataclass
class Decision(Wire):
    """Rank 0's verdict after one verification step, numbered ``seq = 1, 2, ...`` within generation ``gen``.

    Applying it (:func:`draft.tree.decision_keep`): the nodes ``path`` (node ids, root first) become committed
    context, in that order; of the other tree nodes only the subtree of ``root`` survives (``root = -1``:
    none: the new root has not been sent yet, or the round ended). Stages apply decisions in ``seq`` order,
    each exactly once, whichever copy (direct or ring-borne) arrives first.
    """

    gen: int = 0
    seq: int = 0
    status: Status = Status.CONTINUE
    root: int = -1
    finished: bool = False
    path: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long, device=HOST))
    lane: int = 0             # the request slot (module docstring: lanes); not in ints() nor in a packed log

    kind = Kind.DECISION
    INTS = (("gen", int), ("seq", int), ("status", Status), ("root", int), ("finished", bool))
    TENSORS = ("path",)


def pack_log(decisions: list[Decision]) -> Tensor:
    """Decisions as one int64 vector: per decision ``[gen, seq, status, root, finished, len(path), *path]``."""
    out: list[int] = []
    for d in decisions:
        out += d.ints() + [d.path.numel()] + d.path.tolist()
    return torch.tensor(out, dtype=torch.long, device=HOST)


def unpack_log(log: Tensor) -> list[Decision]:
    vals, out, i = log.tolist(), [], 0
    while i < len(vals):
        n = vals[i + 5]
        out.append(Decision.build(vals[i:i + 5], [torch.tensor(vals[i + 6:i + 6 + n], dtype=torch.long,
                                                                device=HOST)]))
        i += 6 + n
    return out


@dataclass
class Context(Wire):
    x: Tensor                 # token ids [1, n] (to rank 1) or hidden [1, n, H]
    gen: int = 0              # generation number (decisions of other generations are ignored)
    reset: bool = False
    lane: int = 0

    kind = Kind.CONTEXT
    INTS = (("gen", int), ("reset", bool))
    TENSORS = ("x",)


@dataclass
class Segment(Wire):
    """Draft-tree nodes on their way through the stages (and back to rank 0 as hidden states).

    ``gids`` are the nodes' ids and ``parents`` their parents' ids (``-1``: child of the committed context).
    ``epoch`` is the number of decisions rank 0 had issued when it sent the segment: a stage applies
    decisions ``1..epoch`` before computing it (they are in this or an earlier segment's ``log``) and may
    apply later ones it already holds, dropping rows they kill. Rows travel in send order.
    """

    x: Tensor                 # token ids [1, n] or hidden [1, n, H]; n may be 0
    parents: Tensor           # [n] parent node ids, -1 = child of the committed context
    gids: Tensor              # [n] node ids
    gen: int = 0
    epoch: int = 0
    log: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long, device=HOST))
    tag: int = 0              # mode-specific (tp/galaxy: the group's schedule); stages forward it
    lane: int = 0

    kind = Kind.SEGMENT
    INTS = (("gen", int), ("epoch", int), ("tag", int))
    TENSORS = ("x", "parents", "gids", "log")

    @property
    def n(self) -> int:
        return int(self.parents.numel())

    def decisions(self) -> list[Decision]:
        """The decisions of the log, each of this segment's lane."""
        out = unpack_log(self.log)
        for d in out:
            d.lane = self.lane
        return out


@dataclass
class Shutdown(Wire):
    kind = Kind.SHUTDOWN
    lane = 0                  # global: it ends every lane


@dataclass
class Stats(Wire):
    """Travels once around the ring between generation phases; each rank writes its busy seconds and, when its
    meter counts (``model.meter``: e.g. the emulated testbed's fidelity counters), those counters into row
    ``counters[rank]``."""

    busy_s: Tensor                  # float64 [world]
    counters: Tensor | None = None  # float64 [world, len(rank 0's meter.counter_names)] or None
    lane: int = 0                   # the lane whose decode window it closes (pipeline.worker: busy per lane)

    kind = Kind.STATS
    TENSORS = ("busy_s", "counters")


@dataclass
class Fork(Wire):
    """Start generation ``gen`` on lane ``lane`` from lane ``src``'s committed prefix: every stage copies ``src``'s
    first ``n`` committed KV slots into ``lane``'s cache (:meth:`model.kv_cache.KVCache.copy_prefix_to`) and resets
    ``lane``'s decision state to ``gen``, then forwards the message; back on rank 0 it says every stage holds the
    prefix. It stands for the resetting prefill ``Context`` chunks of the same ``n`` tokens, and leaves ``lane``'s
    caches bit-for-bit as they would be (the same rows computed by the same forwards, on ``src``).

    Sender's invariant (rank 0, :class:`pipeline.lanes.SharedPrefill`): ``src``'s prefill of those ``n`` tokens is
    complete and no resetting ``Context`` of ``src`` was sent after it and before this message. Then every stage
    holds them when the message arrives (the ring is FIFO per link and a stage handles messages in order), and
    a committed prefix only grows while its generation lasts (decisions append to it, never rewrite it)."""

    gen: int
    src: int
    n: int
    lane: int = 0

    kind = Kind.FORK
    INTS = (("gen", int), ("src", int), ("n", int))


_CLASSES = {Kind.CONTEXT: Context, Kind.SEGMENT: Segment, Kind.SHUTDOWN: Shutdown, Kind.DECISION: Decision,
            Kind.STATS: Stats, Kind.FORK: Fork}
Message = Context | Segment | Shutdown | Decision | Stats | Fork
_KINDS = {int(k) for k in _CLASSES}


def layout(msg: Message) -> tuple[list[int], list[Tensor], int]:
    """``(header ints, the tensors as contiguous host tensors, payload bytes)`` of ``msg``: what
    :func:`encode` writes. The header ints are ``[MAGIC, kind, n_ints, n_tensors, *ints]`` followed, per
    tensor, by ``[dtype code, ndim, *shape padded to 4]``; the payload is the tensors' raw bytes in order."""
    ints, tensors = msg.ints(), msg.tensors()
    if len(tensors) > MAX_TENSORS:
        raise ValueError("too many tensors in one message")
    head = [MAGIC, kind_word(int(msg.kind), msg.lane), len(ints), len(tensors), *ints]
    ts, nbytes = [], 0
    for t in tensors:
        nd = t.dim()
        if nd > 4:
            raise ValueError("tensors of at most 4 dims")
        if t.device.type != "cpu":
            t = t.detach().cpu()     # the one device->host copy of a message (no-op for host tensors)
        elif not t.is_contiguous():
            t = t.contiguous()
        head += (_CODE[t.dtype], nd, *t.shape, *_PAD[nd])
        ts.append(t)
        nbytes += t.numel() * t.element_size()
    if len(head) > HEADER_LEN:
        raise ValueError("header overflow")
    return head, ts, nbytes


_PAD = [(0,) * (4 - i) for i in range(5)]


def kind_word(kind: int, lane: int) -> int:
    """Header word 1: the message kind and its lane (:func:`split_kind_word` inverts it). Pure."""
    if not 0 <= lane < MAX_LANES:
        raise ValueError(f"lane {lane} out of range [0, {MAX_LANES})")
    return kind + lane * LANE_SHIFT


def split_kind_word(word: int) -> tuple[Kind, int]:
    """``(kind, lane)`` of header word 1; a word no message can have is a corrupt header (ValueError)."""
    kind, lane = word % LANE_SHIFT, word // LANE_SHIFT
    if word < 0 or lane >= MAX_LANES or kind not in _KINDS:
        raise ValueError("corrupt message header (kind or lane)")
    return Kind(kind), lane


def _build(kind: Kind, lane: int, ints: list[int], tensors: list[Tensor]) -> "Message":
    msg = _CLASSES[kind].build(ints, tensors)
    if lane:
        msg.lane = lane
    return msg


def encode(msg: Message) -> tuple[Tensor, Tensor]:
    """-> ``(header int64[HEADER_LEN], payload uint8[nbytes])`` (fresh tensors; :class:`pipeline.comm.Comm`
    writes the same bytes into preallocated buffers instead)."""
    head, ts, nbytes = layout(msg)
    header = torch.zeros(HEADER_LEN, dtype=torch.long, device=HOST)
    header.numpy()[:len(head)] = head
    payload = torch.empty(nbytes, dtype=torch.uint8, device=HOST)
    write_at(ts, payload.data_ptr())
    return header, payload


def shapes(h: list[int]) -> tuple[list, int]:
    """``([(dtype, shape, nbytes)], total bytes)`` of a header's tensors; checks the magic number."""
    if h[0] != MAGIC:
        raise ValueError("corrupt message header (bad magic)")
    n_t = h[3]
    pos, total, out = 4 + h[2], 0, []
    if not (0 <= h[2] and 0 <= n_t <= MAX_TENSORS and pos + 6 * n_t <= HEADER_LEN):
        raise ValueError("corrupt message header (counts)")
    for _ in range(n_t):
        code, nd = h[pos], h[pos + 1]
        if not (0 <= code < len(_DTYPES) and 0 <= nd <= 4):
            raise ValueError("corrupt message header (dtype or rank)")
        dt, shape = _DTYPES[code], h[pos + 2:pos + 2 + nd]
        numel = 1
        for s in shape:
            if s < 0:
                raise ValueError("corrupt message header (negative size)")
            numel *= s
        nbytes = numel * dt.itemsize
        out.append((dt, shape, nbytes))
        total += nbytes
        pos += 6
    return out, total


def payload_size(header: Tensor) -> int:
    return shapes(header.tolist())[1]


def decode_at(h: list[int], address: int) -> Message:
    """The message of header ints ``h`` whose payload bytes start at host memory ``address`` (a frame the
    caller owns and has sized by :func:`payload_size`): every tensor is allocated once and filled by one
    memory copy, with no intermediate payload tensor (the transport's receive path)."""
    specs, _ = shapes(h)
    (kind, lane), n_ints = split_kind_word(h[1]), h[2]
    tensors = []
    for dt, shape, nbytes in specs:
        t = torch.empty(shape, dtype=dt, device=HOST)
        if nbytes:
            ctypes.memmove(t.data_ptr(), address, nbytes)
            address += nbytes
        tensors.append(t)
    return _build(kind, lane, h[4:4 + n_ints], tensors)


def write_at(tensors: list[Tensor], address: int) -> None:
    """Copy the (contiguous, host) tensors' raw bytes, in order, to host memory at ``address`` (the
    transport's send buffer, sized by :func:`layout`)."""
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            ctypes.memmove(address, t.data_ptr(), n)
            address += n


def decode(header: Tensor, payload: Tensor, share: bool = False) -> Message:
    """The message of ``header`` and ``payload``. Its tensors are copies, or, with ``share=True`` (the
    caller hands the payload over and never reuses it), views of ``payload`` wherever the bytes are aligned
    for their dtype (no copy)."""
    h = header.tolist()
    specs, _ = shapes(h)
    (kind, lane), n_ints = split_kind_word(h[1]), h[2]
    ints = h[4:4 + n_ints]
    if payload.device.type != "cpu":
        payload = payload.cpu()
    off, tensors = 0, []
    for dt, shape, nbytes in specs:
        if nbytes:
            raw = payload[off:off + nbytes]
            if not share or off % dt.itemsize:
                raw = raw.clone()
            tensors.append(raw.view(dt).reshape(shape))
        else:
            tensors.append(torch.zeros(shape, dtype=dt, device=HOST))
        off += nbytes
    return _build(kind, lane, ints, tensors)
