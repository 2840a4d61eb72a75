"""``data --translate``: translation prompts from the target's own answers (draft/train/translation_prompts.py)."""
import random

import pytest

from draft.train import translation_prompts as tp

TEXTS = {
    1: "The old bridge was rebuilt in the spring of last year. It is now open to walkers and cyclists every day.",
    2: "**Note**: see below.\n1. Buy fresh bread from the bakery on the corner today.\nShort one.",
    3: "Le pont a été reconstruit au printemps dernier, et il est ouvert tous les jours.",
    4: "French: Le pont est ouvert.",
}


def _record(pid, text_id, prompt_len=3):
    """A conversation whose only answer decodes to ``TEXTS[text_id]`` (the fake decode below reads the id)."""
    return {"pid": pid, "input_ids": [0] * prompt_len + [text_id, text_id], "loss_mask": [0] * prompt_len + [1, 1]}


def _decode(ids):
    return TEXTS[ids[0]]


def test_english_sentences_keep_plain_prose_only():
    text = " ".join([TEXTS[1], TEXTS[2], "Ein ganz normaler deutscher Satz über Brücken und Wege.",
                     "This sentence has a supercalifragilisticexpialidocious word in it.",
                     "Café au lait is served here every single morning.", "A `code` span is not prose at all here."])
    assert list(tp.english_sentences(text)) == [
        "The old bridge was rebuilt in the spring of last year.", "It is now open to walkers and cyclists every day.",
        "Buy fresh bread from the bakery on the corner today."]   # markup, short, non-ASCII, long words dropped


@pytest.mark.parametrize("template", tp.TO_TEMPLATES)
@pytest.mark.parametrize("lang", tp.LANGS)
def test_target_language_reads_every_template(template, lang):
    # the sentence names another language first: a search for any language name would answer French (planted in
    # the first version of this rule)
    turn = template.format(L=lang, s="The French Revolution began in 1789, long before German unification.")
    assert tp.target_language(turn) == lang


def test_target_language_refuses_other_prompts():
    assert tp.target_language("Translate into Klingon: hello there friend.") is None
    assert tp.target_language("Write a poem about the sea.") is None
    assert tp.target_language(tp.BACK_TEMPLATES[0].format(L="French", s="Le pont.")) is None


def test_first_sentence():
    assert tp.first_sentence(TEXTS[3]) == TEXTS[3]
    assert tp.first_sentence('"Le pont est ouvert tous les jours." Voilà.') == "Le pont est ouvert tous les jours."
    assert tp.first_sentence(TEXTS[4]) is None                                          # a label, not a sentence
    assert tp.first_sentence("Oui.") is None


def test_directions_follow_the_prompt_answered():
    prompts = {0: {"turns": ["Tell me about bridges."]},
               1: {"turns": [tp.TO_TEMPLATES[0].format(L="French", s="The bridge is open.")]},
               2: {"turns": [tp.TO_TEMPLATES[1].format(L="German", s="The bridge is open.")]}}
    recs = [_record(0, 1), _record(1, 3), _record(2, 4)]
    out = tp.translation_prompts(recs, prompts, _decode, 10, seed=0)
    to = [p for p in out if p["source"] == "translate:to"]
    back = [p for p in out if p["source"] == "translate:back"]
    assert len(to) == 2 and len(back) == 1                  # two English sentences; the German answer is a label
    assert all(tp.target_language(p["turns"][0]) in tp.LANGS for p in to)
    assert back[0]["turns"][0] in {t.format(L="French", s=TEXTS[3]) for t in tp.BACK_TEMPLATES}
    assert all(len(p["turns"]) == 1 for p in out)


def test_seeded_capped_and_distinct():
    prompts = {i: {"turns": ["Tell me something."]} for i in range(3)}
    recs = [_record(0, 1), _record(1, 1), _record(2, 2)]
    a = tp.translation_prompts(recs, prompts, _decode, 10, seed=3)
    assert a == tp.translation_prompts(recs, prompts, _decode, 10, seed=3)
    sentences = [p["turns"][0].split(": ", 1)[-1].split("\n")[-1].split("? ", 1)[-1] for p in a]
    assert len(sentences) == len(set(sentences)) == 3       # the same answer twice gives its sentences once
    assert len(tp.translation_prompts(recs, prompts, _decode, 1, seed=3)) == 1
    rng = random.Random(3)                                   # the documented draw order: pool sorted, shuffled, ...
    pool = sorted({*tp.english_sentences(TEXTS[1]), *tp.english_sentences(TEXTS[2])})
    rng.shuffle(pool)
    lang = rng.choice(tp.LANGS)
    assert a[0]["turns"][0] == rng.choice(tp.TO_TEMPLATES).format(L=lang, s=pool[0])
