"""One pipeline stage: optional embedding, a block of decoder layers, optional final norm / lm_head."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from model.layers import LayerBlock, block_classes, family_classes
from model.light import embedding
from model.stage_format import (STAGE_FIELDS, SUPPORTED_FAMILIES, WEIGHTS, StageDirError,  # noqa: F401
                                check_world, iter_safetensors, stage_dir, verify_stage_file)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


class SliceLinear(nn.Linear):
    """rank 0's ``lm_head``: a plain ``Linear`` that reads only the first ``in_features`` columns, so rows that
    carry tapped-layer features as extra columns (EAGLE-3, see :meth:`StageModel.set_taps`) go through unchanged
    (a no-op for ordinary ``[.., H]`` rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            x = x[..., :self.in_features]
        return super().forward(x)


class StageModel(nn.Module):
    """Rank ``r``'s slice of the base model.

    Rank 0 (draft stage) has ``embed_tokens`` (for the draft head) and ``lm_head``, no layers.
    Rank 1 embeds token ids; the last rank applies the final norm, so it emits the normalized
    hidden states that are both the ``lm_head`` input and EAGLE's feature.

    Feature taps (EAGLE-3, :meth:`set_taps`): rows travel as ``[.., H * (1 + m)]``: the first ``H`` columns are
    the hidden state, then the outputs of the ``m`` tapped layers already passed, in layer order. A stage runs
    its layers (and the final norm) on the first ``H`` columns only, passes the extra columns through untouched
    and appends the outputs of the tapped layers it holds. With no taps nothing changes (``[.., H]`` rows).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.rank = config.stage_index
        self.num_stages = config.num_stages
        start, end = config.layer_range
        self.num_layers = end - start
        _, _, norm_cls = block_classes(config)
        h = config.hidden_size
        self.embed_tokens = embedding(config.vocab_size, h) if config.has_embedding else None
        self.block = LayerBlock(config, self.num_layers) if self.num_layers else None
        self.norm = norm_cls(h, eps=config.rms_norm_eps) if config.has_final_norm else None
        self.lm_head = SliceLinear(h, config.vocab_size, bias=False) if config.has_lm_head else None
        self.set_taps([])

    def set_taps(self, layers: list[int]) -> None:
        """Tap the outputs of global decoder layers ``layers`` (every rank gets the same list, e.g. from
        :func:`draft.eagle3.stage_taps`). Invariant: :attr:`out_width` = ``H * (1 + taps before this stage's
        end)``, the width of every row this stage emits."""
        start, end = self.config.layer_range
        self.taps = sorted(int(i) for i in layers)
        self.local_taps = [i - start for i in self.taps if start <= i < end]
        self.out_width = self.config.hidden_size * (1 + sum(1 for i in self.taps if i < end))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """``x``: token ids ``[1, n]`` on the first layer stage, hidden ``[1, n, H]`` elsewhere."""
        if self.rank == 1:
            x = self.embed_tokens(x)
        h = self.config.hidden_size
        extra = None
        if x.shape[-1] != h:                       # tapped features of earlier stages ride along
            x, extra = x[..., :h], x[..., h:]
        tapped: list[torch.Tensor] = []
        if self.block is not None:
            x = self.block(x, positions, mask, cache, self.local_taps, tapped)
        if self.norm is not None:
            x = self.norm(x)
        if extra is None and not tapped:
            return x
        return torch.cat([x] + ([extra] if extra is not None else []) + tapped, dim=-1)


def load_stage_config(root: str | Path, rank: int, hf: bool = False):
    """Stage ``rank``'s config: a :class:`model.light.LightConfig` (no transformers import) where
    :func:`model.light.light_ok` accepts it, else (or with ``hf``) the transformers config of its folder."""
    from model.light import LightConfig, light_ok
    path = stage_dir(root, rank) / "config.json"
    if not path.is_file():
        raise StageDirError(f"{path} is missing")
    raw = json.loads(path.read_text())
    missing = [f for f in STAGE_FIELDS if f not in raw]
    if missing:
        raise StageDirError(f"{path} lacks stage fields {missing}: not written by split_and_save_models.py")
    config = LightConfig(raw)
    if raw.get("model_type") not in SUPPORTED_FAMILIES:
        family_classes(config)      # raises UnsupportedModel: one line naming the supported families
    if hf or not light_ok(config):
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(stage_dir(root, rank))
        for f in STAGE_FIELDS:
            setattr(config, f, raw[f])
    return config


def load_weights(model: torch.nn.Module, root: str | Path, rank: int, dtype: torch.dtype, what: str,
                 rename=None) -> None:
    """Stage ``rank``'s weights become ``model``'s parameters themselves (``model`` was built on the meta device: no
    random weights materialised), each tensor read from the file one at a time and already in ``dtype``
    (:func:`model.stage_format.iter_safetensors`): the rank's resident set is the stage's weights plus one tensor,
    not two copies of the stage. ``rename``: a file name to the model's (names as in ``model/stage_format.py``).
    StageDirError (one line, ``what`` names the stage): an unreadable file, or names that do not match the model's."""
    path = stage_dir(root, rank) / WEIGHTS
    try:
        state = {rename(k) if rename else k: v for k, v in iter_safetensors(path, dtype)}
    except StageDirError:
        raise
    except Exception as e:  # an unreadable file
        raise StageDirError(f"cannot read {path}: {e}") from None
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise StageDirError(f"{what} weights do not match its config: missing {missing[:4]} "
                            f"unexpected {unexpected[:4]}")
    model.load_state_dict(state, strict=True, assign=True)


def load_stage(root: str | Path, rank: int, world_size: int, dtype: torch.dtype = torch.float32,
               device: str = "cpu", verify: bool = True, quant: str = "none",
               quant_compute_dtype: torch.dtype | None = None) -> StageModel:
    """Load rank ``rank``'s stage from a split checkpoint, checking manifest, world size and checksum."""
    manifest = check_world(root, world_size)
    if verify:
        verify_stage_file(root, manifest, rank)
    config = load_stage_config(root, rank)
    if config.stage_index != rank:
        raise StageDirError(f"{stage_dir(root, rank)} holds stage {config.stage_index}, expected {rank}")
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = StageModel(config)
    load_weights(model, root, rank, dtype, f"stage {rank}", lambda k: "block." + k if k.startswith("layers.") else k)
    if model.block is not None:  # rotary buffers were created on meta; rebuild them (same class: light or not)
        model.block.rotary_emb = type(model.block.rotary_emb)(config=config)
    model = model.to(dtype=dtype)
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:
        raise StageDirError(f"stage {rank}: {on_meta[:3]} were not loaded from {path}")
    if quant != "none" and model.block is not None:
        from model.quant import quantize_linears
        quantize_linears(model.block, quant, quant_compute_dtype or dtype, device)
        model.block.refresh_lean()   # quantized projections run through bitsandbytes' own modules
    return model.to(device).eval()
