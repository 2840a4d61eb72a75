"""``pipeline.tools.fuzz``: seeded draws of run-key combinations whose greedy answers must equal HF ``generate``.

The draw is pure and seeded per trial; every drawn word is a key the configuration knows, and a draw either
validates or is one :class:`config.errors.UserError`. End to end on stories260K (3 ranks in one process): a few
drawn combinations are exact against HF; a protocol bug planted in the verification walk (a wrong token after an
accepted path of two nodes or more, the kind of bug a combination reaches and a fixed test may not) is reported as a
mismatch with the words that reproduce it and exit 1; an exception inside the decode loop is a crash, not a pass;
bad input is one line and exit 2."""
from __future__ import annotations

import json

import pytest

from config.errors import UserError
from pipeline.tools import fuzz
from tests.helpers import STORIES


def test_a_trial_is_the_same_draw_whatever_came_before():
    heads = [fuzz.OWN, "oracle:/m", "untrained"]
    a = [fuzz.draw_trial(5, i, heads, 0.5) for i in range(8)]
    b = fuzz.draw_trial(5, 6, heads, 0.5)
    assert (a[6].mode, a[6].head, a[6].words) == (b.mode, b.head, b.words)
    assert len({tuple(t.words) for t in a}) == 8                       # the draws differ between trials
    assert fuzz.draw_trial(6, 6, heads, 0.5).words != b.words          # and between seeds
    none = fuzz.draw_trial(5, 0, heads, 0.0)
    assert none.words[0] == f"mode={none.mode}" and len(none.words) <= 2   # p = 0: the mode and the head only
    every = fuzz.draw_trial(5, 0, ["untrained"], 1.0, modes=("naive",))
    assert every.words[:2] == ["mode=naive", "model.head_dir=untrained"] and len(every.words) == 2 + len(fuzz.SPACE)
    own = [t for t in a if t.head == fuzz.OWN]
    assert own and all(not any(w.startswith("model.head_dir=") for w in t.words) for t in own)


def test_every_drawn_word_is_a_known_key_and_validates_or_is_one_user_error():
    from config.run_config import DEFAULT, apply_overrides
    for i in range(60):
        t = fuzz.draw_trial(0, i, ["untrained"], 0.7)
        try:
            apply_overrides(DEFAULT, t.words)
        except UserError as e:                      # a refused combination: one line, never another exception
            assert "\n" not in str(e).strip()
    for key, values in fuzz.SPACE.items():          # each key's values are valid alone
        for v in values:
            apply_overrides(DEFAULT, [f"{key}={str(v).lower() if isinstance(v, bool) else v}"])


def test_first_difference():
    assert fuzz.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert fuzz.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert fuzz.first_difference([1, 2, 3], [1, 2]) == 2
    assert fuzz.first_difference([1, 2], [1, 2, 9]) == 2
    assert fuzz.first_difference([], []) is None


needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260K")


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    from model.split import split_checkpoint
    return split_checkpoint(STORIES, tmp_path_factory.mktemp("fuzz") / "stages", [0, 3, 2], progress=False)


def _run(stages, tmp_path, *args):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "fuzz.jsonl"
    rc = fuzz.main(["--prompts", "1", *args, "--max-new-tokens", "24", "--out", str(out),   # (args may set --prompts)
                    f"model.stage_dir={stages}"])
    return rc, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


@needs_stories
def test_drawn_combinations_are_exact(stages, tmp_path):
    rc, rows = _run(stages, tmp_path, "--trials", "4", "--seed", "12", "--p", "0.6",
                    "--heads", f"oracle:{STORIES},oracle@1:{STORIES},untrained")
    assert rc == 0 and len(rows) == 4, rows
    assert all(r["verdict"] in ("exact", "rejected") for r in rows), rows
    assert sum(r["verdict"] == "exact" for r in rows) >= 3     # (seed 12: four oracle trials, none refused)
    assert any(max(r["tau"], default=0) > 1.5 for r in rows)           # some trial accepted whole paths


@needs_stories
def test_the_ar_reference_needs_no_unsplit_model(stages, tmp_path):
    rc, rows = _run(stages, tmp_path, "--trials", "1", "--seed", "1", "--reference", "ar",
                    "--heads", f"oracle@1:{STORIES}")
    assert rc == 0 and rows[0]["verdict"] == "exact", rows


@needs_stories
def test_drawn_combinations_with_requests_at_once(stages, tmp_path, monkeypatch):
    """``--lanes 2``: every trial answers its prompts at once (generate_many on two lanes), each still HF's; the
    generations did overlap; and a planted verification bug is still a mismatch there."""
    from pipeline.lanes import LanePool
    peak, acquire = [], LanePool.acquire

    def spy(self, *a, **k):
        lane = acquire(self, *a, **k)
        peak.append(self.active)
        return lane
    monkeypatch.setattr(LanePool, "acquire", spy)
    args = ("--lanes", "2", "--prompts", "2", "--modes", "continuous,pipedec")
    rc, rows = _run(stages, tmp_path / "good", "--trials", "2", "--seed", "12", "--p", "0.5", *args,
                    "--heads", f"oracle:{STORIES},oracle@1:{STORIES}")
    assert rc == 0 and all(r["verdict"] in ("exact", "rejected") for r in rows), rows
    assert any(r["verdict"] == "exact" for r in rows) and max(peak) == 2, (rows, peak)
    import pipeline.modes.flowspec as flowspec
    monkeypatch.setattr(flowspec, "walk_tree", _corrupt_after_two(flowspec.walk_tree))
    rc, rows = _run(stages, tmp_path / "bad", "--trials", "1", *args, "--modes", "continuous",
                    "--heads", f"oracle:{STORIES}")
    assert rc == 1 and rows[0]["verdict"] == "mismatch", rows


@needs_stories
def test_launched_trials_run_the_real_transports(stages, tmp_path, monkeypatch):
    """``--launch``: a trial is a real job (a process per rank); its answers are checked as in one process; a rank
    killed mid-decode (``FLOWSPEC_FAULT``) is a crash naming the lost rank; a wrong reference (planted) is a
    mismatch, so the launched answers are really compared."""
    args = ("--launch", "--modes", "continuous", "--heads", f"oracle@1:{STORIES}", "--seed", "3")
    rc, rows = _run(stages, tmp_path / "good", "--trials", "1", *args)
    assert rc == 0 and rows[0]["verdict"] == "exact", rows
    monkeypatch.setenv("FLOWSPEC_FAULT", "rank=2,at=segment,count=3")
    rc, rows = _run(stages, tmp_path / "fault", "--trials", "1", *args)
    assert rc == 1 and rows[0]["verdict"] == "crash" and "rank 2" in rows[0]["detail"], rows
    monkeypatch.delenv("FLOWSPEC_FAULT")
    out = tmp_path / "refused.jsonl"          # a rank's setup refuses it (an untrained head has no token counts)
    assert fuzz.main(["--trials", "1", "--launch", "--modes", "naive", "--heads", "untrained", "--prompts", "1",
                      "--out", str(out), f"model.stage_dir={stages}", "model.draft_vocab=64"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["verdict"] == "rejected" and "token counts" in rows[0]["detail"], rows
    real = fuzz.References.answer
    monkeypatch.setattr(fuzz.References, "answer", lambda self, p, s: [t + 1 for t in real(self, p, s)])
    rc, rows = _run(stages, tmp_path / "bad", "--trials", "1", *args)
    assert rc == 1 and rows[0]["verdict"] == "mismatch" and "position 0" in rows[0]["detail"], rows


def _corrupt_after_two(walk):
    """The planted bug: after an accepted path of two nodes or more, the target's token is replaced by another."""
    def wrapped(tree, n_verified, logits, sampler):
        path, token, new_root = walk(tree, n_verified, logits, sampler)
        if token is not None and len(path) >= 2:
            return path, (token + 1) % logits.shape[-1], None
        return path, token, new_root
    return wrapped


@needs_stories
def test_a_planted_verification_bug_is_a_mismatch(stages, tmp_path, monkeypatch, capsys):
    import pipeline.modes.flowspec as flowspec
    import pipeline.modes.naive as naive
    monkeypatch.setattr(naive, "walk_tree", _corrupt_after_two(naive.walk_tree))
    monkeypatch.setattr(flowspec, "walk_tree", _corrupt_after_two(flowspec.walk_tree))
    rc, rows = _run(stages, tmp_path, "--trials", "2", "--seed", "0", "--modes", "naive,continuous",
                    "--heads", f"oracle:{STORIES}")
    assert rc == 1 and [r["verdict"] for r in rows] == ["mismatch", "mismatch"], rows
    assert "position" in rows[0]["detail"] and "logit gap" in rows[0]["detail"]
    printed = capsys.readouterr().out
    assert "mismatch (trial 0)" in printed and f"model.head_dir=oracle:{STORIES}" in printed


@needs_stories
def test_seeded_sampled_answers_do_not_depend_on_the_combination(stages, tmp_path, monkeypatch):
    """At T > 0 every drawn combination's seeded answer equals naive's with the default keys ("Draw first"); a
    planted bug in continuous's walk (the reference, naive, keeps the real one) is a mismatch."""
    args = ("--trials", "3", "--seed", "12", "--temperature", "1", "--modes", "continuous,pruned",
            "--heads", f"oracle@1:{STORIES},oracle:{STORIES}")
    rc, rows = _run(stages, tmp_path / "good", *args)
    assert rc == 0 and all(r["verdict"] in ("exact", "rejected") for r in rows), rows
    assert sum(r["verdict"] == "exact" for r in rows) >= 2, rows
    import pipeline.modes.flowspec as flowspec
    monkeypatch.setattr(flowspec, "walk_tree", _corrupt_after_two(flowspec.walk_tree))
    rc, rows = _run(stages, tmp_path / "bad", "--trials", "1", "--temperature", "1", "--modes", "continuous",
                    "--heads", f"oracle:{STORIES}")
    assert rc == 1 and rows[0]["verdict"] == "mismatch", rows


@needs_stories
@pytest.mark.parametrize("error", ["IndexError", "PeerLost"])
def test_an_exception_in_the_decode_loop_is_a_crash(stages, tmp_path, monkeypatch, error):
    """Any exception inside a generation is a crash, a lost peer too (a UserError for the command line, where it is
    one line; here a combination that lost a stage is no refused combination)."""
    import pipeline.modes.naive as naive
    from pipeline.comm import PeerLost
    make = {"IndexError": lambda: IndexError("planted"), "PeerLost": lambda: PeerLost(2, "planted")}[error]

    def broken(*a, **k):
        raise make()
    monkeypatch.setattr(naive, "walk_tree", broken)
    rc, rows = _run(stages, tmp_path, "--trials", "1", "--modes", "naive", "--heads", "untrained")
    assert rc == 1 and rows[0]["verdict"] == "crash" and rows[0]["detail"].startswith(error), rows
    assert "planted" in rows[0]["detail"], rows


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        fuzz.parse_args(["--modes", "ar"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        fuzz.parse_args(["--lanes", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        fuzz.parse_args(["--launch", "--lanes", "2"])
    assert e.value.code == 2
    capsys.readouterr()
    assert fuzz.main([f"model.stage_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no usable split checkpoint"), err
    assert fuzz.main(["tree.no_such_key=1"]) == 2
    assert "tree.no_such_key" in capsys.readouterr().err
