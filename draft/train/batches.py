"""Batches of training conversations: right-padded token ids, loss masks and target features (from the target on
the fly, from feature shards, or from a cache filled on first use), and the deterministic batch order of an epoch.

Invariants: :meth:`ConversationBatches.make` returns the teacher-forcing entries of
:func:`draft.train.objective.sequence_batch` whatever the feature source (shards and on-the-fly features agree up
to the stored dtype; cached ones are fp16); :func:`epoch_batches` depends only on its arguments (a resumed run
sees the same order), returns full batches only, and uses each training index at most once per epoch.
"""
from __future__ import annotations

import random

import torch

from draft.train.features import FeatureStore, target_features
from draft.train.objective import sequence_batch
from draft.train.records import pad_batch

Tensor = torch.Tensor


class ConversationBatches:
    """Right-padded batches of conversations, with features from a target run on the fly or from shards.

    ``cache`` (``"cpu"`` or ``"device"``) keeps each conversation's features (fp16) after their first use,
    so later epochs skip the target forward.
    """

    def __init__(self, records: list[dict], max_len: int, device, target=None, store: FeatureStore | None = None,
                 record_ids: list[int] | None = None, feat_dtype=torch.float32, cache: str = "none") -> None:
        self.records, self.max_len, self.device = records, max_len, device
        self.target, self.store, self.feat_dtype = target, store, feat_dtype
        self.record_ids = record_ids if record_ids is not None else list(range(len(records)))
        self.cache_where = None if cache == "none" else (device if cache == "device" else torch.device("cpu"))
        self.cache: dict[int, Tensor] = {}

    def make(self, idx: list[int]) -> dict:
        seqs = [self.records[i]["input_ids"][:self.max_len] for i in idx]
        masks = [self.records[i]["loss_mask"][:self.max_len] for i in idx]
        ids = pad_batch(seqs).to(self.device)
        mask = pad_batch(masks).to(self.device)
        if self.cache_where is not None and all(i in self.cache for i in idx):
            feats = torch.zeros(len(idx), ids.shape[1], self.cache[idx[0]].shape[-1], dtype=self.feat_dtype,
                                device=self.device)
            for j, i in enumerate(idx):
                f = self.cache[i]
                feats[j, :f.shape[0]] = f.to(self.device, self.feat_dtype)
        elif self.store is not None:
            feats = torch.zeros(len(idx), ids.shape[1], self.store_hidden(idx[0]), dtype=self.feat_dtype)
            for j, i in enumerate(idx):
                f = self.store.get(self.record_ids[i])[:self.max_len]
                feats[j, :f.shape[0]] = f.to(self.feat_dtype)
            feats = feats.to(self.device)
        else:
            feats = target_features(self.target, ids).to(self.feat_dtype)
        if self.cache_where is not None:
            for j, i in enumerate(idx):
                if i not in self.cache:
                    self.cache[i] = feats[j, :len(seqs[j])].to(self.cache_where, torch.float16)
        return sequence_batch(ids, feats, mask)

    def store_hidden(self, i: int) -> int:
        return self.store.get(self.record_ids[i]).shape[-1]


def require_full_batch(n_train: int, batch_size: int) -> None:
    """One clear error instead of an epoch with no batch (:func:`epoch_batches` drops incomplete batches, so
    fewer training conversations than ``batch_size`` would make every epoch empty: an IndexError in the
    EAGLE-1/2 loop, an endless loop in the EAGLE-3 one)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if n_train < batch_size:
        raise ValueError(f"{n_train} training conversations are fewer than --batch-size {batch_size}: "
                         f"lower --batch-size or add data")


def epoch_batches(train_idx: list[int], lengths: list[int], batch_size: int, seed: int, epoch: int,
                  bucket: int = 64) -> list[list[int]]:
    """The batches of one epoch (deterministic in ``seed, epoch``, so a resumed run sees the same order).

    With ``bucket > 1`` conversations of similar length share batches: a shuffled window of
    ``bucket * batch_size`` conversations is sorted by length, cut into batches, and all batches are
    shuffled again. Incomplete trailing batches are dropped.
    """
    rng = random.Random(seed * 1000 + epoch)
    perm = list(train_idx)
    rng.shuffle(perm)
    n = len(perm) // batch_size * batch_size
    if bucket <= 1:
        return [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    out = []
    win = bucket * batch_size
    for w in range(0, n, win):
        part = sorted(perm[w:min(w + win, n)], key=lambda i: lengths[i])
        out += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    rng.shuffle(out)
    return out
