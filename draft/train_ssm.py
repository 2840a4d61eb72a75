"""Distil small draft LMs (SpecInfer's SSMs, the draft model of ``sps``) from a target, with optional
collective boost-tuning.

Recipe (every step is in this file):
  1. prompts: FastChat ``question.jsonl`` files (``--prompts``, records ``--begin``/``--end``, first turn, the
     target's chat template) or ``--random-prompts N`` (random token prefixes; for tokenizer-less test models);
  2. self-generated data: the target answers every prompt greedily (``--gen-tokens``); a share
     ``--eval-frac`` of the conversations is held out;
  3. labels: the target's argmax next token at every answer position (teacher-forced, one forward);
  4. student: the target's config with ``--layers`` decoder layers, initialised from the target's embedding,
     first ``--layers`` layers, final norm and ``lm_head``; embedding and ``lm_head`` stay frozen (shared
     vocabulary; the CPU cost of a step is then the layers and one pass through ``lm_head``);
  5. training: cross-entropy to the labels on answer positions (AdamW, ``--steps``, ``--batch``, ``--lr``);
  6. ``--models K`` trains K students; with ``--boost`` (SpecInfer's collective boost-tuning) student k only
     learns from the positions that every earlier student gets wrong (weight 1) and ``--boost-keep`` elsewhere;
  7. evaluation on the held-out conversations: greedy acceptance alpha (top-1 agreement with the target), the
     greedy ``sps`` tokens per round for ``--gamma`` (exact for teacher-forced greedy chains: 1 + the run of
     consecutive agreements from each position, capped at gamma), and the collective coverage of the first k
     students (a position counts when any of them agrees: what a merged tree of their top-1 guesses covers).

Writes ``OUT/ssm_<k>/`` (Hugging Face layout, safetensors, the target's tokenizer files; with
``--shared-vocab`` the layers and norm only, in float16, as shipped in ``draft/ssms/``), ``OUT/metrics.json``
and ``OUT/MODEL_CARD.md``. Use a trained student with ``draft.sources=...,ssm:OUT/ssm_1`` or ``mode=sps
sps.draft_dir=OUT/ssm_1``.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from config.invocation import prog
from draft.train.records import pad_batch

EXAMPLE = ("Example: python -m draft.train_ssm --target checkpoints/SmolLM2-135M-Instruct --out /tmp/ssm "
           "--prompts ../shared/data/mt_bench/question.jsonl --end 30 --layers 2 --models 2 --boost --steps 150")


class TrainError(ValueError):
    pass


def student_from_target(target, layers: int):
    """A copy of ``target``'s architecture with its first ``layers`` decoder layers (weights copied: embedding,
    those layers, final norm, lm_head). Works for LLaMA-family checkpoints (``model.layers.<i>.*`` names)."""
    import copy
    n = target.config.num_hidden_layers
    if not 1 <= layers <= n:
        raise TrainError(f"--layers must be in 1..{n} (the target has {n} layers)")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:layers]
    student = type(target)(cfg).to(next(target.parameters()).dtype)
    src = target.state_dict()
    missing = [k for k in student.state_dict() if k not in src]
    if missing:
        raise TrainError(f"cannot initialise the student from the target: missing {missing[:3]}")
    student.load_state_dict({k: src[k] for k in student.state_dict()})
    return student


def freeze_vocab(student) -> None:
    """Embedding and lm_head keep the target's weights (shared vocabulary)."""
    student.get_input_embeddings().weight.requires_grad_(False)
    student.get_output_embeddings().weight.requires_grad_(False)


@torch.no_grad()
def argmax_labels(model, seqs: list[list[int]], batch: int, device) -> list[list[int]]:
    """``labels[i][t]`` = the model's argmax after ``seqs[i][:t + 1]`` (teacher-forced, right-padded batches)."""
    out = []
    for s in range(0, len(seqs), batch):
        chunk = seqs[s:s + batch]
        ids = pad_batch(chunk).to(device)
        att = pad_batch([[1] * len(c) for c in chunk]).to(device)
        pred = model(input_ids=ids, attention_mask=att).logits.argmax(-1).cpu()
        out += [pred[i, :len(c)].tolist() for i, c in enumerate(chunk)]
    return out


def train_student(student, seqs, labels, weights, *, steps: int, batch: int, lr: float, seed: int, device,
                  log=print) -> list[float]:
    """Cross-entropy to ``labels`` weighted by ``weights`` (per position; 0 = not trained). Returns losses."""
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    usable = [i for i, w in enumerate(weights) if sum(w) > 0]
    if not usable:
        return []
    rng = random.Random(seed)
    student.train()
    losses = []
    for step in range(steps):
        idx = [rng.choice(usable) for _ in range(batch)]
        ids = pad_batch([seqs[i] for i in idx]).to(device)
        att = pad_batch([[1] * len(seqs[i]) for i in idx]).to(device)
        lab = pad_batch([labels[i] for i in idx]).to(device)
        w = torch.tensor([weights[i] + [0.0] * (ids.shape[1] - len(weights[i])) for i in idx], device=device)
        hidden = student.model(input_ids=ids, attention_mask=att).last_hidden_state
        sel = w > 0                                  # lm_head only where the loss looks (answer positions)
        logits = student.lm_head(hidden[sel]).float()
        ce = F.cross_entropy(logits, lab[sel], reduction="none")
        loss = (ce * w[sel]).sum() / w[sel].sum().clamp(min=1e-9)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(f"[train_ssm]   step {step + 1}/{steps} loss {losses[-1]:.3f}")
    student.eval()
    return losses


def boost_weights(masks: list[list[int]], labels: list[list[int]], earlier: list[list[list[int]]],
                  keep: float) -> list[list[float]]:
    """Collective boost-tuning weights: 1 on answer positions that *every* earlier student gets wrong
    (``earlier[k][i][t] != labels[i][t]``), ``keep`` on the ones some earlier student already gets right, 0
    outside answers."""
    return [[float(m[t]) * (1.0 if all(p[i][t] != lab[t] for p in earlier) else keep) for t in range(len(m))]
            for i, (m, lab) in enumerate(zip(masks, labels))]


def evaluate(preds: list[list[int]], labels: list[list[int]], masks: list[list[int]], gamma: int) -> dict:
    """Greedy acceptance and sps tokens per round (module docstring, step 7) of one student's predictions."""
    hits = total = 0
    tau_sum = rounds = 0
    for p, lab, m in zip(preds, labels, masks):
        ok = [int(a == b) for a, b in zip(p, lab)]
        pos = [t for t in range(len(m)) if m[t]]
        hits += sum(ok[t] for t in pos)
        total += len(pos)
        for t in pos:                      # a chain drafted after position t: run of agreements from t
            run = 0
            while run < gamma and t + run < len(ok) and m[t + run] and ok[t + run]:
                run += 1
            tau_sum += 1 + run
            rounds += 1
    return {"alpha": hits / max(1, total), "sps_tokens_per_round": tau_sum / max(1, rounds), "positions": total}


def coverage(all_preds: list[list[list[int]]], labels, masks) -> float:
    """Share of answer positions where at least one student's top-1 equals the target's."""
    hit = total = 0
    for i, (lab, m) in enumerate(zip(labels, masks)):
        for t, keep in enumerate(m):
            if keep:
                total += 1
                hit += any(preds[i][t] == lab[t] for preds in all_preds)
    return hit / max(1, total)


def load_prompts(args, tok, rng: random.Random, vocab: int) -> list[list[int]]:
    if args.random_prompts:
        return [[rng.randrange(3, vocab) for _ in range(rng.randint(6, 14))] for _ in range(args.random_prompts)]
    if not args.prompts:
        raise TrainError("give --prompts FILE.jsonl (FastChat questions) or --random-prompts N")
    if tok is None:
        raise TrainError("the target has no tokenizer: use --random-prompts N")
    from draft.train.prompt_files import is_excluded, load_excluded
    from model.prompts import chat_prompt_ids
    try:
        excluded = load_excluded(args.exclude)
    except (OSError, ValueError) as e:
        raise TrainError(f"--exclude: {e}") from None
    out, dropped = [], 0
    for path in args.prompts:
        p = Path(path)
        if not p.is_file():
            raise TrainError(f"--prompts {path}: no such file")
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        for r in rows[args.begin:args.end]:
            text = r["turns"][0] if isinstance(r.get("turns"), list) else r.get("prompt", "")
            if text and is_excluded([text], excluded):
                dropped += 1
            elif text:
                out.append(chat_prompt_ids(tok, [text[:args.max_prompt_chars]], []))
    if dropped and not args.quiet:
        print(f"[train_ssm] --exclude dropped {dropped} prompts", file=sys.stderr)
    if not out:
        raise TrainError("no prompts read")
    return out


def write_card(out: Path, args, metrics: dict, n_train: int, n_eval: int) -> None:
    lines = [f"# Distilled draft LMs for {Path(args.target).name}", "",
             "Written by `python -m draft.train_ssm` (draft/train_ssm.py has the full recipe).", "",
             "## Data", f"- prompts: {', '.join(args.prompts) if args.prompts else f'{args.random_prompts} random'}"
             f" (records {args.begin}:{args.end})"
             + (f", minus the turns of {', '.join(args.exclude)}" if args.exclude else ""),
             f"- answers: the target's own greedy answers, up to {args.gen_tokens} new tokens",
             f"- {n_train} training / {n_eval} held-out conversations", "",
             "## Recipe",
             f"- student: first {args.layers} of the target's layers + norm + lm_head (embedding and lm_head frozen)",
             f"- {args.models} model(s), boost-tuning {'on' if args.boost else 'off'} (keep weight {args.boost_keep})",
             f"- {args.steps} AdamW steps, batch {args.batch}, lr {args.lr}, seed {args.seed}, device {args.device}",
             f"- training time: {metrics['train_s']:.0f} s", "",
             "## Measured on the held-out conversations (teacher-forced, greedy)",
             "| model | alpha (top-1 agreement) | sps tokens/round, gamma=%d | coverage of models 1..k |" % args.gamma,
             "|---|---|---|---|"]
    for m in metrics["models"]:
        lines.append(f"| ssm_{m['k']} | {m['alpha']:.3f} | {m['sps_tokens_per_round']:.2f} | {m['coverage']:.3f} |")
    (out / "MODEL_CARD.md").write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog("draft.train_ssm"), description=__doc__, epilog=EXAMPLE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="the target's full Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory (ssm_<k>/, metrics.json, MODEL_CARD.md)")
    ap.add_argument("--prompts", nargs="*", default=[], help="FastChat question.jsonl files")
    ap.add_argument("--begin", type=int, default=0)
    ap.add_argument("--end", type=int, default=None)
    ap.add_argument("--exclude", action="append", default=[], metavar="FILE:BEGIN:END",
                    help="drop prompts equal to these FastChat records' turns (e.g. an evaluation split; repeatable)")
    ap.add_argument("--random-prompts", type=int, default=0, help="N random token prompts instead of --prompts")
    ap.add_argument("--max-prompt-chars", type=int, default=1500)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--models", type=int, default=1)
    ap.add_argument("--boost", action="store_true", help="collective boost-tuning (SpecInfer)")
    ap.add_argument("--boost-keep", type=float, default=0.0, help="weight of positions an earlier model gets right")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-frac", type=float, default=0.25)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--shared-vocab", action="store_true",
                    help="write each student without its embedding and lm_head (float16 layers and norm; rank 0 "
                         "lends the target's, draft/ssm.py: load_small_lm): the layout shipped in draft/ssms/")
    ap.add_argument("--quiet", action="store_true")
    return ap


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from draft.train.generate import generate_all, pad_id
    from model.prompts import stop_token_ids
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.models < 1 or args.steps < 0 or args.batch < 1 or not 0 < args.eval_frac < 1:
        raise TrainError("need --models >= 1, --steps >= 0, --batch >= 1 and 0 < --eval-frac < 1")
    target_dir = Path(args.target)
    if not (target_dir / "config.json").is_file():
        raise TrainError(f"--target {target_dir}: no config.json (a Hugging Face causal LM directory)")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError):
        tok = None
    gen_cfg = target_dir / "generation_config.json"
    if tok is not None:
        stop = stop_token_ids(tok, json.loads(gen_cfg.read_text()) if gen_cfg.is_file() else None)
    else:
        eos = target.config.eos_token_id
        stop = set(eos if isinstance(eos, list) else [eos if eos is not None else 2])
    pad = pad_id(tok, stop) if tok is not None else int(min(stop))
    prompts = load_prompts(args, tok, rng, target.config.vocab_size)
    t0 = time.time()
    log(f"[train_ssm] generating {len(prompts)} answers with the target ({args.gen_tokens} tokens) ...")
    answers = generate_all(target, prompts, [False] * len(prompts), {"max_new_tokens": args.gen_tokens},
                           args.gen_batch, stop, pad, "[train_ssm] answers", not args.quiet)  # greedy, by length
    seqs = [p + a for p, a in zip(prompts, answers)]
    masks = [[0] * (len(p) - 1) + [1] * len(a) + [0] for p, a in zip(prompts, answers)]  # predict answer tokens
    labels = argmax_labels(target, seqs, args.gen_batch, device)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_eval = max(1, int(round(args.eval_frac * len(seqs))))
    ev, tr = order[:n_eval], order[n_eval:]
    if not tr:
        raise TrainError("too few prompts for a train/eval split")
    log(f"[train_ssm] data ready in {time.time() - t0:.0f} s: {len(tr)} train, {len(ev)} eval conversations")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t1 = time.time()
    weights = [[float(m) for m in masks[i]] for i in tr]
    models, train_preds, eval_preds = [], [], []
    for k in range(1, args.models + 1):
        if args.boost and train_preds:
            weights = boost_weights([masks[i] for i in tr], [labels[i] for i in tr], train_preds, args.boost_keep)
        log(f"[train_ssm] student {k}/{args.models}: {args.layers} layers, "
            f"{sum(sum(w) for w in weights):.0f} weighted positions")
        student = student_from_target(target, args.layers).to(device)
        freeze_vocab(student)
        losses = train_student(student, [seqs[i] for i in tr], [labels[i] for i in tr], weights, steps=args.steps,
                               batch=args.batch, lr=args.lr, seed=args.seed + k, device=device, log=log)
        train_preds.append(argmax_labels(student, [seqs[i] for i in tr], args.gen_batch, device))
        eval_preds.append(argmax_labels(student, [seqs[i] for i in ev], args.gen_batch, device))
        m = evaluate(eval_preds[-1], [labels[i] for i in ev], [masks[i] for i in ev], args.gamma)
        m.update(k=k, coverage=coverage(eval_preds, [labels[i] for i in ev], [masks[i] for i in ev]),
                 final_loss=losses[-1] if losses else None)
        models.append(m)
        d = out / f"ssm_{k}"
        if args.shared_vocab:
            from draft.ssm import ship_student
            ship_student(student, d)
        else:
            student.save_pretrained(d, safe_serialization=True)
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
        for name in ("generation_config.json", *(() if args.shared_vocab else names)):  # shared: not standalone
            if (target_dir / name).is_file():
                shutil.copy(target_dir / name, d / name)
        log(f"[train_ssm] ssm_{k}: alpha {m['alpha']:.3f}, sps tokens/round {m['sps_tokens_per_round']:.2f} "
            f"(gamma {args.gamma}), coverage of 1..{k} {m['coverage']:.3f}")
    metrics = {"models": models, "train_s": time.time() - t1, "n_train": len(tr), "n_eval": len(ev),
               "target": str(target_dir), "args": {k: v for k, v in vars(args).items()}}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    write_card(out, args, metrics, len(tr), len(ev))
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except TrainError as e:
        print(f"[train_ssm] error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
