"""Rank 0's turnaround off the chain (issue 41): two opt-in run keys that send before drafting.

``tree.root_first``: after a truncation the next round's root goes out alone at once, and the commit of the
accepted tokens and the first tree follow (``pipeline.modes.flowspec.StreamingMode.run_round``):

* in the decode loop the send of a new round's root precedes the commit that gives its draft output, and without
  the key it does not; the greedy output is the same;
* the exact law with the key is in tests/test_sampling.py (EXACT_CASES' ``tree.root_first`` case), greedy output
  against HF on stories260K below.

``tree.early_level``: after a verified step's re-root, the next expansion's first level is chosen from the
prefetched candidates (``draft.drafter.BeamTreeDrafter.append_prefetched_level``, no model call) and sent before the
commit and the rest of the expansion (``pipeline.modes.flowspec.ContinuousMode.send_early``, then
``commit_and_grow`` finishes it with the ``EarlyLevel`` as ``pre``).

* the rule: the appended level is exactly the beam the prefetched expansion feeds as its first level, best first;
  the finished tree holds the same nodes (token paths and scores) as the plain prefetched expansion whenever that
  one keeps its whole beam, and the early level comes first; a budget below the beam keeps its best nodes only;
* planted bugs fail that check: an ``EarlyLevel`` that names other candidates as the appended ones (they would be
  appended twice, or lost), and later levels fed at the wrong draft-cache slots;
* counted: choosing the level costs no draft-head forward and no log-prob call; finishing costs one of each
  (levels = 2), so the step's model calls are the prefetched step's, all after the send;
* in the decode loop (the real ContinuousMode against an in-process ring): the first ring send after a verified
  step comes before any draft-head forward of that step, and without the key it does not;
* greedy output equals HF with the key on in every mode (stories260K); the exact law is in tests/test_sampling.py
  (EXACT_CASES' ``tree.early_level`` case, which must see early levels).

``tree.early_whole`` (both on by default since docs/results.md §63): the
prefetch drafts the next expansion's second level too, below the likeliest new roots' beams
(``draft.drafter.level2_seeds``), and a covered step sends its whole expansion in one segment
(``BeamTreeDrafter.prefetch_expansion``, ``append_prefetched_expansion``): the rule against a plain-Python
reference; the whole expansion equal to the early level's finished tree on a context-free drafter, with three planted
bugs that fail it; its op counts; the decode loop; greedy output equal to HF on stories260K. Tests of the older keys
turn the new ones off explicitly.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.test_fuse_commit import _eagle_lookup, _markov, _OpCount


def _paths(tree, start: int = 0) -> list[tuple[tuple[int, ...], float]]:
    """Each node from ``start`` on as (its token path from the root, its score), sorted: a tree's nodes whatever
    their order."""
    out = []
    for i in range(start, len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.append((tuple(reversed(path)), round(float(tree.scores[i]), 6)))
    return sorted(out)


def _grown(levels: int, max_new: int, early: bool, plant=None):
    from tests.test_sampling import enc
    d = _markov()
    root = enc(4)
    tree, inputs = d.grow_tree_with_inputs(4, root, 9, 2, 3)
    tokens, feats = torch.tensor([2, 4]), torch.zeros(2, 1, dtype=torch.float64)
    pre = d.prefetch_leaves(tree, inputs, root, 3)
    if not early:
        return tree, None, d.commit_extend_tree(tokens, feats, tree, inputs, levels, 3, max_new, pre)[0]
    level, lin, rec = d.append_prefetched_level(tree, inputs, pre, 3, max_new)
    if plant is not None:
        rec = plant(rec)
    left = max_new - (len(level) - len(tree))
    return tree, level, d.commit_extend_tree(tokens, feats, level, lin, levels, 3, left, rec)[0]


@pytest.mark.parametrize("levels,max_new", [(2, 6), (3, 9), (2, 12), (2, 3)])
def test_early_level_is_the_beam_and_the_tree_holds_the_plain_expansions_nodes(levels, max_new):
    tree, level, early = _grown(levels, max_new, True)
    _, _, plain = _grown(levels, max_new, False)
    n = len(tree)
    beam = min(3, max_new)
    assert len(level) == n + beam
    assert early.tokens[:len(level)].tolist() == level.tokens.tolist()   # the level first, then the rest
    assert (early.parents[n:len(level)] < n).all()                        # children of the old tree's leaves
    sc = level.scores[n:].tolist()
    assert sc == sorted(sc, reverse=True)                                 # best first
    assert (early.parents[1:] < torch.arange(1, len(early))).all()       # ancestors-first
    assert len(early) == len(plain) == n + min(max_new, len(plain) - n)
    if max_new >= 6:     # the plain expansion keeps its whole beam here: the same nodes, another order
        assert _paths(early, n) == _paths(plain, n)
        assert early.tokens.tolist() != plain.tokens.tolist() or early.parents.tolist() == plain.parents.tolist()
    else:                # a budget below the beam plus its children: the early tree keeps the beam's best nodes
        assert _paths(early, n) == _paths(level, n)


def test_siblings_stay_distinct():
    _, _, early = _grown(3, 9, True)
    seen = set()
    for i in range(1, len(early)):
        key = (int(early.parents[i]), int(early.tokens[i]))
        assert key not in seen, f"node {i} duplicates a sibling"
        seen.add(key)


@pytest.mark.parametrize("bug", ["other_candidates", "outputs_off_by_one"])
def test_planted_early_level_bugs_fail(monkeypatch, bug):
    """Planted: (a) the record names other candidates as the appended level (the level's own nodes then compete
    again for the remaining slots and a real candidate is lost); (b) the level's head outputs read one row off
    (its nodes' children drafted from a sibling's output). Either gives another tree than
    the plain expansion, so the equality above can fail."""
    if bug == "other_candidates":
        plant = (lambda rec: dataclasses.replace(rec, best=np.roll(np.arange(rec.cum.size), 1)[:rec.best.size]))
        _, _, early = _grown(2, 6, True, plant)
    else:
        from draft.drafter import BeamTreeDrafter
        real = BeamTreeDrafter._beam_levels

        def shifted(self, b, first, levels, top_k, max_new, n, dev, dtype):
            if first == 1 and len(b.rows_out) > 1:
                b.rows_out[1] = b.rows_out[1].roll(1, 0)
            return real(self, b, first, levels, top_k, max_new, n, dev, dtype)
        monkeypatch.setattr(BeamTreeDrafter, "_beam_levels", shifted)
        _, _, early = _grown(3, 9, True)
    monkeypatch.undo()
    tree, _, plain = _grown(2 if bug == "other_candidates" else 3, 6 if bug == "other_candidates" else 9, False)
    assert _paths(early, len(tree)) != _paths(plain, len(tree))


def test_choosing_the_level_calls_no_model_and_finishing_one_forward_one_log_prob():
    """Counted on an EAGLE + lookup drafter (levels = 2): append_prefetched_level 0 head forwards and 0 log-prob
    calls; the finishing commit_extend_tree 1 and 1 (the commit, the re-fed tree and the level in one forward;
    level 2's log-probs) -- the prefetched step's calls, after the send."""
    from draft.protocol import install_meter
    d, g = _eagle_lookup()
    tokens, feats = torch.tensor([5, 7, 11]), torch.randn(3, 16, generator=g, dtype=torch.float64)
    root = d.commit(tokens[:1], feats[:1])
    tree, inputs = d.grow_tree_with_inputs(11, root, 9, 2, 3)
    pre = d.prefetch_leaves(tree, inputs, root, 3)
    got = []
    meter = _OpCount()
    install_meter(d, meter)
    level, lin, rec = d.append_prefetched_level(tree, inputs, pre, 3, 6)
    got.append(dict(meter.ops))
    meter.ops.clear()
    grown, _, _ = d.commit_extend_tree(tokens, feats, level, lin, 2, 3, 6 - (len(level) - len(tree)), rec)
    got.append(dict(meter.ops))
    assert got[0].get("draft_forward", 0) == 0 and got[0].get("lm_head", 0) == 0, got
    assert got[1].get("draft_forward", 0) == 1 and got[1].get("lm_head", 0) == 1, got
    assert len(level) > len(tree) and len(grown) >= len(level)


def _firsts_after(events: list[str], mark: str, kinds: tuple[str, str]) -> list[str]:
    """For each ``mark`` event, which of ``kinds`` happened first after it (marks with neither after them skipped)."""
    firsts = []
    for i, e in enumerate(events):
        if e == mark:
            nxt = [x for x in events[i + 1:] if x in kinds]
            if nxt:
                firsts.append(nxt[0])
    return firsts


def test_the_first_send_of_a_step_precedes_its_forwards():
    early, out_early, _ = _step_events({"tree.early_level": True})
    plain, out_plain, _ = _step_events({})
    assert out_early == out_plain                              # the same greedy output
    assert early and plain
    assert early.count("send") > early.count("forward"), early
    assert plain.count("send") < early.count("send"), (plain, early)


def _events_after_truncate(over: dict, watch, drafter_cls=None) -> tuple[list[str], list]:
    """Run the real ContinuousMode once (greedy, a world whose rounds truncate, run keys ``over``) and record, after
    each TRUNCATE decision, which comes first: the next ring send or a call ``watch`` wraps. ``watch(run, drafter,
    record)`` wraps that call so that it runs ``record(name)`` first and returns the names it records. The drafter:
    ``drafter_cls`` (default ``tests.test_sampling.MarkovDrafter``) on the world's draft table."""
    from pipeline.messages import Status
    from pipeline.verify import Sampler
    from tests.test_sampling import MarkovDrafter, make_runner, make_world
    tables = make_world(11, "random", 1.5)
    drafter = (drafter_cls or MarkovDrafter)(tables[1])
    run = make_runner("continuous", 3, tables, Sampler(), 12, over, drafter=drafter)
    events = []
    ring = run.ring
    send, direct = ring.send_next, ring.send_direct

    def rec_send(*a, **k):
        events.append("send")
        return send(*a, **k)

    def rec_direct(d):
        if d.status == Status.TRUNCATE and not d.finished:
            events.append("truncate")
        return direct(d)
    ring.send_next, ring.send_direct = rec_send, rec_direct
    names = watch(run, drafter, events.append)
    out = run()
    return _firsts_after(events, "truncate", ("send", *names)), out


def wrap(obj, attr: str, record, name: str) -> None:
    """Replace ``obj.attr`` (a bound method) by one that records ``name`` first."""
    call = getattr(obj, attr)

    def recorded(*a, **k):
        record(name)
        return call(*a, **k)
    setattr(obj, attr, recorded)


def _root_sends_before_commit(key: str | None):
    """After each TRUNCATE decision, whether the next ring send or the next commit comes first."""
    def watch(run, drafter, record):
        wrap(drafter, "commit", record, "commit")
        return ("commit",)
    return _events_after_truncate({key: True} if key else {}, watch)


def test_a_new_rounds_root_is_sent_before_the_commit():
    first, out_first = _root_sends_before_commit("tree.root_first")
    plain, out_plain = _root_sends_before_commit(None)
    assert out_first == out_plain
    assert first and set(first) == {"send"}, first
    assert set(plain) == {"commit"}, plain


# The turnaround keys change what the streaming modes (pruned, continuous: pipeline/modes/flowspec.py) send and
# when, never what the others do; the end-to-end checks below run those modes only (test_e2e runs every mode on
# the defaults), and this guard keeps that choice honest.
TURNAROUND_KEYS = ("root_first", "early_level", "early_whole", "early_cover", "early_split", "first_levels",
                   "prefetch_level", "fuse_commit")


def test_turnaround_keys_are_read_by_the_streaming_modes_only():
    from tests.helpers import REPO
    others = [REPO / "pipeline" / "modes" / f"{m}.py" for m in ("ar", "naive", "pipedec", "sps", "tp")]
    others += [REPO / "pipeline" / f for f in ("engine.py", "worker.py", "verify.py", "outbox.py")]
    for path in others:
        text = path.read_text()
        assert not [k for k in TURNAROUND_KEYS if k in text], f"{path.name} reads a turnaround key"


def streaming_modes_equal_hf(tmp_path, keys: list[str], modes: str = "continuous") -> None:
    """``modes`` with ``keys`` equal HF generate (greedy): stories260K on 5 ranks in one process, the untrained
    EAGLE head with prompt lookup (the default sources), prompts from three of the six datasets."""
    from transformers import AutoTokenizer

    from model.split import split_checkpoint
    from pipeline.inprocess import run_threaded
    from tests.helpers import STORIES, hf_greedy
    from tests.test_e2e import _dataset_prompts
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 1, 1, 1, 2], progress=False)
    prompts = _dataset_prompts(AutoTokenizer.from_pretrained(STORIES), 40)[:3]
    res = run_threaded(stages, prompts, modes.split(","), ["max_new_tokens=32", "dtype=float32", *keys], {2},
                       dtype=torch.float32)
    assert sorted(res) == sorted(modes.split(","))
    for mode, rows in res.items():
        assert len(rows) == len(prompts), mode
        for p, r in zip(prompts, rows):
            assert r.output_ids == hf_greedy(STORIES, p, 32, {2}, torch.float32), f"{mode} differs from HF"


@pytest.mark.skipif(not __import__("tests.helpers", fromlist=["STORIES"]).STORIES.is_dir(),
                    reason="../shared is not available")
@pytest.mark.parametrize("keys,modes", [
    (["tree.early_level=true", "tree.early_whole=0"], "continuous"),
    (["tree.root_first=true", "tree.early_level=true", "tree.early_whole=0"], "pruned,continuous"),
    (["tree.early_level=false", "tree.early_whole=40"], "continuous"),
    (["tree.early_level=true", "tree.early_whole=16", "tree.early_cover=0"], "continuous"),
    (["tree.early_split=2"], "continuous"),
    (["tree.first_levels=1"], "continuous")])   # tests/test_round_start.py; the defaults: test_e2e, every mode
def test_stories260k_streaming_modes_equal_hf_off_chain(tmp_path, keys, modes):
    streaming_modes_equal_hf(tmp_path, keys, modes)


# ---------------------------------------------------------------------------------------------------------------
# tree.early_whole: both levels of the next expansion prefetched, sent in one segment right after the re-root
# ---------------------------------------------------------------------------------------------------------------

def _beam_of(parents, leaf, scores, cand, top_k, r) -> set[int]:
    """Reference (plain Python): the first-level beam of the subtree of ``r``, as flat candidate indices."""
    n, kk = cand.shape
    inside = []
    for i in range(n):
        j = i
        while j >= 0 and j != r:
            j = int(parents[j])
        if j == r and leaf[i]:
            inside.append(i)
    fr = sorted(inside, key=lambda i: (-scores[i], i))[:top_k]
    cands = sorted(((scores[i] + cand[i, c], fi * kk + c, i * kk + c) for fi, i in enumerate(fr) for c in range(kk)),
                   key=lambda x: (-x[0], x[1]))[:top_k]
    return {flat for _, _, flat in cands}


@pytest.mark.parametrize("seed", range(6))
def test_level2_seeds_covers_the_likeliest_new_roots_beams_within_the_width(seed):
    """The rule, against a plain-Python reference on random trees: every index a leaf's candidate, distinct, at most
    ``width``; the covered outcomes are the best-scored new roots in order, each one's whole beam in the set; a
    smaller width gives a prefix of a larger one's set."""
    from draft.drafter import level2_seeds
    rng = np.random.default_rng(seed)
    n, kk, top_k = int(rng.integers(2, 14)), 3, 3
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    scores = np.zeros(n)
    for i in range(1, n):
        scores[i] = scores[parents[i]] + np.log(rng.uniform(0.05, 1.0))
    leaf = np.ones(n, dtype=bool)
    leaf[parents[1:]] = False
    cand = np.log(np.sort(rng.uniform(0.01, 1.0, (n, kk)), axis=1)[:, ::-1])
    prev = None
    for width in (0, 3, 5, 9, 20, 1000):
        got = level2_seeds(parents, leaf, scores, cand, top_k, width)
        assert got.size <= width and np.unique(got).size == got.size
        assert leaf[got // kk].all() and (got % kk < top_k).all()
        covered, union = 0, set()
        for r in sorted(range(1, n), key=lambda i: (-scores[i], i)) if n > 1 else [0]:
            beam = _beam_of(parents, leaf, scores, cand, top_k, r)
            if len(union | beam) > width:
                break
            union |= beam
            covered += 1
        assert set(got.tolist()) == union, (width, covered)
        if prev is not None:
            assert got[:prev.size].tolist() == prev.tolist()
        prev = got
    assert prev.size == len(set().union(*[_beam_of(parents, leaf, scores, cand, top_k, r) for r in range(1, n)]))


def _whole(max_new: int, width: int = 100, plant=None):
    """The Markov drafter's tree of :func:`_grown`: the whole expansion chosen from :meth:`prefetch_expansion`'s
    candidates (``plant`` edits them first), and the early level's finished tree with its inputs."""
    from tests.test_sampling import enc
    d = _markov()
    root = enc(4)
    tree, inputs = d.grow_tree_with_inputs(4, root, 9, 2, 3)
    pre, pre2, _, _ = d.prefetch_expansion(tree, inputs, root, 3, width)
    if plant is not None:
        pre2 = plant(pre2)
    got = d.append_prefetched_expansion(tree, inputs, pre, pre2, 3, max_new)
    tokens, feats = torch.tensor([2, 4]), torch.zeros(2, 1, dtype=torch.float64)
    level, lin, rec = d.append_prefetched_level(tree, inputs, d.prefetch_leaves(tree, inputs, root, 3), 3, max_new)
    early, e_in, _ = d.commit_extend_tree(tokens, feats, level, lin, 2, 3, max_new - (len(level) - len(tree)), rec)
    return tree, got, early, e_in


@pytest.mark.parametrize("max_new", [2, 3, 6, 9, 12])
def test_the_whole_expansion_is_the_early_levels_finished_tree(max_new):
    """On a drafter whose outputs do not depend on the context, the two prefetched levels chosen before the send are
    node for node (tokens, parents, scores, depths, and the new nodes' inputs) the tree the early level's path
    finishes after the commit: the same rule, with no model call on the chain. The prefetch's first level is
    :meth:`prefetch_leaves`'s."""
    tree, got, early, e_in = _whole(max_new)
    assert got is not None
    grown, g_in = got
    n = len(tree)
    assert grown.tokens.tolist() == early.tokens.tolist() and grown.parents.tolist() == early.parents.tolist()
    assert grown.depths.tolist() == early.depths.tolist()
    torch.testing.assert_close(grown.scores, early.scores)
    torch.testing.assert_close(g_in[n:], e_in[n:])
    assert (grown.depths[n:] - grown.depths[grown.parents[n:]] == 1).all()
    assert (grown.parents[1:] < torch.arange(1, len(grown))).all()
    if max_new >= 6:
        assert int(grown.depths[n:].max()) - int(tree.depths.max()) >= 1 and (grown.parents[n:] >= n).any()


def test_prefetched_first_level_is_prefetch_leaves():
    from tests.test_sampling import enc
    d = _markov()
    root = enc(4)
    tree, inputs = d.grow_tree_with_inputs(4, root, 9, 2, 3)
    pre, pre2, _, _ = d.prefetch_expansion(tree, inputs, root, 3, 100)
    for a, b in zip(pre, d.prefetch_leaves(tree, inputs, root, 3)):
        assert torch.equal(a, b)
    assert pre2 is not None and (pre2[0] >= 0).sum() == pre2[1].shape[0]


@pytest.mark.parametrize("bug", ["children_of_another_node", "outputs_off_by_one", "uncovered_beam_sent"])
def test_planted_whole_expansion_bugs_fail(bug):
    """Planted: (a) each beam node reads another candidate's prefetched children; (b) the children's inputs read
    one row off; (c) a beam member whose children were not prefetched is treated as covered (rows -1 wrap to
    the last row). Each gives a tree or inputs other than the early level's finished ones."""
    def roll_rows(p):
        seed = p[0].copy()
        seed[seed >= 0] = np.roll(seed[seed >= 0], 1)
        return (seed, *p[1:])
    plants = {"children_of_another_node": roll_rows,
              "outputs_off_by_one": lambda p: (p[0], p[1].roll(1, 0), *p[2:])}
    if bug == "uncovered_beam_sent":
        tree, got, early, e_in = _whole(9, width=3,
                                        plant=lambda p: (np.where(p[0] < 0, p[0].max(), p[0]), *p[1:]))
        assert got is not None
    else:
        tree, got, early, e_in = _whole(9, plant=plants[bug])
    grown, g_in = got
    n = len(tree)
    same = grown.tokens.tolist() == early.tokens.tolist() and grown.parents.tolist() == early.parents.tolist() \
        and torch.allclose(grown.scores, early.scores) and torch.allclose(g_in[n:], e_in[n:])
    assert not same


def test_an_uncovered_beam_falls_back_to_the_first_level():
    """With room for one beam's children only (width 3: the best new root's), the tree kept whole (no re-root here)
    has another beam: not covered, so no whole expansion (None) and the caller sends the early level alone; with
    room for every beam (width 100) it is covered."""
    assert _whole(9, width=3)[1] is None
    assert _whole(9, width=100)[1] is not None


def _path_of(tree, i: int) -> tuple[int, ...]:
    out = []
    while i >= 0:
        out.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return tuple(reversed(out))


def _partly_covered(max_new: int, cover: float, plant=None):
    """The Markov drafter's tree of :func:`_whole`, every candidate's children prefetched (width 100), then the
    beam's best member made uncovered (its seed row -1; the others stay covered, so the children's rows shift);
    ``append_prefetched_expansion`` with ``cover``, and with room for every candidate (the universe the reference
    chooses from); ``plant`` edits the partly covered rows first."""
    from tests.test_sampling import enc
    d = _markov()
    root = enc(4)
    tree, inputs = d.grow_tree_with_inputs(4, root, 9, 2, 3)
    pre, pre2, _, _ = d.prefetch_expansion(tree, inputs, root, 3, 100)
    leaves = np.flatnonzero(pre[0].numpy())
    cum = tree.scores.numpy()[leaves][:, None] + pre[2].numpy()[leaves]
    li, j = np.unravel_index(int(np.argmax(cum)), cum.shape)
    lf = int(leaves[li])
    seed = pre2[0].copy()
    seed[lf, j] = -1                                   # the beam's best member: its children left out
    part = (seed, *pre2[1:])
    if plant is not None:
        part = plant(part)
    got = d.append_prefetched_expansion(tree, inputs, pre, part, 3, max_new, cover)
    full = d.append_prefetched_expansion(tree, inputs, pre, pre2, 3, 1000)
    return tree, (lf, int(pre[3][lf, j])), got, full


def _partial_reference(tree, gone_node: tuple[int, int], full, max_new: int) -> list:
    """Plain Python: the beam (the universe's first ``min(3, max_new)`` new nodes), then the best ``max_new - beam``
    of the universe's other new nodes by score, leaving out the children of the beam member ``gone_node`` (its
    leaf, its token)."""
    grown, _ = full
    n = len(tree)
    nb = min(3, max_new)
    beam = list(range(n, n + nb))
    gone = {i for i in beam if (int(grown.parents[i]), int(grown.tokens[i])) == gone_node}
    assert len(gone) == 1
    others = [i for i in range(n + nb, len(grown)) if int(grown.parents[i]) not in gone]
    others.sort(key=lambda i: -float(grown.scores[i]))
    return sorted((_path_of(grown, i), round(float(grown.scores[i]), 6)) for i in beam + others[:max_new - nb])


@pytest.mark.parametrize("max_new", [3, 6, 9, 12])
def test_a_partly_covered_beam_is_sent_whole_without_the_uncovered_childrens(max_new):
    """``tree.early_cover`` below 1: a beam some of whose members had no children prefetched is sent whole anyway:
    the beam first, then the best of the level's other candidates and the COVERED members' children (against a
    plain-Python reference on the universe of every prefetched candidate); each new node's input is the one it
    has in the fully covered expansion (its leaf's output, or its beam parent's prefetched output); the tree stays
    ancestors-first. With ``cover`` 1 (the default) the same rows give None (the fallback)."""
    tree, gone, got, full = _partly_covered(max_new, 0.0)
    assert _partly_covered(max_new, 1.0)[2] is None
    assert got is not None
    grown, g_in = got
    n = len(tree)
    assert len(grown) - n == max_new
    assert _paths(grown, n) == _partial_reference(tree, gone, full, max_new)
    f_in = {_path_of(full[0], i): full[1][i] for i in range(n, len(full[0]))}
    for i in range(n, len(grown)):
        torch.testing.assert_close(g_in[i], f_in[_path_of(grown, i)])
    assert (grown.parents[1:] < torch.arange(1, len(grown))).all()
    assert (grown.depths[n:] - grown.depths[grown.parents[n:]] == 1).all()
    if max_new >= 9:                                   # the covered members' children do get in
        assert (grown.parents[n:] >= n).any()


@pytest.mark.parametrize("bug", ["children_of_another_node", "outputs_off_by_one"])
def test_planted_partial_expansion_bugs_fail(bug):
    """Planted: the covered members read another candidate's children rows, or their outputs one row off: the
    partly covered expansion then differs from the reference (nodes) or from the covered inputs."""
    def roll_rows(p):
        seed = p[0].copy()
        seed[seed >= 0] = np.roll(seed[seed >= 0], 1)
        return (seed, *p[1:])
    plant = roll_rows if bug == "children_of_another_node" else (lambda p: (p[0], p[1].roll(1, 0), *p[2:]))
    tree, gone, got, full = _partly_covered(9, 0.0, plant)
    grown, g_in = got
    n = len(tree)
    f_in = {_path_of(full[0], i): full[1][i] for i in range(n, len(full[0]))}
    same = _paths(grown, n) == _partial_reference(tree, gone, full, 9) and all(
        torch.allclose(g_in[i], f_in.get(_path_of(grown, i), g_in[i] + 1)) for i in range(n, len(grown)))
    assert not same


def test_early_cover_zero_sends_every_step_whole(monkeypatch):
    """In the real ContinuousMode loop with every prefetch's seed set missing its best candidate (so no beam is
    covered whole: ``draft.drafter.level2_seeds`` patched), the default ``tree.early_cover=1`` sends no whole
    expansion (level-only early sends), ``tree.early_cover=0`` makes every early send a whole one; the greedy
    output is the same."""
    import draft.drafter as dd
    real = dd.level2_seeds
    monkeypatch.setattr(dd, "level2_seeds", lambda *a: real(*a)[1:])
    _, out_one, one = _step_events({"tree.early_level": True, "tree.early_whole": 16})
    _, out_zero, zero = _step_events({"tree.early_level": True, "tree.early_whole": 16, "tree.early_cover": 0.0})
    assert out_one == out_zero
    assert one.early_sent > 0 and one.whole_sent == 0
    assert zero.whole_sent == zero.early_sent > 0


def _sends_before_forward(events: list[str]) -> list[int]:
    """Per verified step: the ring sends between its mark and its first draft-head forward (or the next step)."""
    out = []
    for i, e in enumerate(events):
        if e == "step":
            k = 0
            for x in events[i + 1:]:
                if x != "send":
                    break
                k += 1
            out.append(k)
    return out


class _Box:
    """An outbox stand-in for ``ContinuousMode.top_up``: ``busy`` live segments already in flight, sends recorded."""

    def __init__(self, busy: int) -> None:
        self.busy, self.sizes, self.next_gid = busy, [], 0

    def live_inflight(self, alive) -> int:
        return self.busy + len(self.sizes)

    def send(self, tokens, parent_gids, tag: int = 0):
        self.sizes.append(int(tokens.numel()))
        self.next_gid += int(tokens.numel())


@pytest.mark.parametrize("free,busy,split,want", [(2, 0, 3, [3, 5]), (2, 2, 3, [3, 5]), (2, 3, 3, [8]), (2, 0, 0, [8]),
                                                  (2, 0, 8, [8]), (3, 1, 3, [3, 5]), (3, 2, 3, [8])])
def test_early_split_sends_two_segments_when_two_links_are_free(free, busy, split, want):
    """``tree.early_split`` (``ContinuousMode.top_up``): with a split recorded by the whole send (``split`` waiting
    nodes first) and at least ``tree.early_split`` of the 4 links free, the waiting nodes leave as two segments at
    once (the
    split's prefix, then the rest); one link free, no split, or a split covering every waiting node: one segment
    as without the key. The split is consumed (the next top-up is plain)."""
    from types import SimpleNamespace

    from config.run_config import TreeConfig
    from draft.tree import DraftTree
    from pipeline.modes.flowspec import ContinuousMode
    from pipeline.outbox import RankTree
    engine = SimpleNamespace(cfg=SimpleNamespace(tree=TreeConfig(early_split=free)), comm=SimpleNamespace(world=4))
    tree = DraftTree(torch.arange(9), torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 4]), torch.zeros(9),
                     torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3]))
    state = RankTree(tree)
    box = _Box(busy)
    state.send(box, 1)                                  # the root, sent before
    box.sizes.clear()
    mode = ContinuousMode()
    mode.split = split
    mode.top_up(engine, box, state)
    assert box.sizes == want and mode.split == 0 and state.waiting == 0


def test_whole_expansion_calls_no_model_and_the_commit_with_the_prefetch_two_forwards_two_log_probs():
    """Counted on an EAGLE + lookup drafter: choosing both levels costs 0 head forwards and 0 log-prob calls (the
    chain); the commit with the next prefetch (off the chain) 2 and 2, the prefetched step's count: the commit, the
    re-fed tree and the first level's log-probs as before, plus the second level's rows in one forward and one
    log-prob call."""
    from draft.protocol import install_meter
    d, g = _eagle_lookup()
    tokens, feats = torch.tensor([5, 7, 11]), torch.randn(3, 16, generator=g, dtype=torch.float64)
    root = d.commit(tokens[:1], feats[:1])
    tree, inputs = d.grow_tree_with_inputs(11, root, 9, 2, 3)
    pre, pre2, _, _ = d.prefetch_expansion(tree, inputs, root, 3, 100)
    meter = _OpCount()
    install_meter(d, meter)
    got = d.append_prefetched_expansion(tree, inputs, pre, pre2, 3, 6)
    chain = dict(meter.ops)
    meter.ops.clear()
    assert got is not None
    grown, g_in = got
    d.prefetch_expansion(grown, g_in, None, 3, 100, (tokens[1:], feats[1:]))
    after = dict(meter.ops)
    assert chain.get("draft_forward", 0) == 0 and chain.get("lm_head", 0) == 0, chain
    assert after.get("draft_forward", 0) == 2 and after.get("lm_head", 0) == 2, after
    assert len(grown) > len(tree)


def test_a_whole_step_sends_before_any_forward_and_grows_nothing_after_the_send():
    """The real ContinuousMode loop (greedy): with ``tree.early_whole`` verified steps send the whole expansion before
    any draft-head forward, and the commit after the send appends nothing (nodes appended after the send per early
    step: below the early level's, which appends the second level there). The greedy output is the same."""
    whole, out_whole, cont_whole = _step_events({"tree.early_level": True, "tree.early_whole": 16})
    level, out_level, cont_level = _step_events({"tree.early_level": True})
    assert out_whole == out_level
    assert whole and whole.count("send") == len(whole), whole
    assert cont_whole.whole_sent > 0 and cont_level.whole_sent == 0
    assert cont_whole.grown_after / cont_whole.early_sent < cont_level.grown_after / cont_level.early_sent, \
        (cont_whole.grown_after, cont_level.grown_after)


def test_early_whole_alone_sends_whole_expansions_or_nothing_early():
    """``tree.early_whole`` without ``early_level``: every early send is a whole expansion (an uncovered beam takes
    the plain prefetched path, no level-only send), with a tiny width some steps are uncovered, and the greedy
    output is the plain run's."""
    _, out_alone, cont = _step_events({"tree.early_whole": 16})
    _, out_tiny, tiny = _step_events({"tree.early_whole": 1})
    _, out_plain, plain = _step_events({})
    assert out_alone == out_plain == out_tiny
    assert cont.whole_sent > 0 and cont.early_sent == cont.whole_sent
    assert tiny.early_sent == tiny.whole_sent < cont.whole_sent
    assert plain.early_sent == 0


def _step_events(over: dict):
    """Per verified step of the real ContinuousMode (greedy): which came first after the re-root, a ring send or a
    draft-head forward; the output and the mode (its counters)."""
    from pipeline.verify import Sampler
    from tests.test_sampling import MarkovDrafter, make_runner, make_world
    tables = make_world(11, "target", 1.5)
    drafter = MarkovDrafter(tables[1])
    run = make_runner("continuous", 3, tables, Sampler(), 12,
                      {"tree.expand_total_token": 9, "tree.expand_topk": 2, "tree.expand_levels": 2,
                       "tree.early_level": False, "tree.early_whole": 0, **over},   # off unless ``over`` says
                      drafter=drafter)
    events = []
    ring = run.ring
    send, fwd = ring.send_next, drafter.tree_forward

    def rec_send(*a, **k):
        events.append("send")
        return send(*a, **k)

    def rec_fwd(*a, **k):
        events.append("forward")
        return fwd(*a, **k)
    ring.send_next, drafter.tree_forward = rec_send, rec_fwd
    cont = run.cont
    real = type(cont).send_early

    def mark(self, engine, state):
        events.append("step")
        return real(self, engine, state)
    cont.send_early = mark.__get__(cont)
    grow = type(cont).commit_and_grow
    cont.grown_after = 0

    def after(self, engine, tree, tokens, feats):              # nodes the commit after the send appends
        got = grow(self, engine, tree, tokens, feats)
        self.grown_after += 0 if got is None else len(got[0]) - len(tree)
        return got
    cont.commit_and_grow = after.__get__(cont)
    cont.events = events
    out = run()
    return _firsts_after(events, "step", ("send", "forward")), out, cont


@pytest.mark.parametrize("bad", ["tree.early_cover=1.5", "tree.early_cover=-0.1", "tree.early_split=1",
                                 "tree.early_split=-2"])
def test_bad_early_keys_are_one_line_errors(bad):
    from config.errors import UserError
    from config.run_config import DEFAULT, ConfigError, apply_overrides
    with pytest.raises(ConfigError) as e:
        apply_overrides(DEFAULT, [bad])
    assert issubclass(ConfigError, UserError) and "\n" not in str(e.value) and bad.split("=")[0] in str(e.value)
