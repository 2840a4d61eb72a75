"""The drafter interface every mode talks to, and what a drafter returns.

A drafter lives on rank 0 and proposes continuations of the committed text. Every mode (``naive``,
``pruned``, ``continuous``, ``pipedec``) only calls the methods of :class:`TreeDrafter`; today's EAGLE
drafter (:class:`draft.drafter.Drafter`) already has exactly these methods, and so do the oracle/adversary
test drafters (:mod:`draft.oracle`), the small causal LM (:mod:`draft.ssm`), prompt lookup
(:mod:`draft.lookup`) and the merge of several of them (:mod:`draft.merged`).

What a drafter returns: ``grow_tree`` returns a :class:`draft.tree.DraftTree` rooted at the last committed
token (the root is *not* a guess: the target already chose it):
  * ``tokens[i]`` and ``parents[i]`` (``-1`` for the root, else an earlier node: ancestors first);
    sibling tokens are distinct (``tests.helpers.check_tree``); at most ``total_token`` nodes, root included;
  * ``scores[i]``: the node's cumulative draft score relative to the root (a log-probability for model
    drafters, lookup's match score for prompt lookup); along a path scores never increase, which is what
    ``top_nodes_tree``/``merge_sources`` rely on to keep budgets ancestor-closed;
  * for sampling, per node how its children were proposed (``DraftTree.proposals``): ``None`` means the
    tree is **deterministic** (top-k/beam or lookup: each child is a fixed guess, q = point mass, verified
    by ``pipeline.verify.walk_tree``); otherwise each node lists ``(child, q)`` in try order, where ``q`` is
    the [V] float64 distribution the child's token was *drawn* from, or ``None`` for a deterministic
    proposal (verified by ``pipeline.verify.walk_proposals``, SpecInfer's multi-step speculative sampling).

The "hidden" values that ``start``/``commit``/``tree_forward`` return are the drafter's own opaque state
for the next guess (EAGLE: the head's output feature; oracle/SSM/lookup: a log-probability vector over
the vocabulary; merged: the concatenation of its sources' states). Modes never look inside; they only hand
them back (``grow_tree``'s ``root_hidden``, PipeDec's per-node ``features``) and read ``logprobs`` of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from draft.tree import DraftTree

Tensor = torch.Tensor


@dataclass(frozen=True)
class DraftSampling:
    """One generation's sampling settings as its drafter takes them (an argument of :meth:`TreeDrafter.start`):
    the generation's ``temperature`` and ``seed`` (:class:`pipeline.engine.GenSettings`'). A drafter that samples
    its trees on request (``draft.eagle_sample``, a small LM's ``draft.ssm_sample``:
    :meth:`draft.drafter.BeamTreeDrafter.take_sampling`) draws them at T > 0 only, from this seed's stream, so one
    drafter serves generations of other settings without being rebuilt; a deterministic draft ignores it."""

    temperature: float
    seed: int


@runtime_checkable
class TreeDrafter(Protocol):
    """What every mode calls on ``engine.drafter`` (see the module docstring for the return values)."""

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor,
              sampling: DraftSampling | None = None) -> Tensor:
        """New generation: forget everything, take the prompt and the target's first token as the committed
        context. ``features``: the target's last-layer hidden state of every prompt token (EAGLE uses them;
        others may ignore them). ``sampling``: the generation's own (:class:`DraftSampling`; None: the settings
        the drafter was built with). Returns the state after ``first_token`` (the next tree's ``root_hidden``)."""

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        """Append committed ``tokens`` (accepted draft tokens, then the target's new token, which becomes the
        next root). ``features[i]``: the target feature of the position *before* ``tokens[i]``. Drops any
        temporary tree state. Returns the state after the last token."""

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                  top_k: int) -> DraftTree:
        """A draft tree rooted at ``root_token`` of at most ``total_token`` nodes (root included), at most
        ``depth + 1`` levels below the root, at most ``top_k`` children per node (lookup and merged trees may
        have more children per node: their budget is ``total_token``). Leaves the drafter's committed state
        unchanged."""

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        """Temporary tree entries (kept until :meth:`drop_tree`): node ``i`` holds ``tokens[i]`` below
        ``parents[i]`` (``-1``: below the last committed token; else an earlier entry of this tree, counted
        from the first entry since the last ``drop_tree``). ``features[i]``: the state returned for the parent
        (the root's for ``-1``). Returns each entry's state (rows, aligned with ``tokens``)."""

    def drop_tree(self) -> None:
        """Forget the temporary tree entries."""

    def logprobs(self, hidden: Tensor) -> Tensor:
        """Next-token log-scores ``[..., V]`` of states returned above (used to rank children)."""


@runtime_checkable
class ExtendableTreeDrafter(TreeDrafter, Protocol):
    """A :class:`TreeDrafter` whose trees come from the EAGLE-2 beam search and can be grown in place
    (incremental expansion, ``ContinuousMode``): :class:`draft.drafter.BeamTreeDrafter` and its subclasses,
    and wrappers that delegate to one (:class:`draft.osd.OnlineDrafter`). ``supports_extend`` is False where
    the trees may carry sampled draws (a small LM at T > 0): those are redrafted from the root instead."""

    supports_extend: bool

    def grow_tree_with_inputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                              top_k: int) -> tuple[DraftTree, Tensor]:
        """:meth:`grow_tree`, plus each node's draft input feature (what :meth:`extend_tree` re-feeds)."""

    def extend_tree(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor, levels: int, top_k: int,
                    max_new: int) -> tuple[DraftTree, Tensor]:
        """Grow ``levels`` levels below the best leaves, appending at most ``max_new`` nodes (ancestors-first,
        existing indices unchanged); returns the tree and its per-node input features."""


def grow_tree_deferred(drafter: object, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                       top_k: int):
    """``grow_tree_with_inputs`` in two halves: ``(tree, inputs)`` where ``inputs()`` gives the per-node input
    features that ``grow_tree_with_inputs`` would have returned with the same tree, bitwise.

    Why (issue 41, rank 0's turnaround): a round's first segment needs the tree alone, and the inputs can cost
    model calls of their own. A merged drafter computes, for a node that only another source proposed, the states
    a source lacks, one head forward per tree level (:meth:`draft.merged.MergedDrafter.tree_inputs`); a suffix
    chain copied 12 deep costs 11 forwards there. :meth:`pipeline.modes.flowspec.ContinuousMode.first_tree` sends
    the tree first and asks for its inputs after the send. The drafter's own ``grow_tree_deferred`` where it has
    one (a wrapper's forwards to its inner drafter), else both halves at once. Between the halves the caller
    makes no other call on the drafter: the second half feeds the sources on top of the state the first left."""
    own = getattr(drafter, "grow_tree_deferred", None)
    if own is not None:
        return own(root_token, root_hidden, total_token, depth, top_k)
    tree, inputs = drafter.grow_tree_with_inputs(root_token, root_hidden, total_token, depth, top_k)
    return tree, lambda: inputs


def meter_sites(drafter: object) -> list:
    """Every object of ``drafter`` whose ``meter`` attribute meters model work (:class:`model.meter.OpMeter`): the
    drafter itself (its ``logprobs`` as ``lm_head`` ops, a small LM's ``ssm_forward`` ops) and its draft head when it
    keeps a draft cache (EAGLE's ``draft_forward`` ops). A merged drafter (one with ``sources``) runs no model op of
    its own: its sites are its sources', so each op is metered exactly once. So are a wrapper's (one with ``inner``,
    e.g. :class:`draft.osd.OnlineDrafter`): the inner drafter's meter then also sees the ``lm_head`` calls of its own
    tree search (metering the wrapper's ``logprobs`` would miss those). None has no site."""
    if drafter is None:
        return []
    inner = getattr(drafter, "inner", None)
    if inner is not None:
        return meter_sites(inner)
    sources = getattr(drafter, "sources", None)
    if sources is not None:
        return [site for s in sources for site in meter_sites(s)]
    head = getattr(drafter, "head", None)
    return [drafter] + ([head] if head is not None and getattr(drafter, "cache", None) is not None else [])


def install_meter(drafter: object, meter) -> None:
    """Put ``meter`` (:class:`model.meter.OpMeter`) on every site of ``drafter`` that runs model work
    (:func:`meter_sites`)."""
    for site in meter_sites(drafter):
        site.meter = meter


def top_tokens(drafter: object, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The best ``k`` (log-score, target token) per row of ``hidden`` (fewer where the drafter's vocabulary is
    smaller), best first: the drafter's own ``top_tokens`` where it has one (a reduced draft vocabulary, a lookup
    state or merged sources rank without vocabulary-sized work), else ``torch.topk`` of :meth:`TreeDrafter.logprobs`.
    Both give the same ranking (ties aside): ``logprobs`` is -inf (or a floor) wherever ``top_tokens`` cannot reach."""
    own = getattr(drafter, "top_tokens", None)
    if own is not None:
        return own(hidden, k)
    lp = drafter.logprobs(hidden)
    return torch.topk(lp, min(k, lp.shape[-1]), dim=-1)


def target_observer(drafter: object):
    """The feed seam (issue 45): the callable ``observe(tokens, logits)`` through which ``drafter`` watches the
    target's logits of committed positions, or None when nothing of it watches (then the seam costs nothing).

    The rule: :class:`pipeline.engine.OutputBuffer` (every mode's one commit path, :meth:`OutputBuffer.extend`)
    calls it once per commit with the tokens each committed token follows and the logits rows those committed
    tokens were chosen from: ``logits[i]`` is the target's distribution after ``tokens[i]`` (a committed token: the
    prompt's last token, then every committed token but the newest), rows the verifier already computed, never an
    extra ``lm_head``. Only committed positions: what is observed is a function of the committed prefix (the
    target's own distributions there), so a draft built from it changes neither greedy output nor the sampling law.
    A hook must not change the logits and should cost what it needs (one ``topk`` for :mod:`draft.recycle_source`).

    Found as the drafter's optional ``observe_target`` method; a drafter may say it has nothing to watch with a
    false ``observes_target`` (:class:`draft.merged.MergedDrafter` forwards to the sources that define the hook and
    says so when none does); a wrapper's (``inner``: :class:`draft.osd.OnlineDrafter`, the simulator's) is its inner
    drafter's."""
    owner = hook_owner(drafter, "observe_target")
    return owner.observe_target if owner is not None and getattr(owner, "observes_target", True) else None


def hook_owner(drafter: object, name: str):
    """The drafter that answers an optional hook ``name``: ``drafter`` itself when it defines it, else a wrapper's
    (``inner``) inner drafter, recursively; None when none does (or ``drafter`` is None)."""
    while drafter is not None and getattr(drafter, name, None) is None:
        drafter = getattr(drafter, "inner", None)
    return drafter


def forget_requests(drafter: object) -> None:
    """A fresh measurement: ``drafter`` forgets what earlier requests of this process taught it (the suffix
    source's store of earlier texts, token recycling's table, online learning's distilled weights), so that decoding
    the same prompts once more drafts what the first decode drafted.

    Why: a drafter that remembers earlier requests (issue 45) proposes an earlier *answer* when the same prompt
    comes back. In serving that is the point; in a run that decodes the same prompts again -- every mode of
    ``pipeline.run --modes`` (also ``bench`` and ``eval``), the warm-up before them, every replay and pass of the
    simulator -- the later decodes would copy the earlier ones' answers and report a speed no single-mode run
    gets (docs/results.md §89: the what-if's `continuous` τ 1.86 -> 2.46 with the suffix source, before this rule).
    So those loops call this before each mode or replay, and each one sees as earlier requests only its own.

    Found as the drafter's optional ``forget_requests`` method; a merged drafter forwards to its sources, a
    wrapper (``inner``) to its inner drafter (:class:`draft.osd.OnlineDrafter` forgets its learning, then forwards);
    a drafter without such memory needs nothing. Never called by the decode loop or the server."""
    owner = hook_owner(drafter, "forget_requests")
    if owner is not None:
        owner.forget_requests()


def can_extend(drafter: object) -> bool:
    """True when ``drafter`` supports incremental expansion (:class:`ExtendableTreeDrafter`)."""
    return isinstance(drafter, ExtendableTreeDrafter) and bool(drafter.supports_extend)


def tree_outputs(drafter: object, tokens: Tensor, features: Tensor, parents: Tensor, rows: Tensor) -> Tensor:
    """``drafter.tree_forward(tokens, features, parents)[rows]``: every row fed (a tree entry until ``drop_tree``),
    only the outputs of ``rows`` (indices of fed rows, a host long tensor) returned, in that order.

    Why: a re-fed tree (an expansion, a prefetch: :mod:`draft.drafter`) needs the outputs of its frontier or its
    leaves only, and every row must still enter the cache (a later row attends to its ancestors). A drafter whose
    ``tree_forward`` takes ``rows`` (``out_rows = True``: :class:`draft.drafter.Drafter`,
    :class:`draft.merged.MergedDrafter`) skips the other rows' work: an EAGLE head's keys and values depend on each
    row's own input, so its last layer runs attention, output projection and MLP for the wanted rows alone
    (:class:`draft.fused_head.FusedHead`). Any other drafter runs every row and the wanted ones are taken."""
    if getattr(drafter, "out_rows", False):
        return drafter.tree_forward(tokens, features, parents, rows=rows)
    out = drafter.tree_forward(tokens, features, parents)
    return out[rows.to(out.device)]


def commit_tree_outputs(drafter: object, tokens: Tensor, features: Tensor, tree_tokens: Tensor, tree_inputs: Tensor,
                        parents: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """``drafter.commit_tree_forward(...)`` (the commit's last output, the tree rows' outputs) with only the tree
    rows ``rows``' outputs, as :func:`tree_outputs`."""
    if getattr(drafter, "out_rows", False):
        return drafter.commit_tree_forward(tokens, features, tree_tokens, tree_inputs, parents, rows=rows)
    root, out = drafter.commit_tree_forward(tokens, features, tree_tokens, tree_inputs, parents)
    return root, out[rows.to(out.device)]
