"""Online speculative decoding (OSD): the draft models keep learning from the traffic rank 0 serves.

:class:`OnlineDrafter` wraps rank 0's drafter (:class:`draft.drafter.Drafter`, the EAGLE head; or a small draft LM,
or a merged drafter: every model :func:`learnable_slots` finds gets a learner, :class:`Learner` for the head,
:class:`SmallLMLearner` for a small LM; what follows says "head" for either) and implements
every method the modes call (:class:`draft.protocol.TreeDrafter`, plus ``grow_tree_with_inputs``,
``extend_tree``, ``top_tokens``, ``supports_extend``, ``tree_size``, ``head``, ``cache``), delegating each one
explicitly. It never changes what the modes do: a drafter only proposes, verification is lossless for *any* proposal, so
greedy output stays token-identical to HF and sampling keeps the target's law whatever the weights are
(``tests/test_osd.py``, ``tests/test_sampling.py``).

Data flow (all on rank 0):

1. **Collect.** ``start(prompt, first, features)`` and every ``commit(tokens, features)`` already hand the
   drafter the committed tokens and the target's features at them. The wrapper copies them into the current
   request's :class:`Record` (entry ``j`` = ``(token[j+1], f_j)``, as in the draft cache). When the next
   request starts (or :meth:`OnlineDrafter.flush`), the record enters the bounded :class:`ReplayBuffer`
   (FIFO eviction of whole requests beyond ``osd.buffer_tokens`` entries). The teacher distribution at entry
   ``j`` is the target's ``softmax(lm_head(f_{j+1}))`` (temperature 1, no top-p: the raw model), kept as its
   **top-``osd.teacher_topk`` log-probabilities plus the tail mass** (:func:`teacher_topk`). It is computed by
   the learner, off the decode path, with rank 0's own ``lm_head``; the decode path only copies tensors.
2. **Learn** in a background thread (torch releases the GIL; ``osd.sync=true`` runs the same update inline
   at the request boundary, deterministic, for tests and measurements on small hosts). The learner distils a
   float32 copy of the head (``embed_tokens`` and ``lm_head`` frozen and shared) with ``osd.loss``
   (:func:`divergence`: ``fkl`` KL(p||q), ``rkl`` KL(q||p), ``jsd`` generalised JSD with ``osd.jsd_beta``),
   on rows chosen by ``osd.sample_source`` (:func:`rollout_levels`), plus ``osd.feature_weight`` x EAGLE's
   SmoothL1 feature regression (the head consumes its own features deeper in the tree).
3. **Gate** (:func:`should_update`, :func:`should_publish`): an update is attempted only when at least
   ``osd.update_interval`` new generated tokens arrived since the last attempt and the learner's busy share of
   wall time is at most ``osd.max_busy``; the candidate replaces the live weights only when its held-out
   agreement with the target (the newest ``osd.holdout`` requests, never trained on before this test) beats
   the live weights' by at least ``osd.min_gain``. A rejected candidate keeps training (``osd.on_reject=keep``)
   or is dropped, the next one starting again from the live weights (``restart``).
4. **Swap** (double buffer): the learner publishes a snapshot (version ``v``); the serving thread copies it
   into the live head *only* at ``OnlineDrafter.start`` (``osd.swap_at=generation``: before the new prompt's
   entries are fed, so one request is drafted by one version) or, with ``osd.swap_at=commit``, at the top of
   ``commit`` (a round boundary: the draft cache is rebuilt from the recorded context with the new weights,
   then the commit proceeds). Nothing else ever writes the live weights.
5. **Rollback** (:func:`rollback_due`): after ``osd.window`` finished requests on a new version, if their mean
   τ (tokens per commit, the drafter's measured acceptance) fell below ``(1 - osd.rollback_tol)`` x the mean τ
   of the previous version's last ``osd.window`` requests, the previous weights are restored (live and
   learner). **Floor**: at every update the learner also scores the shipped head on the held-out requests;
   when the shipped head agrees better than both live and candidate by ``osd.min_gain``, the shipped weights
   are published again (the learner restarts from them).

**Lanes** (``serve.max_active`` > 1, ``pipeline/lanes.py``): refused, with one line, when the configuration is
read (``config.run_config``: ``osd.enabled`` with ``serve.max_active`` > 1 is a ``ConfigError``; before this rule
the refusal came only from ``pipeline.lanes.fork_drafter`` once the server had warmed up and opened its HTTP
port, a ``LaneError`` while requests could already be arriving). Why not per lane: a lane's drafter is a deep
copy that shares the head's modules (``fork_drafter``), so each lane would get its own learner thread, replay
buffer and staged swap, all writing the *one* shared live head: a swap made at one lane's request boundary or
round boundary would change the weights another lane is drafting with in the middle of its request, its draft
cache computed with the old ones (``swap_at=generation``'s "one request is drafted by one version" broken, and
``swap_at=commit``'s rebuild done in the swapping lane only); and the rollback rule compares τ per version over
the last ``osd.window`` *finished requests*, which interleaved lanes attribute to whichever version was live
when each ended. Lossless verification would keep every output exact, but the learning's own guarantees would
not hold. What it would take: one learner and one replay buffer behind a lock (each lane's :class:`Record` filed
when its request ends), and per-lane live weights (a copy of the head per lane, swapped in at that lane's own
boundary: ``serve.max_active`` copies of the head's weights) with the version recorded per request, so that
rollback's windows count requests by the version that drafted them.

Versions: 0 = the weights loaded at start (the shipped head); every publication gets the next integer (a
rollback returns to the older number). :meth:`OnlineDrafter.row_fields` is what ``pipeline.run`` writes on
every output row. :meth:`OnlineDrafter.save` writes the live head in the shipped EAGLE layout
(:func:`draft.eagle.save_eagle_head`), loadable as ``model.head_dir``; ``osd.save_dir`` does it at exit.
"""
from __future__ import annotations

import copy
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from config.run_config import OsdConfig
from draft.protocol import forget_requests, grow_tree_deferred, top_tokens

Tensor = torch.Tensor

LOSSES = ("fkl", "rkl", "jsd")
SOURCES = ("teacher", "student", "mix_token", "mix_request")
SWAP_POINTS = ("generation", "commit")


# ---------------------------------------------------------------------------------------------------------
# Pure functions: teacher top-k, bucketed divergences, gate and rollback rules
# ---------------------------------------------------------------------------------------------------------

def teacher_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The teacher's top-``k`` tokens and the ``k + 1`` bucket log-probabilities ``[..., k + 1]``.

    Buckets: the ``k`` most likely tokens (descending) and "everything else" (last column, its total mass).
    Invariant: ``logsumexp`` of the buckets is 0 up to float error (a distribution)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, logp.shape[-1])
    top, idx = torch.topk(logp, k, dim=-1)
    tail = torch.logsumexp(logp.scatter(-1, idx, float("-inf")), dim=-1, keepdim=True)   # exact, even when tiny
    return idx, torch.cat([top, tail], dim=-1)


def student_buckets(student_logits: Tensor, idx: Tensor) -> Tensor:
    """The student's log-probabilities on the teacher's buckets (``idx``: the teacher's top-k tokens)."""
    logp = torch.log_softmax(student_logits.float(), dim=-1)
    top = logp.gather(-1, idx)
    rest = logp.scatter(-1, idx, float("-inf"))
    return torch.cat([top, torch.logsumexp(rest, dim=-1, keepdim=True)], dim=-1)


def _kl(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """KL(a || b) per row from log-probabilities (terms with a = 0 contribute 0)."""
    pa = logp_a.exp()
    diff = torch.where(pa > 0, logp_a - logp_b, torch.zeros_like(logp_a))
    return (pa * diff).sum(-1)


def divergence(teacher_logp: Tensor, student_logp: Tensor, kind: str, beta: float = 0.5) -> Tensor:
    """Per-row divergence between the teacher's p and the student's q (both as bucket log-probabilities).

    ``fkl``: KL(p || q) (OSD's forward KL; same gradient as its soft cross-entropy). ``rkl``: KL(q || p).
    ``jsd``: the generalised Jensen-Shannon divergence of GKD/OSD, ``beta KL(p || m) + (1 - beta) KL(q || m)``
    with ``m = beta p + (1 - beta) q`` (``beta = 0.5``: the symmetric JSD). Invariants: every value >= 0, and 0
    exactly when p = q on the buckets. (OSD's offline trainer labels ``0.9 FKL + 0.1 RKL`` as "jsd"; this is
    the paper's definition.)"""
    if kind == "fkl":
        return _kl(teacher_logp, student_logp)
    if kind == "rkl":
        return _kl(student_logp, teacher_logp)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
        m = torch.logsumexp(torch.stack([teacher_logp + math.log(beta), student_logp + math.log(1 - beta)]), 0)
        return beta * _kl(teacher_logp, m) + (1 - beta) * _kl(student_logp, m)
    raise ValueError(f"unknown loss {kind!r}; choose one of {', '.join(LOSSES)}")


def should_update(new_tokens: int, interval: int, busy_s: float, wall_s: float, max_busy: float) -> bool:
    """The cost gate before spending compute: enough new data (``new_tokens >= interval``) and the learner's
    busy share of wall time so far at most ``max_busy`` (``wall_s <= 0``: no time has passed, allowed)."""
    if new_tokens < interval:
        return False
    return wall_s <= 0 or busy_s <= max_busy * wall_s


def should_publish(candidate_acc: float, live_acc: float, min_gain: float) -> bool:
    """The gate after training: the candidate replaces the live weights only if its held-out agreement with the
    target beats the live weights' by at least ``min_gain`` (a swap is never free: ties keep the live weights)."""
    return candidate_acc - live_acc >= min_gain and candidate_acc > live_acc


def rollback_due(new_taus: list[float], prev_taus: list[float], window: int, tol: float) -> bool | None:
    """After a swap: ``None`` while the new version has fewer than ``window`` finished requests (or the
    previous one has none); else True when the new version's mean τ over its first ``window`` requests is
    below ``(1 - tol)`` x the previous version's mean τ over its last ``window`` requests."""
    if len(new_taus) < window or not prev_taus:
        return None
    new = sum(new_taus[:window]) / window
    prev = prev_taus[-window:]
    return new < (1.0 - tol) * (sum(prev) / len(prev))


def rollout_levels(source: str, levels: int, mix_ratio: float, rng: random.Random) -> tuple[int, bool]:
    """``(levels to train, mix tokens)`` for one request under ``osd.sample_source``.

    Teacher labels exist only along the committed path (the target's features at the committed tokens), so a
    sample source here decides *whose states* the head learns from on that path:

    * ``teacher``: teacher forcing: every entry fed the target's own feature (what the depth-1 draft sees);
    * ``student``: the head's own rollout along the committed tokens: level ``l`` (depth ``l + 1`` in a draft
      tree) is fed the head's own predicted feature of level ``l - 1``, as the tree's deeper nodes are;
      all ``levels`` are trained;
    * ``mix_request``: per request, ``student`` with probability ``mix_ratio``, else ``teacher``;
    * ``mix_token``: all levels, but each row's input feature at levels >= 1 comes from the student with
      probability ``mix_ratio``, else from the target (per token).
    """
    if source == "teacher":
        return 1, False
    if source == "student":
        return levels, False
    if source == "mix_request":
        return (levels if rng.random() < mix_ratio else 1), False
    if source == "mix_token":
        return levels, True
    raise ValueError(f"unknown sample_source {source!r}; choose one of {', '.join(SOURCES)}")


def rollout_mask(n: int, level: int, device=None) -> tuple[Tensor, Tensor]:
    """Attention mask (bool, True = may attend) and positions of ``level + 1`` stacked copies of ``n`` entries.

    Row ``(l, t)`` (copy ``l``, entry ``t``) sits at position ``t``; copy 0 is causal teacher forcing; a row of
    copy ``l >= 1`` is the depth-``l + 1`` draft of chain origin ``o = t - l``: it sees the context entries
    ``0..o`` and the chain's rows ``(m, o + m)`` for ``m = 1..l`` (itself included), exactly what a tree node
    sees in the draft cache. Rows with ``t < l`` have no origin and see only themselves (never trained)."""
    L = level + 1
    i = torch.arange(n, device=device)
    mask = torch.zeros(L * n, L * n, dtype=torch.bool, device=device)
    mask[:n, :n] = i[:, None] >= i[None, :]
    for l in range(1, L):
        rows = slice(l * n, (l + 1) * n)
        origin = i - l
        mask[rows, :n] = i[None, :] <= origin[:, None]
        for m in range(1, l + 1):
            col = origin + m
            ok = origin >= 0
            mask[l * n + i[ok], m * n + col[ok]] = True
        mask[l * n + i, l * n + i] = True
    return mask, i.repeat(L)


# ---------------------------------------------------------------------------------------------------------
# Replay buffer
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Record:
    """One served request. Entry ``j`` = ``(tokens[j], features[j])`` as in the draft cache (``tokens[j]`` is
    the token at position ``j + 1``, ``features[j]`` the target feature at ``j``); entries ``j >= first_gen``
    predict generated tokens. ``teacher`` (filled by the learner): top-k ids and bucket log-probs for entries
    ``0..n-2`` (entry ``j``'s label is ``lm_head(features[j + 1])``)."""

    tokens: Tensor
    features: Tensor
    first_gen: int
    taus: list = field(default_factory=list)
    first_id: int = 0            # the prompt's first token (position 0, before entry 0's token)
    version: int = 0
    teacher: tuple | None = None

    @property
    def n(self) -> int:
        return int(self.tokens.numel())

    @property
    def generated(self) -> int:
        return max(0, self.n - 1 - self.first_gen)


class ReplayBuffer:
    """Bounded FIFO of whole requests. Invariant: after :meth:`add`, the entries held sum to at most
    ``capacity`` unless a single request is larger (then only that request is kept). Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: deque[Record] = deque()
        self.entries = 0
        self.generated = 0         # generated tokens added in all
        self.marks: dict = {}      # consumer -> ``generated`` at its last take_new()
        self.added = 0
        self.lock = threading.Lock()

    def add(self, rec: Record) -> None:
        with self.lock:
            self.records.append(rec)
            self.entries += rec.n
            self.generated += rec.generated
            self.added += 1
            while self.entries > self.capacity and len(self.records) > 1:
                self.entries -= self.records.popleft().n

    def snapshot(self) -> list[Record]:
        with self.lock:
            return list(self.records)

    def take_new(self, consumer=None) -> int:
        """Generated tokens added since ``consumer``'s last call (each learner counts its own)."""
        with self.lock:
            n = self.generated - self.marks.get(consumer, 0)
            self.marks[consumer] = self.generated
            return n

    def peek_new(self, consumer=None) -> int:
        with self.lock:
            return self.generated - self.marks.get(consumer, 0)


# ---------------------------------------------------------------------------------------------------------
# Settings (from config.run_config's OsdConfig, or built directly in tests)
# ---------------------------------------------------------------------------------------------------------

@dataclass
class OsdSettings(OsdConfig):
    """The learner's knobs: the ``osd.*`` configuration (``config.run_config.OsdConfig``: meanings and defaults
    there) plus the learner's random seed."""

    seed: int = 0

    @classmethod
    def from_config(cls, osd: OsdConfig) -> "OsdSettings":
        return cls(**{f.name: getattr(osd, f.name) for f in fields(OsdConfig)})


# ---------------------------------------------------------------------------------------------------------
# The learner
# ---------------------------------------------------------------------------------------------------------

FROZEN = ("embed_tokens", "lm_head")   # shared with the target (or the student's own vocabulary): never learned


def _frozen(name: str) -> bool:
    return any(part in FROZEN for part in name.split("."))


def head_state(head) -> dict[str, Tensor]:
    """The swapped weights (everything but the frozen embedding and ``lm_head``), cloned to the host."""
    return {n: q.detach().to("cpu", copy=True) for n, q in head.named_parameters() if not _frozen(n)}


@torch.no_grad()
def load_head_state(head, state: dict[str, Tensor]) -> None:
    params = dict(head.named_parameters())
    for n, v in state.items():
        params[n].copy_(v.to(params[n].device, params[n].dtype))


class Learner:
    """Distils a float32 copy of the EAGLE head on the replay buffer; publishes snapshots through ``publish``.

    ``publish(state, reason) -> version`` is :meth:`OnlineDrafter.publish` for this learner's slot. Runs as a
    daemon thread (:meth:`start_thread`) or inline (:meth:`maybe_update`, ``osd.sync``). What depends on the
    student is in four methods (:meth:`_make_net`, :meth:`_levels`, :meth:`_forward`, :meth:`_logits`);
    :class:`SmallLMLearner` overrides them for a small draft LM."""

    regress_features = True      # EAGLE's SmoothL1 feature term (osd.feature_weight) applies to this student

    def __init__(self, head, lm_head, buffer: ReplayBuffer, settings: OsdSettings, publish) -> None:
        s = self.s = settings
        p = next(head.parameters())
        self.device = p.device
        self.dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        self.net = self._make_net(head)
        self.shipped = head_state(head)
        load_head_state(self.net, self.shipped)
        self.live = self.shipped                                   # what the serving head holds (or will)
        self.lm_w = lm_head.weight.detach()
        self.buffer, self.publish = buffer, publish
        self.rng = random.Random(s.seed)
        self.gen = torch.Generator(device="cpu").manual_seed(s.seed)
        self._new_opt()
        self.busy_s, self.updates, self.published, self.floor_restores = 0.0, 0, 0, 0
        self.last: dict = {}
        self.log: list[dict] = []
        self.lock = threading.Lock()
        self._reset_to: dict | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.t_start = time.perf_counter()
        self.error: BaseException | None = None

    def _make_net(self, head):
        """The trainable copy: a new head in ``self.dtype`` that shares the live head's frozen embedding."""
        from draft.eagle import EagleHead
        net = EagleHead(head.config, bias=head.fc.bias is not None)
        net.embed_tokens = head.embed_tokens                      # shared, frozen
        for q in net.embed_tokens.parameters():
            q.requires_grad_(False)
        net = net.to(self.device)
        for n, q in net.named_parameters():
            if not _frozen(n):
                q.data = q.data.to(self.dtype)
        return net

    def _levels(self) -> tuple[int, bool]:
        """(levels, mix tokens) for one request: :func:`rollout_levels` of ``osd.sample_source``."""
        return rollout_levels(self.s.sample_source, self.s.rollout, self.s.mix_ratio, self.rng)

    def _logits(self, pred: Tensor) -> Tensor:
        """Next-token logits (float32) of predicted states: the target's ``lm_head`` on the head's features."""
        return F.linear(pred.to(self.lm_w.dtype), self.lm_w).float()

    def _new_opt(self) -> None:
        params = [q for n, q in self.net.named_parameters() if not _frozen(n)]
        self.opt = torch.optim.AdamW(params, lr=self.s.lr, betas=(0.9, 0.95), weight_decay=0.0)

    # -- thread control --------------------------------------------------------------------------------
    def start_thread(self) -> None:
        self.thread = threading.Thread(target=self._loop, daemon=True, name="osd-learner")
        self.thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread is not None:
            self.thread.join(timeout=120)

    def reset_to(self, state: dict) -> None:
        """Called by the serving thread on a rollback: the learner continues from ``state``."""
        with self.lock:
            self._reset_to = state

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                if self._stop.is_set():
                    break
                self.maybe_update()
        except BaseException as e:  # surfaced in row_fields / close; serving goes on with the live weights
            self.error = e

    # -- one update ------------------------------------------------------------------------------------
    def maybe_update(self) -> bool:
        """Run one update if the gate allows; returns whether a new version was published."""
        with self.lock:
            reset, self._reset_to = self._reset_to, None
        if reset is not None:
            load_head_state(self.net, reset)
            self.live = reset
            self._new_opt()
        recs = self.buffer.snapshot()
        if len(recs) <= self.s.holdout:
            return False
        wall = time.perf_counter() - self.t_start if self.thread is not None else 0.0
        if not should_update(self.buffer.peek_new(self), self.s.update_interval, self.busy_s, wall, self.s.max_busy):
            return False
        new = self.buffer.take_new(self)
        t0 = time.perf_counter()
        try:
            return self._update(recs, new)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _update(self, recs: list[Record], new_tokens: int) -> bool:
        s = self.s
        for r in recs:
            self._ensure_teacher(r)
        hold, train = recs[-s.holdout:], recs[:-s.holdout]
        train = [r for r in train if self._labelled(r)] or train
        live_acc = self._with_weights(self.live, lambda: self.evaluate(hold))
        shipped_acc = (live_acc if self.live is self.shipped else
                       self._with_weights(self.shipped, lambda: self.evaluate(hold)))
        losses = []
        for _ in range(s.steps):
            batch = self._pick(train)
            losses.append(self.train_step(batch))
        cand_acc = self.evaluate(hold)
        self.updates += 1
        version, reason = None, ""
        if should_publish(cand_acc, live_acc, s.min_gain):
            reason = "gain"
            self.live = head_state(self.net)
        elif shipped_acc - max(live_acc, cand_acc) >= max(s.min_gain, 1e-9) and self.live is not self.shipped:
            reason = "floor"
            self.floor_restores += 1
            self.live = self.shipped
            load_head_state(self.net, self.shipped)
            self._new_opt()
        elif s.on_reject == "restart":     # the rejected candidate is dropped: the next one starts from live
            load_head_state(self.net, self.live)
            self._new_opt()
        if reason:
            version = self.publish(self.live, reason)
            self.published += 1
        self.last = {"update": self.updates, "new_tokens": new_tokens, "loss": sum(losses) / max(1, len(losses)),
                     "live_acc": round(live_acc, 4), "cand_acc": round(cand_acc, 4),
                     "shipped_acc": round(shipped_acc, 4), "published": version, "reason": reason or "rejected"}
        self.log.append(dict(self.last))
        return version is not None

    def _labelled(self, r: Record) -> bool:
        return r.n >= 2 and (self.s.train_prompt or r.generated > 0)

    def _with_weights(self, state: dict, fn):
        keep = head_state(self.net)
        load_head_state(self.net, state)
        try:
            return fn()
        finally:
            load_head_state(self.net, keep)

    def _pick(self, recs: list[Record]) -> list[Record]:
        """Requests for one step: a random order, taken until ``batch_tokens`` entries (at least one)."""
        order = list(recs)
        self.rng.shuffle(order)
        out, total = [], 0
        for r in order:
            if out and total + r.n > self.s.batch_tokens:
                continue
            out.append(r)
            total += r.n
            if total >= self.s.batch_tokens:
                break
        return out

    @torch.no_grad()
    def _ensure_teacher(self, r: Record) -> None:
        if r.teacher is not None or r.n < 2:
            return
        f = r.features[1:].to(self.device, self.lm_w.dtype)
        logits = F.linear(f, self.lm_w)
        r.teacher = teacher_topk(logits, self.s.teacher_topk)

    # -- forward over one request ----------------------------------------------------------------------
    def _forward(self, r: Record, levels: int, mix_token: bool, grad: bool) -> list[tuple[int, Tensor]]:
        """Outputs per level: ``[(level, pred [n, H])]``; level ``l`` row ``t`` predicts ``f_{t+1}``."""
        from draft.train.objective import head_forward
        n = r.n
        toks = r.tokens.to(self.device).view(1, n)
        feats = r.features.to(self.device, self.dtype).view(1, n, -1)
        with torch.set_grad_enabled(grad and levels <= 1):
            pred0 = head_forward(self.net, toks, feats)[0]
        if levels <= 1:
            return [(0, pred0)]
        in_feats = [feats[0]]
        prev = pred0.detach()
        outs: list = []
        for lvl in range(1, levels):
            shifted = torch.cat([torch.zeros_like(prev[:1]), prev[:-1]])     # row t gets level-(l-1) row t-1
            if mix_token:
                keep = torch.rand(n, generator=self.gen) < self.s.mix_ratio    # True: the student's own
                shifted = torch.where(keep.to(self.device)[:, None], shifted, feats[0])
            in_feats.append(shifted.to(self.dtype))
            mask, pos = rollout_mask(n, lvl, self.device)
            with torch.set_grad_enabled(grad and lvl == levels - 1):
                out = head_forward(self.net, toks.repeat(1, lvl + 1), torch.cat(in_feats)[None], pos[None],
                                   mask[None, None])[0]
            prev = out[lvl * n:].detach()
            if lvl == levels - 1:
                outs = [(m, out[m * n:(m + 1) * n]) for m in range(lvl + 1)]
        return outs

    def _rows(self, r: Record, level: int) -> Tensor:
        """Trained rows of a level: entries with a label (``t <= n - 2``), an origin (``t >= level``) and in
        the generated region unless ``osd.train_prompt``."""
        lo = max(level, 0 if self.s.train_prompt else r.first_gen)
        return torch.arange(lo, r.n - 1, device=self.device)

    def train_step(self, batch: list[Record]) -> float:
        s = self.s
        self.net.train()
        count = 0
        self.opt.zero_grad(set_to_none=True)
        terms = []
        for r in batch:
            levels, mix = self._levels()
            idx, tlp = r.teacher
            for lvl, pred in self._forward(r, levels, mix, grad=True):
                rows = self._rows(r, lvl)
                if rows.numel() == 0:
                    continue
                p = pred[rows]
                sb = student_buckets(self._logits(p), idx[rows].to(self.device))
                div = divergence(tlp[rows].to(self.device), sb, s.loss, s.jsd_beta)
                term = div.sum()
                if s.feature_weight and self.regress_features:
                    tf = r.features[1:].to(self.device, self.dtype)[rows]
                    term = term + s.feature_weight * F.smooth_l1_loss(p, tf, reduction="none").mean(-1).sum()
                terms.append(term)
                count += rows.numel()
        if not terms:
            return 0.0
        loss = torch.stack(terms).sum() / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in self.net.parameters() if q.requires_grad], 0.5)
        self.opt.step()
        self.net.eval()
        return float(loss.detach())

    def _levels_max(self) -> int:
        """The most levels :meth:`_levels` trains (evaluation scores at most two of them)."""
        return self.s.rollout

    @torch.no_grad()
    def evaluate(self, recs: list[Record]) -> float:
        """Held-out agreement: share of labelled rows where the head's top-1 equals the target's, averaged over
        the depth-1 (teacher-forced) and depth-2 (own feature) drafts (depth 1 only when ``osd.rollout=1``)."""
        self.net.eval()
        hits, tot = [0.0, 0.0], [0, 0]
        for r in recs:
            if r.teacher is None or r.n < 2:
                continue
            idx, _ = r.teacher
            for lvl, pred in self._forward(r, min(2, self._levels_max()), False, grad=False):
                rows = self._rows(r, lvl)
                if rows.numel() == 0:
                    continue
                top1 = self._logits(pred[rows]).argmax(-1)
                hits[lvl] += float((top1 == idx[rows, 0].to(self.device)).sum())
                tot[lvl] += rows.numel()
        accs = [h / t for h, t in zip(hits, tot) if t]
        return sum(accs) / len(accs) if accs else 0.0


class SmallLMLearner(Learner):
    """Distils a small draft LM (:class:`draft.ssm.SmallLMDrafter`'s ``model``, e.g. a shipped student) on the
    same replay buffer, teacher and gates as the head: its logits after the committed tokens ``0..j+1`` against
    the target's distribution at entry ``j`` (the next committed token's law).

    Its inputs are tokens only, so the committed path has no student states to roll out: every sample source
    trains it teacher-forced (``osd.sample_source`` shapes the EAGLE head's rows; OSD's on-policy "student" data
    would need the target's labels at the student's own drafts, which only the verified tree nodes carry).
    The embedding and ``lm_head`` stay frozen (a shared-vocabulary student holds the target's)."""

    regress_features = False

    def _make_net(self, model):
        """A deep copy in ``self.dtype`` whose frozen embedding / ``lm_head`` are shared with the live model
        when they already have that dtype (a shipped student's are the target's own tensors)."""
        memo = {id(q): q for n, q in model.named_parameters() if _frozen(n) and q.dtype == self.dtype}
        net = copy.deepcopy(model, memo)
        for n, q in net.named_parameters():
            if _frozen(n):
                q.requires_grad_(False)
            else:
                q.data = q.data.to(self.dtype)
                q.requires_grad_(True)
        if any(_frozen(n) and q.dtype != self.dtype for n, q in net.named_parameters()):
            net = net.to(self.dtype)
        return net.to(self.device).eval()

    def _levels(self) -> tuple[int, bool]:
        return 1, False

    def _levels_max(self) -> int:
        return 1

    def _forward(self, r: Record, levels: int, mix_token: bool, grad: bool) -> list[tuple[int, Tensor]]:
        """``[(0, hidden [n, H])]``: the model's last hidden state after position ``j + 1`` (entry ``j``'s token)
        for every entry ``j``; the input is the prompt's first token followed by the entries' tokens."""
        ids = torch.cat([torch.tensor([r.first_id]), r.tokens.reshape(-1).cpu()]).to(self.device)[None]
        with torch.set_grad_enabled(grad):
            hidden = self.net.model(input_ids=ids).last_hidden_state[0]
        return [(0, hidden[1:])]

    def _logits(self, pred: Tensor) -> Tensor:
        """The student's own ``lm_head``, its vocabulary cut or padded (very low score) to the target's, as
        :class:`draft.ssm.SmallLMDrafter` does when drafting."""
        logits = self.net.lm_head(pred.to(self.net.lm_head.weight.dtype)).float()
        v = int(self.lm_w.shape[0])
        if logits.shape[-1] > v:
            return logits[..., :v]
        if logits.shape[-1] < v:
            pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), -1e4)
            return torch.cat([logits, pad], dim=-1)
        return logits


@dataclass
class Slot:
    """One learnable model inside rank 0's drafter: ``name`` (``eagle`` or ``ssm:<dir>``), the live ``module``
    the drafter computes with (the EAGLE head, or the small LM), and ``kind`` (``eagle`` | ``ssm``)."""

    name: str
    module: object
    kind: str


def learnable_slots(drafter) -> list[Slot]:
    """The models online learning can distil in ``drafter``: an EAGLE-1/2-shaped head (a ``head`` with ``fc``; not
    EAGLE-3, whose own ``lm_head`` and fused features this learner does not model), small draft
    LMs (:class:`draft.ssm.SmallLMDrafter`), and those among a merged drafter's sources. Lookup has none."""
    from draft.ssm import SmallLMDrafter
    sources = getattr(drafter, "sources", None)
    if sources is not None:
        names = getattr(drafter, "names", None) or [type(x).__name__ for x in sources]
        out = []
        for name, src in zip(names, sources):
            inner = learnable_slots(src)
            out += [Slot(name if len(inner) == 1 else f"{name}.{sl.name}", sl.module, sl.kind) for sl in inner]
        return out
    if isinstance(drafter, SmallLMDrafter):
        return [Slot("ssm", drafter.model, "ssm")]
    head = getattr(drafter, "head", None)
    if head is not None and hasattr(head, "fc") and not getattr(head, "aux_layers", None):
        return [Slot("eagle", head, "eagle")]
    return []


# ---------------------------------------------------------------------------------------------------------
# The drafter wrapper
# ---------------------------------------------------------------------------------------------------------

class OnlineDrafter:
    """Rank 0's drafter with online learning (see the module docstring). ``inner`` is the drafter the modes
    would use: a :class:`draft.drafter.Drafter` (its ``head`` is the live head), a small LM drafter, or a merged
    drafter (``draft.sources``); every :func:`learnable_slots` model gets its own learner on the shared replay
    buffer. ``lm_head`` is the target's.

    Versions are joint: a version is the weights of every slot; a learner's publication replaces its own slot's
    weights and keeps the others', and a rollback restores all slots of the previous version.

    ``learn=False`` builds the wrapper without a learner (versions come only from :meth:`publish`; tests)."""

    def __init__(self, inner, lm_head, settings: OsdSettings, learn: bool = True) -> None:
        if settings.loss not in LOSSES or settings.sample_source not in SOURCES or settings.swap_at not in SWAP_POINTS:
            raise ValueError(f"bad OSD settings {settings}")
        self.inner, self.s = inner, settings
        self.lm_head = lm_head
        self.slots = {sl.name: sl for sl in learnable_slots(inner)}
        self._learn = learn
        self._fresh()

    def _fresh(self) -> None:
        """What online learning accumulates, as when built: version 0 = the slots' weights now, an empty replay
        buffer, no statistics, fresh learners (their threads started unless ``osd.sync``)."""
        settings, lm_head = self.s, self.lm_head
        self.buffer = ReplayBuffer(settings.buffer_tokens)
        self.lock = threading.Lock()
        self.version = 0                       # the live weights' version
        self._next_version = 1
        self._staged: dict[str, tuple[int, dict, str]] = {}   # slot -> (version, weights, reason) to swap in
        self.states: dict[int, dict] = {}      # version -> {slot: weights} (the ones rollback may return to)
        self.taus: dict[int, list[float]] = {0: []}
        self.history: list[int] = [0]          # kept versions, oldest first
        self.judged: set[int] = {0}
        self.rollbacks = 0
        self.swaps = 0
        self.swap_s = 0.0
        self.events: list[dict] = []
        self._rec: dict | None = None
        self._gen_versions: list[int] = []
        self.learners: dict[str, Learner] = {}
        self.states[0] = {name: head_state(sl.module) for name, sl in self.slots.items()}
        if self._learn:
            for name, sl in self.slots.items():
                kind = SmallLMLearner if sl.kind == "ssm" else Learner
                self.learners[name] = kind(sl.module, lm_head, self.buffer, settings,
                                           lambda state, reason="", _slot=name: self.publish(state, reason, _slot))
            if not settings.sync:
                for L in self.learners.values():
                    L.start_thread()

    def forget_requests(self) -> None:
        """:func:`draft.protocol.forget_requests`: back to version 0 (the weights this wrapper was built with), an
        empty replay buffer, fresh learners and counters; then the inner drafter forgets its own memory.

        Why: online learning is a memory of earlier requests too, held in weights. A run that decodes the same
        prompts in several modes (``pipeline.run --modes``, ``bench``, ``eval``, ``run_threaded``) would otherwise
        start each later mode with a head distilled on the earlier modes' answers to those very prompts, and
        report a τ that no run of that mode alone gets (docs/results.md §89's leak, here in learned weights). The
        request in progress, if any, is dropped, not filed (``_fresh`` clears it)."""
        for L in self.learners.values():
            L.stop()
        for name, sl in self.slots.items():
            load_head_state(sl.module, self.states[0][name])
        self._fresh()
        forget_requests(self.inner)

    @property
    def learner(self) -> Learner | None:
        """The first slot's learner (the EAGLE head's when there is one), or None."""
        return next(iter(self.learners.values()), None)

    # -- explicit delegation -----------------------------------------------------------------------------
    @property
    def supports_extend(self) -> bool:
        return bool(getattr(self.inner, "supports_extend", False))

    @property
    def head(self):
        return getattr(self.inner, "head", None)

    @property
    def cache(self):
        return getattr(self.inner, "cache", None)

    @property
    def tree_size(self) -> int:
        return self.inner.tree_size

    def reset(self) -> None:
        self.inner.reset()

    def top_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return top_tokens(self.inner, hidden, k)

    def logprobs(self, hidden: Tensor) -> Tensor:
        return self.inner.logprobs(hidden)    # metered there (draft.protocol.install_meter meters ``inner``)

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int):
        return self.inner.grow_tree(root_token, root_hidden, total_token, depth, top_k)

    def grow_tree_with_inputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int):
        return self.inner.grow_tree_with_inputs(root_token, root_hidden, total_token, depth, top_k)

    def grow_tree_deferred(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int):
        return grow_tree_deferred(self.inner, root_token, root_hidden, total_token, depth, top_k)

    def extend_tree(self, tree, inputs: Tensor, root_hidden: Tensor, levels: int, top_k: int, max_new: int):
        return self.inner.extend_tree(tree, inputs, root_hidden, levels, top_k, max_new)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        return self.inner.tree_forward(tokens, features, parents)

    def drop_tree(self) -> None:
        self.inner.drop_tree()

    # -- the two calls that carry the target's data --------------------------------------------------------
    def start(self, prompt_ids: list[int], first_token: int, features: Tensor, sampling=None) -> Tensor:
        """New request: file the finished one, judge rollbacks, run the inline learner (``osd.sync``), swap in a
        published version (the ``generation`` swap point), then start the inner drafter (with ``sampling``)."""
        self.flush()
        for L in self.learners.values():
            if self.s.sync:
                L.maybe_update()
            else:
                L.wake()
        self._swap_if_staged()
        self._gen_versions = [self.version]
        toks = list(prompt_ids[1:]) + [int(first_token)]
        self._rec = {"prompt_ids": list(prompt_ids), "first": int(first_token), "tokens": [toks],
                     "features": [None if features is None else features.detach().clone()], "commits": 0,
                     "committed": 0, "first_gen": len(toks) - 1, "version": self.version}
        return self.inner.start(prompt_ids, first_token, features, sampling=sampling)

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        rec = self._rec
        if rec is not None:
            rec["tokens"].append([int(t) for t in tokens.reshape(-1).tolist()])
            rec["features"].append(None if features is None else features.detach().clone())
            rec["commits"] += 1
            rec["committed"] += int(tokens.numel())
        if self.s.swap_at == "commit" and self._staged and rec is not None:
            if self._swap_if_staged():
                self._gen_versions.append(self.version)
                return self._rebuild()
        return self.inner.commit(tokens, features)

    def _rebuild(self) -> Tensor:
        """Re-feed the whole recorded context (prompt entries and every commit so far) through the new weights:
        the draft cache then holds what the new head would have computed; returns the last entry's state."""
        rec = self._rec
        feats = rec["features"]
        if all(f is not None for f in feats):
            flat = [t for part in rec["tokens"] for t in part]
            # start(p, first, f) feeds the entries p[1:] + [first]: here every entry token in order
            return self.inner.start(rec["prompt_ids"][:1] + flat[:-1], flat[-1], torch.cat(feats))
        out = self.inner.start(rec["prompt_ids"], rec["first"], feats[0])
        for toks, f in zip(rec["tokens"][1:], feats[1:]):
            out = self.inner.commit(torch.tensor(toks), f)
        return out

    def flush(self) -> None:
        """File the current request (if any) into the buffer and its τ into its version's statistics; judge a
        pending rollback. Called by :meth:`start` and at exit."""
        rec, self._rec = self._rec, None
        if rec is None:
            return
        tau = rec["committed"] / rec["commits"] if rec["commits"] else None
        if tau is not None and len(self._gen_versions) == 1:
            self.taus.setdefault(rec["version"], []).append(tau)
        feats = rec["features"]
        if all(f is not None for f in feats) and self.learners:
            flat = [t for part in rec["tokens"] for t in part]
            self.buffer.add(Record(torch.tensor(flat), torch.cat(feats), rec["first_gen"], version=rec["version"],
                                   first_id=int(rec["prompt_ids"][0])))
        self._judge()

    def _judge(self) -> None:
        v = self.version
        if v in self.judged or len(self.history) < 2:
            return
        prev = self.history[-2]
        verdict = rollback_due(self.taus.get(v, []), self.taus.get(prev, []), self.s.window, self.s.rollback_tol)
        if verdict is None:
            return
        self.judged.add(v)
        if verdict:
            self.rollbacks += 1
            self.history.pop()
            state = self.states[prev]
            with self.lock:
                self._staged = {}
            t0 = time.perf_counter()
            for name, sl in self.slots.items():
                load_head_state(sl.module, state[name])
            self.swap_s += time.perf_counter() - t0
            self.events.append({"event": "rollback", "from": v, "to": prev})
            self.version = prev
            for name, L in self.learners.items():
                L.reset_to(state[name])

    # -- double buffer ------------------------------------------------------------------------------------
    def publish(self, state: dict, reason: str = "", slot: str | None = None) -> int:
        """Stage ``state`` (weights of ``slot``, default: the first slot) as the next version; returns its
        number. Called by a learner's thread, or a test. The live model is not touched here: the serving thread
        copies it in at the next swap point (a newer publication for the same slot replaces a staged one)."""
        slot = slot if slot is not None else next(iter(self.slots), None)
        if slot not in self.slots:
            raise KeyError(f"no learnable slot {slot!r} in this drafter (slots: {', '.join(self.slots) or 'none'})")
        with self.lock:
            v = self._next_version
            self._next_version += 1
            self._staged[slot] = (v, state, reason)
        return v

    def _swap_if_staged(self) -> bool:
        with self.lock:
            staged, self._staged = self._staged, {}
        if not staged:
            return False
        joint = dict(self.states[self.version])
        t0 = time.perf_counter()
        for name, (_, state, _) in staged.items():
            load_head_state(self.slots[name].module, state)
            joint[name] = state
        self.swap_s += time.perf_counter() - t0
        v = max(sv for sv, _, _ in staged.values())
        reason = ",".join(f"{name}:{r}" if len(self.slots) > 1 else r for name, (_, _, r) in staged.items())
        self.states[v] = joint
        self.taus.setdefault(v, [])
        self.history.append(v)
        for old in self.history[:-3]:          # rollback needs the previous kept version; the floor is 0
            if old != 0:
                self.states.pop(old, None)
        self.version = v
        self.swaps += 1
        self.events.append({"event": "swap", "version": v, "reason": reason})
        return True

    # -- outputs ------------------------------------------------------------------------------------------
    def row_fields(self) -> dict:
        """Fields for the output row of the request that just ended (``pipeline.outputs.drafter_fields``)."""
        Ls = list(self.learners.values())
        L = self.learner
        errors = [f"{n}: {L_.error!r}"[:200] for n, L_ in self.learners.items() if L_.error]
        osd = {"loss": self.s.loss, "sample_source": self.s.sample_source, "swaps": self.swaps,
               "rollbacks": self.rollbacks, "buffer_entries": self.buffer.entries,
               "requests_seen": self.buffer.added, "updates": sum(x.updates for x in Ls),
               "floor_restores": sum(x.floor_restores for x in Ls),
               "learner_busy_s": round(sum(x.busy_s for x in Ls), 3), "swap_s": round(self.swap_s, 4),
               "last_update": dict(L.last) if L else {}, "learner_error": "; ".join(errors) or None,
               "slots": list(self.slots)}
        if len(Ls) > 1:
            osd["per_slot"] = {n: {"updates": x.updates, "published": x.published, "floor_restores": x.floor_restores,
                                   "learner_busy_s": round(x.busy_s, 3), "last_update": dict(x.last)}
                               for n, x in self.learners.items()}
        return {"drafter_version": self._gen_versions[0] if self._gen_versions else self.version,
                "drafter_versions": list(self._gen_versions), "osd": osd}

    def save(self, out_dir) -> str:
        """Write the live models: the EAGLE head in the shipped layout in ``out_dir`` (``model.head_dir`` loads
        it), each small LM in the shipped student layout (:func:`draft.ssm.ship_student`, float32) in
        ``out_dir/ssm`` (``out_dir/ssm_<k>`` for the k-th of several; ``draft.sources=...,ssm:<that dir>`` loads
        it). Returns ``out_dir``."""
        from draft.eagle import save_eagle_head
        from draft.ssm import ship_student
        out = Path(out_dir)
        ssms = [sl for sl in self.slots.values() if sl.kind == "ssm"]
        for sl in self.slots.values():
            if sl.kind == "eagle":
                save_eagle_head(sl.module, out, {"osd_version": self.version})
        for k, sl in enumerate(ssms):
            ship_student(sl.module, out / ("ssm" if len(ssms) == 1 else f"ssm_{k}"), dtype=torch.float32)
        return str(out)

    def close(self) -> None:
        """Stop the learners; with ``osd.save_dir``, save the live models. Idempotent."""
        self.flush()
        for L in self.learners.values():
            L.stop()
        if self.s.save_dir and self.slots:
            self.save(self.s.save_dir)
            self.s.save_dir = ""
