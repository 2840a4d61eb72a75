"""Optional bitsandbytes quantization of a stage's linear layers (8-bit or 4-bit nf4/fp4)."""
from __future__ import annotations

import torch
from torch import nn

QUANT_MODES = ("none", "int8", "nf4", "fp4")


def quantize_linears(module: nn.Module, mode: str, compute_dtype: torch.dtype, device: str) -> None:
    """Replace every ``nn.Linear`` below ``module`` by its bitsandbytes counterpart, in place."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quant {mode!r}; choose from {QUANT_MODES}")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise RuntimeError("quant needs bitsandbytes: pip install bitsandbytes") from None
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            bias = child.bias is not None
            if mode == "int8":
                q = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias, has_fp16_weights=False,
                                        threshold=6.0)
                q.weight = bnb.nn.Int8Params(child.weight.data.to(torch.float16).cpu(), requires_grad=False,
                                             has_fp16_weights=False)
            else:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=bias, compute_dtype=compute_dtype,
                                      quant_type=mode)
                q.weight = bnb.nn.Params4bit(child.weight.data.to(torch.float16).cpu(), requires_grad=False,
                                             quant_type=mode)
            if bias:
                q.bias = nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            setattr(module, name, q.to(device))
        else:
            quantize_linears(child, mode, compute_dtype, device)
