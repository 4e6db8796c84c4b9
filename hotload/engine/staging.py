"""Where a hot load's staging runs and how its failures answer: a fresh thread of lower
priority, so generation keeps the CPU while the old weights serve, and the hot-load API's
error for each way a snapshot can be unusable."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from hotload.engine.layout import WeightsMismatchError
from hotload.engine.protocol import ApiError
from hotload.errors import ChecksumMismatchError, HotloadError, SnapshotValidationError
from hotload_patch import PatchError

T = TypeVar("T")


async def run_in_thread(fn: Callable[[], T], *, nice: int = 0, name: str = "hotload-stage") -> T:
    """Run `fn` in a fresh thread, its niceness raised by `nice` (Linux only), and await it.

    A fresh thread rather than the loop's executor: an unprivileged thread cannot lower its
    niceness again, so a pooled thread would stay slow for whatever runs on it next.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def run() -> None:
        lower_priority(nice)
        try:
            result = fn()
        except BaseException as exc:
            loop.call_soon_threadsafe(deliver, False, exc)
        else:
            loop.call_soon_threadsafe(deliver, True, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by `nice` (Linux; elsewhere, or when refused, a
    no-op)."""
    if nice:
        with contextlib.suppress(AttributeError, OSError):
            tid = threading.get_native_id()
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(current + nice, 19))


def load_error(exc: BaseException) -> ApiError:
    """Map a staging failure to the hot-load API's error (422 unusable snapshot or patch, else
    500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PatchError):
        # A patch that cannot be written here is refused (422: nothing changed); a failure
        # while writing or staging it is the engine's (500), the old weights serving either way.
        failed = exc.reason in ("write_failed", "stage_failed")
        return ApiError(500 if failed else 422, exc.reason, str(exc))
    if isinstance(exc, WeightsMismatchError):
        return ApiError(422, "weights_mismatch", str(exc))
    if isinstance(exc, ChecksumMismatchError):
        return ApiError(422, "checksum_mismatch", str(exc))
    if isinstance(exc, SnapshotValidationError):
        return ApiError(422, "snapshot_invalid", str(exc))
    if isinstance(exc, HotloadError):
        return ApiError(422, "snapshot_unusable", str(exc))
    return ApiError(500, "load_failed", f"{type(exc).__name__}: {exc}")
