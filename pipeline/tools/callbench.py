"""What the per-call benches (:mod:`pipeline.tools.graphbench`, :mod:`pipeline.tools.layerbench`) share, one copy:
their options and argument checks, the run configuration and stage root they time on, the stage they time with its
cached context and its step call, the alternating-block timing loop, where they ran, their Markdown table and their
JSON file (:mod:`pipeline.tools.ringbench` shares the ``--rows`` parser).

Both take ``--device``, ``--threads``, ``--json`` and ``key=value`` run overrides; a bad override or a CUDA device
that is absent raises the bench's own error class (a :class:`ValueError`), which its ``main`` prints as one line.
"""
from __future__ import annotations

import json
from pathlib import Path


def parse_rows(p, text: str) -> list[int]:
    """``--rows`` (comma-separated integers) as a list; ``p.error`` when it is not one (the ring and call benches)."""
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {text!r}")


def add_call_args(p, stage_help: str, overrides_help: str) -> None:
    """The options both call benches take (checked by :func:`check_args`)."""
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16", "float64"))
    p.add_argument("--stage", type=int, default=2, help=stage_help)
    p.add_argument("--rows", default="1,16", help="comma-separated segment sizes for the stage step")
    p.add_argument("--ctx", type=int, default=256, help="context tokens cached before every timed call")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per block")
    p.add_argument("--blocks", type=int, default=3, help="alternating blocks per setting")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--json", help="also write the table as JSON here")
    p.add_argument("overrides", nargs="*", help=overrides_help)


def check_args(p, args) -> None:
    """The checks both benches' parsers make after parsing (``p.error`` on the first that fails): ``--repeat``,
    ``--blocks`` and ``--ctx`` at least 1, ``--rows`` comma-separated integers at least 1 (turned into a list),
    ``--stage`` at least 2."""
    if args.repeat < 1 or args.blocks < 1 or args.ctx < 1:
        p.error("--repeat, --blocks and --ctx must be >= 1")
    args.rows = parse_rows(p, args.rows)
    if any(r < 1 for r in args.rows):
        p.error("--rows must be >= 1")
    if args.stage < 2:
        p.error("--stage must be >= 2 (stage 1 takes token ids, rank 0 has no layers)")


def run_setup(args, error: type[Exception]):
    """``(cfg, stage_root)``: the run configuration ``DEFAULT`` + ``args.overrides`` and its resolved stage root,
    with torch set to ``args.threads`` threads. Raises ``error(message)`` on a bad override or on
    ``--device cuda...`` without CUDA."""
    import torch

    from config.run_config import DEFAULT, ConfigError, apply_overrides
    from model.default_model import resolve_stage_root
    try:
        cfg = apply_overrides(DEFAULT, args.overrides)
    except ConfigError as e:
        raise error(str(e)) from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise error(f"--device {args.device}: no CUDA device here")
    torch.set_num_threads(args.threads)
    return cfg, resolve_stage_root(cfg.model.stage_dir)


def load_stage(args, cfg, stage_root: Path, error: type[Exception], room: int):
    """``(stage, rank0, drafter, cache, g, dtype, dev)``: the timed stage ``--stage`` (raises ``error`` when the
    root has no such stage), rank 0 and its drafter, and the stage's KV cache (``--ctx + room`` entries) holding a
    committed ``--ctx``-token context of random rows (generator ``g``, seeded 0, which the caller goes on drawing
    from)."""
    import torch

    from model.stage_format import read_manifest
    from pipeline.build import load_rank_stage, make_drafter
    world = len(read_manifest(stage_root)["split"])
    if args.stage >= world:
        raise error(f"--stage {args.stage}: {stage_root} has stages 1..{world - 1}")
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    stage = load_rank_stage(cfg, stage_root, args.stage, world, dtype, args.device)
    rank0 = load_rank_stage(cfg, stage_root, 0, world, dtype, args.device)
    drafter = make_drafter(cfg, stage_root, rank0, dtype, args.device)
    g = torch.Generator().manual_seed(0)
    cache = stage.block.new_cache(args.ctx + room, dtype, dev)
    pos, mask = cache.context_inputs(args.ctx, dtype)
    with torch.no_grad():
        stage(torch.randn(1, args.ctx, rank0.config.hidden_size, generator=g).to(dev, dtype), pos, mask, cache)
    cache.commit_forward(args.ctx, as_context=True)
    return stage, rank0, drafter, cache, g, dtype, dev


def stage_step(cache, forward, w: int, hidden: int, g, dtype, dev):
    """One verification stage step on a ``w``-row chain segment (random rows drawn from ``g`` now) after the
    cached context, as a call that leaves the cache as it found it; ``forward()`` gives the stage callable."""
    import torch
    x = torch.randn(1, w, hidden, generator=g).to(dev, dtype)
    parents = torch.arange(-1, w - 1)

    def call():
        p, m, anc, depth = cache.tree_inputs(parents, dtype)
        with torch.no_grad():
            forward()(x, p, m, cache)
        cache.truncate_tree()
    return call


def alternate(args, settings: list, pick, warm: int = 2, clock=None) -> dict:
    """``{setting: [seconds]}``: ``args.blocks`` blocks of ``args.repeat`` timed calls per setting, the settings'
    order reversed every other block (load drift hits all alike), each warmed first with ``warm`` untimed calls.
    ``pick(setting)`` puts the setting in place and returns its ``(fn, setup)``: ``setup`` (or None) runs untimed
    before each call (:func:`pipeline.tools.profile.timed_call`: CUDA synchronised around it; ``clock``: its clock)."""
    import time

    from pipeline.tools.profile import timed_call
    cuda, clock = args.device.startswith("cuda"), clock or time.perf_counter

    def once(fn, setup) -> float:
        if setup is not None:
            setup()
        return timed_call(fn, cuda, clock)
    times = {s: [] for s in settings}
    for s in settings:
        fn, setup = pick(s)
        for _ in range(warm):
            once(fn, setup)
    for i in range(args.blocks):
        for s in (settings if i % 2 == 0 else settings[::-1]):
            fn, setup = pick(s)
            times[s] += [once(fn, setup) for _ in range(args.repeat)]
    return times


def where(args) -> str:
    """The device a bench ran on, for its header and JSON: the GPU's name, or the CPU and its thread count."""
    import torch
    return torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {args.threads} thread(s)"


def md_table(header: str, cols: list[str], rows: list[tuple[str, list[str]]]) -> str:
    """``header``, a blank line, then a Markdown table whose first column is ``call``: one line per
    ``(call, cells)`` in ``rows`` (``cells`` as many as ``cols``)."""
    out = [header, "", "| call | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    out += [f"| {call} | " + " | ".join(cells) + " |" for call, cells in rows]
    return "\n".join(out)


def write_json(path: str | None, doc: dict) -> None:
    """``doc`` as indented JSON at ``path`` (its folder created); nothing when ``path`` is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
