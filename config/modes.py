"""The decoding modes by name: the one list every config check, tool and report reads.

``pipeline/modes/__init__.py`` maps each name to its strategy (``tests/test_architecture.py`` checks the two
agree); this module holds only names and labels, so configuration and tools need not import the decoder.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModeInfo:
    name: str          # the config value (``mode=continuous``)
    label: str         # the method's name in papers and reports
    compared: bool     # one of the five pipeline methods every benchmark compares side by side
    needs_tp_split: bool = False   # runs only on a tensor-parallel split (``split_and_save_models.py --tp``)


MODE_INFO: tuple[ModeInfo, ...] = (
    ModeInfo("ar", "PP-AR", True),
    ModeInfo("naive", "Chunk-PP", True),
    ModeInfo("pruned", "Pruned-PP", True),
    ModeInfo("pipedec", "PipeDec", True),
    ModeInfo("continuous", "FlowSpec", True),
    ModeInfo("sps", "SpS", False),
    ModeInfo("tp", "TP", False, needs_tp_split=True),
    ModeInfo("galaxy", "Galaxy", False, needs_tp_split=True),
)
MODES: tuple[str, ...] = tuple(m.name for m in MODE_INFO)
# The mode that runs when nobody chooses one: FlowSpec. On the edge testbed it is the fastest of the compared
# modes (docs/results.md, the headline table); on a one-host CPU run every speculative mode loses to ``ar``.
DEFAULT_MODE = "continuous"
COMPARED_MODES: tuple[str, ...] = tuple(m.name for m in MODE_INFO if m.compared)   # ar, naive, pruned, pipedec, continuous
TP_MODES: tuple[str, ...] = tuple(m.name for m in MODE_INFO if m.needs_tp_split)
MODE_LABELS: dict[str, str] = {m.name: m.label for m in MODE_INFO}
MODE_ALIASES: dict[str, str] = {"flowspec": "continuous"}   # the paper's name for the method


def canonical_mode(name: str) -> str:
    """A mode name as the code knows it: ``"flowspec"`` -> ``"continuous"`` (any case); other names unchanged
    (an unknown one is left for the caller's check to report)."""
    key = name.strip()
    return MODE_ALIASES.get(key.lower(), key)


def label(mode: str) -> str:
    """``"continuous"`` -> ``"FlowSpec"``; an unknown name is shown as itself."""
    return MODE_LABELS.get(mode, mode)
