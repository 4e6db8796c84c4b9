"""A work queue that coalesces: each key asked for runs once, a short window after the first
request, however many requests arrive meanwhile; a key asked for while it runs runs once more
afterwards. The operator's roll-ups and ledger polls go through one each, so a burst of replica
reports becomes one status write per deployment per window.

A key whose work fails is requeued with a per-key exponential backoff (client-go's rate-limited
requeue: `backoff`, doubling up to `max_backoff`), forgotten at its first success; every failure
is counted (`on_failure`, the operator's `hotload_operator_work_failures_total`). A request that
arrives meanwhile still runs at its own, earlier time: the work is level-triggered.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from hotload.errors import HotloadError

log = logging.getLogger("hotload_operator.workqueue")

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass
class WorkQueue(Generic[K]):
    """Runs `work(key)` for the keys requested, each at most once at a time, at most
    `concurrency` keys at once (the work awaits the API and the bucket)."""

    work: Callable[[K], Awaitable[None]]
    #: Seconds a first request waits for others to join it.
    window: float = 0.25
    concurrency: int = 8
    name: str = "work"
    clock: Callable[[], float] = time.monotonic
    #: Seconds before a failed key runs again, doubled at each further failure up to
    #: `max_backoff`.
    backoff: float = 1.0
    max_backoff: float = 300.0
    #: Called with the queue's name at each failure (a metric).
    on_failure: Callable[[str], None] | None = None
    #: Runs so far (for metrics and tests).
    runs: int = 0
    #: Per key failing now: its failures in a row (dropped at its first success or cancel).
    _failures: dict[K, int] = field(default_factory=dict)
    _due: dict[K, float] = field(default_factory=dict)
    _heap: list[tuple[float, int, K]] = field(default_factory=list)
    _running: set[K] = field(default_factory=set)
    _again: dict[K, float] = field(default_factory=dict)
    _order: itertools.count[int] = field(default_factory=itertools.count)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def request(self, key: K, delay: float | None = None) -> None:
        """Run `key` `delay` seconds from now (default: the window), or sooner if it is already
        due sooner; while it runs, once more after it."""
        wait = self.window if delay is None else max(0.0, delay)
        if key in self._running:
            self._again[key] = min(self._again.get(key, wait), wait)
            return
        at = self.clock() + wait
        if key in self._due and self._due[key] <= at:
            return
        self._due[key] = at
        heapq.heappush(self._heap, (at, next(self._order), key))
        self._idle.clear()
        self._wake.set()

    def cancel(self, key: K) -> None:
        """Forget a pending request for `key` and its failures (a run in progress finishes)."""
        self._due.pop(key, None)
        self._again.pop(key, None)
        self._failures.pop(key, None)

    def queued(self, key: K) -> bool:
        """Whether `key` waits to run or runs now."""
        return key in self._due or key in self._running

    def failing(self, key: K) -> int:
        """How many times in a row `key`'s work has failed (0: its last run succeeded)."""
        return self._failures.get(key, 0)

    def pending(self) -> int:
        """Keys waiting or running."""
        return len(self._due) + len(self._running)

    def __len__(self) -> int:
        """Entries kept (`hotload_operator_cached_entries`)."""
        return len(self._due) + len(self._running) + len(self._again) + len(self._failures)

    async def idle(self) -> None:
        """Return once nothing waits or runs."""
        while self.pending():
            self._idle.clear()
            await self._idle.wait()

    async def run(self) -> None:
        """Dispatch due keys until cancelled."""
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                now = self.clock()
                while self._heap and self._heap[0][0] <= now:
                    at, _, key = heapq.heappop(self._heap)
                    if self._due.get(key) != at:
                        continue  # superseded by an earlier request, or cancelled
                    del self._due[key]
                    await slots.acquire()
                    self._running.add(key)
                    task = asyncio.create_task(self._one(key, slots), name=f"{self.name} {key}")
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    now = self.clock()
                if not self.pending():
                    self._idle.set()
                self._wake.clear()
                timeout = self._heap[0][0] - now if self._heap else None
                with contextlib.suppress(TimeoutError):
                    await wait_for_cancellable(self._wake.wait(), timeout)
        finally:
            for task in tasks:
                task.cancel()

    async def _one(self, key: K, slots: asyncio.Semaphore) -> None:
        retry: float | None = None
        try:
            await self.work(key)
            self._failures.pop(key, None)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # one key's failure must not stop the others
            retry = self._failed(key, err)
        finally:
            self.runs += 1
            self._running.discard(key)
            slots.release()
            again = self._again.pop(key, None)
            if again is not None or retry is not None:
                self.request(key, min(d for d in (again, retry) if d is not None))
            elif not self.pending():
                self._idle.set()
            self._wake.set()

    def _failed(self, key: K, err: Exception) -> float:
        """Count the failure and return the backoff before `key` runs again."""
        count = self._failures[key] = self._failures.get(key, 0) + 1
        delay = min(self.max_backoff, self.backoff * 2.0 ** min(count - 1, 32))
        # hotload's own errors name their cause; anything else is a bug: its traceback.
        log.warning(
            "%s of %s failed (%d in a row), again in %.0fs: %s",
            self.name, key, count, delay, err, exc_info=not isinstance(err, HotloadError),
        )  # fmt: skip
        if self.on_failure is not None:
            self.on_failure(self.name)
        return delay


async def wait_for_cancellable(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`asyncio.wait_for` that never swallows a cancellation: Python 3.11's returns the result
    when it is ready as the cancellation arrives, and a loop around it then never ends (a
    replica that lost the Lease hung on its way out, its work queues not stopping)."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    finally:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
