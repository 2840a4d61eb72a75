"""The EAGLE-1/2 draft head's forward as few operators (issue 41): the same weights and math as
:func:`model.lean_layer.lean_forward`, about half its aten operators.

Why: rank 0 runs the head once per drafted level and once per commit, at batch 1; on a GPU every aten operator is a
launch and on this CPU a few microseconds of host time (docs/results.md §24: the operator count *is* the host time
of a small head). The lean layer already drops transformers' framework; this drops the layer's own redundancy:

* q/k/v as ONE matmul and gate/up as ONE matmul (weights concatenated once, kept until a weight changes, below);
* the rotary ``(cos, sin)`` gathered from a table precomputed per position by the layer's own rotary module (no
  per-call rotary module: its cos/sin are elementwise in the position, so a table row is bitwise the per-call
  value), with ``rotate_half(x) * sin`` as ``roll(x, d/2) * sin'`` (``sin'``: ``sin`` with its first half negated,
  bitwise the same products) applied to q and k in one pass;
* the transposed weights kept as views (``mm`` / ``addmm``: no ``t`` per call), the residual adds folded into the
  ``addmm`` of ``o_proj`` and ``down_proj`` where those have no bias, ``fc`` + embedding on the rows as given;
* the post-attention RMSNorm's weight folded into the fused gate/up weights (``(w * y) @ W = y @ (w * W)``, equal up
  to float rounding; the norm weight is in the signature below), the rotary applied in place on the q/k slice of the
  q/k/v matmul so that one transpose and one split give q, k and v (issue 41, docs/results.md "A draft level in fewer
  operators": 39 -> 35 operators per forward);
* grouped-query attention through ``scaled_dot_product_attention(enable_gqa=True)`` on a CPU (no ``repeat_kv``
  copies; :data:`NATIVE_GQA_DEVICES`), the key/value write into the draft cache through per-layer views of its
  buffers.

Contract (``tests/test_fused_head.py``): for every input the drafter gives the head (a :class:`model.kv_cache.KVCache`
or a :class:`model.lane_batch.LaneBatch` of several lanes' caches), the output and the keys/values written equal
the lean path's up to float reassociation (the folded residual adds, the fused matmuls' blocking, ``addcmul``):
within 1e-5 in float32 and 1e-12 in float64, and the drafted trees match up to float ties
(``trees_match_up_to_ties``, the tests' tie rule).

Weights never go stale: the fused copies are rebuilt whenever any weight the head reads changes, detected by a
signature of every such parameter's ``(data_ptr, _version)``: an in-place update (an optimizer step, OSD's
``load_head_state`` copy, ``torch.no_grad`` edits) bumps the version, a loaded or moved weight (``load_state_dict``
with ``assign``, ``.to(...)``) has another pointer. Writes through ``param.data`` (which autograd does not version)
are not seen: the project writes ``.data`` only into the embedding and ``lm_head``, which this path reads live, never
copies. Not used (the head runs :func:`model.lean_layer.lean_forward`): with autograd on (training: the fused
copies carry no gradient to the parameters), while ``torch.compile`` traces, on a static-shape cache
(``model.graphs``: a recorded graph or compiled body would keep the fused copies of its recording, which a weight
update could not refresh), for a layer :func:`fusable` refuses, and with ``model.lean_layers=false`` (the reference).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from model.kv_cache import KVCache
from model.lane_batch import LaneBatch
from model.lean_layer import lean_supported

Tensor = torch.Tensor


def fusable(block) -> bool:
    """Whether :class:`FusedHead` computes this :class:`model.layers.LayerBlock`: every layer
    :func:`model.lean_layer.lean_supported`, without Qwen3's per-head query/key norms, with a rotary embedding whose
    angles depend on the position alone (not ``dynamic`` / ``longrope``, which rescale with the sequence length)."""
    rope = getattr(block.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope") or not hasattr(block.rotary_emb, "inv_freq"):
        return False
    return all(lean_supported(layer) and getattr(layer.self_attn, "q_norm", None) is None
               for layer in block.layers)


def _weights(head) -> list[Tensor | None]:
    """Every parameter/buffer the fused forward reads through a copy or a cached view (its signature). Read through
    the modules' own dicts (``nn.Module.__getattr__`` is the slow path; called once per forward)."""
    m = head._modules
    fc = m["fc"]._parameters
    block = m["block"]._modules
    out = [fc["weight"], fc.get("bias"), block["rotary_emb"]._buffers.get("inv_freq")]
    for layer in block["layers"]._modules.values():
        a, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
        for lin in (a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"], mlp["gate_proj"], mlp["up_proj"],
                    mlp["down_proj"]):
            p = lin._parameters
            out += [p.get("weight"), p.get("bias")]
        out.append(layer._modules["post_attention_layernorm"]._parameters["weight"])   # folded into gate/up
    return out


def _signature(head) -> tuple:
    return tuple((t.data_ptr(), t._version) if t is not None else None for t in _weights(head))


class _Layer:
    """One decoder layer's fused weights (copies / views of the layer's parameters at build time)."""

    def __init__(self, layer: nn.Module) -> None:
        a, m = layer.self_attn, layer.mlp
        self.in_norm = None if isinstance(layer.input_layernorm, nn.Identity) else layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.d = a.head_dim
        self.hq = a.q_proj.out_features // self.d
        self.hkv = a.k_proj.out_features // self.d
        self.scale = a.scaling
        self.act = _direct_act(m.act_fn)
        self.eps = self.post_norm.variance_epsilon
        self.groups = self.hq // self.hkv
        self.inter = m.gate_proj.out_features
        self.qkv_sizes, self.gu_sizes = [self.hq, self.hkv, self.hkv], [self.inter, self.inter]
        self.qkv_t = torch.cat([a.q_proj.weight.detach(), a.k_proj.weight.detach(), a.v_proj.weight.detach()]).t()
        self.qkv_b = _fused_bias([a.q_proj, a.k_proj, a.v_proj])
        # the post-attention norm's weight folded into the rows of gate/up (RMSNorm without its last multiply)
        self.gu_t = (torch.cat([m.gate_proj.weight.detach(), m.up_proj.weight.detach()])
                     * self.post_norm.weight.detach()).t()
        self.gu_b = _fused_bias([m.gate_proj, m.up_proj])
        self.o_t, self.o_b = a.o_proj.weight.detach().t(), _bias(a.o_proj)
        self.down_t, self.down_b = m.down_proj.weight.detach().t(), _bias(m.down_proj)


class _Dead:
    """Stands for the head of a copied :class:`FusedHead` (which its copy's head replaces at first use)."""


def _bias(lin: nn.Linear) -> Tensor | None:
    return None if lin.bias is None else lin.bias.detach()


def _fused_bias(lins: list[nn.Linear]) -> Tensor | None:
    """The concatenated biases of ``lins`` (zeros for one without: Qwen2's q/k/v have biases, o has none)."""
    if all(lin.bias is None for lin in lins):
        return None
    w = lins[0].weight
    return torch.cat([lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.out_features) for lin in lins])


def _direct_act(act):
    """The activation module's own C function where it is SiLU (transformers' ``SiLUActivation`` and a non-inplace
    ``nn.SiLU`` both return ``F.silu(x)``, i.e. ``torch._C._nn.silu(x)``: bitwise the same), without the module call
    and ``F.silu``'s wrapper per forward (issue 41: host time around the operators); any other activation as it is."""
    if (type(act).__name__ == "SiLUActivation" and type(act).forward.__module__.startswith("transformers")) or \
            (type(act) is nn.SiLU and not act.inplace):
        return torch._C._nn.silu
    return act


def _rms(norm: nn.Module, x: Tensor) -> Tensor:
    """transformers' ``LlamaRMSNorm`` (the lean layer's ``_rms_norm``): statistics in float32, the weight after the
    cast back (bitwise the same operations)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rms_unweighted(norm: nn.Module, x: Tensor, eps: float | None = None) -> Tensor:
    """:func:`_rms` without the weight's multiply (folded into the next matmul's weights: ``(w * y) @ W = y @ (w[:,
    None] * W)``, equal up to float rounding): one operator fewer.

    On a CPU, ``F.rms_norm`` without a weight: torch decomposes it into exactly these operators (``pow``, ``mean``,
    ``add_``, ``rsqrt``, ``mul``: bitwise the same result, the same count) from ONE Python call instead of five
    (issue 41, the commit's host time). Elsewhere the explicit form (CUDA may run a fused kernel with another
    reduction order: the drafted trees would change)."""
    dtype = x.dtype
    eps = norm.variance_epsilon if eps is None else eps
    f32 = dtype == torch.float32                          # (no .to call when it would return its input: host time)
    h = x if f32 else x.to(torch.float32)
    if h.device.type == "cpu":                            # (torch.rms_norm: F.rms_norm's body without its wrapper)
        y = torch.rms_norm(h, (h.shape[-1],), None, eps)
    else:
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return y if f32 else y.to(dtype)


def _linear_res(x: Tensor, w_t: Tensor, b: Tensor | None, res: Tensor) -> Tensor:
    """``res + x @ w_t (+ b)``: one ``addmm`` with the residual as its input where there is no bias."""
    if b is None:
        return torch.addmm(res, x, w_t)
    return res + torch.addmm(b, x, w_t)


# Devices whose scaled_dot_product_attention runs grouped-query attention (``enable_gqa``) in its fused kernel with an
# explicit mask: the CPU's flash kernel does. On CUDA (torch 2.13's documentation) only the flash kernel, which takes
# no mask, and the math fallback do: there the key/value heads are repeated (as the lean layer does) so the
# memory-efficient kernel runs.
NATIVE_GQA_DEVICES = ("cpu",)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """``[b, kv, s, d]`` -> ``[b, kv * groups, s, d]``: kv head ``j`` serves query heads ``j * groups ..``."""
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def _attention(groups: int, native: bool, scale: float, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """One layer's attention: grouped-query in the kernel where ``native`` (:data:`NATIVE_GQA_DEVICES`), else the
    key/value heads repeated first."""
    if groups > 1 and not native:
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=native)


def _capacity(cache) -> int | None:
    """The highest position + 1 a forward on ``cache`` may use (its slots), or None for a cache this path skips."""
    if type(cache) is KVCache:
        return cache.max_len
    if isinstance(cache, LaneBatch) and all(type(c) is KVCache for c in cache.caches):
        return max(c.max_len for c in cache.caches)
    return None


def rows_from_layer(layers: int) -> int:
    """The layer from which a forward given ``rows`` runs those rows alone (:meth:`FusedHead.__call__`): the last.
    Every earlier layer's output rows are the next layer's keys and values, which every row needs."""
    return layers - 1


class FusedHead:
    """The fused forward of one :class:`draft.eagle.EagleHead` (``head.fused_head``): ``fused(tokens, features,
    positions, mask, cache)`` -> what ``head.compute`` returns on the lean path, or None where this path does not
    apply (the caller runs the lean path; see the module docstring)."""

    def __init__(self, head) -> None:
        self._head = weakref.ref(head)      # the head holds this object: no cycle
        self._sig = None
        self._ok = False
        self._layers: list[_Layer] = []
        self._fc_t = self._fc_b = None
        self._rope: Tensor | None = None   # [positions, 2, 1, head_dim]: cos, then sin with its first half negated
        self._rope_key = None
        self._views = weakref.WeakKeyDictionary()   # KVCache -> (keys ptr, [(keys[i], values[i]) per layer])
        self.rebuilds = 0

    def __getstate__(self) -> dict:        # a copied / pickled head builds its own (nothing stale crosses over)
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__(_Dead())

    def _refresh(self, head) -> bool:
        try:
            sig = _signature(head)
        except (KeyError, AttributeError):                 # not the layout the fused path reads
            return False
        if sig != self._sig:
            self._sig = sig
            self._ok = fusable(head.block)
            if self._ok:
                self._layers = [_Layer(layer) for layer in head.block.layers]
                self._fc_t, self._fc_b = head.fc.weight.detach().t(), _bias(head.fc)
                self.rebuilds += 1
            else:
                self._layers = []
            self._rope = None
        return self._ok

    def _rope_table(self, head, length: int, dtype: torch.dtype, device) -> Tensor:
        key = (dtype, device)
        if self._rope is None or self._rope_key != key or self._rope.shape[0] < length:
            rot = head.block.rotary_emb
            n = max(length, 2 * self._rope.shape[0] if self._rope is not None and self._rope_key == key else 0, 64)
            with torch.no_grad():
                cos, sin = rot(torch.zeros(1, 1, dtype=dtype, device=device),
                               torch.arange(n, device=device)[None])          # the layer's own angles, per position
            cos, sin = cos[0], sin[0]
            half = sin.shape[-1] // 2
            sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)       # rotate_half's sign moved into the table
            self._rope = torch.stack([cos, sin], dim=1)[:, :, None].contiguous()
            self._rope_key = key
        return self._rope

    def _kv(self, cache: KVCache) -> list[tuple[Tensor, Tensor]]:
        got = self._views.get(cache)
        if got is None or got[0] != cache.keys.data_ptr():
            got = (cache.keys.data_ptr(), [(cache.keys[i], cache.values[i]) for i in range(cache.keys.shape[0])])
            self._views[cache] = got
        return got[1]

    def __call__(self, tokens: Tensor, features: Tensor, positions: Tensor, mask: Tensor | None,
                 cache, rows: Tensor | None = None) -> Tensor | None:
        """``rows`` (a long tensor of row indices, or None for all): the rows whose outputs are returned, in that
        order (:meth:`draft.eagle.EagleHead.compute`'s ``rows``); every row still writes its keys and values. In the
        last layer only these rows' queries attend and only they run the output projection and the MLP: a row's
        keys and values depend on its own input alone, and every later operator is row-wise, so the kept rows'
        outputs are those of the whole forward (up to float reassociation of the smaller matmuls)."""
        head = self._head()
        cap = _capacity(cache)
        if head is None or cap is None or torch.is_grad_enabled() or torch.compiler.is_compiling() \
                or not self._refresh(head):
            return None
        n = tokens.shape[-1]
        dtype, dev = features.dtype, features.device
        # [1, n] tokens and [1, n, H] features as they come: the embedding and the concatenation on 3-D rows, one
        # view to 2-D for fc (no reshape of each input first)
        e = torch.embedding(head.embed_tokens.weight, tokens).to(dtype)      # F.embedding's own op, no wrapper
        x = torch.cat([e, features], dim=-1).view(n, -1)
        h = torch.mm(x, self._fc_t) if self._fc_b is None else torch.addmm(self._fc_b, x, self._fc_t)
        cos, sin = self._rope_table(head, cap, dtype, dev)[positions.to(dev)].unbind(2)   # [1, n, 1, d] each
        lanes = isinstance(cache, LaneBatch)
        if lanes:
            cache.to(dev, dtype)
        else:
            mask = mask.to(device=dev, dtype=dtype)
            length = cache.length
            kv = self._kv(cache)
        native_dev = dev.type in NATIVE_GQA_DEVICES
        last = rows_from_layer(len(self._layers))
        for i, ly in enumerate(self._layers):
            d, hq, hkv, groups = ly.d, ly.hq, ly.hkv, ly.groups
            x = h if ly.in_norm is None else _rms(ly.in_norm, h)
            qkv = torch.mm(x, ly.qkv_t) if ly.qkv_b is None else torch.addmm(ly.qkv_b, x, ly.qkv_t)
            qkv = qkv.view(1, n, hq + 2 * hkv, d)
            qk = qkv[:, :, :hq + hkv]
            torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin, out=qk)          # rotary on q and k at once, in place
            q, k, v = qkv.transpose(1, 2).split_with_sizes(ly.qkv_sizes, dim=1)   # (not Tensor.split's wrapper)
            native = groups > 1 and native_dev
            m = n
            if lanes:
                o = cache.attend(q, k, v, i, functools.partial(_attention, groups, native, ly.scale))
            else:
                kl, vl = kv[i]
                end = length + n
                kl[:, :, length:end] = k
                vl[:, :, length:end] = v
                if rows is not None and i == last:       # only the wanted rows from here on (docstring: why)
                    q, mask, h, m = q[:, :, rows], mask[:, :, rows], h[rows], rows.numel()
                o = _attention(groups, native, ly.scale, q, kl[:, :, :end], vl[:, :, :end], mask)
            h = _linear_res(o.transpose(1, 2).reshape(m, hq * d), ly.o_t, ly.o_b, h)
            x = _rms_unweighted(ly.post_norm, h, ly.eps)                         # its weight is in gu_t
            gu = torch.mm(x, ly.gu_t) if ly.gu_b is None else torch.addmm(ly.gu_b, x, ly.gu_t)
            g, u = gu.split_with_sizes(ly.gu_sizes, dim=1)
            h = _linear_res(ly.act(g) * u, ly.down_t, ly.down_b, h)
        if rows is not None and lanes:                   # (several lanes' rows: all rows ran)
            h = h[rows]
        return h.view(1, h.shape[0], -1)
