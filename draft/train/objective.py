"""The EAGLE-1/2 objective: the head's cache-free forward, teacher-forcing entries, the loss, one optimizer step,
and held-out evaluation (also used by online learning, :mod:`draft.osd`).

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
    feats = batch["features"]
    if noise_std > 0:
        u = torch.rand(feats.shape, generator=generator, device=feats.device, dtype=torch.float32)
        feats = feats + ((u - 0.5) * noise_std).to(feats.dtype)
    pred = head_forward(head, batch["tokens"], feats, batch.get("position_ids"), batch.get("attn_mask"))
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


def train_step(head: EagleHead, batch: dict, optimizer: torch.optim.Optimizer, lm_head: nn.Module, *,
               p_weight: float = 0.1, v_weight: float = 1.0, noise_std: float = 0.2, grad_clip: float = 0.5,
               scheduler=None, amp_dtype: torch.dtype | None = None,
               generator: torch.Generator | None = None) -> dict:
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
    """
    head.train()
    dev = batch["tokens"].device
    ctx = torch.autocast(device_type=dev.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    with ctx:
        out = eagle_loss(head, lm_head, batch, p_weight, v_weight, noise_std, generator)
    optimizer.zero_grad(set_to_none=True)
    out["loss"].backward()
    params = [p for p in head.parameters() if p.requires_grad]
    gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip and grad_clip > 0 else torch.zeros(())
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return {"loss": float(out["loss"].detach()), "vloss": float(out["vloss"]), "ploss": float(out["ploss"]),
            "top1": float(out["top1"]), "grad_norm": float(gnorm), "n": out["n"]}


def step2_batch(tokens: Tensor, pred: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Inputs that check the head's second drafting step under teacher forcing.

    Rows ``[context entries e_0..e_{N-1}; draft entries d_0..d_{N-1}]`` where ``d_t`` pairs ``token[t+1]``
    with the head's *own* prediction ``pred[t-1]`` of ``f_t`` and sees ``e_0..e_{t-1}`` and itself (as a
    tree node does at inference). Returns ``(tokens2, positions, attn_mask, d_features)``.
    """
    b, n = tokens.shape
    dev = tokens.device
    i = torch.arange(n, device=dev)
    causal = i[:, None] >= i[None, :]
    strict = i[:, None] > i[None, :]
    top = torch.cat([causal, torch.zeros(n, n, dtype=torch.bool, device=dev)], 1)
    bottom = torch.cat([strict, torch.eye(n, dtype=torch.bool, device=dev)], 1)
    mask = torch.cat([top, bottom], 0)[None, None].expand(b, 1, 2 * n, 2 * n)
    pos = torch.cat([i, i])[None].expand(b, 2 * n)
    dfeat = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], 1)
    return torch.cat([tokens, tokens], 1), pos, mask, dfeat


@torch.no_grad()
def evaluate(head: EagleHead, lm_head: nn.Module, batches, amp_dtype=None, step2: bool = True) -> dict:
    """Held-out agreement of ``argmax lm_head(pred)`` with the target's next token (teacher forcing).

    ``top1``/``top5``: the target's greedy next token is the head's top-1 / in its top-5; ``top1_data``:
    against the token actually in the conversation; ``top1_step2``: the second draft step, fed with
    the head's own predicted feature (see :func:`step2_batch`).
    """
    head.eval()
    tot = {"n": 0.0, "top1": 0.0, "top5": 0.0, "top1_data": 0.0, "n_data": 0.0, "top1_step2": 0.0, "n2": 0.0,
           "vloss": 0.0, "ploss": 0.0}
    for batch in batches:
        dev = batch["tokens"].device
        ctx = torch.autocast(device_type=dev.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
        with ctx:
            pred = head_forward(head, batch["tokens"], batch["features"])
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
            if step2:
                n = batch["tokens"].shape[1]
                toks2, pos2, mask2, dfeat = step2_batch(batch["tokens"], pred.to(batch["features"].dtype))
                feats2 = torch.cat([batch["features"], dfeat], 1)
                pred2 = head_forward(head, toks2, feats2, pos2, mask2)[:, n:]
                w2 = w.clone()
                w2[:, 0] = False
                l2 = lm_head(pred2[w2]).float()
                t2 = lm_head(batch["target_features"][w2]).float().argmax(-1)
                tot["top1_step2"] += float((l2.argmax(-1) == t2).sum())
                tot["n2"] += float(w2.sum())
    n = max(tot["n"], 1e-6)
    return {"top1": tot["top1"] / n, "top5": tot["top5"] / n, "top1_data": tot["top1_data"] / max(tot["n_data"], 1),
            "top1_step2": tot["top1_step2"] / max(tot["n2"], 1) if step2 else None,
            "vloss": tot["vloss"] / n, "ploss": tot["ploss"] / n, "tokens": int(tot["n"])}
