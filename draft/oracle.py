"""Reference drafters for testing and ablations: ``oracle`` (the target model itself drafts, so greedy
acceptance is 100%) and ``adversary`` (the target's *least* likely tokens, so acceptance is 0%).

They implement the :class:`~draft.drafter.BeamTreeDrafter` hooks (``start``, ``commit``, ``tree_forward``,
``drop_tree``, ``logprobs``) with a full unsplit model on rank 0, so the EAGLE-2 beam and every mode run
unchanged. Their "hidden states" are the target's log-probabilities at each entry. Slow; for small models.
Select with ``head_dir=oracle:<full checkpoint dir>`` or ``head_dir=adversary:<dir>``.
"""
from __future__ import annotations

import torch

from draft.drafter import BeamTreeDrafter
from draft.token_history import TokenHistory
from model.devices import HOST
from model.meter import hidden_rows

Tensor = torch.Tensor


class OracleDrafter(TokenHistory, BeamTreeDrafter):
    def __init__(self, model_dir: str, adversarial: bool = False, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        self.adversarial = adversarial
        TokenHistory.__init__(self)

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor) -> Tensor:
        self.reset()
        self.context = list(prompt_ids)
        return self.commit(torch.tensor([first_token], device=HOST), features)

    @torch.no_grad()
    def _dist(self, sequences: list[list[int]]) -> Tensor:
        out = []
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(sequences):
            by_len.setdefault(len(s), []).append(i)
        res: dict[int, Tensor] = {}
        for _, idx in by_len.items():
            batch = torch.tensor([sequences[i] for i in idx], device=self.device)
            logits = self.model(batch).logits[:, -1].double()
            lp = torch.log_softmax(-logits if self.adversarial else logits, dim=-1)
            for j, i in enumerate(idx):
                res[i] = lp[j]
        out = [res[i] for i in range(len(sequences))]
        return torch.stack(out)

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        return self._dist([self.append_context(tokens)])[0]

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        return self._dist(self.add_tree_entries(tokens, parents))

    def logprobs(self, hidden: Tensor) -> Tensor:
        with self.meter.op("lm_head", hidden_rows(hidden)):
            return hidden.double()
