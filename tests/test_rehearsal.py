"""Loading without waste and the 7B rehearsal's small variant.

* :func:`model.stage_format.iter_safetensors` (what ranks load stages with) returns exactly ``load_file``'s tensors,
  every dtype, casts floating ones only, and refuses a truncated file in one line;
* a Vicuna-layout checkpoint (``pytorch_model-0000X-of-0000N.bin`` + ``pytorch_model.bin.index.json``) splits into
  the same stages as its safetensors twin, the splitter opening one shard at a time;
* a stage is built on the meta device: nothing of it is left there after loading;
* ``scripts/rehearse_7b.py`` with a tiny shape runs end to end (checkpoint, head, split, ranks, HF) and passes its
  checks.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.split import WeightSource, split_checkpoint
from model.stage_format import StageDirError, WEIGHTS, iter_safetensors, stage_dir
from model.stage_model import load_stage
from tests.helpers import REPO, tiny_llama


def test_iter_safetensors_equals_load_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
               "c": torch.randn(2, 2, generator=g).half(), "d": torch.arange(5), "e": torch.tensor([True, False]),
               "f": torch.zeros(0, 4), "g": torch.tensor(3.5, dtype=torch.float64)}
    p = tmp_path / "t.safetensors"
    save_file(tensors, str(p))
    ref = load_file(str(p))
    got = dict(iter_safetensors(p))
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    cast = dict(iter_safetensors(p, torch.float32, names={"b", "d"}))
    assert set(cast) == {"b", "d"} and cast["b"].dtype == torch.float32 and cast["d"].dtype == torch.int64
    raw = p.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-8])
    with pytest.raises(StageDirError, match="truncated"):
        list(iter_safetensors(tmp_path / "cut.safetensors"))


def _as_vicuna_bin(src, out, first_share=0.6):
    """``src`` (a save_pretrained safetensors checkpoint) rewritten as two .bin shards + index, Vicuna-style."""
    from scripts.rehearse_7b import shard_plan
    out.mkdir()
    state = load_file(str(src / "model.safetensors"))
    plan = shard_plan([(k, tuple(v.shape)) for k, v in state.items()], first_share)
    weight_map = {}
    for i, shard in enumerate(plan, 1):
        name = f"pytorch_model-{i:05d}-of-{len(plan):05d}.bin"
        torch.save({k: state[k] for k, _ in shard}, out / name)
        weight_map.update({k: name for k, _ in shard})
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def test_sharded_bin_splits_like_safetensors_one_shard_at_a_time(tmp_path, monkeypatch):
    src = tiny_llama(tmp_path / "st", layers=4)
    binckpt = _as_vicuna_bin(src, tmp_path / "bin")
    opened = []
    real = torch.load

    def spy(f, *a, **kw):
        assert kw.get("weights_only") is True
        opened.append(str(f))
        return real(f, *a, **kw)
    monkeypatch.setattr(torch, "load", spy)
    src_ws = WeightSource(binckpt)
    assert not opened and len(set(src_ws.key_file.values())) == 2      # keys from the index: no shard opened
    a = split_checkpoint(src, tmp_path / "a", [0, 1, 3], progress=False)
    b = split_checkpoint(binckpt, tmp_path / "b", [0, 1, 3], progress=False)
    # each stage reads its tensors grouped by shard: a shard is opened at most once per stage
    assert len(opened) <= 2 * 3 and len(opened) >= 2
    for r in range(3):
        ta, tb = (load_file(str(stage_dir(x, r) / WEIGHTS)) for x in (a, b))
        assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_stage_loads_nothing_left_on_meta(tmp_path):
    src = tiny_llama(tmp_path / "st", layers=2)
    root = split_checkpoint(src, tmp_path / "s", [0, 2], dtype="bfloat16", progress=False)
    for r in range(2):
        m = load_stage(root, r, 2, torch.float32)
        assert all(not t.is_meta and t.dtype in (torch.float32,) for t in m.parameters())
        ref = load_file(str(stage_dir(root, r) / WEIGHTS))
        name = "lm_head.weight" if r == 0 else "layers.0.self_attn.q_proj.weight"
        got = dict(m.named_parameters())["block." + name if name.startswith("layers.") else name]
        assert torch.equal(got, ref[name].float())


def test_rehearsal_small_variant_passes(tmp_path):
    cmd = [sys.executable, "-m", "scripts.rehearse_7b", "--work", str(tmp_path / "w"), "--layers", "2", "--hidden",
           "64", "--intermediate", "128", "--heads", "4", "--vocab", "300", "--stages", "2", "--tokens", "3",
           "--modes", "ar,naive,continuous", "--no-load-probe"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert s["split"] == "0+1+1" and len(s["checkpoint"]["shards"]) == 2
    assert all(c["ok"] for c in s["checks"]) and len([c for c in s["checks"] if "equals HF" in c["check"]]) == 3
    assert s["step_times"] and all(v["forwards"] > 0 for v in s["step_times"].values())
    assert not (tmp_path / "w" / "vicuna").exists()          # deleted without --keep
