"""The prompt material of the data builder, read from JSON files beside this module.

``prompt_lists.json`` holds the self-prompt lists (``TOPICS``, ``META_STYLES``, ... used by
:mod:`draft.train.self_prompts`), ``broad_prompt_lists.json`` those of :mod:`draft.train.broad_prompts`.
Both ship as package data (``pyproject.toml``).

Invariants: the lists keep the order of the files (prompts are drawn from them with ``random.Random(seed)``, so
the same seed gives the same prompts only while the files are unchanged; ``tests/test_prompt_lists.py`` pins
that); every entry is a string or a tuple of strings (JSON arrays become tuples); a missing list or another
shape is a :class:`ValueError` naming the file and the key.
"""
from __future__ import annotations

import json
from importlib import resources

SELF_LISTS = ("TOPICS", "META_STYLES", "SUMMARIZE_PREFIXES", "REWRITE_PREFIXES", "TEMPLATE_STYLES", "FOLLOWUPS",
              "CODE_TASKS", "CODE_STYLES", "NAMES", "ITEMS", "MATH_TEMPLATES")
BROAD_LISTS = ("LANGS", "FOREIGN", "ENTITIES", "ROLES", "FOLLOWUP2", "PASSAGE_STYLES", "TRANSLATE_TO_ENGLISH",
               "SUMMARY_PREFIXES", "RAG_QUESTIONS", "MULTITURN_OPENERS")


def load_prompt_lists(filename: str, names: tuple[str, ...]) -> dict[str, list]:
    """The lists ``names`` of the JSON file ``filename`` beside this module (strings, or tuples of strings)."""
    return parse_prompt_lists(resources.files(__package__).joinpath(filename).read_text(encoding="utf-8"), filename,
                              names)


def parse_prompt_lists(text: str, filename: str, names: tuple[str, ...]) -> dict[str, list]:
    """The lists ``names`` of the JSON object ``text`` (read from ``filename``, named in errors)."""
    data = json.loads(text)
    out = {}
    for name in names:
        values = data.get(name)
        if not isinstance(values, list) or not values:
            raise ValueError(f"{filename}: {name} must be a non-empty list")
        items = []
        for v in values:
            if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
                items.append(tuple(v))
            elif isinstance(v, str):
                items.append(v)
            else:
                raise ValueError(f"{filename}: {name} holds {json.dumps(v)[:60]}; expected a string or a list of "
                                 f"strings")
        out[name] = items
    return out


_SELF = load_prompt_lists("prompt_lists.json", SELF_LISTS)
TOPICS: list[str] = _SELF["TOPICS"]
META_STYLES: list[tuple[str, str]] = _SELF["META_STYLES"]          # (kind, instruction with {topic})
SUMMARIZE_PREFIXES: list[str] = _SELF["SUMMARIZE_PREFIXES"]
REWRITE_PREFIXES: list[str] = _SELF["REWRITE_PREFIXES"]
TEMPLATE_STYLES: list[str] = _SELF["TEMPLATE_STYLES"]              # {topic}, {topic2}
FOLLOWUPS: list[str] = _SELF["FOLLOWUPS"]
CODE_TASKS: list[tuple[str, str, str, str]] = _SELF["CODE_TASKS"]  # (name, args, return type, docstring)
CODE_STYLES: list[str] = _SELF["CODE_STYLES"]                      # "complete" or {name} {args} {doc}
NAMES: list[str] = _SELF["NAMES"]
ITEMS: list[str] = _SELF["ITEMS"]
MATH_TEMPLATES: list[str] = _SELF["MATH_TEMPLATES"]

_BROAD = load_prompt_lists("broad_prompt_lists.json", BROAD_LISTS)
LANGS: list[str] = _BROAD["LANGS"]
FOREIGN: list[tuple[str, str]] = _BROAD["FOREIGN"]                 # (language, sentence) for X -> English
ENTITIES: list[str] = _BROAD["ENTITIES"]
ROLES: list[tuple[str, str]] = _BROAD["ROLES"]                     # (role, the user's first line)
FOLLOWUP2: list[str] = _BROAD["FOLLOWUP2"]
PASSAGE_STYLES: list[str] = _BROAD["PASSAGE_STYLES"]               # {t}: a topic
TRANSLATE_TO_ENGLISH: list[str] = _BROAD["TRANSLATE_TO_ENGLISH"]   # {lang}, {s}
SUMMARY_PREFIXES: list[str] = _BROAD["SUMMARY_PREFIXES"]
RAG_QUESTIONS: list[str] = _BROAD["RAG_QUESTIONS"]                 # {t}
MULTITURN_OPENERS: list[str] = _BROAD["MULTITURN_OPENERS"]         # {t}
