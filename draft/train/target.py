"""The target model as the trainers see it: device choice, the default checkpoint, model and tokenizer loading,
and its embedding / output matrices read straight from the safetensors files.

Invariants: ``resolve_device("auto")`` is CUDA when available, else CPU; :func:`load_target` returns the model in
eval mode on the device; :func:`read_target_embeddings` loads no model (it reads two tensors) and returns the
embedding matrix as ``lm_head`` when the target ties them or has no ``lm_head.weight``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

Tensor = torch.Tensor


def resolve_device(name: str) -> torch.device:
    """``name`` as a device; ``"auto"``: CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_target() -> Path:
    """The embedded default checkpoint (SmolLM2-135M-Instruct), unpacked on first use."""
    from model.default_model import ensure_default_checkpoint
    return ensure_default_checkpoint()


def load_target(target_dir: str | Path, device, dtype=torch.float32):
    """The target as a transformers causal LM in ``dtype``, on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(target_dir: str | Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(target_dir))


def read_target_embeddings(target_dir: str | Path) -> tuple[Tensor, Tensor]:
    """``(embed_tokens.weight, lm_head.weight)`` read straight from the target's safetensors files."""
    from safetensors import safe_open
    from transformers import AutoConfig
    target_dir = Path(target_dir)
    cfg = AutoConfig.from_pretrained(str(target_dir))
    idx = target_dir / "model.safetensors.index.json"
    if idx.is_file():
        weight_map = json.loads(idx.read_text())["weight_map"]
    else:
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}

    def get(name):
        with safe_open(str(target_dir / weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    emb = get("model.embed_tokens.weight")
    lm = emb if (getattr(cfg, "tie_word_embeddings", False) or "lm_head.weight" not in weight_map) \
        else get("lm_head.weight")
    return emb, lm
