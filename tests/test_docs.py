"""The docs' links: every relative link and anchor in README.md and docs/*.md resolves.

Anchors are GitHub's: a heading's text, lower-cased, without punctuation, spaces as hyphens, and
`-1`, `-2`, ... on repeats. Code blocks and code spans are not markdown, so nothing in them counts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HTML_SOURCE = re.compile(r"<(?:img|a)\s[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)  # <img src="...">
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "code", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match and not fenced:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """Relative link targets of a page (images and HTML <img>/<a> included), outside code."""
    text = "\n".join(prose(path.read_text(encoding="utf-8")))
    targets = LINK.findall(text) + HTML_SOURCE.findall(text)
    return [t for t in targets if not EXTERNAL.match(t)]


def broken(page: Path) -> list[str]:
    """The links of `page` whose file or anchor does not exist."""
    bad = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            bad.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(target)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    """Each relative link of the page names a file that exists, and a heading that exists."""
    assert broken(page) == []


def test_the_check_reads_headings_and_links_as_github_does(tmp_path):
    """Anchors drop punctuation and count repeats; code is not read; a missing target is caught."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Operating `tokenstream serve`\n## Notes\n## Notes\n```\n# not a heading\n```\n"
        "[a](#operating-tokenstream-serve) [b](#notes-1) [c](#not-a-heading) [d](gone.md)\n"
        "`[e](also-gone.md)` [f](https://example.com/x)\n"
        '<img src="img/gone.png" alt="x" width="9"> <img alt="y" src="https://example.com/i.png">\n',
        encoding="utf-8",
    )
    assert anchors(page) == {"operating-tokenstream-serve", "notes", "notes-1"}
    assert broken(page) == ["#not-a-heading", "gone.md", "img/gone.png"]


def test_readme_is_a_front_door():
    """The README stays short (reference lives in docs/) and keeps the two commands CI runs."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert "bash scripts/setup.sh && .venv/bin/tokenstream serve" in text
    assert "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q" in text
