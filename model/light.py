"""The supported families' decoder layer, RMSNorm and rotary embedding, and their config, without transformers.

Why: importing a transformers model module costs about 1.5 s of CPU on every process start (``modeling_llama``
pulls ``modeling_utils``, ``core_model_loading`` and ``torch.distributed.tensor``; ``configuration_llama`` the
activations and hub kernels), more than loading and running a small split (docs/results.md, "The API example
under 5 s"). The pipeline runs its layers through :func:`model.lean_layer.lean_forward`, which needs the
layers' *weights and attributes*, not transformers' forward; so a stage is built from these modules, transformers
being imported only where its own code runs: the reference path (``model.lean_layers=false``), quantized
projections, an EAGLE-3 head, a tensor-parallel shard, a rope type or activation these modules do not implement
(:func:`light_ok` false).

Contract (``tests/test_light.py``): for every config :func:`light_ok` accepts,

* :class:`DecoderLayer` has transformers' parameter names, shapes, biases and parameter order (Llama, Mistral,
  Qwen2, Qwen3), so state dicts load unchanged and a seeded random init draws the same numbers;
* :class:`RotaryEmbedding` returns transformers' ``(cos, sin)`` bit for bit (rope types ``default``, ``linear``,
  ``llama3``), :class:`RMSNorm` transformers' RMSNorm;
* :func:`to_reference` turns a layer into the transformers layer holding the same parameter (and module) objects;
* :class:`LightConfig` reads a ``config.json`` that transformers 5 wrote (``rope_parameters``); anything else
  (a legacy ``rope_scaling``, an unknown rope type) is left to ``AutoConfig`` by the caller.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.lean_layer import lean_forward
from model.stage_format import SUPPORTED_FAMILIES

ROPE_TYPES = ("default", "linear", "llama3")     # computed here; others (dynamic, yarn, longrope...) by transformers
ACTIVATIONS = ("silu", "swish")


class LightConfig:
    """A model config read from its ``config.json`` as plain attributes (what the project reads of a
    transformers config: ``hidden_size``, ``rope_parameters``, the stage fields ...), with transformers'
    ``to_dict`` / ``from_dict``. :meth:`to_hf` builds the transformers config of the same dict when transformers'
    own modules are needed."""

    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)
        kv = self.__dict__.get("num_key_value_heads")
        if kv is None and "num_attention_heads" in d:      # transformers' default: multi-head attention
            self.num_key_value_heads = d["num_attention_heads"]
        self.__dict__.setdefault("_attn_implementation", "sdpa")

    @classmethod
    def from_dict(cls, d: dict) -> "LightConfig":
        return cls(dict(d))

    @classmethod
    def from_json_file(cls, path: str | Path) -> "LightConfig":
        return cls(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def to_hf(self):
        """The transformers config of this dict (imports transformers)."""
        from transformers import AutoConfig
        d = self.to_dict()
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        cfg._attn_implementation = self._attn_implementation
        return cfg

    def __repr__(self) -> str:
        return f"LightConfig({self.to_dict()})"


def hf_config(config):
    """``config`` as a transformers config (a :class:`LightConfig` converted; imports transformers): for modules
    that run transformers' own code (an EAGLE-3 head's attention, a TP shard)."""
    return config.to_hf() if isinstance(config, LightConfig) else config


def light_ok(config) -> bool:
    """Whether these modules compute ``config``'s layers (a transformers config or a :class:`LightConfig`): a
    supported family, a SiLU MLP, the sdpa backend (or none chosen yet) and a rope type in :data:`ROPE_TYPES`
    with its parameters given as transformers 5 standardises them (one flat ``rope_parameters`` dict, no partial
    rotation)."""
    if getattr(config, "model_type", None) not in SUPPORTED_FAMILIES:
        return False
    if getattr(config, "hidden_act", "silu") not in ACTIVATIONS:
        return False
    if getattr(config, "_attn_implementation", None) not in (None, "sdpa"):
        return False
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) not in ROPE_TYPES:
        return False
    if not isinstance(rope.get("rope_theta"), (int, float)) or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return False
    if rope.get("rope_type") == "linear" and "factor" not in rope:
        return False
    if rope.get("rope_type") == "llama3" and not all(k in rope for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")):
        return False
    return True


def read_config(path: str | Path):
    """A ``config.json`` as a :class:`LightConfig` when :func:`light_ok` accepts it, else transformers'
    ``AutoConfig`` of its folder (imports transformers)."""
    path = Path(path)
    cfg = LightConfig.from_json_file(path)
    if light_ok(cfg):
        return cfg
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path.parent)


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; on the meta device without its random init, whose meta ``normal_`` goes through
    torch's Python reference kernels and imports ``torch._dynamo`` (about 1 s of CPU at every load that builds a
    module on meta before reading its weights, docs/results.md, "The API example under 5 s")."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm`` (Mistral's, Qwen2's and Qwen3's are the same): statistics in float32, the
    weight applied after the cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def rope_inv_freq(config) -> torch.Tensor:
    """The inverse frequencies of ``config``'s rope type, as transformers' ``compute_default_rope_parameters`` /
    ``ROPE_INIT_FUNCTIONS[type]`` compute them (``default``; ``linear``: divided by ``factor``; ``llama3``: low
    frequencies divided by ``factor``, a smooth interpolation between ``low_freq_factor`` and
    ``high_freq_factor`` wavelengths). Computed on the CPU even under a meta default device (a module built on
    meta: the meta ``pow`` goes through torch's Python reference kernels, which import ``torch._dynamo``)."""
    rope = config.rope_parameters
    kind = rope.get("rope_type", rope.get("type", "default"))
    dim = head_dim_of(config)
    base = rope["rope_theta"]
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim))
    factor = rope["factor"]
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} is not computed here (light_ok is false for it)")
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """transformers' rotary embedding of the supported families for the rope types in :data:`ROPE_TYPES` (none of
    them rescales with the positions, so there is no dynamic update): ``(x, position_ids) -> (cos, sin)`` in
    ``x``'s dtype."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = getattr(config, "max_position_embeddings", None)
        self.rope_type = config.rope_parameters.get("rope_type", config.rope_parameters.get("type", "default"))
        inv_freq = rope_inv_freq(config)
        self.attention_scaling = 1.0        # every type computed here leaves cos/sin unscaled
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _biases(config) -> tuple[bool, bool, bool]:
    """``(q/k/v bias, o bias, MLP bias)`` of the family, as its transformers modules set them."""
    mt = config.model_type
    if mt == "qwen2":
        return True, False, False
    if mt == "mistral":
        return False, False, False
    attn = bool(getattr(config, "attention_bias", False))
    return attn, attn, bool(getattr(config, "mlp_bias", False)) if mt == "llama" else False


class Attention(nn.Module):
    """The attention module's weights and the attributes :func:`model.lean_layer.lean_forward` reads."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = getattr(config, "attention_dropout", 0.0)
        self.is_causal = True
        qkv_bias, o_bias, _ = _biases(config)
        h, q, kv = config.hidden_size, config.num_attention_heads * self.head_dim, \
            config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(h, q, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=o_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = _biases(config)[2]
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _NoCache:
    """A cache-free call's keys/values: the rows themselves."""

    @staticmethod
    def update(k, v, layer_idx):
        return k, v


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer with transformers' module tree (``self_attn``, ``mlp``, ``input_layernorm``,
    ``post_attention_layernorm``). :class:`model.layers.LayerBlock` runs it through
    :func:`model.lean_layer.lean_forward`; calling it directly is transformers' cache-free call (the heads'
    trainer, ``draft.train.objective.head_forward``): ``attention_mask`` None means causal, as transformers' sdpa
    path makes it."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids=None, use_cache: bool = False, position_embeddings=None, **kwargs) -> torch.Tensor:
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None:
            raise ValueError("model.light.DecoderLayer is called cache-free only; a stage runs it through lean_forward")
        n = hidden_states.shape[1]
        mask = attention_mask
        if mask is None and n > 1:
            mask = torch.ones(n, n, dtype=torch.bool, device=hidden_states.device).tril()
        cos, sin = position_embeddings
        return lean_forward(self, hidden_states, cos, sin, mask, _NoCache(), self.self_attn.layer_idx)


def to_reference(layer: DecoderLayer, config, layer_cls: type, norm_cls: type):
    """The transformers decoder layer ``layer_cls(config)`` (the family's, from
    :func:`model.layers.family_classes`) holding ``layer``'s own parameters and projection modules (quantized ones
    included): the reference path, and the path for modules ``lean_forward`` cannot run. Norms become the family's
    RMSNorm class ``norm_cls`` on the same weight parameter."""
    with torch.device("meta"):
        ref = layer_cls(config, layer_idx=layer.self_attn.layer_idx)

    def moved(child):
        if isinstance(child, RMSNorm):
            with torch.device("meta"):
                norm = norm_cls(child.weight.shape[0], eps=child.variance_epsilon)
            norm.weight = child.weight
            return norm
        return child

    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        if name in layer.self_attn._modules:
            setattr(ref.self_attn, name, moved(layer.self_attn._modules[name]))
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(ref.mlp, name, layer.mlp._modules[name])
    ref.input_layernorm = moved(layer.input_layernorm)
    ref.post_attention_layernorm = moved(layer.post_attention_layernorm)
    left = [n for n, t in list(ref.named_parameters()) + list(ref.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"to_reference left {left[:3]} unset")
    return ref.train(layer.training)
