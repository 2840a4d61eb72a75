"""KV cache compaction/masking, message codec, verification walk and config errors."""
import pytest
import torch

from config.run_config import DEFAULT, ConfigError, apply_overrides
from draft.tree import DraftTree, keep_indices_for
from model.kv_cache import KVCache, compact_slots
from pipeline.messages import Context, Decision, Segment, Shutdown, Stats, Status, decode, encode
from pipeline.verify import Sampler, walk_tree
from pipeline.worker import apply_decision


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


def test_apply_decision_prunes_uncomputed_segment():
    c = KVCache(1, 1, 1, 32, torch.float32)
    _, _, anc, depth = c.tree_inputs(torch.tensor([-1, 0, 0]), torch.float32)
    c.commit_forward(3, False, anc, depth)
    seg = Segment(torch.arange(3)[None], torch.tensor([1, 2, 1]))   # nodes 3, 4, 5
    d = Decision(1, 1, Status.CONTINUE, 1, 7, False, torch.tensor([0, 1, 3, 5]))
    seg = apply_decision(c, d, seg)
    assert seg.x.tolist() == [[0, 2]] and seg.parents.tolist() == [0, 0]
    assert c.context_len == 1 and c.num_tree == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32,
                                   torch.int64, torch.bool])
def test_message_roundtrip_every_dtype(dtype):
    x = (torch.randn(1, 3, 5) * 10).to(dtype)
    for msg in (Context(x, 3, True), Segment(x, torch.tensor([-1, 0, 1]), 2, 7, 3),
                Segment(x[:, :0], torch.zeros(0, dtype=torch.long), 1, 0, 1,
                        Decision(1, 2, Status.TRUNCATE, 2, 9, True, torch.tensor([0, 4])))):
        back = decode(*encode(msg))
        assert type(back) is type(msg)
        assert back.x.dtype == dtype and torch.equal(back.x, msg.x)
        if isinstance(msg, Segment):
            assert torch.equal(back.parents, msg.parents) and back.decide_from_rank == msg.decide_from_rank
            if msg.prior is not None:
                assert back.prior.status == Status.TRUNCATE and back.prior.keep_indices.tolist() == [0, 4]
    d = decode(*encode(Decision(5, 6, Status.SKIP)))
    assert d.status == Status.SKIP and d.keep_indices.numel() == 0
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
    cfg = apply_overrides(DEFAULT, ["mode=continuous", "tree.init_depth=4", "max_new_tokens=7", "trace=true"])
    assert cfg.gen.mode == "continuous" and cfg.tree.init_depth == 4 and cfg.gen.max_new_tokens == 7
    assert cfg.comm.trace is True and DEFAULT.gen.mode == "naive"
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
