"""scripts/round_start_bound.py's pure rules (issue 41, docs/results.md §80): which of rank 0's turnarounds are
round starts, and what a perfectly precomputed one would no longer run. The replay itself is
pipeline.tools.simulate's (tests/test_simulate.py)."""
from __future__ import annotations

import pytest

import scripts.round_start_bound as B

VERIFY = [("recv", 4), ("host", 1e-4, 5, 0), ("lm_head", 3, 1.0, 0.0), ("dsend", 1, 9), ("host", 1e-4, 7, 1)]
ROUND_START = VERIFY + [("draft", 3, 20, 0.0), ("lm_head", 1, 0.3, 0.0), ("host", 1e-4, 30, 1),
                        ("draft", 10, 23, 0.0), ("lm_head", 10, 0.3, 0.0), ("send", 1, 11, 64)]
STEP = VERIFY + [("send", 1, 6, 64), ("draft", 6, 30, 0.0), ("lm_head", 6, 0.3, 0.0)]   # early send: draft after
FIRST_TREE = [("mark", "decode_begin"), ("recv", 4), ("draft", 3, 20, 0.0), ("lm_head", 1, 0.3, 0.0),
              ("draft", 10, 23, 0.0), ("lm_head", 10, 0.3, 0.0), ("send", 1, 11, 64)]
LOG = FIRST_TREE + STEP + ROUND_START + STEP + ROUND_START


def test_turnarounds_and_round_starts():
    pairs = B.turnarounds(LOG)
    assert [(LOG[i][0], LOG[j][0]) for i, j in pairs] == [("recv", "send")] * 5
    kinds = [B.is_round_start(LOG[i + 1:j]) for i, j in pairs]
    assert kinds == [False, False, True, False, True]    # the prefill's first tree and early sends are not
    assert B.turnarounds([("recv", 4), ("host", 1e-4), ("recv", 4), ("send", 1, 1, 1)]) == [(2, 3)]


def test_freeing_keeps_the_verification_and_the_messages():
    new, starts, freed = B.free_round_starts(LOG, 1.0)
    assert (starts, freed) == (2, 2)
    assert len(new) == len(LOG) - 2 * 4                 # per round start: two forwards, two draft lm_heads
    assert [o for o in new if o[0] in ("recv", "send", "dsend", "mark")] == \
        [o for o in LOG if o[0] in ("recv", "send", "dsend", "mark")]
    verifications = sum(o[0] == "lm_head" and o[2] == 1.0 for o in LOG)
    assert verifications == 4 and sum(o[0] == "lm_head" and o[2] == 1.0 for o in new) == verifications
    assert [o for o in new if o[0] == "draft"] == [o for o in FIRST_TREE + STEP + STEP if o[0] == "draft"]
    whole, _, _ = B.free_round_starts(LOG, B.WHOLE)
    assert len(whole) == len(new) - 2 * 3    # all of the turnaround's host work goes too (a looser ceiling)
    assert sum(o[0] == "host" for o in whole) == sum(o[0] == "host" for o in FIRST_TREE + STEP + STEP)
    assert B.free_round_starts(LOG, 0.0) == (LOG, 2, 0)


def test_rates_nest():
    log = LOG + ROUND_START * 40
    chosen = []
    for rate in (0.2, 0.5, 0.9):
        new, starts, freed = B.free_round_starts(log, rate)
        assert starts == 42 and 0 < freed < 42
        chosen.append({i for i, o in enumerate(log) if o not in new})
    assert chosen[0] <= chosen[1] <= chosen[2]            # a higher rate frees a superset (one draw each)


def test_a_planted_rule_that_drops_the_verification_fails(monkeypatch):
    """The first lm_head of a round start is the verification's; a rule that frees it too is wrong."""
    real = B.free_round_starts

    def planted(ops, rate, seed=0):
        new, s, f = real(ops, rate, seed)
        return [o for o in new if not (o[0] == "lm_head" and o[2] == 1.0)], s, f
    monkeypatch.setattr(B, "free_round_starts", planted)
    with pytest.raises(AssertionError):
        test_freeing_keeps_the_verification_and_the_messages()


def test_bad_rates_are_one_line(capsys):
    assert B.main(["rows.jsonl", "--rates", "1.5"]) == 2
    assert B.main(["rows.jsonl", "--rates", "half"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("error: --rates") for e in err)


def test_the_script_counts_truncations_and_prints_every_rate(tmp_path, capsys):
    """End to end on a tiny 2-stage model with the oracle drafter (the target drafts itself, its greedy answer
    recorded): the script's step observer and decoder factory (the simulator's Hooks) see every truncation and
    the prefetched candidates, and the table has one row per rate. With the oracle every truncated leaf's
    prefetched top-k holds the target's token (its top 1), so the hit rate is exactly 1: a script that read no
    candidates, the wrong node's or an inner node's (the prefetch ranks the leaves only) would count fewer."""
    import json
    import re

    import torch

    from model.split import split_checkpoint
    from tests.helpers import hf_greedy, tiny_llama
    full = tiny_llama(tmp_path / "full", layers=2, vocab=96, dtype=torch.float64)
    stages = split_checkpoint(full, tmp_path / "stages", [0, 1, 1], progress=False)
    prompt = [1, 5, 9, 13]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"mode": "continuous", "temperature": 0.0, "prompt_ids": prompt, "world_size": 3,
                                "output_ids": hf_greedy(full, prompt, 16, {2}, torch.float64)}) + "\n")
    assert B.main([str(rows), "--rates", "measured,0.5,1", "--profile", "edge_orin_7b", "--stages", "2",
                   "--direct-passes", "0", f"model.stage_dir={stages}", f"model.head_dir=oracle:{full}",
                   "dtype=float64", "max_new_tokens=16", "tree.init_total_token=24", "tree.expand_total_token=16",
                   "tree.init_topk=4", "tree.expand_topk=4", "tree.subseq_token=8",   # small trees: a counted replay
                   "--out-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    m = re.search(r"truncations (\d+) \(every replay pass\), prefetched (\d+), .*: (\d+) = hit rate ([\d.]+)", out)
    assert m, out
    trunc, seen, hit = map(int, m.groups()[:3])
    assert 0 < seen <= trunc and hit == seen and float(m.group(4)) == 1.0, m.group(0)
    table = [line for line in out.splitlines() if line.startswith("| ") and "%" in line]
    assert [line.split(" | ")[0] for line in table] == ["| measured hit rate", "| model calls", "| model calls",
                                                        "| whole round start (host work too)"]
