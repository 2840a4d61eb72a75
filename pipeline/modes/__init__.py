"""Decoding modes: each is a small rank-0 strategy; the verification stages run the same worker loop.

The registry maps every mode name of :mod:`config.modes` to a factory; :func:`new_decoder` makes a fresh
decoder for each generation, so strategy objects (``PrunedMode``, ``ContinuousMode``, ``PipeDecMode``) never
carry per-generation state (the expansion's draft inputs, a quick-start flag) from one generation, request or
thread into another.
"""
from __future__ import annotations

from typing import Callable

from pipeline.engine import Decoder
from pipeline.modes.ar import ar_decode
from pipeline.modes.flowspec import ContinuousMode, PrunedMode
from pipeline.modes.naive import naive_decode
from pipeline.modes.pipedec import PipeDecMode
from pipeline.modes.sps import sps_decode
from pipeline.modes.tp import make_tp_decode

REGISTRY: dict[str, Callable[[], Decoder]] = {
    "ar": lambda: ar_decode,
    "naive": lambda: naive_decode,
    "pruned": lambda: PrunedMode().decode,
    "pipedec": lambda: PipeDecMode().decode,
    "continuous": lambda: ContinuousMode().decode,
    "sps": lambda: sps_decode,
    "tp": lambda: make_tp_decode("tp"),
    "galaxy": lambda: make_tp_decode("galaxy"),
}


def new_decoder(mode: str) -> Decoder:
    """A fresh decoder of ``mode`` for one generation (``KeyError`` for a name :mod:`config.modes` lacks:
    configuration is validated before any decoder is made)."""
    return REGISTRY[mode]()
