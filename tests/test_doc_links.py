"""The markdown pages' relative links and images resolve, and the user-facing pages cite no tracker issues.

A link resolves when its file exists and, where it has a `#anchor` into a markdown file (or is an in-page
`#anchor`), that file has a heading whose GitHub-style slug is the anchor: GitHub lowercases the heading's text,
removes punctuation other than '-' and '_', turns each space into '-', and suffixes repeated slugs with -1, -2, ...
External links (http, https, mailto and other schemes) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pages(*patterns: str) -> list[Path]:
    found: set[Path] = set()
    for pattern in patterns:
        found.update(path for path in ROOT.glob(pattern) if path.is_file())
    return sorted(found)


LINKED_PAGES = _pages("README.md", "CHANGELOG.md", "benchmarks/README.md", "examples/**/*.md", "docs/**/*.md")
USER_PAGES = _pages("README.md", "docs/**/*.md")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for the lines outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)[0] * len(opening.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
                fence = None
            continue
        lines.append((number, line))
    return lines


def _without_code_spans(line: str) -> str:
    """The line with each inline code span's content blanked out (so `x[0](y)` in code is no link)."""
    return CODE_SPAN.sub(lambda match: "`" + "x" * len(match.group(2)) + "`", line)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger, before duplicate suffixes)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images count by their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def heading_anchors(text: str) -> set[str]:
    """Every anchor a markdown page defines: its headings' slugs (duplicates suffixed) and HTML anchors."""
    anchors: set[str] = set()
    occurrences: dict[str, int] = {}
    previous: str | None = None

    def add(heading: str) -> None:
        slug = original = github_slug(heading)
        while slug in occurrences:
            occurrences[original] += 1
            slug = f"{original}-{occurrences[original]}"
        occurrences[slug] = 0
        anchors.add(slug)

    for _, line in _prose_lines(text):
        anchors.update(HTML_ANCHOR.findall(line))
        atx = ATX_HEADING.match(line)
        if atx:
            add(atx.group(2) or "")
            previous = None
            continue
        setext = SETEXT_UNDERLINE.match(line)
        if setext and previous is not None and previous.strip():
            add(previous)
            previous = None
            continue
        previous = line if line.strip() and not line.startswith(("    ", "\t", ">", "|")) else None
    return anchors


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    targets = []
    for number, line in _prose_lines(text):
        line = _without_code_spans(line)
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            targets.append((number, definition.group(1)))
            continue
        targets.extend((number, match.group(1)) for match in INLINE_LINK.finditer(line))
    return [(number, target.strip("<>")) for number, target in targets]


def broken_links(page: Path) -> list[str]:
    """One message per relative link or anchor of `page` that does not resolve."""
    text = page.read_text(encoding="utf-8")
    name = page.relative_to(ROOT)
    anchors_of: dict[Path, set[str]] = {page: heading_anchors(text)}
    problems = []
    for number, target in link_targets(text):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # external: http(s), mailto, ...
        path_part, _, anchor = target.partition("#")
        path_part, anchor = unquote(path_part), unquote(anchor)
        if path_part:
            base = ROOT if path_part.startswith("/") else page.parent
            destination = (base / path_part.lstrip("/")).resolve()
            if not destination.exists():
                problems.append(f"{name}:{number}: {target!r}: no file {path_part!r}")
                continue
        else:
            destination = page
        if not anchor or destination.suffix.lower() != ".md" or not destination.is_file():
            continue  # no anchor, or one into a file GitHub anchors by other rules (source lines)
        if destination not in anchors_of:
            anchors_of[destination] = heading_anchors(destination.read_text(encoding="utf-8"))
        if anchor not in anchors_of[destination]:
            where = "this page" if destination == page else str(destination.relative_to(ROOT))
            problems.append(f"{name}:{number}: {target!r}: no heading with anchor #{anchor} in {where}")
    return problems


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


# "issue 16", "issues #9", "issue-16", "PR 12"; and a bare "#16" not part of a word, path, entity or anchor.
ISSUE_WORD = re.compile(r"\b(?:issues?|PRs?|pull requests?)\b[ \t#-]*\d+", re.IGNORECASE)
BARE_NUMBER = re.compile(r"(?<![\w/&#])#\d+\b")
# "step #3", "rank #1", "row #12": ordinals, not tracker numbers.
ORDINAL_NOUN = re.compile(
    r"\b(?:step|row|rank|seed|run|turn|layer|process|gpu|epoch|rollout|sample|group|token|completion|episode|"
    r"chunk|pass|item|call|trial|no\.?|number)s?\s*$",
    re.IGNORECASE,
)


def tracker_mentions(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every tracker issue number in the page's prose."""
    found = []
    for number, line in _prose_lines(text):
        line = _without_code_spans(line)
        line = INLINE_LINK.sub(lambda match: match.group(0).split("](", 1)[0] + "]", line)  # drop link targets
        line = re.sub(r"https?://\S+", "", line)
        found.extend((number, match.group(0)) for match in ISSUE_WORD.finditer(line))
        for match in BARE_NUMBER.finditer(line):
            if not ORDINAL_NOUN.search(line[: match.start()]):
                found.append((number, match.group(0)))
    return found


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_user_pages_cite_no_tracker_issues(page: Path):
    mentions = tracker_mentions(page.read_text(encoding="utf-8"))
    name = page.relative_to(ROOT)
    assert not mentions, (
        "tracker issue numbers in a user-facing page (say what the target or measurement is instead):\n"
        + "\n".join(f"{name}:{number}: {text!r}" for number, text in mentions)
    )


def test_the_checks_catch_what_they_look_for():
    page = "# Title\n\n## Set-up: `pip` & more\n\n## Set-up: `pip` & more\n\n```\n[no](missing.md)\n```\n"
    assert heading_anchors(page) == {"title", "set-up-pip--more", "set-up-pip--more-1"}
    assert github_slug("Skipping the π_old pass (paper §5.4)") == "skipping-the-π_old-pass-paper-54"
    assert github_slug("[`rollout_func`](agents.md): yours") == "rollout_func-yours"
    assert link_targets(page) == []
    assert link_targets('see [a](b.md#c "t") and ![img](d.png) and `[x](y.md)`\n[ref]: e.md\n') == [
        (1, "b.md#c"),
        (1, "d.png"),
        (2, "e.md"),
    ]
    text = "Met issue 16's target.\nSee #12.\nAt step #3, row #4.\nColour #1f77b4, [link](#16-x), `#9`.\n"
    assert tracker_mentions(text) == [(1, "issue 16"), (2, "#12")]
