"""Target-side token choice and tree verification on rank 0 (greedy and lossless sampling).

``walk_tree`` verifies the prefix ``[0, n_verified)`` of a tree whose target logits are known. Node
indices are ancestors-first, so a verified node's ancestors are verified too.

Sampling rule (EAGLE-2 / SpecInfer multi-candidate rule with a deterministic draft, q = 1): at a
verified node with processed target distribution p, try its distinct children in index order; accept
child x with probability p'(x), where p' is p with previously rejected siblings zeroed and
renormalised; on acceptance descend, otherwise sample the next token from the final residual p'.
Exactness under pipelining: a node's children are fixed before any draw at that node because a node is
resolved only once it is verified, and expansion only attaches nodes below the new (unverified) root.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draft.tree import DraftTree

Tensor = torch.Tensor


@dataclass
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """Processed distribution, like HF generate: temperature, then top-k, then top-p."""
        x = logits.double() / self.temperature
        if self.top_k > 0:
            kth = torch.topk(x, min(self.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=False)
            cum = sorted_x.softmax(-1).cumsum(-1)
            remove = cum <= (1 - self.top_p)
            remove[-1] = False
            x = x.masked_fill(remove.scatter(0, idx, remove), float("-inf"))
        return torch.softmax(x, dim=-1)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def draw(self, p: Tensor) -> int:
        return int(torch.multinomial(p.float(), 1, generator=self.generator))

    def choose(self, logits: Tensor) -> int:
        return int(torch.argmax(logits)) if self.greedy else self.draw(self.probs(logits))


def walk_tree(tree: DraftTree, n_verified: int, logits: Tensor, sampler: Sampler) -> tuple[list[int], int | None, int | None]:
    """Verify as far as the known logits allow.

    Returns ``(accepted_path, new_token, new_root)``:
      * ``accepted_path``: node indices from the root, all verified (empty when the root is not);
      * ``new_token``: the target's token after the path (``None`` when the root is not verified);
      * ``new_root``: an existing, not yet verified child carrying ``new_token`` (the tree continues),
        else ``None`` (truncate: the round ends and a fresh tree starts from ``new_token``).
    """
    if n_verified <= 0:
        return [], None, None
    path, cur = [0], 0
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    while True:
        children = kids.get(cur, [])
        if sampler.greedy:
            x = int(torch.argmax(logits[cur]))
            child = next((c for c in children if tokens[c] == x), None)
        else:
            p = sampler.probs(logits[cur])
            child = None
            for c in children:
                t = tokens[c]
                if sampler.uniform() < float(p[t]):
                    child = c
                    break
                p[t] = 0.0
                total = p.sum()
                if total <= 0:  # cannot happen for a valid distribution; guard against float dust
                    break
                p = p / total
            x = tokens[child] if child is not None else sampler.draw(p)
        if child is None:
            return path, x, None
        if child >= n_verified:
            return path, x, child
        path.append(child)
        cur = child
