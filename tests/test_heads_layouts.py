"""Published draft-head layouts: random-weight files written in exactly the layout users download, loaded, drafted
with, and checked against their target.

The writers (:mod:`draft.head_layouts`; EAGLE-3: :func:`write_eagle3` below) reproduce each layout's keys, dtypes,
file names and config fields:
EAGLE-1/2 as ``yuhuili/EAGLE-Vicuna-7B-v1.3`` (fp16 .bin, fc bias, stale inv_freq), ``EAGLE-LLaMA3-Instruct-8B``
(bf16 .bin, ``bias: false``) and EAGLE's Qwen2 drafts (``qkv_bias``); EAGLE-3 as its authors write it (fp16 .bin,
default taps) and as SpecForge does (bf16 safetensors, ``eagle_config`` layer ids, ``embed_tokens``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import UserError
from draft.drafter import Drafter
from draft.eagle import EagleHead
from draft.eagle3 import Eagle3Head, stage_taps
from draft.head_io import HeadError
from draft.head_layouts import _cfg_dict, _layer, _rand, write_eagle1
from draft.load_head import load_draft_head
from model.split import split_checkpoint
from pipeline.inprocess import run_threaded
from tests.helpers import hf_greedy
from tests.test_families import family_checkpoint

MODES = ["ar", "naive", "continuous"]
PROMPTS = [[1, 5, 9, 13, 22, 7]]
MAX_NEW = 8


DRAFT_IDS = torch.tensor([0, 1, 2, 3, 5, 7, 9, 11, 13, 20, 22, 30, 31, 40, 41, 42, 43, 44, 45, 46, 47, 60, 70, 95])


def write_eagle3(out: Path, target_cfg, flavor: str, draft_ids: torch.Tensor, aux: list[int] | None = None,
                 seed: int = 0) -> Path:
    """An EAGLE-3 head in a published layout (random weights), ``draft_ids`` = the sorted target ids of the draft
    vocabulary (``d2t[i] = draft_ids[i] - i``, ``t2d[draft_ids] = True``):

    * ``authors`` (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): ``pytorch_model.bin`` (float16),
      ``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``, no target layer ids (the default taps), keys
      ``fc.weight [H, 3H]``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight [Vd, H]``, ``d2t`` (int64 offsets),
      ``t2d`` (bool), no ``embed_tokens``.
    * ``specforge``: ``model.safetensors`` (bfloat16) with the same keys plus ``embed_tokens.weight``, the
      target layer ids in ``eagle_config.eagle_aux_hidden_state_layer_ids``."""
    g = torch.Generator().manual_seed(seed)
    t = target_cfg
    h, v, vd = t.hidden_size, t.vocab_size, int(draft_ids.numel())
    kv = t.num_key_value_heads
    dtype = torch.float16 if flavor == "authors" else torch.bfloat16
    cfg = _cfg_dict(t, architectures=["LlamaForCausalLMEagle3"], num_key_value_heads=kv, draft_vocab_size=vd,
                    rms_norm_eps=1e-05, torch_dtype=str(dtype).removeprefix("torch."))
    if flavor == "specforge":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}
        cfg["target_hidden_size"] = h
        cfg["transformers_version"] = "4.51.0"
    state = {"fc.weight": _rand((h, 3 * h), dtype, g)}
    state.update(_layer("midlayer.", h, t.num_attention_heads, kv, t.intermediate_size, 2 * h, dtype, g))
    state.update({"midlayer.hidden_norm.weight": torch.ones(h, dtype=dtype),
                  "midlayer.input_layernorm.weight": torch.ones(h, dtype=dtype),
                  "norm.weight": torch.ones(h, dtype=dtype),
                  "lm_head.weight": _rand((vd, h), dtype, g, 1.0),
                  "d2t": (draft_ids - torch.arange(vd)).long()})
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    state["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    if flavor == "specforge":
        state["embed_tokens.weight"] = _rand((v, h), dtype, g, 1.0)
        save_file({k: x.contiguous() for k, x in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        torch.save(state, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Targets by family, split 0+a+b; the llama3 one has 8 layers (EAGLE-3's default taps need >= 7)."""
    from transformers import AutoConfig
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for name, layers, split in (("llama3", 8, [0, 3, 5]), ("qwen2.5", 4, [0, 2, 2]), ("qwen3", 4, [0, 1, 3]),
                                ("mistral", 4, [0, 2, 2])):
        full = family_checkpoint(root / name, name, layers=layers)
        out[name] = (full, AutoConfig.from_pretrained(full), split_checkpoint(full, root / f"{name}_s", split,
                                                                              progress=False))
    return root, out


LAYOUTS = [  # (head layout, target family)
    ("eagle1-vicuna", "llama3"), ("eagle1-vicuna", "mistral"), ("eagle1-llama3", "llama3"),
    ("eagle1-qwen2", "qwen2.5"), ("eagle1-llama3", "qwen3"),
    ("eagle3-authors", "llama3"), ("eagle3-specforge", "qwen3"), ("eagle3-specforge", "qwen2.5"),
]


def _write(root: Path, layout: str, family: str, cfg) -> Path:
    d = root / f"{layout}-{family}"
    if d.is_dir():
        return d
    kind, flavor = layout.split("-")
    if kind == "eagle1":
        return write_eagle1(d, cfg, flavor)
    aux = None if flavor == "authors" else [0, 1, cfg.num_hidden_layers - 1]
    return write_eagle3(d, cfg, flavor, DRAFT_IDS, aux)


@pytest.mark.parametrize("layout,family", LAYOUTS)
def test_published_layout_loads_and_keeps_output_exact(targets, layout, family):
    root, t = targets
    full, cfg, stages = t[family]
    d = _write(root, layout, family, cfg)
    embed = load_file(str(full / "model.safetensors"))["model.embed_tokens.weight"]
    head = load_draft_head(d, cfg, embed, torch.float32)
    if layout.startswith("eagle1"):
        assert isinstance(head, EagleHead)
        raw = json.loads((d / "config.json").read_text())
        assert (head.fc.bias is not None) == raw.get("bias", True)      # EAGLE: bias defaults to True
        attn = head.block.layers[0].self_attn
        assert (attn.q_proj.bias is not None) == (layout == "eagle1-qwen2") and attn.o_proj.bias is None
        if layout == "eagle1-vicuna":     # the file's fp16 tensors, not a random init
            sd = torch.load(d / "pytorch_model.bin", weights_only=True)
            torch.testing.assert_close(head.fc.weight, sd["fc.weight"].float())
            torch.testing.assert_close(head.embed_tokens.weight, sd["embed_tokens.weight"].float())
        else:
            torch.testing.assert_close(head.embed_tokens.weight, embed)
    else:
        assert isinstance(head, Eagle3Head)
        assert torch.equal(head.vocab_map, DRAFT_IDS)
        want = [1, 3, 4] if layout == "eagle3-authors" else [0, 1, cfg.num_hidden_layers - 1]
        assert head.aux_layers == want == stage_taps("auto", d, cfg.num_hidden_layers)
    res = run_threaded(stages, PROMPTS, MODES, [f"max_new_tokens={MAX_NEW}", "dtype=float32"], {2}, str(d),
                       torch.float32)
    ref = hf_greedy(full, PROMPTS[0], MAX_NEW, {2}, torch.float32)
    for mode, rows in res.items():
        assert rows[0].output_ids == ref, f"{layout} on {family}: {mode} differs from HF"


def test_eagle3_draft_vocabulary_maps_to_target_ids(targets):
    """Draft id i proposes target id ``i + d2t[i]``: a head whose lm_head favours draft id j drafts DRAFT_IDS[j]
    first, and never a target id outside the draft vocabulary."""
    root, t = targets
    full, cfg, _ = t["qwen3"]
    d = _write(root, "eagle3-specforge", "qwen3", cfg)
    head = load_draft_head(d, cfg, None, torch.float64)
    lm = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).double()
    drafter = Drafter(head, lm, 128)
    allowed = set(DRAFT_IDS.tolist())
    class Ones(torch.nn.Module):           # the head's final norm made constant: logits = lm_head row sums
        def forward(self, x):
            return torch.ones_like(x)
    head.norm = Ones()
    for j in (0, 5, 23):
        with torch.no_grad():
            head.lm_head.weight.zero_()
            head.lm_head.weight[j] = 1.0      # draft id j gets logit H, every other 0
        feats = torch.ones(4, 4 * cfg.hidden_size, dtype=torch.float64)
        root_node = drafter.start([1, 5, 9, 13], 7, feats)
        lp = drafter.logprobs(root_node)
        assert int(lp.argmax()) == int(DRAFT_IDS[j])
        assert torch.isinf(lp[[i for i in range(cfg.vocab_size) if i not in allowed]]).all()
        tree, _ = drafter.grow_tree_with_inputs(7, root_node, 12, 3, 3)
        assert int(tree.tokens[1]) == int(DRAFT_IDS[j]) and set(tree.tokens[1:].tolist()) <= allowed


@pytest.mark.parametrize("what", ["hidden", "vocab", "layers", "d2t", "shape", "vocab_eagle1", "hidden_eagle1",
                                  "shape_eagle1"])
def test_mismatched_head_is_one_line(targets, tmp_path, what):
    root, t = targets
    full, cfg, stages = t["llama3"]
    if what.endswith("eagle1"):
        d = write_eagle1(tmp_path / "h", cfg, "llama3")
    else:
        d = write_eagle3(tmp_path / "h", cfg, "specforge", DRAFT_IDS, [0, 1, 7])
    raw = json.loads((d / "config.json").read_text())
    if what in ("hidden", "hidden_eagle1"):
        raw["hidden_size"] = cfg.hidden_size * 2
        raw.pop("target_hidden_size", None)
    elif what in ("vocab", "vocab_eagle1"):
        raw["vocab_size"] = cfg.vocab_size + 32
    elif what == "layers":
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 4, cfg.num_hidden_layers + 3]
    elif what == "d2t":
        raw["draft_vocab_size"] = int(DRAFT_IDS.numel()) + 1
    elif what in ("shape", "shape_eagle1"):
        raw["intermediate_size"] = cfg.intermediate_size + 8
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HeadError) as e:
        load_draft_head(d, cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    if what == "layers":     # the stages refuse the same head before loading anything
        with pytest.raises(HeadError):
            stage_taps("auto", d, cfg.num_hidden_layers)


def test_bin_heads_are_read_with_weights_only(targets, tmp_path):
    """A pickle that is not plain tensors is refused (torch.load(weights_only=True)), in one line."""
    _, t = targets
    _, cfg, _ = t["llama3"]
    d = write_eagle1(tmp_path / "h", cfg, "llama3")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    torch.save({"fc.weight": Evil()}, d / "pytorch_model.bin")
    with pytest.raises(HeadError) as e:
        load_draft_head(d, cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    assert "\n" not in str(e.value)
