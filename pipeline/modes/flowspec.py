"""FlowSpec (``continuous``) and its ``pruned`` ablation: rank 0's asynchronous streaming loop.

One round, as seen from rank 0 (ranks 1..N run :mod:`pipeline.worker`; the transport is :mod:`pipeline.outbox`)::

    draft a tree from the root -> fill: send up to world_size segments of it (nodes beyond wait on rank 0)
    each step:
      receive the oldest segment in flight; its rows still in the tree are nodes [0, k) (none: a stale result)
      verify the prefix-closed subtree they complete (walk_tree)
      issue one Decision: CONTINUE (re-root at a child the draft already has) | TRUNCATE (no such child, or
        finished); it goes point to point to the stages at once and rides on the next segment
      CONTINUE: re-root; send the nodes already drafted and waiting first, then commit the accepted tokens to
        the drafter and expand (continuous) while the stages compute; send what the expansion added if a
        link is free
      TRUNCATE: the next round's tree follows at once; stale work in flight is dropped where it stands

No step waits for the stages to agree: a stage prunes with whatever decisions it holds when a segment reaches
it, and the segments in flight keep at most ``world_size`` live ones (one per ring link) so that rank 0 never
floods the ring with work a decision is about to kill.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from config.profiles import load_profile
from draft.protocol import can_extend, grow_tree_deferred
from draft.tree import DraftTree, keep_indices_for, merge_trees, split_sizes
from model.devices import HOST
from pipeline.budget import (AcceptanceStats, StepCosts, affordable_levels, choose_segment_size, lookahead_levels,
                             path_probs)
from pipeline.engine import DecodeResult, Engine, OutputBuffer, live_segments, segment_cap
from pipeline.messages import Segment, Status
from pipeline.outbox import Outbox, RankTree
from pipeline.verify import Sampler, walk_tree


@dataclass
class StepVerdict:
    """What one returned segment verified: tree nodes ``[0, k)`` were checked against the target."""

    k: int                    # nodes of the current tree this result completed (a prefix: score order)
    path: list[int]           # accepted nodes, root first (tree indices)
    token: int                # the target's own token after the path (the bonus token)
    new_root: int | None      # CONTINUE: the node that already holds ``token``; None: TRUNCATE
    committed: list[int]      # accepted draft tokens, then ``token``
    features: torch.Tensor    # target features of the path's positions (what the drafter commits)
    logits: torch.Tensor | None = None   # target logits of nodes [0, k): committed[j] was chosen at path[j]


def verify_step(engine: Engine, state: RankTree, msg: Segment, sampler: Sampler) -> StepVerdict | None:
    """Score-ordered step-wise verification: verify what one returned segment completes (None: nothing).

    Why a single segment can be verified on its own: rank 0 sends the tree's nodes in index order, which is
    the draft's score order with every ancestor before its descendants (:func:`draft.tree.top_nodes_tree`,
    ``extend_tree``), and expansion only appends; so the sent nodes are always a prefix of the tree and the
    rows of a returned segment that are still alive are exactly the next unverified prefix ``[0, k)``
    (:meth:`pipeline.outbox.RankTree.alive_rows` checks it). Every node in ``[0, k)`` has its target logits
    and its ancestors' (``parents[i] < i``), so :func:`pipeline.verify.walk_tree` can resolve the path through
    them now, without waiting for the rest of the tree: the best-scored candidates are verified first, one
    pipeline step after they were sent. A result whose rows were all pruned by a decision issued while it
    travelled verifies nothing (``None``).
    """
    rows, k = state.alive_rows(msg)
    if k == 0:
        return None
    hidden = msg.x[0][rows.to(msg.x.device)]
    logits = engine.logits(hidden)
    tree = state.tree
    with engine.tracer.span("verify"):
        path, token, new_root = walk_tree(tree, k, logits, sampler)
    committed = tree.tokens[path[1:]].tolist() + [token]
    return StepVerdict(k, list(path), token, new_root, committed, hidden[path], logits)


def root_children_inputs(parents: np.ndarray, root_hidden: torch.Tensor) -> torch.Tensor | None:
    """Each node's draft input in a tree whose every node but the root is the root's child (``parents``: the tree's
    parent array, ``-1`` for the root): ``root_hidden`` per row, on fresh memory; None for any other tree.

    Why it is exact: a node's draft input is its parent's draft output, and the root's own row is ``root_hidden``
    (:meth:`draft.drafter.BeamTreeDrafter.grow_tree_with_inputs`), so in such a tree every row is the root's output,
    for any drafter (a merged drafter's rows are its sources' root states joined, which is ``root_hidden``). A deeper
    tree's rows below a child are that child's output, which only a forward gives: None."""
    if parents.size > 1 and int(parents[1:].max()) > 0:
        return None
    return root_hidden[None].expand(parents.size, -1).clone()


class StreamingMode:
    """Shared FlowSpec step loop. Subclasses choose the first tree and how the tree grows per step."""

    commit_every_step = True  # feed accepted features to the drafter at every verified step

    # -- strategy hooks ----------------------------------------------------------------------------
    def first_tree(self, engine: Engine, root: int, root_hidden: torch.Tensor) -> DraftTree:
        t = engine.cfg.tree
        with engine.tracer.span("draft"):
            return engine.drafter.grow_tree(root, root_hidden, t.init_total_token, t.init_depth, t.init_topk)

    def fill_sizes(self, engine: Engine, state: RankTree) -> list[int]:
        """Segment sizes for the waiting nodes when (re)filling the ring; nodes beyond their sum keep waiting."""
        cap = self.budget_size(engine, state)
        return split_sizes(state.waiting, live_segments(engine), cap or engine.cfg.tree.subseq_token)

    def budget_size(self, engine: Engine, state: RankTree) -> int | None:
        """Cost-aware segment size when ``tree.budget`` names a profile (``None`` otherwise): the prefix of the
        waiting nodes, in send order, that maximises expected tokens per second of the step's bottleneck,
        each node worth its draft path probability ``exp(score)`` (:func:`pipeline.budget.choose_segment_size`
        states the rule and its properties)."""
        if not engine.cfg.tree.budget or not state.waiting:
            return None
        return choose_segment_size(path_probs(state.tree.scores[state.sent:]), self.profile_costs(engine))

    def profile_costs(self, engine: Engine) -> StepCosts:
        """The step costs of the ``tree.budget`` profile for this ring, loaded once per (profile, world)."""
        key = (engine.cfg.tree.budget, engine.comm.world)
        if getattr(self, "_costs_key", None) != key:
            self._costs = StepCosts.from_profile(load_profile(key[0]), key[1])
            self._costs_key = key
        return self._costs

    def grow(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor, verified: bool) -> DraftTree:
        return tree

    def finish_first_tree(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor) -> DraftTree:
        """Called once per round after the fill: complete a first tree that :meth:`first_tree` started small."""
        return tree

    def on_reroot(self, keep: torch.Tensor, accepted_len: int) -> None:
        pass

    def observe(self, tree: DraftTree, verdict: StepVerdict) -> None:
        """Called with every verified step before the re-root (the tree the verdict's indices refer to)."""

    # -- the loop ------------------------------------------------------------------------------------
    def decode(self, engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
               out: OutputBuffer) -> DecodeResult:
        x = out.sampler.choose(logits)
        out.extend([x], logits[None])
        with engine.tracer.span("draft"):
            root_hidden = engine.drafter.start(prompt_ids, x, features, sampling=out.draft_sampling)
        box = Outbox(engine)
        self.deferred = None
        rounds, accepts, steps = 0, [], 0
        while not out.finished:
            rounds += 1
            x, root_hidden, n_steps = self.run_round(engine, box, x, root_hidden, out, accepts)
            steps += n_steps
        steps += box.drain()
        out.drafted = box.next_gid - rounds   # every node sent but each round's fresh root (a committed token)
        return DecodeResult(rounds, accepts, steps)

    @staticmethod
    def segment_target(engine: Engine) -> int:
        """Waiting nodes that make a segment worth sending before drafting: a thinner pool (say the new root
        alone) is sent after the expansion instead, so one segment carries the root and its best children
        rather than splitting levels across two ring trips."""
        t = engine.cfg.tree
        return t.expand_subseq_token if t.expand_subseq_token > 0 else t.subseq_token

    def deepen(self, engine: Engine, state: RankTree, root_hidden: torch.Tensor) -> bool:
        """Draft ahead: grow the tree so that a free ring link has nodes to carry. Returns whether nodes were
        added (the base class never drafts ahead)."""
        return False

    def top_up(self, engine: Engine, box: Outbox, state: RankTree, root_hidden: torch.Tensor | None = None) -> None:
        """Keep ``world_size`` live segments in flight: send waiting nodes, and when none wait and a link is
        free, draft ahead (:meth:`deepen`, given ``root_hidden``) and send what that added."""
        alive = state.alive_gids()
        while box.live_inflight(alive) < live_segments(engine):
            if not state.waiting and (root_hidden is None or not self.deepen(engine, state, root_hidden)):
                break
            cap = segment_cap(engine, self.budget_size(engine, state) or engine.cfg.tree.expand_subseq_token)
            state.send(box, state.waiting if cap < 0 else min(cap, state.waiting))
            alive = state.alive_gids()

    def fill(self, engine: Engine, box: Outbox, state: RankTree) -> None:
        """Send the waiting nodes in up to ``world_size`` segments (:meth:`fill_sizes`) while links are free."""
        for size in self.fill_sizes(engine, state):
            if box.live_inflight(state.alive_gids()) >= live_segments(engine):
                break
            state.send(box, size)

    def run_round(self, engine: Engine, box: Outbox, root: int, root_hidden: torch.Tensor | None, out: OutputBuffer,
                  accepts: list[int]):
        if root_hidden is None:      # tree.root_first: the round's root leaves before the commit that drafts from it
            state = RankTree(DraftTree.single(root))
            state.send(box, 1)
            root_hidden = self._commit(engine, *self.deferred)
            self.deferred = None
            state.set_tree(self.first_tree(engine, root, root_hidden))     # node 0: that root (sent)
        else:
            state = RankTree(self.first_tree(engine, root, root_hidden))
        self.fill(engine, box, state)
        grown = self.finish_first_tree(engine, state.tree, root_hidden)
        if len(grown) > len(state.tree):
            state.set_tree(grown)
            self.fill(engine, box, state)
        self.after_send(engine, state, root_hidden)
        pending_tokens: list[int] = []
        pending_feats: list[torch.Tensor] = []
        steps = 0
        while True:
            if not box.inflight:
                raise RuntimeError("protocol stalled: nothing in flight and nothing to verify")
            msg = box.receive()
            steps += 1
            verdict = verify_step(engine, state, msg, out.sampler)
            if verdict is None:   # a stale result: nothing of the current tree was verified
                state.set_tree(self.grow(engine, state.tree, root_hidden, False))
                self.top_up(engine, box, state, root_hidden)
                continue
            self.observe(state.tree, verdict)
            path = verdict.path
            accepts.append(out.extend(verdict.committed, verdict.logits, path))
            engine.observe_step(state.tree, path, verdict.token, out.finished)
            pending_tokens += verdict.committed
            pending_feats.append(verdict.features)
            path_gids = state.gids[path].tolist()
            if out.finished or verdict.new_root is None:
                box.decide(Status.TRUNCATE, path_gids, -1, out.finished)
                if not out.finished and engine.cfg.tree.root_first:
                    self.deferred = (pending_tokens, pending_feats)   # committed after the next root's send
                    return verdict.token, None, steps
                if not out.finished:
                    root_hidden = self._commit(engine, pending_tokens, pending_feats)
                return verdict.token, root_hidden, steps
            box.decide(Status.CONTINUE, path_gids, int(state.gids[verdict.new_root]), False)
            with engine.tracer.span("prune"):
                keep = keep_indices_for(state.tree, path, verdict.new_root)
                state.reroot(keep, len(path))
                self.on_reroot(keep, len(path))
            early = self.send_early(engine, state)
            if early or state.waiting >= self.segment_target(engine):
                self.top_up(engine, box, state)      # what is already drafted goes out first
            if self.commit_every_step:
                fused = self.commit_and_grow(engine, state.tree, pending_tokens, pending_feats)
                if fused is None:
                    root_hidden = self._commit(engine, pending_tokens, pending_feats)
                    state.set_tree(self.grow(engine, state.tree, root_hidden, True))
                else:
                    tree, root_hidden = fused
                    state.set_tree(tree)
                pending_tokens, pending_feats = [], []
            else:
                state.set_tree(self.grow(engine, state.tree, root_hidden, True))
            self.top_up(engine, box, state, root_hidden)
            self.after_send(engine, state, root_hidden)

    # tree.root_first (issue 41): (tokens, features) of a truncated round, committed only after the next round's root
    # was sent (run_round). Why: a round start's turnaround otherwise holds the commit (a head forward) and the quick
    # first tree's levels, though the stages need nothing of them to compute the root itself; the root's result then
    # verifies the root alone (one more segment per round: measured in docs/results.md §59,
    # to cut the turnaround but not to raise the what-if's throughput, so it is off by default).
    deferred: tuple | None = None

    def send_early(self, engine: Engine, state: RankTree) -> bool:
        """After a re-root, before the commit: add to the tree nodes that need no model call, to be sent at once
        (True: it added some). The base class adds none."""
        return False

    def after_send(self, engine: Engine, state: RankTree, root_hidden: torch.Tensor) -> None:
        """Work that waits for no result, done after a step's ring sends while the stages compute (off rank 0's
        turnaround). The base class has none."""

    def commit_and_grow(self, engine: Engine, tree: DraftTree, tokens: list[int],
                        feats: list[torch.Tensor]) -> tuple[DraftTree, torch.Tensor] | None:
        """Commit the accepted tokens and grow the re-rooted tree in one call, ``(grown tree, root_hidden)``; None:
        this mode does it as a commit then :meth:`grow` (the base class always)."""
        return None

    @staticmethod
    def _commit(engine: Engine, tokens: list[int], feats: list[torch.Tensor]) -> torch.Tensor:
        with engine.tracer.span("draft"):
            return engine.drafter.commit(torch.tensor(tokens, device=HOST), torch.cat(feats))


class PrunedMode(StreamingMode):
    """Step-wise verification and pruning of one tree per round, no expansion."""

    commit_every_step = False


class ContinuousMode(StreamingMode):
    """FlowSpec: after each verified step the tree grows again (dynamic expansion).

    ``tree.expand_levels > 0`` (default): incremental expansion (:meth:`draft.drafter.Drafter.extend_tree`):
    the surviving tree keeps its drafted nodes and their draft inputs, and grows ``expand_levels`` levels below
    its best leaves, up to ``expand_total_token`` nodes in all: the likely outcomes of the segments in flight
    are drafted ahead, at a cost that does not grow with the tree's depth. ``expand_levels = 0``: the paper
    code's expansion, a fresh ``expand_depth``-deep EAGLE-2 tree drafted from the new root and merged.
    ``expand_total_token = 0``: no expansion after a verified step (the ablation; with
    ``ahead_levels`` off, as by default, it is ``pruned`` with this mode's quick-started first tree and per-step
    commits).
    """

    def __init__(self) -> None:
        self.inputs: torch.Tensor | None = None   # draft input feature per tree node (incremental expansion)
        self.quick_fill = False                   # the round's quick-started first tree is not sent yet
        self.acceptance: AcceptanceStats | None = None   # per-level acceptance, measured with tree.lookahead_*
        self.pre: tuple | None = None             # tree.prefetch_level: the next expansion's first level, per node
        self.early: tuple[int, int] | None = None  # tree.early_level: (levels, room) of the expansion under way
        self.pre2: tuple | None = None            # tree.early_whole: the next expansion's second level (prefetched)
        self.whole = False                        # tree.early_whole: this step's whole expansion was sent early
        self.split = 0                            # tree.early_split: the first of a whole send's two segments

    @staticmethod
    def incremental(engine: Engine) -> bool:
        """Incremental expansion needs per-node draft inputs and a deterministic beam (``supports_extend``: EAGLE
        heads, deterministic small LMs, merged sources none of which samples); drafters with sampled draws redraft
        from the root."""
        return engine.cfg.tree.expand_levels > 0 and can_extend(engine.drafter)

    def first_tree(self, engine: Engine, root: int, root_hidden: torch.Tensor) -> DraftTree:
        """A round's first tree. Incremental expansion with ``tree.first_levels > 0``: only the best
        ``subseq_token + 1`` nodes of its first ``first_levels`` levels, sent as one segment after
        ``first_levels`` draft steps instead of ``init_depth + 1``; :meth:`finish_first_tree` grows the rest
        while it travels, and the rest fills the other links."""
        t = engine.cfg.tree
        self.pending = None
        if not self.incremental(engine):
            self.inputs = None
            return super().first_tree(engine, root, root_hidden)
        quick = self.quick_start(t)
        self.quick_fill = quick
        self.pre = self.early = self.pre2 = None
        self.whole = False
        total = self.quick_total(t) if quick else t.init_total_token
        depth = t.first_levels - 1 if quick else t.init_depth
        if quick and depth == 0 and engine.cfg.draft.tree_shape == "eagle2":   # the root's children alone:
            # their inputs wait for the send (take_lazy; a confidence shape drafts 2 levels at depth 0)
            with engine.tracer.span("draft"):
                tree = engine.drafter.grow_tree(root, root_hidden, total, depth, t.init_topk)
            self.inputs = None
            return tree
        if quick:         # sent first: its inputs (take_lazy) and its buffers at the round's capacity after the send
            with engine.tracer.span("draft"):
                tree, self.pending = grow_tree_deferred(engine.drafter, root, root_hidden, total, depth, t.init_topk)
            self.inputs = None
            return tree
        with engine.tracer.span("draft"):
            tree, self.inputs = engine.drafter.grow_tree_with_inputs(root, root_hidden, total, depth, t.init_topk)
        return tree.with_capacity(self.capacity(t))

    @staticmethod
    def quick_start(t) -> bool:
        """Whether a round's first tree starts quick (``t``: the ``tree`` run keys): ``tree.first_levels`` levels sent
        first, the rest grown while they travel (:meth:`finish_first_tree`); on an incremental drafter only."""
        return 0 < t.first_levels <= t.init_depth

    @staticmethod
    def quick_total(t) -> int:
        """Nodes of a quick-started first tree (``t``: the ``tree`` run keys): one segment's worth and the root."""
        return min(t.init_total_token, t.subseq_token + 1)

    # issue 41, the round start: a quick first tree is drafted without its inputs (one level: by ``grow_tree``;
    # more: by ``grow_tree_deferred``, whose second half waits here) and :meth:`take_lazy` gives them after the first
    # send; until then ``self.inputs`` is None (what :meth:`finish_first_tree` reads)
    pending = None

    def take_lazy(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor) -> None:
        """A quick first tree's inputs (:meth:`first_tree`), after its send: ``self.inputs``, exactly what
        ``grow_tree_with_inputs`` gives with the tree. A tree of two levels or more calls the second half that
        :func:`draft.protocol.grow_tree_deferred` left (``self.pending``); a one-level tree's inputs are below.

        Why: on rank 0's turnaround at a round start (a truncation's result in hand -> the new tree's send) nothing
        of the inputs is needed; the send needs the tree alone. A node's input is its parent's draft output, so in a
        tree whose every node but the root is the root's child every row is ``root_hidden`` (the root's own row too),
        for any drafter (a merged drafter's joined state per row); a tree that came out deeper than one level (a
        merged drafter whose suffix source has ``draft.suffix_max_depth`` set copies long matches past depth 0:
        tests/test_round_start.py) is asked for again with ``grow_tree_with_inputs``, which must draft the same tree
        (deterministic drafts: ``incremental``)."""
        pending, self.pending = self.pending, None
        if pending is not None:                   # a quick tree of two levels or more: its deferred inputs
            with engine.tracer.span("draft"):
                self.inputs = pending()
            return
        self.inputs = root_children_inputs(tree.host_numpy()[1], root_hidden)
        if self.inputs is None:                   # a node below a root's child: the general inputs
            t = engine.cfg.tree
            with engine.tracer.span("draft"):
                again, self.inputs = engine.drafter.grow_tree_with_inputs(int(tree.tokens[0]), root_hidden,
                                                                          self.quick_total(t), 0, t.init_topk)
            if len(again) != len(tree) or not torch.equal(again.tokens, tree.tokens) \
                    or not torch.equal(again.parents, tree.parents):
                raise AssertionError("a deterministic drafter drafted another tree for the same root")

    @staticmethod
    def capacity(t) -> int:
        """Node slots a round's tree is preallocated at (:class:`draft.tree.DraftTree`; ``t``: the ``tree`` run
        keys): the first tree's ``init_total_token``, an expansion's ``expand_total_token`` plus the ``expand_topk``
        it may add beyond it, and a draft-ahead's ``subseq_token``. Only a size hint: a tree that outgrows it is
        copied into buffers twice as large (exactness never depends on it)."""
        return max(t.init_total_token, t.expand_total_token + t.expand_topk) + max(t.subseq_token, 0)

    def fill_sizes(self, engine: Engine, state: RankTree) -> list[int]:
        """A quick-started first tree goes out as one segment (its best nodes stay together); later fills as
        usual."""
        if self.quick_fill:
            self.quick_fill = False
            return [state.waiting]
        return super().fill_sizes(engine, state)

    def finish_first_tree(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor) -> DraftTree:
        """Grow a quick-started first tree to its full ``init_depth + 1`` levels and ``init_total_token`` nodes
        (:meth:`draft.drafter.Drafter.extend_tree` below its best leaves; appended nodes keep the tree
        ancestors-first, so the segments already sent stay a prefix)."""
        t = engine.cfg.tree
        quick = self.quick_start(t)
        if self.inputs is None and quick and self.incremental(engine):   # a quick tree, sent: now its inputs
            self.take_lazy(engine, tree, root_hidden)
        if self.inputs is None or not quick:
            return tree
        tree = tree.with_capacity(self.capacity(t))   # a quick tree, sent: now its buffers at the round's capacity
        room = t.init_total_token - len(tree)
        if room <= 0:
            return tree
        with engine.tracer.span("draft"):
            tree, self.inputs = engine.drafter.extend_tree(tree, self.inputs, root_hidden,
                                                           t.init_depth + 1 - t.first_levels, t.init_topk, room)
        return tree

    def on_reroot(self, keep: torch.Tensor, accepted_len: int) -> None:
        if self.inputs is not None:
            self.inputs = self.inputs[keep[accepted_len:].to(self.inputs.device)]
        if self.pre is not None:                  # per-node rows follow their nodes; a kept leaf stays a leaf
            kept = keep[accepted_len:]
            self.pre = tuple(x[kept.to(x.device)] for x in self.pre)
            if self.pre2 is not None:             # tree.early_whole: each candidate's row of prefetched children
                self.pre2 = (self.pre2[0][kept.numpy()], *self.pre2[1:])

    def after_send(self, engine: Engine, state: RankTree, root_hidden: torch.Tensor) -> None:
        """``tree.prefetch_level`` (issue 41): draft the next expansion's first level for every leaf now
        (:meth:`draft.drafter.BeamTreeDrafter.prefetch_leaves`), after the sends, while the stages compute.

        Why: with it, the next verified step's expansion (:meth:`commit_and_grow`) starts from these candidates:
        its turnaround holds the verification's log-prob call, ONE head forward (the commit, the re-fed tree and
        the first level's chosen nodes together) and the second level's log-prob call, instead of two forwards
        and two log-prob calls more. The work moves, it does not vanish (one re-feed and one log-prob call per
        step, here). The candidates were ranked before the step's accepted tokens were committed (those are draft
        tree entries then): a different draft, the same exactness. Invariant: ``self.pre`` has one row per node
        of the current tree (re-rooted with it, :meth:`on_reroot`); any growth drops it (set to None)."""
        t = engine.cfg.tree
        if self.whole:                            # tree.early_whole: commit_and_grow prefetched this very tree
            self.whole = False
            if self.pre is not None and self.pre[0].numel() == len(state.tree):
                return
        self.pre = self.pre2 = None
        if not t.prefetch_level or self.inputs is None or t.expand_total_token == 0 \
                or not hasattr(engine.drafter, "prefetch_leaves"):
            return
        with engine.tracer.span("expand"):
            if self.whole_ok(engine):
                self.pre, self.pre2, _, _ = engine.drafter.prefetch_expansion(
                    state.tree, self.inputs, root_hidden, t.expand_topk, t.early_whole)
            else:
                self.pre = engine.drafter.prefetch_leaves(state.tree, self.inputs, root_hidden, t.expand_topk)

    @staticmethod
    def whole_ok(engine: Engine) -> bool:
        """``tree.early_whole`` applies: on, with ``prefetch_level``, an expansion of exactly two levels (the two it
        prefetches; the measured lookahead varies them: off there) and a drafter that has the calls (a wrapper such
        as :class:`draft.osd.OnlineDrafter` has not)."""
        t = engine.cfg.tree
        return t.early_whole > 0 and t.prefetch_level and t.expand_levels == 2 and t.lookahead_min_prob == 0 \
            and hasattr(engine.drafter, "prefetch_expansion")

    def send_early(self, engine: Engine, state: RankTree) -> bool:
        """``tree.early_level`` (issue 41): after a verified step's re-root, append the next expansion's first level,
        chosen from the prefetched candidates (:meth:`draft.drafter.BeamTreeDrafter.append_prefetched_level`: no
        model call), so that it leaves on the ring before the commit and the rest of the expansion.

        Why: with ``tree.prefetch_level`` the turnaround (a result in hand -> the next ring send) still holds the
        fused head forward and the second level's log-prob call, because every node the step sends is drafted
        after the result. The first level's candidates were drafted while the stages computed; choosing among
        those of the surviving leaves takes bookkeeping only, so the turnaround becomes verify -> re-root ->
        choose -> send, and the commit, the re-feed and the later levels (:meth:`commit_and_grow`, which finishes
        this expansion) run after the send. The expansion's budget is unchanged (the level counts against
        ``expand_room``) and it holds the same nodes as without the key whenever the plain expansion keeps its whole
        first-level beam; a different order, sent in two segments. Trees change, the output never does. Measured
        (docs/results.md §59): the turnaround falls by about a third on both profiles, but the level's nodes then
        leave a stage step ahead of their children, which reach the stages a stage step later than in one segment;
        alone it was off by default; with ``tree.early_whole`` (covered steps send one segment) both are the
        default. (Holding the second segment for the next step's early send, or sending early only after
        root-alone steps, measured no better there and was removed.)
        ``tree.early_whole`` (issue 41): the prefetch also drafted the second level below the likeliest beams
        (:meth:`draft.drafter.BeamTreeDrafter.prefetch_expansion`), so when this step's beam is among them the WHOLE
        expansion is chosen here (:meth:`draft.drafter.BeamTreeDrafter.append_prefetched_expansion`: the same rule
        as the early level then its finishing, no model call) and leaves as ONE segment; :meth:`commit_and_grow` then
        only commits, fused with the next prefetch. Why: the early level's second segment costs a launch-bound stage
        a whole step and sends the level's children a step late (§59: -1.6% on the what-if); this keeps one
        segment per step and the early level's short turnaround. A beam outside the prefetched ones falls back to
        the early level alone with ``tree.early_level``, else to the plain prefetched expansion after the commit
        (one segment per step always).
        Invariant: ``self.early`` is ``(levels, room left)`` exactly while ``self.pre`` is the appended level's
        :class:`draft.drafter.EarlyLevel` (set here, consumed by :meth:`commit_and_grow`); ``self.whole`` is True from
        a whole send to the next :meth:`after_send`, and ``self.pre2`` (the second level's rows) is None whenever
        ``self.pre`` does not cover the current tree."""
        t = engine.cfg.tree
        self.early = None
        whole = self.whole_ok(engine)
        if not ((t.early_level or whole) and t.prefetch_level) or self.pre is None or self.inputs is None \
                or t.expand_total_token == 0 or not hasattr(engine.drafter, "append_prefetched_level"):
            return False
        levels = self.expand_levels(engine, state.tree)
        if levels < 2:                            # one level: the expansion is the prefetched choice alone
            return False
        room = self.expand_room(engine, state.tree)
        if self.pre[0].numel() != len(state.tree):
            raise AssertionError("prefetched rows do not match the tree")      # on_reroot keeps them in step
        if self.pre2 is not None and whole:       # tree.early_whole: both levels, one segment
            with engine.tracer.span("expand"):
                got = engine.drafter.append_prefetched_expansion(state.tree, self.inputs, self.pre, self.pre2,
                                                                 t.expand_topk, room, t.early_cover)
            if got is not None:
                tree, self.inputs = got
                self.pre = self.pre2 = None
                self.whole = True
                if t.early_split:                 # the waiting nodes and the leading first-level run
                    n = len(state.tree)
                    run = (tree.host_numpy()[1][n:] >= n).nonzero()[0]
                    self.split = state.waiting + (int(run[0]) if run.size else len(tree) - n)
                state.set_tree(tree)
                return True
        if not t.early_level:                     # early_whole alone: an uncovered beam takes the plain path
            return False
        with engine.tracer.span("expand"):
            got = engine.drafter.append_prefetched_level(state.tree, self.inputs, self.pre, t.expand_topk, room)
        if got is None:
            return False
        tree, self.inputs, self.pre = got
        self.early = (levels, room - (len(tree) - len(state.tree)))
        state.set_tree(tree)
        return True

    def top_up(self, engine: Engine, box: Outbox, state: RankTree, root_hidden: torch.Tensor | None = None) -> None:
        """``tree.early_split`` (issue 41, docs/results.md §66): a whole early send goes out
        as TWO segments at once when at least ``early_split`` links are free (0: off; only then is a split
        recorded) -- the first-level run (with any nodes already waiting), then the rest -- else as usual. Why: the
        stages were less busy with one large segment per step than with the early level's two (§63); two segments
        in flight at once keep two links busy and the children still leave before the commit. Measured: ξ up on
        the edge, down on the launch-bound what-if (each segment costs a stage step there), so off by default.
        Only a schedule (any prefix of the ancestors-first nodes is sendable): the output never changes."""
        k, self.split = self.split, 0
        if 0 < k < state.waiting \
                and live_segments(engine) - box.live_inflight(state.alive_gids()) >= engine.cfg.tree.early_split:
            state.send(box, k)
        super().top_up(engine, box, state, root_hidden)

    def decode(self, engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
               out: OutputBuffer) -> DecodeResult:
        # measured per generation (a generation's trees depend on it alone), and only when the lookahead reads it
        self.acceptance = AcceptanceStats() if engine.cfg.tree.lookahead_min_prob > 0 else None
        return super().decode(engine, logits, features, prompt_ids, out)

    def observe(self, tree: DraftTree, verdict: StepVerdict) -> None:
        """Per-level acceptance for the lookahead (:class:`pipeline.budget.AcceptanceStats`): every accepted draft
        token is a success, and so is a bonus token the tree already holds (``new_root``); the step failed a level
        when the path's last node had drafted children and the target's token is none of them. A path that ends
        at a leaf says nothing about the next level (censored). Nothing to do without the lookahead."""
        if self.acceptance is None:
            return
        last = verdict.path[-1]
        hit = verdict.new_root is not None
        had_children = hit or bool((tree.parents == last).any())
        self.acceptance.record(len(verdict.path) - 1 + int(hit), rejected=had_children and not hit)

    def lookahead(self, engine: Engine, tree: DraftTree) -> int:
        """Levels to grow after a verified step with ``tree.lookahead_min_prob > 0``: what keeps the tree its
        useful lookahead deep below the root at the measured acceptance (:func:`pipeline.budget.lookahead_levels`),
        at most ``tree.lookahead_max_levels`` per step and, with ``tree.budget``, at most what the profile's ring
        step leaves rank 0 for drafting (:func:`pipeline.budget.affordable_levels`). 0: the tree is deep enough,
        nothing is drafted this step."""
        t = engine.cfg.tree
        cap = t.lookahead_max_levels
        if t.budget:
            cap = affordable_levels(self.profile_costs(engine), t.subseq_token, t.expand_topk, cap)
        depth = int(tree.depths.max()) if len(tree) > 1 else 0
        return lookahead_levels(self.acceptance.alpha, depth, t.lookahead_min_prob, cap)

    def expand_levels(self, engine: Engine, tree: DraftTree) -> int:
        """Levels an incremental expansion grows after a verified step: ``tree.expand_levels``, or with
        ``tree.lookahead_min_prob > 0`` what :meth:`lookahead` says (0: none this step)."""
        t = engine.cfg.tree
        if t.lookahead_min_prob > 0 and self.inputs is not None:
            return self.lookahead(engine, tree)
        return t.expand_levels

    @staticmethod
    def expand_room(engine: Engine, tree: DraftTree) -> int:
        """Nodes an incremental expansion may add to ``tree``: up to ``tree.expand_total_token``, at least one
        level's ``tree.expand_topk``."""
        t = engine.cfg.tree
        return max(t.expand_total_token - len(tree), t.expand_topk)

    def commit_and_grow(self, engine: Engine, tree: DraftTree, tokens: list[int],
                        feats: list[torch.Tensor]) -> tuple[DraftTree, torch.Tensor] | None:
        """``tree.fuse_commit`` (issue 41): commit the accepted tokens and re-feed the surviving tree in ONE draft
        forward (:meth:`draft.drafter.BeamTreeDrafter.commit_extend_tree`), then grow as :meth:`grow` would.

        Why: every call between a result and the next ring send is on rank 0's turnaround; with a separate commit
        the chain holds two head forwards (commit, then the re-feed that needs the commit's output for the root's
        children) before the first level's log-probs. Fused, the root's children keep the input they were drafted
        with, and the commit's rows and the tree's rows share one forward: one head forward fewer per verified
        step, on the chain and in total. It changes which trees are drafted (τ may move), never the output:
        verification accepts exactly what the target says, whatever the tree. None (commit, then :meth:`grow`):
        the key is off, there is no incremental expansion, expansion is off, nothing is grown this step, or the
        drafter has no fused call (a wrapper such as :class:`draft.osd.OnlineDrafter`)."""
        t = engine.cfg.tree
        if self.whole:                            # tree.early_whole: the expansion is sent; commit + next prefetch
            with engine.tracer.span("expand"):
                self.pre, self.pre2, root_hidden, self.inputs = engine.drafter.prefetch_expansion(
                    tree, self.inputs, None, t.expand_topk, t.early_whole,
                    (torch.tensor(tokens, device=HOST), torch.cat(feats)))
            return tree, root_hidden
        pre, self.pre = self.pre, None
        self.pre2 = None
        early, self.early = self.early, None
        if early is not None:                     # tree.early_level: finish the expansion whose level was sent
            levels, room = early
        else:
            if not (t.fuse_commit or t.prefetch_level) or self.inputs is None or t.expand_total_token == 0 \
                    or not hasattr(engine.drafter, "commit_extend_tree"):
                return None
            levels = self.expand_levels(engine, tree)
            if levels <= 0:
                return None
            if pre is not None and (pre[0].numel() != len(tree) or not t.prefetch_level):
                raise AssertionError("prefetched rows do not match the tree")      # on_reroot keeps them in step
            room = self.expand_room(engine, tree)
        with engine.tracer.span("expand"):
            tree, self.inputs, root_hidden = engine.drafter.commit_extend_tree(
                torch.tensor(tokens, device=HOST), torch.cat(feats), tree, self.inputs, levels, t.expand_topk,
                room, pre)
        return tree, root_hidden

    def grow(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor, verified: bool) -> DraftTree:
        """After a verified step (``verified``): incremental expansion grows ``tree.expand_levels`` levels, or with
        ``tree.lookahead_min_prob > 0`` what :meth:`lookahead` says (none when the tree is deep enough); the
        redraft expansion merges a fresh ``expand_depth`` tree. A result that verified nothing grows nothing."""
        t = engine.cfg.tree
        if not verified or t.expand_total_token == 0:   # expansion off: the round keeps its first tree
            return tree
        if self.inputs is not None:
            levels = self.expand_levels(engine, tree)
            if levels <= 0:
                return tree
            with engine.tracer.span("expand"):
                tree, self.inputs = engine.drafter.extend_tree(tree, self.inputs, root_hidden, levels,
                                                               t.expand_topk, self.expand_room(engine, tree))
            return tree
        with engine.tracer.span("expand"):
            extra = engine.drafter.grow_tree(int(tree.tokens[0]), root_hidden, t.expand_total_token, t.expand_depth,
                                             t.expand_topk)
            tree, _ = merge_trees(tree, extra)
        return tree

    def deepen(self, engine: Engine, state: RankTree, root_hidden: torch.Tensor) -> bool:
        """Draft ahead for the likely outcomes of the segments in flight (incremental expansion only).

        Called when a ring link is free and every drafted node has been sent: grow ``tree.ahead_levels`` levels
        below the best leaves (:meth:`draft.drafter.Drafter.extend_tree`) and keep the new nodes whose draft
        path probability from the current root, ``exp(score)``, is at least ``tree.ahead_min_prob``, at most
        ``tree.subseq_token`` of them. New nodes come in descending score order and a child never outranks its
        parent, so every prefix of them is ancestor-closed (sendable). Without this a result that verifies
        nothing new, or a re-root that kills most of the work in flight, leaves links idle until a full ring
        trip brings the next result; with it rank 0 spends that idle time drafting the next levels, which is
        worth doing while the path is likely (the threshold) and free while rank 0 would otherwise wait.
        """
        t = engine.cfg.tree
        if t.ahead_levels <= 0 or self.inputs is None or state.waiting:
            return False
        n = len(state.tree)
        with engine.tracer.span("expand"):
            tree, inputs = engine.drafter.extend_tree(state.tree, self.inputs, root_hidden, t.ahead_levels,
                                                      t.expand_topk, t.subseq_token)
        worth = int((tree.scores[n:].exp() >= t.ahead_min_prob).sum())   # a prefix: scores descend
        if worth == 0:
            return False
        keep = n + worth
        tree = tree.prefix(keep)
        self.inputs = inputs[:keep]
        self.pre = self.pre2 = None               # new leaves: the prefetched level no longer covers the tree
        state.set_tree(tree)
        return True

