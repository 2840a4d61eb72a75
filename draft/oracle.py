"""Reference drafters for testing and ablations: ``oracle`` (the target model itself drafts, so greedy
acceptance is 100%) and ``adversary`` (the target's *least* likely tokens, so acceptance is 0%).

They implement the :class:`~draft.drafter.BeamTreeDrafter` hooks (``start``, ``commit``, ``tree_forward``,
``drop_tree``, ``logprobs``) with a full unsplit model on rank 0, so the EAGLE-2 beam and every mode run
unchanged. Their "hidden states" are the target's log-probabilities at each entry. Slow; for small models.
Select with ``head_dir=oracle:<full checkpoint dir>`` or ``head_dir=adversary:<dir>``.

``head_dir=oracle@<noise>:<dir>`` is the *noisy oracle*, a what-if draft of tunable acceptance: its log-probs
are ``log_softmax(logits + noise * G)`` with ``G`` standard Gumbel noise drawn from a generator seeded by the
context (the same context always gets the same draft distribution, in every mode and process). With
``noise = 1`` its top-1 token is a *sample* of the target's distribution (the Gumbel-max trick), so at T = 0 it
agrees with the target's greedy token with probability ``p_max`` of that context; smaller noise agrees more
often, ``noise = 0`` is the exact oracle. Verification never depends on the draft's distribution being right,
so every mode stays exact with it (tests/test_protocol.py).

Their model work is metered as rank 0's ``draft_forward`` ops (one per ``commit`` / ``tree_forward``), so the
emulated testbed and the simulator price the oracle like an EAGLE head of the profile: "a draft as cheap as the
head, with this acceptance".
"""
from __future__ import annotations

import math

import torch

from draft.drafter import BeamTreeDrafter
from draft.token_history import TokenHistory
from model.meter import hidden_rows

Tensor = torch.Tensor


REFERENCE_DRAFTERS = ("oracle", "adversary")


def reference_drafter_kind(head_dir: str) -> str | None:
    """``"oracle"``/``"adversary"`` when ``head_dir`` names a test drafter (``<kind>[@noise]:<dir>``), else None."""
    kind = str(head_dir).split(":", 1)[0].split("@", 1)[0]
    return kind if ":" in str(head_dir) and kind in REFERENCE_DRAFTERS else None


def parse_reference_drafter(head_dir: str) -> tuple[str, float, str]:
    """``<kind>[@noise]:<full model dir>`` -> ``(kind, noise, dir)``; a noise that is not a number >= 0 is a
    :class:`ValueError` naming the setting."""
    spec, path = str(head_dir).split(":", 1)
    kind, _, text = spec.partition("@")
    try:
        noise = float(text or 0)
    except ValueError:
        noise = float("nan")
    if kind not in REFERENCE_DRAFTERS or not (math.isfinite(noise) and noise >= 0.0):
        raise ValueError(f"model.head_dir={head_dir}: expected oracle[@noise]:<dir> or adversary:<dir> with a "
                         f"noise >= 0, e.g. oracle@1:<dir>")
    return kind, noise, path


class OracleDrafter(TokenHistory, BeamTreeDrafter):
    def __init__(self, model_dir: str, adversarial: bool = False, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", noise: float = 0.0) -> None:
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        self.adversarial = adversarial
        self.noise = float(noise)
        TokenHistory.__init__(self)

    def begin(self, prompt_ids: list[int]) -> None:
        self.reseed()
        self.context = prompt_ids

    @torch.no_grad()
    def _dist(self, sequences: list[list[int]]) -> Tensor:
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(sequences):
            by_len.setdefault(len(s), []).append(i)
        res: dict[int, Tensor] = {}
        for _, idx in by_len.items():
            batch = torch.tensor([sequences[i] for i in idx], device=self.device)
            logits = self.model(batch).logits[:, -1].double()
            if self.noise > 0:
                logits = logits + self.noise * torch.stack([context_gumbel(sequences[i], logits.shape[-1])
                                                            for i in idx]).to(logits.device)
            lp = torch.log_softmax(-logits if self.adversarial else logits, dim=-1)
            for j, i in enumerate(idx):
                res[i] = lp[j]
        return torch.stack([res[i] for i in range(len(sequences))])

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        with self.meter.op("draft_forward", int(tokens.numel()), len(self.context)):
            return self._dist([self.append_context(tokens)])[0]

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        with self.meter.op("draft_forward", int(tokens.numel()), len(self.context)):
            return self._dist(self.add_tree_entries(tokens, parents))

    def logprobs(self, hidden: Tensor) -> Tensor:
        with self.meter.op("lm_head", hidden_rows(hidden)):
            return hidden.double()


def context_gumbel(context: list[int], vocab: int) -> Tensor:
    """Standard Gumbel noise over the vocabulary, a pure function of the token context (seeded by its hash:
    Python hashes tuples of ints the same way in every process)."""
    g = torch.Generator().manual_seed(hash(tuple(context)) & 0x7FFF_FFFF_FFFF_FFFF)
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_min(1e-300)
    return -torch.log(-torch.log(u))
