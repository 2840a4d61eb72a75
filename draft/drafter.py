"""Rank 0's drafter: the EAGLE head with its own KV cache, and EAGLE-2 dynamic tree building.

Draft cache entries pair a token with the feature of the position before it: entry ``t`` is
``(token[t+1], feature[t])`` at position ``t``. The cache's committed context only ever holds entries
whose feature came from the *target* (accepted tokens); tree search adds temporary tree entries whose
feature is the draft's own prediction for the parent, and drops them afterwards.
"""
from __future__ import annotations

import torch

from draft.eagle import EagleHead
from draft.tree import DraftTree, select_top_nodes
from model.devices import HOST

Tensor = torch.Tensor


class Drafter:
    def __init__(self, head: EagleHead, lm_head: torch.nn.Linear, max_len: int) -> None:
        self.head = head
        self.lm_head = lm_head
        p = next(head.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.cache = head.block.new_cache(max_len, self.dtype, self.device)

    def reset(self) -> None:
        self.cache.reset()

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor) -> Tensor:
        """New generation: entries pair each prompt token's feature with the token after it."""
        self.reset()
        return self.commit(torch.tensor(prompt_ids[1:] + [first_token], device=HOST), features)

    @torch.no_grad()
    def logprobs(self, hidden: Tensor) -> Tensor:
        return torch.log_softmax(self.lm_head(hidden.to(self.lm_head.weight.dtype)).float(), dim=-1)

    @torch.no_grad()
    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        """Append context entries ``(tokens[i], features[i])``; returns the last entry's output feature.

        The caller pairs each token with the target feature of the position *before* it.
        """
        cache = self.cache
        if cache.num_tree:
            cache.truncate_tree()
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
        if total_token <= 1:
            return DraftTree.single(root_token)
        lp = self.logprobs(root_hidden)
        dev = lp.device
        k = min(top_k, lp.numel())
        s, t = torch.topk(lp, k)
        cand_tokens, cand_parents, cand_scores = [t], [torch.full((k,), -1, device=dev)], [s]
        frontier_ids = torch.arange(k, device=dev)       # candidate indices of the frontier
        frontier_tok, frontier_score = t, s
        frontier_feat = root_hidden.expand(k, -1)
        frontier_cache_parent = torch.full((k,), -1, device=HOST)  # parent slot in the draft cache tree
        n_cand = k
        for _ in range(depth):
            start = self.tree_size
            out = self.tree_forward(frontier_tok, frontier_feat, frontier_cache_parent)
            lp = self.logprobs(out)                                       # [k, V]
            cs, ct = torch.topk(lp, k, dim=-1)                            # [k, k]
            cum = (frontier_score[:, None] + cs).reshape(-1)
            cand_tokens.append(ct.reshape(-1))
            cand_parents.append(frontier_ids.repeat_interleave(k))
            cand_scores.append(cum)
            best = torch.sort(-cum.double(), stable=True).indices[:k]
            parent_row = best // k
            frontier_ids = n_cand + best
            n_cand += k * k
            frontier_tok = ct.reshape(-1)[best]
            frontier_score = cum[best]
            frontier_feat = out[parent_row]
            frontier_cache_parent = start + parent_row.to(HOST)            # the one transfer of this level
        self.drop_tree()
        return select_top_nodes(root_token, torch.cat(cand_tokens).to(HOST), torch.cat(cand_parents).to(HOST),
                                torch.cat(cand_scores).to(HOST), total_token)
