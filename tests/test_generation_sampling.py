"""Sampled drafts follow each generation's own temperature and seed (a :class:`draft.protocol.DraftSampling`, an
argument of the drafter's ``start``).

``draft.eagle_sample`` and a small LM's ``draft.ssm_sample`` used to be fixed when the drafter was built, from the
run's ``gen.temperature`` (0 by default): through the API or a server, whose generations bring their own
temperature and seed, they did nothing at T > 0, and the draws' stream kept the load's seed. The rule
(:meth:`draft.drafter.BeamTreeDrafter.take_sampling`): sampled trees iff the wish and the generation's T > 0, q at
that T (unless the temperature is fixed, ``draft.ssm_temperature`` >= 0), the stream seeded with the generation's
seed. The law itself is tests/test_sampled_beam.py's and tests/test_sampling.py's."""
from __future__ import annotations

import torch

from draft.drafter import BeamTreeDrafter
from draft.merged import MergedDrafter
from draft.protocol import DraftSampling
from model.split import split_checkpoint
from tests.helpers import STORIES


def test_take_sampling_rules():
    d = BeamTreeDrafter()
    d.set_sampling(True, 1.0, 5)
    for t, samples in ((0.0, False), (0.7, True), (0.0, False), (1.3, True)):
        d.take_sampling(DraftSampling(t, 11))
        assert d.samples == samples and d.seed == 11
    assert d.temperature == 1.3                       # q at the generation's T (the last T > 0)
    d.take_sampling(None)                             # none given: the current settings stay
    assert d.samples and d.temperature == 1.3 and d.seed == 11
    off = BeamTreeDrafter()
    off.set_sampling(False, 1.0, 5)
    off.take_sampling(DraftSampling(1.0, 2))
    assert not off.samples                            # no wish: never
    fixed = BeamTreeDrafter()
    fixed.set_sampling(True, 0.5, 5, follow=False)
    fixed.take_sampling(DraftSampling(1.2, 3))
    assert fixed.samples and fixed.temperature == 0.5
    fixed.take_sampling(DraftSampling(0.0, 3))
    assert not fixed.samples                          # a greedy generation never samples its drafts
    d.take_sampling(DraftSampling(1.0, 4))
    d.reseed()
    a = [d.draw(torch.full((9,), 1 / 9)) for _ in range(12)]
    d.reseed()
    assert a == [d.draw(torch.full((9,), 1 / 9)) for _ in range(12)]
    d.take_sampling(DraftSampling(1.0, 5))
    d.reseed()
    assert a != [d.draw(torch.full((9,), 1 / 9)) for _ in range(12)]     # the generation's seed, not the load's


def test_start_takes_the_generations_sampling_through_merges_and_wrappers():
    a, b = BeamTreeDrafter(), BeamTreeDrafter()
    a.set_sampling(True, 1.0, 0)
    b.set_sampling(False, 1.0, 0)
    for d in (a, b):                                  # only what start does with ``sampling`` matters here
        d.start = lambda p, f, feats, sampling=None, _d=d: (_d.take_sampling(sampling), torch.zeros(1))[1]
    m = MergedDrafter.__new__(MergedDrafter)
    m.sources = [a, b]
    m.start([1, 2], 3, None, sampling=DraftSampling(0.9, 7))
    assert a.samples and a.temperature == 0.9 and a.seed == 7 and not b.samples
    from pipeline.tools.simulate.drafter import ReplayDrafter
    w = ReplayDrafter(a, None)                        # a wrapper (``inner``): start hands ``sampling`` on
    w._features = lambda rows: rows
    w.start([1], 2, None, sampling=DraftSampling(0.0, 8))
    assert not a.samples and a.seed == 8


def test_api_generation_at_t1_samples_drafts_loaded_at_t0(tmp_path, monkeypatch):
    """A split loaded at T = 0 with draft.eagle_sample=true: a generation at temperature 1 drafts sampled trees
    (proposals), reproducibly per seed; one at T = 0 drafts deterministic trees. Planted: without the seam (the
    load's settings kept) no tree of the T = 1 generation is sampled."""
    from pipeline.api import FlowSpec
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 2, 3], progress=False)
    with FlowSpec.load(stages, "mode=naive", f"head_dir=oracle:{STORIES}", "draft.eagle_sample=true",
                       "draft.sample_chains=3") as fs:
        drafter, seen = fs.engine.drafter, []
        grow = drafter.grow_tree

        def recording(*a, **k):
            tree = grow(*a, **k)
            seen.append(tree.proposals is not None)
            return tree
        monkeypatch.setattr(drafter, "grow_tree", recording)

        def run(t, seed):
            seen.clear()
            ids = fs.generate("Once upon a time", max_new_tokens=12, temperature=t, seed=seed).ids
            return ids, list(seen)
        ids1, sampled = run(1.0, 3)
        assert sampled and all(sampled)
        assert run(1.0, 3)[0] == ids1                 # the same seed: the same draws and answer
        _, greedy = run(0.0, 0)
        assert greedy and not any(greedy)
        import pipeline.engine as engine_mod     # planted: the generation's sampling not handed to start
        monkeypatch.setattr(engine_mod, "DraftSampling", lambda t, seed: None)
        _, planted = run(1.0, 3)
        assert planted and not any(planted)
