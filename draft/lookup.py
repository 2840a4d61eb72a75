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
supported token ids then their scores (``LookupDrafter._state_row``; unused slots hold id ``-1``), so a merged state
(EAGLE's feature beside it) stays small; :meth:`LookupDrafter.logprobs` spreads it over the vocabulary.

Speed (issue 41 item 2): ``tree_forward`` computes many rows' states in ONE vectorised pass, no Python per node: the
committed context kept as NumPy arrays indexed by token as it grows (:class:`ContextIndex`), the rows' paths by
pointer doubling (:func:`tree_paths`), every row's occurrences found at once (:func:`level_matches`: its last token's
positions in the context by binary search, the path positions on a grid), the rows packed by :func:`pack_states`.
That pass has a fixed cost of about 40 NumPy calls, which on this CPU loses to the per-node rule for a beam level of
10 rows and wins from a few dozen rows (a re-fed tree of 64 rows: 285 us against 352); so fewer than
:attr:`LookupDrafter.vector_rows` rows take the per-node rule (the context indexed by its n-grams as it grows,
:class:`NgramIndex`; :meth:`NgramIndex.next_tokens`: a query costs the occurrences it returns plus one pass over the
positions of the tree path, each compared once for its match length). Both equal the rule in plain Python,
``find_continuations`` then ``state_row`` per row (``tests/helpers.py``, checked by ``tests/test_lookup_level.py``).
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict

import numpy as np
import torch

from draft.token_history import TokenHistory
from draft.tree import DraftTree, below_mask, best_first, top_nodes_tree
from model.devices import HOST
from model.meter import NULL_METER, OpMeter

Tensor = torch.Tensor
FLOOR = -1e4   # log-score of a token no occurrence supports (finite: top-k still ranks cleanly)


def continuation_trie(root_token: int, conts: list[list[int]], token_logp: float, total_token: int) -> DraftTree:
    """The trie of ``conts`` below ``root_token``, scored as in the module docstring, cut to the best
    ``total_token`` nodes (root included; :func:`draft.tree.top_nodes_tree`, so ancestor-closed, best first)."""
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
    # EAGLE-2's re-ranking on the NumPy candidates (issue 41, the round start: no tensor built per list and viewed back)
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
        """``find_continuations`` of ``seq + path`` (``seq``: the synced list), without building it: occurrences
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


    def next_tokens(self, path: list[int], max_matches: int) -> list[int]:
        """``[c[0] for c in continuations(path, max_matches, 1)]``, with less Python: each occurrence that ends in
        ``path`` is compared once for its match length (not once per n-gram length); what
        :meth:`draft.lookup.LookupDrafter.tree_forward`'s per-node rule runs, per row. Same order as there: the
        occurrences that end in ``path`` (the most recent) first, then the index's, most recent first."""
        seq, lc = self.seq or [], self.length
        total = lc + len(path)
        if total < 2:
            return []
        mg = self.max_ngram
        base = max(0, lc - mg)
        w = seq[base:lc] + path                                      # positions base .. total - 1
        top = total - 1 - base
        last = w[top]
        hits, best = [], 0                                           # (length, next token), most recent first
        for j in range(top - 1, lc - base - 1, -1):                  # last token at p = base + j, lc <= p <= len - 2
            if w[j] == last:
                n = 1
                while n < mg and j >= n and w[j - n] == w[top - n]:
                    n += 1
                hits.append((n, w[j + 1]))
                best = max(best, n)
        for n in range(min(mg, total - 1), self.min_ngram - 1, -1):
            out = [t for ln, t in hits if ln >= n][:max_matches] if n <= best else []
            for i in reversed(self.starts[n].get(tuple(w[top - n + 1:]), ())):   # inside seq, most recent first
                if len(out) >= max_matches:
                    break
                if i + n < lc:
                    out.append(seq[i + n])
                elif i + n < total:                                  # the next token is path[0] (not the suffix itself)
                    out.append(path[0])
            if out:
                return out
        return []

class ContextIndex:
    """The committed context as NumPy arrays, indexed by token as it grows (what :func:`level_matches` reads).

    Invariant: after :meth:`sync`, ``padded[pad + p]`` is ``seq[p]`` for every position ``p`` of the list last synced,
    and the ``pad`` slots before it hold distinct values below -1 (a read before the start is a non-token that equals
    no token, no pad of another position and no -1 filler: :func:`level_matches` needs no bounds checks); ``keys``
    holds, ascending, ``token << 32 | p`` for every position ``p`` that has a next token (``p <= len - 2``), so one
    token's positions are one contiguous ascending run, found by two binary searches. The caller's list may only
    grow by appends between syncs (as :class:`draft.token_history.TokenHistory` does); a new list object, or a shorter
    one, starts over, but an in-place rewrite of tokens already indexed is not detected. A sync costs the appended
    tokens plus one ``np.insert`` (a copy of the index), not a pass of Python over the context."""

    def __init__(self, pad: int) -> None:
        self.pad = pad
        self.clear()

    def clear(self) -> None:
        self.seq: list[int] | None = None
        self.length = 0
        self.padded = np.full(self.pad + 64, -1, dtype=np.int64)
        self.padded[:self.pad] = -2 - np.arange(self.pad)
        self.keys = np.empty(0, dtype=np.int64)

    def sync(self, seq: list[int]) -> None:
        """Index the tokens appended to ``seq`` since the last call (``seq`` is the caller's list, read only)."""
        if seq is not self.seq or len(seq) < self.length:
            self.clear()
            self.seq = seq
        old, new = self.length, len(seq)
        if new == old:
            return
        if self.pad + new > self.padded.size:
            grown = np.full(max(self.pad + new, 2 * self.padded.size), -1, dtype=np.int64)
            grown[:self.pad + old] = self.padded[:self.pad + old]
            self.padded = grown
        self.padded[self.pad + old:self.pad + new] = seq[old:]
        at = max(old - 1, 0)                                   # positions that now have a next token
        keys = (self.padded[self.pad + at:self.pad + new - 1] << 32) | np.arange(at, new - 1, dtype=np.int64)
        if keys.size > 1:
            keys.sort()
        self.keys = np.insert(self.keys, np.searchsorted(self.keys, keys), keys) if self.keys.size else keys
        self.length = new


def level_matches(padded: np.ndarray, keys: np.ndarray, lc: int, paths: np.ndarray, depth: np.ndarray,
                  max_ngram: int, min_ngram: int, max_matches: int) -> np.ndarray:
    """``find_continuations`` (continuations of one token) for many rows at once, as one fixed sequence of NumPy
    calls (issue 41 item 2: no Python per row). Row ``r``'s sequence is the context (``lc`` tokens; ``padded`` and
    ``keys`` as :class:`ContextIndex` keeps them, with ``pad = max_ngram``) followed by its path, ``paths[r,
    :depth[r]]`` (``paths``: ``[rows, D]``, ``D >= 1``, left-aligned). Returns ``[rows, max_matches]`` int64: per row
    the next tokens of the chosen occurrences, most recent first, -1 in unused slots.

    The rule, restated (equal to ``find_continuations``'s loop over ``n``): an earlier occurrence whose last token
    is at ``p`` (its next token at ``p + 1 < len``) matches the sequence's suffix for ``l(p)`` tokens, the number of
    leading equal tokens of ``seq[p], seq[p-1], ...`` and ``seq[-1], seq[-2], ...`` (at most ``max_ngram``, at most
    ``p + 1``: an occurrence starts at 0 or later, which also keeps the suffix inside the sequence). The longest
    n-gram with a match has ``n* = max l(p)`` (when ``>= min_ngram``); its occurrences are the ``p`` with ``l(p) =
    n*``, of which the ``max_matches`` most recent are taken. The candidates ``p``: in the context up to ``lc - 2``,
    the positions of the row's last token (``keys``: one binary search per row, no scan of the context); from
    ``lc - 1`` on, every position of a window of the context's last ``max_ngram`` tokens and the path (a grid).
    All rows' candidates are laid out in one token array (the context, then each row's window), ranked by one sort
    of packed keys (row, longest first, most recent first)."""
    mg = max_ngram
    rows, width = paths.shape
    w = mg + width
    head = mg + lc
    src = np.empty(head + rows * w, dtype=np.int64)             # [pads | context | row 0's window | row 1's | ...]
    src[:head] = padded[:head]
    win = src[head:].reshape(rows, w)
    win[:, :mg] = padded[lc:head]                              # the context's last mg tokens (pads before its start)
    win[:, mg:] = paths
    ar, row_at, cell, r_b, cols, back = _layout(rows, width, mg)
    suffix = src[(row_at + (head + mg - 1) + depth)[:, None] - back]    # [rows, mg]: seq[-1], seq[-2], ...
    bounds = np.searchsorted(keys, (suffix[:, :1] << 32) + _RUN)     # the last token's run of context positions
    cnt = bounds[:, 1] - bounds[:, 0]
    r_a = np.repeat(ar, cnt)
    p_a = keys[np.arange(r_a.size) + np.repeat(bounds[:, 0] - (np.cumsum(cnt) - cnt), cnt)] & 0xFFFFFFFF
    r = np.concatenate([r_a, r_b])
    idx = np.concatenate([p_a + mg, cell + head])               # src index of each candidate's last token
    ok = np.concatenate([np.ones(r_a.size, dtype=bool), (cols < depth[:, None]).reshape(-1)])    # p < len - 1
    # its match length (a pad equals nothing: no bound checks); src index grows with p within a row: recency
    length = np.logical_and.accumulate(src[idx[:, None] - back] == suffix[r], axis=1).sum(1)
    key = np.sort((((r * (mg + 1) + mg - length) << 32) | (0xFFFFFFFF - idx))[ok & (length >= min_ngram)])
    hi = key >> 32
    r, length, idx = hi // (mg + 1), mg - hi % (mg + 1), 0xFFFFFFFF - (key & 0xFFFFFFFF)
    start = np.searchsorted(r, ar)[r]                          # each candidate's row's first (longest, newest)
    rank = np.arange(r.size) - start
    sel = (rank < max_matches) & (length == length[start])
    out = np.full((rows, max_matches), -1, dtype=np.int64)
    out[r[sel], rank[sel]] = src[idx[sel] + 1]                 # the next tokens
    return out


_RUN = np.array([0, 1 << 32])


@functools.lru_cache(maxsize=256)
def _layout(rows: int, width: int, mg: int) -> tuple[np.ndarray, ...]:
    """:func:`level_matches`' index patterns for ``rows`` windows of ``mg + width`` columns (cached, read only): the
    rows, each window's offset in the window area, then per path-grid cell (window columns ``mg - 1 .. mg + width -
    2``, row-major) its window-area index and its row, the cells' path index ``[1, width]`` (a cell is a candidate
    below its row's depth), and ``0 .. mg - 1`` (how far back a token is read)."""
    w = mg + width
    ar = np.arange(rows)
    cell = (ar[:, None] * w + np.arange(mg - 1, w - 1)).reshape(-1)
    out = (ar, ar * w, cell, np.repeat(ar, width), np.arange(width)[None, :], np.arange(mg))
    for x in out:
        x.flags.writeable = False
    return out


def pack_states(nxt: np.ndarray, logt: np.ndarray) -> np.ndarray:
    """The compact states (``_state_row``) of rows of next tokens ``nxt`` (``[rows, slots]``, -1 unused, the used
    ones first: :func:`level_matches`), as one ``[rows, 2 * slots]`` float32 array: ids in order of first appearance,
    then ``logt[count, n]`` (``log(count / n) + token_logp``, precomputed with :func:`math.log`: the very floats
    ``_state_row`` computes), unused slots id -1 and score ``FLOOR``. NumPy, a fixed sequence of calls."""
    rows, slots = nxt.shape
    used = nxt >= 0
    same = nxt[:, :, None] == nxt[:, None, :]
    first = used & ~(same & below_mask(slots)).any(-1)                       # no earlier copy in its row
    r, c = np.nonzero(first)
    at = np.cumsum(first, axis=1)[r, c] - 1                               # its slot: firsts before it in the row
    out = np.empty((rows, 2 * slots), dtype=np.float32)
    out[:, :slots] = -1
    out[:, slots:] = FLOOR
    out[r, at] = nxt[r, c]
    out[r, at + slots] = logt[same[r, c].sum(-1), used.sum(1)[r]]       # float64 -> float32: torch.tensor's rounding
    return out


def unpack_state(hidden: Tensor, slots: int, what: str) -> tuple[Tensor, Tensor]:
    """A compact state (``_state_row``; also :mod:`draft.suffix`'s) as ``(ids, scores)``: ``slots`` token ids
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
    """:func:`best_supported` of lookup's own states (``_state_row``), in 5 operators instead of 10 (issue 41): the
    state split once, ``topk`` of its scores as they are, the ``FLOOR`` of an unused slot turned into ``-inf``, the
    ids gathered. Equal to ``best_supported(state[..., :slots], state[..., slots:], vocab_size, k)`` because a
    lookup state keeps two invariants (``_state_row``): an unused slot holds id -1 and score ``FLOOR``, a used one an
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
    drafter's union reads (:meth:`LookupDrafter.union_candidates`; :func:`draft.merged.union_top_np` drops a slot by its
    -1 token on the host, so the two operators that turn ``FLOOR`` into ``-inf`` are not needed there). 3 operators."""
    ids, scores = state.split_with_sizes([slots, slots], dim=-1)    # (Tensor.split's Python wrapper costs more)
    s, j = torch.topk(scores, min(k, slots), dim=-1)
    return s, ids.gather(-1, j)


def tree_paths(parents: np.ndarray, tokens: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """The paths below the context of tree entries ``first ..`` of a tree (``parents``: every entry's parent entry, -1
    = below the context, ancestors first; ``tokens``: every entry's token): ``(paths [rows, D], depth [rows])``,
    paths left-aligned and -1 after their ``depth`` tokens, ``D = max(1, deepest)``. By pointer doubling: about
    log2(depth) steps of a few NumPy calls, whatever the rows (no walk per entry)."""
    n = parents.size
    up = np.append(np.where(parents >= 0, parents, n), n)      # n: above the root, and n -> n
    anc = np.arange(first, n)[:, None]                          # column k: the k-th ancestor (n once past the root)
    while anc.size and (anc[:, -1] < n).any():
        anc = np.concatenate([anc, up[anc]], axis=1)
        up = up[up]
    depth = (anc < n).sum(1)
    width = max(1, int(depth.max()) if depth.size else 1)
    k = depth[:, None] - 1 - np.arange(width)                   # column c holds the ancestor depth - 1 - c levels up
    pick = anc[np.arange(anc.shape[0])[:, None], np.clip(k, 0, anc.shape[1] - 1)]
    return np.where(k >= 0, np.append(tokens, -1)[pick], -1), depth


class LookupDrafter(TokenHistory):
    """Prompt lookup (n-gram copying) with the :class:`draft.protocol.TreeDrafter` methods."""

    meter: OpMeter = NULL_METER   # no model op to meter: its scores are table look-ups (model.meter)
    out_rows = True               # tree_forward takes rows= (draft.protocol.tree_outputs): only their states
    features_free = True          # tree_forward reads the token paths only (draft.merged.MergedDrafter.tree_inputs)

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8,
                 token_logp: float = math.log(0.6)) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        if vocab_size >= 2 ** 24:
            raise ValueError(f"lookup keeps token ids in float32 states: vocabulary {vocab_size} >= 2**24")
        self.max_matches, self.token_logp = max_matches, token_logp
        self._raw_ok = token_logp - math.log(max_matches) > FLOOR    # every used slot above FLOOR (lookup_supported)
        self.index = ContextIndex(max_ngram)
        self.ngrams = NgramIndex(min_ngram, max_ngram)           # the per-node path's index (vector_rows)
        # logt[c, n] = log(c / n) + token_logp (math.log, as the rule): a state's score of a token c of n matches had
        self.logt = np.full((max_matches + 1, max_matches + 1), FLOOR)
        for n in range(1, max_matches + 1):
            for c in range(1, n + 1):
                self.logt[c, n] = math.log(c / n) + token_logp
        self._logt_rows = self.logt.T.tolist()                    # [n][c]: the per-node rule's look-up
        TokenHistory.__init__(self)

    # Rows from which tree_forward takes the vectorised pass (level_matches); fewer go through the per-node rule
    # (NgramIndex.next_tokens + the rule's counting): measured on this CPU (docs/results.md §61), the vectorised
    # pass's fixed cost (about 40 NumPy calls) loses to the per-node Python below a few dozen rows and wins above
    # (a re-fed tree). Both give the same states (tests/test_lookup_level.py runs both).
    vector_rows: int = 48

    def continuations(self, path: list[int], length: int) -> list[list[int]]:
        """``find_continuations`` of the committed context followed by ``path`` (through the n-gram index)."""
        self.ngrams.sync(self.context)
        return self.ngrams.continuations(path, self.max_matches, length)

    def state(self, path: list[int]) -> Tensor:
        """The compact lookup state (module docstring) after the committed context followed by ``path``: the per-node
        rule of :meth:`tree_forward` for one row."""
        self.ngrams.sync(self.context)
        return torch.tensor(self._state_row(self.ngrams.next_tokens(path, self.max_matches)), dtype=torch.float32,
                            device=HOST)

    def _state_row(self, nxt: list[int]) -> list[float]:
        """The state rule (module docstring; its plain statement: ``tests/helpers.py``'s ``state_row``) for one
        row's next tokens ``nxt`` (:meth:`NgramIndex.next_tokens`), its scores looked up in ``logt`` (precomputed with
        :func:`math.log`): ids in order of first appearance, then their scores, unused slots id -1 and score
        ``FLOOR``."""
        counts: dict[int, int] = {}
        for t in nxt:
            counts[t] = counts.get(t, 0) + 1
        ids, lt = list(counts), self._logt_rows[len(nxt)]
        pad = self.max_matches - len(ids)
        return ids + [-1] * pad + [lt[c] for c in counts.values()] + [FLOOR] * pad

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        self.append_context(tokens)
        return self.state([])

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """The continuation trie (module docstring); ``top_k`` is not used (the matches decide the width)."""
        path = [] if self.context and self.context[-1] == root_token else [root_token]
        return continuation_trie(root_token, self.continuations(path, depth + 1), self.token_logp, total_token)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor, rows: Tensor | None = None) -> Tensor:
        """Every node's state (equal to stacking :meth:`state` per node), or with ``rows`` only those rows' states
        (:func:`draft.protocol.tree_outputs`; every node still becomes a tree entry): from :attr:`vector_rows` rows
        in one vectorised pass (:func:`tree_paths`, :func:`level_matches`, :func:`pack_states`), fewer per node
        (:meth:`NgramIndex.next_tokens`, then :meth:`_state_row`), whichever is cheaper on this CPU."""
        first = len(self.tree_tokens)
        par = (parents if parents.dim() == 1 else parents.reshape(-1)).tolist()
        if any(not -1 <= p < first + i for i, p in enumerate(par)):
            raise ValueError("lookup tree entries: a parent must be -1 or an earlier entry")
        self.tree_tokens += (tokens if tokens.dim() == 1 else tokens.reshape(-1)).tolist()
        self.tree_parents += par
        fed = len(par)
        want = range(fed) if rows is None else rows.tolist()
        if len(want) >= self.vector_rows:
            paths, depth = tree_paths(np.array(self.tree_parents, dtype=np.int64),
                                      np.array(self.tree_tokens, dtype=np.int64), first)
            if rows is not None:
                paths, depth = paths[want], depth[want]
            ix = self.index
            ix.sync(self.context)
            nxt = level_matches(ix.padded, ix.keys, ix.length, paths, depth, self.max_ngram, self.min_ngram,
                                self.max_matches)
            return torch.from_numpy(pack_states(nxt, self.logt))
        ng = self.ngrams
        ng.sync(self.context)
        m = self.max_matches
        paths = self._tree_paths(first)
        toks = self.tree_tokens
        for i in range(first, first + fed):
            p = par[i - first]
            paths.append((paths[p] if p >= 0 else []) + [toks[i]])   # its parent's path (an earlier entry) + its token
        rows_out = [self._state_row(ng.next_tokens(paths[first + i], m)) for i in want]
        # one NumPy conversion of the rows (Python floats -> float32 rounds as torch.tensor does; ids are exact)
        return torch.from_numpy(np.array(rows_out, dtype=np.float32).reshape(len(want), 2 * m))

    def _tree_paths(self, upto: int) -> list:
        """Each tree entry's path below the context (``_path``), kept for the entries fed since the last
        ``drop_tree``/``reset`` (which replace ``tree_tokens`` with a new list: the key) and grown by the per-node rule
        (a node's path is its parent's plus its token: no walk up per node). Entries fed otherwise (the vectorised
        pass, ``add_tree_paths``) are filled in by ``_path``. Returns the list, exactly ``upto`` long (entries ``< upto``)."""
        if getattr(self, "_paths_of", None) is not self.tree_tokens:
            self._paths_of, self._paths = self.tree_tokens, []
        paths = self._paths
        del paths[upto:]
        for i in range(len(paths), upto):
            paths.append(self._path(i))
        return paths

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
        # the float state (_state_row writes them), a float32 -> float64 widening is exact and keeps every
        # comparison (so topk's order), and the merged drafter's one concatenation widens both to float64 anyway:
        # the same candidates in 3 fewer operators per level (issue 41). Tokens come back as floats holding ids.
        m = self.max_matches
        if self._raw_ok:                                   # every used slot scores above FLOOR: lookup_supported
            return lookup_supported(hidden, m, k)
        return best_supported(hidden[..., :m], hidden[..., m:], self.vocab_size, k)

    def union_candidates(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """What a merged drafter's union reads (:meth:`draft.merged.MergedDrafter.top_numpy`, which drops an empty
        slot by its token -1): :meth:`supported_tokens` with the empty slots as ``(FLOOR, -1)`` instead of ``(-inf,
        -1)`` (:func:`lookup_supported_raw`, 2 operators fewer) where every used slot scores above ``FLOOR``; else
        :meth:`supported_tokens` itself."""
        if self._raw_ok and hidden.dtype in (torch.float32, torch.float64):
            return lookup_supported_raw(hidden, self.max_matches, k)
        return self.supported_tokens(hidden, k)

    def _unpack(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        return unpack_state(hidden, self.max_matches, "lookup")
