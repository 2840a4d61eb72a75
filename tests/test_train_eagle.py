"""EAGLE head training tool: data builder, features, training step, numerics vs inference, checkpoints."""
from __future__ import annotations

import json

import pytest
import torch

from draft.drafter import Drafter
from draft.eagle import HeadError, init_untrained_head, load_eagle_head, save_eagle_head
from draft import train_eagle as te
from draft.train.batches import ConversationBatches, epoch_batches
from draft.train.features import FeatureStore, target_features
from draft.train.generate import build_conversations
from draft.train.objective import (decay_toward, eagle_loss, evaluate, head_forward, sequence_batch, train_step,
                                   unrolled_forward, unrolled_loss)
from draft.train.prompt_files import is_excluded, load_excluded, load_prompt_file
from draft.train.prompt_lists import META_STYLES, TEMPLATE_STYLES, TOPICS
from draft.train.records import pad_batch, read_jsonl
from draft.train.self_prompts import code_prompt, finish_meta_prompt, math_prompt
from draft.train.target import load_target, load_tokenizer
from model.prompts import chat_prompt_ids
from tests.helpers import STORIES, step2_batch, tiny_llama

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!:'-()"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _char_tokenizer():
    """A character-level tokenizer (ids < 96) with a ChatML template, matching tiny_llama's special ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<unk>": 3}
    for c in CHARS:
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_target")
    tiny_llama(d, seed=3, layers=2, vocab=96, hidden=64)
    _char_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, "cpu")


@pytest.fixture(scope="module")
def tok(target_dir):
    return load_tokenizer(target_dir)


def _fresh_head(model, seed=0):
    head = init_untrained_head(model.config, seed=seed)
    head.embed_tokens.weight.data.copy_(model.model.embed_tokens.weight.data)
    head.embed_tokens.weight.requires_grad_(False)
    return head


# -- prompt sources ---------------------------------------------------------------------------------

def test_prompt_sources_and_exclusion(tmp_path):
    fc = tmp_path / "q.jsonl"
    fc.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"question {i}", f"follow {i}"]})
                            for i in range(5)))
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi there"},
                                                 {"from": "gpt", "value": "hello"},
                                                 {"from": "human", "value": "how are you"}]},
                              {"messages": [{"role": "user", "content": "tell me a joke"}]}]))
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert load_prompt_file(fc)[2] == ["question 2", "follow 2"]
    assert load_prompt_file(fc, max_turns=1)[0] == ["question 0"]
    assert load_prompt_file(sg) == [["hi there", "how are you"], ["tell me a joke"]]
    assert load_prompt_file(txt) == [["first prompt"], ["second prompt"]]
    ex = load_excluded([f"{fc}:1:3"])
    assert is_excluded(["  Question   1 "], ex) and is_excluded(["x", "follow 2"], ex)
    assert not is_excluded(["question 0"], ex) and not is_excluded(["question 3"], ex)


def test_self_prompt_material_is_sizeable():
    assert len(TOPICS) >= 60 and len(META_STYLES) >= 5 and len(TEMPLATE_STYLES) >= 10
    import random
    rng = random.Random(0)
    assert "Complete the code" in "".join(code_prompt(rng) for _ in range(30))
    assert "?" in math_prompt(rng)
    assert finish_meta_prompt("question", 'The question is: "What makes volcanoes erupt?"', rng) == \
        "What makes volcanoes erupt?"
    assert finish_meta_prompt("summarize", "x" * 100, rng).endswith("x" * 100)


# -- data builder -------------------------------------------------------------------------------------

def test_data_builder_loss_mask(target, tok):
    convs = [{"pid": 0, "turns": ["what is a volcano?"]},
             {"pid": 1, "turns": ["explain rain.", "why?"]},
             {"pid": 2, "turns": ["hello"]}]
    recs = build_conversations(target, tok, convs, max_new_tokens=12, batch_size=2, progress=False)
    assert [r["pid"] for r in recs] == [0, 1, 2]
    for r in recs:
        ids, mask = r["input_ids"], r["loss_mask"]
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        last_prompt = chat_prompt_ids(tok, r["turns"], r["answers"][:-1])
        assert ids[:len(last_prompt)] == last_prompt
        n_last = len(ids) - len(last_prompt)
        assert 1 <= n_last <= 12 and mask[len(last_prompt):] == [1] * n_last
        first_prompt = chat_prompt_ids(tok, r["turns"][:1], [])
        assert mask[:len(first_prompt)] == [0] * len(first_prompt)
        if len(r["turns"]) == 1:
            assert sum(mask) == n_last
        else:  # the first answer (re-tokenized inside the second prompt) is marked up to its <|im_end|>
            span = [i for i in range(len(last_prompt)) if mask[i]]
            assert span == list(range(len(first_prompt), span[-1] + 1))
            assert ids[span[-1]] == tok.convert_tokens_to_ids("<|im_end|>")
            assert tok.decode(ids[span[0]:span[-1]]).strip() == r["answers"][0]
    # greedy batched generation (left padding) equals unbatched generation
    one = build_conversations(target, tok, convs[:1], max_new_tokens=12, batch_size=1, progress=False)
    assert one[0]["input_ids"] == recs[0]["input_ids"]


def test_data_cli_self_prompts_resume_and_exclude(target_dir, tmp_path, capsys):
    out = tmp_path / "d.jsonl"
    q = tmp_path / "q.jsonl"
    q.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["keep me", "drop me", "also keep"]))
    ex = tmp_path / "eval.jsonl"
    ex.write_text(json.dumps({"turns": ["drop me"]}) + "\n")
    argv = ["data", "--target", str(target_dir), "--out", str(out), "--prompts", str(q), "--self-prompts", "6",
            "--exclude", f"{ex}:0:1", "--max-new-tokens", "6", "--prompt-max-new-tokens", "16", "--batch-size",
            "4", "--chunk-batches", "1", "--device", "cpu", "--no-progress", "--followup-frac", "0.5",
            "--temperature", "0.7", "--sample-frac", "0.5"]
    assert te.main(argv) == 0
    recs = read_jsonl(out)
    prompts = read_jsonl(out.with_name(out.name + ".prompts.jsonl"))
    assert not any(p["turns"][0] == "drop me" for p in prompts)
    assert {p["turns"][0] for p in prompts} >= {"keep me", "also keep"}
    assert len(recs) == len(prompts) and len(prompts) >= 6
    # resume after losing the last records: only the missing ones are regenerated
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")
    assert te.main(argv + ["--resume"]) == 0
    again = read_jsonl(out)
    assert sorted(r["pid"] for r in again) == sorted(r["pid"] for r in recs)
    assert again[:2] == recs[:2]
    # the summary says whether every prompt was tried (scripts/gpu_head_recipe.sh resumes until it is): a budget
    # spent before the first chunk leaves the file as it was and says so
    out.write_text("\n".join(lines[:2]) + "\n")
    capsys.readouterr()
    assert te.main(argv + ["--resume", "--time-budget", "1e-9"]) == 0
    assert '"complete": false' in capsys.readouterr().err and len(read_jsonl(out)) == 2
    assert te.main(argv + ["--resume"]) == 0
    assert '"complete": true' in capsys.readouterr().err


def test_data_cli_translate_from_an_earlier_data_file(target_dir, tok, tmp_path):
    """``--translate N --translate-from DATA``: English sentences of DATA's answers become English -> X prompts, and
    the answers to those (run again on its own output) become X -> English prompts."""
    from draft.train.translation_prompts import BACK_TEMPLATES, first_sentence, target_language
    src = tmp_path / "src.jsonl"
    answer = "The old bridge was rebuilt in the spring of last year. It is now open to walkers and cyclists every day."
    ids = tok.encode(answer, add_special_tokens=False)
    src.write_text(json.dumps({"pid": 0, "input_ids": [1, 2] + ids, "loss_mask": [0, 0] + [1] * len(ids)}) + "\n")
    (tmp_path / "src.jsonl.prompts.jsonl").write_text(json.dumps({"pid": 0, "turns": ["Tell me about bridges."]}))
    out = tmp_path / "t.jsonl"
    base = ["data", "--target", str(target_dir), "--max-new-tokens", "4", "--batch-size", "4", "--device", "cpu",
            "--no-progress", "--translate", "5"]
    assert te.main(base + ["--translate-from", str(src), "--out", str(out)]) == 0
    prompts = read_jsonl(out.with_name(out.name + ".prompts.jsonl"))
    assert len(prompts) == len(read_jsonl(out)) == 2 and all(target_language(p["turns"][0]) for p in prompts)
    # back into English: the tiny target's answers are its own tokens; hand it a French one to read back
    recs = read_jsonl(out)
    fr = tok.encode("Le pont a ete reconstruit au printemps dernier.", add_special_tokens=False)
    recs[0]["input_ids"], recs[0]["loss_mask"] = [1, 2] + fr, [0, 0] + [1] * len(fr)
    out.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    back = tmp_path / "b.jsonl"
    assert te.main(base + ["--translate-from", str(out), "--out", str(back)]) == 0
    lang = target_language(prompts[[p["pid"] for p in prompts].index(recs[0]["pid"])]["turns"][0])
    said = first_sentence(tok.decode(fr, skip_special_tokens=True))      # (the tiny tokenizer drops a few letters)
    got = [p["turns"][0] for p in read_jsonl(back.with_name(back.name + ".prompts.jsonl"))]
    assert said and got and set(got) <= {t.format(L=lang, s=said) for t in BACK_TEMPLATES}, (got, said, lang)
    assert te.main(base + ["--out", str(tmp_path / "x.jsonl")]) == 2           # no source: one clear error


# -- features -----------------------------------------------------------------------------------------

def test_features_equal_last_hidden_state_and_shards(target, target_dir, tmp_path):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (7, 12, 5)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": s, "loss_mask": [0] * 2 + [1] * (len(s) - 2)})
                              for s in seqs))
    ids = pad_batch(seqs)
    f = target_features(target, ids)
    assert f.shape == (3, 12, 64)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = target.model(torch.tensor([s])).last_hidden_state[0]
            assert torch.allclose(f[i, :len(s)], ref, atol=1e-5)
            # lm_head of the features gives the target's logits
            assert torch.allclose(target.lm_head(ref), target(torch.tensor([s])).logits[0], atol=1e-4)
    fdir = tmp_path / "feat"
    assert te.main(["features", "--target", str(target_dir), "--data", str(data), "--out", str(fdir),
                    "--shard-size", "2", "--batch-size", "2", "--device", "cpu", "--no-progress",
                    "--store-dtype", "float32"]) == 0
    store = FeatureStore(fdir)
    assert len(store.index["shards"]) == 2
    for i, s in enumerate(seqs):
        assert torch.allclose(store.get(i), f[i, :len(s)], atol=1e-5)


# -- head numerics vs inference -------------------------------------------------------------------------

def _eval_head_and_entries(target, head_seed: int, data_seed: int, b: int, n: int):
    """A random eval-mode head with the target's embedding, and ``b`` rows of ``n`` random entries."""
    head = init_untrained_head(target.config, seed=head_seed).eval()
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    g = torch.Generator().manual_seed(data_seed)
    toks = torch.randint(4, 96, (b, n), generator=g)
    return head, toks, torch.randn(b, n, 64, generator=g)


def test_head_forward_matches_cached_inference(target):
    n = 9
    head, toks, feats = _eval_head_and_entries(target, 1, 0, 1, n)
    with torch.no_grad():
        ref = head_forward(head, toks, feats)[0]
        d = Drafter(head, target.lm_head, 64)
        d.reset()
        outs = [d.commit(toks[0, :4], feats[0, :4])]
        for i in range(4, n):  # incremental commits, as during decoding
            outs.append(d.commit(toks[0, i:i + 1], feats[0, i:i + 1]))
        assert torch.allclose(outs[0], ref[3], atol=1e-5)
        assert torch.allclose(torch.stack(outs[1:]), ref[4:], atol=1e-5)
        # second draft step: a tree node fed with the head's own prediction
        toks2, pos2, mask2, dfeat = step2_batch(toks, ref[None])
        pred2 = head_forward(head, toks2, torch.cat([feats, dfeat], 1), pos2, mask2)[0, n:]
        for t in (1, 5, n - 1):
            d.reset()
            d.commit(toks[0, :t], feats[0, :t])
            node = d.tree_forward(toks[0, t:t + 1], ref[t - 1:t], torch.tensor([-1]))
            assert torch.allclose(node[0], pred2[t], atol=1e-5)
            d.drop_tree()


def test_unrolled_steps_match_tree_drafting(target):
    """Unrolled step j at entry t computes exactly what the drafter computes for the tree node j levels below the
    entry of tokens[t] (context committed through t, then a chain fed the head's own features)."""
    n = 10
    head, toks, feats = _eval_head_and_entries(target, 2, 4, 2, n)
    with torch.no_grad():
        outs = list(unrolled_forward(head, toks, feats, 4))
        torch.testing.assert_close(outs[0], head_forward(head, toks, feats))   # step 0 = teacher forcing
        d = Drafter(head, target.lm_head, 64)
        for b in (0, 1):
            for t in (0, 2, 5):
                d.reset()
                h = d.commit(toks[b, :t + 1], feats[b, :t + 1])
                torch.testing.assert_close(h, outs[0][b, t], atol=1e-5, rtol=1e-5)
                for j in range(1, 4):
                    h = d.tree_forward(toks[b, t + j:t + j + 1], h[None], torch.tensor([j - 2]))[0]
                    torch.testing.assert_close(h, outs[j][b, t], atol=1e-5, rtol=1e-5)
                d.drop_tree()
        # the second step is the step2_batch construction the validation has always used
        toks2, pos2, mask2, dfeat = step2_batch(toks, outs[0])
        pred2 = head_forward(head, toks2, torch.cat([feats, dfeat], 1), pos2, mask2)[:, n:]
        torch.testing.assert_close(outs[1][:, :n - 1], pred2[:, 1:], atol=1e-5, rtol=1e-5)


def test_unrolled_loss_one_step_is_eagle_loss_and_deeper_steps_learn(target):
    batch = _fixture_batch(target)
    head = _fresh_head(target, seed=5)
    with torch.no_grad():
        a = eagle_loss(head, target.lm_head, batch)
        b = unrolled_loss(head, target.lm_head, batch, 1)
        torch.testing.assert_close(a["loss"], b["loss"])
        c = unrolled_loss(head, target.lm_head, batch, 3, decay=0.5)
        assert len(c["step_top1"]) == 3 and torch.equal(c["vloss"], a["vloss"])
        # the total is the decay-weighted mean of the per-step losses (steps 1, 2 re-derived by hand below)
        preds = list(unrolled_forward(head, batch["tokens"], batch["features"], 3))
        from draft.train.objective import prediction_loss, shifted
        per = [prediction_loss(p, target.lm_head, {"target_features": shifted(batch["target_features"], j),
                                                   "loss_mask": shifted(batch["loss_mask"], j)}, 0.1, 1.0)["loss"]
               for j, p in enumerate(preds)]
        torch.testing.assert_close(c["loss"], (per[0] + 0.5 * per[1] + 0.25 * per[2]) / 1.75)
        assert abs(float(per[1]) - float(per[0])) > 1e-3
    with pytest.raises(ValueError, match="sequence batches"):
        unrolled_loss(head, target.lm_head, dict(batch, attn_mask=torch.ones(1)), 2)
    with pytest.raises(ValueError, match="target_logits"):
        unrolled_loss(head, target.lm_head, dict(batch, target_logits=torch.ones(1)), 2)
    with pytest.raises(ValueError, match="decay > 0"):
        unrolled_loss(head, target.lm_head, batch, 2, decay=-1.0)
    with torch.no_grad():   # a batch shorter than the unroll: the unreachable steps are None, not 0
        short = {k: v[:, :5] for k, v in batch.items()}   # 5 entries, 2..4 weighted: steps 0..4 reach one
        r = unrolled_loss(head, target.lm_head, short, 7)
        assert r["step_top1"][5:] == [None] * 2 and None not in r["step_top1"][:5]
        assert torch.isfinite(r["loss"])
        assert evaluate(head, target.lm_head, [short], steps=7)["top1_steps"][5:] == [None] * 2
    # training with the unrolled objective raises the deeper steps' agreement on the batch it sees
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    before = evaluate(head, target.lm_head, [batch], steps=3)["top1_steps"]
    hist = [train_step(head, batch, opt, target.lm_head, p_weight=0.5, noise_std=0.0, unroll_steps=3)
            for _ in range(40)]
    after = evaluate(head, target.lm_head, [batch], steps=3)["top1_steps"]
    assert len(hist[-1]["step_top1"]) == 3 and all(0 <= x <= 1 for x in hist[-1]["step_top1"])
    assert after[2] > before[2] + 0.3 and after[1] > before[1] + 0.3, (before, after)


# -- training ---------------------------------------------------------------------------------------

def _fixture_batch(target, b=4, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 96, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[:, :3] = 0
    mask[1, 18:] = 0  # "padding"
    feats = target_features(target, ids)
    return sequence_batch(ids, feats, mask)


def test_train_step_runs_and_loss_decreases(target):
    head = _fresh_head(target)
    batch = _fixture_batch(target)
    assert batch["tokens"].shape == (4, 23) and batch["features"].shape == (4, 23, 64)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    emb0 = head.embed_tokens.weight.clone()
    lm0 = target.lm_head.weight.clone()
    hist = [train_step(head, batch, opt, target.lm_head, p_weight=0.5, noise_std=0.2, generator=gen)
            for _ in range(40)]
    for m in hist:
        assert all(torch.isfinite(torch.tensor(m[k])) for k in ("loss", "vloss", "ploss", "grad_norm"))
    first, last = hist[0], {k: sum(h[k] for h in hist[-5:]) / 5 for k in ("loss", "vloss", "ploss", "top1")}
    # the soft-target CE cannot go below the (high) entropy of the random teacher; the rest must fall
    assert last["loss"] < 0.8 * first["loss"] and last["ploss"] < first["ploss"], (first, last)
    assert last["vloss"] < 0.2 * first["vloss"], (first, last)
    assert first["top1"] < 0.2 and last["top1"] > 0.6, (first, last)
    assert torch.equal(head.embed_tokens.weight, emb0) and torch.equal(target.lm_head.weight, lm0)
    # hard labels and explicit logits work as teachers too
    hard = dict(batch, labels=batch["next_tokens"].clamp_min(0))
    hard.pop("target_features")
    assert torch.isfinite(torch.tensor(train_step(head, hard, opt, target.lm_head)["loss"]))
    soft = dict(batch, target_logits=target.lm_head(batch["target_features"]).detach())
    assert torch.isfinite(torch.tensor(train_step(head, soft, opt, target.lm_head)["loss"]))
    v = evaluate(head, target.lm_head, [batch])
    assert 0 <= v["top1"] <= v["top5"] <= 1 and v["top1_step2"] is not None and v["tokens"] > 0


def test_decay_toward_pulls_to_the_anchor_not_to_zero():
    """L2-SP as a decoupled step: the distance to the anchor shrinks by ``rate``, clipped to [0, 1]. Planted bugs:
    AdamW's decay (toward 0) and an unclipped rate (overshoots the anchor) both fail."""
    a = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([[0.5]])]
    p = [x + torch.tensor(0.25) for x in a]
    decay_toward(p, a, 0.2)
    for x, y in zip(p, a):
        assert torch.allclose(x, y + 0.2, atol=1e-7)        # 0.25 * (1 - 0.2); toward 0 would shrink y too
    decay_toward(p, a, 5.0)                                  # clipped to 1: exactly back on the anchor
    assert all(torch.equal(x, y) for x, y in zip(p, a))
    q = [x + 1.0 for x in a]
    decay_toward(q, a, -1.0)                                 # clipped to 0: no step
    assert all(torch.equal(x, y + 1.0) for x, y in zip(q, a))

    def planted(params, anchors, rate):                      # AdamW's weight decay: toward zero
        for x in params:
            x.mul_(1 - rate)
    r = [x + torch.tensor(0.25) for x in a]
    planted(r, a, 0.2)
    assert not all(torch.allclose(x, y + 0.2, atol=1e-7) for x, y in zip(r, a))


def test_train_step_anchor_holds_the_head_at_its_start(target):
    """With the rate at 1 every step ends on the anchor (the update undone); at 0 the head moves; between, the
    head stays nearer its start than without an anchor (same batches, same seed)."""
    batch = _fixture_batch(target)

    def trained(strength):
        head = _fresh_head(target, seed=2)
        start = [p.detach().clone() for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            train_step(head, batch, opt, target.lm_head, generator=gen,
                       anchor=None if strength is None else ([x.clone() for x in start], strength))
        now = [p.detach() for p in head.parameters() if p.requires_grad]
        return sum(float((x - y).pow(2).sum()) for x, y in zip(now, start)), now, start

    free, _, _ = trained(None)
    held, now, start = trained(100.0)                        # lr x 100 = 1: back on the start
    assert all(torch.equal(x, y) for x, y in zip(now, start))
    assert held == 0.0 < free
    half, _, _ = trained(20.0)                               # lr x 20 = 0.2 per step
    assert 0.0 < half < free


def test_saved_head_round_trips_bit_exactly(target, tmp_path):
    head = _fresh_head(target, seed=5)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.01)
    out = save_eagle_head(head, tmp_path / "h")
    from safetensors.torch import load_file
    assert not any(k.startswith("embed_tokens") for k in load_file(str(out / "model.safetensors")))
    loaded = load_eagle_head(out, target.config, target_embed=target.model.embed_tokens.weight.data)
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_mismatched_head_is_rejected(target, tmp_path):
    from transformers import LlamaConfig
    other = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    save_eagle_head(init_untrained_head(other), tmp_path / "small")
    with pytest.raises(HeadError, match="hidden_size"):
        load_eagle_head(tmp_path / "small", target.config, target_embed=target.model.embed_tokens.weight.data)


def test_train_cli_end_to_end_with_resume(target, target_dir, tmp_path):
    g = torch.Generator().manual_seed(1)
    data = tmp_path / "d.jsonl"
    with open(data, "w") as fh:
        for i in range(12):
            n = 10 + i
            ids = torch.randint(4, 96, (n,), generator=g).tolist()
            fh.write(json.dumps({"pid": i, "input_ids": ids, "loss_mask": [0] * 4 + [1] * (n - 4)}) + "\n")
    out = tmp_path / "head"
    base = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--batch-size", "4", "--val-count", "4", "--val-every", "3", "--log-every", "1", "--ckpt-every", "2",
            "--lr", "2e-3", "--no-progress", "--save-dtype", "bfloat16"]
    assert te.main(base + ["--max-steps", "4"]) == 0
    st = torch.load(out / "train_state" / "checkpoint.pt", weights_only=True)
    assert st["step"] == 4
    assert te.main(base + ["--max-steps", "4", "--resume"]) == 0  # already done: no new steps
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    st["total"] = 6
    torch.save(st, out / "train_state" / "checkpoint.pt")
    assert te.main(base + ["--resume"]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    final = [r for r in rows if r["kind"] == "final"][-1]
    assert final["step"] == 6 and 0 <= final["top1"] <= 1
    assert (out / "loss_curve.png").stat().st_size > 1000
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["torch_dtype"] == "bfloat16"
    head = load_eagle_head(out, target.config, target_embed=target.model.embed_tokens.weight.data)
    assert head.fc.weight.shape == (64, 128)
    # precomputed features give the same training input as on-the-fly features
    fdir = tmp_path / "feat"
    assert te.main(["features", "--target", str(target_dir), "--data", str(data), "--out", str(fdir),
                    "--device", "cpu", "--no-progress", "--store-dtype", "float32"]) == 0
    out2 = tmp_path / "head2"
    assert te.main(["train", "--target", str(target_dir), "--data", str(data), "--features", str(fdir),
                    "--out", str(out2), "--device", "cpu", "--batch-size", "4", "--val-count", "4",
                    "--max-steps", "2", "--no-progress"]) == 0
    # the unrolled objective from the CLI, starting from the head above: per-step metrics in train and val rows
    out3 = tmp_path / "head_unrolled"
    assert te.main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out3), "--device", "cpu",
                    "--batch-size", "4", "--val-count", "4", "--max-steps", "2", "--log-every", "1", "--no-progress",
                    "--init-from", str(out), "--unroll-steps", "3", "--eval-steps", "3"]) == 0
    rows3 = read_jsonl(out3 / "metrics.jsonl")
    assert all(len(r["step_top1"]) == 3 for r in rows3 if r["kind"] == "train")
    assert len([r for r in rows3 if r["kind"] == "final"][-1]["top1_steps"]) == 3
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--unroll-steps", "0"]) == 2
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--unroll-steps", "2",
                           "--unroll-decay", "0"]) == 2
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--eval-steps", "-1"]) == 2
    # fewer training conversations (8) than one batch: one error line (was an IndexError traceback)
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--batch-size", "9"]) == 2
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--arch", "eagle3",
                           "--unroll-steps", "2"]) == 2
    # --anchor-decay: toward --init-from's head, so it needs one; not negative; not for EAGLE-3
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--anchor-decay", "10"]) == 2
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--anchor-decay", "-1",
                           "--init-from", str(out)]) == 2
    assert te.main(base + ["--out", str(tmp_path / "h4"), "--max-steps", "1", "--anchor-decay", "10",
                           "--init-from", str(out), "--arch", "eagle3"]) == 2
    # the anchor is --init-from's head, also after --resume (not the checkpoint's): two steps at rate 0.5 leave the
    # head off its start; resumed at rate 1 (constant lr 1e-2 x 100), the third step ends on it (float32: exactly)
    out5 = tmp_path / "anchored"
    anchored = base[:base.index("--save-dtype")] + ["--out", str(out5), "--init-from", str(out), "--lr", "1e-2",
                                                    "--warmup", "1", "--min-lr-ratio", "1"]
    assert te.main(anchored + ["--anchor-decay", "50", "--max-steps", "2"]) == 0

    def off_start():
        h0 = load_eagle_head(out, target.config, target_embed=target.model.embed_tokens.weight.data).state_dict()
        h5 = load_eagle_head(out5, target.config, target_embed=target.model.embed_tokens.weight.data).state_dict()
        return [k for k in h0 if not k.startswith("embed_tokens") and not torch.equal(h0[k].float(), h5[k])]
    assert off_start()
    st5 = torch.load(out5 / "train_state" / "checkpoint.pt", weights_only=True)
    st5["total"] = 3
    torch.save(st5, out5 / "train_state" / "checkpoint.pt")
    assert te.main(anchored + ["--anchor-decay", "100", "--resume"]) == 0
    assert off_start() == []
    # a head for another model is refused as the starting point
    from transformers import LlamaConfig
    other = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    save_eagle_head(init_untrained_head(other), tmp_path / "small")
    assert te.main(base + ["--out", str(tmp_path / "h3"), "--max-steps", "1", "--init-from",
                           str(tmp_path / "small")]) == 2


def test_epoch_batches_bucketing_and_feature_cache(target):
    lengths = [5 + (i * 7) % 40 for i in range(50)]
    train_idx = list(range(3, 50))
    a = epoch_batches(train_idx, lengths, 4, seed=0, epoch=1, bucket=3)
    assert a == epoch_batches(train_idx, lengths, 4, seed=0, epoch=1, bucket=3)
    assert a != epoch_batches(train_idx, lengths, 4, seed=0, epoch=2, bucket=3)
    flat = [i for b in a for i in b]
    assert len(a) == 11 and all(len(b) == 4 for b in a) and len(set(flat)) == 44 and set(flat) <= set(train_idx)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in a)
    plain = epoch_batches(train_idx, lengths, 4, seed=0, epoch=1, bucket=1)
    assert spread < sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in plain)
    g = torch.Generator().manual_seed(2)
    recs = [{"input_ids": torch.randint(4, 96, (n,), generator=g).tolist(), "loss_mask": [1] * n} for n in (6, 9, 4)]
    data = ConversationBatches(recs, 64, torch.device("cpu"), target, cache="cpu")
    b1 = data.make([0, 1, 2])
    assert sorted(data.cache) == [0, 1, 2] and data.cache[1].dtype == torch.float16
    b2 = data.make([2, 0])  # served from the cache (fp16)
    assert torch.allclose(b2["features"][1, :5], b1["features"][0, :5], atol=1e-2)
    assert torch.equal(b2["tokens"][0, :3], b1["tokens"][2, :3])


def test_train_time_budget(target_dir, tmp_path):
    g = torch.Generator().manual_seed(1)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": torch.randint(4, 96, (12,), generator=g).tolist(),
                                          "loss_mask": [0] * 3 + [1] * 9}) for _ in range(20)))
    out = tmp_path / "h"
    assert te.main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--device", "cpu",
                    "--batch-size", "4", "--val-count", "4", "--epochs", "1000", "--time-budget", "6",
                    "--calib-steps", "3", "--cache-features", "cpu", "--no-progress"]) == 0
    final = read_jsonl(out / "metrics.jsonl")[-1]
    assert final["kind"] == "final" and 15 <= final["step"] < 4000


@pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K not available")
def test_stories260k_features_and_step():
    model = load_target(STORIES, "cpu")
    ids = torch.tensor([[1, 403, 407, 261, 378, 425, 259, 411, 365, 302]])
    f = target_features(model, ids)
    with torch.no_grad():
        assert torch.equal(f, model.model(ids).last_hidden_state)
    head = _fresh_head(model)
    batch = sequence_batch(ids, f, torch.ones_like(ids))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    m = train_step(head, batch, opt, model.lm_head)
    assert m["n"] == 9 and m["loss"] > 0
