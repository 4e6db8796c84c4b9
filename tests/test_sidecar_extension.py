"""The loader puts the engine side of sparse hot loads (`hotload_patch`) on the weights volume,
where vLLM (an image without hotload) imports its worker extension from.

A fresh copy holds the package's `*.py` and `py.typed` and nothing else, readable by any user;
an identical copy is left alone; a stale or damaged one (a volume that outlived an older loader)
is replaced whole; the weights folder's housekeeping keeps it; the copy imports in a process
where hotload does not exist; a volume the loader cannot write ends it with an error naming the
path; and the loader process makes the copy (for vLLM only) before its endpoints answer.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hotload.api.names import ENGINE_PYTHONPATH_DIR, VLLM_WORKER_EXTENSION
from hotload_sidecar import extension
from hotload_sidecar.extension import (
    ExtensionCopyError,
    install_engine_extension,
    package_digest,
    package_files,
    package_source,
    prepare_engine_extension,
)
from hotload_sidecar.weights import WeightsFolder
from support.fleet import REPO, free_port, wait_for

SOURCE = package_source()


def _target(root: Path) -> Path:
    return root / ENGINE_PYTHONPATH_DIR / "hotload_patch"


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (whatever its name), relative path -> bytes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


@pytest.fixture
def stale_source(tmp_path: Path) -> Path:
    """An older `hotload_patch`: one module changed, one that no longer exists, bytecode."""
    old = tmp_path / "old" / "hotload_patch"
    shutil.copytree(SOURCE, old, ignore=shutil.ignore_patterns("__pycache__"))
    (old / "format.py").write_text("# an older format\n")
    (old / "gone.py").write_text("REMOVED = True\n")
    (old / "__pycache__").mkdir()
    (old / "__pycache__" / "gone.cpython-311.pyc").write_bytes(b"\0")
    (old / "notes.txt").write_text("not part of the package\n")
    return old


def test_a_fresh_copy_holds_the_package_and_nothing_else(tmp_path: Path) -> None:
    # The source in this checkout has bytecode beside it once anything imported it.
    import hotload_patch.format  # noqa: F401

    root = tmp_path / "weights"
    done = install_engine_extension(root)
    target = _target(root)
    assert done.copied and done.path == target
    assert done.digest == package_digest(SOURCE) == package_digest(target)
    expected = {rel.as_posix(): (SOURCE / rel).read_bytes() for rel in package_files(SOURCE)}
    assert "py.typed" in expected and "__init__.py" in expected and "vllm.py" in expected
    assert _tree(target) == expected  # no __pycache__, nothing but *.py and py.typed
    # Readable by the engine whatever user it runs as; nothing left beside the copy.
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert {stat.S_IMODE((target / f).stat().st_mode) for f in expected} == {0o644}
    assert [p.name for p in target.parent.iterdir()] == ["hotload_patch"]
    # The class vLLM is told to load (--worker-extension-cls) is in the copy.
    # (A line match, not ast.parse: CPython 3.11.7's parser can fail with "AST constructor
    # recursion depth mismatch" late in a long session, after some other test's deep recursion.)
    module, _, cls = VLLM_WORKER_EXTENSION.rpartition(".")
    source = (target.parent / (module.replace(".", "/") + ".py")).read_text()
    assert re.search(rf"^class {cls}\b", source, re.MULTILINE)


def test_an_identical_copy_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    first = install_engine_extension(root)
    before = {p.name: p.stat().st_ino for p in [_target(root), *_target(root).iterdir()]}
    again = install_engine_extension(root)
    assert first.copied and not again.copied and again.digest == first.digest
    after = {p.name: p.stat().st_ino for p in [_target(root), *_target(root).iterdir()]}
    assert after == before  # not rewritten


def test_a_stale_or_damaged_copy_is_replaced_whole(tmp_path: Path, stale_source: Path) -> None:
    root = tmp_path / "weights"
    old = install_engine_extension(root, source=stale_source)
    assert old.copied and (_target(root) / "gone.py").exists()
    assert not (_target(root) / "notes.txt").exists()
    assert not (_target(root) / "__pycache__").exists()
    # Leftovers of a loader killed in the middle of a replacement.
    python_root = _target(root).parent
    (python_root / ".hotload_patch.tmp-dead").mkdir()
    (python_root / ".hotload_patch.old-dead").mkdir()
    new = install_engine_extension(root)
    assert new.copied and new.digest != old.digest
    assert _tree(_target(root)) == {
        rel.as_posix(): (SOURCE / rel).read_bytes() for rel in package_files(SOURCE)
    }
    assert [p.name for p in python_root.iterdir()] == ["hotload_patch"]
    # Damaged in place (bit rot, a hand edit): the bytes are compared, not a recorded digest.
    (_target(root) / "sums.py").write_text("broken\n")
    assert install_engine_extension(root).copied
    assert (_target(root) / "sums.py").read_bytes() == (SOURCE / "sums.py").read_bytes()
    # A stray module in the copy makes it differ too.
    (_target(root) / "extra.py").write_text("")
    assert install_engine_extension(root).copied
    assert not (_target(root) / "extra.py").exists()


def test_the_weights_folders_housekeeping_keeps_the_copy(tmp_path: Path) -> None:
    """`prepare` clears `.hotload/`'s work folders at every start and `collect` deletes old
    snapshots: neither touches the copy, and it is never listed as a snapshot."""
    root = tmp_path / "weights"
    done = install_engine_extension(root)
    weights = WeightsFolder(root)
    assert weights.python_root == done.path.parent
    (weights.staging_root / "step-1").mkdir(parents=True)
    weights.prepare()
    assert not (weights.staging_root / "step-1").exists()
    (weights.snapshots / "step-1").mkdir()
    assert weights.local() == {"step-1"}
    assert weights.collect(keep=0, order=["step-1"]) == ["step-1"]
    weights.prepare()
    assert weights.local() == set()
    assert package_digest(done.path) == done.digest
    assert not install_engine_extension(root).copied


# Imports the copy in a process without hotload: the editable install's finder and the
# checkout are out of reach, so only the copy on PYTHONPATH can answer.
_IMPORT_THE_COPY = """
import importlib, sys
class NoHotload:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hotload", "hotload_sidecar", "hotload_operator"):
            raise ModuleNotFoundError(f"no module named {name!r} in an engine's image")
        return None
sys.meta_path.insert(0, NoHotload())
import hotload_patch.format
for name in sys.argv[2:]:
    importlib.import_module(name)
loaded = [m for m in sys.modules if m.split(".")[0] in ("hotload", "hotload_sidecar")]
assert not loaded, loaded
print(hotload_patch.__file__)
print(hotload_patch.format.__file__)
print(hotload_patch.PROTOCOL)
"""


def test_the_copy_imports_where_hotload_is_not_installed(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    done = install_engine_extension(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env |= {"PYTHONPATH": str(root / ENGINE_PYTHONPATH_DIR), "PYTHONDONTWRITEBYTECODE": "1"}
    # Every module but the vLLM extension itself (vLLM lives in its own venv).
    modules = [
        f"hotload_patch.{rel.stem}"
        for rel in package_files(done.path)
        if rel.suffix == ".py" and rel.stem not in ("__init__", "vllm")
    ]
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_THE_COPY, "-", *modules],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    init, fmt, protocol = run.stdout.split()
    assert Path(init) == done.path / "__init__.py" and Path(fmt) == done.path / "format.py"
    import hotload_patch

    assert int(protocol) == hotload_patch.PROTOCOL
    assert str(REPO) not in init


def _without_dac_override() -> None:
    """In a child process before it runs the loader: drop root's power to write anywhere
    (CAP_DAC_OVERRIDE, from the bounding set, which caps what the new program gets), so that a
    folder's permission bits bind it as they bind the loader's non-root user in its pod."""
    import ctypes

    pr_capbset_drop, cap_dac_override = 24, 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_capbset_drop, cap_dac_override, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def _loader(tmp_path: Path, weights: Path, kind: str, port: int) -> list[str]:
    """The loader's command line, following an empty ledger under tmp_path/bucket."""
    ledger, listen = str(tmp_path / "bucket" / "policy"), f"127.0.0.1:{port}"
    return [sys.executable, "-m", "hotload_sidecar", "--ledger-url", ledger,
            "--weights-dir", str(weights), "--engine", kind, "--listen", listen]  # fmt: skip


def _env() -> dict[str, str]:
    """This environment without hotload's settings or a PYTHONPATH that would hide the copy."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("HOTLOAD_", "PYTHON"))}


def test_a_volume_the_loader_cannot_write_ends_it_naming_the_path(tmp_path: Path) -> None:
    """The loader process exits with code 1 and a message naming the folder it could not
    write, before it listens (so the pod never starts its engine)."""
    (tmp_path / "bucket").mkdir()
    weights = tmp_path / "weights"
    weights.mkdir()
    weights.chmod(0o555)
    try:
        run = subprocess.run(
            _loader(tmp_path, weights, "vllm", free_port()),
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
        )
    finally:
        weights.chmod(0o755)
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith(
        "hotload-sidecar: error: cannot copy the engine extension hotload_patch to "
        f"{_target(weights)}: Permission denied ({weights}/.hotload); the loader must be able to "
        "write to the weights volume"
    ), run.stderr
    assert not (weights / ".hotload").exists()


def test_a_read_only_volume_is_named_in_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "weights"

    def read_only(prefix: str, dir: Path) -> str:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))

    monkeypatch.setattr(extension.tempfile, "mkdtemp", read_only)
    with pytest.raises(ExtensionCopyError) as err:
        install_engine_extension(root)
    assert str(err.value).startswith(
        f"cannot copy the engine extension hotload_patch to {_target(root)}: "
        f"Read-only file system ({root / ENGINE_PYTHONPATH_DIR})"
    )


def test_only_vllm_gets_the_copy(tmp_path: Path) -> None:
    for kind in ("reference", "sglang"):
        assert asyncio.run(prepare_engine_extension(tmp_path / kind, kind)) is None
        assert not (tmp_path / kind).exists()
    done = asyncio.run(prepare_engine_extension(tmp_path / "vllm", "vllm"))
    assert done is not None and done.copied and done.path == _target(tmp_path / "vllm")


@pytest.mark.parametrize("kind", ["vllm", "reference"])
def test_the_loader_copies_before_its_endpoints_answer(tmp_path: Path, kind: str) -> None:
    """The loader process copies at start-up, before anything listens: the kubelet's startup
    probe (and so the engine's start) can only pass after the copy is whole."""
    (tmp_path / "bucket").mkdir()
    weights = tmp_path / "weights"
    port = free_port()
    proc = subprocess.Popen(
        [
            *_loader(tmp_path, weights, kind, port),
            "--engine-url",
            f"http://127.0.0.1:{free_port()}",
        ],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def answers() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/startup", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as err:
            return err.code

    try:
        status = wait_for("the loader's endpoints", answers, timeout=60)
        assert status == 503  # the ledger has no head yet: the engine would not start
        if kind == "vllm":
            assert package_digest(_target(weights)) == package_digest(SOURCE)
        else:
            assert not (weights / ENGINE_PYTHONPATH_DIR).exists()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr.decode()
