"""Prompt lookup: a drafter with no weights that copies what followed earlier occurrences of the last n-gram.

The committed text (prompt + generated tokens, the root last) is searched for earlier occurrences of its
last ``n`` tokens, for ``n = max_ngram`` down to ``min_ngram``; the longest ``n`` with a match wins. The
``max_matches`` most recent occurrences each propose the ``depth + 1`` tokens that followed them; the
continuations form a trie below the root. Where answers copy the prompt (summaries, retrieval QA, code
edits) these guesses are long and right; elsewhere the drafter returns the root alone.

Scores (comparable in spirit to a log-probability, so that :func:`draft.tree.merge_sources` can rank lookup
nodes against model drafters'): a node at depth ``d`` reached by ``c`` of the ``N`` continuations scores
``log(c / N) + d * token_logp``; ``token_logp`` (``draft.lookup_token_logp``, default log 0.6) is the prior
log-probability that one copied token is right. Scores never increase along a path. The tree is
deterministic (no proposal distribution: q = point mass).

State ("hidden") for the tree interface (PipeDec and the merged drafter's ``logprobs``): the lookup
next-token distribution after a sequence, as log-probabilities over the vocabulary: the empirical law of
the tokens that followed the matching occurrences, ``floor`` (a very small log-score) elsewhere and
everywhere when nothing matches.
"""
from __future__ import annotations

import math

import torch

from draft.token_history import TokenHistory
from draft.tree import DraftTree, select_top_nodes
from model.devices import HOST
from model.meter import NULL_METER, OpMeter

Tensor = torch.Tensor
FLOOR = -1e4   # log-score of a token no occurrence supports (finite: top-k still ranks cleanly)


def find_continuations(seq: list[int], max_ngram: int, min_ngram: int, max_matches: int,
                       length: int) -> list[list[int]]:
    """Continuations (each up to ``length`` tokens) of the most recent earlier occurrences of the longest
    suffix n-gram of ``seq`` (``min_ngram <= n <= max_ngram``) that occurs earlier; most recent first.
    An occurrence counts when at least one token follows it inside ``seq`` (so never the suffix itself)."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = seq[L - n:]
        out = []
        for i in range(L - n - 1, -1, -1):      # start of an earlier occurrence, most recent first
            if seq[i:i + n] == suffix:
                out.append(seq[i + n:i + n + length])
                if len(out) >= max_matches:
                    break
        if out:
            return out
    return []


def continuation_trie(root_token: int, conts: list[list[int]], token_logp: float, total_token: int) -> DraftTree:
    """The trie of ``conts`` below ``root_token``, scored as in the module docstring, cut to the best
    ``total_token`` nodes (root included; :func:`select_top_nodes`, so ancestor-closed, best first)."""
    if not conts or total_token <= 1:
        return DraftTree.single(root_token)
    n = len(conts)
    index: dict[tuple[int, int], int] = {}
    toks, pars, counts, depths = [], [], [], []
    for cont in conts:
        parent = -1
        for d, t in enumerate(cont, start=1):
            key = (parent, t)
            node = index.get(key)
            if node is None:
                node = index[key] = len(toks)
                toks.append(t)
                pars.append(parent)
                counts.append(0)
                depths.append(d)
            counts[node] += 1
            parent = node
    scores = [math.log(c / n) + d * token_logp for c, d in zip(counts, depths)]
    return select_top_nodes(root_token, torch.tensor(toks, device=HOST), torch.tensor(pars, device=HOST),
                            torch.tensor(scores, dtype=torch.float64, device=HOST), total_token)


class LookupDrafter(TokenHistory):
    """Prompt lookup (n-gram copying) with the :class:`draft.protocol.TreeDrafter` methods."""

    meter: OpMeter = NULL_METER   # no model op to meter: its log-probs are table look-ups (model.meter)

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8,
                 token_logp: float = math.log(0.6)) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self.max_matches, self.token_logp = max_matches, token_logp
        TokenHistory.__init__(self)

    def state(self, seq: list[int]) -> Tensor:
        """Lookup next-token log-probabilities after ``seq`` (see the module docstring)."""
        # empty().fill_(): torch.full is ~1000x slower on vocabulary-sized CPU tensors (torch 2.13, measured)
        out = torch.empty(self.vocab_size, dtype=torch.float32, device=HOST).fill_(FLOOR)
        nxt = [c[0] for c in find_continuations(seq, self.max_ngram, self.min_ngram, self.max_matches, 1) if c]
        if nxt:
            ids, counts = torch.tensor(nxt, device=HOST).unique(return_counts=True)
            keep = ids < self.vocab_size
            out[ids[keep]] = torch.log(counts[keep].float() / len(nxt))
        return out

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor) -> Tensor:
        self.reset()
        self.context = list(prompt_ids)
        return self.commit(torch.tensor([first_token], device=HOST), features)

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        return self.state(self.append_context(tokens))

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """The continuation trie (module docstring); ``top_k`` is not used (the matches decide the width)."""
        seq = self.context if self.context and self.context[-1] == root_token else self.context + [root_token]
        conts = find_continuations(seq, self.max_ngram, self.min_ngram, self.max_matches, depth + 1)
        return continuation_trie(root_token, conts, self.token_logp, total_token)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        return torch.stack([self.state(seq) for seq in self.add_tree_entries(tokens, parents)])

    def logprobs(self, hidden: Tensor) -> Tensor:
        return hidden.double()
