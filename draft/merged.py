"""Several drafters as one (``draft.sources=eagle,lookup,ssm:<dir>``): one merged token tree per call.

:class:`MergedDrafter` has the :class:`draft.protocol.TreeDrafter` methods, so every mode takes merged
trees unchanged:
  * ``start``/``commit`` go to every source; the returned state is the concatenation of the sources' states
    (each flattened, widened to their common dtype, which is exact), split again on the way in;
  * ``grow_tree`` asks every source for its own tree with the same arguments and merges them with
    :func:`draft.tree.merge_sources` under the one ``total_token`` budget (the rule: sampled proposals are
    kept whole, deterministic nodes survive by their best score over the sources, see there). Before the
    merge each source's scores are multiplied by its calibration scale (:func:`scale_scores`; 1 except a small
    LM's: ``draft.ssm_score_scale``, by default the student's own ``merge_score_scale``,
    :func:`student_score_scale`): a weak student's log-probabilities are over-confident next to EAGLE's, and a
    scale > 1 makes its nodes win only where it is sure;
  * ``tree_forward``/``drop_tree``/``logprobs`` (PipeDec grows its layers through them): each source feeds
    the same entries with its own slice of the features; ``logprobs`` of a merged state is the elementwise
    **maximum** of the sources' (scaled) log-scores, the same "best available score" rule as the tree merge.

Sources are built by :func:`build_sources` from the ``draft.sources`` list: ``eagle`` (the drafter that
``model.head_dir`` selects: the EAGLE head, or the oracle/adversary test drafters), ``lookup`` (prompt
lookup, :mod:`draft.lookup`) and ``ssm:<dir>`` (a small causal LM, :mod:`draft.ssm`).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from config.run_config import SourceError, parse_sources
from draft.tree import DraftTree, merge_sources

Tensor = torch.Tensor


class MergedDrafter:
    """See the module docstring. Instrumentation meters the sources, not the merge
    (:func:`draft.protocol.install_meter` reaches every source's model ops)."""

    def __init__(self, sources: list, names: list[str] | None = None,
                 score_scales: list[float] | None = None) -> None:
        if not sources:
            raise SourceError("draft.sources needs at least one source")
        self.sources = list(sources)
        self.names = list(names) if names else [type(s).__name__ for s in sources]
        self.score_scales = list(score_scales) if score_scales else [1.0] * len(self.sources)
        if len(self.score_scales) != len(self.sources) or any(c <= 0 for c in self.score_scales):
            raise SourceError("one positive score scale per source")
        self.widths: list[int] = []

    @staticmethod
    def _cat(states: list[Tensor]) -> Tensor:
        """Concatenate along the last dim in the sources' common dtype (float32 for EAGLE + lookup: a smaller
        vector to allocate per commit than float64; widening is exact either way)."""
        dtype = states[0].dtype
        for s in states[1:]:
            dtype = torch.promote_types(dtype, s.dtype)
        dev = states[0].device
        return torch.cat([s.to(dev, dtype) for s in states], dim=-1)

    def _join(self, states: list[Tensor]) -> Tensor:
        self.widths = [int(s.shape[-1]) for s in states]
        return self._cat(states)

    def _split(self, state: Tensor) -> list[Tensor]:
        return list(torch.split(state, self.widths, dim=-1))

    def reset(self) -> None:
        for s in self.sources:
            s.reset()

    def start(self, prompt_ids: list[int], first_token: int, features: Tensor) -> Tensor:
        return self._join([s.start(prompt_ids, first_token, features) for s in self.sources])

    def commit(self, tokens: Tensor, features: Tensor) -> Tensor:
        return self._join([s.commit(tokens, features) for s in self.sources])

    def grow_tree(self, root_token: int, root_hidden: Tensor, total_token: int, depth: int, top_k: int) -> DraftTree:
        """Every source drafts with the same arguments, except that a sampling source (``samples`` true) gets
        ``1 + (total_token - 1) // len(sources)`` nodes: its draws are all kept by the merge, so it must leave
        room for the others. Then :func:`merge_sources` under ``total_token``."""
        share = 1 + (total_token - 1) // len(self.sources)
        trees = [s.grow_tree(root_token, h, share if getattr(s, "samples", False) else total_token, depth, top_k)
                 for s, h in zip(self.sources, self._split(root_hidden))]
        return merge_sources([scale_scores(t, c) for t, c in zip(trees, self.score_scales)], total_token)

    def tree_forward(self, tokens: Tensor, features: Tensor, parents: Tensor) -> Tensor:
        return self._cat([s.tree_forward(tokens, f, parents) for s, f in zip(self.sources, self._split(features))])

    def drop_tree(self) -> None:
        for s in self.sources:
            s.drop_tree()

    @property
    def tree_size(self) -> int:
        return max(s.tree_size for s in self.sources)

    def logprobs(self, hidden: Tensor) -> Tensor:
        lps = [s.logprobs(h).double() for s, h in zip(self.sources, self._split(hidden))]
        lps = [lp if c == 1.0 else lp * c for lp, c in zip(lps, self.score_scales)]
        dev = lps[0].device
        out = lps[0]
        for lp in lps[1:]:
            out = torch.maximum(out, lp.to(dev))
        return out

    def source(self, kind: type):
        """The first source of class ``kind`` (e.g. the small LM for ``sps``), or None."""
        return next((s for s in self.sources if isinstance(s, kind)), None)


def scale_scores(tree: DraftTree, scale: float) -> DraftTree:
    """``tree`` with every score times ``scale`` > 0: the source's calibration before the merge. Scores are
    log-scores <= 0 that never increase along a path; a positive factor keeps both and the tree's own order, so
    only the competition between sources changes."""
    return tree if scale == 1.0 else replace(tree, scores=tree.scores * scale)


def student_score_scale(path) -> float:
    """A small LM's own merge calibration: ``merge_score_scale`` in its ``config.json`` (written when it was
    calibrated against the EAGLE head on held-out prompts, e.g. ``data/calibration``), else 1."""
    import json
    from pathlib import Path
    try:
        value = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("merge_score_scale", 1.0)
    except (OSError, ValueError):
        return 1.0
    if not isinstance(value, (int, float)) or value <= 0:
        raise SourceError(f"draft.sources: ssm:{path}: merge_score_scale in config.json must be a number > 0")
    return float(value)


def build_sources(cfg, vocab_size: int, eagle_factory, dtype, device, sampling: bool, vocab_model=None):
    """The drafter for ``cfg.draft.sources`` (``eagle_factory()`` builds the ``eagle`` source as
    ``model.head_dir`` says; ``vocab_model``: rank 0's stage, whose embedding and ``lm_head`` shared-vocabulary
    students use). One source is returned as itself (its trees are verified as they are)."""
    import math
    from pathlib import Path

    from draft.lookup import LookupDrafter
    from draft.ssm import SmallLMDrafter, SmallLMError
    d = cfg.draft
    sources, names, scales = [], [], []
    for kind, arg in parse_sources(d.sources):
        if kind == "eagle":
            sources.append(eagle_factory())
        elif kind == "lookup":
            sources.append(LookupDrafter(vocab_size, d.lookup_max_ngram, d.lookup_min_ngram, d.lookup_max_matches,
                                         math.log(d.lookup_token_prob)))
        else:
            if not (Path(arg) / "config.json").is_file():
                raise SourceError(f"draft.sources: ssm:{arg}: no config.json there (a Hugging Face causal LM "
                                  "directory, e.g. one written by python -m draft.train_ssm)")
            temp = cfg.gen.temperature if d.ssm_temperature < 0 else d.ssm_temperature
            try:
                sources.append(SmallLMDrafter(arg, vocab_size, dtype, device, sample=d.ssm_sample and sampling,
                                              temperature=temp, seed=cfg.gen.seed, vocab_model=vocab_model))
            except SmallLMError as e:
                raise SourceError(f"draft.sources: ssm:{arg}: {e}") from None
        names.append(kind if not arg else f"{kind}:{arg}")
        scales.append((d.ssm_score_scale if d.ssm_score_scale > 0 else student_score_scale(arg)) if kind == "ssm"
                      else 1.0)
    if len(sources) == 1:
        return sources[0]
    return MergedDrafter(sources, names, scales)
