"""Token recycling as a ``draft.sources`` source (``recycle``): :mod:`draft.recycle`'s rule over a table that the
verifier feeds, with the :class:`draft.protocol.TreeDrafter` methods (a drafter with no weights, like
:mod:`draft.lookup`).

The table, as an array: ``ids[t]`` (``[vocab, k]`` int64) is ``M[t]``, the target's top-``k`` next tokens at the
latest committed occurrence of token ``t``, best first, ``-1`` in every slot of a token never observed (a row is
always whole: ``k`` ids from one ``topk``, or none). :class:`draft.recycle.RecycleTable` is the plain statement of
the same rule (newest observation wins, a row replaced whole); ``tests/test_recycle_source.py`` checks the array
against it.

**The feed** (:meth:`RecycleDrafter.observe_target`, the optional protocol hook
:func:`draft.protocol.target_observer` finds): after each verification the committed tokens' logits rows, which
rank 0 computed to verify them, come here with the token each row follows; ONE ``topk`` over those rows, and the
rows of the table are overwritten (newest wins). The rows of the prompt are not observed (that would need the
full-vocabulary ``lm_head`` over every prompt feature, which verification never computes), nor the rejected tree
nodes' (a ``topk`` over every verified row, ~10x the rows: not measured to pay).

**Persistence** (``draft.recycle_persist``, default on): the table outlives a request (``start``/``reset`` keep it),
so a serving process drafts from every earlier request's rows, as the paper's table does. Off: each request starts
from an empty table.

Proposals: a node whose token is ``t`` proposes ``M[t]``, the ``r``-th entry scored
:func:`draft.recycle.rank_logprob` ``= log_p0 + r * log_step`` (``draft.recycle_log_p0``, ``draft.recycle_log_step``,
both ``<= 0``; the defaults were measured on calibration records < 30, ``scripts/recycle_calibrate.py``: the log of
the rate at which a row's rank-``r`` entry was the target's next token). A tree (:meth:`RecycleDrafter.grow_tree`)
is :func:`draft.recycle.recycle_tree`'s best-first walk (scores never increase along a path; at most ``total``
nodes and ``depth + 1`` levels below the root, as lookup's). Deterministic (q = point mass): greedy output and the
sampling law are the verifier's business (``pipeline.verify.walk_tree``), whatever the table holds.

State ("hidden") for the tree interface: a function of the node's token alone, its row: ``k`` ids then their
scores, unused slots id ``-1`` and score ``FLOOR`` (lookup's layout, :func:`draft.lookup.unpack_state`), float32
(ids exact below 2**24). :meth:`RecycleDrafter.tree_forward` computes a whole level's states with ONE row gather
(``ids[tokens]``) and one ``where``; ``logprobs`` spreads a state over the vocabulary.
"""
from __future__ import annotations

import numpy as np
import torch

from config.run_config import SourceError
from draft.lookup import FLOOR, best_supported, spread_state, unpack_state
from draft.recycle import rank_logprob, recycle_tree
from draft.token_history import TokenHistory
from draft.tree import DraftTree
from model.devices import HOST
from model.meter import NULL_METER, OpMeter

Tensor = torch.Tensor


def pack_rows(ids: np.ndarray, rank_scores: np.ndarray) -> np.ndarray:
    """The compact states of table rows ``ids`` (``[rows, k]``, -1 unused): ``[rows, 2k]`` float32, ids then
    ``rank_scores[r]`` for a used slot of rank ``r``, ``FLOOR`` for an unused one."""
    return np.concatenate([ids.astype(np.float32),
                           np.where(ids >= 0, rank_scores[None, :], np.float32(FLOOR)).astype(np.float32)], axis=1)


class ArrayRows:
    """The array table read as :class:`draft.recycle.RecycleTable` is read (``row(t)``: the observed ids, best first;
    rows are whole, so the first ``-1`` ends one), so that :func:`draft.recycle.recycle_tree` walks it."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids

    def row(self, token: int) -> list[int]:
        r = self.ids[token].tolist()
        return r[:r.index(-1)] if -1 in r else r


class RecycleDrafter(TokenHistory):
    """Token recycling with the :class:`draft.protocol.TreeDrafter` methods and the feed hook (module docstring)."""

    meter: OpMeter = NULL_METER   # no model op to meter: its states are table rows
    features_free = True          # tree_forward reads the tokens only (draft.merged.MergedDrafter.tree_inputs)

    def __init__(self, vocab_size: int, k: int = 8, log_p0: float = -1.4, log_step: float = -0.6,
                 persist: bool = True) -> None:
        if vocab_size >= 2 ** 24:
            raise SourceError(f"recycle keeps token ids in float32 states: vocabulary {vocab_size} >= 2**24")
        if k < 1:
            raise SourceError(f"draft.recycle_k={k} must be >= 1")
        if log_p0 > 0 or log_step > 0:
            raise SourceError("draft.recycle_log_p0 and draft.recycle_log_step must be <= 0")
        self.vocab_size, self.k, self.log_p0, self.log_step, self.persist = vocab_size, k, log_p0, log_step, persist
        self.rank_scores = np.array([rank_logprob(r, log_p0, log_step) for r in range(k)], dtype=np.float32)
        self.ids = np.full((vocab_size, k), -1, dtype=np.int64)
        self.observed = 0              # rows the feed handed over (all requests; one per committed token)
        self._last_feed: tuple | None = None   # the latest feed call's (tokens, top ids): reset keeps it
        TokenHistory.__init__(self)

    def clear_table(self) -> None:
        self.ids.fill(-1)

    def forget_requests(self) -> None:
        """:func:`draft.protocol.forget_requests`: the table and the latest feed go (called between generations,
        before the next one's first commit feeds its own rows)."""
        self.clear_table()
        self._last_feed = None

    def reset(self) -> None:
        """A new request (``start``): the committed context and tree entries go; the table stays when ``persist``.
        Else the table is emptied but for the rows of the latest feed call, which belong to the new request: every
        mode commits the generation's first token (the feed: the prompt's last token's row) before it starts the
        drafter (``pipeline.modes``: ``out.extend([x], ...)`` then ``drafter.start``)."""
        TokenHistory.reset(self)
        if not self.persist:
            self.clear_table()
            if self._last_feed is not None:
                self._write(*self._last_feed)

    # -- the feed ------------------------------------------------------------------------------------------------
    def observe_target(self, tokens: list[int], logits: Tensor) -> None:
        """The seam's hook (:func:`draft.protocol.target_observer`): ``logits[i]`` are the target's logits after
        committed token ``tokens[i]`` (the row its successor was chosen from). ONE ``topk`` over the rows; each
        token's row of the table is replaced by its top ``k`` (a token twice in one call: its later row wins)."""
        if not len(tokens):
            return
        width = min(self.vocab_size, logits.shape[-1])
        top = torch.topk(logits[..., :width], min(self.k, width), dim=-1).indices.to(HOST).numpy()
        t = np.asarray(tokens, dtype=np.int64)
        if t.size > 1:                                     # keep the last occurrence of each token (newest wins)
            _, last = np.unique(t[::-1], return_index=True)
            keep = t.size - 1 - last
            t, top = t[keep], top[keep]
        self._write(t, top)
        self._last_feed = (t, top)
        self.observed += len(tokens)

    def _write(self, t: np.ndarray, top: np.ndarray) -> None:
        self.ids[t, :top.shape[1]] = top
        self.ids[t, top.shape[1]:] = -1

    # -- states ----------------------------------------------------------------------------------------------------
    def states(self, tokens) -> np.ndarray:
        """The compact states of nodes of ``tokens`` (module docstring): one row gather."""
        return pack_rows(self.ids[np.asarray(tokens, dtype=np.int64)], self.rank_scores)

    def _root_state(self) -> Tensor:
        return torch.from_numpy(self.states([self.context[-1]])[0])

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        self.append_context(tokens)
        return self._root_state()

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """The best-first walk of the table from ``root_token`` (:func:`draft.recycle.recycle_tree`), at most ``depth + 1`` levels below
        the root (as lookup's); ``top_k`` is not used (a row's ``k`` decides the width)."""
        if total_token <= 1:
            return DraftTree.single(root_token)
        toks, pars, scores = recycle_tree(ArrayRows(self.ids), root_token, total_token, depth + 1, self.log_p0,
                                          self.log_step)
        if len(toks) == 1:
            return DraftTree.single(root_token)
        return DraftTree(torch.tensor(toks, device=HOST), torch.tensor(pars, device=HOST),
                         torch.tensor(scores, dtype=torch.float32, device=HOST))

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        """Every entry's state: a function of its token alone, so the level is one gather of table rows (the
        entries are kept only for the ``tree_size`` bookkeeping of :meth:`draft.merged.MergedDrafter.tree_inputs`)."""
        toks = tokens.reshape(-1)
        self.tree_tokens += toks.tolist()
        self.tree_parents += parents.reshape(-1).tolist()
        return torch.from_numpy(self.states(toks.to(HOST).numpy()))

    def logprobs(self, hidden: Tensor) -> Tensor:
        """The states spread over the vocabulary: ``[..., V]`` float64, ``FLOOR`` where the row names no token."""
        return spread_state(*self._unpack(hidden), self.vocab_size)

    def supported_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The best ``min(k, self.k)`` (score, token) per state among the tokens its row names, empty slots as
        (-inf, -1) (what :meth:`draft.merged.MergedDrafter.top_numpy` reads; no vocabulary-sized work)."""
        return best_supported(*self._unpack(hidden), self.vocab_size, k)

    union_candidates = supported_tokens   # what a merged drafter's union reads

    def _unpack(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        return unpack_state(hidden, self.k, "recycle")


def build_recycle_source(cfg, vocab_size: int) -> RecycleDrafter:
    """The ``recycle`` source of ``draft.sources`` from the ``draft.recycle_*`` keys."""
    d = cfg.draft
    return RecycleDrafter(vocab_size, d.recycle_k, d.recycle_log_p0, d.recycle_log_step, d.recycle_persist)
