"""scripts/seeded_repro.py (docs/results.md §101): its table and exit codes on a small split, and its planted former
rule (``--rules cdf``) is the inverse CDF it names. The robustness of ``Sampler.pick`` itself is tested in
tests/test_seeded_draws.py."""
from __future__ import annotations

import pytest
import torch

import scripts.seeded_repro as R
from model.split import split_checkpoint
from pipeline.verify import Sampler
from tests.helpers import STORIES


def test_the_former_rule_is_the_inverse_cdf():
    p = torch.tensor([0.25, 0.0, 0.5, 0.25, 0.0], dtype=torch.float64)

    class Coin(Sampler):
        def __init__(self, u):
            super().__init__(1.0, 1.0, 0, None)
            self.u = u

        def uniform(self):
            return self.u
    assert [R.inverse_cdf_pick(Coin(u), p) for u in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999, 1.0)] == \
        [0, 0, 2, 2, 3, 3, 3]


def test_table_on_stories(tmp_path, capsys):
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 2, 3], progress=False)
    assert R.main(["--stage-dir", str(stages), f"head_dir=oracle:{STORIES}", "--modes", "continuous", "--runs", "2",
                   "--max-new-tokens", "6", "--prompts", "Once upon a time"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| mode | rule | runs |") and len(lines) == 4
    assert lines[2].startswith("| continuous | race | 2 | 1 of 1 | 0 of 1 |")     # stories260K: stable logits
    assert lines[3].startswith("| continuous | cdf | 2 | 1 of 1 | 0 of 1 |")
    assert Sampler.pick is not R.inverse_cdf_pick                                   # restored
    assert R.main(["--stage-dir", str(stages), f"head_dir=oracle:{STORIES}", "--modes", "naive", "--runs", "2",
                   "--rules", "race", "--lanes", "2", "--max-new-tokens", "6",
                   "--prompts", "Once upon a time", "The cat"]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("| naive, 2 lanes | race | 2 | 1 of 1 | 0 of 2 |")


def test_bad_input(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        R.parse_args(["--stage-dir", "x", "--runs", "1"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        R.parse_args(["--stage-dir", "x", "--lanes", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:         # a run key after --prompts would be answered as a prompt
        R.parse_args(["--stage-dir", "x", "--prompts", "Hi", "gen.top_p=0.9"])
    assert e.value.code == 2 and "before --prompts" in capsys.readouterr().err
    assert R.parse_args(["--stage-dir", "x", "gen.top_p=0.9", "--prompts", "Hi", "a=b"]).prompts == ["Hi", "a=b"]
    capsys.readouterr()
    assert R.main(["--stage-dir", str(tmp_path / "none"), "--runs", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
