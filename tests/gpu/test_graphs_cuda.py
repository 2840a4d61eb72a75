"""CUDA graphs of the static-shape forwards (model/graphs.py, draft/static_head.py; ``model.graphs=on``) against eager
on CUDA: the draft trees are identical and hidden states close, a stage block's outputs and committed KV entries
agree, and whole generations through CUDA-graph ranks equal HF ``generate`` on the same GPU. Skipped without CUDA
(tests/gpu/conftest.py); the CPU twins of these checks are tests/test_graphs.py.

``model.graphs=compile`` (torch.compile, ``mode="reduce-overhead"`` on CUDA) against eager too: the head's trees
(equal up to near-ties, ``tests/helpers.py: trees_match_up_to_ties``) and a stage block's outputs and KV entries.

Never run yet: the sessions that wrote it had no GPU (docs/gpu.md, "Static shapes and CUDA graphs").
"""
from __future__ import annotations

import pytest
import torch

from model.graphs import CompileExecutor, GraphExecutor, StaticStage, make_executor
from model.split import split_checkpoint
from tests.gpu.test_cuda import assert_equal_hf, report, run_cuda
from tests.helpers import STORIES, trees_match_up_to_ties
from tests.test_graphs import _Stage, _stage_run, _trees
from tests.test_lean_layer import block_for


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_draft_trees_graph_vs_eager_on_cuda(dtype, tol):
    ref_trees, ref_tensors, _ = _trees(None, device="cuda", dtype=dtype)
    for kind in ("eager", "cuda"):
        trees, tensors, static = _trees(kind, device="cuda", dtype=dtype)
        if kind == "cuda":
            assert isinstance(static.static.executor, GraphExecutor)
            assert static.static.executor.stats["recorded"] >= 2 and static.static.executor.stats["replayed"] >= 10
        for a, b in zip(trees, ref_trees, strict=True):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents), kind
        diffs = [float((a.double() - b.double()).abs().max()) for a, b in zip(tensors, ref_tensors, strict=True)]
        report(check=f"static head {kind} vs dynamic on cuda", dtype=str(dtype), max_abs_diff=max(diffs))
        assert max(diffs) < tol, (kind, diffs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_stage_block_graph_vs_eager_on_cuda(dtype, tol):
    ref_outs, ref_cache = _stage_run(_Stage(block_for("llama", dtype=dtype).cuda()), device="cuda", dtype=dtype)
    stage = StaticStage(_Stage(block_for("llama", dtype=dtype).cuda()), make_executor("cuda"), (1, 4, 8))
    outs, cache = _stage_run(stage, device="cuda", dtype=dtype)
    assert stage.static.executor.stats["recorded"] == 3       # buckets 8, 4, 1
    n = cache.length
    for a, b in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    torch.testing.assert_close(cache.keys[..., :n, :], ref_cache.keys[..., :n, :], rtol=tol, atol=tol)
    torch.testing.assert_close(cache.values[..., :n, :], ref_cache.values[..., :n, :], rtol=tol, atol=tol)


def test_draft_trees_compile_vs_eager_on_cuda():
    ref_trees, ref_tensors, _ = _trees(None, device="cuda", dtype=torch.float32)
    trees, tensors, static = _trees("compile", device="cuda", dtype=torch.float32)
    ex = static.static.executor
    assert isinstance(ex, CompileExecutor) and ex.stats["compiled"] >= 2 and ex.stats["calls"] >= 6
    for a, b in zip(trees, ref_trees, strict=True):
        assert trees_match_up_to_ties(b, a, 1e-4) is None
    same = all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) for a, b in zip(trees, ref_trees))
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(tensors, ref_tensors)) if same else None
    report(check="static head compile vs dynamic on cuda", same_trees=same, max_abs_diff=diff,
           compile_s=round(ex.compile_s, 1), graphs=ex.stats["compiled"])


def test_stage_block_compile_vs_eager_on_cuda():
    tol = 1e-4
    ref_outs, ref_cache = _stage_run(_Stage(block_for("llama", dtype=torch.float32).cuda()), device="cuda",
                                     dtype=torch.float32)
    stage = StaticStage(_Stage(block_for("llama", dtype=torch.float32).cuda()), make_executor("compile"), (1, 4, 8))
    outs, cache = _stage_run(stage, device="cuda", dtype=torch.float32)
    assert stage.static.executor.stats["compiled"] == 3       # buckets 8, 4, 1
    n = cache.length
    for a, b in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=tol, atol=tol)
    torch.testing.assert_close(cache.keys[..., :n, :], ref_cache.keys[..., :n, :], rtol=tol, atol=tol)
    torch.testing.assert_close(cache.values[..., :n, :], ref_cache.values[..., :n, :], rtol=tol, atol=tol)


@pytest.mark.skipif(not STORIES.is_dir(), reason="../shared is not available")
def test_stories260k_graph_ranks_equal_hf_on_cuda(tmp_path):
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 1, 1, 1, 2], progress=False)
    prompts = [[1, 365, 147, 471, 263, 221], [1, 90, 250, 263, 93, 298, 27, 471]]
    rows, _ = run_cuda(5, stages, tmp_path / "o.jsonl", prompts, 32, "float32", ("model.graphs=on",),
                       modes="ar,naive,continuous,pipedec")
    assert_equal_hf(rows, STORIES, 32, {2}, "float32", 4 * len(prompts), "stories260K/5/graphs")


def test_smollm2_graph_ranks_equal_hf_on_cuda(tmp_path):
    from tests.gpu.test_cuda import _smol_prompts
    from tests.helpers import DATA
    if not DATA.is_dir():
        pytest.skip("../shared/data is not available")
    full, stages, prompts, stop = _smol_prompts()
    rows, _ = run_cuda(5, stages, tmp_path / "o.jsonl", prompts[:3], 48, "float32", ("model.graphs=on",),
                       modes="ar,naive,continuous,pipedec")
    assert_equal_hf(rows, full, 48, stop, "float32", 4 * 3, "smollm2/5/graphs")
