"""One-process HF ``generate`` on the prompts ``pipeline.run`` would ask: the single-device baseline a pipeline is
judged against (the FlowSpec-speed issue's GPU-host goal: ``continuous`` faster than HF ``generate`` on the same GPU).

``python -m pipeline.tools.hf_generate --prompts-file data/mt_bench/question.jsonl --end 8 --output hf.jsonl
device=cuda max_new_tokens=128``

* **Same prompts.** The first turn of each record, built as ``pipeline.run`` builds it (the stage-0 tokenizer, chat
  template, ``gen.system_prompt``, ``--template``), or ``--prompt-ids``. Same stop ids, ``max_new_tokens``,
  ``device``, ``dtype``; at ``temperature`` > 0 HF samples with the same temperature / top-p / top-k and seed.
* **Same model.** The unsplit checkpoint the stage manifest names as its ``source`` (``--model DIR`` for another).
* **Same clock.** As in ``pipeline.engine.timed_generation``: ``prefill_s`` ends when the first new token is known
  (the streamer's first ``put`` of a generated token; ``put`` reads the token to the host, i.e. waits for the
  GPU), ``decode_s`` runs from there to the last token. So ``new_tokens / decode_s`` counts the same n tokens over
  the same n - 1 forwards as every pipeline mode does, prefill excluded.
* **Same rows.** One JSON line per generation with ``pipeline.run``'s row fields (mode ``hf_generate``, world size
  1, ``tau`` 1), so ``pipeline.tools.bench --hf-generate`` aggregates it beside the pipeline modes and checks it
  against ``ar`` at T = 0.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from config.errors import UserError, exit_status
from config.invocation import prog

MODE = "hf_generate"


class HFBaselineError(UserError, RuntimeError):
    """Bad input; ``main`` prints it, like every other :class:`UserError` (a bad override or prompt), as one line."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.hf_generate"),
        description="Time one-process HF generate (the unsplit model on one device) on the prompts pipeline.run "
                    "would ask, and write rows in pipeline.run's format (mode hf_generate).",
        epilog="Extra key=value words are config overrides (config/run_config.py): device, dtype, max_new_tokens, "
               "temperature, model.stage_dir... Example: python -m pipeline.tools.hf_generate --prompts-file "
               "data/mt_bench/question.jsonl --end 8 --output outputs/hf.jsonl device=cuda max_new_tokens=128")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument("--prompts-file", help="FastChat question.jsonl (first turns are asked)")
    p.add_argument("--begin", type=int, default=None, help="first record of --prompts-file (0-based)")
    p.add_argument("--end", type=int, default=None, help="end record (exclusive)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a raw prompt as comma-separated token ids")
    p.add_argument("--template", default="auto", help="chat template, as pipeline.run's --template")
    p.add_argument("--model", help="unsplit checkpoint (default: the stage manifest's source)")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations of the first prompt (default: 1)")
    p.add_argument("--output", required=True, help="rows JSONL (appended)")
    p.add_argument("--quiet", action="store_true", help="no per-generation lines")
    return p.parse_intermixed_args(argv)


class _FirstTokenClock:
    """HF streamer: the time each generated token reached the host (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        value.tolist()  # the token on the host: the step that made it has finished
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def timed_hf_generation(model, prompt_ids: list[int], gen, stop_ids: set[int], device) -> dict:
    """Generate once; return output ids, prefill_s and decode_s by ``timed_generation``'s clock."""
    import torch
    ids = torch.tensor([prompt_ids], device=device)
    clock = _FirstTokenClock()
    sample = gen.temperature > 0
    kw = dict(do_sample=True, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k or None) if sample \
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if sample:
        torch.manual_seed(gen.seed)
    stops = sorted(stop_ids)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen.max_new_tokens,
                             eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, streamer=clock,
                             **kw)
    t_end = time.perf_counter()
    new = out[0, len(prompt_ids):].tolist()
    first = clock.times[0] if clock.times else t_end
    return {"output_ids": new, "prefill_s": first - t0, "decode_s": (clock.times[-1] if clock.times else t_end) - first}


def main(argv=None) -> int:
    args = parse_args(argv)
    return exit_status(lambda: _main(args))


def _main(args) -> int:
    from config.run_config import DEFAULT, apply_overrides
    from model.prompts import chat_prompt_ids, eos_ids, prompt_records, stop_token_ids
    cfg = apply_overrides(DEFAULT, args.overrides)
    if bool(args.prompts_file) == bool(args.prompt_ids):
        raise HFBaselineError("give --prompts-file FILE or --prompt-ids (one of the two)")
    records = prompt_records(args.prompt_ids, args.prompts_file, args.begin, args.end)
    if not records:
        raise HFBaselineError("no prompts in the given range")

    from model.default_model import resolve_stage_root
    stage_root = resolve_stage_root(cfg.model.stage_dir)
    manifest_path = stage_root / "manifest.json"
    if not manifest_path.is_file():
        raise HFBaselineError(f"{stage_root} has no manifest.json (not a split checkpoint)")
    model_dir = Path(args.model or json.loads(manifest_path.read_text()).get("source") or "")
    if not (model_dir / "config.json").is_file():
        raise HFBaselineError(f"unsplit checkpoint {model_dir} not found: pass --model DIR")

    import torch
    from transformers import AutoModelForCausalLM

    from model.stage_model import DTYPES
    from pipeline.build import generation_config, load_tokenizer
    device = cfg.model.device
    if device == "cuda" and not torch.cuda.is_available():
        raise HFBaselineError("device=cuda but CUDA is not available")
    torch.set_num_threads(max(1, cfg.model.num_threads))
    gen_cfg = generation_config(stage_root)
    tokenizer = None if args.prompt_ids else load_tokenizer(stage_root)
    stop_ids = stop_token_ids(tokenizer, gen_cfg) if tokenizer is not None else eos_ids(gen_cfg)

    def prompt(rec) -> list[int]:
        if tokenizer is None:
            return list(rec["turns"][0])
        return chat_prompt_ids(tokenizer, rec["turns"][:1], [], cfg.gen.system_prompt, args.template)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[cfg.model.dtype]).to(device).eval()
    prompts = [prompt(r) for r in records]
    keep = cfg.gen.max_new_tokens
    for _ in range(args.warmup):  # as pipeline.run's warm-up: first prompt, <= 32 new tokens, not recorded
        cfg.gen.max_new_tokens = min(32, keep)
        timed_hf_generation(model, prompts[0], cfg.gen, stop_ids, device)
    cfg.gen.max_new_tokens = keep
    with open(args.output, "a", encoding="utf-8") as out:
        for rec, ids in zip(records, prompts):
            res = timed_hf_generation(model, ids, cfg.gen, stop_ids, device)
            n = len(res["output_ids"])
            text = "" if tokenizer is None else tokenizer.decode(
                [t for t in res["output_ids"] if t not in stop_ids], skip_special_tokens=True)
            row = {"question_id": rec.get("question_id"), "category": rec.get("category"), "turn": 0, "mode": MODE,
                   "temperature": cfg.gen.temperature, "prompt_ids": ids, "output_ids": res["output_ids"],
                   "text": text, "new_tokens": n, "rounds": n, "tau": 1.0, "accept_lengths": [],
                   "pipeline_steps": 0, "prefill_s": round(res["prefill_s"], 6), "decode_s": round(res["decode_s"], 6),
                   "tokens_per_s": round(n / res["decode_s"], 3) if res["decode_s"] > 0 else None,
                   "busy_fraction": [], "world_size": 1, "device": device, "dtype": cfg.model.dtype,
                   "model_dir": str(model_dir)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            if not args.quiet:
                print(f"[hf_generate] q{row['question_id']}: {n} tokens, {row['tokens_per_s'] or 0:.1f} tok/s",
                      file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
