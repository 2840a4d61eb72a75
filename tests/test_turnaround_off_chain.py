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


def _first_send_before_forward(key: str | None):
    """Run the real ContinuousMode once (tests/test_sampling.py's ring and Markov drafter) and record, per verified
    step, whether the step's first ring send came before its first draft-head (tree) forward."""
    from pipeline.verify import Sampler
    from tests.test_sampling import MarkovDrafter, make_runner, make_world
    tables = make_world(11, "target", 1.5)
    over = {"tree.expand_total_token": 9, "tree.expand_topk": 2, "tree.expand_levels": 2}
    if key:
        over[key] = True
    drafter = MarkovDrafter(tables[1])
    run = make_runner("continuous", 3, tables, Sampler(), 12, over, drafter=drafter)      # greedy
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
    out = run()
    return _firsts_after(events, "step", ("send", "forward")), out


def test_the_first_send_of_a_step_precedes_its_forwards():
    early, out_early = _first_send_before_forward("tree.early_level")
    plain, out_plain = _first_send_before_forward(None)
    assert out_early == out_plain                              # the same greedy output
    assert early and plain
    assert early.count("send") > early.count("forward"), early
    assert plain.count("send") < early.count("send"), (plain, early)


def _root_sends_before_commit(key: str | None):
    """Run the real ContinuousMode once (greedy, a world whose rounds truncate) and record, after each TRUNCATE
    decision, whether the next ring send or the next commit comes first."""
    from pipeline.messages import Status
    from pipeline.verify import Sampler
    from tests.test_sampling import MarkovDrafter, make_runner, make_world
    tables = make_world(11, "random", 1.5)
    over = {key: True} if key else {}
    drafter = MarkovDrafter(tables[1])
    run = make_runner("continuous", 3, tables, Sampler(), 12, over, drafter=drafter)
    events = []
    ring = run.ring
    send, direct, commit = ring.send_next, ring.send_direct, drafter.commit

    def rec_send(*a, **k):
        events.append("send")
        return send(*a, **k)

    def rec_direct(d):
        if d.status == Status.TRUNCATE and not d.finished:
            events.append("truncate")
        return direct(d)

    def rec_commit(*a, **k):
        events.append("commit")
        return commit(*a, **k)
    ring.send_next, ring.send_direct, drafter.commit = rec_send, rec_direct, rec_commit
    out = run()
    return _firsts_after(events, "truncate", ("send", "commit")), out


def test_a_new_rounds_root_is_sent_before_the_commit():
    first, out_first = _root_sends_before_commit("tree.root_first")
    plain, out_plain = _root_sends_before_commit(None)
    assert out_first == out_plain
    assert first and set(first) == {"send"}, first
    assert set(plain) == {"commit"}, plain


@pytest.mark.skipif(not __import__("tests.helpers", fromlist=["STORIES"]).STORIES.is_dir(),
                    reason="../shared is not available")
@pytest.mark.parametrize("keys", [["tree.early_level=true"], ["tree.root_first=true", "tree.early_level=true"]])
def test_stories260k_all_modes_equal_hf_off_chain(tmp_path, keys):
    """Every mode with the keys equals HF generate (greedy), stories260K on 5 ranks in one process, the untrained
    EAGLE head with prompt lookup (the default sources), prompts from the six datasets."""
    from transformers import AutoTokenizer

    from model.split import split_checkpoint
    from pipeline.inprocess import run_threaded
    from tests.helpers import STORIES, hf_greedy
    from tests.test_e2e import ALL_MODES, _dataset_prompts
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 1, 1, 1, 2], progress=False)
    prompts = _dataset_prompts(AutoTokenizer.from_pretrained(STORIES), 40)[:3]
    res = run_threaded(stages, prompts, ALL_MODES.split(","), ["max_new_tokens=32", "dtype=float32", *keys], {2},
                       dtype=torch.float32)
    for mode, rows in res.items():
        assert len(rows) == len(prompts), mode
        for p, r in zip(prompts, rows):
            assert r.output_ids == hf_greedy(STORIES, p, 32, {2}, torch.float32), f"{mode} differs from HF"
