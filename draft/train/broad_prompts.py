"""Broader self-distillation prompts (``python -m draft.train_eagle data --broad N``): the kinds of requests users
send beyond chat, with the passages they work on written by the target itself.

Kinds (round robin): translation (English -> several languages and several languages -> English), summarisation
of a given text, retrieval-augmented answers that must quote a given passage, extraction to JSON, arithmetic word
problems, code completion, multi-turn chat (a second user turn), role-play. The answers are generated later by
:func:`draft.train.generate.build_conversations` (greedy and sampled), and the prompts are deduplicated against
the evaluation records with ``--exclude`` as for the other prompt sources. The lists the prompts are drawn from
live in ``broad_prompt_lists.json`` (:mod:`draft.train.prompt_lists`).

Invariants: one ``random.Random(seed)`` draws everything in a fixed order (same seed, lists and passages -> same
prompts); prompts are distinct after :func:`draft.train.prompt_files.norm_text`; kinds that need a passage fall
back to another kind when the target wrote none usable (at least 20 words).
"""
from __future__ import annotations

import random
import re

from draft.train.generate import generate_all, pad_id
from draft.train.prompt_files import norm_text
from draft.train.prompt_lists import (ENTITIES, FOLLOWUP2, FOREIGN, LANGS, MULTITURN_OPENERS, PASSAGE_STYLES,
                                      RAG_QUESTIONS, ROLES, SUMMARY_PREFIXES, TRANSLATE_TO_ENGLISH)
from draft.train.self_prompts import code_prompt, math_prompt
from model.prompts import chat_prompt_ids, stop_token_ids

KINDS = ("translate", "summarize", "rag", "extract", "math", "code", "multiturn", "roleplay")


def _first_sentence(text: str) -> str:
    m = re.match(r"\s*(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text).strip()


def broad_prompts(model, tok, n: int, topics: list[str], seed: int = 0, batch_size: int = 64,
                  max_new_tokens: int = 160, system: str = "", template: str = "auto",
                  progress: bool = True) -> list[dict]:
    """``n`` prompts, round robin over :data:`KINDS`; passages are paragraphs the target writes about ``topics``."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    need = sum(k in ("translate", "summarize", "rag", "extract") for k in kinds)
    passages: list[tuple[str, str]] = []
    if need:
        stops = stop_token_ids(tok, getattr(model, "generation_config", None) and model.generation_config.to_dict())
        pad = pad_id(tok, stops)
        jobs = [rng.choice(topics) for _ in range(need + need // 4 + 2)]
        prompts = [chat_prompt_ids(tok, [rng.choice(PASSAGE_STYLES).format(t=t)], [], system, template) for t in jobs]
        replies = generate_all(model, prompts, [True] * len(prompts),
                               dict(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.95),
                               batch_size, stops, pad, "passages", progress)
        for t, r in zip(jobs, replies):
            text = tok.decode([x for x in r if x not in stops], skip_special_tokens=True).strip()
            if len(text.split()) >= 20:
                passages.append((t, text))
    out, seen = [], set()
    for k in kinds:
        turns = None
        if k in ("translate", "summarize", "rag", "extract") and not passages:
            k = rng.choice(["math", "code", "multiturn", "roleplay"])
        if k == "translate":
            if rng.random() < 0.5:
                lang, s = rng.choice(FOREIGN)
                turns = [rng.choice(TRANSLATE_TO_ENGLISH).format(lang=lang, s=s)]
            else:
                t, p = rng.choice(passages)
                turns = [f"Translate the following sentence into {rng.choice(LANGS)}:\n{_first_sentence(p)}"]
        elif k == "summarize":
            t, p = rng.choice(passages)
            turns = [rng.choice(SUMMARY_PREFIXES) + p]
        elif k == "rag":
            t, p = rng.choice(passages)
            q = rng.choice(RAG_QUESTIONS).format(t=t)
            turns = [f"Answer the question using only the passage below, and quote the sentence that supports your "
                     f"answer.\n\nPassage: {p}\n\nQuestion: {q}"]
        elif k == "extract":
            t, p = rng.choice(passages)
            turns = [f"Extract all {rng.choice(ENTITIES)} mentioned in the text below. Answer as a JSON list.\n\n{p}"]
        elif k == "math":
            turns = [math_prompt(rng)]
        elif k == "code":
            turns = [code_prompt(rng)]
        elif k == "multiturn":
            t = rng.choice(topics)
            turns = [rng.choice(MULTITURN_OPENERS).format(t=t), rng.choice(FOLLOWUP2)]
        elif k == "roleplay":
            role, line = rng.choice(ROLES)
            turns = [f"Let's role-play. You are {role}. Stay in character.\n\n{line}"]
        key = norm_text(" ".join(turns))
        if key in seen:
            continue
        seen.add(key)
        out.append({"turns": turns, "source": f"broad:{k}"})
    rng.shuffle(out)
    return out
