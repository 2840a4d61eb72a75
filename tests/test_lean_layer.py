"""model/lean_layer.py: the lean decoder-layer forward against the transformers layer it replaces.

Every family the project runs (Llama with and without grouped-query attention, Mistral, Qwen2 with its q/k/v
biases), an EAGLE head's first layer (no input norm), context then tree segments on the project's KV cache,
float64 and float32, gradients; a planted bug must fail; layers the lean path cannot run keep the transformers
path; the run key reaches the stages and the head.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from model import lean_layer
from model.layers import LayerBlock, set_lean


def config(family: str, kv_heads: int = 2):
    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=kv_heads,
                  vocab_size=97, max_position_embeddings=256, rms_norm_eps=1e-5)
    if family == "llama":
        return LlamaConfig(**common, attention_bias=False)
    if family == "llama_head_dim":      # head_dim set apart from hidden / heads
        return LlamaConfig(**common, head_dim=24)
    if family == "llama_bias":
        return LlamaConfig(**common, attention_bias=True, mlp_bias=True)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    return Qwen2Config(**common, use_sliding_window=False)


def block_for(family: str, kv_heads: int = 2, layers: int = 2, eagle: bool = False, dtype=torch.float64):
    torch.manual_seed(0)
    blk = LayerBlock(config(family, kv_heads), layers, skip_first_input_norm=eagle).to(dtype).eval()
    for p in blk.parameters():           # non-trivial norms and biases
        p.data.add_(0.05 * torch.randn_like(p))
    return blk


def run(blk: LayerBlock, lean: bool, dtype=torch.float64, grad: bool = False, tree: bool = True):
    """A context of 7 tokens, then a 6-node tree segment, 3 more nodes and one node alone (an ``ar`` step; the
    one-row case transformers treats apart), as a stage and a draft head see them. Returns every forward's output
    and the cache."""
    set_lean(blk, lean)
    assert blk.lean == lean
    cache = blk.new_cache(64, dtype, "cpu")
    g = torch.Generator().manual_seed(1)
    outs = []
    h = blk.layers[0].self_attn.q_proj.in_features
    x = torch.randn(1, 7, h, generator=g, dtype=dtype, requires_grad=grad)
    pos, mask = cache.context_inputs(7, dtype)
    outs.append(blk(x, pos, mask, cache))
    cache.commit_forward(7, as_context=True)
    for parents in (torch.tensor([-1, 0, 0, 1, 1, 2]), torch.tensor([3, 5, 6]), torch.tensor([8])) if tree else ():
        y = torch.randn(1, len(parents), h, generator=g, dtype=dtype)
        pos, mask, anc, depth = cache.tree_inputs(parents, dtype)
        outs.append(blk(y, pos, mask, cache))
        cache.commit_forward(len(parents), as_context=False, anc=anc, depth=depth)
    return outs, cache, x


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("llama", 4), ("llama", 1), ("llama_bias", 2),
                                             ("llama_head_dim", 2), ("mistral", 2), ("qwen2", 2)])
def test_lean_equals_transformers_layer(family, kv_heads):
    blk = block_for(family, kv_heads)
    assert blk.lean_ok
    ref, ref_cache, _ = run(blk, lean=False)
    got, got_cache, _ = run(blk, lean=True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    n = ref_cache.length
    torch.testing.assert_close(got_cache.keys[..., :n, :], ref_cache.keys[..., :n, :], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_cache.values[..., :n, :], ref_cache.values[..., :n, :], rtol=1e-12, atol=1e-12)


def test_eagle_first_layer_without_input_norm_and_float32():
    blk = block_for("llama", eagle=True, layers=1, dtype=torch.float32)
    assert isinstance(blk.layers[0].input_layernorm, torch.nn.Identity) and blk.lean_ok
    ref, _, _ = run(blk, lean=False, dtype=torch.float32)
    got, _, _ = run(blk, lean=True, dtype=torch.float32)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_gradients_match():
    """Gradients through the project's KV cache (a context forward: the preallocated cache is written in place,
    so later segments would overwrite what autograd saved; the trainer's own cache is tested below)."""
    blk = block_for("qwen2")
    grads = []
    for lean in (False, True):
        blk.zero_grad()
        outs, _, x = run(blk, lean=lean, grad=True, tree=False)
        sum(o.pow(2).sum() for o in outs).backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in blk.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 10
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_a_planted_rotary_bug_fails(monkeypatch):
    """The comparison above can fail: a rotary half-turn with the wrong sign is caught."""
    blk = block_for("llama")
    ref, _, _ = run(blk, lean=False)
    monkeypatch.setattr(lean_layer, "_rotate_half", lambda x: torch.cat((x[..., x.shape[-1] // 2:],
                                                                          -x[..., :x.shape[-1] // 2]), dim=-1))
    got, _, _ = run(blk, lean=True)
    assert not torch.allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)


def test_a_planted_kv_head_order_bug_fails(monkeypatch):
    """Grouped-query heads must serve query heads in transformers' order (kv head j -> query heads j*g..): a tiled
    repeat (kv head j -> query heads j, j + kv, ...) is caught by the comparison."""
    blk = block_for("llama", kv_heads=2)
    ref, _, _ = run(blk, lean=False)
    monkeypatch.setattr(lean_layer, "_repeat_kv", lambda x, g: x.repeat(1, g, 1, 1))
    got, _, _ = run(blk, lean=True)
    assert not torch.allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)


def test_trainer_batches_autocast_and_dropout_match():
    """The heads' trainer runs the lean path too: batch 3 through the unrolled training-time test (its own
    StepCache), with bf16 autocast and with train-mode dropout (same seed), gives the transformers path's outputs
    and gradients."""
    from draft.eagle import EagleHead
    from draft.train.objective import unrolled_forward
    cfg = config("llama")
    cfg.attention_dropout = 0.3
    torch.manual_seed(0)
    head = EagleHead(cfg).float()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 97, (3, 9), generator=g)
    feats = torch.randn(3, 9, 64, generator=g)
    for autocast, train in ((False, False), (True, False), (False, True)):
        head.train(train)
        results = []
        for lean in (False, True):
            set_lean(head, lean)
            head.zero_grad()
            torch.manual_seed(5)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                outs = list(unrolled_forward(head, tokens, feats, 3))
            loss = sum(o.float().pow(2).sum() for o in outs)
            loss.backward()
            results.append([o.detach().float() for o in outs] + [p.grad.clone() for p in head.parameters()
                                                                  if p.grad is not None])
        assert len(results[0]) == len(results[1]) > 3
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_unsupported_layers_keep_the_transformers_path():
    blk = block_for("llama")
    blk.layers[1].self_attn.q_norm = torch.nn.Identity()       # e.g. a Qwen3-style query norm
    assert not lean_layer.lean_supported(blk.layers[1])
    fresh = LayerBlock(config("llama"), 1)
    assert fresh.lean_ok and fresh.lean
    assert set_lean(blk, True) == 0 and not blk.lean
    assert not lean_layer.lean_supported(torch.nn.Linear(2, 2))
    eager = LayerBlock(config("llama"), 1)
    eager.layers[0].self_attn.config._attn_implementation = "eager"    # another backend: its own semantics
    assert set_lean(eager, True) == 0
    # and the forward really takes the transformers path then
    calls = []
    real = lean_layer.lean_forward
    import model.layers as layers_mod
    layers_mod.lean_forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        run(block_for("llama"), lean=False)
        assert calls == []
        run(block_for("llama"), lean=True)
        assert len(calls) == 2 * 4       # 2 layers x 4 forwards
    finally:
        layers_mod.lean_forward = real


def test_quantized_projections_keep_the_transformers_path():
    """A subclass of nn.Linear (bitsandbytes' quantized linears) has its own forward: never run it as F.linear."""
    class QuantLinear(torch.nn.Linear):
        pass
    blk = block_for("llama")
    old = blk.layers[0].mlp.up_proj
    q = QuantLinear(old.in_features, old.out_features, bias=False).to(torch.float64)
    blk.layers[0].mlp.up_proj = q
    assert blk.lean       # decided at construction ...
    blk.refresh_lean()    # ... and re-checked after modules were swapped (model.stage_model does it after quant)
    assert not blk.lean_ok and not blk.lean and set_lean(blk, True) == 0


def test_run_key_reaches_stages_and_head(tmp_path):
    """``model.lean_layers`` switches both the verification stages and rank 0's head."""
    from config.run_config import DEFAULT, apply_overrides
    from model.split import split_checkpoint
    from pipeline.build import load_rank_stage, make_drafter
    from tests.helpers import tiny_llama
    root = tmp_path / "stages"
    split_checkpoint(tiny_llama(tmp_path / "full", layers=2, dtype=torch.float64), root, [0, 1, 1], progress=False)
    for on in (True, False):
        cfg = apply_overrides(DEFAULT, [f"model.lean_layers={str(on).lower()}", "draft.sources=eagle",
                                        "model.head_dir=untrained"])
        stage = load_rank_stage(cfg, root, 1, 3, torch.float64, "cpu")
        assert stage.block.lean is on
        rank0 = load_rank_stage(cfg, root, 0, 3, torch.float64, "cpu")
        drafter = make_drafter(cfg, root, rank0, torch.float64, "cpu")
        assert drafter.head.block.lean is on


def test_layerbench_times_every_call_both_ways(tmp_path, capsys):
    """``pipeline.tools.layerbench`` on a tiny split: a row per call, both settings, JSON written; bad input is
    one line and exit 2."""
    import json

    from model.split import split_checkpoint
    from pipeline.tools.layerbench import main
    from tests.helpers import tiny_llama
    root = tmp_path / "stages"
    split_checkpoint(tiny_llama(tmp_path / "full", layers=2), root, [0, 1, 1], progress=False)
    out = tmp_path / "lb.json"
    assert main(["--blocks", "1", "--repeat", "2", "--ctx", "8", "--json", str(out), f"model.stage_dir={root}",
                 "model.head_dir=untrained", "tree.init_total_token=20", "tree.expand_total_token=16"]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    names = [r["call"] for r in rows]
    assert names[:2] == ["stage step, 1 row (1 layers)", "stage step, 16 rows (1 layers)"]
    assert {"draft head forward, 10 rows", "expand (2 levels)", "commit 3 tokens"} <= set(names)
    assert all(r["transformers_ms"] > 0 and r["lean_ms"] > 0 for r in rows)
    assert text.count("\n| ") == len(rows) + 1   # the header row, then one per call
    assert main(["--stage", "5", f"model.stage_dir={root}"]) == 2
    assert capsys.readouterr().err.strip() == f"layerbench: error: --stage 5: {root} has stages 1..2"
    assert main(["tree.nope=1", f"model.stage_dir={root}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("layerbench: error:") and "\n" not in err
    assert main([f"model.stage_dir={root}", "osd.enabled=true"]) == 2
    assert capsys.readouterr().err.strip().startswith("layerbench: error: osd.enabled")
