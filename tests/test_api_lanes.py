"""The Python API with several generations at once (``FlowSpec.load(..., lanes=N)``, ``generate_many``), on
stories260K stages: every answer is the one the same call gives alone (greedy: HF's; sampled: the same seed's), the
generations really interleave on the ring, the outputs come back in the prompts' order, memory is forgotten on every
lane, ``close`` waits for the generations in flight, and bad input is one line. Planted: one generator shared by
the concurrent requests, which the sampled check must catch."""
from __future__ import annotations

import threading

import pytest
import torch

from config.errors import UserError
from tests.helpers import STORIES, hf_greedy

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="../shared/models/stories260K is not available")
STOP = {2}
PROMPTS = [[1, 403, 261, 350, 426], [1, 378, 432, 383, 286, 261, 376], [1, 298, 315, 421, 395], [1, 300, 301, 302]]
NEW = 20
# float64: a sampled answer's equality with its answer alone must not rest on float32 rounding (a stage's segment
# holds other rows when lanes share a forward; the race of ``Sampler.pick`` keeps almost every such draw, §101)
COMMON = (f"head_dir=oracle:{STORIES}", f"max_new_tokens={NEW}", "dtype=float64")


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    from model.split import split_checkpoint
    return split_checkpoint(STORIES, tmp_path_factory.mktemp("api_lanes") / "stages", [0, 3, 2], progress=False)


@pytest.fixture(scope="module")
def fs(stages):
    from pipeline.api import FlowSpec
    with FlowSpec.load(stages, *COMMON, template="raw", lanes=3) as f:
        yield f


@pytest.fixture(scope="module")
def refs():
    return [hf_greedy(STORIES, p, NEW, STOP, torch.float64) for p in PROMPTS]


def _max_active(fs, monkeypatch) -> list[int]:
    """Record how many lanes were active at each acquire (the generations' overlap)."""
    seen, acquire = [], fs.pool.acquire

    def spy(*a, **k):
        lane = acquire(*a, **k)
        seen.append(fs.pool.active)
        return lane

    monkeypatch.setattr(fs.pool, "acquire", spy)
    return seen


@pytest.mark.parametrize("mode", ["continuous", "naive", "pipedec", "ar"])
def test_concurrent_greedy_answers_equal_hf(fs, refs, mode, monkeypatch):
    seen = _max_active(fs, monkeypatch)
    switches = fs.pool.mux.switches
    outs = fs.generate_many(PROMPTS, mode=mode)
    assert [o.ids for o in outs] == refs                          # the prompts' order, each HF's answer
    assert [o.prompt_ids for o in outs] == PROMPTS and {o.mode for o in outs} == {mode}
    assert max(seen) == 3 and fs.pool.mux.switches > switches     # three at once, interleaved on the ring


def _sampled_alone_and_many(fs):
    seed = dict(temperature=1.0, seed=11)
    alone = [fs.generate(p, **seed).ids for p in PROMPTS]          # one at a time: each alone on a lane
    many = [o.ids for o in fs.generate_many(PROMPTS, **seed)]
    return alone, many


def test_concurrent_sampled_answers_equal_their_seed_alone(fs):
    alone, many = _sampled_alone_and_many(fs)
    assert many == alone
    assert len({tuple(a) for a in alone}) > 1


def test_planted_shared_generator_fails(stages, monkeypatch):
    """Planted: every request's sampler draws from one generator (seeded per request). Alone the answers are
    the same as before; interleaved, the requests take each other's draws: the check above must fail."""
    from pipeline.api import FlowSpec
    from pipeline.engine import GenSettings
    from pipeline.verify import Sampler
    shared = torch.Generator(device="cpu")

    def one_generator(self):
        return Sampler(float(self.temperature), float(self.top_p), int(self.top_k), shared.manual_seed(int(self.seed)))

    monkeypatch.setattr(GenSettings, "new_sampler", one_generator)
    with FlowSpec.load(stages, *COMMON, "mode=ar", template="raw", lanes=3) as f:
        alone, many = _sampled_alone_and_many(f)
    assert many != alone


def test_order_callbacks_progress_and_a_failed_prompt(fs, refs, capsys):
    done = []
    outs = fs.generate_many(PROMPTS[:2], mode="naive", on_output=lambda i, o: done.append((i, o.ids)), progress=True)
    assert sorted(done) == [(0, refs[0]), (1, refs[1])] and [o.ids for o in outs] == refs[:2]
    bar = capsys.readouterr().err
    assert "generate_many (3 at once)" in bar and "2/2" in bar and f"{len(refs[0]) + len(refs[1])} new tokens" in bar
    assert fs.generate_many([]) == []
    from pipeline.api import GenerationError
    with pytest.raises(GenerationError, match="token ids must be in"):
        fs.generate_many([PROMPTS[0], [1, 10 ** 6], PROMPTS[1]])
    with pytest.raises(GenerationError, match="does not stream"):
        fs.generate_many(PROMPTS, on_token=print)
    assert fs.generate(PROMPTS[2]).ids == refs[2]                   # the pipeline is whole afterwards


def test_forget_requests_reaches_every_lane(fs, monkeypatch):
    import draft.protocol
    forgotten = []
    monkeypatch.setattr(draft.protocol, "forget_requests", forgotten.append)
    fs.forget_requests()
    lanes = [e.drafter for e in fs.pool.engines]
    assert len({id(d) for d in lanes}) == 3 and all(any(d is f for f in forgotten) for d in lanes)


def test_close_waits_for_the_generations_in_flight(stages, refs):
    from pipeline.api import FlowSpec, GenerationError
    f = FlowSpec.load(stages, *COMMON, "mode=naive", template="raw", lanes=2)
    started, result = threading.Event(), {}

    def run():
        result["ids"] = f.generate(PROMPTS[0], on_commit=lambda ids: started.set()).ids

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    f.close()
    t.join(60)
    assert result["ids"] == refs[0]                                 # whole, not cut by the close
    with pytest.raises(GenerationError, match="closed"):
        f.generate(PROMPTS[0])
    f.close()                                                       # idempotent
    assert not any(th.is_alive() for th in f._threads)


def test_serve_max_active_is_the_same_knob(stages):
    from pipeline.api import FlowSpec
    with FlowSpec.load(stages, *COMMON, "serve.max_active=2", template="raw") as f:
        assert f.lanes == 2 and f.pool is not None
    with FlowSpec.load(stages, *COMMON, "serve.max_active=2", template="raw", lanes=1) as f:
        assert f.lanes == 1 and f.pool is None
    with FlowSpec.load(stages, *COMMON, template="raw") as f:     # serve.max_active=0 (auto): one at a time here
        assert f.lanes == 1 and f.pool is None


@pytest.mark.parametrize("lanes,words,match", [
    (0, (), "integer from 1 to 64"),
    (65, (), "integer from 1 to 64"),
    (True, (), "integer from 1 to 64"),
    (2, ("osd.enabled=true",), "online learning"),
    (1, ("emu.profile=edge_orin_7b",), "emu.profile is not available in one process"),
    (1, ("comm.trace=true",), "comm.trace is not available"),
])
def test_bad_lanes_are_one_line(stages, lanes, words, match):
    from pipeline.api import FlowSpec
    with pytest.raises(UserError, match=match) as e:
        FlowSpec.load(stages, *words, lanes=lanes)
    assert "\n" not in str(e.value)


def test_api_lanes_bench_table_and_bad_input(stages, tmp_path, capsys):
    """scripts/api_lanes_bench.py (docs/results.md §102): a row per lane count, the same answers in every row, and
    one-line errors."""
    import json
    import scripts.api_lanes_bench as B
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n"
                         for i, t in enumerate(["Once upon a time", "The cat sat", "A big dog"])))
    assert B.main(["--prompts-file", str(q), "-n", "3", "--lanes", "1,3", "--modes", "naive", "--stage-dir", str(stages),
                   f"head_dir=oracle:{STORIES}", "max_new_tokens=8", "dtype=float64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| mode | lanes |") and len(lines) == 4
    assert lines[2].startswith("| naive | 1 |") and lines[3].startswith("| naive | 3 |")
    assert all(line.endswith("| yes |") for line in lines[2:])
    for bad in (["--lanes", "0"], ["--lanes", "x"], ["-n", "0"], ["notakeyvalue"]):
        with pytest.raises(SystemExit) as e:
            B.parse_args(["--prompts-file", str(q), *bad])
        assert e.value.code == 2
    capsys.readouterr()
    assert B.main(["--prompts-file", str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("error: prompts file")
