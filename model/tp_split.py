"""Tensor-parallel split of a LLaMA-family checkpoint: rank 0 = draft stage, ranks 1..N = one TP shard each.

Layout (same manifest, checksums and stage directories as :mod:`model.stage_format`; the manifest adds
``"tp": N`` and its ``split`` is ``[0, L, ..., L]``: every TP rank holds all ``L`` layers)::

    stage_model_0/   embed_tokens + lm_head (identical to a pipeline split's rank 0)
    stage_model_r/   (r = 1..N, TP rank t = r - 1) all layers at 1/N width:
        embed_tokens.weight     vocab rows [tp_vocab_range)            (vocab-parallel embedding)
        q_proj                  output rows of query heads [t*hq, (t+1)*hq)   hq = heads / N
        k_proj, v_proj          output rows of the key/value heads those query heads read (tp_kv_heads)
        o_proj, down_proj       input columns of this rank's heads / FFN slice; a bias only on t = 0
        gate_proj, up_proj      output rows of FFN slice t (I split near-evenly; need not divide)
        norms                   replicated
    config.json: the HF config with the *local* head counts and FFN width (so the family's own modules build
    at shard size), ``head_dim`` explicit, plus the stage fields and ``tp_size``, ``tp_rank``,
    ``tp_vocab_range``, ``tp_kv_heads`` (source indices of the key/value heads held) and ``tp_full``.

GQA. With ``K`` key/value heads and group size ``g = heads / K``, rank ``t``'s query heads read key/value
heads ``(t*hq + j) // g``. When every head it needs serves the same number of its query heads, the rank holds
each needed head once: ``K/N`` of them when ``N`` divides ``K``, one (replicated across ranks) when ``K < N``
divides evenly. Otherwise (a rank's query heads straddle groups unevenly) it holds one copy per query head
(local group size 1). Every case computes exactly the unsplit attention.

Streaming: shards are written one at a time, each from tensors read one at a time, so the peak memory is
about one shard plus one source tensor.
"""
from __future__ import annotations

import re
from pathlib import Path

from config.modes import TP_MODES  # the modes that run on a tensor-parallel split (and only they)
from model.stage_format import StageDirError, stage_fields

LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight")


def kv_heads_for(t: int, n: int, heads: int, kv_heads: int) -> list[int]:
    """Source key/value head indices TP rank ``t`` of ``n`` holds, in local order.

    Invariant: local query head ``j`` reads local key/value head ``j // (hq // len(result))`` and that is
    source head ``(t*hq + j) // g`` (``hq = heads / n``, ``g = heads / kv_heads``)."""
    hq, g = heads // n, heads // kv_heads
    per_q = [(t * hq + j) // g for j in range(hq)]
    distinct = sorted(set(per_q))
    if hq % len(distinct) == 0 and per_q == [d for d in distinct for _ in range(hq // len(distinct))]:
        return distinct
    return per_q


def ffn_range(inter: int, n: int, t: int) -> tuple[int, int]:
    """FFN rows of TP rank ``t``: ``inter`` split near-evenly (earlier ranks one more when it does not divide)."""
    base, extra = divmod(inter, n)
    start = t * base + min(t, extra)
    return start, start + base + (t < extra)


def check_tp(config: dict, n: int) -> None:
    """Raise ``ValueError`` (one line) unless ``n`` ranks can split this model."""
    heads = config.get("num_attention_heads")
    inter = config.get("intermediate_size")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--tp must be a positive number of ranks, got {n!r}")
    if heads % n:
        raise ValueError(f"--tp {n} does not divide the model's {heads} attention heads; choose one of "
                         f"{', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)}")
    if inter < n:
        raise ValueError(f"--tp {n} exceeds the model's intermediate_size {inter}")


def _plan_rank(keys: set[str], config: dict, n: int, t: int) -> list[tuple[str, str, str, object]]:
    """``[(shard name, source key, how, arg)]`` for TP rank ``t``; ``how`` is one of rows/cols/full/bias0/kv."""
    layers = config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    hq = heads // n
    vocab = config["vocab_size"]
    per = -(-vocab // n)
    v0, v1 = min(vocab, t * per), min(vocab, (t + 1) * per)
    plan = [("embed_tokens.weight", "model.embed_tokens.weight", "rows", (v0, v1))]
    kv_list = kv_heads_for(t, n, heads, kv)
    known = set()
    for i in range(layers):
        p = f"model.layers.{i}."
        for s in REPLICATED:
            plan.append((f"layers.{i}.{s}", p + s, "full", None))
        q_rows = (t * hq * hd, (t + 1) * hq * hd)
        ff_rows = ffn_range(config["intermediate_size"], n, t)
        for mod, how, arg in (("self_attn.q_proj", "rows", q_rows), ("self_attn.k_proj", "kv", kv_list),
                              ("self_attn.v_proj", "kv", kv_list), ("mlp.gate_proj", "rows", ff_rows),
                              ("mlp.up_proj", "rows", ff_rows), ("self_attn.o_proj", "cols", q_rows),
                              ("mlp.down_proj", "cols", ff_rows)):
            plan.append((f"layers.{i}.{mod}.weight", f"{p}{mod}.weight", how, arg))
            if f"{p}{mod}.bias" in keys:
                plan.append((f"layers.{i}.{mod}.bias", f"{p}{mod}.bias", *(("bias0", t) if mod in ROW else (how, arg))))
        known |= {f"{p}{s}" for s in REPLICATED} | {f"{p}{m}.weight" for m in COLUMN + ROW} \
            | {f"{p}{m}.bias" for m in COLUMN + ROW}
    plan.append(("norm.weight", "model.norm.weight", "full", None))
    extra = sorted(k for k in keys if LAYER_RE.match(k) and k not in known and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"--tp cannot split layer tensor(s) it does not know: {', '.join(extra[:4])} "
                         f"(supported: norms, q/k/v/o and gate/up/down projections)")
    missing = sorted({src for _, src, _, _ in plan} - keys)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    return plan


def _slice(t, how: str, arg, hd: int):
    import torch
    if how == "full":
        return t
    if how == "rows":
        return t[arg[0]:arg[1]]
    if how == "cols":
        return t[:, arg[0]:arg[1]]
    if how == "kv":   # whole key/value heads (weight rows or bias entries), in the listed order
        return torch.cat([t[h * hd:(h + 1) * hd] for h in arg])
    if how == "bias0":  # row-parallel bias: added once, by TP rank 0
        return t if arg == 0 else torch.zeros_like(t)
    raise AssertionError(how)


def shard_config(config: dict, n: int, t: int) -> dict:
    """The HF config of TP rank ``t``'s shard (local head counts and FFN width) plus the ``tp_*`` fields."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or config["hidden_size"] // heads
    vocab = config["vocab_size"]
    per = -(-vocab // n)
    kv_list = kv_heads_for(t, n, heads, kv)
    ff0, ff1 = ffn_range(config["intermediate_size"], n, t)
    cfg = dict(config)
    cfg.update(num_attention_heads=heads // n, num_key_value_heads=len(kv_list), head_dim=hd,
               intermediate_size=ff1 - ff0, tp_size=n, tp_rank=t,
               tp_vocab_range=[min(vocab, t * per), min(vocab, (t + 1) * per)], tp_kv_heads=kv_list,
               tp_full={"num_attention_heads": heads, "num_key_value_heads": kv,
                        "intermediate_size": config["intermediate_size"]})
    return cfg


def split_checkpoint_tp(model_dir: str | Path, out_dir: str | Path, n: int, dtype: str | None = None,
                        force: bool = False, progress: bool = True) -> Path:
    """Write a tensor-parallel split of ``model_dir`` for ``n`` TP ranks (world ``n + 1``) into ``out_dir``."""
    from model.split import (WeightSource, cast_for_output, check_output, prepare_out, read_config, torch_dtype,
                             write_manifest, write_stage)
    model_dir, out = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)
    check_tp(config, n)
    check_output(out, dtype, force)
    from tqdm import tqdm

    out_dtype = torch_dtype(dtype)
    source = WeightSource(model_dir)
    keys = set(source.key_file)
    layers = config["num_hidden_layers"]
    split = [0] + [layers] * n
    head = [("embed_tokens.weight", "model.embed_tokens.weight")]
    if "lm_head.weight" in keys:
        head.append(("lm_head.weight", "lm_head.weight"))
    elif config.get("tie_word_embeddings") and "model.embed_tokens.weight" in keys:
        head.append(("lm_head.weight", "model.embed_tokens.weight"))
    else:
        raise ValueError("checkpoint is missing lm_head.weight (and its embeddings are not tied)")
    plans = {0: [(name, key, "full", None) for name, key in head]}
    plans.update({t + 1: _plan_rank(keys, config, n, t) for t in range(n)})
    prepare_out(out, model_dir, force)
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype_name, files = dtype, {}
    bar = tqdm(total=sum(len(p) for p in plans.values()), desc="splitting (tp)", unit="tensor", disable=not progress)
    try:
        for rank in range(n + 1):
            tensors = {}
            for name, key, how, arg in plans[rank]:
                t = _slice(source.get(key), how, arg, hd).contiguous().clone()   # own storage: drop the source
                tensors[name], dtype_name = cast_for_output(t, out_dtype, dtype_name)
                bar.update(1)
            cfg = dict(config) if rank == 0 else shard_config(config, n, rank - 1)
            cfg.update(stage_fields(split, rank))
            if rank:
                cfg.update(layer_range=[0, layers], has_embedding=True, has_final_norm=True)
            write_stage(out, rank, tensors, cfg, model_dir, dtype_name, files)
            del tensors
    finally:
        bar.close()
        source.close()
    return write_manifest(out, model_dir, split, layers, dtype_name, files, tp=n)


def tp_size(manifest: dict) -> int:
    """TP ranks of a stage root's manifest (0 for a pipeline split)."""
    n = manifest.get("tp", 0)
    if not isinstance(n, int) or n < 0 or (n and len(manifest.get("split", [])) != n + 1):
        raise StageDirError(f"manifest field tp={n!r} does not match its split {manifest.get('split')}")
    return n


def check_tp_modes(manifest: dict, modes: list[str], cfg) -> str | None:
    """The one-line reason why ``modes`` cannot run on this stage root, or None (no torch needed)."""
    n = tp_size(manifest)
    tp_modes = [m for m in modes if m in TP_MODES]
    if n and len(tp_modes) < len(modes):
        other = next(m for m in modes if m not in TP_MODES)
        return (f"mode {other} needs a pipeline split, but this stage root is a tensor-parallel split (--tp {n}); "
                f"run modes {' or '.join(TP_MODES)} on it")
    if tp_modes and not n:
        return (f"mode {tp_modes[0]} needs a tensor-parallel split: python split_and_save_models.py --model <hf dir> "
                f"--tp <N> --out <dir>, then launch N+1 ranks")
    return None
