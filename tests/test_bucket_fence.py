"""Every attempt of a leader's bucket write passes its lease (`hotload_operator.fence`), read at
the bucket's door (a `CountingProxy` in front of SeaweedFS), never from the operator's logs:

- a write the store keeps failing is retried (the bucket's retries, obstore's own inside each)
  only while the lease is valid: nothing reaches the door after it ran out, and the call ends
  with `NotLeadingError` instead of retrying for a minute;
- a write the store holds is cancelled when the lease's validity passes, or at once when the
  replica stops leading (`abort_in_flight`);
- the gc journal and pins are conditional writes: a late write from a run that read them before
  another writer changed them is refused by the store (412), and the gc plans again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from hotload.bucket import Bucket, open_bucket
from hotload.errors import PreconditionFailedError
from hotload.ledger import Ledger
from hotload.ledger.gc import gc_async, journal_key
from hotload.ledger.pins import Pin, write_pin_async
from hotload.sdk import publish_folder_async
from hotload_operator.fence import NotLeadingError, WriteFence, fenced_bucket
from support.counting_proxy import CountingProxy, Fault, Served
from support.seaweedfs import SeaweedFS
from support.snapshots import full, weights


@pytest.fixture
def door(s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingProxy]:
    """A door in front of the session's SeaweedFS, which the AWS_* environment points at."""
    with CountingProxy(s3_env.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy


def _prefix(request: pytest.FixtureRequest) -> str:
    return f"fence-{request.node.name[-40:].replace('[', '-').replace(']', '')}-{time.time_ns()}"


class Lease:
    """A lease valid for `seconds` from now, as the elector reports one (may_write, window)."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def fence(self) -> WriteFence:
        return WriteFence(
            may_write=lambda: time.monotonic() < self.until,
            window=lambda: max(0.0, self.until - time.monotonic()),
        )


def _prefix_of(url: str) -> str:
    return url.split("/", 3)[3]


def _writes(door: CountingProxy, key: str) -> list[Served]:
    return door.served(lambda s: s.method in ("PUT", "POST", "DELETE") and s.key.endswith(key))


@pytest.mark.asyncio
async def test_a_write_the_store_keeps_failing_stops_at_the_end_of_the_lease(
    door: CountingProxy, s3_env: SeaweedFS, request: pytest.FixtureRequest
) -> None:
    """The door answers every delete 503 after 0.2 s (obstore deletes with S3's multi-object
    delete, a POST). The bucket's policy (4 attempts with backoff, each retried by obstore)
    would go on for many seconds; with the lease valid for 2 s, no delete arrives after it, and
    the call fails as not leading soon after."""
    url = s3_env.url(_prefix(request))
    plain = open_bucket(url)
    await plain.put_async("doomed/a.bin", b"x")
    door.fault = lambda method, key: Fault(0.2, 503) if method in ("DELETE", "POST") else None
    lease = Lease(2.0)
    bucket = fenced_bucket(open_bucket(url), lease.fence())
    started = time.monotonic()
    with pytest.raises(NotLeadingError, match="does not lead"):
        await bucket.delete_async("doomed/a.bin")
    ended = time.monotonic()
    deletes = door.served(lambda s: s.method == "POST" and "delete" in s.query)
    assert deletes, "the door saw no delete: the test tried nothing"
    late = [round(d.at - lease.until, 2) for d in deletes if d.at >= lease.until]
    assert not late, f"deletes arrived after the lease ran out (seconds after): {late}"
    # Cancelled at the end of the lease, not when the policy gave up (its sleeps alone can add
    # up to several seconds).
    assert ended - lease.until < 1.5, (ended - started, len(deletes))
    door.fault = None
    assert await plain.exists_async("doomed/a.bin")  # nothing was deleted


@pytest.mark.asyncio
async def test_a_write_the_store_holds_is_cancelled_when_the_lease_passes_or_is_lost(
    door: CountingProxy, s3_env: SeaweedFS, request: pytest.FixtureRequest
) -> None:
    """The door holds each PUT 20 s before it answers 503. A PUT under a lease valid for 1.5 s
    is cancelled then (not 20 s later, nor retried); one under a 60 s lease is cancelled as soon
    as the replica stops leading (`abort_in_flight`, as the elector's loss of the Lease calls
    it)."""
    url = s3_env.url(_prefix(request))
    door.fault = lambda method, key: Fault(20.0, 503) if method == "PUT" else None
    lease = Lease(1.5)
    bucket = fenced_bucket(open_bucket(url), lease.fence())
    with pytest.raises(NotLeadingError):
        await bucket.put_async("held/a.json", b"{}")
    assert time.monotonic() - lease.until < 1.5
    assert len(_writes(door, "held/a.json")) <= 1  # the held one, or none: never a retry

    long = Lease(60.0)
    fence = long.fence()
    bucket = fenced_bucket(open_bucket(url), fence)
    put = asyncio.create_task(bucket.put_async("held/b.json", b"{}"))
    key = f"{_prefix_of(url)}/held/b.json"
    deadline = time.monotonic() + 30
    while not door.arrived("PUT", key):
        assert not put.done() and time.monotonic() < deadline, "the PUT never reached the door"
        await asyncio.sleep(0.05)
    long.until = time.monotonic()  # the Lease is lost now
    lost = time.monotonic()
    assert fence.abort_in_flight() == 1
    with pytest.raises(NotLeadingError):
        await put
    assert time.monotonic() - lost < 1.0
    door.fault = None
    assert not await open_bucket(url).exists_async("held/b.json")


class PausedGate:
    """A gate that holds the first write attempt whose target contains `marker` until
    `release` is set (a replica frozen just before that write), passing every other."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.reached = asyncio.Event()
        self.release = asyncio.Event()
        self._held = False

    @contextlib.asynccontextmanager
    async def attempt(self, what: str, *, bounded: bool = True) -> AsyncIterator[None]:
        if self.marker in what and not self._held:
            self._held = True
            self.reached.set()
            await self.release.wait()
        yield


async def _policy_with_entries(url: str, tmp_path: Path, n: int) -> Ledger:
    ledger = Ledger(open_bucket(url), "policy")
    for i in range(n):
        await publish_folder_async(ledger, full(tmp_path / f"step-{i}", weights(i, layers=1)))
    return ledger


@pytest.mark.asyncio
async def test_a_late_gc_journal_write_is_refused_and_the_gc_plans_again(
    door: CountingProxy, s3_env: SeaweedFS, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """gc A reads the bucket (no journal yet) and stops just before writing its journal; gc B
    runs meanwhile and writes one. A's journal write, woken, is refused at the door (412), it
    reads the bucket again and plans afresh: B's journal is what the bucket keeps, and the
    ledger lost each retired entry once."""
    url = s3_env.url(_prefix(request))
    ledger = await _policy_with_entries(url, tmp_path, 4)
    grace = timedelta(minutes=10)  # the dropped folders stay: the journal keeps them
    gate = PausedGate(journal_key("policy"))
    late = Ledger(open_bucket(url).gated(gate), "policy")
    a = asyncio.create_task(gc_async(late, keep=2, apply=True, grace=grace))
    await asyncio.wait_for(gate.reached.wait(), 30)
    b = await gc_async(ledger, keep=2, apply=True, grace=grace)
    assert b.applied and set(b.plan.retiring) == {"step-0", "step-1"}
    b_journal = (await ledger.bucket.get_async(journal_key("policy"))).data
    gate.release.set()
    a_result = await asyncio.wait_for(a, 60)
    journal_writes = _writes(door, journal_key("policy"))
    statuses = [w.status for w in journal_writes]
    assert statuses == [200, 412], statuses  # B's create, then A's refused late create
    # A planned again from what B left: nothing more to retire, the journal untouched.
    assert not a_result.plan.retiring
    assert (await ledger.bucket.get_async(journal_key("policy"))).data == b_journal
    retired = {r["identity"] for r in json.loads(b_journal)["retired"]}
    assert retired == {"step-0", "step-1"}
    entries = [e.identity for e in (await ledger.read_async()).document.entries]
    assert entries == ["step-2", "step-3"]


@pytest.mark.asyncio
async def test_a_late_pin_write_is_refused(
    door: CountingProxy, s3_env: SeaweedFS, request: pytest.FixtureRequest
) -> None:
    """A pin written by another writer after this one read it is not overwritten: the late
    write fails at the door (412) and the newer pin stays."""
    url = s3_env.url(_prefix(request))
    key = ".hotload/pins/team/fleet.json"
    plain = open_bucket(url)
    assert await write_pin_async(plain, key, Pin("step-1", "team/fleet"))
    gate = PausedGate(key)
    late: Bucket = open_bucket(url).gated(gate)
    stale = asyncio.create_task(write_pin_async(late, key, Pin("step-2", "team/fleet")))
    await asyncio.wait_for(gate.reached.wait(), 30)  # it read step-1's pin
    assert await write_pin_async(plain, key, Pin("step-3", "team/fleet"))
    gate.release.set()
    with pytest.raises(PreconditionFailedError):
        await asyncio.wait_for(stale, 30)
    assert [w.status for w in _writes(door, key)] == [200, 200, 412]
    stored = Pin.loads((await plain.get_async(key)).data, key)
    assert stored.identity == "step-3"
