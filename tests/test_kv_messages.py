"""KV cache compaction/masking, message codec, verification walk and config errors."""
import pytest
import torch

from config.run_config import DEFAULT, ConfigError, apply_overrides
from draft.tree import DraftTree, keep_indices_for
from model.kv_cache import KVCache, compact_slots
from pipeline.messages import Context, Decision, Segment, Shutdown, Stats, Status, decode, encode, pack_log
from pipeline.verify import Sampler, walk_tree
from pipeline.worker import StageTree


def test_compact_slots_moves_kept_rows_in_order():
    buf = torch.arange(10, dtype=torch.float32).view(1, 1, 1, 10, 1).repeat(2, 1, 1, 1, 1)
    compact_slots(buf, 3, torch.tensor([0, 2, 5]))
    assert buf[0, 0, 0, 3:6, 0].tolist() == [3.0, 5.0, 8.0]
    compact_slots(buf, 3, torch.zeros(0, dtype=torch.long))


def test_cache_tree_mask_positions_and_apply_keep():
    c = KVCache(1, 1, 1, 32, torch.float32)
    pos, mask = c.context_inputs(3, torch.float32)
    assert pos.tolist() == [[0, 1, 2]] and (mask[0, 0] == 0).tolist() == [[True, False, False], [True, True, False],
                                                                          [True, True, True]]
    c.keys[0, 0, 0, :3, 0] = torch.tensor([1., 2, 3])
    c.commit_forward(3, as_context=True)
    # tree: 0 -> (1, 2); 1 -> 3
    pos, mask, anc, depth = c.tree_inputs(torch.tensor([-1, 0, 0]), torch.float32)
    assert pos.tolist() == [[3, 4, 4]]
    allowed = (mask[0, 0] == 0)
    assert allowed.tolist() == [[True] * 4 + [False] * 2, [True] * 5 + [False], [True] * 4 + [False, True]]
    c.keys[0, 0, 0, 3:6, 0] = torch.tensor([10., 11, 12])
    c.commit_forward(3, as_context=False, anc=anc, depth=depth)
    # a one-node segment under node 1 must not see node 2
    pos, mask, anc2, depth2 = c.tree_inputs(torch.tensor([1]), torch.float32)
    assert pos.tolist() == [[5]]
    assert (mask[0, 0, 0] == 0).tolist() == [True, True, True, True, True, False, True]
    c.keys[0, 0, 0, 6, 0] = 13.0
    c.commit_forward(1, as_context=False, anc=anc2, depth=depth2)
    # accept root(0) -> continue at node 1 (kept: 0, 1, 3)
    c.apply_keep(torch.tensor([0, 1, 3]), 1)
    assert c.context_len == 4 and c.length == 6
    assert c.keys[0, 0, 0, :6, 0].tolist() == [1, 2, 3, 10, 11, 13]
    assert c.tree_depth.tolist() == [0, 1] and c.tree_anc.tolist() == [[True, False], [True, True]]
    c.truncate_tree()
    assert c.length == c.context_len == 4


def test_cache_overflow_is_an_error():
    c = KVCache(1, 1, 1, 4, torch.float32)
    with pytest.raises(RuntimeError, match="KV cache full"):
        c.context_inputs(5, torch.float32)


def _stage(slots=32):
    return StageTree(KVCache(1, 1, 1, slots, torch.float32))


def _seg(gids, parents, epoch=0, log=()):
    g = torch.tensor(gids, dtype=torch.long)
    return Segment(g[None], torch.tensor(parents, dtype=torch.long), g, 1, epoch, pack_log(list(log)))


def _take(tree, seg, direct=()):
    """The stage worker's admission step; returns the admitted node ids and their parents' slots."""
    tree.offer(seg.decisions())
    tree.offer(list(direct))
    tree.apply_ready()
    rows, parents = tree.admit(seg)
    gids = seg.gids[rows]
    c = tree.cache
    _, _, anc, depth = c.tree_inputs(parents, torch.float32)
    c.commit_forward(int(gids.numel()), False, anc, depth)
    tree.computed(gids.tolist())
    return gids.tolist(), parents.tolist()


def _dec(seq, path, root, status=Status.CONTINUE):
    return Decision(1, seq, status, root, False, torch.tensor(path, dtype=torch.long))


def test_decision_before_the_segment_prunes_it_uncomputed():
    """Tree 0 -> {1, 2}, 1 -> {3}, 2 -> {4}: segments [0, 1, 2] then [3, 4]. The stage computed the first;
    decision 1 (path 0 -> 1, root 3) arrives directly before the second: only node 3 is computed, as a child
    of the context, and the path became context."""
    t = _stage()
    t.reset(1)
    assert _take(t, _seg([0, 1, 2], [-1, 0, 0])) == ([0, 1, 2], [-1, 0, 0])
    d1 = _dec(1, [0, 1], 3)
    assert _take(t, _seg([3, 4], [1, 2]), direct=[d1]) == ([3], [-1])
    assert t.cache.context_len == 2 and t.slot_gids == [3] and t.applied == 1


def test_late_decision_in_the_log_and_duplicates_are_applied_once():
    t = _stage()
    t.reset(1)
    _take(t, _seg([0, 1, 2], [-1, 0, 0]))
    _take(t, _seg([3, 4], [1, 2]))              # computed before the decision: both rows
    d1 = _dec(1, [0, 1], 3)
    assert _take(t, _seg([5], [3], epoch=1, log=[d1]), direct=[d1]) == ([5], [0])
    assert t.slot_gids == [3, 5] and t.cache.context_len == 2 and t.applied == 1


def test_truncate_then_fresh_root_and_stale_rows_dropped_where_they_stand():
    t = _stage()
    t.reset(1)
    _take(t, _seg([0, 1], [-1, 0]))
    d1 = _dec(1, [0], -1, Status.TRUNCATE)
    # a stale segment (sent before the decision) arrives after it: all dead
    assert _take(t, _seg([2, 3], [1, 2]), direct=[d1]) == ([], [])
    # the next round's root (parent -1) and its child
    assert _take(t, _seg([4, 5], [-1, 4], epoch=1, log=[d1])) == ([4, 5], [-1, 0])
    assert t.cache.context_len == 1


def test_pending_root_is_admitted_when_it_arrives():
    """The surviving root was sent but is still upstream when the decision arrives."""
    t = _stage()
    t.reset(1)
    _take(t, _seg([0, 1, 2], [-1, 0, 0]))
    d1 = _dec(1, [0, 1], 4)                  # root 4 (child of 1) is in the next segment
    assert _take(t, _seg([3, 4, 5, 6], [2, 1, 4, 3]), direct=[d1]) == ([4, 5], [-1, 0])
    assert t.pending_root == -1


def test_segment_ahead_of_its_decisions_is_an_error_not_a_wrong_answer():
    t = _stage()
    t.reset(1)
    _take(t, _seg([0, 1], [-1, 0]))
    with pytest.raises(RuntimeError, match="before decision 1"):
        _take(t, _seg([2], [-1], epoch=1))       # its decision neither in the log nor direct


def test_decisions_of_another_generation_are_ignored():
    t = _stage()
    t.reset(2)
    t.offer([_dec(1, [0], -1)])                # gen 1
    assert t.apply_ready() == 0 and t.applied == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32,
                                   torch.int64, torch.bool])
def test_message_roundtrip_every_dtype(dtype):
    x = (torch.randn(1, 3, 5) * 10).to(dtype)
    log = pack_log([Decision(1, 2, Status.TRUNCATE, -1, True, torch.tensor([0, 4])),
                    Decision(1, 3, Status.CONTINUE, 9, False, torch.tensor([7]))])
    for msg in (Context(x, 3, True), Segment(x, torch.tensor([-1, 0, 1]), torch.tensor([4, 5, 6]), 2, 7),
                Segment(x[:, :0], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 1, 3, log)):
        back = decode(*encode(msg))
        assert type(back) is type(msg)
        assert back.x.dtype == dtype and torch.equal(back.x, msg.x)
        if isinstance(msg, Segment):
            assert torch.equal(back.parents, msg.parents) and torch.equal(back.gids, msg.gids)
            assert (back.gen, back.epoch) == (msg.gen, msg.epoch)
            assert [(d.seq, d.status, d.root, d.finished, d.path.tolist()) for d in back.decisions()] == \
                   [(d.seq, d.status, d.root, d.finished, d.path.tolist()) for d in msg.decisions()]
    d = decode(*encode(Decision(5, 6, Status.TRUNCATE)))
    assert d.status == Status.TRUNCATE and d.path.numel() == 0 and d.root == -1
    assert isinstance(decode(*encode(Shutdown())), Shutdown)
    assert decode(*encode(Stats(torch.tensor([0.5, 1.0], dtype=torch.float64)))).busy_s.tolist() == [0.5, 1.0]


def test_walk_tree_greedy_cases():
    # root 0 -> a(1) -> c(3); root -> b(2)
    tree = DraftTree(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]), torch.zeros(4))
    V = 6
    def onehot(*toks):
        lg = torch.full((len(toks), V), -5.0)
        for i, t in enumerate(toks):
            lg[i, t] = 5.0
        return lg
    s = Sampler()
    # everything verified, path 0->1->3, bonus 5
    assert walk_tree(tree, 4, onehot(1, 3, 0, 5), s) == ([0, 1, 3], 5, None)
    # only root and node 1 verified; node1 predicts 3 = unverified child -> re-root at 3
    assert walk_tree(tree, 2, onehot(1, 3), s) == ([0, 1], 3, 3)
    # root predicts 4: no such child -> truncate
    assert walk_tree(tree, 1, onehot(4), s) == ([0], 4, None)
    assert walk_tree(tree, 0, onehot(), s) == ([], None, None)
    assert keep_indices_for(tree, [0, 1], 3).tolist() == [0, 1, 3]


def test_config_overrides_and_errors():
    cfg = apply_overrides(DEFAULT, ["mode=naive", "tree.init_depth=4", "max_new_tokens=7", "trace=true"])
    assert cfg.gen.mode == "naive" and cfg.tree.init_depth == 4 and cfg.gen.max_new_tokens == 7
    assert cfg.comm.trace is True and DEFAULT.gen.mode == "continuous"
    # an unknown key names itself and where every key is listed (typos get suggestions: tests/test_cli.py)
    with pytest.raises(ConfigError, match="unknown config key 'nope'.*--print-config lists every key"):
        apply_overrides(DEFAULT, ["nope=1"])
    with pytest.raises(ConfigError, match="choose one of ar, naive, pruned, pipedec, continuous"):
        apply_overrides(DEFAULT, ["mode=fast"])
    with pytest.raises(ConfigError, match="bad value"):
        apply_overrides(DEFAULT, ["max_new_tokens=lots"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(DEFAULT, ["mode"])
    with pytest.raises(ConfigError, match=">= 1"):
        apply_overrides(DEFAULT, ["max_new_tokens=0"])
