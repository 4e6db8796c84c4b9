"""What the bucket interface speaks: object metadata and contents, the answer of a conditional
read, progress callbacks, the gate writes pass, key rules, and a way to call it from blocking
code."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

#: Called with a byte count as data moves (negative to take back bytes of a failed attempt).
Progress = Callable[[int], None]


class WriteGate(Protocol):
    """What every attempt of a bucket write (each try of a put or delete, retries included)
    passes: the operator's lease fence. `attempt` raises to refuse the try before anything is
    sent, and may bound how long the try runs (a try still running when its bound passes is
    cancelled, and its request with it)."""

    def attempt(self, what: str, *, bounded: bool = True) -> AbstractAsyncContextManager[None]:
        """A context the try of write `what` (e.g. `PUT s3://b/key`) runs in; `bounded` False
        for a try that cannot be stopped once started (a folder write in a worker thread)."""
        ...


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one object: key (relative to the bucket URL), size, ETag, modification time.

    `etag` is an opaque revision token for conditional calls; it is None only in local-folder
    listings, where computing it would mean reading every file.
    """

    key: str
    size: int
    etag: str | None
    last_modified: datetime | None = None


@dataclass(frozen=True)
class ObjectData:
    """An object's bytes together with the ETag of exactly that revision."""

    key: str
    data: bytes
    etag: str | None


@dataclass(frozen=True)
class NotModified:
    """Result of a conditional read whose object still has the ETag the caller already holds."""

    key: str
    etag: str


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from blocking code (refuses inside a running event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "a blocking hotload bucket call was made inside a running event loop; "
        "await the matching *_async method instead"
    )


def check_key(key: str) -> str:
    """Validate an object key: `/`-separated, relative, no empty, `.` or `..` segments."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid object key {key!r}")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise ValueError(f"invalid object key {key!r}: segment {seg!r}")
    return key
