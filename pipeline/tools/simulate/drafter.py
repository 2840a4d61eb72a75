"""The replay drafter: rank 0's real drafter, fed the target's features, its model calls logged as modeled ops.

In a replay the stages' "hidden states" are stand-in rows ``(on_path, position)`` (:mod:`.stand_ins`), not
features. :class:`ReplayDrafter` turns the rows that ``start`` and ``commit`` receive into the target's real
features at those positions (:class:`.recorded.Committed`) and passes every other call to the real drafter
unchanged, so the draft trees are exactly those of a real run on the same committed text. Invariant: a row that
is committed is on the committed path (else the replay has diverged: :class:`AssertionError`).

It has the methods of :class:`draft.protocol.TreeDrafter` (``start``, ``commit``, ``grow_tree``,
``tree_forward``, ``drop_tree``, ``logprobs``, ``top_tokens``) and the incremental-expansion extension the
``continuous`` mode uses when ``supports_extend`` is true (``grow_tree_with_inputs``, ``extend_tree``), each
delegated explicitly.

:func:`record_drafter` makes the real drafter's draft-head forwards and draft log-prob (lm_head) calls show up in
rank 0's op log as modeled ops (``draft``, ``lm_head``), which the timing model prices by the profile.
"""
from __future__ import annotations

import torch

from draft.protocol import grow_tree_deferred, top_tokens
from draft.tree import DraftTree
from model.meter import vocab_share
from pipeline.tools.simulate.oplog import OpLog
from pipeline.tools.simulate.recorded import Committed

Tensor = torch.Tensor


class ReplayDrafter:
    """The real drafter, fed the target's features at the positions the replay rows name."""

    def __init__(self, drafter, committed: Committed, log: OpLog | None = None) -> None:
        self.inner, self.committed, self.log = drafter, committed, log

    def _features(self, rows: Tensor) -> Tensor:
        """The target's features at the rows' positions: the replay's own lookup, not rank 0's work (with a log:
        untimed, and its output counts as device memory, where a stage's features arrive)."""
        if self.log is None:
            return self._lookup(rows)
        with self.log.untimed():
            out = self._lookup(rows)
        if self.log.counter is not None:
            self.log.counter.mark(out)
        return out

    def _lookup(self, rows: Tensor) -> Tensor:
        if not bool((rows[:, 0] > 0.5).all()):
            raise AssertionError("replay: a committed row is off the committed path")
        return self.committed.features[rows[:, 1].long()]

    # -- the two calls that carry the target's data: stand-in rows become the target's features ----------
    def start(self, prompt_ids: list[int], first_token: int, features: Tensor, sampling=None) -> Tensor:
        return self.inner.start(prompt_ids, first_token, self._features(features), sampling=sampling)

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        return self.inner.commit(tokens, self._features(features))

    # -- the rest of draft.protocol.TreeDrafter: the drafter's own states, passed through -------------------
    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                  top_k: int) -> DraftTree:
        return self.inner.grow_tree(root_token, root_hidden, total_token, depth, top_k)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        return self.inner.tree_forward(tokens, features, parents)

    def drop_tree(self) -> None:
        self.inner.drop_tree()

    def top_tokens(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return top_tokens(self.inner, hidden, k)

    def logprobs(self, hidden: Tensor) -> Tensor:
        return self.inner.logprobs(hidden)

    # -- incremental expansion (draft.drafter.Drafter; not in the Protocol) ---------------------------------
    @property
    def supports_extend(self) -> bool:
        return bool(getattr(self.inner, "supports_extend", False))

    def grow_tree_with_inputs(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int,
                              top_k: int) -> tuple[DraftTree, Tensor]:
        return self.inner.grow_tree_with_inputs(root_token, root_hidden, total_token, depth, top_k)

    def grow_tree_deferred(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int):
        return grow_tree_deferred(self.inner, root_token, root_hidden, total_token, depth, top_k)

    def extend_tree(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor, levels: int, top_k: int,
                    max_new: int) -> tuple[DraftTree, Tensor]:
        return self.inner.extend_tree(tree, inputs, root_hidden, levels, top_k, max_new)

    def commit_extend_tree(self, tokens: Tensor, features: Tensor, tree: DraftTree, inputs: Tensor, levels: int,
                           top_k: int, max_new: int, pre: tuple | None = None) -> tuple[DraftTree, Tensor, Tensor]:
        """``tree.fuse_commit`` (:meth:`draft.drafter.BeamTreeDrafter.commit_extend_tree`): a commit, so the rows
        become the target's features first."""
        return self.inner.commit_extend_tree(tokens, self._features(features), tree, inputs, levels, top_k, max_new,
                                             pre)

    def prefetch_leaves(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor, top_k: int) -> tuple:
        return self.inner.prefetch_leaves(tree, inputs, root_hidden, top_k)

    def append_prefetched_level(self, tree: DraftTree, inputs: Tensor, pre: tuple, top_k: int, max_new: int):
        return self.inner.append_prefetched_level(tree, inputs, pre, top_k, max_new)

    def prefetch_expansion(self, tree: DraftTree, inputs: Tensor, root_hidden: Tensor | None, top_k: int, width: int,
                           commit: tuple[Tensor, Tensor] | None = None) -> tuple:
        """``tree.early_whole``: with ``commit`` a commit, so its rows become the target's features first."""
        if commit is not None:
            commit = (commit[0], self._features(commit[1]))
        return self.inner.prefetch_expansion(tree, inputs, root_hidden, top_k, width, commit)

    def append_prefetched_expansion(self, tree: DraftTree, inputs: Tensor, pre: tuple, pre2: tuple, top_k: int,
                                    max_new: int, cover: float = 1.0):
        return self.inner.append_prefetched_expansion(tree, inputs, pre, pre2, top_k, max_new, cover)


class LogMeter:
    """An :class:`model.meter.OpMeter` that logs each op as a modeled rank-0 op of the current log (``lm_head`` as
    ``("lm_head", rows, share)``, ``share`` = the vocabulary rows applied / the target's vocabulary (1 unless the
    draft has a reduced vocabulary), ``draft_forward`` as ``("draft", rows, ctx)``, ``ssm_forward`` as ``("ssm",
    rows, ctx)``), its own CPU time recorded with it."""

    def __init__(self, log: OpLog, vocab_size: int = 0) -> None:
        self.log, self.vocab_size = log, vocab_size

    def op(self, kind: str, rows: int, ctx: int = 0):
        if kind == "lm_head":
            return self.log.modeled("lm_head", rows, vocab_share(ctx, self.vocab_size))
        return self.log.modeled("ssm" if kind == "ssm_forward" else "draft", rows, ctx)


def record_drafter(drafter, log: OpLog, vocab_size: int = 0) -> None:
    """Log the drafter's model ops (draft log-prob / lm_head calls, draft-head and small-LM forwards) as modeled
    rank-0 ops: one :class:`LogMeter` on every site (:func:`draft.protocol.install_meter`). A later call only
    redirects the logging to ``log``, so one drafter serves replay after replay."""
    meter = getattr(drafter, "_replay_log_meter", None)
    if meter is not None:
        meter.log = log
        return
    from draft.protocol import install_meter
    meter = drafter._replay_log_meter = LogMeter(log, vocab_size)
    install_meter(drafter, meter)
