"""``no_grad``: :func:`torch.no_grad` as a decorator that costs nothing where autograd is off already.

Why (issue 41, rank 0's host time per call): ``@torch.no_grad()`` enters and leaves a grad-mode context on every
call, about 3 us of Python on this CPU, and rank 0's chain nests such calls (a beam level runs the drafter's
``tree_forward``, ``logprobs`` and ``draft_logprobs``, each decorated, inside a decorated ``extend_tree``). Where
grad mode is off already, entering ``no_grad`` sets it off and leaving restores it off: a no-op, so this wrapper
calls the function straight (one ``torch.is_grad_enabled()`` check, ~0.3 us); where it is on, it enters
``torch.no_grad`` exactly as the decorator does. Same results, same grad mode inside and after, either way
(``tests/test_grad.py``). For plain functions and methods (not generators).
"""
from __future__ import annotations

import functools

import torch


def no_grad(fn):
    """``fn`` run under :class:`torch.no_grad` (module docstring: no context entered when grad mode is off)."""
    enabled, ctx = torch.is_grad_enabled, torch.no_grad

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not enabled():
            return fn(*args, **kwargs)
        with ctx():
            return fn(*args, **kwargs)
    return wrapper
