"""EAGLE-3 heads: the published checkpoint layout, fit checks, tapped-feature forwarding across stages, and greedy
output token-identical to HF generate in every mode (random heads, full and reduced draft vocabulary).

Tiny float64 random Llama targets (7 layers: the default taps are the outputs of layers 1, 2, 3), the whole ring
in one process (``pipeline/inprocess.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft.drafter import Drafter
from draft.eagle import init_untrained_head, save_eagle_head
from draft.head_io import HeadError
from draft.load_head import load_draft_head
from draft.eagle3 import (Eagle3Head, default_aux_layers, init_eagle3_head, save_eagle3_head, stage_taps,
                          vocab_from_ids)
from model.stage_model import load_stage
from model.split import split_checkpoint
from tests.helpers import hf_greedy, tiny_llama
from pipeline.inprocess import run_threaded

MODES = ["ar", "naive", "pruned", "continuous", "pipedec"]
PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
LAYERS = 7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoConfig
    root = tmp_path_factory.mktemp("eagle3")
    full = tiny_llama(root / "full", layers=LAYERS, dtype=torch.float64)
    cfg = AutoConfig.from_pretrained(full)
    splits = {}
    for spec in ([0, 7], [0, 2, 5], [0, 1, 1, 2, 3]):      # taps 1, 2, 3 on one / two / three stages
        splits[len(spec)] = split_checkpoint(full, root / ("s" + "_".join(map(str, spec))), spec, progress=False)
    heads = {}
    embed = load_file(str(full / "model.safetensors"))["model.embed_tokens.weight"]
    for name, vm in (("full", None), ("reduced", torch.arange(0, cfg.vocab_size, 2))):   # even ids only
        h = init_eagle3_head(cfg, seed=3, vocab_map=vm).double()
        with torch.no_grad():
            h.lm_head.weight.mul_(40.0)        # peaked draft: top-k differs from a uniform tie-break
            h.embed_tokens.weight.copy_(embed)
        heads[name] = save_eagle3_head(h, root / f"head_{name}")
    return full, cfg, splits, heads


_REF: dict = {}


def _check(full, res, max_new, stop_ids):
    """Every mode equals HF; returns the mean tau of the speculative modes (acceptance happened at all)."""
    taus = []
    for mode, rows in res.items():
        assert len(rows) == len(PROMPTS), mode
        for p, r in zip(PROMPTS, rows):
            key = (str(full), tuple(p), max_new)
            if key not in _REF:
                _REF[key] = hf_greedy(full, p, max_new, stop_ids, torch.float64)
            assert r.output_ids == _REF[key], mode
            assert sum(r.accept_lengths) == len(r.output_ids) - 1, mode
            if mode != "ar":
                taus.append(r.tau)
    return sum(taus) / len(taus)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint layout and fit checks
# ---------------------------------------------------------------------------------------------------------------

def test_published_layout_round_trip(tiny):
    full, cfg, _, heads = tiny
    d = heads["reduced"]
    raw = json.loads((d / "config.json").read_text())
    assert raw["draft_vocab_size"] == cfg.vocab_size // 2 and raw["num_hidden_layers"] == 1
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == default_aux_layers(LAYERS) == [1, 2, 3]
    st = load_file(str(d / "model.safetensors"))
    H, V = cfg.hidden_size, cfg.vocab_size
    assert st["fc.weight"].shape == (H, 3 * H)
    assert st["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert st["lm_head.weight"].shape == (V // 2, H) and st["norm.weight"].shape == (H,)
    assert st["d2t"].dtype == torch.int64 and st["t2d"].dtype == torch.bool and int(st["t2d"].sum()) == V // 2
    assert torch.equal(st["d2t"] + torch.arange(V // 2), torch.arange(0, V, 2))
    assert "embed_tokens.weight" not in st and not any(k.startswith("rotary") for k in st)
    embed = torch.randn(V, H, dtype=torch.float64)
    head = load_draft_head(d, cfg, embed, torch.float64)
    assert isinstance(head, Eagle3Head) and torch.equal(head.vocab_map, torch.arange(0, V, 2))
    torch.testing.assert_close(head.embed_tokens.weight.detach(), embed, rtol=0, atol=1e-6)
    full_head = load_draft_head(heads["full"], cfg, embed, torch.float64)
    assert full_head.vocab_map is None and full_head.draft_vocab == V


def _write_variant(src: Path, dst: Path, cfg_edit=None, state_edit=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    if cfg_edit:
        cfg_edit(raw)
    if state_edit:
        state_edit(state)
    (dst / "config.json").write_text(json.dumps(raw))
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("case,needle", [
    ("hidden", "expects target hidden size 32"),
    ("vocab", "vocab_size 100"),
    ("no_d2t", "no d2t map"),
    ("bad_t2d", "t2d does not agree"),
    ("bad_layers", "aux layers"),
    ("fc_shape", "does not fit the target"),
    ("missing_key", "missing ['midlayer.mlp.down_proj.weight']"),
])
def test_mismatched_head_is_one_clear_error(tiny, tmp_path, case, needle):
    full, cfg, _, heads = tiny
    edits = {
        "hidden": (lambda c: c.update(target_hidden_size=32), None),
        "vocab": (lambda c: c.update(vocab_size=100), None),
        "no_d2t": (None, lambda s: s.pop("d2t")),
        "bad_t2d": (None, lambda s: s.__setitem__("t2d", torch.ones_like(s["t2d"]))),
        "bad_layers": (lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 1, 9]}), None),
        "fc_shape": (None, lambda s: s.__setitem__("fc.weight", s["fc.weight"][:, :2 * cfg.hidden_size].contiguous())),
        "missing_key": (None, lambda s: s.pop("midlayer.mlp.down_proj.weight")),
    }[case]
    d = _write_variant(heads["reduced"], tmp_path / case, *edits)
    with pytest.raises(HeadError) as e:
        load_draft_head(d, cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_eagle12_heads_still_load(tiny, tmp_path):
    _, cfg, _, _ = tiny
    d = save_eagle_head(init_untrained_head(cfg), tmp_path / "e1")
    head = load_draft_head(d, cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    assert not isinstance(head, Eagle3Head)
    assert stage_taps("auto", d, LAYERS) == []


def test_stage_taps_setting(tiny):
    _, _, _, heads = tiny
    assert stage_taps("auto", heads["full"], LAYERS) == [1, 2, 3]
    assert stage_taps("none", heads["full"], LAYERS) == []
    assert stage_taps("auto", None, LAYERS) == []
    assert stage_taps("0,4,6", None, LAYERS) == [0, 4, 6]
    for bad in ("4,1", "1,x", "1,7"):
        with pytest.raises(HeadError):
            stage_taps(bad, None, LAYERS)


def test_vocab_from_ids():
    vm = vocab_from_ids([5, 5, 5, 3, 3, 9, 1], 12, 4)
    assert vm.tolist() == [1, 3, 5, 9]     # the four seen ids win over unseen ones
    assert vocab_from_ids([], 6, 3).tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------------------
# Tapped features across stages
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 5])
def test_stages_forward_the_tapped_layers(tiny, world):
    """Stage by stage in one process: the rows rank 0 receives are [final normed hidden | layer 1 | 2 | 3] and
    equal HF's hidden states; without taps the rows are H wide (no extra bytes)."""
    from transformers import AutoModelForCausalLM
    full, cfg, splits, _ = tiny
    ref = AutoModelForCausalLM.from_pretrained(full, torch_dtype=torch.float64)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    H = cfg.hidden_size
    for taps in ([1, 2, 3], []):
        models = [load_stage(splits[world], r, world, torch.float64) for r in range(world)]
        x = ids
        for m in models[1:]:
            m.set_taps(taps)
            cache = m.block.new_cache(64, torch.float64, "cpu")
            pos, mask = cache.context_inputs(ids.shape[1], torch.float64)
            x = m(x, pos, mask, cache)
            assert x.shape[-1] == m.out_width
        assert x.shape[-1] == H * (1 + len(taps))
        torch.testing.assert_close(x[0, :, :H], hs[-1][0])              # HF's last hidden state is normed
        for j, layer in enumerate(taps):
            torch.testing.assert_close(x[0, :, H * (1 + j):H * (2 + j)], hs[layer + 1][0])
        models[0].set_taps(taps)
        torch.testing.assert_close(models[0].lm_head(x[0]), ref.lm_head(hs[-1][0]))   # wide rows: same logits


# ---------------------------------------------------------------------------------------------------------------
# Greedy output equals HF in every mode
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,vocab,overrides", [
    (2, "reduced", []),
    (3, "full", ["tree.subseq_token=2", "tree.expand_subseq_token=3"]),
    (5, "reduced", ["tree.subseq_token=1", "tree.init_total_token=12", "tree.total_token=9"]),
    (3, "reduced", ["tree.expand_levels=3", "prefill_chunk=4"]),
])
def test_eagle3_all_modes_equal_hf(tiny, world, vocab, overrides):
    full, _, splits, heads = tiny
    res = run_threaded(splits[world], PROMPTS, MODES, ["max_new_tokens=14", "dtype=float64", *overrides], {2},
                       str(heads[vocab]))
    tau = _check(full, res, 14, {2})
    print(f"EAGLE-3 random head ({vocab} vocabulary), world {world}: mean tau {tau:.2f}")


def test_reduced_vocab_drafts_only_its_vocabulary(tiny):
    _, cfg, _, heads = tiny
    torch.manual_seed(0)   # the inputs below: the same whatever ran before in this process
    head = load_draft_head(heads["reduced"], cfg, torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64),
                           torch.float64)
    lm = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).double()
    d = Drafter(head, lm, 256)
    feats = torch.randn(5, 4 * cfg.hidden_size, dtype=torch.float64)
    root = d.start([1, 5, 9, 13, 22], 7, feats)
    lp = d.logprobs(root)
    assert torch.isinf(lp[1::2]).all() and torch.isfinite(lp[0::2]).all()
    # draft log-probs are float32 by design (Drafter.draft_logprobs): a distribution to float32 rounding
    assert abs(float(lp.double().exp().sum()) - 1.0) < 1e-6
    tree, inputs = d.grow_tree_with_inputs(7, root, 40, 4, 6)
    assert all(int(t) % 2 == 0 for t in tree.tokens[1:])
    grown, _ = d.extend_tree(tree, inputs, root, 2, 6, 10)
    assert len(grown) > len(tree) and all(int(t) % 2 == 0 for t in grown.tokens[1:])
    with pytest.raises(HeadError, match="width"):
        d.commit(torch.tensor([3]), torch.randn(1, 2 * cfg.hidden_size, dtype=torch.float64))


def test_head_and_taps_must_agree(tiny):
    from pipeline.build import SetupError
    full, _, splits, heads = tiny
    with pytest.raises(SetupError, match="model.eagle3_taps=1,2,3"):
        run_threaded(splits[3], PROMPTS[:1], ["naive"], ["max_new_tokens=4", "model.eagle3_taps=none"], {2},
                     str(heads["full"]))


# ---------------------------------------------------------------------------------------------------------------
# Training (draft/train_eagle3.py)
# ---------------------------------------------------------------------------------------------------------------

def test_training_time_test_matches_tree_drafting(tiny):
    """Unrolled step j at row t computes exactly what the drafter computes for the node j levels below the entry
    of token[t+1] (the committed context up to t, then a chain of tree nodes fed the head's own outputs)."""
    from transformers import AutoModelForCausalLM
    from draft.train_eagle3 import target_pass, ttt_forward
    full, cfg, _, heads = tiny
    model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float64)
    head = load_draft_head(heads["reduced"], cfg, model.model.embed_tokens.weight.data, torch.float64)
    ids = torch.tensor([[1, 5, 9, 13, 22, 7, 40, 41, 3, 17, 60, 8]])
    fused, _ = target_pass(model, ids, head.aux_layers, head.vocab_map)
    with torch.no_grad():
        outs = list(ttt_forward(head, ids, fused, 4))
    d = Drafter(head, torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).double(), 64)
    for t in (0, 3, 6):
        d.reset()
        h = d.commit(ids[0, 1:t + 2], fused[0, :t + 1])
        torch.testing.assert_close(h, outs[0][0, t])
        parent = -1
        for j in range(1, 4):
            h = d.tree_forward(ids[0, t + 1 + j:t + 2 + j], h[None], torch.tensor([parent]))[0]
            torch.testing.assert_close(h, outs[j][0, t])
            parent += 1
        d.drop_tree()


def test_train_eagle3_cli(tiny, tmp_path):
    from draft import train_eagle as te
    from draft.train.records import read_jsonl
    full, cfg, _, _ = tiny
    g = torch.Generator().manual_seed(1)
    data = tmp_path / "d.jsonl"
    with open(data, "w") as fh:
        for i in range(10):
            n = 12 + i
            ids = torch.randint(4, 60, (n,), generator=g).tolist()   # ids >= 60 never occur: outside the vocabulary
            fh.write(json.dumps({"pid": i, "input_ids": ids, "loss_mask": [0] * 4 + [1] * (n - 4)}) + "\n")
    out = tmp_path / "head3"
    argv = ["train", "--arch", "eagle3", "--target", str(full), "--data", str(data), "--out", str(out), "--device",
            "cpu", "--batch-size", "4", "--val-count", "2", "--log-every", "1", "--max-steps", "6", "--lr", "3e-3",
            "--draft-vocab", "40", "--ttt-steps", "3", "--no-progress", "--cache-features", "cpu"]
    assert te.main(argv) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 6 and len(train[0]["step_loss"]) == 3
    head = load_draft_head(out, cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    assert isinstance(head, Eagle3Head) and head.draft_vocab == 40 and int(head.vocab_map.max()) < 60
    assert stage_taps("auto", out, LAYERS) == [1, 2, 3]
    # fewer training conversations (8) than one batch: one error line (every epoch was empty: an endless loop)
    assert te.main(argv[:argv.index("--batch-size") + 1] + ["9"] + argv[argv.index("--batch-size") + 2:]
                   + ["--out", str(tmp_path / "h9")]) == 2


def test_broad_prompts_cover_every_kind(monkeypatch):
    from draft.train import broad_prompts as bp

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "The river floods every spring. Farmers plant rice after the water recedes and the soil is " \
                   "rich. Dams were built in 1962. Many birds live on the banks."

    monkeypatch.setattr(bp, "chat_prompt_ids", lambda *a, **k: [1, 2, 3])
    monkeypatch.setattr(bp, "stop_token_ids", lambda *a, **k: {2})
    monkeypatch.setattr(bp, "generate_all", lambda model, prompts, *a, **k: [[5, 6]] * len(prompts))
    convs = bp.broad_prompts(None, Tok(), 64, ["rivers", "farming"], seed=1, progress=False)
    kinds = {c["source"].split(":")[1] for c in convs}
    assert kinds == set(bp.KINDS), kinds
    assert len({json.dumps(c["turns"]) for c in convs}) == len(convs)          # deduplicated
    assert any(len(c["turns"]) == 2 for c in convs)                            # multi-turn
    assert any("quote" in c["turns"][0] and "floods" in c["turns"][0] for c in convs)   # RAG over the passage


def test_multiprocess_ranks_tap_from_the_head_config(tiny, tmp_path):
    """``python -m pipeline.run`` on 3 processes: every rank derives the taps from model.head_dir (auto) and the
    output equals HF (the mismatch error is checked in-process by test_head_and_taps_must_agree)."""
    from tests.helpers import launch, read_jsonl
    full, _, splits, heads = tiny
    out = tmp_path / "rows.jsonl"
    args = [f"model.stage_dir={splits[3]}", "dtype=float64", "max_new_tokens=10", "comm.timeout_s=60",
            f"head_dir={heads['reduced']}", "--modes", "continuous", "--output", str(out), "--quiet",
            "--prompt-ids", ",".join(map(str, PROMPTS[1]))]
    launch(3, args, timeout=300)
    rows = read_jsonl(out)
    ref = hf_greedy(full, PROMPTS[1], 10, {2}, torch.float64)
    assert len(rows) == 1 and all(r["output_ids"] == ref for r in rows)


def test_simulator_replays_an_eagle3_head_like_a_real_run(tiny):
    """pipeline.tools.simulate loads the stages with the head's taps (load_target), so the replayed drafter gets
    the fused features a real run forwards: every mode's accepted tokens per step equal the real run's."""
    from config.run_config import DEFAULT, apply_overrides
    from pipeline.build import make_drafter
    from pipeline.tools.simulate import load_target, replay
    full, cfg, splits, heads = tiny
    modes = ["naive", "pruned", "continuous", "pipedec"]
    over = ["max_new_tokens=12", "dtype=float64"]
    for head in ("full", "reduced"):
        real = run_threaded(splits[3], PROMPTS[:1], modes, over, {2}, str(heads[head]), torch.float64)
        rcfg = apply_overrides(DEFAULT, over + [f"model.stage_dir={splits[3]}", f"model.head_dir={heads[head]}"])
        target = load_target(rcfg)
        assert target.model0.taps == [1, 2, 3] and target.features(PROMPTS[0]).shape[-1] == 4 * cfg.hidden_size
        drafter = make_drafter(rcfg, target.stage_root, target.model0, target.dtype, "cpu")
        row = {"prompt_ids": PROMPTS[0], "output_ids": real["naive"][0].output_ids, "mode": "naive", "world_size": 3}
        for mode in modes:
            sess = replay([row], mode, 2, rcfg, drafter, target.vocab_size, target.features)
            (g,) = sess.gens
            assert g.accept_lengths == real[mode][0].accept_lengths, (head, mode)
            # modeled wire: both stages (layers [0, 4) and [4, 7)) send rows 4 hidden rows wide (taps 1, 2, 3)
            for r in (1, 2):
                ops = sess.logs[r].ops
                sent = sum(op[2] for op in ops if op[0] == "send")
                computed = sum(op[1] for op in ops if op[0] == "compute")
                assert sent == 4 * computed > 0, (head, mode, r)
        assert max(r[0].tau for r in real.values()) > 1.2          # the head really drafts
