"""Write a benchmark's generated run into its RESULTS file without touching the rest.

Each RESULTS-*.md opens with a hand-written "## Current figures" and keeps older runs under
"## Earlier runs"; a benchmark owns only the part between its two markers,
`<!-- NAME:begin -->` and `<!-- NAME:end -->`, and replaces that part alone. Every benchmark
that writes a RESULTS file goes through `replace_section`, so a rerun never wipes the
hand-written text. This module imports no other benchmark (issue 37: one-way imports).
"""

from __future__ import annotations

from pathlib import Path


class ResultsError(ValueError):
    """A RESULTS file's markers are missing, doubled or out of order."""


def markers(name: str) -> tuple[str, str]:
    """The begin and end marker lines of section `name`."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def splice(text: str, name: str, body: str) -> str:
    """`text` with the lines between section `name`'s markers replaced by `body`."""
    begin, end = markers(name)
    for marker in (begin, end):
        count = text.count(marker)
        if count != 1:
            found = "missing" if count == 0 else f"found {count} times"
            raise ResultsError(
                f"marker {marker!r} is {found}; the file needs exactly one {begin} ... {end} "
                "pair around the generated run"
            )
    start = text.index(begin) + len(begin)
    stop = text.index(end)
    if stop < start:
        raise ResultsError(f"marker {end!r} comes before {begin!r}")
    # The markers sit on their own lines: keep the newline after begin and the one before end.
    return text[:start] + "\n" + body.strip("\n") + "\n" + text[stop:]


def replace_section(path: Path, name: str, body: str) -> None:
    """Replace section `name` of the RESULTS file `path` with `body`; the rest stays byte-identical.

    A file that does not exist yet (a run sent to a fresh `--out`) is created holding only the
    section, between its markers. Raises ResultsError (naming the file) when an existing file
    lacks the section's markers, has them twice or in the wrong order; the file is then left
    as it was.
    """
    if not path.exists():
        begin, end = markers(name)
        path.write_text(f"{begin}\n{body.strip(chr(10))}\n{end}\n")
        return
    text = path.read_text()
    try:
        new = splice(text, name, body)
    except ResultsError as err:
        raise ResultsError(f"{path}: {err}") from None
    path.write_text(new)
