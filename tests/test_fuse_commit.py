"""``tree.fuse_commit`` (issue 41): the commit of the accepted tokens and the re-feed of the surviving tree in ONE
draft-head forward (``draft.drafter.Drafter.commit_tree_forward``, ``BeamTreeDrafter.commit_extend_tree``,
``pipeline.modes.flowspec.ContinuousMode.commit_and_grow``).

* the fused forward equals a commit followed by a tree forward (outputs, keys, values, the cache's bookkeeping),
  and two planted bugs (tree rows blind to the commit rows; tree positions not shifted past them) fail that check;
* ``commit_extend_tree`` equals ``commit`` + ``extend_tree`` whenever the root's children's remembered input is
  the commit's output (the one thing the fused path does differently), and differs when it is not (so the check
  can fail);
* in the decode loop, fused, a verified step costs one draft-head forward fewer (counted with a meter);
* greedy output equals HF with the key on in every mode (stories260K); its exact sampling law is in
  tests/test_sampling.py (EXACT_CASES' ``tree.fuse_commit`` case).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from draft.merged import MergedDrafter
from draft.tree import DraftTree
from tests.test_drafters import V_TINY, _random_eagle


def _committed(seed: int = 1):
    d = _random_eagle(seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V_TINY, (9,), generator=g).tolist()
    d.start(prompt, 3, torch.randn(9, 16, generator=g, dtype=torch.float64))
    return d, g


def _rows(g):
    tokens = torch.tensor([5, 7, 11])                               # the accepted tokens + the bonus (the root)
    feats = torch.randn(3, 16, generator=g, dtype=torch.float64)
    tree_tok = torch.tensor([4, 9, 2, 6, 8])
    tree_in = torch.randn(5, 16, generator=g, dtype=torch.float64)
    parents = torch.tensor([-1, -1, 0, 0, 2])                        # cache slots: two roots' children, then deeper
    return tokens, feats, tree_tok, tree_in, parents


def _state(d):
    c = d.cache
    n = c.length
    return (c.keys[..., :n, :].clone(), c.values[..., :n, :].clone(), c.context_len, c.length,
            c.tree_anc.clone(), c.tree_depth.clone())


def _fused_vs_separate():
    a, g = _committed()
    b, _ = _committed()
    tokens, feats, tt, ti, par = _rows(g)
    root_a, out_a = a.commit_tree_forward(tokens, feats, tt, ti, par)
    root_b = b.commit(tokens, feats)
    out_b = b.tree_forward(tt, ti, par)
    return (root_a, out_a, _state(a)), (root_b, out_b, _state(b))


def _assert_same(fused, separate):
    (ra, oa, sa), (rb, ob, sb) = fused, separate
    torch.testing.assert_close(ra, rb)
    torch.testing.assert_close(oa, ob)
    assert sa[2:4] == sb[2:4]                                        # context_len, length
    for x, y in zip(sa[:2] + sa[4:], sb[:2] + sb[4:]):
        torch.testing.assert_close(x, y)


def test_fused_forward_equals_commit_then_tree_forward():
    _assert_same(*_fused_vs_separate())


@contextlib.contextmanager
def _planted(monkeypatch, bug: str):
    """Plant a bug in the fused forward's inputs: ``blind``: the tree rows do not see the commit rows; ``pos``: the
    tree rows' positions ignore the commit (as if staged before it)."""
    from model.kv_cache import KVCache
    real = KVCache.staged_tree_inputs

    def staged(self, parents, dtype):
        pos, mask = real(self, parents, dtype)
        if bug == "pos":
            pos = pos - 3
        else:
            mask = mask.clone()
            mask[..., self.length - 3:self.length] = torch.finfo(dtype).min
        return pos, mask
    monkeypatch.setattr(KVCache, "staged_tree_inputs", staged)
    yield


@pytest.mark.parametrize("bug", ["blind", "pos"])
def test_planted_fused_forward_bug_fails(monkeypatch, bug):
    a, g = _committed()
    b, _ = _committed()
    tokens, feats, tt, ti, par = _rows(g)
    root_b = b.commit(tokens, feats)
    out_b = b.tree_forward(tt, ti, par)
    with _planted(monkeypatch, bug):
        root_a, out_a = a.commit_tree_forward(tokens, feats, tt, ti, par)
    with pytest.raises(AssertionError):
        _assert_same((root_a, out_a, _state(a)), (root_b, out_b, _state(b)))


def _tree_and_inputs(d, root_hidden):
    tree, inputs = d.grow_tree_with_inputs(11, root_hidden, 9, 2, 3)
    return tree, inputs


@pytest.mark.parametrize("merged", [False, True], ids=["eagle", "eagle+lookup"])
def test_commit_extend_tree_equals_commit_then_extend_when_inputs_agree(merged):
    """With the root's children's remembered input set to what the commit returns, the fused expansion is the
    separate one (same tree, same inputs, same root output); with a different remembered input it is not."""
    from draft.lookup import LookupDrafter

    def make():
        d, g = _committed()
        if merged:
            look = LookupDrafter(V_TINY, max_matches=4)
            look.start(list(range(9)), 3, None)
            d = MergedDrafter([d, look], ["eagle", "lookup"])
            d.widths = [16, int(look.state([]).shape[-1])]
        return d, g

    a, g = make()
    b, _ = make()
    tokens, feats = torch.tensor([5, 7, 11]), torch.randn(3, 16, generator=g, dtype=torch.float64)
    probe, _ = make()                                                  # what the commit will return
    root = probe.commit(tokens, feats)
    tree, inputs = _tree_and_inputs(probe, root)                       # remembered inputs: depth 1 = root
    ga, ia, ra = a.commit_extend_tree(tokens, feats, tree, inputs, 2, 3, 6)
    rb = b.commit(tokens, feats)
    gb, ib = b.extend_tree(tree, inputs, rb, 2, 3, 6)
    torch.testing.assert_close(ra, rb)
    assert ga.tokens.tolist() == gb.tokens.tolist() and ga.parents.tolist() == gb.parents.tolist()
    torch.testing.assert_close(ga.scores, gb.scores)
    torch.testing.assert_close(ia, ib)
    assert len(ga) > len(tree)
    # the root's children drafted from another input: the fused re-feed reads it, the separate one replaces it
    stale = inputs.clone()
    stale[(tree.parents == 0)] += 0.7
    c, _ = make()
    d, _ = make()
    gc, _, _ = c.commit_extend_tree(tokens, feats, tree, stale, 2, 3, 6)
    gd, _ = d.extend_tree(tree, stale, d.commit(tokens, feats), 2, 3, 6)
    assert not torch.equal(gc.scores, gd.scores)


def test_commit_extend_tree_on_a_root_alone_is_a_commit():
    a, g = _committed()
    b, _ = _committed()
    tokens, feats = torch.tensor([5, 7]), torch.randn(2, 16, generator=g, dtype=torch.float64)
    single = DraftTree.single(7)
    ga, ia, ra = a.commit_extend_tree(tokens, feats, single, torch.zeros(1, 16, dtype=torch.float64), 2, 3, 6)
    rb = b.commit(tokens, feats)
    gb, _ = b.extend_tree(single, torch.zeros(1, 16, dtype=torch.float64), rb, 2, 3, 6)
    torch.testing.assert_close(ra, rb)
    assert ga.tokens.tolist() == gb.tokens.tolist()


class _OpCount:
    """A meter that counts its ops by kind (``draft_forward``, ``lm_head``, ...)."""

    def __init__(self):
        self.ops = {}

    @contextlib.contextmanager
    def op(self, kind, rows, ctx=0):
        self.ops[kind] = self.ops.get(kind, 0) + 1
        yield


def _eagle_lookup():
    """A committed EAGLE drafter merged with prompt lookup (its generator too): the counted tests' drafter."""
    from draft.lookup import LookupDrafter
    d, g = _committed()
    look = LookupDrafter(V_TINY, max_matches=4)
    look.start(list(range(9)), 3, None)
    m = MergedDrafter([d, look], ["eagle", "lookup"])
    m.widths = [16, int(look.state([]).shape[-1])]
    return m, g


def test_a_fused_step_costs_one_head_forward_fewer():
    """The claim, counted: the same expansion after a verified step, fused and separate, on an EAGLE + lookup
    drafter: draft-head forwards (the meter's ``draft_forward`` ops) 1 fewer, log-prob calls the same."""
    from draft.protocol import install_meter
    Count, make = _OpCount, _eagle_lookup

    counts = []
    for fused in (True, False):
        d, g = make()
        tokens, feats = torch.tensor([5, 7, 11]), torch.randn(3, 16, generator=g, dtype=torch.float64)
        root = d.commit(tokens[:1], feats[:1])
        tree, inputs = d.grow_tree_with_inputs(11, root, 9, 2, 3)
        meter = Count()
        install_meter(d, meter)
        if fused:
            d.commit_extend_tree(tokens, feats, tree, inputs, 2, 3, 6)
        else:
            d.extend_tree(tree, inputs, d.commit(tokens, feats), 2, 3, 6)
        counts.append(meter.ops)
    fused, separate = counts
    assert fused["draft_forward"] == separate["draft_forward"] - 1, counts
    assert fused["lm_head"] == separate["lm_head"], counts


@pytest.mark.skipif(not __import__("tests.helpers", fromlist=["STORIES"]).STORIES.is_dir(),
                    reason="../shared is not available")
@pytest.mark.parametrize("keys", [["tree.prefetch_level=false"],                              # the plain commit
                                  ["tree.prefetch_level=false", "tree.fuse_commit=true"]])    # fused, no prefetch
def test_stories260k_continuous_equals_hf_fused(tmp_path, keys):
    """``continuous`` with the commit neither fused nor prefetched, and fused without the prefetch, equals HF
    generate (greedy), stories260K on 5 ranks in one process, the untrained EAGLE head with prompt lookup (the
    fused forward and the merged fallback both run). The default (prefetched, hence fused) is test_e2e's run of
    every mode; no other mode reads these keys (tests/test_turnaround_off_chain.py's guard)."""
    from tests.test_turnaround_off_chain import streaming_modes_equal_hf
    streaming_modes_equal_hf(tmp_path, keys)


def _markov(seed: int = 3, vocab: int = 12):
    """A drafter whose states are their tokens (tests/test_sampling.py's Markov world): its outputs do not depend on
    the context, so a prefetched first level equals the one drafted after the commit, and the prefetched
    expansion must then equal the plain one node for node (its bookkeeping is what differs)."""
    from tests.test_sampling import MarkovDrafter
    g = torch.Generator().manual_seed(seed)
    return MarkovDrafter(torch.randn(vocab, vocab, generator=g) * 2.0)


@pytest.mark.parametrize("levels,max_new", [(2, 6), (3, 9), (2, 1)])
def test_prefetched_expansion_equals_the_plain_one_on_a_context_free_drafter(levels, max_new):
    from tests.test_sampling import enc
    d = _markov()
    root = enc(4)
    tree, inputs = d.grow_tree_with_inputs(4, root, 9, 2, 3)
    tokens, feats = torch.tensor([2, 4]), torch.zeros(2, 1, dtype=torch.float64)
    pre = d.prefetch_leaves(tree, inputs, root, 3)
    ga, ia, ra = d.commit_extend_tree(tokens, feats, tree, inputs, levels, 3, max_new, pre)
    gb, ib, rb = d.commit_extend_tree(tokens, feats, tree, inputs, levels, 3, max_new)
    assert ga.tokens.tolist() == gb.tokens.tolist() and ga.parents.tolist() == gb.parents.tolist()
    assert ga.depths.tolist() == gb.depths.tolist()
    torch.testing.assert_close(ga.scores, gb.scores)
    torch.testing.assert_close(ia, ib)
    torch.testing.assert_close(ra, rb)
    assert len(ga) > len(tree)


def test_planted_prefetch_rows_of_other_nodes_fail():
    """Planted bug: prefetched rows that belong to other nodes (as after a re-root that forgot to re-index them)
    give another tree, so the equality above can fail."""
    from tests.test_sampling import enc
    d = _markov()
    root = enc(4)
    tree, inputs = d.grow_tree_with_inputs(4, root, 9, 2, 3)
    tokens, feats = torch.tensor([2, 4]), torch.zeros(2, 1, dtype=torch.float64)
    leaf, out, s, t = d.prefetch_leaves(tree, inputs, root, 3)
    shifted = (leaf, out.roll(1, 0), s.roll(1, 0), t.roll(1, 0))
    ga, _, _ = d.commit_extend_tree(tokens, feats, tree, inputs, 2, 3, 6, shifted)
    gb, _, _ = d.commit_extend_tree(tokens, feats, tree, inputs, 2, 3, 6)
    assert ga.tokens.tolist() != gb.tokens.tolist()


def test_a_prefetched_step_holds_one_forward_and_one_log_prob_call():
    """The claim, counted on an EAGLE + lookup drafter, levels = 2: on the verified step's chain, plain = 3 head
    forwards (commit, re-feed, level 2) and 2 log-prob calls; fused = 2 and 2; prefetched = 1 and 1 (the prefetch
    itself, after the send: 1 and 1)."""
    from draft.protocol import install_meter
    Count, make = _OpCount, _eagle_lookup

    got = {}
    for how in ("plain", "fused", "prefetch", "chain"):
        d, g = make()
        tokens, feats = torch.tensor([5, 7, 11]), torch.randn(3, 16, generator=g, dtype=torch.float64)
        root = d.commit(tokens[:1], feats[:1])
        tree, inputs = d.grow_tree_with_inputs(11, root, 9, 2, 3)
        pre = d.prefetch_leaves(tree, inputs, root, 3) if how == "chain" else None
        meter = Count()
        install_meter(d, meter)
        if how == "plain":
            d.extend_tree(tree, inputs, d.commit(tokens, feats), 2, 3, 6)
        elif how == "fused":
            d.commit_extend_tree(tokens, feats, tree, inputs, 2, 3, 6)
        elif how == "prefetch":
            d.prefetch_leaves(tree, inputs, root, 3)
        else:
            d.commit_extend_tree(tokens, feats, tree, inputs, 2, 3, 6, pre)
        got[how] = (meter.ops.get("draft_forward", 0), meter.ops.get("lm_head", 0))
    assert got == {"plain": (3, 2), "fused": (2, 2), "prefetch": (1, 1), "chain": (1, 1)}, got
