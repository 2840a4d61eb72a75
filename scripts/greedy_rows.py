"""Rows for the what-if simulators without running the pipeline: HF greedy answers of the unsplit model.

At T = 0 every mode's answer equals HF ``generate(do_sample=False)`` (the acceptance test of the suite), so
these rows are what any mode would record; ``pipeline.tools.simulate`` / ``pipeline.tools.tp_sim`` replay them.

    python -m scripts.greedy_rows --out rows.jsonl --max-new-tokens 96       # record 30 of the six datasets
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from config.paths import REPO


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write pipeline-style rows (prompt_ids, output_ids) of HF greedy "
                                            "answers, one per dataset, for pipeline.tools.simulate / pipeline.tools.tp_sim.",
                                epilog="Example: python -m scripts.greedy_rows --out rows.jsonl --max-new-tokens 96")
    p.add_argument("--model", default=str(REPO / "checkpoints" / "SmolLM2-135M-Instruct"), help="HF checkpoint")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"), help="folder of <dataset>/question.jsonl")
    p.add_argument("--record", type=int, default=30, help="record index taken from every dataset")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-chars", type=int, default=600)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model_dir, data = Path(args.model), Path(args.data)
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir} is not a Hugging Face checkpoint", file=sys.stderr)
        return 2
    datasets = sorted(d.name for d in data.iterdir() if (d / "question.jsonl").is_file()) if data.is_dir() else []
    if not datasets:
        print(f"error: no <dataset>/question.jsonl under {data}", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.prompts import chat_prompt_ids, stop_token_ids
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen_cfg = model_dir / "generation_config.json"
    stop = sorted(stop_token_ids(tok, json.loads(gen_cfg.read_text()) if gen_cfg.is_file() else {}))
    with open(args.out, "w", encoding="utf-8") as f:
        for ds in datasets:
            recs = [json.loads(l) for l in (data / ds / "question.jsonl").read_text().splitlines() if l.strip()]
            rec = recs[min(args.record, len(recs) - 1)]
            ids = chat_prompt_ids(tok, [rec["turns"][0][:args.max_prompt_chars]], [])
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=stop,
                                     pad_token_id=stop[0])
            f.write(json.dumps({"question_id": rec.get("question_id"), "dataset": ds, "mode": "hf_greedy",
                                "temperature": 0.0, "prompt_ids": ids,
                                "output_ids": out[0, len(ids):].tolist()}) + "\n")
    print(f"wrote {len(datasets)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
