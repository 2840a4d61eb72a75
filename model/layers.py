"""Run a family's decoder layers on our :class:`~model.kv_cache.KVCache`.

One code path serves Llama, Mistral, Qwen2 and Qwen3 layouts. A block is built from :mod:`model.light`'s modules
(transformers' parameter names and math, no transformers import) wherever :func:`model.light.light_ok` accepts the
config, else from the transformers classes :func:`family_classes` looks up from the config's ``model_type``; the
transformers reference path (``model.lean_layers=false``, quantized projections) swaps in the transformers layers
holding the same parameters (:func:`model.light.to_reference`).
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

from model import light
from model.hf_compat import cache_arg
from model.kv_cache import KVCache
from model.lane_batch import LaneBatch
from config.errors import UserError
from model.lean_layer import lean_forward, lean_supported
from model.stage_format import SUPPORTED_FAMILIES


class UnsupportedModel(UserError, ValueError):
    """A config whose ``model_type`` is not one of :data:`model.stage_format.SUPPORTED_FAMILIES` (one line)."""


def family_classes(config) -> tuple[type, type, type]:
    """``(DecoderLayer, RotaryEmbedding, RMSNorm)`` classes for the config's model family."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_FAMILIES:
        raise UnsupportedModel(f"unsupported architecture model_type={mt!r}; supported: "
                               f"{', '.join(SUPPORTED_FAMILIES)}")
    prefix = SUPPORTED_FAMILIES[mt]
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    return (getattr(mod, f"{prefix}DecoderLayer"), getattr(mod, f"{prefix}RotaryEmbedding"),
            getattr(mod, f"{prefix}RMSNorm"))


def block_classes(config) -> tuple[type, type, type]:
    """``(DecoderLayer, RotaryEmbedding, RMSNorm)`` a stage or head block is built from: :mod:`model.light`'s where
    :func:`model.light.light_ok` accepts ``config`` (no transformers import), else :func:`family_classes`."""
    mt = getattr(config, "model_type", None)
    if mt in SUPPORTED_FAMILIES and light.light_ok(config):
        return light.DecoderLayer, light.RotaryEmbedding, light.RMSNorm
    return family_classes(config)


class LayerBlock(nn.Module):
    """A contiguous block of decoder layers (renumbered from 0) plus the rotary embedding.

    ``forward`` appends the rows' keys/values to ``cache`` at ``cache.length``; the caller advances the
    cache afterwards (``KVCache.commit_forward``). With ``taps`` (block-local layer indices) it also appends
    those layers' outputs to ``tapped`` (EAGLE-3 features, see :meth:`model.stage_model.StageModel.set_taps`).

    ``lean`` (default: on wherever :func:`model.lean_layer.lean_supported` holds for every layer): each layer runs
    as :func:`model.lean_layer.lean_forward` on the same weights, a fraction of the transformers layer's operator
    dispatches; off, the transformers layers' own forward (the reference; run key ``model.lean_layers=false``,
    :func:`set_lean`).

    ``cache`` may be a :class:`model.lane_batch.LaneBatch` (several lanes' rows in one forward, ``mask`` None):
    the lean path attends lane by lane, the transformers path over its block-diagonal mask.
    """

    def __init__(self, config, num_layers: int, skip_first_input_norm: bool = False) -> None:
        super().__init__()
        layer_cls, rotary_cls, _ = block_classes(config)
        config._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
        self.config = config
        self.layers = nn.ModuleList(layer_cls(config, layer_idx=i) for i in range(num_layers))
        if skip_first_input_norm and num_layers:
            self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1/2 heads have none on layer 0
        self.rotary_emb = rotary_cls(config=config)
        cfg = config
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.lean_ok = all(lean_supported(layer) for layer in self.layers)
        self.lean = self.lean_ok
        self.cache_arg = None
        if not self.lean:
            self.use_reference_layers()

    def refresh_lean(self) -> None:
        """Re-check :func:`model.lean_layer.lean_supported` after the layers' modules were replaced (e.g. by
        quantized linears); a block that no longer qualifies falls back to the transformers path."""
        self.lean_ok = all(lean_supported(layer) for layer in self.layers)
        self.lean = self.lean and self.lean_ok
        if not self.lean:
            self.use_reference_layers()

    def use_reference_layers(self) -> None:
        """Make every layer a transformers layer (the non-lean path calls their forward): :mod:`model.light`
        layers become the family's transformers layers holding the same parameters and projection modules
        (:func:`model.light.to_reference`; imports transformers). Idempotent."""
        if any(isinstance(layer, light.DecoderLayer) for layer in self.layers):
            cfg = self.config.to_hf() if isinstance(self.config, light.LightConfig) else self.config
            layer_cls, _, norm_cls = family_classes(cfg)
            for i, layer in enumerate(self.layers):
                if isinstance(layer, light.DecoderLayer):
                    self.layers[i] = light.to_reference(layer, cfg, layer_cls, norm_cls)
        if self.cache_arg is None and len(self.layers):
            self.cache_arg = cache_arg(type(self.layers[0]))    # the release's name of the KV-cache argument

    def new_cache(self, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(len(self.layers), self.num_kv_heads, self.head_dim, max_len, dtype, device)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache, taps=(), tapped: list | None = None) -> torch.Tensor:
        positions = positions.to(hidden.device)
        if isinstance(cache, LaneBatch):    # several lanes' rows: attention per lane (model/lane_batch.py)
            cache.to(hidden.device, hidden.dtype)
            mask = None if self.lean else cache.joint_mask()
        else:
            mask = mask.to(device=hidden.device, dtype=hidden.dtype)
        pos_emb = self.rotary_emb(hidden, positions)
        if self.lean:
            cos, sin = pos_emb
            for i, layer in enumerate(self.layers):
                hidden = lean_forward(layer, hidden, cos, sin, mask, cache, i)
                if i in taps:
                    tapped.append(hidden)
            return hidden
        self.use_reference_layers()     # no-op unless a caller turned ``lean`` off by hand
        cache_kw = {self.cache_arg: cache}
        for i, layer in enumerate(self.layers):
            out = layer(hidden, attention_mask=mask, position_ids=positions, use_cache=True,
                        position_embeddings=pos_emb, **cache_kw)
            hidden = out[0] if isinstance(out, tuple) else out
            if i in taps:
                tapped.append(hidden)
        return hidden


def set_lean(module: nn.Module, on: bool) -> int:
    """Turn the lean layer path on or off in every :class:`LayerBlock` inside ``module`` (a stage model, a draft
    head, a drafter's head); a block whose layers it cannot run stays on the transformers path. Returns how many
    blocks run lean."""
    n = 0
    for m in module.modules():
        if isinstance(m, LayerBlock):
            m.refresh_lean()
            m.lean = bool(on) and m.lean_ok
            if not m.lean:
                m.use_reference_layers()
            n += m.lean
    return n
