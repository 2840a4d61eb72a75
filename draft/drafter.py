"""Rank 0's drafter: the EAGLE head with its own KV cache, and EAGLE-2 dynamic tree building.

EAGLE-3 heads (:class:`draft.eagle3.Eagle3Head`) run through the same code: their committed entries take the
target's fused tapped-layer features (the wide rows the stages send), tree entries the head's own output; their
log-probs come from the head's own ``norm``/``lm_head`` over the draft vocabulary, mapped to target ids by
``vocab_map`` (a reduced vocabulary: top-k runs in the draft vocabulary, target ids outside it get -inf).
An EAGLE-1/2 head, which shares the target's ``lm_head``, can draft over a reduced vocabulary too
(``draft_ids``, the run key ``model.draft_vocab``, :mod:`draft.vocab`): the ranked ids plus the tokens of the
generation's context; its draft log-probs then apply only those rows of the target's ``lm_head``
(:class:`draft.vocab.DraftVocab`), the same ``vocab_map`` path as EAGLE-3's.

Draft cache entries pair a token with the feature of the position before it: entry ``t`` is
``(token[t+1], feature[t])`` at position ``t``. The cache's committed context only ever holds entries
whose feature came from the *target* (accepted tokens); tree search adds temporary tree entries whose
feature is the draft's own prediction for the parent, and drops them afterwards.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from draft.eagle import EagleHead
from draft.protocol import DraftSampling, commit_tree_outputs, tree_outputs
from draft.race import seeded_pick
from draft.shape import EAGLE2, TreeShape, pick_frontier
from draft.static_head import level_step
from draft.tree import DraftTree, beam_frontier, best_first, top_nodes_tree
from model.devices import HOST
from model.grad import no_grad
from model.meter import NULL_METER, OpMeter, hidden_rows, run_rows

Tensor = torch.Tensor


def to_host(*xs: Tensor) -> tuple[Tensor, ...]:
    """Same-shaped-but-the-last-dim tensors on the host in **one** device->host copy (a synchronisation on a GPU):
    concatenated as float64 (exact for float32 scores and for integer ids below 2**53), split and cast back.
    Done on a CPU-only run too (a few cheap ops), so that it runs, and is counted, as on a GPU."""
    if len(xs) == 1:
        return (xs[0].to(HOST),)
    both = torch.cat([x.to(torch.float64) for x in xs], dim=-1).to(HOST)
    out, at = [], 0
    for x in xs:
        w = x.shape[-1]
        out.append(both[..., at:at + w].to(x.dtype))
        at += w
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _row_pattern_np(rows: int, width: int) -> np.ndarray:
    """``[0]*width + [1]*width + ... + [rows-1]*width`` (cached; read only): the frontier row of each of a level's
    ``rows * width`` candidates (the beam's host bookkeeping, :class:`_Beam`)."""
    out = np.repeat(np.arange(rows, dtype=np.int64), width)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _beam_layout(shape: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Host patterns (NumPy, cached; read only) of a beam whose level ``L`` (0: the root's children) has ``rows``
    frontier rows of ``width`` candidates each, ``shape[L] = (rows, width)`` (level 0: ``(1, k)``), candidates
    numbered level by level: each candidate's parent as a row of the expanded frontiers, concatenated in order (-1
    for the root's children: it reads the trailing -1 of those ids), and its depth below the root (1 for the root's
    children). The round start's final selection reads both on the host."""
    parent, depth, off = [], [], -1
    for level, (rows, width) in enumerate(shape):
        parent.append(_row_pattern_np(rows, width) + off)
        depth.append(np.full(rows * width, level + 1, dtype=np.int64))
        off += rows if level else 1
    par, dep = np.concatenate(parent), np.concatenate(depth)
    par.flags.writeable = dep.flags.writeable = False
    return par, dep


_NUMPY_SCORES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}   # host_top_numpy


def _host_rows(n: int, rows: np.ndarray, x: Tensor, fill: float) -> Tensor:
    """An ``[n, w]`` host tensor with ``x``'s rows at ``rows`` and ``fill`` elsewhere: in NumPy (no dispatched
    operator) where NumPy has ``x``'s dtype, else two torch operators."""
    if x.dtype in _NUMPY_SCORES or x.dtype == torch.int64:
        a = np.full((n, x.shape[1]), fill, dtype=x.numpy().dtype)
        a[rows] = x.numpy()
        return torch.from_numpy(a)
    return torch.full((n, x.shape[1]), fill, dtype=x.dtype).index_copy_(0, torch.from_numpy(rows), x)


def float_log_softmax(logits: Tensor) -> Tensor:
    """Log-probs of ``logits`` rows in float32 (row-wise)."""
    return torch.log_softmax(logits.float(), dim=-1)

@dataclass
class _Beam:
    """A beam search's state below a tree (:meth:`BeamTreeDrafter._beam_levels`): the candidates so far (scores,
    frontier rows and tokens, preallocated at ``cap``; ``n_cand`` written), every level's frontier rows (parent code,
    depth, head output; ``n_rows`` of them before the current frontier), and the current frontier's draft-cache
    slots and cumulative scores.

    Host bookkeeping in NumPy (issue 41; docs/results.md, §52 ("Fewer operators on the chain")): everything here
    but ``rows_out`` (the head's
    outputs, on the drafter's device) is a few dozen host integers and scores per level, which the level reads
    after its one device->host copy. As torch ops on host tensors they were about a dozen dispatched operators
    per level (slices, adds, gathers, arange), each a few microseconds of dispatch; NumPy calls on the same
    numbers are about a microsecond each and dispatch nothing. The operator count (``pipeline.tools.opcount``,
    the simulator's ``--rank0-cost ops``) does not see them: they are host time, which layerbench's timings and
    the simulator's ``--rank0-cost measured`` include."""
    cap: int
    c_score: np.ndarray | None
    c_row: np.ndarray | None
    c_tok: list
    rows_par: list
    rows_dep: list
    rows_out: list
    f_slot: np.ndarray
    f_score: np.ndarray
    n_cand: int = 0
    n_rows: int = 0


@dataclass
class EarlyLevel:
    """An expansion's first level already in the tree (``tree.early_level``, issue 41;
    :meth:`BeamTreeDrafter.append_prefetched_level`): what :meth:`BeamTreeDrafter.commit_extend_tree` needs, as its
    ``pre``, to finish that expansion after the level was sent. ``n0``: the tree's size before the level (the
    level's nodes are ``[n0, len(tree))``, best first); ``frontier``: the leaves whose prefetched candidates
    ranked it (tree ids, host); ``f_out``: those leaves' draft outputs (the candidates' inputs); ``cum`` / ``tok``:
    every candidate's cumulative score and token (``len(frontier) * kk``, row-major); ``best``: the candidates
    that became the level's nodes (indices into ``cum``, in the nodes' order)."""
    n0: int
    frontier: np.ndarray
    f_out: Tensor
    cum: np.ndarray
    tok: np.ndarray
    best: np.ndarray
    kk: int


def level2_seeds(parents: np.ndarray, leaf: np.ndarray, scores: np.ndarray, cand_scores: np.ndarray, top_k: int,
                 width: int) -> np.ndarray:
    """Which prefetched first-level candidates get their own children prefetched too (``tree.early_whole``, issue
    41), as flat indices ``node * kk + j`` into ``cand_scores`` ``[n, kk]`` (a leaf's candidates ranked by its
    log-prob; ``scores``: the tree's cumulative scores, ``parents[0] = -1``).

    The rule: the next verified step keeps the subtree of a new root ``r`` (a node of this tree), and its
    expansion's first level is then that subtree's beam: the best ``top_k`` of the best ``top_k`` leaves'
    candidates by cumulative score (:meth:`BeamTreeDrafter.append_prefetched_level`). For the candidate new roots
    in descending score (the draft's own odds that the target's path reaches them; ties by index), add each one's
    beam while the union stays within ``width`` candidates; stop at the first beam that does not fit. So
    every outcome it covers is covered whole (a beam member outside the set makes the step fall back to the first
    level alone or the plain expansion), and the likeliest outcomes come first. The beams are EAGLE-2's (a
    confidence-shaped frontier, ``draft.tree_shape``, may pick others: those steps fall back). Why a cap: each
    chosen candidate is a row of the prefetch's second head forward and log-prob call, real work on rank 0 (priced
    as such); nested subtrees share most of their beams, so a few beams' worth of rows covers the likely outcomes.
    Invariants: pure; at most ``width`` indices, distinct, all of leaves, each a leaf's candidate rank below
    ``top_k``; ``width <= 0`` or no candidates: none."""
    n, kk = cand_scores.shape
    if width <= 0 or kk == 0 or n == 0 or top_k <= 0:
        return np.empty(0, dtype=np.int64)
    # Vectorised over every candidate new root at once (a few dozen NumPy calls, whatever the tree: issue 41's
    # bookkeeping rule); tests/test_turnaround_off_chain.py checks it against a plain-Python reference.
    under = np.zeros((n, n), dtype=bool)                 # under[i, r]: r is i or an ancestor of i
    node, anc = np.arange(n), np.arange(n)
    while True:                                          # one pass per depth (pointer walk up, all nodes at once)
        ok = anc >= 0
        if not ok.any():
            break
        under[node[ok], anc[ok]] = True
        anc = np.where(ok, parents[np.maximum(anc, 0)], -1)
    roots = best_first(scores[1:], n - 1) + 1 if n > 1 else np.zeros(1, dtype=np.int64)
    nr = roots.size
    lv = np.flatnonzero(leaf)
    lv = lv[best_first(scores[lv], lv.size)]             # leaves best first (ties by index)
    inside = under[lv][:, roots]                         # [leaves, roots]: the leaf is in the root's subtree
    rank = np.cumsum(inside, axis=0) - 1                 # its place among that subtree's leaves
    li, ri = np.nonzero(inside & (rank < top_k))
    fr = np.full((nr, top_k), -1, dtype=np.int64)        # each root's frontier: its best top_k leaves
    fr[ri, rank[li, ri]] = lv[li]
    valid = (fr >= 0)[:, :, None]
    safe = np.maximum(fr, 0)
    cum = np.where(valid, scores[safe][:, :, None] + cand_scores[safe], -np.inf).reshape(nr, -1)
    flat = np.where(valid, safe[:, :, None] * kk + np.arange(kk), -1).reshape(nr, -1)
    beams = np.take_along_axis(flat, np.argsort(-cum, axis=1, kind="stable")[:, :top_k], 1)   # [roots, top_k]
    seq = beams.reshape(-1)
    real = np.flatnonzero(seq >= 0)
    new = np.zeros(seq.size, dtype=bool)                 # a candidate's first appearance, roots in order
    new[real[np.unique(seq[real], return_index=True)[1]]] = True
    fits = int(np.searchsorted(np.cumsum(new.reshape(nr, -1).sum(1)), width, side="right"))
    return seq[:fits * beams.shape[1]][new[:fits * beams.shape[1]]].astype(np.int64)


class BeamTreeDrafter:
    """EAGLE-2's dynamic tree search, written against a drafter's state hooks only.

    A subclass keeps the committed context and the temporary tree entries and implements the
    :class:`draft.protocol.TreeDrafter` hooks ``start``, ``commit``, ``tree_forward``, ``drop_tree`` and
    ``logprobs``, plus the ``tree_size`` property (tree entries fed since the last ``drop_tree``); this class
    adds ``grow_tree`` (beam search), ``grow_tree_with_inputs`` and ``extend_tree`` (incremental expansion)
    on top. Subclasses: :class:`Drafter` (EAGLE heads), :class:`draft.oracle.OracleDrafter`,
    :class:`draft.ssm.SmallLMDrafter`.
    """

    vocab_map: Tensor | None = None   # reduced draft vocabulary (draft id -> target id); None = the target's
    # sampled drafting (T > 0, :meth:`sampled_tree`): off unless a subclass or :meth:`set_sampling` turns it on
    sample: bool = False                   # sampled trees now (take_sampling: the wish and this generation's T > 0)
    sample_wish: bool = False              # set_sampling's ``sample``: what take_sampling turns on at T > 0
    follow_temperature: bool = True        # q's temperature follows the generation's (take_sampling)
    temperature: float = 1.0
    seed: int = 0
    sample_chains: int = 0                 # chains of a sampled tree (0: the call's top_k)
    sample_distinct: bool = True           # chains meeting at a node draw distinct children (without replacement)
    generator: torch.Generator | None = None
    meter: OpMeter = NULL_METER   # instrumentation sees each draft log-prob call as an lm_head op (model.meter)
    tree_shape: TreeShape = EAGLE2   # draft.tree_shape: the fixed beam or confidence-shaped levels (draft/shape.py)
    # a subclass that sets vocab_map also implements draft_logprobs (log-probs over the draft vocabulary, metered)

    @property
    def supports_extend(self) -> bool:
        """``extend_tree`` may continue this drafter's trees: they come from the deterministic EAGLE-2 search.
        Not while it samples (:attr:`samples`): a sampled tree's draws may not be re-ranked or cut by value, so
        ``continuous`` redrafts those from the root instead."""
        return not self.samples

    # -- sampled trees (SpecInfer's multi-step speculative sampling; T > 0) --------------------------------------
    def set_sampling(self, sample: bool, temperature: float, seed: int, chains: int = 0, distinct: bool = True,
                     follow: bool = True) -> None:
        """Draw sampled trees (:meth:`sampled_tree`) when ``sample`` and ``temperature > 0``: children drawn from
        ``q = softmax(logprobs / temperature)``, reseeded with ``seed`` at every :meth:`start` (a seeded run
        repeats); ``chains``: chains per tree (0: the call's ``top_k``); ``distinct``: chains that meet at a node
        draw distinct children there (without replacement), else i.i.d. draws that may join. ``sample`` is the
        wish (a run key); each generation's own temperature and seed replace these at its :meth:`start`
        (:meth:`take_sampling`)
        (``follow``: q's temperature is the generation's; False: ``temperature`` stays, e.g. a fixed
        ``draft.ssm_temperature``)."""
        self.sample_wish, self.follow_temperature = bool(sample), bool(follow)
        self.sample, self.temperature, self.seed = bool(sample), float(temperature), int(seed)
        self.sample_chains, self.sample_distinct = chains, distinct
        self.generator = torch.Generator(device=HOST).manual_seed(self.seed)

    def take_sampling(self, sampling: DraftSampling | None) -> None:
        """One generation's own sampling settings, taken by :meth:`start` (``sampling``, a
        :class:`draft.protocol.DraftSampling`; None: the current ones stay): sampled trees iff the wish
        (:meth:`set_sampling`) and the generation's T > 0; q's temperature that T where :attr:`follow_temperature`;
        the draws' stream seeded with its seed. Why: a served request or an API call brings its own temperature
        and seed, and a drafter set up at load time drew at the load's (at T = 0 by default: ``draft.eagle_sample``
        and a small LM's ``draft.ssm_sample`` did nothing for any request at T > 0). An argument of ``start``, not
        a call of its own: the generation's settings are part of starting it, like its prompt."""
        if sampling is None:
            return
        t = float(sampling.temperature)
        self.sample = self.sample_wish and t > 0
        if self.follow_temperature and t > 0:
            self.temperature = t
        self.seed = int(sampling.seed)

    def reseed(self) -> None:
        """Restart the draws of a sampling drafter (called by ``start``: one generation, one stream)."""
        if self.generator is not None:
            self.generator.manual_seed(self.seed)

    @property
    def samples(self) -> bool:
        """True when ``grow_tree`` draws sampled proposals (sampling on, with a temperature > 0)."""
        return self.sample and self.temperature > 0

    def draw(self, q: Tensor) -> int:
        """One token from ``q`` (the drafter's own generator; tests replace this to enumerate the draws), by the
        exponential race of :func:`draft.race.race_pick`: ``q`` is computed from the target's features, which round
        differently with the schedule in the pipelined modes, and a race keeps a seeded draw through such noise
        where an inverse CDF flips in the long tail; this two-level one costs 0.05 ms at V = 49152 against 1.0 for
        the one-sample ``multinomial`` it replaced (a race over the whole vocabulary: docs/results.md §101, §102)."""
        if self.generator is None:
            self.generator = torch.Generator(device=HOST).manual_seed(self.seed)
        return seeded_pick(q, self.generator)

    def proposal(self, hidden: Tensor) -> Tensor:
        """q per row of ``hidden``: the distribution sampled children are drawn from, ``softmax(logprobs /
        temperature)``, float64 on the host (what :func:`pipeline.verify.walk_proposals` reads). One metered
        log-prob call for all rows."""
        return torch.softmax(self.logprobs(hidden).double().to(HOST) / self.temperature, dim=-1)

    @no_grad
    def sampled_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                     width: int) -> DraftTree:
        """A sampled tree: ``width`` chains of draws from the drafter's own law q.

        Shape: ``width`` chains (at most ``total_token - 1``), each ``min(depth + 1, (total_token - 1) // width)``
        draws long, level by level, chains in order (the draw order). A chain draws its next token at its current
        node u from q(u). With ``sample_distinct`` (the default) a chain that finds others already drew at u this
        level draws from q(u) without their tokens, renormalised, so the chains through u take distinct children
        (a node the draft finds likely collects several chains, hence several children) and the tree has one node
        per draw; a chain stops where q(u) has no token left. Without it chains draw i.i.d. from q(u) and join
        where they draw the same token (SpecInfer's small-LM trees).
        Exactness (:func:`pipeline.verify.walk_proposals`): every draw is kept as a proposal ``(child, q_j)`` of
        its node in draw order, ``q_j`` the distribution it was drawn from, a fresh draw given everything drawn
        before it at that node; how many proposals a node gets depends only on draws above it (how many chains
        arrive), never on its own draws; nothing is re-ranked or dropped by a drawn value.
        Model work: one ``tree_forward`` and one log-prob call per level, over the level's new nodes.
        Scores: the best cumulative ``log q`` of the chains through a node (never above its parent's).
        """
        width = max(1, min(width, total_token - 1))
        length = min(depth + 1, (total_token - 1) // width) if total_token > 1 else 0
        if length <= 0:
            return DraftTree.single(root_token)
        distinct = self.sample_distinct
        index: dict[tuple[int, int], int] = {}
        tokens, parents, scores, props = [root_token], [-1], [0.0], [[]]
        q_of = {0: self.proposal(root_hidden[None])[0]}          # node -> q its children are drawn from
        out_of = {0: root_hidden}                                # node -> its draft output (what a child is fed)
        slot_of = {0: -1}                                        # node -> its draft-cache tree slot
        chain_node, chain_score = [0] * width, [0.0] * width
        alive = [True] * width
        for level in range(length):
            left = dict(q_of) if distinct else q_of              # node -> what its next chain draws from
            for c in range(width):
                if not alive[c]:
                    continue
                u = chain_node[c]
                q = left[u]
                if distinct and float(q.sum()) <= 0:             # every token of q(u) drawn by earlier chains
                    alive[c] = False
                    continue
                x = self.draw(q)
                chain_score[c] += math.log(float(q[x]))
                v = index.get((u, x))
                if v is None:
                    v = index[(u, x)] = len(tokens)
                    tokens.append(x)
                    parents.append(u)
                    scores.append(chain_score[c])
                    props.append([])
                else:
                    scores[v] = max(scores[v], chain_score[c])
                props[u].append((v, q))
                chain_node[c] = v
                if distinct:
                    rest = q.clone()
                    rest[x] = 0.0
                    mass = float(rest.sum())
                    left[u] = rest / mass if mass > 0 else rest
            need = sorted({chain_node[c] for c in range(width) if alive[c]}) if level + 1 < length else []
            if need:                                             # the chains' nodes are this level's new ones
                start = self.tree_size
                out = self.tree_forward(torch.tensor([tokens[v] for v in need], device=HOST),
                                        torch.stack([out_of[parents[v]] for v in need]),
                                        torch.tensor([slot_of[parents[v]] for v in need], device=HOST))
                qs = self.proposal(out)
                for i, v in enumerate(need):
                    out_of[v], slot_of[v], q_of[v] = out[i], start + i, qs[i]
        self.drop_tree()
        return DraftTree(torch.tensor(tokens, device=HOST), torch.tensor(parents, device=HOST),
                         torch.tensor(scores, device=HOST), proposals=props)

    @staticmethod
    def _frontier(shape: TreeShape, level_scores: Tensor, all_scores: list[Tensor], total_token: int, width: int,
                  rows_left: float = math.inf) -> Tensor:
        """Which of a level's candidates (``level_scores``, cumulative) the search expands next, best first:
        EAGLE-2's ``width`` best (:func:`draft.tree.beam_frontier`), or with a confidence shape
        :func:`draft.shape.pick_frontier` (only those that can still enter the ``total_token`` tree, as many as
        cover the shape's share of their mass, within ``rows_left`` head rows)."""
        if not shape.shaped:
            return beam_frontier(level_scores, width)
        return pick_frontier(level_scores, torch.cat(all_scores), total_token - 1, width, shape.cover, rows_left)

    def top_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Best ``min(k, draft vocabulary)`` (log-prob, target token) per row of ``hidden``; for a reduced
        vocabulary the search runs over the draft vocabulary and only the winners are mapped to target ids."""
        vm = getattr(self, "vocab_map", None)
        lp = self.logprobs(hidden) if vm is None else self.draft_logprobs(hidden)
        s, t = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        return (s, t) if vm is None else (s, vm.to(t.device)[t])

    def level(self, tokens: Tensor, features: Tensor, parents: Tensor, scores: Tensor,
              k: int) -> tuple[Tensor, Tensor, Tensor]:
        """One beam level below a frontier (its ``tokens``, input ``features``, draft-cache ``parents`` slots and
        cumulative ``scores [rows, 1]``): :func:`draft.static_head.level_step` with :meth:`tree_forward` and
        :meth:`top_tokens` -> ``(out [rows, H], cum [rows, k'], tok [rows, k'])``, ``k' = min(k, vocabulary)``.
        :class:`Drafter` runs the same step on static shapes where ``model.graphs`` gives it a static head."""
        return level_step(lambda: self.tree_forward(tokens, features, parents), lambda h: self.top_tokens(h, k),
                          scores)

    def _root_topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The first level of a tree (the root's children): :meth:`top_tokens` unless a subclass widens it."""
        return self.top_tokens(hidden, k)

    @no_grad
    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """EAGLE-2 dynamic tree rooted at ``root_token``.

        ``root_hidden`` is the draft output of the root's entry (returned by :meth:`commit`). A beam of
        width ``top_k`` runs for ``depth`` expansions after the first level; all ``top_k + depth * top_k**2``
        candidates compete for ``total_token - 1`` places by cumulative log-prob (root included in
        ``total_token``, as in EAGLE). The draft is deterministic: top-k, never sampled; a drafter that
        samples (:attr:`samples`, T > 0) draws :meth:`sampled_tree` instead.

        Placement (``model/devices.py``): the beam's candidates stay on the draft head's device; per level
        only the ``top_k`` chosen parent rows go to the host (the draft cache's tree bookkeeping), and the
        candidates cross once at the end, where :func:`draft.tree.top_nodes_tree` re-ranks them on the host.
        """
        if self.samples:
            return self.sampled_tree(root_token, root_hidden, total_token, depth, self.sample_chains or top_k)
        return self._search(root_token, root_hidden, total_token, depth, top_k, False)[0]

    @no_grad
    def grow_tree_with_inputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                              top_k: int) -> tuple[DraftTree, Tensor]:
        """:meth:`grow_tree`, plus each node's draft *input* feature (its parent's draft output; row 0, the
        root's, is ``root_hidden``), on the head's device: what :meth:`extend_tree` re-feeds later."""
        return self.grow_tree_with_outputs(root_token, root_hidden, total_token, depth, top_k)[:2]

    @no_grad
    def grow_tree_with_outputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                               top_k: int) -> tuple[DraftTree, Tensor, Tensor, Tensor]:
        """:meth:`grow_tree_with_inputs`, plus each node's own draft *output* where the search computed it:
        ``(tree, inputs, outputs, known)``, ``known[i]`` true iff ``outputs[i]`` is node ``i``'s draft output
        (row 0: the root's, ``root_hidden``; a node the beam expanded: the state its candidate children were
        ranked from). Rows of ``outputs`` with ``known`` false are zeros. A merged drafter reads these to give a
        node proposed by another source the input this source would have fed it, without a forward
        (:meth:`draft.merged.MergedDrafter.tree_inputs`)."""
        return self._search(root_token, root_hidden, total_token, depth, top_k, True)

    def _search(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int,
                with_rows: bool) -> tuple:
        """The EAGLE-2 search of :meth:`grow_tree_with_outputs`; ``with_rows`` False: the tree alone, ``(tree,)``,
        without the inputs' and outputs' gathers (:meth:`grow_tree`: issue 41, a round start drafted as a tree only
        and its inputs taken after the send, :meth:`pipeline.modes.flowspec.ContinuousMode.first_tree`). The same
        tree either way."""
        if total_token <= 1:
            if not with_rows:
                return (DraftTree.single(root_token),)
            return DraftTree.single(root_token), root_hidden[None], root_hidden[None], torch.ones(1, dtype=torch.bool)
        s, t = self._root_topk(root_hidden, top_k)
        dev = s.device
        k = s.numel()
        # A candidate's parent (a row of the fed frontiers), input row and level follow from the levels' shapes and
        # the fed frontier ids (_beam_layout, cached), gathered once at the end, not repeated per level.
        tshape = self.tree_shape                          # draft.tree_shape: which candidates a level expands
        rows_left = tshape.row_budget(depth, top_k)
        cand_scores, cand_tokens, shape = [s], [t], [(1, k)]
        n_cand = k
        last = tshape.levels(depth) - 2                                   # EAGLE-2: depth levels below the root's
        expanded, outs = [], []                                           # candidate ids fed, level by level
        if last >= 0:                                     # a level below the root's (none: the frontier is unused)
            if tshape.shaped:                             # which of the root's children to expand
                first = self._frontier(tshape, s, cand_scores, total_token, k, rows_left)
                frontier_tok, frontier_score = t[first], s[first][:, None]
            else:                                         # EAGLE-2: all k (top-k's order is already the beam's)
                first, frontier_tok, frontier_score = torch.arange(k, device=dev), t, s[:, None]
            expanded.append(first)
            frontier_feat = root_hidden.expand(first.numel(), -1)
            frontier_cache_parent = torch.full((first.numel(),), -1, device=HOST)  # parent slot in the draft cache
        for level in range(last + 1):
            if frontier_tok.numel() == 0:                 # a shaped search found nothing worth expanding
                break
            rows_left -= frontier_tok.numel()
            start = self.tree_size
            out, cum, ct = self.level(frontier_tok, frontier_feat, frontier_cache_parent, frontier_score, k)
            outs.append(out)
            cum = cum.view(-1)                                                 # [frontier * k]
            cand_tokens.append(ct.view(-1))
            cand_scores.append(cum)
            shape.append(tuple(ct.shape))                                      # (frontier, k)
            if level == last:
                n_cand += cum.numel()
                break
            best = self._frontier(tshape, cum, cand_scores, total_token, k, rows_left)
            parent_row = best // ct.shape[-1]
            expanded.append(best + n_cand)
            n_cand += cum.numel()
            frontier_tok = cand_tokens[-1][best]
            frontier_score = cum[best][:, None]
            frontier_feat = out[parent_row]
            frontier_cache_parent = start + parent_row.to(HOST)            # the one transfer of this level
        self.drop_tree()
        scores, cand_tok, fed_np = self._host_candidates(cand_scores, cand_tokens, expanded[:len(outs)], dev)
        parent_row, levels = _beam_layout(tuple(shape))
        order = best_first(scores, max(0, min(total_token - 1, n_cand)))   # the kept ones
        tree = top_nodes_tree(root_token, cand_tok, fed_np[parent_row], scores, order, levels)
        if not with_rows:
            return (tree,)
        # the row gathers' indices in NumPy (issue 41): rows = [zeros, root's output, each fed level's outputs]
        rowof = np.full(n_cand, -1, dtype=np.int64)                        # candidate -> its output row (-1: none)
        rowof[fed_np[:-1]] = np.arange(1, fed_np.size)
        own = rowof[order]
        known = np.concatenate([np.ones(1, dtype=bool), own >= 0])
        rows = torch.cat([root_hidden.new_zeros(1, root_hidden.shape[-1]), root_hidden[None], *outs])
        pick_in = np.concatenate([np.ones(1, dtype=np.int64), parent_row[order] + 2])
        pick_out = np.concatenate([np.ones(1, dtype=np.int64), own + 1])  # an unknown row (-1) reads the zeros
        inputs = rows[torch.from_numpy(pick_in).to(dev)]
        outputs = rows[torch.from_numpy(pick_out).to(dev)]
        return tree, inputs, outputs.to(inputs.dtype), torch.from_numpy(known)

    def _host_candidates(self, scores: list[Tensor], tokens: list[Tensor], fed: list[Tensor],
                         dev) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The EAGLE-2 search's candidates on the host as NumPy arrays: ``(scores, tokens, fed)``, each list's parts
        concatenated, ``fed`` (the candidate ids each level fed) followed by ``-1`` (what a root's child's parent row
        reads). ONE ``cat`` of every part into a float64 buffer kept per length and device, and one device->host copy
        (exact: float16/32/64 scores, ids below 2**53), split and cast back in NumPy: the values and dtypes of
        :func:`to_host` of the three concatenations (issue 41, the round start: its casts, slices and the three
        concatenations were 13 dispatched operators, here 1). A score dtype NumPy lacks (bfloat16): :func:`to_host`."""
        sdt = scores[0].dtype
        for x in scores[1:]:
            if x.dtype != sdt:                   # (promote_types is a dispatched operator: only where needed)
                sdt = torch.promote_types(sdt, x.dtype)
        npd = _NUMPY_SCORES.get(sdt)
        if npd is None:
            both = to_host(torch.cat(scores), torch.cat(tokens),
                           torch.cat(fed + [torch.full((1,), -1, dtype=torch.long, device=dev)]))
            return tuple(x.numpy() for x in both)
        ns, nt = sum(x.numel() for x in scores), sum(x.numel() for x in tokens)
        key = ("cand", ns + nt + sum(x.numel() for x in fed), dev)
        packs = self.__dict__.setdefault("_host_packs", {})
        buf = packs.get(key)
        if buf is None:
            buf = packs[key] = torch.empty(key[1], dtype=torch.float64, device=dev)
        both = torch.cat(scores + tokens + fed, out=buf).to(HOST).numpy()
        return (both[:ns].astype(npd), both[ns:ns + nt].astype(np.int64),
                np.append(both[ns + nt:].astype(np.int64), -1))

    def commit_tree_forward(self, tokens: Tensor, features: Tensor, tree_tokens: Tensor, tree_inputs: Tensor,
                            parents: Tensor) -> tuple[Tensor, Tensor]:
        """Commit context entries ``(tokens, features)`` (:meth:`commit`), then feed tree entries ``(tree_tokens,
        tree_inputs)`` below them (:meth:`tree_forward`, ``parents``: draft-cache tree slots, -1 = a child of the
        context); returns ``(the commit's last output, the tree rows' outputs)``. Here the two calls in that order
        (a drafter with no cheaper way); :class:`Drafter` does both in ONE head forward, and
        :class:`draft.merged.MergedDrafter` asks each source. The tree rows' inputs must not depend on the
        commit's outputs (that is what makes one forward possible: issue 41, ``tree.fuse_commit``)."""
        root = self.commit(tokens, features)
        return root, self.tree_forward(tree_tokens, tree_inputs, parents)

    @no_grad
    def prefetch_leaves(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor,
                        top_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The first level of the NEXT expansion, drafted ahead for every leaf (``tree.prefetch_level``, issue 41):
        re-feed the tree as :meth:`extend_tree` does (one head forward; the root's children take ``root_hidden``),
        then every leaf's draft output and its best ``top_k`` (:meth:`host_top_tokens`, one log-prob call, one
        device->host copy). Returns ``(leaf mask [n], outputs [n, H], scores [n, kk], tokens [n, kk])`` with rows
        of non-leaves unused. Called after a ring send, while the stages compute: the next verified step's
        expansion (:meth:`commit_extend_tree` with ``pre``) then starts from these candidates instead of a re-feed
        and a log-prob call, so its turnaround holds one head forward and one log-prob call fewer.
        (:meth:`prefetch_expansion` with no second level: one home of the re-feed and the leaves' top-k.)"""
        return self.prefetch_expansion(tree, inputs, root_hidden, top_k, 0)[0]

    @no_grad
    def prefetch_expansion(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor | None, top_k: int,
                           width: int, commit: tuple[Tensor, Tensor] | None = None) -> tuple:
        """``tree.early_whole`` (issue 41): :meth:`prefetch_leaves`, and the SECOND level of the next expansion too:
        the children of at most ``width`` first-level candidates (:func:`level2_seeds`) fed in one more head
        forward (each with its leaf's output as input, below the leaf's slot) and ranked in one more log-prob call.
        Returns ``(pre, pre2, root_hidden, inputs)``: ``pre`` as :meth:`prefetch_leaves` returns it; ``pre2 =
        (seed [n, kk] int64: each candidate's row in the next three arrays, or -1, outputs [width, H],
        scores [width, kk2], tokens [width, kk2])``, host rows NumPy.

        ``commit = (tokens, features)`` (a verified step after a whole early send, :meth:`append_prefetched_expansion`):
        the commit rows and the re-fed tree share the first forward (:meth:`commit_tree_forward`; the root's
        children keep their drafted inputs, as ``tree.fuse_commit``), ``root_hidden`` is its output and the
        returned ``inputs`` carry it for the root's children. Without ``commit``: ``root_hidden`` is given (a
        round start) and the re-feed is :meth:`prefetch_leaves`'s.

        Why: with both levels' candidates at hand, the next verified step chooses its whole expansion with no model
        call and sends it as ONE segment right after the re-root; all of this step's model calls (2 head forwards,
        2 log-prob calls, as the prefetched step's) run after the send, while the stages compute. The second
        forward and log-prob call are ``width`` rows each: real work on rank 0, priced by the meter like any other."""
        n = len(tree)
        dev = inputs.device
        _, t_par, t_score, _ = tree.host_numpy()
        depth1 = torch.from_numpy((t_par == 0)[:, None]).to(dev)
        slots = torch.from_numpy(t_par[1:] - 1)                                   # node i at slot i-1
        if commit is not None:
            if n > 1:
                root_hidden, out = self.commit_tree_forward(commit[0], commit[1], tree.tokens[1:], inputs[1:], slots)
            else:
                root_hidden = self.commit(*commit)
            inputs = torch.where(depth1, root_hidden.to(inputs.dtype), inputs)
        else:
            inputs = torch.where(depth1, root_hidden.to(inputs.dtype), inputs)
            if n > 1:
                out = self.tree_forward(tree.tokens[1:], inputs[1:], slots)
        outs = root_hidden[None].to(inputs.dtype)
        if n > 1:
            outs = torch.cat([outs, out.to(inputs.dtype)])
        leaf = np.ones(n, dtype=bool)
        leaf[t_par[1:]] = False
        if n > 1:   # only the leaves are ranked: nothing reads an inner node's candidates (its row: none, -inf)
            lv = np.flatnonzero(leaf)
            ls, lt = self.host_top_tokens(outs[torch.from_numpy(lv).to(dev)], top_k)
            cs, ct = _host_rows(n, lv, ls, float("-inf")), _host_rows(n, lv, lt, 0)
        else:
            cs, ct = self.host_top_tokens(outs, top_k)
        seed = np.full(tuple(cs.shape), -1, dtype=np.int64)
        pick = level2_seeds(t_par, leaf, t_score, cs.numpy(), top_k, width)
        pre2 = None
        if pick.size:
            kk = cs.shape[1]
            node = pick // kk
            seed.reshape(-1)[pick] = np.arange(pick.size)
            out2 = self.tree_forward(torch.from_numpy(ct.numpy().reshape(-1)[pick]),
                                     outs[torch.from_numpy(node).to(dev)], torch.from_numpy(node - 1))  # root: -1
            out2 = out2.to(inputs.dtype)
            s2, t2 = self.host_top_numpy(out2, top_k)
            pre2 = (seed, out2, s2, t2)
        self.drop_tree()
        return (torch.from_numpy(leaf), outs, cs, ct), pre2, root_hidden, inputs

    @no_grad
    def append_prefetched_expansion(self, tree: DraftTree, inputs: Tensor, pre: tuple, pre2: tuple, top_k: int,
                                    max_new: int, cover: float = 1.0) -> tuple[DraftTree, Tensor] | None:
        """``tree.early_whole`` (issue 41): the next expansion's two levels, chosen from the prefetched candidates
        (:meth:`prefetch_expansion` of this tree, re-rooted with it) with no model call, appended to ``tree``;
        ``(grown tree, its per-node inputs)``, or None when fewer than ``cover`` of the beam's members had their
        children prefetched (``cover = 1``: every one; the caller then sends the first level alone,
        :meth:`append_prefetched_level`, or the plain expansion).

        The rule (which nodes, how many), that of :meth:`append_prefetched_level` followed by
        :meth:`commit_extend_tree` with its record: the first level is the beam (the best ``top_k`` leaves' best
        ``top_k`` candidates by cumulative score, at most ``max_new``), appended first, best first; then the beam's
        prefetched children and the first level's other candidates compete for the remaining ``max_new -
        len(beam)`` slots by cumulative score (ties: the level's candidates first, then the children in beam order),
        appended best first. A child never outranks its parent, so the appended nodes are ancestors-first and every
        prefix of them is sendable. On a drafter whose outputs do not depend on the context the result is exactly
        the early level's finished tree (tested); otherwise the children were ranked with the previous step's
        context: a different draft, the same exactness.

        ``cover < 1`` (``tree.early_cover``, issue 41, docs/results.md §66): a beam partly
        prefetched is sent whole too, its uncovered members' children simply absent (the room goes to the next-best
        candidates: the level's others and the covered members' children). Why: the fallback for an uncovered beam
        is a second segment (the early level's rest after the commit) or a plain expansion whose turnaround holds
        the head forward; a missing child only waits for the next step's expansion (its parent is a leaf then).
        Measured: τ up (1.86 -> 1.94 at 20 answers) but ξ down on both profiles (the stages less busy), so the
        default stays 1. With every member covered the result is the ``cover = 1`` one (the same code path)."""
        beam = self._prefetched_beam(tree, pre, top_k, max_new)
        if beam is None:
            return None
        fr, ct, cum, best, kk, t_dep = beam
        p_out = pre[1]
        seed, out2, s2, t2 = pre2
        n = len(tree)
        dev = inputs.device
        rows = seed[fr].reshape(-1)[best]                      # each beam node's prefetched children (row of pre2)
        cb = np.flatnonzero(rows >= 0)                         # the covered beam members (all of them: cover = 1)
        if cb.size < best.size and (cover >= 1 or cb.size < cover * best.size):
            return None
        kk2 = s2.shape[1]
        rest = np.ones(cum.size, dtype=bool)
        rest[best] = False
        rest = np.flatnonzero(rest)                            # the level's other candidates
        c_score = np.concatenate([cum[rest], (cum[best[cb]][:, None] + s2[rows[cb]]).reshape(-1)])
        chosen = best_first(c_score, max(0, min(max_new - best.size, c_score.size)))
        lv = chosen < rest.size                                # a first-level candidate, else a beam node's child
        c1 = np.append(rest, 0)[np.where(lv, chosen, rest.size)]    # (a child's entries here are unused)
        c2 = np.where(lv, 0, chosen - rest.size)
        b2 = np.append(cb, 0)[c2 // max(kk2, 1)]               # the child's beam member (a level's entry: unused)
        m = best.size + chosen.size
        grown, (tok, parents, score, depth) = tree.append_slots_numpy(m)
        f1 = fr[best // kk]
        parents[:best.size] = f1
        tok[:best.size] = ct[best]
        score[:best.size] = cum[best]
        depth[:best.size] = t_dep[f1] + 1
        fc = fr[c1 // kk]
        parents[best.size:] = np.where(lv, fc, n + b2)
        tok[best.size:] = np.where(lv, ct[c1], t2[rows[b2], c2 % kk2] if kk2 else 0)
        score[best.size:] = c_score[chosen]
        depth[best.size:] = np.where(lv, t_dep[fc] + 1, t_dep[f1[b2]] + 2)
        # inputs: a first-level node takes its leaf's output, a child its beam parent's prefetched output
        src = np.concatenate([np.arange(n), n + f1, np.where(lv, n + fc, 2 * n + rows[b2])])
        return grown, torch.cat([inputs, p_out.to(inputs.dtype), out2])[torch.from_numpy(src).to(dev)]

    @no_grad
    def commit_extend_tree(self, tokens: Tensor, features: Tensor, tree: DraftTree, inputs: Tensor, levels: int,
                           top_k: int, max_new: int, pre: tuple | None = None) -> tuple[DraftTree, Tensor, Tensor]:
        """Commit the accepted tokens and expand the re-rooted tree with ONE draft forward fewer than
        :meth:`commit` followed by :meth:`extend_tree` (``tree.fuse_commit``, issue 41): ``(grown tree, its
        per-node inputs, the commit's output = the new root's draft output)``.

        Why: in :meth:`extend_tree` the re-feed of the surviving tree waits on the commit (the root's children take
        the commit's output as their input), so a verified step's turnaround holds two head forwards before the
        first level's log-probs. Here the root's children keep the input they were drafted with (the new root's
        draft output as a tree node, remembered in ``inputs``), so the commit's rows and the tree's rows are
        independent and go through the head in one forward (:meth:`commit_tree_forward`): the tree rows attend to
        the freshly committed context (target features) exactly as after a separate commit; only the root's
        children's own input differs (draft-predicted instead of recomputed from the target's features). The
        returned ``inputs`` carry the fresh commit output for the root's children (later re-feeds use it).
        Changes which trees are drafted, never what is accepted: verification is exact for any tree.

        ``pre`` (:meth:`prefetch_leaves` of this tree, re-rooted with it; ``tree.prefetch_level``): the first
        level's candidates come from it (no re-feed, no log-prob call), and the commit, the re-fed tree and the
        first level's chosen nodes share the level's one head forward. Its candidates were ranked with the
        context of the previous step (the path just accepted as draft tree entries): a different draft, the
        same exactness."""
        return self._extend(tree, inputs, None, levels, top_k, max_new, (tokens, features), pre)

    @no_grad
    def extend_tree(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor, levels: int, top_k: int,
                    max_new: int) -> tuple[DraftTree, Tensor]:
        """Incremental expansion: grow ``levels`` beam levels below the tree's best leaves, keep the best
        ``max_new`` new nodes, and return the grown tree and its per-node input features.

        The surviving tree is re-fed in one forward on top of the committed context (each node with its
        remembered input feature; the root's children with the fresh ``root_hidden``), so every node's draft
        output is known; the ``top_k`` leaves with the best cumulative score seed an EAGLE-2 beam of width
        ``top_k`` that runs ``levels`` levels (one lm_head call per level, one head forward between levels).
        New candidates are ranked by cumulative score (ties: generation order) and the best ``max_new`` are
        appended in that order: a child never outranks its parent, so the appended set is ancestor-closed
        and ancestors-first, and existing node indices do not change (what the protocol needs).
        Cost per call: ``levels`` lm_head calls and ``levels`` head forwards (the first over the tree).

        Bookkeeping (issue 41): a level is a fixed sequence of a few tensor ops over the whole frontier, whatever
        its width: :meth:`host_top_tokens` (the level's one device->host copy), the candidates' cumulative scores
        and tokens written in place into arrays preallocated at the call's capacity (``levels * top_k**2``
        candidates), the next frontier (:func:`draft.tree.beam_frontier`, the per-level choice) and its head
        forward. A candidate records only its frontier row; the rows' parent, depth and output feature are
        gathered once, for the chosen candidates, at the end. No per-node Python, no concatenation per level.
        """
        return self._extend(tree, inputs, root_hidden, levels, top_k, max_new, None)[:2]

    def _extend(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor | None, levels: int, top_k: int,
                max_new: int, commit: tuple[Tensor, Tensor] | None,
                pre: tuple | None = None) -> tuple[DraftTree, Tensor, Tensor | None]:
        """:meth:`extend_tree` (``commit`` None) or :meth:`commit_extend_tree` (``commit = (tokens, features)``:
        the re-feed is :meth:`commit_tree_forward`, ``root_hidden`` its output; with ``pre``, the first level's
        forward)."""
        if isinstance(pre, EarlyLevel):                # tree.early_level: the first level is in the tree already
            return self._extend_early(tree, inputs, levels, top_k, max_new, commit, pre)
        n = len(tree)
        dev = inputs.device
        _, t_par, t_score, t_dep = tree.host_numpy()      # the tree's host arrays as NumPy views (no operator)
        depth1 = torch.from_numpy((t_par == 0)[:, None]).to(dev)
        if pre is not None and commit is not None and levels >= 2 and max_new > 0 and n > 1:
            return self._extend_prefetched(tree, inputs, levels, top_k, max_new, commit, pre)
        if commit is not None and (levels <= 0 or max_new <= 0 or n == 1):   # nothing to fuse with: commit alone
            root_hidden = self.commit(*commit)
            inputs = torch.where(depth1, root_hidden.to(inputs.dtype), inputs)
            commit = None
        if levels <= 0 or max_new <= 0:
            return tree, inputs, root_hidden
        # the frontier: the best top_k leaves (host NumPy on the tree's views: beam_frontier's stable order)
        has_child = np.zeros(n, dtype=bool)
        has_child[t_par[1:]] = True
        leaves = np.flatnonzero(~has_child)
        fr = leaves[best_first(t_score[leaves], min(top_k, leaves.size))]         # tree node ids
        # the re-feed: every node enters the cache (node i at slot i-1), only the frontier's outputs are computed
        # (tree_outputs: why); the root is a leaf only of a one-node tree, whose frontier's output is root_hidden
        want = torch.from_numpy(fr - 1)
        if commit is None:
            inputs = torch.where(depth1, root_hidden.to(inputs.dtype), inputs)  # a fresh copy: root's children
            if n > 1:
                f_out = tree_outputs(self, tree.tokens[1:], inputs[1:], torch.from_numpy(t_par[1:] - 1), want)
        else:   # the root's children as drafted (remembered inputs): commit rows and tree rows in one forward
            root_hidden, f_out = commit_tree_outputs(self, commit[0], commit[1], tree.tokens[1:], inputs[1:],
                                                     torch.from_numpy(t_par[1:] - 1), want)
            inputs = torch.where(depth1, root_hidden.to(inputs.dtype), inputs)  # later re-feeds: the fresh output
        if n == 1:
            f_out = root_hidden[None]
        # frontier rows of every level, in order: parent code (a tree node < n, or n + candidate), depth, output
        b = _Beam(levels * top_k * top_k, None, None, [], [fr], [t_dep[fr]],
                  [f_out.to(inputs.dtype)], fr - 1, t_score[fr][:, None])  # node i's slot: i-1
        self._beam_levels(b, 0, levels, top_k, max_new, n, dev, inputs.dtype)
        self.drop_tree()
        if not b.n_cand:
            return tree, inputs, root_hidden
        return (*self._append_chosen(tree, inputs, b, max_new), root_hidden)

    def _beam_levels(self, b: "_Beam", first: int, levels: int, top_k: int, max_new: int, n: int, dev,
                     dtype: torch.dtype) -> None:
        """Beam levels ``first .. levels-1`` below ``b``'s frontier (:meth:`_extend`'s loop, shared with
        :meth:`_extend_prefetched`, whose level 0 came prefetched): each level ranks the frontier's top-k (one
        device->host copy), writes its candidates' cumulative scores, tokens and frontier rows in place into ``b``'s
        arrays (allocated at ``b.cap`` by the first level that needs them), and, unless it is the last, picks the next
        frontier and feeds it (one head forward). ``n``: the tree's size (a candidate's parent code is ``n + its
        index``)."""
        for level in range(first, levels):
            cs, ct = self.host_top_numpy(b.rows_out[-1], top_k)                  # one device->host copy per level
            nf, kk = cs.shape
            if kk == 0:       # no source proposes a token below some frontier node (merged top-k): stop here
                break
            if b.c_score is None:
                b.c_score = np.empty(b.cap, dtype=np.promote_types(b.f_score.dtype, cs.dtype))
                b.c_row = np.empty(b.cap, dtype=np.int64)
            elif b.c_score.dtype != np.promote_types(b.c_score.dtype, cs.dtype):
                b.c_score = b.c_score.astype(np.promote_types(b.c_score.dtype, cs.dtype))  # exact widening (never yet)
            end = b.n_cand + nf * kk
            cum = b.c_score[b.n_cand:end]                                         # this level's candidates
            cum[:] = (b.f_score + cs).reshape(-1)       # cumulative scores in their common dtype, as torch.add
            b.c_tok.append(ct.reshape(-1))
            b.c_row[b.n_cand:end] = _row_pattern_np(nf, kk) + b.n_rows            # each candidate's frontier row
            if level == levels - 1:
                b.n_cand = end
                break
            best = self._frontier_np(cum, b.c_score[:end], max_new + 1, top_k)
            if best.size == 0:                           # a shaped search found nothing worth expanding
                b.n_cand = end
                break
            row = best // kk
            start = self.tree_size
            out = self.tree_forward(torch.from_numpy(b.c_tok[-1][best]),
                                    b.rows_out[-1][torch.from_numpy(row).to(dev)], torch.from_numpy(b.f_slot[row]))
            b.n_rows += nf
            b.rows_par.append(best + (n + b.n_cand))
            b.rows_dep.append(b.rows_dep[-1][row] + 1)
            b.rows_out.append(out.to(dtype))
            b.f_slot = np.arange(start, start + best.size, dtype=np.int64)
            b.f_score = cum[best][:, None]
            b.n_cand = end

    def _frontier_np(self, level_scores: np.ndarray, all_scores: np.ndarray, total_token: int,
                     width: int) -> np.ndarray:
        """:meth:`_frontier` on the beam's NumPy scores (:class:`_Beam`): EAGLE-2's stable best-``width`` in
        NumPy; a confidence shape's :func:`draft.shape.pick_frontier` on torch views of the same memory."""
        if not self.tree_shape.shaped:
            return best_first(level_scores, width)
        return self._frontier(self.tree_shape, torch.from_numpy(level_scores), [torch.from_numpy(all_scores)],
                              total_token, width).numpy()

    @staticmethod
    def _append_chosen(tree: DraftTree, inputs: Tensor, b: "_Beam", max_new: int) -> tuple[DraftTree, Tensor]:
        """The end of an expansion: the best ``max_new`` of ``b``'s candidates appended to ``tree`` (its
        buffers, in place where it owns them), and the grown tree's per-node inputs (a candidate's input: its
        frontier row's output). The beam's arrays are NumPy (:class:`_Beam`: why); the tree's new slots are
        written through NumPy views of its buffers (one view per array; the values and their casts as torch's)."""
        n, dev, n_cand = len(tree), inputs.device, b.n_cand
        chosen = best_first(b.c_score[:n_cand], max(0, min(max_new, n_cand)))  # the best max_new, stable
        row = b.c_row[chosen]
        par = np.concatenate(b.rows_par)[row]                             # a tree node, or n + a candidate
        inv = np.full(n_cand, -1, dtype=np.int64)                         # candidate -> new tree index
        inv[chosen] = np.arange(n, n + chosen.size)
        # the chosen nodes are written straight into the tree's buffers (draft.tree: capacity-sized trees)
        grown, (tok, parents, score, depth) = tree.append_slots_numpy(chosen.size)
        par = np.where(par < n, par, inv[np.clip(par - n, 0, None)])     # ancestors-first
        if (par < 0).any():
            raise AssertionError("chosen candidates are not ancestor-closed")        # impossible by construction
        parents[:] = par
        tok[:] = np.concatenate(b.c_tok)[chosen]
        score[:] = b.c_score[chosen]
        depth[:] = np.concatenate(b.rows_dep)[row] + 1
        # the grown tree's inputs: the old rows, then each chosen candidate's frontier row's output (one gather)
        pick = np.concatenate([np.arange(n), row + n])
        return grown, torch.cat([inputs, *b.rows_out])[torch.from_numpy(pick).to(dev)]

    def _extend_prefetched(self, tree: DraftTree, inputs: Tensor, levels: int, top_k: int, max_new: int,
                           commit: tuple[Tensor, Tensor], pre: tuple) -> tuple[DraftTree, Tensor, Tensor]:
        """:meth:`commit_extend_tree` with ``pre``: level 0's candidates are the prefetched ones of the frontier
        leaves; its chosen nodes are fed in ONE forward with the commit rows and the re-fed tree
        (:meth:`commit_tree_forward`); later levels as in :meth:`_extend`, the final choice
        :meth:`_append_chosen`."""
        n = len(tree)
        dev = inputs.device
        _, t_par, _, _ = tree.host_numpy()                # the tree's host arrays as NumPy views (no operator)
        depth1 = torch.from_numpy((t_par == 0)[:, None]).to(dev)
        beam = self._prefetched_beam(tree, pre, top_k, max_new, cut=False)
        if beam is None:               # no candidate (a re-rooted tree of n > 1 nodes always has a leaf)
            root_hidden = self.commit(*commit)
            return tree, torch.where(depth1, root_hidden.to(inputs.dtype), inputs), root_hidden
        frontier, ct, cum, best, kk, t_dep = beam
        nf = frontier.size
        f_out = pre[1][torch.from_numpy(frontier).to(dev)].to(inputs.dtype)
        row = best // kk
        root_hidden, out = commit_tree_outputs(                                 # the level's outputs only
            self, commit[0], commit[1], torch.cat([tree.tokens[1:], torch.from_numpy(ct[best])]),
            torch.cat([inputs[1:], f_out[torch.from_numpy(row).to(dev)]]),
            torch.from_numpy(np.concatenate([t_par[1:], frontier[row]]) - 1),
            torch.from_numpy(np.arange(n - 1, n - 1 + best.size)))
        inputs = torch.where(depth1, root_hidden.to(inputs.dtype), inputs)
        l1_out = out.to(inputs.dtype)
        start = n - 1                                                             # the level's cache slots
        # the remaining levels: one beam below the level-1 nodes; candidates of level 0 compete with them
        cap = levels * top_k * top_k
        b = _Beam(cap, np.empty(cap, dtype=np.promote_types(cum.dtype, np.float32)), np.empty(cap, dtype=np.int64),
                  [ct], [frontier, best + n], [t_dep[frontier]],
                  [f_out, l1_out], np.arange(start, start + best.size, dtype=np.int64), cum[best][:, None],
                  n_cand=nf * kk, n_rows=nf)
        b.rows_dep.append(b.rows_dep[-1][best // kk] + 1)
        b.c_score[:nf * kk] = cum
        b.c_row[:nf * kk] = _row_pattern_np(nf, kk)
        self._beam_levels(b, 1, levels, top_k, max_new, n, dev, inputs.dtype)
        self.drop_tree()
        return (*self._append_chosen(tree, inputs, b, max_new), root_hidden)

    @no_grad
    def _prefetched_beam(self, tree: DraftTree, pre: tuple, top_k: int, max_new: int,
                         cut: bool = True) -> tuple | None:
        """The next expansion's first-level beam, read from the prefetched leaf candidates ``pre``
        (:meth:`prefetch_leaves`) with no model call: ``(frontier, cand_tokens, cum, best, kk, tree_depths)`` --
        the best ``top_k`` leaves by cumulative score (best first), their candidates' tokens and cumulative scores
        flattened ``[len(frontier) * kk]``, the beam's candidates ``best`` (``_frontier``'s choice, at most
        ``max_new``), and the tree's depths (a NumPy view); None when there is nothing to append (no leaf, no
        candidate, ``max_new <= 0``). The one home of the beam rule of :meth:`append_prefetched_level`,
        :meth:`append_prefetched_expansion` and :meth:`_extend_prefetched` (they must agree: the early level is
        the whole expansion's first). ``cut=False`` (:meth:`_extend_prefetched`): ``best`` is not cut to
        ``max_new`` and may be empty (the beam's nodes compete with the later levels' for the slots there)."""
        leaf, _, p_s, p_t = pre
        _, _, t_score, t_dep = tree.host_numpy()          # the tree's host arrays as NumPy views (no operator)
        leaves = np.flatnonzero(leaf.numpy())
        k = min(top_k, leaves.size)
        if k == 0 or max_new <= 0 or p_s.shape[1] == 0:
            return None
        fr = leaves[best_first(t_score[leaves], k)]
        cs, ct = p_s.numpy()[fr], p_t.numpy()[fr]
        kk = cs.shape[1]
        cum = (t_score[fr][:, None] + cs).reshape(-1)                           # [len(fr) * kk], as torch.add's dtype
        best = self._frontier_np(cum, cum, max_new + 1, top_k)
        if not cut:
            return fr, ct.reshape(-1), cum, best, kk, t_dep
        best = best[:max_new]
        return (fr, ct.reshape(-1), cum, best, kk, t_dep) if best.size else None

    def append_prefetched_level(self, tree: DraftTree, inputs: Tensor, pre: tuple, top_k: int,
                                max_new: int) -> tuple[DraftTree, Tensor, EarlyLevel] | None:
        """``tree.early_level`` (issue 41): append the next expansion's first level, chosen from the prefetched
        candidates (:meth:`prefetch_leaves` of this tree, re-rooted with it), with no model call, so that it can
        be sent at once; :meth:`commit_extend_tree` with the returned :class:`EarlyLevel` as ``pre`` finishes the
        expansion (the commit, the re-fed tree and the level in one head forward, the later levels) after the send.

        The rule (which nodes, how many): exactly the nodes the prefetched expansion feeds as its first level
        (:meth:`_extend_prefetched`): the best ``top_k`` leaves by cumulative score seed it, and the best
        ``top_k`` of their candidates by cumulative score (``_frontier``; a confidence shape's choice) become
        nodes, best first, at most ``max_new`` of them. Why these: they are the expansion's beam, the nodes the
        search was going to feed anyway, and each one's score is at least that of every node the expansion's
        later levels could add below it; the rest of the candidates still compete with the later levels for
        the remaining ``max_new - len(level)`` slots. So the grown tree holds the same nodes as the plain
        prefetched expansion whenever that one kept its whole beam (the usual case: the beam is the best-scored
        part of the level), in another order (the level first). Every new node is a child of an existing leaf:
        the tree stays ancestors-first and the sent nodes a prefix. None: nothing to append (no leaf, no
        candidate, ``max_new <= 0``)."""
        beam = self._prefetched_beam(tree, pre, top_k, max_new)
        if beam is None:
            return None
        frontier, ct, cum, best, kk, t_dep = beam
        n = len(tree)
        dev = inputs.device
        f_out = pre[1][torch.from_numpy(frontier).to(dev)].to(inputs.dtype)
        row = best // kk
        par = frontier[row]
        grown, (tok, parents, score, depth) = tree.append_slots_numpy(best.size)
        parents[:] = par
        tok[:] = ct[best]
        score[:] = cum[best]
        depth[:] = t_dep[par] + 1
        early = EarlyLevel(n, frontier, f_out, cum, ct, best, kk)
        return grown, torch.cat([inputs, f_out[torch.from_numpy(row).to(dev)]]), early

    def _extend_early(self, tree: DraftTree, inputs: Tensor, levels: int, top_k: int, max_new: int,
                      commit: tuple[Tensor, Tensor], early: EarlyLevel) -> tuple[DraftTree, Tensor, Tensor]:
        """:meth:`commit_extend_tree` after :meth:`append_prefetched_level` (``pre = early``; ``tree`` holds the
        level as nodes ``[early.n0, len(tree))``; ``max_new``: the slots left after it): the commit, the re-fed
        tree and the level in ONE head forward (:meth:`commit_tree_forward`), then levels ``1 .. levels-1`` below
        the level's nodes; the level's unchosen candidates compete with them for the ``max_new`` slots, as in
        :meth:`_extend_prefetched`."""
        n, n0, dev = len(tree), early.n0, inputs.device
        _, t_par, _, t_dep = tree.host_numpy()            # the tree's host arrays as NumPy views (no operator)
        depth1 = torch.from_numpy((t_par == 0)[:, None]).to(dev)
        root_hidden, out = commit_tree_outputs(self, commit[0], commit[1], tree.tokens[1:], inputs[1:],
                                               torch.from_numpy(t_par[1:] - 1),     # node i at slot i-1
                                               torch.from_numpy(np.arange(n0 - 1, n - 1)))  # the level's outputs only
        inputs = torch.where(depth1, root_hidden.to(inputs.dtype), inputs)
        if levels < 2 or max_new <= 0:
            self.drop_tree()
            return tree, inputs, root_hidden
        nf = early.frontier.size
        rest = np.ones(early.cum.size, dtype=bool)
        rest[early.best] = False
        rest = np.flatnonzero(rest)                                               # the level's other candidates
        cap = rest.size + (levels - 1) * top_k * top_k
        cum = early.cum
        b = _Beam(cap, np.empty(cap, dtype=np.promote_types(cum.dtype, np.float32)), np.empty(cap, dtype=np.int64),
                  [early.tok[rest]], [early.frontier, np.arange(n0, n, dtype=np.int64)],
                  [t_dep[early.frontier], t_dep[n0:]],
                  [early.f_out, out.to(inputs.dtype)], np.arange(n0 - 1, n - 1, dtype=np.int64),
                  cum[early.best][:, None], n_cand=rest.size, n_rows=nf)
        b.c_score[:rest.size] = cum[rest]
        b.c_row[:rest.size] = _row_pattern_np(nf, early.kk)[rest]
        self._beam_levels(b, 1, levels, top_k, max_new, n, dev, inputs.dtype)
        self.drop_tree()
        return (*self._append_chosen(tree, inputs, b, max_new), root_hidden)

    def host_top_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`top_tokens` of a frontier, moved to the host in one copy (:func:`to_host`): what a beam level
        ranks. A drafter whose ``top_tokens`` already answers on the host (the merged one) returns it as is."""
        return to_host(*self.top_tokens(hidden, k))

    def host_top_numpy(self, hidden: Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`host_top_tokens` as NumPy arrays (the beam's bookkeeping, :class:`_Beam`); the merged drafter
        answers in NumPy already (no view to take). Scores and ids cross in ONE ``cat`` into a float64 buffer kept
        per shape (exact: float32/float64 scores, ids below 2**53) and one device->host copy, split back in NumPy
        (issue 41: :func:`to_host`'s widening casts, slices and narrowing casts were 9 dispatched operators per
        level, here 2); a score dtype NumPy lacks (bfloat16) takes :func:`to_host`."""
        s, t = self.top_tokens(hidden, k)
        npd = _NUMPY_SCORES.get(s.dtype)
        if npd is None or s.dim() != 2 or t.shape != s.shape:
            return tuple(x.numpy() for x in to_host(s, t))
        key = (tuple(s.shape), s.device)
        packs = self.__dict__.setdefault("_host_packs", {})
        buf = packs.get(key)
        if buf is None:
            buf = packs[key] = torch.empty((s.shape[0], 2 * s.shape[1]), dtype=torch.float64, device=s.device)
        both = torch.cat([s, t], dim=-1, out=buf).to(HOST).numpy()
        w = s.shape[1]
        return both[:, :w].astype(npd), both[:, w:].astype(np.int64)


class Drafter(BeamTreeDrafter):
    """The EAGLE drafter: an EAGLE-1/2 or EAGLE-3 head with its own KV cache (see the module docstring)."""

    out_rows = True      # tree_forward / commit_tree_forward take rows= (draft.protocol.tree_outputs)
    static_head = None   # draft.static_head.StaticHead: tree forwards on static shapes / CUDA graphs (model.graphs)

    def __init__(self, head: EagleHead, lm_head: torch.nn.Linear, max_len: int,
                 draft_ids: Tensor | None = None, context_vocab: bool = True, full_root: bool = True) -> None:
        """``draft_ids``: draft only over these target ids (strictly increasing; :func:`draft.vocab.top_ids`),
        plus, with ``context_vocab``, every token of the generation's context (:class:`draft.vocab.DraftVocab`);
        for a head that uses the target's ``lm_head``; an EAGLE-3 head brings its own vocabulary instead.
        ``full_root``: a tree's first level (one row) is still drafted over the whole vocabulary: a token missed
        there ends the verification step at once, deeper levels cost ``top_k`` rows per call.
        Sampled trees at T > 0: :meth:`BeamTreeDrafter.set_sampling` (the run key ``draft.eagle_sample``)."""
        self.head = head
        self.lm_head = lm_head
        p = next(head.parameters())
        self.dtype, self.device = p.dtype, p.device
        new_cache = getattr(head, "new_cache", None) or head.block.new_cache
        self.cache = new_cache(max_len, self.dtype, self.device)
        self._head_vocab = getattr(head, "vocab_map", None)   # EAGLE-3 reduced vocabulary: draft id -> target id
        self.dvocab = None
        self.full_root = full_root
        if draft_ids is not None:
            from draft.eagle3 import check_vocab_map
            from draft.vocab import DraftVocab, require_shared_lm_head
            require_shared_lm_head(head)
            ids = draft_ids.to(torch.int64).cpu()
            check_vocab_map(ids, lm_head.weight.shape[0], ids.numel())
            self.dvocab = DraftVocab(ids, lm_head, max_len if context_vocab else 0)

    @property
    def vocab_map(self) -> Tensor | None:
        """Draft id -> target id (the head's EAGLE-3 vocabulary, or :attr:`dvocab`'s); None = the whole one."""
        return self.dvocab.ids if self.dvocab is not None else self._head_vocab

    def _root_topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        if self.dvocab is None or not self.full_root:
            return self.top_tokens(hidden, k)
        with self.meter.op("lm_head", hidden_rows(hidden), 0):
            lp = self._target_logprobs(hidden)
        return torch.topk(lp, min(k, lp.shape[-1]), dim=-1)

    @property
    def draft_vocab_rows(self) -> int:
        """Rows of the draft's vocabulary projection (0 = the target's whole vocabulary): an lm_head op's ``ctx``."""
        vm = self.vocab_map
        return 0 if vm is None else int(vm.numel())

    def reset(self) -> None:
        self.cache.reset()

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor,
              sampling: DraftSampling | None = None) -> Tensor:
        """New generation: entries pair each prompt token's feature with the token after it; ``sampling``: the
        generation's own (:meth:`take_sampling`)."""
        self.reset()
        self.take_sampling(sampling)
        self.reseed()
        if self.dvocab is not None:
            self.dvocab.begin(list(prompt_ids) + [int(first_token)])
        return self._commit(torch.tensor(prompt_ids[1:] + [first_token], device=HOST), features, last_only=True)

    @no_grad
    def draft_logprobs(self, hidden: Tensor) -> Tensor:
        """Log-probs over the *draft* vocabulary (the target's, except for a reduced vocabulary); one metered
        ``lm_head`` op over :attr:`draft_vocab_rows` rows of the vocabulary. Through the target's own ``lm_head``
        the op is row-wise: with several lanes it may share one op with other lanes' rows (:func:`model.meter.run_rows`)."""
        if self.dvocab is None and not hasattr(self.head, "draft_logits"):
            return run_rows(self.meter, "lm_head", hidden.to(self.lm_head.weight.dtype), self.lm_head,
                            self.draft_vocab_rows, key=self.lm_head, post=float_log_softmax)
        with self.meter.op("lm_head", hidden_rows(hidden), self.draft_vocab_rows):
            if hasattr(self.head, "draft_logits"):
                return torch.log_softmax(self.head.draft_logits(hidden.to(self.dtype)).float(), dim=-1)
            if self.dvocab is not None:
                return torch.log_softmax(self.dvocab.logits(hidden).float(), dim=-1)
            return self._target_logprobs(hidden)

    def _target_logprobs(self, hidden: Tensor) -> Tensor:
        """Log-probs over the whole target vocabulary through the shared ``lm_head`` (unmetered: callers meter)."""
        return torch.log_softmax(self.lm_head(hidden.to(self.lm_head.weight.dtype)).float(), dim=-1)

    @no_grad
    def logprobs(self, hidden: Tensor) -> Tensor:
        """Log-probs over the target vocabulary (-inf outside a reduced draft vocabulary)."""
        lp = self.draft_logprobs(hidden)
        if self.vocab_map is None:
            return lp
        full = torch.full((*lp.shape[:-1], self.lm_head.out_features), float("-inf"), dtype=lp.dtype,
                          device=lp.device)
        full[..., self.vocab_map.to(lp.device)] = lp
        return full

    @no_grad
    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        """Append context entries ``(tokens[i], features[i])``; returns the last entry's output feature.

        The caller pairs each token with the target feature of the position *before* it.
        """
        return self._commit(tokens, features)

    @no_grad
    def _commit(self, tokens: Tensor, features: Tensor, last_only: bool = False) -> Tensor:
        """:meth:`commit`; ``last_only`` (a generation's :meth:`start`): the head's last layer runs the last row
        alone (:meth:`_head_rows`, :func:`draft.protocol.tree_outputs`: why it is exact). Why only there: a start
        feeds the whole prompt, hundreds of rows of which only the last output is read (most of the draft's
        prefill, on a CPU); a commit of a few accepted tokens keeps the whole forward, where the cut's four
        operators would cost more than the rows they skip."""
        cache = self.cache
        if cache.num_tree:
            cache.truncate_tree()
        if self.dvocab is not None:
            self.dvocab.add(tokens)
        n = tokens.numel()
        pos, mask = cache.context_inputs(n, self.dtype)
        fed = (tokens.view(1, -1).to(self.device), features.view(1, n, -1).to(self.device, self.dtype))
        out = self._head_rows(fed, pos, mask, cache, torch.from_numpy(np.array([n - 1])) if last_only else None)
        cache.commit_forward(n, as_context=True)
        return out[0, -1]

    @no_grad
    def commit_tree_forward(self, tokens: Tensor, features: Tensor, tree_tokens: Tensor, tree_inputs: Tensor,
                            parents: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`BeamTreeDrafter.commit_tree_forward` (``rows``: only those tree rows' outputs,
        :func:`draft.protocol.tree_outputs`) as ONE head forward over ``n`` commit rows then ``t`` tree
        rows: the commit rows see the context and each other causally (:meth:`model.kv_cache.KVCache.context_inputs`),
        the tree rows the whole context including the commit rows plus their tree ancestors
        (:meth:`~model.kv_cache.KVCache.staged_tree_inputs`, staged as if the commit were done); afterwards the cache
        holds the commit rows as context and the tree rows as tree entries, exactly as after :meth:`commit` then
        :meth:`tree_forward` (same keys, values and outputs up to float reassociation: tested). Rows of different
        widths (an EAGLE-3 head: wide target features, narrow tree inputs) or no tree rows: the two calls."""
        t = tree_tokens.numel()
        if t == 0 or features.shape[-1] != tree_inputs.shape[-1]:
            root, out = super().commit_tree_forward(tokens, features, tree_tokens, tree_inputs, parents)
            return root, out if rows is None else out[rows.to(out.device)]
        cache = self.cache
        if cache.num_tree:
            cache.truncate_tree()
        if self.dvocab is not None:
            self.dvocab.add(tokens)
        n, c = tokens.numel(), cache.length
        pos_c, mask_c = cache.context_inputs(n, self.dtype)                  # [1, n], [1, 1, n, c + n]
        cache.length = cache.context_len = c + n                             # stage the tree rows after the commit
        try:
            pos_t, mask_t = cache.staged_tree_inputs(parents, self.dtype)    # [1, t], [1, 1, t, c + n + t]
        finally:
            cache.length = cache.context_len = c
        mask = torch.full((1, 1, n + t, c + n + t), torch.finfo(self.dtype).min, dtype=self.dtype, device=HOST)
        mask[..., :n, :c + n] = mask_c
        mask[..., n:, :] = mask_t
        fed = (torch.cat([tokens.view(-1).to(self.device), tree_tokens.view(-1).to(self.device)]).view(1, -1),
               torch.cat([features.view(n, -1).to(self.device, self.dtype),
                          tree_inputs.view(t, -1).to(self.device, self.dtype)]).view(1, n + t, -1))
        want = None if rows is None else \
            torch.from_numpy(np.concatenate([np.array([n - 1]), rows.numpy() + n]))   # the commit's last row first
        out = self._head_rows(fed, torch.cat([pos_c, pos_t], dim=-1), mask, cache, want)
        cache.commit_forward(n, as_context=True)
        cache.commit_forward(t, as_context=False)                            # the staged tree rows
        return (out[0, n - 1], out[0, n:]) if rows is None else (out[0, 0], out[0, 1:])

    @no_grad
    def level(self, tokens: Tensor, features: Tensor, parents: Tensor, scores: Tensor,
              k: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`BeamTreeDrafter.level`; with a static head (``model.graphs``) and the target's whole vocabulary,
        the whole step (head forward, log-probs, top-k, cumulative scores) runs padded to a bucket as one body
        (:meth:`draft.static_head.StaticHead.level`: one compiled graph per bucket under ``model.graphs=compile``).
        A reduced vocabulary, or a frontier no bucket holds, runs the dynamic step."""
        sh, cache, n = self.static_head, self.cache, tokens.numel()
        k = min(k, self.lm_head.out_features)
        b = sh.static.bucket_for(n, cache) if sh is not None and self.vocab_map is None and self.head.block.lean \
            else None
        if b is None:
            return super().level(tokens, features, parents, scores, k)
        pos, mask = cache.staged_tree_inputs(parents, self.dtype)
        out, cum, tok = sh.level(b, tokens.view(1, -1).to(self.device),
                                 features.view(1, n, -1).to(self.device, self.dtype),
                                 scores.reshape(1, n, 1).to(self.device), pos, mask, cache, self.lm_head, k, self.meter)
        cache.commit_forward(n, as_context=False)
        return out[0], cum[0], tok[0]

    @no_grad
    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor, rows: Tensor | None = None) -> Tensor:
        """Feed tree entries (kept in the cache until :meth:`drop_tree`); returns their output features, or only
        those of ``rows`` (:func:`draft.protocol.tree_outputs`: why)."""
        cache = self.cache
        pos, mask = cache.staged_tree_inputs(parents, self.dtype)       # tree rows staged in the cache's buffers
        n = tokens.numel()
        fed = (tokens.view(1, -1).to(self.device), features.view(1, n, -1).to(self.device, self.dtype))
        out = self.static_head(*fed, pos, mask, cache) if self.static_head is not None else None
        if out is None:                   # dynamic shapes (model.graphs=off, or no bucket fits: draft/static_head.py)
            out = self._head_rows(fed, pos, mask, cache, rows)
        elif rows is not None:
            out = out[:, rows.to(out.device)]
        cache.commit_forward(n, as_context=False)
        return out[0]

    def _head_rows(self, fed: tuple[Tensor, Tensor], pos: Tensor, mask: Tensor, cache, rows: Tensor | None) -> Tensor:
        """The head's forward of ``fed`` rows, only the outputs of ``rows`` where given: computed for those rows
        alone by an EAGLE-1/2 head (:meth:`draft.eagle.EagleHead.compute`) when they are at most half the rows
        fed, taken from every row's output otherwise. Why half: the cut itself costs four operators (three row
        gathers and a copy; kernel launches on a GPU) against the one gather of the whole output, so it is taken
        where the skipped rows' attention, output projection and MLP clearly outweigh that (an expansion's 79-row
        re-feed for its 10 frontier rows, docs/results.md §95), not for a few rows (a round start's 16-row re-feed
        for 10, a prefetch's re-feed for its leaves)."""
        if rows is None:
            return self.head(*fed, pos, mask, cache)
        rows = rows.to(self.device)
        if isinstance(self.head, EagleHead) and 2 * rows.numel() <= fed[0].shape[-1]:
            return self.head(*fed, pos, mask, cache, rows)
        return self.head(*fed, pos, mask, cache)[:, rows]

    def drop_tree(self) -> None:
        self.cache.truncate_tree()

    @property
    def tree_size(self) -> int:
        """Tree entries currently fed (they sit after the committed context)."""
        return self.cache.num_tree
