"""The documentation holds together: every relative link and image in README.md and docs/ points
at a file that exists, every ``#anchor`` at a heading that exists (GitHub's slugs), no issue
numbers in user documentation, and a README that stays short and starts with the two commands.

No network: links with a scheme (http, https, mailto) are not followed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_CHARS = 16_000


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target "title") and ![alt](target): the target up to whitespace or ')', or in <...>.
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ATTR = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
ISSUE_WORDING = re.compile(r"\bissues? #?\d+", re.I)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(2)
                continue
            out.append((number, line))
        elif m and m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence) \
                and not line.strip()[len(m.group(2)):].strip():
            fence = None
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character but letters,
    digits, '_', '-' and spaces dropped, each space a '-'."""
    parts = []
    for i, part in enumerate(re.split(r"(`+[^`]*`+)", heading)):
        if i % 2:  # a code span: its text as written
            parts.append(part.strip("`"))
            continue
        part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)  # a link's text, not its target
        part = re.sub(r"<[^>]+>", "", part)  # inline HTML
        part = re.sub(r"\*{1,3}(\S(?:.*?\S)?)\*{1,3}", r"\1", part)  # emphasis markers; '_' only
        parts.append(re.sub(r"(?<!\w)_{1,3}(\S(?:.*?\S)?)_{1,3}(?!\w)", r"\1", part))  # around words
    text = "".join(parts).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: its headings' slugs (a repeated one gets -1, -2, ...)
    and explicit ``<a name=...>`` / ``id=...`` targets."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(re.findall(r"""<a\b[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""", line, re.I))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link, image and reference definition outside code."""
    out: list[tuple[int, str]] = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        bare = CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in INLINE_LINK.finditer(bare)]
        targets += [m.group(1) for m in REFERENCE_DEF.finditer(bare)]
        targets += HTML_ATTR.findall(bare)
        out += [(number, t[1:-1] if t.startswith("<") and t.endswith(">") else t) for t in targets]
    return out


def broken_links(path: Path) -> list[str]:
    """What is wrong with path's relative links, one line each (empty: nothing)."""
    problems: list[str] = []
    rel = path.relative_to(ROOT)
    for number, target in links(path):
        if SCHEME.match(target):
            continue  # http(s), mailto: not checked here
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        if not file_part:
            dest = path
        elif file_part.startswith("/"):
            dest = (ROOT / file_part.lstrip("/")).resolve()
        else:
            dest = (path.parent / file_part).resolve()
        where = f"{rel}:{number}: {target}"
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where}: outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: {dest.relative_to(ROOT)} does not exist")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers_in_user_documentation(path: Path) -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}"
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for m in ISSUE_WORDING.finditer(line)]
    assert not found, "describe behaviour, not history:\n" + "\n".join(found)


def test_the_documentation_has_links_to_check() -> None:
    """The checker sees the links (a parser that found none would pass everything)."""
    assert len(links(README)) >= 15
    assert sum(len(links(p)) for p in doc_files()) >= 60
    assert any(t.startswith("screenshots/") and t.endswith(".svg") for _, t in links(README))


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text) < README_MAX_CHARS, f"README.md has {len(text):,} characters"
    lines = text.splitlines()
    assert lines[0].startswith("# "), lines[0]
    block = lines[lines.index("```sh"):]
    assert lines.index("```sh") <= 3, "the two commands come first"
    assert block[1].startswith("make demo"), block[1]
    assert block[2].startswith("make test"), block[2]
    assert block[3] == "```", block[3]


def test_the_checker_finds_what_is_broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text(
        "# A\n\n## Sizing Redis, for `N` nodes\n\n## Same\n\n## Same\n\n"
        "## **Log** (`{J}:<node>`) of restart_storm\n")
    page = tmp_path / "docs" / "B.md"
    page.write_text(
        "# B\n\n"
        "[ok](A.md#sizing-redis-for-n-nodes) [ok](A.md#same-1) [ok](#b) ![ok](A.md) [web](https://x.org/y)\n"
        "[ok](A.md#log-jnode-of-restart_storm)\n"
        "`[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
        "[gone](missing.md) [no anchor](A.md#nope) [here](#nothing) [up](../../outside.md)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = broken_links(page)
    assert len(problems) == 4, problems
    assert [p.split(": ")[1] for p in problems] == [
        "missing.md", "A.md#nope", "#nothing", "../../outside.md"]
