"""``data --self-prompts N``: single-turn prompts built offline from :mod:`draft.train.prompt_lists`, most of them
written by the target itself (questions, instructions, first messages, news paragraphs to summarise or rewrite),
the rest templated (topic instructions, arithmetic word problems, coding tasks); and the generic follow-up turns
of ``--followup-frac``.

Invariants: everything is drawn from one ``random.Random(seed)`` in a fixed order, so a seed, the lists and the
target's replies fix the prompts; prompts are distinct after :func:`draft.train.prompt_files.norm_text`;
:func:`finish_meta_prompt` returns ``None`` for a reply that makes no usable prompt (wrong length, empty).
"""
from __future__ import annotations

import random
import re

from draft.train.generate import generate_all, pad_id
from draft.train.prompt_files import norm_text
from draft.train.prompt_lists import (CODE_STYLES, CODE_TASKS, FOLLOWUPS, ITEMS, MATH_TEMPLATES, META_STYLES, NAMES,
                                      REWRITE_PREFIXES, SUMMARIZE_PREFIXES, TEMPLATE_STYLES, TOPICS)
from model.prompts import chat_prompt_ids, stop_token_ids


def finish_meta_prompt(kind: str, reply: str, rng: random.Random) -> str | None:
    """Turn the target's reply to a meta-instruction into a user prompt (None when unusable)."""
    text = reply.replace("<|im_end|>", "").strip()
    if not text:
        return None
    if kind in ("question", "instruction", "message"):
        quoted = re.findall(r'"([^"\n]{10,300})"', text)
        if kind == "question":
            quoted = [q for q in quoted if q.strip().endswith("?")] or quoted
        if quoted:
            text = quoted[0]
        else:
            text = text.split("\n\n")[0]
            text = re.sub(r"^(question|instruction|message|here is[^:]*|sure[^:]*)\s*:\s*", "", text, flags=re.I)
        text = text.strip().strip('"').strip()
        if kind == "question" and "?" in text and len(text) > 400:
            text = text[:text.index("?") + 1]
        return text if 10 <= len(text) <= 600 else None
    if kind == "summarize":
        return rng.choice(SUMMARIZE_PREFIXES) + text if len(text) >= 80 else None
    if kind == "rewrite":
        return rng.choice(REWRITE_PREFIXES) + text if len(text) >= 40 else None
    return text


def code_prompt(rng: random.Random) -> str:
    """A coding task from :data:`CODE_TASKS` in one of the :data:`CODE_STYLES` (``complete``: a Python stub)."""
    name, args, ret, doc = rng.choice(CODE_TASKS)
    style = rng.choice(CODE_STYLES)
    if style == "complete":
        imports = "from typing import Dict, List, Tuple\n\n\n"
        return f'Complete the code I provided.{imports}def {name}({args}) -> {ret}:\n    """ {doc}\n    """\n'
    return style.format(name=name, args=args, doc=doc)


def math_prompt(rng: random.Random) -> str:
    """An arithmetic word problem: one of :data:`MATH_TEMPLATES` with names, items and numbers drawn by ``rng``."""
    n1, n2 = rng.sample(NAMES, 2)
    vals = dict(n1=n1, n2=n2, item=rng.choice(ITEMS), a=rng.randint(3, 40), b=rng.randint(2, 25),
                c=rng.randint(1, 9), p=rng.randint(2, 9), bill=rng.choice([20, 50, 100]), s=rng.randint(30, 90),
                s2=rng.randint(30, 90), h=rng.randint(2, 9), h2=rng.randint(1, 5), w=rng.randint(8, 40),
                k=rng.randint(2, 8), pct=rng.choice([10, 20, 25, 40, 60, 75]), big=rng.choice(
                    [120, 150, 200, 240, 300, 360, 480, 600, 720]))
    return rng.choice(MATH_TEMPLATES).format(**vals)


def self_prompts(model, tok, n: int, seed: int = 0, batch_size: int = 64, max_new_tokens: int = 128,
                 temperature: float = 0.9, top_p: float = 0.95, meta_frac: float = 0.45, math_frac: float = 0.1,
                 code_frac: float = 0.15, system: str = "", template: str = "auto",
                 progress: bool = True) -> list[dict]:
    """``n`` single-turn prompts: ``meta_frac`` written by the target from :data:`META_STYLES` x
    :data:`TOPICS`, the rest templated (:data:`TEMPLATE_STYLES`, arithmetic word problems, coding tasks)."""
    rng = random.Random(seed)
    n_meta = int(round(n * meta_frac))
    n_math = int(round(n * math_frac))
    n_code = int(round(n * code_frac))
    n_tmpl = max(0, n - n_meta - n_math - n_code)
    out: list[dict] = []
    seen: set[str] = set()

    def add(text: str, source: str) -> bool:
        key = norm_text(text)
        if key in seen:
            return False
        seen.add(key)
        out.append({"turns": [text], "source": source})
        return True

    # target-written prompts: a few rounds in case replies are unusable
    stops = stop_token_ids(tok, getattr(model, "generation_config", None) and model.generation_config.to_dict())
    pad = pad_id(tok, stops)
    want, tries = n_meta, 0
    while want > 0 and tries < 4:
        tries += 1
        jobs = []
        for _ in range(int(want * 1.3) + 4):
            kind, instr = rng.choice(META_STYLES)
            jobs.append((kind, instr.format(topic=rng.choice(TOPICS))))
        prompts = [chat_prompt_ids(tok, [instr], [], system, template) for _, instr in jobs]
        replies = generate_all(model, prompts, [True] * len(prompts),
                               dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p),
                               batch_size, stops, pad, f"self-prompts (round {tries})", progress)
        for (kind, _), r in zip(jobs, replies):
            if want <= 0:
                break
            text = finish_meta_prompt(kind, tok.decode([t for t in r if t not in stops], skip_special_tokens=True),
                                      rng)
            if text and add(text, f"self:{kind}"):
                want -= 1
    n_tmpl += max(0, want)  # top up with templated prompts if the target's replies ran short
    for _ in range(n_math * 5):
        if n_math <= 0:
            break
        n_math -= add(math_prompt(rng), "tmpl:math")
    for _ in range(n_code * 5):
        if n_code <= 0:
            break
        n_code -= add(code_prompt(rng), "tmpl:code")
    for _ in range(n_tmpl * 5):
        if n_tmpl <= 0:
            break
        t1, t2 = rng.sample(TOPICS, 2)
        n_tmpl -= add(rng.choice(TEMPLATE_STYLES).format(topic=t1, topic2=t2), "tmpl:topic")
    rng.shuffle(out)
    return out


def add_followups(convs: list[dict], frac: float, seed: int) -> None:
    """In place: each single-turn conversation gets, with probability ``frac``, a second user turn from
    :data:`FOLLOWUPS` (one ``random.Random(seed)`` over ``convs`` in order; ``frac <= 0`` draws nothing)."""
    rng = random.Random(seed)
    for c in convs:
        if len(c["turns"]) == 1 and frac > 0 and rng.random() < frac:
            c["turns"] = c["turns"] + [rng.choice(FOLLOWUPS)]
