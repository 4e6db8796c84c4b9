"""How the codec spreads one encode or decode over threads: lanes that each take whole shards
and help with the chunks of other shards when they have none.

numpy, zlib-ng, zstd and file writes release the GIL, so threads code chunks in parallel.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from hotload.arc.encodings import release_scratch

T = TypeVar("T")


def default_threads() -> int:
    """Worker threads used when a caller does not say: every core."""
    return max(1, os.cpu_count() or 1)


class ChunkRunner(Protocol):
    """What runs a shard's chunk tasks: a `concurrent.futures.Executor`, or the lanes of
    `encode` and `decode`. `map` returns the results in the order of `items`."""

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], /) -> Iterable[Any]:
        """Apply `fn` to every item; raise the first (in item order) exception raised."""
        ...


class Inline:
    """Runs chunk tasks in the calling thread, in order (one thread: nothing to hand off)."""

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], /) -> list[Any]:
        return [fn(item) for item in items]


class SharedTasks:
    """The chunk tasks of one shard, taken one at a time by every thread that helps."""

    def __init__(self, fn: Callable[[Any], Any], items: list[Any]) -> None:
        self.fn, self.items = fn, items
        self.results: list[tuple[bool, Any]] = [(False, None)] * len(items)
        self._lock = threading.Lock()
        self._taken = 0
        self._left = len(items)
        self.done = threading.Event()
        if not items:
            self.done.set()

    def unstarted(self) -> bool:
        """Tell whether some task has not been taken yet (another thread may take it first)."""
        return self._taken < len(self.items)

    def _take(self) -> int | None:
        with self._lock:
            if self._taken >= len(self.items):
                return None
            self._taken += 1
            return self._taken - 1

    def work(self) -> None:
        """Run tasks until none is left to take."""
        while (i := self._take()) is not None:
            try:
                self.results[i] = (True, self.fn(self.items[i]))
            except Exception as exc:  # handed to the shard's own thread, which raises it
                self.results[i] = (False, exc)
            finally:
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self.done.set()

    def cancel(self) -> None:
        """Let no thread take another task (those under way finish)."""
        with self._lock:
            self._taken = len(self.items)

    def outcome(self) -> list[Any]:
        """The results in item order, or the first exception in item order."""
        for ok, value in self.results:
            if not ok:
                raise value
        return [value for _, value in self.results]


# Shards under way at once: each holds its files mapped, so this bounds memory to a few
# shards (plus a chunk buffer per thread) however many threads there are; threads beyond it
# help with those shards' chunks.
MAX_SHARDS_IN_FLIGHT = 4


class Lanes:
    """`threads` threads sharing the shards of one encode or decode, and their chunks.

    Each lane (the caller's thread and threads - 1 others) takes the next shard, while fewer
    than MAX_SHARDS_IN_FLIGHT are under way, and runs its chunk tasks itself; a lane that
    cannot take a shard helps with the chunks of the shards under way. Threads hand no task to
    each other: with Python's GIL every hand-off (a pool's queue, a future's result) is a
    wake-up that then waits for the GIL, and with a task per chunk those cost more than
    decoding small chunks. Measured on the MiniLM lr 1e-5 chain: a ThreadPoolExecutor of one
    worker decoded about 10% slower than running inline, and two workers barely faster than
    one; lanes are faster in both cases.
    """

    def __init__(self, threads: int | None) -> None:
        self.threads = max(1, threads or default_threads())
        self._open: list[SharedTasks] = []
        self._cond = threading.Condition()
        self._stop = False

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], /) -> list[Any]:
        """Run one shard's chunk tasks in this thread, with help from idle lanes."""
        tasks = SharedTasks(fn, list(items))
        with self._cond:
            self._open.append(tasks)
            self._cond.notify_all()
        try:
            tasks.work()
            tasks.done.wait()  # a helper may still be running a task it took
        except BaseException:  # Ctrl-C: helpers take no more of this shard's tasks
            tasks.cancel()
            raise
        finally:
            with self._cond:
                self._open.remove(tasks)
        return tasks.outcome()

    def each_shard(self, shards: list[str], fn: Callable[[str, ChunkRunner], T]) -> list[T]:
        """Run `fn(shard, runner)` for every shard; return the stats in shard order.

        On a failure no new shard starts, the shards under way finish, and the error of the
        first failing shard (in shard order) is raised. Every thread has ended when this
        returns or raises, so a caller that removes the output never races a writer.
        """
        if self.threads == 1:
            inline = Inline()
            return [fn(shard, inline) for shard in shards]
        results: list[tuple[bool, Any]] = [(False, None)] * len(shards)
        state = {"next": 0, "in_flight": 0}

        def take() -> int | SharedTasks | None:
            """The next shard index to code, or chunk tasks to help with; None when done."""
            with self._cond:
                while True:
                    if self._stop:
                        return None
                    if state["next"] < len(shards) and state["in_flight"] < MAX_SHARDS_IN_FLIGHT:
                        state["next"] += 1
                        state["in_flight"] += 1
                        return state["next"] - 1
                    tasks = next((t for t in self._open if t.unstarted()), None)
                    if tasks is not None:
                        return tasks
                    if state["next"] >= len(shards) and state["in_flight"] == 0:
                        return None
                    # Wake when a shard ends or a shard's chunk tasks open.
                    self._cond.wait()

        def lane() -> None:
            while (job := take()) is not None:
                if isinstance(job, SharedTasks):
                    job.work()
                    continue
                try:
                    results[job] = (True, fn(shards[job], self))
                except Exception as exc:
                    results[job] = (False, exc)
                    with self._cond:
                        self._stop = True
                finally:
                    with self._cond:
                        state["in_flight"] -= 1
                        self._cond.notify_all()

        others = [
            threading.Thread(target=lane, name=f"hotload-arc-lane-{n}", daemon=True)
            for n in range(1, self.threads)
        ]
        for t in others:
            t.start()
        try:
            lane()
        finally:
            # Ctrl-C lands in this thread: stop the others from starting shards, let the
            # shards under way finish, and only then let the exception through.
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            for t in others:
                t.join()
        for ok, value in results:
            if not ok:  # the first failure in shard order; shards after it never started
                raise value
        return [value for _, value in results]


@contextmanager
def released_scratch() -> Iterator[None]:
    # The caller's thread may live on (a loader's worker thread): do not keep its chunk
    # buffers after the call. The lanes' own threads release theirs when they end.
    try:
        yield
    finally:
        release_scratch()
