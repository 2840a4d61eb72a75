"""The README and the docs pages: every relative link resolves (the file, and a ``#anchor`` to a heading of it), the
README stays an entrance (at most 250 lines, the test command in its Tests section), and the headline table it
quotes is the one in docs/results.md (one home per number)."""
from __future__ import annotations

import re
from pathlib import Path

from pipeline.headline import RESULTS, read_headline, slug
from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are examples, not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (a repeated heading gets ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S).splitlines():
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Every relative link of ``page`` that does not resolve: a missing file, or an anchor no heading has."""
    bad = []
    for m in LINK.finditer(_prose(page.read_text(encoding="utf-8"))):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_resolves():
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_checker_finds_planted_broken_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## 1. A section's title\n")
    page.write_text("# Page\n\n[ok](other.md#1-a-sections-title) [ok](#page) [web](https://example.org/x)\n"
                    "`[code](nowhere.md)`\n[gone](nowhere.md) [bad anchor](other.md#2-nope)\n")
    assert broken_links(page, tmp_path) == ["page.md: nowhere.md (no such file)",
                                            "page.md: other.md#2-nope (no such heading)"]


def test_readme_is_an_entrance():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    tests = text.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    assert "./run_tests.sh" in tests and "./run_tests.sh" in (REPO / ".ci" / "run").read_text()
    heads = re.findall(r"^## (.*)$", text, flags=re.M)
    for needed in ("Two commands", "Modes", "The ten settings people change", "The headline result", "Tests"):
        assert needed in heads, heads


def test_the_readme_quotes_the_results_headline():
    """The README's headline row at T = 0 carries exactly the figures of docs/results.md's marked table."""
    h = read_headline(RESULTS.read_text(encoding="utf-8"))
    assert h is not None
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    row = next(l for l in readme.splitlines() if l.startswith("| 0 |"))
    for mode, value in h.tok_s.items():
        assert f"{value:.2f}" in row, (mode, value, row)
    assert h.anchor in readme


MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)


def leftover_merge_markers(paths) -> list[str]:
    """``file:line`` of every Git conflict marker left in ``paths`` (a merge that kept both sides by hand)."""
    out = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        out += [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}" for m in MARKER.finditer(text)]
    return out


def test_no_merge_markers_are_left_in_the_pages(tmp_path):
    assert leftover_merge_markers(PAGES) == []
    planted = tmp_path / "p.md"
    planted.write_text("a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> i45\n", encoding="utf-8")
    assert leftover_merge_markers([planted]) == ["p.md:2", "p.md:4", "p.md:6"]
