"""The product's Python modules, where they live, and a report of the largest.

`tests/test_layers.py` reads the import graph of these modules; `make test` (through
`tests/conftest.py`) ends with the ten largest, a report to read, not a limit to cut code to:
a module is split where it holds more than one responsibility, whatever its length.
"""

from __future__ import annotations

from pathlib import Path

from support.paths import REPO

#: Each top-level package of the product and its folder.
ROOTS = {
    "hotload": REPO / "hotload",
    "hotload_patch": REPO / "hotload_patch",
    "hotload_operator": REPO / "operator" / "hotload_operator",
    "hotload_sidecar": REPO / "sidecar" / "hotload_sidecar",
}


def product_modules() -> dict[str, Path]:
    """Every module of the product's packages, by dotted name (stubs of extension modules
    too, where no source module has the name)."""
    found: dict[str, Path] = {}
    for top, root in ROOTS.items():
        for path in sorted(root.rglob("*.py*")):
            if path.suffix not in (".py", ".pyi"):
                continue
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if path.suffix == ".py" or name not in found:
                found[name] = path
    return found


def largest_modules(count: int = 10) -> list[tuple[int, str]]:
    """The `count` longest modules as (lines, path relative to the repository), longest
    first."""
    sizes = [
        (len(path.read_text().splitlines()), str(path.relative_to(REPO)))
        for path in product_modules().values()
    ]
    return sorted(sizes, key=lambda s: (-s[0], s[1]))[:count]


def size_report(count: int = 10) -> list[str]:
    """The lines of the report: a title, then one line per module."""
    return [f"the {count} largest modules (lines; split by responsibility, not by length):"] + [
        f"{lines:6d}  {path}" for lines, path in largest_modules(count)
    ]
