"""Train an EAGLE-1/2 draft head for a target model by self-distillation.

Three subcommands (``python -m draft.train_eagle SUBCOMMAND --help``)::

    data      prompts -> conversations answered by the target itself (JSONL: token ids + loss mask)
    features  optional: precompute the target's features as fp16/bf16 safetensors shards
    train     train the head with EAGLE's objective and save it in EAGLE layout (load_eagle_head reads it)

Prompts come from FastChat ``question.jsonl`` files, ShareGPT-style JSON(L), plain text (one prompt a
line) and/or ``--self-prompts N``: prompts built offline from the topic lists of
draft/train/prompt_lists.json, most of them written by the target itself (questions, instructions, news
paragraphs to summarise, ...), the rest templated instructions, arithmetic word problems and coding tasks.

Conventions (the same as :mod:`draft.drafter` at inference): the target's *feature* ``f_t`` is its final
normalized hidden state at position ``t`` (what ``lm_head`` consumes). Head entry ``t`` pairs
``token[t+1]`` with ``f_t`` at position ``t``; its output predicts ``f_{t+1}`` and ``lm_head`` of it
predicts ``token[t+2]``.
"""
# This module is the command line only (parser + dispatch; its docstring is the --help text). The work lives in
# draft/train/ (one module per concern: see draft/train/__init__.py) and draft/train_eagle3.py (--arch eagle3).
from __future__ import annotations

import argparse
import sys

from config.errors import exit_status
from config.invocation import prog
from draft.eagle import HeadError
from draft.train.dataset import cmd_data
from draft.train.eagle_loop import train_eagle
from draft.train.features import cmd_features


def cmd_train(args) -> int:
    """``train``: ``--arch eagle3`` goes to :func:`draft.train_eagle3.train_eagle3`, else the EAGLE-1/2 loop."""
    if args.unroll_steps < 1:
        raise ValueError(f"--unroll-steps must be >= 1, got {args.unroll_steps}")
    if args.unroll_decay <= 0:
        raise ValueError(f"--unroll-decay must be > 0, got {args.unroll_decay}")
    if args.eval_steps is None:   # default: report the unrolled steps when training them
        args.eval_steps = args.unroll_steps if args.unroll_steps > 1 else 0
    if args.eval_steps < 0:
        raise ValueError(f"--eval-steps must be >= 0, got {args.eval_steps}")
    if args.anchor_decay < 0:
        raise ValueError(f"--anchor-decay must be >= 0, got {args.anchor_decay}")
    if args.anchor_decay and not args.init_from:
        raise ValueError("--anchor-decay pulls toward the starting head: give it with --init-from HEAD")
    if args.anchor_decay and args.arch == "eagle3":
        raise ValueError("--anchor-decay is for --arch eagle")
    if args.arch == "eagle3" and args.unroll_steps != 1:
        raise ValueError("--unroll-steps is for --arch eagle; EAGLE-3 heads unroll with --ttt-steps")
    if getattr(args, "arch", "eagle") == "eagle3":
        from draft.train_eagle3 import train_eagle3
        return train_eagle3(args)
    return train_eagle(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog("draft.train_eagle"), description=__doc__,
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
                   help="add N prompts built from the topic lists of draft/train/prompt_lists.json, mostly "
                        "written by the target")
    d.add_argument("--broad", type=int, default=0, metavar="N",
                   help="add N prompts of broader kinds (translation, summarisation, RAG with quotes, extraction, "
                        "math, code, multi-turn, role-play; draft/train/broad_prompts.py), passages written by the target")
    d.add_argument("--translate", type=int, default=0, metavar="N",
                   help="add N translation prompts made from the answers of --translate-from (English sentences "
                        "-> French/Spanish/German/Italian/Portuguese; answers to those -> back into English; "
                        "draft/train/translation_prompts.py)")
    d.add_argument("--translate-from", default=None, metavar="DATA.jsonl",
                   help="a file this subcommand wrote (its DATA.prompts.jsonl beside it), the source of --translate")
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
    t.add_argument("--anchor-decay", type=float, default=0.0, metavar="S",
                   help="with --init-from: after every step pull the weights toward the starting head by lr x S of "
                        "their distance (L2-SP as a decoupled decay: against forgetting on a small replay set)")
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
    t.add_argument("--unroll-steps", type=int, default=1, metavar="K",
                   help="eagle: train K unrolled draft steps, each fed the head's own predicted feature (training-time "
                        "test as in HASS/EAGLE-3; 1 = teacher forcing only, the default)")
    t.add_argument("--unroll-decay", type=float, default=0.8, help="eagle: loss weight of unrolled step j is DECAY**j")
    t.add_argument("--eval-steps", type=int, default=None, metavar="K",
                   help="eagle: validation reports top-1 agreement of K unrolled draft steps (0 = off; default: "
                        "--unroll-steps when > 1, else 0)")
    t.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="eagle3: reduced draft vocabulary of the N most frequent training tokens (0 = full)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(lambda: args.func(args), HeadError, ValueError, FileNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
