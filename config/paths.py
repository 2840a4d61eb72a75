"""Where things live in a checkout: the one definition of the repository's folders.

Every module that needs a path under the repository imports it from here (none computes
``Path(__file__).parent.parent`` itself), so moving a module never changes where it looks.
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKPOINTS = REPO / "checkpoints"          # converted default model and its stage roots
OUTPUTS = REPO / "outputs"                  # default results folders of the tools
PROFILE_DIR = REPO / "profiles"             # builtin emulation profiles (profiles/*.json)
HEADS = REPO / "draft" / "heads"            # shipped draft heads, one folder per target model
DATA = REPO / "data"                        # eval datasets (<dataset>/question.jsonl) and prompt lists

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_SPLIT = "0+8+8+7+7"
DEFAULT_STAGE_DIR = CHECKPOINTS / DEFAULT_MODEL_NAME / f"stages_{DEFAULT_SPLIT}"
DEFAULT_HEAD_DIR = HEADS / DEFAULT_MODEL_NAME

# the six evaluation sets (data/<set>/question.jsonl; data/prepare.py builds them), in the order tables show them
DATASETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
DATASET_LABELS = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "Alpaca",
                  "sum": "CNN/DM", "qa": "NaturalQ"}
