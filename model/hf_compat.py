"""The one place that knows which transformers release renamed what.

transformers 5.24 renamed the ``past_key_values`` argument of every decoder layer, attention module and model
``forward`` to ``cache`` (and the output field likewise); the old name still works there but warns on every
process's stderr, which breaks the "one clear line per rank" rule of the launchers. The requirements allow
5.20.2 (the newest on Python 3.10 / JetPack 6) up to <6, so the code asks the installed release which name it
takes instead of pinning either side. Callers look the name up once, when they build their modules.
"""
from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def cache_arg(cls: type) -> str:
    """The name of the KV-cache argument of ``cls.forward`` in this release: ``cache`` or ``past_key_values``."""
    params = inspect.signature(cls.forward).parameters      # follows functools.wraps (deprecate_kwarg keeps it)
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The KV cache a model returned (``out.cache`` from 5.24 on, ``out.past_key_values`` before)."""
    return out["cache"] if "cache" in out else out["past_key_values"]
