"""Prompt lookup (``draft/lookup.py``), the merged drafter (``draft/merged.py``: top tokens, incremental
expansion, reused search outputs) and the small-LM drafter's KV cache against a plain forward.
"""
from __future__ import annotations

from types import SimpleNamespace
import math

import numpy as np
import pytest
import torch

from config.run_config import ConfigError, DEFAULT, apply_overrides
from draft.drafter import BeamTreeDrafter
from draft.lookup import FLOOR, LookupDrafter, NgramIndex, continuation_trie
from tests.helpers import check_tree, find_continuations
from draft.merged import MergedDrafter, SourceError, parse_sources
from draft.protocol import TreeDrafter, can_extend, top_tokens
from draft.ssm import SmallLMDrafter
from draft.tree import DraftTree
from tests.multidraft_common import T, path_to, tree


def test_find_continuations_longest_ngram_most_recent_first():
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    assert find_continuations(seq, 3, 1, 8, 2) == [[5, 7], [4, 9]]            # "2 3" occurs twice before
    assert find_continuations(seq, 3, 1, 1, 2) == [[5, 7]]
    assert find_continuations([1, 2, 3], 3, 1, 8, 2) == []
    assert find_continuations([4, 4, 4], 2, 2, 8, 3) == [[4]]                  # overlaps allowed, not the suffix


def test_lookup_tree_scores_and_drafter():
    t = continuation_trie(3, [[5, 7], [5, 8], [6]], math.log(0.5), 10)
    check_tree(t)
    by_path = {tuple(t.tokens[path_to(t, i)].tolist()): float(t.scores[i]) for i in range(len(t))}
    assert by_path[(3, 5)] == pytest.approx(math.log(2 / 3) + math.log(0.5))
    assert by_path[(3, 5, 7)] == pytest.approx(math.log(1 / 3) + 2 * math.log(0.5))
    d = LookupDrafter(vocab_size=20, max_ngram=2, max_matches=4, token_logp=math.log(0.5))
    h = d.start([1, 2, 3, 4, 9, 2], 3, None)                                   # context ... 2 3: copies "4 9"
    assert h.shape == (8,)                                                     # compact: 4 id slots, 4 scores
    lp = d.logprobs(h)
    assert lp.shape == (20,) and int(torch.argmax(lp)) == 4 and float(lp[4]) == pytest.approx(math.log(0.5))
    assert float(lp[5]) == FLOOR
    assert [x.tolist() for x in d.supported_tokens(h, 2)] == [[pytest.approx(math.log(0.5)), float("-inf")], [4, -1]]
    s, t = top_tokens(d, h, 3)                                                 # alone: real tokens, floor after
    assert t[0] == 4 and len(set(t.tolist())) == 3 and (t >= 0).all() and float(s[1]) == FLOOR
    g = d.grow_tree(3, h, 10, 2, 4)
    assert g.tokens.tolist()[:3] == [3, 4, 9]
    assert float(g.scores[1]) == pytest.approx(float(lp[4]))                  # the state is the trie's first level
    out = d.tree_forward(T([4]), h[None], T([-1]))                            # after ... 2 3 4: "9" followed
    assert int(torch.argmax(d.logprobs(out[0]))) == 9
    d.drop_tree()
    assert isinstance(d, TreeDrafter)
    h = d.commit(T([7, 2, 3]), None)                                           # ... 2 3 4 9 2 3 7 2 3: two matches
    lp = d.logprobs(h)
    assert float(lp[4]) == pytest.approx(float(lp[7])) == pytest.approx(math.log(0.5) + math.log(0.5))


def test_ngram_index_equals_find_continuations():
    """The indexed query (context indexed as it grows, the tree path scanned) returns exactly what the plain
    scan of the whole sequence returns, for every split between context and path."""
    import random
    rng = random.Random(0)
    for _ in range(1500):
        seq = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        index, ctx = NgramIndex(lo, hi), []
        cut = rng.randint(0, len(seq))
        for t in seq[:cut]:
            ctx.append(t)
            if rng.random() < 0.3:
                index.sync(ctx)
        index.sync(ctx)
        m, n = rng.randint(1, 5), rng.randint(1, 6)
        assert index.continuations(seq[cut:], m, n) == find_continuations(seq, hi, lo, m, n), (seq, cut, lo, hi)
    index = NgramIndex(1, 2)
    index.sync([1, 2, 1])
    index.sync([5, 5])                                                         # a new list starts over
    assert index.continuations([], 8, 2) == [[5]] and index.continuations([2], 8, 2) == []


def _random_eagle(seed: int = 0):
    """A real :class:`draft.drafter.Drafter` on a random EAGLE head (states depend on the whole path)."""
    from transformers import LlamaConfig

    from draft.drafter import Drafter
    from draft.eagle import init_untrained_head
    cfg = LlamaConfig(vocab_size=V_TINY, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      num_key_value_heads=2, num_hidden_layers=1)
    head = init_untrained_head(cfg, seed=seed).double().eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5)
    return Drafter(head, torch.nn.Linear(16, V_TINY, bias=False).double(), 128)


V_TINY = 40


def _eagle_lookup(seed: int = 0, scale: float = 1.0):
    eagle, look = _random_eagle(seed), LookupDrafter(V_TINY, max_matches=4)
    merged = MergedDrafter([eagle, look], ["eagle", "lookup"], [1.0, scale])
    g = torch.Generator().manual_seed(seed)
    prompt = [1, 5, 9, 13, 22, 7, 5, 9, 13, 30, 5, 9]
    h = merged.start(prompt, 13, torch.randn(len(prompt), 16, generator=g, dtype=torch.float64))
    return merged, h


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_merged_top_tokens_is_the_topk_of_the_maximum(scale):
    """The union of the sources' own top-k, best score per token, is the top-k of the elementwise maximum
    (``logprobs``), with no vocabulary-sized work in the lookup source; empty lookup slots never win."""
    merged, h = _eagle_lookup(scale=scale)
    rows = merged.tree_forward(T([22, 30, 7]), h.expand(3, -1), T([-1, -1, 1]))
    states = torch.cat([h[None], rows])
    merged.drop_tree()
    s, t = merged.top_tokens(states, 5)
    ref_s, ref_t = torch.topk(merged.logprobs(states), 5, dim=-1)
    assert torch.equal(t, ref_t) and torch.allclose(s, ref_s)
    assert (t >= 0).all()


def test_merged_drafter_expands_incrementally_and_exactly():
    """eagle + lookup supports incremental expansion: ``tree_inputs`` gives each node its parent's merged state
    (checked against feeding the path alone), ``extend_tree`` appends ancestors-first below the tree, and the
    committed state is untouched by all of it."""
    merged, h = _eagle_lookup()
    assert can_extend(merged)
    tree, inputs = merged.grow_tree_with_inputs(13, h, 14, 4, 3)
    check_tree(tree)
    assert len(tree) == 14 and inputs.shape == (14, h.numel()) and merged.tree_size == 0
    for i in range(1, len(tree)):
        path = path_to(tree, int(tree.parents[i]))[1:]                           # the parent's path below the root
        if not path:
            assert torch.equal(inputs[i], h)
            continue
        feats, state = h, None
        for j, node in enumerate(path):                                         # feed the path as a chain
            state = merged.tree_forward(tree.tokens[node:node + 1], feats[None], T([j - 1]))[0]
            feats = state
        merged.drop_tree()
        assert torch.allclose(inputs[i], state, atol=1e-9), i
    grown, grown_inputs = merged.extend_tree(tree, inputs, h, 2, 3, 6)
    check_tree(grown)
    assert len(grown) == 20 and torch.equal(grown.tokens[:14], tree.tokens)
    assert torch.equal(grown_inputs[:14], inputs) and merged.tree_size == 0
    assert torch.allclose(merged.commit(T([22]), torch.zeros(1, 16, dtype=torch.float64)),
                          _eagle_lookup()[0].commit(T([22]), torch.zeros(1, 16, dtype=torch.float64)))
    sampling = MergedDrafter([_random_eagle(), SimpleNamespace(samples=True)])
    assert not can_extend(sampling)                                             # sampled draws: redraft instead


def _count_forwards(drafter) -> list[int]:
    """Record the rows of every ``tree_forward`` call of ``drafter`` (a list that grows as it is called)."""
    calls, real = [], drafter.tree_forward

    def counted(tokens, features, parents):
        calls.append(int(tokens.numel()))
        return real(tokens, features, parents)
    drafter.tree_forward = counted
    return calls


@pytest.mark.parametrize("seed,total,depth,top_k", [(0, 14, 4, 3), (1, 30, 5, 4), (2, 60, 5, 10), (3, 17, 1, 10)])
def test_merged_tree_inputs_reuse_the_search_outputs(seed, total, depth, top_k):
    """The EAGLE source's own search outputs give its slice of the merged inputs: the same states as feeding every
    inner node again (``tree_inputs`` without them), with EAGLE forwards beyond the search's ``depth`` levels only
    for the parents lookup alone proposed (and their paths): fewer rows than feeding every inner node."""
    merged, h = _eagle_lookup(seed)
    calls = _count_forwards(merged.sources[0])
    tree, inputs = merged.grow_tree_with_inputs(13, h, total, depth, top_k)
    extra = calls[depth:]                                               # after the beam's own levels
    calls.clear()
    ref = merged.tree_inputs(tree, h)                                   # every inner node fed again
    assert torch.allclose(inputs, ref, atol=1e-9) and merged.tree_size == 0
    assert sum(extra) < sum(calls) and len(extra) <= len(calls)


def test_merged_tree_inputs_cost_no_forward_when_lookup_adds_nothing():
    """With no earlier occurrence to copy, the merged tree is EAGLE's and its inputs come from the search alone."""
    eagle, look = _random_eagle(5), LookupDrafter(V_TINY, max_matches=4)
    merged = MergedDrafter([eagle, look], ["eagle", "lookup"])
    prompt = [1, 2, 3, 4, 5, 6]
    h = merged.start(prompt, 13, torch.randn(len(prompt), 16, generator=torch.Generator().manual_seed(5),
                                             dtype=torch.float64))
    calls = _count_forwards(eagle)
    tree, inputs = merged.grow_tree_with_inputs(13, h, 30, 4, 4)
    assert calls == [4] * 4                                             # the beam's levels, nothing more
    assert torch.equal(tree.tokens, eagle.grow_tree(13, h[:16], 30, 4, 4).tokens)
    assert torch.allclose(inputs, merged.tree_inputs(tree, h), atol=1e-9)


def test_small_lm_drafter_cache_equals_plain_forward(tmp_path):
    from transformers import AutoModelForCausalLM
    from tests.helpers import tiny_llama
    path = tiny_llama(tmp_path / "ssm", seed=4, layers=2, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    d = SmallLMDrafter(path, vocab_size=100, dtype=torch.float64)             # model vocab 96: padded to 100
    assert isinstance(d, TreeDrafter)
    ctx = [1, 5, 9, 13]
    h = d.start(ctx[:-1], ctx[-1], None)
    h = d.commit(T([7, 8]), None)
    ctx += [7, 8]

    def plain(seq):
        with torch.no_grad():
            return torch.log_softmax(ref(T([seq])).logits[0, -1].double(), -1)
    assert torch.allclose(h[:96], plain(ctx), atol=1e-9) and float(h[96:].max()) < -1e3
    out = d.tree_forward(T([3, 4, 6]), h.expand(3, -1), T([-1, -1, 0]))       # 3, 4 below the root, 6 below 3
    for row, path in zip(out, ([3], [4], [3, 6])):
        assert torch.allclose(row[:96], plain(ctx + path), atol=1e-9)
    d.drop_tree()
    t = d.grow_tree(8, h, 8, 2, 3)                                            # deterministic: EAGLE-2 beam
    check_tree(t)
    assert t.proposals is None and len(t) == 8
    assert torch.allclose(d.commit(T([2]), None)[:96], plain(ctx + [2]), atol=1e-9)


def test_sources_config_errors_are_one_line():
    assert parse_sources("eagle, lookup,ssm:/x") == [("eagle", ""), ("lookup", ""), ("ssm", "/x")]
    for bad in ("medusa", "ssm", "lookup,lookup", "eagle:/x", ","):
        with pytest.raises(SourceError):
            parse_sources(bad)
    with pytest.raises(ConfigError, match="unknown source"):
        apply_overrides(DEFAULT, ["draft.sources=eagle,medusa"])
    with pytest.raises(ConfigError, match="sps.variant"):
        apply_overrides(DEFAULT, ["sps.variant=meta"])
    with pytest.raises(ConfigError, match="gamma"):
        apply_overrides(DEFAULT, ["sps.gamma=0"])
    with pytest.raises(ConfigError, match="ssm_temperature"):
        apply_overrides(DEFAULT, ["draft.ssm_temperature=0"])


@pytest.mark.parametrize("empty_from_level", [0, 1])
def test_extend_tree_stops_where_no_source_proposes_a_token(empty_from_level):
    """A merged top-k can be empty below some frontier node (no source proposes a valid token there: the union
    keeps ``min`` valid entries over rows). Incremental expansion then stops at that level instead of feeding
    the head zero rows (a reshape error seen in the simulator under load); what was found before stays."""
    from draft.drafter import BeamTreeDrafter
    from draft.tree import DraftTree

    class Stub(BeamTreeDrafter):
        def __init__(self):
            self.calls, self.fed = 0, []

        tree_size = 0

        def tree_forward(self, tokens, features, parents):
            assert tokens.numel() > 0, "fed zero rows"
            self.fed.append(tokens.numel())
            return torch.zeros(tokens.numel(), 4)

        def drop_tree(self):
            pass

        def top_tokens(self, hidden, k):
            level, self.calls = self.calls, self.calls + 1
            if level >= empty_from_level:
                return torch.zeros(hidden.shape[0], 0), torch.zeros(hidden.shape[0], 0, dtype=torch.long)
            return (torch.full((hidden.shape[0], 2), -1.0),
                    torch.arange(2).repeat(hidden.shape[0], 1) + 10)

    tree = DraftTree(torch.tensor([5, 6]), torch.tensor([-1, 0]), torch.tensor([0.0, -0.5]))
    grown, inputs = Stub().extend_tree(tree, torch.zeros(2, 4), torch.zeros(4), 3, 2, 8)
    check_tree(grown)
    assert len(grown) == len(inputs) == 2 + (0 if empty_from_level == 0 else 2)


@pytest.mark.parametrize("seed,total,depth,top_k", [(0, 14, 4, 3), (1, 30, 5, 4), (2, 60, 5, 10)])
def test_path_states_are_the_general_loop(seed, total, depth, top_k, monkeypatch):
    """``draft.merged._path_states`` (issue 41, the round start: lookup's slice of the merged inputs in one feed and
    one gather) equals, bitwise, the general per-level loop that ``tree_inputs`` runs for a source that is not
    ``features_free``; a planted bug (the deepest inner node left unfed: its children read the root's state)
    differs."""
    import draft.merged as merged_mod
    merged, h = _eagle_lookup(seed)
    tree, _ = merged.grow_tree_with_inputs(13, h, total, depth, top_k)
    fast = merged.tree_inputs(tree, h)
    monkeypatch.setattr(LookupDrafter, "features_free", False)
    general = merged.tree_inputs(tree, h)
    assert torch.equal(fast, general) and merged.tree_size == 0
    monkeypatch.setattr(LookupDrafter, "features_free", True)
    real = merged_mod._path_states

    def planted(src, tree_, h_, inner, par_np):
        short = inner.copy()
        short[np.flatnonzero(inner)[-1:]] = False
        return real(src, tree_, h_, short, par_np)
    monkeypatch.setattr(merged_mod, "_path_states", planted)
    assert not torch.equal(merged.tree_inputs(tree, h), general)


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_oracle_cache_equals_whole_sequence_forwards(tmp_path, noise):
    """The oracle drafter keeps its committed context's KV cache and runs only a tree entry's path (issue 43: the
    suite's oracle runs were mostly recomputing the context): every log-prob row equals the plain forward of the
    whole sequence (context + path), with noise too (seeded by that whole sequence), across commits, a second
    tree level, a dropped tree, and more requests (a different prompt, one extending the last context, one
    repeating the first, one leaving the cached tokens part way). A cache that kept the previous request's tokens
    fails (planted below)."""
    from transformers import AutoModelForCausalLM
    from draft.oracle import OracleDrafter, context_gumbel
    from tests.helpers import tiny_llama
    path = tiny_llama(tmp_path / "m", seed=3, layers=2, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    d = OracleDrafter(str(path), dtype=torch.float64, noise=noise)

    def plain(seq):
        with torch.no_grad():
            logits = ref(T([seq])).logits[0, -1].double()
        if noise:
            logits = logits + noise * context_gumbel(seq, logits.shape[-1])
        return torch.log_softmax(logits, -1)

    def check(prompt, first):
        ctx = prompt + [first]
        assert torch.allclose(d.start(prompt, first, None), plain(ctx), atol=1e-9)
        assert torch.allclose(d.commit(T([7, 8]), None), plain(ctx + [7, 8]), atol=1e-9)
        ctx += [7, 8]
        out = d.tree_forward(T([3, 4]), None, T([-1, -1]))
        out2 = d.tree_forward(T([6, 9, 2]), None, T([0, 0, 1]))                # a second level, below 3 and 4
        for row, p in zip([*out, *out2], ([3], [4], [3, 6], [3, 9], [4, 2])):
            assert torch.allclose(row, plain(ctx + p), atol=1e-9), p
        d.drop_tree()
        assert torch.allclose(d.commit(T([2]), None), plain(ctx + [2]), atol=1e-9)
        return ctx + [2]
    last = check([1, 5, 9, 13], 11)
    check([1, 40, 41], 12)                       # a new request: a different prompt
    check(last, 5)                               # a new request whose prompt extends the first one's context
    check([1, 5, 9, 13], 11)                     # the first request again: a prefix of the cached tokens
    check([1, 5, 9, 13, 11, 7], 4)               # a prompt that leaves the cached tokens part way


def test_oracle_planted_stale_cache_fails(tmp_path, monkeypatch):
    """The cache-reuse rule is what the test above checks: an oracle that keeps its cache across requests
    whatever their prompt (here: never rebuilt) must fail it."""
    from draft.oracle import OracleDrafter
    real = OracleDrafter._context_logits

    def stale(self):
        if self._kv is not None:
            self._kv_tokens = list(self.context[:len(self._kv_tokens)])      # claims the cache is of this context
        return real(self)
    monkeypatch.setattr(OracleDrafter, "_context_logits", stale)
    with pytest.raises(AssertionError):
        test_oracle_cache_equals_whole_sequence_forwards(tmp_path, 0.0)
