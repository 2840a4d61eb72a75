"""Generation with the target: left-padded batched generation, and whole conversations answered turn by turn
(self-distillation records with a loss mask on the assistant's tokens).

Invariants: a generated answer ends after its first stop token, which is kept; batches are grouped by prompt
length and by sampling vs greedy, and the results come back in the prompts' order; in a record, ``input_ids`` is
the last turn's prompt (chat template, earlier answers re-tokenized inside it) followed by the last answer, and
``loss_mask`` is 1 exactly on the assistant's tokens (each earlier answer up to and including its stop token).
"""
from __future__ import annotations

import random

import torch

from model.prompts import chat_prompt_ids, stop_token_ids


def pad_id(tok, stop_ids) -> int:
    """The tokenizer's pad id, else the smallest stop id."""
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


def generate_all(model, prompts: list[list[int]], flags: list[bool], args_gen: dict, batch_size: int,
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
    pad = pad_id(tok, stops)
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
        gens = generate_all(model, [s["prompts"][-1] for s in todo], [s["sampled"] for s in todo],
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
