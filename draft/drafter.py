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

import math

import torch

from draft.eagle import EagleHead
from draft.shape import EAGLE2, TreeShape, beam_frontier, pick_frontier
from draft.tree import DraftTree, select_top_nodes, top_node_order
from model.devices import HOST
from model.meter import NULL_METER, OpMeter, hidden_rows

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
    sample: bool = False
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
    def set_sampling(self, sample: bool, temperature: float, seed: int, chains: int = 0, distinct: bool = True) -> None:
        """Draw sampled trees (:meth:`sampled_tree`) when ``sample`` and ``temperature > 0``: children drawn from
        ``q = softmax(logprobs / temperature)``, reseeded with ``seed`` at every :meth:`start` (a seeded run
        repeats); ``chains``: chains per tree (0: the call's ``top_k``); ``distinct``: chains that meet at a node
        draw distinct children there (without replacement), else i.i.d. draws that may join."""
        self.sample, self.temperature, self.seed = bool(sample), float(temperature), int(seed)
        self.sample_chains, self.sample_distinct = chains, distinct
        self.generator = torch.Generator(device=HOST).manual_seed(self.seed)

    def reseed(self) -> None:
        """Restart the draws of a sampling drafter (called by ``start``: one generation, one stream)."""
        if self.generator is not None:
            self.generator.manual_seed(self.seed)

    @property
    def samples(self) -> bool:
        """True when ``grow_tree`` draws sampled proposals (sampling on, with a temperature > 0)."""
        return self.sample and self.temperature > 0

    def draw(self, q: Tensor) -> int:
        """One token from ``q`` (the drafter's own generator; tests replace this to enumerate the draws)."""
        if self.generator is None:
            self.generator = torch.Generator(device=HOST).manual_seed(self.seed)
        return int(torch.multinomial(q.float(), 1, generator=self.generator))

    def proposal(self, hidden: Tensor) -> Tensor:
        """q per row of ``hidden``: the distribution sampled children are drawn from, ``softmax(logprobs /
        temperature)``, float64 on the host (what :func:`pipeline.verify.walk_proposals` reads). One metered
        log-prob call for all rows."""
        return torch.softmax(self.logprobs(hidden).double().to(HOST) / self.temperature, dim=-1)

    @torch.no_grad()
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
        EAGLE-2's ``width`` best (:func:`draft.shape.beam_frontier`), or with a confidence shape
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

    def _root_topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The first level of a tree (the root's children): :meth:`top_tokens` unless a subclass widens it."""
        return self.top_tokens(hidden, k)

    @torch.no_grad()
    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """EAGLE-2 dynamic tree rooted at ``root_token``.

        ``root_hidden`` is the draft output of the root's entry (returned by :meth:`commit`). A beam of
        width ``top_k`` runs for ``depth`` expansions after the first level; all ``top_k + depth * top_k**2``
        candidates compete for ``total_token - 1`` places by cumulative log-prob (root included in
        ``total_token``, as in EAGLE). The draft is deterministic: top-k, never sampled; a drafter that
        samples (:attr:`samples`, T > 0) draws :meth:`sampled_tree` instead.

        Placement (``model/devices.py``): the beam's candidates stay on the draft head's device; per level
        only the ``top_k`` chosen parent rows go to the host (the draft cache's tree bookkeeping), and the
        candidates cross once at the end, where :func:`select_top_nodes` re-ranks them on the host.
        """
        if self.samples:
            return self.sampled_tree(root_token, root_hidden, total_token, depth, self.sample_chains or top_k)
        return self.grow_tree_with_inputs(root_token, root_hidden, total_token, depth, top_k)[0]

    @torch.no_grad()
    def grow_tree_with_inputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                              top_k: int) -> tuple[DraftTree, Tensor]:
        """:meth:`grow_tree`, plus each node's draft *input* feature (its parent's draft output; row 0, the
        root's, is ``root_hidden``), on the head's device: what :meth:`extend_tree` re-feeds later."""
        return self.grow_tree_with_outputs(root_token, root_hidden, total_token, depth, top_k)[:2]

    @torch.no_grad()
    def grow_tree_with_outputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                               top_k: int) -> tuple[DraftTree, Tensor, Tensor, Tensor]:
        """:meth:`grow_tree_with_inputs`, plus each node's own draft *output* where the search computed it:
        ``(tree, inputs, outputs, known)``, ``known[i]`` true iff ``outputs[i]`` is node ``i``'s draft output
        (row 0: the root's, ``root_hidden``; a node the beam expanded: the state its candidate children were
        ranked from). Rows of ``outputs`` with ``known`` false are zeros. A merged drafter reads these to give a
        node proposed by another source the input this source would have fed it, without a forward
        (:meth:`draft.merged.MergedDrafter.tree_inputs`)."""
        if total_token <= 1:
            return DraftTree.single(root_token), root_hidden[None], root_hidden[None], torch.ones(1, dtype=torch.bool)
        s, t = self._root_topk(root_hidden, top_k)
        dev = s.device
        k = s.numel()
        cand_tokens, cand_parents, cand_scores = [t], [torch.full((k,), -1, device=dev)], [s]
        cand_inputs = [root_hidden.expand(k, -1)]
        shape = self.tree_shape                          # draft.tree_shape: which candidates a level expands
        rows_left = shape.row_budget(depth, top_k)
        frontier_ids = self._frontier(shape, s, cand_scores, total_token, k, rows_left)   # candidate indices
        frontier_tok, frontier_score = t[frontier_ids], s[frontier_ids]
        frontier_feat = root_hidden.expand(frontier_ids.numel(), -1)
        frontier_cache_parent = torch.full((frontier_ids.numel(),), -1, device=HOST)  # parent slot in the draft cache
        n_cand = k
        expanded: list[tuple[Tensor, Tensor]] = []                       # (candidate ids, their outputs) per level
        for _ in range(shape.levels(depth) - 1):
            if frontier_ids.numel() == 0:                 # a shaped search found nothing worth expanding
                break
            rows_left -= frontier_ids.numel()
            start = self.tree_size
            out = self.tree_forward(frontier_tok, frontier_feat, frontier_cache_parent)
            expanded.append((frontier_ids, out))
            cs, ct = self.top_tokens(out, k)                                   # [frontier, k]
            cum = (frontier_score[:, None] + cs).reshape(-1)
            cand_tokens.append(ct.reshape(-1))
            cand_parents.append(frontier_ids.repeat_interleave(k))
            cand_scores.append(cum)
            cand_inputs.append(out.repeat_interleave(k, dim=0))
            best = self._frontier(shape, cum, cand_scores, total_token, k, rows_left)
            parent_row = best // k
            frontier_ids = n_cand + best
            n_cand += cum.numel()
            frontier_tok = ct.reshape(-1)[best]
            frontier_score = cum[best]
            frontier_feat = out[parent_row]
            frontier_cache_parent = start + parent_row.to(HOST)            # the one transfer of this level
        self.drop_tree()
        scores, cand_tok, cand_par = to_host(torch.cat(cand_scores), torch.cat(cand_tokens), torch.cat(cand_parents))
        levels = torch.arange(1, len(cand_scores) + 1, device=HOST).repeat_interleave(
            torch.tensor([c.numel() for c in cand_scores], device=HOST), output_size=scores.numel())
        tree = select_top_nodes(root_token, cand_tok, cand_par, scores, total_token, levels)
        order = top_node_order(scores, total_token)                       # the candidates select_top_nodes kept
        inputs = torch.cat([root_hidden[None].to(cand_inputs[0].dtype), torch.cat(cand_inputs)[order.to(dev)]])
        cand_out = inputs.new_zeros((n_cand, inputs.shape[-1]))
        cand_known = torch.zeros(n_cand, dtype=torch.bool, device=dev)
        for ids, out in expanded:
            cand_out[ids] = out.to(cand_out.dtype)
            cand_known[ids] = True
        outputs = torch.cat([inputs[:1], cand_out[order.to(dev)]])
        known = torch.cat([torch.ones(1, dtype=torch.bool, device=dev), cand_known[order.to(dev)]]).to(HOST)
        return tree, inputs, outputs, known

    @torch.no_grad()
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
        """
        n = len(tree)
        if levels <= 0 or max_new <= 0:
            return tree, inputs
        dev = inputs.device
        inputs = inputs.clone()
        depth1 = (tree.parents == 0).nonzero().flatten()
        inputs[depth1.to(dev)] = root_hidden.to(inputs.dtype)
        outs = root_hidden[None].to(inputs.dtype)
        if n > 1:
            body = torch.arange(1, n, device=HOST)
            out = self.tree_forward(tree.tokens[body], inputs[1:], tree.parents[body] - 1)
            outs = torch.cat([outs, out.to(inputs.dtype)])
        slot = torch.arange(-1, n - 1, device=HOST)                        # draft-cache tree slot of each node
        has_child = torch.zeros(n, dtype=torch.bool, device=HOST)
        has_child[tree.parents[1:]] = True
        leaves = (~has_child).nonzero().flatten()
        k = min(top_k, leaves.numel())
        order = torch.sort(-tree.scores[leaves].double(), stable=True).indices[:k]
        frontier = leaves[order]                                          # tree node ids (host)
        f_par_node, f_score, f_dep = frontier, tree.scores[frontier], tree.depths[frontier]
        f_out, f_slot = outs[frontier.to(dev)], slot[frontier]
        cand_tok, cand_par, cand_score, cand_in, cand_dep = [], [], [], [], []   # parent: tree node or -(cand+2)
        n_cand = 0
        for level in range(levels):
            cs, ct = to_host(*self.top_tokens(f_out, top_k))                   # one device->host copy per level
            kk = cs.shape[-1]
            if kk == 0:       # no source proposes a token below some frontier node (merged top-k): stop here
                break
            cum = (f_score[:, None] + cs).reshape(-1)
            cand_tok.append(ct.reshape(-1))
            cand_par.append(f_par_node.repeat_interleave(kk))
            cand_score.append(cum)
            cand_in.append(f_out.repeat_interleave(kk, dim=0))
            cand_dep.append((f_dep + 1).repeat_interleave(kk))
            if level == levels - 1:
                break
            best = self._frontier(self.tree_shape, cum, cand_score, max_new + 1, top_k)
            if best.numel() == 0:
                break
            f_dep = cand_dep[-1][best]
            start = self.tree_size
            f_out = self.tree_forward(ct.reshape(-1)[best], f_out[(best // kk).to(dev)],
                                      f_slot[best // kk]).to(inputs.dtype)
            f_slot = start + torch.arange(best.numel(), device=HOST)
            f_par_node = -(n_cand + best + 2)                             # parents are these candidates
            f_score = cum[best]
            n_cand += cum.numel()
        self.drop_tree()
        if not cand_score:
            return tree, inputs
        scores = torch.cat(cand_score)
        chosen = top_node_order(scores, max_new + 1)                      # + 1: the helper counts a root
        par = torch.cat(cand_par)[chosen]
        inv = torch.full((scores.numel(),), -1, dtype=torch.long, device=HOST)   # candidate -> new tree index
        inv[chosen] = n + torch.arange(chosen.numel(), device=HOST)
        parents = torch.where(par >= 0, par, inv[(-par - 2).clamp(min=0)])         # ancestors-first
        if bool((parents < 0).any()):
            raise AssertionError("chosen candidates are not ancestor-closed")        # impossible by construction
        grown = DraftTree(torch.cat([tree.tokens, torch.cat(cand_tok)[chosen]]),
                          torch.cat([tree.parents, parents]),
                          torch.cat([tree.scores, scores[chosen]]),
                          torch.cat([tree.depths, torch.cat(cand_dep)[chosen]]))
        return grown, torch.cat([inputs, torch.cat(cand_in)[chosen.to(dev)]])


class Drafter(BeamTreeDrafter):
    """The EAGLE drafter: an EAGLE-1/2 or EAGLE-3 head with its own KV cache (see the module docstring)."""

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

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor) -> Tensor:
        """New generation: entries pair each prompt token's feature with the token after it."""
        self.reset()
        self.reseed()
        if self.dvocab is not None:
            self.dvocab.begin(list(prompt_ids) + [int(first_token)])
        return self.commit(torch.tensor(prompt_ids[1:] + [first_token], device=HOST), features)

    @torch.no_grad()
    def draft_logprobs(self, hidden: Tensor) -> Tensor:
        """Log-probs over the *draft* vocabulary (the target's, except for a reduced vocabulary); one metered
        ``lm_head`` op over :attr:`draft_vocab_rows` rows of the vocabulary."""
        with self.meter.op("lm_head", hidden_rows(hidden), self.draft_vocab_rows):
            if hasattr(self.head, "draft_logits"):
                return torch.log_softmax(self.head.draft_logits(hidden.to(self.dtype)).float(), dim=-1)
            if self.dvocab is not None:
                return torch.log_softmax(self.dvocab.logits(hidden).float(), dim=-1)
            return self._target_logprobs(hidden)

    def _target_logprobs(self, hidden: Tensor) -> Tensor:
        """Log-probs over the whole target vocabulary through the shared ``lm_head`` (unmetered: callers meter)."""
        return torch.log_softmax(self.lm_head(hidden.to(self.lm_head.weight.dtype)).float(), dim=-1)

    @torch.no_grad()
    def logprobs(self, hidden: Tensor) -> Tensor:
        """Log-probs over the target vocabulary (-inf outside a reduced draft vocabulary)."""
        lp = self.draft_logprobs(hidden)
        if self.vocab_map is None:
            return lp
        full = torch.full((*lp.shape[:-1], self.lm_head.out_features), float("-inf"), dtype=lp.dtype,
                          device=lp.device)
        full[..., self.vocab_map.to(lp.device)] = lp
        return full

    @torch.no_grad()
    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        """Append context entries ``(tokens[i], features[i])``; returns the last entry's output feature.

        The caller pairs each token with the target feature of the position *before* it.
        """
        cache = self.cache
        if cache.num_tree:
            cache.truncate_tree()
        if self.dvocab is not None:
            self.dvocab.add(tokens)
        n = tokens.numel()
        pos, mask = cache.context_inputs(n, self.dtype)
        out = self.head(tokens.view(1, -1).to(self.device), features.view(1, n, -1).to(self.device, self.dtype),
                        pos, mask, cache)
        cache.commit_forward(n, as_context=True)
        return out[0, -1]

    @torch.no_grad()
    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        """Feed tree entries (kept in the cache until :meth:`drop_tree`); returns their output features."""
        cache = self.cache
        pos, mask, anc, depth = cache.tree_inputs(parents, self.dtype)
        n = tokens.numel()
        out = self.head(tokens.view(1, -1).to(self.device), features.view(1, n, -1).to(self.device, self.dtype),
                        pos, mask, cache)
        cache.commit_forward(n, as_context=False, anc=anc, depth=depth)
        return out[0]

    def drop_tree(self) -> None:
        self.cache.truncate_tree()

    @property
    def tree_size(self) -> int:
        """Tree entries currently fed (they sit after the committed context)."""
        return self.cache.num_tree
