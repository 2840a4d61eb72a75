"""Emulated edge testbed (pipeline/emulation.py), the profiler CLI, the evaluation driver and data.prepare.

Three pipeline launches in all (world 3, a tiny random LLaMA): one with a 20 ms-per-step analytic profile,
two through the evaluation driver with the zero profile (first run, then a resume after a torn last line).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.split import split_checkpoint
from tests.helpers import hf_greedy, launch, read_jsonl, tiny_llama

from config.profiles import CostModel, EmulationError, LinkModel, Profile, interp1, load_profile
from pipeline.emulation import COUNTERS, Emulator, EmuMeter, LinkSender, fidelity_fields

STEP_S = 0.02
T20 = {"name": "t20", "stage": {"model": "analytic", "overhead_s": STEP_S},
       "link": {"latency_s": 0.001, "bandwidth_mbps": 100, "hidden_bytes_per_token": 128}}


# -- helpers ---------------------------------------------------------------------------------------------
def make_tokenizer(out: Path):
    """A small byte-level BPE tokenizer with a chat template, built offline (<unk>=0, <s>=1, </s>=2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "what is two plus two?"] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ '<s>' + m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    fast.save_pretrained(out)
    return fast


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("emu")
    full = tiny_llama(root / "full", layers=4, vocab=320, dtype=torch.float64)
    stages = split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)
    # two ranks for the eval driver's launches (issue 43): its claims (resume, torn rows, exact rows) name no world
    # size, and each launch then starts one rank process fewer
    stages2 = split_checkpoint(full, root / "stages2", [0, 4], progress=False)
    make_tokenizer(root / "tok")
    for d in [*sorted(Path(stages).glob("stage_model_*")), *sorted(Path(stages2).glob("stage_model_*"))]:
        for f in (root / "tok").iterdir():
            shutil.copy(f, d / f.name)
    (root / "t20.json").write_text(json.dumps(T20))
    return SimpleNamespace(root=root, full=full, stages=Path(stages), stages2=Path(stages2), t20=root / "t20.json")


# -- profile math ----------------------------------------------------------------------------------------
def test_interp1_and_table_bilinear():
    assert interp1([1, 3], [10, 30], 2) == 20
    assert interp1([1, 3], [10, 30], 5) == 50                     # linear extension above
    assert interp1([1, 3], [10, 30], 0, clamp_low=True) == 10     # held below
    assert interp1([5], [7], 100) == 7
    cm = CostModel.parse({"model": "table", "w": [1, 4], "ctx": [0, 100], "t_s": [[1.0, 2.0], [3.0, 4.0]]}, "t")
    assert cm.time(1, 0) == 1.0 and cm.time(4, 100) == 4.0
    assert cm.time(2.5, 50) == pytest.approx(2.5)                 # bilinear centre
    assert cm.time(7, 0) == pytest.approx(5.0)                    # w beyond the table: edge slope
    assert cm.time(0, 0) == 1.0                                   # below the smallest w: first row
    assert cm.time(1, 200) == pytest.approx(3.0)                  # ctx beyond: edge slope
    down = CostModel.parse({"model": "table", "w": [1, 2], "ctx": [0, 10], "t_s": [[1.0, 0.5], [1.0, 0.5]]}, "t")
    assert down.time(1, 1000) == 0.0                              # never negative
    one_d = CostModel.parse({"model": "table", "w": [1, 8], "ctx": [0], "t_s": [[0.001], [0.008]]}, "t")
    assert one_d.time(4, 12345) == pytest.approx(0.004)


def test_analytic_model_and_builtin_profiles():
    cm = CostModel.parse({"weight_bytes": 1e9, "mem_bw_Bps": 1e11, "mem_efficiency": 0.5, "flops_per_token": 1e9,
                          "peak_flops": 1e12, "compute_efficiency": 0.5, "overhead_s": 0.001}, "a")
    assert cm.time(1, 0) == pytest.approx(0.02 + 0.001)          # memory bound: 1 GB / 50 GB/s
    assert cm.time(100, 0) == pytest.approx(0.2 + 0.001)         # compute bound: 100 GFLOP / 0.5 TFLOPS
    assert CostModel.parse({"overhead_s": STEP_S}, "a").time(64, 999) == STEP_S
    orin = load_profile("edge_orin_7b")
    t1 = orin.stage_model(1).time(1, 0)
    assert 0.020 < t1 < 0.030                                     # 3.24 GB at 70% of 204.8 GB/s + 2 ms
    assert orin.stage_model(3).time(16, 0) == pytest.approx(t1, rel=0.01)   # memory bound: w is ~free
    assert orin.stage_model(1).time(256, 0) > 1.5 * t1           # compute bound eventually
    assert orin.stage_model(1).time(1, 2048) > t1                 # KV reads grow with context
    assert orin.link.transfer_s(16 * 4096 * 2) == pytest.approx(16 * 8192 * 8 / 150e6)
    assert orin.models_rank0 and 0.001 < orin.lm_head.time(1) < 0.004
    zero = load_profile("zero")
    assert zero.stage.time(128, 2048) == 0 and zero.link.transfer_s(1e9) == 0 and zero.lm_head.time(9) == 0


def test_profile_validation_and_config():
    from config.run_config import DEFAULT, ConfigError, apply_overrides
    with pytest.raises(EmulationError, match="unknown keys"):
        Profile.from_dict({"stage": {"model": "analytic", "overhed_s": 1}})
    with pytest.raises(EmulationError, match="grid"):
        Profile.from_dict({"stage": {"model": "table", "w": [1, 2], "ctx": [0], "t_s": [[1.0]]}})
    with pytest.raises(EmulationError, match="missing 'stage'"):
        Profile.from_dict({"link": {}})
    with pytest.raises(EmulationError, match="bandwidth"):
        Profile.from_dict({"stage": {}, "link": {"bandwidth_mbps": 0}})
    with pytest.raises(ConfigError, match="builtin"):
        apply_overrides(DEFAULT, ["emu.profile=no_such_profile"])
    cfg = apply_overrides(DEFAULT, ["profile=zero", "emu.time_scale=2"])
    assert cfg.emu.profile == "zero" and cfg.emu.time_scale == 2.0 and DEFAULT.emu.profile == ""


def test_link_bytes_follow_the_modeled_deployment():
    from pipeline.messages import Context, Segment
    link = LinkModel(hidden_bytes_per_token=8192, header_bytes=384)
    hidden = Context(torch.zeros(1, 16, 576))                     # small model's real payload: 36 KiB
    assert link.message_bytes(hidden) == 384 + 16 * 8192
    ids = Segment(torch.zeros(1, 5, dtype=torch.long), torch.zeros(5, dtype=torch.long), torch.arange(5))
    assert link.message_bytes(ids) == 384 + 3 * 5 * 8             # ids, parents, node ids count their real bytes
    tapped = Context(torch.zeros(1, 16, 4 * 576))                 # EAGLE-3: the hidden state + 3 tapped features
    assert link.message_bytes(tapped, 576) == 384 + 4 * 16 * 8192
    assert link.message_bytes(hidden, 576) == 384 + 16 * 8192
    assert link.message_bytes(tapped) == 384 + 16 * 8192          # without the model's H: one row per token


def test_tap_row_factors():
    from model.stage_format import tap_row_factors
    assert tap_row_factors([0, 3, 2, 2], [1, 2, 3]) == [1, 3, 4, 4]
    assert tap_row_factors([0, 8, 8, 7, 7], [1, 14, 26]) == [1, 2, 3, 3, 4]
    assert tap_row_factors([0, 4, 3], []) == [1, 1, 1]


def test_stats_message_roundtrip():
    from pipeline.messages import Stats, decode, encode
    table = torch.arange(3 * len(COUNTERS), dtype=torch.float64).reshape(3, -1)
    for msg in (Stats(torch.ones(3, dtype=torch.float64)), Stats(torch.ones(3, dtype=torch.float64), table),
                Stats(torch.ones(3, dtype=torch.float64), torch.zeros(3, 0, dtype=torch.float64))):
        back = decode(*encode(msg))
        assert torch.equal(back.busy_s, msg.busy_s)
        assert (back.counters is None) == (msg.counters is None)
        if msg.counters is not None:
            assert torch.equal(back.counters, msg.counters)


def test_the_meter_stack_carries_its_counters():
    """Counters ride on the meters (model.meter): a stack concatenates its counting meters' columns, hands each
    its own columns back for the row fields, and a meter that counts nothing adds no column; the worker writes
    its stack's counters into a Stats table (pipeline.worker.write_counters) without knowing who counts."""
    from model.meter import NULL_METER, MeterStack, SpanMeter, counter_fields, take_counters
    from pipeline.trace import Tracer
    from pipeline.messages import Stats
    from pipeline.worker import write_counters

    class Count:
        def __init__(self, names, values):
            self.counter_names, self.values = names, values

        def op(self, kind, rows, ctx=0):
            return NULL_METER.op(kind, rows, ctx)

        def take(self):
            return list(self.values)

        def row_fields(self, table, phase):
            return {f"{phase}_{n}": sum(r[i] for r in table) for i, n in enumerate(self.counter_names)}

    stack = MeterStack(SpanMeter(Tracer(0), {}), Count(("a", "b"), (1.0, 2.0)), NULL_METER, Count(("c",), (5.0,)))
    assert stack.counter_names == ("a", "b", "c") and take_counters(stack) == [1.0, 2.0, 5.0]
    table = [[1.0, 2.0, 5.0], [10.0, 20.0, 50.0]]
    assert counter_fields(stack, table, "decode") == {"decode_a": 11.0, "decode_b": 22.0, "decode_c": 55.0}
    assert take_counters(SpanMeter(Tracer(0), {})) == [] and counter_fields(NULL_METER, table, "decode") == {}
    msg = Stats(torch.zeros(2, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64))
    write_counters(msg, 1, stack)
    assert msg.counters[1].tolist() == [1.0, 2.0, 5.0] and msg.counters[0].tolist() == [0.0, 0.0, 0.0]
    write_counters(msg, 0, NULL_METER)                      # nothing counted: the row stays as it was
    assert msg.counters[0].tolist() == [0.0, 0.0, 0.0]


# -- unit-level padding and links -----------------------------------------------------------------------
def _emu(profile: dict, rank: int = 1, **kw) -> Emulator:
    return Emulator(Profile.from_dict(profile), rank, 3, **kw)


def test_worker_compute_is_padded_to_modeled_time(tiny):
    from model.stage_model import load_stage
    from pipeline.trace import Tracer
    from pipeline.worker import StageWorker
    model = load_stage(tiny.stages, 1, 3, torch.float64)
    step = 0.25                                                    # far above the real cost, even on a busy host
    emu = _emu({"stage": {"overhead_s": step}})
    comm = SimpleNamespace(rank=1, tracer=Tracer(1), open_direct_inbox=lambda: None)
    worker = StageWorker(model, comm, 64, torch.float64, "cpu")
    emu.install_stage(worker)                                      # what pipeline.build.make_stage_worker does
    ids = torch.tensor([[1, 5, 9, 13]])
    pos, mask = worker.cache.context_inputs(4, torch.float64)
    ref = model(ids, pos, mask, model.block.new_cache(64, torch.float64, "cpu"))   # also warms up
    t0 = time.perf_counter()
    out = worker._compute(ids, pos, mask)
    elapsed = time.perf_counter() - t0
    assert out.shape == (1, 4, 64)
    assert elapsed >= step                                         # padded up to the modeled step
    c = dict(zip(COUNTERS, emu.take()))
    assert c["ops"] == 1 and c["modeled_s"] == pytest.approx(step)
    assert (c["overrun_ops"], c["overrun_s"] > 0) in ((0, False), (1, True))   # 1 only on a starved host
    assert worker.tracer.busy_s >= step                            # padding counts as busy compute
    assert torch.equal(out, ref)                                   # real compute, exact output
    # an op slower than modeled is an overrun, never hidden; dilation scales the model
    zero = _emu({"stage": {}}, time_scale=3.0)
    zero.pad(time.perf_counter() - 0.01, 0.0)
    slow = _emu({"stage": {"overhead_s": 0.01}}, time_scale=3.0)
    t0 = time.perf_counter()
    with EmuMeter(slow).op("stage_forward", 1, 0):     # the stage worker's seam: pad to the stage model
        pass
    assert time.perf_counter() - t0 >= 0.03
    cz, cs = dict(zip(COUNTERS, zero.take())), dict(zip(COUNTERS, slow.take()))
    assert cz["overrun_ops"] == 1 and cz["overrun_s"] >= 0.01
    assert cs["modeled_s"] == pytest.approx(0.03) and cs["overrun_ops"] == 0    # pad() itself is instant


class RecordingMeter:
    """A model.meter.OpMeter that counts the ops it sees."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, int, int]] = []

    def op(self, kind: str, rows: int, ctx: int = 0):
        from contextlib import nullcontext
        self.ops.append((kind, rows, ctx))
        return nullcontext()


def test_rank0_meters_see_and_pad_lm_head_and_draft_forward():
    """The one instrumentation seam (model.meter): the drafter's lm_head calls and its head's forwards run inside
    meter ops; the emulator's meters pad each to the profile's rank-0 model, counted op by op."""
    from transformers import LlamaConfig

    from draft.drafter import Drafter
    from draft.eagle import init_untrained_head
    from model.meter import NULL_METER
    from pipeline.trace import Tracer
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

    def run(drafter) -> None:
        root_hidden = drafter.start([1, 5, 9], 7, torch.randn(3, 32))
        drafter.grow_tree(7, root_hidden, 12, 3, 3)

    def fresh():
        head = init_untrained_head(cfg).eval()
        return Drafter(head, torch.nn.Linear(32, 64, bias=False), 128)

    rec, drafter = RecordingMeter(), fresh()
    drafter.meter = drafter.head.meter = rec
    run(drafter)
    kinds = [k for k, _, _ in rec.ops]
    n_lm, n_fwd = kinds.count("lm_head"), kinds.count("draft_forward")
    assert n_lm == 4 and n_fwd == 4     # the root's top-k + 3 beam levels; start's commit + 3 tree forwards
    assert rec.ops[0] == ("draft_forward", 3, 0)        # start: the prompt's entries on an empty cache
    lm_s, fwd_s = 0.004, 0.006
    emu = _emu({"stage": {"overhead_s": 0.0}, "rank0": {"lm_head": {"overhead_s": lm_s},
                                                       "draft_forward": {"overhead_s": fwd_s}}}, rank=0)
    drafter = fresh()
    engine = SimpleNamespace(tracer=Tracer(0, enabled=False), drafter=drafter, meter=NULL_METER)
    emu.install_rank0(engine)
    t0 = time.perf_counter()
    run(drafter)
    took = time.perf_counter() - t0
    ops, modeled = emu.take()[:2]
    assert ops == n_lm + n_fwd and modeled == pytest.approx(n_lm * lm_s + n_fwd * fwd_s)
    assert took >= 0.95 * modeled
    assert engine.meter is not NULL_METER     # the engine's own lm_head (verification) is metered too
    # an online-learning wrapper (draft.osd) is metered through its inner drafter: the same ops, once each,
    # including the lm_head calls of the inner tree search (the learner's own work is not a decode op)
    from draft.osd import OnlineDrafter, OsdSettings
    from draft.protocol import install_meter
    rec2, inner = RecordingMeter(), fresh()
    od = OnlineDrafter(inner, inner.lm_head, OsdSettings(sync=True), learn=False)
    install_meter(od, rec2)
    run(od)
    assert rec2.ops == rec.ops and inner.meter is rec2 and inner.head.meter is rec2


def test_small_lm_and_merged_sources_are_metered_once_per_model_op(tmp_path):
    """A small draft LM's forwards are ``ssm_forward`` ops and its log-prob calls ``lm_head`` ops; in a merged
    drafter every source is metered (install_meter), the merge itself adds no op, lookup adds none; the
    emulator pads ``ssm_forward`` to the profile's rank0.ssm_forward model."""
    from draft.lookup import LookupDrafter
    from draft.merged import MergedDrafter
    from draft.protocol import install_meter
    from draft.ssm import SmallLMDrafter
    from tests.helpers import tiny_llama
    path = tiny_llama(tmp_path / "ssm", seed=4, layers=2, dtype=torch.float64)

    def run(drafter):
        h = drafter.start([1, 5, 9], 7, None)
        drafter.grow_tree(7, h, 8, 2, 3)

    rec, ssm = RecordingMeter(), SmallLMDrafter(path, vocab_size=100, dtype=torch.float64)
    install_meter(ssm, rec)
    run(ssm)
    kinds = [k for k, _, _ in rec.ops]
    assert rec.ops[0] == ("ssm_forward", 4, 0)                  # start: prompt + first token on an empty cache
    assert kinds.count("ssm_forward") >= 3 and kinds.count("lm_head") >= 3
    assert all(ctx == 4 for k, _, ctx in rec.ops[1:] if k == "ssm_forward")   # tree entries sit on the context

    rec2, merged = RecordingMeter(), MergedDrafter([SmallLMDrafter(path, vocab_size=100, dtype=torch.float64),
                                                    LookupDrafter(100)])
    install_meter(merged, rec2)
    run(merged)
    assert rec2.ops == rec.ops                                  # the SSM's ops, once each; lookup and merge: none

    emu = _emu({"stage": {}, "rank0": {"lm_head": {"overhead_s": 0.0}, "ssm_forward": {"overhead_s": 0.005}}}, rank=0)
    assert emu.op_time("ssm_forward", 3, 10) == pytest.approx(0.005)
    assert _emu({"stage": {}, "rank0": {"lm_head": {}}}, rank=0).op_time("ssm_forward", 3, 10) is None  # not modeled
    engine = SimpleNamespace(tracer=None, drafter=SmallLMDrafter(path, vocab_size=100, dtype=torch.float64),
                             meter=RecordingMeter())
    emu.install_rank0(engine)
    run(engine.drafter)
    c = dict(zip(COUNTERS, emu.take()))
    assert c["modeled_s"] == pytest.approx(0.005 * kinds.count("ssm_forward"))


def test_stage_cost_scale_and_bandwidth_override(tmp_path):
    """emu.stage_cost_scale multiplies the pipeline stages' modeled time (the profile's model on another stage
    count); emu.bandwidth_mbps replaces every link's rate; both are validated."""
    from config.run_config import DEFAULT, ConfigError, apply_overrides
    from pipeline.emulation import install
    emu = _emu({"stage": {"overhead_s": 0.03}}, stage_cost_scale=4 / 3)
    assert emu.stage_time(5, 0) == pytest.approx(0.04) and emu.op_time("stage_forward", 5, 0) == pytest.approx(0.04)
    cfg = apply_overrides(DEFAULT, ["emu.profile=edge_orin_7b", "emu.bandwidth_mbps=1000", "emu.stage_cost_scale=1.5"])
    comm = SimpleNamespace(rank=1, world=3, send=lambda *a: None, post=lambda *a: None)
    emu = install(comm, cfg)
    from pipeline.emulation import emulator_of
    assert emulator_of(comm) is emu and comm.link is emu.sender and emu.stage_cost_scale == 1.5
    assert emulator_of(SimpleNamespace()) is None                  # a transport without a link: no testbed
    assert {lm.bandwidth_mbps for lm in [emu.profile.link, *emu.profile.links.values()]} == {1000}
    assert emu.stage_time(1, 0) == pytest.approx(1.5 * emu.profile.stage.time(1, 0))
    for bad in ("emu.stage_cost_scale=0", "emu.bandwidth_mbps=-1"):
        with pytest.raises(ConfigError):
            apply_overrides(DEFAULT, [bad]).validate()


def test_link_sender_delays_in_order_without_blocking():
    from pipeline.messages import Context
    delivered = []
    comm = SimpleNamespace(rank=0, world=3, post=lambda dst, m: delivered.append((time.perf_counter(), dst, m)),
                           link=None)
    prof = {"stage": {}, "link": {"latency_s": 0.2, "bandwidth_mbps": 1.0, "header_bytes": 0}}
    emu = _emu(prof, rank=0)
    sender = LinkSender(emu, comm)
    assert comm.link is sender                                     # Comm.send hands every message to its link
    sizes = [1000, 10, 500, 10]                                    # int8 payloads: 8 ms, 0.08 ms, 4 ms, 0.08 ms
    t0 = time.perf_counter()
    xs = [torch.full((1, n), i, dtype=torch.int8) for i, n in enumerate(sizes)]
    for x in xs:
        comm.link.send(1, Context(x))
    assert time.perf_counter() - t0 < 0.1                           # the caller never waits for the link
    xs[0].fill_(99)                                                # reuse after send must not leak into the wire
    comm.link.drain()                                              # what Comm.flush does first
    assert [int(m.x[0, 0]) for _, _, m in delivered] == [0, 1, 2, 3]   # FIFO
    done = 0.0
    for (t, dst, m), n in zip(delivered, sizes):
        done += n * 8 / 1e6                                        # serialised on the link
        assert dst == 1 and t - t0 >= done + 0.2 - 1e-3
    c = dict(zip(COUNTERS, emu.take()))
    assert c["link_msgs"] == 4 and c["link_modeled_s"] > 4 * 0.2
    assert sender.inflight == 0


def test_fidelity_fields_flag():
    emu = _emu(T20, rank=0)
    ok = [[10, 0.2, 0, 0, 5, 0.05, 0, 0, 0], [10, 0.2, 1, 0.005, 5, 0.05, 0, 0, 0]]
    f = fidelity_fields(ok, emu)
    assert f["emu_overrun_frac"] == 0.05 and f["emu_overrun_s"] == 0.005 and not f["emu_flag"]
    bad = [[10, 0.2, 5, 0.1, 5, 0.05, 2, 0.01, 0], [0] * 9]
    f = fidelity_fields(bad, emu)
    assert f["emu_flag"] and f["emu_overrun_s"] == pytest.approx(0.11)
    assert fidelity_fields([[1, 0, 1, 0.1, 0, 0, 0, 0, 0]], emu)["emu_overrun_ratio"] is None   # zero profile


# -- end to end ------------------------------------------------------------------------------------------
def test_emulated_run_is_exact_and_takes_modeled_time(tiny, tmp_path):
    out = tmp_path / "rows.jsonl"
    prompts = [[1, 5, 9, 13, 22, 7], [1, 40, 41]]
    args = [f"model.stage_dir={tiny.stages}", "dtype=float64", "max_new_tokens=8", "comm.timeout_s=60",
            f"emu.profile={tiny.t20}", "--modes", "ar,naive,continuous", "--output", str(out), "--quiet"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    launch(3, args, timeout=300)
    rows = read_jsonl(out)
    assert len(rows) == 3 * len(prompts)
    for r in rows:
        assert r["output_ids"] == hf_greedy(tiny.full, r["prompt_ids"], 8, {2}, torch.float64), r["mode"]
        assert r["emu_profile"] == "t20" and r["emu_ops"] > 0
        assert r["emu_modeled_s"] == pytest.approx(r["emu_ops"] * STEP_S, rel=1e-6)
        # loose lower bounds from the modeled time alone (no timing assertion on this host's speed)
        steps = r["pipeline_steps"]
        if r["mode"] == "ar":          # every token crosses both stages in turn
            assert r["decode_s"] >= 0.9 * steps * 2 * STEP_S
        else:                          # each stage computes at most one segment per modeled step
            assert r["decode_s"] >= 0.9 * (r["emu_ops"] / 2) * STEP_S
        for k in ("emu_overrun_frac", "emu_overrun_s", "emu_flag", "emu_prefill_overrun_s"):
            assert k in r


def _tiny_dataset(root: Path) -> Path:
    data = root / "data"
    (data / "tiny").mkdir(parents=True, exist_ok=True)
    recs = [{"question_id": 7, "turns": ["what is the quick fox?", "and the lazy dog?"]},
            {"question_id": 8, "turns": ["what is two plus two?"]}, {"question_id": 9, "turns": ["unused"]}]
    (data / "tiny" / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return data


def _eval(tiny, data, out, capsys, *extra):
    from pipeline.tools.eval import main
    code = main(["--data-dir", str(data), "--datasets", "tiny", "--modes", "ar,naive", "--temperatures", "0",
                 "--begin", "0", "--end", "2", "--stage-dir", str(tiny.stages2), "--profile", "zero",
                 "--max-new-tokens", "6", "--out-dir", str(out), "--no-plots", "--quiet", "dtype=float64",
                 "comm.timeout_s=60", *extra])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_eval_driver_resumes_without_duplicates(tiny, tmp_path, capsys):
    data = _tiny_dataset(tmp_path)
    out = tmp_path / "eval"
    code, stdout, err = _eval(tiny, data, out, capsys)
    assert code == 0, err
    rows = read_jsonl(out / "rows.jsonl")
    keys = [(r["dataset"], r["question_id"], r["turn"], r["mode"], r["temperature"]) for r in rows]
    assert len(rows) == 6 and len(set(keys)) == 6                  # 3 turns x 2 modes, warm-up excluded
    assert {r["question_id"] for r in rows} == {7, 8}
    turn1 = [r for r in rows if r["turn"] == 1]
    assert all(r["emu_profile"] == "zero" for r in rows) and len(turn1) == 2
    for r in rows:                                                 # exact under the zero profile too
        assert r["output_ids"] == hf_greedy(tiny.full, r["prompt_ids"], 6, {2}, torch.float64)
    assert "equal ar's output" in stdout and (out / "summary.csv").is_file()

    code, _, err = _eval(tiny, data, out, capsys)                  # nothing left: no launch, no rows
    assert code == 0 and "nothing to run" in err
    assert len(read_jsonl(out / "rows.jsonl")) == 6

    lines = (out / "rows.jsonl").read_text().splitlines(keepends=True)
    torn = json.loads(lines[-1])
    (out / "rows.jsonl").write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])   # crash mid-write
    code, _, err = _eval(tiny, data, out, capsys)
    assert code == 0 and "partially written" in err and "launch 1/1" in err
    rows = read_jsonl(out / "rows.jsonl")
    keys = [(r["dataset"], r["question_id"], r["turn"], r["mode"], r["temperature"]) for r in rows]
    assert len(rows) == 6 and len(set(keys)) == 6
    again = [r for r in rows if (r["question_id"], r["turn"], r["mode"]) ==
             (torn["question_id"], torn["turn"], torn["mode"])]
    assert again[0]["output_ids"] == torn["output_ids"]

    code, _, err = _eval(tiny, data, out, capsys, "--max-new-tokens", "7")   # another config: refused
    assert code == 2 and "another configuration" in err


def test_mismatch_is_reported_loudly(tmp_path, capsys):
    from pipeline.tools.eval import main
    from pipeline.tools.rows import find_mismatches
    data = _tiny_dataset(tmp_path)
    base = {"dataset": "tiny", "question_id": 7, "turn": 0, "temperature": 0.0, "prompt_ids": [1, 2],
            "new_tokens": 3, "decode_s": 0.5, "accept_lengths": [1, 2], "tau": 1.5}
    rows = [dict(base, mode="ar", output_ids=[5, 6, 7]), dict(base, mode="naive", output_ids=[5, 6, 7]),
            dict(base, mode="continuous", output_ids=[5, 9, 7])]
    bad, compared, unref = find_mismatches(rows, by_dataset=True)
    assert compared == 2 and unref == 0 and len(bad) == 1 and "continuous" in bad[0] and "token 1" in bad[0]
    out = tmp_path / "eval"
    out.mkdir()
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["--summarize-only", "--data-dir", str(data), "--datasets", "tiny", "--modes", "ar,naive,continuous",
                 "--temperatures", "0", "--begin", "0", "--end", "1", "--out-dir", str(out), "--profile", "none",
                 "--no-plots"])
    cap = capsys.readouterr()
    assert code == 3 and "MISMATCH" in cap.err and "MISMATCH" in cap.out
    assert "MISMATCH" in (out / "summary.md").read_text()


def test_eval_missing_dataset_names_the_prepare_command(tmp_path, capsys):
    from pipeline.tools.eval import main
    code = main(["--data-dir", str(tmp_path), "--datasets", "gsm8k", "--summarize-only", "--out-dir",
                 str(tmp_path / "o"), "--profile", "none"])
    assert code == 2 and "python -m data.prepare" in capsys.readouterr().err


# -- tools ------------------------------------------------------------------------------------------------
def test_profile_cli_writes_a_usable_table(tmp_path):
    from pipeline.tools.profile import main
    out = tmp_path / "p.json"
    assert main(["--hidden", "32", "--intermediate", "64", "--heads", "4", "--kv-heads", "2", "--layers", "2",
                 "--vocab", "50", "--w", "1,4", "--ctx", "0,8", "--repeat", "1", "--warmup", "0", "--device", "cpu",
                 "--out", str(out), "--quiet"]) == 0
    prof = load_profile(str(out))
    assert prof.stage.model == "table" and prof.stage.w == [1, 4] and prof.stage.ctx == [0, 8]
    assert all(v > 0 for row in prof.stage.t_s for v in row) and prof.stage.time(2, 4) > 0
    assert prof.lm_head is not None and prof.draft_forward is not None
    assert prof.link.hidden_bytes_per_token == 64 and prof.link.bandwidth_mbps == 150


def test_prepare_copies_and_validates(tmp_path, capsys):
    from data.prepare import main
    src = tmp_path / "src"
    (src / "gsm8k").mkdir(parents=True)
    good = [{"question_id": i, "turns": [f"q{i}"]} for i in range(3)]
    (src / "gsm8k" / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    assert main(["--from", str(src), "--out", str(tmp_path / "data"), "--datasets", "gsm8k"]) == 0
    assert (tmp_path / "data" / "gsm8k" / "question.jsonl").read_text() == (src / "gsm8k" / "question.jsonl").read_text()
    (src / "qa").mkdir()
    (src / "qa" / "question.jsonl").write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
    assert main(["--from", str(src), "--out", str(tmp_path / "data"), "--datasets", "qa"]) == 2
    assert "turns" in capsys.readouterr().err
    assert main(["--from", str(src), "--out", str(tmp_path / "data"), "--datasets", "alpaca"]) == 2
    assert "Alpaca" in capsys.readouterr().err
