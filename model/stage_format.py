"""The on-disk format of a split checkpoint, shared by the splitter and the loader.

::

    <stage_root>/manifest.json               format, split, source, sha256 + size of every stage file
    <stage_root>/stage_model_<r>/config.json  the HF config plus the STAGE_FIELDS below
    <stage_root>/stage_model_<r>/model.safetensors
        embed_tokens.weight      (rank 0 for the draft head, rank 1 for the first layers)
        layers.<i>.<...>         decoder layers of this stage renumbered from 0
        norm.weight              (last stage)
        lm_head.weight           (rank 0: the base model's head; a copy when embeddings are tied)
    <stage_root>/stage_model_<r>/tokenizer files (every stage; small)

Rank 0 is the draft stage and holds no decoder layers, so a split spec always starts with ``0``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from config.invocation import prog
from config.errors import UserError

FORMAT = "flowspec-stages/1"
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
# model_type -> the class-name prefix of its transformers module (``transformers.models.<type>.modeling_<type>``).
# Tested families (tests/test_families.py): Llama 1/2/3.x (GQA, ``rope_scaling`` llama3, tied or untied
# embeddings), Mistral, Qwen2/Qwen2.5 (q/k/v biases), Qwen3 (``q_norm``/``k_norm``, free ``head_dim``).
SUPPORTED_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_FAMILIES)
STAGE_FIELDS = ("stage_index", "num_stages", "split", "layer_range", "has_embedding", "has_lm_head",
                "has_final_norm")


class StageDirError(UserError, ValueError):
    """A missing, corrupt or mismatched stage directory."""


def stage_dir(root: str | Path, rank: int) -> Path:
    return Path(root) / f"stage_model_{rank}"


def parse_split(spec: str | list[int], num_layers: int | None = None) -> list[int]:
    """``"0+8+8+7+7"`` -> ``[0, 8, 8, 7, 7]``, validated against ``num_layers`` when given."""
    if isinstance(spec, str):
        try:
            parts = [int(p) for p in spec.strip().split("+")]
        except ValueError:
            raise StageDirError(f"bad split spec {spec!r}: expected numbers joined by '+', e.g. 0+8+8+7+7") from None
    else:
        parts = [int(p) for p in spec]
    if len(parts) < 2 or parts[0] != 0:
        raise StageDirError(f"bad split {parts}: it must start with 0 (the draft stage) and name at least one layer stage")
    if any(p <= 0 for p in parts[1:]):
        raise StageDirError(f"bad split {parts}: every layer stage needs at least one layer")
    if num_layers is not None and sum(parts) != num_layers:
        raise StageDirError(f"split {'+'.join(map(str, parts))} sums to {sum(parts)} but the model has "
                            f"num_hidden_layers={num_layers}")
    return parts


def even_split(num_layers: int, num_layer_stages: int) -> list[int]:
    """Near-even split with a leading draft stage; the remainder goes to the first stages."""
    if num_layer_stages < 1 or num_layer_stages > num_layers:
        raise StageDirError(f"cannot split {num_layers} layers into {num_layer_stages} stages")
    base, extra = divmod(num_layers, num_layer_stages)
    return [0] + [base + 1] * extra + [base] * (num_layer_stages - extra)


def tap_row_factors(split: list[int], taps: list[int] | tuple = ()) -> list[int]:
    """Width of the rows each rank emits, in hidden rows, when EAGLE-3 taps ride along
    (:meth:`model.stage_model.StageModel.set_taps`): rank ``r`` emits ``1 + (taps in layers before its end)``
    hidden rows' worth per token (rank 0 sends ids: factor 1). Without taps every factor is 1."""
    ends = [sum(split[:r + 1]) for r in range(len(split))]
    return [1] + [1 + sum(1 for i in taps if i < ends[r]) for r in range(1, len(split))]


def stage_fields(split: list[int], rank: int) -> dict:
    start = sum(split[:rank])
    last = len(split) - 1
    return {
        "stage_index": rank,
        "num_stages": len(split),
        "split": list(split),
        "layer_range": [start, start + split[rank]],
        "has_embedding": rank in (0, 1),
        "has_lm_head": rank == 0,
        "has_final_norm": rank == last,
    }


SAFE_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                   "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
READ_CHUNK = 1 << 26      # bytes per read() call: a >2 GiB tensor is read in pieces (one read() may stop short)


def safetensors_header(path: str | Path) -> tuple[dict, int]:
    """``({name: {"dtype", "shape", "data_offsets"}}, offset of the data section)`` of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise StageDirError(f"{path} is not a safetensors file (truncated header)")
        n = int.from_bytes(raw, "little")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise StageDirError(f"{path} is not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def iter_safetensors(path: str | Path, dtype=None, names=None):
    """Yield ``(name, tensor)`` for every tensor of a safetensors file (or those in ``names``), one at a time, each
    read straight into its own fresh CPU tensor (floating ones cast to ``dtype`` when given).

    Why not ``safetensors.torch.load_file`` / ``safe_open``: they map the whole file, and every page a tensor
    was copied from stays in the process's resident set while the map lives, so a rank that loads a 3 GiB
    stage peaks at about twice that. Here the file is read with ``readinto`` (the kernel's page cache holds
    the file, not the process): the resident set grows by the tensors kept, plus one tensor during a cast.
    Invariant: the tensors equal ``load_file``'s, bit for bit (``tests/test_split.py``)."""
    import torch

    header, start = safetensors_header(path)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    with open(path, "rb") as f:
        for name, info in items:
            if names is not None and name not in names:
                continue
            kind = SAFE_DTYPE_NAMES.get(info["dtype"])
            if kind is None:
                raise StageDirError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            t = torch.empty(info["shape"], dtype=getattr(torch, kind))
            a, b = info["data_offsets"]
            if b - a != t.numel() * t.element_size():
                raise StageDirError(f"{path}: tensor {name} has {b - a} bytes for shape {info['shape']}")
            if t.numel():
                buf = memoryview(t.view(-1).view(torch.uint8).numpy())
                f.seek(start + a)
                done = 0
                while done < len(buf):
                    got = f.readinto(buf[done:done + READ_CHUNK])
                    if not got:
                        raise StageDirError(f"{path} is truncated (tensor {name})")
                    done += got
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(root: str | Path) -> dict:
    root = Path(root)
    if not root.is_dir():
        raise StageDirError(f"stage directory {root} does not exist; create it with "
                            f"`python split_and_save_models.py --model <checkpoint> --out {root}`")
    path = root / MANIFEST
    if not path.is_file():
        raise StageDirError(f"{path} is missing: {root} is not a split checkpoint (run split_and_save_models.py)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StageDirError(f"{path} is unreadable: {e}") from None
    if manifest.get("format") != FORMAT:
        raise StageDirError(f"{path}: unknown format {manifest.get('format')!r} (expected {FORMAT})")
    return manifest


def check_world(root: str | Path, world_size: int) -> dict:
    """Validate the stage root against the world size; returns the manifest (no torch needed)."""
    manifest = read_manifest(root)
    split = manifest["split"]
    if len(split) != world_size:
        raise StageDirError(f"{root} is split {'+'.join(map(str, split))} for {len(split)} ranks, "
                            f"but the world size is {world_size}; relaunch with {len(split)} processes "
                            f"or re-split with --stages {world_size - 1}")
    return manifest


def verify_stage_file(root: str | Path, manifest: dict, rank: int) -> None:
    rel = f"stage_model_{rank}/{WEIGHTS}"
    entry = manifest.get("files", {}).get(rel)
    path = Path(root) / rel
    if entry is None or not path.is_file():
        raise StageDirError(f"{path} is missing")
    if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
        raise StageDirError(f"{path} does not match its manifest checksum (corrupt or replaced file)")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog=prog("model.stage_format"),
                                 description="Inspect a stage root written by split_and_save_models.py.")
    ap.add_argument("root", help="stage root directory (holds manifest.json)")
    ap.add_argument("--world", action="store_true", help="print only the number of ranks it needs")
    args = ap.parse_args(argv)
    try:
        manifest = read_manifest(args.root)
    except StageDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.world:
        print(len(manifest["split"]))
    else:
        print(json.dumps({k: manifest[k] for k in ("format", "split", "num_hidden_layers", "dtype")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
