"""The whole pipeline in one process: one thread per stage, queues as ring links, the real stage worker, engine
and modes.

The ring itself is :mod:`pipeline.local_ring` (the :class:`pipeline.transport.Transport` surface and ordering,
the real wire codec). The tests use it to sweep many world sizes and tree shapes quickly (the real
multi-process path is covered by ``tests/test_e2e.py``); tools use it to measure acceptance without launching
ranks (``pipeline/tools/drafter_bench.py``).
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from config.run_config import DEFAULT, apply_overrides
from draft.protocol import forget_requests
from pipeline.engine import timed_generation
from pipeline.local_ring import TIMEOUT_S, LocalComm, LocalRing, stage_threads
from pipeline.build import load_rank_stage, make_drafter, make_engine, make_static_stage
from pipeline.modes import new_decoder
from pipeline.worker import StageWorker


def _wait_s(cfg) -> float:
    """How long a thread of the in-process ring waits for its next message: the ring's own 60 s, or longer when
    ``comm.timeout_s`` says so (on a loaded host a long prefill can take longer than 60 s; the threads can be
    slow, not lost, and a failed thread's error is raised by ``stage_threads``)."""
    return max(TIMEOUT_S, float(cfg.comm.timeout_s))


def head_key(head: str) -> str:
    """One name per head: an existing directory as its resolved path (``./H``, ``H``, ``H/`` and the absolute path
    are one head), anything else (``untrained``, ``oracle:<dir>``, a path still to be created) as given. What
    :func:`head_conflict` and ``drafter_bench``'s rows compare."""
    p = Path(head)
    return str(p.resolve()) if p.is_dir() else head


def not_in_process(cfg) -> str | None:
    """Why ``cfg`` cannot run in one process as it says, or None: settings the in-process ring cannot honour
    (``emu.profile``: the emulated testbed models launched ranks' links and compute, and this ring has no link to
    pace; ``comm.trace``: per-rank timelines). Refused rather than ignored: a run "with" them would measure without
    them. The API and :func:`run_threaded` (its tools: ``drafter_bench``) ask it."""
    for key, on in (("emu.profile", bool(cfg.emu.profile)), ("comm.trace", cfg.comm.trace)):
        if on:
            return (f"{key} is not available in one process (the stages are threads, with no emulated links or "
                    f"per-rank traces): launch the ranks, ./run_pipe.sh {key}=..., or use the simulator "
                    f"(docs/simulator.md)")
    return None


def head_conflict(overrides: list[str], drafter: str | None) -> str | None:
    """The head an override names (``model.head_dir=`` or its alias) when it is not ``drafter`` (compared by
    :func:`head_key`), the head :func:`run_threaded` is handed and uses: such an override would lose silently, so
    callers refuse it (a tool can ask before loading anything). None where there is no conflict."""
    named = apply_overrides(DEFAULT, overrides).model.head_dir
    if drafter is None or named in ("", DEFAULT.model.head_dir) or head_key(named) == head_key(drafter):
        return None
    return named


def run_threaded(stage_root: Path, prompts: list[list[int]], modes: list[str], overrides: list[str],
                 stop_ids: set[int], drafter: str | None = None, dtype=torch.float64,
                 guard=nullcontext, step_observers=()) -> dict[str, list]:
    """Generate every prompt in every mode; returns ``{mode: [GenResult, ...]}``.

    ``drafter``: a ``model.head_dir`` value, chosen exactly as ``pipeline.run`` does (an EAGLE head directory,
    ``oracle:<dir>``, ``adversary:<dir>``); None = the untrained head. ``guard()``: a context manager that every
    rank's thread enters around its decode work once the models are loaded (``tests/test_device_guard.py``
    passes ``lambda: torch.device("meta")``). ``step_observers``: rank 0's step observers
    (e.g. a :class:`pipeline.tree_stats.TreeStats`).
    """
    conflict = head_conflict(overrides, drafter)
    if conflict is not None:
        raise ValueError(f"an override names the head {conflict!r}, but the head given is {drafter!r}")
    cfg = apply_overrides(DEFAULT, overrides)
    if (why := not_in_process(cfg)) is not None:
        raise ValueError(why)
    from model.stage_format import read_manifest
    world = len(read_manifest(stage_root)["split"])
    if drafter is not None:
        cfg.model.head_dir = drafter
    ring = LocalRing(world)
    models = [load_rank_stage(cfg, stage_root, r, world, dtype, "cpu") for r in range(world)]   # as pipeline.run

    def stage(r: int) -> None:
        worker = StageWorker(models[r], LocalComm(ring, r, timeout_s=_wait_s(cfg)), cfg.model.max_seq_len, dtype,
                             "cpu")
        worker.static = make_static_stage(cfg, models[r], "cpu")
        with guard():
            worker.run()

    comm0 = LocalComm(ring, 0, timeout_s=_wait_s(cfg))
    d = make_drafter(cfg, stage_root, models[0], dtype, "cpu") if any(m != "ar" for m in modes) else None
    engine = make_engine(cfg, comm0, models[0], stage_root, modes, stop_ids, dtype, "cpu", drafter=d)
    engine.step_observers = list(step_observers)
    results: dict[str, list] = {}
    with stage_threads(world, stage, ring) as errors:
        try:
            with guard():
                for mode in modes:
                    forget_requests(d)     # each mode drafts as a run of it alone would (draft/protocol.py)
                    results[mode] = [timed_generation(engine, p, new_decoder(mode)) for p in prompts]
        finally:
            if not errors:
                engine.shutdown()
    return results
