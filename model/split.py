"""Split a Hugging Face LLaMA-family checkpoint into pipeline stages (see ``model/stage_format.py``).

The library behind ``split_and_save_models.py`` (its command line) and ``model.default_model``::

    python split_and_save_models.py --model <hf_checkpoint_dir | default> --out <stage_root> \\
        (--split 0+8+8+7+7 | --stages N) [--dtype float32|float16|bfloat16] [--force]

Stage ``r`` is written as soon as its tensors are collected, reading them shard by shard (one source shard open
at a time, :class:`WeightSource`), so the peak memory is about one stage plus what one shard maps; sharded
``.bin`` checkpoints (Vicuna's ``pytorch_model-0000X-of-0000N.bin`` + ``pytorch_model.bin.index.json``) and
safetensors ones alike.
The manifest is written last: a stage root without ``manifest.json`` is an interrupted split.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from model.stage_format import (FORMAT, MANIFEST, SUPPORTED_MODEL_TYPES, WEIGHTS, parse_split,
                                sha256_file, stage_dir, stage_fields)

DTYPE_NAMES = ("float32", "float16", "bfloat16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "vocab.json", "merges.txt")
SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
CORE_LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                      "mlp.down_proj.weight")


def torch_dtype(name: str | None):
    import torch

    if name is None:
        return None
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported --dtype {name!r}: choose one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


class WeightSource:
    """Tensor-by-tensor access to a safetensors or .bin checkpoint (single file or sharded), one shard open at a
    time.

    Memory: a sharded checkpoint's key -> shard map comes from its index (no shard is opened to list keys); a
    ``.bin`` shard is opened with ``torch.load(mmap=True, weights_only=True)`` and a safetensors one is read
    tensor by tensor (:func:`model.stage_format.iter_safetensors`); :meth:`get` closes the previous shard
    when it moves to another, so the pages of a mapped shard leave the resident set with it. The splitter reads
    each stage's tensors grouped by shard (:meth:`shard_order`): its peak is about one stage's tensors plus the
    pages of one shard that they came from."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.kind, files, weight_map = self._find_files(model_dir)
        self.key_file: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        if weight_map is not None:
            for key, name in weight_map.items():
                self.key_file[key] = model_dir / name
        else:
            for f in files:
                for key in self._keys(f):
                    self.key_file.setdefault(key, f)
            self.close()

    @staticmethod
    def _find_files(d: Path) -> tuple[str, list[Path], dict | None]:
        for index, kind in ((SAFE_INDEX, "safetensors"), (BIN_INDEX, "bin")):
            p = d / index
            if p.is_file():
                try:
                    weight_map = json.loads(p.read_text())["weight_map"]
                except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{p} is not a valid shard index: {e}") from None
                files = [d / name for name in sorted(set(weight_map.values()))]
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise FileNotFoundError(f"{p} names shard files that are missing: {', '.join(missing[:4])}")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"{p} is not a valid shard index: weight_map is not a mapping")
                return kind, files, weight_map
        if (d / SAFE_SINGLE).is_file():
            return "safetensors", [d / SAFE_SINGLE], None
        if (d / BIN_SINGLE).is_file():
            return "bin", [d / BIN_SINGLE], None
        raise FileNotFoundError(f"no weights in {d}: expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} "
                                f"or {BIN_INDEX}")

    def _open(self, f: Path):
        h = self._handles.get(f)
        if h is not None:
            return h
        self.close()                       # one shard at a time
        if self.kind == "safetensors":
            from model.stage_format import StageDirError, safetensors_header

            try:
                h, _ = safetensors_header(f)
            except (StageDirError, OSError) as e:  # corrupt / truncated file
                raise ValueError(f"cannot read {f}: {e}") from None
        else:
            import torch

            try:
                h = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise ValueError(f"cannot read {f} (torch.load weights_only/mmap): {e}") from None
            if not isinstance(h, dict):
                raise ValueError(f"{f} does not hold a state dict")
        self._handles[f] = h
        return h

    def _keys(self, f: Path) -> list[str]:
        h = self._open(f)
        return list(h.keys())

    def get(self, key: str, dtype=None):
        """An owned (non-shared), contiguous copy of tensor ``key`` (floating ones cast to ``dtype`` when given)."""
        import torch

        f = self.key_file[key]
        h = self._open(f)
        if self.kind == "safetensors":
            from model.stage_format import StageDirError, iter_safetensors

            if key not in h:
                raise ValueError(f"{f} has no tensor {key} (its index says it does)")
            try:
                return next(iter_safetensors(f, dtype, {key}))[1]
            except StageDirError as e:
                raise ValueError(str(e)) from None
        if key not in h:
            raise ValueError(f"{f} has no tensor {key} (its index says it does)")
        t = h[key]
        # Always copy: a .bin tensor is a view of the mapped shard (and tied weights share storage), and
        # save_file refuses tensors that share memory (rank 0 holds embed + lm_head).
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype, memory_format=torch.contiguous_format)
        return t.clone(memory_format=torch.contiguous_format)

    def shard_order(self, keys: list[str]) -> list[str]:
        """``keys`` grouped by the shard that holds them (shards in file order): each shard is opened once."""
        return sorted(keys, key=lambda k: str(self.key_file[k]))

    def close(self) -> None:
        """Drop the open shard (a mapped ``.bin`` is unmapped once its tensors' copies are all that remain)."""
        self._handles.clear()


def read_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise FileNotFoundError(f"input checkpoint directory {model_dir} does not exist")
    p = model_dir / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: {model_dir} is not a Hugging Face checkpoint")
    try:
        config = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p} is unreadable: {e}") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {p}: supported are "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if not isinstance(config.get("num_hidden_layers"), int):
        raise ValueError(f"{p} has no integer num_hidden_layers")
    return config


def _plan(keys: list[str], config: dict, split: list[int]) -> dict[int, list[tuple[str, str]]]:
    """``rank -> [(stage tensor name, source tensor name)]``; raises on missing tensors."""
    num_layers = config["num_hidden_layers"]
    last = len(split) - 1
    ranges = [stage_fields(split, r)["layer_range"] for r in range(len(split))]
    plan: dict[int, list[tuple[str, str]]] = {r: [] for r in range(len(split))}
    layer_suffixes: dict[int, set[str]] = {g: set() for g in range(num_layers)}
    ignored: list[str] = []
    have = set(keys)
    for key in sorted(keys, key=_natural_key):
        if key.endswith("rotary_emb.inv_freq"):
            continue
        m = LAYER_RE.match(key)
        if m:
            g, rest = int(m.group(1)), m.group(2)
            if g >= num_layers:
                raise ValueError(f"checkpoint has tensor {key} but config.json says num_hidden_layers={num_layers}")
            rank = next(r for r in range(1, len(split)) if ranges[r][0] <= g < ranges[r][1])
            plan[rank].append((f"layers.{g - ranges[rank][0]}.{rest}", key))
            layer_suffixes[g].add(rest)
        elif key == "model.embed_tokens.weight":
            plan[0].append(("embed_tokens.weight", key))
            plan[1].append(("embed_tokens.weight", key))
        elif key == "model.norm.weight":
            plan[last].append(("norm.weight", key))
        elif key == "lm_head.weight":
            plan[0].append(("lm_head.weight", key))
        else:
            ignored.append(key)
    if ignored:
        print(f"warning: ignoring {len(ignored)} unknown tensor(s): {', '.join(ignored[:5])}"
              f"{' ...' if len(ignored) > 5 else ''}", file=sys.stderr, flush=True)

    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in have]
    if "lm_head.weight" not in have:
        if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in have:
            plan[0].append(("lm_head.weight", "model.embed_tokens.weight"))  # tied: rank 0 gets a copy
        else:
            missing.append("lm_head.weight")
    expected = set(CORE_LAYER_TENSORS).union(*layer_suffixes.values())
    for g in range(num_layers):
        missing += [f"model.layers.{g}.{s}" for s in sorted(expected - layer_suffixes[g])]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return plan


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def prepare_out(out: Path, model_dir: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {out} exists and is not a directory")
    if out.resolve() == model_dir.resolve():
        raise ValueError(f"output directory {out} must differ from the input checkpoint directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"output directory {out} is not empty (use --force to overwrite)")
        # Remove only what a split writes: the manifest first, so a half-overwritten root never looks valid.
        (out / MANIFEST).unlink(missing_ok=True)
        for d in out.glob("stage_model_*"):
            if d.is_dir():
                shutil.rmtree(d)
            else:
                d.unlink()
    out.mkdir(parents=True, exist_ok=True)


def cast_for_output(t, out_dtype, dtype_name: str | None):
    """``(t in the output dtype, the split's dtype name)``: floating tensors are cast to ``out_dtype`` (None keeps
    theirs); the dtype name is the first floating tensor's unless one was given."""
    if out_dtype is not None and t.is_floating_point() and t.dtype != out_dtype:
        t = t.to(out_dtype)
    if dtype_name is None and t.is_floating_point():
        dtype_name = str(t.dtype).removeprefix("torch.")
    return t, dtype_name


def check_output(out: Path, dtype: str | None, force: bool) -> None:
    """A known output dtype and an empty (or ``force``d) output directory: checked before any tensor is read."""
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"output directory {out} is not empty (use --force to overwrite)")


def write_stage(out: Path, rank: int, tensors: dict, cfg: dict, model_dir: Path, dtype_name: str | None,
                files: dict) -> None:
    """Write stage ``rank``'s weights, its ``config.json`` (``cfg`` plus the source and the dtype) and the tokenizer
    files; its manifest entry goes into ``files``: ``{relative path of the weights: {"sha256", "bytes"}}``."""
    from safetensors.torch import save_file
    cfg = {**cfg, "source_model": str(model_dir.resolve()), "dtype": dtype_name, "torch_dtype": dtype_name}
    d = stage_dir(out, rank)
    d.mkdir(parents=True, exist_ok=True)
    weights = d / WEIGHTS
    save_file(tensors, str(weights), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for fname in TOKENIZER_FILES:
        src = model_dir / fname
        if src.is_file():
            shutil.copyfile(src, d / fname)
    files[f"{d.name}/{WEIGHTS}"] = {"sha256": sha256_file(weights), "bytes": weights.stat().st_size}


def write_manifest(out: Path, model_dir: Path, split: list[int], num_layers: int, dtype_name: str | None,
                   files: dict, **extra) -> Path:
    """The manifest goes last, atomically: a stage root without one is an interrupted split. Returns ``out``."""
    manifest = {"format": FORMAT, "split": split, **extra, "source": str(model_dir.resolve()),
                "num_hidden_layers": num_layers, "dtype": dtype_name, "files": files}
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out / MANIFEST)
    return out


def split_checkpoint(model_dir: str | Path, out_dir: str | Path, split: list[int] | str,
                     dtype: str | None = None, force: bool = False, progress: bool = True) -> Path:
    """Split the HF checkpoint ``model_dir`` into ``out_dir`` following ``split`` (leading 0 = draft stage).

    ``dtype`` casts floating tensors (``None`` keeps the source dtype). Returns ``out_dir``.
    """
    model_dir, out = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)  # cheap checks first: no torch import for a bad command line
    num_layers = config["num_hidden_layers"]
    split = parse_split(split, num_layers)
    check_output(out, dtype, force)

    import torch
    from tqdm import tqdm

    out_dtype = torch_dtype(dtype)
    source = WeightSource(model_dir)
    plan = _plan(list(source.key_file), config, split)
    prepare_out(out, model_dir, force)

    dtype_name = dtype
    files: dict[str, dict] = {}
    bar = tqdm(total=sum(len(v) for v in plan.values()), desc="splitting", unit="tensor", disable=not progress)
    try:
        for rank in range(len(split)):
            bar.set_postfix_str(f"stage {rank}")
            tensors: dict[str, torch.Tensor] = {}
            names_of: dict[str, list[str]] = {}      # tied lm_head: one key under two names
            for name, key in plan[rank]:
                names_of.setdefault(key, []).append(name)
            for key in source.shard_order(list(names_of)):
                t, dtype_name = cast_for_output(source.get(key, out_dtype), out_dtype, dtype_name)
                for i, name in enumerate(names_of[key]):
                    tensors[name] = t if i == 0 else t.clone()
                    bar.update(1)
            source.close()
            write_stage(out, rank, tensors, {**config, **stage_fields(split, rank)}, model_dir, dtype_name, files)
            del tensors
    finally:
        bar.close()
        source.close()
    return write_manifest(out, model_dir, split, num_layers, dtype_name, files)
