"""The status writer treats resourceVersions as opaque (the API conventions): only equality, and
the watch's order, tell its own writes from the cache's older and newer states. The versions
below are chosen so that reading them as numbers (as the writer once did) gets every case
wrong: a server may hand out any strings (an etcd restore, kine, an aggregated API).

The Kubernetes client is a stand-in that answers a status patch with a given resourceVersion:
the writer's decisions are what is tested; the real API server's side is in
tests/test_operator_ha.py (a burst is one write; nothing unchanged is written again)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from hotload.kube import KubeClient
from hotload_operator.writes import ECHO_TIMEOUT, StatusWriter

JSON = dict[str, Any]
KEY = ("ns", "fleet")
PLURAL = "hotloaddeployments"


class Server:
    """Answers each status patch with the next of `versions`, the status merged."""

    def __init__(self, *versions: str) -> None:
        self.versions = list(versions)
        self.patches: list[JSON] = []

    async def patch(self, path: str, body: JSON, kind: str) -> JSON:
        self.patches.append(body)
        return {"metadata": {"resourceVersion": self.versions.pop(0)}, "status": body["status"]}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _writer(server: Server, clock: Clock) -> StatusWriter:
    return StatusWriter(cast(KubeClient, server), clock=clock)


@pytest.mark.asyncio
async def test_until_its_echo_arrives_the_write_is_newer_than_the_cache() -> None:
    clock, server = Clock(), Server("100")
    writer = _writer(server, clock)
    cached, cached_version = {"phase": "a"}, "900"  # the cache's state before the write
    assert await writer.write(PLURAL, KEY, {"phase": "b"}, cached, cached_version)
    # The cache still holds "900" (older: the write's event has not arrived).
    assert writer.previous(PLURAL, KEY, cached, cached_version) == {"phase": "b"}
    # The same status is not written again while the cache lags.
    assert not await writer.write(PLURAL, KEY, {"phase": "b"}, cached, cached_version)
    assert len(server.patches) == 1
    # An event from before the write, still on its way, is no reason to roll up.
    assert not writer.observed(PLURAL, KEY, {"phase": "a"}, "900")
    # The echo: from now on the cache is the newest.
    assert not writer.observed(PLURAL, KEY, {"phase": "b"}, "100")
    assert writer.previous(PLURAL, KEY, {"phase": "b"}, "100") == {"phase": "b"}


@pytest.mark.asyncio
async def test_after_the_echo_another_writers_change_is_seen() -> None:
    clock, server = Clock(), Server("100")
    writer = _writer(server, clock)
    await writer.write(PLURAL, KEY, {"phase": "b"}, {"phase": "a"}, "900")
    assert not writer.observed(PLURAL, KEY, {"phase": "b"}, "100")
    # Someone else's change, under a version that sorts before the write's.
    assert writer.observed(PLURAL, KEY, {"phase": "edited"}, "50")
    assert writer.previous(PLURAL, KEY, {"phase": "edited"}, "50") == {"phase": "edited"}


@pytest.mark.asyncio
async def test_the_cache_holding_the_writes_version_is_its_echo() -> None:
    """The watch event may arrive before the patch's answer: a roll-up that then finds the
    write's version in the cache trusts the cache."""
    clock, server = Clock(), Server("7")
    writer = _writer(server, clock)
    await writer.write(PLURAL, KEY, {"phase": "b"}, {"phase": "a"}, "8")
    assert writer.previous(PLURAL, KEY, {"phase": "b", "extra": 1}, "7") == {
        "phase": "b",
        "extra": 1,
    }
    # Echoed: a later event with another status is someone else's.
    assert writer.observed(PLURAL, KEY, {"phase": "c"}, "3")


@pytest.mark.asyncio
async def test_an_echo_that_never_comes_stops_counting_after_the_timeout() -> None:
    """A watch that re-listed delivers the newest state, not every write's event: after
    `ECHO_TIMEOUT` the cache is trusted without the echo."""
    clock, server = Clock(), Server("100", "101")
    writer = _writer(server, clock)
    await writer.write(PLURAL, KEY, {"phase": "b"}, {"phase": "a"}, "900")
    clock.now += ECHO_TIMEOUT / 2
    assert writer.previous(PLURAL, KEY, {"phase": "c"}, "555") == {"phase": "b"}
    clock.now += ECHO_TIMEOUT
    assert writer.previous(PLURAL, KEY, {"phase": "c"}, "555") == {"phase": "c"}
    assert writer.observed(PLURAL, KEY, {"phase": "c"}, "555")
    # And a status that differs from the cache's is written again.
    assert await writer.write(PLURAL, KEY, {"phase": "b"}, {"phase": "c"}, "555")
