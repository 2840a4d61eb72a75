"""Static-shape forwards (model/graphs.py, draft/static_head.py; run key ``model.graphs``) on the CPU.

The CUDA-graph executor needs a GPU (tests/gpu/test_graphs_cuda.py); here the same padded shapes run eagerly (the
"twin", ``eager``) and through the recorded-closure executor (``replay``), which keeps static input buffers and a
static output exactly as a graph does, so copy-in / replay / copy-out are exercised. Checked:

* the pure rules: bucket choice, the static mask (a real row sees exactly what the dynamic mask lets it see, a
  padding row only its own slot), the slots, the run key's values and its one-line errors;
* a stage block: outputs and the committed KV entries equal the dynamic forward's (context chunks, tree segments,
  decisions in between);
* the drafter: the static path's draft trees (tokens, parents, scores, per-node inputs/outputs) equal the dynamic
  path's, for beam trees, expansion and merged sources;
* end to end: greedy output equals HF generate in ar, naive, pruned, continuous and pipedec with both executors on
  every stage and the draft head, and the static path did run;
* planted bugs that must fail: padding slots left visible to real rows, a skipped copy-in, a copy-out that returns
  the shared output buffer, padding rows written over real rows' slots.
"""
from __future__ import annotations

import pytest
import torch

import model.graphs as G
from config.run_config import DEFAULT, ConfigError, apply_overrides
from draft.static_head import StaticHead, head_buckets, static_head
from model.graphs import (StaticStage, make_executor, pick_bucket, resolve_executor, static_mask, static_slots)
from model.split import split_checkpoint
from pipeline.inprocess import run_threaded
from tests.helpers import STORIES, hf_greedy, tiny_llama, trees_match_up_to_ties
from tests.test_lean_layer import block_for

EXECUTORS = ["eager", "replay"]


# -- the pure rules ----------------------------------------------------------------------------------------------

def test_pick_bucket_and_slots():
    b = (1, 4, 8, 16)
    assert [pick_bucket(n, b) for n in (0, 1, 2, 4, 5, 16, 17)] == [None, 1, 4, 4, 8, 16, None]
    assert static_slots(7, 4, "cpu").tolist() == [7, 8, 9, 10]
    assert head_buckets((10, 10, 4), (1, 8, 16)) == (1, 4, 8, 10, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_static_mask_gives_real_rows_their_dynamic_view_and_padding_rows_only_themselves(dtype):
    from model.kv_cache import KVCache
    cache = KVCache(1, 1, 2, 32, dtype)
    cache.context_inputs(5, dtype)
    cache.commit_forward(5, as_context=True)
    pos, mask, anc, depth = cache.tree_inputs(torch.tensor([-1, 0]), dtype)     # two cached tree nodes
    cache.commit_forward(2, as_context=False, anc=anc, depth=depth)
    pos, mask, anc, depth = cache.tree_inputs(torch.tensor([-1, 0, 2, 1]), dtype)
    n, length, bucket = 4, cache.length, 8
    sm = static_mask(mask, n, bucket, length, cache.max_len)
    low = torch.finfo(dtype).min
    assert sm.shape == (1, 1, bucket, cache.max_len)
    assert torch.equal(sm[0, 0, :n, :length + n], mask[0, 0])                  # real rows: the dynamic view
    assert bool((sm[0, 0, :n, length + n:] == low).all())                       # ... and nothing past it
    for j in range(n, bucket):                                                  # padding rows: their own slot
        seen = (sm[0, 0, j] == 0).nonzero().flatten().tolist()
        assert seen == [length + j]
        assert bool((sm[0, 0, j, torch.arange(cache.max_len) != length + j] == low).all())
    with pytest.raises(ValueError):
        static_mask(mask, n, bucket, length, length + bucket - 1)               # no room for the bucket


def test_run_key_values_and_errors():
    assert [resolve_executor(s, "cpu") for s in ("auto", "on", "off", "eager", "replay", "compile")] == \
        [None, "eager", None, "eager", "replay", "compile"]
    assert resolve_executor("compile", "cuda") == "compile" and isinstance(make_executor("compile"), G.CompileExecutor)
    assert resolve_executor("on", "cuda") == "cuda" and resolve_executor("off", "cuda:1") is None
    assert resolve_executor("auto", "cuda") == ("cuda" if G.AUTO_ON_CUDA else None)
    cfg = apply_overrides(DEFAULT, ["model.graphs=on", "graph_buckets=2,8"])
    assert cfg.model.graphs == "on" and cfg.model.graph_buckets == "2,8"
    for bad, words in ((["model.graphs=yes"], "model.graphs='yes' is not valid; choose one of auto, on, off"),
                       (["model.graph_buckets=8,4"], "strictly increasing"),
                       (["model.graph_buckets=0,4"], "positive"), (["model.graph_buckets=a"], "e.g. 1,4,8")):
        with pytest.raises(ConfigError) as e:
            apply_overrides(DEFAULT, bad)
        assert words in str(e.value) and "\n" not in str(e.value)


# -- a stage block: static = dynamic ------------------------------------------------------------------------------

class _Stage(torch.nn.Module):
    """A stage model stand-in: a LayerBlock called as StageModel is (``model(x, positions, mask, cache)``)."""

    def __init__(self, block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, positions, mask, cache):
        return self.block(x, positions, mask, cache)


def _stage_run(stage, cache_len=64, device="cpu", dtype=torch.float64):
    """A 7-token context chunk, a 6-node tree segment, a decision keeping node 0 + its subtree (accepting node 0),
    3 more nodes, one node alone and a 2-token context after truncation: each forward's output and the cache."""
    blk = stage.model.block if isinstance(stage, StaticStage) else stage.block
    cache = blk.new_cache(cache_len, dtype, device)
    g = torch.Generator().manual_seed(1)
    h = blk.layers[0].self_attn.q_proj.in_features
    outs = []
    x = torch.randn(1, 7, h, generator=g, dtype=dtype).to(device)
    pos, mask = cache.context_inputs(7, dtype)
    outs.append(stage(x, pos, mask, cache))
    cache.commit_forward(7, as_context=True)
    for parents in (torch.tensor([-1, 0, 0, 1, 1, 2]), None, torch.tensor([0, 2, 3]), torch.tensor([4]), "ctx"):
        if parents is None:
            cache.apply_keep(torch.tensor([0, 1, 3, 4]), 1)
            continue
        if isinstance(parents, str):
            cache.truncate_tree()
            pos, mask = cache.context_inputs(2, dtype)
            outs.append(stage(torch.randn(1, 2, h, generator=g, dtype=dtype).to(device), pos, mask, cache))
            cache.commit_forward(2, as_context=True)
            continue
        y = torch.randn(1, len(parents), h, generator=g, dtype=dtype).to(device)
        pos, mask, anc, depth = cache.tree_inputs(parents, dtype)
        outs.append(stage(y, pos, mask, cache))
        cache.commit_forward(len(parents), as_context=False, anc=anc, depth=depth)
    return outs, cache


@pytest.mark.parametrize("executor", EXECUTORS)
def test_stage_static_forward_equals_dynamic(executor):
    ref_outs, ref_cache = _stage_run(_Stage(block_for("llama")))
    stage = StaticStage(_Stage(block_for("llama")), make_executor(executor), (1, 4, 8))
    outs, cache = _stage_run(stage)
    assert (stage.stats[8], stage.stats[4], stage.stats[1], stage.stats['dynamic']) == (2, 2, 1, 0)
    for a, b in zip(outs, ref_outs, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    n = cache.length
    assert n == ref_cache.length and cache.context_len == ref_cache.context_len
    torch.testing.assert_close(cache.keys[..., :n, :], ref_cache.keys[..., :n, :], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache.values[..., :n, :], ref_cache.values[..., :n, :], rtol=1e-12, atol=1e-12)


def test_stage_falls_back_to_dynamic_beyond_the_buckets_and_near_capacity():
    ref_outs, _ = _stage_run(_Stage(block_for("llama")), cache_len=15)
    stage = StaticStage(_Stage(block_for("llama")), make_executor("replay"), (1, 5))
    outs, _ = _stage_run(stage, cache_len=15)
    # dynamic: the 7-row chunk and the 6-row segment (no bucket), the 3 rows at 11 cached (11 + 5 > 15 slots)
    assert (stage.stats["dynamic"], stage.stats[1], stage.stats[5]) == (3, 1, 1)
    for a, b in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# -- the draft head: the same trees --------------------------------------------------------------------------------

def _random_drafter(seed: int = 0, std: float = 0.2, device="cpu", dtype=torch.float64):
    """A :class:`draft.drafter.Drafter` on a random EAGLE head (float64) whose attention is not so sharp that a key
    more or less goes unnoticed (tests.test_drafters' ``std=0.5`` head gives a visible padding key ~1e-300 weight)."""
    from transformers import LlamaConfig

    from draft.drafter import Drafter
    from draft.eagle import init_untrained_head
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      num_key_value_heads=2, num_hidden_layers=1)
    head = init_untrained_head(cfg, seed=seed).to(dtype).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    return Drafter(head.to(device), torch.nn.Linear(16, 40, bias=False).to(device, dtype), 128)


def _trees(executor, seed=0, device="cpu", dtype=torch.float64):
    """A beam tree with per-node inputs/outputs, an expansion of it, and a small tree of width 3 (padded to 4)."""
    d = _random_drafter(seed, device=device, dtype=dtype)
    if executor:
        d.static_head = static_head(d.head, executor, head_buckets((4,), (1, 8, 16, 32, 64)))
        assert isinstance(d.static_head, StaticHead)
    g = torch.Generator().manual_seed(1)
    prompt = [1, 5, 9, 13, 22, 7, 5, 9, 13, 30, 5, 9]
    h = d.start(prompt, 13, torch.randn(len(prompt), 16, generator=g, dtype=dtype).to(device))
    tree, inputs, outputs, known = d.grow_tree_with_outputs(13, h, 40, 5, 4)
    grown, grown_in = d.extend_tree(tree, inputs, h, 2, 4, 20)
    h2 = d.commit(torch.tensor([4, 6]), torch.randn(2, 16, generator=g, dtype=dtype).to(device))
    small = d.grow_tree(6, h2, 12, 3, 3)
    return [tree, grown, small], [inputs, outputs, known, grown_in], d.static_head


@pytest.mark.parametrize("executor", EXECUTORS)
def test_static_head_drafts_exactly_the_dynamic_trees(executor):
    ref_trees, ref_tensors, _ = _trees(None)
    trees, tensors, static = _trees(executor)
    assert static.stats[4] >= 8 and static.stats[64] == 1     # levels padded to the beam width, the re-feed to 64
    for a, b in zip(trees, ref_trees, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-12, atol=1e-12)
    for a, b in zip(tensors, ref_tensors, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_static_head_only_for_lean_eagle_heads():
    d = _random_drafter(0)
    assert static_head(d.head, None, (4,)) is None
    from model.layers import set_lean
    set_lean(d.head, False)
    assert static_head(d.head, "eager", (4,)) is None


# -- end to end ----------------------------------------------------------------------------------------------------

MODES = ["ar", "naive", "pruned", "continuous", "pipedec"]
PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    return full, split_checkpoint(full, root / "s3", [0, 2, 2], progress=False)


@pytest.fixture
def static_calls(monkeypatch):
    """Counts the static forwards that ran, by what they ran (a StageModel or an EagleHead)."""
    calls: dict[str, int] = {}
    run = G.StaticForward.run

    def counting(self, *args, **kw):
        name = type(getattr(self.body, "__self__", self.body)).__name__
        calls[name] = calls.get(name, 0) + 1
        return run(self, *args, **kw)
    monkeypatch.setattr(G.StaticForward, "run", counting)
    return calls


def _generate(tiny, graphs: str, modes=MODES, max_new=14):
    full, stages = tiny
    res = run_threaded(stages, PROMPTS, modes, ["max_new_tokens=%d" % max_new, "dtype=float64",
                                                "model.max_seq_len=256", f"model.graphs={graphs}"], {2}, None)
    return {m: [r.output_ids for r in rows] for m, rows in res.items()}


def _hf(tiny, max_new=14):
    return [hf_greedy(tiny[0], p, max_new, {2}, torch.float64) for p in PROMPTS]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_tree_modes_equal_hf_on_static_shapes(tiny, static_calls, executor):
    out = _generate(tiny, executor)
    ref = _hf(tiny)
    assert all(out[m] == ref for m in MODES), {m: out[m] for m in MODES if out[m] != ref}
    assert static_calls.get("StageModel", 0) > 100 and static_calls.get("EagleHead", 0) > 50, static_calls


def test_graphs_off_and_auto_on_cpu_run_no_static_forward(tiny, static_calls):
    _generate(tiny, "auto", modes=["continuous"], max_new=4)
    _generate(tiny, "off", modes=["continuous"], max_new=4)
    assert static_calls == {}


@pytest.mark.skipif(not STORIES.is_dir(), reason="../shared is not available")
def test_stories260k_tree_modes_equal_hf_on_static_shapes(tmp_path, static_calls):
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 3, 2], progress=False)
    prompts = [[1, 365, 147, 471, 263, 221], [1, 90, 250, 263, 93, 298, 27, 471]]
    res = run_threaded(stages, prompts, ["naive", "continuous", "pipedec"],
                       ["max_new_tokens=24", "dtype=float32", "model.max_seq_len=192", "model.graphs=replay"], {2},
                       None, dtype=torch.float32)
    for p, *rows in zip(prompts, *res.values()):
        ref = hf_greedy(STORIES, p, 24, {2}, torch.float32)
        assert all(r.output_ids == ref for r in rows)
    assert static_calls.get("StageModel", 0) > 0 and static_calls.get("EagleHead", 0) > 0


# -- planted bugs: each must break a test above ---------------------------------------------------------------------

def _visible_padding(mask, n, bucket, length, capacity):
    """Bug: the padding rows' slots left unmasked for the real rows."""
    out = static_mask(mask, n, bucket, length, capacity)
    out[0, 0, :n, length + n:length + bucket] = 0
    return out


def _slots_over_real_rows(length, bucket, device):
    """Bug: the rows written in reverse (padding rows land on the slots the real rows are committed at)."""
    return torch.arange(length + bucket - 1, length - 1, -1, device=device)


@pytest.mark.parametrize("where,bug", [("static_mask", _visible_padding), ("static_slots", _slots_over_real_rows)])
def test_planted_padding_bugs_break_equality(tiny, monkeypatch, where, bug):
    monkeypatch.setattr(G, where, bug)
    with pytest.raises(AssertionError):
        test_stage_static_forward_equals_dynamic("eager")
    with pytest.raises(AssertionError):
        test_static_head_drafts_exactly_the_dynamic_trees("eager")
    out = _generate(tiny, "eager", modes=["continuous", "naive"])
    assert out != {m: _hf(tiny) for m in ("continuous", "naive")}


@pytest.mark.parametrize("where,bug", [("copy_in", lambda bufs, xs: None), ("copy_out", lambda out: out)])
def test_planted_copy_bugs_break_the_recorded_path(monkeypatch, where, bug):
    monkeypatch.setattr(G, where, bug)
    with pytest.raises((AssertionError, ValueError)):   # stale frontier rows may also give the cache bad parents
        test_static_head_drafts_exactly_the_dynamic_trees("replay")
    if where == "copy_in":
        with pytest.raises(AssertionError):
            test_stage_static_forward_equals_dynamic("replay")


def test_graphbench_times_both_paths_and_checks_the_trees(tmp_path, capsys):
    """``pipeline.tools.graphbench`` on a tiny split: a row per call with both paths' times and operator counts,
    the same draft tree both ways, JSON written; bad input is one line and exit 2."""
    import json

    from pipeline.tools.graphbench import main
    root = tmp_path / "stages"
    split_checkpoint(tiny_llama(tmp_path / "full", layers=2), root, [0, 1, 1], progress=False)
    out = tmp_path / "gb.json"
    assert main(["--blocks", "1", "--repeat", "2", "--ctx", "8", "--executor", "replay", "--json", str(out),
                 f"model.stage_dir={root}", "model.head_dir=untrained", "tree.total_token=20", "tree.depth=3"]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    names = [r["call"] for r in data["rows"]]
    assert names == ["head forward, 10 rows", "draft tree, per level (3 levels)", "stage step, 1 row (1 layers)",
                     "stage step, 16 rows (1 layers)"]
    assert data["same_tree"] is True and data["executor"] == "replay" and "same draft tree: yes" in text
    assert all(r["dynamic_ms"] > 0 and r["static_ms"] > 0 and r["dynamic_ops"] > 0 for r in data["rows"])
    # a replayed graph dispatches none of its forward's operators: what is left is copy-in, padding and bookkeeping
    assert all(r["graph_ops"] < r["dynamic_ops"] < r["static_ops"] for r in data["rows"])
    assert main(["--stage", "5", f"model.stage_dir={root}"]) == 2
    assert capsys.readouterr().err.strip() == f"graphbench: error: --stage 5: {root} has stages 1..2"
    assert main(["--executor", "cuda", f"model.stage_dir={root}"]) == 2
    assert capsys.readouterr().err.strip() == "graphbench: error: --executor cuda needs --device cuda"


def test_launched_ranks_on_static_shapes_equal_hf(tiny, tmp_path):
    """The rank entry point (``pipeline.run`` through ``pipeline.build``) with ``model.graphs=replay`` on 3 CPU
    ranks: the tree modes equal HF generate (tests/test_e2e.py's helpers)."""
    from tests.test_e2e import _check_against_hf, _run
    full, stages = tiny
    rows = _run(3, stages, tmp_path / "o.jsonl", PROMPTS, 12, ("model.graphs=replay", "model.max_seq_len=512"),
                modes="naive,continuous,pipedec")
    _check_against_hf(rows, full, 12, {2}, torch.float64, 3 * len(PROMPTS))


@pytest.mark.parametrize("graphs,kind", [("off", None), ("auto", None), ("on", "eager"), ("replay", "replay")])
def test_build_installs_the_static_paths_from_the_run_key(tiny, graphs, kind):
    """``pipeline.build`` (what every rank entry point builds through) puts the stage worker and the EAGLE drafter
    on static shapes as ``model.graphs`` says (on a CPU: on = the eager twin; auto = off until measured on a GPU),
    and never an online-learning head."""
    from pipeline.build import load_rank_stage, make_drafter, make_stage_worker
    from pipeline.local_ring import LocalComm, LocalRing
    full, stages = tiny
    cfg = apply_overrides(DEFAULT, [f"model.stage_dir={stages}", f"model.graphs={graphs}", "draft.sources=eagle"])
    stage = load_rank_stage(cfg, stages, 1, 3, torch.float64, "cpu")
    worker = make_stage_worker(cfg, LocalComm(LocalRing(3), 1), stage, torch.float64, "cpu")
    drafter = make_drafter(cfg, stages, load_rank_stage(cfg, stages, 0, 3, torch.float64, "cpu"), torch.float64,
                           "cpu")
    for static in (worker.static, drafter.static_head):
        assert (static is None) if kind is None else (static.static.executor.kind == kind)
    if kind is not None:
        assert 10 in drafter.static_head.static.buckets and worker.static.static.buckets == (1, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_static_head_draws_the_same_sampled_trees(executor):
    """T > 0 (``draft.eagle_sample``): the sampled chains' tree forwards go through the static head too; the same
    seed draws the same tree, with the same proposal distributions, as the dynamic path."""
    trees = []
    for kind in (None, executor):
        d = _random_drafter(0)
        d.static_head = static_head(d.head, kind, head_buckets((4,), (1, 8, 16)))
        d.set_sampling(True, 1.0, seed=5)
        g = torch.Generator().manual_seed(1)
        prompt = [1, 5, 9, 13, 22, 7]
        h = d.start(prompt, 13, torch.randn(len(prompt), 16, generator=g, dtype=torch.float64))
        trees.append(d.grow_tree(13, h, 24, 5, 4))
        assert kind is None or d.static_head.stats[4] + d.static_head.stats[1] >= 4
    a, b = trees
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    for pa, pb in zip(a.proposals, b.proposals, strict=True):
        assert [v for v, _ in pa] == [v for v, _ in pb]
        for (_, qa), (_, qb) in zip(pa, pb):
            torch.testing.assert_close(qa, qb, rtol=1e-12, atol=1e-12)


# -- model.graphs=compile: torch.compile (inductor) of the same static bodies --------------------------------------
# Compiling costs ~15 s per graph on the shared 2-core host (warm inductor cache; the first compile of a fresh
# machine more), so these share module-scoped fixtures and one small configuration each.

COMPILE_TOL = 1e-5   # compiled vs eager float math: last bits (float32 rotary angles: ~3e-7 seen even in float64)


@pytest.fixture(scope="module")
def compiled_trees():
    """The drafter's trees, dynamic and through the compile executor (each level one compiled level_step)."""
    return _trees(None), _trees("compile")


def test_compile_head_drafts_the_dynamic_trees_up_to_ties(compiled_trees):
    (ref_trees, ref_tensors, _), (trees, tensors, static) = compiled_trees
    ex = static.static.executor
    assert isinstance(ex, G.CompileExecutor) and ex.stats["compiled"] >= 2 and ex.stats["calls"] >= 6
    assert ex.compile_s > 0 and static.stats[4] >= 8             # the levels ran on the compiled path
    for a, b in zip(trees, ref_trees, strict=True):
        assert trees_match_up_to_ties(b, a, COMPILE_TOL) is None
    if all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) for a, b in zip(trees, ref_trees)):
        for a, b in zip(tensors, ref_tensors, strict=True):   # same trees: same per-node inputs/outputs up to the tol
            torch.testing.assert_close(a, b, rtol=COMPILE_TOL, atol=COMPILE_TOL)


def test_tie_rule_accepts_only_near_ties():
    from draft.tree import DraftTree

    def tree(tokens, parents, scores):
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores, dtype=torch.float64))
    ref = tree([5, 1, 2, 3], [-1, 0, 0, 1], [0.0, -1.0, -1.5, -2.0])
    assert trees_match_up_to_ties(ref, ref, 1e-6) is None
    assert trees_match_up_to_ties(ref, tree([5, 1, 2, 3], [-1, 0, 0, 1], [0.0, -1.0, -1.5, -2.0 + 1e-7]), 1e-6) is None
    # candidates 2 and 9 tie at -1.5 within the tolerance: the compiled search took 9, both then diverge
    assert trees_match_up_to_ties(ref, tree([5, 1, 9, 4], [-1, 0, 0, 2], [0.0, -1.0, -1.5 + 5e-7, -1.7]), 1e-6) is None
    for bad in (tree([5, 1, 9, 3], [-1, 0, 0, 1], [0.0, -1.0, -1.4, -2.0]),      # a different token, no tie
                tree([5, 1, 2, 3], [-1, 0, 0, 2], [0.0, -1.0, -1.5, -2.1]),      # a different parent, no tie
                tree([5, 1, 2, 3], [-1, 0, 0, 1], [0.0, -1.0, -1.5, -2.001]),    # a score off by more than tol
                tree([5, 1, 2], [-1, 0, 0], [0.0, -1.0, -1.5])):                  # a node lost, no tie
        assert trees_match_up_to_ties(ref, bad, 1e-6) is not None


def test_planted_level_bug_breaks_the_tie_rule(monkeypatch):
    """A level step that ranks by slightly wrong log-probs (each row's second best raised by 1e-3) must fail the rule:
    run on the
    eager static twin, which runs the same level_step body as the compiled path (no compile: fast)."""
    import draft.static_head as SH
    ref_trees, _, _ = _trees(None)
    right = SH.target_topk

    def biased(lm_head, hidden, k):
        s, t = right(lm_head, hidden, k)
        return s + 1e-3 * (torch.arange(s.shape[-1]) == 1), t
    monkeypatch.setattr(SH, "target_topk", biased)
    trees, _, _ = _trees("eager")
    assert any(trees_match_up_to_ties(b, a, COMPILE_TOL) is not None for a, b in zip(trees, ref_trees))


def test_stage_compiled_forward_equals_dynamic():
    ref_outs, ref_cache = _stage_run(_Stage(block_for("llama")))
    stage = StaticStage(_Stage(block_for("llama")), make_executor("compile"), (4, 8))
    outs, cache = _stage_run(stage)
    ex = stage.static.executor
    assert (stage.stats[8], stage.stats[4], ex.stats["compiled"], ex.stats["calls"]) == (2, 3, 2, 3)
    for a, b in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=COMPILE_TOL, atol=COMPILE_TOL)
    n = cache.length
    torch.testing.assert_close(cache.keys[..., :n, :], ref_cache.keys[..., :n, :], rtol=COMPILE_TOL, atol=COMPILE_TOL)
    torch.testing.assert_close(cache.values[..., :n, :], ref_cache.values[..., :n, :], rtol=COMPILE_TOL,
                               atol=COMPILE_TOL)


@pytest.mark.skipif(not STORIES.is_dir(), reason="../shared is not available")
def test_stories260k_all_modes_equal_hf_compiled(tmp_path, static_calls):
    """Greedy output equals HF generate in every mode with model.graphs=compile (one stage of all 5 layers, one
    stage bucket: few graphs to compile). ``comm.timeout_s`` is raised: a rank compiling a bucket for longer than
    the 30 s default (a loaded host) looks dead to the others."""
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 5], progress=False)
    prompts = [[1, 365, 147, 471, 263, 221], [1, 90, 250, 263, 93, 298, 27, 471]]
    modes = ["ar", "naive", "pruned", "continuous", "pipedec"]
    res = run_threaded(stages, prompts, modes, ["max_new_tokens=16", "dtype=float32", "model.max_seq_len=160",
                                                "model.graphs=compile", "model.graph_buckets=16",
                                                "comm.timeout_s=600"], {2}, None,
                       dtype=torch.float32)
    for i, p in enumerate(prompts):
        ref = hf_greedy(STORIES, p, 16, {2}, torch.float32)
        assert all(res[m][i].output_ids == ref for m in modes), {m: res[m][i].output_ids for m in modes}
    assert static_calls.get("StageModel", 0) > 0 and static_calls.get("EagleHead", 0) > 0, static_calls
