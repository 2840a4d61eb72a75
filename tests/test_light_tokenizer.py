"""model/tokenizer.py: the tokenizer read with the ``tokenizers`` library alone gives AutoTokenizer's ids, text,
special ids and chat template on stories260K (a ``LlamaTokenizer``) and the default SmolLM2 split (a
``TokenizersBackend`` with a ChatML template); a planted difference fails; what it does not reproduce falls back
to AutoTokenizer."""
from __future__ import annotations

import json
import shutil

import pytest

from config.paths import DEFAULT_STAGE_DIR
from model.prompts import chat_prompt_ids, stop_token_ids
from model.tokenizer import LightTokenizer, load_light_tokenizer
from tests.helpers import STORIES

TEXTS = ["Once upon a time", "  two  spaces\n\nnew line", "héllo wörld 日本語 🙂", "", " leading", "trailing ",
         "a\tb", "<s> x </s>", "<|im_start|>user\nhi<|im_end|>", "x" * 50, "Don't you're 1234567 3.14 -- foo_bar()",
         "\n", "   ", "Write a haiku about the sea."]
CHATS = [([], ["Hi there"], ""), ([], ["Q1", "Q2 ünï"], "Be brief."), (["A1"], ["Q1", "Q2"], "")]


def _folders():
    out = []
    if STORIES.is_dir():
        out.append(STORIES)
    if (DEFAULT_STAGE_DIR / "stage_model_0").is_dir():
        out.append(DEFAULT_STAGE_DIR / "stage_model_0")
    return out


def _pair(folder):
    from transformers import AutoTokenizer
    light = load_light_tokenizer(folder)
    assert isinstance(light, LightTokenizer), folder
    return AutoTokenizer.from_pretrained(folder), light


def _differences(ref, got) -> list:
    bad = []
    for s in TEXTS:
        ids = ref(s)["input_ids"]
        if got(s)["input_ids"] != ids:
            bad.append(("encode", s))
        for skip in (True, False):
            if got.decode(ids, skip_special_tokens=skip) != ref.decode(ids, skip_special_tokens=skip):
                bad.append(("decode", s, skip))
    for answers, turns, system in CHATS:
        for template in ("auto", "raw"):
            if chat_prompt_ids(got, turns, answers, system, template) != chat_prompt_ids(ref, turns, answers, system,
                                                                                          template):
                bad.append(("chat", template, turns))
    return bad


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.parent.name if p.name.startswith("stage") else p.name)
def test_light_tokenizer_equals_autotokenizer(folder):
    ref, got = _pair(folder)
    assert _differences(ref, got) == []
    assert bool(got.chat_template) == bool(ref.chat_template)
    for attr in ("eos_token_id", "bos_token_id", "unk_token_id", "pad_token_id", "eos_token"):
        assert getattr(got, attr) == getattr(ref, attr), attr
    assert stop_token_ids(got, {}) == stop_token_ids(ref, {})
    for token in ("<|im_end|>", "<|eot_id|>", "</s>"):
        assert got.convert_tokens_to_ids(token) == ref.convert_tokens_to_ids(token), token


@pytest.mark.parametrize("plant", ["no_bos", "decode_keeps_specials", "template_without_generation_prompt"])
def test_a_planted_difference_fails(monkeypatch, plant):
    """Encoding without the post-processor's BOS, decoding that ignores ``skip_special_tokens``, a chat template
    rendered without the assistant's generation prompt: each is caught by the comparison above."""
    import model.tokenizer as mt
    folder = DEFAULT_STAGE_DIR / "stage_model_0" if plant == "template_without_generation_prompt" else STORIES
    if not folder.is_dir():
        pytest.skip(f"{folder} is not available")
    if plant == "no_bos":
        real = mt.LightTokenizer.encode
        monkeypatch.setattr(mt.LightTokenizer, "encode", lambda self, text, add=True: real(self, text, False))
    elif plant == "decode_keeps_specials":
        real = mt.LightTokenizer.decode
        monkeypatch.setattr(mt.LightTokenizer, "decode", lambda self, ids, skip_special_tokens=False: real(self, ids))
    else:
        real = mt.LightTokenizer.apply_chat_template
        monkeypatch.setattr(mt.LightTokenizer, "apply_chat_template",
                            lambda self, msgs, add_generation_prompt=False, **kw: real(self, msgs, False, **kw))
    ref, got = _pair(folder)
    assert _differences(ref, got)


def test_what_it_does_not_reproduce_is_left_to_autotokenizer(tmp_path):
    if not STORIES.is_dir():
        pytest.skip("../shared/models/stories260K is not available")
    for change in ({"tokenizer_class": "T5Tokenizer"}, {"add_bos_token": False}, {"clean_up_tokenization_spaces": True},
                   {"chat_template": [{"name": "default", "template": "x"}]}):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(STORIES, d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.update(change)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        assert load_light_tokenizer(d) is None, change
    assert load_light_tokenizer(tmp_path / "nothing") is None
