"""The shape of the code: no import circles, the layers of docs/architecture.md.

The import graph of `hotload`, `hotload_operator` and `hotload_sidecar` is read from the source
with `ast`. Function-level imports count as much as module-level ones: an import moved into a
function still runs, so it only hides a circle from readers, it does not remove it. Imports
under `if TYPE_CHECKING:` count too (they are how one module's types reach another, and a
circle among them still ties the modules' meaning together).

An edge goes to the module an import names: `from a.b import c` reaches `a.b.c` when that is a
module, else `a.b` (the package's `__init__`). Importing `a.b.c` also runs the `__init__` of
`a` and `a.b`, but those are not edges here: a package that re-exports its modules would
otherwise form a circle with every module of it that imports a sibling. Where two layers may
import each other, `test_two_way_layers_import_in_any_order` imports every module of theirs
first, in a fresh process, which is where an eager `__init__` would bite.

Module length is a report, not a check: `make test` ends with the ten largest modules
(`support.modules.size_report`, printed by `tests/conftest.py`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support.modules import REPO, product_modules

# Which layer may import which: a module of the layer on the left may import modules of the
# layers on the right (and of its own layer). A layer is a subpackage of `hotload`, a
# top-level module of it, or one of the two deployables. docs/architecture.md has the table.
BASE = {
    "hotload.errors",
    "hotload.units",
    "hotload.parse_cache",
    "hotload.fileio",
    "hotload.metrics",
    "hotload._extras",
    "hotload.logs",
    "hotload.faults",
}
# The engine side of sparse hot loads runs inside vLLM's process, where hotload is not installed:
# it imports nothing of ours, and the core may import it (the patch format, dtypes, checksums).
ENGINE_SIDE = "hotload_patch"
ALLOWED: dict[str, set[str]] = {
    ENGINE_SIDE: set(),
    "hotload.errors": set(),
    "hotload.units": {"hotload.errors"},
    "hotload.parse_cache": set(),
    "hotload.fileio": set(),
    "hotload.metrics": set(),
    "hotload._extras": {"hotload.errors"},
    "hotload.logs": set(),
    "hotload.faults": set(),
    "hotload.process": set(),
    # Router Replay's wire form and router discovery, shared by the engine and the SDK.
    "hotload.routes": {"hotload.errors"},
    "hotload.api": BASE,
    # Only the delta container (checksums, the shard header): see FORMAT_MAY_USE.
    "hotload.snapshot": BASE | {"hotload.arc", ENGINE_SIDE},
    # The codec knows no storage: no bucket, ledger, Kubernetes or SDK.
    "hotload.arc": BASE | {"hotload.snapshot", ENGINE_SIDE},
    "hotload.bucket": BASE | {"hotload.snapshot", "hotload.arc"},
    "hotload.kube": BASE,
    "hotload.ledger": BASE | {"hotload.snapshot", "hotload.arc", "hotload.bucket"},
    "hotload.engine": BASE
    | {"hotload.process", "hotload.routes", "hotload.snapshot", "hotload.arc", ENGINE_SIDE},
    "hotload.router": BASE | {"hotload.api", "hotload.kube", "hotload.engine"},
    "hotload.sdk": BASE
    | {"hotload.api", "hotload.snapshot", "hotload.arc", "hotload.bucket", "hotload.kube"}
    | {"hotload.ledger", "hotload.routes"},
    "hotload.demo": BASE
    | {"hotload.snapshot", "hotload.arc", "hotload.bucket", "hotload.ledger", "hotload.sdk"},
    # Entry points: the CLI may use everything in `hotload`; nothing but them imports it.
    "hotload.cli": {"hotload", "hotload.process"}
    | BASE
    | {"hotload.api", "hotload.snapshot", "hotload.arc", "hotload.bucket", "hotload.kube"}
    | {"hotload.ledger", "hotload.engine", "hotload.router", "hotload.sdk", "hotload.demo"},
    "hotload.__main__": {"hotload.cli"},
    # `import hotload` names the trainer's entry points lazily.
    "hotload": {"hotload.errors", "hotload.sdk"},
    # The operator and the loader meet only through `hotload`, never import each other.
    "hotload_operator": BASE
    | {"hotload.api", "hotload.snapshot", "hotload.bucket", "hotload.kube", "hotload.ledger"}
    | {"hotload.router"},
    "hotload_sidecar": BASE
    | {"hotload.process", "hotload.api", "hotload.snapshot", "hotload.arc", "hotload.bucket"}
    | {"hotload.kube", "hotload.ledger", ENGINE_SIDE},
}

# The format knows no codec internals: what `hotload.snapshot` may use of `hotload.arc`.
FORMAT_MAY_USE = {"hotload.arc.checksum", "hotload.arc.container"}
# The bottom of `hotload.arc`: the delta container that the format reads. It imports only these
# and BASE, neither the coding modules nor the snapshot format (which sits on top of it).
CONTAINER = {"hotload.arc.checksum", "hotload.arc.container", "hotload.arc.streams"}

# Entry points: the only importers of `hotload.cli`.
ALLOWED_CLI_USERS = {"hotload.cli", "hotload.__main__"}

# What the engine side may import besides the standard library: it runs in engines' images.
ENGINE_SIDE_THIRD_PARTY = {"numpy", "torch", "vllm"}

# Third-party packages that belong to one place only.
CONFINED = {
    "kopf": {"hotload_operator.handlers", "hotload_operator.__main__"},
    "obstore": {"hotload.bucket", "hotload.demo.seaweedfs"},
}


@dataclass(frozen=True)
class Edge:
    """One import: `source` imports `target` at `line` of the source's file."""

    source: str
    target: str
    line: int


MODULES = product_modules()


def _owner(name: str) -> str | None:
    """The module of ours an imported dotted name lands in (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported dotted name, line) for every import in the file, wherever it stands."""
    is_package = path.stem == "__init__"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                yield (sub if sub in MODULES else origin), node.lineno


def _graph() -> tuple[dict[str, list[Edge]], dict[str, list[tuple[str, int]]]]:
    """Our edges by source module, and every import (ours or not) by source module."""
    edges: dict[str, list[Edge]] = {name: [] for name in MODULES}
    everything: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, path in MODULES.items():
        if path.suffix == ".pyi":
            continue
        for imported, line in _imports(name, path):
            everything[name].append((imported, line))
            target = _owner(imported)
            edge = Edge(name, target or "", line)
            if target is not None and target != name and edge not in edges[name]:
                edges[name].append(edge)
    return edges, everything


EDGES, ALL_IMPORTS = _graph()


def layer(module: str) -> str:
    """The layer of a module: `hotload.<sub>` for the core, the top package for the others."""
    parts = module.split(".")
    if parts[0] == "hotload" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _where(edge: Edge) -> str:
    return f"{MODULES[edge.source].relative_to(REPO)}:{edge.line} imports {edge.target}"


def _strongly_connected() -> list[list[str]]:
    """The groups of modules that reach each other (Tarjan), those of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep graph cannot hit the recursion limit.
        work = [(start, iter(EDGES[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            step = next(pending, None)
            if step is not None:
                nxt = step.target
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(EDGES[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for name in MODULES:
        if name not in index:
            visit(name)
    return groups


def _one_circle(group: list[str]) -> list[Edge]:
    """A shortest circle through the first module of a group, as the imports that make it."""
    members = set(group)
    start = group[0]
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in EDGES[node]:
                if edge.target not in members or edge.target in came:
                    continue
                came[edge.target] = edge
                if edge.target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                following.append(edge.target)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # pragma: no cover - a group has one


def test_the_graph_is_read() -> None:
    # A broken reader would pass every check below: make sure it sees known imports.
    assert any(e.target == "hotload.errors" for e in EDGES["hotload.arc.codec"])
    assert any(e.target.startswith("hotload.ledger") for e in EDGES["hotload_sidecar.loader"])
    assert "hotload.arc._native" in MODULES


def test_no_import_circles() -> None:
    circles = [
        " -> ".join([*(e.source for e in path), path[0].source])
        + "".join(f"\n    {_where(e)}" for e in path)
        for path in map(_one_circle, _strongly_connected())
    ]
    assert not circles, "import circles (function-level imports count):\n" + "\n".join(circles)


def test_every_module_has_a_layer() -> None:
    unknown = sorted({layer(m) for m in MODULES} - set(ALLOWED))
    assert not unknown, f"layers missing from ALLOWED (and docs/architecture.md): {unknown}"


def test_layers_import_only_what_they_may() -> None:
    broken = [
        _where(edge)
        for edges in EDGES.values()
        for edge in edges
        if layer(edge.target) != layer(edge.source)
        and layer(edge.target) not in ALLOWED[layer(edge.source)]
    ]
    assert not broken, "imports across layers that the table does not allow:\n" + "\n".join(broken)


def test_the_format_knows_no_codec_internals() -> None:
    broken = [
        _where(edge)
        for source, edges in EDGES.items()
        for edge in edges
        if (
            layer(source) == "hotload.snapshot"
            and layer(edge.target) == "hotload.arc"
            and edge.target not in FORMAT_MAY_USE
        )
        or (
            source in CONTAINER
            and edge.target not in CONTAINER | BASE
            and layer(edge.target) != ENGINE_SIDE
        )
    ]
    assert not broken, "the format reaches into the codec:\n" + "\n".join(broken)


def test_only_entry_points_import_the_cli() -> None:
    broken = [
        _where(edge)
        for edges in EDGES.values()
        for edge in edges
        if layer(edge.target) == "hotload.cli" and layer(edge.source) not in ALLOWED_CLI_USERS
    ]
    assert not broken, "only the CLI itself and `python -m hotload` import hotload.cli:\n" + (
        "\n".join(broken)
    )


def test_confined_third_party_packages() -> None:
    broken = [
        f"{MODULES[source].relative_to(REPO)}:{line} imports {imported}"
        for source, imports in ALL_IMPORTS.items()
        for imported, line in imports
        for package, homes in CONFINED.items()
        if imported.split(".")[0] == package
        and not any(source == home or source.startswith(home + ".") for home in homes)
    ]
    assert not broken, "third-party packages outside their home:\n" + "\n".join(broken)


def test_the_engine_side_needs_only_numpy_and_torch() -> None:
    # hotload_patch is copied into engines' containers, where only the standard library, numpy,
    # torch and the engine itself are installed.
    broken = [
        f"{MODULES[source].relative_to(REPO)}:{line} imports {imported}"
        for source, imports in ALL_IMPORTS.items()
        if layer(source) == ENGINE_SIDE
        for imported, line in imports
        if (top := imported.split(".")[0]) not in sys.stdlib_module_names
        and top not in ENGINE_SIDE_THIRD_PARTY | {ENGINE_SIDE, "__future__"}
    ]
    assert not broken, "the engine side imports what engines lack:\n" + "\n".join(broken)


# Imports every module named on the command line first, in a process where no module of ours
# is loaded yet (third-party packages stay loaded: they cannot depend on ours).
_IMPORT_FIRST = """
import importlib, sys
ours = ("hotload", "hotload_operator", "hotload_sidecar")
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
"""


def test_two_way_layers_import_in_any_order() -> None:
    # Layers that may import each other (the format and the codec) are free of circles module
    # by module, but a package `__init__` that imported its modules eagerly would still pull
    # one package into the middle of the other's import, and fail for one import order only.
    pairs = {a for a, allowed in ALLOWED.items() for b in allowed if a in ALLOWED.get(b, ())}
    assert pairs == {"hotload.snapshot", "hotload.arc"}, "a new two-way pair: check it here"
    names = sorted(
        name
        for name, path in MODULES.items()
        if layer(name) in pairs and path.suffix == ".py" and not name.endswith("__main__")
    )
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_FIRST, *names],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert not run.stdout, "modules that fail when imported first:\n" + run.stdout


def test_no_test_module_imports_another() -> None:
    # Shared test helpers live in tests/support/ (one helper for each thing), never in a test
    # module another one imports: that would run its tests' module fixtures and hide the helper.
    tests = REPO / "tests"
    names = {p.stem for p in tests.glob("test_*.py")}
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in names:
                found.append(f"{path.name}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{path.name}:{node.lineno}" for a in node.names if a.name in names]
    assert names and not found, found
