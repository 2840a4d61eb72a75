"""Pure tree functions of several drafters: ``merge_sources`` (union by token path, best-score budget, sampled
proposals kept whole), ``merge_trees``/``reroot`` carrying proposals, score scales.
"""
from __future__ import annotations

import pytest
import torch

from config.run_config import ConfigError, DEFAULT, apply_overrides
from draft.lookup import LookupDrafter
from draft.merged import MergedDrafter, SourceError
from draft.tree import DraftTree, keep_indices_for, merge_sources, merge_trees, proposal_lists, reroot
from tests.helpers import check_tree, select_top_nodes
from tests.multidraft_common import path_to, tree


def test_merge_sources_union_best_score_and_budget():
    a = tree([5, 1, 2, 3], [-1, 0, 0, 1], [0, -0.1, -0.5, -0.3])          # 5 -> 1 -> 3, 5 -> 2
    b = tree([5, 2, 4, 7], [-1, 0, 1, 0], [0, -0.2, -0.4, -2.0])          # 5 -> 2 -> 4, 5 -> 7
    m = merge_sources([a, b], 10)
    check_tree(m)
    paths = {tuple(m.tokens[path_to(m, i)].tolist()): float(m.scores[i]) for i in range(len(m))}
    assert set(paths) == {(5,), (5, 1), (5, 2), (5, 1, 3), (5, 2, 4), (5, 7)}
    assert paths[(5, 2)] == pytest.approx(-0.2)             # best of -0.5 (a) and -0.2 (b)
    assert m.proposals is None                              # deterministic sources: a plain tree
    assert m.scores.tolist() == sorted(m.scores.tolist(), reverse=True)
    cut = merge_sources([a, b], 4)                          # root + the 3 best: 1, 2, 1->3
    assert {tuple(cut.tokens[path_to(cut, i)].tolist()) for i in range(len(cut))} == {(5,), (5, 1), (5, 2), (5, 1, 3)}
    check_tree(cut)
    with pytest.raises(ValueError):
        merge_sources([a, tree([6], [-1], [0])], 10)


def test_score_scale_calibrates_a_source_before_the_merge():
    """draft.ssm_score_scale: a source's log-scores times c > 0 keep its own order and the path monotonicity, and
    change only which source's nodes win the shared budget."""
    from draft.merged import scale_scores
    eagle = tree([5, 1, 3], [-1, 0, 1], [0, -0.7, -1.0])                 # 5 -> 1 -> 3
    ssm = tree([5, 2, 4], [-1, 0, 1], [0, -0.3, -0.6])                   # 5 -> 2 -> 4 (over-confident)
    paths = lambda m: {tuple(m.tokens[path_to(m, i)].tolist()) for i in range(len(m))}
    assert paths(merge_sources([eagle, ssm], 3)) == {(5,), (5, 2), (5, 2, 4)}
    scaled = scale_scores(ssm, 3.0)
    assert scaled.scores.tolist() == pytest.approx([0, -0.9, -1.8]) and scaled.tokens.tolist() == ssm.tokens.tolist()
    assert paths(merge_sources([eagle, scaled], 3)) == {(5,), (5, 1), (5, 2)}
    assert scale_scores(ssm, 1.0) is ssm
    with pytest.raises(ConfigError):
        apply_overrides(DEFAULT, ["draft.ssm_score_scale=0"])
    with pytest.raises(SourceError):
        MergedDrafter([LookupDrafter(10)], score_scales=[1.0, 2.0])


def test_a_students_own_calibration_is_the_default_scale(tmp_path):
    """draft.ssm_score_scale=-1 (default) takes merge_score_scale from the student's config.json; a value given
    on the command line wins; a bad stored value is one clear error."""
    import json
    from draft.merged import build_sources
    from tests.helpers import tiny_llama
    path = tiny_llama(tmp_path / "ssm", seed=4, layers=1, dtype=torch.float64)
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "merge_score_scale": 2.5}))

    def scales(over):
        cfg = apply_overrides(DEFAULT, [f"draft.sources=lookup,ssm:{path}", *over])
        return build_sources(cfg, 100, None, torch.float64, "cpu").score_scales
    assert scales([]) == [1.0, 2.5]
    assert scales(["draft.ssm_score_scale=3"]) == [1.0, 3.0]
    (path / "config.json").write_text(json.dumps({**conf, "merge_score_scale": "high"}))
    with pytest.raises(SourceError, match="merge_score_scale"):
        scales([])


def test_merge_sources_keeps_every_sampled_draw_and_reserves_their_budget():
    q1, q2 = torch.full((8,), 1 / 8, dtype=torch.float64), torch.full((8,), 1 / 8, dtype=torch.float64)
    det = tree([5, 1, 2, 3, 4], [-1, 0, 0, 0, 0], [0, -0.1, -0.2, -0.3, -0.4])
    # a sampled source that drew token 1 twice and token 6 once (one node per token, three proposals)
    smp = tree([5, 1, 6], [-1, 0, 0], [0, -5.0, -6.0], proposals=[[(1, q1), (2, q2), (1, q2)], [], []])
    m = merge_sources([det, smp], 5)                        # budget 4 = 3 sampled proposals + 1 deterministic
    check_tree(m)
    toks = m.tokens.tolist()
    assert sorted(toks[1:]) == [1, 6]                       # 2,3,4 lose to the reservation, 6 survives anyway
    root_list = m.proposals[0]
    assert [toks[c] for c, q in root_list] == [1, 1, 6, 1]  # det first (source order), then draws in order
    assert [q is None for _, q in root_list] == [True, False, False, False]
    # the same draws always take the same budget, whatever their values (value-independent selection)
    smp2 = tree([5, 7, 0, 3], [-1, 0, 0, 0], [0, -1.0, -1.0, -1.0], proposals=[[(1, q1), (2, q1), (3, q1)], [], [], []])
    assert len(merge_sources([det, smp2], 5)) - 1 == 4


def test_merge_trees_and_reroot_carry_proposals():
    q = torch.full((8,), 1 / 8, dtype=torch.float64)
    t = tree([5, 1, 2, 3], [-1, 0, 1, 1], [0, -1, -2, -2], proposals=[[(1, q)], [(2, q), (3, None)], [], []])
    extra = tree([1, 2, 4], [-1, 0, 0], [0, -1, -1])                           # rooted at node 1's token
    r = reroot(t, keep_indices_for(t, [0], 1), 1)
    assert r.tokens.tolist() == [1, 2, 3] and r.proposals == [[(1, q), (2, None)], [], []]
    m, n_new = merge_trees(r, extra)
    assert n_new == 1 and m.tokens.tolist() == [1, 2, 3, 4]
    assert m.proposals[0] == [(1, q), (2, None), (1, None), (3, None)]          # appended, duplicate kept
    assert proposal_lists(extra) == [[(1, None), (2, None)], [], []]
    plain, _ = merge_trees(tree([1, 2], [-1, 0], [0, -1]), extra)
    assert plain.proposals is None


def _random_tree(rng, root: int, n: int, vocab: int):
    """A random deterministic tree (ancestors first, distinct siblings, scores never rising along a path, many
    equal scores, some -inf), best first as select_top_nodes orders it."""
    toks, pars, scores, seen = [], [], [], set()
    for _ in range(n):
        p = rng.randrange(-1, len(toks))
        t = rng.randrange(vocab)
        if (p, t) in seen:
            continue
        seen.add((p, t))
        base = 0.0 if p < 0 else scores[p]
        toks.append(t)
        pars.append(p)
        scores.append(base + rng.choice([0.0, -0.5, -0.5, -1.0, float("-inf")]))
    if not toks:
        return DraftTree.single(root)
    return select_top_nodes(root, torch.tensor(toks), torch.tensor(pars), torch.tensor(scores, dtype=torch.float64),
                            len(toks) + 1)


@pytest.mark.parametrize("seed", range(30))
def test_deterministic_merge_is_the_general_rule(seed):
    """merge_sources on trees without proposal lists (the union's inline deterministic update, one sort) gives exactly
    the tree of the rule through proposal lists, which it takes when the same trees carry their proposal lists (q None: the same
    deterministic proposals): tokens, parents, scores (bitwise) and depths, for random trees with shared paths,
    equal scores and -inf nodes, under budgets that cut and that do not (at least two trees proposing: one alone
    takes merge_sources' as-is path); a planted bug fails it (below)."""
    import random
    from dataclasses import replace
    rng = random.Random(seed)
    trees = [_random_tree(rng, 5, rng.randrange(2, 25), 6) for _ in range(rng.randrange(2, 4))]
    if sum(len(t) > 1 for t in trees) < 2:      # one live tree takes merge_sources' own as-is path: not this one
        trees.append(_random_tree(rng, 5, 8, 3))
    for total in (1, 2, 4, 9, 40):
        fast = merge_sources(trees, total)
        general = merge_sources([replace(t, proposals=proposal_lists(t)) for t in trees], total)
        assert fast.proposals is None and general.proposals is None
        for a, b in ((fast.tokens, general.tokens), (fast.parents, general.parents), (fast.scores, general.scores),
                     (fast.depths, general.depths)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        check_tree(fast)


def test_deterministic_merge_planted_bug_fails(monkeypatch):
    """The comparison above can fail: a planted variant of the union's deterministic update (a tree without proposal
    lists) that keeps ``-inf`` nodes (the rule drops them: no deterministic score) differs from the rule through the
    proposal lists on some random trees."""
    import random
    from dataclasses import replace
    import draft.tree as T
    real = T._union

    def planted(trees, root):
        nodes, parents, best_det, sampled, maps, n_sampled = real(trees, root)
        if all(t.proposals is None for t in trees):
            best_det = [-1e300 if b == float("-inf") else b for b in best_det]
        return nodes, parents, best_det, sampled, maps, n_sampled
    differs = 0
    monkeypatch.setattr(T, "_union", planted)
    for seed in range(30):
        rng = random.Random(seed)
        trees = [_random_tree(rng, 5, rng.randrange(2, 25), 6) for _ in range(3)]
        a = merge_sources(trees, 40)
        b = merge_sources([replace(t, proposals=proposal_lists(t)) for t in trees], 40)
        differs += len(a) != len(b) or not torch.equal(a.tokens, b.tokens)
    assert differs > 0
