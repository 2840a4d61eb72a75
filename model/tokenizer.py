"""A tokenizer read with the ``tokenizers`` library alone: transformers' ids, text and chat template, without
importing transformers.

Why: ``AutoTokenizer`` imports transformers (about 1 s of CPU per process start, more than loading and running a
small split: docs/results.md, "The API example under 5 s"); the tokenizer itself is ``tokenizers``' Rust object from
``tokenizer.json``, which loads in milliseconds. :func:`load_light_tokenizer` builds the same backend transformers
5 builds for the tokenizer classes it knows (``TokenizersBackend`` / ``PreTrainedTokenizerFast``: the file as is;
``LlamaTokenizer``: transformers' Metaspace pre-tokenizer and decoder replace the file's), and renders a chat
template the way ``apply_chat_template`` does (jinja2's sandbox, ``trim_blocks``/``lstrip_blocks``, the same
``tojson``/``raise_exception``/``strftime_now``, the special tokens as variables; the text encoded without added
special tokens). Anything else returns None and the caller uses ``AutoTokenizer``.

Contract (``tests/test_light_tokenizer.py``, on stories260K and the default SmolLM2 split): ``tok(text)["input_ids"]``,
``apply_chat_template(...)``, ``decode(ids, skip_special_tokens=...)``, ``eos_token_id``, ``unk_token_id``,
``convert_tokens_to_ids`` equal ``AutoTokenizer``'s.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

AS_IS = ("TokenizersBackend", "PreTrainedTokenizerFast")
LLAMA = ("LlamaTokenizer", "LlamaTokenizerFast")
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


class LightTokenizer:
    """The part of a transformers tokenizer the pipeline uses (see the module docstring)."""

    def __init__(self, backend, tcfg: dict, chat_template: str | None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens_map = {k: _text(tcfg.get(k)) for k in SPECIAL if _text(tcfg.get(k)) is not None}
        for k in SPECIAL:
            tok = self.special_tokens_map.get(k)
            setattr(self, k, tok)
            setattr(self, f"{k}_id", self.backend.token_to_id(tok) if tok is not None else None)
        self._template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str):
        tid = self.backend.token_to_id(token)
        return self.unk_token_id if tid is None else tid

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs):
        """``messages`` rendered with the chat template; token ids when ``tokenize`` (returned as a list)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile(source: str):
    """transformers' chat-template environment (``utils/chat_template_utils._cached_compile_jinja_template``),
    without its generation-tracking extension (``{% generation %}`` templates: the caller falls back)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_light_tokenizer(folder: str | Path) -> LightTokenizer | None:
    """The tokenizer of ``folder`` without transformers, or None where this module does not reproduce
    transformers' (another tokenizer class, no ``tokenizer.json``, explicit ``add_bos_token``/``add_eos_token``,
    clean-up of spaces, several named chat templates or one with ``{% generation %}``)."""
    folder = Path(folder)
    try:
        tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    cls = tcfg.get("tokenizer_class")
    if cls not in AS_IS + LLAMA or not (folder / "tokenizer.json").is_file():
        return None
    if "add_bos_token" in tcfg or "add_eos_token" in tcfg or tcfg.get("clean_up_tokenization_spaces"):
        return None
    template = tcfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is not None and (not isinstance(template, str) or "generation" in template and "{% generation" in
                                 template):
        return None
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:
        return None
    if cls in LLAMA:     # transformers 5's LlamaTokenizer.__init__ rebuilds these around the file's vocabulary
        prefix = tcfg.get("add_prefix_space")
        prefix = True if prefix is None else bool(prefix)
        scheme = ("first" if not tcfg.get("legacy", False) else "always") if prefix else "never"
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        seq = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            seq.append(decoders.Strip(content=" ", left=1))
        backend.decoder = decoders.Sequence(seq)
    return LightTokenizer(backend, tcfg, template)
