"""Shared helpers of the several-drafter tests (split from the old tests/test_multidraft.py): tree builders, a
sampling Markov "small LM", the merged-tree exact-law runner and the tiny model fixture.
"""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from config.run_config import DEFAULT, apply_overrides
from draft.protocol import target_observer
from draft.ssm import SmallLMDrafter
from draft.tree import DraftTree
from pipeline.engine import OutputBuffer
from pipeline.modes.flowspec import ContinuousMode, PrunedMode
from pipeline.modes.naive import naive_decode
from pipeline.modes.pipedec import PipeDecMode
from pipeline.modes.sps import sps_decode
from tests.test_sampling import BranchingSampler, FakeRing, ROOT, TREE, V


def T(x, dtype=torch.long):
    return torch.tensor(x, dtype=dtype)


def tree(tokens, parents, scores, proposals=None):
    return DraftTree(T(tokens), T(parents), T(scores, torch.float32), proposals=proposals)


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root to ``node`` inclusive."""
    path, par = [], tree.parents.tolist()
    while node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1]


def sparse_draft(seed: int, support: int = 3) -> torch.Tensor:
    """Draft logits whose law lives on ``support`` random tokens per row (small supports keep enumeration cheap)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((V, V), -1e4)
    for r in range(V):
        idx = torch.randperm(V, generator=g)[:support]
        out[r, idx] = torch.randn(support, generator=g) * 1.5
    return out


class MarkovSSM(SmallLMDrafter):
    """The real ``SmallLMDrafter`` (deterministic beam and ``sampled_tree``) on a Markov table instead of a model."""

    def __init__(self, draft_logits: torch.Tensor, sample: bool = True, temperature: float = 1.0, draw=None,
                 seed: int = 0) -> None:
        self.table = torch.log_softmax(draft_logits.double(), dim=-1)
        self.vocab_size, self.sample, self.temperature, self.seed = V, sample, temperature, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.levels = 0                           # tree_forward calls since drop_tree: the next draw's depth - 1
        if draw is not None:
            self.draw = lambda q: draw(q, self.levels + 1)   # an enumerating draw; else BeamTreeDrafter.draw
        self.tree_paths = []

    def start(self, prompt_ids, first_token, features, sampling=None):
        self.tree_paths, self.levels = [], 0
        self.generator.manual_seed(self.seed)
        return self.table[first_token]

    def commit(self, tokens, features):
        self.drop_tree()
        return self.table[int(tokens.reshape(-1)[-1])]

    def tree_forward(self, tokens, features, parents):
        self.levels += 1                          # sampled_tree and sps' draft_chain: one call per level
        return super().tree_forward(tokens, features, parents)

    def drop_tree(self):
        self.levels = 0
        super().drop_tree()

    def _paths_logprobs(self, paths):
        return torch.stack([self.table[p[-1]] for p in paths])


def draft_draws(sampler: BranchingSampler):
    """A drafter's draw that branches like the verifier's (weighted by q) but commits no token: ``draw(q, depth)``,
    ``depth`` the draw's level below its tree's root (:meth:`tests.test_sampling.BranchingSampler.drafted`)."""
    def draw(q: torch.Tensor, depth: int) -> int:
        q = (q.double() / q.double().sum()).tolist()
        return sampler.drafted([(i, w) for i, w in enumerate(q) if w > 0], depth)
    return draw


MERGED_MODES = {"naive": (naive_decode, False), "pruned": (PrunedMode().decode, True),
                "continuous": (ContinuousMode().decode, True), "pipedec": (PipeDecMode().decode, True),
                "sps": (sps_decode, False)}


def make_merged_runner(mode, world, target, drafter, sampler, horizon, overrides):
    """``run() -> first horizon tokens`` through the mode's real rank-0 code with ``drafter`` (cf. test_sampling)."""
    decode, lockstep = MERGED_MODES[mode]
    ring = FakeRing(world, lockstep, getattr(sampler, "live", lambda: True))
    from pipeline.build import make_sps_drafter
    cfg = apply_overrides(DEFAULT, {**TREE, **overrides})
    engine = SimpleNamespace(comm=ring, gen=1, cfg=cfg, drafter=drafter,
                             sps_drafter=make_sps_drafter(cfg, drafter, None, None, None) if mode == "sps" else None,
                             tracer=SimpleNamespace(span=lambda *a, **k: nullcontext()),
                             observe_step=lambda *a: None, logits=lambda hidden: target[hidden[:, 0].long()])
    first = torch.full((V,), -1e9)
    first[ROOT] = 0.0

    def run():
        ring.reset()
        out = OutputBuffer(set(), horizon + 1, sampler=sampler, observe_target=target_observer(drafter),
                           prompt_last=ROOT)          # the feed seam, as pipeline.engine.timed_generation wires it
        decode(engine, first, None, [ROOT], out)
        assert out.finished and out.ids[0] == ROOT and not ring.inflight
        return tuple(out.ids[1:])
    run.ring = ring
    return run


def assert_merged_law(mode, world, target, drafter, sampler, overrides, horizon=2, max_runs=5000) -> int:
    """Every random branch of :func:`make_merged_runner`'s run enumerated: the law of the first ``horizon`` tokens
    is the target's (:func:`tests.test_sampling.assert_target_law`). Returns the number of runs enumerated."""
    from tests.test_sampling import assert_target_law, exact_law, target_law
    law, runs = exact_law(make_merged_runner(mode, world, target, drafter, sampler, horizon, overrides), sampler,
                          max_runs=max_runs)
    assert_target_law(law, target_law(sampler, target, horizon), mode)
    return runs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model.split import split_checkpoint
    from tests.helpers import tiny_llama
    root = tmp_path_factory.mktemp("multidraft")
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    ssm = tiny_llama(root / "ssm", seed=3, layers=1, dtype=torch.float64)
    stages = split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)
    return SimpleNamespace(full=full, ssm=ssm, stages=stages)


E2E_PROMPTS = [[1, 5, 9, 13, 22, 7, 5, 9, 13], [1] + list(range(3, 40)) + list(range(3, 20))]  # lookup hits
