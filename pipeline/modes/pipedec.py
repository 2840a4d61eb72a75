"""``pipedec`` (PipeDec baseline): the tree grows by one layer of ``pipedec_topk`` nodes per pipeline step.

It reuses FlowSpec's streaming loop; only the tree policy differs: a round starts with the root alone,
the fill sends the root and then one new layer per segment, and every step appends one more layer
below the deepest surviving layer (the best ``pipedec_topk`` children by cumulative draft score).
To score a layer, the drafter re-feeds the surviving tree (whose draft inputs are remembered per node)
on top of its accepted context, as PipeDec does.
"""
from __future__ import annotations

import torch

from draft.protocol import top_tokens
from draft.tree import DraftTree
from model.devices import HOST
from pipeline.engine import Engine
from pipeline.modes.flowspec import StreamingMode


class PipeDecMode(StreamingMode):
    def __init__(self) -> None:
        self.feat_in: torch.Tensor | None = None  # draft input feature per node (row 0 unused)

    def first_tree(self, engine: Engine, root: int, root_hidden: torch.Tensor) -> DraftTree:
        # preallocated for the fill's world - 1 layers and the layer each step adds (draft.tree: capacity)
        tree = DraftTree.single(root).with_capacity(engine.comm.world * engine.cfg.tree.pipedec_topk + 1)
        self.feat_in = root_hidden[None].clone()
        for _ in range(engine.comm.world - 1):
            tree = self.grow(engine, tree, root_hidden, False)
        return tree

    def budget_size(self, engine: Engine, state) -> None:
        """PipeDec keeps its own policy (one tree layer per step) whatever ``tree.budget`` says."""
        return None

    def fill_sizes(self, engine: Engine, state) -> list[int]:
        """One segment per tree level of the waiting nodes (levels are contiguous: the tree grows by levels)."""
        depths = state.tree.depths[state.sent:]
        return [n for n in torch.bincount(depths).tolist() if n] if depths.numel() else []

    def on_reroot(self, keep: torch.Tensor, accepted_len: int) -> None:
        self.feat_in = self.feat_in[keep[accepted_len:].to(self.feat_in.device)]

    def grow(self, engine: Engine, tree: DraftTree, root_hidden: torch.Tensor, verified: bool) -> DraftTree:
        drafter, k = engine.drafter, engine.cfg.tree.pipedec_topk
        with engine.tracer.span("expand"):
            depths = tree.depths                                  # host bookkeeping (model/devices.py)
            dev = self.feat_in.device                             # the draft head's device
            self.feat_in[(depths == 1).to(dev)] = root_hidden.to(self.feat_in.dtype)
            if len(tree) == 1:
                frontier, outs = torch.tensor([0], device=HOST), root_hidden[None]
            else:
                body = torch.arange(1, len(tree), device=HOST)
                parents = tree.parents[body] - 1          # the root is the drafter's last context entry
                out = drafter.tree_forward(tree.tokens[body], self.feat_in[body.to(dev)], parents)
                drafter.drop_tree()
                frontier = (depths == depths.max()).nonzero().flatten()
                outs = out[(frontier - 1).to(out.device)]
            cs, ct = (x.to(HOST) for x in top_tokens(drafter, outs, k))  # the step's one device->host copy
            kk = cs.shape[-1]
            cum = (tree.scores[frontier][:, None] + cs).reshape(-1)
            best = torch.sort(-cum.double(), stable=True).indices[:k]
            par = frontier[best // kk]
            tree = tree.append(ct.reshape(-1)[best], par, cum[best], depths[par] + 1)   # into the tree's buffers
            self.feat_in = torch.cat([self.feat_in, outs[(best // kk).to(outs.device)].to(self.feat_in.dtype)])
        return tree
