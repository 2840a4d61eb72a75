"""Train an EAGLE-3 head by self-distillation (``python -m draft.train_eagle train --arch eagle3 ...``).

Recipe (EAGLE-3, arXiv 2503.01840; written from the paper's description):
  * features: the target's outputs of three decoder layers (default: the inputs of layers 2, L//2, L-3), fused by
    ``fc`` (3H -> H); the head's own norm + ``lm_head`` (over an optional reduced vocabulary) give the logits;
  * loss: token level only (no feature regression): soft cross-entropy against the target's next-token
    distribution (restricted to the draft vocabulary and renormalised), per unrolled step ``j`` weighted ``0.8**j``;
  * training-time test: the head is unrolled ``--ttt-steps`` times on its *own* outputs. Step ``j`` entry ``t`` pairs
    ``token[t+1+j]`` with step ``j-1``'s output at ``t`` (step 0: the fused target feature ``f_t``), sits at position
    ``t+j``, and attends to the step-0 entries ``<= t`` plus its own chain (steps ``1..j`` at ``t``) -- exactly
    what a tree node ``j`` levels below the root sees at inference (:class:`draft.drafter.Drafter`);
  * reduced vocabulary (``--draft-vocab N``): the ``N`` most frequent token ids of the training data
    (:func:`draft.eagle3.vocab_from_ids`); the head's ``lm_head``/``norm`` start from the target's rows/norm.

Conventions as :mod:`draft.train.objective` (records: ``input_ids`` + ``loss_mask``); entry ``t``'s prediction is
trained towards the target's distribution at position ``t + 1 + j`` weighted by ``loss_mask[t + 1 + j]``.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from draft.eagle3 import (Eagle3Head, default_aux_layers, init_eagle3_head, load_eagle3_head, save_eagle3_head,
                          vocab_from_ids)
from draft.train.batches import epoch_batches, require_full_batch
from draft.train.objective import unrolled_forward
from draft.train.records import held_out_order, load_records, pad_batch
from draft.train.target import default_target, load_target, resolve_device


def ttt_forward(head: Eagle3Head, ids: Tensor, fused: Tensor, steps: int):
    """Yield the head's outputs ``[B, L-1, H]`` of unrolled steps ``0..steps-1`` (see the module docstring): step
    ``j`` row ``t`` is what a draft-tree node ``j`` levels below the entry of ``token[t+1]`` computes. The same
    unrolling as EAGLE-1/2 training (:func:`draft.train.objective.unrolled_forward`) on entries ``(token[t+1],
    fused_t)``."""
    return unrolled_forward(head, ids[:, 1:], fused[:, :-1], steps)


def ttt_loss(head: Eagle3Head, ids: Tensor, fused: Tensor, target_logp: Tensor, loss_mask: Tensor,
             steps: int, decay: float = 0.8) -> tuple[Tensor, list[float], list[float]]:
    """Training-time-test loss of one batch.

    ``ids [B, L]``, ``fused [B, L, 3Ht]`` (tapped target features), ``target_logp [B, L, Vd]`` (the target's
    log-probs over the draft vocabulary at each position), ``loss_mask [B, L]``. Returns the weighted loss and per
    step (loss, top-1 agreement with the target's argmax).
    """
    n = ids.shape[1] - 1
    total, losses, accs, wsum = 0.0, [], [], 0.0
    for j, out in enumerate(ttt_forward(head, ids, fused, steps)):
        logq = torch.log_softmax(head.draft_logits(out).float(), dim=-1)          # predicts token t+2+j
        tgt = target_logp[:, 1 + j:].float()                                     # distribution at t+1+j
        valid = loss_mask[:, 1 + j:].float()
        logq = logq[:, :n - j]
        ce = -(tgt.exp() * logq).sum(-1)
        w = valid.sum().clamp_min(1.0)
        lj = (ce * valid).sum() / w
        total = total + (decay ** j) * lj
        wsum += decay ** j
        losses.append(float(lj.detach()))
        accs.append(float(((logq.argmax(-1) == tgt.argmax(-1)).float() * valid).sum() / w))
    return total / max(wsum, 1e-9), losses, accs


@torch.no_grad()
def target_pass(model, ids: Tensor, layers: list[int], vocab_map: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(fused [B, L, 3H], logp [B, L, Vd])`` of the target (HF causal LM) on ``ids``."""
    out = model.model(input_ids=ids, output_hidden_states=True)
    fused = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
    w = model.lm_head.weight if vocab_map is None else model.lm_head.weight[vocab_map]
    logp = torch.log_softmax((out.last_hidden_state @ w.T).float(), dim=-1)
    return fused, logp


def train_eagle3(args) -> int:
    """``train --arch eagle3``: see the module docstring. Reads the same records/options as EAGLE-1/2 training."""
    t0 = time.time()
    torch.manual_seed(args.seed)
    dev = resolve_device(args.device)
    target_dir = Path(args.target) if args.target else default_target()
    model = load_target(target_dir, dev, getattr(torch, args.target_dtype))
    tcfg = model.config
    records = load_records(args.data, args.max_len)
    if not records:
        print("error: no usable training records", file=sys.stderr)
        return 2
    order, n_val = held_out_order(len(records), args.seed, args.val_count, args.val_frac)
    val_idx, train_idx = order[:n_val], order[n_val:] or order[:1]   # unsorted; all held out: the first trains too
    require_full_batch(len(train_idx), args.batch_size)
    layers = default_aux_layers(tcfg.num_hidden_layers)
    vocab_map = None
    if args.draft_vocab and args.draft_vocab < tcfg.vocab_size:
        ids_all = torch.tensor([t for i in train_idx for t in records[i]["input_ids"][:args.max_len]])
        vocab_map = vocab_from_ids(ids_all, tcfg.vocab_size, args.draft_vocab)
    if args.init_from:
        head = load_eagle3_head(args.init_from, tcfg, model.model.embed_tokens.weight.data.float())
        vocab_map, layers = head.vocab_map, head.aux_layers
    else:
        head = init_eagle3_head(tcfg, seed=args.seed, aux_layers=layers, vocab_map=vocab_map)
        with torch.no_grad():   # frozen target embedding; lm_head/norm start from the target's
            head.embed_tokens.weight.copy_(model.model.embed_tokens.weight.float())
            w = model.lm_head.weight.float()
            head.lm_head.weight.copy_(w if vocab_map is None else w[vocab_map])
            head.norm.weight.copy_(model.model.norm.weight.float())
    head = head.to(dev).float().train()
    head.embed_tokens.weight.requires_grad_(False)
    vm_dev = None if vocab_map is None else vocab_map.to(dev)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    lengths = [min(len(r["input_ids"]), args.max_len) for r in records]
    steps_per_epoch = max(1, len(train_idx) // args.batch_size)
    total = args.max_steps or max(1, int(steps_per_epoch * args.epochs))
    warm = args.warmup if args.warmup is not None else max(1, int(0.03 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    cache: dict[int, tuple[Tensor, Tensor]] = {}

    def batch(idx: list[int]):
        seqs = [records[i]["input_ids"][:args.max_len] for i in idx]
        ids = pad_batch(seqs).to(dev)
        mask = pad_batch([records[i]["loss_mask"][:args.max_len] for i in idx]).to(dev)
        if all(i in cache for i in idx):
            W = ids.shape[1]
            fused = torch.zeros(len(idx), W, cache[idx[0]][0].shape[-1], device=dev)
            logp = torch.zeros(len(idx), W, cache[idx[0]][1].shape[-1], device=dev)
            for j, i in enumerate(idx):
                f, lp = cache[i]
                fused[j, :f.shape[0]] = f.to(dev).float()
                logp[j, :lp.shape[0]] = lp.to(dev).float()
            return ids, fused, logp, mask
        fused, logp = target_pass(model, ids, layers, vm_dev)
        if args.cache_features != "none":
            for j, i in enumerate(idx):
                cache[i] = (fused[j, :len(seqs[j])].half().cpu(), logp[j, :len(seqs[j])].half().cpu())
        return ids, fused.float(), logp, mask

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = (out_dir / "metrics.jsonl").open("a")

    def evaluate() -> dict:
        head.eval()
        ls, acc = [], []
        with torch.no_grad():
            for b in range(0, len(val_idx), args.batch_size):
                ids, fused, logp, mask = batch(val_idx[b:b + args.batch_size])
                _, l, a = ttt_loss(head, ids, fused, logp, mask, args.ttt_steps)
                ls.append(l)
                acc.append(a)
        head.train()
        k = min(len(x) for x in acc)
        return {"val_loss": [round(sum(x[j] for x in ls) / len(ls), 4) for j in range(k)],
                "val_top1": [round(sum(x[j] for x in acc) / len(acc), 4) for j in range(k)]}

    step, epoch = 0, 0
    print(f"[eagle3] {len(train_idx)} train / {len(val_idx)} val records, taps {layers}, draft vocabulary "
          f"{tcfg.vocab_size if vocab_map is None else vocab_map.numel()}, {total} steps", file=sys.stderr)
    while step < total:
        for idx in epoch_batches(train_idx, lengths, args.batch_size, args.seed, epoch, args.bucket):
            ids, fused, logp, mask = batch(idx)
            loss, ls, acc = ttt_loss(head, ids, fused, logp, mask, args.ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if args.grad_clip > 0:   # 0 = no clipping (as the EAGLE-1/2 trainer; clip_grad_norm_(p, 0) zeroes grads)
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0:
                row = {"kind": "train", "step": step, "loss": round(float(loss.detach()), 4), "step_loss": [round(x, 4) for x in ls],
                       "top1": [round(x, 4) for x in acc], "s": round(time.time() - t0, 1)}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                print(f"[eagle3] {json.dumps(row)}", file=sys.stderr, flush=True)
            if step >= total or (args.time_budget and time.time() - t0 > args.time_budget):
                total = step
                break
        epoch += 1
    final = evaluate()
    metrics.write(json.dumps({"kind": "val", "step": step, **final}) + "\n")
    metrics.close()
    head.eval()
    save_eagle3_head(head, out_dir, dtype=getattr(torch, args.save_dtype))
    info = {"arch": "eagle3", "steps": step, "records": len(records), "ttt_steps": args.ttt_steps,
            "draft_vocab": tcfg.vocab_size if vocab_map is None else int(vocab_map.numel()), "taps": layers,
            "seconds": round(time.time() - t0, 1), **final}
    (out_dir / "train_summary.json").write_text(json.dumps(info, indent=1))
    print(f"[eagle3] saved {out_dir}: {json.dumps(info)}", file=sys.stderr)
    return 0
