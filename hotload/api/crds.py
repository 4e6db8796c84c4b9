"""CustomResourceDefinitions generated from the pydantic models in `hotload.api.models`, and
the files made from them.

The models are the single source of truth: `crd_schema` turns their JSON schema into the
structural `openAPIV3Schema` an API server accepts, `crd_kinds` adds names, subresources,
printer columns and CEL rules, `crd_docs` writes the field reference.
`python -m hotload.api.crds --write` regenerates `crds/*.yaml` and `docs/crds.md`; `--check`
says whether the committed files are current.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hotload.api.crd_docs import render_docs
from hotload.api.crd_kinds import (
    CRDS_DIR,
    DOCS_PATH,
    HEADER,
    KINDS,
    WRITE_COMMAND,
    build_crd,
    build_crds,
    crd_filename,
    crd_name,
    openapi_schema,
)
from hotload.api.crd_schema import structural_schema

__all__ = [
    "CRDS_DIR",
    "DOCS_PATH",
    "HEADER",
    "KINDS",
    "WRITE_COMMAND",
    "build_crd",
    "build_crds",
    "check",
    "crd_filename",
    "crd_name",
    "generated_files",
    "main",
    "openapi_schema",
    "render_all",
    "render_crd",
    "render_docs",
    "structural_schema",
    "write",
]


def render_crd(kind: str) -> str:
    """One CRD as the YAML text committed under `crds/`, header comment included."""
    return HEADER + _dump(build_crd(kind))


def render_all() -> str:
    """Every CRD as one multi-document YAML stream (for `kubectl apply -f -`)."""
    return "".join(f"---\n{render_crd(kind)}" for kind in KINDS)


def generated_files() -> dict[str, str]:
    """Every generated file, keyed by its path relative to the repository root."""
    files = {f"{CRDS_DIR}/{crd_filename(kind)}": render_crd(kind) for kind in KINDS}
    files[DOCS_PATH] = render_docs(build_crds())
    return files


def write(root: Path, *, docs: bool = True) -> list[Path]:
    """Write the generated files under `root`; return the paths written."""
    written = []
    for rel, text in generated_files().items():
        if rel == DOCS_PATH and not docs:
            continue
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def check(root: Path, *, max_diff_lines: int = 40) -> list[str]:
    """Compare the files under `root` with freshly generated ones; return a diff summary
    (empty when every file is current)."""
    report: list[str] = []
    for rel, text in generated_files().items():
        path = root / rel
        if not path.exists():
            report.append(f"{rel}: missing")
            continue
        current = path.read_text(encoding="utf-8")
        if current == text:
            continue
        diff = list(
            difflib.unified_diff(
                current.splitlines(),
                text.splitlines(),
                f"{rel} (committed)",
                f"{rel} (generated)",
                lineterm="",
            )
        )
        added = sum(1 for d in diff[2:] if d.startswith("+"))
        removed = sum(1 for d in diff[2:] if d.startswith("-"))
        report.append(f"{rel}: out of date (+{added} -{removed} lines)")
        report.extend("    " + d for d in diff[:max_diff_lines])
        if len(diff) > max_diff_lines:
            report.append(f"    ... {len(diff) - max_diff_lines} more diff lines")
    return report


def _dump(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False, width=100, allow_unicode=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate (`--write`) or verify (`--check`) the CRDs and their docs; return the exit
    code (1 when `--check` finds a file out of date)."""
    parser = argparse.ArgumentParser(
        prog="python -m hotload.api.crds",
        description="Generate the hotload CustomResourceDefinitions (crds/*.yaml) and their "
        "field reference (docs/crds.md) from the pydantic models in hotload/api/models.py.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the files")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 with a diff when a file is out of date"
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path.cwd(),
        help="repository root holding crds/ and docs/ (default: the current directory)",
    )
    args = parser.parse_args(argv)
    if args.write:
        for path in write(args.root):
            print(f"wrote {path}")
        return 0
    report = check(args.root)
    if report:
        print("\n".join(report), file=sys.stderr)
        print(f"generated files are out of date: run `{WRITE_COMMAND}`", file=sys.stderr)
        return 1
    print("generated files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
