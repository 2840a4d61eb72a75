"""Shared argparse pieces of the command-line tools."""
from __future__ import annotations

import argparse


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Like ``ArgumentDefaultsHelpFormatter``, but shows each default once: nothing is appended when the help
    text already states it (``[4096]``, ``(default: ...)``) or when there is no meaningful default (None,
    empty string, False for flags, positional lists)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if ("default" in text.lower() or "[" in text or d is None or d == "" or d is False or d == []
                or d is argparse.SUPPRESS or not action.option_strings):
            return text
        return super()._get_help_string(action)
