"""Measure a pipeline stage's step time t(w, ctx) on this machine and write an emulation profile.

``python -m pipeline.tools.profile --help``. The stage is built from the project's own
:class:`model.layers.LayerBlock` and :class:`model.kv_cache.KVCache` (exactly what a verification rank runs)
with random weights of any shape: e.g. the defaults are one 8-layer LLaMA-7B stage. For every ``ctx`` (KV
slots already cached) and every ``w`` (rows in the segment) it times the forward (median of ``--repeat``
runs after ``--warmup`` runs; CUDA is synchronised around each), and optionally rank 0's operations
(``lm_head`` over ``w`` rows and one EAGLE-style draft-head forward: ``fc`` 2H->H + one decoder layer), and
rank 0's host cost per dispatched operator and per host<->device synchronisation (:func:`measure_host_costs`:
the profile's ``rank0_host``, which the simulator's ``--rank0-cost ops`` multiplies by the replay's counts).
The result is a ``"model": "table"`` profile for ``emu.profile=<file>`` (pipeline/emulation.py), with the
link model given on the command line. ``--host-only`` measures only the host costs (seconds) and writes them
as a ``profiles/rank0_host/<profile name>.json`` file, for a profile kept elsewhere.

Examples::

    python -m pipeline.tools.profile --device cuda --dtype float16 --out profiles/h100_7b.json
    python -m pipeline.tools.profile --like checkpoints/SmolLM2-135M-Instruct --layers 8 --device cpu --out /tmp/p.json
    python -m pipeline.tools.profile --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --layers 2 --w 1,4 --ctx 0,32
    python -m pipeline.tools.profile --host-only --device cuda --out profiles/rank0_host/h100_7b_fp16.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from config.invocation import prog

DTYPES = ("float32", "float16", "bfloat16", "float64")


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce  # each default shown once
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.profile"),
        description="Measure t(w, ctx) of one pipeline stage (random weights, the project's LayerBlock + KVCache) "
                    "and write an emulation profile JSON (use it with emu.profile=<file>).",
        epilog="Example: python -m pipeline.tools.profile --like checkpoints/SmolLM2-135M-Instruct --layers 8 "
               "--out profiles/my_host.json",
        formatter_class=DefaultsOnce)
    g = p.add_argument_group("stage shape (default: 8 LLaMA-7B layers)")
    g.add_argument("--like", help="take hidden/intermediate/heads/kv-heads/vocab/family from this HF config.json "
                                  "(or a directory holding one); explicit options still win")
    g.add_argument("--hidden", type=int, help="hidden size [4096]")
    g.add_argument("--intermediate", type=int, help="MLP intermediate size [11008]")
    g.add_argument("--heads", type=int, help="attention heads [32]")
    g.add_argument("--kv-heads", type=int, help="key/value heads [= heads]")
    g.add_argument("--layers", type=int, default=8, help="decoder layers in the stage")
    g.add_argument("--vocab", type=int, help="vocabulary (rank-0 lm_head) [32000]")
    m = p.add_argument_group("measurement")
    m.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (cuda when available)")
    m.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES, help="auto = float16 on cuda, float32 on cpu")
    m.add_argument("--w", default="1,2,4,8,16,32,64,128", help="segment rows to measure (comma-separated)")
    m.add_argument("--ctx", default="0,256,512,1024,2048", help="cached KV slots to measure (comma-separated)")
    m.add_argument("--repeat", type=int, default=5, help="timed runs per point (median kept)")
    m.add_argument("--warmup", type=int, default=2, help="untimed runs per point")
    m.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave torch's default)")
    m.add_argument("--no-rank0", action="store_true", help="do not measure rank 0 (lm_head, draft head, host costs)")
    m.add_argument("--host-only", action="store_true",
                   help="measure only rank 0's host cost per dispatched operator and per sync (a few seconds) and "
                        "write it as a rank0_host file (profiles/rank0_host/<profile>.json)")
    m.add_argument("--host-rounds", type=int, default=2000,
                   help="rounds of tiny operators per host-cost measurement (median of --repeat)")
    m.add_argument("--transformers-layers", action="store_true",
                   help="time the transformers layers' own forward instead of the lean one the runs use by default "
                        "(model.lean_layers; profiles measured before 2026-11-26 timed the transformers path)")
    m.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("link model and output")
    o.add_argument("--bandwidth-mbps", type=float, default=150.0, help="link bandwidth (0 = unlimited)")
    o.add_argument("--latency-ms", type=float, default=0.5, help="one-way link latency")
    o.add_argument("--hidden-bytes", type=int, default=0,
                   help="bytes per hidden state on the wire [hidden x 2 (fp16)]")
    o.add_argument("--name", help="profile name [output file stem]")
    o.add_argument("--out", required=True, help="profile JSON to write")
    o.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0 or args.host_rounds < 1:
        p.error("--repeat and --host-rounds must be >= 1, --warmup >= 0")
    return args


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"error: --{what} takes comma-separated integers, not {text!r}") from None
    if not vals or vals[0] < (1 if what == "w" else 0):
        raise SystemExit(f"error: --{what} needs values >= {1 if what == 'w' else 0}")
    return vals


def stage_config(args):
    from transformers import AutoConfig, LlamaConfig
    base = {}
    if args.like:
        like = Path(args.like)
        cfg = AutoConfig.from_pretrained(like if like.is_dir() else like.parent)
        base = {"hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "heads": cfg.num_attention_heads,
                "kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                "vocab": cfg.vocab_size, "model_type": cfg.model_type, "rms_norm_eps": getattr(cfg, "rms_norm_eps", 1e-6),
                "rope_theta": getattr(cfg, "rope_theta", None)}
    shape = {"hidden": args.hidden or base.get("hidden", 4096),
             "intermediate": args.intermediate or base.get("intermediate", 11008),
             "heads": args.heads or base.get("heads", 32),
             "vocab": args.vocab or base.get("vocab", 32000)}
    shape["kv_heads"] = args.kv_heads or base.get("kv_heads", shape["heads"])
    if shape["hidden"] % shape["heads"] or shape["heads"] % shape["kv_heads"]:
        raise SystemExit("error: hidden must be divisible by heads, and heads by kv-heads")
    cfg = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      num_hidden_layers=args.layers, vocab_size=shape["vocab"], max_position_embeddings=1 << 16)
    cfg._attn_implementation = "sdpa"
    return cfg, shape


def build_block(cfg, num_layers: int, dtype, device, skip_first_input_norm: bool = False):
    """A LayerBlock with random weights, allocated directly on ``device`` (no slow CPU init)."""
    import torch
    from model.layers import LayerBlock, family_classes
    with torch.device("meta"):
        block = LayerBlock(cfg, num_layers, skip_first_input_norm)
    block = block.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
    _, rotary_cls, _ = family_classes(cfg)
    block.rotary_emb = rotary_cls(config=cfg).to(device)
    return block.eval()


def _timer(device: str):
    import torch
    cuda = device.startswith("cuda")

    def measure(fn, repeat: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(timed_call(fn, cuda) for _ in range(repeat))
    return measure


def timed_call(fn, cuda: bool, clock=time.perf_counter) -> float:
    """Seconds of one call of ``fn``, with CUDA synchronised before and after (queued work is not counted to
    it, its own kernels are). ``clock=time.thread_time``: this thread's CPU seconds instead of wall seconds (on
    a CPU shared with other jobs, time spent descheduled is not counted; host work only)."""
    import torch
    if cuda:
        torch.cuda.synchronize()
    t0 = clock()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return clock() - t0


def _grid(name: str, block, ws, ctxs, dtype, device, repeat, warmup, log, forward) -> list[list[float]]:
    """``t[i][j]`` = seconds of ``forward(w, pos, mask, cache)`` (a forward of ``block`` on ``w = ws[i]`` new rows)
    over ``ctxs[j]`` cached slots of a fresh ``block`` cache."""
    measure = _timer(device)
    cache = block.new_cache(max(ctxs) + max(ws), dtype, device)
    grid = [[0.0] * len(ctxs) for _ in ws]
    for j, ctx in enumerate(ctxs):
        for i, w in enumerate(ws):
            cache.reset()
            cache.context_len = cache.length = ctx   # ctx committed slots; forwards write after them, never commit
            pos, mask = cache.context_inputs(w, dtype)
            grid[i][j] = measure(forward(w, pos, mask, cache), repeat, warmup)
            log(f"  {name:6s} w={w:4d} ctx={ctx:5d}  {grid[i][j] * 1e3:9.3f} ms")
    return grid


def measure_stage(block, cfg, ws, ctxs, dtype, device, repeat, warmup, log) -> list[list[float]]:
    """``t[i][j]`` = seconds of one forward of ``ws[i]`` rows over ``ctxs[j]`` cached slots."""
    import torch

    def forward(w, pos, mask, cache):
        x = torch.randn(1, w, cfg.hidden_size, device=device).to(dtype)
        return lambda: block(x, pos, mask, cache)
    with torch.no_grad():
        return _grid("stage", block, ws, ctxs, dtype, device, repeat, warmup, log, forward)


def measure_rank0(cfg, ws, ctxs, dtype, device, repeat, warmup, log, transformers_layers: bool = False) -> dict:
    import torch
    from torch import nn
    measure = _timer(device)
    h, v = cfg.hidden_size, cfg.vocab_size
    lm_head = nn.Linear(h, v, bias=False, device=device, dtype=dtype).eval()
    fc = nn.Linear(2 * h, h, bias=True, device=device, dtype=dtype).eval()
    with torch.no_grad():
        lm_head.weight.normal_(0, 0.02)
        fc.weight.normal_(0, 0.02)
    head = build_block(cfg, 1, dtype, device, skip_first_input_norm=True)
    from model.layers import set_lean
    set_lean(head, not transformers_layers)
    lm = []
    for w in ws:
        x = torch.randn(w, h, device=device).to(dtype)

        def f():
            with torch.no_grad():
                torch.log_softmax(lm_head(x).float(), dim=-1)
        lm.append([measure(f, repeat, warmup)])
        log(f"  lm_head w={w:4d}            {lm[-1][0] * 1e3:9.3f} ms")

    def forward(w, pos, mask, cache):
        emb, feat = (torch.randn(1, w, h, device=device).to(dtype) for _ in range(2))
        return lambda: head(fc(torch.cat([emb, feat], dim=-1)), pos, mask, cache)
    with torch.no_grad():
        draft = _grid("draft", head, ws, ctxs, dtype, device, repeat, warmup, log, forward)
    return {"lm_head": {"model": "table", "w": ws, "ctx": [0], "t_s": lm},
            "draft_forward": {"model": "table", "w": ws, "ctx": ctxs, "t_s": draft}}


def host_round(device: str):
    """One round of the tiny operators rank 0's drafting dispatches (top-k of a level's scores, gathering rows,
    growing an index array by concatenation, a small matmul, a cumulative sum, a mask), on ``device``."""
    import torch
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, generator=g).to(device)
    rows = torch.randn(64, 8, generator=g).to(device)
    w = torch.randn(8, 8, generator=g).to(device)
    idx = torch.arange(8).to(device)

    def run():
        top = torch.topk(scores, 8)
        picked = torch.index_select(rows, 0, top.indices)
        grown = torch.cat([idx, top.indices])
        mixed = picked @ w
        depth = torch.cumsum(grown, 0)
        return torch.where(depth > 3, depth, idx.repeat(2)), mixed
    return run, scores


def measure_host_costs(device: str, rounds: int = 2000, repeat: int = 5) -> dict:
    """Rank 0's host cost on ``device``, in microseconds: ``op_us`` per dispatched aten operator (``rounds``
    rounds of :func:`host_round`'s tiny operators, queued back to back with one synchronisation at the end, over
    their operator count as :class:`pipeline.tools.opcount.OpCounter` counts them, the count the simulator
    multiplies) and ``sync_us`` per host<->device synchronisation (a tiny operator plus ``.item()`` per round: its
    time per round minus its operators at ``op_us``). Medians of ``repeat``. On a GPU these are launch-bound
    (the kernels are tiny), so it is the host's dispatch + launch rate (wall clock); on a CPU, the dispatch rate
    and a ``.item()`` that waits for nothing, timed as this thread's CPU time (what the simulator's measured
    host work is), so that a shared, loaded CPU does not count time spent descheduled."""
    import torch
    from pipeline.tools.opcount import OpCounter
    cuda = device.startswith("cuda")
    run, scores = host_round(device)

    def sync_round():
        return (scores + 1.0).sum().item()

    def per_op(fn, n_rounds):
        with OpCounter() as c:
            fn()
        ops = c.count.ops
        for _ in range(min(50, n_rounds)):
            fn()

        def block():
            for _ in range(n_rounds):
                fn()
        times = [timed_call(block, cuda, time.perf_counter if cuda else time.thread_time) for _ in range(repeat)]
        return statistics.median(times) / n_rounds, ops
    t_round, ops = per_op(run, rounds)
    op_us = t_round / ops * 1e6
    t_sync, sync_ops = per_op(sync_round, max(1, rounds // 4))
    sync_us = max(0.0, t_sync * 1e6 - sync_ops * op_us)
    return {"op_us": round(op_us, 3), "sync_us": round(sync_us, 3), "ops_per_round": ops,
            "sync_round_ops": sync_ops, "rounds": rounds, "repeat": repeat}


def _device_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or platform.machine()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    ws, ctxs = _ints(args.w, "w"), _ints(args.ctx, "ctx")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    dtype_name = args.dtype if args.dtype != "auto" else ("float16" if device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    host = None
    if not args.no_rank0 or args.host_only:
        host = measure_host_costs(device, args.host_rounds, args.repeat)
        log(f"  rank 0 host: {host['op_us']:.3f} us per dispatched operator, {host['sync_us']:.3f} us per sync "
            f"({host['ops_per_round']} operators per round x {host['rounds']} rounds, median of {host['repeat']})")
        stamp = {"tool": "python -m pipeline.tools.profile", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "device": _device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                 **{k: host[k] for k in ("ops_per_round", "sync_round_ops", "rounds", "repeat")},
                 "argv": sys.argv[1:] if argv is None else list(argv)}
        rank0_host = {"op_us": host["op_us"], "sync_us": host["sync_us"],
                      "source": f"measured by pipeline.tools.profile on {stamp['device']} ({stamp['date']})"}
    if args.host_only:
        out = Path(args.out)
        doc = {"description": "rank 0's host cost per dispatched aten operator and per host<->device sync "
                              "(python -m pipeline.tools.profile --host-only)", **rank0_host, "measured": stamp}
        from config.profiles import HostCost
        HostCost.parse(doc, str(out))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        log(f"wrote {out} (the simulator reads profiles/rank0_host/<profile name>.json for --rank0-cost ops)")
        return 0
    cfg, shape = stage_config(args)
    log(f"profiling {args.layers} layers hidden={shape['hidden']} intermediate={shape['intermediate']} "
        f"heads={shape['heads']}/{shape['kv_heads']} {dtype_name} on {device}")
    block = build_block(cfg, args.layers, dtype, device)
    from model.layers import set_lean
    set_lean(block, not args.transformers_layers)
    grid = measure_stage(block, cfg, ws, ctxs, dtype, device, args.repeat, args.warmup, log)
    del block
    out = Path(args.out)
    name = args.name or out.stem
    elt = torch.empty(0, dtype=dtype).element_size()
    params = sum(p.numel() for p in build_block(cfg, 1, dtype, "meta").layers.parameters()) * args.layers
    prof = {
        "name": name,
        "description": f"measured on {platform.node() or 'this host'} ({device}, {dtype_name}): {args.layers} layers "
                       f"hidden {shape['hidden']}, intermediate {shape['intermediate']}, heads {shape['heads']}/"
                       f"{shape['kv_heads']}, random weights, median of {args.repeat} runs",
        "measured": {"tool": "python -m pipeline.tools.profile", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "device": _device_name(device), "torch": torch.__version__, "dtype": dtype_name, "layers": args.layers,
                     "stage_params": params, "stage_weight_bytes": params * elt, **shape,
                     "threads": torch.get_num_threads(), "repeat": args.repeat, "warmup": args.warmup,
                     "argv": sys.argv[1:] if argv is None else list(argv)},
        "stage": {"model": "table", "w": ws, "ctx": ctxs, "t_s": grid},
        "link": {"latency_s": args.latency_ms / 1e3, "bandwidth_mbps": args.bandwidth_mbps or None,
                 "hidden_bytes_per_token": args.hidden_bytes or shape["hidden"] * 2, "header_bytes": 384},
    }
    if not args.no_rank0:
        prof["rank0"] = measure_rank0(cfg, ws, ctxs, dtype, device, args.repeat, args.warmup, log,
                                      args.transformers_layers)
        prof["rank0_host"] = rank0_host
    from config.profiles import Profile
    Profile.from_dict(json.loads(json.dumps(prof)), str(out))   # validate before writing
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1))
    log(f"wrote {out} (use: emu.profile={out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
