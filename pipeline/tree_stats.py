"""Where a draft tree meets the target: acceptance by sibling rank and draft probability, and why rounds end.

:class:`TreeStats` is a step observer (:class:`pipeline.engine.StepObserver`): a mode hands it every verified
step as ``(tree, path, token)`` -- the tree the step's indices refer to, the accepted path (node indices, root
first) and the target's token after it -- and it aggregates two things a draft head and a tree policy are
judged by inside the pipeline (the simulator writes them as ``tree_stats.md`` / ``.csv``):

* **Calibration.** For every node ``u`` on the path the target's token at ``u`` is known: the next path node's
  token, or ``token`` after the last one. So *every* drafted child ``c`` of ``u``, sent or not, is one trial of
  "the target's token is ``c``'s", with the draft's conditional probability ``q = exp(score[c] - score[u])`` and
  the child's rank among its siblings by score (0 = the draft's best). Trials are binned by (rank, ``q``); a
  calibrated draft accepts a bin's children at its mean ``q`` (what ``tree.budget`` assumes when it values a
  node at its draft path probability, :mod:`pipeline.budget`). At T > 0 the event is the same (the target's
  emitted token is the child's), so the table reads the same way.
* **Round ends.** A step whose new token is no child of the last path node ends the tree's round (TRUNCATE);
  the number of children that node had says why: 0 = the path ran into a leaf (the tree was too shallow
  there), otherwise the draft's ``k`` candidates all missed (too narrow, or a miss a wider tree would share).
  Finished generations (the last step) are not counted as round ends: their stop is the output's.

Invariants: each (node, child) pair is counted at most once per verified step, and in the step-wise modes at
most once per generation (a verified path is committed and re-rooted away, and a continued step's new root
was not verified, so the next step starts below it); ``record`` reads the tree and never changes it.
"""
from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draft.tree import DraftTree

Q_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)   # bins of the draft's conditional probability


def q_bin(q: float) -> int:
    """Index of the ``Q_EDGES`` bin holding ``q`` (``[lo, hi)``, the last bin closed)."""
    for i in range(len(Q_EDGES) - 2, -1, -1):
        if q >= Q_EDGES[i]:
            return i
    return 0


@dataclass
class Cell:
    """Trials of one (sibling rank, probability bin): how many, how many the target took, the summed ``q``."""

    trials: int = 0
    accepted: int = 0
    q_sum: float = 0.0

    def add(self, q: float, hit: bool) -> None:
        self.trials += 1
        self.accepted += int(hit)
        self.q_sum += q

    def absorb(self, other: "Cell") -> "Cell":
        """Add ``other``'s counts to these; returns ``self``."""
        self.trials += other.trials
        self.accepted += other.accepted
        self.q_sum += other.q_sum
        return self


Trial = tuple[int, int, float, bool]   # (child, sibling rank, q, hit)


def sibling_ranks(tree: DraftTree, children: torch.Tensor) -> torch.Tensor:
    """Rank of each of ``children`` (siblings: one parent) by score, best first; ties keep index order."""
    return torch.sort(torch.sort(-tree.scores[children].double(), stable=True).indices).indices


def path_children(tree: DraftTree, path: list[int], token: int) -> list[tuple[int, list[Trial]]]:
    """For every node ``u`` of a verified ``path`` (root first) with the target's ``token`` after it: ``(u,
    [(child, sibling rank, q, hit), ...])`` over all of ``u``'s drafted children, where ``q`` is the draft's
    conditional probability ``exp(score[child] - score[u])`` (at most 1) and ``hit`` says the target's
    token at ``u`` is the child's (the next path node's token, or ``token`` after the last one)."""
    tokens = tree.tokens.tolist()
    targets = [tokens[v] for v in path[1:]] + [int(token)]
    out = []
    for u, target in zip(path, targets):
        children = (tree.parents == u).nonzero().flatten()
        trials = []
        if children.numel():
            ranks = sibling_ranks(tree, children).tolist()
            cond = (tree.scores[children] - tree.scores[u]).double().tolist()
            for c, r, lq in zip(children.tolist(), ranks, cond):
                trials.append((c, r, math.exp(min(0.0, lq)), tokens[c] == target))
        out.append((u, trials))
    return out


@dataclass
class TreeStats:
    """Calibration and round-end counts of the verified steps it was given (module docstring)."""

    max_rank: int = 3                                     # ranks >= max_rank share one row ("3+")
    cells: dict[tuple[int, int], Cell] = field(default_factory=dict)
    ends: Counter = field(default_factory=Counter)        # children of the last path node at a round end
    steps: int = 0                                        # verified steps seen
    path_nodes: int = 0                                   # path nodes judged (each has a known target token)
    covered: int = 0                                      # ... whose target token was one of their children

    def __call__(self, tree: DraftTree, path: list[int], token: int | None, finished: bool = False) -> None:
        self.record(tree, path, token, finished)

    def record(self, tree: DraftTree, path: list[int], token: int | None, finished: bool = False) -> None:
        """One verified step: ``path`` (root first, all verified) and the target's ``token`` after it."""
        if not path or token is None:
            return
        self.steps += 1
        for u, trials in path_children(tree, path, token):
            hit = False
            for _, rank, q, ok in trials:
                hit |= ok
                self.cells.setdefault((min(rank, self.max_rank), q_bin(q)), Cell()).add(q, ok)
            self.path_nodes += 1
            self.covered += int(hit)
            if u == path[-1] and not hit and not finished:
                self.ends[len(trials)] += 1

    # -- tables ------------------------------------------------------------------------------------
    def rank_label(self, r: int) -> str:
        return f"{r}+" if r >= self.max_rank else str(r)

    def calibration_rows(self) -> list[dict]:
        """One row per (sibling rank, probability bin) with trials: acceptance against the mean draft ``q``."""
        rows = []
        for (r, b), c in sorted(self.cells.items()):
            rows.append({"rank": self.rank_label(r), "q_bin": f"[{Q_EDGES[b]:g}, {Q_EDGES[b + 1]:g})",
                         "trials": c.trials, "accepted": c.accepted,
                         "acceptance": round(c.accepted / c.trials, 4), "mean_q": round(c.q_sum / c.trials, 4)})
        return rows

    def rank_rows(self) -> list[dict]:
        """The same trials per sibling rank alone."""
        per: dict[int, Cell] = {}
        for (r, _), c in self.cells.items():
            per.setdefault(r, Cell()).absorb(c)
        return [{"rank": self.rank_label(r), "trials": c.trials, "acceptance": round(c.accepted / c.trials, 4),
                 "mean_q": round(c.q_sum / c.trials, 4)} for r, c in sorted(per.items())]

    def end_rows(self) -> list[dict]:
        """Round ends by the children the last path node had (0: a leaf)."""
        total = sum(self.ends.values())
        return [{"children": k, "round_ends": n, "share": round(n / total, 4)} for k, n in sorted(self.ends.items())]

    @property
    def coverage(self) -> float:
        """Share of judged path nodes whose target token was among their drafted children (a round continues
        through such a node; ``1 - coverage`` of them end a round or a generation)."""
        return self.covered / self.path_nodes if self.path_nodes else 0.0

    @property
    def leaf_end_share(self) -> float:
        total = sum(self.ends.values())
        return self.ends.get(0, 0) / total if total else 0.0


def write_tree_stats(stats: dict[str, TreeStats], out_dir: Path) -> Path:
    """``tree_stats.md`` (per label: coverage, acceptance per sibling rank, round ends, the calibration table)
    and ``tree_stats.csv`` (the calibration rows with their label) in ``out_dir``; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = ["# Draft trees against the target", "",
          "Per verified step, every drafted child of every node on the accepted path is one trial (sent or "
          "not): `acceptance` = share the target took, `mean_q` = the draft's mean conditional probability "
          "(a calibrated draft has the two equal); rank = place among its siblings by draft score (0 = best). "
          "Round ends: steps whose target token was no child of the last path node, by that node's number of "
          "children (0 = the path ran into a leaf). Module `pipeline/tree_stats.py`.", ""]
    with open(out_dir / "tree_stats.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["label", "rank", "q_bin", "trials", "accepted", "acceptance", "mean_q"])
        for label, s in stats.items():
            for row in s.calibration_rows():
                w.writerow([label, *row.values()])
    for label, s in stats.items():
        md += [f"## {label}", "",
               f"{s.steps} verified steps, {s.path_nodes} path nodes judged; coverage (target token among the "
               f"node's children) {s.coverage:.3f}; round ends {sum(s.ends.values())}, of which at a leaf "
               f"{s.leaf_end_share:.3f}", ""]
        md += _table(s.rank_rows()) + [""] + _table(s.end_rows()) + [""] + _table(s.calibration_rows()) + [""]
    path = out_dir / "tree_stats.md"
    path.write_text("\n".join(md), encoding="utf-8")
    return path


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(none)"]
    keys = list(rows[0])
    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + \
        ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
