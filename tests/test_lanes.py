"""Several requests in flight through one ring (pipeline/lanes.py), in one process (tests/helpers.py: run_concurrent).

Every concurrent greedy answer equals HF ``generate(do_sample=False)`` (its single-request answer) in every mode,
with modes mixed on one ring and lanes reused; a sampled answer equals the same request's answer alone (same
seed: the same draws, hence the same law, which tests/test_sampling.py proves is the target's); planted bugs
(a stage that ignores lanes, a result routed to the wrong lane, one generator shared by two requests) fail;
a cancelled request frees its lane for the next while the other finishes; the lane codec round-trips. Stage
steps carry several lanes' segments in one forward (pipeline/batching.py) in these runs (counted: > 0), on the lean
and the transformers layers, and planted batching bugs fail too.
"""
import threading

import pytest
import torch

from model.split import split_checkpoint
from pipeline.engine import GenSettings
from pipeline.inprocess import run_threaded
from pipeline.messages import (MAX_LANES, Context, Decision, Segment, Shutdown, Stats, Status, decode, decode_at,
                               encode, pack_log, split_kind_word)
from tests.helpers import Pad, batched, hf_greedy, run_batched, run_concurrent, tiny_llama

PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 43], [1, 7, 7, 8, 9, 10, 11]]
NEW = 12
COMMON = [f"max_new_tokens={NEW}", "dtype=float64"]


def tiny_ring(root):
    """``(full model dir, stages split [0, 2, 2], HF greedy answers to PROMPTS)``: a 4-layer float64 LLaMA (the
    fixture of this file and of ``tests/test_lane_chain.py``)."""
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    stages = split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)
    return full, stages, [hf_greedy(full, p, NEW, {2}, torch.float64) for p in PROMPTS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_ring(tmp_path_factory.mktemp("lanes"))


def _greedy(n=NEW):
    return GenSettings(n)


@pytest.mark.parametrize("mode", ["continuous", "naive", "pipedec", "ar", "pruned"])
@pytest.mark.parametrize("drafter", ["oracle", "default"])
def test_concurrent_greedy_equals_alone(tiny, mode, drafter):
    """Three requests on three lanes at once; ``default``: the untrained EAGLE head merged with prompt lookup
    (the Drafter fork), ``oracle``: deep acceptance (CONTINUE decisions, direct pruning)."""
    full, stages, refs = tiny
    d = f"oracle:{full}" if drafter == "oracle" else None
    def check(res):
        assert [r.output_ids for r in res] == refs
    res, pool = run_batched(check, stages, [(p, mode, _greedy()) for p in PROMPTS], COMMON, {2}, d, lanes=3,
                            stage_meter=lambda r: Pad())
    assert pool.mux.switches >= 3, "the lanes did not interleave on the ring"


@pytest.mark.parametrize("mode", ["continuous", "naive"])
def test_concurrent_greedy_on_transformers_layers(tiny, mode):
    """The same on the transformers decoder layers (``model.lean_layers=false``): several lanes in one forward
    attend through a block-diagonal mask there (model/lane_batch.py)."""
    full, stages, refs = tiny
    def check(res):
        assert [r.output_ids for r in res] == refs
    run_batched(check, stages, [(p, mode, _greedy()) for p in PROMPTS], [*COMMON, "model.lean_layers=false"],
                {2}, f"oracle:{full}", lanes=3, stage_meter=lambda r: Pad())


def test_mixed_modes_and_lane_reuse(tiny):
    """Six requests of three modes on two lanes: lanes are reused (a new request resets the lane's caches)."""
    full, stages, refs = tiny
    modes = ["continuous", "naive", "pipedec"]
    jobs = [(p, modes[(i + j) % 3], _greedy()) for j in range(2) for i, p in enumerate(PROMPTS)]
    lanes_used: list[int] = []
    res, pool = run_concurrent(stages, jobs, COMMON, {2}, f"oracle:{full}", lanes=2,
                               started=lambda i, lane: lanes_used.append(lane))
    assert [r.output_ids for r in res] == refs + refs
    assert sorted(set(lanes_used)) == [0, 1] and pool.mux.switches > 0


def test_lanes_after_a_warm_up_on_the_base_engine(tiny):
    """A server warms up on its base engine (lane 0) before the lanes start: a late direct decision of the warm-up
    must not be taken for one of lane 0's next generation (generation numbers continue: ``lane_engine``)."""
    from pipeline.local_ring import LocalComm
    full, stages, refs = tiny

    def late_decisions(ring, engine):   # what a slow direct link delivers after the warm-up ended
        for gen in range(1, engine.gen + 1):
            ring.direct[2].put(LocalComm.wire(Decision(gen, 1, Status.TRUNCATE, -1, False, torch.tensor([0]))))

    res, _ = run_concurrent(stages, [(p, "continuous", _greedy()) for p in PROMPTS], COMMON, {2}, f"oracle:{full}",
                            lanes=2, warmup=[(PROMPTS[0], "naive")], after_warmup=late_decisions, lane_timeout_s=20)
    assert [r.output_ids for r in res] == refs


@pytest.mark.parametrize("mode", ["continuous", "naive", "ar"])
def test_sampling_interleaved_equals_alone(tiny, mode):
    """T = 1: each request's draws are its own (its sampler's generator), so its answer with seed s is the one it
    gives alone with seed s; the law of a lane is therefore the single-request law, exact by test_sampling."""
    full, stages, _ = tiny
    seeds = [3, 4, 5]
    alone = [run_threaded(stages, [p], [mode], [*COMMON, "temperature=1.0", f"seed={s}"], {2}, f"oracle:{full}")
             [mode][0].output_ids for p, s in zip(PROMPTS, seeds)]
    jobs = [(p, mode, GenSettings(NEW, temperature=1.0, seed=s)) for p, s in zip(PROMPTS, seeds)]
    def check(res):
        assert [r.output_ids for r in res] == alone
    res, pool = run_batched(check, stages, jobs, COMMON, {2}, f"oracle:{full}", lanes=3, stage_meter=lambda r: Pad())
    assert pool.mux.switches >= 3


def test_planted_shared_generator_fails(tiny, monkeypatch):
    """Planted bug: every request's sampler draws from one shared generator (seeded per request): interleaved,
    the requests take each other's draws and the answers are no longer their single-request answers."""
    from pipeline.verify import Sampler
    full, stages, _ = tiny
    mode, seeds = "ar", [3, 4, 5]
    alone = [run_threaded(stages, [p], [mode], [*COMMON, "temperature=1.0", f"seed={s}"], {2}, f"oracle:{full}")
             [mode][0].output_ids for p, s in zip(PROMPTS, seeds)]
    shared = torch.Generator(device="cpu")

    def one_generator(self):
        return Sampler(float(self.temperature), float(self.top_p), int(self.top_k), shared.manual_seed(int(self.seed)))

    monkeypatch.setattr(GenSettings, "new_sampler", one_generator)
    jobs = [(p, mode, GenSettings(NEW, temperature=1.0, seed=s)) for p, s in zip(PROMPTS, seeds)]
    res, pool = run_concurrent(stages, jobs, COMMON, {2}, f"oracle:{full}", lanes=3)
    assert pool.mux.switches >= 3
    assert [r.output_ids for r in res] != alone


@pytest.mark.parametrize("bug", ["stage-ignores-lanes", "results-to-lane-0", "batch-attends-to-another-lane",
                                 "batch-outputs-to-another-lane"])
def test_planted_lane_routing_bugs_fail(tiny, monkeypatch, bug):
    """Planted bugs: a stage that keeps one cache for every lane, or rank 0 stamping every message with lane 0
    (every result lands in lane 0's queue); in a stage step of several lanes, one lane's rows attending over
    another lane's cache, or the lanes' outputs sent as each other's: an error, a timeout or a wrong answer,
    never the right answers."""
    from model.lane_batch import LaneBatch
    from pipeline.lanes import LaneMux
    from pipeline.worker import StageWorker
    from tests.test_lanes_batch import crossed_attend
    full, stages, refs = tiny
    if bug == "stage-ignores-lanes":
        real = StageWorker.select
        monkeypatch.setattr(StageWorker, "select", lambda self, lane: real(self, 0))
    elif bug == "batch-attends-to-another-lane":
        monkeypatch.setattr(LaneBatch, "attend", crossed_attend)
    elif bug == "batch-outputs-to-another-lane":
        real_fwd = StageWorker.forward_lanes
        monkeypatch.setattr(StageWorker, "forward_lanes", lambda self, works: real_fwd(self, works)[::-1])
    else:
        real_send = LaneMux.send
        monkeypatch.setattr(LaneMux, "send", lambda self, lane, msg, direct: real_send(self, 0, msg, direct))
    # The two batch bugs live in a stage step of several lanes, which timing decides (see run_batched): a run
    # whose steps never batched did not exercise them, so it is repeated rather than counted as a pass.
    needs_batch = bug.startswith("batch-")
    for _ in range(3):
        try:
            res, pool = run_concurrent(stages, [(p, "continuous", _greedy()) for p in PROMPTS], COMMON, {2},
                                       f"oracle:{full}", lanes=3, lane_timeout_s=3, stage_meter=lambda r: Pad())
        except Exception:   # noqa: BLE001 - the protocol's own checks, a stage error or a lane's timeout
            return
        if not needs_batch or batched(pool) > 0:
            assert [r.output_ids for r in res] != refs
            return
    pytest.fail("no stage step carried several lanes in 3 runs: the planted bug was never exercised")


def test_cancelled_request_frees_its_lane_while_the_other_finishes(tiny):
    full, stages, refs = tiny
    cancel = threading.Event()
    got: dict[int, int] = {}
    cancelled = GenSettings(200, on_commit=lambda toks: cancel.set(), cancel=cancel)
    jobs = [(PROMPTS[0], "continuous", cancelled), (PROMPTS[1], "naive", _greedy()),
            (PROMPTS[2], "pipedec", _greedy())]
    gate = threading.Event()

    def started(i, lane):
        got[i] = lane
        if i == 2:
            gate.set()

    res, _ = run_concurrent(stages, jobs, COMMON, {2}, f"oracle:{full}", lanes=2,
                            started=lambda i, lane: started(i, lane))
    assert 1 <= len(res[0].output_ids) < 200, "the cancelled request should end at its next commit"
    assert res[1].output_ids == refs[1] and res[2].output_ids == refs[2]
    assert gate.is_set() and got[2] == got[0], "the third request should take the cancelled request's lane"


# -- the codec ---------------------------------------------------------------------------------------------------

def _messages(lane: int):
    path = torch.tensor([3, 4], dtype=torch.long)
    d = Decision(2, 5, Status.CONTINUE, 7, False, path, lane)
    return [Context(torch.tensor([[1, 2, 3]]), 4, True, lane),
            Segment(torch.randn(1, 2, 8, dtype=torch.float64), torch.tensor([-1, 0]), torch.tensor([0, 1]), 3, 1,
                    pack_log([d]), 2, lane),
            d, Stats(torch.zeros(3, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64), lane)]


def _same(a, b) -> bool:
    if type(a) is not type(b) or a.lane != b.lane or a.ints() != b.ints():
        return False
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


@pytest.mark.parametrize("lane", [0, 1, 5, MAX_LANES - 1])
def test_lane_codec_round_trip(lane):
    for msg in _messages(lane):
        header, payload = encode(msg)
        assert split_kind_word(int(header[1]))[1] == lane
        assert _same(decode(header, payload), msg)
        assert _same(decode_at(header.tolist(), payload.data_ptr()), msg)
    seg = _messages(lane)[1]
    assert [d.lane for d in decode(*encode(seg)).decisions()] == [lane], "a logged decision is its segment's lane"
    assert decode(*encode(Shutdown())).lane == 0


def test_lane_codec_rejects_bad_lanes():
    with pytest.raises(ValueError, match="lane"):
        encode(Context(torch.tensor([[1]]), 0, False, MAX_LANES))
    header, payload = encode(Context(torch.tensor([[1]]), 0, False, 3))
    for word in (-1, 99, MAX_LANES * 256 + 1):   # negative, an unknown kind, a lane beyond MAX_LANES
        bad = header.clone()
        bad[1] = word
        with pytest.raises(ValueError, match="corrupt"):
            decode(bad, payload)


# -- pure pieces -------------------------------------------------------------------------------------------------

def test_busy_marks_per_lane_window():
    from pipeline.worker import BusyMarks
    b = BusyMarks()
    assert b.take(0, 1.0) == 1.0          # one lane: busy since the previous trip, as before lanes
    assert b.take(0, 0.5) == 0.5
    assert b.take(1, 0.25) == 1.75        # lane 1's first trip: everything so far
    assert b.take(0, 0.25) == 0.5         # lane 0: since its own previous trip (lane 1's trip did not cut it)


def test_fork_drafter_shares_weights_not_state(tiny):
    from config.run_config import DEFAULT, apply_overrides
    from model.stage_model import load_stage
    from pipeline.build import make_drafter
    from pipeline.lanes import fork_drafter
    full, stages, _ = tiny
    cfg = apply_overrides(DEFAULT, [*COMMON, "draft.sources=eagle"])
    model = load_stage(stages, 0, 3, torch.float64)
    d = make_drafter(cfg, stages, model, torch.float64, "cpu")
    f = fork_drafter(d)
    assert f is not d and f.head is d.head and f.lm_head is d.lm_head
    assert f.cache is not d.cache and f.cache.keys.data_ptr() != d.cache.keys.data_ptr()
    feats = torch.randn(4, model.config.hidden_size, dtype=torch.float64)
    a = d.start([1, 5, 9, 13], 7, feats)
    d.commit(torch.tensor([3]), feats[-1:])        # the original moves on; the fork is untouched
    b = f.start([1, 5, 9, 13], 7, feats)
    assert torch.equal(a, b)


def test_ring_share_rule():
    from pipeline.lanes import ring_share
    assert [ring_share(5, a) for a in range(7)] == [5, 5, 3, 2, 2, 1, 1]   # alone: every link, as before lanes
    assert all(1 <= ring_share(w, a) <= w and ring_share(w, a) * a >= w for w in range(1, 9) for a in range(1, 9))
    assert [ring_share(5, a, 2.0) for a in range(1, 7)] == [5, 5, 4, 3, 2, 2]     # serve.ring_share=2
    assert [ring_share(5, a, 0.5) for a in range(1, 7)] == [5, 2, 1, 1, 1, 1]
    assert all(ring_share(w, a, 64) == w for w in range(1, 9) for a in range(1, 9))


def test_lane_rows_rule():
    """``serve.lane_rows``: a segment limit only while several requests are active, never alone, never when off."""
    from pipeline.engine import segment_cap
    from pipeline.lanes import lane_rows
    assert [lane_rows(a, 16) for a in range(5)] == [None, None, 16, 16, 16]
    assert all(lane_rows(a, 0) is None for a in range(6))

    class E:   # an engine as segment_cap reads it
        def __init__(self, rows):
            self.lane_rows = None if rows == "none" else (lambda: rows)
    assert [segment_cap(E("none"), c) for c in (-1, 4)] == [-1, 4]        # not a lane: the mode's own cap
    assert [segment_cap(E(None), c) for c in (-1, 4)] == [-1, 4]          # a lane alone: unchanged
    assert [segment_cap(E(3), c) for c in (-1, 2, 4)] == [3, 2, 3]        # every waiting node -> at most 3


def test_auto_max_active_rule():
    """``serve.max_active=0`` (the default) serves AUTO_MAX_ACTIVE requests at once, one with online learning; a
    setting > 0 is taken as it is; a configuration reads 0 and refuses negatives."""
    from config.run_config import DEFAULT, ConfigError, apply_overrides
    from pipeline.lanes import AUTO_MAX_ACTIVE, auto_max_active
    assert DEFAULT.serve.max_active == 0 and AUTO_MAX_ACTIVE == 4
    assert [auto_max_active(s, False) for s in (0, 1, 2, 8)] == [4, 1, 2, 8]
    assert [auto_max_active(s, True) for s in (0, 1)] == [1, 1]
    apply_overrides(DEFAULT, ["osd.enabled=true"])           # the default does not refuse online learning
    with pytest.raises(ConfigError):
        apply_overrides(DEFAULT, ["serve.max_active=-1"])


def _segment_sends(monkeypatch) -> list[tuple[int, object]]:
    """``(rows, limit)`` of every ``Segment`` rank 0's lanes put on the ring (LaneMux.send recorded); ``limit``: what
    the lane rule said just before that send in the same lane thread (``StreamingMode.top_up`` asks it once per
    send), ``"-"`` for a send that did not ask (a round's first segments: ``fill``)."""
    import threading

    import pipeline.lanes as lanes
    sizes: list[tuple[int, object]] = []
    asked = threading.local()
    send, rule = lanes.LaneMux.send, lanes.lane_rows

    def recording_rule(active, rows):
        asked.limit = rule(active, rows)
        return asked.limit

    def recording(self, lane, msg, direct):
        if isinstance(msg, Segment) and not direct:
            sizes.append((int(msg.gids.numel()), getattr(asked, "limit", "-")))
            asked.limit = "-"
        return send(self, lane, msg, direct)
    monkeypatch.setattr(lanes.LaneMux, "send", recording)
    monkeypatch.setattr(lanes, "lane_rows", recording_rule)
    return sizes


@pytest.mark.parametrize("drafter", ["oracle", "default"])
@pytest.mark.parametrize("planted", [False, True])
def test_lane_rows_limits_segments_under_load_and_stays_exact(tiny, monkeypatch, drafter, planted):
    """Three ``continuous`` requests at ``serve.lane_rows=1``: every segment sent after a verified step while
    several requests are active carries one node (with the oracle's deep acceptance many do, and some had more
    waiting), and every answer is still HF's. Planted: the mode asks the rule and ignores its limit, and the test
    fails."""
    full, stages, refs = tiny
    d = f"oracle:{full}" if drafter == "oracle" else None
    sizes = _segment_sends(monkeypatch)
    if planted:
        monkeypatch.setattr("pipeline.modes.flowspec.segment_cap", lambda engine, cap: (engine.lane_rows(), cap)[1])
    res, _ = run_concurrent(stages, [(p, "continuous", _greedy()) for p in PROMPTS], [*COMMON, "serve.lane_rows=1"],
                            {2}, d, lanes=3, stage_meter=lambda r: Pad())
    assert [r.output_ids for r in res] == refs
    limited = [n for n, limit in sizes if limit == 1]

    def obeyed():
        assert all(n <= 1 for n in limited), sizes
    if drafter == "default":    # an untrained head: rounds end at once, few sends ask the rule; exactness only
        return
    assert len(limited) >= 3, sizes
    if planted:
        with pytest.raises(AssertionError):
            obeyed()
    else:
        obeyed()


def test_lane_rows_leaves_a_request_alone_unchanged(tiny, monkeypatch):
    """One request on a pool (the only one active) sends exactly the segments it sends with the limit off."""
    full, stages, refs = tiny
    seen = []
    for rows in (0, 1):
        sizes = _segment_sends(monkeypatch)
        res, _ = run_concurrent(stages, [(PROMPTS[0], "continuous", _greedy())], [*COMMON, f"serve.lane_rows={rows}"],
                                {2}, f"oracle:{full}", lanes=2)
        monkeypatch.undo()
        assert res[0].output_ids == refs[0]
        seen.append(list(sizes))
    assert seen[0] == seen[1] and seen[0]


def test_in_process_ring_waits_as_long_as_comm_timeout_says():
    """The in-process ring's threads wait the ring's own 60 s, or ``comm.timeout_s`` when that is longer (a long
    prefill on a loaded host took over 60 s and failed a bench run with ``queue.Empty``: the fixed wait ignored
    the setting)."""
    from config.run_config import DEFAULT, apply_overrides
    from pipeline.inprocess import _wait_s
    from pipeline.local_ring import TIMEOUT_S
    assert _wait_s(apply_overrides(DEFAULT, [])) == TIMEOUT_S
    assert _wait_s(apply_overrides(DEFAULT, ["comm.timeout_s=900"])) == 900.0


def test_the_api_waits_as_long_as_comm_timeout_says_and_a_timeout_names_the_ranks(tiny):
    """The one-process API's rank 0 waited the ring's fixed 60 s whatever ``comm.timeout_s`` said (a long prefill
    of a large model on a CPU failed after 60 s); now it waits as the in-process ring does. A receive that runs
    out is a TimeoutError naming both ranks (it was a bare ``queue.Empty``)."""
    from pipeline.api import FlowSpec
    from pipeline.local_ring import LocalComm, LocalRing
    _, stages, _ = tiny
    with FlowSpec.load(stages, "comm.timeout_s=900", "mode=ar", "dtype=float64", template="raw") as f:
        assert f.engine.comm.timeout_s == 900.0
    with pytest.raises(TimeoutError, match="rank 1: no message from rank 0 for 0.05 s"):
        LocalComm(LocalRing(3), 1, timeout_s=0.05).recv_prev()


def drawn_lane_case(i: int) -> tuple[list[str], list[str], str | None]:
    """Case ``i`` of the drawn lane cases: the ``tree.*`` and ``draft.*`` words of ``pipeline.tools.fuzz``'s trial
    ``i`` of seed 43 (the first draw from ``i`` on that the configuration accepts), the modes of three concurrent
    requests (three consecutive modes of ``fuzz.MODES`` from the ``i``-th: every tree mode beside every other) and
    the trial's drafter: the oracle at its noise, or (untrained) the default, the untrained EAGLE head and lookup."""
    from config.errors import UserError
    from config.run_config import DEFAULT, apply_overrides
    from pipeline.tools import fuzz
    heads = ["oracle:FULL", "oracle@1:FULL", "oracle@3:FULL", "untrained"]
    for k in range(i, i + 50):
        t = fuzz.draw_trial(43, k, heads, 0.5)
        words = [fuzz.word(k, v) for k, v in t.keys.items() if k.split(".")[0] in ("tree", "draft")
                 and k != "tree.budget"]
        try:
            apply_overrides(DEFAULT, words)
        except UserError:
            continue
        modes = [fuzz.MODES[(i + n) % len(fuzz.MODES)] for n in range(3)]
        return words, modes, None if t.head == "untrained" else t.head
    raise AssertionError("no drawn combination validates")


@pytest.mark.parametrize("i", range(6))
def test_concurrent_greedy_under_drawn_combinations(tiny, i):
    """Three requests of three modes on two lanes at once under tree and drafting keys drawn as
    ``pipeline.tools.fuzz`` draws them (one configuration per ring, as a server has): every answer equals HF's."""
    full, stages, refs = tiny
    words, modes, head = drawn_lane_case(i)
    jobs = [(p, m, _greedy()) for p, m in zip(PROMPTS, modes)]
    res, pool = run_concurrent(stages, jobs, [*COMMON, *words], {2},
                               head.replace("FULL", str(full)) if head else None, lanes=2)
    assert [r.output_ids for r in res] == refs, (modes, head, words)
