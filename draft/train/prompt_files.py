"""Prompt files and the exclusion of evaluation prompts from training data.

Readers: FastChat ``question.jsonl`` (``turns``), ShareGPT-style JSON/JSONL (``conversations`` / ``messages`` /
``items`` with ``from``/``role`` and ``value``/``content``), records with a ``prompt`` / ``instruction`` (+
``input``) / ``question`` / ``text`` field, and plain text (one prompt a line).

Invariants: only user turns are read, empty ones dropped, at most ``max_turns`` per conversation, in file order;
texts are compared after :func:`norm_text` (whitespace collapsed, lower case), so an excluded evaluation prompt
is caught however it is spaced or cased.
"""
from __future__ import annotations

import json
import re
from pathlib import Path


def norm_text(text: str) -> str:
    """``text`` with runs of whitespace made one space, stripped, lower case (the key prompts are compared by)."""
    return re.sub(r"\s+", " ", text).strip().lower()


def turns_of(obj, max_turns: int) -> list[str] | None:
    """User turns of one record: FastChat ``turns``, ShareGPT ``conversations``/``messages`` or a plain field."""
    if isinstance(obj, str):
        return [obj] if obj.strip() else None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("turns"), list):
        turns = [t for t in obj["turns"] if isinstance(t, str)]
    else:
        conv = obj.get("conversations") or obj.get("messages") or obj.get("items")
        if isinstance(conv, list):
            turns = []
            for m in conv:
                if not isinstance(m, dict):
                    continue
                role = str(m.get("from", m.get("role", ""))).lower()
                text = m.get("value", m.get("content"))
                if role in ("human", "user") and isinstance(text, str):
                    turns.append(text)
        else:
            turns = []
            for key in ("prompt", "instruction", "question", "text"):
                if isinstance(obj.get(key), str):
                    text = obj[key]
                    if key == "instruction" and isinstance(obj.get("input"), str) and obj["input"].strip():
                        text = text + "\n\n" + obj["input"]
                    turns = [text]
                    break
    turns = [t for t in turns if t.strip()][:max_turns]
    return turns or None


def load_prompt_file(path: str | Path, max_turns: int = 2) -> list[list[str]]:
    """User turns of every conversation in a FastChat/ShareGPT JSON(L) file or a plain text file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    items: list = []
    if path.suffix == ".json" or stripped.startswith("["):
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    elif path.suffix == ".jsonl" or stripped.startswith("{"):
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        items = [line for line in text.splitlines() if line.strip()]
    out = []
    for it in items:
        turns = turns_of(it, max_turns)
        if turns:
            out.append(turns)
    return out


def load_excluded(specs: list[str]) -> set[str]:
    """Normalized user turns of ``FILE:BEGIN:END`` FastChat record ranges (e.g. an evaluation split)."""
    out: set[str] = set()
    for spec in specs or []:
        parts = spec.rsplit(":", 2)
        if len(parts) != 3:
            raise ValueError(f"--exclude expects FILE:BEGIN:END, got {spec!r}")
        path, b, e = parts
        lines = [l for l in Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]
        for line in lines[int(b) if b else None:int(e) if e else None]:
            turns = turns_of(json.loads(line), 1000) or []
            out.update(norm_text(t) for t in turns)
    return out


def is_excluded(turns: list[str], excluded: set[str]) -> bool:
    """True when a turn equals an excluded turn (or, for long texts, one contains the other)."""
    if not excluded:
        return False
    for t in turns:
        n = norm_text(t)
        if n in excluded:
            return True
        if len(n) >= 40 and any(len(x) >= 40 and (n in x or x in n) for x in excluded):
            return True
    return False
