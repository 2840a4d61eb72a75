"""Rank 0's end of the protocol: node ids, the decision log and the segments in flight (every tree mode).

* :class:`Outbox` numbers nodes as they are sent (node ids, increasing, never reused in a generation),
  attaches every decision made since the previous segment to the next one (the ring-borne copy every stage
  is guaranteed to see before that segment), sends each decision point to point to stages 2..N at once while
  work is in flight (so they can prune it before computing it), and tracks the segments in flight.
* :class:`RankTree` is rank 0's current tree with the node id of each node (``-1``: not sent yet); sent
  nodes are always a prefix of the tree (segments go out in index order, expansion appends), so node ids
  increase with tree index, and the alive rows of any result are exactly the next unverified prefix.
"""
from __future__ import annotations

from collections import deque

import torch

from draft.tree import DraftTree, reroot
from model.devices import HOST
from pipeline.messages import Decision, Segment, Status, pack_log

Tensor = torch.Tensor


class Outbox:
    def __init__(self, engine) -> None:
        self.comm = engine.comm
        self.gen = engine.gen
        self.seq = 0                              # decisions issued (the epoch of the next segment)
        self.next_gid = 0
        self.log: list[Decision] = []             # issued, not yet attached to a segment
        self.inflight: deque[list[int]] = deque()  # node ids of every segment sent and not yet received back

    def send(self, tokens: Tensor, parent_gids: Tensor, tag: int = 0) -> Tensor:
        """Send nodes (token ids, parents' node ids) as one segment; returns their node ids."""
        n = int(tokens.numel())
        gids = torch.arange(self.next_gid, self.next_gid + n, device=HOST)
        self.next_gid += n
        self.comm.send_next(Segment(tokens.reshape(1, -1), parent_gids, gids, self.gen, self.seq, pack_log(self.log), tag))
        self.log = []
        self.inflight.append(gids.tolist())
        return gids

    def receive(self) -> Segment:
        msg = self.comm.recv_prev()
        self.inflight.popleft()
        return msg

    def decide(self, status: Status, path_gids: list[int], root_gid: int, finished: bool) -> Decision:
        """Issue the next decision: on the ring with the next segment, and directly while work is in flight."""
        self.seq += 1
        d = Decision(self.gen, self.seq, status, root_gid, finished, torch.tensor(path_gids, dtype=torch.long,
                                                                                    device=HOST))
        self.log.append(d)
        if self.inflight:
            self.comm.send_direct(d)
        return d

    def live_inflight(self, alive: set[int]) -> int:
        """Segments in flight that still hold a node of the current tree (``alive``: its sent node ids)."""
        return sum(1 for gids in self.inflight if gids and not alive.isdisjoint(gids))

    def drain(self) -> int:
        """Receive every segment still in flight (their work is dead); returns how many."""
        n = len(self.inflight)
        while self.inflight:
            self.receive()
        return n


class RankTree:
    """Rank 0's current tree and the node ids of its sent prefix. Invariant: ``gids[:sent] >= 0`` increasing,
    ``gids[sent:] == -1``. ``gids`` is a view of the first ``len(tree)`` slots of a buffer preallocated at the
    tree's capacity plus one (:class:`draft.tree.DraftTree`), whose slots past the tree (at least one) are all
    -1, so a grown tree's ids are a longer view of it (no concatenation), and the buffer's last slot is the -1 a
    root's parent (-1) reads in :meth:`send`; a re-root gathers the survivors into a fresh buffer."""

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree
        self._gbuf = torch.full((max(tree.capacity, len(tree)) + 1,), -1, dtype=torch.long, device=HOST)
        self.gids = self._gbuf[:len(tree)]
        self.sent = 0

    @property
    def waiting(self) -> int:
        return len(self.tree) - self.sent

    def alive_gids(self) -> set[int]:
        return set(self.gids[:self.sent].tolist())

    def send(self, box: Outbox, size: int, tag: int = 0) -> None:
        """Send the next ``size`` waiting nodes (index order) as one segment."""
        sl = slice(self.sent, self.sent + size)
        start = box.next_gid
        self.gids[sl] = torch.arange(start, start + size, device=HOST)     # what box.send assigns
        pg = self._gbuf[self.tree.parents[sl]]          # a parent -1 reads the buffer's last slot: -1 (class doc)
        box.send(self.tree.tokens[sl], pg, tag)
        if box.next_gid != start + size:
            raise AssertionError("node ids out of step with the outbox")
        self.sent += size

    def set_tree(self, tree: DraftTree) -> None:
        """The tree grew (nodes appended after the existing ones)."""
        n = len(tree)
        if n != len(self.tree):
            if n >= self._gbuf.numel():                   # past the capacity: a bigger buffer (-1 beyond the ids)
                buf = torch.full((max(n, tree.capacity, 2 * self._gbuf.numel()) + 1,), -1, dtype=torch.long,
                                 device=HOST)
                buf[:len(self.tree)] = self.gids
                self._gbuf = buf
            elif n < len(self.tree):                      # (never so far) the dropped slots back to -1
                self._gbuf[n:len(self.tree)] = -1
            self.gids = self._gbuf[:n]
        self.tree = tree

    def alive_rows(self, seg: Segment) -> tuple[Tensor, int]:
        """Rows of a received result that belong to the current tree: ``(row indices, k)``; they are tree nodes
        ``[0, k)`` in order (the protocol's invariant, checked)."""
        index = {g: i for i, g in enumerate(self.gids[:self.sent].tolist())}
        rows, nodes = [], []
        for r, g in enumerate(seg.gids.tolist()):
            i = index.get(g)
            if i is not None:
                rows.append(r)
                nodes.append(i)
        if nodes != list(range(len(nodes))):
            raise AssertionError(f"result rows {nodes} are not the current tree's unverified prefix")
        return torch.tensor(rows, dtype=torch.long, device=HOST), len(nodes)

    def reroot(self, keep: Tensor, accepted_len: int) -> None:
        rest = keep[accepted_len:]
        self.tree = reroot(self.tree, keep, accepted_len)
        buf = torch.full((max(self.tree.capacity, rest.numel()) + 1,), -1, dtype=torch.long, device=HOST)
        self.gids = torch.index_select(self.gids, 0, rest, out=buf[:rest.numel()])
        self._gbuf = buf
        self.sent = int(torch.searchsorted(rest, self.sent))   # the kept sent nodes (rest increasing, sent a prefix)
