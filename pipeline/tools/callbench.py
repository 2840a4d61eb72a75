"""What the per-call benches (:mod:`pipeline.tools.graphbench`, :mod:`pipeline.tools.layerbench`) share, one copy:
their argument checks, the run configuration and stage root they time on, where they ran, their Markdown table and
their JSON file (:mod:`pipeline.tools.ringbench` shares the ``--rows`` parser).

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
