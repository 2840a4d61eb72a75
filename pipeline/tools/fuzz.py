"""Randomised exactness check: greedy output of sampled run-key combinations equals plain decoding.

``python -m pipeline.tools.fuzz --trials 40 --seed 0 model.stage_dir=/tmp/s260``

The suite checks every mode against HF ``generate`` with each drafting and schedule key mostly at its default, one
key at a time; the keys interact (a suffix chain deeper than the head's levels under a confidence shape, an early
whole send after a fused commit with a one-node segment budget, ...), and a protocol bug that only one combination
reaches passes every fixed test. This tool draws combinations:

* **A trial** (:func:`draw_trial`, seeded: trial ``i`` of seed ``s`` is the same draw whatever ``--trials`` is) is a
  tree mode, a drafter (``--heads``: by default the split's own head, the noisy oracle at several noise levels, so
  acceptance ranges from every node to almost none, and the untrained head) and each key of :data:`SPACE` set
  with probability ``--p`` to one of its listed values (else left at its default).
* **The check** (:func:`run_trial`): the split loads into one process (:class:`pipeline.api.FlowSpec`, the real
  ranks' code on threads) with the trial's ``key=value`` words and answers every prompt; each answer must equal the
  reference: HF ``generate(do_sample=False)`` on the unsplit model the stage manifest names (``--reference hf``),
  or mode ``ar`` on the same split (``--reference ar``, no transformers model). Generations of one trial share the
  drafter's memory of earlier requests, as a server's do.
* **At T > 0** (``--temperature``, seeded with ``--seed``): a seeded answer of a deterministic draft is a function
  of the prompt, the seed and the target's logits only, the same on any schedule and tree shape
  (:mod:`pipeline.verify`, "Draw first"), so every trial's answer must equal mode ``naive``'s with the default keys
  and the same seed (``ar`` draws another stream, for HF parity). The law itself is the exact-law tests' job
  (``tests/test_sampling.py``, which also enumerates drawn combinations).
* **With several requests at once** (``--lanes N``): a trial loads with ``lanes=N`` and answers every prompt at
  once (:meth:`pipeline.api.FlowSpec.generate_many`: the generations interleave on the ring and a stage computes
  several lanes' segments in one forward); each answer must still equal its reference.
* **Through launched ranks** (``--launch``): a trial runs as a real job instead (``pipeline.run`` on one process per
  rank through the project's launcher, the gloo transport between them, ``--prompt-ids`` and ``--output``), so the
  multi-process transports, the direct decision links and the stages' processes are under the same draws; slower
  (every trial starts its processes). A job that refuses the combination (exit 2: the launcher's check, or a
  rank's setup, refused it with one line) is ``rejected``; any other failure (a lost rank, a timeout, a non-zero
  exit) a ``crash`` with its last line.
* **Verdicts**: ``exact``; ``rejected`` (the configuration or the setup refused the combination with one clear
  error while loading, a :class:`config.errors.UserError`, or a generation's settings with a
  :class:`pipeline.api.GenerationError`; counted, not a failure); ``mismatch`` (first differing position,
  both tokens, and with the HF reference the target's logit gap between them there: a gap within ``--tie`` is a
  float near-tie of the two tokens, reported as ``tie`` and not a failure); ``crash`` (any other exception).
  Every trial is one JSON line in ``--out`` with the words that reproduce it
  (``./run_pipe.sh model.stage_dir=... <words>``).

Exit status: 0 when no trial is a mismatch or a crash, 1 otherwise, 2 for bad input (one line).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from config.errors import UserError, exit_status
from config.invocation import prog

MODES = ("naive", "pruned", "continuous", "pipedec")
OWN = "own"            # --heads: the split's own head (model.head_dir left as the base words set it)

# Each key's values: its default among them, the bounds of its range, and the values that switch a mechanism on or
# off. Only keys that may change trees or the schedule (never the output): what exactness is about.
SPACE: dict[str, tuple] = {
    "draft.sources": ("eagle", "eagle,lookup", "eagle,suffix", "eagle,lookup,suffix", "eagle,recycle",
                      "eagle,lookup,recycle"),
    "draft.tree_shape": ("eagle2", "confidence"),
    "draft.shape_cover": (0.5, 0.9, 1.0),
    "draft.shape_max_depth": (0, 2, 9),
    "draft.suffix_max_depth": (0, 2, 12),
    "draft.suffix_threshold": (1, 3, 6),
    "draft.suffix_other_threshold": (1, 8),
    "draft.lookup_max_ngram": (1, 3, 5),
    "draft.lookup_max_matches": (1, 8),
    "tree.total_token": (2, 8, 60),
    "tree.depth": (1, 3, 5, 8),
    "tree.top_k": (1, 3, 10),
    "tree.init_total_token": (2, 12, 80),
    "tree.init_depth": (1, 3, 6),
    "tree.init_topk": (1, 4, 10),
    "tree.subseq_token": (1, 4, 16),
    "tree.first_levels": (0, 1, 2, 3),
    "tree.expand_total_token": (0, 10, 64),
    "tree.expand_depth": (1, 6),
    "tree.expand_topk": (1, 10),
    "tree.expand_subseq_token": (-1, 1, 8),
    "tree.expand_levels": (0, 1, 2, 3),
    "tree.lookahead_min_prob": (0.0, 0.1),
    "tree.ahead_levels": (0, 1, 2),
    "tree.fuse_commit": (False, True),
    "tree.prefetch_level": (False, True),
    "tree.early_level": (False, True),
    "tree.early_whole": (0, 4, 80),
    "tree.early_cover": (0.5, 1.0),
    "tree.early_split": (0, 2, 3),
    "tree.root_first": (False, True),
    "tree.pipedec_topk": (1, 4, 16),
    "tree.budget": ("", "edge_orin_7b"),
    "model.graphs": ("off", "on"),
    "model.draft_vocab": (-1, 0, 64),
    "osd.enabled": (False, True),
}


class FuzzError(UserError, ValueError):
    """Bad input to the tool (one line, exit 2)."""


def word(key: str, value) -> str:
    """``key=value`` as the command line takes it (booleans lower case)."""
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"


@dataclass
class Trial:
    index: int
    mode: str
    head: str
    keys: dict                             # the drawn keys of SPACE and their values (the rest at their defaults)
    verdict: str = ""
    detail: str = ""
    prompts: int = 0
    tau: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def words(self) -> list[str]:
        """The trial as ``key=value`` words: the mode, the head (none for :data:`OWN`), then :attr:`keys`."""
        return ([f"mode={self.mode}"] + ([] if self.head == OWN else [f"model.head_dir={self.head}"])
                + [word(k, v) for k, v in self.keys.items()])

    def row(self) -> dict:
        return {"trial": self.index, "mode": self.mode, "head": self.head, "words": self.words,
                "verdict": self.verdict, "detail": self.detail, "prompts": self.prompts,
                "tau": [round(t, 3) for t in self.tau], "seconds": round(self.seconds, 2)}


def draw_trial(seed: int, index: int, heads: list[str], p: float, modes=MODES) -> Trial:
    """Trial ``index`` of ``seed``: its own generator (``random.Random(f"{seed}/{index}")``), so a trial does not
    depend on how many were drawn before it. A mode, a head, then each key of :data:`SPACE` in its listed order set
    with probability ``p`` to one of its values."""
    rng = random.Random(f"{seed}/{index}")
    mode = rng.choice(list(modes))
    head = rng.choice(heads)
    keys = {}
    for key, values in SPACE.items():
        if rng.random() < p:
            keys[key] = rng.choice(values)
    return Trial(index, mode, head, keys)


def first_difference(ref: list[int], got: list[int]) -> int | None:
    """The first position where two answers differ (a shorter answer differs where it ends), or None if equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


class References:
    """Each prompt's reference answer, computed once: HF ``generate(do_sample=False)`` on the unsplit model, or
    mode ``ar`` through the split; at T > 0 mode ``naive``'s seeded answer at the default keys. :meth:`gap`: the
    target's logit of ``want`` minus that of ``got`` after ``prefix`` (HF reference only; None otherwise), to tell a
    float near-tie from a protocol bug."""

    def __init__(self, kind: str, stage_dir: Path, base_words: list[str], max_new_tokens: int,
                 temperature: float = 0.0, seed: int = 0) -> None:
        self.kind = "naive" if temperature > 0 else kind      # at T > 0: the module docstring's seeded reference
        self.stage_dir, self.max_new, self.temperature, self.seed = stage_dir, max_new_tokens, temperature, seed
        self.base_words = base_words
        self._answers: dict[tuple, list[int]] = {}
        self._model = None
        self._pipeline = None             # the split in mode ``kind`` (ar / naive references), loaded once

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def _hf(self):
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            from model.stage_format import read_manifest
            source = read_manifest(self.stage_dir).get("source")
            if not source or not Path(source).is_dir():
                raise FuzzError(f"--reference hf needs the unsplit model the manifest of {self.stage_dir} names "
                                f"(source: {source!r}); use --reference ar")
            self._model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        return self._model

    def answer(self, prompt: list[int], stop_ids: list[int]) -> list[int]:
        key = (tuple(prompt), tuple(sorted(stop_ids)))
        if key not in self._answers:
            if self.kind == "hf":
                import torch
                model, stops = self._hf(), sorted(stop_ids)
                with torch.no_grad():
                    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                         dtype=torch.long), do_sample=False, max_new_tokens=self.max_new,
                                         eos_token_id=stops, pad_token_id=stops[0])
                self._answers[key] = out[0, len(prompt):].tolist()
            else:
                if self._pipeline is None:
                    from pipeline.api import FlowSpec
                    self._pipeline = FlowSpec.load(self.stage_dir, *self.base_words, f"mode={self.kind}",
                                                   template="raw")
                self._answers[key] = self._pipeline.generate(prompt, max_new_tokens=self.max_new,
                                                             temperature=self.temperature, seed=self.seed).ids
        return list(self._answers[key])

    def gap(self, prefix: list[int], want: int, got: int) -> float | None:
        if self.kind != "hf":
            return None
        import torch
        with torch.no_grad():
            logits = self._hf()(torch.tensor([prefix])).logits[0, -1]
        return float(logits[want] - logits[got])


def run_trial(trial: Trial, stage_dir: Path, base_words: list[str], prompts: list[list[int]], refs: References,
              max_new_tokens: int, tie: float, lanes: int = 1) -> Trial:
    """Load the split with the trial's words, answer every prompt (``lanes`` > 1: all at once), compare with the
    references (module docstring: the verdicts)."""
    from pipeline.api import FlowSpec, GenerationError
    t0 = time.perf_counter()
    fs = None
    try:
        try:
            fs = FlowSpec.load(stage_dir, *base_words, *trial.words, template="raw", lanes=lanes)
        except UserError as e:          # the configuration or the setup refused the combination
            trial.verdict, trial.detail = "rejected", str(e).splitlines()[0][:300]
            return trial
        settings = dict(max_new_tokens=max_new_tokens, temperature=refs.temperature, seed=refs.seed)
        outs = fs.generate_many(prompts, **settings) if lanes > 1 else None
        for n, prompt in enumerate(prompts):
            out = outs[n] if outs is not None else fs.generate(prompt, **settings)
            ref = refs.answer(prompt, fs.stop_ids)
            trial.prompts += 1
            trial.tau.append(out.stats.tau)
            if not _compare(trial, n, prompt, ref, out.ids, refs, tie):
                return trial
        trial.verdict = "exact"
    except GenerationError as e:        # a generation's own settings refused (e.g. a prompt the context cannot hold)
        trial.verdict, trial.detail = "rejected", str(e).splitlines()[0][:300]
    except Exception as e:   # noqa: BLE001 -- every other exception is what the tool looks for (a lost peer or a
        # stage's protocol error during a generation too: they are UserErrors for the command line, crashes here)
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        first = str(e).splitlines()[0][:240] if str(e) else ""
        trial.verdict, trial.detail = "crash", f"{type(e).__name__}: {first}{where}"
    finally:
        trial.seconds = time.perf_counter() - t0
        if fs is not None:
            try:
                fs.close()
            except Exception:   # noqa: BLE001 -- a crashed pipeline may not close cleanly; the verdict stands
                pass
    return trial


def launched_answers(stage_dir: Path, words: list[str], prompts: list[list[int]], settings: dict,
                     timeout_s: float) -> tuple[list[list[int]] | None, int, str]:
    """``(answers in prompt order, or None, the job's exit status, its last stderr line)`` of one
    ``pipeline.run`` job over ``prompts`` (token ids) with ``words`` and the generation ``settings``, every rank a
    process (:func:`pipeline.tools.ranks.job_command`)."""
    import os
    import subprocess
    import tempfile

    from model.stage_format import read_manifest
    from pipeline.tools.ranks import job_command
    world = len(read_manifest(stage_dir)["split"])
    with tempfile.TemporaryDirectory(prefix="fuzz-launch-") as tmp:
        out = Path(tmp) / "rows.jsonl"
        args = [f"model.stage_dir={stage_dir}", *words, *(f"{k}={v}" for k, v in settings.items()),
                *(a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))), "--output", str(out),
                "--quiet"]
        try:
            job = subprocess.run(job_command(world, args), capture_output=True, text=True, timeout=timeout_s,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
        except subprocess.TimeoutExpired:
            return None, -1, f"the job ran past {timeout_s:g} s"
        lines = [ln for ln in job.stderr.splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else ""
        if job.returncode != 0 or not out.exists():
            return None, job.returncode, last
        rows = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
    by_prompt = {tuple(r["prompt_ids"]): r["output_ids"] for r in rows}
    return [by_prompt.get(tuple(p)) for p in prompts], 0, last


def run_trial_launched(trial: Trial, stage_dir: Path, base_words: list[str], prompts: list[list[int]],
                       refs: References, max_new_tokens: int, tie: float, stop_ids: list[int],
                       timeout_s: float = 600.0) -> Trial:
    """:func:`run_trial` through launched ranks (module docstring, ``--launch``)."""
    t0 = time.perf_counter()
    try:
        settings = {"max_new_tokens": max_new_tokens, "temperature": refs.temperature, "seed": refs.seed}
        answers, code, last = launched_answers(stage_dir, [*base_words, *trial.words], prompts, settings, timeout_s)
        if answers is None:   # exit 2: a user error (a refused key, or a setup a rank refused: config.errors)
            refused = code == 2
            trial.verdict = "rejected" if refused else "crash"
            trial.detail = (last if refused else f"exit {code}: {last}")[:300]
            return trial
        for n, (prompt, got) in enumerate(zip(prompts, answers)):
            if got is None:
                trial.verdict, trial.detail = "crash", f"prompt {n}: no row in --output"
                return trial
            ref = refs.answer(prompt, stop_ids)
            trial.prompts += 1
            if not _compare(trial, n, prompt, ref, got, refs, tie):
                return trial
        trial.verdict = "exact"
    finally:
        trial.seconds = time.perf_counter() - t0
    return trial


def _compare(trial: Trial, n: int, prompt: list[int], ref: list[int], got: list[int], refs: References,
             tie: float) -> bool:
    """True when ``got`` equals ``ref``; else the trial's verdict (``tie`` or ``mismatch``) and detail are set."""
    i = first_difference(ref, got)
    if i is None:
        return True
    want = ref[i] if i < len(ref) else None
    tok = got[i] if i < len(got) else None
    gap = refs.gap(prompt + ref[:i], want, tok) if want is not None and tok is not None else None
    # a near-tie either way; a reference token far below the answer's is no tie (a wrong reference: a mismatch)
    trial.verdict = "tie" if gap is not None and abs(gap) < tie else "mismatch"
    trial.detail = (f"prompt {n}: position {i}: reference {want}, got {tok}"
                    + (f", logit gap {gap:.3g}" if gap is not None else ""))
    return False


FAILURES = ("mismatch", "crash")


def summary(trials: list[Trial]) -> str:
    """The verdict counts per mode as a Markdown table, then one line per failing trial with its words."""
    verdicts = ("exact", "rejected", "tie", "mismatch", "crash")
    lines = ["| mode | " + " | ".join(verdicts) + " |", "|---" * (len(verdicts) + 1) + "|"]
    for mode in sorted({t.mode for t in trials}) + ["all"]:
        ts = [t for t in trials if mode in ("all", t.mode)]
        lines.append(f"| {mode} | " + " | ".join(str(sum(t.verdict == v for t in ts)) for v in verdicts) + " |")
    text = "\n".join(lines)
    bad = [t for t in trials if t.verdict in FAILURES]
    for t in bad:
        text += f"\n{t.verdict} (trial {t.index}): {t.detail}\n  words: {' '.join(t.words)}"
    return text


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.fuzz"), formatter_class=DefaultsOnce,
        description="Draw run-key combinations (mode, drafter, tree.* and draft.* keys) and check that every "
                    "greedy answer equals plain decoding (HF generate on the unsplit model, or mode ar).",
        epilog="Example: python -m pipeline.tools.fuzz --trials 40 --seed 0 --out fuzz.jsonl "
               "model.stage_dir=/tmp/s260   (a stories260K split; the default: the default model's split)")
    p.add_argument("overrides", nargs="*", help="key=value words every trial starts from (model.stage_dir=...)")
    p.add_argument("--trials", type=int, default=20, help="combinations to draw")
    p.add_argument("--first", type=int, default=0, help="index of the first trial (rerun one: --first 7 --trials 1)")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed")
    p.add_argument("--p", type=float, default=0.35, help="probability that a key of the space is set in a trial")
    p.add_argument("--modes", default=",".join(MODES), help="tree modes to draw from")
    p.add_argument("--heads", default="", help=f"comma-separated model.head_dir values to draw from, {OWN!r} for "
                   "the split's own head (default: that, the noisy oracle of the manifest's source at noise 0, 1 and "
                   "3, and the untrained head)")
    p.add_argument("--prompts", type=int, default=2, help="prompts, the same in every trial (token ids drawn "
                   "from the vocabulary with --seed, after the model's BOS)")
    p.add_argument("--prompt-len", type=int, default=12, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=40, help="new tokens per answer")
    p.add_argument("--reference", choices=("hf", "ar"), default="hf", help="hf: HF generate on the unsplit model "
                   "the stage manifest names; ar: mode ar on the same split")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled answers, seeded with --seed, each "
                   "checked against mode naive's with the default keys (a seeded answer does not depend on the tree)")
    p.add_argument("--tie", type=float, default=1e-4, help="a mismatch where the two tokens' logits differ by less "
                   "is a float near-tie, not a failure (HF reference only)")
    p.add_argument("--lanes", type=int, default=1, help="> 1: every trial answers its prompts at once on this "
                   "many lanes (FlowSpec.load(lanes=N).generate_many), each answer still checked")
    p.add_argument("--launch", action="store_true", help="run every trial as a launched job (one process per "
                   "rank, the real transports) instead of in one process")
    p.add_argument("--out", help="write every trial as a JSON line here")
    args = p.parse_args(argv)
    if args.trials < 1 or args.first < 0 or args.prompts < 1 or args.prompt_len < 1 or args.max_new_tokens < 1:
        p.error("--trials, --prompts, --prompt-len and --max-new-tokens must be >= 1 and --first >= 0")
    if not 0 <= args.p <= 1:
        p.error("--p must be in [0, 1]")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if not 1 <= args.lanes <= 64:
        p.error("--lanes must be in [1, 64]")
    if args.launch and args.lanes > 1:
        p.error("--launch runs one request at a time (a launched pipeline.run job); drop --lanes")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes takes tree modes among {', '.join(MODES)}")
    return args


def _setup(args):
    """The split, the words every trial starts from, its heads and its prompts."""
    import torch

    from config.paths import DEFAULT_STAGE_DIR
    from config.run_config import DEFAULT, apply_overrides
    from model.stage_format import StageDirError, read_manifest
    cfg = apply_overrides(DEFAULT, list(args.overrides))          # a bad word: one ConfigError line
    stage_dir = Path(cfg.model.stage_dir or DEFAULT_STAGE_DIR)
    try:
        manifest = read_manifest(stage_dir)
    except (StageDirError, OSError, ValueError) as e:
        raise FuzzError(f"no usable split checkpoint at {stage_dir}: {str(e).splitlines()[0][:200]}") from None
    source = manifest.get("source") or ""
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    if not heads:
        if not source or not Path(source).is_dir():
            raise FuzzError(f"the manifest of {stage_dir} names no unsplit model to build the oracle from "
                            f"(source: {source!r}); give --heads")
        heads = [OWN, f"oracle:{source}", f"oracle@1:{source}", f"oracle@3:{source}", "untrained"]
    config = json.loads((stage_dir / "stage_model_0" / "config.json").read_text())
    vocab, bos = int(config["vocab_size"]), config.get("bos_token_id")
    g = torch.Generator().manual_seed(args.seed)
    prompts = [([int(bos)] if isinstance(bos, int) else [])
               + torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    return stage_dir, list(args.overrides), heads, prompts


def _stop_ids(stage_dir: Path, base: list[str]) -> list[int]:
    """The split's stop token ids, as a launched ``pipeline.run`` derives them (its tokenizer's, else the
    generation config's)."""
    from pipeline.api import FlowSpec
    with FlowSpec.load(stage_dir, *base, "mode=ar", template="raw") as fs:
        return sorted(fs.stop_ids)


def run(args) -> int:
    stage_dir, base, heads, prompts = _setup(args)
    refs = References(args.reference, stage_dir, base, args.max_new_tokens, args.temperature, args.seed)
    out = open(args.out, "a") if args.out else None
    trials = []
    stop_ids = _stop_ids(stage_dir, base) if args.launch else None
    try:
        for k in range(args.first, args.first + args.trials):
            trial = draw_trial(args.seed, k, heads, args.p, args.modes)
            if args.launch:
                t = run_trial_launched(trial, stage_dir, base, prompts, refs, args.max_new_tokens, args.tie, stop_ids)
            else:
                t = run_trial(trial, stage_dir, base, prompts, refs, args.max_new_tokens, args.tie, args.lanes)
            trials.append(t)
            tau = f", tau {sum(t.tau) / len(t.tau):.2f}" if t.tau else ""
            print(f"[fuzz] trial {k} ({len(trials)}/{args.trials}) {t.verdict}{tau} in {t.seconds:.1f} s: "
                  f"{' '.join(t.words)}" + (f"\n       {t.detail}" if t.detail else ""), file=sys.stderr, flush=True)
            if out is not None:
                out.write(json.dumps(t.row()) + "\n")
                out.flush()
    finally:
        refs.close()
        if out is not None:
            out.close()
    print(summary(trials))
    return 1 if any(t.verdict in FAILURES for t in trials) else 0


def main(argv=None) -> int:
    return exit_status(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
