"""End to end on the in-process ring: every mode with ``draft.sources`` and ``sps`` equals HF greedy; seeded
T > 0 runs reproduce.
"""
from __future__ import annotations

import pytest
import torch

from config.run_config import ConfigError, DEFAULT, apply_overrides
from draft.lookup import LookupDrafter
from draft.merged import MergedDrafter
from draft.protocol import TreeDrafter
from tests.test_sampling import MarkovDrafter, V
from tests.multidraft_common import E2E_PROMPTS, MarkovSSM, tiny


ALL = ["naive", "pruned", "continuous", "pipedec", "sps"]


@pytest.mark.parametrize("sources,head", [("eagle,lookup,ssm:SSM", None), ("lookup,ssm:FULL", None),
                                          ("eagle,lookup", "oracle"), ("lookup", None)])
def test_every_mode_with_merged_sources_equals_hf(tiny, sources, head):
    from tests.helpers import hf_greedy
    from pipeline.inprocess import run_threaded
    src = sources.replace("SSM", str(tiny.ssm)).replace("FULL", str(tiny.full))
    modes = ALL if "ssm" in sources else ALL[:-1]
    res = run_threaded(tiny.stages, E2E_PROMPTS, modes, ["max_new_tokens=16", "dtype=float64", f"draft.sources={src}"],
                       {2}, f"oracle:{tiny.full}" if head else None)
    for mode, rows in res.items():
        for p, r in zip(E2E_PROMPTS, rows):
            assert r.output_ids == hf_greedy(tiny.full, p, 16, {2}, torch.float64), (sources, mode)
    if "FULL" in sources:       # a perfect small LM: long chains accepted
        assert min(r.tau for r in res["sps"]) > 3 and min(r.tau for r in res["naive"]) > 2


def test_every_drafter_has_the_protocol(tiny):
    from draft.oracle import OracleDrafter
    eagle_like = MarkovDrafter(torch.zeros(V, V))                  # a draft.drafter.Drafter
    for d in (eagle_like, OracleDrafter(str(tiny.full), adversarial=True), LookupDrafter(V),
              MergedDrafter([eagle_like, LookupDrafter(V)]), MarkovSSM(torch.zeros(V, V))):
        assert isinstance(d, TreeDrafter), type(d).__name__
    assert not isinstance(object(), TreeDrafter)


def test_sampled_merged_runs_are_seeded(tiny):
    from pipeline.inprocess import run_threaded
    args = ["max_new_tokens=12", "dtype=float64", "temperature=1.0", f"draft.sources=lookup,ssm:{tiny.ssm}"]
    outs = [run_threaded(tiny.stages, E2E_PROMPTS[:1], ["naive", "continuous", "sps"], [*args, f"seed={s}"], {2})
            for s in (5, 5, 6)]
    ids = [{m: r[0].output_ids for m, r in o.items()} for o in outs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_sampled_eagle_drafts_through_the_ring(tiny):
    """``draft.eagle_sample=true`` end to end on the in-process ring with the oracle drafter (q = the target's own
    law): seeded runs repeat and another seed differs; every sampled chain is accepted (q = p: min(1, p/q) = 1), so
    τ is long; at T = 0 the key changes nothing (greedy output = HF generate)."""
    from pipeline.inprocess import run_threaded
    from tests.helpers import hf_greedy
    head = f"oracle:{tiny.full}"
    args = ["max_new_tokens=12", "dtype=float64", "draft.sources=eagle", "draft.eagle_sample=true",
            "draft.sample_chains=2", "tree.total_token=9", "tree.depth=3"]
    outs = [run_threaded(tiny.stages, E2E_PROMPTS[:1], ["naive", "continuous"], [*args, "temperature=1.0",
                                                                                   f"seed={s}"], {2}, head)
            for s in (5, 5, 6)]
    ids = [{m: r[0].output_ids for m, r in o.items()} for o in outs]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert min(r[0].tau for r in outs[0].values()) > 2.5, {m: r[0].tau for m, r in outs[0].items()}
    greedy = run_threaded(tiny.stages, E2E_PROMPTS[:1], ["naive", "continuous"], args, {2}, head)
    for mode, rows in greedy.items():
        assert rows[0].output_ids == hf_greedy(tiny.full, E2E_PROMPTS[0], 12, {2}, torch.float64), mode


def test_eagle_sampling_keys():
    from draft.drafter import BeamTreeDrafter
    from pipeline.build import _set_eagle_sampling
    with pytest.raises(ConfigError, match="sample_chains"):
        apply_overrides(DEFAULT, ["draft.sample_chains=-1"])

    def state(words):
        d = BeamTreeDrafter()
        _set_eagle_sampling(d, apply_overrides(DEFAULT, words))
        return d.samples, d.temperature, d.seed, d.sample_chains, d.sample_wish
    on = ["draft.eagle_sample=true", "temperature=0.8", "seed=4", "draft.sample_chains=3"]
    assert state(on) == (True, 0.8, 4, 3, True)
    assert state(["draft.eagle_sample=true"])[::4] == (False, True)     # T = 0: the beam, sampling wished for
    assert state(["temperature=1.0"])[::4] == (False, False)            # off by default