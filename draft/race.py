"""An exponential race: a token of law ``p / p.sum()`` from a fixed number of uniforms, robust to rounding noise in
``p`` (the seeded draws of the tree walk, :meth:`pipeline.verify.Sampler.pick`, and of a sampled draft,
:meth:`draft.drafter.BeamTreeDrafter.draw`; why: docs/results.md §101)."""
from __future__ import annotations

import math

import torch

from model.devices import HOST

Tensor = torch.Tensor


def uniforms(generator: torch.Generator | None, n: int) -> Tensor:
    """``n`` fresh uniforms in [0, 1), float64, from ``generator`` on its own device (the host without one): a
    race's randomness, never on the default device."""
    return torch.rand(n, generator=generator, dtype=torch.float64,
                      device=generator.device if generator is not None else HOST)


def seeded_pick(p: Tensor, generator: torch.Generator | None) -> int:
    """:func:`race_pick` of ``p`` with its :func:`pick_draws` uniforms from ``generator``: the one draw rule of the
    tree walk (:meth:`pipeline.verify.Sampler.pick`) and of a sampled draft
    (:meth:`draft.drafter.BeamTreeDrafter.draw`)."""
    return race_pick(p, uniforms(generator, pick_draws(p.numel())))


def pick_blocks(v: int) -> tuple[int, int]:
    """``(blocks, size)`` of :func:`race_pick` for a vocabulary of ``v`` tokens: blocks of ``ceil(sqrt(v))``
    consecutive token ids (the last one padded), so both levels of the race are about ``sqrt(v)`` wide."""
    size = math.isqrt(v - 1) + 1 if v > 1 else 1
    return -(-v // size), size


def pick_draws(v: int) -> int:
    """How many uniforms one race (:func:`race_pick`) spends for a vocabulary of ``v`` tokens (fixed by ``v``)."""
    blocks, size = pick_blocks(v)
    return blocks + size


def race_pick(p: Tensor, u: Tensor) -> int:
    """A token of law ``p / p.sum()`` (``p`` >= 0 with some mass, ``[V]``) from ``pick_draws(V)`` uniforms ``u`` in
    [0, 1): an exponential race (``argmax w_j / E_j`` over independent ``E_j ~ Exp(1)`` is ``j`` with probability
    ``w_j / sum w``) among the blocks of :func:`pick_blocks` by their masses (``u[:blocks]``), then among the
    chosen block's tokens by theirs (``u[blocks:]``). ``E = -log1p(-u)`` is finite; an entry without mass scores
    -1 and never wins (a zero ``E`` gives an entry with mass +inf: a probability-zero event of a continuous law).
    One read, the token; ``u`` may live on another device than ``p``."""
    v = p.numel()
    blocks, size = pick_blocks(v)
    e = -torch.log1p(-u.to(p.device, torch.float64))
    w = p.reshape(-1).double()
    if blocks * size != v:
        w = torch.cat([w, w.new_zeros(blocks * size - v)])
    w = w.view(blocks, size)
    mass = w.sum(1)
    b = torch.argmax(torch.where(mass > 0, mass / e[:blocks], -1.0))
    row = w.index_select(0, b.view(1))[0]
    i = torch.argmax(torch.where(row > 0, row / e[blocks:], -1.0))
    return int(b * size + i)
