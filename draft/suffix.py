"""Suffix retrieval: a drafter with no weights that copies the continuations of the longest earlier match of the
text's suffix, found with suffix automata (SAM-Decoding, SuffixDecoding) over four kinds of text:

  * the request's own text (prompt + committed tokens), indexed as tokens commit;
  * earlier requests of the same process (``draft.suffix_history_tokens``; a bounded store shared by every suffix
    drafter of the same configuration in the process, :func:`shared_store`: serving reuses the drafter, and a
    rebuilt drafter finds the store again);
  * an optional static corpus (``draft.suffix_corpus=<path>``: a ``.txt`` with one text per line, or a ``.jsonl``
    whose records hold ``text``, ``turns`` or ``token_ids``), tokenised once per process (:func:`corpus_automaton`).

The structure (pure functions on :class:`SuffixAutomaton`, property-tested against brute force in
``tests/test_suffix.py``): the online suffix automaton of a token list, with, per state, the number of end
positions of its strings (``cnt``: how often they occur) and the number of real (non-separator) outgoing tokens.
Documents are separated by unique negative tokens, so no match spans two documents. A **match** ``(state, L)``
is the longest suffix (length ``L``) of the query text that occurs in the indexed text (:func:`advance`), and
:func:`with_continuation` shortens it to the longest suffix that occurs *followed by a token*: in the request's own
automaton the text itself is indexed, so that is exactly "the longest suffix with an earlier occurrence" (what
:mod:`draft.lookup` searches with n-grams of at most 3 tokens; here of any length, at O(1) amortised cost per
token instead of a search).

Proposals: below a match ``u`` (``L >= draft.suffix_min_match``) the continuation trie of ``u`` is walked best
first: a node ``x1..xd`` scores ``log(cnt(u x1..xd) / N) + log p(L) + log p(L + 1) + ... + log p(L + d - 1)``,
``N`` the occurrences of ``u`` followed by a token and ``cnt(u x1..xd)`` those followed by ``x1..xd`` (so
``log(cnt / N)`` is the empirical probability of the path; the ``j``-th copied token is copied below a match of
``L + j`` tokens, the match having grown by the ones before it; scores never increase along a path). Every node keeps its ``draft.suffix_max_children`` most frequent
children, the trie is at most ``depth + 1`` deep (as :mod:`draft.lookup`'s; ``draft.suffix_max_depth`` sets another
depth), and the three automata's tries are
united by token path with the best score (one trie; the tree merge's rule). The tree is deterministic (q = point
mass): greedy output and the sampling law are the verifier's business, never the drafter's.

**The rule that joins it with the EAGLE tree** (SAM-Decoding: use the retrieval draft when the match is long,
else the EAGLE-2 tree), expressed through scores inside the one merged node budget of
:func:`draft.tree.merge_sources`: ``p(L)``, the prior probability that one copied token is right, is
``draft.suffix_long_token_prob`` when the match length ``L >= draft.suffix_threshold``, else
``draft.suffix_token_prob`` (for a match in the store or the corpus the threshold is
``draft.suffix_other_threshold``: other texts' matches are right less often, :meth:`SuffixDrafter.other_prior`). A
long match's chain scores near ``d * log p_long``, above EAGLE's own nodes beyond the first level, so it takes the
budget's first places ("take the retrieval branch"); a short match's first tokens score low and survive only where
EAGLE is less sure still, and its deeper tokens rise to ``p_long`` as the match grows past the threshold. The
thresholds and the two priors were measured on held-out records (docs/suffix.md: the target's acceptance of the
copied tokens by match length).

State ("hidden") for the tree interface, the same layout as :mod:`draft.lookup`'s so that
:class:`draft.merged.MergedDrafter` merges it as a source: the next-token scores after a sequence (the trie's first
level: a child ``x`` scores ``log(cnt(u x) / N) + log p(L)``, best over the automata), compact: ``max_children``
token ids then their scores (unused slots: id ``-1``, score ``FLOOR``), float32 (ids exact below 2**24).
``logprobs`` spreads it over the vocabulary, ``supported_tokens`` reads only its slots.

Speed: a commit advances every automaton by the committed tokens (O(1) amortised each, plus the count update
along the request automaton's suffix links); a tree entry (``tree_forward``) is one :func:`advance` per automaton
from its parent's match; a tree is ``total_token`` heap steps, each over one state's children. No call scans the
context.
"""
from __future__ import annotations

import heapq
import json
import math
from collections import deque
from pathlib import Path

import torch

from config.run_config import SourceError
from draft.lookup import FLOOR, best_supported, spread_state, unpack_state   # FLOOR: the same floor as lookup's
from draft.token_history import TokenHistory
from draft.tree import DraftTree
from model.devices import HOST
from model.meter import NULL_METER, OpMeter

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------------------------
# The suffix automaton (pure data structure)
# ---------------------------------------------------------------------------------------------------------------

class SuffixAutomaton:
    """The online suffix automaton of a token list (Blumer et al.), built by :meth:`extend` one token at a time.

    Invariants (checked against brute force in ``tests/test_suffix.py``), for the text ``s`` extended so far:
      * reading a string ``w`` from state 0 along ``next`` succeeds iff ``w`` occurs in ``s``; the state reached is
        ``w``'s class (all strings with the same end positions), whose lengths are ``(length[link[v]], length[v]]``;
      * ``cnt[v]`` is the number of end positions of ``v``'s strings (occurrences of each of them in ``s``);
      * ``nreal[v]`` is the number of non-negative tokens in ``next[v]`` (negative tokens are document separators);
      * the arrays depend on ``s`` alone: extending token by token between queries builds exactly what building
        from scratch builds.
    Cost: O(1) amortised per token for the automaton, plus the count update along the suffix links of the new
    state (their number is the number of distinct repeat classes of the text's suffixes: small for text, up to the
    period's multiples in a looping text).
    """

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.cnt: list[int] = [0]
        self.nreal: list[int] = [0]
        self.last = 0
        self.size = 0              # tokens extended so far (separators included)
        self.separators = 0

    def __len__(self) -> int:
        return len(self.length)

    def extend(self, c: int) -> None:
        nxt, link, length, cnt, nreal = self.next, self.link, self.length, self.cnt, self.nreal
        cur = len(length)
        nxt.append({})
        length.append(length[self.last] + 1)
        link.append(0)
        cnt.append(0)
        nreal.append(0)
        p = self.last
        real = c >= 0
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            if real:
                nreal[p] += 1
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                length.append(length[p] + 1)
                link.append(link[q])
                cnt.append(cnt[q])
                nreal.append(nreal[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
        self.size += 1
        v = cur
        while v > 0:                 # the new end position belongs to every class on the suffix-link path
            cnt[v] += 1
            v = link[v]

    def extend_all(self, tokens) -> None:
        for t in tokens:
            self.extend(int(t))

    def add_document(self, tokens) -> None:
        """Append ``tokens`` then a separator no other document shares (a negative token): no match crosses it."""
        self.extend_all(tokens)
        self.separators += 1
        self.extend(-self.separators)


def advance(sam: SuffixAutomaton, state: int, length: int, token: int) -> tuple[int, int]:
    """The match after appending ``token``: from ``(state, length)``, the longest suffix of the query text that
    occurs in ``sam``'s text, to that of the query text followed by ``token`` (classic suffix-automaton matching:
    shorten along suffix links until ``token`` can follow)."""
    nxt, link, ln = sam.next, sam.link, sam.length
    while state > 0 and token not in nxt[state]:
        state = link[state]
        length = ln[state]
    v = nxt[state].get(token)
    if v is None:
        return 0, 0
    return v, length + 1


def with_continuation(sam: SuffixAutomaton, state: int, length: int) -> tuple[int, int]:
    """The longest suffix of the match ``(state, length)`` that occurs in ``sam``'s text followed by a real token
    (the shorter suffixes live on the suffix-link path); ``(0, 0)`` when none does."""
    link, ln, nreal = sam.link, sam.length, sam.nreal
    while state > 0 and nreal[state] == 0:
        state = link[state]
        length = ln[state]
    return (state, length) if state > 0 else (0, 0)


def children(sam: SuffixAutomaton, state: int, k: int) -> tuple[list[tuple[int, int, int]], int]:
    """``state``'s ``k`` most frequent real continuations as ``(count, token, next state)`` (count descending, then
    token ascending), and the total count over all of them (``N``: occurrences followed by a real token)."""
    cnt = sam.cnt
    items = [(cnt[v], t, v) for t, v in sam.next[state].items() if t >= 0]
    total = sum(c for c, _, _ in items)
    if len(items) > k:
        items = heapq.nsmallest(k, items, key=lambda x: (-x[0], x[1]))
    else:
        items.sort(key=lambda x: (-x[0], x[1]))
    return items, total


def token_logp(length: int, threshold: int, short_logp: float, long_logp: float) -> float:
    """SAM's rule as a score prior: the log-probability that one token copied below a match of ``length`` is right
    (``long_logp`` from ``threshold`` on)."""
    return long_logp if length >= threshold else short_logp


def path_logp(length: int, d: int, threshold: int, short_logp: float, long_logp: float) -> float:
    """The prior of ``d`` copied tokens below a match of ``length``: ``sum_{j < d} token_logp(length + j)`` (the
    ``j``-th token is copied below a match grown by ``j``), in closed form. Non-increasing in ``d``."""
    n_long = max(0, d - max(0, threshold - length))
    return n_long * long_logp + (d - n_long) * short_logp


def continuation_tree(root_token: int, roots: list[tuple], total_token: int, max_depth: int,
                      max_children: int) -> DraftTree:
    """The united continuation trie below ``root_token`` (module docstring), best ``total_token`` nodes (root
    included), ancestors first and scores non-increasing (a best-first walk emits a node after its parent, and a
    child never scores above its parent). ``roots``: per automaton, its proposal match and prior ``(sam, state, L,
    prior)`` (state 0: no proposal; ``prior(L, d)``: the log prior of ``d`` tokens copied below a match of ``L`` in
    that automaton, :func:`path_logp` with its threshold). A path proposed by several automata is one node with the
    first (best) score; the children of every automaton that reached it hang below it."""
    heap: list = []
    order = 0
    for sam, state, length, prior in roots:
        if state <= 0:
            continue
        kids, total = children(sam, state, max_children)
        for c, t, v in kids:
            heapq.heappush(heap, (-(math.log(c / total) + prior(length, 1)), order, 0, t, sam, v, 1, total, length,
                                  prior))
            order += 1
    toks, pars, scores = [root_token], [-1], [0.0]
    index: dict[tuple[int, int], int] = {}
    while heap and len(toks) < total_token:
        neg, _, parent, t, sam, v, d, total, length, prior = heapq.heappop(heap)
        node = index.get((parent, t))
        if node is None:
            node = index[(parent, t)] = len(toks)
            toks.append(t)
            pars.append(parent)
            scores.append(-neg)
        if d >= max_depth:
            continue
        kids, _ = children(sam, v, max_children)
        for c, t2, v2 in kids:
            heapq.heappush(heap, (-(math.log(c / total) + prior(length, d + 1)), order, node, t2, sam, v2, d + 1,
                                  total, length, prior))
            order += 1
    return DraftTree(torch.tensor(toks, device=HOST), torch.tensor(pars, device=HOST),
                     torch.tensor(scores, dtype=torch.float32, device=HOST))


def first_level(roots: list[tuple], slots: int) -> list[float]:
    """The compact state row (module docstring): the trie's first level, best score per token over the automata,
    best first (ties: smaller token), ``slots`` ids then ``slots`` scores; ``roots`` as
    :func:`continuation_tree`'s."""
    best: dict[int, float] = {}
    for sam, state, length, prior in roots:
        if state <= 0:
            continue
        lp = prior(length, 1)
        kids, total = children(sam, state, slots)
        for c, t, _ in kids:
            s = math.log(c / total) + lp
            if s > best.get(t, -math.inf):
                best[t] = s
    items = sorted(best.items(), key=lambda x: (-x[1], x[0]))[:slots]
    pad = slots - len(items)
    return [float(t) for t, _ in items] + [-1.0] * pad + [s for _, s in items] + [FLOOR] * pad


# ---------------------------------------------------------------------------------------------------------------
# Earlier requests and the static corpus
# ---------------------------------------------------------------------------------------------------------------

class SuffixStore:
    """A bounded store of earlier requests' texts (prompt + output) and their automaton. At most ``capacity``
    tokens: adding past it drops the oldest texts (down to 3/4 of the capacity, so a rebuild is amortised over a
    quarter of the capacity) and rebuilds the automaton from the rest. ``capacity`` 0: keeps nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.docs: deque[list[int]] = deque()
        self.tokens = 0
        self.sam = SuffixAutomaton()
        self.version = 0           # bumped whenever the automaton changes (drafters re-match then)

    def add(self, tokens: list[int]) -> None:
        if self.capacity <= 0 or not tokens:
            return
        doc = list(tokens[-self.capacity:])
        self.docs.append(doc)
        self.tokens += len(doc)
        if self.tokens > self.capacity:
            while self.tokens > self.capacity * 3 // 4 and len(self.docs) > 1:
                self.tokens -= len(self.docs.popleft())
            self.sam = SuffixAutomaton()
            for d in self.docs:
                self.sam.add_document(d)
        else:
            self.sam.add_document(doc)
        self.version += 1

    def clear(self) -> None:
        """Every earlier text goes (:func:`draft.protocol.forget_requests`)."""
        self.docs.clear()
        self.tokens = 0
        self.sam = SuffixAutomaton()
        self.version += 1


_STORES: dict[tuple, SuffixStore] = {}
_CORPORA: dict[tuple, SuffixAutomaton] = {}


def shared_store(key: tuple, capacity: int) -> SuffixStore:
    """The process-wide store for ``key`` (e.g. the vocabulary size and the ``draft.sources`` text: drafters of the
    same configuration share their earlier requests; two configurations in one process never see each other's)."""
    store = _STORES.get(key)
    if store is None or store.capacity != capacity:
        store = _STORES[key] = SuffixStore(capacity)
    return store


def read_corpus(path: str | Path, tokenize) -> list[list[int]]:
    """The texts of a corpus file as token lists: ``.jsonl`` records with ``token_ids`` (used as they are),
    ``text`` or ``turns`` (joined by newlines), or a bare string; any other file: one text per non-empty line.
    ``tokenize(text) -> list[int]``. A file that cannot be read or parsed is a :class:`SourceError`."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"draft.suffix_corpus={path}: cannot read it ({type(e).__name__})") from None
    docs = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                rec = json.loads(line)
            except ValueError:
                raise SourceError(f"draft.suffix_corpus={path}: line {n} is not JSON") from None
            if isinstance(rec, dict) and isinstance(rec.get("token_ids"), list):
                docs.append([int(t) for t in rec["token_ids"]])
                continue
            text = rec if isinstance(rec, str) else (rec.get("text") if isinstance(rec, dict) else None)
            if text is None and isinstance(rec, dict) and isinstance(rec.get("turns"), list):
                text = "\n".join(str(t) for t in rec["turns"])
            if not isinstance(text, str):
                raise SourceError(f"draft.suffix_corpus={path}: line {n} has no text, turns or token_ids")
            docs.append(list(tokenize(text)))
        else:
            docs.append(list(tokenize(line)))
    return docs


def corpus_automaton(path: str | Path, tokenize, key: tuple = ()) -> SuffixAutomaton:
    """The automaton of a corpus file's texts (:func:`read_corpus`), built once per process per
    ``(path, modification time, key)`` (``key``: the tokenizer's identity)."""
    p = Path(path)
    try:
        stamp = p.stat().st_mtime_ns
    except OSError:
        raise SourceError(f"draft.suffix_corpus={path}: no such file") from None
    k = (str(p.resolve()), stamp, key)
    sam = _CORPORA.get(k)
    if sam is None:
        sam = SuffixAutomaton()
        for doc in read_corpus(p, tokenize):
            sam.add_document(doc)
        _CORPORA[k] = sam
    return sam


# ---------------------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------------------

class SuffixDrafter(TokenHistory):
    """Suffix retrieval with the :class:`draft.protocol.TreeDrafter` methods (module docstring)."""

    meter: OpMeter = NULL_METER   # no model op to meter
    out_rows = True               # tree_forward takes rows= (draft.protocol.tree_outputs): only their states
    features_free = True          # tree_forward reads the token paths only (draft.merged.MergedDrafter.tree_inputs)

    def __init__(self, vocab_size: int, store: SuffixStore | None = None, corpus: SuffixAutomaton | None = None,
                 min_match: int = 1, threshold: int = 3, token_prob: float = 0.3, long_token_prob: float = 0.8,
                 max_children: int = 8, max_depth: int = 0, other_threshold: int = 8) -> None:
        if vocab_size >= 2 ** 24:
            raise SourceError(f"suffix keeps token ids in float32 states: vocabulary {vocab_size} >= 2**24")
        if min_match < 1 or threshold < 1 or other_threshold < 1 or max_children < 1 or max_depth < 0:
            raise SourceError("draft.suffix_min_match, suffix_threshold, suffix_other_threshold and "
                              "suffix_max_children must be >= 1 and suffix_max_depth >= 0")
        if not (0 < token_prob <= 1 and 0 < long_token_prob <= 1):
            raise SourceError("draft.suffix_token_prob and suffix_long_token_prob must be in (0, 1]")
        self.vocab_size, self.store, self.corpus = vocab_size, store, corpus
        self.min_match, self.threshold, self.max_children, self.max_depth = min_match, threshold, max_children, max_depth
        self.other_threshold = other_threshold
        self.short_logp, self.long_logp = math.log(token_prob), math.log(long_token_prob)
        TokenHistory.__init__(self)

    def prior(self, length: int, d: int) -> float:
        """:func:`path_logp` with this drafter's threshold and priors: a match in the request's own text."""
        return path_logp(length, d, self.threshold, self.short_logp, self.long_logp)

    def other_prior(self, length: int, d: int) -> float:
        """:func:`path_logp` for a match in another text (the store of earlier requests, the static corpus): the
        long prior from ``other_threshold`` on.

        Why another threshold: a match of a given length in other requests' text is right less often than one in
        the request's own text (measured on self-distilled conversations held out of the corpus, docs/suffix.md
        "Other texts' threshold": at 3 tokens 0.41 against 0.77, at 5 0.62 against 0.86; both above 0.9 from 12).
        With the own text's threshold their short matches took the long prior and their chains displaced the
        head's nodes from the one node budget (docs/results.md §98)."""
        return path_logp(length, d, self.other_threshold, self.short_logp, self.long_logp)

    @property
    def state_width(self) -> int:
        return 2 * self.max_children

    def reset(self) -> None:
        """A new request: the one that ended (if any) joins the process-wide store first."""
        if self.store is not None and getattr(self, "context", None):
            self.store.add(self.context)
        TokenHistory.reset(self)
        self.sam = SuffixAutomaton()          # the request's own text
        self.others: list[SuffixAutomaton] = [s for s in (self.store.sam if self.store else None, self.corpus)
                                              if s is not None]
        self.matches: list[tuple[int, int]] = [(0, 0)] * len(self.others)   # committed context vs the others
        self.tree_matches: list[tuple] = []  # per tree entry: (own match, matches in the others)

    def forget_requests(self) -> None:
        """:func:`draft.protocol.forget_requests`: the store of earlier requests is emptied (the process-wide one of
        this configuration: every drafter sharing it forgets) and the request that ended does not join it; the
        static corpus stays (it is configuration, not memory)."""
        self.context = []
        if self.store is not None:
            self.store.clear()
        self.reset()

    # -- matches ---------------------------------------------------------------------------------------------
    def _own_root(self) -> tuple[int, int]:
        return self.sam.last, self.sam.length[self.sam.last]

    def _roots(self, own: tuple[int, int], others: list[tuple[int, int]]):
        """Per automaton ``(sam, state, L, prior)`` of the proposal match, state 0 below ``min_match``; the own text's
        prior first, then :meth:`other_prior` for the store and the corpus."""
        out = []
        for i, (sam, (st, ln)) in enumerate(zip([self.sam, *self.others], [own, *others])):
            st, ln = with_continuation(sam, st, ln)
            if ln < self.min_match:
                st = 0
            out.append((sam, st, ln, self.other_prior if i else self.prior))
        return out

    def _advance(self, own, others, token: int):
        return (advance(self.sam, own[0], own[1], token),
                [advance(s, st, ln, token) for s, (st, ln) in zip(self.others, others)])

    def _path_matches(self, path: list[int]):
        own, others = self._own_root(), list(self.matches)
        for t in path:
            own, others = self._advance(own, others, t)
        return own, others

    def match_lengths(self, path: list[int] = ()) -> list[int]:
        """The proposal match length per automaton (own text, store, corpus) after the context followed by
        ``path`` (0: no proposal): what the threshold is measured on."""
        return [ln if st > 0 else 0 for _, st, ln, _ in self._roots(*self._path_matches(list(path)))]

    # -- protocol --------------------------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> None:
        self.context = []
        self._append(prompt_ids)

    def _append(self, tokens: list[int]) -> None:
        self.context += tokens
        self.sam.extend_all(tokens)
        ms = self.matches
        for t in tokens:
            ms = [advance(s, st, ln, t) for s, (st, ln) in zip(self.others, ms)]
        self.matches = ms

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        self.drop_tree()
        self._append([int(t) for t in tokens.reshape(-1).tolist()])
        return self.state([])

    def state(self, path: list[int]) -> Tensor:
        """The compact state (module docstring) after the committed context followed by ``path``."""
        row = first_level(self._roots(*self._path_matches(path)), self.max_children)
        return torch.tensor(row, dtype=torch.float32, device=HOST)

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """The united continuation trie (module docstring), at most ``depth + 1`` levels (``max_depth`` levels when
        set: a long match's chain may then copy past the head's depth, still within ``total_token``); ``top_k`` is
        not used (``draft.suffix_max_children`` and the counts decide the width)."""
        path = [] if self.context and self.context[-1] == root_token else [root_token]
        if total_token <= 1:
            return DraftTree.single(root_token)
        return continuation_tree(root_token, self._roots(*self._path_matches(path)), total_token,
                                 self.max_depth or depth + 1, self.max_children)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor, rows: Tensor | None = None) -> Tensor:
        """Every entry's state, each one :func:`advance` per automaton from its parent's match (parents: ``-1`` =
        below the committed context, else an earlier tree entry); with ``rows`` only those entries' states
        (:func:`draft.protocol.tree_outputs`: every entry still advances its matches, which later entries read)."""
        toks, pars = tokens.reshape(-1).tolist(), parents.reshape(-1).tolist()
        first = len(self.tree_matches)
        self.tree_tokens += toks
        self.tree_parents += pars
        base = (self._own_root(), list(self.matches))
        for t, p in zip(toks, pars):
            own, others = base if p < 0 else self.tree_matches[p]
            self.tree_matches.append(self._advance(own, others, int(t)))
        want = range(len(toks)) if rows is None else rows.tolist()
        out = [first_level(self._roots(*self.tree_matches[first + i]), self.max_children) for i in want]
        return torch.tensor(out, dtype=torch.float32, device=HOST).reshape(len(out), self.state_width)

    def drop_tree(self) -> None:
        TokenHistory.drop_tree(self)
        self.tree_matches = []

    def logprobs(self, hidden: Tensor) -> Tensor:
        """The states spread over the vocabulary: ``[..., V]`` float64, ``FLOOR`` where no match supports a token."""
        return spread_state(*self._unpack(hidden), self.vocab_size)

    def supported_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The best ``min(k, max_children)`` (score, token) per state among the supported tokens, empty slots as
        (-inf, -1) (what :meth:`draft.merged.MergedDrafter.top_tokens` reads; no vocabulary-sized work)."""
        return best_supported(*self._unpack(hidden), self.vocab_size, k)

    union_candidates = supported_tokens   # what a merged drafter's union reads (draft.merged.MergedDrafter.top_numpy)

    def _unpack(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        return unpack_state(hidden, self.max_children, "suffix")


def build_suffix_source(cfg, vocab_size: int) -> SuffixDrafter:
    """The ``suffix`` source of ``draft.sources`` from the ``draft.suffix_*`` keys: the process-wide store of this
    configuration and, with ``draft.suffix_corpus``, the corpus automaton (tokenised with stage 0's tokenizer,
    unless its records carry ``token_ids``)."""
    d = cfg.draft
    store = shared_store((vocab_size, d.sources), d.suffix_history_tokens) if d.suffix_history_tokens > 0 else None
    corpus = None
    if d.suffix_corpus:
        stage_root = cfg.model.stage_dir
        corpus = corpus_automaton(d.suffix_corpus, _lazy_tokenizer(stage_root), (stage_root, vocab_size))
    return SuffixDrafter(vocab_size, store, corpus, d.suffix_min_match, d.suffix_threshold, d.suffix_token_prob,
                         d.suffix_long_token_prob, d.suffix_max_children, d.suffix_max_depth,
                         d.suffix_other_threshold)


def _lazy_tokenizer(stage_root: str):
    """``text -> ids`` with stage 0's tokenizer, loaded at the first text (a corpus of ``token_ids`` needs none)."""
    held = []

    def tokenize(text: str) -> list[int]:
        if not held:
            from transformers import AutoTokenizer

            from config.paths import DEFAULT_STAGE_DIR
            from model.stage_format import stage_dir
            sdir = stage_dir(stage_root or DEFAULT_STAGE_DIR, 0)
            try:
                held.append(AutoTokenizer.from_pretrained(sdir))
            except Exception as e:
                raise SourceError(f"draft.suffix_corpus: no usable tokenizer in {sdir} to tokenise it "
                                  f"({str(e).splitlines()[0][:120]})") from None
        return held[0](text, add_special_tokens=False)["input_ids"]
    return tokenize
