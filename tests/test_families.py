"""Model families users run today, on tiny random configs, through every mode against HF generate.

Llama-3.x (grouped-query attention, ``rope_scaling`` of type ``llama3``, untied and tied embeddings), Qwen2.5
(q/k/v biases, tied embeddings), Qwen3 (``q_norm``/``k_norm``, ``head_dim`` != hidden / heads) and Mistral. Each
is saved with ``save_pretrained``, split by the splitter, and decoded by the whole ring in one process
(``pipeline/inprocess.py``) in every mode, in float32, bfloat16 and float16 (HF runs all three on CPU), with an untrained EAGLE
head and with the oracle drafter (long accepted paths, re-rooting, expansion); one family also runs as real
processes. The lean layer path (``model/lean_layer.py``) is checked against the transformers layers it replaces,
family by family, with a planted bug that must fail.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.layers import LayerBlock, UnsupportedModel, family_classes, set_lean
from model.split import split_checkpoint
from model.stage_format import SUPPORTED_MODEL_TYPES
from pipeline.inprocess import run_threaded
from tests.helpers import hf_greedy, launch, read_jsonl

MODES = ["ar", "naive", "pruned", "continuous", "pipedec"]
PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47, 3, 3]]
MAX_NEW = 10
FAMILIES = ("llama3", "llama3_tied", "qwen2.5", "qwen3", "mistral")


def family_config(name: str, layers: int = 4, vocab: int = 96, hidden: int = 64):
    """A tiny random config of family ``name`` with the feature that sets it apart switched on."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name in ("llama3", "llama3_tied"):
        # original_max_position_embeddings=64 so that the llama3 rescaling touches this head_dim's frequencies
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return LlamaConfig(**common, rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=name.endswith("tied"))
    if name == "qwen2.5":
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False, rope_theta=1000000.0)
    if name == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, attention_bias=False,
                           use_sliding_window=False)
    if name == "mistral":
        return MistralConfig(**common, sliding_window=4096, tie_word_embeddings=False)
    raise KeyError(name)


def family_checkpoint(path: Path, name: str, seed: int = 0, dtype=torch.float32, **kw) -> Path:
    """A random ``name`` checkpoint saved with ``save_pretrained`` (safetensors); non-trivial norms and biases, a
    sharpened ``lm_head`` so that greedy choices have margins."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, **kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(8.0)         # tied: the embedding too, which is fine
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in FAMILIES:
        full = family_checkpoint(root / name, name)
        out[name] = (full, split_checkpoint(full, root / f"{name}_stages", [0, 2, 2], progress=False))
    return out


_REF: dict = {}


def _check(full: Path, res: dict, dtype) -> None:
    for mode, rows in res.items():
        assert len(rows) == len(PROMPTS), mode
        for p, r in zip(PROMPTS, rows):
            key = (str(full), tuple(p), dtype)
            if key not in _REF:
                _REF[key] = hf_greedy(full, p, MAX_NEW, {2}, dtype)
            assert r.output_ids == _REF[key], f"{full.name} {mode} {dtype} prompt {p[:3]}: differs from HF"


# ---------------------------------------------------------------------------------------------------------------
# The configs really exercise what sets each family apart
# ---------------------------------------------------------------------------------------------------------------

def test_configs_exercise_the_family_features(checkpoints):
    from transformers import AutoConfig
    from safetensors import safe_open
    for name, (full, stages) in checkpoints.items():
        cfg = AutoConfig.from_pretrained(full)
        with safe_open(str(full / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        if name.startswith("llama3"):
            assert cfg.rope_parameters["rope_type"] == "llama3"
            assert ("lm_head.weight" in keys) == (name == "llama3")      # tied: no lm_head tensor on disk
        if name == "qwen2.5":
            assert "model.layers.0.self_attn.q_proj.bias" in keys and "model.layers.0.self_attn.v_proj.bias" in keys
        if name == "qwen3":
            assert "model.layers.0.self_attn.q_norm.weight" in keys
            assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
        stage_cfg = json.loads((stages / "stage_model_1" / "config.json").read_text())
        assert stage_cfg["model_type"] == cfg.model_type


def test_llama3_rope_scaling_changes_the_rotation():
    """The llama3 rescaling must matter for the test configs (else a stage that ignored it would pass)."""
    cfg = family_config("llama3")
    _, rotary_cls, _ = family_classes(cfg)
    plain = family_config("llama3")
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    x, pos = torch.zeros(1, 1, 64), torch.arange(40)[None]
    cos_a, _ = rotary_cls(config=cfg)(x, pos)
    cos_b, _ = rotary_cls(config=plain)(x, pos)
    assert not torch.allclose(cos_a, cos_b)


# ---------------------------------------------------------------------------------------------------------------
# Lean layers against the transformers layers, family by family
# ---------------------------------------------------------------------------------------------------------------

def _block_outputs(name: str, lean: bool, monkeypatch=None, planted: bool = False):
    torch.manual_seed(0)
    cfg = family_config(name)
    cfg._attn_implementation = "sdpa"
    blk = LayerBlock(cfg, 2).double().eval()
    with torch.no_grad():
        for n, p in blk.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert blk.lean_ok, f"{name}: the lean path must run this family"
    set_lean(blk, lean)
    if planted:      # a lean path that forgets Qwen3's q_norm (or anything using the per-head norm)
        from model import lean_layer
        real = lean_layer._rms_norm
        monkeypatch.setattr(lean_layer, "_rms_norm",
                            lambda norm, x: x if norm.weight.shape[0] != x.shape[-1] or x.dim() == 4 else real(norm, x))
    cache = blk.new_cache(64, torch.float64, "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 7, 64, generator=g, dtype=torch.float64)
    pos, mask = cache.context_inputs(7, torch.float64)
    outs = [blk(x, pos, mask, cache)]
    cache.commit_forward(7, as_context=True)
    parents = torch.tensor([-1, 0, 0, 1])
    y = torch.randn(1, 4, 64, generator=g, dtype=torch.float64)
    pos, mask, anc, depth = cache.tree_inputs(parents, torch.float64)
    outs.append(blk(y, pos, mask, cache))
    return outs


@pytest.mark.parametrize("name", FAMILIES)
def test_lean_layers_equal_transformers_layers(name):
    for a, b in zip(_block_outputs(name, True), _block_outputs(name, False)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_lean_layers_planted_qk_norm_bug_fails(monkeypatch):
    ref = _block_outputs("qwen3", False)
    bad = _block_outputs("qwen3", True, monkeypatch, planted=True)
    assert not torch.allclose(ref[0], bad[0])


# ---------------------------------------------------------------------------------------------------------------
# Every mode equals HF generate, every family
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("drafter", ["untrained", "oracle"])
def test_every_mode_equals_hf_float32(checkpoints, name, drafter):
    full, stages = checkpoints[name]
    head = None if drafter == "untrained" else f"oracle:{full}"
    res = run_threaded(stages, PROMPTS, MODES, [f"max_new_tokens={MAX_NEW}", "dtype=float32"], {2}, head,
                       torch.float32)
    _check(full, res, torch.float32)
    if drafter == "oracle":      # a perfect draft is accepted beyond the root: the tree paths really ran
        assert max(r.tau for r in res["naive"]) > 2.0


# half-precision matmuls are slow on a CPU and the oracle drafts with the full model: trees of 24 nodes (80 by
# default) keep every path the claim needs (tree verification, long accepted paths, re-rooting, expansion) in half
# the time; the default tree sizes run in float32 above
SMALL_TREES = ["tree.total_token=24", "tree.init_total_token=24", "tree.expand_total_token=16", "tree.top_k=4",
               "tree.init_topk=4", "tree.expand_topk=4", "tree.subseq_token=8"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_mode_equals_hf_half(tmp_path, name, dtype):
    """bf16 / fp16 checkpoints and stages, HF in the same dtype on CPU: the same tokens."""
    dt = getattr(torch, dtype)
    full = family_checkpoint(tmp_path / name, name, dtype=dt)
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 3], progress=False)
    res = run_threaded(stages, PROMPTS, MODES, [f"max_new_tokens={MAX_NEW}", f"dtype={dtype}", *SMALL_TREES], {2},
                       f"oracle:{full}", dt)
    _check(full, res, dt)
    assert max(r.tau for r in res["naive"]) > 2.0        # long accepted paths in half precision too


def test_qwen3_as_processes_equals_hf(checkpoints, tmp_path):
    """The multi-process path (one process per rank, torch.distributed): Qwen3, every mode."""
    full, stages = checkpoints["qwen3"]
    out = tmp_path / "out.jsonl"
    args = [f"model.stage_dir={stages}", "dtype=float32", f"max_new_tokens={MAX_NEW}", "comm.timeout_s=60",
            "--modes", ",".join(MODES), "--output", str(out), "--quiet", f"head_dir=oracle:{full}"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    launch(3, args, timeout=600)
    rows = read_jsonl(out)
    assert len(rows) == len(MODES) * len(PROMPTS)
    for row in rows:
        assert row["output_ids"] == hf_greedy(full, row["prompt_ids"], MAX_NEW, {2}, torch.float32), row["mode"]


# ---------------------------------------------------------------------------------------------------------------
# An unsupported family is one line naming the supported ones
# ---------------------------------------------------------------------------------------------------------------

def test_unsupported_model_type_is_one_line(checkpoints, tmp_path):
    from config.errors import UserError
    full, stages = checkpoints["mistral"]
    bad = tmp_path / "gemma"
    bad.mkdir()
    raw = json.loads((full / "config.json").read_text())
    raw["model_type"] = "gemma"
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as e:
        split_checkpoint(bad, tmp_path / "out", [0, 2, 2], progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "gemma" in msg and all(t in msg for t in SUPPORTED_MODEL_TYPES)

    class Cfg:
        model_type = "gemma"
    with pytest.raises(UnsupportedModel) as e:
        family_classes(Cfg())
    assert isinstance(e.value, UserError) and "\n" not in str(e.value) and "qwen3" in str(e.value)
