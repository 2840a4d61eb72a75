"""The recorded run: its rows, the generation being replayed, and the target model's features.

**Why a recorded answer fixes the schedule.** Given the committed text (``prompt_ids`` + ``output_ids``):

* a drafted child is accepted iff its token is the next committed token: at T = 0 by definition, and at T > 0
  because the multi-candidate rule removes a rejected child's token from the residual (``pipeline/verify.py``),
  so a committed token that equals a drafted child was that child's acceptance;
* the draft trees depend only on committed tokens and the target's features at them, which one forward of the
  target over prompt + output provides (:class:`TargetFeatures`).

So a replay needs only the rows (:func:`load_rows`), the generation being replayed (:class:`Committed`, which
the stand-ins of :mod:`.stand_ins` and the replay drafter of :mod:`.drafter` read) and the recorded run's model
(:func:`load_target`: rank 0's stage for the drafter and the vocabulary, and the unsplit layers for the
features). Feature values come from one full forward rather than the pipeline's tree forwards, so a draft
near-tie can rarely flip (the summary shows the recorded τ beside the replayed one).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


def load_rows(paths: list[str], temperature: str, limit: int) -> list[dict]:
    """The rows of ``paths`` (JSONL with ``prompt_ids`` and ``output_ids``), in file order: those of
    ``temperature`` (``"all"``: every row), at most ``limit`` per file (0: all). A torn last line (an interrupted
    sweep) is skipped; any other bad line is a :class:`ValueError` naming file and line."""
    rows = []
    for path in paths:
        got = []
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    continue        # a torn last line of an interrupted sweep
                raise ValueError(f"{path}:{i + 1} is not a JSON line") from None
            if "prompt_ids" not in r or "output_ids" not in r:
                raise ValueError(f"{path}:{i + 1} has no prompt_ids/output_ids (not a pipeline row)")
            if temperature != "all" and float(r.get("temperature", 0)) != float(temperature):
                continue
            got.append(r)
            if limit and len(got) >= limit:
                break
        rows += got
    return rows


class Committed:
    """The generation being replayed: ``seq`` = prompt + output ids, ``features[p]`` = the target's feature at p."""

    seq: list[int] = []
    features: torch.Tensor | None = None


class TargetFeatures:
    """The unsplit target's final normalized hidden states (EAGLE's features), from the stage checkpoints; with
    ``taps`` (EAGLE-3: :func:`draft.eagle3.stage_taps`) followed by those layers' outputs as extra columns, exactly
    the rows the last stage sends rank 0 in a real run."""

    def __init__(self, stage_root: Path, dtype=torch.float32, taps: list[int] | tuple = ()) -> None:
        from model.stage_format import read_manifest
        from model.stage_model import load_stage
        world = len(read_manifest(stage_root)["split"])
        self.stages = [load_stage(stage_root, r, world, dtype) for r in range(1, world)]   # layer stages
        for m in self.stages:
            m.set_taps(list(taps))
        self.dtype = dtype
        self.taps = list(taps)
        self.num_layers = self.stages[-1].config.layer_range[1]

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids])
        for m in self.stages:
            cache = m.block.new_cache(len(ids), self.dtype, "cpu") if m.block is not None else None
            pos, mask = (cache.context_inputs(len(ids), self.dtype) if cache is not None else
                         (torch.arange(len(ids))[None], None))
            x = m(x, pos, mask, cache)
        return x[0]


@dataclass
class ReplayTarget:
    """The recorded run's model as a replay needs it (:func:`load_target`)."""

    stage_root: Path              # the split checkpoint
    world: int                    # ranks of its split (rank 0 + layer stages)
    dtype: torch.dtype
    model0: torch.nn.Module       # rank 0's stage: embedding and lm_head (the drafter's, and the vocabulary)
    features: TargetFeatures

    @property
    def vocab_size(self) -> int:
        return self.model0.config.vocab_size

    @property
    def hidden_bytes(self) -> int:
        """Bytes of one hidden row of the real model (for profiles that count real payloads)."""
        return self.model0.config.hidden_size * torch.empty(0, dtype=self.dtype).element_size()


def load_target(cfg, device: str = "cpu") -> ReplayTarget:
    """Load ``cfg``'s split checkpoint (``model.stage_dir``, default: the embedded model) for replays: rank 0's
    stage on ``device`` and the target's features. ``device="cuda"`` without CUDA is a :class:`ValueError`."""
    from config.paths import DEFAULT_STAGE_DIR
    from model.stage_format import read_manifest
    from model.stage_model import DTYPES
    from pipeline.build import load_rank_stage

    stage_root = Path(cfg.model.stage_dir or DEFAULT_STAGE_DIR)
    world = len(read_manifest(stage_root)["split"])
    dtype = DTYPES[cfg.model.dtype]
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available")
    model0 = load_rank_stage(cfg, stage_root, 0, world, dtype, device)   # with its EAGLE-3 taps, as pipeline.run
    return ReplayTarget(stage_root, world, dtype, model0, TargetFeatures(stage_root, dtype, model0.taps))
