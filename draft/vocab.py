"""A reduced draft vocabulary for EAGLE-1/2 heads: draft over the ``N`` target tokens the target emits most often.

Rank 0's drafting cost for a small target is dominated by the draft log-probs: every tree level applies the
target's ``lm_head`` (``V x H``; 49152 x 576 for SmolLM2, 21% of the model) to the frontier. Restricting the
*draft* to the ``N`` most frequent target tokens cuts that to ``N/V`` of the work, as EAGLE-3's ``d2t`` does, for
heads that share the target's ``lm_head`` (EAGLE-1/2) too. With ``model.draft_vocab_context`` (default) the
tokens of the request's own context join them (:class:`DraftVocab`).

Counts: ``token_counts.safetensors`` (key ``counts``: int64 ``[V]``, how often the target emitted each token in
its answers: assistant tokens of self-distilled conversations, ``loss_mask == 1``), kept beside the head
(:data:`COUNTS_FILE`), made by ``python -m draft.vocab count``. The shipped SmolLM2 heads carry theirs, so the
default (``model.draft_vocab=-1``, auto: :func:`resolve_draft_vocab`) drafts over :data:`DEFAULT_DRAFT_VOCAB` ids
with them and over the whole vocabulary for a head without counts, an EAGLE-3 head or a small vocabulary.

Invariants of :func:`top_ids`: it returns ``min(n, V)`` distinct ids in ``[0, V)``, strictly increasing (the
``vocab_map`` layout of :mod:`draft.eagle3`), the ``n`` largest counts with ties broken towards the lower id, so
the same counts always give the same vocabulary. When fewer than ``n`` ids were ever counted, the rest are the
lowest unseen ids: byte-level BPE numbers its tokens in merge order, which roughly follows their frequency in
the tokenizer's own corpus (for SmolLM2, the 16384 lowest ids cover 95% of the counted tokens by themselves).

Exactness: the draft proposes only ids inside the vocabulary and verification never reads the draft's
probabilities for a deterministic tree; a sampled draft has zero mass outside it, where the residual
``max(0, p - q)`` equals ``p`` (docs/eagle3.md, "Draft vocabulary and lossless verification").

Example::

    python -m draft.vocab count --data outputs/vocab_data.jsonl --out draft/heads/SmolLM2-135M-Instruct
    python -m pipeline.run --prompt "Hello" model.draft_vocab=8192
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from config.invocation import prog
from draft.head_io import HeadError

COUNTS_FILE = "token_counts.safetensors"
AUTO = -1                   # ``model.draft_vocab=-1`` (the default): :func:`resolve_draft_vocab`
DEFAULT_DRAFT_VOCAB = 16384  # what AUTO drafts over where it applies (measured: docs/results.md, "The reduced draft
#                              vocabulary by default")


def count_tokens(records, vocab_size: int) -> torch.Tensor:
    """int64 ``[vocab_size]``: how often each id occurs where ``loss_mask`` is 1 (the target's own tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for r in records:
        ids = torch.tensor(r["input_ids"], dtype=torch.int64)
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
        if mask.numel() != ids.numel():
            raise ValueError(f"a record has {ids.numel()} input_ids but {mask.numel()} loss_mask entries")
        ids = ids[mask]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token id out of range for a {vocab_size}-token vocabulary")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def top_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The ``min(n, V)`` most frequent ids (ties: lower id first), sorted increasing (module invariants)."""
    v = counts.numel()
    n = min(int(n), v)
    # stable sort on -counts keeps the id order among equal counts
    order = torch.sort(-counts.to(torch.int64), stable=True).indices[:n]
    return torch.sort(order).values


def coverage(counts: torch.Tensor, n: int) -> float:
    """Share of the counted tokens inside :func:`top_ids` ``(counts, n)``."""
    total = int(counts.sum())
    return float(counts[top_ids(counts, n)].sum()) / total if total else 0.0


def save_counts(path: str | Path, counts: torch.Tensor, meta: dict) -> Path:
    path = Path(path)
    if path.suffix != ".safetensors":     # a (head) directory, existing or not
        path = path / COUNTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"counts": counts.to(torch.int64).contiguous()}, str(path),
              metadata={k: json.dumps(v) for k, v in meta.items()})
    return path


def load_counts(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The counts at ``path`` (a file, or a head directory holding :data:`COUNTS_FILE`); one :class:`HeadError`
    when missing, unreadable or made for another vocabulary size."""
    p = Path(path)
    if p.is_dir():
        p = p / COUNTS_FILE
    if not p.is_file():
        raise HeadError(f"model.draft_vocab needs token counts, and {p} does not exist: make them with "
                        f"python -m draft.vocab count --data <conversations.jsonl> --out {p.parent} "
                        "(or set model.draft_vocab_counts=<file>)")
    try:
        counts = load_file(str(p))["counts"]
    except Exception as e:
        raise HeadError(f"cannot read token counts {p}: {e}") from None
    if counts.dim() != 1 or counts.numel() != vocab_size:
        raise HeadError(f"token counts {p} are for a {counts.numel()}-token vocabulary, the target has {vocab_size}")
    return counts


def draft_vocab_ids(n: int, counts_path: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The run key ``model.draft_vocab=n``: ``None`` for the whole vocabulary (``n == 0`` or ``n >= V``), else the
    ``n`` ids of :func:`top_ids`. A negative ``n`` is one :class:`HeadError`."""
    if n < 0:
        raise HeadError(f"model.draft_vocab must be >= 0 (0 = the whole vocabulary), got {n}")
    if n == 0 or n >= vocab_size:
        return None
    return top_ids(load_counts(counts_path, vocab_size), n)


def resolve_draft_vocab(setting: int, *, counts_found: bool, shares_lm_head: bool, vocab_size: int,
                        static_levels: bool = False) -> int:
    """The ``model.draft_vocab`` a drafter applies: an explicit ``N >= 0`` as given (errors where it cannot apply
    are the caller's: :func:`require_shared_lm_head`, :func:`load_counts`); :data:`AUTO` (the default) is
    :data:`DEFAULT_DRAFT_VOCAB` where it applies (the head shares the target's ``lm_head``, token counts are
    found, and the vocabulary is larger than it), else 0 (the whole vocabulary), silently.

    Why auto and not a plain 16384: the default must not refuse what ran before it, so a head without counts (an
    untrained head, a custom model's head), an EAGLE-3 head (its own vocabulary) or a vocabulary of at most 16384
    tokens drafts over the whole vocabulary as before, while the shipped SmolLM2 heads, whose counts ship beside
    them, draft over 16384 (measured: docs/results.md §46, "The reduced draft vocabulary by default"). The output is the
    same either way.

    ``static_levels`` (rank 0 runs draft levels on static shapes: ``model.graphs`` resolves to an executor, as
    ``auto`` does on CUDA): auto gives the whole vocabulary there, because a reduced vocabulary keeps a level's step
    out of the graph (docs/gpu.md) and its gain was measured only where levels run eagerly (a CPU, the simulator's
    profiles); an explicit ``N`` still applies."""
    if setting != AUTO:
        return setting
    ok = counts_found and shares_lm_head and vocab_size > DEFAULT_DRAFT_VOCAB and not static_levels
    return DEFAULT_DRAFT_VOCAB if ok else 0


def counts_path(explicit: str, head_dir) -> Path | None:
    """Where ``model.draft_vocab`` reads its counts: ``model.draft_vocab_counts`` when set, else
    :data:`COUNTS_FILE` in the head's directory; None without either (an untrained head)."""
    if explicit:
        p = Path(explicit)
        return p / COUNTS_FILE if p.is_dir() else p
    return None if head_dir is None else Path(head_dir) / COUNTS_FILE


def require_shared_lm_head(head) -> None:
    """A reduced vocabulary cuts the *target's* ``lm_head``: an EAGLE-3 head, which has its own, is one
    :class:`HeadError`."""
    if hasattr(head, "draft_logits"):
        raise HeadError("model.draft_vocab applies to heads that share the target's lm_head (EAGLE-1/2); "
                        "an EAGLE-3 head drafts over its own vocabulary (its d2t)")


def default_vocab_size() -> int:
    """The default model's vocabulary size, or 0 when it has not been converted here."""
    from config.paths import DEFAULT_STAGE_DIR
    cfg = DEFAULT_STAGE_DIR / "stage_model_0" / "config.json"
    return int(json.loads(cfg.read_text())["vocab_size"]) if cfg.is_file() else 0


class DraftVocab:
    """The draft vocabulary of one generation and the ``lm_head`` rows it applies: the ranked ``base`` ids plus the
    tokens of the context (prompt and committed output), because the tokens a request is most likely to repeat
    and a frequency list misses are its own (names, code identifiers, words of a quoted passage, the target
    language of a translation).

    Invariants: ``ids`` holds distinct target ids in ``[0, V)``, ``base`` first (increasing), context tokens after
    in order of first appearance; ``rows[i]`` is the ``lm_head`` row (and ``bias[i]`` its bias) of ``ids[i]``;
    at most ``cap = len(base) + extra`` ids (context tokens beyond that are left out, the draft just never
    proposes them); room for context rows is allocated as it fills (:meth:`_reserve`), not ``extra`` rows up
    front; :meth:`begin` restores ``base`` before adding a new generation's context.
    """

    def __init__(self, base: torch.Tensor, lm_head: torch.nn.Linear, extra: int) -> None:
        w = lm_head.weight.detach()
        self.n_base = int(base.numel())
        self.cap = min(self.n_base + max(0, int(extra)), w.shape[0])   # most ids it will ever hold
        self._lm_head = lm_head   # the module, not a detached tensor: a lane's copy (pipeline.lanes.fork_drafter
        #                           deep-copies a drafter but shares its modules) must not copy the V x H weight
        self._ids = torch.empty(0, dtype=torch.int64, device=w.device)
        self._rows = torch.empty(0, w.shape[1], dtype=w.dtype, device=w.device)
        self._bias = None if lm_head.bias is None else torch.empty(0, dtype=lm_head.bias.dtype, device=w.device)
        self.n = 0
        self._reserve(min(self.cap, self.n_base + self.GROW))
        self._ids[:self.n_base] = base.to(w.device)
        self._rows[:self.n_base] = w[self._ids[:self.n_base]]
        if self._bias is not None:
            self._bias[:self.n_base] = self._b[self._ids[:self.n_base]]
        self._member = torch.zeros(w.shape[0], dtype=torch.bool)      # host copy: membership in O(1)
        self._member[base.cpu()] = True
        self._base_member = self._member.clone()
        self.n = self.n_base

    @property
    def _w(self) -> torch.Tensor:
        return self._lm_head.weight.detach()

    @property
    def _b(self) -> torch.Tensor | None:
        return None if self._lm_head.bias is None else self._lm_head.bias.detach()

    GROW = 256    # room for context tokens allocated up front; doubled on demand up to ``cap``

    def _reserve(self, size: int) -> None:
        """Make room for ``size`` ids (never beyond ``cap``), keeping the first ``n``: the row copy grows
        geometrically instead of holding ``extra`` rows from the start."""
        size = min(size, self.cap)
        have = self._ids.numel()
        if size <= have:
            return
        size = min(self.cap, max(size, 2 * have))
        ids = torch.empty(size, dtype=self._ids.dtype, device=self._ids.device)
        rows = torch.empty(size, self._rows.shape[1], dtype=self._rows.dtype, device=self._rows.device)
        ids[:self.n], rows[:self.n] = self._ids[:self.n], self._rows[:self.n]
        self._ids, self._rows = ids, rows
        if self._bias is not None:
            bias = torch.empty(size, dtype=self._bias.dtype, device=self._bias.device)
            bias[:self.n] = self._bias[:self.n]
            self._bias = bias

    def begin(self, context: list[int]) -> None:
        """A new generation: the base vocabulary plus ``context``'s tokens."""
        self._member.copy_(self._base_member)
        self.n = self.n_base
        self.add(context)

    def add(self, tokens) -> None:
        """Add the tokens not in the vocabulary yet (committed output), while there is room."""
        t = torch.as_tensor(tokens, dtype=torch.int64).flatten().cpu()
        if t.numel() == 0 or self.n >= self.cap:
            return
        new = t[~self._member[t]]
        if new.numel() == 0:
            return
        new = torch.tensor(list(dict.fromkeys(new.tolist()))[: self.cap - self.n])   # first appearance
        self._member[new] = True
        k = new.numel()
        self._reserve(self.n + k)
        dev_new = new.to(self._ids.device)
        self._ids[self.n:self.n + k] = dev_new
        self._rows[self.n:self.n + k] = self._w[dev_new]
        if self._bias is not None:
            self._bias[self.n:self.n + k] = self._b[dev_new]
        self.n += k

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[:self.n]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)`` restricted to :attr:`ids` (same order)."""
        b = None if self._bias is None else self._bias[:self.n]
        return torch.nn.functional.linear(hidden.to(self._rows.dtype), self._rows[:self.n], b)


def cmd_count(args) -> int:
    from draft.train.records import read_jsonl
    records = [r for f in args.data for r in read_jsonl(f)]
    if not records:
        print(f"error: no conversations in {', '.join(args.data)}", file=sys.stderr)
        return 2
    vocab = args.vocab_size or default_vocab_size() or 1 + max(max(r["input_ids"]) for r in records)
    try:
        counts = count_tokens(records, vocab)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"data": [Path(f).name for f in args.data], "conversations": len(records), "tokens": int(counts.sum())}
    out = save_counts(args.out, counts, meta)
    print(f"{out}: {meta['tokens']} tokens of {len(records)} conversations, {int((counts > 0).sum())} distinct ids",
          file=sys.stderr)
    print("| draft vocabulary | share of the counted tokens inside |\n|---|---|")
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        if n < vocab:
            print(f"| {n} | {coverage(counts, n):.4f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("draft.vocab"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("count", help="token counts of the target's answers (data subcommand JSONL) -> "
                                     f"{COUNTS_FILE}")
    c.add_argument("--data", action="append", required=True, help="JSONL from python -m draft.train_eagle data "
                                                                   "(repeatable)")
    c.add_argument("--out", required=True, help=f"head directory (writes {COUNTS_FILE}) or a .safetensors file")
    c.add_argument("--vocab-size", type=int, default=0, help="target vocabulary size (default: the default "
                                                             "model's, or the largest id + 1)")
    c.set_defaults(func=cmd_count)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
