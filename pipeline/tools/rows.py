"""Result rows as the tools read them: following a job's growing rows file, and the losslessness check at T=0.

What this module holds, one copy each (reading a finished rows file is :func:`pipeline.outputs.read_rows` /
:func:`pipeline.outputs.jsonl_lines`, the one torn-line rule, not repeated here):

* :class:`RowTailer`: the rows a running ``pipeline.run --output FILE`` has completed since the last look
  (a line counts once it ends in a newline; a half-written last line waits for the next look);
* :func:`find_mismatches`: T=0 rows whose ``output_ids`` differ from ``ar``'s for the same prompt, with the
  compared and unreferenced counts (bench: keyed by question and turn; eval: by dataset, question and turn);
* :func:`losslessness_md`: the summary's verdict text on those mismatches;
* :func:`mismatch_banner`: the loud console block a tool prints (with exit status 3) when any differ;
* :func:`draft_heads` / :func:`head_line` / :data:`UNTRAINED_WARNING`: which draft head the rows were drafted by
  (name and weights hash), for every summary and plot title;
* :func:`sr_baseline`: the mode a speed-up ratio is taken against (naive when it ran).

Invariant: at temperature 0 every decoding mode must reproduce ``ar``'s tokens exactly (``ar`` equals HF
``generate``); a row is compared only with the ``ar`` row of the same key.
"""
from __future__ import annotations

import json
from pathlib import Path


class RowTailer:
    """Follows a JSONL file another process appends to: :meth:`poll` returns the rows completed since the
    previous call, in file order, each exactly once. A missing file has no rows yet."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def poll(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].decode("utf-8").splitlines() if line.strip()]


def first_difference(x: list, y: list) -> int:
    """Index of the first position where ``x`` and ``y`` differ (the shorter length when one is a prefix)."""
    return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))


def find_mismatches(rows: list[dict], by_dataset: bool = False) -> tuple[list[str], int, int]:
    """T=0 rows whose ``output_ids`` (or ``prompt_ids``) differ from ``ar``'s for the same key. Returns
    ``(messages, compared, rows without an ar reference)``.

    Key: (question_id, turn); with ``by_dataset`` (eval's rows) (dataset, question_id, turn), the rows are
    compared in key then mode order and the messages name dataset and turn (a later turn's prompt holds the
    earlier answers, so a prompt difference there means an earlier turn diverged). A missing ``turn`` is 0,
    a missing ``temperature`` 0."""
    def key(r: dict) -> tuple:
        k = (r["question_id"], int(r.get("turn", 0)))
        return (r["dataset"], *k) if by_dataset else k

    t0 = [r for r in rows if float(r.get("temperature", 0)) == 0.0]
    ref = {key(r): r for r in t0 if r["mode"] == "ar"}
    others = [r for r in t0 if r["mode"] != "ar"]
    if by_dataset:
        others.sort(key=lambda r: (str(key(r)), r["mode"]))
    bad, compared, unref = [], 0, 0
    for r in others:
        k = key(r)
        a = ref.get(k)
        if a is None:
            unref += 1
            continue
        compared += 1
        x, y, m = a["output_ids"], r["output_ids"], r["mode"]
        where = f"{k[0]} question {k[1]} turn {k[2]}" if by_dataset else f"question {r['question_id']}"
        if a.get("prompt_ids") != r.get("prompt_ids"):
            bad.append(f"{where}: {m} != ar: prompt differs (an earlier turn diverged)" if by_dataset
                       else f"{where}: {m} was given another prompt than ar")
        elif x != y:
            bad.append(f"{where}: {m} != ar: first difference at token {first_difference(x, y)} "
                       f"(ar {len(x)} tokens, {m} {len(y)} tokens)")
    return bad, compared, unref


def losslessness_md(mismatch: tuple[list[str], int, int], scope: str = "") -> str:
    """The verdict under a summary's "Losslessness at T = 0" heading. ``scope`` qualifies "generations"
    (eval: ``"T=0 "``, its rows mix temperatures)."""
    bad, compared, unref = mismatch
    if bad:
        text = f"**MISMATCH: {len(bad)} of {compared} generations differ from ar:**\n\n" + "".join(f"- {b}\n" for b in bad)
    elif compared:
        text = f"All {compared} {scope}generations of the speculative modes equal ar's output token for token.\n"
    else:
        text = f"Nothing compared (needs {'T=0 rows of ' if scope else ''}ar and another mode).\n"
    if unref:
        text += f"\n{unref} {scope}generations had no ar row to compare with.\n"
    return text


def mismatch_banner(tool: str, messages: list[str]) -> str:
    """The console block for T=0 mismatches: a line of ``!``, one line per differing generation, a line of ``!``."""
    bar = "!" * 78
    return (f"{bar}\n[{tool}] LOSSLESSNESS MISMATCH at T=0: {len(messages)} generation(s) differ from ar:\n  "
            + "\n  ".join(messages) + f"\n{bar}")


UNTRAINED_WARNING = ("WARNING: these rows were drafted by an UNTRAINED (random) draft head: tau and speed-ups "
                     "measure nothing about a trained drafter (give model.head_dir=<trained head>)")


def draft_heads(rows: list[dict]) -> list[tuple[str, str | None]]:
    """The distinct ``(head_dir, head_sha256)`` of rows that drafted (``ar`` rows and ``head_dir == "none"``
    aside), in first-seen order."""
    out: list[tuple[str, str | None]] = []
    for r in rows:
        head = r.get("head_dir")
        if r.get("mode") == "ar" or head in (None, "none"):
            continue
        key = (str(head), r.get("head_sha256"))
        if key not in out:
            out.append(key)
    return out


def head_line(rows: list[dict]) -> str:
    """One line naming the draft head(s) of ``rows``: the folder's name and the first 12 hex digits of its
    weights' sha256 (``pipeline.outputs.head_identity``), ``untrained (random weights)``, or ``none`` when no
    row drafted."""
    heads = draft_heads(rows)
    if not heads:
        return "draft head: none (no drafting mode ran)"
    parts = []
    for head, sha in heads:
        if head == "untrained":
            parts.append("UNTRAINED (random weights)")
        else:
            kind, _, path = head.rpartition(":") if head.startswith(("oracle:", "adversary:")) else ("", "", head)
            parts.append((f"{kind}:" if kind else "") + Path(path).name + (f" (sha256 {sha[:12]})" if sha else ""))
    return "draft head: " + ", ".join(parts)


def untrained(rows: list[dict]) -> bool:
    """True when any row was drafted by the untrained head."""
    return any(head == "untrained" for head, _ in draft_heads(rows))


def sr_baseline(modes: list[str]) -> str | None:
    """The mode SR = ξ / ξ(baseline) is taken against: ``naive`` (Chunk-PP, the paper's baseline) when it ran,
    else ``ar`` (PP-AR), else the first mode that ran (SR 1 for it); None when nothing ran."""
    for m in ("naive", "ar"):
        if m in modes:
            return m
    return modes[0] if modes else None
