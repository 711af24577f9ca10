"""What the docs and scripts point at exists: every relative link and anchor in README.md and
docs/*.md resolves, every path of this repository named in the docs and scripts is there, and
docs/layout.md lists every file.

Anchors are GitHub's: a heading's text, lower-cased, without punctuation, spaces as hyphens, and
`-1`, `-2`, ... on repeats. Code blocks and code spans are not markdown, so nothing in them counts
as a link; paths are read everywhere, code included (a script's commands are code).
"""

from __future__ import annotations

import re
import subprocess
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


# ---- paths of this repository named in the docs and scripts

TOP_FOLDERS = ("tests", "scripts", "streaming_backend", "docs", "repository", "clients", "docker")
TOP_FOLDERS += (".ci",)
# A path starts at a top folder that no other path character comes before: in `/v2/repository/...`
# (a URL) or `$OUT/docs/...` (somewhere else) the folder is not this repository's.
REPO_PATH = re.compile(
    r"(?<![\w./$-])(?:" + "|".join(map(re.escape, TOP_FOLDERS)) + r")/[\w./*<>{}$-]*"
)
TEMPLATE = re.compile(r"[<>{}$]")  # clients/<name>_client.py: a placeholder, no file of ours


def texts() -> list[Path]:
    """The text files that name repository paths: docs, scripts, docker, CI and the README."""
    found = [ROOT / "README.md", ROOT / ".ci" / "run"]
    for folder in ("docs", "scripts", "docker"):
        found += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file())
    return [p for p in found if p.suffix not in (".png", ".pyc") and "__pycache__" not in p.parts]


def named_paths(text: str) -> set[str]:
    """The repository paths a text names, templates left out (a sentence's last dot dropped)."""
    found = {match.rstrip(".") for match in REPO_PATH.findall(text)}
    return {path for path in found if not TEMPLATE.search(path)}


def missing(text: str, root: Path = ROOT) -> list[str]:
    """The named paths that do not exist under `root` (a glob: that match nothing)."""
    return sorted(
        path
        for path in named_paths(text)
        if not (any(root.glob(path)) if "*" in path else (root / path).exists())
    )


@pytest.mark.parametrize("path", texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(path):
    """Each path of this repository that a doc or script names (tests/..., scripts/...,
    streaming_backend/..., ...) is a file or folder of the checkout, or a glob that matches one."""
    assert missing(path.read_text(encoding="utf-8")) == []


def test_the_path_check_reads_paths_as_meant(tmp_path):
    """Moved test files are caught; URLs, other roots and templates are not this repository's."""
    (tmp_path / "tests" / "test_forward").mkdir(parents=True)
    (tmp_path / "tests" / "test_forward" / "test_llama.py").touch()
    text = (
        "pytest tests/test_llama.py tests/test_forward/test_llama.py tests/test_forward/.\n"
        "see tests/test_forward/test_*.py and tests/test_gone_*.py; POST /v2/repository/models/x\n"
        "$OUT/docs/run.txt ../docker/README.md clients/<name>_client.py in a sentence: docs/gone."
    )
    assert missing(text, tmp_path) == ["docs/gone", "tests/test_gone_*.py", "tests/test_llama.py"]


def test_performance_is_reference():
    """docs/performance.md stays a reference (settings, a current table per CPU kind; how to
    measure is docs/benchmarks.md): history lives in git and design facts in docs/design.md."""
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 320  # four CPU kinds, each a short section


# ---- docs/layout.md lists every file

LAYOUT = ROOT / "docs" / "layout.md"
# Every file of the checkout has its line in layout.md's Files block but those under tests/, which
# mirror the packages (tests/test_layout.py checks that). A line naming a folder (ending in "/")
# stands for every file in it.
UNLISTED_FOLDERS = ("tests/",)


def listed(text: str) -> list[str]:
    """The first word of each line of the fenced block under the '## Files' heading."""
    block = text.split("\n## Files\n", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def unlisted(files: list[str], entries: list[str]) -> list[str]:
    """The files that no entry names, themselves or by a folder (the tests' folder left out)."""
    named, folders = set(entries), tuple(e for e in entries if e.endswith("/"))
    return sorted(
        f
        for f in files
        if f not in named and not f.startswith(folders) and not f.startswith(UNLISTED_FOLDERS)
    )


def tracked_files() -> list[str]:
    """The checkout's files as git tracks them (those still on disk)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def test_layout_lists_every_file():
    """docs/layout.md's Files block has a line for each tracked file outside tests/ (scripts,
    docs, docker and the top level included), and each line names a file or folder that exists."""
    entries = listed(LAYOUT.read_text(encoding="utf-8"))
    assert unlisted(tracked_files(), entries) == []
    assert sorted(e for e in entries if not (ROOT / e).exists()) == []


def test_the_layout_check_reads_lines_and_folders():
    """A folder line covers its files, tests/ is left out, and a file with no line is caught."""
    text = "# x\n\n## Files\n\n```\na.py   one\nstatic/   the page\n```\n\n## Other\n"
    entries = listed(text)
    assert entries == ["a.py", "static/"]
    files = ["a.py", "static/x.js", "tests/test_a.py", "b.py", "static_b.py"]
    assert unlisted(files, entries) == ["b.py", "static_b.py"]
