"""The ``train`` subcommand for EAGLE-1/2 heads: setup, the held-out split, the step loop (with the
``--time-budget`` fit), checkpoints for ``--resume``, the saved head and its final evaluation.

Files in ``--out``: ``train_args.json`` (the arguments and split sizes), ``metrics.jsonl`` (``train`` rows every
``--log-every`` steps, ``val`` rows every ``--val-every`` steps, one ``final`` row), ``loss_curve.png``,
``config.json`` + ``model.safetensors`` (EAGLE layout, :func:`draft.eagle.save_eagle_head`), and
``train_state/checkpoint.pt`` (head, optimizer, schedule, step, elapsed seconds) unless ``--ckpt-dir``.

Invariants: the run is deterministic in ``--seed`` (split, head init, batch order per epoch, feature noise seeded
with ``seed + step``), so a resumed run continues the same sequence of batches; the schedule is warmup then
cosine to ``--min-lr-ratio`` over ``total`` steps, where ``total`` starts at ``--max-steps`` (else epochs x steps
per epoch) and only the time-budget fit lowers it; the final numbers are those of the head as saved and loaded
back (``--save-dtype``), not of the training copy.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from draft.eagle import EagleHead, init_untrained_head, load_eagle_head, save_eagle_head
from draft.train.batches import ConversationBatches, epoch_batches, require_full_batch
from draft.train.features import FeatureStore
from draft.train.objective import evaluate, train_step
from draft.train.plots import save_loss_plot
from draft.train.records import held_out_order, load_records, read_jsonl
from draft.train.target import default_target, load_target, read_target_embeddings, resolve_device

Tensor = torch.Tensor


@dataclass
class TrainRun:
    """One training run: what setup made (fixed) and where the loop stands (``step``, ``schedule["total"]``)."""
    args: object
    t_start: float
    dev: torch.device
    amp: torch.dtype | None
    target_dir: Path
    tcfg: object
    out: Path
    ckpt_path: Path
    metrics_path: Path
    train_idx: list[int]
    val_idx: list[int]
    lengths: list[int]
    head: EagleHead
    lm_head: nn.Module
    emb_w: Tensor
    data: ConversationBatches
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    schedule: dict            # {"total": steps of the schedule}; shared with the LR function
    planned: int
    steps_per_epoch: int
    step: int = 0
    elapsed_before: float = 0.0   # training seconds of earlier (resumed) sessions
    t_loop: float = 0.0
    gen: torch.Generator | None = None
    anchor: tuple[list[Tensor], float] | None = None   # (--init-from's weights, --anchor-decay): decay_toward
    val_batches_idx: list[list[int]] = field(default_factory=list)


# -- setup ----------------------------------------------------------------------------------------------

def select_device(args) -> tuple[torch.device, torch.dtype | None]:
    """The device (TF32 matmuls allowed on CUDA) and the autocast dtype of ``--amp``."""
    dev = resolve_device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return dev, {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]


def split_records(args) -> tuple[list[dict], list[int], list[int]] | None:
    """``(records, train_idx, val_idx)``: usable records, at least one held out and one trained on (``val_idx``
    sorted); None when fewer than 2 records are usable."""
    records = load_records(args.data, args.max_len)
    if len(records) < 2:
        return None
    order, n_val = held_out_order(len(records), args.seed, args.val_count, args.val_frac)
    n_val = min(n_val, len(records) - 1)
    return records, order[n_val:], sorted(order[:n_val])


def build_heads(args, tcfg, target_dir: Path, dev) -> tuple[EagleHead, nn.Module, Tensor]:
    """``(head, lm_head, embed_tokens.weight)``: the frozen target ``lm_head`` on ``dev``, and the head (new or
    ``--init-from``) with the target's embedding, frozen, in fp32 on ``dev``."""
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
    return head, lm_head, emb_w


def feature_source(args, records: list[dict], target_dir: Path, dev) -> ConversationBatches:
    """Batches with features from ``--features`` shards, else from the target run on the fly."""
    if args.features and len(args.data) != 1:
        raise ValueError("--features goes with exactly one --data file (the one the shards were made from)")
    store = FeatureStore(args.features) if args.features else None
    target = None if store else load_target(target_dir, dev, getattr(torch, args.target_dtype))
    return ConversationBatches(records, args.max_len, dev, target, store, feat_dtype=torch.float32,
                               cache=args.cache_features)


def cosine_schedule(opt: torch.optim.Optimizer, warm: int, min_lr_ratio: float,
                    schedule: dict) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warm`` steps, then cosine from 1 to ``min_lr_ratio`` at ``schedule["total"]`` (read at
    every step, so a lowered total reshapes the rest of the curve)."""

    def lr_lambda(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        total = max(schedule["total"], warm + 1)
        prog = min(1.0, (step - warm) / max(1, total - warm))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def prepare_run(args) -> TrainRun | None:
    """Everything before the first step (None: too few usable records, reported on stderr)."""
    from transformers import AutoConfig
    t_start = time.time()
    torch.manual_seed(args.seed)
    dev, amp = select_device(args)
    target_dir = Path(args.target) if args.target else default_target()
    tcfg = AutoConfig.from_pretrained(str(target_dir))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else out / "train_state"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    split = split_records(args)
    if split is None:
        print("error: the dataset needs at least 2 usable conversations", file=sys.stderr)
        return None
    records, train_idx, val_idx = split
    require_full_batch(len(train_idx), args.batch_size)
    head, lm_head, emb_w = build_heads(args, tcfg, target_dir, dev)
    data = feature_source(args, records, target_dir, dev)
    lengths = [min(len(r["input_ids"]), args.max_len) for r in records]
    steps_per_epoch = max(1, len(train_idx) // args.batch_size)
    planned = args.max_steps or max(1, int(steps_per_epoch * args.epochs))
    params = [p for p in head.parameters() if p.requires_grad]
    # the starting head's weights, before --resume replaces them (they are what --init-from loaded, every session)
    anchor = ([p.detach().clone() for p in params], args.anchor_decay) if args.anchor_decay else None
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    schedule = {"total": planned}
    warm = args.warmup if args.warmup is not None else max(1, int(0.03 * planned))
    sched = cosine_schedule(opt, warm, args.min_lr_ratio, schedule)
    return TrainRun(args=args, t_start=t_start, dev=dev, amp=amp, target_dir=target_dir, tcfg=tcfg, out=out,
                    ckpt_path=ckpt_dir / "checkpoint.pt", metrics_path=out / "metrics.jsonl", train_idx=train_idx,
                    val_idx=val_idx, lengths=lengths, head=head, lm_head=lm_head, emb_w=emb_w, data=data, opt=opt,
                    sched=sched, schedule=schedule, planned=planned, steps_per_epoch=steps_per_epoch,
                    anchor=anchor)


def resume_or_start(run: TrainRun) -> None:
    """``--resume`` with a checkpoint: restore head, optimizer, schedule, step; else start a new metrics file.
    Then write ``train_args.json``, seed the noise generator and cut the validation batches."""
    args = run.args
    if args.resume and run.ckpt_path.is_file():
        try:  # tensors and plain containers only: a replaced file in the output folder cannot run code
            st = torch.load(run.ckpt_path, map_location="cpu", weights_only=True)
        except Exception as e:
            sys.exit(f"[train] error: cannot resume from {run.ckpt_path}: {str(e).strip().splitlines()[0][:200]} "
                     f"(delete it to start over)")
        run.head.load_state_dict(st["head"])
        run.opt.load_state_dict(st["optimizer"])
        run.sched.load_state_dict(st["scheduler"])
        run.step, run.schedule["total"] = st["step"], st["total"]
        run.elapsed_before = st.get("elapsed", 0.0)
        print(f"[train] resumed from {run.ckpt_path} at step {run.step}/{run.schedule['total']}", file=sys.stderr)
    elif run.metrics_path.exists():
        run.metrics_path.unlink()
    (run.out / "train_args.json").write_text(json.dumps(
        {**{k: v for k, v in vars(args).items() if k != "func"}, "target": str(run.target_dir),
         "train_conversations": len(run.train_idx), "val_conversations": len(run.val_idx),
         "device": str(run.dev), "cuda_name": torch.cuda.get_device_name(0) if run.dev.type == "cuda" else None},
        indent=1, default=str))
    run.gen = torch.Generator(device=run.dev)
    run.gen.manual_seed(args.seed + run.step)
    bs = args.batch_size
    run.val_batches_idx = [run.val_idx[i:i + bs] for i in range(0, len(run.val_idx), bs)]


# -- during the run ---------------------------------------------------------------------------------------

def run_val(run: TrainRun) -> dict:
    """:func:`draft.train.objective.evaluate` of the current head on the held-out conversations."""
    return evaluate(run.head, run.lm_head, (run.data.make(b) for b in run.val_batches_idx), run.amp,
                    step2=not run.args.no_step2, steps=run.args.eval_steps)


def log_row(run: TrainRun, row: dict) -> None:
    with open(run.metrics_path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def save_checkpoint(run: TrainRun) -> None:
    """Head, optimizer, schedule, step and elapsed seconds, written atomically (temporary file + rename)."""
    tmp = run.ckpt_path.with_suffix(".tmp")
    torch.save({"head": run.head.state_dict(), "optimizer": run.opt.state_dict(), "scheduler": run.sched.state_dict(),
                "step": run.step, "total": run.schedule["total"],
                "elapsed": run.elapsed_before + time.time() - run.t_loop}, tmp)
    os.replace(tmp, run.ckpt_path)


class TimeBudget:
    """Step-time measurements under ``--time-budget``: early (``--calib-steps``), later (5x), once the second epoch
    runs (cached features), then every 200 steps while less than half of the schedule has run. A run without a
    budget, or a resumed one, measures nothing."""

    def __init__(self, args, start_step: int, steps_per_epoch: int) -> None:
        self.budget = args.time_budget
        self.steps_per_epoch = steps_per_epoch
        self.calib_at = [] if (start_step > 0 or not args.time_budget) else sorted(
            {args.calib_steps, 5 * args.calib_steps} | ({steps_per_epoch + args.calib_steps}
                                                        if args.cache_features != "none" else set()))
        self.warm_steps = min(5, max(0, args.calib_steps - 1))
        self.step_time, self.window_steps = 0.0, 0
        self.val_s: float | None = None   # seconds of one validation, measured at the first fit

    def new_window(self) -> None:
        self.step_time, self.window_steps = 0.0, 0

    def record(self, step: int, seconds: float) -> None:
        """Count step ``step``'s time unless it is a warmup step or the first of an epoch (new features)."""
        if step > self.warm_steps and not (self.steps_per_epoch >= 10 and (step - 1) % self.steps_per_epoch == 0):
            self.step_time += seconds
            self.window_steps += 1

    def due(self, step: int) -> float | None:
        """The mean step time when a measurement is due at ``step`` (the window restarts), else None. A measurement
        point with fewer than 3 timed steps moves to the next step."""
        while self.calib_at and self.calib_at[0] < step:
            self.calib_at[0] = step
        if self.calib_at and step == self.calib_at[0] and self.window_steps >= 3:
            self.calib_at.pop(0)
            per = self.step_time / max(1, self.window_steps)
            self.new_window()
            return per
        return None

    def plan_next(self, step: int, total: int) -> None:
        if not self.calib_at and step + 200 < total // 2:
            self.calib_at.append(step + 200)

    def out_of_time(self, t_start: float) -> bool:
        """The safety net: past the budget less two validations and 2 s (the fits normally prevent this)."""
        return bool(self.budget) and time.time() - t_start > self.budget - 2 * (self.val_s or 0) - 2.0


def fit_to_budget(run: TrainRun, clock: TimeBudget, per: float, bar) -> None:
    """Cut ``schedule["total"]`` so the remaining time pays for the steps at ``per`` seconds, a validation every
    ``--val-every`` steps and the final one (the first fit runs and times a validation)."""
    args = run.args
    if clock.val_s is None:
        t_val = time.time()
        v = run_val(run)
        log_row(run, {"kind": "val", "step": run.step, **v})
        clock.val_s = time.time() - t_val
    remaining = args.time_budget - (time.time() - run.t_start) - 2 * clock.val_s - 5.0
    fit = run.step + max(0, int(remaining / (per + clock.val_s / args.val_every)))
    run.schedule["total"] = max(run.step, min(run.planned, fit))
    bar.total = run.schedule["total"]
    print(f"\n[train] step {run.step}: {per * 1000:.0f} ms/step, validation {clock.val_s:.1f} s: --time-budget "
          f"allows {fit} steps (planned {run.planned}; running {run.schedule['total']})", file=sys.stderr)
    clock.plan_next(run.step, run.schedule["total"])


def train_row(run: TrainRun, acc_rows: list[dict]) -> dict:
    """A ``train`` metrics row: the means of the step metrics since the last row."""
    row = {"kind": "train", "step": run.step, "epoch": run.step / run.steps_per_epoch,
           "lr": run.sched.get_last_lr()[0], "time": round(run.elapsed_before + time.time() - run.t_loop, 1)}
    for key in ("loss", "vloss", "ploss", "top1", "grad_norm"):
        row[key] = sum(r[key] for r in acc_rows) / len(acc_rows)
    if "step_top1" in acc_rows[0]:   # per unrolled step, over the steps' batches that reached it
        per = [[r["step_top1"][j] for r in acc_rows if r["step_top1"][j] is not None]
               for j in range(len(acc_rows[0]["step_top1"]))]
        row["step_top1"] = [sum(v) / len(v) if v else None for v in per]
    return row


def validate(run: TrainRun, bar) -> None:
    """A ``val`` row, its line on the progress bar, and a fresh loss curve."""
    v = run_val(run)
    log_row(run, {"kind": "val", "step": run.step, **v})
    bar.write(f"[val] step {run.step}: top1 {v['top1']:.3f} top5 {v['top5']:.3f} "
              f"step2 {v['top1_step2'] if v['top1_step2'] is None else round(v['top1_step2'], 3)} "
              f"vloss {v['vloss']:.4f} ploss {v['ploss']:.3f}"
              + (f" steps {[x if x is None else round(x, 3) for x in v['top1_steps']]}" if v.get("top1_steps") else ""))
    save_loss_plot(run.metrics_path, run.out / "loss_curve.png")


def train_loop(run: TrainRun) -> None:
    """Steps from ``run.step`` to ``schedule["total"]``: one batch each, in the order of :func:`epoch_batches`;
    metrics, validations and checkpoints at their intervals and at the last step."""
    from tqdm import tqdm
    args = run.args
    run.t_loop = time.time()
    bar = tqdm(total=run.schedule["total"], initial=run.step, desc="train", disable=args.no_progress)
    clock = TimeBudget(args, run.step, run.steps_per_epoch)
    ema = None
    acc_rows = []
    epoch_cache: dict[int, list[list[int]]] = {}
    while run.step < run.schedule["total"]:
        epoch, k = divmod(run.step, run.steps_per_epoch)
        if epoch not in epoch_cache:
            epoch_cache = {epoch: epoch_batches(run.train_idx, run.lengths, args.batch_size, args.seed, epoch,
                                                args.bucket)}
            if run.step > 0:  # timings of a new epoch (cached features) start a new window
                clock.new_window()
        t_step = time.time()
        batch = run.data.make(epoch_cache[epoch][k])
        m = train_step(run.head, batch, run.opt, run.lm_head, p_weight=args.p_weight, v_weight=args.v_weight,
                       noise_std=args.noise_std, grad_clip=args.grad_clip, scheduler=run.sched, amp_dtype=run.amp,
                       generator=run.gen, unroll_steps=args.unroll_steps, unroll_decay=args.unroll_decay,
                       anchor=run.anchor)
        run.step += 1
        clock.record(run.step, time.time() - t_step)
        bar.update(1)
        acc_rows.append(m)
        ema = m["loss"] if ema is None else 0.95 * ema + 0.05 * m["loss"]
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{m['top1']:.2f}")
        per = clock.due(run.step)
        if per is not None:
            fit_to_budget(run, clock, per, bar)
        if clock.out_of_time(run.t_start):
            run.schedule["total"] = run.step  # out of time (safety net; the measurements normally prevent this)
        last = run.step == run.schedule["total"]
        if run.step % args.log_every == 0 or last:
            log_row(run, train_row(run, acc_rows))
            acc_rows = []
        if run.step % args.val_every == 0 or last:
            validate(run, bar)
        if run.step % args.ckpt_every == 0:
            save_checkpoint(run)
    bar.close()


# -- the end -----------------------------------------------------------------------------------------------

def finish(run: TrainRun) -> dict:
    """Checkpoint, save the head (``--save-dtype``), load it back as inference does and evaluate it: the ``final``
    metrics row (also returned)."""
    args = run.args
    save_checkpoint(run)
    train_seconds = run.elapsed_before + time.time() - run.t_loop
    save_eagle_head(run.head, run.out, dtype=getattr(torch, args.save_dtype))
    # final numbers with the saved (possibly bf16) weights as loaded by the inference loader
    run.head = load_eagle_head(run.out, run.tcfg, target_embed=run.emb_w.float(), dtype=torch.float32,
                               device=str(run.dev))
    final = run_val(run)
    final.update(kind="final", step=run.step, train_seconds=round(train_seconds, 1),
                 total_seconds=round(time.time() - run.t_start, 1), saved_dtype=args.save_dtype)
    last_train = [r for r in read_jsonl(run.metrics_path) if r.get("kind") == "train"][-1:]
    if last_train:
        final.update({f"final_train_{k}": last_train[0][k] for k in ("loss", "vloss", "ploss")})
    log_row(run, final)
    save_loss_plot(run.metrics_path, run.out / "loss_curve.png")
    return final


def train_eagle(args) -> int:
    """``train`` (``--arch eagle``): train an EAGLE-1/2 head and save it in EAGLE layout; 2 on unusable data."""
    run = prepare_run(args)
    if run is None:
        return 2
    resume_or_start(run)
    train_loop(run)
    final = finish(run)
    print(json.dumps(final), file=sys.stderr)
    return 0
