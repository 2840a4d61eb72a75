"""model.grad.no_grad: the function runs with grad mode off, and the caller's grad mode is restored after."""
import pytest
import torch

from model.grad import no_grad


@no_grad
def _inside(x):
    return torch.is_grad_enabled(), x * 2


@pytest.mark.parametrize("outer", [True, False])
def test_no_grad_inside_and_restored(outer):
    x = torch.ones(2, requires_grad=True)
    with torch.set_grad_enabled(outer):
        inside, y = _inside(x)
        assert torch.is_grad_enabled() is outer
    assert inside is False
    assert not y.requires_grad                       # computed without autograd, as under torch.no_grad
    assert torch.equal(y, torch.full((2,), 2.0))


def test_no_grad_restores_after_raise():
    @no_grad
    def boom():
        raise ValueError("x")
    with torch.enable_grad():
        with pytest.raises(ValueError):
            boom()
        assert torch.is_grad_enabled()


def test_wraps_metadata():
    assert _inside.__name__ == "_inside"
