"""model/light.py: the families' layers, norms, rotary embedding and config without transformers, against
transformers' own; and the one-process API's path importing neither transformers nor ``torch._dynamo``.

The rotary embedding must equal transformers' bit for bit for every rope type :func:`model.light.light_ok` accepts
(a planted wrong rope fails), the layer must have transformers' parameter names, shapes and init order, and the
reference path (``model.lean_layers=false``) must run transformers' layers on the same parameter objects.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from model import light
from model.layers import LayerBlock, family_classes, set_lean
from tests.helpers import STORIES
from tests.test_families import FAMILIES, family_config

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def _rope_config(kind: str, family: str = "llama3"):
    cfg = family_config(family)
    cfg.rope_parameters = dict(ROPES[kind])
    return cfg


def _cos_sin(rotary, dtype=torch.float32):
    x = torch.zeros(1, 1, 8, dtype=dtype)
    pos = torch.tensor([[0, 1, 2, 7, 63, 64, 100, 511, 4000]])
    return rotary(x, pos)


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_rotary_equals_transformers_bit_for_bit(kind, family):
    cfg = _rope_config(kind, family)
    assert light.light_ok(cfg)
    _, hf_rotary, _ = family_classes(cfg)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        ref, got = _cos_sin(hf_rotary(config=cfg), dtype), _cos_sin(light.RotaryEmbedding(cfg), dtype)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), (family, kind, dtype)


def test_a_planted_wrong_rope_fails(monkeypatch):
    """Ignoring the llama3 rescaling (computing the default frequencies) is caught by the comparison above."""
    cfg = _rope_config("llama3")
    _, hf_rotary, _ = family_classes(cfg)
    ref = _cos_sin(hf_rotary(config=cfg))
    plain = dict(ROPES["llama3"], rope_type="default")
    real = light.rope_inv_freq
    monkeypatch.setattr(light, "rope_inv_freq",
                        lambda c: real(type("C", (), {"rope_parameters": plain, "head_dim": light.head_dim_of(c)})()))
    got = _cos_sin(light.RotaryEmbedding(cfg))
    assert not torch.equal(ref[0], got[0])


def test_rope_types_and_settings_not_computed_here_are_left_to_transformers():
    for rope in ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, {"rope_type": "yarn", "rope_theta": 1e4},
                 {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                 {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}):
        cfg = family_config("llama3")
        cfg.rope_parameters = rope
        assert not light.light_ok(cfg), rope
        if rope["rope_type"] == "dynamic":          # built from transformers' classes
            blk = LayerBlock(cfg, 1)
            assert not isinstance(blk.layers[0], light.DecoderLayer)
            assert not isinstance(blk.rotary_emb, light.RotaryEmbedding)
    cfg = family_config("llama3")
    cfg.hidden_act = "gelu"
    assert not light.light_ok(cfg)
    cfg = family_config("mistral")
    cfg._attn_implementation = "eager"
    assert not light.light_ok(cfg)


@pytest.mark.parametrize("family", FAMILIES + ("llama_bias",))
def test_layer_has_transformers_parameters_in_transformers_order(family):
    """Same names, shapes, biases and order: a seeded init draws the same weights, state dicts load both ways."""
    if family == "llama_bias":
        cfg = family_config("llama3")
        cfg.attention_bias = cfg.mlp_bias = True
    else:
        cfg = family_config(family)
    cfg._attn_implementation = "sdpa"
    hf_layer, _, hf_norm = family_classes(cfg)
    torch.manual_seed(0)
    ref = hf_layer(cfg, layer_idx=3)
    torch.manual_seed(0)
    got = light.DecoderLayer(cfg, 3)
    a, b = list(ref.named_parameters()), list(got.named_parameters())
    assert [(n, p.shape) for n, p in a] == [(n, p.shape) for n, p in b]
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(a, b))
    for attr in ("head_dim", "num_key_value_groups", "scaling", "layer_idx", "is_causal"):
        assert getattr(ref.self_attn, attr) == getattr(got.self_attn, attr), attr
    x = torch.randn(2, 5, cfg.hidden_size)
    torch.testing.assert_close(light.RMSNorm(cfg.hidden_size, 1e-5)(x), hf_norm(cfg.hidden_size, eps=1e-5)(x),
                               rtol=0, atol=0)


def test_reference_path_runs_transformers_layers_on_the_same_parameters():
    cfg = family_config("qwen3")
    blk = LayerBlock(cfg, 2)
    assert isinstance(blk.layers[0], light.DecoderLayer) and blk.lean
    params = {n: p for n, p in blk.named_parameters()}
    q_proj = blk.layers[1].self_attn.q_proj
    assert set_lean(blk, False) == 0
    hf_layer, _, _ = family_classes(cfg)
    assert all(type(layer) is hf_layer for layer in blk.layers)
    assert blk.layers[1].self_attn.q_proj is q_proj                  # modules move (quantized ones too)
    assert all(p is params[n] for n, p in blk.named_parameters())    # the same parameter objects, nothing copied
    assert set_lean(blk, True) == 1 and blk.lean                      # lean_forward runs transformers' layers too


def test_cache_free_call_is_transformers_call():
    """The heads' trainer calls a layer directly (``draft.train.objective.head_forward``): no mask means causal."""
    cfg = family_config("qwen2.5")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    got = light.DecoderLayer(cfg, 0).double()
    hf_layer, hf_rotary, _ = family_classes(cfg)
    ref = hf_layer(cfg, layer_idx=0).double()
    ref.load_state_dict(got.state_dict())
    x = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    pos = torch.arange(6)[None].expand(2, 6)
    emb = hf_rotary(config=cfg)(x, pos)
    bool_mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    for mask in (None, bool_mask):
        a = ref(x, attention_mask=mask, position_ids=pos, use_cache=False, position_embeddings=emb)
        b = got(x, attention_mask=mask, position_ids=pos, use_cache=False, position_embeddings=emb)
        torch.testing.assert_close(b, a[0] if isinstance(a, tuple) else a, rtol=1e-12, atol=1e-12)


def test_light_config_reads_a_stage_config(tmp_path):
    if not STORIES.is_dir():
        pytest.skip("../shared/models/stories260K is not available")
    from model.split import split_checkpoint
    from model.stage_model import load_stage_config
    root = split_checkpoint(STORIES, tmp_path / "s", [0, 3, 2], progress=False)
    cfg = load_stage_config(root, 1)
    assert isinstance(cfg, light.LightConfig) and cfg.layer_range == [0, 3] and cfg.model_type == "llama"
    raw = json.loads((root / "stage_model_1" / "config.json").read_text())
    assert cfg.to_dict() == raw and light.LightConfig.from_dict(cfg.to_dict()).to_dict() == raw
    hf = load_stage_config(root, 1, hf=True)
    assert not isinstance(hf, light.LightConfig) and hf.layer_range == [0, 3]
    for key in ("hidden_size", "num_key_value_heads", "rope_parameters", "rms_norm_eps", "vocab_size"):
        assert getattr(cfg.to_hf(), key) == getattr(hf, key) == getattr(cfg, key), key
    legacy = dict(raw)
    legacy.pop("rope_parameters")
    legacy["rope_theta"] = 10000.0
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    assert not isinstance(light.read_config(tmp_path / "legacy" / "config.json"), light.LightConfig)


def test_api_path_imports_neither_transformers_nor_dynamo(tmp_path):
    """The one-process API on stories260K (the README's example): no transformers and no torch._dynamo import
    (together about 2.5 s of the example's 6 s before, docs/results.md, "The API example under 5 s")."""
    if not STORIES.is_dir():
        pytest.skip("../shared/models/stories260K is not available")
    from model.split import split_checkpoint
    root = split_checkpoint(STORIES, tmp_path / "s", [0, 3, 2], progress=False)
    code = ("import sys\nfrom pipeline.api import FlowSpec\n"
            f"fs = FlowSpec.load({str(root)!r})\nout = fs.generate('Once upon a time', max_new_tokens=8)\n"
            "fs.close()\nprint(len(out.ids), sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' "
            "or m.startswith('torch._dynamo'))[:5])\n")
    from config.paths import REPO
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "8 []", res.stdout
