"""EAGLE-1/2 draft head: ``fc([embed(token) ; feature])`` -> one decoder layer -> predicted feature.

Checkpoint format (as published by EAGLE, ``yuhuili/EAGLE-Vicuna-7B-v1.3``, ``EAGLE-LLaMA3-Instruct-8B`` ...):
``config.json`` (a Llama-style config with ``num_hidden_layers = 1``, optional ``bias`` for ``fc`` and
``qkv_bias`` for q/k/v biases on Qwen2 drafts) plus ``model.safetensors`` or ``pytorch_model.bin`` (read with
``torch.load(weights_only=True)``) with keys ``fc.weight``, optional ``fc.bias``, ``layers.0.*`` (no
``input_layernorm`` on layer 0; a stale ``rotary_emb.inv_freq`` is ignored) and an optional
``embed_tokens.weight`` (taken from the target when absent). The layouts tested are in
``tests/test_heads_layouts.py``. The head has no ``lm_head``: the
target's ``lm_head`` (held by rank 0) turns predicted features into logits.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from draft.fused_head import FusedHead
from draft.head_io import (HeadError, assign_weights, head_config_from_target, init_head_weights, is_eagle3_config,
                           read_head_config, read_head_weights, write_head)
from model.layers import LayerBlock
from model.light import embedding, read_config
from model.meter import NULL_METER, OpMeter, cache_length, run_joint


class EagleHead(nn.Module):
    meter: OpMeter = NULL_METER   # instrumentation sees each forward as a draft_forward op (model.meter)
    # issue 41: inference forwards on the lean path run the fused forward (draft/fused_head.py); False: the lean
    # layer path (tests compare the two)
    fused: bool = True

    def __init__(self, config, bias: bool = True) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, h)   # no random init on meta (model.light.embedding)
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.block = LayerBlock(config, 1, skip_first_input_norm=True)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens [1, n]`` paired with the feature of the *previous* position ``features [1, n, H]``; the output
        ``[1, n, H]``, or with ``rows`` (row indices) only those rows' outputs ``[1, len(rows), H]`` (:meth:`compute`).
        Metered as a ``draft_forward`` op of ``n`` rows over the cache's entries (:mod:`model.meter`)."""
        return run_joint(self.meter, "draft_forward", (tokens, features, positions, mask, cache, rows),
                         int(tokens.shape[-1]), cache_length(cache), lambda a: self.compute(*a), self.compute_lanes,
                         key=self if cache is not None else None)

    def compute_lanes(self, calls: list[tuple]) -> list[torch.Tensor]:
        """Several callers' :meth:`compute` arguments ``(tokens, features, positions, mask, cache[, rows])`` (several
        lanes' drafters sharing this head, each with its own cache) in ONE forward: the rows concatenated, each
        caller's attention over its own cache with its own mask (:class:`model.lane_batch.LaneBatch`); returns
        each caller's output (only its ``rows``, where given: every row runs here, then each caller's are taken). Equal to each caller's own :meth:`compute` up to float reassociation of the
        row-batched matmuls (``tests/test_coalesce.py``)."""
        from model.lane_batch import LaneBatch
        sizes = [int(c[0].shape[-1]) for c in calls]
        out = self.compute(torch.cat([c[0] for c in calls], dim=-1), torch.cat([c[1] for c in calls], dim=1),
                           torch.cat([c[2] for c in calls], dim=-1), None,
                           LaneBatch([c[4] for c in calls], [c[3] for c in calls]))
        return [o if len(c) < 6 or c[5] is None else o[:, c[5]] for o, c in zip(out.split(sizes, dim=1), calls)]

    def compute(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache, rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` unmetered (what a recorded static forward replays: ``draft/static_head.py`` meters
        around it). ``rows``: return only these rows' outputs, in that order; every row still enters the cache.
        Why: a re-fed tree (an expansion, a prefetch) needs the outputs of its frontier or its leaves only, and the
        fused forward then skips the other rows' last attention, output projection and MLP (draft/fused_head.py);
        the other paths run every row and take the wanted ones."""
        if self.fused and self.block.lean:      # the fused forward where it applies (draft/fused_head.py)
            out = self.fused_head(tokens, features, positions, mask, cache, rows)
            if out is not None:
                return out
        x = self.fc(torch.cat([self.embed_tokens(tokens).to(features.dtype), features], dim=-1))
        out = self.block(x, positions, mask, cache)
        return out if rows is None else out[:, rows]

    @property
    def fused_head(self) -> FusedHead:
        """This head's :class:`draft.fused_head.FusedHead` (built at first use; it rebuilds its fused weights
        itself whenever a weight changes)."""
        fh = self.__dict__.get("_fused_head")
        if fh is None or fh._head() is not self:      # a deep copy carries the original's: make its own
            fh = self.__dict__["_fused_head"] = FusedHead(self)
        return fh

    # -- checkpoint I/O (EAGLE layout) -----------------------------------------------------------
    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's weights as a published checkpoint holds them (no rotary buffers, no embeddings: a head reads
        the target's)."""
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith(("block.rotary_emb", "embed_tokens")):
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
    cfg = head.config.to_dict()
    cfg.update(num_hidden_layers=1, bias=head.fc.bias is not None, architectures=["LlamaForCausalLM"])
    return write_head(out_dir, cfg, head.eagle_state_dict(), extra_config, dtype)


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
        cfg = read_config(head_dir / "config.json")   # transformers' AutoConfig only where model.light cannot
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
    # Layer 0 of an EAGLE-1/2 head has no input norm; checkpoints written by transformers < 4.31 carry the rotary
    # inv_freq buffer (recomputed here from the config).
    state = {k: v for k, v in state.items()
             if k != "layers.0.input_layernorm.weight" and not k.endswith("rotary_emb.inv_freq")}
    raw = read_head_config(head_dir) or {}
    cfg._attn_implementation = "sdpa"
    qkv_bias = bool(raw.get("qkv_bias")) or "layers.0.self_attn.q_proj.bias" in state
    if qkv_bias and not getattr(cfg, "attention_bias", True):
        cfg.attention_bias = True          # EAGLE's Qwen2 drafts: a Llama config with "qkv_bias": q/k/v biases only
    try:
        with torch.device("meta"):       # no random weights materialised: the file's tensors become the parameters
            head = EagleHead(cfg, bias="fc.bias" in state)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise HeadError(f"EAGLE head {head_dir}: unusable config: {e}") from None
    attn = head.block.layers[0].self_attn
    if qkv_bias and getattr(attn.o_proj, "bias", None) is not None and "layers.0.self_attn.o_proj.bias" not in state:
        attn.o_proj.bias = None
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
    shapes = {k: v.shape for k, v in head.state_dict().items()}
    bad = [f"{k} {tuple(mapped[k].shape)} != {tuple(shapes[k])}" for k in sorted(own) if mapped[k].shape != shapes[k]]
    if bad:
        raise HeadError(f"EAGLE head {head_dir} does not fit its config / the target: {bad[0]}")
    assign_weights(head, mapped, dtype, ["block.rotary_emb"], cfg, head_dir)
    return head.to(device=device, dtype=dtype).eval()
