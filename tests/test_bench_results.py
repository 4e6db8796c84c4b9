"""benchmarks/results.py: a benchmark rewrites only its own marked run in a RESULTS file, so a
rerun never wipes the hand-written "Current figures" opening or the earlier runs; markers that
are missing, doubled or out of order stop the write with an error naming the file and marker.
The RESULTS files carry the markers every benchmark's write names."""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from support.paths import REPO

BENCHMARKS = REPO / "benchmarks"


def _results() -> ModuleType:
    # Loaded from its path: benchmarks/ is not a package, and `results` is too common a name to
    # put benchmarks/ on sys.path for the whole test session.
    spec = importlib.util.spec_from_file_location("bench_results", BENCHMARKS / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results = _results()

OPENING = "# Some benchmark\n\n## Current figures\n\nHand-written: 1.23 s, commit abc1234.\n\n"
BEFORE_A = "## The run in detail\n\n<!-- bench_a:begin -->\n"
OLD_A = "Command: `old a`\n\n| x | 1 |\n"
BETWEEN = "<!-- bench_a:end -->\n\nReading, by hand.\n\n## Earlier runs\n\n<!-- bench_b:begin -->\n"
OLD_B = "Command: `old b`\n"
CLOSING = "<!-- bench_b:end -->\n\nTrailing notes  \nwith odd   spacing\n"


def _file(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "RESULTS-x.md"
    text = OPENING + BEFORE_A + OLD_A + BETWEEN + OLD_B + CLOSING
    path.write_text(text)
    return path, text


def test_replaces_only_its_section(tmp_path: Path) -> None:
    path, _ = _file(tmp_path)
    results.replace_section(path, "bench_a", "Command: `new a`\n\n| x | 2 |")
    assert path.read_text() == (
        OPENING + BEFORE_A + "Command: `new a`\n\n| x | 2 |\n" + BETWEEN + OLD_B + CLOSING
    )
    results.replace_section(path, "bench_b", "\n\nCommand: `new b`\n\n")
    assert path.read_text() == (
        OPENING
        + BEFORE_A
        + "Command: `new a`\n\n| x | 2 |\n"
        + BETWEEN
        + "Command: `new b`\n"
        # the other section and everything outside both stay byte for byte
        + CLOSING
    )


def test_the_same_run_again_changes_nothing(tmp_path: Path) -> None:
    path, text = _file(tmp_path)
    results.replace_section(path, "bench_a", OLD_A)
    assert path.read_text() == text


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (
            lambda t: t.replace("<!-- bench_a:begin -->\n", ""),
            "'<!-- bench_a:begin -->' is missing",
        ),
        (lambda t: t.replace("<!-- bench_a:end -->\n", ""), "'<!-- bench_a:end -->' is missing"),
        (lambda t: t + "<!-- bench_a:begin -->\n", "'<!-- bench_a:begin -->' is found 2 times"),
        (lambda t: t + "<!-- bench_a:end -->\n", "'<!-- bench_a:end -->' is found 2 times"),
        (
            lambda t: (
                t.replace("<!-- bench_a:begin -->", "@@")
                .replace("<!-- bench_a:end -->", "<!-- bench_a:begin -->")
                .replace("@@", "<!-- bench_a:end -->")
            ),
            "'<!-- bench_a:end -->' comes before '<!-- bench_a:begin -->'",
        ),
    ],
    ids=["no-begin", "no-end", "two-begins", "two-ends", "end-first"],
)
def test_refuses_bad_markers_and_leaves_the_file(
    tmp_path: Path, edit: Callable[[str], str], says: str
) -> None:
    path, text = _file(tmp_path)
    broken = edit(text)
    path.write_text(broken)
    with pytest.raises(results.ResultsError) as err:
        results.replace_section(path, "bench_a", "Command: `new a`")
    assert str(path) in str(err.value) and says in str(err.value)
    assert path.read_text() == broken


def test_a_new_file_holds_only_the_section(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "RESULTS-new.md"
    path.parent.mkdir()
    results.replace_section(path, "bench_a", "Command: `a`\n")
    assert path.read_text() == "<!-- bench_a:begin -->\nCommand: `a`\n<!-- bench_a:end -->\n"


def _written_sections() -> list[tuple[str, str]]:
    """(script, section name) for every replace_section call with a literal name in benchmarks/."""
    found: list[tuple[str, str]] = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        source = script.read_text()
        for name in re.findall(r"replace_section\(\s*[^,]+,\s*\"([^\"]+)\"", source):
            found.append((script.name, name))
    return found


def test_every_benchmark_write_has_its_markers_once() -> None:
    written = _written_sections()
    # the scripts that wrote RESULTS files before the helper (issue 37) all go through it now
    assert {script for script, _ in written} >= {
        "bench_arc.py",
        "bench_engine_front.py",
        "bench_fanout.py",
        "bench_hints.py",
        "bench_router.py",
        "bench_sidecar.py",
        "bench_sparse_load.py",
        "sparse_runs.py",
    }
    texts = {p.name: p.read_text() for p in BENCHMARKS.glob("RESULTS-*.md")}
    for script, name in written:
        begin, end = results.markers(name)
        holders = [f for f, t in texts.items() if begin in t]
        assert len(holders) == 1, f"{script}: section {name} in {holders or 'no RESULTS file'}"
        text = texts[holders[0]]
        assert text.count(begin) == 1 and text.count(end) == 1, (holders[0], name)
        assert text.index(begin) < text.index(end), (holders[0], name)
        if "## Current figures" in text:
            # a run is written below the hand-written opening, never in its first lines
            assert text.index("## Current figures") < text.index(begin), (holders[0], name)


def test_rewriting_each_results_section_as_it_is_keeps_the_file(tmp_path: Path) -> None:
    for source in sorted(BENCHMARKS.glob("RESULTS-*.md")):
        copy = tmp_path / source.name
        shutil.copy(source, copy)
        text = source.read_text()
        for name in re.findall(r"<!-- (\S+):begin -->", text):
            begin, end = results.markers(name)
            results.replace_section(
                copy, name, text[text.index(begin) + len(begin) : text.index(end)]
            )
        assert copy.read_text() == text, source.name
