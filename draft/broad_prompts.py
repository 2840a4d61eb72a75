"""Broader self-distillation prompts (``python -m draft.train_eagle data --broad N``): the kinds of requests users
send beyond chat, with the passages they work on written by the target itself.

Kinds (round robin): translation (English -> several languages and several languages -> English), summarisation
of a given text, retrieval-augmented answers that must quote a given passage, extraction to JSON, arithmetic word
problems, code completion, multi-turn chat (a second user turn), role-play. The answers are generated later by
:func:`draft.train_eagle.build_conversations` (greedy and sampled), and the prompts are deduplicated against the
evaluation records with ``--exclude`` as for the other prompt sources.
"""
from __future__ import annotations

import random
import re

KINDS = ("translate", "summarize", "rag", "extract", "math", "code", "multiturn", "roleplay")
LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Dutch"]
FOREIGN = [  # short sentences in several languages (authored here) for X -> English translation
    ("French", "Le train pour Lyon part à huit heures et demie demain matin."),
    ("French", "Nous avons visité le musée, puis nous avons mangé dans un petit restaurant."),
    ("Spanish", "Mi hermana trabaja en un hospital y le encanta ayudar a la gente."),
    ("Spanish", "El año pasado plantamos tomates y pimientos en el jardín."),
    ("German", "Könnten Sie mir bitte sagen, wo der nächste Bahnhof ist?"),
    ("German", "Das Wetter war schlecht, deshalb sind wir zu Hause geblieben."),
    ("Italian", "La biblioteca chiude alle sette, quindi dobbiamo sbrigarci."),
    ("Portuguese", "Ele aprendeu a tocar violão quando tinha doze anos."),
    ("Dutch", "We fietsen elke zondag langs de rivier naar het park."),
    ("Chinese", "我每天早上喝一杯咖啡，然后去公司上班。"),
    ("Japanese", "週末は友達と山に登る予定です。"),
]
ENTITIES = ["names of people", "places", "numbers and dates", "organisations", "key terms", "actions"]
ROLES = [
    ("a friendly museum guide", "What is the most interesting object in your museum?"),
    ("a pirate captain", "Tell me about your last voyage."),
    ("a strict but fair chess coach", "I keep losing in the opening. What should I do?"),
    ("a medieval innkeeper", "Do you have a room for the night, and what is for dinner?"),
    ("a customer support agent for an internet provider", "My connection keeps dropping every evening."),
    ("Sherlock Holmes", "Someone took the last cookie from the jar. Who did it?"),
    ("a travel agent", "I have one week and a small budget. Where should I go?"),
    ("a fitness trainer", "I want to start running. How do I begin?"),
    ("a science teacher for children", "Why is the sky blue?"),
    ("a chef on a cooking show", "Show me how to make a quick pasta dish."),
]
FOLLOWUP2 = ["Can you give me a concrete example?", "What are the pros and cons?", "Summarize that in two sentences.",
             "How would you explain this to a beginner?", "What should I read next about it?"]


def _first_sentence(text: str) -> str:
    m = re.match(r"\s*(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text).strip()


def broad_prompts(model, tok, n: int, topics: list[str], seed: int = 0, batch_size: int = 64,
                  max_new_tokens: int = 160, system: str = "", template: str = "auto",
                  progress: bool = True) -> list[dict]:
    """``n`` prompts, round robin over :data:`KINDS`; passages are paragraphs the target writes about ``topics``."""
    from draft.train_eagle import (_code_prompt, _generate_all, _math_prompt, _norm, _pad_id, chat_prompt_ids,
                                   stop_token_ids)
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    need = sum(k in ("translate", "summarize", "rag", "extract") for k in kinds)
    passages: list[tuple[str, str]] = []
    if need:
        stops = stop_token_ids(tok, getattr(model, "generation_config", None) and model.generation_config.to_dict())
        pad = _pad_id(tok, stops)
        jobs = [rng.choice(topics) for _ in range(need + need // 4 + 2)]
        styles = ["Write a short factual paragraph (4 sentences) about {t}.",
                  "Write a short news report about a recent event related to {t}.",
                  "Describe {t} in one paragraph for an encyclopedia."]
        prompts = [chat_prompt_ids(tok, [rng.choice(styles).format(t=t)], [], system, template) for t in jobs]
        replies = _generate_all(model, prompts, [True] * len(prompts),
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
                turns = [rng.choice([f"Translate this {lang} sentence into English: {s}",
                                     f"What does \"{s}\" mean in English?"])]
            else:
                t, p = rng.choice(passages)
                turns = [f"Translate the following sentence into {rng.choice(LANGS)}:\n{_first_sentence(p)}"]
        elif k == "summarize":
            t, p = rng.choice(passages)
            turns = [rng.choice(["Summarize the following text in two sentences:\n\n", "TL;DR:\n\n",
                                 "Write a one-line summary of this text:\n\n"]) + p]
        elif k == "rag":
            t, p = rng.choice(passages)
            q = rng.choice([f"What does the passage say about {t}?", "What is the main claim of the passage?",
                            "Which details in the passage support its conclusion?"])
            turns = [f"Answer the question using only the passage below, and quote the sentence that supports your "
                     f"answer.\n\nPassage: {p}\n\nQuestion: {q}"]
        elif k == "extract":
            t, p = rng.choice(passages)
            turns = [f"Extract all {rng.choice(ENTITIES)} mentioned in the text below. Answer as a JSON list.\n\n{p}"]
        elif k == "math":
            turns = [_math_prompt(rng)]
        elif k == "code":
            turns = [_code_prompt(rng)]
        elif k == "multiturn":
            t = rng.choice(topics)
            turns = [rng.choice([f"What should a beginner know about {t}?", f"Why does {t} matter?",
                                 f"Give me three facts about {t}."]), rng.choice(FOLLOWUP2)]
        elif k == "roleplay":
            role, line = rng.choice(ROLES)
            turns = [f"Let's role-play. You are {role}. Stay in character.\n\n{line}"]
        key = _norm(" ".join(turns))
        if key in seen:
            continue
        seen.add(key)
        out.append({"turns": turns, "source": f"broad:{k}"})
    rng.shuffle(out)
    return out
