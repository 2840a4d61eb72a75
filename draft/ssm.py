"""A small causal LM as drafter (SpecInfer's "SSM", the draft model of Leviathan/Chen speculative sampling).

Any Hugging Face LLaMA-family causal LM that shares the target's tokenizer (same token ids; a smaller or
larger vocabulary is cut or padded with a very low log-score) drafts on rank 0 with its **own KV cache**: the
committed context (prompt + accepted tokens) lives in a ``DynamicCache``; tree entries are computed on top of
a copy of it, each node from its path below the context, and thrown away by :meth:`drop_tree`.

Two ways to draft a tree (``grow_tree``):
  * deterministic (default, and always at T = 0): the EAGLE-2 beam (``Drafter.grow_tree``: top-k per level,
    best ``total_token`` by cumulative log-prob) over this model's log-probabilities;
  * sampled (``sample=True`` with a temperature > 0): ``top_k`` i.i.d. draws from the model's distribution
    q at the root, each extended as a chain of further draws, ``min(depth + 1, (total_token - 1) // top_k)``
    tokens long (a fixed shape, independent of the drawn values). Every draw is recorded as a proposal
    ``(child, q)`` in draw order (``DraftTree.proposals``), which ``pipeline.verify.walk_proposals`` verifies
    with SpecInfer's multi-step speculative sampling. ``q`` = softmax(logits / temperature). The chains are
    :meth:`draft.drafter.BeamTreeDrafter.sampled_tree`, shared with the EAGLE head's sampled trees.

Shipped students share the target's vocabulary (``"shares_target_vocab": true`` in their ``config.json``): their
``model.safetensors`` holds the decoder layers and final norm only, and :func:`load_small_lm` takes the
embedding and ``lm_head`` from rank 0's stage, which holds the target's (no copy, no extra memory). That keeps
a 4-layer SmolLM2 student at 28 MB (float16) instead of 85 MB.

The "hidden" state returned to modes is the model's next-token log-probability vector (float64, target
vocabulary size), so ``logprobs`` is the identity, as for the oracle drafter.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from draft.drafter import BeamTreeDrafter
from model.devices import HOST
from model.hf_compat import cache_arg, output_cache
from model.meter import hidden_rows

Tensor = torch.Tensor
FLOOR = -1e4


class SmallLMError(ValueError):
    """A small draft LM directory that cannot be used with this target (one line, for the user)."""


SHARED_VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


def load_small_lm(path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", vocab_model=None):
    """A small causal LM from a Hugging Face directory. A student saved with ``"shares_target_vocab": true``
    (``python -m draft.train_ssm --shared-vocab``) has no embedding or ``lm_head`` of its own: they are taken from
    ``vocab_model`` (rank 0's stage: ``embed_tokens`` and ``lm_head`` of the target), shared, not copied.

    Invariant: the returned model computes exactly what the full student that ``train_ssm`` trained computes,
    since training froze the embedding and ``lm_head`` at the target's values."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = Path(path)
    cfg = AutoConfig.from_pretrained(path)
    if not getattr(cfg, "shares_target_vocab", False):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if vocab_model is None or getattr(vocab_model, "embed_tokens", None) is None or vocab_model.lm_head is None:
        raise SmallLMError(f"{path}: this small LM shares its target's embedding and lm_head; load it on rank 0 "
                           "of that target (draft.sources=ssm:<dir> or sps.draft_dir=<dir>)")
    emb, head = vocab_model.embed_tokens.weight, vocab_model.lm_head.weight
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size) or tuple(head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise SmallLMError(f"{path}: its vocabulary x hidden size {cfg.vocab_size} x {cfg.hidden_size} does not fit "
                           f"the target's embedding {tuple(emb.shape)} (a student of another target?)")
    from safetensors.torch import load_file
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    absent = sorted(set(missing) - set(SHARED_VOCAB_KEYS))
    if unexpected or absent:
        raise SmallLMError(f"{path}: weights do not fit its config (missing {absent[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})")
    model = model.to(device=device, dtype=dtype)
    model.model.embed_tokens.weight = torch.nn.Parameter(emb.detach().to(device, dtype), requires_grad=False)
    model.lm_head.weight = torch.nn.Parameter(head.detach().to(device, dtype), requires_grad=False)
    return model.eval()


def ship_student(model, out_dir, dtype: torch.dtype = torch.float16) -> None:
    """Write ``model`` (a student trained with frozen target embedding / ``lm_head``) in the shared-vocabulary
    layout :func:`load_small_lm` reads: ``config.json`` with ``shares_target_vocab``, layers and norm only."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.update(shares_target_vocab=True, torch_dtype=str(dtype).removeprefix("torch."))
    cfg.pop("dtype", None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k not in SHARED_VOCAB_KEYS}
    save_file(state, str(out_dir / "model.safetensors"))


class SmallLMDrafter(BeamTreeDrafter):
    """See the module docstring. ``model``: a loaded causal LM or a directory to load one from."""

    supports_extend = False  # its trees may carry sampled draws: ContinuousMode redraws from the root
    sample_distinct = False  # SpecInfer's i.i.d. chains (they may join)

    def __init__(self, model, vocab_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", sample: bool = False, temperature: float = 1.0,
                 seed: int = 0, vocab_model=None, follow: bool = True) -> None:
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            model = load_small_lm(model, dtype, device, vocab_model)
        self.model = model
        self.cache_arg = cache_arg(type(model))   # the release's name of the KV-cache argument
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        # i.i.d. chains; tests swap in ``draw``
        self.set_sampling(sample, temperature, seed, distinct=False, follow=follow)
        self.cache = None
        self.ctx_len = 0
        self.tree_paths: list[list[int]] = []   # per tree entry: its tokens below the context

    # -- context ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        from transformers import DynamicCache
        self.cache = DynamicCache()
        self.ctx_len = 0
        self.tree_paths = []

    def _logprobs_of(self, logits: Tensor) -> Tensor:
        lp = torch.log_softmax(logits.double(), dim=-1).to(HOST)
        v = lp.shape[-1]
        if v == self.vocab_size:
            return lp
        if v > self.vocab_size:
            return lp[..., :self.vocab_size]
        pad = torch.empty((*lp.shape[:-1], self.vocab_size - v), dtype=lp.dtype, device=HOST).fill_(FLOOR)
        return torch.cat([lp, pad], dim=-1)

    @torch.no_grad()
    def _feed(self, tokens: list[int]) -> Tensor:
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(self.ctx_len, self.ctx_len + len(tokens), device=self.device)[None]
        with self.meter.op("ssm_forward", len(tokens), self.ctx_len):
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self.cache_arg: self.cache},
                             logits_to_keep=1)   # only the last position's logits are read (the vocabulary is large)
        self.cache = output_cache(out)
        self.ctx_len += len(tokens)
        return self._logprobs_of(out.logits[0, -1])

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor, sampling=None) -> Tensor:
        self.reset()
        self.take_sampling(sampling)    # the generation's T and seed (draft.protocol.DraftSampling)
        self.reseed()
        return self._feed(list(prompt_ids) + [first_token])

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        self.drop_tree()
        return self._feed([int(t) for t in tokens.reshape(-1)])

    # -- tree entries -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _paths_logprobs(self, paths: list[list[int]]) -> Tensor:
        """Log-probs after context + each path (paths of equal length run as one batch on a cache copy)."""
        out: list[Tensor | None] = [None] * len(paths)
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(paths):
            by_len.setdefault(len(p), []).append(i)
        for n, idx in by_len.items():
            ids = torch.tensor([paths[i] for i in idx], device=self.device)
            pos = torch.arange(self.ctx_len, self.ctx_len + n, device=self.device)[None].expand(len(idx), -1)
            with self.meter.op("ssm_forward", len(idx) * n, self.ctx_len):
                cache = copy.deepcopy(self.cache)
                if len(idx) > 1:
                    cache.batch_repeat_interleave(len(idx))
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self.cache_arg: cache},
                                    logits_to_keep=1).logits
            lp = self._logprobs_of(logits[:, -1])
            for j, i in enumerate(idx):
                out[i] = lp[j]
        return torch.stack(out)  # type: ignore[arg-type]

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        new = []
        for t, p in zip(tokens.reshape(-1).tolist(), parents.reshape(-1).tolist()):
            new.append((self.tree_paths[p] if p >= 0 else []) + [int(t)])
            self.tree_paths.append(new[-1])
        return self._paths_logprobs(new)

    def drop_tree(self) -> None:
        self.tree_paths = []

    @property
    def tree_size(self) -> int:
        return len(self.tree_paths)

    def logprobs(self, hidden: Tensor) -> Tensor:
        with self.meter.op("lm_head", hidden_rows(hidden)):
            return hidden.double()

