"""Re-fed tree rows whose outputs nobody reads are not computed (issue 41: ``draft.protocol.tree_outputs``).

A re-fed tree (an expansion's, a prefetch's) needs the outputs of its frontier or its leaves only, while every row
must still enter the draft cache. The rule: a forward given ``rows`` returns exactly what the whole forward returns at
those rows, leaves the cache exactly as the whole forward leaves it (so every later forward is the same), and on an
EAGLE-1/2 head really runs the last layer's attention, output projection and MLP over those rows alone. Checked for
every head layout of ``tests/test_fused_head.py``, a two-layer block (rows only from the last layer: a planted
first-layer cut fails), the lean path (which takes the rows afterwards), the drafter's commit-and-feed forward, a
merged drafter (EAGLE + prompt lookup), a drafter without the keyword (the protocol takes the rows itself), and
prompt lookup (both of its passes) and the suffix source alone.
"""
from __future__ import annotations

import copy

import pytest
import torch

import draft.fused_head as fh
from draft.protocol import commit_tree_outputs, tree_outputs
from model.layers import LayerBlock
from tests.test_fused_head import H, V, make_head

ROWS = torch.tensor([5, 0, 3])           # out of order on purpose: the outputs come back in this order


def fed_cache(head, dtype=torch.float64, seed=2, device="cpu"):
    """A draft cache holding 9 context rows and 2 tree rows, and the next tree level to feed (6 rows below them)."""
    cache = head.block.new_cache(64, dtype, device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, parents in ((9, None), (2, [-1, -1])):
            pos, mask = cache.context_inputs(n, dtype) if parents is None else \
                cache.staged_tree_inputs(torch.tensor(parents), dtype)
            head(torch.randint(0, V, (1, n), generator=g).to(device),
                 torch.randn(1, n, H, generator=g, dtype=dtype).to(device), pos, mask, cache)
            cache.commit_forward(n, as_context=parents is None)
    level = (torch.randint(0, V, (1, 6), generator=g).to(device),
             torch.randn(1, 6, H, generator=g, dtype=dtype).to(device), torch.tensor([0, 0, 1, 1, 0, 1]))
    return cache, level


def feed(head, cache, level, rows=None):
    """The level fed (its rows' outputs, or those of ``rows``), then one more row below its last node: its output
    reads the keys and values the level wrote for its ancestors (the caller compares the rest directly)."""
    tok, feat, parents = level
    with torch.no_grad():
        pos, mask = cache.staged_tree_inputs(parents, feat.dtype)
        out = head(tok, feat, pos, mask, cache, None if rows is None else rows.to(feat.device))
        cache.commit_forward(tok.shape[-1], as_context=False)
        pos, mask = cache.staged_tree_inputs(torch.tensor([cache.num_tree - 1]), feat.dtype)
        after = head(torch.tensor([[7]], device=feat.device),
                     torch.randn(1, 1, H, generator=torch.Generator().manual_seed(9), dtype=feat.dtype).to(feat.device),
                     pos, mask, cache)
    return out, after


def compare(head, tol, dtype=torch.float64, device="cpu"):
    """``feed`` with and without ``ROWS`` on twin caches (``head`` on ``device``): the same rows, the same next
    forward, the same keys and values (``tests/gpu/test_cuda.py`` runs it on CUDA)."""
    cache, level = fed_cache(head, dtype, device=device)
    twin = copy.deepcopy(cache)
    whole, after = feed(head, cache, level)
    got, got_after = feed(head, twin, level, ROWS)
    n = cache.length + cache.num_tree
    assert got.shape == (1, ROWS.numel(), H)
    torch.testing.assert_close(got[0], whole[0, ROWS.to(whole.device)], rtol=tol, atol=tol)
    torch.testing.assert_close(got_after, after, rtol=tol, atol=tol)
    for a, b in ((cache.keys, twin.keys), (cache.values, twin.values)):
        torch.testing.assert_close(b[..., :n, :], a[..., :n, :], rtol=tol, atol=tol)


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("llama", 1), ("llama_bias", 2), ("llama_head_dim", 2),
                                             ("llama3_rope", 2), ("qwen2", 2), ("qwen3", 2)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "lean"])
def test_rows_are_the_whole_forward_at_those_rows(family, kv_heads, fused):
    head = make_head(family, kv_heads)
    head.fused = fused
    compare(head, 1e-12)


def test_float32_within_rounding():
    head = make_head("llama", 2, torch.float32)
    compare(head, 1e-5, torch.float32)


def two_layer_head():
    head = make_head()
    torch.manual_seed(4)
    block = LayerBlock(head.config, 2, skip_first_input_norm=True).to(torch.float64).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.05 * torch.randn_like(p))
    head.block = block
    assert fh.fusable(head.block)
    return head


def test_two_layers_cut_rows_in_the_last_layer_only(monkeypatch):
    """The first layer's outputs are the second layer's keys and values of every row: a forward that cut the rows
    from the first layer on (planted) cannot give the whole forward's cache, and fails."""
    compare(two_layer_head(), 1e-12)
    monkeypatch.setattr(fh, "rows_from_layer", lambda layers: 0)
    with pytest.raises((AssertionError, RuntimeError)):
        compare(two_layer_head(), 1e-12)


def test_the_fused_forward_really_runs_fewer_rows(monkeypatch):
    """The last layer's output projection and MLP see the wanted rows only (the saving the rule is for)."""
    seen = []
    real = fh._linear_res
    monkeypatch.setattr(fh, "_linear_res", lambda x, w, b, res: (seen.append(x.shape[0]), real(x, w, b, res))[1])
    head = make_head()
    cache, level = fed_cache(head)
    seen.clear()
    feed(head, cache, level, ROWS)
    assert seen[:2] == [ROWS.numel(), ROWS.numel()], seen          # o_proj, down_proj of the level's forward
    assert head.fused_head.rebuilds == 1


def _drafter(merged: bool, fused: bool = True):
    from draft.lookup import LookupDrafter
    from draft.merged import MergedDrafter
    from tests.test_graphs import _random_drafter
    d = _random_drafter(0)
    d.head.fused = fused
    if merged:
        d = MergedDrafter([d, LookupDrafter(40, max_matches=4)], ["eagle", "lookup"])
    prompt = [1, 5, 9, 13, 22, 7, 5, 9, 13, 30, 5, 9]
    h = d.start(prompt, 13, torch.randn(len(prompt), 16, generator=torch.Generator().manual_seed(1),
                                        dtype=torch.float64))
    return d, h


class _NoRows:
    """A drafter whose tree_forward takes no ``rows`` (every source but EAGLE's and the merge's)."""

    def __init__(self, inner):
        self.inner = inner

    def tree_forward(self, tokens, features, parents):
        return self.inner.tree_forward(tokens, features, parents)

    def commit_tree_forward(self, tokens, features, tree_tokens, tree_inputs, parents):
        return self.inner.commit_tree_forward(tokens, features, tree_tokens, tree_inputs, parents)


@pytest.mark.parametrize("rows", [[4, 1], [4, 1, 3]], ids=["cut", "gathered"])
@pytest.mark.parametrize("kind", ["eagle", "eagle-lean", "eagle+lookup", "no-rows"])
def test_drafter_calls_equal_the_whole_forward_at_those_rows(kind, rows):
    """``tree_outputs`` / ``commit_tree_outputs`` against the whole ``tree_forward`` / ``commit_tree_forward``: the
    same rows, the same commit output, and the same next forward over the fed tree (the cache alike). Two of five
    rows: the head runs them alone (``Drafter._head_rows``: at most half the rows fed); three: the whole forward,
    gathered."""
    tokens, parents = torch.tensor([22, 30, 7, 5, 9]), torch.tensor([-1, -1, 0, 0, 2])
    rows = torch.tensor(rows)

    def make():
        d, h = _drafter(kind == "eagle+lookup", fused=kind != "eagle-lean")
        return (_NoRows(d) if kind == "no-rows" else d), h

    for commit in (False, True):
        (a, h), (b, _) = make(), make()
        feats = h.expand(5, -1).clone()
        c = (torch.tensor([3, 8]), torch.randn(2, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
        if commit:
            ra, whole = a.commit_tree_forward(*c, tokens, feats, parents)
            rb, got = commit_tree_outputs(b, *c, tokens, feats, parents, rows)
            torch.testing.assert_close(rb, ra, rtol=1e-12, atol=1e-12)
        else:
            whole = a.tree_forward(tokens, feats, parents)
            got = tree_outputs(b, tokens, feats, parents, rows)
        torch.testing.assert_close(got, whole[rows], rtol=1e-12, atol=1e-12)
        nxt = (torch.tensor([11]), whole[4:5], torch.tensor([4]))
        inner = [x.inner if kind == "no-rows" else x for x in (a, b)]
        torch.testing.assert_close(inner[1].tree_forward(*nxt), inner[0].tree_forward(*nxt), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("source", ["lookup-vectorised", "lookup-per-node", "suffix"])
def test_retrieval_states_of_rows_are_the_whole_forwards(source):
    """Prompt lookup's (in both of its passes) and the suffix source's states of the wanted rows only: the whole
    forward's rows, and a later level below the fed rows (their paths and matches kept) sees the same states."""
    from draft.lookup import LookupDrafter
    from draft.suffix import SuffixDrafter

    def make():
        if source == "suffix":
            d = SuffixDrafter(40, threshold=2, max_children=4)
        else:
            d = LookupDrafter(40, max_matches=4)
            d.vector_rows = 1 if source == "lookup-vectorised" else 1000
        d.start([1, 5, 9, 13, 22, 7, 5, 9, 13, 30, 5, 9, 13, 22], 7, None)
        return d
    a, b = make(), make()
    tokens, parents = torch.tensor([5, 9, 13, 22, 30, 9]), torch.tensor([-1, 0, 1, 2, 0, -1])
    rows = torch.tensor([3, 5, 1])
    whole = a.tree_forward(tokens, None, parents)
    got = tree_outputs(b, tokens, None, parents, rows)
    assert torch.equal(got, whole[rows])
    nxt = (torch.tensor([7, 5]), None, torch.tensor([3, 4]))
    assert torch.equal(b.tree_forward(*nxt), a.tree_forward(*nxt))
    assert (whole[:, :4] >= 0).any()                   # some row has a match (the check is not of empty states)


def test_start_runs_the_last_prompt_row_alone_and_equals_the_whole_commit(monkeypatch):
    """A generation's start reads only the last prompt row's output (``Drafter._commit(last_only=True)``): the same
    root state and the same cache as committing the whole prompt, with the last layer's MLP over one row."""
    from tests.test_graphs import _random_drafter
    seen = []
    real = fh._linear_res
    monkeypatch.setattr(fh, "_linear_res", lambda x, w, b, res: (seen.append(x.shape[0]), real(x, w, b, res))[1])
    prompt = [1, 5, 9, 13, 22, 7, 5, 9, 13, 30, 5, 9]
    feats = torch.randn(len(prompt), 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b = _random_drafter(0), _random_drafter(0)
    h_start = a.start(prompt, 13, feats)
    assert seen == [1, 1], seen                                   # o_proj and down_proj of the start: one row
    b.reset()
    h_whole = b.commit(torch.tensor(prompt[1:] + [13]), feats)
    assert seen[2:] == [len(prompt)] * 2                          # a commit keeps the whole forward
    torch.testing.assert_close(h_start, h_whole, rtol=1e-12, atol=1e-12)
    n = a.cache.length
    assert n == b.cache.length == len(prompt)
    torch.testing.assert_close(a.cache.keys[..., :n, :], b.cache.keys[..., :n, :], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.cache.values[..., :n, :], b.cache.values[..., :n, :], rtol=1e-12, atol=1e-12)
    nxt = (torch.tensor([4, 6]), torch.randn(2, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    torch.testing.assert_close(a.commit(*nxt), b.commit(*nxt), rtol=1e-12, atol=1e-12)
