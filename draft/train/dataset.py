"""The ``data`` subcommand: prompts (files, ``--self-prompts``, ``--broad``) -> conversations answered by the
target, written as JSONL (token ids + loss mask), resumable.

Files: ``OUT.prompts.jsonl`` is the prompt set (each with a ``pid``), written once before any answer; ``OUT`` gets
the answered records in chunks of ``--batch-size x --chunk-batches`` conversations.

Invariants: a prompt equal to an ``--exclude`` record's turn never enters the prompt set; ``--resume`` reads the
prompt set back and answers only the pids missing from ``OUT``, with the same per-chunk seeds
(``--seed + offset``), so an interrupted run and a resumed one give the same records; the target is loaded at most
once, and only when something needs it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from draft.train.broad_prompts import broad_prompts
from draft.train.generate import build_conversations
from draft.train.prompt_files import is_excluded, load_excluded, load_prompt_file
from draft.train.prompt_lists import TOPICS
from draft.train.records import read_jsonl
from draft.train.self_prompts import add_followups, self_prompts
from draft.train.target import default_target, load_target, load_tokenizer, resolve_device
from draft.train.translation_prompts import translation_prompts


def prompts_path(out: Path) -> Path:
    """Where the prompt set of the data file ``out`` is kept."""
    return out.with_name(out.name + ".prompts.jsonl")


def new_prompt_set(args, tok, target_model) -> list[dict]:
    """The prompt set of a fresh run: prompt files, then self prompts, broad prompts and translation prompts; minus
    the excluded ones; follow-up turns added; ``pid`` = position. ``target_model()`` loads the target (once) when a
    source needs it."""
    excluded = load_excluded(args.exclude)
    convs = []
    for f in args.prompts or []:
        for turns in load_prompt_file(f, args.max_turns):
            convs.append({"turns": turns, "source": Path(f).name})
    if args.self_prompts:
        convs += self_prompts(target_model(), tok, args.self_prompts, seed=args.seed, batch_size=args.batch_size,
                              max_new_tokens=args.prompt_max_new_tokens, system=args.system,
                              template=args.template, progress=not args.no_progress)
    if args.broad:
        convs += broad_prompts(target_model(), tok, args.broad, TOPICS, seed=args.seed, batch_size=args.batch_size,
                               max_new_tokens=args.prompt_max_new_tokens, system=args.system,
                               template=args.template, progress=not args.no_progress)
    if args.translate:
        src = Path(args.translate_from)
        convs += translation_prompts(read_jsonl(src), {p["pid"]: p for p in read_jsonl(prompts_path(src))},
                                     lambda ids: tok.decode(ids, skip_special_tokens=True), args.translate, args.seed)
    n0 = len(convs)
    convs = [c for c in convs if not is_excluded(c["turns"], excluded)]
    if n0 != len(convs):
        print(f"[data] --exclude dropped {n0 - len(convs)} prompts", file=sys.stderr)
    add_followups(convs, args.followup_frac, args.seed)
    for i, c in enumerate(convs):
        c["pid"] = i
    return convs


def answer_prompts(args, model, tok, todo: list[dict], n_total: int, n_done: int, out: Path, t0: float) -> bool:
    """Append the answered conversations of the prompts ``todo`` to ``out``, chunk by chunk, until done or out of
    ``--time-budget`` (``n_total`` / ``n_done``: the prompt set's size and the conversations already in ``out``).
    Returns whether every prompt was tried (a prompt over ``--max-prompt-tokens`` is tried and gives no record)."""
    from tqdm import tqdm
    chunk = max(1, args.batch_size * args.chunk_batches)
    bar = tqdm(total=n_total, initial=n_done, desc="conversations", disable=args.no_progress)
    n_written = 0
    for s in range(0, len(todo), chunk):
        if args.time_budget and time.time() - t0 > args.time_budget:
            print(f"[data] time budget reached; {n_done + n_written}/{n_total} conversations written "
                  f"(rerun with --resume to continue)", file=sys.stderr)
            bar.close()
            return False
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
    return True


def cmd_data(args) -> int:
    """Build (or resume building) a self-distilled conversation dataset."""
    t0 = time.time()
    dev = resolve_device(args.device)
    target = Path(args.target) if args.target else default_target()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts_file = prompts_path(out)
    if args.translate:
        src = Path(args.translate_from) if args.translate_from else None
        if src is None or not src.is_file() or not prompts_path(src).is_file():
            print(f"error: --translate needs --translate-from DATA.jsonl, a file this subcommand wrote with its "
                  f"prompts beside it (got {args.translate_from!r})", file=sys.stderr)
            return 2
    tok = load_tokenizer(target)
    loaded = []

    def target_model():
        if not loaded:
            loaded.append(load_target(target, dev, getattr(torch, args.dtype)))
        return loaded[0]

    if args.resume and prompts_file.is_file():
        convs = read_jsonl(prompts_file)
        print(f"[data] resuming with {len(convs)} prompts from {prompts_file}", file=sys.stderr)
    else:
        convs = new_prompt_set(args, tok, target_model)
        with open(prompts_file, "w", encoding="utf-8") as fh:
            for c in convs:
                fh.write(json.dumps(c, ensure_ascii=False) + "\n")
        if out.exists():
            out.unlink()
    if not convs:
        print("error: no prompts (give --prompts FILE, --self-prompts N, --broad N and/or --translate N)",
              file=sys.stderr)
        return 2
    done = {r["pid"] for r in read_jsonl(out)} if out.is_file() else set()
    todo = [c for c in convs if c["pid"] not in done]
    model = target_model() if todo or loaded else None
    complete = answer_prompts(args, model, tok, todo, len(convs), len(done), out, t0)
    recs = read_jsonl(out) if out.is_file() else []
    ntok = sum(len(r["input_ids"]) for r in recs)
    nans = sum(sum(r["loss_mask"]) for r in recs)
    info = {"conversations": len(recs), "tokens": ntok, "assistant_tokens": nans, "target": str(target),
            "seconds": round(time.time() - t0, 1), "complete": complete}
    print(json.dumps(info), file=sys.stderr)
    return 0
