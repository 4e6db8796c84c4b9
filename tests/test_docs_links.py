"""The user-facing docs point only at what a user of a clone has.

Read: README.md, every docs/*.md (docs/crds.md included: fix a hit there in its generator,
hotload/api/crd_docs.py, then `python -m hotload.api.crds --write`), examples/README.md,
benchmarks/README.md, tests/README.md, charts/hotload/README.md when there is one, and
charts/hotload/templates/NOTES.txt (what `helm install` prints; machine paths only).

Two checks, each failing with every hit as `file:line: problem`:

(a) No paths of the project's own machines, anywhere in a file (code blocks included: a user
copies them): `/work/` (the machines' work tree), `/root/`, pytest's `/tmp/pytest-of-...`
folders, and the steering repository's notes, `DESIGN.md` and `NOTES.md` (`shared/DESIGN.md`,
`../shared/NOTES.md`, or the bare name: this repository has neither file). `../shared` (the
folder beside the clone holding the shared control plane, `../shared/k8s`) is a contributor's
matter: it may appear only in tests/README.md (the test suite's guide) and, in README.md, only
inside a section whose heading names contributors (a heading containing "contribut", e.g.
"## For contributors" or "## Contributing", down to the next heading of the same or a higher
level, its subsections included). Nowhere in docs/, examples/, benchmarks/ or charts/.

(b) Every relative link resolves: `[text](path)`, `[text](path#anchor)` and `[text](#anchor)`
outside code (fenced blocks and inline code are not links). The path, relative to the file
that links, must exist inside the repository; an anchor into a markdown file must be the
GitHub slug of one of its headings (lowercased; punctuation but `-` and `_` removed; each space
a `-`; inline code, emphasis and link syntax reduced to their text; a repeated heading's slug
gets `-1`, `-2`, ...) or an explicit `<a name=...>`/`<a id=...>`. Links with a scheme
(`https:`, `mailto:`, ...) are not checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

from support.paths import REPO

#: The markdown files a user reads (links and machine paths are checked).
MARKDOWN: list[Path] = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "examples" / "README.md",
    REPO / "benchmarks" / "README.md",
    REPO / "tests" / "README.md",
    *([REPO / "charts/hotload/README.md"] if (REPO / "charts/hotload/README.md").exists() else []),
]
#: Files only checked for machine paths (not markdown).
PLAIN: list[Path] = [REPO / "charts" / "hotload" / "templates" / "NOTES.txt"]

#: Where `../shared` may appear anywhere in the file.
SHARED_ANYWHERE = {REPO / "tests" / "README.md"}
#: Where `../shared` may appear inside a contributors' section only.
SHARED_IN_CONTRIBUTOR_SECTION = {REPO / "README.md"}
CONTRIBUTOR_HEADING = re.compile(r"contribut", re.IGNORECASE)

#: Paths of the project's machines that no user has, with what is wrong with each.
MACHINE_PATHS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?<![\w.-])/work/"), "the project machines' work tree"),
    (re.compile(r"(?<![\w.-])/root/"), "a machine's root home folder"),
    (re.compile(r"(?<![\w.-])/tmp/pytest-of-"), "a pytest temp folder of one machine"),
    (
        re.compile(r"(?<![\w-])(?:[\w./-]*/)?(?:DESIGN|NOTES)\.md\b"),
        "the steering repository's notes, which users do not have",
    ),
]
SHARED = re.compile(r"(?<![\w.-])\.\./shared(?![\w-])")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
EXPLICIT_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""", re.IGNORECASE)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
# [text](target) or ![alt](target), the text possibly holding one level of brackets and
# newlines, the target possibly in <...> and followed by a "title".
LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^\s()]+(?:\([^\s()]*\)[^\s()]*)*)"
    r"(?:\s+\"[^\"]*\")?\s*\)"
)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def blank_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked out (`x`s, newlines kept, so
    offsets and line numbers stay), for finding links only where markdown renders them."""
    lines = text.split("\n")
    out: list[str] = []
    fence: str | None = None
    for line in lines:
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * len(opened.group(1))
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            out.append("")
        else:
            out.append(line)
    # Code spans do not cross paragraphs (blank lines).
    paragraphs = re.split(r"(\n[ \t]*\n)", "\n".join(out))
    return "".join(
        CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", "x", m.group(0)), p) for p in paragraphs
    )


@dataclass(frozen=True)
class Heading:
    line: int  # 1-based
    level: int
    text: str


def headings(text: str) -> list[Heading]:
    """ATX headings outside fenced code blocks."""
    found: list[Heading] = []
    fence: str | None = None
    for number, line in enumerate(text.split("\n"), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * len(opened.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        match = HEADING.match(line)
        if match:
            found.append(Heading(number, len(match.group(1)), match.group(2)))
    return found


def rendered(heading: str) -> str:
    """A heading's text as GitHub renders it: code spans' content, links' text, no emphasis."""
    parts = re.split(r"(`+[^`]*?`+)", heading)
    return "".join(
        part.strip("`").strip(" ") if part.startswith("`") else _plain(part) for part in parts
    )


def _plain(text: str) -> str:
    """Heading text outside code spans, as rendered: links' text, no HTML, escapes or emphasis."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"\\(.)", r"\1", text)  # escapes
    text = text.replace("*", "")
    return re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_, not snake_case


def slug(text: str) -> str:
    """GitHub's slug of one heading text (github-slugger, before de-duplication)."""
    return re.sub(r"[^\w\- ]", "", rendered(text).strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor GitHub makes for a markdown file: de-duplicated heading slugs, and explicit
    `<a name>`/`<a id>` anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in headings(text):
        base = result = slug(heading.text)
        while result in seen:
            seen[base] += 1
            result = f"{base}-{seen[base]}"
        seen[result] = 0
        found.add(result)
    found |= set(EXPLICIT_ANCHOR.findall(blank_code(text)))
    return found


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def contributor_lines(text: str) -> set[int]:
    """The lines inside sections whose heading names contributors, subsections included."""
    lines: set[int] = set()
    all_headings = headings(text)
    total = text.count("\n") + 1
    for i, heading in enumerate(all_headings):
        if not CONTRIBUTOR_HEADING.search(heading.text):
            continue
        end = next((h.line for h in all_headings[i + 1 :] if h.level <= heading.level), total + 1)
        lines |= set(range(heading.line, end))
    return lines


def machine_path_hits(path: Path, text: str) -> list[str]:
    hits: list[str] = []
    allowed_shared: set[int] | None = None  # None: nowhere
    if path in SHARED_ANYWHERE:
        allowed_shared = set(range(1, text.count("\n") + 2))
    elif path in SHARED_IN_CONTRIBUTOR_SECTION:
        allowed_shared = contributor_lines(text)
    for number, line in enumerate(text.split("\n"), 1):
        for pattern, why in MACHINE_PATHS:
            for match in pattern.finditer(line):
                hits.append(f"{rel(path)}:{number}: `{match.group(0)}`: {why}")
        if SHARED.search(line) and (allowed_shared is None or number not in allowed_shared):
            where = (
                "outside a section whose heading names contributors"
                if path in SHARED_IN_CONTRIBUTOR_SECTION
                else "in a user's doc"
            )
            hits.append(
                f"{rel(path)}:{number}: `../shared` {where}: users have no ../shared beside"
                " their clone (see this test's docstring for where it may appear)"
            )
    return hits


def link_hits(path: Path, text: str) -> list[str]:
    hits: list[str] = []
    blanked = blank_code(text)
    cache: dict[Path, set[str]] = {}
    for match in LINK.finditer(blanked):
        target = match.group(1).strip("<>")
        if not target or SCHEME.match(target):
            continue
        where = f"{rel(path)}:{line_of(blanked, match.start())}: link `{target}`"
        file_part, _, fragment = target.partition("#")
        if not file_part:  # this file's own anchors
            if unquote(fragment) not in cache.setdefault(path, anchors(text)):
                hits.append(f"{where}: no heading of {rel(path)} has the slug `{fragment}`")
            continue
        resolved = (path.parent / unquote(file_part)).resolve()
        if not resolved.is_relative_to(REPO):
            hits.append(f"{where}: points outside the repository")
            continue
        if not resolved.exists():
            hits.append(f"{where}: {rel(resolved)} does not exist")
            continue
        if not fragment or resolved.suffix != ".md" or not resolved.is_file():
            continue
        if resolved not in cache:
            cache[resolved] = anchors(resolved.read_text())
        if unquote(fragment) not in cache[resolved]:
            hits.append(f"{where}: no heading of {rel(resolved)} has the slug `{fragment}`")
    return hits


@pytest.mark.parametrize("path", MARKDOWN + PLAIN, ids=rel)
def test_no_machine_paths(path: Path) -> None:
    hits = machine_path_hits(path, path.read_text())
    assert not hits, "paths of the project's machines:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_relative_links_resolve(path: Path) -> None:
    hits = link_hits(path, path.read_text())
    assert not hits, "broken links:\n" + "\n".join(hits)


def test_every_doc_is_read() -> None:
    assert all(p.is_file() for p in MARKDOWN + PLAIN)
    assert len(MARKDOWN) >= 15


# The checks themselves, on made-up files.


def test_slugs_follow_github() -> None:
    text = "\n".join(
        [
            "# Hot loads: the `Publisher` (v2)",
            "## The two commands",
            "## The two commands",
            "## The two commands",
            "### 7.3 `sparse_exp`",
            "## What's *new*, and [links](x.md)",
            "```",
            "# not a heading",
            "```",
            '<a name="explicit"></a>',
        ]
    )
    assert anchors(text) == {
        "hot-loads-the-publisher-v2",
        "the-two-commands",
        "the-two-commands-1",
        "the-two-commands-2",
        "73-sparse_exp",
        "whats-new-and-links",
        "explicit",
    }


def test_links_outside_code_are_checked() -> None:
    doc = REPO / "docs" / "made-up.md"  # never written: only its folder matters
    text = "\n".join(
        [
            "# Title",
            "## A section",
            "[ok](#a-section) [ok](architecture.md#layers) [ok](../README.md) [web](https://x/y#z)",
            "[missing](nowhere.md) [bad anchor](#no-such) [bad](architecture.md#nope)",
            "`[in code](nowhere.md)`",
            "```",
            "[in a block](nowhere.md)",
            "```",
            "[multi",
            "line](../examples/none.yaml)",
        ]
    )
    hits = link_hits(doc, text)
    assert [h.split(": ", 1)[0] for h in hits] == ["docs/made-up.md:4"] * 3 + ["docs/made-up.md:9"]
    assert "nowhere.md does not exist" in hits[0]
    assert "`no-such`" in hits[1] and "docs/made-up.md" in hits[1]
    assert "`nope`" in hits[2] and "docs/architecture.md" in hits[2]


def test_shared_only_in_a_contributor_section() -> None:
    readme = REPO / "README.md"
    text = "\n".join(
        [
            "# hotload",
            "Run it against ../shared/k8s.",  # 2: a hit
            "## For contributors",
            "CI has ../shared/k8s beside the clone.",  # 4: allowed
            "### Lanes",
            "../shared again.",  # 6: allowed, a subsection
            "## Installing",
            "not ../shared here; nor /work/shared/NOTES.md",  # 8: two hits (and NOTES.md)
        ]
    )
    lines = sorted(int(h.split(":")[1]) for h in machine_path_hits(readme, text))
    assert lines == [2, 8, 8, 8]
    docs_hits = machine_path_hits(REPO / "docs" / "made-up.md", "CI has ../shared/k8s")
    assert len(docs_hits) == 1
    assert not machine_path_hits(REPO / "tests" / "README.md", "# Tests\n../shared/k8s")
