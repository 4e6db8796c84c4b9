"""How a hotload process runs work beside what matters more, and how it ends: shared by every
entry point (the CLI, the engine, the loader sidecar)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def exit_now(code: int) -> None:
    """Flush and leave without interpreter finalisation.

    obstore's Rust runtime occasionally aborts (SIGABRT, no Python frame) while the interpreter
    tears down after all work has finished; skipping teardown keeps exit codes truthful.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
