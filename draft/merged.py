"""Several drafters as one (``draft.sources=eagle,lookup,ssm:<dir>``): one merged token tree per call.

:class:`MergedDrafter` has the :class:`draft.protocol.TreeDrafter` methods, so every mode takes merged
trees unchanged:
  * ``start``/``commit`` go to every source; the returned state is the concatenation of the sources' states
    (each flattened, widened to their common dtype, which is exact), split again on the way in;
  * ``grow_tree`` asks every source for its own tree with the same arguments and merges them with
    :func:`draft.tree.merge_sources` under the one ``total_token`` budget (the rule: sampled proposals are
    kept whole, deterministic nodes survive by their best score over the sources, see there). Before the
    merge each source's scores are multiplied by its calibration scale (:func:`scale_scores`; 1 except a small
    LM's: ``draft.ssm_score_scale``, by default the student's own ``merge_score_scale``,
    :func:`student_score_scale`): a weak student's log-probabilities are over-confident next to EAGLE's, and a
    scale > 1 makes its nodes win only where it is sure;
  * ``tree_forward``/``drop_tree``/``logprobs`` (PipeDec grows its layers through them): each source feeds
    the same entries with its own slice of the features; ``logprobs`` of a merged state is the elementwise
    **maximum** of the sources' (scaled) log-scores, the same "best available score" rule as the tree merge;
    ``top_tokens`` ranks by that same maximum without vocabulary-sized work (the union of the sources' own
    top-k, :meth:`MergedDrafter.top_tokens`);
  * incremental expansion (``continuous``, :class:`draft.protocol.ExtendableTreeDrafter`) when no source samples:
    ``grow_tree_with_inputs`` is the merged tree plus each node's merged input state (:meth:`tree_inputs`), and
    ``extend_tree`` is the EAGLE-2 beam of :class:`draft.drafter.BeamTreeDrafter` over ``top_tokens``, so a
    lookup continuation keeps growing below a copied chain as an EAGLE guess does.

Sources are built by :func:`build_sources` from the ``draft.sources`` list: ``eagle`` (the drafter that
``model.head_dir`` selects: the EAGLE head, or the oracle/adversary test drafters), ``lookup`` (prompt
lookup, :mod:`draft.lookup`), ``suffix`` (suffix retrieval, :mod:`draft.suffix`), ``recycle`` (token recycling,
:mod:`draft.recycle_source`, fed through :meth:`MergedDrafter.observe_target`) and ``ssm:<dir>`` (a small causal LM,
:mod:`draft.ssm`).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import torch

from config.run_config import SourceError, parse_sources
from draft.drafter import BeamTreeDrafter
from draft.protocol import (DraftSampling, commit_tree_outputs, forget_requests, target_observer, top_tokens,
                            tree_outputs)
from draft.tree import DraftTree, below_mask, merge_sources
from model.devices import HOST
from model.grad import no_grad

Tensor = torch.Tensor


class MergedDrafter(BeamTreeDrafter):
    """See the module docstring. Instrumentation meters the sources, not the merge
    (:func:`draft.protocol.install_meter` reaches every source's model ops). Of :class:`BeamTreeDrafter` it uses
    ``extend_tree`` only (over :meth:`top_tokens`); its trees come from :func:`merge_sources`."""

    out_rows = True      # tree_forward / commit_tree_forward take rows= (draft.protocol.tree_outputs)

    def __init__(self, sources: list, names: list[str] | None = None,
                 score_scales: list[float] | None = None) -> None:
        if not sources:
            raise SourceError("draft.sources needs at least one source")
        self.sources = list(sources)
        self.names = list(names) if names else [type(s).__name__ for s in sources]
        self.score_scales = list(score_scales) if score_scales else [1.0] * len(self.sources)
        if len(self.score_scales) != len(self.sources) or any(c <= 0 for c in self.score_scales):
            raise SourceError("one positive score scale per source")
        self.widths: list[int] = []
        self._pack_buffers: dict = {}     # (shape, device) -> float64 buffer of top_numpy's one concatenation
        # each source's union candidates (top_numpy), resolved once: its own union_candidates (lookup: its raw
        # supported slots; suffix: its supported tokens), else draft.protocol.top_tokens
        self._candidates = [getattr(s, "union_candidates", None) or functools.partial(top_tokens, s)
                            for s in self.sources]
        self._scaled = any(c != 1.0 for c in self.score_scales)
        self._last_parts = None           # (tree_forward's output, its version, the sources' outputs): _split_known
        # the feed seam (draft.protocol.target_observer): the sources that watch the target's committed logits
        self._observers = [h for h in (target_observer(s) for s in self.sources) if h is not None]
        self.observes_target = bool(self._observers)

    def observe_target(self, tokens: list[int], logits: Tensor) -> None:
        """The feed seam (:func:`draft.protocol.target_observer`), forwarded to every source that defines it."""
        for hook in self._observers:
            hook(tokens, logits)

    @staticmethod
    def _cat(states: list[Tensor]) -> Tensor:
        """Concatenate along the last dim in the sources' common dtype (float32 for EAGLE + lookup: a smaller
        vector to allocate per commit than float64; widening is exact either way)."""
        dtype, dev = states[0].dtype, states[0].device
        if all(s.dtype == dtype and s.device == dev for s in states):     # the usual case: nothing to convert
            return torch.cat(states, dim=-1)
        for s in states[1:]:
            if s.dtype != dtype:
                dtype = torch.promote_types(dtype, s.dtype)
        return torch.cat([s.to(dev, dtype) for s in states], dim=-1)

    def _join(self, states: list[Tensor]) -> Tensor:
        self.widths = [int(s.shape[-1]) for s in states]
        return self._cat(states)

    def _split(self, state: Tensor) -> list[Tensor]:
        return state.split_with_sizes(self.widths, dim=-1)      # (Tensor.split's Python wrapper costs more)

    def reset(self) -> None:
        for s in self.sources:
            s.reset()

    def forget_requests(self) -> None:
        """:func:`draft.protocol.forget_requests` for every source."""
        for s in self.sources:
            forget_requests(s)

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor, sampling=None) -> Tensor:
        """Every source starts, each with the generation's ``sampling`` (the merge itself draws nothing)."""
        return self._join([s.start(prompt_ids, first_token, features, sampling=sampling) for s in self.sources])

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        return self._join([s.commit(tokens, features) for s in self.sources])

    @property
    def supports_extend(self) -> bool:
        """Incremental expansion is a deterministic beam: only when no source samples its drafts."""
        return not any(getattr(s, "samples", False) for s in self.sources)

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """Every source drafts with the same arguments, except that a sampling source (``samples`` true) gets
        ``1 + (total_token - 1) // len(sources)`` nodes: its draws are all kept by the merge, so it must leave
        room for the others. Then :func:`merge_sources` under ``total_token``."""
        share = 1 + (total_token - 1) // len(self.sources)
        trees = [s.grow_tree(root_token, h, share if getattr(s, "samples", False) else total_token, depth, top_k)
                 for s, h in zip(self.sources, self._split(root_hidden))]
        return merge_sources([scale_scores(t, c) for t, c in zip(trees, self.score_scales)], total_token)

    @no_grad
    def grow_tree_with_inputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                              top_k: int) -> tuple[DraftTree, Tensor]:
        """:meth:`grow_tree` (no source samples here: ``supports_extend``), plus each node's input state
        (:meth:`tree_inputs`) for :meth:`extend_tree`. A source with ``grow_tree_with_outputs`` (the EAGLE-2
        search) also hands over the draft outputs its search computed, so its slice of the inputs costs no
        forward wherever its own tree reached."""
        tree, inputs = self.grow_tree_deferred(root_token, root_hidden, total_token, depth, top_k)
        return tree, inputs()

    @no_grad
    def grow_tree_deferred(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int):
        """:func:`draft.protocol.grow_tree_deferred`: the merged tree now, :meth:`tree_inputs` when asked (the
        sources' states that no search computed cost a forward per level: after the first send)."""
        trees, searched = [], []
        for s, h in zip(self.sources, self._split(root_hidden)):
            if hasattr(s, "grow_tree_with_outputs"):
                t, _, out, known = s.grow_tree_with_outputs(root_token, h, total_token, depth, top_k)
                searched.append((t, out, known))
            else:
                t = s.grow_tree(root_token, h, total_token, depth, top_k)
                searched.append(None)
            trees.append(t)
        tree = merge_sources([scale_scores(t, c) for t, c in zip(trees, self.score_scales)], total_token)
        return tree, functools.partial(self.tree_inputs, tree, root_hidden, searched)     # (itself no_grad)

    @no_grad
    def tree_inputs(self, tree: DraftTree, root_hidden: Tensor, searched: list | None = None) -> Tensor:
        """Each node's input state: its parent's merged state (row 0 and the root's children: ``root_hidden``).

        Per source: a parent's state in that source is known when the source's own search computed it
        (``searched[i] = (its tree, outputs, known)`` from ``grow_tree_with_outputs``, matched to the merged
        tree by token path); the rest, a node proposed only by another source, is computed by feeding the
        source the parents it lacks, with their ancestors (a fed node attends to its path), level by level on
        top of the committed context. Exact: the same states a source's own search computes for the nodes it
        proposed (``searched`` None: every source is fed every inner node, as without it). A source whose states
        are a function of the token path alone (``features_free``: lookup, suffix) takes every fed node in one
        ``tree_forward`` (ancestors first, parents earlier in the same call), not one per level; a source with
        nothing to feed costs no ancestry and no level loop."""
        # Host bookkeeping in NumPy on the tree's buffers (issue 41: which nodes each source lacks, their levels and
        # cache slots are a few dozen host integers; as torch ops they were ~45 dispatched operators per source);
        # only the states' gathers and writes are torch ops.
        n = len(tree)
        tok_np, par_np, _, dep_np = tree.host_numpy()
        pl = par_np.tolist()
        has_child = np.zeros(n, dtype=bool)
        has_child[par_np[1:]] = True
        has_child[0] = False                                        # the root's state is root_hidden
        key = {(p, t): i for i, (p, t) in enumerate(zip(pl, tok_np.tolist()))}
        clamped = torch.from_numpy(np.maximum(par_np, 0))           # each node's parent row (the root: row 0)
        out_states = []
        for i, (src, h) in enumerate(zip(self.sources, self._split(root_hidden.reshape(1, -1)))):
            dev = h.device
            found = searched[i] if searched else None
            if found is None and getattr(src, "features_free", False):
                out_states.append(_path_states(src, tree, h, has_child, par_np))
                continue
            states = h.expand(n, -1).clone()                        # row i: node i's state in this source
            known = np.zeros(n, dtype=bool)
            known[0] = True
            if found is not None:
                at = _match_nodes_np(found[0], key)
                hit = np.flatnonzero((at > 0) & found[2].to(HOST).numpy())    # row 0 stays h: the root's own
                if hit.size:
                    states[torch.from_numpy(at[hit]).to(dev)] = \
                        found[1][torch.from_numpy(hit).to(found[1].device)].to(dev, states.dtype)
                    known[at[hit]] = True
            feed = has_child & ~known
            if feed.any():
                fl = feed.tolist()                                   # ancestors of a fed node are fed (its path):
                for j in range(n - 1, 0, -1):                        # one pass up, children after their parents
                    if fl[j]:
                        fl[pl[j]] = True
                feed = np.array(fl)
                feed[0] = False
                slot = np.full(n, -1, dtype=np.int64)                # draft-cache tree slot (root: -1)
                if getattr(src, "features_free", False):             # states from token paths: one call, all levels
                    levels = [np.flatnonzero(feed)]
                else:
                    levels = [np.flatnonzero((dep_np == d) & feed) for d in range(1, int(dep_np.max()) if n > 1 else 1)]
                for level in levels:
                    if level.size == 0:
                        continue
                    start = src.tree_size
                    par = par_np[level]
                    slot[level] = start + np.arange(level.size)       # before the parents' read
                    lv = torch.from_numpy(level)
                    out = src.tree_forward(tree.tokens[lv], states[torch.from_numpy(par).to(dev)],
                                           torch.from_numpy(slot[par]))
                    states[lv.to(dev)] = out.to(dev, states.dtype)   # lookup's live on the host
                src.drop_tree()
            out_states.append(states[clamped.to(dev)])               # row 0: states[0], h itself
        return self._cat(out_states)

    def top_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`top_numpy` as host tensors (of the same memory)."""
        return tuple(torch.from_numpy(x) for x in self.top_numpy(hidden, k))

    def host_top_numpy(self, hidden: Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`top_numpy`: a beam level's candidates (``draft.drafter._Beam`` keeps its bookkeeping in NumPy)."""
        return self.top_numpy(hidden, k)

    def top_numpy(self, hidden: Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The best ``k`` (score, token) per row of merged states by the **maximum** over the sources' (scaled)
        scores, the :meth:`logprobs` rule, from each source's own top-``k``: a token in the top ``k`` of the maximum
        is in the top ``k`` of a source that attains it, so the union holds the answer (ties aside). Each source
        answers through ONE method, resolved when the merge is built: its ``union_candidates(hidden, k)`` where it
        has one (lookup and suffix: only the tokens an occurrence supports, no vocabulary-sized work; an empty slot
        is token -1, whatever its score, and never wins: every other token of theirs is at their floor), else
        :func:`draft.protocol.top_tokens`. A token proposed twice keeps its best score. Fewer than ``k`` only where
        fewer distinct tokens were proposed in some row. Returned on the host: the sources' candidates cross in one
        copy (one concatenation of every source's scores and ids, as :func:`draft.drafter.to_host` packs them), and
        the dedup, whose width is read, runs there in NumPy (:func:`union_top_np`)."""
        parts = [f(h, k) for f, h in zip(self._candidates, self._split_known(hidden))]
        dev = parts[0][0].device
        scores = [p[0] for p in parts]
        if self._scaled:
            scores = [x if c == 1.0 else x.double() * c for x, c in zip(scores, self.score_scales)]
        xs = scores + [p[1] for p in parts]
        if any(x.device != dev for x in xs):
            xs = [x.to(dev) for x in xs]
        m = sum(x.shape[-1] for x in scores)
        # ONE concatenation into a float64 buffer kept per shape (float32 / float64 scores and int64 / float ids
        # widen exactly: ids below 2**53) and the level's one device->host copy; the dedup then runs in NumPy on
        # the host (union_top_np: why). The buffer is only read into fresh arrays (union_top_np), never kept.
        key = (xs[0].shape[:-1], 2 * m, dev)
        buf = self._pack_buffers.get(key)
        if buf is None:
            buf = self._pack_buffers[key] = torch.empty((*key[0], 2 * m), dtype=torch.float64, device=dev)
        return union_top_np(torch.cat(xs, dim=-1, out=buf).to(HOST).numpy(), m, k)   # (counted as a sync on a CPU)

    def host_top_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """:meth:`top_tokens`, which answers on the host already (one copy per level)."""
        return self.top_tokens(hidden, k)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor, rows: Tensor | None = None) -> Tensor:
        """Each source's :meth:`tree_forward` of its own slice of ``features``, the states joined; with ``rows``
        only those rows' (:func:`draft.protocol.tree_outputs`, asked of each source)."""
        outs = [s.tree_forward(tokens, f, parents) if rows is None else tree_outputs(s, tokens, f, parents, rows)
                for s, f in zip(self.sources, self._split(features))]
        out = self._cat(outs)
        # the parts of this output as the sources returned them, where they already had its dtype and device: a beam
        # level ranks exactly this output next (top_numpy), which then needs no split (issue 41: one operator per
        # level). Kept with the output's version: an in-place write to it after this call makes them stale.
        same = all(o.dtype == out.dtype and o.device == out.device for o in outs)
        self._last_parts = (out, out._version, outs) if same else None
        return out

    def _split_known(self, state: Tensor) -> list[Tensor]:
        """:meth:`_split` of ``state``; for the output of the last :meth:`tree_forward`, unchanged since (same object,
        same version), the parts it was concatenated from (the same values as the split's views, no operator)."""
        last = self._last_parts
        if last is not None and last[0] is state and last[1] == state._version:
            return last[2]
        return self._split(state)

    def commit_tree_forward(self, tokens: Tensor, features: Tensor, tree_tokens: Tensor, tree_inputs: Tensor,
                            parents: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Every source commits the same target ``features`` and feeds its own slice of ``tree_inputs``, in one
        forward where it can (:meth:`draft.drafter.Drafter.commit_tree_forward`), else commit then tree_forward;
        with ``rows`` only those tree rows' outputs (:func:`draft.protocol.commit_tree_outputs`)."""
        roots, outs = [], []
        for s, f in zip(self.sources, self._split(tree_inputs)):
            if hasattr(s, "commit_tree_forward"):
                r, o = s.commit_tree_forward(tokens, features, tree_tokens, f, parents) if rows is None else \
                    commit_tree_outputs(s, tokens, features, tree_tokens, f, parents, rows)
            else:
                r = s.commit(tokens, features)
                o = s.tree_forward(tree_tokens, f, parents) if rows is None else \
                    tree_outputs(s, tree_tokens, f, parents, rows)
            roots.append(r)
            outs.append(o)
        return self._join(roots), self._cat(outs)

    def drop_tree(self) -> None:
        for s in self.sources:
            s.drop_tree()

    @property
    def tree_size(self) -> int:
        return max(s.tree_size for s in self.sources)

    def logprobs(self, hidden: Tensor) -> Tensor:
        lps = [s.logprobs(h).double() for s, h in zip(self.sources, self._split(hidden))]
        lps = [lp if c == 1.0 else lp * c for lp, c in zip(lps, self.score_scales)]
        dev = lps[0].device
        out = lps[0]
        for lp in lps[1:]:
            out = torch.maximum(out, lp.to(dev))
        return out

    def source(self, kind: type):
        """The first source of class ``kind`` (e.g. the small LM for ``sps``), or None."""
        return next((s for s in self.sources if isinstance(s, kind)), None)


def _path_states(src, tree: DraftTree, h: Tensor, inner: np.ndarray, par_np: np.ndarray) -> Tensor:
    """:meth:`MergedDrafter.tree_inputs`' states for a source whose states are a function of the token path alone
    (``features_free``: lookup, suffix) and that searched nothing of its own: each node's input, its parent's state
    (``h`` for the root's children). Every inner node (``inner``: has a child, the root excluded) is fed in ONE
    ``tree_forward`` (ancestors first, so a parent's slot precedes its children's; the source reads no features: it
    gets ``h`` rows), then one gather from ``[h; outputs]`` (issue 41, the round start: the general loop's ancestor
    pass, per-level lists, state buffer and its writes are not needed here, where every inner node is fed). The same
    values as the general loop: there the fed set is the inner nodes too (only the root is known)."""
    n, dev = par_np.size, h.device
    fed = np.flatnonzero(inner)
    if fed.size == 0:
        return h.expand(n, -1)
    slot = np.full(n, -1, dtype=np.int64)                   # draft-cache tree slot (root: -1)
    slot[fed] = src.tree_size + np.arange(fed.size)
    out = src.tree_forward(tree.tokens[torch.from_numpy(fed)], h.expand(fed.size, -1),
                           torch.from_numpy(slot[par_np[fed]]))
    src.drop_tree()
    row = np.zeros(n, dtype=np.int64)                       # node -> its row of [h; outputs] (0: h)
    row[fed] = np.arange(1, fed.size + 1)
    return torch.cat([h, out.to(dev, h.dtype)])[torch.from_numpy(row[np.maximum(par_np, 0)]).to(dev)]


def union_top_np(both: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` distinct tokens per row of a union of host candidates ``both = [scores | tokens]`` (float64,
    ``[rows, 2m]``, ``m`` score columns; the tokens ride as float64: exact ids), what
    :meth:`MergedDrafter.top_numpy` hands over from its one device->host copy: each token at its best score, best
    first, ties by position in the union (a stable sort). An empty slot is ``(-inf, -1)`` (a source's
    :meth:`draft.lookup.LookupDrafter.supported_tokens`), and no candidate with score -inf is returned. Returns
    float64 scores and int64 tokens, ``kk = min(k, the fewest valid distinct tokens of any row)`` columns.

    Runs in NumPy on the host. Why: this is a few dozen host numbers per level, after the level's one device->host
    copy; as torch ops it was 19 dispatched operators per level (sort, gathers, an outer comparison, a read of the
    width): 70 us of host time for 10 rows of 18 candidates, 35 us here (one thread, thread clock; ``np.take_along_axis``
    instead of the fancy-index gathers would cost as much as the torch ops). The dispatched-operator count
    (``pipeline.tools.opcount``, the simulator's ``--rank0-cost ops``) does not see NumPy calls: they are host
    time, which layerbench's timings and the simulator's ``--rank0-cost measured`` do see (docs/results.md,
    §52 ("Fewer operators on the chain")). A fixed sequence of about ten NumPy calls, whatever the rows (no per-row
    Python)."""
    s, t = both[:, :m], both[:, m:].astype(np.int64)
    r = _rows(s.shape[0])                    # row-wise gathers by fancy indexing (take_along_axis: twice slower)
    order = np.argsort(-s, axis=-1, kind="stable")                           # best first, ties in union order
    s, t = s[r, order], t[r, order]
    bad = ((t[:, :, None] == t[:, None, :]) & below_mask(t.shape[1])).any(-1)   # a better copy comes earlier
    bad |= (s == -np.inf) | (t < 0)                   # a token out of reach, or an empty slot (its token is -1;
    #                                                   lookup's raw slots keep their FLOOR score: union_candidates)
    kk = min(k, bad.shape[-1] - int(bad.sum(-1).max())) if bad.size else 0
    pick = np.argsort(bad, axis=-1, kind="stable")[:, :kk]                   # the valid ones, in order
    return s[r, pick], t[r, pick]


@functools.lru_cache(maxsize=64)
def _rows(n: int) -> np.ndarray:
    """``[[0], [1], ..., [n-1]]`` (cached, read only): the row index of a row-wise fancy-index gather."""
    out = np.arange(n)[:, None]
    out.flags.writeable = False
    return out


def _match_nodes_np(tree: DraftTree, key: dict[tuple[int, int], int]) -> np.ndarray:
    """For each node of ``tree`` (ancestors first), the index of the node with the same token path in the tree
    whose ``(parent, token) -> index`` map is ``key``, or -1 where that tree lacks the path (NumPy int64)."""
    at = [0]
    for p, t in zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:]):
        at.append(key.get((at[p], t), -1) if at[p] >= 0 else -1)
    return np.array(at, dtype=np.int64)


def scale_scores(tree: DraftTree, scale: float) -> DraftTree:
    """``tree`` with every score times ``scale`` > 0: the source's calibration before the merge. Scores are
    log-scores <= 0 that never increase along a path; a positive factor keeps both and the tree's own order, so
    only the competition between sources changes."""
    return tree if scale == 1.0 else replace(tree, scores=tree.scores * scale)


def student_score_scale(path) -> float:
    """A small LM's own merge calibration: ``merge_score_scale`` in its ``config.json`` (written when it was
    calibrated against the EAGLE head on held-out prompts, e.g. ``data/calibration``), else 1."""
    import json
    from pathlib import Path
    try:
        value = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("merge_score_scale", 1.0)
    except (OSError, ValueError):
        return 1.0
    if not isinstance(value, (int, float)) or value <= 0:
        raise SourceError(f"draft.sources: ssm:{path}: merge_score_scale in config.json must be a number > 0")
    return float(value)


def build_sources(cfg, vocab_size: int, eagle_factory, dtype, device, vocab_model=None):
    """The drafter for ``cfg.draft.sources`` (``eagle_factory()`` builds the ``eagle`` source as
    ``model.head_dir`` says; ``vocab_model``: rank 0's stage, whose embedding and ``lm_head`` shared-vocabulary
    students use). One source is returned as itself (its trees are verified as they are)."""
    import math
    from pathlib import Path

    from draft.lookup import LookupDrafter
    from draft.ssm import SmallLMDrafter, SmallLMError
    d = cfg.draft
    sources, names, scales = [], [], []
    for kind, arg in parse_sources(d.sources):
        if kind == "eagle":
            sources.append(eagle_factory())
        elif kind == "lookup":
            sources.append(LookupDrafter(vocab_size, d.lookup_max_ngram, d.lookup_min_ngram, d.lookup_max_matches,
                                         math.log(d.lookup_token_prob)))
        elif kind == "suffix":
            from draft.suffix import build_suffix_source
            sources.append(build_suffix_source(cfg, vocab_size))
        elif kind == "recycle":
            from draft.recycle_source import build_recycle_source
            sources.append(build_recycle_source(cfg, vocab_size))
        else:
            if not (Path(arg) / "config.json").is_file():
                raise SourceError(f"draft.sources: ssm:{arg}: no config.json there (a Hugging Face causal LM "
                                  "directory, e.g. one written by python -m draft.train_ssm)")
            temp = cfg.gen.temperature if d.ssm_temperature < 0 else d.ssm_temperature
            try:
                sources.append(SmallLMDrafter(arg, vocab_size, dtype, device, sample=d.ssm_sample,
                                              temperature=temp, seed=cfg.gen.seed,
                                              vocab_model=vocab_model, follow=d.ssm_temperature < 0))
                # the run's settings; then each generation's own, at its start
                sources[-1].take_sampling(DraftSampling(cfg.gen.temperature, cfg.gen.seed))
            except SmallLMError as e:
                raise SourceError(f"draft.sources: ssm:{arg}: {e}") from None
        names.append(kind if not arg else f"{kind}:{arg}")
        scales.append((d.ssm_score_scale if d.ssm_score_scale > 0 else student_score_scale(arg)) if kind == "ssm"
                      else 1.0)
    if len(sources) == 1:
        return sources[0]
    return MergedDrafter(sources, names, scales)
