"""Train an EAGLE-1/2 draft head for a target model by self-distillation.

Three subcommands (``python -m draft.train_eagle SUBCOMMAND --help``)::

    data      prompts -> conversations answered by the target itself (JSONL: token ids + loss mask)
    features  optional: precompute the target's features as fp16/bf16 safetensors shards
    train     train the head with EAGLE's objective and save it in EAGLE layout (load_eagle_head reads it)

Prompts come from FastChat ``question.jsonl`` files, ShareGPT-style JSON(L), plain text (one prompt a
line) and/or ``--self-prompts N``: prompts built offline from the topic lists of this module, most of
them written by the target itself (questions, instructions, news paragraphs to summarise, ...), the
rest templated instructions, arithmetic word problems and coding tasks.

Conventions (the same as :mod:`draft.drafter` at inference): the target's *feature* ``f_t`` is its final
normalized hidden state at position ``t`` (what ``lm_head`` consumes). Head entry ``t`` pairs
``token[t+1]`` with ``f_t`` at position ``t``; its output predicts ``f_{t+1}`` and ``lm_head`` of it
predicts ``token[t+2]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


from draft.eagle import EagleHead, HeadError, init_untrained_head, load_eagle_head, save_eagle_head  # noqa: E402
from model.prompts import chat_prompt_ids, stop_token_ids  # noqa: E402

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------------
# Self-prompt material (authored here; no external data needed)
# ---------------------------------------------------------------------------------------------------

TOPICS = [
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "the solar system", "climate change",
    "renewable energy", "electric cars", "the human heart", "vaccines", "sleep", "healthy eating",
    "running a marathon", "yoga", "learning a new language", "public speaking", "time management",
    "job interviews", "personal finance", "saving for retirement", "starting a small business",
    "social media marketing", "the stock market", "cryptocurrency", "the French Revolution", "ancient Rome",
    "World War II", "the Renaissance", "the Industrial Revolution", "the history of the internet",
    "artificial intelligence", "machine learning", "cybersecurity", "cloud computing", "smartphones",
    "video games", "chess", "football", "the Olympic Games", "cooking pasta", "baking bread", "coffee",
    "gardening", "houseplants", "dogs", "cats", "birds", "the ocean", "rainforests", "deserts", "mountains",
    "traveling in Japan", "visiting Paris", "camping", "photography", "painting", "classical music", "jazz",
    "writing poetry", "science fiction novels", "movies", "friendship", "parenting", "moving to a new city",
    "recycling", "urban planning", "democracy", "philosophy", "the ethics of technology", "space exploration",
    "dinosaurs", "earthquakes", "the immune system", "mental health", "meditation", "electricity",
    "the printing press", "famous inventors", "honeybees", "the moon landing",
]

# Prompts the target writes itself: (kind, instruction given to the target). The kind says how its
# reply becomes a user prompt (see _finish_meta_prompt).
META_STYLES = [
    ("question", "Write one question that a curious person might ask an AI assistant about {topic}. "
                 "Reply with the question only."),
    ("question", "Write a short trivia question about {topic}. Reply with the question only."),
    ("question", "Write a question a student could ask a teacher about {topic}. Reply with the question only."),
    ("instruction", "Write a short instruction asking an AI assistant to do a task related to {topic}. "
                    "Reply with the instruction only."),
    ("message", "You are a user talking to an AI assistant. Write your first message to the assistant "
                "about {topic}."),
    ("summarize", "Write a short news paragraph (3-4 sentences) about {topic}."),
    ("summarize", "Write a short article about {topic}."),
    ("rewrite", "Write two sentences about {topic}."),
]
SUMMARIZE_PREFIXES = ["Summarize: ", "Summarize the following text in one sentence:\n",
                      "Give a short summary of this article:\n"]
REWRITE_PREFIXES = ["Rewrite the following text in a more formal tone:\n", "Make this text simpler:\n",
                    "Correct the grammar and improve the style of this text:\n",
                    "Turn the following text into a bulleted list:\n"]

TEMPLATE_STYLES = [
    "Explain {topic} in simple terms.",
    "What are the most important facts about {topic}?",
    "Write a short poem about {topic}.",
    "Give me five tips related to {topic}.",
    "Write a short blog post about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a persuasive paragraph about why people should care about {topic}.",
    "Compose a short story that involves {topic}.",
    "Create a quiz with three questions about {topic}.",
    "Write an email to a friend about {topic}.",
    "What is the biggest misconception people have about {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "Compare {topic} and {topic2}.",
    "How are {topic} and {topic2} related?",
    "Write a dialogue between two people discussing {topic}.",
    "Plan a one-week study schedule for learning about {topic}.",
]

FOLLOWUPS = [
    "Can you explain that in simpler terms?", "Please summarize your answer in three bullet points.",
    "Can you give me another example?", "Rewrite your answer in a more formal tone.",
    "What is the most important point in your answer?", "Can you make it shorter?", "Why is that?",
    "Can you add more details?", "Now explain it to a five-year-old.", "Are there any exceptions?",
    "What would you recommend doing next?", "Can you turn that into a short list?",
]

CODE_TASKS = [
    ("reverse_words", "s: str", "str", "Return the words of s in reverse order."),
    ("is_palindrome", "s: str", "bool", "Check whether s reads the same forwards and backwards, ignoring case."),
    ("fizzbuzz", "n: int", "List[str]", "Return the FizzBuzz sequence from 1 to n as strings."),
    ("count_vowels", "s: str", "int", "Count the vowels in the string s."),
    ("fibonacci", "n: int", "int", "Return the n-th Fibonacci number."),
    ("factorial", "n: int", "int", "Return n factorial."),
    ("is_prime", "n: int", "bool", "Return True if n is a prime number."),
    ("flatten", "nested: List[list]", "list", "Flatten a list of lists into a single list."),
    ("merge_sorted", "a: List[int], b: List[int]", "List[int]", "Merge two sorted lists into one sorted list."),
    ("word_count", "text: str", "Dict[str, int]", "Return a dictionary mapping each word to how often it occurs."),
    ("max_subarray", "nums: List[int]", "int", "Return the largest sum of a contiguous subarray of nums."),
    ("binary_search", "items: List[int], target: int", "int",
     "Return the index of target in the sorted list items, or -1 if it is absent."),
    ("remove_duplicates", "items: list", "list", "Remove duplicates from items while keeping the original order."),
    ("gcd", "a: int, b: int", "int", "Return the greatest common divisor of a and b."),
    ("to_binary", "n: int", "str", "Return the binary representation of the non-negative integer n."),
    ("are_anagrams", "a: str, b: str", "bool", "Return True if a and b are anagrams of each other."),
    ("transpose", "matrix: List[List[int]]", "List[List[int]]", "Return the transpose of a matrix."),
    ("celsius_to_fahrenheit", "c: float", "float", "Convert a temperature from Celsius to Fahrenheit."),
    ("second_largest", "nums: List[int]", "int", "Return the second largest distinct value in nums."),
    ("capitalize_words", "s: str", "str", "Capitalize the first letter of every word in s."),
    ("sum_of_digits", "n: int", "int", "Return the sum of the decimal digits of n."),
    ("rotate_list", "items: list, k: int", "list", "Rotate items to the right by k positions."),
    ("running_average", "nums: List[float]", "List[float]", "Return the running average of nums."),
    ("valid_parentheses", "s: str", "bool", "Return True if the brackets in s are balanced."),
    ("chunk", "items: list, size: int", "List[list]", "Split items into consecutive chunks of length size."),
    ("most_common_char", "s: str", "str", "Return the character that occurs most often in s."),
    ("roman_to_int", "s: str", "int", "Convert a Roman numeral to an integer."),
    ("filter_even", "nums: List[int]", "List[int]", "Return only the even numbers of nums."),
    ("longest_word", "sentence: str", "str", "Return the longest word in sentence."),
    ("matrix_multiply", "a: List[List[int]], b: List[List[int]]", "List[List[int]]", "Multiply two matrices."),
    ("count_words_longer_than", "text: str, n: int", "int", "Count the words in text longer than n characters."),
    ("pairs_with_sum", "nums: List[int], target: int", "List[Tuple[int, int]]",
     "Return all pairs of numbers in nums that add up to target."),
]
CODE_STYLES = [
    "complete",
    "Write a Python function `{name}({args})` that does the following: {doc}",
    "How do I write a Python function that does this: {doc} Show the code and explain it.",
    "Write a JavaScript function named {name} for this task: {doc}",
]

NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Imma", "Jamal", "Kate", "Luis",
         "Maya", "Noah", "Olga", "Priya"]
ITEMS = ["apples", "stickers", "marbles", "books", "pencils", "cookies", "cards", "shells", "stamps", "candies"]
MATH_TEMPLATES = [
    "{n1} has {a} {item}. {n1} buys {b} more and then gives {c} to {n2}. How many {item} does {n1} have now?",
    "A shop sells {item} for ${p} each. {n1} buys {a} of them and pays with a ${bill} bill. "
    "How much change does {n1} get?",
    "{n1} reads {a} pages every day. How many days will it take to finish a book with {big} pages?",
    "A train travels at {s} miles per hour for {h} hours, then at {s2} miles per hour for {h2} hours. "
    "How far does it travel in total?",
    "{n1} earns ${w} per hour and works {h} hours a week. How much does {n1} earn in {k} weeks?",
    "There are {big} students in a school. {pct}% of them walk to school. How many students do not walk?",
    "{n1} bakes {big} cookies and packs them into boxes of {b}. How many full boxes are there, and how many "
    "cookies are left over?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
    "{n1} is {a} years old. {n2} is {b} years older than {n1}. How old will {n2} be in {c} years?",
    "{n1} saves ${w} every week. How many weeks does {n1} need to save ${big}?",
]


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


# ---------------------------------------------------------------------------------------------------
# Prompt sources and exclusion
# ---------------------------------------------------------------------------------------------------

def _turns_of(obj, max_turns: int) -> list[str] | None:
    """User turns of one record: FastChat ``turns``, ShareGPT ``conversations``/``messages`` or a plain field."""
    if isinstance(obj, str):
        return [obj] if obj.strip() else None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("turns"), list):
        turns = [t for t in obj["turns"] if isinstance(t, str)]
    else:
        conv = obj.get("conversations") or obj.get("messages") or obj.get("items")
        if isinstance(conv, list):
            turns = []
            for m in conv:
                if not isinstance(m, dict):
                    continue
                role = str(m.get("from", m.get("role", ""))).lower()
                text = m.get("value", m.get("content"))
                if role in ("human", "user") and isinstance(text, str):
                    turns.append(text)
        else:
            turns = []
            for key in ("prompt", "instruction", "question", "text"):
                if isinstance(obj.get(key), str):
                    text = obj[key]
                    if key == "instruction" and isinstance(obj.get("input"), str) and obj["input"].strip():
                        text = text + "\n\n" + obj["input"]
                    turns = [text]
                    break
    turns = [t for t in turns if t.strip()][:max_turns]
    return turns or None


def load_prompt_file(path: str | Path, max_turns: int = 2) -> list[list[str]]:
    """User turns of every conversation in a FastChat/ShareGPT JSON(L) file or a plain text file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    items: list = []
    if path.suffix == ".json" or stripped.startswith("["):
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    elif path.suffix == ".jsonl" or stripped.startswith("{"):
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        items = [line for line in text.splitlines() if line.strip()]
    out = []
    for it in items:
        turns = _turns_of(it, max_turns)
        if turns:
            out.append(turns)
    return out


def load_excluded(specs: list[str]) -> set[str]:
    """Normalized user turns of ``FILE:BEGIN:END`` FastChat record ranges (e.g. an evaluation split)."""
    out: set[str] = set()
    for spec in specs or []:
        parts = spec.rsplit(":", 2)
        if len(parts) != 3:
            raise ValueError(f"--exclude expects FILE:BEGIN:END, got {spec!r}")
        path, b, e = parts
        lines = [l for l in Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]
        for line in lines[int(b) if b else None:int(e) if e else None]:
            turns = _turns_of(json.loads(line), 1000) or []
            out.update(_norm(t) for t in turns)
    return out


def is_excluded(turns: list[str], excluded: set[str]) -> bool:
    """True when a turn equals an excluded turn (or, for long texts, one contains the other)."""
    if not excluded:
        return False
    for t in turns:
        n = _norm(t)
        if n in excluded:
            return True
        if len(n) >= 40 and any(len(x) >= 40 and (n in x or x in n) for x in excluded):
            return True
    return False


# ---------------------------------------------------------------------------------------------------
# Generation with the target
# ---------------------------------------------------------------------------------------------------

def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(target_dir: str | Path, device, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(target_dir: str | Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(target_dir))


def _pad_id(tok, stop_ids) -> int:
    pid = getattr(tok, "pad_token_id", None)
    return int(pid) if pid is not None else int(min(stop_ids))


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_ids, pad_id: int,
                   temperature: float = 0.0, top_p: float = 1.0) -> list[list[int]]:
    """Left-padded batched generation; each result is cut after its first stop token (kept)."""
    from transformers import GenerationConfig
    dev = next(model.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    stops = sorted(int(s) for s in stop_ids)
    sample = temperature > 0
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=stops,
                           pad_token_id=pad_id, temperature=temperature if sample else 1.0,
                           top_p=top_p if sample else 1.0, top_k=0 if sample else 50, num_beams=1)
    out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), generation_config=cfg)
    res = []
    stop_set = set(stops)
    for row in out[:, width:].tolist():
        cut = []
        for t in row:
            cut.append(t)
            if t in stop_set:
                break
        res.append(cut)
    return res


def _generate_all(model, prompts: list[list[int]], flags: list[bool], args_gen: dict, batch_size: int,
                  stop_ids, pad_id: int, desc: str, progress: bool) -> list[list[int]]:
    """Generate for every prompt; ``flags[i]`` picks sampling (True) or greedy; batches grouped by length."""
    from tqdm import tqdm
    out: list[list[int] | None] = [None] * len(prompts)
    groups = {}
    for i, f in enumerate(flags):
        groups.setdefault(bool(f), []).append(i)
    jobs = []
    for f, idx in groups.items():
        idx.sort(key=lambda i: len(prompts[i]))
        jobs += [(f, idx[s:s + batch_size]) for s in range(0, len(idx), batch_size)]
    for f, chunk in tqdm(jobs, desc=desc, disable=not progress, leave=False):
        temp = args_gen["temperature"] if f else 0.0
        res = generate_batch(model, [prompts[i] for i in chunk], args_gen["max_new_tokens"], stop_ids, pad_id,
                             temperature=temp, top_p=args_gen.get("top_p", 1.0))
        for i, r in zip(chunk, res):
            out[i] = r
    return out  # type: ignore[return-value]


def _finish_meta_prompt(kind: str, reply: str, rng: random.Random) -> str | None:
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


def _code_prompt(rng: random.Random) -> str:
    name, args, ret, doc = rng.choice(CODE_TASKS)
    style = rng.choice(CODE_STYLES)
    if style == "complete":
        imports = "from typing import Dict, List, Tuple\n\n\n"
        return f'Complete the code I provided.{imports}def {name}({args}) -> {ret}:\n    """ {doc}\n    """\n'
    return style.format(name=name, args=args, doc=doc)


def _math_prompt(rng: random.Random) -> str:
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
        key = _norm(text)
        if key in seen:
            return False
        seen.add(key)
        out.append({"turns": [text], "source": source})
        return True

    # target-written prompts: a few rounds in case replies are unusable
    stops = stop_token_ids(tok, getattr(model, "generation_config", None) and model.generation_config.to_dict())
    pad = _pad_id(tok, stops)
    want, tries = n_meta, 0
    while want > 0 and tries < 4:
        tries += 1
        jobs = []
        for _ in range(int(want * 1.3) + 4):
            kind, instr = rng.choice(META_STYLES)
            jobs.append((kind, instr.format(topic=rng.choice(TOPICS))))
        prompts = [chat_prompt_ids(tok, [instr], [], system, template) for _, instr in jobs]
        replies = _generate_all(model, prompts, [True] * len(prompts),
                                dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p),
                                batch_size, stops, pad, f"self-prompts (round {tries})", progress)
        for (kind, _), r in zip(jobs, replies):
            if want <= 0:
                break
            text = _finish_meta_prompt(kind, tok.decode([t for t in r if t not in stops], skip_special_tokens=True),
                                       rng)
            if text and add(text, f"self:{kind}"):
                want -= 1
    n_tmpl += max(0, want)  # top up with templated prompts if the target's replies ran short
    for _ in range(n_math * 5):
        if n_math <= 0:
            break
        n_math -= add(_math_prompt(rng), "tmpl:math")
    for _ in range(n_code * 5):
        if n_code <= 0:
            break
        n_code -= add(_code_prompt(rng), "tmpl:code")
    for _ in range(n_tmpl * 5):
        if n_tmpl <= 0:
            break
        t1, t2 = rng.sample(TOPICS, 2)
        n_tmpl -= add(rng.choice(TEMPLATE_STYLES).format(topic=t1, topic2=t2), "tmpl:topic")
    rng.shuffle(out)
    return out


def _assemble(prompt_ids: list[list[int]], answers: list[list[int]], stop_ids) -> tuple[list[int], list[int]]:
    """Final token ids of a conversation and its loss mask (1 on the assistant's tokens)."""
    ids = list(prompt_ids[-1]) + list(answers[-1])
    mask = [0] * len(prompt_ids[-1]) + [1] * len(answers[-1])
    for p in prompt_ids[:-1]:  # earlier answers, as re-tokenized inside the later prompts
        if ids[:len(p)] != list(p):
            continue
        j = len(p)
        while j < len(prompt_ids[-1]):
            mask[j] = 1
            if ids[j] in stop_ids:
                break
            j += 1
    return ids, mask


def build_conversations(model, tok, convs: list[dict], *, max_new_tokens: int = 256, batch_size: int = 64,
                        temperature: float = 0.0, top_p: float = 1.0, sample_frac: float = 0.0,
                        system: str = "", template: str = "auto", max_prompt_tokens: int = 1024,
                        seed: int = 0, progress: bool = True) -> list[dict]:
    """Let the target answer every conversation turn by turn (self-distillation).

    ``convs``: dicts with ``turns`` (user messages) and optional ``pid``/``source``. Returns records with
    ``input_ids`` (prompt template + answers), ``loss_mask`` (1 on assistant tokens), ``answers`` (text).
    A fraction ``sample_frac`` of conversations is answered by sampling at ``temperature``, the rest greedily.
    """
    rng = random.Random(seed)
    gen_cfg = getattr(model, "generation_config", None)
    stops = stop_token_ids(tok, gen_cfg.to_dict() if gen_cfg is not None else None)
    pad = _pad_id(tok, stops)
    state = []
    for c in convs:
        state.append({"conv": c, "sampled": temperature > 0 and rng.random() < sample_frac,
                      "prompts": [], "answers": [], "texts": [], "alive": True})
    max_turns = max((len(c["turns"]) for c in convs), default=0)
    for k in range(max_turns):
        todo = []
        for s in state:
            if not s["alive"] or len(s["conv"]["turns"]) <= k:
                continue
            p = chat_prompt_ids(tok, s["conv"]["turns"][:k + 1], s["texts"], system, template)
            if len(p) > max_prompt_tokens:
                s["alive"] = False  # keep the turns already answered
                s["conv"] = dict(s["conv"], turns=s["conv"]["turns"][:k])
                continue
            s["prompts"].append(p)
            todo.append(s)
        if not todo:
            break
        gens = _generate_all(model, [s["prompts"][-1] for s in todo], [s["sampled"] for s in todo],
                             dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p),
                             batch_size, stops, pad, f"answers (turn {k + 1})", progress)
        for s, g in zip(todo, gens):
            s["answers"].append(g)
            s["texts"].append(tok.decode([t for t in g if t not in stops], skip_special_tokens=True).strip())
    records = []
    for s in state:
        if not s["answers"]:
            continue
        ids, mask = _assemble(s["prompts"], s["answers"], stops)
        c = s["conv"]
        records.append({"pid": c.get("pid"), "source": c.get("source", ""), "turns": c["turns"][:len(s["answers"])],
                        "answers": s["texts"], "sampled": s["sampled"], "input_ids": ids, "loss_mask": mask})
    return records


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]


def _default_target() -> Path:
    from model.default_model import ensure_default_checkpoint
    return ensure_default_checkpoint()


def cmd_data(args) -> int:
    """Build (or resume building) a self-distilled conversation dataset."""
    t0 = time.time()
    dev = _device(args.device)
    target = Path(args.target) if args.target else _default_target()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts_file = out.with_name(out.name + ".prompts.jsonl")
    tok = load_tokenizer(target)
    model = None
    if args.resume and prompts_file.is_file():
        convs = read_jsonl(prompts_file)
        print(f"[data] resuming with {len(convs)} prompts from {prompts_file}", file=sys.stderr)
    else:
        excluded = load_excluded(args.exclude)
        convs = []
        for f in args.prompts or []:
            for turns in load_prompt_file(f, args.max_turns):
                convs.append({"turns": turns, "source": Path(f).name})
        if args.self_prompts:
            model = load_target(target, dev, getattr(torch, args.dtype))
            convs += self_prompts(model, tok, args.self_prompts, seed=args.seed, batch_size=args.batch_size,
                                  max_new_tokens=args.prompt_max_new_tokens, system=args.system,
                                  template=args.template, progress=not args.no_progress)
        if args.broad:
            from draft.broad_prompts import broad_prompts
            model = model or load_target(target, dev, getattr(torch, args.dtype))
            convs += broad_prompts(model, tok, args.broad, TOPICS, seed=args.seed, batch_size=args.batch_size,
                                   max_new_tokens=args.prompt_max_new_tokens, system=args.system,
                                   template=args.template, progress=not args.no_progress)
        n0 = len(convs)
        convs = [c for c in convs if not is_excluded(c["turns"], excluded)]
        if n0 != len(convs):
            print(f"[data] --exclude dropped {n0 - len(convs)} prompts", file=sys.stderr)
        rng = random.Random(args.seed)
        for c in convs:
            if len(c["turns"]) == 1 and args.followup_frac > 0 and rng.random() < args.followup_frac:
                c["turns"] = c["turns"] + [rng.choice(FOLLOWUPS)]
        for i, c in enumerate(convs):
            c["pid"] = i
        with open(prompts_file, "w", encoding="utf-8") as fh:
            for c in convs:
                fh.write(json.dumps(c, ensure_ascii=False) + "\n")
        if out.exists():
            out.unlink()
    if not convs:
        print("error: no prompts (give --prompts FILE, --self-prompts N and/or --broad N)", file=sys.stderr)
        return 2
    done = {r["pid"] for r in read_jsonl(out)} if out.is_file() else set()
    todo = [c for c in convs if c["pid"] not in done]
    if model is None and todo:
        model = load_target(target, dev, getattr(torch, args.dtype))
    from tqdm import tqdm
    chunk = max(1, args.batch_size * args.chunk_batches)
    bar = tqdm(total=len(convs), initial=len(done), desc="conversations", disable=args.no_progress)
    n_written = 0
    for s in range(0, len(todo), chunk):
        if args.time_budget and time.time() - t0 > args.time_budget:
            print(f"[data] time budget reached; {len(done) + n_written}/{len(convs)} conversations written "
                  f"(rerun with --resume to continue)", file=sys.stderr)
            break
        part = todo[s:s + chunk]
        recs = build_conversations(model, tok, part, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   temperature=args.temperature, top_p=args.top_p, sample_frac=args.sample_frac,
                                   system=args.system, template=args.template,
                                   max_prompt_tokens=args.max_prompt_tokens, seed=args.seed + s,
                                   progress=not args.no_progress)
        with open(out, "a", encoding="utf-8") as fh:
            for r in recs:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        n_written += len(recs)
        bar.update(len(part))
    bar.close()
    recs = read_jsonl(out) if out.is_file() else []
    ntok = sum(len(r["input_ids"]) for r in recs)
    nans = sum(sum(r["loss_mask"]) for r in recs)
    info = {"conversations": len(recs), "tokens": ntok, "assistant_tokens": nans, "target": str(target),
            "seconds": round(time.time() - t0, 1)}
    print(json.dumps(info), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def target_features(model, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The target's final normalized hidden states ``[B, L, H]`` (what its ``lm_head`` consumes)."""
    return model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _pad_batch(seqs: list[list[int]], pad: int = 0) -> Tensor:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def cmd_features(args) -> int:
    """Precompute features of every record into safetensors shards (resumable shard by shard)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    dev = _device(args.device)
    target = Path(args.target) if args.target else _default_target()
    recs = read_jsonl(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_target(target, dev, getattr(torch, args.dtype))
    sdtype = getattr(torch, args.store_dtype)
    shards = []
    idx = list(range(len(recs)))
    per = args.shard_size
    for si, s in enumerate(tqdm(range(0, len(idx), per), desc="feature shards", disable=args.no_progress)):
        name = f"features-{si:05d}.safetensors"
        part = idx[s:s + per]
        shards.append({"file": name, "records": part})
        if (out / name).is_file() and args.resume:
            continue
        feats, offsets = [], [0]
        for b in range(0, len(part), args.batch_size):
            sub = part[b:b + args.batch_size]
            seqs = [recs[i]["input_ids"][:args.max_len] for i in sub]
            ids = _pad_batch(seqs).to(dev)
            h = target_features(model, ids)
            for j, sq in enumerate(seqs):
                feats.append(h[j, :len(sq)].to(sdtype).cpu())
                offsets.append(offsets[-1] + len(sq))
        save_file({"features": torch.cat(feats), "offsets": torch.tensor(offsets, dtype=torch.long),
                   "records": torch.tensor(part, dtype=torch.long)}, str(out / (name + ".tmp")))
        os.replace(out / (name + ".tmp"), out / name)
    (out / "index.json").write_text(json.dumps({"data": str(Path(args.data).resolve()), "target": str(target),
                                                 "max_len": args.max_len, "dtype": args.store_dtype,
                                                 "shards": shards}, indent=1))
    print(f"[features] {len(recs)} records -> {out}", file=sys.stderr)
    return 0


class FeatureStore:
    """Random access to the features of record ``i`` from :func:`cmd_features` shards."""

    def __init__(self, root: str | Path) -> None:
        from safetensors import safe_open
        root = Path(root)
        self.index = json.loads((root / "index.json").read_text())
        self.where: dict[int, tuple[int, int, int]] = {}
        self.files = []
        for si, sh in enumerate(self.index["shards"]):
            f = safe_open(str(root / sh["file"]), framework="pt")
            self.files.append(f)
            offs = f.get_tensor("offsets").tolist()
            for j, r in enumerate(f.get_tensor("records").tolist()):
                self.where[r] = (si, offs[j], offs[j + 1])

    def get(self, i: int) -> Tensor:
        si, a, b = self.where[i]
        return self.files[si].get_slice("features")[a:b]


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------

def head_forward(head: EagleHead, tokens: Tensor, features: Tensor, position_ids: Tensor | None = None,
                 attn_mask: Tensor | None = None) -> Tensor:
    """Cache-free forward of the head over entries ``(tokens[b, i], features[b, i])``.

    Defaults: entry ``i`` at position ``i`` with causal attention (as in :meth:`Drafter.commit`).
    ``attn_mask`` (bool ``[B, 1, N, N]``, True = may attend) and ``position_ids`` ``[B, N]`` allow other
    shapes, e.g. flattened draft trees.
    """
    b, n = tokens.shape
    x = head.fc(torch.cat([head.embed_tokens(tokens).to(features.dtype), features], dim=-1))
    if position_ids is None:
        position_ids = torch.arange(n, device=tokens.device).unsqueeze(0).expand(b, n)
    pos_emb = head.block.rotary_emb(x, position_ids)
    for layer in head.block.layers:
        out = layer(x, attention_mask=attn_mask, position_ids=position_ids, past_key_values=None, use_cache=False,
                    position_embeddings=pos_emb)
        x = out[0] if isinstance(out, tuple) else out
    return x


def sequence_batch(input_ids: Tensor, features: Tensor, loss_mask: Tensor) -> dict:
    """Teacher-forcing entries of whole sequences ``[B, L]``: entry ``t`` = ``(token[t+1], f_t)`` predicts
    ``f_{t+1}`` (``target_features``) and the target's distribution at ``t+1``; weighted by ``loss_mask[t+1]``."""
    return {"tokens": input_ids[:, 1:], "features": features[:, :-1], "target_features": features[:, 1:],
            "loss_mask": loss_mask[:, 1:], "next_tokens": F.pad(input_ids[:, 2:], (0, 1), value=-100)}


def eagle_loss(head: EagleHead, lm_head: nn.Module, batch: dict, p_weight: float = 0.1, v_weight: float = 1.0,
               noise_std: float = 0.0, generator: torch.Generator | None = None) -> dict:
    """EAGLE objective on one batch of entries (see :func:`train_step` for the batch keys).

    ``v_weight * SmoothL1(pred, target_features) + p_weight * CE(lm_head(pred), teacher)``, averaged over
    the weighted entries; the teacher is ``softmax(target_logits)``, else ``softmax(lm_head(target_features))``,
    else the hard ``labels``. Uniform noise ``U(-noise_std/2, noise_std/2)`` is added to the input features.
    """
    feats = batch["features"]
    if noise_std > 0:
        u = torch.rand(feats.shape, generator=generator, device=feats.device, dtype=torch.float32)
        feats = feats + ((u - 0.5) * noise_std).to(feats.dtype)
    pred = head_forward(head, batch["tokens"], feats, batch.get("position_ids"), batch.get("attn_mask"))
    w = batch["loss_mask"].to(pred.device).float()
    sel = w > 0
    ws = w[sel]
    denom = ws.sum().clamp_min(1e-6)
    p = pred[sel]
    zero = pred.sum() * 0.0
    tf = batch.get("target_features")
    if tf is not None and v_weight:
        vl = F.smooth_l1_loss(p.float(), tf[sel].float(), reduction="none").mean(-1)
        vloss = (vl * ws).sum() / denom
    else:
        vloss = zero
    logits = lm_head(p.to(lm_head.weight.dtype) if not torch.is_autocast_enabled() else p).float()
    logp = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        if batch.get("target_logits") is not None:
            tl = batch["target_logits"][sel].float()
        elif tf is not None:
            tl = lm_head(tf[sel].to(lm_head.weight.dtype) if not torch.is_autocast_enabled() else tf[sel]).float()
        else:
            tl = None
    if tl is not None:
        ploss_each = -(torch.softmax(tl, dim=-1) * logp).sum(-1)
        teacher = tl.argmax(-1)
    else:
        labels = batch["labels"][sel]
        ploss_each = F.cross_entropy(logits, labels.clamp_min(0), reduction="none")
        teacher = labels
    ploss = (ploss_each * ws).sum() / denom
    loss = v_weight * vloss + p_weight * ploss
    with torch.no_grad():
        valid = (teacher >= 0).float() * ws
        top1 = ((logits.argmax(-1) == teacher).float() * valid).sum() / valid.sum().clamp_min(1e-6)
    return {"loss": loss, "vloss": vloss.detach(), "ploss": ploss.detach(), "top1": top1, "n": float(ws.sum())}


def train_step(head: EagleHead, batch: dict, optimizer: torch.optim.Optimizer, lm_head: nn.Module, *,
               p_weight: float = 0.1, v_weight: float = 1.0, noise_std: float = 0.2, grad_clip: float = 0.5,
               scheduler=None, amp_dtype: torch.dtype | None = None,
               generator: torch.Generator | None = None) -> dict:
    """One optimizer update of the head on one batch; returns float metrics.

    ``batch`` holds *entries* (the rows the head consumes), all on the head's device:

    - ``tokens`` ``[B, N]`` long: the token of each entry (``token[t+1]`` for a context entry ``t``);
    - ``features`` ``[B, N, H]``: the target feature paired with it (``f_t``: the token's predecessor);
    - ``loss_mask`` ``[B, N]``: entry weights (0 = padding / not trained);
    - teacher, at least one of: ``target_features`` ``[B, N, H]`` (the target's ``f_{t+1}``; gives the
      feature-regression term and, through the frozen ``lm_head``, the soft token targets),
      ``target_logits`` ``[B, N, V]`` (soft targets given directly), ``labels`` ``[B, N]`` (hard tokens);
    - optional ``position_ids`` ``[B, N]`` and ``attn_mask`` bool ``[B, 1, N, N]`` (default: positions
      ``0..N-1``, causal).

    :func:`sequence_batch` makes these from whole conversations (teacher forcing). Online-distillation
    hook (e.g. Online Speculative Decoding): rank 0 can feed verified draft trees straight into this step,
    each tree as one row: ``tokens`` = the tree's tokens, ``features`` = the target feature of each
    node's parent, ``position_ids`` = context length + depth, ``attn_mask`` = ancestor matrix (plus the
    committed context), and ``target_logits`` = the verifier's logits for each node, which rank 0
    already holds, with ``loss_mask`` marking the nodes to learn from.
    """
    head.train()
    dev = batch["tokens"].device
    ctx = torch.autocast(device_type=dev.type, dtype=amp_dtype) if amp_dtype is not None else _nullctx()
    with ctx:
        out = eagle_loss(head, lm_head, batch, p_weight, v_weight, noise_std, generator)
    optimizer.zero_grad(set_to_none=True)
    out["loss"].backward()
    params = [p for p in head.parameters() if p.requires_grad]
    gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip and grad_clip > 0 else torch.zeros(())
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return {"loss": float(out["loss"].detach()), "vloss": float(out["vloss"]), "ploss": float(out["ploss"]),
            "top1": float(out["top1"]), "grad_norm": float(gnorm), "n": out["n"]}


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def step2_batch(tokens: Tensor, pred: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Inputs that check the head's second drafting step under teacher forcing.

    Rows ``[context entries e_0..e_{N-1}; draft entries d_0..d_{N-1}]`` where ``d_t`` pairs ``token[t+1]``
    with the head's *own* prediction ``pred[t-1]`` of ``f_t`` and sees ``e_0..e_{t-1}`` and itself (as a
    tree node does at inference). Returns ``(tokens2, positions, attn_mask, d_features)``.
    """
    b, n = tokens.shape
    dev = tokens.device
    i = torch.arange(n, device=dev)
    causal = i[:, None] >= i[None, :]
    strict = i[:, None] > i[None, :]
    top = torch.cat([causal, torch.zeros(n, n, dtype=torch.bool, device=dev)], 1)
    bottom = torch.cat([strict, torch.eye(n, dtype=torch.bool, device=dev)], 1)
    mask = torch.cat([top, bottom], 0)[None, None].expand(b, 1, 2 * n, 2 * n)
    pos = torch.cat([i, i])[None].expand(b, 2 * n)
    dfeat = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], 1)
    return torch.cat([tokens, tokens], 1), pos, mask, dfeat


@torch.no_grad()
def evaluate(head: EagleHead, lm_head: nn.Module, batches, amp_dtype=None, step2: bool = True) -> dict:
    """Held-out agreement of ``argmax lm_head(pred)`` with the target's next token (teacher forcing).

    ``top1``/``top5``: the target's greedy next token is the head's top-1 / in its top-5; ``top1_data``:
    against the token actually in the conversation; ``top1_step2``: the second draft step, fed with
    the head's own predicted feature (see :func:`step2_batch`).
    """
    head.eval()
    tot = {"n": 0.0, "top1": 0.0, "top5": 0.0, "top1_data": 0.0, "n_data": 0.0, "top1_step2": 0.0, "n2": 0.0,
           "vloss": 0.0, "ploss": 0.0}
    for batch in batches:
        dev = batch["tokens"].device
        ctx = torch.autocast(device_type=dev.type, dtype=amp_dtype) if amp_dtype is not None else _nullctx()
        with ctx:
            pred = head_forward(head, batch["tokens"], batch["features"])
            w = batch["loss_mask"] > 0
            p, tf = pred[w], batch["target_features"][w]
            logits = lm_head(p).float()
            tl = lm_head(tf).float()
            teacher = tl.argmax(-1)
            top5 = logits.topk(5, dim=-1).indices
            tot["top1"] += float((top5[:, 0] == teacher).sum())
            tot["top5"] += float((top5 == teacher[:, None]).any(-1).sum())
            tot["n"] += float(w.sum())
            nxt = batch["next_tokens"][w]
            ok = nxt >= 0
            tot["top1_data"] += float(((top5[:, 0] == nxt) & ok).sum())
            tot["n_data"] += float(ok.sum())
            tot["vloss"] += float(F.smooth_l1_loss(p.float(), tf.float(), reduction="none").mean(-1).sum())
            tot["ploss"] += float(-(torch.softmax(tl, -1) * torch.log_softmax(logits, -1)).sum(-1).sum())
            if step2:
                n = batch["tokens"].shape[1]
                toks2, pos2, mask2, dfeat = step2_batch(batch["tokens"], pred.to(batch["features"].dtype))
                feats2 = torch.cat([batch["features"], dfeat], 1)
                pred2 = head_forward(head, toks2, feats2, pos2, mask2)[:, n:]
                w2 = w.clone()
                w2[:, 0] = False
                l2 = lm_head(pred2[w2]).float()
                t2 = lm_head(batch["target_features"][w2]).float().argmax(-1)
                tot["top1_step2"] += float((l2.argmax(-1) == t2).sum())
                tot["n2"] += float(w2.sum())
    n = max(tot["n"], 1e-6)
    return {"top1": tot["top1"] / n, "top5": tot["top5"] / n, "top1_data": tot["top1_data"] / max(tot["n_data"], 1),
            "top1_step2": tot["top1_step2"] / max(tot["n2"], 1) if step2 else None,
            "vloss": tot["vloss"] / n, "ploss": tot["ploss"] / n, "tokens": int(tot["n"])}


def read_target_embeddings(target_dir: str | Path) -> tuple[Tensor, Tensor]:
    """``(embed_tokens.weight, lm_head.weight)`` read straight from the target's safetensors files."""
    from safetensors import safe_open
    from transformers import AutoConfig
    target_dir = Path(target_dir)
    cfg = AutoConfig.from_pretrained(str(target_dir))
    idx = target_dir / "model.safetensors.index.json"
    if idx.is_file():
        weight_map = json.loads(idx.read_text())["weight_map"]
    else:
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}

    def get(name):
        with safe_open(str(target_dir / weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    emb = get("model.embed_tokens.weight")
    lm = emb if (getattr(cfg, "tie_word_embeddings", False) or "lm_head.weight" not in weight_map) \
        else get("lm_head.weight")
    return emb, lm


class _Batches:
    """Right-padded batches of conversations, with features from a target run on the fly or from shards.

    ``cache`` (``"cpu"`` or ``"device"``) keeps each conversation's features (fp16) after their first use,
    so later epochs skip the target forward.
    """

    def __init__(self, records: list[dict], max_len: int, device, target=None, store: FeatureStore | None = None,
                 record_ids: list[int] | None = None, feat_dtype=torch.float32, cache: str = "none") -> None:
        self.records, self.max_len, self.device = records, max_len, device
        self.target, self.store, self.feat_dtype = target, store, feat_dtype
        self.record_ids = record_ids if record_ids is not None else list(range(len(records)))
        self.cache_where = None if cache == "none" else (device if cache == "device" else torch.device("cpu"))
        self.cache: dict[int, Tensor] = {}

    def make(self, idx: list[int]) -> dict:
        seqs = [self.records[i]["input_ids"][:self.max_len] for i in idx]
        masks = [self.records[i]["loss_mask"][:self.max_len] for i in idx]
        ids = _pad_batch(seqs).to(self.device)
        mask = _pad_batch(masks).to(self.device)
        if self.cache_where is not None and all(i in self.cache for i in idx):
            feats = torch.zeros(len(idx), ids.shape[1], self.cache[idx[0]].shape[-1], dtype=self.feat_dtype,
                                device=self.device)
            for j, i in enumerate(idx):
                f = self.cache[i]
                feats[j, :f.shape[0]] = f.to(self.device, self.feat_dtype)
        elif self.store is not None:
            feats = torch.zeros(len(idx), ids.shape[1], self.store_hidden(idx[0]), dtype=self.feat_dtype)
            for j, i in enumerate(idx):
                f = self.store.get(self.record_ids[i])[:self.max_len]
                feats[j, :f.shape[0]] = f.to(self.feat_dtype)
            feats = feats.to(self.device)
        else:
            feats = target_features(self.target, ids).to(self.feat_dtype)
        if self.cache_where is not None:
            for j, i in enumerate(idx):
                if i not in self.cache:
                    self.cache[i] = feats[j, :len(seqs[j])].to(self.cache_where, torch.float16)
        return sequence_batch(ids, feats, mask)

    def store_hidden(self, i: int) -> int:
        return self.store.get(self.record_ids[i]).shape[-1]


def epoch_batches(train_idx: list[int], lengths: list[int], batch_size: int, seed: int, epoch: int,
                  bucket: int = 64) -> list[list[int]]:
    """The batches of one epoch (deterministic in ``seed, epoch``, so a resumed run sees the same order).

    With ``bucket > 1`` conversations of similar length share batches: a shuffled window of
    ``bucket * batch_size`` conversations is sorted by length, cut into batches, and all batches are
    shuffled again. Incomplete trailing batches are dropped.
    """
    rng = random.Random(seed * 1000 + epoch)
    perm = list(train_idx)
    rng.shuffle(perm)
    n = len(perm) // batch_size * batch_size
    if bucket <= 1:
        return [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    out = []
    win = bucket * batch_size
    for w in range(0, n, win):
        part = sorted(perm[w:min(w + win, n)], key=lambda i: lengths[i])
        out += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    rng.shuffle(out)
    return out


def _save_plot(metrics_path: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_jsonl(metrics_path) if metrics_path.is_file() else []
    tr = [r for r in rows if r.get("kind") == "train"]
    va = [r for r in rows if r.get("kind") == "val"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if tr:
        s = [r["step"] for r in tr]
        for key in ("loss", "vloss", "ploss"):
            axes[0].plot(s, [r[key] for r in tr], label=f"train {key}", lw=1)
    if va:
        s = [r["step"] for r in va]
        axes[0].plot(s, [r["vloss"] for r in va], "o--", label="val vloss", ms=3)
        axes[0].plot(s, [r["ploss"] for r in va], "o--", label="val ploss", ms=3)
        for key in ("top1", "top5", "top1_step2"):
            if va[0].get(key) is not None:
                axes[1].plot(s, [r[key] for r in va], "o-", label=f"val {key}", ms=3)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_title("losses")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("step")
    axes[1].set_title("held-out agreement with the target")
    axes[1].set_ylim(0, 1)
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def cmd_train(args) -> int:
    if getattr(args, "arch", "eagle") == "eagle3":
        from draft.train_eagle3 import train_eagle3
        return train_eagle3(args)
    from tqdm import tqdm
    from transformers import AutoConfig
    t_start = time.time()
    torch.manual_seed(args.seed)
    dev = _device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    target_dir = Path(args.target) if args.target else _default_target()
    tcfg = AutoConfig.from_pretrained(str(target_dir))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else out / "train_state"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    records = [r for path in args.data for r in read_jsonl(path)]
    records = [r for r in records if sum(r["loss_mask"][1:args.max_len]) > 0 and len(r["input_ids"]) >= 3]
    if len(records) < 2:
        print("error: the dataset needs at least 2 usable conversations", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    order = list(range(len(records)))
    rng.shuffle(order)
    n_val = args.val_count if args.val_count is not None else max(1, int(round(len(records) * args.val_frac)))
    n_val = min(n_val, len(records) - 1)
    val_idx, train_idx = sorted(order[:n_val]), order[n_val:]

    emb_w, lm_w = read_target_embeddings(target_dir)
    lm_head = nn.Linear(lm_w.shape[1], lm_w.shape[0], bias=False)
    lm_head.weight.data.copy_(lm_w.float())
    lm_head.requires_grad_(False)
    lm_head.to(dev)
    if args.init_from:
        head = load_eagle_head(args.init_from, tcfg, target_embed=emb_w.float())
    else:
        head = init_untrained_head(tcfg, seed=args.seed, bias=not args.no_bias)
    head.embed_tokens.weight.data.copy_(emb_w.float())
    head.embed_tokens.weight.requires_grad_(False)
    head.float().to(dev)

    if args.features and len(args.data) != 1:
        raise ValueError("--features goes with exactly one --data file (the one the shards were made from)")
    store = FeatureStore(args.features) if args.features else None
    target = None if store else load_target(target_dir, dev, getattr(torch, args.target_dtype))
    feat_dtype = torch.float32
    data = _Batches(records, args.max_len, dev, target, store, feat_dtype=feat_dtype, cache=args.cache_features)
    lengths = [min(len(r["input_ids"]), args.max_len) for r in records]

    bs = args.batch_size
    steps_per_epoch = max(1, len(train_idx) // bs)
    planned = args.max_steps or max(1, int(steps_per_epoch * args.epochs))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched_state = {"total": planned}
    warm = args.warmup if args.warmup is not None else max(1, int(0.03 * planned))

    def lr_lambda(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        total = max(sched_state["total"], warm + 1)
        prog = min(1.0, (step - warm) / max(1, total - warm))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    step = 0
    ckpt_path = ckpt_dir / "checkpoint.pt"
    metrics_path = out / "metrics.jsonl"
    elapsed_before = 0.0
    if args.resume and ckpt_path.is_file():
        try:  # tensors and plain containers only: a replaced file in the output folder cannot run code
            st = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        except Exception as e:
            sys.exit(f"[train] error: cannot resume from {ckpt_path}: {str(e).strip().splitlines()[0][:200]} "
                     f"(delete it to start over)")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step, sched_state["total"] = st["step"], st["total"]
        elapsed_before = st.get("elapsed", 0.0)
        print(f"[train] resumed from {ckpt_path} at step {step}/{sched_state['total']}", file=sys.stderr)
    elif metrics_path.exists():
        metrics_path.unlink()
    (out / "train_args.json").write_text(json.dumps(
        {**{k: v for k, v in vars(args).items() if k != "func"}, "target": str(target_dir),
         "train_conversations": len(train_idx), "val_conversations": len(val_idx),
         "device": str(dev), "cuda_name": torch.cuda.get_device_name(0) if dev.type == "cuda" else None},
        indent=1, default=str))

    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + step)
    val_batches_idx = [val_idx[i:i + bs] for i in range(0, len(val_idx), bs)]

    def run_val() -> dict:
        return evaluate(head, lm_head, (data.make(b) for b in val_batches_idx), amp, step2=not args.no_step2)

    def log(row: dict) -> None:
        with open(metrics_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def save_ckpt() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "step": step, "total": sched_state["total"],
                    "elapsed": elapsed_before + time.time() - t_loop}, tmp)
        os.replace(tmp, ckpt_path)

    t_loop = time.time()
    bar = tqdm(total=sched_state["total"], initial=step, desc="train", disable=args.no_progress)
    ema = None
    acc_rows = []
    # step-time measurements: early, later, once the second epoch runs (cached features), then every
    # 200 steps while less than half of the schedule has run
    calib_at = [] if (step > 0 or not args.time_budget) else sorted(
        {args.calib_steps, 5 * args.calib_steps} | ({steps_per_epoch + args.calib_steps}
                                                    if args.cache_features != "none" else set()))
    warm_steps = min(5, max(0, args.calib_steps - 1))
    step_time, window_steps, val_s = 0.0, 0, None
    epoch_cache: dict[int, list[list[int]]] = {}
    while step < sched_state["total"]:
        epoch, k = divmod(step, steps_per_epoch)
        if epoch not in epoch_cache:
            epoch_cache = {epoch: epoch_batches(train_idx, lengths, bs, args.seed, epoch, args.bucket)}
            if step > 0:  # timings of a new epoch (cached features) start a new window
                step_time, window_steps = 0.0, 0
        t_step = time.time()
        batch = data.make(epoch_cache[epoch][k])
        m = train_step(head, batch, opt, lm_head, p_weight=args.p_weight, v_weight=args.v_weight,
                       noise_std=args.noise_std, grad_clip=args.grad_clip, scheduler=sched, amp_dtype=amp,
                       generator=gen)
        step += 1
        if step > warm_steps and not (steps_per_epoch >= 10 and (step - 1) % steps_per_epoch == 0):
            step_time += time.time() - t_step
            window_steps += 1
        bar.update(1)
        acc_rows.append(m)
        ema = m["loss"] if ema is None else 0.95 * ema + 0.05 * m["loss"]
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{m['top1']:.2f}")
        while calib_at and calib_at[0] < step:  # a measurement point with too few timed steps: next step
            calib_at[0] = step
        if calib_at and step == calib_at[0] and window_steps >= 3:
            calib_at.pop(0)
            per = step_time / max(1, window_steps)
            step_time, window_steps = 0.0, 0
            if val_s is None:
                t_val = time.time()
                v = run_val()
                log({"kind": "val", "step": step, **v})
                val_s = time.time() - t_val
            # the remaining time pays for the steps, a validation every --val-every steps and the final one
            remaining = args.time_budget - (time.time() - t_start) - 2 * val_s - 5.0
            fit = step + max(0, int(remaining / (per + val_s / args.val_every)))
            sched_state["total"] = max(step, min(planned, fit))
            bar.total = sched_state["total"]
            print(f"\n[train] step {step}: {per * 1000:.0f} ms/step, validation {val_s:.1f} s: --time-budget "
                  f"allows {fit} steps (planned {planned}; running {sched_state['total']})", file=sys.stderr)
            if not calib_at and step + 200 < sched_state["total"] // 2:
                calib_at.append(step + 200)
        if args.time_budget and time.time() - t_start > args.time_budget - 2 * (val_s or 0) - 2.0:
            sched_state["total"] = step  # out of time (safety net; the measurements normally prevent this)
        if step % args.log_every == 0 or step == sched_state["total"]:
            row = {"kind": "train", "step": step, "epoch": step / steps_per_epoch, "lr": sched.get_last_lr()[0],
                   "time": round(elapsed_before + time.time() - t_loop, 1)}
            for key in ("loss", "vloss", "ploss", "top1", "grad_norm"):
                row[key] = sum(r[key] for r in acc_rows) / len(acc_rows)
            acc_rows = []
            log(row)
        if step % args.val_every == 0 or step == sched_state["total"]:
            v = run_val()
            log({"kind": "val", "step": step, **v})
            bar.write(f"[val] step {step}: top1 {v['top1']:.3f} top5 {v['top5']:.3f} "
                      f"step2 {v['top1_step2'] if v['top1_step2'] is None else round(v['top1_step2'], 3)} "
                      f"vloss {v['vloss']:.4f} ploss {v['ploss']:.3f}")
            _save_plot(metrics_path, out / "loss_curve.png")
        if step % args.ckpt_every == 0:
            save_ckpt()
    bar.close()
    save_ckpt()
    train_seconds = elapsed_before + time.time() - t_loop
    save_dtype = getattr(torch, args.save_dtype)
    save_eagle_head(head, out, dtype=save_dtype)
    # final numbers with the saved (possibly bf16) weights as loaded by the inference loader
    loaded = load_eagle_head(out, tcfg, target_embed=emb_w.float(), dtype=torch.float32, device=str(dev))
    head = loaded
    final = run_val()
    final.update(kind="final", step=step, train_seconds=round(train_seconds, 1),
                 total_seconds=round(time.time() - t_start, 1), saved_dtype=args.save_dtype)
    last_train = [r for r in read_jsonl(metrics_path) if r.get("kind") == "train"][-1:]
    if last_train:
        final.update({f"final_train_{k}": last_train[0][k] for k in ("loss", "vloss", "ploss")})
    log(final)
    _save_plot(metrics_path, out / "loss_curve.png")
    print(json.dumps(final), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m draft.train_eagle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Example: python -m draft.train_eagle data --self-prompts 2000 --out "
                                        "outputs/eagle_data && python -m draft.train_eagle train --help\n"
                                        "EAGLE-3: python -m draft.train_eagle data --broad 800 --out outputs/e3.jsonl && "
                                        "python -m draft.train_eagle train --arch eagle3 --draft-vocab 8192 "
                                        "--data outputs/e3.jsonl --out outputs/eagle3_head")
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=None,
                        help="target HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    common.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    common.add_argument("--no-progress", action="store_true", help="hide progress bars")
    common.add_argument("--resume", action="store_true", help="continue an interrupted run from its files")

    d = sub.add_parser("data", parents=[common], help="build a self-distilled conversation dataset",
                       description="Prompts -> conversations answered by the target (JSONL of token ids + "
                                   "loss mask on the assistant tokens). Written incrementally; --resume continues.")
    d.add_argument("--out", required=True, help="output JSONL (prompts are kept beside it as OUT.prompts.jsonl)")
    d.add_argument("--prompts", action="append", default=[],
                   help="prompt file (repeatable): FastChat question.jsonl, ShareGPT-style JSON/JSONL, or plain "
                        "text with one prompt a line")
    d.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="add N prompts built from this module's topic lists, mostly written by the target")
    d.add_argument("--broad", type=int, default=0, metavar="N",
                   help="add N prompts of broader kinds (translation, summarisation, RAG with quotes, extraction, "
                        "math, code, multi-turn, role-play; draft/broad_prompts.py), passages written by the target")
    d.add_argument("--exclude", action="append", default=[], metavar="FILE:BEGIN:END",
                   help="drop prompts equal to the turns of these FastChat records (repeatable; e.g. an eval split)")
    d.add_argument("--max-turns", type=int, default=2, help="user turns kept per source conversation")
    d.add_argument("--followup-frac", type=float, default=0.0,
                   help="fraction of single-turn prompts given a generic second user turn")
    d.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap per turn")
    d.add_argument("--prompt-max-new-tokens", type=int, default=128, help="length cap of self-written prompts")
    d.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip turns whose prompt is longer")
    d.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    d.add_argument("--sample-frac", type=float, default=1.0,
                   help="with --temperature > 0: fraction of conversations sampled (the rest greedy)")
    d.add_argument("--top-p", type=float, default=0.95)
    d.add_argument("--batch-size", type=int, default=64, help="generation batch (left padded)")
    d.add_argument("--chunk-batches", type=int, default=4, help="batches per write (resume granularity)")
    d.add_argument("--system", default="", help="system prompt (default: the chat template's own)")
    d.add_argument("--template", default="auto", help="chat format: auto (tokenizer template), raw, or fschat name")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    d.add_argument("--time-budget", type=float, default=0, help="stop starting new chunks after this many seconds")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_data)

    f = sub.add_parser("features", parents=[common], help="precompute target features into safetensors shards")
    f.add_argument("--data", required=True, help="JSONL from the data subcommand")
    f.add_argument("--out", required=True, help="output directory (index.json + features-*.safetensors)")
    f.add_argument("--batch-size", type=int, default=16)
    f.add_argument("--shard-size", type=int, default=512, help="conversations per shard")
    f.add_argument("--max-len", type=int, default=2048)
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the target runs in")
    f.add_argument("--store-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    f.set_defaults(func=cmd_features)

    t = sub.add_parser("train", parents=[common], help="train the head; save it in EAGLE layout",
                       description="Teacher-forced EAGLE training: SmoothL1(pred, next feature) + p_weight x "
                                   "CE(lm_head(pred), target distribution), uniform feature noise, AdamW, warmup + "
                                   "cosine. Features come from the target on the fly unless --features is given.")
    t.add_argument("--data", required=True, action="append",
                   help="JSONL from the data subcommand (repeatable: the files are concatenated)")
    t.add_argument("--out", required=True, help="head directory (config.json, model.safetensors, metrics, plot)")
    t.add_argument("--features", default=None, help="feature shards from the features subcommand")
    t.add_argument("--ckpt-dir", default=None, help="training state for --resume (default OUT/train_state)")
    t.add_argument("--init-from", default=None, help="start from an existing EAGLE head directory")
    t.add_argument("--epochs", type=float, default=3)
    t.add_argument("--max-steps", type=int, default=0, help="override epochs")
    t.add_argument("--time-budget", type=float, default=0,
                   help="seconds; after --calib-steps the step count is cut to fit (the schedule follows)")
    t.add_argument("--calib-steps", type=int, default=30,
                   help="with --time-budget: measure the step time at this step and 5x it")
    t.add_argument("--cache-features", default="none", choices=["none", "cpu", "device"],
                   help="keep on-the-fly features (fp16) after their first use, so later epochs skip the target")
    t.add_argument("--bucket", type=int, default=64,
                   help="batch conversations of similar length within windows of BUCKET batches (1 = off)")
    t.add_argument("--batch-size", type=int, default=16, help="conversations per step")
    t.add_argument("--max-len", type=int, default=1024, help="tokens kept per conversation")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--min-lr-ratio", type=float, default=0.0)
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default 3%% of the steps)")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--p-weight", type=float, default=0.1, help="weight of the token cross-entropy")
    t.add_argument("--v-weight", type=float, default=1.0, help="weight of the feature SmoothL1")
    t.add_argument("--noise-std", type=float, default=0.2, help="width of the uniform input-feature noise")
    t.add_argument("--val-frac", type=float, default=0.03, help="held-out fraction of conversations")
    t.add_argument("--val-count", type=int, default=None, help="held-out conversations (overrides --val-frac)")
    t.add_argument("--val-every", type=int, default=250)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--ckpt-every", type=int, default=500)
    t.add_argument("--no-step2", action="store_true", help="skip the second-step agreement in validation")
    t.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"], help="autocast dtype")
    t.add_argument("--target-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the target runs in for on-the-fly features")
    t.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--no-bias", action="store_true", help="fc without bias")
    t.add_argument("--arch", default="eagle", choices=["eagle", "eagle3"],
                   help="eagle: EAGLE-1/2 head (default); eagle3: EAGLE-3 head (fused taps, token-level loss with "
                        "training-time test, optional --draft-vocab; draft/train_eagle3.py)")
    t.add_argument("--ttt-steps", type=int, default=7, help="eagle3: unrolled steps of the training-time test")
    t.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="eagle3: reduced draft vocabulary of the N most frequent training tokens (0 = full)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (HeadError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
