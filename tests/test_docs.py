"""The documentation's shape: README.md fits in 400 lines, prose lines of README.md and docs/*.md stay within 160
characters (code blocks and table rows excepted), every relative link points at a file that exists and, with a
``#anchor``, at a heading of that file (GitHub's slug rule), and every docs/ page is linked from the README and
links back to it. The shell commands in them are checked in test_first_hour and test_cli."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
MAX_README_LINES = 400
MAX_LINE = 160
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside ``` blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside ``` blocks that is not a table row."""
    return [(n, line) for n, line in outside_code(text) if not line.lstrip().startswith("|")]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (``-`` and ``_`` kept), spaces -> ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated slug gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in outside_code(text):
        m = re.match(r"#{1,6} (.+?)\s*#*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside code (tables included, inline code spans left out)."""
    out = []
    for n, line in outside_code(text):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            out.append((n, target))
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``path`` whose file, or heading anchor, does not exist (named relative to ``root``)."""
    bad, name = [], path.relative_to(root)
    for n, target in links(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{name}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{name}:{n}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def test_the_checks_catch_what_they_look_for(tmp_path):
    assert slug("Strength: `norm`, calibrate, sweep") == "strength-norm-calibrate-sweep"
    assert slug("Quickstart (CPU)") == "quickstart-cpu" and slug("How it works (short)") == "how-it-works-short"
    assert slug("`--api-server-count` and max_configs") == "--api-server-count-and-max_configs"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B c.\n") == {"a", "a-1", "b-c"}
    (tmp_path / "other.md").write_text("# Other\n\n## Site names\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#site-names) [gone](missing.md) [bad](other.md#sites) `[code](nowhere.md)`\n"
                    "[self](#page) [web](https://example.com/x.md)\n```\n[fenced](nowhere.md)\n```\n# Page\n"
                    "| [in a table](gone.md) |\n")
    assert broken_links(page, tmp_path) == ["page.md:1: missing.md (no such file)",
                                            "page.md:1: other.md#sites (no heading #sites in other.md)",
                                            "page.md:7: gone.md (no such file)"]
    assert prose_lines("a\n| x |\n```\nlong\n```\nb\n") == [(1, "a"), (6, "b")]


def test_readme_fits_in_400_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move a section to docs/"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_lines_are_at_most_160_characters(path):
    long = [f"{path.relative_to(ROOT)}:{n}: {len(line)} characters"
            for n, line in prose_lines(path.read_text()) if len(line) > MAX_LINE]
    assert not long, long


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(path):
    assert not broken_links(path)


def test_every_docs_page_is_linked_from_the_readme_and_links_back():
    assert len(PAGES) >= 8, PAGES  # requests, modules, SAE, capture, conditions, extraction, operating, performance
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README.read_text())}
    for page in PAGES:
        assert page.resolve() in linked, f"README.md does not link docs/{page.name}"
        head = page.read_text().splitlines()[:5]
        assert head[0].startswith("# ") and "](../README.md)" in "\n".join(head), f"docs/{page.name}: {head}"
