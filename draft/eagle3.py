"""EAGLE-3 draft head: fused low/mid/high target features, one "mid layer", own norm + (reduced) lm_head.

Checkpoint layout (as published by EAGLE-3 / SpecForge): ``config.json`` (Llama-style, ``num_hidden_layers
= 1``, ``draft_vocab_size``, optional ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``)
plus ``model.safetensors`` (or ``pytorch_model.bin``) with::

    fc.weight                          [H, 3 * Ht]   fused target features -> head width (no bias)
    midlayer.hidden_norm.weight        [H]           RMSNorm of the feature half
    midlayer.input_layernorm.weight    [H]           RMSNorm of the embedding half
    midlayer.self_attn.{q,k,v}_proj    [*, 2H]       attention over concat(norm(embed), norm(feature))
    midlayer.self_attn.o_proj          [H, *]
    midlayer.post_attention_layernorm  [H]
    midlayer.mlp.{gate,up,down}_proj
    norm.weight                        [H]
    lm_head.weight                     [Vd, H]       the draft vocabulary (Vd = draft_vocab_size)
    d2t                                [Vd] int64    target id = draft id + d2t[draft id]
    t2d                                [V]  bool     target ids inside the draft vocabulary
    embed_tokens.weight                optional      (the target's embedding when absent)

``d2t``/``t2d`` may be absent only when ``draft_vocab_size == vocab_size`` (identity map).

Tapped layers ("aux" layers): the head consumes the *outputs* of three target decoder layers, concatenated in
layer order (``[n, 3 * Ht]``). ``eagle_aux_hidden_state_layer_ids`` lists them (0-based decoder layer indices);
when absent the EAGLE-3 reference choice is used: the *inputs* of layers ``2, L//2, L-3``, i.e. the outputs of
layers ``1, L//2 - 1, L - 4`` (:func:`default_aux_layers`).

In the pipeline those layers live on different stages; each stage appends the outputs of the tapped layers it
holds as extra columns of the rows it sends on (``model/stage_model.py``), so rank 0 receives ``[n, Ht * (1 + 3)]``
rows: the final normalized hidden state (``lm_head``'s input) then the three taps. :meth:`Eagle3Head.forward`
accepts those wide rows, the fused ``[n, 3 * Ht]`` features, or its own ``[n, H]`` outputs (tree nodes).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from draft.head_io import (HeadError, assign_weights, head_config_from_target, init_head_weights, is_eagle3_config,
                           read_head_config, read_head_weights, write_head)
from model.hf_compat import cache_arg
from model.kv_cache import KVCache
from model.layers import family_classes
from model.light import hf_config
from model.meter import NULL_METER, OpMeter, cache_length

Tensor = torch.Tensor
NUM_AUX = 3


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's reference taps as decoder-layer *outputs*: the inputs of layers 2, L//2 and L-3."""
    if num_layers < 7:
        raise HeadError(f"the default EAGLE-3 taps need a target with at least 7 decoder layers (it has "
                        f"{num_layers}); name the layers in eagle_config.eagle_aux_hidden_state_layer_ids")
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layers_of(cfg_dict: dict, num_layers: int) -> list[int]:
    """The tapped layer outputs a head config names (or the EAGLE-3 default), validated against the target."""
    ec = cfg_dict.get("eagle_config") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
    layers = [int(i) for i in ids] if ids else default_aux_layers(num_layers)
    if len(layers) != NUM_AUX or sorted(set(layers)) != layers or not all(0 <= i < num_layers for i in layers):
        raise HeadError(f"EAGLE-3 aux layers {layers} must be {NUM_AUX} increasing layer indices in "
                        f"[0, {num_layers})")
    return layers


class Eagle3MidLayer(nn.Module):
    """The head's one decoder layer: attention over ``concat(input_layernorm(embed), hidden_norm(h))`` (2H)."""

    def __init__(self, config) -> None:
        super().__init__()
        layer_cls, _, norm_cls = family_classes(config)
        h = config.hidden_size
        proto = layer_cls(config, layer_idx=0)     # the family's attention/MLP, widened below
        attn = proto.self_attn
        bias = getattr(config, "attention_bias", False)
        attn.q_proj = nn.Linear(2 * h, attn.q_proj.out_features, bias=bias)
        attn.k_proj = nn.Linear(2 * h, attn.k_proj.out_features, bias=bias)
        attn.v_proj = nn.Linear(2 * h, attn.v_proj.out_features, bias=bias)
        self.self_attn, self.mlp = attn, proto.mlp
        self.cache_arg = cache_arg(type(attn))
        self.hidden_norm = norm_cls(h, eps=config.rms_norm_eps)
        self.input_layernorm = norm_cls(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(h, eps=config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))   # some SpecForge heads

    def forward(self, emb: Tensor, hidden: Tensor, pos_emb, mask: Tensor, cache) -> Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        out = self.self_attn(hidden_states=x, position_embeddings=pos_emb, attention_mask=mask,
                             **{self.cache_arg: cache})
        hidden = residual + (out[0] if isinstance(out, tuple) else out)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """EAGLE-3 head. ``forward`` has :class:`draft.eagle.EagleHead`'s signature (so :class:`draft.drafter.Drafter`
    drives both); :meth:`draft_logits` gives logits over the draft vocabulary, :attr:`vocab_map` maps them to
    target ids (``None`` when the draft vocabulary is the target's)."""

    meter: OpMeter = NULL_METER   # instrumentation sees each forward as a draft_forward op (model.meter)

    def __init__(self, config, target_hidden: int, aux_layers: list[int], vocab_map: Tensor | None,
                 target_vocab: int) -> None:
        super().__init__()
        config = hf_config(config)      # its mid layer drives transformers' attention module (model.light)
        h = config.hidden_size
        self.config = config
        self.aux_layers = list(aux_layers)
        self.target_hidden = target_hidden
        self.target_vocab = target_vocab
        self.draft_vocab = config.draft_vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(NUM_AUX * target_hidden, h, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        _, rotary_cls, norm_cls = family_classes(config)
        self.norm = norm_cls(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)
        self.rotary_emb = rotary_cls(config=config)
        if vocab_map is not None:
            check_vocab_map(vocab_map, target_vocab, self.draft_vocab)
        self.register_buffer("vocab_map", vocab_map, persistent=False)   # [Vd] target ids, or None
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads

    def new_cache(self, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(1, self.num_kv_heads, self.head_dim, max_len, dtype, device)

    def fuse(self, features: Tensor) -> Tensor:
        """Input feature of an entry: ``fc`` of the three taps (wide pipeline rows or ``[.., 3Ht]``), or the
        head's own ``[.., H]`` output (tree nodes) as is."""
        w, ht, h = features.shape[-1], self.target_hidden, self.config.hidden_size
        if w == ht * (1 + NUM_AUX):
            return self.fc(features[..., ht:])
        if w == NUM_AUX * ht:
            return self.fc(features)
        if w == h:
            return features
        raise HeadError(f"EAGLE-3 head got features of width {w}: expected {ht * (1 + NUM_AUX)} (pipeline rows "
                        f"with layers {self.aux_layers} tapped), {NUM_AUX * ht} (fused) or {h} (its own output); "
                        f"are the stages forwarding the tapped layers (model.eagle3_taps)?")

    def forward(self, tokens: Tensor, features: Tensor, positions: Tensor, mask: Tensor, cache) -> Tensor:
        """``tokens [B, n]`` paired with the feature of the *previous* position (see :meth:`fuse`); returns the
        mid layer's output ``[B, n, H]`` (pre-norm: the next entry's feature). Metered as a ``draft_forward`` op
        (:mod:`model.meter`)."""
        with self.meter.op("draft_forward", int(tokens.shape[-1]), cache_length(cache)):
            hidden = self.fuse(features)
            emb = self.embed_tokens(tokens).to(hidden.dtype)
            positions = positions.to(hidden.device)
            if mask is not None:
                mask = mask.to(device=hidden.device, dtype=hidden.dtype)
            pos_emb = self.rotary_emb(hidden, positions)
            return self.midlayer(emb, hidden, pos_emb, mask, cache)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary ``[.., Vd]``."""
        return self.lm_head(self.norm(hidden))

    # -- checkpoint I/O (EAGLE-3 layout) -------------------------------------------------------------
    def eagle3_state_dict(self) -> dict[str, Tensor]:
        out = {k: v.detach().contiguous() for k, v in self.state_dict().items()
               if not k.startswith(("rotary_emb", "embed_tokens"))}
        vm = self.vocab_map if self.vocab_map is not None else torch.arange(self.draft_vocab)
        vm = vm.cpu().long()
        out["d2t"] = vm - torch.arange(self.draft_vocab)
        t2d = torch.zeros(self.target_vocab, dtype=torch.bool)
        t2d[vm] = True
        out["t2d"] = t2d
        return out


def check_vocab_map(vocab_map: Tensor, target_vocab: int, draft_vocab: int) -> None:
    """``vocab_map``: ``[Vd]`` distinct target ids in ``[0, V)`` (strictly increasing, as EAGLE-3 builds it)."""
    if vocab_map.shape != (draft_vocab,):
        raise HeadError(f"EAGLE-3 d2t has {tuple(vocab_map.shape)} entries, draft_vocab_size is {draft_vocab}")
    if draft_vocab and (int(vocab_map.min()) < 0 or int(vocab_map.max()) >= target_vocab):
        raise HeadError(f"EAGLE-3 d2t maps outside the target vocabulary [0, {target_vocab})")
    if draft_vocab > 1 and not bool((vocab_map[1:] > vocab_map[:-1]).all()):
        raise HeadError("EAGLE-3 d2t does not map draft ids to distinct increasing target ids")


def eagle3_config_from_target(target_config, draft_vocab: int, aux_layers: list[int]):
    cfg = head_config_from_target(target_config, bias=False)
    cfg.draft_vocab_size = int(draft_vocab)
    cfg.target_hidden_size = target_config.hidden_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    cfg.tie_word_embeddings = False
    return cfg


def vocab_from_ids(token_ids: Tensor | list[int], target_vocab: int, size: int) -> Tensor:
    """The ``size`` most frequent target ids of ``token_ids`` (ties: smaller id), topped up with the smallest unseen
    ids when fewer distinct ids occur; returned sorted (the ``vocab_map`` EAGLE-3's ``d2t`` encodes)."""
    if not 0 < size <= target_vocab:
        raise HeadError(f"draft vocabulary size {size} must be in [1, {target_vocab}]")
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    counts = torch.bincount(ids, minlength=target_vocab).double()
    counts -= torch.arange(target_vocab, dtype=torch.float64) / (2.0 * target_vocab)   # ties -> smaller id
    return torch.sort(torch.topk(counts, size).indices).values


def init_eagle3_head(target_config, seed: int = 0, aux_layers: list[int] | None = None,
                     vocab_map: Tensor | None = None) -> Eagle3Head:
    """A randomly initialised EAGLE-3 head (optionally with a reduced vocabulary ``vocab_map``)."""
    layers = aux_layers or default_aux_layers(target_config.num_hidden_layers)
    vd = target_config.vocab_size if vocab_map is None else int(vocab_map.numel())
    cfg = eagle3_config_from_target(target_config, vd, layers)
    head = Eagle3Head(cfg, target_config.hidden_size, layers, vocab_map, target_config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    return init_head_weights(head, getattr(target_config, "initializer_range", 0.02), g)


def save_eagle3_head(head: Eagle3Head, out_dir: str | Path, extra_config: dict | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    cfg = head.config.to_dict()
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=head.draft_vocab,
               target_hidden_size=head.target_hidden,
               eagle_config={"eagle_aux_hidden_state_layer_ids": head.aux_layers})
    return write_head(out_dir, cfg, head.eagle3_state_dict(), extra_config, dtype)


def load_eagle3_head(head_dir: str | Path, target_config, target_embed: Tensor | None = None,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> Eagle3Head:
    """Load a published EAGLE-3 head and check it fits the target; any mismatch is one :class:`HeadError`."""
    head_dir = Path(head_dir)
    raw = read_head_config(head_dir)
    if raw is None:
        raise HeadError(f"draft head directory {head_dir} has no readable config.json")
    try:
        from transformers import AutoConfig    # here: the decode path imports no transformers (model/light.py)
        cfg = AutoConfig.from_pretrained(head_dir)
    except Exception as e:
        raise HeadError(f"cannot read {head_dir / 'config.json'}: {e}") from None
    L, V, Ht = target_config.num_hidden_layers, target_config.vocab_size, target_config.hidden_size
    th = int(raw.get("target_hidden_size") or cfg.hidden_size)
    if th != Ht:
        raise HeadError(f"EAGLE-3 head {head_dir} expects target hidden size {th} but the target has {Ht}: "
                        "it was trained for another model")
    if cfg.vocab_size != V:
        raise HeadError(f"EAGLE-3 head {head_dir} has vocab_size {cfg.vocab_size} but the target has {V}: "
                        "it was trained for another model")
    if getattr(cfg, "num_hidden_layers", 1) != 1:
        raise HeadError(f"{head_dir}: only one-layer EAGLE-3 heads are supported")
    vd = int(raw.get("draft_vocab_size") or V)
    cfg.draft_vocab_size = vd
    layers = aux_layers_of(raw, L)
    state = read_head_weights(head_dir)
    if vd != V and "d2t" not in state:
        raise HeadError(f"EAGLE-3 head {head_dir} has a reduced vocabulary ({vd} of {V}) but no d2t map")
    vocab_map = None
    if "d2t" in state:
        d2t = state.pop("d2t").long()
        if d2t.shape != (vd,):
            raise HeadError(f"EAGLE-3 head {head_dir}: d2t has shape {tuple(d2t.shape)}, expected ({vd},)")
        vocab_map = d2t + torch.arange(vd)
        if "t2d" in state:
            t2d = state.pop("t2d").bool()
            if t2d.shape != (V,) or int(t2d.sum()) != vd or (vd and not bool(t2d[vocab_map.clamp(0, V - 1)].all())):
                raise HeadError(f"EAGLE-3 head {head_dir}: t2d does not agree with d2t")
        if vd == V and bool((vocab_map == torch.arange(V)).all()):
            vocab_map = None
    state.pop("t2d", None)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    cfg._attn_implementation = "sdpa"
    try:
        with torch.device("meta"):       # no random weights materialised: the file's tensors become the parameters
            head = Eagle3Head(cfg, Ht, layers, vocab_map, V)
    except (ValueError, TypeError, AttributeError) as e:
        raise HeadError(f"EAGLE-3 head {head_dir}: unusable config: {e}") from None
    if "embed_tokens.weight" not in state:
        if target_embed is None:
            raise HeadError(f"{head_dir} has no embed_tokens and no target embedding was given")
        state["embed_tokens.weight"] = target_embed
    own = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary_emb")}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise HeadError(f"draft head {head_dir} does not have the EAGLE-3 layout: missing {missing[:4]}, "
                        f"unexpected {unexpected[:4]}")
    bad = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in own.items() if state[k].shape != v.shape]
    if bad:
        raise HeadError(f"EAGLE-3 head {head_dir} does not fit the target: {bad[0]}")
    assign_weights(head, state, dtype, ["rotary_emb"], cfg, head_dir)
    return head.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------------------------------------
# Which layers the stages tap (every rank computes the same list from the run config)
# ---------------------------------------------------------------------------------------------------

def stage_taps(setting: str, head_dir: Path | None, num_layers: int) -> list[int]:
    """Layer outputs the layer stages forward to rank 0 (``model.eagle3_taps``).

    ``auto`` (default): the aux layers of ``head_dir`` when it is an EAGLE-3 head readable on this rank, else none;
    ``none``: never; ``"1,14,26"``: those layers. Without an EAGLE-3 head nothing is tapped: no extra bytes.
    """
    s = (setting or "auto").strip().lower()
    if s == "none":
        return []
    if s == "auto":
        if head_dir is None or ":" in str(head_dir):
            return []
        raw = read_head_config(head_dir)
        return aux_layers_of(raw, num_layers) if is_eagle3_config(raw) else []
    try:
        layers = [int(p) for p in s.split(",") if p.strip()]
    except ValueError:
        raise HeadError(f"model.eagle3_taps={setting!r}: expected auto, none or layer indices like 1,14,26") from None
    if sorted(set(layers)) != layers or not all(0 <= i < num_layers for i in layers):
        raise HeadError(f"model.eagle3_taps={setting!r}: layers must be increasing indices in [0, {num_layers})")
    return layers
