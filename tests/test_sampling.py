"""Temperature sampling keeps the target's distribution, in every mode (issue 5).

The world: a tiny vocabulary with a Markov target and a Markov draft (the next-token law depends on the last
token only), so the joint law of the first K committed tokens is a product of known per-token laws and can be
enumerated. Trees come from the real EAGLE-2 builder (``Drafter.grow_tree`` -> ``top_nodes_tree``) fed by a
Markov "draft head"; decoding runs each mode's real rank-0 code (``ar_decode``, ``naive_decode``,
``PrunedMode``, ``ContinuousMode``, ``PipeDecMode``) against an in-process fake ring (:class:`FakeRing`) that
prunes the in-flight segments with the stage's real decision code (``pipeline.worker.StageTree``), so step-wise
verification, stale results, re-rooting, pruning and dynamic expansion happen as in the pipeline.

Checks:
  1. exact law (the proof-grade check): the sampler's two random primitives, ``accept(prob)`` and
     ``draw(p)``, are replaced by a branching oracle (:class:`BranchingSampler`) and every random branch of the
     real mode code is enumerated; the law of the first K tokens must equal the target's to 1e-6 (float32
     processing noise). This sees any deviation, however small, and covers T in {0.3, 1, 2}, top-p/top-k on
     and off, draft = target, disjoint supports, one-hot drafts, and forced pruning/re-rooting/expansion.
  2. chi-square with the real ``torch.Generator`` (real ``Sampler``: uniform draws, ``torch.multinomial``) on
     the naive and the step-wise (verify a prefix, re-root, expand) verification patterns, with a sample count
     whose power against a 1%-TV deviation is computed and asserted; broken verifiers must fail it (and the
     exact check) -- the tests have power.
  3. end to end through ``python -m pipeline.run`` on 3 local ranks: seeded runs are byte-identical, another
     seed differs, and ``ar`` at T > 0 reproduces HF ``generate(do_sample=True)`` token for token.
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from config.run_config import DEFAULT, apply_overrides
from draft.drafter import BeamTreeDrafter
from draft.tree import keep_indices_for, merge_trees, reroot
from pipeline.engine import DecodeResult, OutputBuffer
from model.kv_cache import KVCache
from pipeline.messages import Segment
from pipeline.modes.ar import ar_decode
from pipeline.modes.flowspec import ContinuousMode, PrunedMode
from pipeline.modes.naive import naive_decode
from pipeline.modes.pipedec import PipeDecMode
from pipeline.verify import Sampler, walk_tree
from pipeline.worker import StageTree

V = 8          # vocabulary
ROOT = 0       # the token every generation starts from (forced first token)
ALPHA = 1e-3   # chi-square significance


# ---------------------------------------------------------------------------------------------------------------
# The Markov world
# ---------------------------------------------------------------------------------------------------------------

def make_world(seed: int, draft: str, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits ``[V, V]`` (row = last token) and draft logits of the given adversarial kind."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * scale
    if draft == "random":
        draft_logits = torch.randn(V, V, generator=g) * 2.0
    elif draft == "target":                   # draft = target (before temperature/top-p)
        draft_logits = target.clone()
    elif draft == "onehot":                   # q is (numerically) a point mass on a random token
        draft_logits = torch.full((V, V), -1e4)
        draft_logits[torch.arange(V), torch.randint(0, V, (V,), generator=g)] = 0.0
    elif draft == "disjoint":                 # the target lives on the lower half, the draft on the upper half
        target[:, V // 2:] = float("-inf")
        draft_logits = torch.full((V, V), -1e4)
        draft_logits[:, V // 2:] = torch.randn(V, V - V // 2, generator=g)
    else:
        raise ValueError(draft)
    return target.float(), draft_logits.float()


def enc(token: int) -> torch.Tensor:
    """The fake hidden state of a position: just its token (the world is Markov)."""
    return torch.tensor([float(token)], dtype=torch.float64)


class MarkovDrafter(BeamTreeDrafter):
    """A drafter whose head is a Markov table: the real EAGLE-2 tree search (``BeamTreeDrafter``) runs on top."""

    def __init__(self, draft_logits: torch.Tensor) -> None:  # no EAGLE head, no cache
        self.table = torch.log_softmax(draft_logits.float(), dim=-1)
        self.n_tree = 0
        self.memo: dict = {}

    def logprobs(self, hidden):
        return self.table[hidden[..., 0].long()]

    def tree_forward(self, tokens, features, parents):
        self.n_tree += tokens.numel()
        return tokens.double()[:, None]       # a node's output feature = its token

    def drop_tree(self):
        self.n_tree = 0

    @property
    def tree_size(self):
        return self.n_tree

    def commit(self, tokens, features):
        return enc(int(tokens[-1]))

    def start(self, prompt_ids, first_token, features, sampling=None):
        return enc(first_token)

    def grow_tree(self, root_token, root_hidden, total_token, depth, top_k):
        # deterministic given the root token: build once with the real search, then reuse
        key = (root_token, total_token, depth, top_k)
        if key not in self.memo:
            self.memo[key] = super().grow_tree(root_token, root_hidden, total_token, depth, top_k)
        return self.memo[key]


class ReducedVocabDrafter(MarkovDrafter):
    """An EAGLE-3-style reduced draft vocabulary on the Markov world: the draft's law lives on ``vocab`` only
    (zero mass elsewhere); the real ``Drafter`` search runs top-k over the draft vocabulary and maps the winners
    to target ids through ``vocab_map`` (:meth:`Drafter.top_tokens`), and ``logprobs`` is -inf outside it."""

    def __init__(self, draft_logits: torch.Tensor, vocab: list[int]) -> None:
        super().__init__(draft_logits)
        self.vocab_map = torch.tensor(vocab)
        self.reduced = torch.log_softmax(draft_logits.float()[:, self.vocab_map], dim=-1)   # [V, Vd]

    def draft_logprobs(self, hidden):
        return self.reduced[hidden[..., 0].long()]

    def logprobs(self, hidden):
        lp = torch.full((*hidden.shape[:-1], V), float("-inf"))
        lp[..., self.vocab_map] = self.draft_logprobs(hidden)
        return lp


class FakeRing:
    """Rank 0's view of the ring, in one process. Layers are not simulated (the world is Markov: a node's
    "hidden state" is its token); what matters is the protocol, and it runs the stage's real decision code
    (:class:`pipeline.worker.StageTree` on a one-slot-wide KV cache): every segment applies its decision log,
    and, with ``early`` (default), every decision sent point to point before the segment is received, so
    in-flight work is pruned and stale results come back as at the most eager stage; with ``early=False``
    decisions reach the stage only on the ring. Rank 0 must cope with both."""

    def __init__(self, world: int, lockstep: bool, live, early: bool = True) -> None:
        self.world, self.lockstep, self.live, self.early = world, lockstep, live, early
        self.events: Counter = Counter()
        self.reset()

    def reset(self) -> None:
        self.inflight: list = []
        self.direct: list = []
        self.tree = StageTree(KVCache(1, 1, 1, 4096, torch.float64))

    def send_next(self, msg) -> None:
        if not self.early:
            msg = self._compute(msg)
        self.inflight.append(msg)

    def send_direct(self, d) -> None:
        if self.live():
            self.events[d.status.name] += 1
        self.direct.append(d)

    def _compute(self, seg):
        """The stage worker's segment step (pipeline.worker.StageWorker._segment) without layers."""
        if not isinstance(seg, Segment):   # ar's Context: one token, its "hidden state" is the token
            return SimpleNamespace(x=seg.x.double().reshape(1, -1, 1))
        tree = self.tree
        if seg.gen != tree.gen:
            tree.reset(seg.gen)
        if self.live():
            for d in seg.decisions():
                if d.seq > tree.applied and d.seq not in tree.early:
                    self.events[d.status.name] += 1
        tree.offer(seg.decisions())
        if self.early:
            tree.offer(self.direct)
            self.direct = []
        tree.apply_ready()
        rows, parents = tree.admit(seg)
        toks, gids, pg = seg.x[0][rows], seg.gids[rows], seg.parents[rows]
        cache = tree.cache
        pos, mask, anc, depth = cache.tree_inputs(parents, torch.float64)
        cache.commit_forward(int(gids.numel()), as_context=False, anc=anc, depth=depth)
        tree.computed(gids.tolist())
        if gids.numel() == 0 and self.live():
            self.events["EMPTY"] += 1
        return Segment(toks.double().reshape(1, -1, 1), pg, gids, seg.gen, seg.epoch, seg.log)

    def recv_prev(self):
        msg = self.inflight.pop(0)
        return self._compute(msg) if self.early else msg


class CountingContinuous(ContinuousMode):
    """The real ContinuousMode; counts nodes that expansion appends before the horizon is reached."""

    def __init__(self) -> None:
        super().__init__()
        self.appended = 0
        self.fused = 0          # verified steps whose commit and expansion ran as one call (tree.fuse_commit)
        self.prefetched = 0     # ... of them, started from a prefetched first level (tree.prefetch_level)
        self.early_sent = 0     # verified steps that sent that first level before the commit (tree.early_level)
        self.whole_sent = 0     # ... that sent the whole expansion so (tree.early_whole)

    def grow(self, engine, tree, root_hidden, verified):
        out = super().grow(engine, tree, root_hidden, verified)
        if engine.comm.live():
            self.appended += len(out) - len(tree)
        return out

    def send_early(self, engine, state):
        n = len(state.tree)
        sent = super().send_early(engine, state)
        if sent and engine.comm.live():        # expansion nodes too (appended before the send: tree.early_*)
            self.appended += len(state.tree) - n
        self.early_sent += int(sent and engine.comm.live())
        self.whole_sent += int(sent and self.whole and engine.comm.live())
        return sent

    def commit_and_grow(self, engine, tree, tokens, feats):
        pre = self.pre is not None
        got = super().commit_and_grow(engine, tree, tokens, feats)
        if got is not None and engine.comm.live():
            self.appended += len(got[0]) - len(tree)
            self.fused += 1
            self.prefetched += int(pre)
        return got


TREE = {  # small trees so that enumeration stays cheap, segments of 1-2 nodes so that every event happens
    "tree.total_token": 7, "tree.depth": 2, "tree.top_k": 3,
    "tree.init_total_token": 7, "tree.init_depth": 2, "tree.init_topk": 3, "tree.subseq_token": 1,
    "tree.expand_total_token": 5, "tree.expand_depth": 2, "tree.expand_topk": 2, "tree.expand_subseq_token": 2,
    "tree.pipedec_topk": 3,
}
MODES = {
    "ar": (ar_decode, False),
    "naive": (naive_decode, False),
    "pruned": (PrunedMode().decode, True),
    "continuous": (None, True),          # a fresh CountingContinuous per configuration
    "pipedec": (PipeDecMode().decode, True),
}


def make_runner(mode: str, world: int, tables, sampler: Sampler, horizon: int, overrides: dict,
                early: bool = True, drafter=None):
    """``run() -> first `horizon` tokens after ROOT`` through the mode's real rank-0 code."""
    target, draft_logits = tables
    live = getattr(sampler, "live", lambda: True)
    decode, lockstep = MODES[mode]
    cont = None
    if mode == "continuous":
        cont = CountingContinuous()
        decode = cont.decode
    ring = FakeRing(world, lockstep, live, early)
    engine = SimpleNamespace(comm=ring, gen=1, cfg=apply_overrides(DEFAULT, {**TREE, **overrides}),
                             drafter=drafter or MarkovDrafter(draft_logits),
                             tracer=SimpleNamespace(span=lambda *a, **k: nullcontext()),
                             observe_step=lambda *a: None, logits=lambda hidden: target[hidden[:, 0].long()])
    first = torch.full((V,), -1e9)
    first[ROOT] = 0.0                      # the prefill "logits" force the first token to ROOT

    def run() -> tuple[int, ...]:
        ring.reset()
        out = OutputBuffer(set(), horizon + 1, sampler=sampler)
        res = decode(engine, first, None, [ROOT], out)
        assert isinstance(res, DecodeResult) and res.rounds >= 1 and len(res.accept_lengths) >= 1
        assert out.finished and out.ids[0] == ROOT and len(out.ids) == horizon + 1
        assert not ring.inflight, "the ring did not drain"
        return tuple(out.ids[1:])

    run.ring, run.cont = ring, cont
    return run


def target_law(sampler: Sampler, target: torch.Tensor, horizon: int) -> dict[tuple[int, ...], float]:
    """The exact law of ``horizon`` tokens after ROOT under the processed target (what HF would sample)."""
    rows = []
    for t in range(V):
        p = sampler.probs(target[t]).double()
        rows.append((p / p.sum()).tolist())   # torch.multinomial normalises its float32 input
    law = {(): 1.0}
    for _ in range(horizon):
        law = {seq + (x,): w * rows[seq[-1] if seq else ROOT][x]
               for seq, w in law.items() for x in range(V) if rows[seq[-1] if seq else ROOT][x] > 0}
    return law


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# ---------------------------------------------------------------------------------------------------------------
# 1. Exact law by enumeration of every random branch
# ---------------------------------------------------------------------------------------------------------------

class BranchingSampler(Sampler):
    """Replaces the generator by a branching oracle; the processing (``probs``) is the real one.

    A run replays a script of branch indices; a new branch point takes option 0 and queues the others, and
    the run's weight is the product of its options' probabilities. Every resolution of a node (an accepted
    child or a residual draw) commits exactly one token, so once ``horizon`` tokens are resolved the rest of
    the run cannot change them: later branch points take option 0 without weight (they sum out to 1).

    A sampling drafter's draws branch too (:meth:`drafted`), with one more such cut-off: a draw ``depth`` levels
    below a tree's root can decide nothing before token ``resolved + depth`` (the verifier reads a node's
    proposals only once every node above it was accepted, and its outcome there is that token), so a draw
    with ``resolved + depth`` past the horizon takes option 0 without weight, like a branch point after it
    (``pin_past_horizon``; off, every draw branches: ``tests/test_sampled_beam.py`` checks that both give the
    same law). Which tree the later draws build still varies with the draws that matter.
    """

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 0, horizon: int = 2,
                 pin_past_horizon: bool = True) -> None:
        super().__init__(temperature, top_p, top_k, None)
        self.horizon = horizon + 1              # + the forced first token
        self.pin_past_horizon = pin_past_horizon
        self.pinned = 0                         # drafter draws taken as option 0 (all runs)
        self.begin([])

    def begin(self, script: list[int]) -> None:
        self.script, self.pos, self.weight, self.resolved, self.todo = list(script), 0, 1.0, 0, []

    def drafted(self, options: list[tuple[object, float]], depth: int):
        """A drafter's draw ``depth`` levels below the root of the tree it grows (the root: the latest resolved
        token, or one after it), over ``options`` (token, q)."""
        assert depth >= 1
        if self.pin_past_horizon and self.live() and self.resolved + depth > self.horizon:
            self.pinned += 1
            return options[0][0]
        return self._branch(options)

    def live(self) -> bool:
        return self.resolved < self.horizon

    def _branch(self, options: list[tuple[object, float]]):
        if not self.live():
            return options[0][0]
        if self.pos == len(self.script):
            self.todo += [self.script + [j] for j in range(1, len(options))]
            self.script.append(0)
        value, w = options[self.script[self.pos]]
        self.pos += 1
        self.weight *= w
        return value

    def uniform(self) -> float:
        raise AssertionError("the verifiers must spend randomness through accept(), draw() and pick() only")

    def pick(self, p: torch.Tensor) -> int:
        return self.draw(p)                  # the same law (Sampler.pick: inverse CDF of one uniform)

    def accept(self, prob: float) -> bool:
        ok = self._branch([o for o in ((False, 1.0 - prob), (True, prob)) if o[1] > 0])
        self.resolved += ok
        return ok

    def draw(self, p: torch.Tensor) -> int:
        p = p.double()
        p = (p / p.sum()).tolist()
        x = self._branch([(i, w) for i, w in enumerate(p) if w > 0])
        self.resolved += 1
        return x


def exact_law(run, sampler: BranchingSampler, max_runs: int = 5000) -> tuple[dict, int]:
    law: dict = defaultdict(float)
    todo, runs = [[]], 0
    while todo:
        sampler.begin(todo.pop())
        law[run()] += sampler.weight
        todo += sampler.todo
        runs += 1
        assert runs <= max_runs, "enumeration exploded"
    return dict(law), runs


def assert_target_law(law: dict, ref: dict, what: str) -> None:
    """``law`` (:func:`exact_law`'s) is ``ref`` (:func:`target_law`'s): it sums to one, emits no zero-probability
    sequence, and every sequence's probability is within 1e-6 of the target's."""
    assert abs(sum(law.values()) - 1.0) < 1e-6
    assert set(law) <= set(ref), "a zero-probability sequence was emitted"
    worst = max(abs(law.get(k, 0.0) - w) for k, w in ref.items())
    assert worst < 1e-6, f"{what}: |law - target| up to {worst:.3g} (TV {total_variation(law, ref):.3g})"


# (mode, world, T, top_p, top_k, draft, horizon, overrides, events that must happen before the horizon)
EXACT_CASES = [
    ("ar", 3, 1.0, 1.0, 0, "random", 3, {}, ()),
    ("naive", 3, 1.0, 1.0, 0, "random", 3, {}, ()),
    ("naive", 3, 0.3, 0.8, 0, "target", 2, {}, ()),
    ("naive", 2, 2.0, 1.0, 3, "onehot", 2, {}, ()),
    ("pruned", 3, 1.0, 0.9, 0, "random", 3, {}, ("CONTINUE", "EMPTY")),
    ("pruned", 4, 2.0, 1.0, 0, "target", 2, {"tree.subseq_token": 2}, ("CONTINUE",)),
    ("pruned", 3, 0.3, 1.0, 0, "disjoint", 2, {}, ()),
    ("continuous", 3, 1.0, 1.0, 0, "target", 3, {},
     ("CONTINUE", "EMPTY", "expand")),
    ("continuous", 3, 0.3, 0.8, 4, "onehot", 2, {"tree.first_levels": 0}, ("CONTINUE", "expand")),
    ("continuous", 3, 1.0, 1.0, 0, "target", 3,   # quick-started first trees and drafting ahead
     {"tree.first_levels": 1, "tree.ahead_levels": 1, "tree.ahead_min_prob": 0.0}, ("CONTINUE", "expand")),
    ("continuous", 3, 1.0, 1.0, 0, "target", 3,   # a lookahead from the measured acceptance
     {"tree.lookahead_min_prob": 0.05, "tree.lookahead_max_levels": 3}, ("CONTINUE", "expand")),
    ("continuous", 4, 2.0, 0.9, 0, "random", 2, {"tree.first_levels": 0},
     ("CONTINUE", "expand")),
    ("continuous", 3, 1.0, 1.0, 0, "target", 3,   # commit + re-feed fused (issue 41: commit_extend_tree)
     {"tree.fuse_commit": True}, ("CONTINUE", "EMPTY", "expand", "fused")),
    ("continuous", 4, 2.0, 0.9, 0, "random", 3,   # + the next first level drafted after the send (prefetched)
     {"tree.prefetch_level": True, "tree.early_level": False, "tree.early_whole": 0},
     ("CONTINUE", "expand", "fused", "prefetched")),
    ("continuous", 4, 2.0, 0.9, 0, "random", 3,   # + that level sent before the commit (issue 41: early_level)
     {"tree.early_level": True, "tree.early_whole": 0}, ("CONTINUE", "expand", "fused", "prefetched", "early")),
    ("continuous", 4, 2.0, 0.9, 0, "random", 3,   # + the whole expansion sent so (issue 41: early_whole)
     {"tree.early_level": True, "tree.early_whole": 8}, ("CONTINUE", "expand", "fused", "early", "whole")),
    ("continuous", 3, 1.0, 1.0, 0, "target", 3,   # a new round's root sent before the commit (tree.root_first)
     {"tree.root_first": True, "tree.early_level": True}, ("CONTINUE", "TRUNCATE", "expand", "early")),
    ("pruned", 3, 1.0, 0.9, 0, "random", 3, {"tree.root_first": True}, ("CONTINUE", "TRUNCATE")),
    ("continuous", 3, 1.0, 1.0, 0, "disjoint", 2, {}, ()),
    ("pipedec", 3, 1.0, 0.9, 0, "random", 3, {}, ("CONTINUE",)),
    ("pipedec", 4, 0.3, 1.0, 0, "target", 2, {}, ("CONTINUE",)),
    ("pipedec", 3, 2.0, 1.0, 0, "onehot", 2, {}, ("CONTINUE",)),
    ("pipedec", 3, 1.0, 1.0, 0, "disjoint", 2, {}, ()),
]


@pytest.mark.parametrize("early", [True, False], ids=["direct-decisions", "ring-only-decisions"])
@pytest.mark.parametrize("mode,world,temp,top_p,top_k,draft,horizon,overrides,events", EXACT_CASES,
                         ids=[f"{c[0]}-w{c[1]}-T{c[2]}-p{c[3]}-k{c[4]}-{c[5]}-K{c[6]}" for c in EXACT_CASES])
def test_exact_law_every_mode(mode, world, temp, top_p, top_k, draft, horizon, overrides, events, early):
    """``early``: decisions prune in-flight work at once (the eagerest stage) or only when the ring brings them
    (the laziest): the law must be the target's either way."""
    if not early and mode in ("ar", "naive"):
        pytest.skip("nothing is in flight when ar/naive decide")
    tables = make_world(11, draft, 0.3 if temp < 1 else 1.5)   # T = 0.3 on flatter logits: still random
    sampler = BranchingSampler(temp, top_p, top_k, horizon)
    run = make_runner(mode, world, tables, sampler, horizon, overrides, early)
    law, runs = exact_law(run, sampler)
    ref = target_law(sampler, tables[0], horizon)
    assert_target_law(law, ref, mode)
    seen = dict(run.ring.events)
    print(mode, runs, seen, getattr(run.cont, "appended", None), len(law), len(ref))
    if run.cont is not None:
        seen["expand"] = run.cont.appended
        seen["fused"] = run.cont.fused
        seen["prefetched"] = run.cont.prefetched
        seen["early"] = run.cont.early_sent
        seen["whole"] = run.cont.whole_sent
    for e in events:
        if e == "EMPTY" and not early:
            continue   # without early pruning a stale result still carries its (dead) rows
        assert seen.get(e, 0) > 0, f"no {e} event before the horizon: {seen}"


@pytest.mark.parametrize("levels", [2, 0], ids=["incremental", "redraft"])
def test_expansion_off_appends_nothing_and_keeps_the_law(levels):
    """``tree.expand_total_token=0`` (continuous without dynamic expansion, docs/results.md §9's ablation): no node is
    appended after a verified step, rounds still continue through re-roots, and the law stays the target's;
    the same setting with expansion on does append (so the check can fail). Both expansion paths: incremental
    (``expand_levels > 0``) and the paper's redraft-and-merge (``expand_levels = 0``)."""
    tables = make_world(11, "target", 1.5)
    for budget, expect_growth in ((0, False), (5, True)):
        sampler = BranchingSampler(1.0, 1.0, 0, 3)
        run = make_runner("continuous", 3, tables, sampler, 3,
                          {"tree.expand_total_token": budget, "tree.expand_levels": levels})
        law, _ = exact_law(run, sampler)
        ref = target_law(sampler, tables[0], 3)
        assert max(abs(law.get(k, 0.0) - w) for k, w in ref.items()) < 1e-6
        assert (run.cont.appended > 0) == expect_growth, (budget, run.cont.appended)
        assert dict(run.ring.events).get("CONTINUE", 0) > 0


# Reduced draft vocabulary (EAGLE-3 d2t/t2d). Why verification stays lossless: the EAGLE tree is deterministic
# (top-k), so every child is a point-mass proposal and walk_tree never reads the draft's probabilities. At a node
# it draws the token from the target's p over the *whole target vocabulary* and descends into the child carrying
# it, if any (pipeline.verify, "Draw first"), so P(emit x) = p(x) for every x whatever the proposed set: tokens
# the draft gives zero mass (outside its vocabulary) are simply never proposed and keep their full target
# probability. (For a sampled draft, walk_proposals accepts with min(1, p/q) only
# at tokens drawn from q, where q > 0, and its residual max(0, p - q) equals p outside the draft vocabulary.)
# The planted bug below restricts the residual draw to the draft vocabulary: the law must then differ.
REDUCED_VOCAB = [0, 2, 3, 5, 6]


@pytest.mark.parametrize("mode,world,temp,draft,overrides", [
    ("naive", 3, 1.0, "target", {}),
    ("continuous", 3, 1.0, "random", {}),
    ("pruned", 3, 2.0, "target", {}),
    ("pipedec", 3, 1.0, "random", {}),
])
def test_exact_law_reduced_draft_vocabulary(mode, world, temp, draft, overrides):
    tables = make_world(11, draft)
    sampler = BranchingSampler(temp, 1.0, 0, 2)
    d = ReducedVocabDrafter(tables[1], REDUCED_VOCAB)
    run = make_runner(mode, world, tables, sampler, 2, overrides, drafter=d)
    law, _ = exact_law(run, sampler)
    assert_target_law(law, target_law(sampler, tables[0], 2), mode)
    assert any(x not in REDUCED_VOCAB for seq in law for x in seq), "tokens outside the draft vocabulary vanished"
    tree = d.grow_tree(ROOT, enc(ROOT), 7, 2, 3)
    assert set(tree.tokens[1:].tolist()) <= set(REDUCED_VOCAB)      # the draft proposes its vocabulary only


def test_residual_restricted_to_draft_vocabulary_fails_exact_law(monkeypatch):
    """Planted bug: a verifier that treats the draft vocabulary as the support of the target (masks the residual
    draw to it) is caught by the exact-law check."""
    from pipeline import verify
    real = verify.walk_tree
    outside = torch.tensor([t not in REDUCED_VOCAB for t in range(V)])

    class Masking:
        def __init__(self, s):
            self.s = s

        def __getattr__(self, name):
            return getattr(self.s, name)

        def draw(self, p):
            p = p.clone()
            p[outside] = 0.0
            return self.s.draw(p / p.sum())

        pick = draw                          # walk_tree's draw (pipeline.verify, "Draw first")

    def bad_walk(tree, n_verified, logits, sampler):
        return real(tree, n_verified, logits, Masking(sampler))

    monkeypatch.setattr("pipeline.modes.naive.walk_tree", bad_walk)
    tables = make_world(11, "target")
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    run = make_runner("naive", 3, tables, sampler, 2, {}, drafter=ReducedVocabDrafter(tables[1], REDUCED_VOCAB))
    law, _ = exact_law(run, sampler)
    assert total_variation(law, target_law(sampler, tables[0], 2)) > 0.02


# ---------------------------------------------------------------------------------------------------------------
# Broken verifiers (must be caught)
# ---------------------------------------------------------------------------------------------------------------

def _broken_walk(rule: str, draft_table: torch.Tensor):
    """``walk_tree`` with one classic mistake: ``no_renorm`` tries later siblings with the un-renormalised
    p(x); ``draft_ratio`` accepts with min(1, p'(x)/q(x)) using the draft's probability q (the rule for
    *sampled* drafts, wrong for a deterministic top-k tree)."""
    q_rows = torch.softmax(draft_table.double(), dim=-1)

    def walk(tree, n_verified, logits, sampler):
        if n_verified <= 0:
            return [], None, None
        path, cur = [0], 0
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        while True:
            children = [i for i, p in enumerate(parents) if p == cur]
            p = sampler.probs(logits[cur])
            child = None
            for c in children:
                t = tokens[c]
                a = float(p[t]) if rule == "no_renorm" else min(1.0, float(p[t]) / float(q_rows[tokens[cur], t]))
                if sampler.accept(a):
                    child = c
                    break
                p[t] = 0.0
                if rule != "no_renorm":
                    p = p / p.sum()
            x = tokens[child] if child is not None else sampler.draw(p / p.sum())
            if child is None:
                return path, x, None
            if child >= n_verified:
                return path, x, child
            path.append(child)
            cur = child
    return walk


@pytest.mark.parametrize("rule,mode", [("no_renorm", "naive"), ("draft_ratio", "continuous")])
def test_broken_verifier_fails_exact_law(monkeypatch, rule, mode):
    tables = make_world(11, "target")
    bad = _broken_walk(rule, tables[1])
    monkeypatch.setattr("pipeline.modes.naive.walk_tree", bad)
    monkeypatch.setattr("pipeline.modes.flowspec.walk_tree", bad)
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    law, _ = exact_law(make_runner(mode, 3, tables, sampler, 2, {}), sampler)
    assert total_variation(law, target_law(sampler, tables[0], 2)) > 0.02


DRAWN_LAW_MODES = ("continuous", "pruned", "continuous", "naive", "continuous", "pipedec", "continuous", "pruned",
                   "continuous", "pipedec")   # continuous, the mode with the most schedule keys, every other case


def drawn_law_case(i: int) -> tuple:
    """Case ``i`` of the drawn exact-law cases: a tree mode, a world, a sampling setting, a draft table and the
    ``tree.*`` keys of :data:`pipeline.tools.fuzz.SPACE` drawn as ``pipeline.tools.fuzz`` draws them (its trial
    ``i`` of seed 41 in the mode :data:`DRAWN_LAW_MODES` gives it, the cost-aware ``tree.budget`` left out), each
    capped to this small world's trees (at most 9 nodes a tree, 3 levels, 3 children): enumeration stays cheap,
    the combination is the fuzz's."""
    import random

    from pipeline.tools import fuzz
    t = fuzz.draw_trial(41, i, ["untrained"], 0.5, modes=(DRAWN_LAW_MODES[i],))
    rng = random.Random(f"law/{i}")
    cap = {"total_token": 9, "init_total_token": 9, "expand_total_token": 9, "depth": 3, "init_depth": 3,
           "expand_depth": 3, "top_k": 3, "init_topk": 3, "expand_topk": 3, "pipedec_topk": 3, "subseq_token": 4,
           "expand_subseq_token": 4, "early_whole": 4}
    over = {}
    for key, value in t.keys.items():
        if not key.startswith("tree.") or key == "tree.budget":
            continue
        name = key.split(".", 1)[1]
        if name in cap and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            value = min(value, cap[name])
        over[key] = value
    return (t.mode, rng.choice([3, 4]), rng.choice([0.3, 1.0, 2.0]), rng.choice([1.0, 0.9]),
            rng.choice(["random", "target", "onehot", "disjoint"]), rng.choice([2, 3]), over)


@pytest.mark.parametrize("i", range(len(DRAWN_LAW_MODES)))
def test_exact_law_drawn_combinations(i):
    """The exact law under combinations of tree and schedule keys drawn as ``pipeline.tools.fuzz`` draws them (the
    fuzz checks greedy answers; this checks the sampled law of the same kind of combination)."""
    mode, world, temp, top_p, draft, horizon, over = drawn_law_case(i)
    tables = make_world(11 + i, draft, 0.3 if temp < 1 else 1.5)
    sampler = BranchingSampler(temp, top_p, 0, horizon)
    law, _ = exact_law(make_runner(mode, world, tables, sampler, horizon, over, early=bool(i % 2)), sampler)
    assert_target_law(law, target_law(sampler, tables[0], horizon), f"case {i}: {mode} {over}")


def test_broken_verifier_fails_a_drawn_exact_law_case(monkeypatch):
    """The drawn cases can fail: the first drawn ``continuous`` case with the draft-ratio mistake of
    :func:`_broken_walk` is off the target's law."""
    i = 0                                                      # (a continuous case)
    mode, world, temp, top_p, draft, horizon, over = drawn_law_case(i)
    tables = make_world(11 + i, "target", 1.5)
    bad = _broken_walk("draft_ratio", tables[1])
    monkeypatch.setattr("pipeline.modes.flowspec.walk_tree", bad)
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    law, _ = exact_law(make_runner(mode, world, tables, sampler, 2, over), sampler)
    assert total_variation(law, target_law(sampler, tables[0], 2)) > 0.02


# ---------------------------------------------------------------------------------------------------------------
# 2. Chi-square with the real generator
# ---------------------------------------------------------------------------------------------------------------

def chi2_sf(stat: float, dof: int) -> float:
    """P(chi2_dof > stat) = Q(dof/2, stat/2), the regularised upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, dof: int) -> float:
    lo, hi = 0.0, dof + 100.0 * math.sqrt(2 * dof) + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, dof: int, lam: float) -> float:
    """Survival function of the noncentral chi-square (Poisson mixture of central ones)."""
    total, j = 0.0, 0
    while j < 1000:
        w = math.exp(-lam / 2 + j * math.log(lam / 2) - math.lgamma(j + 1)) if lam > 0 else float(j == 0)
        total += w * chi2_sf(x, dof + 2 * j)
        if j > lam / 2 + 10 and w < 1e-12:
            break
        j += 1
    return total


def chi_square_bins(law: dict, n: int, min_expected: float = 5.0) -> list[list]:
    """Cells with expected count >= ``min_expected``, the rest pooled into one bin (if it is big enough)."""
    cells = sorted(law, key=law.get, reverse=True)
    big = [[k] for k in cells if law[k] * n >= min_expected]
    small = [k for k in cells if law[k] * n < min_expected]
    if small:
        if sum(law[k] for k in small) * n >= min_expected:
            big.append(small)
        else:
            big[-1] = big[-1] + small
    return big


def chi_square_pvalue(counts: Counter, law: dict, n: int) -> float:
    if any(k not in law for k in counts):
        return 0.0                                   # a zero-probability sequence was emitted
    bins = chi_square_bins(law, n)
    stat = 0.0
    for cell in bins:
        e = n * sum(law[k] for k in cell)
        o = sum(counts.get(k, 0) for k in cell)
        stat += (o - e) ** 2 / e
    return chi2_sf(stat, len(bins) - 1)


def power_against_one_percent_tv(law: dict, n: int) -> float:
    """Power of the test at ALPHA against the least detectable 1%-TV deviation between two bins (1% of the
    mass moved between the two largest bins: lambda = n * d^2 * (1/p1 + 1/p2) is smallest there)."""
    bins = chi_square_bins(law, n)
    probs = sorted((sum(law[k] for k in cell) for cell in bins), reverse=True)
    lam = n * 0.01 ** 2 * (1 / probs[0] + 1 / probs[1])
    dof = len(bins) - 1
    return ncx2_sf(chi2_isf(ALPHA, dof), dof, lam)


class MemoSampler(Sampler):
    """The real sampler (generator, ``accept``, ``draw``), with ``probs`` computed once per logits row: the
    rows live in cached tensors, so a row is identified by its address. Only speed changes."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.memo: dict = {}

    def probs(self, logits):
        key = logits.data_ptr()
        if key not in self.memo:
            self.memo[key] = super().probs(logits)
        return self.memo[key].clone()


def monte_carlo(tables, sampler: Sampler, n: int, horizon: int, prefix: int | None, expand: bool,
                walker=walk_tree) -> Counter:
    """``n`` generations of ``horizon`` tokens from ROOT, verifying with ``walker``.

    ``prefix=None``: the naive pattern (whole tree verified; a fresh tree from every new token).
    ``prefix=k``: step-wise verification as in the lock-step modes: only nodes ``[0, k)`` are verified per
    step; ``new_root`` continues the tree (``keep_indices_for`` + ``reroot``), and with ``expand`` a tree
    drafted from the new root is merged below it (``merge_trees``) before the next step.
    """
    target, draft_logits = tables
    drafter = MarkovDrafter(draft_logits)
    cache: dict = {}

    def state(key):
        if key not in cache:
            if key[0] == "fresh":
                tree = drafter.grow_tree(key[1], enc(key[1]), 7, 2, 3)
            else:
                old = cache[key[0]][0]
                path, new_root = list(key[1]), key[2]
                tree = reroot(old, keep_indices_for(old, path, new_root), len(path))
                if expand:
                    tok = int(tree.tokens[0])
                    tree, _ = merge_trees(tree, drafter.grow_tree(tok, enc(tok), 5, 2, 2))
            cache[key] = (tree, target[tree.tokens].contiguous(), tree.tokens.tolist())
        return cache[key]

    counts: Counter = Counter()
    for _ in range(n):
        out, key = [], ("fresh", ROOT)
        while len(out) < horizon:
            tree, logits, toks = state(key)
            path, x, new_root = walker(tree, len(tree) if prefix is None else min(prefix, len(tree)), logits, sampler)
            out += [toks[i] for i in path[1:]] + [x]
            key = ("fresh", x) if new_root is None else (key, tuple(path), new_root)
        counts[tuple(out[:horizon])] += 1
    return counts


# (T, top_p, draft, logit scale, prefix, expand, n): the naive pattern, and the step-wise pattern with
# re-rooting + expansion. Flat-ish worlds: many small cells give the chi-square its power.
MC_CASES = [(2.0, 1.0, "random", 0.5, None, False, 15000), (1.0, 0.9, "target", 0.3, 2, True, 15000)]


@pytest.mark.parametrize("temp,top_p,draft,scale,prefix,expand,n", MC_CASES)
def test_chi_square_real_generator(temp, top_p, draft, scale, prefix, expand, n):
    tables = make_world(5, draft, scale)
    sampler = MemoSampler(temp, top_p, 0, torch.Generator().manual_seed(1234))
    law = target_law(sampler, tables[0], 2)
    assert power_against_one_percent_tv(law, n) > 0.9, "too few samples to detect a 1% deviation"
    counts = monte_carlo(tables, sampler, n, 2, prefix, expand)
    pval = chi_square_pvalue(counts, law, n)
    assert pval > ALPHA, f"chi-square p = {pval:.3g}"


@pytest.mark.parametrize("rule", ["draft_ratio"])  # no_renorm's bias is too small for 4000 samples in this
def test_broken_verifier_fails_chi_square(rule):     # world; the exact-law test above catches it instead
    tables = make_world(5, "random")
    sampler = MemoSampler(1.0, 1.0, 0, torch.Generator().manual_seed(99))
    law = target_law(sampler, tables[0], 2)
    counts = monte_carlo(tables, sampler, 4000, 2, 2, True, walker=_broken_walk(rule, tables[1]))
    assert chi_square_pvalue(counts, law, 4000) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# 3. End to end: seeded reproducibility, and ar == HF generate(do_sample=True)
# ---------------------------------------------------------------------------------------------------------------

ALL_MODES = "ar,naive,pruned,continuous,pipedec"
E2E_PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 43]]
E2E_NEW = 12


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """A tiny random float64 model split 0+2+2 (3 ranks), with the oracle drafter (draft = target, so trees
    are accepted deep), run twice through ``python -m pipeline.run`` at T = 1 with seed 7."""
    from model.split import split_checkpoint
    from tests.helpers import launch, read_jsonl, tiny_llama
    root = tmp_path_factory.mktemp("sampling_e2e")
    full = tiny_llama(root / "full", layers=4, dtype=torch.float64)
    stages = split_checkpoint(full, root / "stages", [0, 2, 2], progress=False)
    runs = []
    for i in range(2):
        out = root / f"seed7_{i}.jsonl"
        args = [f"model.stage_dir={stages}", "dtype=float64", f"max_new_tokens={E2E_NEW}", "comm.timeout_s=120",
                "temperature=1.0", "seed=7", f"head_dir=oracle:{full}", "--modes", ALL_MODES,
                "--output", str(out), "--quiet"]
        for p in E2E_PROMPTS:
            args += ["--prompt-ids", ",".join(map(str, p))]
        launch(3, args, timeout=900)
        runs.append(read_jsonl(out))
    return SimpleNamespace(full=full, stages=stages, runs=runs)


def _outputs(rows) -> dict[tuple[str, int], bytes]:
    return {(r["mode"], r["question_id"]): json.dumps(r["output_ids"]).encode() for r in rows}


_hf_models: dict = {}


def hf_sample(model_dir, prompt: list[int], seed: int, temperature: float, top_k: int, top_p: float) -> list[int]:
    """HF ``generate(do_sample=True)`` from the global RNG seeded like our per-generation generator."""
    from transformers import AutoModelForCausalLM
    key = str(model_dir)
    if key not in _hf_models:
        _hf_models[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = _hf_models[key].generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                       do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                       max_new_tokens=E2E_NEW, eos_token_id=[2], pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_seeded_runs_are_byte_identical_e2e(e2e):
    a, b = (_outputs(rows) for rows in e2e.runs)
    assert len(a) == 5 * len(E2E_PROMPTS) and set(a) == set(b)
    for key in sorted(a):
        assert a[key] == b[key], f"{key}: seed 7 gave {a[key]!r} then {b[key]!r}"


def test_ar_sampling_equals_hf_generate_e2e(e2e):
    """Same seed, same float32 processing, same multinomial draw: ar is HF's sampler token for token."""
    for r in e2e.runs[0]:
        if r["mode"] == "ar":
            assert r["output_ids"] == hf_sample(e2e.full, r["prompt_ids"], 7, 1.0, 0, 1.0), r["question_id"]


def test_threaded_ring_agrees_and_other_seed_differs(e2e):
    """The in-process ring (pipeline/inprocess.py) reproduces the launched seed-7 outputs exactly; seed 8
    changes some output. The seed-8 run takes the first prompt only (issue 43's suite cut): the claim is that the
    seed reaches the draws at all, which one prompt of every mode shows as well as two (before: the two prompts'
    outputs compared as one dict, so "some output differs" was never a per-prompt claim either)."""
    from pipeline.inprocess import run_threaded
    common = ["temperature=1.0", f"max_new_tokens={E2E_NEW}", "dtype=float64"]
    modes = ALL_MODES.split(",")
    launched = _outputs(e2e.runs[0])
    for seed, same, prompts in ((7, True, E2E_PROMPTS), (8, False, E2E_PROMPTS[:1])):
        res = run_threaded(e2e.stages, prompts, modes, [*common, f"seed={seed}"], {2}, f"oracle:{e2e.full}")
        got = {(m, i): json.dumps(r.output_ids).encode() for m, rows in res.items() for i, r in enumerate(rows)}
        want = {k: v for k, v in launched.items() if k[1] < len(prompts)}
        assert len(got) == len(want) == 5 * len(prompts) and (got == want) == same, f"seed {seed}"


def test_ar_processed_sampling_equals_hf_generate(e2e):
    """Temperature, top-k and top-p processing too: ar (through the in-process ring) matches HF exactly."""
    from pipeline.inprocess import run_threaded
    for temp, top_k, top_p, seed in ((0.7, 20, 0.9, 3), (2.0, 0, 0.8, 5)):
        res = run_threaded(e2e.stages, E2E_PROMPTS, ["ar"], [f"temperature={temp}", f"top_k_sampling={top_k}",
                           f"top_p={top_p}", f"seed={seed}", f"max_new_tokens={E2E_NEW}", "dtype=float64"], {2})
        for p, r in zip(E2E_PROMPTS, res["ar"]):
            assert r.output_ids == hf_sample(e2e.full, p, seed, temp, top_k, top_p), (temp, top_k, top_p)


# ---------------------------------------------------------------------------------------------------------------
# 4. Online learning (draft/osd.py): the drafter's weights change between rounds, the law does not
# ---------------------------------------------------------------------------------------------------------------

class _TableHead(torch.nn.Module):
    """The Markov draft's "weights": one [V, V] logits table (what OnlineDrafter swaps)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(1, 1)          # unused; OnlineDrafter only swaps named parameters
        self.table = torch.nn.Parameter(table.clone().float(), requires_grad=False)


class SwappableMarkovDrafter(MarkovDrafter):
    """A MarkovDrafter whose table lives in ``head`` (so OnlineDrafter can swap it); no tree memo."""

    def __init__(self, draft_logits: torch.Tensor) -> None:
        super().__init__(draft_logits)
        self.head = _TableHead(draft_logits)

    def logprobs(self, hidden):
        return torch.log_softmax(self.head.table, dim=-1)[hidden[..., 0].long()]

    def reset(self) -> None:
        self.n_tree = 0

    def grow_tree(self, root_token, root_hidden, total_token, depth, top_k):
        return BeamTreeDrafter.grow_tree(self, root_token, root_hidden, total_token, depth, top_k)


def _draft_tables(seed: int, k: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(V, V, generator=g) * 2.0 for _ in range(k)]


def make_online_runner(mode: str, world: int, target: torch.Tensor, tables: list[torch.Tensor], sampler: Sampler,
                       horizon: int, overrides: dict, swap_at: str = "commit"):
    """``make_runner`` with the drafter wrapped in ``draft.osd.OnlineDrafter``: at every commit a new table is
    published, chosen by the committed history (so enumeration replays are consistent), and swapped in by that
    commit (``swap_at=commit``): every round after the first drafts with other weights."""
    from draft.osd import OnlineDrafter, OsdSettings
    live = getattr(sampler, "live", lambda: True)
    decode = ContinuousMode().decode if mode == "continuous" else MODES[mode][0]
    ring = FakeRing(world, MODES[mode][1], live, True)
    od = OnlineDrafter(SwappableMarkovDrafter(tables[0]), None, OsdSettings(swap_at=swap_at), learn=False)
    inner_commit = od.commit
    seen: list[int] = []

    def commit(tokens, features):   # published before the commit: swapped in by this very commit
        seen.extend(int(t) for t in tokens.reshape(-1).tolist())
        od.publish({"table": tables[(sum(seen) + len(seen)) % len(tables)]})
        return inner_commit(tokens, features)
    od.commit = commit
    engine = SimpleNamespace(comm=ring, gen=1, cfg=apply_overrides(DEFAULT, {**TREE, **overrides}), drafter=od,
                             tracer=SimpleNamespace(span=lambda *a, **k: nullcontext()),
                             observe_step=lambda *a: None, logits=lambda hidden: target[hidden[:, 0].long()])
    first = torch.full((V,), -1e9)
    first[ROOT] = 0.0

    def run() -> tuple[int, ...]:
        ring.reset()
        seen.clear()
        od.publish({"table": tables[0]})      # every run starts from the same weights
        out = OutputBuffer(set(), horizon + 1, sampler=sampler)
        decode(engine, first, None, [ROOT], out)
        assert out.finished and out.ids[0] == ROOT and len(out.ids) == horizon + 1
        return tuple(out.ids[1:])

    run.od = od
    return run


@pytest.mark.parametrize("mode,world,temp,top_p,horizon", [("naive", 3, 1.0, 1.0, 2), ("continuous", 3, 1.0, 0.9, 2),
                                                           ("pruned", 3, 2.0, 1.0, 2)])
def test_exact_law_with_a_drafter_that_changes_between_rounds(mode, world, temp, top_p, horizon):
    target = make_world(11, "random", 1.5)[0]
    sampler = BranchingSampler(temp, top_p, 0, horizon)
    run = make_online_runner(mode, world, target, _draft_tables(4), sampler, horizon, {})
    law, runs = exact_law(run, sampler)
    assert run.od.swaps > runs, "the head did not change between rounds"
    assert_target_law(law, target_law(sampler, target, horizon), mode)


def test_broken_verifier_fails_exact_law_with_a_changing_drafter(monkeypatch):
    target = make_world(11, "target")[0]
    tables = [target.clone()] + _draft_tables(4, 2)
    bad = _broken_walk("no_renorm", tables[0])
    monkeypatch.setattr("pipeline.modes.naive.walk_tree", bad)
    sampler = BranchingSampler(1.0, 1.0, 0, 2)
    law, _ = exact_law(make_online_runner("naive", 3, target, tables, sampler, 2, {}), sampler)
    assert total_variation(law, target_law(sampler, target, 2)) > 0.02


def monte_carlo_changing(target, tables, sampler: Sampler, n: int, horizon: int, walker=walk_tree) -> Counter:
    """The naive pattern with the real generator, the draft table switching after every round as a function of
    the committed history (trees built by the real EAGLE-2 search, cached per (table, root))."""
    drafters = [MarkovDrafter(t) for t in tables]
    cache: dict = {}
    counts: Counter = Counter()
    for _ in range(n):
        out, x = [], ROOT
        while len(out) < horizon:
            k = (sum(out) + len(out)) % len(tables)
            if (k, x) not in cache:
                tree = drafters[k].grow_tree(x, enc(x), 7, 2, 3)
                cache[(k, x)] = (tree, target[tree.tokens].contiguous(), tree.tokens.tolist())
            tree, logits, toks = cache[(k, x)]
            path, x, _ = walker(tree, len(tree), logits, sampler)
            out += [toks[i] for i in path[1:]] + [x]
        counts[tuple(out[:horizon])] += 1
    return counts


def test_chi_square_with_a_drafter_that_changes_between_rounds():
    target = make_world(5, "random", 0.5)[0]
    tables = _draft_tables(6)
    sampler = MemoSampler(2.0, 1.0, 0, torch.Generator().manual_seed(4321))
    law = target_law(sampler, target, 2)
    n = 15000
    assert power_against_one_percent_tv(law, n) > 0.9
    pval = chi_square_pvalue(monte_carlo_changing(target, tables, sampler, n, 2), law, n)
    assert pval > ALPHA, f"chi-square p = {pval:.3g}"
    bad = monte_carlo_changing(target, tables, MemoSampler(1.0, 1.0, 0, torch.Generator().manual_seed(99)), 4000, 2,
                               walker=_broken_walk("draft_ratio", tables[0]))
    assert chi_square_pvalue(bad, target_law(MemoSampler(1.0, 1.0, 0, None), target, 2), 4000) < 1e-6
