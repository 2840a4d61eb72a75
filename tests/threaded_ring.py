"""Test double: the whole pipeline in one process, one thread per stage, queues as ring links.

It implements exactly the :class:`pipeline.comm.Comm` surface the engine and the stage workers use
(``rank``, ``world``, ``tracer``, ``send_next``, ``recv_prev``, ``broadcast``), with the same ordering
guarantees as the real thing (one FIFO per link, broadcasts received in issue order). It lets the
tests sweep many world sizes and tree shapes quickly; the real multi-process path is covered by
``test_e2e.py``. Messages are passed through the real wire codec, so the codec is exercised too.
"""
from __future__ import annotations

import queue
import threading
from pathlib import Path

import torch

from config.run_config import DEFAULT, apply_overrides
from draft.drafter import Drafter
from draft.eagle import init_untrained_head
from model.stage_model import load_stage
from pipeline.engine import Engine, timed_generation
from pipeline.messages import decode, encode
from pipeline.modes import DECODERS
from pipeline.trace import Tracer
from pipeline.verify import Sampler
from pipeline.worker import StageWorker

TIMEOUT_S = 60.0


class _Ring:
    def __init__(self, world: int) -> None:
        self.world = world
        self.links = [queue.Queue() for _ in range(world)]      # links[r]: r -> r+1
        self.bcast = [queue.Queue() for _ in range(world)]


class ThreadComm:
    def __init__(self, ring: _Ring, rank: int) -> None:
        self.ring, self.rank, self.world = ring, rank, ring.world
        self.tracer = Tracer(rank, enabled=False)

    @staticmethod
    def _wire(msg):
        header, payload = encode(msg)
        return decode(header.clone(), payload.clone())

    def send_next(self, msg) -> None:
        self.ring.links[self.rank].put(self._wire(msg))

    def recv_prev(self):
        return self.ring.links[(self.rank - 1) % self.world].get(timeout=TIMEOUT_S)

    def broadcast(self, decision):
        if self.rank == 0:
            for r in range(1, self.world):
                self.ring.bcast[r].put(self._wire(decision))
            return decision
        return self.ring.bcast[self.rank].get(timeout=TIMEOUT_S)


def run_threaded(stage_root: Path, prompts: list[list[int]], modes: list[str], overrides: list[str],
                 stop_ids: set[int], drafter: str | None = None, dtype=torch.float64) -> dict[str, list]:
    """Generate every prompt in every mode; returns ``{mode: [GenResult, ...]}``.

    ``drafter``: None (untrained EAGLE head), ``oracle:<dir>`` or ``adversary:<dir>``.
    """
    from model.stage_format import read_manifest
    world = len(read_manifest(stage_root)["split"])
    cfg = apply_overrides(DEFAULT, overrides)
    ring = _Ring(world)
    models = [load_stage(stage_root, r, world, dtype) for r in range(world)]
    errors: list[BaseException] = []

    def stage(r: int) -> None:
        try:
            StageWorker(models[r], ThreadComm(ring, r), cfg.model.max_seq_len, dtype, "cpu").run()
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)

    threads = [threading.Thread(target=stage, args=(r,), daemon=True) for r in range(1, world)]
    for t in threads:
        t.start()
    comm0 = ThreadComm(ring, 0)
    if drafter is None:
        head = init_untrained_head(models[0].config).to(dtype).eval()
        head.embed_tokens.weight.data.copy_(models[0].embed_tokens.weight.data)
        d = Drafter(head, models[0].lm_head, cfg.model.max_seq_len + 64)
    else:
        from draft.oracle import OracleDrafter
        kind, path = drafter.split(":", 1)
        d = OracleDrafter(path, adversarial=(kind == "adversary"), dtype=dtype)
    sampler = Sampler(cfg.gen.temperature, cfg.gen.top_p, cfg.gen.top_k_sampling, torch.Generator())
    engine = Engine(models[0], comm0, d, sampler, stop_ids, cfg)
    results: dict[str, list] = {}
    try:
        for mode in modes:
            results[mode] = [timed_generation(engine, p, DECODERS[mode]) for p in prompts]
    finally:
        if not errors:
            engine.shutdown()
        for t in threads:
            t.join(timeout=10)
    if errors:
        raise errors[0]
    return results
