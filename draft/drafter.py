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

import torch

from draft.eagle import EagleHead
from draft.tree import DraftTree, select_top_nodes, top_node_order
from model.devices import HOST
from model.meter import NULL_METER, OpMeter, hidden_rows

Tensor = torch.Tensor


class BeamTreeDrafter:
    """EAGLE-2's dynamic tree search, written against a drafter's state hooks only.

    A subclass keeps the committed context and the temporary tree entries and implements the
    :class:`draft.protocol.TreeDrafter` hooks ``start``, ``commit``, ``tree_forward``, ``drop_tree`` and
    ``logprobs``, plus the ``tree_size`` property (tree entries fed since the last ``drop_tree``); this class
    adds ``grow_tree`` (beam search), ``grow_tree_with_inputs`` and ``extend_tree`` (incremental expansion)
    on top. Subclasses: :class:`Drafter` (EAGLE heads), :class:`draft.oracle.OracleDrafter`,
    :class:`draft.ssm.SmallLMDrafter`.
    """

    supports_extend = True   # grow_tree is the EAGLE-2 search: extend_tree may continue its trees
    vocab_map: Tensor | None = None   # reduced draft vocabulary (draft id -> target id); None = the target's
    meter: OpMeter = NULL_METER   # instrumentation sees each draft log-prob call as an lm_head op (model.meter)
    # a subclass that sets vocab_map also implements draft_logprobs (log-probs over the draft vocabulary, metered)

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
        ``total_token``, as in EAGLE). The draft is deterministic: top-k, never sampled.

        Placement (``model/devices.py``): the beam's candidates stay on the draft head's device; per level
        only the ``top_k`` chosen parent rows go to the host (the draft cache's tree bookkeeping), and the
        candidates cross once at the end, where :func:`select_top_nodes` re-ranks them on the host.
        """
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
        frontier_ids = torch.arange(k, device=dev)       # candidate indices of the frontier
        frontier_tok, frontier_score = t, s
        frontier_feat = root_hidden.expand(k, -1)
        frontier_cache_parent = torch.full((k,), -1, device=HOST)  # parent slot in the draft cache tree
        n_cand = k
        expanded: list[tuple[Tensor, Tensor]] = []                       # (candidate ids, their outputs) per level
        for _ in range(depth):
            start = self.tree_size
            out = self.tree_forward(frontier_tok, frontier_feat, frontier_cache_parent)
            expanded.append((frontier_ids, out))
            cs, ct = self.top_tokens(out, k)                                   # [k, k]
            cum = (frontier_score[:, None] + cs).reshape(-1)
            cand_tokens.append(ct.reshape(-1))
            cand_parents.append(frontier_ids.repeat_interleave(k))
            cand_scores.append(cum)
            cand_inputs.append(out.repeat_interleave(k, dim=0))
            best = torch.sort(-cum.double(), stable=True).indices[:k]
            parent_row = best // k
            frontier_ids = n_cand + best
            n_cand += k * k
            frontier_tok = ct.reshape(-1)[best]
            frontier_score = cum[best]
            frontier_feat = out[parent_row]
            frontier_cache_parent = start + parent_row.to(HOST)            # the one transfer of this level
        self.drop_tree()
        scores = torch.cat(cand_scores).to(HOST)
        tree = select_top_nodes(root_token, torch.cat(cand_tokens).to(HOST), torch.cat(cand_parents).to(HOST),
                                scores, total_token)
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
        f_par_node, f_score = frontier, tree.scores[frontier]
        f_out, f_slot = outs[frontier.to(dev)], slot[frontier]
        cand_tok, cand_par, cand_score, cand_in = [], [], [], []          # parent: tree node or -(cand+2)
        n_cand = 0
        for level in range(levels):
            cs, ct = (x.to(HOST) for x in self.top_tokens(f_out, top_k))       # one device->host copy per level
            kk = cs.shape[-1]
            if kk == 0:       # no source proposes a token below some frontier node (merged top-k): stop here
                break
            cum = (f_score[:, None] + cs).reshape(-1)
            cand_tok.append(ct.reshape(-1))
            cand_par.append(f_par_node.repeat_interleave(kk))
            cand_score.append(cum)
            cand_in.append(f_out.repeat_interleave(kk, dim=0))
            if level == levels - 1:
                break
            best = torch.sort(-cum.double(), stable=True).indices[:top_k]
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
        new_index = {int(c): n + i for i, c in enumerate(chosen.tolist())}
        parents = [int(p) if p >= 0 else new_index[int(-p - 2)] for p in par.tolist()]  # ancestors-first
        grown = DraftTree(torch.cat([tree.tokens, torch.cat(cand_tok)[chosen]]),
                          torch.cat([tree.parents, torch.tensor(parents, dtype=torch.long, device=HOST)]),
                          torch.cat([tree.scores, scores[chosen]]))
        return grown, torch.cat([inputs, torch.cat(cand_in)[chosen.to(dev)]])


class Drafter(BeamTreeDrafter):
    """The EAGLE drafter: an EAGLE-1/2 or EAGLE-3 head with its own KV cache (see the module docstring)."""

    def __init__(self, head: EagleHead, lm_head: torch.nn.Linear, max_len: int,
                 draft_ids: Tensor | None = None, context_vocab: bool = True, full_root: bool = True) -> None:
        """``draft_ids``: draft only over these target ids (strictly increasing; :func:`draft.vocab.top_ids`),
        plus, with ``context_vocab``, every token of the generation's context (:class:`draft.vocab.DraftVocab`);
        for a head that uses the target's ``lm_head``; an EAGLE-3 head brings its own vocabulary instead.
        ``full_root``: a tree's first level (one row) is still drafted over the whole vocabulary: a token missed
        there ends the verification step at once, deeper levels cost ``top_k`` rows per call."""
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
