"""``draft.train_ssm``: the recipe on a tiny model (boost weights, outputs, the student drafts through the ring).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.multidraft_common import E2E_PROMPTS, tiny


def test_boost_weights_target_what_earlier_students_miss():
    from draft.train_ssm import boost_weights
    masks, labels = [[0, 1, 1, 1]], [[5, 6, 7, 8]]
    earlier = [[[5, 6, 0, 0]], [[0, 0, 7, 0]]]             # student 1 gets t=1, student 2 gets t=2
    assert boost_weights(masks, labels, earlier, 0.0) == [[0.0, 0.0, 0.0, 1.0]]
    assert boost_weights(masks, labels, earlier[:1], 0.25) == [[0.0, 0.25, 1.0, 1.0]]


def test_train_ssm_recipe_on_a_tiny_model(tiny, tmp_path, capsys):
    import json
    from draft.train_ssm import main
    out = tmp_path / "ssm"
    assert main(["--target", str(tiny.full), "--out", str(out), "--random-prompts", "6", "--gen-tokens", "6",
                 "--layers", "1", "--models", "2", "--boost", "--steps", "2", "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [m["k"] for m in metrics["models"]] == [1, 2]
    for m in metrics["models"]:
        assert 0 <= m["alpha"] <= 1 and 1 <= m["sps_tokens_per_round"] <= 5 and m["positions"] > 0
    assert metrics["models"][1]["coverage"] >= metrics["models"][0]["coverage"]
    assert "alpha" in (out / "MODEL_CARD.md").read_text()
    from transformers import AutoModelForCausalLM
    student = AutoModelForCausalLM.from_pretrained(out / "ssm_2")
    assert student.config.num_hidden_layers == 1
    assert main(["--target", str(tmp_path / "nope"), "--out", str(out), "--random-prompts", "2"]) == 2
    assert "no config.json" in capsys.readouterr().err
    from tests.helpers import hf_greedy
    from pipeline.inprocess import run_threaded
    res = run_threaded(tiny.stages, E2E_PROMPTS[:1], ["sps"], ["max_new_tokens=10", "dtype=float64",
                       f"sps.draft_dir={out / 'ssm_1'}", "sps.gamma=3"], {2})
    assert res["sps"][0].output_ids == hf_greedy(tiny.full, E2E_PROMPTS[0], 10, {2}, torch.float64)


def test_sps_without_a_small_lm_fails_before_launch():
    import subprocess
    import sys
    from tests.helpers import REPO
    res = subprocess.run([sys.executable, "-m", "pipeline.run", "--print-config", "mode=sps"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "mode sps needs a small draft LM" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_merged_and_sps_decode_paths_create_no_tensor_on_the_default_device(tiny):
    """The device-placement guard of tests/test_device_guard.py (rank 0 and the stages under
    ``torch.device("meta")``) with every source merged and with sps, at T = 0 and T > 0."""
    from pipeline.inprocess import run_threaded
    modes = ["naive", "pruned", "continuous", "pipedec", "sps"]
    for extra in (["temperature=0"], ["temperature=0.8", "seed=3"]):
        over = ["max_new_tokens=8", "dtype=float64", f"draft.sources=eagle,lookup,ssm:{tiny.ssm}", *extra]
        plain = run_threaded(tiny.stages, E2E_PROMPTS[:1], modes, over, {2})
        guarded = run_threaded(tiny.stages, E2E_PROMPTS[:1], modes, over, {2}, guard=lambda: torch.device("meta"))
        for m in modes:
            assert guarded[m][0].output_ids == plain[m][0].output_ids, (m, extra)


def test_shared_vocabulary_students_borrow_rank0s_embedding_and_lm_head(tiny, tmp_path):
    """``draft.ssm.ship_student`` drops the (frozen) embedding and lm_head; ``load_small_lm`` takes them from
    rank 0's stage and computes exactly what the full student computes; misuse is one clear error."""
    from model.stage_model import load_stage
    from draft.ssm import SmallLMError, load_small_lm, ship_student
    from draft.train_ssm import freeze_vocab, student_from_target
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(tiny.full, dtype=torch.float64)
    student = student_from_target(target, 2)
    freeze_vocab(student)
    with torch.no_grad():                      # a "trained" student: layers moved, vocabulary untouched
        for name, p in student.named_parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)),
                                          dtype=p.dtype))
    ship_student(student, tmp_path / "s", dtype=torch.float64)
    names = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "s/model.safetensors"))
    assert not any("embed_tokens" in k or k.startswith("lm_head") for k in names)
    rank0 = load_stage(tiny.stages, 0, 3, torch.float64)
    shared = load_small_lm(tmp_path / "s", torch.float64, "cpu", rank0)
    assert shared.lm_head.weight.data_ptr() == rank0.lm_head.weight.data_ptr()    # lent, not copied
    ids = torch.tensor([E2E_PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(shared(ids).logits, student(ids).logits)
    with pytest.raises(SmallLMError, match="shares its target's embedding"):
        load_small_lm(tmp_path / "s", torch.float64, "cpu", None)
    other = SimpleNamespace(embed_tokens=torch.nn.Embedding(7, 3), lm_head=torch.nn.Linear(3, 7))
    with pytest.raises(SmallLMError, match="does not fit"):
        load_small_lm(tmp_path / "s", torch.float64, "cpu", other)


def test_train_ssm_shared_vocab_layout_drafts_through_the_ring(tiny, tmp_path):
    from tests.helpers import hf_greedy
    from draft.train_ssm import main
    from pipeline.inprocess import run_threaded
    out = tmp_path / "ssm"
    assert main(["--target", str(tiny.full), "--out", str(out), "--random-prompts", "6", "--gen-tokens", "6",
                 "--layers", "1", "--steps", "2", "--shared-vocab", "--quiet"]) == 0
    assert (out / "ssm_1" / "config.json").is_file()
    for over in ([f"sps.draft_dir={out / 'ssm_1'}", "sps.gamma=3"], [f"draft.sources=eagle,ssm:{out / 'ssm_1'}"]):
        mode = "sps" if "sps.gamma=3" in over else "continuous"
        res = run_threaded(tiny.stages, E2E_PROMPTS[:1], [mode], ["max_new_tokens=10", "dtype=float64", *over], {2})
        assert res[mode][0].output_ids == hf_greedy(tiny.full, E2E_PROMPTS[0], 10, {2}, torch.float64), mode


SHIPPED_SSM = Path(__file__).resolve().parents[1] / "draft" / "ssms" / "SmolLM2-135M-Instruct" / "ssm_1"


@pytest.mark.skipif(not SHIPPED_SSM.is_dir(), reason="no shipped small draft LM")
def test_shipped_smollm2_student_drafts_exactly(tmp_path):
    """The shipped SmolLM2 student (shared vocabulary) in sps and in a merged tree: output equals HF greedy."""
    import json
    from transformers import AutoTokenizer
    from model.default_model import ensure_default_checkpoint, ensure_default_stages
    from model.prompts import chat_prompt_ids, stop_token_ids
    from pipeline.inprocess import run_threaded
    from tests.helpers import hf_greedy
    full, stages = ensure_default_checkpoint(), ensure_default_stages()
    tok = AutoTokenizer.from_pretrained(full)
    stop = stop_token_ids(tok, json.loads((Path(full) / "generation_config.json").read_text()))
    prompts = [chat_prompt_ids(tok, ["Summarize: the cat sat on the mat and the dog sat on the log."], [])]
    res = run_threaded(stages, prompts, ["sps", "naive"], ["max_new_tokens=16", "dtype=float32",
                       f"draft.sources=eagle,lookup,ssm:{SHIPPED_SSM}", "sps.gamma=3"], stop,
                       str(Path(__file__).resolve().parents[1] / "draft" / "heads" / "SmolLM2-135M-Instruct"),
                       dtype=torch.float32)
    ref = hf_greedy(full, prompts[0], 16, stop, torch.float32)
    assert res["sps"][0].output_ids == ref and res["naive"][0].output_ids == ref
