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
from model.stage_model import load_stage
from pipeline.engine import timed_generation
from pipeline.local_ring import TIMEOUT_S, LocalComm, LocalRing, stage_threads
from pipeline.build import make_drafter, make_engine, make_static_stage
from pipeline.modes import new_decoder
from pipeline.worker import StageWorker



def _wait_s(cfg) -> float:
    """How long a thread of the in-process ring waits for its next message: the ring's own 60 s, or longer when
    ``comm.timeout_s`` says so (on a loaded host a long prefill can take longer than 60 s; the threads can be
    slow, not lost, and a failed thread's error is raised by ``stage_threads``)."""
    return max(TIMEOUT_S, float(cfg.comm.timeout_s))

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
    from model.stage_format import read_manifest
    world = len(read_manifest(stage_root)["split"])
    cfg = apply_overrides(DEFAULT, overrides)
    ring = LocalRing(world)
    models = [load_stage(stage_root, r, world, dtype) for r in range(world)]
    from draft.eagle3 import stage_taps   # as pipeline.run does on every rank (EAGLE-3 heads: tapped layers)
    taps = stage_taps(cfg.model.eagle3_taps, Path(drafter) if drafter else None, models[0].config.num_hidden_layers)
    for m in models:
        m.set_taps(taps)

    def stage(r: int) -> None:
        worker = StageWorker(models[r], LocalComm(ring, r, timeout_s=_wait_s(cfg)), cfg.model.max_seq_len, dtype,
                             "cpu")
        worker.static = make_static_stage(cfg, models[r], "cpu")
        with guard():
            worker.run()

    comm0 = LocalComm(ring, 0, timeout_s=_wait_s(cfg))
    if drafter is not None:
        cfg.model.head_dir = drafter
    d = make_drafter(cfg, stage_root, models[0], dtype, "cpu") if any(m != "ar" for m in modes) else None
    engine = make_engine(cfg, comm0, models[0], stage_root, modes, stop_ids, dtype, "cpu", drafter=d)
    engine.step_observers = list(step_observers)
    results: dict[str, list] = {}
    with stage_threads(world, stage) as errors:
        try:
            with guard():
                for mode in modes:
                    results[mode] = [timed_generation(engine, p, new_decoder(mode)) for p in prompts]
        finally:
            if not errors:
                engine.shutdown()
    return results


def run_concurrent(stage_root: Path, jobs: list[tuple[list[int], str, object]], overrides: list[str],
                   stop_ids: set[int], drafter: str | None = None, lanes: int = 2, dtype=torch.float64,
                   lane_timeout_s: float | None = 60.0, started=None, warmup: list | None = None,
                   after_warmup=None, stage_meter=None, rank0_meter=None):
    """Run ``jobs`` (``(prompt ids, mode, GenSettings or None)``) concurrently on ``lanes`` lanes of one ring
    (:mod:`pipeline.lanes`): every job starts at once in its own thread and waits for a free lane; returns
    ``(results in job order, the LanePool)``. A job's exception is re-raised (the first one). ``started``:
    optional ``started(job index, lane)`` hook, called when a job gets its lane. ``warmup``: ``(prompt ids, mode)``
    generations run first, one at a time, by the engine the pool is then built on (as a server's warm-up);
    ``after_warmup(ring, engine)``: a test hook called then (e.g. to deliver a late direct message).
    ``stage_meter(rank)``: a meter for stage ``rank``'s forwards (e.g. one that pads them, as the emulated testbed
    does); ``rank0_meter()``: one for rank 0's model ops on every lane (``pipeline.lanes.lane_engine``). The pool's
    ``stage_workers`` are the stages' workers."""
    import threading

    from model.stage_format import read_manifest
    from pipeline.lanes import LanePool
    world = len(read_manifest(stage_root)["split"])
    cfg = apply_overrides(DEFAULT, overrides)
    ring = LocalRing(world)
    models = [load_stage(stage_root, r, world, dtype) for r in range(world)]
    from model.layers import set_lean
    for m in models:
        set_lean(m, cfg.model.lean_layers)     # model.lean_layers=false: the transformers layers, as pipeline.build
    modes = sorted({m for _, m, _ in jobs})
    if drafter is not None:
        cfg.model.head_dir = drafter
    d = make_drafter(cfg, stage_root, models[0], dtype, "cpu") if any(m != "ar" for m in modes) else None
    engine = make_engine(cfg, LocalComm(ring, 0, timeout_s=_wait_s(cfg)), models[0], stage_root, modes, stop_ids, dtype,
                         "cpu", drafter=d)
    results: list = [None] * len(jobs)
    failures: list[BaseException] = []
    workers: list[StageWorker] = []      # the stages' workers (tests read their batched-forward counters)

    def stage(r: int) -> None:
        worker = StageWorker(models[r], LocalComm(ring, r, timeout_s=_wait_s(cfg)), cfg.model.max_seq_len, dtype,
                             "cpu")
        if stage_meter is not None:
            worker.meter = stage_meter(r)
        workers.append(worker)
        worker.run()

    with stage_threads(world, stage) as errors:
        for prompt, mode in warmup or []:
            timed_generation(engine, prompt, new_decoder(mode))
        if after_warmup is not None:
            after_warmup(ring, engine)
        pool = LanePool(engine, lanes, timeout_s=lane_timeout_s, rank0_meter=rank0_meter)
        pool.stage_workers = workers

        def job(i: int) -> None:
            lane = pool.acquire()
            try:
                if started is not None:
                    started(i, lane)
                prompt, mode, settings = jobs[i]
                results[i] = timed_generation(pool.engines[lane], prompt, new_decoder(mode), settings)
            except BaseException as e:   # re-raised by the caller's thread
                failures.append(e)
            finally:
                pool.release(lane)

        threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not errors:
            pool.shutdown()
    if failures:
        raise failures[0]
    return results, pool
