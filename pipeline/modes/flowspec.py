"""FlowSpec (``continuous``) and its ``pruned`` ablation: the lock-step pipeline on rank 0.

One round, as seen from rank 0 (ranks 1..N run :mod:`pipeline.worker`)::

    draft a tree from the root -> fill: send exactly world_size segments (empty ones pad), one per ring
    link; nodes beyond that wait on rank 0
    each step:
      receive the oldest in-flight segment's hidden states (its nodes are [0, n) of the current tree)
      verify the prefix-closed subtree they complete (walk_tree)
      broadcast one Decision: SKIP (empty segment) | CONTINUE (re-root at an already drafted child)
                              | TRUNCATE (no such child, or finished: the ring drains, round ends)
      every stage prunes its KV cache and its uncomputed segment with the same keep-list
      CONTINUE: re-root the tree; expand (continuous) by drafting from the new root and merging
      send the next waiting nodes (possibly none) as the next segment: one message per link again

Message ``decide_from_rank``: a fill segment j is computed without decisions by ranks r <= N - j and
with one decision per hop after that; segments sent during steps take a decision at every rank. So in
every step each rank holds exactly one message and joins exactly one broadcast.
"""
from __future__ import annotations

import torch

from draft.tree import DraftTree, keep_indices_for, merge_trees, reroot, split_sizes
from model.devices import HOST
from pipeline.engine import Engine, OutputBuffer
from pipeline.messages import Decision, Segment, Status
from pipeline.verify import walk_tree


class LockstepMode:
    """Shared FlowSpec step loop. Subclasses choose the first tree and how the tree grows per step."""

    commit_every_step = True  # feed accepted features to the drafter at every verified step

    # -- strategy hooks ----------------------------------------------------------------------------
    def first_tree(self, engine: Engine, root: int, root_hidden: torch.Tensor) -> DraftTree:
        t = engine.cfg.tree
        with engine.tracer.span("draft"):
            return engine.drafter.grow_tree(root, root_hidden, t.init_total_token, t.init_depth, t.init_topk)

    def fill_sizes(self, engine: Engine, tree: DraftTree) -> list[int]:
        return split_sizes(len(tree), engine.comm.world, engine.cfg.tree.subseq_token)

    def grow(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor, verified: bool) -> DraftTree:
        return tree

    def on_reroot(self, keep: torch.Tensor, accepted_len: int) -> None:
        pass

    # -- the loop ------------------------------------------------------------------------------------
    def decode(self, engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
               out: OutputBuffer) -> tuple[int, list[int], int]:
        x = engine.sampler.choose(logits)
        out.extend([x])
        with engine.tracer.span("draft"):
            root_hidden = engine.drafter.start(prompt_ids, x, features)
        rounds, accepts, steps = 0, [], 0
        while not out.finished:
            rounds += 1
            x, root_hidden, n_steps = self.run_round(engine, x, root_hidden, out, accepts, rounds)
            steps += n_steps
        return rounds, accepts, steps

    def run_round(self, engine: Engine, root: int, root_hidden: torch.Tensor, out: OutputBuffer,
                  accepts: list[int], round_id: int):
        comm, world = engine.comm, engine.comm.world
        tree = self.first_tree(engine, root, root_hidden)
        sizes = self.fill_sizes(engine, tree)
        sizes += [0] * (world - len(sizes))
        sent = 0
        for j, size in enumerate(sizes):
            comm.send_next(self._segment(tree, sent, size, round_id, j, world - j))
            sent += size
        pending_tokens: list[int] = []
        pending_feats: list[torch.Tensor] = []
        step = 0
        cap = engine.cfg.tree.expand_subseq_token
        while True:
            msg = comm.recv_prev()
            step += 1
            decision = Decision(round_id, step, Status.SKIP)
            if msg.n:
                hidden = msg.x[0]
                logits = engine.logits(hidden)
                with engine.tracer.span("verify"):
                    path, new_token, new_root = walk_tree(tree, msg.n, logits, engine.sampler)
                committed = tree.tokens[path[1:]].tolist() + [new_token]
                accepts.append(out.extend(committed))
                if out.finished or new_root is None:
                    status, keep = Status.TRUNCATE, torch.tensor(path, device=HOST)
                else:
                    status, keep = Status.CONTINUE, keep_indices_for(tree, path, new_root)
                decision = Decision(round_id, step, status, len(path), new_token, out.finished, keep)
                pending_tokens += committed
                pending_feats.append(hidden[path])
            comm.broadcast(decision)
            if decision.status == Status.TRUNCATE:
                if not out.finished:
                    root_hidden = self._commit(engine, pending_tokens, pending_feats)
                return decision.new_token, root_hidden, step
            if decision.status == Status.CONTINUE:
                with engine.tracer.span("prune"):
                    acc = decision.accepted_len
                    sent = int((keep[acc:] < sent).sum())
                    tree = reroot(tree, keep, acc)
                    self.on_reroot(keep, acc)
                if self.commit_every_step:
                    root_hidden = self._commit(engine, pending_tokens, pending_feats)
                    pending_tokens, pending_feats = [], []
            tree = self.grow(engine, tree, root_hidden, decision.status == Status.CONTINUE)
            size = len(tree) - sent if cap < 0 else min(cap, len(tree) - sent)
            comm.send_next(self._segment(tree, sent, size, round_id, world - 1 + step, 1))
            sent += size

    @staticmethod
    def _segment(tree: DraftTree, start: int, size: int, round_id: int, seg_id: int, decide_from: int) -> Segment:
        sl = slice(start, start + size)
        return Segment(tree.tokens[sl][None], tree.parents[sl], round_id, seg_id, decide_from)

    @staticmethod
    def _commit(engine: Engine, tokens: list[int], feats: list[torch.Tensor]) -> torch.Tensor:
        with engine.tracer.span("draft"):
            return engine.drafter.commit(torch.tensor(tokens, device=HOST), torch.cat(feats))


class PrunedMode(LockstepMode):
    """Step-wise verification and pruning of one tree per round, no expansion."""

    commit_every_step = False


class ContinuousMode(LockstepMode):
    """FlowSpec: after each verified step, draft again from the new root and merge (dynamic expansion)."""

    def grow(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor, verified: bool) -> DraftTree:
        t = engine.cfg.tree
        if verified:
            total, depth = t.expand_total_token, t.expand_depth
        elif t.none_expand:
            total, depth = t.expand_total_token + t.none_expand_size, t.expand_depth + t.none_expand_depth
        else:
            return tree
        with engine.tracer.span("expand"):
            extra = engine.drafter.grow_tree(int(tree.tokens[0]), root_hidden, total, depth, t.expand_topk)
            tree, _ = merge_trees(tree, extra)
        return tree
