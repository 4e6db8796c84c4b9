"""A second SeaweedFS to act as a mirror (pytest plugin, registered in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.seaweedfs import SeaweedFS


@pytest.fixture(scope="module")
def plain_mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A second SeaweedFS whose bucket the tests fill with copies (some poisoned or missing)."""
    server = SeaweedFS.start(tmp_path_factory.mktemp("mirror") / "data")
    try:
        yield server
    finally:
        server.stop()
