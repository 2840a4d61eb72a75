"""What every draft-head format shares: the error type, reading a head directory, and a head config derived
from the target's. Below both :mod:`draft.eagle` (EAGLE-1/2) and :mod:`draft.eagle3`; neither imports the other.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from config.errors import UserError


class HeadError(UserError, ValueError):
    """A draft head that is missing, unreadable or does not fit the target."""


def head_config_from_target(target_config, bias: bool = True):
    """A head config derived from the target's: same widths, one layer."""
    d = target_config.to_dict()
    for key in ("stage_index", "num_stages", "split", "layer_range", "has_embedding", "has_lm_head",
                "has_final_norm", "quantization_config", "source_model"):
        d.pop(key, None)
    d.update(num_hidden_layers=1, bias=bias, architectures=["LlamaForCausalLM"])
    if isinstance(d.get("layer_types"), list):      # Qwen2/Qwen3/Mistral configs list one type per layer
        d["layer_types"] = d["layer_types"][:1]
    cfg = type(target_config).from_dict(d)
    cfg._attn_implementation = "sdpa"
    return cfg


def init_head_weights(head: nn.Module, std: float, g: torch.Generator) -> nn.Module:
    """Random head weights: norms 1, biases 0, everything else N(0, std) drawn from ``g`` in parameter order."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
    return head


def write_head(out_dir: str | Path, cfg: dict, state: dict[str, torch.Tensor], extra_config: dict | None,
               dtype: torch.dtype | None) -> Path:
    """A head directory: ``config.json`` (``cfg``, its ``torch_dtype`` set when ``dtype`` is given, then
    ``extra_config``) and ``model.safetensors`` (``state``, its floating tensors cast to ``dtype`` when given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    cfg.update(extra_config or {})
    cfg.pop("_attn_implementation_autoset", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def read_head_weights(head_dir: Path) -> dict[str, torch.Tensor]:
    st, binf = head_dir / "model.safetensors", head_dir / "pytorch_model.bin"
    try:
        if st.is_file():
            return load_file(str(st))
        if binf.is_file():
            return torch.load(str(binf), map_location="cpu", weights_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]     # torch.load's refusal is a page long
        raise HeadError(f"cannot read draft head weights in {head_dir} (safetensors, or a .bin read with "
                        f"torch.load(weights_only=True)): {first}") from None
    raise HeadError(f"{head_dir} has neither model.safetensors nor pytorch_model.bin")


def read_head_config(head_dir: str | Path) -> dict | None:
    """The raw ``config.json`` of a head directory, or None when there is none / it is unreadable."""
    p = Path(head_dir) / "config.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def is_eagle3_config(raw: dict | None) -> bool:
    if not raw:
        return False
    arch = " ".join(raw.get("architectures") or [])
    return "draft_vocab_size" in raw or "eagle3" in arch.lower() or "eagle_config" in raw


def assign_weights(head: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, rotary_paths: list[str],
                   config, where: Path) -> nn.Module:
    """Make the tensors of ``state`` the parameters of ``head`` (built on the meta device), floating ones cast to
    ``dtype`` one at a time, then rebuild the rotary embeddings at ``rotary_paths`` (non-persistent buffers) from
    ``config``.

    Why: building a 7B target's head with random float32 weights first and copying the file into them costs
    about 1.5 GiB that rank 0 never uses (measured in the 7B rehearsal, docs/results.md section 21). Invariant:
    nothing of the head is left on the meta device (else :class:`HeadError`); no tensor is shared with the
    caller's (the target's embedding is copied: training a head must never write into the target)."""
    owned = {}
    for k, v in state.items():
        v = v.detach()
        owned[k] = v.to(dtype, copy=True) if v.is_floating_point() else v.clone()
    head.load_state_dict(owned, strict=False, assign=True)
    for path in rotary_paths:     # the class the head was built with (model.light's or transformers')
        parent, _, name = path.rpartition(".")
        owner = head.get_submodule(parent) if parent else head
        setattr(owner, name, type(getattr(owner, name))(config=config))
    left = [n for n, t in list(head.named_parameters()) + list(head.named_buffers()) if t.is_meta]
    if left:
        raise HeadError(f"draft head {where}: {left[:3]} were not in the checkpoint")
    return head
