"""The round start (issue 41): a quick first tree of ONE level (``tree.first_levels=1``; measured in docs/results.md
§65: faster on the edge profile, not on the what-if, so not the default) is drafted as a tree alone and sent before
its inputs and buffers exist; a quick tree of more levels (the default, 2) gets its buffers after the send too.

At a truncation rank 0 commits the accepted tokens (a head forward: the new root's draft output) and drafts the
next round's first tree; with ``first_levels=1`` that tree is the root and its best children (one log-prob call, no
further forward), and ``ContinuousMode.first_tree`` asks the drafter for the tree only (``grow_tree``: the search
without its row gathers, a merged drafter without ``tree_inputs``); ``finish_first_tree`` then, after the send,
gives it its inputs (``pipeline.modes.flowspec.root_children_inputs``: every row is the root's output) and its
buffers at the round's capacity (``ContinuousMode.take_lazy``).

* the tree-only search drafts exactly the tree of ``grow_tree_with_inputs`` (EAGLE, EAGLE + lookup; depths 0-2);
* the rule: its inputs equal ``grow_tree_with_inputs``' bitwise for one-level trees, and it declines deeper ones;
  planted bugs (no depth check, the root's row left out) fail that check;
* counted: the tree-only call dispatches fewer operators than the tree with its inputs and buffers;
* in the decode loop the one-level first tree is sent before its inputs are taken, and the greedy output is the
  two-level start's (``first_levels=2``); stories260K through every mode equals HF with ``first_levels`` 1 and 2;
* a quick tree of two levels is sent before its inputs too where the drafter defers them
  (``draft.protocol.grow_tree_deferred``): a merged drafter gives the same tree and, when asked after the send,
  the same inputs bitwise, and the head forwards that feed the states no source's search computed (a suffix
  chain below the head's depth: one per level) run only then.
  The exact law with ``first_levels=1`` is in tests/test_sampling.py (its ``EXACT_CASES`` entry with the key).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.modes.flowspec import ContinuousMode, root_children_inputs
from tests.test_fuse_commit import _committed, _eagle_lookup


def _drafters():
    return {"eagle": _committed, "eagle+lookup": _eagle_lookup}


def _same_tree(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents),
                                                                  (a.scores, b.scores), (a.depths, b.depths)))


@pytest.mark.parametrize("name", ["eagle", "eagle+lookup"])
@pytest.mark.parametrize("depth,total", [(0, 17), (0, 5), (1, 17), (2, 9)])
def test_the_tree_only_search_drafts_the_same_tree(name, depth, total):
    d, g = _drafters()[name]()
    root = d.commit(torch.tensor([5, 7]), torch.randn(2, 16, generator=g, dtype=torch.float64))
    eager, _ = d.grow_tree_with_inputs(11, root, total, depth, 3)
    assert _same_tree(d.grow_tree(11, root, total, depth, 3), eager)


def _rule_ok(rule, name: str, depth: int) -> bool:
    """``rule(parents, root_hidden)`` against the eager inputs: equal (bitwise) where it answers, and it answers
    exactly for the trees of one level."""
    d, g = _drafters()[name]()
    root = d.commit(torch.tensor([5, 7, 9]), torch.randn(3, 16, generator=g, dtype=torch.float64))
    tree, inputs = d.grow_tree_with_inputs(11, root, 9, depth, 3)
    got = rule(tree.host_numpy()[1], root)
    one_level = bool((tree.depths <= 1).all())
    if got is None:
        return not one_level
    return one_level and got.dtype == inputs.dtype and torch.equal(got, inputs)


@pytest.mark.parametrize("name", ["eagle", "eagle+lookup"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_root_children_inputs_are_the_eager_inputs(name, depth):
    assert _rule_ok(root_children_inputs, name, depth)


def test_root_children_inputs_rule_on_random_parent_arrays():
    """The rule's answer on its own: rows for exactly the parent arrays of one level, each row the root's, on memory
    of its own (writing a row leaves ``root_hidden`` as it was)."""
    rng = np.random.default_rng(0)
    h = torch.randn(6, dtype=torch.float64)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        par = np.array([-1] + [int(rng.integers(0, i)) if rng.random() < 0.3 else 0 for i in range(1, n)])
        got = root_children_inputs(par, h)
        if (par[1:] > 0).any():
            assert got is None
        else:
            assert got.shape == (n, 6) and torch.equal(got, h.expand(n, -1))
            got[0, 0] += 1.0
            assert float(h[0]) != float(got[0, 0])


def _no_depth_check(parents, root_hidden):
    return root_hidden[None].expand(parents.size, -1).clone()


def _root_row_left_out(parents, root_hidden):
    got = root_children_inputs(parents, root_hidden)
    if got is not None:
        got[0] = 0
    return got


@pytest.mark.parametrize("bug", [_no_depth_check, _root_row_left_out])
def test_planted_rule_bugs_fail(bug):
    assert not all(_rule_ok(bug, name, depth) for name in ("eagle", "eagle+lookup") for depth in (0, 1))


def test_take_lazy_asks_again_for_a_deeper_tree():
    """``take_lazy``'s second path, reached: EAGLE merged with suffix retrieval whose ``suffix_max_depth`` lets a
    long match copy past the head's depth drafts a tree deeper than one level at depth 0, so the rule declines and
    the inputs come from ``grow_tree_with_inputs`` (the same tree: checked there), bitwise the eager ones."""
    import contextlib
    from types import SimpleNamespace
    from draft.merged import MergedDrafter
    from draft.suffix import SuffixDrafter
    from tests.test_fuse_commit import V_TINY

    def make():
        d, g = _committed()
        suf = SuffixDrafter(V_TINY, max_depth=4)
        suf.start([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2], 3, None)
        m = MergedDrafter([d, suf], ["eagle", "suffix"])
        m.widths = [16, int(suf.state([]).shape[-1])]
        return m, m.commit(torch.tensor([5, 7]), torch.randn(2, 16, generator=g, dtype=torch.float64))
    m, root = make()
    tree = m.grow_tree(3, root, 9, 0, 3)
    assert int(tree.depths.max()) > 1 and root_children_inputs(tree.host_numpy()[1], root) is None
    mode = ContinuousMode()
    engine = SimpleNamespace(drafter=m, tracer=SimpleNamespace(span=lambda name: contextlib.nullcontext()),
                             cfg=SimpleNamespace(tree=SimpleNamespace(init_total_token=9, subseq_token=8, init_topk=3)))
    mode.take_lazy(engine, tree, root)
    m2, root2 = make()
    eager_tree, eager = m2.grow_tree_with_inputs(3, root2, 9, 0, 3)
    assert _same_tree(tree, eager_tree) and mode.inputs.dtype == eager.dtype and torch.equal(mode.inputs, eager)


def test_the_tree_only_call_dispatches_fewer_operators():
    """Counted (aten operators, pipeline.tools.opcount): the one-level first tree alone against the tree with its
    inputs on buffers at the round's capacity (what the turnaround held before)."""
    from config.run_config import DEFAULT
    from pipeline.tools.opcount import count_call
    cap = ContinuousMode.capacity(DEFAULT.tree)
    counts = {}
    for lazy in (True, False):
        d, g = _eagle_lookup()
        root = d.commit(torch.tensor([5, 7]), torch.randn(2, 16, generator=g, dtype=torch.float64))
        d.grow_tree(11, root, 17, 0, 3)                                        # warm
        if lazy:
            counts[lazy] = count_call(lambda: d.grow_tree(11, root, 17, 0, 3)).ops
        else:
            counts[lazy] = count_call(lambda: d.grow_tree_with_inputs(11, root, 17, 0, 3)[0].with_capacity(cap)).ops
    assert counts[True] + 10 <= counts[False], counts


def _round_start_events(first_levels: int, drafter_cls=None):
    """The real ContinuousMode (greedy, a world whose rounds truncate): after each TRUNCATE decision, which comes
    first, the next ring send or the first tree's inputs (``take_lazy``, or the eager ``grow_tree_with_inputs``)."""
    from tests.test_turnaround_off_chain import _events_after_truncate, wrap

    def watch(run, drafter, record):
        wrap(drafter, "grow_tree_with_inputs", record, "inputs")
        wrap(run.cont, "take_lazy", record, "inputs")
        return ("inputs",)
    return _events_after_truncate({"tree.first_levels": first_levels}, watch, drafter_cls)


def _deferring():
    """``tests.test_sampling.MarkovDrafter`` with ``grow_tree_deferred``: the tree now, its inputs (through the
    recorded ``grow_tree_with_inputs``) when asked."""
    from tests.test_sampling import MarkovDrafter

    class Deferring(MarkovDrafter):
        def grow_tree_deferred(self, root_token, root_hidden, total_token, depth, top_k):
            tree = self.grow_tree(root_token, root_hidden, total_token, depth, top_k)
            return tree, lambda: self.grow_tree_with_inputs(root_token, root_hidden, total_token, depth, top_k)[1]
    return Deferring


def test_a_quick_first_tree_is_sent_before_its_inputs():
    """One level: always (``take_lazy``). Two levels (the default): where the drafter defers its inputs
    (``draft.protocol.grow_tree_deferred``: a merged drafter does), else both halves at once, before the send (a
    drafter without the method: the seam's fallback); the same output every way."""
    one, out_one = _round_start_events(1)
    two, out_two = _round_start_events(2)
    deferred, out_deferred = _round_start_events(2, _deferring())
    assert out_one == out_two == out_deferred
    assert one and set(one) == {"send"}, one
    assert set(two) == {"inputs"}, two
    assert deferred and set(deferred) == {"send"}, deferred


def _chain_merged():
    """EAGLE merged with suffix retrieval that copies past the head's depth (the quick tree holds nodes the head
    never proposed, below other such nodes: their EAGLE states need a forward per level)."""
    from draft.merged import MergedDrafter
    from draft.suffix import SuffixDrafter
    from tests.test_fuse_commit import V_TINY
    d, g = _committed()
    suf = SuffixDrafter(V_TINY, max_depth=4)
    suf.start([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2], 3, None)
    m = MergedDrafter([d, suf], ["eagle", "suffix"])
    m.widths = [16, int(suf.state([]).shape[-1])]
    return m, d, m.commit(torch.tensor([5, 7]), torch.randn(2, 16, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_merged_drafter_defers_its_inputs_forwards(depth):
    """``MergedDrafter.grow_tree_deferred``: the same tree as ``grow_tree_with_inputs`` and, when asked, the same
    inputs bitwise; the head forwards that feed the states no search computed run in the second half only."""
    from draft.protocol import grow_tree_deferred
    m, eagle, root = _chain_merged()
    eager_tree, eager = m.grow_tree_with_inputs(3, root, 9, depth, 3)
    m, eagle, root = _chain_merged()
    calls = []
    forward = eagle.tree_forward
    eagle.tree_forward = lambda *a: calls.append(a[0].numel()) or forward(*a)
    tree, inputs = grow_tree_deferred(m, 3, root, 9, depth, 3)
    searched = len(calls)
    got = inputs()
    assert _same_tree(tree, eager_tree) and got.dtype == eager.dtype and torch.equal(got, eager)
    assert int(tree.depths.max()) > depth + 1 and len(calls) > searched, (calls, searched)   # fed: after
