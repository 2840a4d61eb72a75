"""One tensor-parallel shard (``model/tp_split.py``) and its two forward schedules.

Both schedules compute exactly the unsplit model's final normalized hidden states (up to the order of
floating-point sums); they differ only in how the ``N`` shards exchange partial results:

* ``megatron`` (mode ``tp``): every rank holds the whole sequence. Per layer: attention over the local heads,
  ``o_proj`` on the local columns -> **all-reduce**; MLP on the local FFN slice, ``down_proj`` -> **all-reduce**.
  The vocab-parallel embedding is one more all-reduce.
* ``galaxy`` (mode ``galaxy``, after Galaxy, INFOCOM'24): the residual stream is sequence-parallel (rank ``t``
  holds rows ``slice t`` and applies norms and residual adds to them only). Before the column-parallel
  projections (q/k/v, gate/up) a **ring all-gather** passes the normalized slices around while each rank
  projects the slice it already holds (communication overlapped with compute); after the row-parallel ones
  (o_proj, down_proj) a **ring reduce-scatter** passes partial sums around while each rank computes its
  partial for the next slice. A final gather brings the normalized slices to TP rank 0.

Collectives go through a :class:`Collectives` object: :class:`DistCollectives` (``torch.distributed`` group,
gloo or NCCL) in real runs, `tests/test_tp.py`'s ThreadCollectives (one thread per shard in one process) in tests.
"""
from __future__ import annotations

import importlib
from typing import Callable, Protocol

import torch
from torch import nn

from model.devices import HOST
from model.kv_cache import KVCache
from model.layers import family_classes
from model.stage_format import StageDirError, stage_dir, verify_stage_file

Tensor = torch.Tensor
SCHEDULES = ("megatron", "galaxy")


class Collectives(Protocol):
    """The TP group as one shard sees it. ``size`` shards, this one is ``rank`` (0-based within the group)."""

    size: int
    rank: int

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the group in place; returns it."""

    def ring_start(self, send: Tensor, recv: Tensor):
        """Start sending ``send`` to the next shard and receiving into ``recv`` from the previous one;
        returns something whose ``wait()`` completes both."""

    def gather_to_first(self, t: Tensor, rows: list[int]) -> Tensor | None:
        """Shard 0 gets every shard's ``t`` (``rows[j]`` rows from shard ``j``) concatenated; others get None."""


def slice_rows(n: int, size: int) -> list[int]:
    """Rows per sequence slice: ``n`` split into ``size`` near-equal parts (earlier slices one longer)."""
    base, extra = divmod(n, size)
    return [base + (j < extra) for j in range(size)]


class TPShard(nn.Module):
    """TP rank ``t``'s weights: vocab-parallel embedding, all decoder layers at 1/N width, the final norm.

    The decoder layers are the family's own modules built from the shard's config (local head counts), so
    parameter names match the checkpoint; :meth:`forward` drives their submodules itself so that the
    collectives sit where the schedule needs them.
    """

    def __init__(self, config) -> None:
        super().__init__()
        layer_cls, rotary_cls, norm_cls = family_classes(config)
        config._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
        self.config = config
        self.tp_size, self.tp_rank = int(config.tp_size), int(config.tp_rank)
        self.vocab_start, self.vocab_end = config.tp_vocab_range
        self.embed_tokens = nn.Embedding(self.vocab_end - self.vocab_start, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_cls(config=config)
        mod = importlib.import_module(type(self.layers[0]).__module__)
        self._rope = mod.apply_rotary_pos_emb
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        self._attention = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
        self.head_dim = config.head_dim

    def new_cache(self, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(len(self.layers), self.config.num_key_value_heads, self.head_dim, max_len, dtype, device)

    # -- pieces shared by both schedules --------------------------------------------------------------
    def embed_partial(self, ids: Tensor) -> Tensor:
        """This shard's share of the embedding: rows of ids outside its vocab range are zero (sum = lookup)."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        out = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        return out * inside[..., None].to(out.dtype)

    def qkv(self, layer, h: Tensor) -> Tensor:
        """Column-parallel q, k, v projections of rows ``h`` ``[1, n, H]``, concatenated on the last dim."""
        a = layer.self_attn
        return torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], dim=-1)

    def attend(self, layer, qkv: Tensor, pos_emb, mask: Tensor, cache: KVCache) -> Tensor:
        """Attention of the local heads over the cache plus these rows; returns ``[1, n, heads_local*hd]``
        (the input of the row-parallel ``o_proj``). Appends the rows' keys/values to ``cache``."""
        a, hd, n = layer.self_attn, self.head_dim, qkv.shape[1]
        nq, nkv = self.config.num_attention_heads * hd, self.config.num_key_value_heads * hd
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q, k, v = (x.reshape(1, n, -1, hd).transpose(1, 2) for x in (q, k, v))
        q, k = self._rope(q, k, *pos_emb)
        k, v = cache.update(k, v, a.layer_idx)
        out, _ = self._attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling)
        return out.reshape(1, n, -1)

    @staticmethod
    def gate_up(layer, h: Tensor) -> Tensor:
        m = layer.mlp
        return m.act_fn(m.gate_proj(h)) * m.up_proj(h)

    # -- schedules ------------------------------------------------------------------------------------
    def forward(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: KVCache, coll: Collectives,
                schedule: str = "megatron") -> Tensor | None:
        """Final normalized hidden states ``[1, n, H]`` of token ``ids`` ``[1, n]`` on shard 0 (None on the
        others under ``galaxy``; every shard gets them under ``megatron``). Writes the rows' keys/values to
        ``cache``; the caller advances it (``KVCache.commit_forward``)."""
        dev = self.embed_tokens.weight.device
        ids, positions = ids.to(dev), positions.to(dev)
        mask = mask.to(device=dev, dtype=self.embed_tokens.weight.dtype)
        x = self.embed_partial(ids)
        pos_emb = self.rotary_emb(x, positions)
        if schedule == "megatron":
            return self._megatron(x, pos_emb, mask, cache, coll)
        if schedule == "galaxy":
            return self._galaxy(x, pos_emb, mask, cache, coll)
        raise ValueError(f"unknown TP schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")

    def _megatron(self, x, pos_emb, mask, cache, coll) -> Tensor:
        x = coll.all_reduce(x)
        for layer in self.layers:
            a = self.attend(layer, self.qkv(layer, layer.input_layernorm(x)), pos_emb, mask, cache)
            x = x + coll.all_reduce(layer.self_attn.o_proj(a))
            m = self.gate_up(layer, layer.post_attention_layernorm(x))
            x = x + coll.all_reduce(layer.mlp.down_proj(m))
        return self.norm(x)

    def _galaxy(self, x, pos_emb, mask, cache, coll) -> Tensor | None:
        rows = slice_rows(x.shape[1], coll.size)
        bounds = [sum(rows[:j]) for j in range(coll.size + 1)]

        def part(full: Tensor) -> Callable[[int], Tensor]:
            return lambda j: full[:, bounds[j]:bounds[j + 1]]

        xs = ring_reduce_scatter(coll, rows, part(x))                  # my slice of the embeddings
        for layer in self.layers:
            h = ring_all_gather(coll, rows, layer.input_layernorm(xs), lambda s: self.qkv(layer, s))
            a = self.attend(layer, torch.cat(h, dim=1), pos_emb, mask, cache)
            xs = xs + ring_reduce_scatter(coll, rows, lambda j: layer.self_attn.o_proj(part(a)(j)))
            g = torch.cat(ring_all_gather(coll, rows, layer.post_attention_layernorm(xs),
                                          lambda s: self.gate_up(layer, s)), dim=1)
            xs = xs + ring_reduce_scatter(coll, rows, lambda j: layer.mlp.down_proj(part(g)(j)))
        return coll.gather_to_first(self.norm(xs), rows)


def ring_all_gather(coll: Collectives, rows: list[int], mine: Tensor, f: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """``[f(slice_0), ..., f(slice_{N-1})]`` where ``mine`` is this shard's slice: each step passes the slice
    held to the next shard while ``f`` runs on it (communication overlapped with compute)."""
    n, t = coll.size, coll.rank
    out: list[Tensor | None] = [None] * n
    cur, j = mine.contiguous(), t
    for step in range(n):
        handle = None
        if step < n - 1:
            nxt = torch.empty(1, rows[(j - 1) % n], *cur.shape[2:], dtype=cur.dtype, device=cur.device)
            handle = coll.ring_start(cur, nxt)
        out[j] = f(cur)
        if handle is not None:
            handle.wait()
            cur, j = nxt, (j - 1) % n
    return out


def ring_reduce_scatter(coll: Collectives, rows: list[int], part: Callable[[int], Tensor]) -> Tensor:
    """This shard's slice of ``sum over shards of part(j)``: the running sum for slice ``j`` travels the ring
    and each shard adds its ``part(j)`` computed while the previous step's transfer is under way. Step ``s``
    works on slice ``(t - s - 1) mod N``, so after ``N - 1`` steps shard ``t`` holds slice ``t``."""
    n, t = coll.size, coll.rank
    acc = part((t - 1) % n).contiguous()
    for s in range(1, n):
        j = (t - s - 1) % n
        buf = torch.empty(1, rows[j], *acc.shape[2:], dtype=acc.dtype, device=acc.device)
        handle = coll.ring_start(acc, buf)
        p = part(j)
        handle.wait()
        acc = buf + p
    return acc


# -- collectives ------------------------------------------------------------------------------------------
class DistCollectives:
    """The TP group over ``torch.distributed``: global ranks ``first .. first + size - 1`` form ``group``.

    With gloo (``host_staging``), tensors on a GPU are staged through host memory for every collective, as
    :class:`pipeline.comm.Comm` does for its messages; NCCL moves them where they are."""

    def __init__(self, group, first: int, size: int, rank: int, host_staging: bool = True) -> None:
        self.group, self.first, self.size, self.rank = group, first, size, rank
        self.host_staging = host_staging

    def _wire(self, t: Tensor) -> Tensor:
        return t.cpu() if self.host_staging and t.device.type != "cpu" else t

    def all_reduce(self, t: Tensor) -> Tensor:
        if self.size > 1:
            import torch.distributed as dist
            w = self._wire(t)
            dist.all_reduce(w, group=self.group)
            if w is not t:
                t.copy_(w)
        return t

    def ring_start(self, send: Tensor, recv: Tensor):
        import torch.distributed as dist
        nxt = self.first + (self.rank + 1) % self.size
        prv = self.first + (self.rank - 1) % self.size
        into = self._wire(recv)
        ops = [dist.P2POp(dist.isend, self._wire(send), nxt, self.group), dist.P2POp(dist.irecv, into, prv, self.group)]
        return _Handles(dist.batch_isend_irecv(ops), into, recv)

    def gather_to_first(self, t: Tensor, rows: list[int]) -> Tensor | None:
        if self.size == 1:
            return t
        import torch.distributed as dist
        width = max(rows)
        padded = torch.zeros(1, width, t.shape[-1], dtype=t.dtype, device=t.device)
        padded[:, :t.shape[1]] = t
        padded = self._wire(padded)
        bufs = [torch.empty_like(padded) for _ in rows] if self.rank == 0 else None
        dist.gather(padded, bufs, group_dst=0, group=self.group)
        if self.rank:
            return None
        return torch.cat([b[:, :r] for b, r in zip(bufs, rows)], dim=1).to(t.device)

    def all_gather_vectors(self, values: list[float]) -> list[list[float]]:
        """Every shard's equally long ``values`` in shard order (busy times and meter counters, once per generation)."""
        if self.size == 1:
            return [list(values)]
        import torch.distributed as dist
        device = HOST if self.host_staging else torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return [v.tolist() for v in every]


class _Handles:
    def __init__(self, works, staged: Tensor | None = None, into: Tensor | None = None) -> None:
        self.works, self.staged, self.into = works, staged, into

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.staged is not None and self.staged is not self.into:
            self.into.copy_(self.staged)


# -- loading ----------------------------------------------------------------------------------------------
def load_tp_shard(root, rank: int, world: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  verify: bool = True) -> TPShard:
    """Load global rank ``rank`` (>= 1) of a TP split, checking manifest, world size and checksum."""
    from model.stage_format import check_world
    from model.stage_model import load_stage_config, load_weights
    manifest = check_world(root, world)
    if not manifest.get("tp"):
        raise StageDirError(f"{root} is a pipeline split, not a tensor-parallel one (split it with --tp N)")
    if verify:
        verify_stage_file(root, manifest, rank)
    config = load_stage_config(root, rank, hf=True)   # TPShard drives transformers' modules
    if getattr(config, "tp_rank", None) != rank - 1:
        raise StageDirError(f"{stage_dir(root, rank)} is not TP rank {rank - 1}")
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = TPShard(config)
    load_weights(model, root, rank, dtype, f"TP shard {rank}")
    _, rotary_cls, _ = family_classes(config)
    model.rotary_emb = rotary_cls(config=config)   # buffers were created on meta
    return model.to(dtype=dtype).to(device).eval()
