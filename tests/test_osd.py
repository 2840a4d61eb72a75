"""Online speculative decoding (draft/osd.py): losses, buffer, gates, rollback, the rollout mask against the real
draft cache, the double buffer, saving, config, and exactness with weights that change between rounds."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from config.run_config import DEFAULT, ConfigError, apply_overrides
from draft.drafter import Drafter
from draft.eagle import init_untrained_head, load_eagle_head
from draft.osd import (OnlineDrafter, OsdSettings, Record, ReplayBuffer, divergence, head_state,
                       rollback_due, rollout_levels, rollout_mask, should_publish, should_update, student_buckets,
                       teacher_topk)
from tests.helpers import hf_greedy, tiny_llama

D = torch.float64


# -- losses ----------------------------------------------------------------------------------------------------

def test_teacher_buckets_are_a_distribution_and_fkl_is_exact_when_k_covers_all_but_one():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(5, 12, generator=g, dtype=D) * 3, torch.randn(5, 12, generator=g, dtype=D)
    idx, tb = teacher_topk(t, 4)
    assert torch.allclose(tb.exp().sum(-1), torch.ones(5, dtype=torch.float32), atol=1e-5)
    assert (idx == t.topk(4).indices).all()
    sb = student_buckets(s, idx)
    assert torch.allclose(sb.exp().sum(-1), torch.ones(5, dtype=torch.float32), atol=1e-5)
    idx, tb = teacher_topk(t, 11)          # the tail bucket is one token: bucketed KL == full KL
    sb = student_buckets(s, idx)
    p, q = torch.log_softmax(t.float(), -1), torch.log_softmax(s.float(), -1)
    full_f = (p.exp() * (p - q)).sum(-1)
    full_r = (q.exp() * (q - p)).sum(-1)
    assert torch.allclose(divergence(tb, sb, "fkl"), full_f, atol=1e-4)
    assert torch.allclose(divergence(tb, sb, "rkl"), full_r, atol=1e-4)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd"])
def test_divergences_are_nonnegative_zero_at_equality_and_trainable(kind):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(6, 10, generator=g) * 2
    idx, tb = teacher_topk(t, 4)
    assert divergence(tb, student_buckets(t, idx), kind).abs().max() < 1e-5
    s = torch.randn(6, 10, generator=g).requires_grad_(True)
    before = divergence(tb, student_buckets(s, idx), kind)
    assert (before > 1e-4).all()
    opt = torch.optim.SGD([s], lr=4.0)
    for _ in range(60):
        opt.zero_grad()
        divergence(tb, student_buckets(s, idx), kind).sum().backward()
        opt.step()
    assert divergence(tb, student_buckets(s, idx), kind).sum() < 0.2 * before.sum()


def test_jsd_is_symmetric_at_half_and_fkl_rkl_differ():
    a = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0, -3.0]]), -1)
    b = torch.log_softmax(torch.tensor([[0.0, 1.0, 0.5, -1.0]]), -1)
    assert torch.allclose(divergence(a, b, "jsd"), divergence(b, a, "jsd"), atol=1e-6)
    assert divergence(a, b, "jsd") <= 0.5 * (divergence(a, b, "fkl") + divergence(a, b, "rkl")) + 1e-6
    assert not torch.allclose(divergence(a, b, "fkl"), divergence(a, b, "rkl"))
    with pytest.raises(ValueError):
        divergence(a, b, "kl")


# -- buffer, gates, rollback rule ----------------------------------------------------------------------------------

def _rec(n: int, first_gen: int = 0) -> Record:
    return Record(torch.arange(n), torch.zeros(n, 4), first_gen)


def test_replay_buffer_is_bounded_fifo_and_counts_new_tokens():
    buf = ReplayBuffer(10)
    buf.add(_rec(4, 1))        # generated = 4 - 1 - 1 = 2
    buf.add(_rec(5, 0))        # 4
    assert buf.entries == 9 and buf.take_new() == 6 and buf.take_new() == 0
    assert buf.peek_new("other") == 6 and buf.take_new("other") == 6 and buf.peek_new("other") == 0   # own count
    buf.add(_rec(3, 0))        # 12 > 10: the oldest goes
    assert [r.n for r in buf.snapshot()] == [5, 3] and buf.entries == 8
    buf.add(_rec(30, 0))       # larger than the capacity: kept alone
    assert [r.n for r in buf.snapshot()] == [30]


def test_gates_and_rollback_rule():
    assert not should_update(10, 128, 0, 0, 0.5)
    assert should_update(128, 128, 0, 0, 0.5)
    assert not should_update(500, 128, busy_s=6, wall_s=10, max_busy=0.5)
    assert should_update(500, 128, busy_s=4, wall_s=10, max_busy=0.5)
    assert should_publish(0.6, 0.5, 0.05) and not should_publish(0.52, 0.5, 0.05)
    assert not should_publish(0.5, 0.5, 0.0)                 # ties keep the live weights
    assert rollback_due([2.0, 2.0], [3.0], window=3, tol=0.1) is None
    assert rollback_due([2.0, 2.0, 2.0], [], window=3, tol=0.1) is None
    assert rollback_due([2.0, 2.0, 2.0], [1.0, 3.0, 3.0, 3.0], window=3, tol=0.1) is True
    assert rollback_due([2.8, 2.8, 2.8, 0.1], [3.0, 3.0, 3.0], window=3, tol=0.1) is False


def test_sample_sources():
    rng = random.Random(0)
    assert rollout_levels("teacher", 3, 0.5, rng) == (1, False)
    assert rollout_levels("student", 3, 0.5, rng) == (3, False)
    assert rollout_levels("mix_token", 3, 0.5, rng) == (3, True)
    seen = {rollout_levels("mix_request", 3, 0.5, rng)[0] for _ in range(50)}
    assert seen == {1, 3}
    with pytest.raises(ValueError):
        rollout_levels("oracle", 3, 0.5, rng)


# -- the rollout rows are exactly the states a draft tree visits ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoConfig
    root = tmp_path_factory.mktemp("osd")
    full = tiny_llama(root / "full", layers=2, dtype=D)
    cfg = AutoConfig.from_pretrained(full)
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(D)
    return full, cfg, lm_head


def _head(cfg, seed=0, scale=20.0):
    h = init_untrained_head(cfg, seed=seed).to(D).eval()
    with torch.no_grad():
        for n, p in h.named_parameters():
            if "norm" not in n:
                p.mul_(scale)                  # untrained heads are near zero: make the outputs distinct
    return h


def test_rollout_mask_reproduces_the_draft_cache(tiny):
    """Level l of the rollout (head_forward + rollout_mask) equals the Drafter's depth-(l+1) chain node built with
    commit + tree_forward: 'student' trains exactly the states the tree feeds the head."""
    from draft.train.objective import head_forward
    from tests.helpers import step2_batch
    _, cfg, lm_head = tiny
    head = _head(cfg)
    n, H = 9, cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    feats = torch.randn(n, H, generator=g, dtype=D)
    m1, _ = rollout_mask(n, 1)
    assert torch.equal(m1, step2_batch(toks[None], feats[None])[2][0, 0])   # level 1 == train_eagle's step 2
    with torch.no_grad():
        pred0 = head_forward(head, toks[None], feats[None])[0]
        f1 = torch.cat([torch.zeros(1, H, dtype=D), pred0[:-1]])
        mask, pos = rollout_mask(n, 1)
        out1 = head_forward(head, toks.repeat(2)[None], torch.cat([feats, f1])[None], pos[None], mask[None, None])[0]
        f2 = torch.cat([torch.zeros(1, H, dtype=D), out1[n:-1]])
        mask, pos = rollout_mask(n, 2)
        out2 = head_forward(head, toks.repeat(3)[None], torch.cat([feats, f1, f2])[None], pos[None],
                            mask[None, None])[0]
    assert torch.allclose(out2[:2 * n], out1, atol=1e-9)
    d = Drafter(head, lm_head, 64)
    for o in (0, 3, 6):                                # chain origin o: context entries 0..o
        d.reset()
        h0 = d.commit(toks[:o + 1], feats[:o + 1])
        assert torch.allclose(h0, pred0[o], atol=1e-9)
        h1 = d.tree_forward(toks[o + 1:o + 2], h0[None], torch.tensor([-1]))
        assert torch.allclose(h1[0], out2[n + o + 1], atol=1e-9)
        h2 = d.tree_forward(toks[o + 2:o + 3], h1, torch.tensor([0]))
        assert torch.allclose(h2[0], out2[2 * n + o + 2], atol=1e-9)
        d.drop_tree()


# -- the wrapper: double buffer, swap points, rollback, learner, save ----------------------------------------------

def _online(cfg, lm_head, learn: bool = True, scale=20.0, cls=OnlineDrafter, **kw) -> OnlineDrafter:
    s = OsdSettings(**{"sync": True, "update_interval": 1, "teacher_topk": 8, "batch_tokens": 64, **kw})
    return cls(Drafter(_head(cfg, scale=scale), lm_head, 256), lm_head, s, learn=learn)


def _fake_request(od: OnlineDrafter, cfg, seed: int, n_prompt=6, commits=(2, 3, 1, 2)):
    g = torch.Generator().manual_seed(seed)
    H, V = cfg.hidden_size, cfg.vocab_size
    prompt = torch.randint(0, V, (n_prompt,), generator=g).tolist()
    od.start(prompt, 5, torch.randn(n_prompt, H, generator=g, dtype=D))
    for c in commits:
        od.commit(torch.randint(0, V, (c,), generator=g), torch.randn(c, H, generator=g, dtype=D))


def test_publish_swaps_only_at_the_next_generation(tiny):
    _, cfg, lm_head = tiny
    od = _online(cfg, lm_head, learn=False)
    w0 = head_state(od.head)
    _fake_request(od, cfg, 0, commits=(2,))
    new = {k: v + 1.0 for k, v in w0.items()}
    assert od.publish(new) == 1
    od.commit(torch.tensor([1, 2]), torch.randn(2, cfg.hidden_size, dtype=D))      # mid-generation: no swap
    assert od.version == 0 and all(torch.equal(head_state(od.head)[k], w0[k]) for k in w0)
    assert od.row_fields()["drafter_version"] == 0
    _fake_request(od, cfg, 1)
    assert od.version == 1 and all(torch.equal(head_state(od.head)[k], new[k]) for k in w0)
    assert od.row_fields()["drafter_version"] == 1


def test_commit_swap_rebuilds_the_draft_cache(tiny):
    """osd.swap_at=commit: after the swap the drafter's state equals a fresh drafter with the new weights fed the
    same context, so later trees are what the new head would draft."""
    _, cfg, lm_head = tiny
    od = _online(cfg, lm_head, learn=False, swap_at="commit")
    other = _head(cfg, seed=7)
    other.embed_tokens.weight.data.copy_(od.head.embed_tokens.weight.data)   # shared with the target, frozen
    g = torch.Generator().manual_seed(5)
    H = cfg.hidden_size
    prompt, pf = [3, 4, 5, 6], torch.randn(4, H, generator=g, dtype=D)
    c1, f1 = torch.tensor([7, 8]), torch.randn(2, H, generator=g, dtype=D)
    c2, f2 = torch.tensor([9]), torch.randn(1, H, generator=g, dtype=D)
    od.start(prompt, 10, pf)
    od.commit(c1, f1)
    od.publish(head_state(other))
    out = od.commit(c2, f2)
    assert od.version == 1 and od.row_fields()["drafter_versions"] == [0, 1]
    ref = Drafter(other, lm_head, 256)
    ref.start(prompt, 10, pf)
    ref.commit(c1, f1)
    want = ref.commit(c2, f2)
    assert torch.allclose(out, want, atol=1e-9)
    t1, t2 = od.grow_tree(9, out, 8, 2, 3), ref.grow_tree(9, want, 8, 2, 3)
    assert torch.equal(t1.tokens, t2.tokens) and torch.equal(t1.parents, t2.parents)


def test_rollback_restores_the_previous_weights_when_tau_falls(tiny):
    _, cfg, lm_head = tiny
    od = _online(cfg, lm_head, learn=False, window=2, rollback_tol=0.1)
    w0 = head_state(od.head)
    for i in range(2):                                   # version 0: tau = 8/4 = 2
        _fake_request(od, cfg, i, commits=(2, 3, 1, 2))
    od.publish({k: v * 0.5 for k, v in w0.items()})
    for i in range(2):                                   # version 1: tau = 4/4 = 1 < 0.9 * 2
        _fake_request(od, cfg, 10 + i, commits=(1, 1, 1, 1))
    assert od.version == 1
    _fake_request(od, cfg, 20)                           # the next start judges version 1
    assert od.version == 0 and od.rollbacks == 1
    assert all(torch.equal(head_state(od.head)[k], w0[k]) for k in w0)
    od.publish({k: v * 0.5 for k, v in w0.items()})      # a version that keeps tau is kept
    for i in range(3):
        _fake_request(od, cfg, 30 + i, commits=(2, 3, 1, 2))
    assert od.version == 2 and od.rollbacks == 1


@pytest.mark.parametrize("loss,source", [("fkl", "teacher"), ("rkl", "student"), ("jsd", "mix_token")])
def test_learner_reduces_the_distillation_loss(tiny, loss, source):
    """On a fixed request whose teacher is a fixed random head, optimizer steps lower the loss (every loss and
    sample source)."""
    _, cfg, lm_head = tiny
    od = _online(cfg, lm_head, loss=loss, sample_source=source, lr=3e-3, rollout=2)
    L = od.learner
    teacher = _head(cfg, seed=11)
    g = torch.Generator().manual_seed(2)
    n = 24
    toks = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    with torch.no_grad():   # a "target" whose features follow the teacher head: learnable
        from draft.train.objective import head_forward
        feats = torch.randn(n, cfg.hidden_size, generator=g, dtype=D)
        feats[1:] = head_forward(teacher, toks[None], feats[None])[0, :-1]
    rec = Record(toks, feats, first_gen=4)
    L._ensure_teacher(rec)
    first = [L.train_step([rec]) for _ in range(3)]
    for _ in range(12):
        last = L.train_step([rec])
    assert last < 0.8 * first[0], (first, last)


def _bigram_requests(od, cfg, n_req: int, seed: int, n: int = 24):
    """Requests in a narrow "domain": the target's feature after token t is table[t], so the teacher's next-token
    law is a fixed function of the current token (learnable by a small LM)."""
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(9), dtype=D)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_req):
        toks = torch.randint(0, 8, (n,), generator=g)
        feats = torch.cat([torch.randn(1, cfg.hidden_size, generator=g, dtype=D), table[toks[:-1]]])
        od.start([1] + toks[:5].tolist(), int(toks[5]), feats[:6])
        for j in range(6, n, 3):
            od.commit(toks[j:j + 3], feats[j:j + 3])
    od.flush()


def test_sync_learner_publishes_and_saved_head_loads(tiny, tmp_path):
    """End to end on the wrapper: in a narrow "domain" the target's next feature is a fixed function of the
    token (learnable); the inline learner publishes a version that agrees better on held-out requests, it is
    swapped in at the next start, and save() writes a head that load_eagle_head reads back."""
    _, cfg, lm_head = tiny
    od = _online(cfg, lm_head, scale=1.0, lr=2e-2, steps=5, update_interval=20, batch_tokens=200)
    _bigram_requests(od, cfg, 6, seed=4)
    log = od.learner.log
    assert any(e["published"] for e in log), [sorted(e.items()) for e in log]
    assert all(e["cand_acc"] > e["live_acc"] for e in log if e["reason"] == "gain")
    od.start([1, 2, 3], 4, torch.randn(3, cfg.hidden_size, dtype=D))
    assert od.version >= 1
    out = od.save(tmp_path / "head")
    back = load_eagle_head(out, cfg, od.head.embed_tokens.weight.data, D)
    for k, v in head_state(od.head).items():
        assert torch.allclose(head_state(back)[k], v, atol=1e-6), k   # load_eagle_head goes through float32
    od.close()


def _learning_run(od, cfg) -> tuple:
    """What a stream of requests teaches ``od``: the version that drafts the next request, the learner's losses and
    decisions, and the live weights."""
    _bigram_requests(od, cfg, 6, seed=4)
    od.start([1, 2, 3], 4, torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=D))
    return od.version, [(e["loss"], e["reason"]) for e in od.learner.log], head_state(od.head)


def test_forget_requests_learns_as_a_fresh_wrapper(tiny):
    """``draft.protocol.forget_requests`` on an OnlineDrafter (what every mode of a run calls first): version 0's
    weights back, an empty buffer, fresh learners and counters, so the same requests teach exactly what they teach
    a wrapper that never saw the earlier ones. Planted forgets fail: one that only reloads the weights (the buffer
    and the learner's optimizer carry on), and none at all."""
    from draft.protocol import forget_requests
    _, cfg, lm_head = tiny
    kw = dict(scale=1.0, lr=2e-2, steps=5, update_interval=20, batch_tokens=200)
    version, log, weights = _learning_run(_online(cfg, lm_head, **kw), cfg)
    assert version >= 1 and log

    def same(got) -> bool:
        return got[0] == version and got[1] == log and all(torch.equal(got[2][k], weights[k]) for k in weights)
    od = _online(cfg, lm_head, **kw)
    w0 = head_state(od.head)
    assert same(_learning_run(od, cfg))
    forget_requests(SimpleNamespace(inner=od))                          # found through a wrapper too
    assert od.version == 0 and all(torch.equal(head_state(od.head)[k], w0[k]) for k in w0)
    osd = od.row_fields()["osd"]
    assert od.buffer.entries == 0 and osd["updates"] == 0 and osd["swaps"] == 0 and osd["requests_seen"] == 0
    assert same(_learning_run(od, cfg))
    od.close()

    class WeightsOnly(OnlineDrafter):
        def forget_requests(self):                     # planted: the weights go back, the learning state stays
            from draft.osd import load_head_state
            for name, sl in self.slots.items():
                load_head_state(sl.module, self.states[0][name])
            self.version = 0
    for planted in (WeightsOnly, None):
        od = _online(cfg, lm_head, cls=planted or OnlineDrafter, **kw)
        _learning_run(od, cfg)
        if planted is not None:
            forget_requests(od)
        assert not same(_learning_run(od, cfg)), planted
        od.close()


def test_osd_config_keys_are_validated():
    cfg = apply_overrides(DEFAULT, ["osd.enabled=true", "loss=jsd", "sample_source=mix_request", "osd.lr=1e-3"])
    assert cfg.osd.enabled and cfg.osd.loss == "jsd" and cfg.osd.lr == 1e-3
    assert OsdSettings.from_config(cfg.osd).sample_source == "mix_request"
    for bad in ("osd.loss=kl", "osd.sample_source=both", "osd.steps=0", "osd.lr=0", "osd.swap_at=never",
                "osd.mix_ratio=2"):
        with pytest.raises(ConfigError):
            apply_overrides(DEFAULT, [bad])
    with pytest.raises(ConfigError, match="has neither"):
        apply_overrides(DEFAULT, ["osd.enabled=true", "draft.sources=lookup"])     # nothing it can learn
    assert apply_overrides(DEFAULT, ["osd.enabled=true", "draft.sources=eagle,lookup,ssm:x"]).osd.enabled


def test_osd_with_lanes_is_one_clear_refusal():
    """osd.enabled with serve.max_active > 1 is refused when the configuration is read (draft/osd.py, "Lanes"): a
    ConfigError, and the server's command line exits 2 with one line before loading anything; max_active=1 is fine."""
    import subprocess
    import sys
    with pytest.raises(ConfigError, match="serve.max_active=2"):
        apply_overrides(DEFAULT, ["osd.enabled=true", "serve.max_active=2"])
    assert apply_overrides(DEFAULT, ["osd.enabled=true", "serve.max_active=1"]).osd.enabled
    assert apply_overrides(DEFAULT, ["serve.max_active=4"]).serve.max_active == 4
    p = subprocess.run([sys.executable, "-m", "pipeline.serve", "osd.enabled=true", "serve.max_active=3", "--no-http"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "osd.enabled cannot serve several requests at once" in p.stderr and "Traceback" not in p.stderr


# -- exactness: greedy output equals HF while the head changes between rounds -------------------------------------

class ChaosPublisher:
    """After every commit, publish a random perturbation of the live weights (swap_at=commit swaps it in at the
    next commit: the head changes between rounds), on top of the real inline learner."""

    def __init__(self, od: OnlineDrafter, seed: int) -> None:
        self.od, self.g = od, torch.Generator().manual_seed(seed)
        self.inner_commit = od.commit
        od.commit = self.commit

    def commit(self, tokens, features):
        out = self.inner_commit(tokens, features)
        state = head_state(self.od.head)
        self.od.publish({k: v + 0.5 * torch.randn(v.shape, generator=self.g, dtype=v.dtype) * v.std().clamp_min(1e-3)
                         for k, v in state.items()})
        return out


@pytest.mark.parametrize("swap_at", ["commit", "generation"])
def test_greedy_output_equals_hf_while_the_head_changes(tiny, tmp_path, monkeypatch, swap_at):
    from model.split import split_checkpoint
    import pipeline.inprocess as tr
    from pipeline.build import make_drafter as real_make
    full, _, _ = tiny
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False)
    made = []

    def make(cfg, stage_root, model, dtype, device):
        od = real_make(cfg, stage_root, model, dtype, device)
        assert isinstance(od, OnlineDrafter)
        made.append(od)
        ChaosPublisher(od, 0)
        return od
    monkeypatch.setattr(tr, "make_drafter", make)
    swaps = []                                   # each mode learns afresh (forget_requests): count every mode's swaps
    monkeypatch.setattr(tr, "forget_requests", lambda d: (swaps.append(d.swaps), d.forget_requests()))
    prompts = [[1, 5, 9, 13, 22, 7], [1, 30, 31, 32, 33, 34, 35, 36], [1, 5, 9, 13, 22, 8]]
    over = ["max_new_tokens=12", "dtype=float64", "draft.sources=eagle", "osd.enabled=true", "osd.sync=true",
            f"osd.swap_at={swap_at}",
            "osd.update_interval=4", "osd.steps=1", "osd.teacher_topk=8", "osd.holdout=1",
            "tree.total_token=12", "tree.init_total_token=12", "tree.expand_total_token=8"]
    res = tr.run_threaded(stages, prompts, ["naive", "continuous"], over, {2})
    od = made[0]
    assert len(swaps) == 2 and sum(swaps) + od.swaps >= (10 if swap_at == "commit" else 2), (swaps, od.swaps)
    for mode, gens in res.items():
        for p, g in zip(prompts, gens):
            assert g.output_ids == hf_greedy(full, p, 12, {2}, D), (mode, p)
    od.close()


def test_each_mode_of_a_run_learns_as_if_alone(tiny, tmp_path, monkeypatch):
    """``run_threaded`` (as ``pipeline.run --modes``) decodes the same prompts in every mode: ``naive`` after
    ``pruned`` learns exactly what ``naive`` alone learns (the inline learner's losses and decisions); with the
    forgetting removed (planted) its learner trains on ``pruned``'s answers too, and learns something else."""
    from model.split import split_checkpoint
    import pipeline.inprocess as tr
    from pipeline.build import make_drafter as real_make
    full, _, _ = tiny
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False)
    made = []
    monkeypatch.setattr(tr, "make_drafter", lambda *a: made.append(real_make(*a)) or made[-1])
    prompts = [[1, 5, 9, 13, 22, 7], [1, 30, 31, 32, 33, 34, 35, 36], [1, 5, 9, 13, 22, 8]]
    over = ["max_new_tokens=12", "dtype=float64", "draft.sources=eagle", "osd.enabled=true", "osd.sync=true",
            "osd.update_interval=4", "osd.steps=1", "osd.teacher_topk=8", "osd.holdout=1", "tree.total_token=12"]

    def naive_learns(modes) -> list:
        tr.run_threaded(stages, prompts, modes, over, {2})
        od = made[-1]
        od.close()
        return [(e["loss"], e["reason"]) for e in od.learner.log]
    alone = naive_learns(["naive"])
    assert alone
    assert naive_learns(["pruned", "naive"]) == alone
    monkeypatch.setattr(tr, "forget_requests", lambda d: None)
    assert naive_learns(["pruned", "naive"]) != alone


def test_osd_report_writes_png_csv_and_rejects_bad_input(tmp_path, capsys):
    import json as _json

    from pipeline.tools.osd_report import main
    def rows(taus, versions):
        return "".join(_json.dumps({"question_id": i, "category": ("stream" if i < 3 else "eval") + f":x:{i}",
                                    "tau": t, "accept_lengths": [int(t)] * 4, "new_tokens": 8, "drafter_version": v})
                       + "\n" for i, (t, v) in enumerate(zip(taus, versions)))
    (tmp_path / "s.jsonl").write_text(rows([2, 2, 2, 2, 2], [0] * 5))
    (tmp_path / "o.jsonl").write_text(rows([2, 3, 3, 3, 3], [0, 1, 1, 2, 2]))
    out = tmp_path / "rep"
    assert main([str(tmp_path / "s.jsonl"), str(tmp_path / "o.jsonl"), "--labels", "static,online",
                 "--out-dir", str(out)]) == 0
    assert (out / "osd_curve.png").stat().st_size > 1000
    summ = {(r["run"], r["group"]): r for r in __import__("csv").DictReader(open(out / "osd_summary.csv"))}
    assert float(summ[("online", "eval")]["vs_static"]) == 1.5 and float(summ[("static", "eval")]["tau"]) == 2.0
    assert summ[("online", "eval")]["vs_static_ci95"] == "[1.5, 1.5]" and summ[("static", "eval")]["vs_static_ci95"] == ""
    from pipeline.tools.osd_report import paired_ratio_ci
    a = [{"question_id": i, "accept_lengths": [2 + i % 2]} for i in range(10)]
    b = [{"question_id": i, "accept_lengths": [2]} for i in range(10)]
    lo, hi = paired_ratio_ci(a, b)
    assert 1.0 <= lo < 1.25 < hi <= 1.5                    # half the requests gain 1.5x: the pooled ratio is 1.25
    assert paired_ratio_ci(a, b[:9]) is None and paired_ratio_ci(a[::-1], b) is None   # rows that do not pair
    assert len(open(out / "osd_rows.csv").read().splitlines()) == 11
    (tmp_path / "bad.jsonl").write_text('{"no_tau": 1}\n')
    assert main([str(tmp_path / "bad.jsonl"), "--out-dir", str(out)]) == 2
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("on_reject", ["keep", "restart"])
def test_rejected_candidate_is_kept_or_dropped(tiny, on_reject):
    _, cfg, lm_head = tiny
    od = _online(cfg, lm_head, scale=1.0, lr=1e-2, steps=2, update_interval=4, min_gain=2.0, on_reject=on_reject)
    for i in range(3):
        _fake_request(od, cfg, i)
    L = od.learner
    assert L.updates >= 1 and not any(e["published"] for e in L.log) and od.version == 0
    same = all(torch.equal(v, L.live[k].to(v.dtype)) for k, v in head_state(L.net).items())
    assert same == (on_reject == "restart")


def test_osd_report_stream_builds_a_shifted_stream_without_repeats(tmp_path, capsys):
    import json as _json

    from pipeline.tools.osd_report import TRANSLATION_SOURCES, build_stream, main
    data = tmp_path / "data"
    for k, ds in enumerate(TRANSLATION_SOURCES + ("humaneval",)):
        (data / ds).mkdir(parents=True)
        long = "x" * 300   # too long to translate: skipped
        recs = [{"question_id": i, "turns": [long if i % 10 == 9 else f"{ds} text {i}?", "second turn"]}
                for i in range(60)]
        (data / ds / "question.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in recs))
    recs = build_stream(data, "translation", 150, 30, 50)
    cats = [r["category"] for r in recs]
    assert cats[:150] == [c for c in cats if c.startswith("stream:")] and len(recs) == 170
    ids = [int(c.rsplit(":", 1)[1]) for c in cats]
    assert not any(30 <= i < 50 for i in ids[:150]) and ids[150:] == list(range(30, 50))
    texts = [r["turns"][0] for r in recs]
    assert len(set(texts)) == len(texts) and all(len(r["turns"]) == 1 for r in recs)
    assert texts[0].startswith("Translate the following text into French:") and "qa text 0?" in texts[0]
    assert "into Spanish" in texts[1] and "alpaca text 0?" in texts[1] and "into German" in texts[2]
    assert not any("x" * 300 in t for t in texts)
    # several sets: the stream is split evenly, one set after the other, then each set's evaluation records
    two = build_stream(data, "gsm8k,humaneval", 20, 30, 50)
    assert [r["category"] for r in two][:11] == [f"stream:gsm8k:{i}" for i in range(10)] + ["stream:humaneval:0"]
    assert [r["category"] for r in two][20] == "eval:gsm8k:30" and len(two) == 60
    # the CLI, and one clear error for a stream the data cannot hold or a missing folder
    out = tmp_path / "s.jsonl"
    assert main(["stream", "--data", str(data), "--stream", "40", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 60
    assert main(["stream", "--data", str(data), "--domain", "gsm8k", "--stream", "41", "--out", str(out)]) == 2
    assert main(["stream", "--data", str(tmp_path / "nope"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "too few" in err and "does not exist" in err


def test_head_dir_untrained_is_a_random_head_even_for_the_default_split(tiny, tmp_path, monkeypatch, capsys):
    """``model.head_dir=untrained`` (learning from scratch) gives the random head where the default split would
    load the shipped one, and names it in the provenance."""
    from config.run_config import DEFAULT, apply_overrides
    from draft.eagle import init_untrained_head
    from model.split import split_checkpoint
    from model.stage_model import load_stage
    import pipeline.build as build
    full, _, _ = tiny
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False)
    monkeypatch.setattr(build, "DEFAULT_STAGE_DIR", stages)   # as if these were the default model's stages
    model0 = load_stage(stages, 0, 3, torch.float64, "cpu")
    cfg = apply_overrides(DEFAULT, ["model.head_dir=untrained", "draft.sources=eagle"])   # the head drafter itself
    assert build.head_choice(cfg, stages) is None
    d = build.make_drafter(cfg, stages, model0, torch.float64, "cpu")
    want = init_untrained_head(model0.config)
    assert torch.equal(d.head.fc.weight.to(want.fc.weight.dtype), want.fc.weight)
    assert torch.equal(d.head.embed_tokens.weight, model0.embed_tokens.weight)
    assert "model.head_dir=untrained" in capsys.readouterr().err


# -- small draft LMs (draft.ssm) and merged drafters ---------------------------------------------------------------

def test_small_lm_learner_publishes_and_the_saved_student_loads(tiny, tmp_path):
    """osd on a small draft LM alone (draft.sources=ssm:<dir>): the learner distils it teacher-forced on the
    committed tokens, publishes a version with better held-out agreement, the live model drafts with it from the
    next request on, and save() writes a student that load_small_lm reads back with the same weights."""
    from draft.osd import SmallLMLearner, learnable_slots
    from draft.ssm import SmallLMDrafter, load_small_lm
    _, cfg, lm_head = tiny
    path = tiny_llama(tmp_path / "ssm", seed=4, layers=1, vocab=cfg.vocab_size, hidden=32, dtype=D)
    inner = SmallLMDrafter(path, vocab_size=cfg.vocab_size, dtype=D)
    assert [(s.name, s.kind) for s in learnable_slots(inner)] == [("ssm", "ssm")]
    s = OsdSettings(sync=True, update_interval=20, teacher_topk=8, batch_tokens=200, lr=2e-2, steps=5)
    od = OnlineDrafter(inner, lm_head, s)
    assert isinstance(od.learner, SmallLMLearner)
    frozen = {n: p for n, p in inner.model.named_parameters() if "embed_tokens" in n or "lm_head" in n}
    w_emb = {n: p.detach().clone() for n, p in frozen.items()}
    before = {k: v.clone() for k, v in head_state(inner.model).items()}
    _bigram_requests(od, cfg, 6, seed=4)
    log = od.learner.log
    assert any(e["published"] for e in log), [sorted(e.items()) for e in log]
    assert all(e["cand_acc"] > e["live_acc"] for e in log if e["reason"] == "gain")
    od.start([1, 2, 3], 4, torch.randn(3, cfg.hidden_size, dtype=D))
    assert od.version >= 1 and any(not torch.equal(v, before[k]) for k, v in head_state(inner.model).items())
    assert all(torch.equal(p, w_emb[n]) for n, p in frozen.items())       # embedding / lm_head never learned
    out = od.save(tmp_path / "saved")
    back = load_small_lm(tmp_path / "saved" / "ssm", D, vocab_model=SimpleNamespace(
        embed_tokens=inner.model.model.embed_tokens, lm_head=inner.model.lm_head))
    for k, v in head_state(inner.model).items():
        assert torch.allclose(head_state(back)[k], v), k
    assert out == str(tmp_path / "saved")
    od.close()


def test_small_lm_learner_reduces_the_loss_on_its_own_rows(tiny, tmp_path):
    """The small LM's rows: entry j's logits come from the prompt's first token and the entries' tokens 0..j
    (checked against a plain forward), and optimizer steps lower the distillation loss whatever sample source."""
    from draft.osd import SmallLMLearner
    from draft.ssm import SmallLMDrafter
    _, cfg, lm_head = tiny
    path = tiny_llama(tmp_path / "ssm", seed=5, layers=1, vocab=cfg.vocab_size, hidden=32, dtype=D)
    inner = SmallLMDrafter(path, vocab_size=cfg.vocab_size, dtype=D)
    L = SmallLMLearner(inner.model, lm_head, ReplayBuffer(1000), OsdSettings(lr=3e-3, sample_source="student"),
                       lambda *a: 0)
    g = torch.Generator().manual_seed(2)
    n = 20
    toks = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    rec = Record(toks, torch.randn(n, cfg.hidden_size, generator=g, dtype=D), first_gen=3, first_id=1)
    (lvl, hidden), = L._forward(rec, 2, True, grad=False)
    with torch.no_grad():
        want = inner.model(input_ids=torch.cat([torch.tensor([1]), toks])[None]).logits[0, 1:]
    assert lvl == 0 and torch.allclose(L._logits(hidden), want.float(), atol=1e-6)
    L._ensure_teacher(rec)
    first = L.train_step([rec])
    for _ in range(12):
        last = L.train_step([rec])
    assert last < 0.8 * first, (first, last)


def test_merged_drafter_learns_every_slot_with_joint_versions(tiny, tmp_path):
    """draft.sources=eagle,lookup,ssm: one learner per learnable source on one buffer; a publication replaces its
    own slot and keeps the other's; a rollback restores both slots of the previous version."""
    from draft.lookup import LookupDrafter
    from draft.merged import MergedDrafter
    from draft.osd import learnable_slots
    from draft.ssm import SmallLMDrafter
    _, cfg, lm_head = tiny
    path = tiny_llama(tmp_path / "ssm", seed=4, layers=1, vocab=cfg.vocab_size, hidden=32, dtype=D)
    ssm = SmallLMDrafter(path, vocab_size=cfg.vocab_size, dtype=D)
    eagle = Drafter(_head(cfg), lm_head, 256)
    merged = MergedDrafter([eagle, LookupDrafter(cfg.vocab_size), ssm], ["eagle", "lookup", f"ssm:{path}"])
    assert [s.name for s in learnable_slots(merged)] == ["eagle", f"ssm:{path}"]
    od = OnlineDrafter(merged, lm_head, OsdSettings(sync=True, window=2, rollback_tol=0.1), learn=False)
    e0, s0 = head_state(eagle.head), head_state(ssm.model)
    for i in range(2):
        _fake_request(od, cfg, i, commits=(2, 3, 1, 2))                 # version 0: tau 2
    od.publish({k: v * 0.5 for k, v in s0.items()}, slot=f"ssm:{path}")
    _fake_request(od, cfg, 5, commits=(2, 3, 1, 2))
    assert od.version == 1 and torch.equal(head_state(eagle.head)["fc.weight"], e0["fc.weight"])
    assert all(torch.equal(v, s0[k] * 0.5) for k, v in head_state(ssm.model).items())
    od.publish({k: v * 0.5 for k, v in e0.items()})                      # default slot: eagle
    for i in range(2):
        _fake_request(od, cfg, 10 + i, commits=(1, 1, 1, 1))            # version 2: tau 1 < 0.9 * 2
    assert od.version == 2 and set(od.states[2]) == {"eagle", f"ssm:{path}"}
    assert all(torch.equal(v, s0[k] * 0.5) for k, v in head_state(ssm.model).items())   # ssm slot kept
    _fake_request(od, cfg, 20)
    assert od.version == 1 and od.rollbacks == 1                         # both slots back to version 1
    assert all(torch.equal(v, e0[k]) for k, v in head_state(eagle.head).items())
    assert all(torch.equal(v, s0[k] * 0.5) for k, v in head_state(ssm.model).items())
    with pytest.raises(KeyError, match="no learnable slot"):
        od.publish({}, slot="lookup")
    # with learners: both learn from the same requests
    od2 = OnlineDrafter(merged, lm_head, OsdSettings(sync=True, update_interval=20, teacher_topk=8, steps=1))
    _bigram_requests(od2, cfg, 4, seed=6)
    assert set(od2.learners) == {"eagle", f"ssm:{path}"} and all(x.updates >= 1 for x in od2.learners.values())
    row = od2.row_fields()["osd"]
    assert row["slots"] == ["eagle", f"ssm:{path}"] and set(row["per_slot"]) == set(row["slots"])
    assert row["updates"] == sum(x.updates for x in od2.learners.values())
    od2.close()
    assert learnable_slots(LookupDrafter(cfg.vocab_size)) == []


@pytest.mark.parametrize("sources", ["ssm", "eagle,lookup,ssm"])
def test_greedy_output_equals_hf_while_small_lm_and_head_change(tiny, tmp_path, monkeypatch, sources):
    """Exactness through pipeline.build.make_drafter with draft.sources and osd.enabled: the real learners update
    the small LM (and the head), a publisher perturbs every slot after every commit (swap_at=commit: the drafter
    changes between rounds), and every greedy answer equals HF generate."""
    from model.split import split_checkpoint
    import pipeline.inprocess as tr
    from pipeline.build import make_drafter as real_make
    full, cfg, _ = tiny
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False)
    ssm_dir = tiny_llama(tmp_path / "ssm", seed=4, layers=1, vocab=cfg.vocab_size, hidden=32, dtype=D)
    made = []

    def make(cfg_, stage_root, model, dtype, device):
        od = real_make(cfg_, stage_root, model, dtype, device)
        assert isinstance(od, OnlineDrafter) and len(od.learners) == len(od.slots) >= 1
        made.append(od)
        g = torch.Generator().manual_seed(0)
        inner_commit = od.commit

        def commit(tokens, features):
            out = inner_commit(tokens, features)
            for name, sl in od.slots.items():
                st = head_state(sl.module)
                od.publish({k: v + 0.5 * torch.randn(v.shape, generator=g, dtype=v.dtype) * v.std().clamp_min(1e-3)
                            for k, v in st.items()}, slot=name)
            return out
        od.commit = commit
        return od
    monkeypatch.setattr(tr, "make_drafter", make)
    prompts = [[1, 5, 9, 13, 22, 7], [1, 30, 31, 32, 33, 34, 35, 36], [1, 5, 9, 13, 22, 8]]
    src = ",".join(f"ssm:{ssm_dir}" if w == "ssm" else w for w in sources.split(","))
    over = ["max_new_tokens=12", "dtype=float64", "osd.enabled=true", "osd.sync=true", "osd.swap_at=commit",
            "osd.update_interval=4", "osd.steps=1", "osd.teacher_topk=8", "osd.holdout=1", f"draft.sources={src}",
            "tree.total_token=12", "tree.init_total_token=12", "tree.expand_total_token=8"]
    res = tr.run_threaded(stages, prompts, ["naive", "continuous"], over, {2})
    assert made and made[0].swaps >= 10
    for mode, gens in res.items():
        for p, g in zip(prompts, gens):
            assert g.output_ids == hf_greedy(full, p, 12, {2}, D), (mode, p)
    for od in made:
        od.close()
