"""Shared fixtures: a real S3 server (SeaweedFS) for the session, and buckets on both backends."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.fleet import Replica
from support.seaweedfs import INSTALL_HINT, SeaweedFS, find_weed

pytest_plugins = ["support.kubeapi"]


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
