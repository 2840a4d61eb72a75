"""Issue 41, a draft level in fewer operators (docs/results.md §58): each cut gives
the values of what it replaced. Lookup's supported tokens in fewer operators (same order, ties included), the
merged union reading lookup's raw empty slots, the KV cache's NumPy staging for every mask dtype, the merged
drafter's known parts, a tree's NumPy slots. Planted bugs (a FLOOR slot left in the union, a stale part, an
unmasked FLOOR score) must fail."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from draft.lookup import best_supported, lookup_supported, lookup_supported_raw
from tests.helpers import state_row
from draft.merged import union_top_np
from draft.tree import DraftTree
from model.kv_cache import KVCache


def lookup_states(rng: random.Random, rows: int, slots: int, vocab: int) -> torch.Tensor:
    """Random lookup states (state_row) with many equal scores (counts 1 and 2 among few continuations)."""
    out = []
    for _ in range(rows):
        conts = [[rng.randrange(vocab)] for _ in range(rng.randrange(0, slots + 3))]
        out.append(state_row(conts, 2 * slots, math.log(0.6)))
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("seed", range(5))
def test_lookup_supported_equals_best_supported_ties_included(seed):
    rng = random.Random(seed)
    slots, vocab = 8, 12                       # a small vocabulary: repeated tokens, equal counts, ties
    st = lookup_states(rng, 40, slots, vocab)
    for k in (1, 3, 8, 10):
        want = best_supported(st[:, :slots], st[:, slots:], vocab, k)
        got = lookup_supported(st, slots, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        raw = lookup_supported_raw(st, slots, k)                 # FLOOR kept where the slot is empty (id -1)
        assert torch.equal(raw[1], want[1])
        assert torch.equal(torch.where(raw[1] < 0, float("-inf"), raw[0]), want[0])
    planted = lookup_supported_raw(st, slots, slots)[0]          # the raw scores are not the masked ones
    assert not torch.equal(planted, best_supported(st[:, :slots], st[:, slots:], vocab, slots)[0])


def test_the_merged_union_drops_raw_empty_slots_like_masked_ones():
    """union_top_np of [head candidates | lookup's raw slots (FLOOR, -1)] equals it with the slots masked to
    (-inf, -1): the same tokens, scores and width. Planted: a union blind to the -1 token returns a FLOOR slot."""
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    slots, vocab, k = 8, 12, 10
    st = lookup_states(rng, 30, slots, vocab)
    head_s, head_t = torch.topk(torch.log_softmax(torch.randn(30, vocab, generator=g).round(), -1), 6)
    masked = best_supported(st[:, :slots], st[:, slots:], vocab, k)
    raw = lookup_supported_raw(st, slots, k)

    def pack(look):
        return torch.cat([head_s.double(), look[0].double(), head_t.double(), look[1].double()], -1).numpy()
    m = head_s.shape[1] + slots
    want, got = union_top_np(pack(masked), m, k), union_top_np(pack(raw), m, k)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    both = pack(raw)
    s, t = both[:, :m], both[:, m:].astype(np.int64)
    order = np.argsort(-s, axis=-1, kind="stable")
    blind = (np.take_along_axis(t, order, -1) == -1)[:, :k].any()   # a union without the rule would reach one
    assert blind, "the planted case needs a row whose empty slot ranks inside the top k by its FLOOR score"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_staged_masks_in_every_dtype(dtype):
    """KVCache.staged_tree_inputs builds its mask in NumPy (bfloat16: torch ops): 0 on the context and on each
    row's ancestors-or-self, the dtype's lowest elsewhere; positions = context + depth; NumPy parents accepted."""
    c = KVCache(1, 1, 4, 64, torch.float32)
    c.length = c.context_len = 5
    levels = [np.array([-1, -1]), torch.tensor([0, 0, 1]), np.array([2, 4])]
    for par in levels:
        m = c.num_tree
        pos, mask = c.staged_tree_inputs(par, dtype)
        c.commit_forward(len(par), as_context=False)
        anc = c.tree_anc[m:]
        want = torch.zeros((len(par), 5 + c.num_tree), dtype=dtype)
        want[:, 5:].masked_fill_(~anc, torch.finfo(dtype).min)
        assert mask.dtype == dtype and torch.equal(mask[0, 0], want)
        assert pos.dtype == torch.long and torch.equal(pos[0], 5 + c.tree_depth[m:])
    assert c.tree_depth.tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert c.tree_anc[6].tolist() == [False, True, False, False, True, False, True]     # 6 -> 4 -> 1
    c.truncate_tree()
    assert c.num_tree == 0 and c.length == 5


def test_merged_reuses_the_parts_of_its_last_output_only_while_unchanged():
    """MergedDrafter._split_known: the sources' own outputs for the state tree_forward just returned (no split);
    anything else, or that state changed in place since, is split. Either way the values are the split's."""
    from draft.merged import MergedDrafter

    class Src:
        def __init__(self, w):
            self.w = w

        def tree_forward(self, tokens, features, parents):
            return torch.full((len(tokens), self.w), float(self.w))

        def drop_tree(self):
            pass
    md = MergedDrafter([Src(3), Src(2)])
    md.widths = [3, 2]
    out = md.tree_forward(torch.tensor([1, 2]), torch.zeros(2, 5), torch.tensor([-1, -1]))
    parts = md._split_known(out)
    assert parts is md._last_parts[2]
    assert all(torch.equal(a, b) for a, b in zip(parts, md._split(out)))
    other = out.clone()
    assert md._split_known(other) is not md._last_parts[2]
    out[0, 0] = 7.0                                           # changed in place: the kept parts are stale
    fresh = md._split_known(out)
    assert fresh is not md._last_parts[2] and float(fresh[0][0, 0]) == 7.0


def test_numpy_slots_write_the_trees_buffers():
    """DraftTree.append_slots_numpy: views of the buffers (the grown tree reads what was written); a tree that is
    not its store's longest grows on a copy (the shorter tree's slots untouched)."""
    t = DraftTree(torch.tensor([5, 6]), torch.tensor([-1, 0]), torch.tensor([0.0, -1.0]), capacity=8)
    grown, (tok, par, sc, dep) = t.append_slots_numpy(2)
    tok[:], par[:], sc[:], dep[:] = [7, 8], [1, 0], [-2.0, -1.5], [2, 1]
    assert grown.tokens.tolist() == [5, 6, 7, 8] and grown.parents.tolist() == [-1, 0, 1, 0]
    assert grown.depths.tolist() == [0, 1, 2, 1] and grown.scores.tolist() == [0.0, -1.0, -2.0, -1.5]
    assert [x.tolist() for x in t.host_numpy()] == [[5, 6], [-1, 0], [0.0, -1.0], [0, 1]]
    again, (tok2, *_) = t.append_slots_numpy(1)              # t is no longer the longest: copy on write
    tok2[:] = [9]
    assert again.tokens.tolist() == [5, 6, 9] and grown.tokens.tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_context_masks_in_every_dtype(dtype):
    """KVCache.context_inputs (a commit's causal mask, NumPy where the dtype has a twin): bitwise the torch
    construction it replaced (``full(min).triu_(length + 1)``), positions ``length .. length + n - 1``."""
    from model.kv_cache import CAUSAL_ROWS
    c = KVCache(1, 1, 4, 64, dtype)
    # views of the shared tables (n <= CAUSAL_ROWS: a commit), at the cache's two ends; then fresh tensors (longer)
    for length, n in ((0, 3), (5, 1), (7, 4), (0, CAUSAL_ROWS), (64 - CAUSAL_ROWS, CAUSAL_ROWS), (63, 1), (0, 1),
                      (0, CAUSAL_ROWS + 1), (20, 40)):
        c.length = c.context_len = length
        pos, mask = c.context_inputs(n, dtype)
        want = torch.full((n, length + n), torch.finfo(dtype).min, dtype=dtype).triu_(length + 1)
        assert mask.dtype == dtype and torch.equal(mask, want.view(1, 1, n, length + n))
        assert pos.dtype == torch.long and pos.tolist() == [list(range(length, length + n))]
        assert mask.device == pos.device == torch.device("cpu")


def test_context_mask_views_are_read_only_tables():
    """KVCache.context_inputs' views (issue 41, the commit's host time): two caches of one ``max_len`` and dtype
    share the tables and neither call changes them; a planted off-by-one column offset of the view (a row that
    cannot see itself) differs from the causal mask."""
    from model.kv_cache import _causal_tables
    a, b = KVCache(1, 1, 4, 48, torch.float32), KVCache(2, 1, 4, 48, torch.float32)
    before = _causal_tables(48, torch.float32)[1][-1].clone()
    a.length = a.context_len = 10
    b.length = b.context_len = 30
    (pa, ma), (pb, mb) = a.context_inputs(3, torch.float32), b.context_inputs(5, torch.float32)
    assert ma.untyped_storage().data_ptr() == mb.untyped_storage().data_ptr()        # one shared table
    assert torch.equal(_causal_tables(48, torch.float32)[1][-1], before)
    assert pa.tolist() == [[10, 11, 12]] and pb.tolist() == [[30, 31, 32, 33, 34]]
    table = _causal_tables(48, torch.float32)[1][-1]
    planted = table[:, :, :3, 48 - 10 - 1:48 + 3 - 1]                                 # one column off
    assert not torch.equal(planted, ma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_host_top_numpy_packs_scores_and_ids_exactly(dtype):
    """BeamTreeDrafter.host_top_numpy: one float64 concatenation into a kept buffer, split in NumPy: bitwise the
    scores and ids of to_host; the buffer's reuse leaves no stale values. (Draft log-probs are float32 or wider:
    float_log_softmax.)"""
    from draft.drafter import BeamTreeDrafter, to_host

    class D(BeamTreeDrafter):
        def top_tokens(self, hidden, k):
            return torch.topk(hidden, k, dim=-1)
    d = D()
    g = torch.Generator().manual_seed(0)
    for rows in (3, 5, 3):
        h = (torch.randn(rows, 50, generator=g) * 30).to(dtype)
        got = d.host_top_numpy(h, 4)
        want = to_host(*torch.topk(h, 4, dim=-1))
        assert got[0].dtype == want[0].numpy().dtype
        assert torch.equal(torch.as_tensor(got[0]).to(dtype), want[0]) and np.array_equal(got[1], want[1].numpy())
        assert got[1].dtype == np.int64
