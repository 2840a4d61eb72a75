"""draft.train.corpus: a static suffix corpus from a self-distilled ``data`` file (the target's answers as token ids),
read back by draft.suffix; and drafter_bench's numbering of the held-out kinds' prompts (records 30..)."""
from __future__ import annotations

import json
import random

import pytest

from draft.suffix import SuffixDrafter, corpus_automaton, read_corpus
from draft.train.corpus import answer_spans, main, write_corpus
from pipeline.tools.drafter_bench import HELDOUT, heldout_slice


def spans_ok(spans, ids, mask, stops) -> bool:
    """The invariant of answer_spans: disjoint, in-order contiguous slices under mask 1 that, with the stops each
    one lost at its end, make up every masked token."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    kept = [r for r in runs if r]
    j = 0
    for s in spans:
        while j < len(kept) and kept[j][:len(s)] != s:
            j += 1
        if j == len(kept):
            return False
        rest = kept[j][len(s):]
        if any(t not in stops for t in rest):
            return False
        j += 1
    return True


def test_answer_spans_are_the_masked_runs_without_trailing_stops():
    ids = [9, 1, 5, 6, 2, 1, 7, 8, 2, 2, 3, 4]
    mask = [0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1]
    assert answer_spans(ids, mask, stop_ids=(2,)) == [[5, 6], [7, 8], [4]]
    assert answer_spans(ids, mask, stop_ids=(2,), min_len=2) == [[5, 6], [7, 8]]
    assert answer_spans(ids, mask) == [[5, 6, 2], [7, 8, 2, 2], [4]]
    with pytest.raises(ValueError, match="differ in length"):
        answer_spans([1, 2], [1])
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randrange(0, 30)
        ids = [rng.randrange(0, 6) for _ in range(n)]
        mask = [rng.randrange(0, 2) for _ in range(n)]
        assert spans_ok(answer_spans(ids, mask, (2,)), ids, mask, {2})


def test_the_invariant_check_catches_a_planted_bug():
    """A builder that joins neighbouring answers (forgets to cut at mask 0) must fail the invariant check."""
    def joined(ids, mask, stops):
        return [[t for t, m in zip(ids, mask) if m]]
    ids, mask = [5, 6, 0, 7, 8], [1, 1, 0, 1, 1]
    assert spans_ok(answer_spans(ids, mask, ()), ids, mask, set())
    assert not spans_ok(joined(ids, mask, ()), ids, mask, set())


def test_written_corpus_is_read_back_and_proposes_an_answer(tmp_path, capsys):
    recs = [{"input_ids": [1, 40, 41, 2, 1, 42, 10, 11, 12, 13, 2], "loss_mask": [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]},
            {"input_ids": [1, 43, 2, 1, 42, 20, 21, 22, 23, 24, 2], "loss_mask": [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]}]
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "corpus.jsonl"
    assert main([str(raw), "--out", str(out)]) == 0
    assert "2 answers, 9 tokens" in capsys.readouterr().out
    docs = read_corpus(out, lambda s: pytest.fail("token ids need no tokenizer"))
    assert docs == [[10, 11, 12, 13], [20, 21, 22, 23, 24]]
    assert write_corpus(recs, tmp_path / "c2.jsonl", stop_ids=(2,), min_len=5) == (1, 5)
    d = SuffixDrafter(64, corpus=corpus_automaton(out, list), threshold=2)
    h = d.start([5, 20, 21], 22, None)            # the request repeats a corpus answer's start
    assert d.match_lengths()[-1] == 3 and int(h[0]) == 23
    assert main([str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "FileNotFoundError" in capsys.readouterr().err


def test_heldout_records_are_numbered_from_30():
    p = HELDOUT["translation"]
    assert heldout_slice(p, 30, 33) == p[:3]
    assert heldout_slice(p, 32, 33) == [p[2]]                 # was p[0] again: the same prompt measured twice
    assert heldout_slice(p, 30, 32) + heldout_slice(p, 32, 35) == p
    assert heldout_slice(p, 0, 4) == p[:4]                    # calibration ranges below 30: the first prompts
    assert heldout_slice(p, 40, 45) == []


def _conv(prompt, answer, sampled=False):
    return {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer), "sampled": sampled}


def test_corpus_calibration_holds_the_queries_out_and_counts_by_match_length(tmp_path, capsys):
    """scripts.suffix_corpus_calibrate: the last greedy conversations are the queries and never in the corpus (a
    query found in its own corpus would be copied whole, every length right); each automaton's most frequent
    continuation is counted by its match length; a query finds the queries before it in the store."""
    from scripts import suffix_corpus_calibrate as cal
    from draft.suffix import SuffixAutomaton
    recs = [_conv([1, 2], [3, 4, 5, 6]), _conv([7], [8, 9], sampled=True), _conv([1, 2], [3, 4, 5, 6]),
            _conv([2], [3, 9, 5], sampled=True)]
    q, rest = cal.split(recs, 1)
    assert q == [recs[2]] and rest == [recs[0], recs[1], recs[3]]        # the last greedy one; sampled never queries
    corpus = SuffixAutomaton()
    for r in rest:
        for span in answer_spans(r["input_ids"], r["loss_mask"]):
            corpus.add_document(span)
    acc = cal.accuracy(q, corpus)
    # the query "1 2 | 3 4 5 6": its own text repeats nothing, so only the corpus proposes. After "1 2" nothing
    # matches (prompts are not in the corpus); "3" follows by 4 once and by 9 once (tie: the smaller token, 4:
    # right); "3 4" -> 5 and "3 4 5" -> 6 (right)
    assert not any(k[0] == "own" for k in acc)
    assert dict(acc) == {("corpus", 1): [1, 1], ("corpus", 2): [1, 1], ("corpus", 3): [1, 1]}
    # two queries: the second finds the first in the store (whole text: "1 2" -> 3 at length 2, then 4 5 6)
    acc2 = cal.accuracy([recs[2], recs[0]], SuffixAutomaton())
    assert dict(acc2) == {("store", 2): [1, 1], ("store", 3): [1, 1], ("store", 4): [1, 1], ("store", 5): [1, 1]}
    leak = SuffixAutomaton()                           # the planted bug: the query itself in the corpus
    leak.add_document([1, 2, 3, 4, 5, 6])
    assert cal.accuracy(q, leak) != acc
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cal.main([str(f), "--queries", "1"]) == 0
    out = capsys.readouterr().out
    assert "| corpus | 1.00 (1) | 1.00 (1) | 1.00 (1) | - |" in out and "1 query conversations" in out
    assert "| store | - |" in out
    f.write_text('{"turns": ["x"]}\n')
    assert cal.main([str(f)]) == 2 and "input_ids" in capsys.readouterr().err
