"""Do seeded sampled answers reproduce? The same prompts, seed and settings, loaded and generated ``--runs`` times
per mode; every run's answers compared with the first run's (docs/results.md §101).

Why: a seeded answer is a function of the prompt, the seed and the target's logits (``pipeline.verify``, "Draw
first"), but the logits are not bit-identical from run to run in the pipelined modes: a node's row is computed in a
stage segment whose rows follow the schedule, and a matmul over another number of rows rounds differently. What
matters is whether the draw is robust to that noise. ``--rule cdf`` replaces ``Sampler.pick`` by the rule it had
before 2026-11-30 (the inverse CDF of one uniform) to measure the difference in the same run.

Each run loads the split anew (:class:`pipeline.api.FlowSpec`: the ranks' code on threads, as a new process would)
and answers every prompt in turn. With ``--lanes N``, the first run still answers them one at a time, and every later
run answers them all at once on ``N`` lanes (``FlowSpec.generate_many``: a stage computes several lanes' segments in
one forward, so the rows of a segment change again): the rows then say whether a request served among others gets
its answer alone.

Example::

    python -m scripts.seeded_repro --stage-dir checkpoints/SmolLM2-135M-Instruct/stages_0+8+8+7+7 \\
        --modes naive,pruned,continuous --runs 6 --temperature 1.0 --seed 7 --max-new-tokens 48

Prints one markdown row per mode and rule; exit 0 (a measurement, not a check), 2 for bad input.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from config.invocation import prog

PROMPTS = ("Write a short story about a robot.", "Explain photosynthesis in two sentences.",
           "List three prime numbers and why.")


def inverse_cdf_pick(sampler, p: torch.Tensor) -> int:
    """``Sampler.pick`` before 2026-11-30: token ``i`` owns ``[c_(i-1), c_i)`` of the cumulative sum, one uniform."""
    c = torch.cumsum(p.double(), 0)
    i = int(torch.searchsorted(c, c[-1:] * sampler.uniform(), right=True)[0])
    return i if i < c.numel() else int(torch.nonzero(p).max())


def run_mode(stage_dir: str, mode: str, args) -> list[list[list[int]]]:
    from pipeline.api import FlowSpec
    runs = []
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    for i in range(args.runs):
        lanes = args.lanes if i > 0 else 1        # --lanes: the reference alone, then every prompt at once
        with FlowSpec.load(stage_dir, f"mode={mode}", *args.overrides, lanes=lanes) as fs:
            runs.append([o.ids for o in fs.generate_many(args.prompts, **settings)])
    return runs


def row(mode: str, rule: str, runs: list[list[list[int]]], seconds: float, lanes: int = 1) -> str:
    same = sum(r == runs[0] for r in runs[1:])
    answers = sum(a != b for r in runs[1:] for a, b in zip(r, runs[0]))
    return (f"| {mode}{f', {lanes} lanes' if lanes > 1 else ''} | {rule} | {len(runs)} | {same} of {len(runs) - 1} | {answers} of "
            f"{(len(runs) - 1) * len(runs[0])} | {seconds:.0f} |")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog("scripts.seeded_repro"), description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("Example::")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage-dir", required=True, help="a split (split_and_save_models.py's output)")
    ap.add_argument("--modes", default="naive,pruned,continuous", help="comma-separated tree modes")
    ap.add_argument("--rules", default="race,cdf", help="race (today's Sampler.pick), cdf (the inverse CDF before)")
    ap.add_argument("--runs", type=int, default=6, help="loads and generations per mode and rule (at least 2)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--lanes", type=int, default=1,
                    help="> 1: the runs after the first answer every prompt at once on this many lanes")
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS), help="prompt texts (default: three)")
    ap.add_argument("overrides", nargs="*", help="key=value run keys for every load")
    args = ap.parse_args(argv)
    rules = args.rules.split(",")
    if args.runs < 2 or args.temperature <= 0 or any(r not in ("race", "cdf") for r in rules) \
            or not 1 <= args.lanes <= 64:
        ap.error("--runs must be at least 2, --temperature above 0, --rules of race and cdf, --lanes 1 to 64")
    from config.run_config import is_run_key
    words = [p for p in args.prompts if is_run_key(p)]
    if words:   # argparse hands key=value words after --prompts to it (nargs="+"): a run key read as a prompt
        ap.error(f"{words[0]!r} reads as a prompt: put key=value run keys before --prompts")
    args.rules = rules
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from config.errors import UserError
    from pipeline.verify import Sampler
    race = Sampler.pick
    print("| mode | rule | runs | runs equal to the first | answers that differ | seconds |")
    print("|---|---|---|---|---|---|")
    try:
        for mode in args.modes.split(","):
            for rule in args.rules:
                Sampler.pick = race if rule == "race" else inverse_cdf_pick
                t0 = time.monotonic()
                runs = run_mode(args.stage_dir, mode, args)
                print(row(mode, rule, runs, time.monotonic() - t0, args.lanes), flush=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        Sampler.pick = race
    return 0


if __name__ == "__main__":
    sys.exit(main())
