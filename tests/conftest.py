"""Shared fixtures: a real S3 server (SeaweedFS) for the session, and buckets on both backends."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.fleet import Replica
from support.modules import size_report
from support.seaweedfs import INSTALL_HINT, SeaweedFS, find_weed

pytest_plugins = ["support.kubeapi", "support.mirrors", "support.node"]

#: Whether this run holds the layer checks (tests/test_layers.py), which the size report joins.
_SIZES = pytest.StashKey[bool]()


#: The run's own temp folder (`pytest_configure`), removed when the run ends.
_RUN_TMP = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Give the run, and everything it starts, a temp folder of its own inside $TMPDIR, removed
    at the end: what engines and tools leave in theirs (vLLM's sockets, torch's error files and
    compile cache, servers' logs) goes with it instead of piling up run after run. pytest's own
    folders (failed tests' `tmp_path`, kept for a look) stay where they were."""
    root = Path(tempfile.gettempdir())
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(root))
    folder = Path(tempfile.mkdtemp(prefix="hotload-run-", dir=root))
    # As /tmp is: tests start processes as other users (uid 65532), which need a temp folder too.
    folder.chmod(0o1777)
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None
    config.stash[_RUN_TMP] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's temp folder, unless something is still mounted in it (a node's
    leftovers: removing through a mount would delete what it shows)."""
    folder = config.stash.get(_RUN_TMP, None)
    if folder is None:
        return
    mounts = Path("/proc/self/mounts")
    inside = [
        line.split()[1]
        for line in (mounts.read_text().splitlines() if mounts.exists() else [])
        if line.split()[1].startswith(f"{folder}/")
    ]
    if inside:
        print(f"\nleft {folder} in place: {len(inside)} mounts inside it ({inside[0]}, ...)")
        return
    shutil.rmtree(folder, ignore_errors=True)


#: Below this much free space at the temp root the header warns: a whole run writes a few GiB there.
_LOW_DISK_BYTES = 8 << 30


def pytest_report_header(config: pytest.Config) -> str:
    """Name the free space where the tests write, so a run that fills the disk says so up front."""
    root = tempfile.gettempdir()
    free = shutil.disk_usage(root).free
    line = f"free space at {root}: {free / 2**30:.1f} GiB"
    if free < _LOW_DISK_BYTES:
        need = _LOW_DISK_BYTES >> 30
        line += f" (LOW: a whole run needs about {need} GiB; free some or set TMPDIR)"
    return line


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note whether the layer checks run (the whole suite does, `make test` included)."""
    session.config.stash[_SIZES] = any(i.path.name == "test_layers.py" for i in session.items)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """With the layer checks, end with the ten largest modules: a report, never a failure."""
    if not config.stash.get(_SIZES, False):
        return
    terminalreporter.section("module sizes")
    try:
        lines = size_report(10)
    except OSError as err:  # a module removed or unreadable mid-run: say so, fail nothing
        lines = [f"no module size report: {err}"]
    for line in lines:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """Give the root logger back its handlers and level after each test: a CLI run in-process
    (`configure_logging`) binds a handler to the stderr pytest captured for that test, which is
    closed afterwards ("Logging error ... I/O operation on closed file" in later tests)."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        # pytest's own capture handlers come and go with each phase: never touched here.
        if handler not in before and type(handler).__module__ != "_pytest.logging":
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS server for the whole session (never skipped: missing means failed)."""
    if find_weed() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    server = SeaweedFS.start(tmp_path_factory.mktemp("seaweedfs") / "data")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> SeaweedFS:
    """Point the AWS_* environment at the session's SeaweedFS."""
    for name, value in seaweedfs.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HOTLOAD_BUCKET_CREDENTIALS_DIR", raising=False)
    return seaweedfs


@pytest.fixture(params=["local", "s3"])
def bucket_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty bucket URL: a local folder, or a unique prefix on SeaweedFS."""
    if request.param == "local":
        return str(tmp_path / "bucket")
    server: SeaweedFS = request.getfixturevalue("s3_env")
    return server.url(f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def env() -> dict[str, str]:
    """The environment of replica processes (`support.fleet`)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    """Replicas a test starts; all stopped afterwards (their logs shown if the test failed)."""
    started: list[Replica] = []
    yield started
    for r in started:
        print(f"--- {r.name} ---\n{r.logs()}")
        r.stop()


@pytest.fixture(params=["kernel", "numpy"])
def arc_decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the codec's C kernel and again with its numpy path (the kernel
    disabled): both decoders must give the same bytes and the same refusals."""
    from hotload.arc import chunk

    if request.param == "numpy":
        monkeypatch.setattr(chunk, "native", None)
    else:
        assert chunk.native is not None, "hotload.arc._native is not built: see test_arc_native.py"
    return str(request.param)
