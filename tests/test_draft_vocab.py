"""A reduced draft vocabulary for EAGLE-1/2 heads (``model.draft_vocab``, :mod:`draft.vocab`): the ranking, the
counts file, the drafter proposing only its vocabulary, greedy output equal to HF in every mode, one-line errors,
and the emulator / simulator pricing the cheaper draft lm_head.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from config.profiles import CostModel
from draft.drafter import Drafter
from draft.eagle import init_untrained_head, save_eagle_head
from draft.head_io import HeadError
from draft.vocab import (AUTO, COUNTS_FILE, DEFAULT_DRAFT_VOCAB, count_tokens, counts_path, coverage, draft_vocab_ids,
                         load_counts, resolve_draft_vocab, save_counts, top_ids)
from model.split import split_checkpoint
from pipeline.inprocess import run_threaded
from tests.helpers import REPO, hf_greedy, launch, tiny_llama

MODES = ["ar", "naive", "pruned", "continuous", "pipedec"]
PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
VOCAB = 96


# -- ranking and counts -----------------------------------------------------------------------------------------
def test_top_ids_invariants():
    counts = torch.tensor([5, 0, 7, 7, 1, 9, 0, 3])
    assert top_ids(counts, 3).tolist() == [2, 3, 5]            # 9, 7, 7
    assert top_ids(counts, 2).tolist() == [2, 5]               # a tie (ids 2, 3 at 7) goes to the lower id
    assert top_ids(counts, 5).tolist() == [0, 2, 3, 5, 7]
    assert top_ids(counts, 100).tolist() == list(range(8))     # clamped to the vocabulary
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 50, 96):
        c = torch.randint(0, 4, (VOCAB,), generator=g)         # many ties
        ids = top_ids(c, n)
        assert ids.numel() == n and bool((ids[1:] > ids[:-1]).all())
        # no id outside beats one inside, and equal counts are split towards lower ids
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[ids] = False
        if outside.any():
            worst_in = int(c[ids].min())
            assert int(c[outside].max()) <= worst_in
            tied_out = torch.nonzero(outside & (c == worst_in)).flatten()
            tied_in = ids[c[ids] == worst_in]
            assert tied_out.numel() == 0 or int(tied_out.min()) > int(tied_in.max())
    assert coverage(counts, 3) == pytest.approx(23 / 32)
    assert coverage(torch.zeros(4, dtype=torch.int64), 2) == 0.0


def test_count_tokens_counts_the_targets_own_tokens_only(tmp_path):
    recs = [{"input_ids": [1, 4, 4, 6, 2], "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [1, 6, 3], "loss_mask": [0, 1, 1]}]
    c = count_tokens(recs, 8)
    assert c.tolist() == [0, 0, 1, 1, 1, 0, 2, 0]              # the prompt's 1, 4 are not counted
    with pytest.raises(ValueError, match="out of range"):
        count_tokens([{"input_ids": [1, 9], "loss_mask": [1, 1]}], 8)
    path = save_counts(tmp_path, c, {"conversations": 2})
    assert path.name == COUNTS_FILE
    assert load_counts(tmp_path, 8).tolist() == c.tolist()
    assert draft_vocab_ids(2, tmp_path, 8).tolist() == [2, 6]    # 6 (2), then the lowest of the ties at 1
    assert draft_vocab_ids(0, tmp_path, 8) is None and draft_vocab_ids(8, tmp_path, 8) is None
    with pytest.raises(HeadError, match="16-token vocabulary"):
        load_counts(save_counts(tmp_path / "other.safetensors", torch.zeros(16, dtype=torch.int64), {}), 8)
    with pytest.raises(HeadError, match="python -m draft.vocab count"):
        load_counts(tmp_path / "nowhere", 8)
    assert save_counts(tmp_path / "heads" / "x-v1.5", c, {}).name == COUNTS_FILE   # a new directory with a dot
    with pytest.raises(ValueError, match="loss_mask"):
        count_tokens([{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}], 8)
    with pytest.raises(HeadError, match=">= 0"):
        draft_vocab_ids(-1, tmp_path, 8)


def test_auto_draft_vocab_applies_only_where_it_can(tmp_path):
    """The default (``model.draft_vocab=-1``, auto): 16384 for a head that shares the target's lm_head, has its counts
    and a larger vocabulary; the whole vocabulary otherwise; an explicit setting is never changed."""
    big = DEFAULT_DRAFT_VOCAB * 3
    assert resolve_draft_vocab(AUTO, counts_found=True, shares_lm_head=True, vocab_size=big) == DEFAULT_DRAFT_VOCAB
    assert resolve_draft_vocab(AUTO, counts_found=False, shares_lm_head=True, vocab_size=big) == 0
    assert resolve_draft_vocab(AUTO, counts_found=True, shares_lm_head=False, vocab_size=big) == 0
    assert resolve_draft_vocab(AUTO, counts_found=True, shares_lm_head=True, vocab_size=DEFAULT_DRAFT_VOCAB) == 0
    # levels on static shapes (graphs): auto keeps the whole vocabulary (the graph holds the level's step); N applies
    assert resolve_draft_vocab(AUTO, counts_found=True, shares_lm_head=True, vocab_size=big, static_levels=True) == 0
    assert resolve_draft_vocab(8192, counts_found=True, shares_lm_head=True, vocab_size=big, static_levels=True) == 8192
    for n in (0, 8, 8192, big):
        for found in (False, True):
            assert resolve_draft_vocab(n, counts_found=found, shares_lm_head=found, vocab_size=16) == n
    assert counts_path("", None) is None
    assert counts_path("", tmp_path) == tmp_path / COUNTS_FILE
    assert counts_path(str(tmp_path), None) == tmp_path / COUNTS_FILE          # a directory names its counts file
    assert counts_path(str(tmp_path / "c.safetensors"), tmp_path) == tmp_path / "c.safetensors"


def test_the_default_heads_ship_their_counts():
    """The default is auto, so the default model's head drafts over 16384 ids only if its counts ship beside it
    (and every shipped SmolLM2 head's counts fit the target's vocabulary); loading and ranking them is quick."""
    import time

    from config.paths import DEFAULT_HEAD_DIR
    from config.run_config import DEFAULT
    assert DEFAULT.model.draft_vocab == AUTO
    heads = [d for d in DEFAULT_HEAD_DIR.parent.iterdir() if (d / "model.safetensors").is_file()]
    assert DEFAULT_HEAD_DIR in heads
    for d in heads:
        vocab = json.loads((d / "config.json").read_text()).get("vocab_size", 49152)
        t = time.perf_counter()
        ids = draft_vocab_ids(DEFAULT_DRAFT_VOCAB, d, vocab)
        assert ids is not None and ids.numel() == DEFAULT_DRAFT_VOCAB, d
        assert time.perf_counter() - t < 30, "ranking the shipped counts should take well under a second"


def test_the_default_model_drafts_over_16384_tokens():
    """The default run keys on the default model: the head drafter (first source of the default merged drafter)
    drafts over the 16384 most frequent ids of the counts shipped beside the default head; ``model.draft_vocab=0``
    gives the whole vocabulary back."""
    from config.paths import DEFAULT_STAGE_DIR
    from config.run_config import DEFAULT, apply_overrides
    from model.stage_model import load_stage
    from pipeline.build import make_drafter
    if not (DEFAULT_STAGE_DIR / "stage_model_0").is_dir():
        pytest.skip("the default model is not converted here")
    world = len([d for d in DEFAULT_STAGE_DIR.iterdir() if d.name.startswith("stage_model_")])
    m0 = load_stage(DEFAULT_STAGE_DIR, 0, world, torch.float32)
    d = make_drafter(DEFAULT, DEFAULT_STAGE_DIR, m0, torch.float32, "cpu").sources[0]
    assert d.draft_vocab_rows == DEFAULT_DRAFT_VOCAB and d.full_root
    d = make_drafter(apply_overrides(DEFAULT, ["model.draft_vocab=0"]), DEFAULT_STAGE_DIR, m0, torch.float32, "cpu")
    assert d.sources[0].vocab_map is None


def test_count_cli(tmp_path, capsys):
    """One real ``python -m draft.vocab`` process; the error and --help paths through its ``main`` in this process
    (the same code after the interpreter's start-up)."""
    from draft.vocab import main
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": [1, 5, 5, 7], "loss_mask": [0, 1, 1, 1]}) for _ in range(3)))
    r = subprocess.run([sys.executable, "-m", "draft.vocab", "count", "--data", str(data), "--out", str(tmp_path),
                        "--vocab-size", "16"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert load_counts(tmp_path, 16)[5] == 6 and "| 1024 |" not in r.stdout      # sizes >= V are not listed
    capsys.readouterr()
    assert main(["count", "--data", str(data), "--out", str(tmp_path), "--vocab-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "out of range" in err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "Example" in capsys.readouterr().out


# -- the drafter ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoConfig
    root = tmp_path_factory.mktemp("dvocab")
    full = tiny_llama(root / "full", layers=4, vocab=VOCAB, dtype=torch.float64)
    cfg = AutoConfig.from_pretrained(full)
    splits = {n: split_checkpoint(full, root / f"s{n}", spec, progress=False)
              for n, spec in ((2, [0, 4]), (3, [0, 2, 2]), (5, [0, 1, 1, 1, 1]))}
    head = init_untrained_head(cfg).double().eval()
    head_dir = save_eagle_head(head, root / "head")
    # counts that favour even ids, so the draft vocabulary is the even ids when it has VOCAB/2 entries
    counts = torch.tensor([10 if i % 2 == 0 else 1 for i in range(VOCAB)])
    save_counts(head_dir, counts, {"test": True})
    return full, cfg, splits, head_dir


def _drafter(cfg, ids=None, context=False, bias=False, full_root=False):
    torch.manual_seed(1)
    head = init_untrained_head(cfg).double().eval()
    lm = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=bias).double()
    return Drafter(head, lm, 256, draft_ids=ids, context_vocab=context, full_root=full_root)


def test_drafter_proposes_only_its_vocabulary(tiny):
    _, cfg, _, _ = tiny
    ids = torch.arange(0, VOCAB, 2)
    full, red = _drafter(cfg), _drafter(cfg, ids)
    assert full.draft_vocab_rows == 0 and red.draft_vocab_rows == VOCAB // 2
    feats = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    root_f = full.start([1, 5, 9, 13, 22], 7, feats)
    root = red.start([1, 5, 9, 13, 22], 7, feats)
    assert torch.equal(root, root_f)                            # the head itself is untouched
    lp, lp_full = red.logprobs(root), full.logprobs(root)
    assert torch.isinf(lp[1::2]).all() and torch.isfinite(lp[0::2]).all()
    assert abs(float(lp.exp().sum()) - 1.0) < 1e-9
    # inside the vocabulary: the full distribution renormalised (the same logits, a smaller softmax)
    ref = torch.log_softmax(lp_full[0::2], dim=-1)
    assert torch.allclose(lp[0::2], ref, atol=1e-10)
    tree, inputs = red.grow_tree_with_inputs(7, root, 30, 4, 6)
    assert len(tree) > 1 and all(int(t) % 2 == 0 for t in tree.tokens[1:])
    grown, _ = red.extend_tree(tree, inputs, root, 2, 6, 10)
    assert len(grown) > len(tree) and all(int(t) % 2 == 0 for t in grown.tokens[1:])


def test_full_root_drafts_the_first_level_over_the_whole_vocabulary(tiny):
    """full_root: the root's children are the whole vocabulary's top-k (as without a reduced vocabulary), deeper
    levels stay inside the draft vocabulary; the root call is charged as a full lm_head op."""
    _, cfg, _, _ = tiny
    ids = torch.arange(0, VOCAB, 2)
    full, d = _drafter(cfg), _drafter(cfg, ids, full_root=True)
    feats = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    root = d.start([1, 5, 9, 13, 22], 7, feats)
    full.start([1, 5, 9, 13, 22], 7, feats)
    ops = []

    class Rec:
        def op(self, kind, rows, ctx=0):
            from contextlib import nullcontext
            ops.append((kind, rows, ctx))
            return nullcontext()

    d.meter = Rec()
    tree, _ = d.grow_tree_with_inputs(7, root, 40, 3, 6)
    ref, _ = full.grow_tree_with_inputs(7, root, 40, 3, 6)
    first = tree.tokens[1:][tree.parents[1:] == 0].tolist()
    assert sorted(first) == sorted(ref.tokens[1:][ref.parents[1:] == 0].tolist())
    assert any(t % 2 for t in first), "the untrained head's top-6 should include an odd id"
    deeper = tree.tokens[1:][tree.parents[1:] != 0].tolist()
    assert deeper and all(t % 2 == 0 for t in deeper)
    assert [op for op in ops if op[0] == "lm_head"] == [("lm_head", 1, 0)] + [("lm_head", 6, VOCAB // 2)] * 3


def test_context_tokens_join_the_draft_vocabulary(tiny):
    """With context_vocab the prompt's and the committed output's tokens join the ranked ids (odd ids here), and a
    new generation starts again from the ranked ids; log-probs stay the full ones renormalised over the set."""
    _, cfg, _, _ = tiny
    ids = torch.arange(0, VOCAB, 2)
    full, d = _drafter(cfg, bias=True), _drafter(cfg, ids, context=True, bias=True)
    feats = torch.randn(6, cfg.hidden_size, dtype=torch.float64)
    root = d.start([1, 5, 9, 5, 22], 7, feats[:5])
    full.start([1, 5, 9, 5, 22], 7, feats[:5])
    assert d.vocab_map.tolist() == ids.tolist() + [1, 5, 9, 7]           # first appearance, no repeats
    lp, lp_full = d.logprobs(root), full.logprobs(root)
    inside = d.vocab_map
    assert torch.allclose(lp[inside], torch.log_softmax(lp_full[inside], dim=-1), atol=1e-10)
    assert torch.isinf(lp[[3, 11, 95]]).all()
    d.commit(torch.tensor([11, 4, 11]), feats[:3])
    assert d.vocab_map.tolist()[-1] == 11 and d.draft_vocab_rows == VOCAB // 2 + 5
    tree, _ = d.grow_tree_with_inputs(7, root, 30, 4, 6)
    assert set(tree.tokens[1:].tolist()) <= set(d.vocab_map.tolist())
    d.start([1, 2], 3, feats[:2])
    assert d.vocab_map.tolist() == ids.tolist() + [1, 3]                 # 2 is a ranked id already


def test_draft_vocab_room_and_order():
    from draft.vocab import DraftVocab
    lm = torch.nn.Linear(4, 20)
    order = DraftVocab(torch.tensor([0]), lm, extra=10)
    order.begin([5, 3, 5, 9, 3, 1])
    assert order.ids.tolist() == [0, 5, 3, 9, 1]                       # first appearance, no repeats
    v = DraftVocab(torch.tensor([2, 4, 6]), lm, extra=3)
    v.begin([1, 2, 3])
    assert v.ids.tolist() == [2, 4, 6, 1, 3]
    v.add([9, 11, 13])                                   # room for one more only
    assert v.ids.tolist() == [2, 4, 6, 1, 3, 9]
    h = torch.randn(2, 4)
    assert torch.allclose(v.logits(h), lm(h)[:, v.ids], atol=1e-6)
    v.begin([])
    assert v.ids.tolist() == [2, 4, 6]
    v.add([19, 19])
    assert v.ids.tolist() == [2, 4, 6, 19]
    # rows for context tokens are allocated as they come (doubling), never beyond the cap; order and rows survive
    big = torch.nn.Linear(4, 2000)
    g = DraftVocab(torch.tensor([0, 1]), big, extra=1500)
    assert g.cap == 1502 and g._rows.shape[0] == 2 + DraftVocab.GROW
    toks = torch.randperm(1998, generator=torch.Generator().manual_seed(0))[:1600] + 2
    for i in range(0, 1600, 100):
        g.add(toks[i:i + 100].tolist())
    assert g.ids.tolist() == [0, 1] + toks[:1500].tolist() and g._rows.shape[0] == 1502
    torch.testing.assert_close(g.logits(h), big(h)[:, g.ids])
    g.begin([5, 1, 7])                                     # a new generation reuses the grown buffer
    assert g.ids.tolist() == [0, 1, 5, 7] and g._rows.shape[0] == 1502
    torch.testing.assert_close(g.logits(h), big(h)[:, [0, 1, 5, 7]])


def test_meter_charges_the_draft_vocabulary(tiny):
    _, cfg, _, _ = tiny

    class Rec:
        def __init__(self):
            self.ops = []

        def op(self, kind, rows, ctx=0):
            from contextlib import nullcontext
            self.ops.append((kind, rows, ctx))
            return nullcontext()

    for ids, want in ((None, 0), (torch.arange(0, VOCAB, 3), VOCAB // 3)):
        d = _drafter(cfg, ids)
        d.meter = rec = Rec()
        root = d.start([1, 5, 9], 7, torch.randn(3, cfg.hidden_size, dtype=torch.float64))
        d.grow_tree(7, root, 12, 3, 3)
        lm = [op for op in rec.ops if op[0] == "lm_head"]
        assert len(lm) == 4 and all(ctx == want for _, _, ctx in lm)     # the root's top-k + 3 levels, once each


def test_bad_draft_ids_and_eagle3_heads_are_refused(tiny):
    from draft.eagle3 import init_eagle3_head
    _, cfg, _, _ = tiny
    with pytest.raises(HeadError):
        _drafter(cfg, torch.tensor([4, 2, 9]))                  # not increasing
    with pytest.raises(HeadError):
        _drafter(cfg, torch.tensor([1, VOCAB]))                 # out of range
    e3 = init_eagle3_head(cfg, seed=1, aux_layers=[0, 1, 2], vocab_map=torch.arange(0, VOCAB, 2)).double()
    lm = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).double()
    with pytest.raises(HeadError, match="its own vocabulary"):
        Drafter(e3, lm, 64, draft_ids=torch.arange(8))


def test_a_lane_fork_shares_the_target_lm_head(tiny):
    """``pipeline.lanes.fork_drafter`` deep-copies a drafter per request but shares its modules: the reduced
    vocabulary keeps the ``lm_head`` module, so a lane copies its own rows and context set, never the V x H weight
    (a detached weight tensor kept as an attribute would be copied for every lane)."""
    from pipeline.lanes import fork_drafter
    _, cfg, _, _ = tiny
    d = _drafter(cfg, torch.arange(0, VOCAB, 2), context=True, bias=True)
    f = fork_drafter(d)
    assert f.dvocab._w.data_ptr() == d.dvocab._w.data_ptr() and f.dvocab._b.data_ptr() == d.dvocab._b.data_ptr()
    f.dvocab.begin([1, 3, 5])
    assert f.dvocab.ids.tolist()[-3:] == [1, 3, 5] and d.dvocab.ids.numel() == VOCAB // 2   # its own context
    h = torch.randn(2, cfg.hidden_size, dtype=torch.float64)
    assert torch.allclose(f.dvocab.logits(h)[:, :VOCAB // 2], d.dvocab.logits(h))


# -- exactness through the ring -------------------------------------------------------------------------------
@pytest.mark.parametrize("world,n,overrides", [
    (2, VOCAB // 2, []),
    (3, 10, ["tree.subseq_token=2", "tree.expand_subseq_token=3", "model.draft_vocab_context=false"]),
    (5, VOCAB // 2, ["tree.subseq_token=1", "tree.init_total_token=12", "tree.total_token=9",
                     "prefill_chunk=4", "model.draft_vocab_full_root=false"]),
])
def test_all_modes_equal_hf_with_a_reduced_vocabulary(tiny, world, n, overrides):
    full, _, splits, head_dir = tiny
    res = run_threaded(splits[world], PROMPTS, MODES, ["max_new_tokens=14", "dtype=float64",
                                                      f"model.draft_vocab={n}", *overrides], {2}, str(head_dir))
    for mode, rows in res.items():
        for p, r in zip(PROMPTS, rows):
            assert r.output_ids == hf_greedy(full, p, 14, {2}, torch.float64), (mode, n)
            assert sum(r.accept_lengths) == len(r.output_ids) - 1


def test_sampled_generation_with_a_growing_vocabulary(tiny):
    """T = 1 through the ring with the context vocabulary (it grows as output is committed): every mode runs to
    the end and accounts for each token (the law itself: tests/test_sampling.py, reduced-vocabulary cases)."""
    _, _, splits, head_dir = tiny
    res = run_threaded(splits[3], PROMPTS, MODES, ["max_new_tokens=14", "dtype=float64", "temperature=1.0",
                                                   "seed=3", "model.draft_vocab=8"], {2}, str(head_dir))
    for mode, rows in res.items():
        for r in rows:
            assert len(r.output_ids) >= 2 and sum(r.accept_lengths) == len(r.output_ids) - 1, mode


def test_build_applies_the_setting_and_errors_are_one_line(tiny, tmp_path):
    from config.run_config import DEFAULT, ConfigError, apply_overrides
    from model.stage_model import load_stage
    from pipeline.build import SetupError, make_drafter
    full, _, splits, head_dir = tiny
    m0 = load_stage(splits[2], 0, 2, torch.float64)
    alone = "draft.sources=eagle"                  # the head drafter itself (the default merges prompt lookup)
    d = make_drafter(apply_overrides(DEFAULT, [f"head_dir={head_dir}", "model.draft_vocab=48", alone]), splits[2], m0,
                     torch.float64, "cpu")
    assert d.vocab_map.tolist() == list(range(0, VOCAB, 2))
    merged = make_drafter(apply_overrides(DEFAULT, [f"head_dir={head_dir}", "model.draft_vocab=48"]), splits[2], m0,
                          torch.float64, "cpu")
    assert merged.sources[0].vocab_map.tolist() == list(range(0, VOCAB, 2))        # the default: head + lookup
    other = save_counts(tmp_path / "c.safetensors", torch.arange(VOCAB), {})     # favours high ids
    d = make_drafter(apply_overrides(DEFAULT, [f"head_dir={head_dir}", "model.draft_vocab=4",
                                               f"model.draft_vocab_counts={other}", alone]), splits[2], m0,
                     torch.float64, "cpu")
    assert d.vocab_map.tolist() == [92, 93, 94, 95]
    d = make_drafter(apply_overrides(DEFAULT, [f"head_dir={head_dir}", "model.draft_vocab=0", alone]), splits[2], m0,
                     torch.float64, "cpu")
    assert d.head is not None and d.vocab_map is None
    with pytest.raises(ConfigError, match=">= 0"):
        apply_overrides(DEFAULT, ["model.draft_vocab=-3"]).validate()
    # the default (auto) refuses nothing: a vocabulary of at most 16384, an untrained head, lookup alone, an oracle
    for over in ([f"head_dir={head_dir}", alone], ["head_dir=untrained", alone], ["draft.sources=lookup"],
                 [f"head_dir=oracle:{full}", alone]):
        d = make_drafter(apply_overrides(DEFAULT, over), splits[2], m0, torch.float64, "cpu")
        assert getattr(d, "vocab_map", None) is None, over
    bare = save_eagle_head(init_untrained_head(m0.config).double(), tmp_path / "bare")
    with pytest.raises(SetupError, match="draft.vocab count"):
        make_drafter(apply_overrides(DEFAULT, [f"head_dir={bare}", "model.draft_vocab=8"]), splits[2], m0,
                     torch.float64, "cpu")
    with pytest.raises(SetupError, match="draft.sources"):
        make_drafter(apply_overrides(DEFAULT, [f"head_dir={head_dir}", "model.draft_vocab=8",
                                               "draft.sources=lookup"]), splits[2], m0, torch.float64, "cpu")
    with pytest.raises(SetupError, match="oracle"):
        make_drafter(apply_overrides(DEFAULT, [f"head_dir=oracle:{full}", "model.draft_vocab=8"]), splits[2], m0,
                     torch.float64, "cpu")


def test_multiprocess_run_with_missing_counts_is_one_error(tiny, tmp_path):
    full, cfg, splits, _ = tiny
    bare = save_eagle_head(init_untrained_head(cfg).double(), tmp_path / "bare")
    r = launch(2, [f"model.stage_dir={splits[2]}", "dtype=float64", "max_new_tokens=4", "comm.timeout_s=30",
                   f"head_dir={bare}", "model.draft_vocab=8", "--prompt-ids", "1,5,9", "--modes", "naive",
                   "--output", str(tmp_path / "o.jsonl"), "--quiet"], check=False, timeout=300)
    assert r.returncode != 0
    err = [l for l in r.stderr.splitlines() if "error" in l.lower()]
    assert any("[rank 0]" in l and "draft.vocab count" in l for l in err), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# -- pricing in the emulator and the simulator -------------------------------------------------------------------
def test_cost_model_time_share():
    lm = CostModel(weight_bytes=1e9, mem_bw_Bps=1e10, mem_efficiency=0.5, flops_per_token=1e9, peak_flops=1e12,
                   compute_efficiency=0.5, overhead_s=0.001)
    assert lm.time_share(4, 1.0) == lm.time(4)
    assert lm.time_share(4, 0.25) == pytest.approx(0.25 * 0.2 + 0.001)            # memory bound: 0.2 s x 1/4
    assert lm.time_share(1000, 0.25) == pytest.approx(0.25 * 2.0 + 0.001)         # compute bound: 2 s x 1/4
    table = CostModel(model="table", w=[1, 10], ctx=[0], t_s=[[0.01, 0.02]])
    assert table.time_share(1, 0.5) == pytest.approx(0.005)


def test_emulator_and_simulator_price_the_share(tiny):
    from types import SimpleNamespace
    from config.profiles import Profile
    from pipeline.emulation import Emulator
    from pipeline.tools.simulate.drafter import LogMeter
    from pipeline.tools.simulate.oplog import OpLog
    from pipeline.tools.simulate.timing import TimingConfig, simulate_timing
    from pipeline.tools.simulate import decode_times
    prof = Profile.from_dict({"name": "t", "stage": {"model": "analytic", "overhead_s": 0.01},
                              "rank0": {"lm_head": {"model": "analytic", "weight_bytes": 1e8, "mem_bw_Bps": 1e10,
                                                    "overhead_s": 0.002}},
                              "link": {"latency_s": 0.0, "bandwidth_mbps": 1000}})
    emu = Emulator(prof, 0, 2)
    lm = torch.nn.Linear(4, 100, bias=False)
    emu.install_rank0(SimpleNamespace(model=SimpleNamespace(lm_head=lm), drafter=None,
                                      meter=__import__("model.meter").meter.NULL_METER))
    assert emu.op_time("lm_head", 3, 0) == pytest.approx(0.012)
    assert emu.op_time("lm_head", 3, 25) == pytest.approx(0.0045)
    log = OpLog()
    meter = LogMeter(log, 100)
    with meter.op("lm_head", 3, 25):
        pass
    with meter.op("lm_head", 3, 0):
        pass
    assert [op[:3] for op in log.ops if op[0] == "lm_head"] == [("lm_head", 3, 0.25), ("lm_head", 3, 1.0)]
    logs = [[("mark", "decode_begin"), ("lm_head", 3, 0.25, 9.0), ("lm_head", 3, 1.0, 9.0), ("mark", "gen_end")], []]
    assert decode_times(simulate_timing(logs, TimingConfig(prof))) == [pytest.approx(0.0045 + 0.012, abs=1e-12)]
