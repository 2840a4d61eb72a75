"""bitsandbytes quantized stages on CPU: layers are replaced, memory shrinks, outputs stay close."""
import pytest
import torch

from model.stage_model import load_stage
from split_and_save_models import split_checkpoint
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
