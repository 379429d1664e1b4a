"""The README and the pages of ``docs/``: every relative link reaches a file (and the heading it
names), every page is reachable from the README, and the README stays a newcomer's page.

Reads files only: no process, no network.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: The README's length the project holds itself to (the rest goes to docs/).
README_MAX_LINES = 250

#: Link targets that other branches add (the lead merges them); each is checked like any other as
#: soon as it exists, and then must leave this list (the test below says so).
PENDING_TARGETS: dict[str, str] = {}

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans: links there are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _links(page: Path) -> list[str]:
    return _LINK.findall(_prose(page.read_text(encoding="utf-8")))


@cache
def _anchors(page: Path) -> frozenset[str]:
    """The anchors GitHub gives ``page``'s headings: the text lowercased, punctuation dropped,
    spaces as hyphens, a repeated anchor numbered ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    for heading in _HEADING.findall(text):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


def _problem(page: Path, target: str) -> str | None:
    """What is wrong with the link ``target`` on ``page``, or None when it reaches its place."""
    path_part, _, anchor = target.partition("#")
    resolved = (page.parent / path_part).resolve() if path_part else page
    if not resolved.is_relative_to(ROOT):
        return "points outside the repository"
    relative = resolved.relative_to(ROOT).as_posix()
    if not resolved.exists():
        return None if relative.rstrip("/") in PENDING_TARGETS else f"{relative} does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
        return f"{relative} has no heading with the anchor #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_reaches_a_file_and_the_heading_it_names(page: Path) -> None:
    broken = [
        f"{target}: {problem}"
        for target in _links(page)
        if not _SCHEME.match(target) and (problem := _problem(page, target)) is not None
    ]
    assert broken == [], f"broken links in {page.relative_to(ROOT)}"


def test_every_page_of_docs_is_linked_from_the_readme() -> None:
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for target in _links(README)
        if not _SCHEME.match(target) and target.partition("#")[0]
    }
    orphans = [page.relative_to(ROOT).as_posix() for page in PAGES[1:] if page not in linked]
    assert orphans == [], "pages of docs/ that the README does not link"


def test_the_readme_stays_a_newcomers_page() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a page of docs/"
    )


def test_pending_link_targets_are_still_missing() -> None:
    arrived = [target for target in PENDING_TARGETS if (ROOT / target).exists()]
    assert arrived == [], "these now exist: remove them from PENDING_TARGETS in tests/test_docs.py"


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    page = ROOT / "docs" / "example.md"  # never written: only its folder matters
    assert _problem(page, "architecture.md#the-contracts") is None
    assert _problem(page, "../benchmarks/RESULTS.md#wrapper-overhead") is None
    assert _problem(page, "nowhere.md") == "docs/nowhere.md does not exist"
    assert _problem(page, "architecture.md#nowhere") == (
        "docs/architecture.md has no heading with the anchor #nowhere"
    )
    assert _problem(page, "../../etc/passwd") == "points outside the repository"
    sample = tmp_path / "sample.md"
    sample.write_text(
        "See [`a`](a.md#x) and ![plot](p.png).\n`[not](code.md)`\n```\n[not](fenced.md)\n```\n",
        encoding="utf-8",
    )
    assert _links(sample) == ["a.md#x", "p.png"]
