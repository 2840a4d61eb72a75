"""``naive`` (the paper's Chunk-PP): one whole EAGLE-2 tree per round, streamed in segments, verified
once it is back; the accepted path reaches every stage as the decision that rides on the next round's first
segment (:class:`pipeline.outbox.Outbox`: nothing is in flight when it is made, so no direct copy is sent).

:func:`whole_tree_rounds` is that round loop with the draft, the verification and the cut into segments as
parameters; ``tp``/``galaxy`` (one segment to the TP group) and ``sps`` (a chain from a small LM, verified by
speculative sampling) are the same loop with other parameters.
"""
from __future__ import annotations

from typing import Callable

import torch

from draft.tree import DraftTree, split_sizes
from model.devices import HOST
from pipeline.engine import DecodeResult, Engine, OutputBuffer
from pipeline.messages import Status
from pipeline.outbox import Outbox, RankTree
from pipeline.verify import Sampler, walk_tree

# draft(root_token, root_hidden) -> (tree, what the verification needs besides the tree)
DraftFn = Callable[[int, torch.Tensor], tuple[DraftTree, object]]
# verify(tree, extra, target logits of every node) -> (accepted path: node indices from the root, next token)
VerifyFn = Callable[[DraftTree, object, torch.Tensor], tuple[list[int], int]]


def whole_tree_rounds(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
                      out: OutputBuffer, drafter, draft: DraftFn, verify: VerifyFn,
                      segment_sizes: Callable[[int], list[int]], tag: int = 0) -> DecodeResult:
    """Rounds of: draft a whole tree from the root, send it as ``segment_sizes(len(tree))`` segments (each with
    ``tag``), wait for all of them, verify, commit the accepted tokens and the target's next token. The
    decision (TRUNCATE: every round starts from a fresh root) rides on the next round's first segment."""
    x = out.sampler.choose(logits)
    out.extend([x], logits[None])
    with engine.tracer.span("draft"):
        root_hidden = drafter.start(prompt_ids, x, features, sampling=out.draft_sampling)
    box = Outbox(engine)
    accepts, steps, rounds = [], 0, 0
    while not out.finished:
        rounds += 1
        with engine.tracer.span("draft"):
            tree, extra = draft(x, root_hidden)
        state = RankTree(tree)
        sizes = segment_sizes(len(tree))
        for size in sizes:
            state.send(box, size, tag)
        hidden = torch.cat([box.receive().x[0] for _ in sizes])
        steps += len(sizes)
        tlogits = engine.logits(hidden)
        with engine.tracer.span("verify"):
            path, x = verify(tree, extra, tlogits)
        committed = tree.tokens[path[1:]].tolist() + [x]
        accepts.append(out.extend(committed, tlogits, path))   # committed[j] was chosen at node path[j]
        engine.observe_step(tree, path, x, out.finished)
        box.decide(Status.TRUNCATE, state.gids[path].tolist(), -1, out.finished)
        if not out.finished:
            with engine.tracer.span("draft"):
                root_hidden = drafter.commit(torch.tensor(committed, device=HOST), hidden[path])
    out.drafted = box.next_gid - rounds   # every node sent but each round's root (a committed token)
    return DecodeResult(rounds, accepts, steps)


def draft_eagle_tree(engine: Engine) -> DraftFn:
    """The EAGLE-2 tree of ``tree.total_token`` / ``depth`` / ``top_k`` from the engine's drafter."""
    t, drafter = engine.cfg.tree, engine.drafter
    return lambda root, root_hidden: (drafter.grow_tree(root, root_hidden, t.total_token, t.depth, t.top_k), None)


def verify_whole_tree(sampler: Sampler) -> VerifyFn:
    """:func:`pipeline.verify.walk_tree` over every node of the tree, with the generation's ``sampler``."""
    def verify(tree: DraftTree, extra, logits: torch.Tensor) -> tuple[list[int], int]:
        path, x, _ = walk_tree(tree, len(tree), logits, sampler)
        return path, x
    return verify


def naive_decode(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
                 out: OutputBuffer) -> DecodeResult:
    world = engine.comm.world
    return whole_tree_rounds(engine, logits, features, prompt_ids, out, engine.drafter, draft_eagle_tree(engine),
                             verify_whole_tree(out.sampler), lambda n: split_sizes(n, world, 0))
