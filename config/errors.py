"""The one base class of errors whose message is the whole story: bad input, a missing file, a lost peer.

Entry points print such an error as one line (``[rank r] error: <message>``) and exit with its
:attr:`UserError.exit_code`, without a traceback; any other exception is a bug and is shown with its type.
Each layer defines its own subclasses (``ConfigError``, ``StageDirError``, ``HeadError``, ``PeerLost`` ...),
all mixed with the built-in type they always had (``ValueError`` / ``RuntimeError``), so existing ``except``
clauses keep working.
"""
from __future__ import annotations

import sys


class UserError(Exception):
    exit_code = 2      # bad input

    def fault_report(self) -> tuple[int, str, int | None]:
        """(exit code, reason recorded for the peers, lost rank or None) when this error ends a rank."""
        return self.exit_code, str(self), None


def exit_status(fn, *errors: type[BaseException]) -> int:
    """An entry point's ``fn()`` (its exit status), or 2 with the error as one line on stderr (``error:
    <message>``, no traceback) when it raises one of ``errors`` (default: :class:`UserError`)."""
    try:
        return fn()
    except (errors or (UserError,)) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
