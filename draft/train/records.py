"""The data builder's JSONL records as training input: reading, the filter for usable conversations, the
shuffled order the held-out split is cut from, and token lists as a padded tensor (shared by the EAGLE-1/2 and
EAGLE-3 trainers).

A record holds ``input_ids`` (the conversation's tokens) and ``loss_mask`` (1 on the assistant's tokens), as
written by :func:`draft.train.generate.build_conversations`.

Invariants: :func:`load_records` keeps the files' order and drops records with fewer than 3 tokens or with no
trained token among the first ``max_len`` (entry ``t`` learns ``loss_mask[t+1]``, so ``loss_mask[0]`` never
counts); :func:`held_out_order` depends on ``(n, seed, val_count, val_frac)`` only; :func:`pad_batch` pads on the
right, so row ``i`` starts with ``seqs[i]``.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]


def load_records(paths: list[str], max_len: int) -> list[dict]:
    """The records of every file in ``paths`` (concatenated in order) that can train a head at ``max_len``."""
    records = [r for path in paths for r in read_jsonl(path)]
    return [r for r in records if sum(r["loss_mask"][1:max_len]) > 0 and len(r["input_ids"]) >= 3]


def held_out_order(n: int, seed: int, val_count: int | None, val_frac: float) -> tuple[list[int], int]:
    """``(order, n_val)``: the record indices shuffled by ``random.Random(seed)`` and how many of the first are
    held out (``val_count``, else ``max(1, round(n * val_frac))``; each trainer clamps it to its own rule)."""
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    n_val = val_count if val_count is not None else max(1, int(round(n * val_frac)))
    return order, n_val


def pad_batch(seqs: list[list[int]], pad: int = 0) -> torch.Tensor:
    """``[len(seqs), max len]`` long tensor of the sequences, right-padded with ``pad``."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out
