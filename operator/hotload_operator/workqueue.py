"""A work queue that coalesces: each key asked for runs once, a short window after the first
request, however many requests arrive meanwhile; a key asked for while it runs runs once more
afterwards. The operator's roll-ups and ledger polls go through one each, so a burst of replica
reports becomes one status write per deployment per window.
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
    #: Runs so far (for metrics and tests).
    runs: int = 0
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
        """Forget a pending request for `key` (a run in progress finishes)."""
        self._due.pop(key, None)
        self._again.pop(key, None)

    def pending(self) -> int:
        """Keys waiting or running."""
        return len(self._due) + len(self._running)

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
        try:
            await self.work(key)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one key's work must not stop the others
            log.exception("%s of %s failed", self.name, key)
        finally:
            self.runs += 1
            self._running.discard(key)
            slots.release()
            again = self._again.pop(key, None)
            if again is not None:
                self.request(key, again)
            elif not self.pending():
                self._idle.set()
            self._wake.set()


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
