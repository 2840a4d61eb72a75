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
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from model.layers import LayerBlock


class HeadError(ValueError):
    """A draft head that is missing, unreadable or does not fit the target."""


class EagleHead(nn.Module):
    def __init__(self, config, bias: bool = True) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.block = LayerBlock(config, 1, skip_first_input_norm=True)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache) -> torch.Tensor:
        """``tokens [1, n]`` paired with the feature of the *previous* position ``features [1, n, H]``."""
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


def head_config_from_target(target_config, bias: bool = True):
    """A head config derived from the target's: same widths, one layer."""
    d = target_config.to_dict()
    for key in ("stage_index", "num_stages", "split", "layer_range", "has_embedding", "has_lm_head",
                "has_final_norm", "quantization_config", "source_model"):
        d.pop(key, None)
    d.update(num_hidden_layers=1, bias=bias, architectures=["LlamaForCausalLM"])
    cfg = type(target_config).from_dict(d)
    cfg._attn_implementation = "sdpa"
    return cfg


def init_untrained_head(target_config, seed: int = 0, bias: bool = True) -> EagleHead:
    """A randomly initialised head (acceptance near zero; output stays exact)."""
    g = torch.manual_seed(seed)
    head = EagleHead(head_config_from_target(target_config, bias))
    return init_head_weights(head, getattr(target_config, "initializer_range", 0.02), g)


def init_head_weights(head: nn.Module, std: float, g: torch.Generator) -> nn.Module:
    """Random head weights: norms 1, biases 0, everything else N(0, std) drawn from ``g`` in parameter order."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
    return head


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


def _read_weights(head_dir: Path) -> dict[str, torch.Tensor]:
    st, binf = head_dir / "model.safetensors", head_dir / "pytorch_model.bin"
    try:
        if st.is_file():
            return load_file(str(st))
        if binf.is_file():
            return torch.load(str(binf), map_location="cpu", weights_only=True)
    except Exception as e:
        raise HeadError(f"cannot read draft head weights in {head_dir}: {e}") from None
    raise HeadError(f"{head_dir} has neither model.safetensors nor pytorch_model.bin")


def load_eagle_head(head_dir: str | Path, target_config, target_embed: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a published EAGLE-1/2 head and check it fits the target (hidden size, vocabulary).

    An EAGLE-3 head directory (``draft_vocab_size`` / ``eagle_config`` in its config) is handed to
    :func:`draft.eagle3.load_eagle3_head` and comes back as an :class:`draft.eagle3.Eagle3Head`.
    """
    head_dir = Path(head_dir)
    if not (head_dir / "config.json").is_file():
        raise HeadError(f"draft head directory {head_dir} has no config.json")
    from draft.eagle3 import is_eagle3_config, load_eagle3_head, read_head_config
    if is_eagle3_config(read_head_config(head_dir)):
        return load_eagle3_head(head_dir, target_config, target_embed, dtype, device)
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
    state = _read_weights(head_dir)
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
