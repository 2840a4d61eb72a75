"""EAGLE-1/2 draft head: ``fc([embed(token) ; feature])`` -> one decoder layer -> predicted feature.

Checkpoint format (as published by EAGLE): ``config.json`` (a Llama-style config with
``num_hidden_layers = 1`` and optional ``bias``) plus ``model.safetensors`` or ``pytorch_model.bin`` with
keys ``fc.weight``, optional ``fc.bias``, ``layers.0.*`` (no ``input_layernorm`` on layer 0) and an
optional ``embed_tokens.weight`` (taken from the target when absent). The head has no ``lm_head``: the
target's ``lm_head`` (held by rank 0) turns predicted features into logits.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig

from draft.head_io import (HeadError, head_config_from_target, init_head_weights, is_eagle3_config,
                           read_head_config, read_head_weights)
from model.layers import LayerBlock
from model.meter import NULL_METER, OpMeter, cache_length


class EagleHead(nn.Module):
    meter: OpMeter = NULL_METER   # instrumentation sees each forward as a draft_forward op (model.meter)

    def __init__(self, config, bias: bool = True) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.block = LayerBlock(config, 1, skip_first_input_norm=True)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache) -> torch.Tensor:
        """``tokens [1, n]`` paired with the feature of the *previous* position ``features [1, n, H]``. Metered as
        a ``draft_forward`` op over the cache's entries (:mod:`model.meter`)."""
        with self.meter.op("draft_forward", int(tokens.shape[-1]), cache_length(cache)):
            x = self.fc(torch.cat([self.embed_tokens(tokens).to(features.dtype), features], dim=-1))
            return self.block(x, positions, mask, cache)

    # -- checkpoint I/O (EAGLE layout) -----------------------------------------------------------
    def eagle_state_dict(self, with_embeddings: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("block.rotary_emb"):
                continue
            if k.startswith("embed_tokens") and not with_embeddings:
                continue
            out[k[len("block."):] if k.startswith("block.") else k] = v.detach().contiguous()
        return out


def init_untrained_head(target_config, seed: int = 0, bias: bool = True) -> EagleHead:
    """A randomly initialised head (acceptance near zero; output stays exact)."""
    g = torch.manual_seed(seed)
    head = EagleHead(head_config_from_target(target_config, bias))
    return init_head_weights(head, getattr(target_config, "initializer_range", 0.02), g)


def save_eagle_head(head: EagleHead, out_dir: str | Path, extra_config: dict | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_dict()
    cfg.update(num_hidden_layers=1, bias=head.fc.bias is not None, architectures=["LlamaForCausalLM"])
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    cfg.update(extra_config or {})
    cfg.pop("_attn_implementation_autoset", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    state = head.eagle_state_dict()
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_eagle_head(head_dir: str | Path, target_config, target_embed: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a published EAGLE-1/2 head and check it fits the target (hidden size, vocabulary).

    Any head directory, EAGLE-3 included, loads through :func:`draft.load_head.load_draft_head`.
    """
    head_dir = Path(head_dir)
    if not (head_dir / "config.json").is_file():
        raise HeadError(f"draft head directory {head_dir} has no config.json")
    if is_eagle3_config(read_head_config(head_dir)):
        raise HeadError(f"{head_dir} is an EAGLE-3 head: load it with draft.load_head.load_draft_head")
    try:
        cfg = AutoConfig.from_pretrained(head_dir)
    except Exception as e:
        raise HeadError(f"cannot read {head_dir / 'config.json'}: {e}") from None
    if cfg.hidden_size != target_config.hidden_size:
        raise HeadError(f"draft head {head_dir} has hidden_size {cfg.hidden_size} but the target has "
                        f"{target_config.hidden_size}: it was trained for another model")
    if cfg.vocab_size != target_config.vocab_size:
        raise HeadError(f"draft head {head_dir} has vocab_size {cfg.vocab_size} but the target has "
                        f"{target_config.vocab_size}: it was trained for another model")
    if getattr(cfg, "num_hidden_layers", 1) != 1:
        raise HeadError(f"{head_dir}: only one-layer EAGLE-1/2 heads are supported")
    state = read_head_weights(head_dir)
    if any(k.startswith("midlayer.") for k in state):
        raise HeadError(f"{head_dir} has EAGLE-3 weights (midlayer.*) but its config.json lacks draft_vocab_size")
    state = {k: v for k, v in state.items() if k != "layers.0.input_layernorm.weight"}
    cfg._attn_implementation = "sdpa"
    head = EagleHead(cfg, bias="fc.bias" in state)
    mapped = {("block." + k if k.startswith("layers.") else k): v for k, v in state.items()}
    if "embed_tokens.weight" not in mapped:
        if target_embed is None:
            raise HeadError(f"{head_dir} has no embed_tokens and no target embedding was given")
        mapped["embed_tokens.weight"] = target_embed
    own = {k for k in head.state_dict() if not k.startswith("block.rotary_emb")}
    missing, unexpected = sorted(own - set(mapped)), sorted(set(mapped) - own)
    if missing or unexpected:
        raise HeadError(f"draft head {head_dir} does not have the EAGLE-1/2 layout: missing {missing[:4]}, "
                        f"unexpected {unexpected[:4]}")
    head.load_state_dict(mapped, strict=False)
    return head.to(device=device, dtype=dtype).eval()
