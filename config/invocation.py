"""The command a user typed, for usage lines: ``flowspec-eval`` when a console script ran, ``./run_eval.sh`` when
a wrapper script said so, else ``python -m <module>``.

Why: a usage line that names another command than the one typed (``usage: python -m pipeline.tools.eval`` after
``flowspec-eval``) sends the user to a command they did not run.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "FLOWSPEC_PROG"   # "<module>=<command>", set by the shell wrappers (run_eval.sh, run_pipe.sh, ...)


def prog(module: str, argv0: str | None = None, env: str | None = None) -> str:
    """The program name for ``module``'s usage line: the console script's name when ``argv0`` (default
    ``sys.argv[0]``) is a ``flowspec-*`` script; the wrapper's command when :data:`ENV` (``env``) names this module
    (``pipeline.tools.eval=./run_eval.sh``: other modules it starts keep their own name); else
    ``python -m <module>``."""
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    if name.startswith("flowspec-"):
        return name
    wanted, _, command = (os.environ.get(ENV, "") if env is None else env).partition("=")
    if wanted == module and command:
        return command
    return f"python -m {module}"
