"""Optional bitsandbytes quantization of a stage's linear layers (8-bit or 4-bit nf4/fp4)."""
from __future__ import annotations

import logging

import torch
from torch import nn

QUANT_MODES = ("none", "int8", "nf4", "fp4")


class _DropCastNotice(logging.Filter):
    """bitsandbytes logs "MatMul8bitLt: inputs will be cast ... to float16" on *every* int8 matmul with
    float32 inputs (the documented behaviour of its int8 path); keep it out of the ranks' stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()


def quantize_linears(module: nn.Module, mode: str, compute_dtype: torch.dtype, device: str) -> None:
    """Replace every ``nn.Linear`` below ``module`` by its bitsandbytes counterpart, in place."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quant {mode!r}; choose from {QUANT_MODES}")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise RuntimeError("quant needs bitsandbytes: pip install bitsandbytes") from None
    bnb_log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropCastNotice) for f in bnb_log.filters):
        bnb_log.addFilter(_DropCastNotice())
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
