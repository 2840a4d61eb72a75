"""The decoder layer's forward without the framework around it: the same modules' weights, the same math, a
fraction of the operator dispatches.

Why: at batch 1 a pipeline stage and rank 0's draft head are dispatch-bound on a GPU (and on a CPU with a small
model): a transformers 5 Llama decoder layer called from :class:`model.layers.LayerBlock` issues about 210 aten
operators per call (kwarg plumbing, the attention-interface registry, GQA packing decisions, deprecation
wrappers, ``nn.Module.__call__`` hooks on every Linear), of which a few dozen launch kernels. The first GPU
run (docs/gpu_h200) found rank 0's drafting launch-bound (30-40 ms per round start against a 5 ms stage step).
:func:`lean_forward` runs one layer of the supported families (Llama, Mistral, Qwen2, Qwen3: one code path, the
differences are biases, which ``F.linear`` takes as ``None`` or a tensor, Qwen3's per-head query/key RMSNorms and
a ``head_dim`` other than hidden/heads, read from the attention module) as the plain sequence of kernels. Rotary
scaling (Llama-3's ``llama3`` type and the others) lives in the family's rotary embedding, which computes the
``(cos, sin)`` passed in.

Contract (tested against the transformers layer in ``tests/test_lean_layer.py``): for every input the module
path accepts in this project -- ``hidden [1, n, H]``, the rotary ``(cos, sin)``, an explicit additive mask
``[1, 1, n, length + n]`` and a :class:`model.kv_cache.KVCache` -- it returns the transformers layer's output up
to floating-point reassociation (the same operations in the same order, except that grouped-query attention
always repeats the key/value heads instead of transformers' single-query packing), and it writes the same keys
and values into the cache. It supports autograd, batches and autocast (the heads' trainer runs it too). Layers it
cannot run (:func:`lean_supported` false: another attention layout, other query/key norms, an attention backend other
than sdpa, quantized projections) keep the transformers path. Sliding windows are applied by neither path: the
project passes its own masks, and transformers' sdpa backend ignores the window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """transformers' ``LlamaRMSNorm`` (also Mistral's and Qwen2's): statistics in float32, weight after the cast
    back; ``nn.Identity`` (an EAGLE head's first layer has no input norm) passes through."""
    if isinstance(norm, nn.Identity):
        return x
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """transformers' ``repeat_kv``: ``[b, kv, s, d]`` -> ``[b, kv * groups, s, d]``, kv head ``j`` serving query
    heads ``j * groups .. (j + 1) * groups - 1``."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def _has_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Plain ``nn.Linear`` modules only: a subclass (bitsandbytes' quantized linears) keeps its own forward."""
    return all(type(getattr(module, n, None)) is nn.Linear for n in names)


def lean_supported(layer: nn.Module) -> bool:
    """Whether :func:`lean_forward` computes this decoder layer: a pre-norm block whose attention has separate
    q/k/v/o projections (biases allowed, any ``head_dim``), rotary positions and no extra norms but Qwen3's, whose MLP is gated (``down(act(gate) * up)``), and
    whose norms are RMSNorms with ``variance_epsilon`` (or an ``nn.Identity`` input norm; Qwen3's per-head
    ``q_norm``/``k_norm`` too, applied before the rotation), on the sdpa attention
    backend (the one the project sets: others may apply sliding windows). Every projection must be a plain
    ``nn.Linear``: quantized ones (``model.quant``) keep the transformers path. Any ``act_fn`` is fine."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    if not _has_linears(attn, ("q_proj", "k_proj", "v_proj", "o_proj")) or not _has_linears(
            mlp, ("gate_proj", "up_proj", "down_proj")):
        return False
    qk = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    if any(n is not None for n in qk) and not all(_is_rms(n) for n in qk):   # Qwen3: both, RMSNorms over head_dim
        return False
    if not callable(getattr(mlp, "act_fn", None)):
        return False
    if not all(hasattr(attn, n) for n in ("head_dim", "num_key_value_groups", "scaling")):
        return False
    if getattr(getattr(attn, "config", None), "_attn_implementation", "sdpa") != "sdpa":
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return all(isinstance(n, nn.Identity) or _is_rms(n) for n in norms) and not isinstance(norms[1], nn.Identity)


def _is_rms(norm) -> bool:
    return hasattr(norm, "variance_epsilon") and isinstance(getattr(norm, "weight", None), torch.Tensor)


def _attention(attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """The layer's attention over cached keys/values ``k``, ``v`` (grouped-query heads repeated)."""
    k, v = _repeat_kv(k, attn.num_key_value_groups), _repeat_kv(v, attn.num_key_value_groups)
    dropout = getattr(attn, "attention_dropout", 0.0) if attn.training else 0.0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=attn.scaling)


def lean_forward(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache,
                 layer_idx: int) -> Tensor:
    """One decoder layer: ``hidden [1, n, H]`` -> ``[1, n, H]``; appends this layer's keys/values for the ``n``
    rows to ``cache`` (``cache.update``, which returns every cached slot up to the new rows). ``mask`` is the
    additive attention mask over those slots (``[1, 1, n, length + n]``, the layer's dtype). A cache with an
    ``attend`` method (:class:`model.lane_batch.LaneBatch`: several lanes' rows, ``mask`` None) does the attention
    itself, lane by lane; everything else runs once over all rows."""
    attn, mlp = layer.self_attn, layer.mlp
    b, n, _ = hidden.shape
    d = attn.head_dim
    x = _rms_norm(layer.input_layernorm, hidden)
    q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, n, -1, d)
    k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, n, -1, d)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:               # Qwen3: RMSNorm of every head's query and key before the rotation
        q, k = _rms_norm(q_norm, q), _rms_norm(attn.k_norm, k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, n, -1, d).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    attend = getattr(cache, "attend", None)
    if attend is None:
        k, v = cache.update(k, v, layer_idx)
        o = _attention(attn, q, k, v, mask)
    else:       # several lanes' rows (model.lane_batch.LaneBatch): each lane attends over its own cache
        o = attend(q, k, v, layer_idx, lambda q_, k_, v_, m: _attention(attn, q_, k_, v_, m))
    o = o.transpose(1, 2).reshape(b, n, -1)
    hidden = hidden + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
    x = _rms_norm(layer.post_attention_layernorm, hidden)
    x = mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)) * F.linear(x, mlp.up_proj.weight,
                                                                                   mlp.up_proj.bias)
    return hidden + F.linear(x, mlp.down_proj.weight, mlp.down_proj.bias)
