"""Random-weight draft heads written in exactly the layouts users download (for tests and the 7B rehearsal).

Each writer reproduces a published layout's file name, keys, dtypes and config fields (``../shared/reference``
section 3: EAGLE's ``cnets1.py`` / ``cnets.py`` and SpecForge's saved drafts); the weights are random. The loaders
(:mod:`draft.load_head`) must read them as they read the real files:

* EAGLE-1/2 ``vicuna`` (``yuhuili/EAGLE-Vicuna-7B-v1.3``): ``pytorch_model.bin`` (float16) with ``fc.weight`` /
  ``fc.bias``, ``layers.0.*`` without ``input_layernorm``, ``embed_tokens.weight`` and the stale rotary
  ``inv_freq`` a transformers-4.28 save carries; a LLaMA-1 config with no ``bias`` key (fc bias defaults to present).
* EAGLE-1/2 ``llama3`` (``yuhuili/EAGLE-LLaMA3-Instruct-8B``): bfloat16 ``pytorch_model.bin``, GQA, ``rope_theta``
  500000, ``"bias": false`` (no ``fc.bias``), no ``embed_tokens``.
* EAGLE-1/2 ``qwen2`` (EAGLE's Qwen2 drafts): a Llama config with ``"qkv_bias": true`` (q/k/v biases, none on o_proj).
* EAGLE-3 ``authors`` and ``specforge``: ``tests/test_heads_layouts.py`` writes them with these helpers (only the
  tests use them).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def _cfg_dict(target_cfg, **over) -> dict:
    """The config fields a published head carries (a one-layer Llama config at the target's widths)."""
    t = target_cfg
    d = {"architectures": ["LlamaForCausalLM"], "bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id,
         "hidden_act": "silu", "hidden_size": t.hidden_size, "initializer_range": 0.02,
         "intermediate_size": t.intermediate_size, "max_position_embeddings": 2048, "model_type": "llama",
         "num_attention_heads": t.num_attention_heads, "num_hidden_layers": 1, "pad_token_id": 0,
         "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "float16",
         "transformers_version": "4.28.1", "use_cache": True, "vocab_size": t.vocab_size}
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def _rand(shape, dtype, g, std=0.05):
    return (torch.randn(*shape, generator=g) * std).to(dtype)


def _layer(prefix: str, h: int, heads: int, kv: int, inter: int, in_w: int, dtype, g, qkv_bias=False) -> dict:
    hd = h // heads
    s = {f"{prefix}self_attn.q_proj.weight": _rand((heads * hd, in_w), dtype, g),
         f"{prefix}self_attn.k_proj.weight": _rand((kv * hd, in_w), dtype, g),
         f"{prefix}self_attn.v_proj.weight": _rand((kv * hd, in_w), dtype, g),
         f"{prefix}self_attn.o_proj.weight": _rand((h, heads * hd), dtype, g),
         f"{prefix}mlp.gate_proj.weight": _rand((inter, h), dtype, g),
         f"{prefix}mlp.up_proj.weight": _rand((inter, h), dtype, g),
         f"{prefix}mlp.down_proj.weight": _rand((h, inter), dtype, g),
         f"{prefix}post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
    if qkv_bias:
        for n, w in (("q", heads), ("k", kv), ("v", kv)):
            s[f"{prefix}self_attn.{n}_proj.bias"] = _rand((w * hd,), dtype, g)
    return s


def write_eagle1(out: Path, target_cfg, flavor: str, seed: int = 0) -> Path:
    """An EAGLE-1/2 head in a published layout: ``vicuna``, ``llama3`` or ``qwen2`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    t = target_cfg
    h, v = t.hidden_size, t.vocab_size
    kv = {"vicuna": t.num_attention_heads}.get(flavor, t.num_key_value_heads)
    if flavor == "vicuna":
        dtype, cfg = torch.float16, _cfg_dict(t)                      # no num_key_value_heads, no "bias"
    elif flavor == "llama3":
        dtype, cfg = torch.bfloat16, _cfg_dict(t, num_key_value_heads=kv, rope_theta=500000.0, bias=False,
                                               torch_dtype="bfloat16", rms_norm_eps=1e-05)
    elif flavor == "qwen2":
        dtype, cfg = torch.bfloat16, _cfg_dict(t, num_key_value_heads=kv, qkv_bias=True, bias=True,
                                               rope_theta=1000000.0, torch_dtype="bfloat16")
    else:
        raise KeyError(flavor)
    state = {"fc.weight": _rand((h, 2 * h), dtype, g)}
    if flavor != "llama3":
        state["fc.bias"] = _rand((h,), dtype, g)
    state.update(_layer("layers.0.", h, t.num_attention_heads, kv, t.intermediate_size, h, dtype, g,
                        qkv_bias=flavor == "qwen2"))
    if flavor == "vicuna":
        state["embed_tokens.weight"] = _rand((v, h), dtype, g, 1.0)
        hd = h // t.num_attention_heads
        state["layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.save(state, out / "pytorch_model.bin")
    return out
