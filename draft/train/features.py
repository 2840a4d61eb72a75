"""Target features for training: the target's final normalized hidden states (what its ``lm_head`` consumes),
computed on the fly or precomputed by the ``features`` subcommand into safetensors shards.

Shard layout (``OUT/index.json`` + ``features-00000.safetensors`` ...): each shard holds ``features`` (the
records' rows concatenated, ``[sum(L_i), H]``), ``offsets`` (``[n + 1]``, record ``j``'s rows are
``offsets[j]:offsets[j+1]``) and ``records`` (the record indices in the data file).

Invariants: row ``t`` of a record's features is ``f_t`` for ``input_ids[t]`` (at most ``max_len`` rows); a shard
is written to a temporary name and renamed, so an existing shard is complete (``--resume`` skips it).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from draft.train.records import pad_batch, read_jsonl
from draft.train.target import default_target, load_target, resolve_device

Tensor = torch.Tensor


@torch.no_grad()
def target_features(model, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The target's final normalized hidden states ``[B, L, H]`` (what its ``lm_head`` consumes)."""
    return model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def cmd_features(args) -> int:
    """Precompute features of every record into safetensors shards (resumable shard by shard)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    dev = resolve_device(args.device)
    target = Path(args.target) if args.target else default_target()
    recs = read_jsonl(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_target(target, dev, getattr(torch, args.dtype))
    sdtype = getattr(torch, args.store_dtype)
    shards = []
    idx = list(range(len(recs)))
    per = args.shard_size
    for si, s in enumerate(tqdm(range(0, len(idx), per), desc="feature shards", disable=args.no_progress)):
        name = f"features-{si:05d}.safetensors"
        part = idx[s:s + per]
        shards.append({"file": name, "records": part})
        if (out / name).is_file() and args.resume:
            continue
        feats, offsets = [], [0]
        for b in range(0, len(part), args.batch_size):
            sub = part[b:b + args.batch_size]
            seqs = [recs[i]["input_ids"][:args.max_len] for i in sub]
            ids = pad_batch(seqs).to(dev)
            h = target_features(model, ids)
            for j, sq in enumerate(seqs):
                feats.append(h[j, :len(sq)].to(sdtype).cpu())
                offsets.append(offsets[-1] + len(sq))
        save_file({"features": torch.cat(feats), "offsets": torch.tensor(offsets, dtype=torch.long),
                   "records": torch.tensor(part, dtype=torch.long)}, str(out / (name + ".tmp")))
        os.replace(out / (name + ".tmp"), out / name)
    (out / "index.json").write_text(json.dumps({"data": str(Path(args.data).resolve()), "target": str(target),
                                                 "max_len": args.max_len, "dtype": args.store_dtype,
                                                 "shards": shards}, indent=1))
    print(f"[features] {len(recs)} records -> {out}", file=sys.stderr)
    return 0


class FeatureStore:
    """Random access to the features of record ``i`` from :func:`cmd_features` shards."""

    def __init__(self, root: str | Path) -> None:
        from safetensors import safe_open
        root = Path(root)
        self.index = json.loads((root / "index.json").read_text())
        self.where: dict[int, tuple[int, int, int]] = {}
        self.files = []
        for si, sh in enumerate(self.index["shards"]):
            f = safe_open(str(root / sh["file"]), framework="pt")
            self.files.append(f)
            offs = f.get_tensor("offsets").tolist()
            for j, r in enumerate(f.get_tensor("records").tolist()):
                self.where[r] = (si, offs[j], offs[j + 1])

    def get(self, i: int) -> Tensor:
        si, a, b = self.where[i]
        return self.files[si].get_slice("features")[a:b]
