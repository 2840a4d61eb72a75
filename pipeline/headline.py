"""The main job's closing line of context: this run's measured speed, and where FlowSpec is faster, quoted.

One home per number: the figure of where FlowSpec is faster lives in ``docs/results.md`` only, in the table that
follows the line ``<!-- headline: SETTING -->`` (SETTING says how the figure was obtained). The README quotes the
same table; ``pipeline.run`` reads it at the end of a run (:func:`read_headline`) instead of carrying a copy,
and says it is quoted, not measured now. Replaying the run's own answer with the simulator would take tens of
seconds more on a CPU (the real draft head runs again for every mode replayed: about 0.12 s per token and mode on
this 2-core CPU, docs/results.md §14), so the run quotes rather than models.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from config.modes import MODES, label

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.md"
MARK = re.compile(r"<!--\s*headline:\s*(.*?)\s*-->")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Headline:
    setting: str                # how the figures were obtained (the marker's text)
    section: str                # the heading of the section that holds it
    anchor: str                 # ``docs/results.md#<slug of that heading>``
    tok_s: dict[str, float]     # mode -> tokens/s


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to
    ``-`` (``"1.2 The issue's scope: 140 prompts"`` -> ``"12-the-issues-scope-140-prompts"``)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def read_headline(text: str, path: str = "docs/results.md") -> Headline | None:
    """The headline of a results page (None when it has no marker or no usable table after it). Pure.

    The table after the marker has one column per mode (a header cell naming the mode in backticks) and a data
    row whose mode cells start with tokens/s (``| ξ, tok/s | 9.59 | 12.12 (τ 3.26) | ...``)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = MARK.search(line)
        if not m:
            continue
        heading = next((l.lstrip("#").strip() for l in reversed(lines[:i]) if l.startswith("#")), "")
        table = []
        for l in lines[i + 1:]:
            if l.startswith("|"):
                table.append([c.strip() for c in l.strip().strip("|").split("|")])
            elif table:
                break
        if len(table) < 3:
            return None
        cols = {j: c.strip("`") for j, c in enumerate(table[0]) if c.startswith("`") and c.strip("`") in MODES}
        values = {}
        for j, mode in cols.items():
            num = _NUMBER.search(table[2][j]) if j < len(table[2]) else None
            if num:
                values[mode] = float(num.group())
        if "continuous" not in values or len(values) < 2:
            return None
        return Headline(m.group(1), heading, f"{path}#{slug(heading)}", values)
    return None


def load_headline(path: Path = RESULTS) -> Headline | None:
    try:
        return read_headline(path.read_text(encoding="utf-8"))
    except OSError:
        return None


def context_line(measured: dict[str, tuple[int, float]], world: int, cores: int | None,
                 headline: Headline | None, gpus: int = 0) -> str:
    """The closing line: ``measured`` = mode -> (new tokens, decode seconds) of this run on this machine (``world``
    ranks on ``cores`` CPU cores, or on ``gpus`` GPUs when > 0), and the quoted headline (``None``: only where to
    look). Pure."""
    runs = ", ".join(f"{label(m)} (`{m}`) {n / s:.1f} tok/s over {n} tokens" for m, (n, s) in measured.items()
                     if s > 0)
    if gpus:
        host = f"{world} ranks on {gpus} GPU{'s' if gpus != 1 else ''}"
        caveat = " One host's GPUs are not the edge testbed below."
    else:
        host = f"{world} ranks on {cores} CPU core{'s' if cores != 1 else ''}" if cores else f"{world} ranks"
        caveat = (" Ranks that share a few cores compete for them, so a one-host run shows the protocol working, "
                  "not its speed-up.")
    here = f"[context] measured now on this machine ({host}): {runs or 'nothing decoded'}.{caveat}"
    if headline is None:
        return here + " Where FlowSpec is faster: docs/results.md."
    fs = headline.tok_s["continuous"]
    ratios = ", ".join(f"{fs / v:.2f}x {label(m)} (`{m}`, {v:.2f})" for m, v in headline.tok_s.items()
                       if m != "continuous" and v > 0)
    return (here + f" Where FlowSpec is faster: {headline.setting}: FlowSpec {fs:.2f} tok/s = {ratios}; "
            f"quoted from {headline.anchor}, not measured now.")
