"""Load any draft head directory: EAGLE-1/2 (:mod:`draft.eagle`) or EAGLE-3 (:mod:`draft.eagle3`), by its config."""
from __future__ import annotations

from pathlib import Path

import torch

from draft.eagle import EagleHead, load_eagle_head
from draft.eagle3 import Eagle3Head, load_eagle3_head
from draft.head_io import is_eagle3_config, read_head_config


def load_draft_head(head_dir: str | Path, target_config, target_embed: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, device: str = "cpu") -> EagleHead | Eagle3Head:
    """The head in ``head_dir``, checked against the target; an EAGLE-3 config (``draft_vocab_size`` /
    ``eagle_config``) gives an :class:`Eagle3Head`, anything else an :class:`EagleHead`. Any mismatch or
    unreadable file is one :class:`HeadError` (a missing ``config.json``: :func:`draft.eagle.load_eagle_head`'s)."""
    if is_eagle3_config(read_head_config(head_dir)):
        return load_eagle3_head(head_dir, target_config, target_embed, dtype, device)
    return load_eagle_head(head_dir, target_config, target_embed, dtype, device)
