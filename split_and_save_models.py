"""Command line of the stage splitter (the library is ``model/split.py``; stage format: ``model/stage_format.py``).

::

    python split_and_save_models.py --model <hf_checkpoint_dir | default> --out <stage_root> \\
        (--split 0+8+8+7+7 | --stages N | --tp N) [--dtype float32|float16|bfloat16] [--force]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model.split import DTYPE_NAMES, read_config, split_checkpoint
from model.stage_format import StageDirError, even_split, parse_split


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Split a Hugging Face LLaMA-family checkpoint (llama, mistral, qwen2, qwen3; safetensors or .bin, "
                    "sharded or not) into FlowSpec pipeline "
                    "stages: stage 0 is the draft stage (embedding + lm_head, no layers), stages 1.. hold the "
                    "decoder layers.",
        epilog="Example: python split_and_save_models.py --model default --split 0+8+8+7+7 "
               "--out checkpoints/SmolLM2-135M-Instruct/stages_0+8+8+7+7; "
               "tensor-parallel: python split_and_save_models.py --model default --tp 3 --out stages_tp3  (modes tp/galaxy)")
    ap.add_argument("--model", required=True,
                    help="HF checkpoint directory (safetensors or .bin, single or sharded), or 'default' for the "
                         "embedded SmolLM2-135M-Instruct (converted on first use)")
    ap.add_argument("--out", required=True, help="stage root directory to write")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--split", help="layers per stage with a leading 0 for the draft stage, e.g. 0+8+8+7+7")
    g.add_argument("--stages", type=int, help="number of layer stages; layers are split near-evenly")
    g.add_argument("--tp", type=int, metavar="N",
                   help="tensor-parallel split for modes tp/galaxy: rank 0 = draft stage, ranks 1..N each hold every "
                        "layer at 1/N of the heads and FFN width (N must divide the attention heads); launch N+1 "
                        "ranks, e.g. --tp 3 --out stages_tp3 then pipeline.tools.launch --nproc_per_node=4 ... mode=tp")
    ap.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="output dtype (default: keep source dtype)")
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = ap.parse_args(argv)

    from model.default_model import DefaultModelError

    try:
        if args.model == "default":
            from model.default_model import ensure_default_checkpoint

            model_dir = ensure_default_checkpoint()
        else:
            model_dir = Path(args.model)
        if args.tp is not None:
            from model.tp_split import split_checkpoint_tp
            out = split_checkpoint_tp(model_dir, args.out, args.tp, dtype=args.dtype, force=args.force,
                                      progress=not args.no_progress)
            print(f"wrote a tensor-parallel split: rank 0 + {args.tp} TP shards to {out}")
            return 0
        if args.split is not None:
            split = parse_split(args.split)
        else:
            split = even_split(read_config(model_dir)["num_hidden_layers"], args.stages)
        out = split_checkpoint(model_dir, args.out, split, dtype=args.dtype, force=args.force,
                               progress=not args.no_progress)
    except (StageDirError, ValueError, FileNotFoundError, DefaultModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(split)} stages ({'+'.join(map(str, split))}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
