"""Suffix retrieval (``draft/suffix.py``): the suffix automaton against brute force, the drafter's proposals against a
brute-force continuation trie, incremental = from scratch, a planted bug the property test catches, the merged
tree, the exact sampling law with the suffix source, and greedy output = HF generate through the in-process ring.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from config.run_config import DEFAULT, ConfigError, apply_overrides
from draft.merged import MergedDrafter, SourceError, build_sources
from draft.protocol import TreeDrafter, can_extend
from tests.multidraft_common import path_to
from draft.suffix import (FLOOR, SuffixAutomaton, SuffixDrafter, SuffixStore, advance, corpus_automaton,
                          read_corpus, with_continuation)
from tests.helpers import check_tree


def match_text(sam: SuffixAutomaton, tokens) -> tuple[int, int]:
    """The match of a whole query text (:func:`advance` token by token from the empty match)."""
    state, length = 0, 0
    for t in tokens:
        state, length = advance(sam, state, length, int(t))
    return state, length


def T(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def occurrences(text: list[int], w: list[int]) -> list[int]:
    """End positions of ``w`` in ``text`` (brute force)."""
    n = len(w)
    return [i + n - 1 for i in range(len(text) - n + 1) if text[i:i + n] == w]


def brute_longest_match(text: list[int], query: list[int]) -> int:
    """Length of the longest suffix of ``query`` that occurs in ``text``."""
    for n in range(len(query), 0, -1):
        if occurrences(text, query[len(query) - n:]):
            return n
    return 0


def automaton_mismatches(sam_cls, rng: random.Random, trials: int = 300) -> list:
    """Property check of an automaton class against brute force; returns the counterexamples (empty: all hold).
    Matches (``advance``) equal the brute-force longest match at every query position; ``cnt`` of a substring's
    state equals its number of occurrences; ``nreal`` equals the real tokens that follow some occurrence."""
    bad = []
    for _ in range(trials):
        alpha = rng.choice([2, 3, 5])
        text = [rng.randrange(alpha) for _ in range(rng.randrange(0, 40))]
        sam = sam_cls()
        sam.extend_all(text)
        query = [rng.randrange(alpha) for _ in range(rng.randrange(1, 15))]
        st, ln = 0, 0
        for i, t in enumerate(query):
            st, ln = advance(sam, st, ln, t)
            if ln != brute_longest_match(text, query[:i + 1]):
                bad.append(("match", text, query[:i + 1]))
        for _ in range(10):
            if not text:
                break
            a = rng.randrange(len(text))
            w = text[a:a + rng.randint(1, 6)]
            st, ln = match_text(sam, w)
            ends = occurrences(text, w)
            if ln != len(w) or sam.cnt[st] != len(ends):
                bad.append(("cnt", text, w))
            follow = {text[e + 1] for e in ends if e + 1 < len(text)}
            if sam.nreal[st] != len(follow):
                bad.append(("nreal", text, w))
    return bad


def test_automaton_equals_brute_force():
    assert automaton_mismatches(SuffixAutomaton, random.Random(0)) == []


class ForgetfulClone(SuffixAutomaton):
    """A planted bug: a clone starts with no occurrences of its own (its copy of ``cnt[q]`` forgotten), so it
    counts only the new end position."""

    def extend(self, c):
        n = len(self.cnt)
        super().extend(c)
        if len(self.cnt) == n + 2:                  # a clone was made (the state after the new one)
            self.cnt[n + 1] = 1


def test_planted_bug_fails_the_property_check():
    assert automaton_mismatches(ForgetfulClone, random.Random(0), 100)


def test_incremental_extension_equals_building_from_scratch():
    """Extending between queries (as tokens commit) leaves exactly the arrays a fresh build makes; and the drafter
    after several commits proposes what a drafter started on the whole context proposes."""
    rng = random.Random(1)
    for _ in range(200):
        text = [rng.randrange(rng.choice([2, 4])) for _ in range(rng.randrange(0, 50))]
        inc = SuffixAutomaton()
        for i, t in enumerate(text):
            inc.extend(t)
            if rng.random() < 0.3:
                match_text(inc, text[:i])                   # queries in between change nothing
        ref = SuffixAutomaton()
        ref.extend_all(text)
        assert (inc.next, inc.link, inc.length, inc.cnt, inc.nreal, inc.last) == \
            (ref.next, ref.link, ref.length, ref.cnt, ref.nreal, ref.last)
    for seed in range(30):
        rng = random.Random(seed)
        ctx = [rng.randrange(5) for _ in range(rng.randrange(2, 40))]
        cut = rng.randrange(1, len(ctx))
        a, b = SuffixDrafter(8, threshold=3), SuffixDrafter(8, threshold=3)
        a.start(ctx[:cut - 1], ctx[cut - 1], None)
        i = cut
        while i < len(ctx):
            j = rng.randint(i + 1, len(ctx))
            ha = a.commit(T(ctx[i:j]), None)
            i = j
        hb = b.start(ctx[:-1], ctx[-1], None)
        if cut < len(ctx):
            assert torch.equal(ha, hb)
        ta, tb = a.grow_tree(ctx[-1], None, 20, 4, 4), b.grow_tree(ctx[-1], None, 20, 4, 4)
        assert torch.equal(ta.tokens, tb.tokens) and torch.equal(ta.parents, tb.parents)


def brute_trie(text: list[int], path_ctx: list[int], min_match: int):
    """The proposal match of ``path_ctx`` against ``text`` (its own text when equal), brute force: the longest
    suffix u (>= min_match) with an occurrence in ``text`` followed by a token; returns (u, {continuation: count},
    N) where counts are per next token."""
    own = path_ctx is text
    for n in range(len(path_ctx) - (1 if own else 0), min_match - 1, -1):
        u = path_ctx[len(path_ctx) - n:]
        ends = [e for e in occurrences(text, u) if e + 1 < len(text)]
        if ends:
            follow = Counter(text[e + 1] for e in ends)
            return u, follow, len(ends)
    return None, Counter(), 0


def test_drafter_state_and_tree_equal_brute_force():
    """The committed state is the brute-force first level (counts / N, prior by match length); every tree node's
    score is log(cnt(u + path) / N) + sum_j log p(L + j), with the counts counted by brute force."""
    rng = random.Random(2)
    lp_short, lp_long = math.log(0.5), math.log(0.9)
    for trial in range(200):
        text = [rng.randrange(rng.choice([2, 3, 4])) for _ in range(rng.randrange(2, 40))]
        d = SuffixDrafter(8, threshold=3, token_prob=0.5, long_token_prob=0.9, max_children=8)
        h = d.start(text[:-1], text[-1], None)
        u, follow, n = brute_trie(text, text, 1)
        ids, scores = h[:8].long().tolist(), h[8:].tolist()
        if u is None:
            assert ids == [-1] * 8 and scores == [FLOOR] * 8
            assert len(d.grow_tree(text[-1], h, 10, 3, 4)) == 1
            continue
        lp = lp_long if len(u) >= 3 else lp_short
        prior = lambda d: sum(lp_long if len(u) + j >= 3 else lp_short for j in range(d))
        want = sorted(((math.log(c / n) + lp, t) for t, c in follow.items()), key=lambda x: (-x[0], x[1]))
        assert ids[:len(want)] == [t for _, t in want], (text, u)
        assert scores[:len(want)] == pytest.approx([s for s, _ in want], abs=1e-5)
        tree = d.grow_tree(text[-1], h, 30, 3, 4)
        check_tree(tree)
        assert tree.scores.tolist() == sorted(tree.scores.tolist(), reverse=True)
        assert max(tree.depths.tolist()) <= 4
        for i in range(1, len(tree)):
            path = tree.tokens[path_to(tree, i)[1:]].tolist()
            cnt = len(occurrences(text, u + path))
            assert float(tree.scores[i]) == pytest.approx(math.log(cnt / n) + prior(len(path)), abs=1e-5), (text, path)


def test_path_prior_is_the_sum_of_per_token_priors():
    from draft.suffix import path_logp, token_logp
    for L in range(0, 8):
        for d in range(0, 8):
            for th in range(1, 6):
                ref = sum(token_logp(L + j, th, -1.0, -0.1) for j in range(d))
                assert path_logp(L, d, th, -1.0, -0.1) == pytest.approx(ref)


def test_tree_forward_states_equal_state_of_the_path():
    rng = random.Random(3)
    for _ in range(50):
        text = [rng.randrange(3) for _ in range(rng.randrange(3, 30))]
        d = SuffixDrafter(8, threshold=2, max_children=4)
        h = d.start(text[:-1], text[-1], None)
        tree = d.grow_tree(text[-1], h, 12, 3, 4)
        if len(tree) == 1:
            continue
        rows = d.tree_forward(tree.tokens[1:], h.expand(len(tree) - 1, -1), tree.parents[1:] - 1)
        assert d.tree_size == len(tree) - 1
        for i in range(1, len(tree)):
            path = tree.tokens[path_to(tree, i)[1:]].tolist()
            assert torch.equal(rows[i - 1], d.state(path))
            first = d.logprobs(rows[i - 1])
            assert first.shape == (8,)
        d.drop_tree()
        assert d.tree_size == 0


def test_store_and_corpus_propose_across_requests(tmp_path):
    """An earlier request of the process (the store) and a corpus both propose; the store stays bounded."""
    store = SuffixStore(capacity=64)
    d = SuffixDrafter(50, store=store, threshold=3, other_threshold=4, long_token_prob=0.9)
    d.start([1, 2, 3, 4, 5, 6, 7, 8], 9, None)
    d.commit(T([10, 11]), None)
    h = d.start([20, 21, 5, 6, 7], 8, None)          # new request: the first one joined the store
    assert store.docs and list(store.docs[0]) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert d.match_lengths() == [0, 4]                 # "5 6 7 8" occurs in the store, followed by 9
    assert int(h[0]) == 9 and float(h[8]) == pytest.approx(math.log(0.9))
    tree = d.grow_tree(8, h, 10, 4, 4)
    assert tree.tokens.tolist() == [8, 9, 10, 11]
    for i in range(20):
        store.add(list(range(i, i + 10)))
    assert store.tokens <= 64
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"token_ids": [30, 31, 32, 33]}\n{"text": "ab"}\n"cd"\n{"turns": ["e", "f"]}\n')
    docs = read_corpus(corpus, lambda s: [ord(ch) for ch in s])
    assert docs == [[30, 31, 32, 33], [97, 98], [99, 100], [101, 10, 102]]
    sam = corpus_automaton(corpus, lambda s: [40 + (ord(ch) % 5) for ch in s])
    assert corpus_automaton(corpus, lambda s: []) is sam                          # built once per process
    c = SuffixDrafter(50, corpus=sam, threshold=2)
    h = c.start([7, 30], 31, None)
    assert c.match_lengths() == [0, 2] and int(h[0]) == 32
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(SourceError, match="line 1"):
        read_corpus(tmp_path / "bad.jsonl", list)
    with pytest.raises(SourceError, match="no such file"):
        corpus_automaton(tmp_path / "missing.txt", list)


def test_matches_in_other_texts_take_their_own_threshold():
    """A match in the static corpus or in the store of earlier requests takes the long prior only from
    ``draft.suffix_other_threshold`` on; a match of the same length in the request's own text keeps
    ``draft.suffix_threshold`` (docs/suffix.md: other texts' matches are right less often). The planted bug, other
    texts scored with the own text's threshold, gives log 0.8 where this asserts log 0.3."""
    corpus = SuffixAutomaton()
    corpus.add_document([1, 2, 3, 4, 9])
    lo, hi = math.log(0.3), math.log(0.8)
    d = SuffixDrafter(50, corpus=corpus, threshold=3, other_threshold=5)
    h = d.start([7, 1, 2], 3, None)                   # the context ends "1 2 3": a corpus match of 3, then 4 9
    assert d.match_lengths() == [0, 3]
    assert int(h[0]) == 4 and float(h[8]) == pytest.approx(lo)
    tree = d.grow_tree(3, h, 10, 4, 4)                 # copied at match lengths 3 and 4: both below 5
    assert tree.tokens.tolist() == [3, 4, 9] and tree.scores.tolist() == pytest.approx([0, lo, 2 * lo])
    own = SuffixDrafter(50, threshold=3, other_threshold=5)
    h = own.start([1, 2, 3, 4, 9, 1, 2], 3, None)     # the same match of 3 in the request's own text
    assert own.match_lengths() == [3] and int(h[0]) == 4 and float(h[8]) == pytest.approx(hi)
    store = SuffixStore(capacity=64)
    s = SuffixDrafter(50, store=store, threshold=3, other_threshold=5)
    s.start([1, 2, 3, 4, 9], 8, None)
    h = s.start([7, 1, 2], 3, None)                   # the first request joined the store: a store match of 3
    assert s.match_lengths() == [0, 3] and int(h[0]) == 4 and float(h[8]) == pytest.approx(lo)
    at = SuffixDrafter(50, corpus=corpus, threshold=3, other_threshold=4)
    h = at.start([7, 1, 2], 3, None)
    tree = at.grow_tree(3, h, 10, 4, 4)                # the second token is copied below a match of 4: long
    assert float(h[8]) == pytest.approx(lo) and tree.scores.tolist() == pytest.approx([0, lo, lo + hi])
    with pytest.raises(SourceError, match="suffix_other_threshold"):
        SuffixDrafter(50, other_threshold=0)


def test_config_keys_and_build_sources(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"token_ids": [3, 4, 5, 6]}\n')
    cfg = apply_overrides(DEFAULT, ["draft.sources=lookup,suffix", f"draft.suffix_corpus={corpus}",
                                    "draft.suffix_threshold=2", "draft.suffix_other_threshold=6"])
    m = build_sources(cfg, 100, None, torch.float64, "cpu")
    assert isinstance(m, MergedDrafter) and m.names == ["lookup", "suffix"] and isinstance(m.sources[1], TreeDrafter)
    assert m.sources[1].corpus is not None and m.sources[1].threshold == 2 and m.sources[1].max_depth == 0
    assert m.sources[1].other_threshold == 6
    with pytest.raises(ConfigError):
        apply_overrides(DEFAULT, ["draft.sources=suffix,suffix"])
    with pytest.raises(SourceError, match="suffix_token_prob"):
        build_sources(apply_overrides(DEFAULT, ["draft.sources=suffix", "draft.suffix_token_prob=0"]), 100, None,
                      torch.float64, "cpu")


# ---------------------------------------------------------------------------------------------------------------
# Merged with an EAGLE-like drafter: the tree interface and incremental expansion
# ---------------------------------------------------------------------------------------------------------------

def _eagle_suffix(seed=0):
    from tests.test_drafters import V_TINY, _random_eagle
    eagle, suf = _random_eagle(seed), SuffixDrafter(V_TINY, max_children=4, threshold=2)
    merged = MergedDrafter([eagle, suf], ["eagle", "suffix"])
    g = torch.Generator().manual_seed(seed)
    prompt = [1, 5, 9, 13, 22, 7, 5, 9, 13, 30, 5, 9]
    h = merged.start(prompt, 13, torch.randn(len(prompt), 16, generator=g, dtype=torch.float64))
    return merged, h


def test_merged_top_tokens_and_incremental_expansion():
    merged, h = _eagle_suffix()
    rows = merged.tree_forward(T([22, 30, 7]), h.expand(3, -1), T([-1, -1, 1]))
    states = torch.cat([h[None], rows])
    merged.drop_tree()
    s, t = merged.top_tokens(states, 5)
    lp = merged.logprobs(states)
    ref_s, _ = torch.topk(lp, 5, dim=-1)
    assert torch.allclose(s, ref_s) and torch.allclose(lp.gather(-1, t), s)      # the top-k of the max (ties aside)
    assert (t >= 0).all() and all(len(set(r.tolist())) == 5 for r in t)
    assert can_extend(merged)
    tree, inputs = merged.grow_tree_with_inputs(13, h, 14, 4, 3)
    check_tree(tree)
    first = {int(t) for t, p in zip(tree.tokens, tree.parents) if p == 0}
    assert {22, 30} <= first                           # "5 9 13" was followed by 22 and by 30
    assert torch.allclose(inputs, merged.tree_inputs(tree, h), atol=1e-9)
    grown, _ = merged.extend_tree(tree, inputs, h, 2, 3, 6)
    check_tree(grown)
    assert len(grown) == 20 and merged.tree_size == 0


# ---------------------------------------------------------------------------------------------------------------
# The exact sampling law with a suffix source in the merged tree (the harness of tests/test_sampling.py)
# ---------------------------------------------------------------------------------------------------------------

def _suffix_world():
    """A suffix source whose corpus makes it propose from the first round (after 0: 3 5 / 3 6). A corpus, not the
    store: the enumeration replays every run, and a store would learn from the replays (a drafter that changes
    between runs breaks the replay, not the law)."""
    from tests.test_sampling import V
    corpus = SuffixAutomaton()
    corpus.add_document([0, 3, 5, 2, 0, 3, 5, 1, 0, 3, 6])
    return SuffixDrafter(V, corpus=corpus, threshold=2, max_children=2)


@pytest.mark.parametrize("mode,world,temp,top_p,overrides", [
    ("naive", 3, 1.0, 1.0, {"tree.top_k": 2}),
    ("continuous", 3, 1.0, 0.9, {"tree.init_topk": 1, "tree.expand_topk": 1, "tree.expand_total_token": 3}),
    ("pruned", 3, 0.7, 1.0, {"tree.init_topk": 1}),
])
def test_exact_law_with_the_suffix_source(mode, world, temp, top_p, overrides):
    from tests.multidraft_common import assert_merged_law
    from tests.test_sampling import BranchingSampler, MarkovDrafter, make_world
    target, det = make_world(11, "random", 1.5)
    sampler = BranchingSampler(temp, top_p, 0, 2)
    suf = _suffix_world()
    drafter = MergedDrafter([MarkovDrafter(det), suf], ["eagle", "suffix"])
    proposed = Counter()
    real_grow = suf.grow_tree

    def grow(*a):
        t = real_grow(*a)
        proposed[len(t) > 1] += 1
        return t
    suf.grow_tree = grow
    assert_merged_law(mode, world, target, drafter, sampler, overrides)
    assert proposed[True] > 0, "the suffix source never proposed"


def test_exact_law_with_the_suffix_source_catches_a_planted_bug(monkeypatch):
    from tests.multidraft_common import make_merged_runner
    from tests.test_sampling import (BranchingSampler, MarkovDrafter, _broken_walk, exact_law, make_world,
                                     target_law, total_variation)
    target, det = make_world(11, "target")
    monkeypatch.setattr("pipeline.modes.naive.walk_tree", _broken_walk("no_renorm", det))
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    drafter = MergedDrafter([MarkovDrafter(det), _suffix_world()], ["eagle", "suffix"])
    law, _ = exact_law(make_merged_runner("naive", 3, target, drafter, sampler, 2, {"tree.top_k": 2}), sampler)
    assert total_variation(law, target_law(sampler, target, 2)) > 0.02


# ---------------------------------------------------------------------------------------------------------------
# Greedy output = HF generate through the in-process ring
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model.split import split_checkpoint
    from tests.helpers import tiny_llama
    root = tmp_path_factory.mktemp("suffix")
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    stages = split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)
    return SimpleNamespace(full=full, stages=stages)


PROMPTS = [[1, 5, 9, 13, 22, 7, 5, 9, 13], [1] + list(range(3, 40)) + list(range(3, 20))]


@pytest.mark.parametrize("sources,head,extra", [("suffix", None, []), ("eagle,lookup,suffix", "oracle", []),
                                                ("eagle,suffix", None, ["draft.suffix_max_depth=12"])])
def test_every_mode_with_the_suffix_source_equals_hf(tiny, sources, head, extra):
    """Greedy output = HF generate in every tree mode; the last case lets suffix chains run 12 deep (past the
    tree's depth) in the merged tree."""
    from pipeline.inprocess import run_threaded
    from tests.helpers import hf_greedy
    modes = ["naive", "pruned", "continuous", "pipedec"]
    over = ["max_new_tokens=16", "dtype=float64", f"draft.sources={sources}", "draft.suffix_threshold=2", *extra]
    res = run_threaded(tiny.stages, PROMPTS + PROMPTS[:1], modes, over, {2}, f"oracle:{tiny.full}" if head else None)
    for mode, rows in res.items():
        for p, r in zip(PROMPTS + PROMPTS[:1], rows):
            assert r.output_ids == hf_greedy(tiny.full, p, 16, {2}, torch.float64), (sources, mode)


def _forgetting_run(d: SuffixDrafter):
    """Request A, then ``forget_requests``, then A again: the tree drafted at A's second start."""
    from draft.protocol import forget_requests
    d.start([1, 2, 3, 4, 5, 6, 7, 8], 9, None)
    d.commit(T([10, 11]), None)
    forget_requests(d)
    h = d.start([20, 21, 5, 6, 7], 8, None)
    return d.match_lengths(), d.grow_tree(8, h, 10, 4, 4).tokens.tolist()


def test_forget_requests_drafts_as_a_fresh_process():
    """After ``draft.protocol.forget_requests`` a drafter drafts what one that never saw the earlier request drafts
    (the store emptied, the ended request not joining it at the next start); a merged drafter and a wrapper
    forward it. Without it the store proposes the earlier text (the case above); a planted forget that empties the
    store but keeps the ended request's context fails (it rejoins the store at the next start)."""
    from draft.protocol import forget_requests
    fresh = SuffixDrafter(50, store=SuffixStore(capacity=64), threshold=3, long_token_prob=0.9)
    h = fresh.start([20, 21, 5, 6, 7], 8, None)
    want = (fresh.match_lengths(), fresh.grow_tree(8, h, 10, 4, 4).tokens.tolist())
    assert want[0] == [0, 0]
    store = SuffixStore(capacity=64)
    assert _forgetting_run(SuffixDrafter(50, store=store, threshold=3, long_token_prob=0.9)) == want
    assert not store.docs and store.tokens == 0

    class KeepsContext(SuffixDrafter):
        def forget_requests(self):                      # planted: the store goes, the ended request stays
            self.store.clear()
            self.reset()
    assert _forgetting_run(KeepsContext(50, store=SuffixStore(capacity=64), threshold=3, long_token_prob=0.9)) != want
    # the seam reaches sources of a merged drafter and a wrapper's inner drafter
    inner = SuffixDrafter(50, store=SuffixStore(capacity=64))
    inner.start([1, 2, 3], 4, None)
    inner.start([5, 6], 7, None)                        # the first request joins the store
    merged = MergedDrafter.__new__(MergedDrafter)
    merged.sources = [inner]
    forget_requests(SimpleNamespace(inner=merged))
    assert not inner.store.docs and inner.context == []
    forget_requests(None)
    forget_requests(SimpleNamespace())                  # no memory: nothing to do


def test_each_mode_of_a_run_drafts_as_if_alone(tiny, monkeypatch):
    """``run_threaded`` (as ``pipeline.run --modes``) decodes the same prompts in every mode; with the suffix
    source's store, a later mode would copy an earlier mode's answers. Each mode now drafts as a run of it alone:
    ``naive`` after ``pruned`` accepts exactly what ``naive`` alone accepts; with the forgetting removed (planted)
    it accepts more."""
    import pipeline.inprocess as inproc
    over = ["max_new_tokens=16", "dtype=float64", "draft.sources=suffix", "draft.suffix_threshold=2"]

    def naive_accepts(modes):
        res = inproc.run_threaded(tiny.stages, PROMPTS, modes, over, {2}, None)
        return [r.accept_lengths for r in res["naive"]]
    alone = naive_accepts(["naive"])
    assert naive_accepts(["pruned", "naive"]) == alone
    monkeypatch.setattr(inproc, "forget_requests", lambda d: None)
    leaked = naive_accepts(["pruned", "naive"])
    assert sum(map(len, leaked)) < sum(map(len, alone)), (leaked, alone)   # fewer steps: it copied pruned's answers
