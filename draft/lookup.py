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

State ("hidden") for the tree interface (PipeDec, the merged drafter's ``logprobs`` and its incremental
expansion): the lookup next-token scores after a sequence, the first level of its trie: a token that followed
``c`` of the ``N`` matching occurrences scores ``log(c / N) + token_logp``, every other token ``FLOOR`` (a very
small log-score; everywhere when nothing matches). It is kept **compact**: ``2 * max_matches`` numbers, the
supported token ids then their scores (:func:`pack_state`; unused slots hold id ``-1``), so a merged state
(EAGLE's feature beside it) stays small; :meth:`LookupDrafter.logprobs` spreads it over the vocabulary.

Speed: the committed context is indexed by its n-grams as it grows (:class:`NgramIndex`), so a query costs the
occurrences it returns plus a scan of the few positions that overlap the tree path, not a scan of the context;
:meth:`NgramIndex.continuations` returns exactly what :func:`find_continuations` returns on the whole sequence.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch

from draft.token_history import TokenHistory
from draft.tree import DraftTree, best_first, top_nodes_tree
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
    scores = np.array([math.log(c / n) + d * token_logp for c, d in zip(counts, depths)], dtype=np.float64)
    # select_top_nodes on the NumPy candidates (issue 41, the round start: no tensor built per list and viewed back)
    order = best_first(scores, max(0, min(total_token - 1, scores.size)))
    return top_nodes_tree(root_token, np.array(toks, dtype=np.int64), np.array(pars, dtype=np.int64), scores, order,
                          np.array(depths, dtype=np.int64))           # depths known here: no recomputation


class NgramIndex:
    """Start positions of every n-gram (``min_ngram <= n <= max_ngram``) of a growing token list.

    Invariant: after :meth:`sync`, ``starts[n][gram]`` lists, ascending, every ``i`` with ``seq[i:i + n] == gram``
    and ``i + n <= len(seq)`` for the list last synced. The caller's list may only grow by appends between syncs
    (as :class:`draft.token_history.TokenHistory` does); a new list object, or a shorter one, starts over, but an
    in-place rewrite of tokens already indexed is not detected.
    """

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.clear()

    def clear(self) -> None:
        self.starts: dict[int, dict[tuple, list[int]]] = {n: defaultdict(list) for n in
                                                          range(self.min_ngram, self.max_ngram + 1)}
        self.seq: list[int] | None = None
        self.length = 0

    def sync(self, seq: list[int]) -> None:
        """Index the tokens appended to ``seq`` since the last call (``seq`` is the caller's list, read only)."""
        if seq is not self.seq or len(seq) < self.length:
            self.clear()
            self.seq = seq
        for end in range(self.length, len(seq)):     # the n-grams that end at ``end``
            for n, table in self.starts.items():
                if end + 1 >= n:
                    table[tuple(seq[end + 1 - n:end + 1])].append(end + 1 - n)
        self.length = len(seq)

    def continuations(self, path: list[int], max_matches: int, length: int) -> list[list[int]]:
        """:func:`find_continuations` of ``seq + path`` (``seq``: the synced list), without building it: occurrences
        inside ``seq`` come from the index, the few that overlap ``path`` from a scan of those positions only."""
        seq, lc = self.seq or [], self.length
        total = lc + len(path)
        # the window every overlapping occurrence and the suffix reach: the last max_ngram tokens of seq, then path
        # (issue 41: list slices compared in C instead of a Python call per token; the same matches in the same order)
        base = max(0, lc - self.max_ngram)
        w = seq[base:lc] + list(path)                                  # positions base .. total - 1

        def cont(i: int) -> list[int]:
            end = min(i + length, total)
            if i >= base:
                return w[i - base:end - base]
            return seq[i:end] if end <= lc else seq[i:lc] + w[lc - base:end - base]

        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            suffix = w[total - n - base:]
            out = []
            for i in range(total - n - 1, max(lc - n, -1), -1):     # occurrences that overlap ``path``
                if w[i - base:i - base + n] == suffix:
                    out.append(cont(i + n))
                    if len(out) >= max_matches:
                        return out
            inside = self.starts[n].get(tuple(suffix), ())
            for i in reversed(inside):                               # occurrences inside ``seq``, most recent first
                if i + n >= total:                                   # the suffix itself (``path`` empty)
                    continue
                out.append(cont(i + n))
                if len(out) >= max_matches:
                    break
            if out:
                return out
        return []


def pack_state(conts: list[list[int]], width: int, token_logp: float) -> Tensor:
    """The compact state (module docstring) of the next tokens of ``conts``: ``width // 2`` id slots then as many
    score slots, ids in order of first appearance, unused slots id ``-1`` and score ``FLOOR``. float32: ids up to
    2**24 are exact (:class:`LookupDrafter` checks its vocabulary), and widening it beside a feature is exact."""
    return torch.tensor(state_row(conts, width, token_logp), dtype=torch.float32, device=HOST)


def state_row(conts: list[list[int]], width: int, token_logp: float) -> list[float]:
    """:func:`pack_state` as a Python list (many rows become one tensor at once: :meth:`LookupDrafter.tree_forward`)."""
    slots = width // 2
    counts: dict[int, int] = {}
    for c in conts:
        if c:
            counts[c[0]] = counts.get(c[0], 0) + 1
    n = sum(counts.values())
    ids = list(counts)[:slots]
    return ids + [-1] * (slots - len(ids)) + [math.log(counts[t] / n) + token_logp for t in ids] + \
        [FLOOR] * (slots - len(ids))


def unpack_state(hidden: Tensor, slots: int, what: str) -> tuple[Tensor, Tensor]:
    """A compact state (:func:`pack_state`; also :mod:`draft.suffix`'s) as ``(ids, scores)``: ``slots`` token ids
    (-1 = unused) then their scores. Ids ride in a float tensor, so only float32/float64 keep them exact."""
    if hidden.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"a {what} state holds token ids: float32 or float64 only, got {hidden.dtype}")
    return hidden[..., :slots].round().long(), hidden[..., slots:].double()


def spread_state(ids: Tensor, scores: Tensor, vocab_size: int) -> Tensor:
    """Compact states spread over the vocabulary: ``[..., V]`` float64, ``FLOOR`` where no slot names a token
    (unused slots, id -1 or out of range, land in a spare column that is cut off)."""
    out = torch.full((*ids.shape[:-1], vocab_size + 1), FLOOR, dtype=torch.float64, device=ids.device)
    spare = (ids < 0) | (ids >= vocab_size)
    out.scatter_(-1, torch.where(spare, vocab_size, ids), scores)
    return out[..., :vocab_size]


def best_supported(ids: Tensor, scores: Tensor, vocab_size: int, k: int) -> tuple[Tensor, Tensor]:
    """The best ``min(k, slots)`` (score, token) per compact state, empty slots as (-inf, -1): no vocabulary-sized
    work (what a merged drafter's union top-k reads). ``ids`` may be the state's float slots (exact integers):
    the tokens then come back in that float dtype."""
    empty = (ids < 0) | (ids >= vocab_size)
    s, j = torch.topk(scores.masked_fill(empty, float("-inf")), min(k, scores.shape[-1]), dim=-1)
    return s, ids.gather(-1, j).masked_fill(s == float("-inf"), -1)


def lookup_supported(state: Tensor, slots: int, k: int) -> tuple[Tensor, Tensor]:
    """:func:`best_supported` of lookup's own states (:func:`state_row`), in 5 operators instead of 10 (issue 41): the
    state split once, ``topk`` of its scores as they are, the ``FLOOR`` of an unused slot turned into ``-inf``, the
    ids gathered. Equal to ``best_supported(state[..., :slots], state[..., slots:], vocab_size, k)`` because a
    lookup state keeps two invariants (``state_row``): an unused slot holds id -1 and score ``FLOOR``, a used one an
    id of the context (a real token, ``0 <= id < vocab_size``) and a score above ``FLOOR`` (``log(count / n) +
    token_logp`` with ``n <= max_matches``: :class:`LookupDrafter` takes this path only where ``token_logp -
    log(max_matches) > FLOOR``, i.e. for every sane ``token_logp``). So nothing needs masking by id, and ``topk`` sees
    the same comparisons between every pair of slots as on the masked scores (``FLOOR`` and ``-inf`` both below
    every used slot, equal among the unused): the same order, ties included; the unused slots come back as
    ``(-inf, -1)`` as there (their ids are -1 already). ``tests/test_level_ops.py`` checks it against
    :func:`best_supported` on random states with ties."""
    s, ids = lookup_supported_raw(state, slots, k)
    return s.masked_fill(s == FLOOR, float("-inf")), ids


def lookup_supported_raw(state: Tensor, slots: int, k: int) -> tuple[Tensor, Tensor]:
    """:func:`lookup_supported` with an unused slot's score left at ``FLOOR`` (its id is -1): what the merged
    drafter's union reads (:func:`draft.merged.union_top_np` drops a slot by its -1 token on the host, so the two
    operators that turn ``FLOOR`` into ``-inf`` are not needed there). 3 operators."""
    ids, scores = state.split(slots, dim=-1)
    s, j = torch.topk(scores, min(k, slots), dim=-1)
    return s, ids.gather(-1, j)


class LookupDrafter(TokenHistory):
    """Prompt lookup (n-gram copying) with the :class:`draft.protocol.TreeDrafter` methods."""

    meter: OpMeter = NULL_METER   # no model op to meter: its scores are table look-ups (model.meter)
    features_free = True          # tree_forward reads the token paths only (draft.merged.MergedDrafter.tree_inputs)

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8,
                 token_logp: float = math.log(0.6)) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        if vocab_size >= 2 ** 24:
            raise ValueError(f"lookup keeps token ids in float32 states: vocabulary {vocab_size} >= 2**24")
        self.max_matches, self.token_logp = max_matches, token_logp
        self.index = NgramIndex(min_ngram, max_ngram)
        TokenHistory.__init__(self)

    @property
    def state_width(self) -> int:
        return 2 * self.max_matches

    def continuations(self, path: list[int], length: int) -> list[list[int]]:
        """:func:`find_continuations` of the committed context followed by ``path`` (through the index)."""
        self.index.sync(self.context)
        return self.index.continuations(path, self.max_matches, length)

    def state(self, path: list[int]) -> Tensor:
        """The compact lookup state (module docstring) after the committed context followed by ``path``."""
        return pack_state(self.continuations(path, 1), self.state_width, self.token_logp)

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor) -> Tensor:
        self.reset()
        self.context = list(prompt_ids)
        return self.commit(torch.tensor([first_token], device=HOST), features)

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        self.append_context(tokens)
        return self.state([])

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """The continuation trie (module docstring); ``top_k`` is not used (the matches decide the width)."""
        path = [] if self.context and self.context[-1] == root_token else [root_token]
        return continuation_trie(root_token, self.continuations(path, depth + 1), self.token_logp, total_token)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        """Every node's state (one tensor built at once; equal to stacking :meth:`state` per node)."""
        w, lp = self.state_width, self.token_logp
        rows = [state_row(self.continuations(path, 1), w, lp) for path in self.add_tree_paths(tokens, parents)]
        out = torch.tensor(rows, dtype=torch.float32, device=HOST)
        return out if rows else out.reshape(0, w)

    def logprobs(self, hidden: Tensor) -> Tensor:
        """The states spread over the vocabulary: ``[..., V]`` float64, ``FLOOR`` where no occurrence supports a
        token."""
        return spread_state(*self._unpack(hidden), self.vocab_size)

    def supported_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The best ``min(k, max_matches)`` (score, token) per state among the tokens an occurrence supports, empty
        slots as (-inf, -1): what a merged drafter's union top-k reads (:meth:`draft.merged.MergedDrafter.top_tokens`
        drops the empty slots), with no vocabulary-sized work. Not a tree's children by itself: alone, lookup's
        children come from :func:`draft.protocol.top_tokens`, the top-k of :meth:`logprobs` (real tokens, the
        unsupported ones at ``FLOOR``)."""
        if hidden.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"a lookup state holds token ids: float32 or float64 only, got {hidden.dtype}")
        # the state's own slices, not unpack_state's rounded int64 ids and float64 scores: ids are exact integers in
        # the float state (state_row writes them), a float32 -> float64 widening is exact and keeps every
        # comparison (so topk's order), and the merged drafter's one concatenation widens both to float64 anyway:
        # the same candidates in 3 fewer operators per level (issue 41). Tokens come back as floats holding ids.
        m = self.max_matches
        if self.token_logp - math.log(m) > FLOOR:          # every used slot scores above FLOOR: lookup_supported
            return lookup_supported(hidden, m, k)
        return best_supported(hidden[..., :m], hidden[..., m:], self.vocab_size, k)

    def supported_raw(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`supported_tokens` with the empty slots as ``(FLOOR, -1)`` instead of ``(-inf, -1)``
        (:func:`lookup_supported_raw`): the merged drafter's union (:meth:`draft.merged.MergedDrafter.top_numpy`)
        drops them by their -1 token. Where the fast path does not apply, :meth:`supported_tokens` itself."""
        if hidden.dtype in (torch.float32, torch.float64) and self.token_logp - math.log(self.max_matches) > FLOOR:
            return lookup_supported_raw(hidden, self.max_matches, k)
        return self.supported_tokens(hidden, k)

    def _unpack(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        return unpack_state(hidden, self.max_matches, "lookup")
