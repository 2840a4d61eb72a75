"""Prompt files (FastChat ``question.jsonl``) and chat formatting.

A tokenizer's own chat template is used when it has one (SmolLM2: ChatML, Llama-3...); Vicuna and
Llama-2-chat tokenizers carry none, so fschat's conversation templates format them.
"""
from __future__ import annotations

import json
from pathlib import Path

from config.errors import UserError


class PromptError(UserError, ValueError):
    pass


def load_questions(path: str | Path, begin: int | None = None, end: int | None = None) -> list[dict]:
    """Records ``[begin, end)`` of a FastChat question file (``question_id``, ``turns``...)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptError(f"prompts file {path} does not exist") from None
    except UnicodeDecodeError:
        raise PromptError(f"prompts file {path} is not UTF-8 text") from None
    except OSError as e:
        raise PromptError(f"cannot read prompts file {path}: {e.strerror}") from None
    records = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise PromptError(f"{path}:{i} is not a JSON object line") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("turns"), list) or not rec["turns"]:
            raise PromptError(f"{path}:{i} lacks a non-empty 'turns' list (FastChat question format)")
        for j, turn in enumerate(rec["turns"]):
            if not isinstance(turn, str):
                raise PromptError(f"{path}:{i}: turn {j + 1} is {type(turn).__name__} {json.dumps(turn)[:40]}, "
                                  f"expected a string (FastChat question format)")
        records.append(rec)
    return records[begin:end]


def chat_prompt_ids(tokenizer, turns: list[str], answers: list[str], system: str = "",
                    template: str = "auto") -> list[int]:
    """Token ids of a conversation ending with the assistant's turn to speak.

    ``turns`` are the user messages so far, ``answers`` the assistant replies to all but the last.
    """
    if template == "raw":
        return tokenizer(turns[-1])["input_ids"]
    if template == "auto" and getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "system", "content": system}] if system else []
        for i, t in enumerate(turns):
            msgs.append({"role": "user", "content": t})
            if i < len(answers):
                msgs.append({"role": "assistant", "content": answers[i]})
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    name = "vicuna" if template == "auto" else template
    if template == "auto":   # fschat's Vicuna template, without importing fastchat.model (tens of seconds on a CPU)
        from fastchat.conversation import get_conv_template
        conv = get_conv_template("vicuna_v1.1")
    else:
        from fastchat.model import get_conversation_template
        conv = get_conversation_template(name)
    if system:
        conv.set_system_message(system)
    for i, t in enumerate(turns):
        conv.append_message(conv.roles[0], t)
        conv.append_message(conv.roles[1], answers[i] if i < len(answers) else None)
    text = conv.get_prompt()
    if "llama-2" in name:
        text += " "
    return tokenizer(text)["input_ids"]


def split_messages(messages: list, system: str = "", content=None) -> tuple[str, list[str], list[str]]:
    """OpenAI-style chat messages -> ``(system prompt, user turns, assistant answers)`` for :func:`chat_prompt_ids`.

    The order is the one a chat template can express: an optional first ``system`` (or ``developer``) message, then
    ``user`` and ``assistant`` alternating, ending with a non-empty ``user`` message; ``system`` is the default
    system prompt when no system message is given. ``content(value, i)`` turns message ``i``'s content into text
    (default: it must be a string). Anything else is a :class:`PromptError` naming the message (``messages[i]``)."""
    def text_of(value, i: int) -> str:
        if not isinstance(value, str):
            raise PromptError(f"messages[{i}].content must be a string")
        return value
    content = content or text_of
    turns: list[str] = []
    answers: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m:
            raise PromptError(f"messages[{i}] must be an object with role and content")
        role, text = m["role"], content(m.get("content"), i)
        if role in ("system", "developer") and i == 0:
            system = text
        elif role == "user" and len(turns) == len(answers):
            turns.append(text)
        elif role == "assistant" and len(turns) == len(answers) + 1:
            answers.append(text)
        else:
            raise PromptError(f"messages[{i}]: role {role!r} out of place; expected an optional system message, then "
                              "user and assistant turns alternating, ending with user")
    if len(turns) != len(answers) + 1:
        raise PromptError("the last message must be the user's")
    if not turns[-1].strip():
        raise PromptError("the last user message is empty")
    return system, turns, answers


def prompt_records(prompt_ids: list[str], prompts_file: str | None, begin: int | None = None,
                   end: int | None = None, texts: list[str] = ()) -> list[dict]:
    """The records a run asks, from its prompt options: ``--prompt-ids`` (comma-separated ids, one record each,
    its only turn a list of ints), else records ``[begin, end)`` of ``prompts_file``, else ``texts`` (one turn
    each). A malformed id list is a :class:`PromptError`."""
    if prompt_ids:
        try:
            return [{"question_id": i, "turns": [[int(t) for t in p.split(",")]]} for i, p in enumerate(prompt_ids)]
        except ValueError:
            raise PromptError("--prompt-ids takes comma-separated integers") from None
    if prompts_file:
        return load_questions(prompts_file, begin, end)
    return [{"question_id": i, "turns": [t]} for i, t in enumerate(texts)]


def eos_ids(generation_config: dict | None, default=None) -> set[int]:
    """The ``eos_token_id`` of a generation config (an int or a list; ``default`` when absent): the stop ids
    of raw-id prompts, which have no tokenizer."""
    eos = (generation_config or {}).get("eos_token_id", default)
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def stop_token_ids(tokenizer, generation_config: dict | None = None) -> set[int]:
    """The generation config's ``eos_token_id`` (:func:`eos_ids`), the tokenizer's and its chat end markers."""
    ids = {int(e) for e in eos_ids(generation_config)}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for special in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(special)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return ids


class StopText:
    """``gen.stop`` as a predicate on committed ids: does the text end in a way that contains a stop string?

    Asked after every appended token, it decodes only the last ``window`` tokens (a stop string of L
    characters spans at most L tokens; the window adds slack for multi-byte characters), so its cost does not
    grow with the answer. Because it is asked token by token, the first ``True`` is the token that
    completes the first occurrence, in every mode alike.
    """

    def __init__(self, tokenizer, strings: list[str]) -> None:
        if not strings:
            raise ValueError("StopText needs at least one string")
        self.tokenizer, self.strings = tokenizer, list(strings)
        self.window = max(len(x) for x in self.strings) + 8

    def __call__(self, ids: list[int]) -> bool:
        tail = self.tokenizer.decode(ids[-self.window:], skip_special_tokens=True)
        return any(x in tail for x in self.strings)


class TextDeltas:
    """Committed token ids -> the text they add, for streaming an answer as its tokens commit.

    ``push(tokens)`` returns the new text since the last call; ``finish()`` the rest. Invariant: the
    concatenation of everything returned equals ``tokenizer.decode(ids without skip_ids,
    skip_special_tokens=True)`` of all pushed ids (the text a finished answer is printed or returned as), because
    each call decodes the whole answer so far and returns only a suffix of text never returned before. A
    decoded tail ending in U+FFFD (an incomplete UTF-8 sequence of byte-level tokens) is held back until
    the next tokens complete it; a change of earlier text (a tokenizer that rewrites spacing when more text
    follows) is held back until ``finish``, which returns the difference only if the text still extends what
    was returned (else nothing: the streamed text was already shown)."""

    def __init__(self, tokenizer, skip_ids=()) -> None:
        self.tokenizer, self.skip = tokenizer, set(int(t) for t in skip_ids)
        self.ids: list[int] = []
        self.shown = ""

    def text(self) -> str:
        return self.tokenizer.decode([t for t in self.ids if t not in self.skip], skip_special_tokens=True)

    def _delta(self, full: str) -> str:
        if not full.startswith(self.shown):
            return ""
        new = full[len(self.shown):]
        self.shown = full
        return new

    def push(self, tokens) -> str:
        self.ids.extend(int(t) for t in tokens)
        full = self.text()
        return self._delta(full[:len(full.rstrip("\ufffd"))])

    def finish(self) -> str:
        return self._delta(self.text())
