"""Reference drafters for testing and ablations: ``oracle`` (the target model itself drafts, so greedy
acceptance is 100%) and ``adversary`` (the target's *least* likely tokens, so acceptance is 0%).

They implement the :class:`~draft.drafter.BeamTreeDrafter` hooks (``start``, ``commit``, ``tree_forward``,
``drop_tree``, ``logprobs``) with a full unsplit model on rank 0, so the EAGLE-2 beam and every mode run
unchanged. Their "hidden states" are the target's log-probabilities at each entry. The committed context's KV cache
is kept, so a tree entry costs a forward over its path only (:meth:`OracleDrafter._path_logits`). Slow all the
same (one full-model forward per level); for small models.
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

import copy
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
        self._kv, self._kv_tokens = None, []
        # the KV cache's keyword: ``cache`` in newer transformers (``past_key_values`` deprecated from 5.24, to be
        # removed in 5.40), ``past_key_values`` at the floor of requirements.txt's range
        import inspect
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        TokenHistory.__init__(self)

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor, sampling=None) -> Tensor:
        """:meth:`TokenHistory.start` with the generation's ``sampling`` taken first (``draft.eagle_sample`` on the
        oracle: :meth:`BeamTreeDrafter.take_sampling`; :meth:`begin` then reseeds with its seed)."""
        self.take_sampling(sampling)
        return TokenHistory.start(self, prompt_ids, first_token, features)

    def begin(self, prompt_ids: list[int]) -> None:
        self.reseed()
        self.context = prompt_ids

    @torch.no_grad()
    def _context_logits(self) -> Tensor:
        """The target's logits after the whole committed context, row ``[1, vocab]``. The context's KV cache
        (``self._kv``, of the tokens ``self._kv_tokens``) grows by the tokens committed since: a tree entry then costs
        its path's tokens, not the whole context again (the tests' oracle runs were mostly this recompute). A new
        request keeps what its context shares with the cached tokens and recomputes the rest."""
        from transformers import DynamicCache
        # keep the longest prefix the cache shares with the context, short of its last token (whose logits are
        # wanted): a request that repeats or extends an earlier one's prompt (every mode of one prompt) reuses it
        keep = 0
        if self._kv is not None:
            for a, b in zip(self._kv_tokens, self.context[:-1]):
                if a != b:
                    break
                keep += 1
        if keep == 0:
            self._kv = DynamicCache()
        elif keep < len(self._kv_tokens):
            self._kv.crop(keep - len(self._kv_tokens))   # negative: drop that many (what every version takes)
        new = torch.tensor([self.context[keep:]], device=self.device)
        logits = self.model(new, use_cache=True, **{self._cache_kw: self._kv}).logits[:, -1]
        self._kv_tokens = list(self.context)
        return logits

    @torch.no_grad()
    def _path_logits(self, paths: list[list[int]]) -> Tensor:
        """The target's logits after ``context + path`` for each (non-empty) tree path, ``[len(paths), vocab]``: one
        batched forward per path length over a copy of the context's cache (tree entries are temporary: the
        context's own cache is never extended by them). Equal to a forward over the whole sequence up to float
        rounding, which never decides an output: verification does (the oracle decides only what is proposed)."""
        by_len: dict[int, list[int]] = {}
        for i, path in enumerate(paths):
            by_len.setdefault(len(path), []).append(i)
        out: list[Tensor | None] = [None] * len(paths)
        for _, idx in by_len.items():
            kv = copy.deepcopy(self._kv)
            kv.batch_repeat_interleave(len(idx))
            batch = torch.tensor([paths[i] for i in idx], device=self.device)
            logits = self.model(batch, use_cache=True, **{self._cache_kw: kv}).logits[:, -1]
            for j, i in enumerate(idx):
                out[i] = logits[j]
        return torch.stack(out)

    def _log_probs(self, logits: Tensor, sequences: list[list[int]]) -> Tensor:
        logits = logits.double()
        if self.noise > 0:
            logits = logits + self.noise * torch.stack([context_gumbel(s, logits.shape[-1])
                                                        for s in sequences]).to(logits.device)
        return torch.log_softmax(-logits if self.adversarial else logits, dim=-1)

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        with self.meter.op("draft_forward", int(tokens.numel()), len(self.context)):
            context = self.append_context(tokens)
            return self._log_probs(self._context_logits(), [context])[0]

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        with self.meter.op("draft_forward", int(tokens.numel()), len(self.context)):
            paths = self.add_tree_paths(tokens, parents)
            if len(self._kv_tokens) != len(self.context):       # the cache is of the committed context
                self._context_logits()
            return self._log_probs(self._path_logits(paths), [self.context + p for p in paths] if self.noise > 0
                                   else paths)

    def logprobs(self, hidden: Tensor) -> Tensor:
        with self.meter.op("lm_head", hidden_rows(hidden)):
            return hidden.double()


def context_gumbel(context: list[int], vocab: int) -> Tensor:
    """Standard Gumbel noise over the vocabulary, a pure function of the token context (seeded by its hash:
    Python hashes tuples of ints the same way in every process)."""
    g = torch.Generator().manual_seed(hash(tuple(context)) & 0x7FFF_FFFF_FFFF_FFFF)
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_min(1e-300)
    return -torch.log(-torch.log(u))
