"""``pipeline.tree_stats``: the calibration and round-end counts of verified steps (pure), and the step-observer
seam that feeds it from the real modes (in-process ring, tiny model; exact oracle and adversary drafts, whose
outcomes are known in advance)."""
import math

import pytest
import torch

from draft.tree import DraftTree
from model.split import split_checkpoint
from pipeline.inprocess import run_threaded
from pipeline.tree_stats import Q_EDGES, TreeStats, q_bin, sibling_ranks, write_tree_stats
from tests.helpers import hf_greedy, tiny_llama


def _tree():
    """root(10) -> a(11, q .6), b(12, q .4); a -> c(13, q .55), d(14, q .55, ties with c: index order)."""
    lq = math.log
    return DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, 0, 0, 1, 1]),
                     torch.tensor([0.0, lq(.6), lq(.4), lq(.6) + lq(.55), lq(.6) + lq(.55)]))


def test_q_bins_and_sibling_ranks():
    assert q_bin(0.0) == 0 and q_bin(0.019) == 0 and q_bin(0.02) == 1 and q_bin(1.0) == len(Q_EDGES) - 2
    t = _tree()
    assert sibling_ranks(t, torch.tensor([1, 2])).tolist() == [0, 1]
    assert sibling_ranks(t, torch.tensor([3, 4])).tolist() == [0, 1]          # a tie keeps index order
    assert sibling_ranks(t, torch.tensor([2, 1])).tolist() == [1, 0]          # by score, not by position


def test_a_continued_step_counts_every_child_of_every_path_node():
    s = TreeStats()
    s.record(_tree(), [0, 1], 14)            # root -> a accepted, then the target says d (a drafted child)
    rows = {(r["rank"], r["q_bin"]): r for r in s.calibration_rows()}
    assert set(rows) == {("0", "[0.5, 0.7)"), ("1", "[0.3, 0.5)"), ("1", "[0.5, 0.7)")}
    assert rows[("0", "[0.5, 0.7)")]["trials"] == 2 and rows[("0", "[0.5, 0.7)")]["accepted"] == 1   # a hit, c missed
    assert rows[("0", "[0.5, 0.7)")]["mean_q"] == pytest.approx((0.6 + 0.55) / 2, abs=1e-4)
    assert rows[("1", "[0.3, 0.5)")]["trials"] == 1 and rows[("1", "[0.3, 0.5)")]["accepted"] == 0   # b missed
    assert rows[("1", "[0.5, 0.7)")]["trials"] == 1 and rows[("1", "[0.5, 0.7)")]["accepted"] == 1   # d hit
    # no round end; both path nodes covered
    assert s.steps == 1 and s.path_nodes == 2 and s.coverage == 1.0 and not s.ends


def test_round_ends_by_children_of_the_last_node():
    s = TreeStats()
    s.record(_tree(), [0, 1], 99)            # a's two children both missed
    s.record(_tree(), [0, 1, 3], 99)         # c is a leaf
    s.record(_tree(), [0, 2], 99, finished=True)   # the generation ended: not the tree's doing
    s.record(_tree(), [], None)              # nothing verified: ignored
    assert s.ends == {2: 1, 0: 1}
    assert s.leaf_end_share == 0.5
    assert [r["children"] for r in s.end_rows()] == [0, 2]
    assert s.steps == 3 and s.path_nodes == 7 and s.covered == 4


def test_tables_are_written(tmp_path):
    total = TreeStats()
    total.record(_tree(), [0, 1], 14)
    total.record(_tree(), [0, 1], 99)
    assert total.steps == 2 and total.ends == {2: 1}
    assert sum(r["trials"] for r in total.rank_rows()) == 8
    md = write_tree_stats({"x": total}, tmp_path).read_text()
    assert "## x" in md and "| rank | trials | acceptance | mean_q |" in md
    assert (tmp_path / "tree_stats.csv").read_text().splitlines()[0].startswith("label,rank,q_bin")


PROMPTS = [[1, 5, 9, 13, 22, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tstats")
    full = tiny_llama(root / "full", layers=3, dtype=torch.float64)
    return full, split_checkpoint(full, root / "s", [0, 2, 1], progress=False)


@pytest.mark.parametrize("mode", ["naive", "pruned", "continuous", "pipedec"])
def test_observed_in_real_modes_exact_oracle_and_adversary(tiny, mode):
    """The seam in every tree mode: the observer changes no output, sees one step per verification, and a
    round end for every round but the last. An exact oracle's best child is always the target's token (rank 0
    acceptance 1, the other ranks 0); an adversary's never is (coverage 0)."""
    full, split = tiny
    over = ["max_new_tokens=14", "dtype=float64", "draft.sources=eagle"]
    for drafter, rank0 in (("oracle", 1.0), ("adversary", 0.0)):
        stats = TreeStats()
        res = run_threaded(split, PROMPTS, [mode], over, {2}, f"{drafter}:{full}", step_observers=[stats])
        rows = res[mode]
        for p, r in zip(PROMPTS, rows):
            assert r.output_ids == hf_greedy(full, p, 14, {2}, torch.float64)
        assert stats.steps == sum(len(r.accept_lengths) for r in rows)
        assert sum(stats.ends.values()) == sum(r.rounds - 1 for r in rows)
        ranks = {r["rank"]: r for r in stats.rank_rows()}
        assert ranks["0"]["acceptance"] == rank0, (drafter, ranks)
        assert all(r["acceptance"] == 0.0 for k, r in ranks.items() if k != "0"), (drafter, ranks)
        if drafter == "adversary":
            assert stats.coverage == 0.0
