"""Drafter state kept as plain token lists, for drafters whose guess is a function of the token sequence alone
(the oracle/adversary test drafters, prompt lookup): the committed context, and the temporary tree entries
fed since the last ``drop_tree`` (parents ``-1`` = below the context, else an earlier entry of the tree).
"""
from __future__ import annotations

import torch
from torch import Tensor

from model.devices import HOST


class TokenHistory:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.context: list[int] = []
        self.tree_tokens: list[int] = []
        self.tree_parents: list[int] = []

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor, sampling=None) -> Tensor:
        """A new request: state reset, the context restarted as the prompt (:meth:`begin`), then ``first_token``
        committed through the drafter's own ``commit`` (so its state after the first token is what it returns).
        ``sampling``: nothing to sample (these drafters are deterministic)."""
        self.reset()
        self.begin(list(prompt_ids))
        return self.commit(torch.tensor([first_token], device=HOST), features)

    def begin(self, prompt_ids: list[int]) -> None:
        """The context of a new request: the prompt (a drafter indexing its context as it grows overrides this)."""
        self.context = prompt_ids

    def append_context(self, tokens: Tensor) -> list[int]:
        """Drop the tree entries, append committed ``tokens``; returns the context."""
        self.drop_tree()
        self.context += (tokens if tokens.dim() == 1 else tokens.reshape(-1)).tolist()   # one read, not one per token
        return self.context

    def add_tree_paths(self, tokens: Tensor, parents: Tensor) -> list[list[int]]:
        """Append tree entries; returns, per new entry, its tree path (what follows the context)."""
        first = len(self.tree_tokens)
        self.tree_tokens += (tokens if tokens.dim() == 1 else tokens.reshape(-1)).tolist()
        self.tree_parents += (parents if parents.dim() == 1 else parents.reshape(-1)).tolist()
        return [self._path(i) for i in range(first, len(self.tree_tokens))]

    def _path(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(self.tree_tokens[node])
            node = self.tree_parents[node]
        return path[::-1]

    def drop_tree(self) -> None:
        self.tree_tokens, self.tree_parents = [], []

    @property
    def tree_size(self) -> int:
        return len(self.tree_tokens)
