"""draft/fused_head.py: the EAGLE-1/2 head's fused forward against the lean layer path it replaces (issue 41).

Every layout a head takes (grouped-query or not, q/k/v and MLP biases, Qwen2's q/k/v-only biases, a head_dim apart
from hidden/heads, Llama-3 rotary scaling), commits and tree levels on the drafter's KV cache, several lanes in one
forward: outputs and cached keys/values within 1e-12 (float64) and 1e-5 (float32) of the lean path; drafted trees
the same up to float ties; weights changed in place, loaded or moved are followed (never stale); planted bugs (a
rotary table off by one position, rotate_half's sign lost, a signature blind to in-place updates) fail; the fused
path stands aside with autograd on, for static-shape caches, for layers it cannot run and with lean layers off.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from draft.eagle import EagleHead
from draft.fused_head import FusedHead, fusable
try:                                     # main keeps the tie rule among the test helpers (issue 43, after 8a472dc)
    from tests.helpers import trees_match_up_to_ties
except ImportError:
    from draft.static_head import trees_match_up_to_ties
from model.layers import set_lean
from tests.helpers import STORIES

H, V = 64, 97


def config(family: str, kv_heads: int = 2):
    common = dict(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=kv_heads,
                  vocab_size=V, max_position_embeddings=256, rms_norm_eps=1e-5)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama_bias":
        return LlamaConfig(**common, attention_bias=True, mlp_bias=True)
    if family == "llama_head_dim":
        return LlamaConfig(**common, head_dim=24)
    if family == "llama3_rope":
        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, use_sliding_window=False)
    raise ValueError(family)


def make_head(family: str = "llama", kv_heads: int = 2, dtype=torch.float64) -> EagleHead:
    torch.manual_seed(0)
    cfg = config(family, kv_heads)
    cfg._attn_implementation = "sdpa"
    head = EagleHead(cfg, bias=True).to(dtype).eval()
    with torch.no_grad():
        for p in head.parameters():          # non-trivial norms and biases
            p.add_(0.05 * torch.randn_like(p))
    return head


def session(head: EagleHead, fused: bool, dtype=torch.float64, seed: int = 1):
    """What the drafter feeds a head: a commit of 7 context rows, three tree levels (roots, a linked segment, one
    node), then, after the tree is dropped, a commit of 3. Returns every output and the cache."""
    head.fused = fused
    cache = head.block.new_cache(64, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    outs = []
    with torch.no_grad():
        def feed(n, parents=None):
            tok = torch.randint(0, V, (1, n), generator=g)
            f = torch.randn(1, n, H, generator=g, dtype=dtype)
            if parents is None:
                pos, mask = cache.context_inputs(n, dtype)
            else:
                pos, mask = cache.staged_tree_inputs(torch.tensor(parents), dtype)
            outs.append(head(tok, f, pos, mask, cache))
            cache.commit_forward(n, as_context=parents is None)
        feed(7)
        feed(4, [-1, -1, -1, -1])
        feed(6, [0, 0, 1, 1, 2, 3])
        feed(1, [5])
        cache.truncate_tree()
        feed(3)
    return outs, cache


def max_diff(head, dtype=torch.float64) -> float:
    """The largest difference between the fused and the lean path's outputs and cached keys/values."""
    ref, ref_cache = session(head, False, dtype)
    got, got_cache = session(head, True, dtype)
    n = ref_cache.length
    pairs = list(zip(ref, got)) + [(ref_cache.keys[..., :n, :], got_cache.keys[..., :n, :]),
                                   (ref_cache.values[..., :n, :], got_cache.values[..., :n, :])]
    return max(float((a - b).abs().max()) for a, b in pairs)


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("llama", 4), ("llama", 1), ("llama_bias", 2),
                                             ("llama_head_dim", 2), ("llama3_rope", 2), ("qwen2", 2)])
def test_fused_equals_lean_float64(family, kv_heads):
    head = make_head(family, kv_heads)
    assert fusable(head.block)
    assert max_diff(head) < 1e-12
    assert head.fused_head.rebuilds == 1                # built once, the weights unchanged since


def test_repeated_kv_heads_where_sdpa_has_no_masked_gqa(monkeypatch):
    """On a device without a masked grouped-query kernel (CUDA) the key/value heads are repeated: the same values."""
    import draft.fused_head as fh
    monkeypatch.setattr(fh, "NATIVE_GQA_DEVICES", ())
    assert max_diff(make_head("llama", 2)) < 1e-12


def test_fused_equals_lean_float32():
    head = make_head("llama", 2, torch.float32)
    assert max_diff(head, torch.float32) < 1e-5


def test_fused_path_really_runs_and_is_fewer_operators():
    """The fused forward is the one that ran (planted below), and it dispatches far fewer operators."""
    from pipeline.tools.opcount import count_call
    head = make_head()
    counts = {}
    for fused in (False, True):
        counts[fused] = count_call(lambda: session(head, fused), head).ops
    assert counts[True] < 0.7 * counts[False], counts


@pytest.mark.parametrize("plant", ["rope_off_by_one", "sin_sign"])
def test_planted_rotary_bugs_fail(plant):
    head = make_head()
    session(head, True)
    fh = head.fused_head
    rope = fh._rope
    with torch.no_grad():
        if plant == "rope_off_by_one":
            rope.copy_(rope.roll(1, 0))                 # every position takes the previous one's angles
        else:
            half = rope.shape[-1] // 2
            rope[:, 1, :, :half].neg_()                  # rotate_half's sign lost
    assert fh._rope is rope
    got, _ = session(head, True)
    ref, _ = session(head, False)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, got)) > 1e-5


def test_weights_changed_in_place_loaded_or_moved_are_followed():
    from draft.osd import head_state, load_head_state
    head = make_head()
    before, _ = session(head, True)
    attn, mlp = head.block.layers[0].self_attn, head.block.layers[0].mlp
    with torch.no_grad():                              # an optimizer step / OSD's swap: in place
        attn.k_proj.weight.mul_(1.5)
        mlp.up_proj.weight.add_(0.1)
        head.fc.bias.add_(0.2)
    assert max_diff(head) < 1e-12
    after, _ = session(head, True)
    assert float((after[-1] - before[-1]).abs().max()) > 1e-3
    state = {k: v * 0.9 for k, v in head_state(head).items()}
    load_head_state(head, state)                       # OSD's publish into the live head
    assert max_diff(head) < 1e-12
    sd = {k: (v * 1.1).clone() for k, v in head.state_dict().items()}
    head.load_state_dict(sd, assign=True)              # loading replaces the parameters
    assert max_diff(head) < 1e-12
    head.to(torch.float32)                             # moved: every weight has a new pointer
    assert max_diff(head, torch.float32) < 1e-5
    twin = copy.deepcopy(head)                         # a copy builds its own fused weights
    with torch.no_grad():
        twin.block.layers[0].mlp.gate_proj.weight.mul_(2)
    assert twin.fused_head is not head.fused_head and max_diff(twin, torch.float32) < 1e-5
    assert max_diff(head, torch.float32) < 1e-5
    assert head.fused_head.rebuilds >= 4


def test_planted_stale_signature_fails(monkeypatch):
    """A fused head that never noticed an in-place update (its signature blind to versions) drafts with stale
    weights: the comparison catches it."""
    import draft.fused_head as fh
    head = make_head()
    session(head, True)
    monkeypatch.setattr(fh, "_signature", lambda h: ("frozen",))
    head.fused_head._sig = ("frozen",)
    with torch.no_grad():
        head.block.layers[0].self_attn.q_proj.weight.mul_(1.5)
    assert max_diff(head) > 1e-5


def test_several_lanes_in_one_forward():
    """``compute_lanes`` (rank 0's head forwards of several lanes coalesced): the fused path attends lane by lane,
    each lane's rows equal to its own lean forward."""
    from model.lane_batch import LaneBatch
    head = make_head()
    g = torch.Generator().manual_seed(3)
    caches, calls = [], []
    for ctx, parents in ((5, [-1, 0, 0]), (9, [-1, -1])):
        c = head.block.new_cache(32, torch.float64, "cpu")
        head.fused = False
        pos, mask = c.context_inputs(ctx, torch.float64)
        with torch.no_grad():
            head(torch.randint(0, V, (1, ctx), generator=g), torch.randn(1, ctx, H, generator=g, dtype=torch.float64),
                 pos, mask, c)
        c.commit_forward(ctx, as_context=True)
        n = len(parents)
        pos, mask = c.staged_tree_inputs(torch.tensor(parents), torch.float64)
        caches.append(c)
        calls.append((torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, H, generator=g, dtype=torch.float64),
                      pos, mask))
    ref = []
    for c, (t, f, p, m) in zip(caches, calls):
        twin = copy.deepcopy(c)
        with torch.no_grad():
            ref.append(head.compute(t, f, p, m, twin))    # lean (head.fused False)
    head.fused = True
    with torch.no_grad():
        got = head.compute_lanes([(t, f, p, m, c) for c, (t, f, p, m) in zip(caches, calls)])
    assert head.fused_head.rebuilds == 1                 # the fused path ran
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    direct = head.fused_head(torch.cat([t for t, *_ in calls], 1), torch.cat([f for _, f, *_ in calls], 1),
                             torch.cat([p for _, _, p, _ in calls], 1), None, LaneBatch(caches, [m for *_, m in calls]))
    assert direct is None                               # autograd on: the fused path stands aside


def test_where_the_fused_path_stands_aside():
    from model.graphs import SlotCache
    head = make_head()
    cache = head.block.new_cache(16, torch.float64, "cpu")
    pos, mask = cache.context_inputs(3, torch.float64)
    args = (torch.tensor([[1, 2, 3]]), torch.randn(1, 3, H, dtype=torch.float64), pos, mask)
    assert head.fused_head(*args, cache) is None                         # autograd on (training)
    with torch.no_grad():
        assert head.fused_head(*args, cache) is not None
        assert head.fused_head(*args, SlotCache(cache, torch.arange(3))) is None   # static shapes (model.graphs)
        set_lean(head, False)                                            # the reference path
        before = head.fused_head.rebuilds
        ref = head(*args, cache)
        assert head.fused_head.rebuilds == before
        set_lean(head, True)
        torch.testing.assert_close(head(*args, cache), ref, rtol=1e-12, atol=1e-12)
    q3 = make_head("qwen3")                                              # per-head q/k norms: the lean path
    assert not fusable(q3.block)
    with torch.no_grad():
        assert FusedHead(q3)(*args, q3.block.new_cache(16, torch.float64, "cpu")) is None
    assert max_diff(q3) == 0.0


def _drafted(d, dtype, hidden: int, vocab: int, fused: bool):
    """Recorded trees of drafter ``d``: a beam tree with its inputs, an expansion, a commit, a small tree; a
    re-rooted commit-and-expand in one forward (``commit_extend_tree``)."""
    d.head.fused = fused
    g = torch.Generator().manual_seed(1)
    prompt = [int(t) for t in torch.randint(3, vocab, (40,), generator=g)]
    h = d.start(prompt, 13, torch.randn(len(prompt), hidden, generator=g, dtype=dtype))
    tree, inputs = d.grow_tree_with_inputs(13, h, 40, 5, 4)
    grown, grown_in = d.extend_tree(tree, inputs, h, 2, 4, 20)
    h2 = d.commit(torch.tensor([4, 6]), torch.randn(2, hidden, generator=g, dtype=dtype))
    small = d.grow_tree(6, h2, 12, 3, 3)
    again, again_in, h3 = d.commit_extend_tree(torch.tensor([7]), torch.randn(1, hidden, generator=g, dtype=dtype),
                                               small, torch.randn(len(small), hidden, generator=g, dtype=dtype), 2,
                                               3, 8)
    return [tree, grown, small, again], [h, inputs, grown_in, h2, again_in, h3]


def _same_trees(d, dtype, tol, hidden, vocab):
    ref = _drafted(d, dtype, hidden, vocab, False)
    got = _drafted(d, dtype, hidden, vocab, True)
    assert d.head.fused_head.rebuilds == 1
    for a, b in zip(ref[0], got[0], strict=True):
        assert trees_match_up_to_ties(a, b, tol) is None
    if all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) for a, b in zip(ref[0], got[0])):
        for a, b in zip(ref[1], got[1], strict=True):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    return ref, got


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_drafted_trees_match_up_to_ties(dtype, tol):
    """A random EAGLE head (tests.test_graphs' drafter): every recorded tree drafted with the fused forward matches
    the lean path's up to float ties, and so do the per-node inputs where the trees are equal."""
    from tests.test_graphs import _random_drafter
    _same_trees(_random_drafter(0, dtype=dtype), dtype, tol, 16, 40)


@pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260K")
def test_stories_head_drafts_the_same_trees(tmp_path):
    """The real stories260K target with its untrained head and prompt lookup off (``draft.sources=eagle``), float32:
    the same trees up to float ties."""
    from config.run_config import DEFAULT, apply_overrides
    from model.split import split_checkpoint
    from model.stage_format import read_manifest
    from pipeline.build import load_rank_stage, make_drafter
    root = split_checkpoint(STORIES, tmp_path / "stages", [0, 1, 1, 1, 2], progress=False)
    cfg = apply_overrides(DEFAULT, ["draft.sources=eagle"])
    rank0 = load_rank_stage(cfg, root, 0, len(read_manifest(root)["split"]), torch.float32, "cpu")
    d = make_drafter(cfg, root, rank0, torch.float32, "cpu")
    ref, got = _same_trees(d, torch.float32, 1e-5, rank0.config.hidden_size, rank0.config.vocab_size)
    assert sum(len(t) for t in ref[0]) > 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_context_mask_in_fewer_ops_is_bitwise_the_old_one(dtype):
    """``KVCache.context_inputs`` builds the commit's causal mask as ``full(min).triu_(length + 1)`` (5 operators
    instead of 9): bitwise the additive form of the ``tril``'d allowed matrix it replaced; a planted off-by-one
    (``triu_(length)``: a row that cannot see itself) differs."""
    from model.kv_cache import KVCache

    def _additive(allowed, dtype):            # the old form: 0 where allowed, the dtype's lowest elsewhere
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
    for length, n in ((0, 1), (0, 5), (7, 1), (7, 3), (30, 12)):
        cache = KVCache(1, 1, 4, 64, dtype)
        cache.length = cache.context_len = length
        pos, mask = cache.context_inputs(n, dtype)
        old = _additive(torch.ones(n, length + n, dtype=torch.bool).tril(length), dtype)
        assert mask.dtype == dtype and mask.shape == old.shape and torch.equal(mask, old)
        assert torch.equal(pos, torch.arange(length, length + n)[None])
        planted = torch.full((n, length + n), torch.finfo(dtype).min, dtype=dtype).triu_(length)[None, None]
        assert not torch.equal(planted, old)
