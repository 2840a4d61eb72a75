"""``data --translate N --translate-from DATA.jsonl``: translation prompts made from the target's own text (issue
45: translation is the kind the shipped head drafts worst, because its training data held none).

Two directions, one rule per answer of ``DATA`` (a file the ``data`` subcommand wrote, with its
``DATA.prompts.jsonl``):

* an answer to any other prompt gives **English -> X** prompts: each of its usable English sentences
  (:func:`english_sentences`) asked to be translated into one of :data:`LANGS`;
* an answer to an English -> X prompt of this module (recognised by its template, :func:`target_language`) gives
  one **X -> English** prompt: the first sentence of the target's translation, asked back into English.

So ``--translate-from general.jsonl`` makes the first kind and ``--translate-from the_first_kind.jsonl`` the
second; nothing but the target's own answers and the templates below is used (no dataset, no download).

Invariants: pure functions of the records, the decoded texts and ``seed`` (one ``random.Random(seed)`` drawn in a
fixed order: pool sorted, shuffled, then one language and one template per prompt; X -> English: one template per
usable answer in file order, then one shuffle); English -> X sentences are distinct; every prompt is one user turn.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Iterator

from draft.train.corpus import answer_spans

LANGS = ("French", "Spanish", "German", "Italian", "Portuguese")
TO_TEMPLATES = ("Translate into {L}: {s}", "Translate the following sentence into {L}:\n{s}",
                "How would you say this in {L}? {s}", "Please translate this sentence to {L}: {s}")
BACK_TEMPLATES = ("Translate this {L} sentence into English: {s}", "What does this {L} sentence mean in English? {s}",
                  "Translate into English: {s}", 'What does "{s}" mean in English?')

_MARKUP = re.compile(r"[*#`|_\[\]<>{}=]|\d\.")


def english_sentences(text: str) -> Iterator[str]:
    """The sentences of ``text`` worth translating: 6-28 words, ASCII, ending in ``.!?``, no word over 16 characters
    (a sampled answer's degenerate runs), no markup or list numbering."""
    for s in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")):
        s = s.strip()
        w = s.split()
        if 6 <= len(w) <= 28 and s[-1:] in ".!?" and not _MARKUP.search(s[:3] + s) and s.isascii() \
                and max(len(x) for x in w) <= 16:
            yield s


def first_sentence(text: str) -> str | None:
    """The first sentence of a translation the target wrote (its first line, without quotes around it), when it
    has 4-30 words and does not open with a label (``French: ...``); else None. (Not
    :func:`draft.train.broad_prompts._first_sentence`: that one reads the target's English passages, keeps a closing
    quote in the sentence, and its seeded prompts are the broad head's recipe, which a shared rule would change.)"""
    line = text.strip().split("\n")[0].strip().strip('"')
    m = re.match(r"(.+?[.!?])[\"”]?(\s|$)", line)
    s = m.group(1) if m else line
    return s if 4 <= len(s.split()) <= 30 and ":" not in s[:20] else None


_TO_PATTERNS = [re.compile("^" + re.escape(t).replace(re.escape("{L}"), "(?P<L>[A-Z][a-z]+)")
                           .replace(re.escape("{s}"), ".*") + "$", re.S) for t in TO_TEMPLATES]


def target_language(turn: str) -> str | None:
    """The language X when ``turn`` is an English -> X prompt of :data:`TO_TEMPLATES` over :data:`LANGS`."""
    for p in _TO_PATTERNS:
        m = p.match(turn)
        if m and m.group("L") in LANGS:
            return m.group("L")
    return None


def translation_prompts(records: list[dict], prompts: dict[int, dict], decode: Callable[[list[int]], str], n: int,
                        seed: int) -> list[dict]:
    """At most ``n`` prompts (``{"turns": [...], "source": "translate:to" | "translate:back"}``) from ``records``
    (``input_ids``, ``loss_mask``, ``pid``) whose prompts are ``prompts[pid]`` (module docstring: which answer
    gives which direction)."""
    rng = random.Random(seed)
    pool, back = set(), []
    for r in records:
        spans = answer_spans(r["input_ids"], r["loss_mask"])
        lang = target_language(prompts[r["pid"]]["turns"][0]) if r["pid"] in prompts else None
        if lang is None:
            for sp in spans:
                pool.update(english_sentences(decode(sp)))
        elif spans:
            back.append((lang, decode(spans[0])))
    out = []
    ordered = sorted(pool)
    rng.shuffle(ordered)
    for s in ordered[:n]:
        lang = rng.choice(LANGS)
        out.append({"turns": [rng.choice(TO_TEMPLATES).format(L=lang, s=s)], "source": "translate:to"})
    backs = []
    for lang, text in back:
        s = first_sentence(text)
        if s is not None:
            backs.append({"turns": [rng.choice(BACK_TEMPLATES).format(L=lang, s=s)], "source": "translate:back"})
    rng.shuffle(backs)
    return out + backs[:max(0, n - len(out))]
