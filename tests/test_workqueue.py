"""The operator's work queue requeues a failed key with a backoff of its own, counts every
failure, forgets the failures at the first success, and drops a cancelled key."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from hotload.errors import BucketError
from hotload_operator.fence import NotLeadingError
from hotload_operator.reconcile import guarded
from hotload_operator.workqueue import WorkQueue

BACKOFF = 0.05


async def _until(check: object, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_failed_key_runs_again_later_each_time_until_it_succeeds() -> None:
    runs: list[float] = []
    failures: list[str] = []
    fail_times = 3

    async def work(key: str) -> None:
        runs.append(time.monotonic())
        if len(runs) <= fail_times:
            raise BucketError(f"the bucket refused ({len(runs)})", url="s3://bucket/rl")

    queue: WorkQueue[str] = WorkQueue(
        work, window=0, name="roll-up", backoff=BACKOFF, on_failure=failures.append
    )
    running = asyncio.create_task(queue.run())
    try:
        queue.request("rl/fleet", 0)
        await _until(lambda: len(runs) == fail_times + 1)
        await queue.idle()
        assert failures == ["roll-up"] * fail_times
        assert queue.failing("rl/fleet") == 0  # forgotten once it succeeded
        gaps = [b - a for a, b in itertools.pairwise(runs)]
        # Each wait at least the backoff, doubled per failure in a row.
        for n, gap in enumerate(gaps):
            assert gap >= BACKOFF * 2**n * 0.95, (n, gaps)
        await asyncio.sleep(BACKOFF * 8)
        assert len(runs) == fail_times + 1  # nothing runs after the success
    finally:
        running.cancel()


@pytest.mark.asyncio
async def test_a_request_during_the_backoff_runs_at_its_own_time_and_cancel_drops_the_key() -> None:
    runs: list[str] = []

    async def work(key: str) -> None:
        runs.append(key)
        raise BucketError("down", url="s3://bucket/rl")

    queue: WorkQueue[str] = WorkQueue(work, window=0, name="poll", backoff=3600)
    running = asyncio.create_task(queue.run())
    try:
        queue.request("a", 0)
        await _until(lambda: queue.failing("a") == 1)
        # Backing off for an hour; a new request (a watch event) runs it now.
        queue.request("a", 0)
        await _until(lambda: queue.failing("a") == 2)
        assert runs == ["a", "a"]
        queue.cancel("a")  # the deployment was deleted
        assert queue.failing("a") == 0 and queue.pending() == 0
    finally:
        running.cancel()


@pytest.mark.asyncio
async def test_work_guarded_for_a_queue_skips_a_lost_lease_and_raises_the_rest() -> None:
    async def deposed() -> None:
        raise NotLeadingError("hotload-operator-1 does not hold the Lease")

    async def down() -> None:
        raise BucketError("connection refused", url="s3://bucket/rl")

    assert await guarded("roll-up", deposed) is None
    with pytest.raises(BucketError, match="connection refused"):
        await guarded("roll-up", down)
