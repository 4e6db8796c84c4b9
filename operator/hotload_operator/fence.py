"""The one gate in front of every write of the operator: Kubernetes requests (status writes,
server-side applies, deletes, Events, kopf's own patches, the Fireworks-compatible API's
Snapshots) and bucket writes (ledger appends, pins, hints).

A write goes out only while this replica leads (`LeaderElector.leading`: less than the renew
deadline since its last renewal was sent, on the monotonic clock). The lease is asked at the
last moment a write can still be stopped: for a Kubernetes request, when aiohttp starts sending
it and again just before its first byte is handed to the socket (no await in between); for a
bucket write, before every attempt (the bucket's retries after a backoff included: a call with
retries lasts far longer than a lease), and the attempt may last only as long as the lease's
validity then (`WriteFence.attempt`: past it, the attempt is cancelled, obstore's request and
its own retries with it). A replica frozen (SIGSTOP, a stalled VM) past its deadline and woken
therefore sends nothing it had queued: its clock moved on while it slept. Reads are never
fenced (a standby keeps its caches warm).

A write already handed to the socket is out of the fence's reach, and a network partition can
hold it: the kernel keeps retransmitting unacknowledged bytes and delivers them when the
partition heals, after another replica took over. So the moment this replica stops leading,
`abort_in_flight` resets every connection a Kubernetes write went out on (`SO_LINGER` 0: the
kernel drops what it still held instead of sending it; tests/test_operator_fencing.py cuts a
leader off through a partition that holds bytes as TCP does) and cancels every bucket write
attempt in flight, which drops obstore's request and closes its connection. obstore's sockets
are not ours to set `SO_LINGER` on, so bytes of a bucket write the kernel still held may yet
arrive: what makes such a late write harmless is the bucket's own precondition (ledger appends,
the gc journal and pins are conditional writes, refused once the new leader wrote; gc deletes
only folders no ledger names).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp.client_reqrep import ClientResponse
from prometheus_client import Counter

from hotload.bucket import Bucket
from hotload.errors import BucketUnreachableError

log = logging.getLogger("hotload_operator")

#: Methods that change nothing on the server (never fenced).
READS = frozenset({"GET", "HEAD", "OPTIONS"})


class NotLeadingError(Exception):
    """A write was refused before it left this replica: it does not hold the lease (or its last
    renewal is older than the renew deadline)."""


@dataclass
class WriteFence:
    """Whether this replica may write now, and the refusal of a write when it may not."""

    #: Whether this replica may write now (always, without leader election).
    may_write: Callable[[], bool] = lambda: True
    #: Who holds the lease as last seen ("" when unknown), for the refusal's message.
    holder: Callable[[], str] = lambda: ""
    #: Refused writes by target ("kubernetes", "bucket").
    refused: Counter | None = None
    #: Seconds this replica may still write (None: no bound, without leader election).
    window: Callable[[], float | None] = lambda: None
    #: This replica's identity in the lease.
    identity: str = ""
    #: The connections writes went out on (kept while open: a weak set).
    _written: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    #: The bucket write attempts running now, each bounded by the lease (see `attempt`).
    _attempts: set[asyncio.Timeout] = field(default_factory=set)

    def sent_on(self, transport: Any) -> None:
        """Remember the connection a write goes out on, and make every close of it a reset
        (`SO_LINGER` 0): a request cancelled at the renew deadline (the Lease's renewal is) closes
        its connection before `abort_in_flight` runs, and a plain close would still let the
        kernel send what it held (see `abort_in_flight`)."""
        if transport is None or transport in self._written:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing left to hold
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._written.add(transport)

    def abort_in_flight(self) -> int:
        """Reset every open connection a Kubernetes write went out on, dropping what the kernel
        still held of it, and cancel every bucket write attempt running; the number stopped.
        Called when this replica stops leading."""
        aborted = 0
        for transport in list(self._written):
            if transport.is_closing():
                continue  # its close was a reset already (`sent_on`)
            transport.abort()
            aborted += 1
        self._written.clear()
        cancelled = 0
        if self._attempts:
            now = asyncio.get_running_loop().time()
            for scope in list(self._attempts):
                if not scope.expired():
                    scope.reschedule(now)  # expires at once: the attempt is cancelled
                    cancelled += 1
        if aborted or cancelled:
            log.warning(
                "stopped leading: reset %d connection(s) Kubernetes writes went out on and "
                "cancelled %d bucket write(s) in flight, so nothing they still held lands after "
                "another replica takes over",
                aborted, cancelled,
            )  # fmt: skip
        return aborted + cancelled

    @contextlib.asynccontextmanager
    async def attempt(self, what: str, *, bounded: bool = True) -> AsyncIterator[None]:
        """One attempt of bucket write `what` (`hotload.bucket.WriteGate`): refused with
        `NotLeadingError` unless this replica leads now, and, when `bounded`, cancelled once the
        lease's validity at its start has passed (then refused the same way, or retried as
        unanswered when a renewal came meanwhile)."""
        self.check("bucket", what)
        left = self.window() if bounded else None
        if left is None:
            yield
            return
        scope = asyncio.timeout(left)
        try:
            async with scope:
                self._attempts.add(scope)
                yield
        except TimeoutError:
            if not scope.expired():
                raise  # the store's own timeout, not the lease's
            self.check("bucket", what)
            op, _, target = what.partition(" ")
            raise BucketUnreachableError(
                f"{op} not answered within the {left:.1f} s the lease had left", url=target
            ) from None
        finally:
            self._attempts.discard(scope)

    def check(self, target: str, what: str) -> None:
        """Raise `NotLeadingError` unless this replica may write `what` to `target` now."""
        if self.may_write():
            return
        if self.refused is not None:
            self.refused.labels(target).inc()
        held = self.holder()
        why = (
            f"the lease is held by {held}"
            if held and held != self.identity
            else "its last lease renewal is older than the renew deadline"
        )
        raise NotLeadingError(f"not sending {what}: this replica does not lead ({why})")


def fenced_request_class(fence: WriteFence) -> type[aiohttp.ClientRequest]:
    """An aiohttp request class that refuses every write `fence` does not allow: when the
    request starts (a clean `NotLeadingError`, nothing sent) and again just before its first byte
    goes to the socket (the body is written by a task of its own, a loop turn later: the
    request then fails as a broken connection, its headers never sent)."""

    class FencedRequest(aiohttp.ClientRequest):
        async def send(self, conn: Any) -> ClientResponse:
            if self.method not in READS:
                fence.check("kubernetes", f"{self.method} {self.url.path}")
                fence.sent_on(conn.transport)
            return await super().send(conn)

        async def write_bytes(
            self, writer: Any, conn: Any, content_length: int | None = None
        ) -> None:
            if self.method not in READS:
                what = f"{self.method} {self.url.path}"
                writer = _FencedWriter(writer, lambda: fence.check("kubernetes", what))
            await super().write_bytes(writer, conn, content_length)

    return FencedRequest


def tracked_request_class(fence: WriteFence) -> type[aiohttp.ClientRequest]:
    """An aiohttp request class for the Lease's own client: its writes (taking and renewing the
    Lease) are never refused, since a replica must write to lead, but their connections are reset
    with the others when it stops leading: a renewal held by a partition must not arrive late."""

    class TrackedRequest(aiohttp.ClientRequest):
        async def send(self, conn: Any) -> ClientResponse:
            if self.method not in READS:
                fence.sent_on(conn.transport)
            return await super().send(conn)

    return TrackedRequest


class _FencedWriter:
    """An aiohttp stream writer that asks the fence before its first body chunk (which carries
    the buffered headers with it) is written."""

    def __init__(self, inner: Any, check: Callable[[], None]) -> None:
        self._inner = inner
        self._check: Callable[[], None] | None = check

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def write(self, chunk: Any, **kwargs: Any) -> None:
        if self._check is not None:
            self._check()  # no await between this and the socket write below
            self._check = None
        await self._inner.write(chunk, **kwargs)

    async def write_eof(self, chunk: bytes = b"") -> None:
        if self._check is not None and chunk:
            self._check()
            self._check = None
        await self._inner.write_eof(chunk)


def fenced_bucket(inner: Bucket, fence: WriteFence) -> Bucket:
    """`inner` (sharing its store and settings) with every attempt of its writes (puts,
    uploads, deletes, each retry included) passing `fence`; reads pass."""
    return inner.gated(fence)
