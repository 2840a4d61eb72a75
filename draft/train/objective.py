"""The EAGLE-1/2 objective: the head's cache-free forward, teacher-forcing entries, the loss, one optimizer step,
and held-out evaluation (also used by online learning, :mod:`draft.osd`); and its training-time-test variant
(:func:`unrolled_loss`: the head unrolled on its own predicted features through a :class:`StepCache`).

Conventions (as :mod:`draft.drafter` at inference): the target's *feature* ``f_t`` is its final normalized hidden
state at position ``t``. Head entry ``t`` pairs ``token[t+1]`` with ``f_t`` at position ``t``; its output predicts
``f_{t+1}`` and ``lm_head`` of it predicts ``token[t+2]``.

Invariants: :func:`head_forward` with default positions and causal attention equals the drafter's incremental
cached forward (``tests/test_train_eagle.py``); the losses average over the weighted entries only (padding has
weight 0); :func:`train_step` updates only the parameters its optimizer holds (the trainers give it the head's
trainable ones: ``lm_head`` and the head's embedding stay frozen); :func:`evaluate` runs without gradients and leaves the head in eval mode.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from draft.eagle import EagleHead

Tensor = torch.Tensor


def head_forward(head: EagleHead, tokens: Tensor, features: Tensor, position_ids: Tensor | None = None,
                 attn_mask: Tensor | None = None) -> Tensor:
    """Cache-free forward of the head over entries ``(tokens[b, i], features[b, i])``.

    Defaults: entry ``i`` at position ``i`` with causal attention (as in :meth:`Drafter.commit`).
    ``attn_mask`` (bool ``[B, 1, N, N]``, True = may attend) and ``position_ids`` ``[B, N]`` allow other
    shapes, e.g. flattened draft trees.
    """
    b, n = tokens.shape
    x = head.fc(torch.cat([head.embed_tokens(tokens).to(features.dtype), features], dim=-1))
    if position_ids is None:
        position_ids = torch.arange(n, device=tokens.device).unsqueeze(0).expand(b, n)
    pos_emb = head.block.rotary_emb(x, position_ids)
    for layer in head.block.layers:
        out = layer(x, attention_mask=attn_mask, position_ids=position_ids, use_cache=False,
                    position_embeddings=pos_emb)
        x = out[0] if isinstance(out, tuple) else out
    return x


def sequence_batch(input_ids: Tensor, features: Tensor, loss_mask: Tensor) -> dict:
    """Teacher-forcing entries of whole sequences ``[B, L]``: entry ``t`` = ``(token[t+1], f_t)`` predicts
    ``f_{t+1}`` (``target_features``) and the target's distribution at ``t+1``; weighted by ``loss_mask[t+1]``."""
    return {"tokens": input_ids[:, 1:], "features": features[:, :-1], "target_features": features[:, 1:],
            "loss_mask": loss_mask[:, 1:], "next_tokens": F.pad(input_ids[:, 2:], (0, 1), value=-100)}


def eagle_loss(head: EagleHead, lm_head: nn.Module, batch: dict, p_weight: float = 0.1, v_weight: float = 1.0,
               noise_std: float = 0.0, generator: torch.Generator | None = None) -> dict:
    """EAGLE objective on one batch of entries (see :func:`train_step` for the batch keys).

    ``v_weight * SmoothL1(pred, target_features) + p_weight * CE(lm_head(pred), teacher)``, averaged over
    the weighted entries; the teacher is ``softmax(target_logits)``, else ``softmax(lm_head(target_features))``,
    else the hard ``labels``. Uniform noise ``U(-noise_std/2, noise_std/2)`` is added to the input features.
    """
    feats = noisy_features(batch["features"], noise_std, generator)
    pred = head_forward(head, batch["tokens"], feats, batch.get("position_ids"), batch.get("attn_mask"))
    return prediction_loss(pred, lm_head, batch, p_weight, v_weight)


def noisy_features(feats: Tensor, noise_std: float, generator: torch.Generator | None) -> Tensor:
    """``feats + U(-noise_std/2, noise_std/2)`` (EAGLE's input-feature noise); ``feats`` itself when 0."""
    if noise_std <= 0:
        return feats
    u = torch.rand(feats.shape, generator=generator, device=feats.device, dtype=torch.float32)
    return feats + ((u - 0.5) * noise_std).to(feats.dtype)


def prediction_loss(pred: Tensor, lm_head: nn.Module, batch: dict, p_weight: float, v_weight: float) -> dict:
    """The loss terms of the head's predictions ``pred [B, N, H]`` against the teacher in ``batch``
    (``loss_mask`` and one of ``target_logits`` / ``target_features`` / ``labels``, see :func:`eagle_loss`)."""
    w = batch["loss_mask"].to(pred.device).float()
    sel = w > 0
    ws = w[sel]
    denom = ws.sum().clamp_min(1e-6)
    p = pred[sel]
    zero = pred.sum() * 0.0
    tf = batch.get("target_features")
    if tf is not None and v_weight:
        vl = F.smooth_l1_loss(p.float(), tf[sel].float(), reduction="none").mean(-1)
        vloss = (vl * ws).sum() / denom
    else:
        vloss = zero
    logits = lm_head(p.to(lm_head.weight.dtype) if not torch.is_autocast_enabled() else p).float()
    logp = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        if batch.get("target_logits") is not None:
            tl = batch["target_logits"][sel].float()
        elif tf is not None:
            tl = lm_head(tf[sel].to(lm_head.weight.dtype) if not torch.is_autocast_enabled() else tf[sel]).float()
        else:
            tl = None
    if tl is not None:
        ploss_each = -(torch.softmax(tl, dim=-1) * logp).sum(-1)
        teacher = tl.argmax(-1)
    else:
        labels = batch["labels"][sel]
        ploss_each = F.cross_entropy(logits, labels.clamp_min(0), reduction="none")
        teacher = labels
    ploss = (ploss_each * ws).sum() / denom
    loss = v_weight * vloss + p_weight * ploss
    with torch.no_grad():
        valid = (teacher >= 0).float() * ws
        top1 = ((logits.argmax(-1) == teacher).float() * valid).sum() / valid.sum().clamp_min(1e-6)
    return {"loss": loss, "vloss": vloss.detach(), "ploss": ploss.detach(), "top1": top1, "n": float(ws.sum())}


class StepCache:
    """transformers' Cache protocol for one layer without preallocation: keys/values of every unrolled step are
    concatenated (gradients flow through them). Used by the training-time test of both head kinds."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.k = key if self.k is None else torch.cat([self.k, key], dim=-2)
        self.v = value if self.v is None else torch.cat([self.v, value], dim=-2)
        return self.k, self.v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.k is None else self.k.shape[-2]


def ttt_mask(n: int, step: int, dtype: torch.dtype, device) -> Tensor:
    """Additive mask ``[1, 1, n, (step + 1) * n]`` of unrolled step ``step``: causal over step 0, diagonal over
    steps ``1..step`` (each entry sees its own chain only)."""
    allowed = [torch.ones(n, n, dtype=torch.bool, device=device).tril()]
    allowed += [torch.eye(n, dtype=torch.bool, device=device)] * step
    a = torch.cat(allowed, dim=1)
    m = torch.zeros(a.shape, dtype=dtype, device=device)
    m.masked_fill_(~a, torch.finfo(dtype).min)
    return m[None, None]


def unrolled_forward(head: nn.Module, tokens: Tensor, features: Tensor, steps: int):
    """Yield the head's outputs ``[B, N, H]`` of unrolled steps ``0..steps-1`` over sequence entries
    (:func:`sequence_batch`): step 0 is teacher forcing; step ``j`` entry ``t`` pairs ``tokens[t + j]`` (the token
    ``j`` places further on) with step ``j-1``'s output at ``t`` (the head's own prediction of that token's
    predecessor feature), sits at position ``t + j`` and attends to the step-0 entries ``<= t`` plus its own chain:
    exactly the draft-tree node ``j`` levels below the entry of ``tokens[t]`` (``tests/test_train_eagle.py``).
    Entries past the end (``t + j >= N``) are padding the caller must weight 0. ``head``: an EAGLE-1/2 or EAGLE-3
    head (``forward(tokens, features, positions, mask, cache)``)."""
    b, n = tokens.shape
    cache = StepCache()
    feats = features
    for j in range(min(steps, n)):
        tok = F.pad(tokens[:, j:], (0, j), value=0)
        pos = (torch.arange(n, device=tokens.device) + j)[None].expand(b, n)
        feats = head(tok, feats, pos, ttt_mask(n, j, feats.dtype, tokens.device), cache)
        yield feats


def shifted(x: Tensor, j: int) -> Tensor:
    """``x[:, j:]`` padded with zeros back to ``x``'s length (the step-``j`` view of a per-entry tensor)."""
    if j == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, j]
    return F.pad(x[:, j:], pad)


def unrolled_loss(head: EagleHead, lm_head: nn.Module, batch: dict, steps: int, decay: float = 0.8,
                  p_weight: float = 0.1, v_weight: float = 1.0, noise_std: float = 0.0,
                  generator: torch.Generator | None = None) -> dict:
    """The EAGLE-1/2 objective with a training-time test (HASS, arXiv 2408.15766; EAGLE-3's unrolling).

    Teacher forcing (:func:`eagle_loss`) trains the head only on the target's features, but at inference every
    node below a tree's first level is fed the head's *own* predicted feature. Here the head is unrolled
    ``steps`` times (:func:`unrolled_forward`; gradients flow through the chain) and step ``j`` is trained towards
    the target's feature and distribution ``j`` places further on (``target_features``/``loss_mask`` shifted by
    ``j``), the same loss terms as step 0, weighted ``decay**j``; the total is normalised by the weights.
    ``steps = 1`` is exactly :func:`eagle_loss` on sequence batches. The feature noise goes on the step-0 inputs.
    Returns :func:`eagle_loss`'s keys for step 0 (``loss`` is the weighted total) plus ``step_top1`` per step
    (``None`` where the batch has no entry for that step). Needs sequence batches (:func:`sequence_batch`) with
    ``target_features`` as the only teacher.
    """
    other = [k for k in ("attn_mask", "position_ids", "target_logits", "labels") if batch.get(k) is not None]
    if other or batch.get("target_features") is None:
        raise ValueError("unrolled training needs sequence batches with target_features only"
                         + (f" (got {', '.join(other)})" if other else ""))
    if steps < 1 or decay <= 0:
        raise ValueError(f"unrolled training needs steps >= 1 and decay > 0 (got {steps}, {decay})")
    feats = noisy_features(batch["features"], noise_std, generator)
    total, wsum, outs = 0.0, 0.0, []
    for j, pred in enumerate(unrolled_forward(head, batch["tokens"], feats, steps)):
        sub = {"target_features": shifted(batch["target_features"], j), "loss_mask": shifted(batch["loss_mask"], j)}
        out = prediction_loss(pred, lm_head, sub, p_weight, v_weight)
        total = total + (decay ** j) * out["loss"]
        wsum += decay ** j
        outs.append(out)
    res = dict(outs[0])
    res["loss"] = total / wsum
    # None for a step this batch cannot reach (shorter than the unroll) or that has no weighted entry
    res["step_top1"] = [float(o["top1"]) if o["n"] > 0 else None for o in outs] + [None] * (steps - len(outs))
    return res


def train_step(head: EagleHead, batch: dict, optimizer: torch.optim.Optimizer, lm_head: nn.Module, *,
               p_weight: float = 0.1, v_weight: float = 1.0, noise_std: float = 0.2, grad_clip: float = 0.5,
               scheduler=None, amp_dtype: torch.dtype | None = None,
               generator: torch.Generator | None = None, unroll_steps: int = 1, unroll_decay: float = 0.8,
               anchor: tuple[list[Tensor], float] | None = None) -> dict:
    """One optimizer update of the head on one batch; returns float metrics.

    ``batch`` holds *entries* (the rows the head consumes), all on the head's device:

    - ``tokens`` ``[B, N]`` long: the token of each entry (``token[t+1]`` for a context entry ``t``);
    - ``features`` ``[B, N, H]``: the target feature paired with it (``f_t``: the token's predecessor);
    - ``loss_mask`` ``[B, N]``: entry weights (0 = padding / not trained);
    - teacher, at least one of: ``target_features`` ``[B, N, H]`` (the target's ``f_{t+1}``; gives the
      feature-regression term and, through the frozen ``lm_head``, the soft token targets),
      ``target_logits`` ``[B, N, V]`` (soft targets given directly), ``labels`` ``[B, N]`` (hard tokens);
    - optional ``position_ids`` ``[B, N]`` and ``attn_mask`` bool ``[B, 1, N, N]`` (default: positions
      ``0..N-1``, causal).

    :func:`sequence_batch` makes these from whole conversations (teacher forcing). Online-distillation
    hook (e.g. Online Speculative Decoding): rank 0 can feed verified draft trees straight into this step,
    each tree as one row: ``tokens`` = the tree's tokens, ``features`` = the target feature of each
    node's parent, ``position_ids`` = context length + depth, ``attn_mask`` = ancestor matrix (plus the
    committed context), and ``target_logits`` = the verifier's logits for each node, which rank 0
    already holds, with ``loss_mask`` marking the nodes to learn from.

    ``unroll_steps > 1`` (sequence batches only) trains with the training-time test of :func:`unrolled_loss`
    and adds ``step_top1`` (top-1 agreement per unrolled step) to the metrics.

    ``anchor = (weights, strength)``: after the optimizer's update, :func:`decay_toward` pulls the trainable
    parameters (in :meth:`head.parameters` order) toward ``weights`` at the rate ``lr x strength``, with the
    learning rate this step used.
    """
    head.train()
    dev = batch["tokens"].device
    ctx = torch.autocast(device_type=dev.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    with ctx:
        if unroll_steps > 1:
            out = unrolled_loss(head, lm_head, batch, unroll_steps, unroll_decay, p_weight, v_weight, noise_std,
                                generator)
        else:
            out = eagle_loss(head, lm_head, batch, p_weight, v_weight, noise_std, generator)
    optimizer.zero_grad(set_to_none=True)
    out["loss"].backward()
    params = [p for p in head.parameters() if p.requires_grad]
    gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip and grad_clip > 0 else torch.zeros(())
    optimizer.step()
    if anchor is not None:
        decay_toward(params, anchor[0], optimizer.param_groups[0]["lr"] * anchor[1])
    if scheduler is not None:
        scheduler.step()
    m = {"loss": float(out["loss"].detach()), "vloss": float(out["vloss"]), "ploss": float(out["ploss"]),
         "top1": float(out["top1"]), "grad_norm": float(gnorm), "n": out["n"]}
    if "step_top1" in out:
        m["step_top1"] = out["step_top1"]
    return m


@torch.no_grad()
def decay_toward(params: list[Tensor], anchors: list[Tensor], rate: float) -> None:
    """``p <- p - rate * (p - a)`` for each parameter ``p`` and its anchor ``a``, in place; ``rate`` clipped to
    ``[0, 1]`` (1 puts every weight back on its anchor; more would overshoot it).

    Why: a head fine-tuned on a new kind of data (``train --init-from HEAD --anchor-decay S``) forgets what it was
    good at when the replay of its old kinds is small (docs/results.md §96: translation data won, the six sets
    lost). This is L2-SP's penalty ``S/2 * ||p - a||^2`` toward the starting weights, applied as a decoupled step
    like AdamW's weight decay (which pulls toward 0 instead): a direction the new data keeps pushing stays moved, a
    drift it does not sustain shrinks by ``lr x S`` per step."""
    rate = min(max(rate, 0.0), 1.0)
    if rate == 0.0:
        return
    for p, a in zip(params, anchors, strict=True):
        p.lerp_(a, rate)                  # (torch's lerp is exact at both ends: rate 1 gives ``a`` bitwise)


@torch.no_grad()
def evaluate(head: EagleHead, lm_head: nn.Module, batches, amp_dtype=None, step2: bool = True,
             steps: int = 0) -> dict:
    """Held-out agreement of ``argmax lm_head(pred)`` with the target's next token (teacher forcing).

    ``top1``/``top5``: the target's greedy next token is the head's top-1 / in its top-5; ``top1_data``:
    against the token actually in the conversation; ``top1_step2``: the second draft step, fed with
    the head's own predicted feature; ``top1_steps`` (when ``steps > 0``): top-1 agreement of each of ``steps``
    unrolled steps (step ``j`` = a tree node ``j`` levels deep, fed the head's own features; ``None`` for a step no
    batch reaches). All come from one :func:`unrolled_forward` chain: step 0 is teacher forcing, ``top1_step2`` is
    its step 1 (``tests.helpers.step2_batch`` builds the same inputs: ``tests/test_train_eagle.py``).
    """
    head.eval()
    tot = {"n": 0.0, "top1": 0.0, "top5": 0.0, "top1_data": 0.0, "n_data": 0.0, "vloss": 0.0, "ploss": 0.0}
    k = max(steps, 2 if step2 else 1)   # one unrolled chain gives step 0 (teacher forcing), step 2 and top1_steps
    hits, counts = [0.0] * k, [0.0] * k
    for batch in batches:
        dev = batch["tokens"].device
        ctx = torch.autocast(device_type=dev.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
        with ctx:
            outs = list(unrolled_forward(head, batch["tokens"], batch["features"], k))
            pred = outs[0]
            w = batch["loss_mask"] > 0
            p, tf = pred[w], batch["target_features"][w]
            logits = lm_head(p).float()
            tl = lm_head(tf).float()
            teacher = tl.argmax(-1)
            top5 = logits.topk(5, dim=-1).indices
            tot["top1"] += float((top5[:, 0] == teacher).sum())
            tot["top5"] += float((top5 == teacher[:, None]).any(-1).sum())
            tot["n"] += float(w.sum())
            nxt = batch["next_tokens"][w]
            ok = nxt >= 0
            tot["top1_data"] += float(((top5[:, 0] == nxt) & ok).sum())
            tot["n_data"] += float(ok.sum())
            tot["vloss"] += float(F.smooth_l1_loss(p.float(), tf.float(), reduction="none").mean(-1).sum())
            tot["ploss"] += float(-(torch.softmax(tl, -1) * torch.log_softmax(logits, -1)).sum(-1).sum())
            for j, pj in enumerate(outs):
                wj = shifted(batch["loss_mask"], j) > 0
                tj = lm_head(shifted(batch["target_features"], j)[wj]).float().argmax(-1)
                hits[j] += float((lm_head(pj[wj]).float().argmax(-1) == tj).sum())
                counts[j] += float(wj.sum())
    n = max(tot["n"], 1e-6)
    return {"top1": tot["top1"] / n, "top5": tot["top5"] / n, "top1_data": tot["top1_data"] / max(tot["n_data"], 1),
            "top1_step2": hits[1] / max(counts[1], 1) if step2 else None,
            "vloss": tot["vloss"] / n, "ploss": tot["ploss"] / n, "tokens": int(tot["n"]),
            **({"top1_steps": [h / c if c else None for h, c in zip(hits[:steps], counts[:steps])]} if steps else {})}
