"""Confidence-shaped trees wired into the drafters (``draft.tree_shape=confidence``, :class:`draft.shape.TreeShape`):
the EAGLE-2 search with the shape hook builds exactly the pure rule's tree (:func:`draft.shape.shaped_tree`) and
EAGLE-2's tree at ``cover = 1``; the keys' one-line errors; the exact sampling law of every tree mode with shaped
trees (alone and merged with the suffix source), and greedy output = HF through the in-process ring (stories260K)
in naive, pruned, continuous and pipedec. Each check has a planted bug that must fail."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import draft.drafter as drafter_mod
from config.run_config import DEFAULT, ConfigError, apply_overrides
from config.errors import UserError
from draft.merged import MergedDrafter
from draft.shape import EAGLE2, TreeShape, install_shape
from draft.tree import beam_frontier
from tests.helpers import STORIES, check_tree, shaped_tree
from tests.test_sampling import V, MarkovDrafter, make_world


def markov(seed: int, shape: TreeShape | None = None, scale: float = 2.0) -> MarkovDrafter:
    g = torch.Generator().manual_seed(seed)
    d = MarkovDrafter(torch.randn(V, V, generator=g) * scale)
    d.table = d.table.double()             # float64 sums: the same rounding as the pure rule's (ties aside)
    if shape is not None:
        d.tree_shape = shape
    return d


def pure_expander(d: MarkovDrafter, root: int, k: int):
    """The pure rule's ``expand`` over a Markov drafter's table (a node's law depends on its token only)."""
    def expand(nodes, tokens, parents):
        rows = [d.table[root if n < 0 else tokens[n]].double() for n in nodes]
        s, t = torch.topk(torch.stack(rows), k, dim=-1)
        return s, t
    return expand


def same(a, b) -> bool:
    return (a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
            and torch.allclose(a.scores.double(), b.scores.double(), atol=1e-6))


def paths(t) -> set[tuple[int, ...]]:
    out, par, tok = [()], t.parents.tolist(), t.tokens.tolist()
    for i in range(1, len(t)):
        out.append(out[par[i]] + (tok[i],))
    return set(out)


def same_nodes(a, b) -> bool:
    """The same token paths with the same scores (float32 vs float64 sums may order exact ties differently)."""
    return (paths(a) == paths(b) and len(a) == len(b)
            and torch.allclose(a.scores.double().sort().values, b.scores.double().sort().values, atol=1e-5))


CASES = [(seed, root, total, depth, k, cover) for seed in (0, 1, 2) for root in range(0, V, 3)
         for total, depth, k in ((7, 2, 3), (16, 3, 4), (30, 4, 5)) for cover in (0.5, 0.9)]


def wired_matches_pure(cases=CASES) -> int:
    """How many cases the drafter's shaped search equals :func:`shaped_tree` on (rows: the search's head rows
    plus the root's, as ``shaped_tree`` counts them); asserts the rows never exceed the budget."""
    ok = 0
    for seed, root, total, depth, k, cover in cases:
        d = markov(seed, TreeShape("confidence", cover))
        rows = []
        real = d.tree_forward
        d.tree_forward = lambda tok, f, p: (rows.append(tok.numel()), real(tok, f, p))[1]
        ours = d.grow_tree_with_inputs(root, d.start([root], root, None), total, depth, k)[0]
        check_tree(ours)
        assert sum(rows) <= depth * k and len(ours) <= total
        ref = shaped_tree(root, pure_expander(d, root, k), total, 2 * (depth + 1), k, cover, rows=1 + depth * k)
        ok += same_nodes(ours, ref)
    return ok


def test_wired_search_is_the_pure_rule():
    assert wired_matches_pure() == len(CASES)


def test_wired_planted_bug_fails(monkeypatch):
    """The hook calling EAGLE-2's beam instead of the shaped frontier must be seen."""
    monkeypatch.setattr(drafter_mod, "pick_frontier", lambda s, a, b, w, c, r=0: beam_frontier(s, w))
    with pytest.raises(AssertionError):
        test_wired_search_is_the_pure_rule()


@pytest.mark.parametrize("seed,total,depth,k", [(0, 7, 2, 3), (1, 16, 3, 4), (2, 30, 4, 5), (3, 60, 5, 8)])
def test_cover_one_at_eagle2_depth_is_eagle2(seed, total, depth, k):
    for root in range(V):
        base, sh = markov(seed), markov(seed, TreeShape("confidence", 1.0, max_depth=depth + 1))
        a = base.grow_tree(root, base.start([root], root, None), total, depth, k)
        b = sh.grow_tree(root, sh.start([root], root, None), total, depth, k)
        assert same(a, b), (seed, root)


def test_confident_draft_goes_deeper_within_the_budget():
    """A peaked draft: the shaped tree is deeper than EAGLE-2's at the same node budget and no more head rows."""
    d = markov(4, TreeShape("confidence", 0.9), scale=6.0)
    e = markov(4, scale=6.0)
    a = e.grow_tree(0, e.start([0], 0, None), 16, 3, 4)
    b = d.grow_tree(0, d.start([0], 0, None), 16, 3, 4)
    assert len(a) == len(b) == 16 and int(b.depths.max()) > int(a.depths.max())


def test_extend_tree_with_a_shape_stays_a_valid_tree():
    for seed in range(3):
        d = markov(seed, TreeShape("confidence", 0.6))
        h = d.start([0], 0, None)
        tree, inputs = d.grow_tree_with_inputs(0, h, 7, 2, 3)
        grown, ins = d.extend_tree(tree, inputs, h, 3, 3, 6)
        check_tree(grown)
        assert len(grown) <= len(tree) + 6 and ins.shape[0] == len(grown)
        assert grown.tokens[:len(tree)].tolist() == tree.tokens.tolist()


# ---------------------------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["draft.tree_shape=wide", "draft.shape_cover=0", "draft.shape_cover=1.5",
                                 "draft.shape_max_depth=-1", "draft.shape_rows=-2"])
def test_bad_values_are_one_line_errors(bad):
    with pytest.raises(ConfigError) as e:
        apply_overrides(DEFAULT, [bad])
    assert issubclass(ConfigError, UserError) and "\n" not in str(e.value) and bad.split("=")[0] in str(e.value)


def test_keys_reach_every_source():
    cfg = apply_overrides(DEFAULT, ["draft.tree_shape=confidence", "draft.shape_cover=0.8", "draft.shape_max_depth=9",
                                    "draft.shape_rows=40"])
    shape = TreeShape.from_config(cfg.draft)
    assert shape == TreeShape("confidence", 0.8, 9, 40) and shape.levels(5) == 9 and shape.row_budget(5, 10) == 40
    assert TreeShape("confidence").levels(5) == 12 and TreeShape("confidence").row_budget(5, 10) == 50
    assert EAGLE2.levels(5) == 6 and not EAGLE2.shaped
    m = MergedDrafter([markov(0), markov(1)], ["eagle", "eagle"])
    install_shape(m, shape)
    assert m.tree_shape == shape and all(s.tree_shape == shape for s in m.sources)
    assert markov(2).tree_shape == EAGLE2                     # the class default is untouched


# ---------------------------------------------------------------------------------------------------------------
# The exact sampling law with shaped trees (the harness of tests/test_sampling.py)
# ---------------------------------------------------------------------------------------------------------------

def _shaped_drafter(det, with_suffix: bool):
    d = MarkovDrafter(det)
    d.tree_shape = TreeShape("confidence", 0.6)
    if not with_suffix:
        return d
    from tests.test_suffix import _suffix_world
    m = MergedDrafter([d, _suffix_world()], ["eagle", "suffix"])
    install_shape(m, d.tree_shape)
    return m


@pytest.mark.parametrize("mode,world,temp,top_p,overrides,with_suffix", [
    ("naive", 3, 1.0, 1.0, {}, False),
    ("naive", 3, 0.7, 0.9, {"tree.top_k": 2}, True),
    ("continuous", 3, 1.0, 0.9, {"tree.expand_topk": 2, "tree.expand_total_token": 4, "tree.first_levels": 0}, False),
    ("continuous", 3, 1.0, 1.0, {"tree.expand_topk": 2, "tree.expand_total_token": 4, "tree.init_depth": 3}, True),
    ("pruned", 3, 1.3, 1.0, {}, False),
])
def test_exact_law_with_shaped_trees(mode, world, temp, top_p, overrides, with_suffix):
    from tests.multidraft_common import assert_merged_law
    from tests.test_sampling import BranchingSampler
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(temp, top_p, 0, 2)
    drafter = _shaped_drafter(det, with_suffix)
    eagle = drafter if not with_suffix else drafter.sources[0]
    differs = Counter()
    real_grow = eagle._search                  # the search behind grow_tree and grow_tree_with_outputs

    def grow(root, h, total, depth, k, with_rows):   # record that the shape changed the tree somewhere
        out = real_grow(root, h, total, depth, k, with_rows)
        ref = markov_like(eagle).grow_tree_with_outputs(root, h, total, depth, k)[0]
        differs[not same(out[0], ref)] += 1
        return out
    eagle._search = grow
    real_extend = drafter.extend_tree

    def extend(*a):                            # ... or an incremental expansion (continuous)
        out = real_extend(*a)
        drafter.tree_shape = EAGLE2
        ref = real_extend(*a)
        drafter.tree_shape = eagle.tree_shape
        differs[not same(out[0], ref[0])] += 1
        return out
    drafter.extend_tree = extend
    assert_merged_law(mode, world, target, drafter, sampler, overrides)
    assert differs[True] > 0, "the shape never changed a tree: the test would not see it"


def markov_like(d: MarkovDrafter) -> MarkovDrafter:
    """The same Markov draft with EAGLE-2's fixed beam."""
    e = MarkovDrafter(torch.zeros(V, V))
    e.table = d.table
    return e


def test_exact_law_with_shaped_trees_catches_a_planted_bug(monkeypatch):
    from tests.multidraft_common import make_merged_runner
    from tests.test_sampling import BranchingSampler, _broken_walk, exact_law, target_law, total_variation
    target, det = make_world(11, "target")
    monkeypatch.setattr("pipeline.modes.naive.walk_tree", _broken_walk("no_renorm", det))
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    law, _ = exact_law(make_merged_runner("naive", 3, target, _shaped_drafter(det, True), sampler, 2, {}), sampler)
    assert total_variation(law, target_law(sampler, target, 2)) > 0.02


# ---------------------------------------------------------------------------------------------------------------
# Greedy output = HF generate through the in-process ring (stories260K, a real tiny LLaMA)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not STORIES.is_dir(), reason="../shared is not available")
@pytest.mark.parametrize("sources,extra", [("eagle,lookup", []),
                                           ("eagle,suffix", ["draft.suffix_max_depth=12", "draft.shape_cover=0.8"])])
def test_every_mode_with_shaped_trees_equals_hf(tmp_path, sources, extra):
    from transformers import AutoTokenizer

    from model.split import split_checkpoint
    from pipeline.inprocess import run_threaded
    from tests.helpers import hf_greedy
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 3, 2], progress=False)
    tok = AutoTokenizer.from_pretrained(STORIES)
    prompts = [tok("Once upon a time, there was a little girl named Lily.")["input_ids"],
               tok("Tom had a red ball. Tom had a red ball. Tom")["input_ids"]]
    modes = ["naive", "pruned", "continuous", "pipedec"]
    over = ["max_new_tokens=24", "dtype=float32", f"draft.sources={sources}", "draft.tree_shape=confidence", *extra]
    res = run_threaded(stages, prompts, modes, over, {2}, f"oracle@1.5:{STORIES}", dtype=torch.float32)
    for mode, rows in res.items():
        for p, r in zip(prompts, rows):
            assert r.output_ids == hf_greedy(STORIES, p, 24, {2}, torch.float32), (sources, mode)
