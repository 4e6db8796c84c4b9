"""When the loader acts: jittered polls, and a doubling back-off for a snapshot that failed."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass


@dataclass
class _Retry:
    identity: str
    not_before: float
    delay: float


class Backoff:
    """Retry a failed snapshot after `base` seconds, doubling on each failure up to 10x."""

    def __init__(self, base: float) -> None:
        self.base = base
        self._retry: _Retry | None = None

    def may_try(self, identity: str) -> bool:
        """Whether `identity` may be tried now (never failed, another one failed, or waited)."""
        retry = self._retry
        return retry is None or retry.identity != identity or time.monotonic() >= retry.not_before

    def failed(self, identity: str) -> None:
        """Note a failure of `identity`: wait before the next try."""
        delay = self.base
        if self._retry is not None and self._retry.identity == identity:
            delay = min(self._retry.delay * 2, self.base * 10)
        self._retry = _Retry(identity, time.monotonic() + delay, delay)

    def clear(self) -> None:
        """Forget failures (the engine serves what it should)."""
        self._retry = None


def jittered(base: float, spread: float) -> float:
    """`base` seconds, spread uniformly by ±`spread` of it (polls of many replicas drift apart)."""
    return base * random.uniform(1 - spread, 1 + spread)


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less when `stop` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
