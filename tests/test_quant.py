"""bitsandbytes quantized stages on CPU: layers are replaced, memory shrinks, outputs stay close."""
import pytest
import torch

from model.stage_model import load_stage
from model.split import split_checkpoint
from tests.helpers import tiny_llama

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    full = tiny_llama(root / "full", layers=2, hidden=128)
    return split_checkpoint(full, root / "stages", [0, 2], progress=False)


def _run(model, x):
    cache = model.block.new_cache(32, torch.float32, "cpu")
    pos, mask = cache.context_inputs(x.shape[1], torch.float32)
    with torch.no_grad():
        return model(x, pos, mask, cache)


@pytest.mark.parametrize("quant,kind,max_err", [("int8", "Linear8bitLt", 0.05), ("nf4", "Linear4bit", 0.35),
                                                ("fp4", "Linear4bit", 0.45)])
def test_quantized_stage(stages, quant, kind, max_err):
    ref = load_stage(stages, 1, 2, torch.float32)
    q = load_stage(stages, 1, 2, torch.float32, quant=quant)
    linears = [m for m in q.modules() if type(m).__name__ == kind]
    assert len(linears) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert not any(type(m) is torch.nn.Linear for m in q.block.modules())
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.block.parameters())
    assert nbytes(q) < 0.5 * nbytes(ref)
    x = torch.tensor([[1, 7, 9, 30, 41, 5]])
    y0, y = _run(ref, x), _run(q, x)
    assert torch.isfinite(y).all()
    err = float((y - y0).norm() / y0.norm())
    assert err < max_err, err


def test_quant_report_helpers(stages):
    from pipeline.tools.quant_report import agreement, compare, weight_bytes
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert agreement([1, 2, 3, 4], [1, 2]) == 0.5           # stopped early
    assert agreement([1, 2], [1, 2, 5]) == 1.0              # the reference is a prefix: all of it agrees
    ref = [{"question_id": 0, "output_ids": [1, 2, 3], "accept_lengths": [1], "new_tokens": 3, "decode_s": 1.0},
           {"question_id": 1, "output_ids": [4, 5, 6, 7], "accept_lengths": [1], "new_tokens": 4, "decode_s": 1.0}]
    rows = [{"question_id": 0, "output_ids": [1, 2, 3], "accept_lengths": [2, 1], "new_tokens": 3, "decode_s": 0.5},
            {"question_id": 1, "output_ids": [4, 9, 6, 7], "accept_lengths": [3, 1, 1], "new_tokens": 4,
             "decode_s": 0.5}]
    c = compare(ref, rows)
    assert (c["answers"], c["exact"], c["exact_rate"]) == (2, 1, 0.5)
    assert c["prefix_agreement"] == pytest.approx((1.0 + 0.25) / 2)
    assert c["tau"] == pytest.approx(8 / 5) and c["tps"] == pytest.approx(7.0)
    full = load_stage(stages, 1, 2, torch.float32)
    assert weight_bytes(full) == sum(t.numel() * t.element_size() for t in list(full.parameters()) + list(full.buffers()))
    for quant, ratio in (("int8", 0.4), ("nf4", 0.3)):
        q = load_stage(stages, 1, 2, torch.float32, quant=quant)
        assert 0 < weight_bytes(q) < ratio * weight_bytes(full)
