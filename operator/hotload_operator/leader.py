"""Leader election on a `coordination.k8s.io/v1` Lease, the way Kubernetes' own controllers do it.

Every operator replica runs its caches; only the one holding the Lease writes. The holder renews
the Lease every `retry` seconds and stops writing once `renew_deadline` has passed since its
last successful renewal; a standby watches the Lease and takes it only after the record stayed
unchanged for the Lease's `leaseDurationSeconds`, counted from when the standby saw that record
(its own clock: the replicas' clocks need not agree). With renew_deadline < lease duration, the
old leader has stopped writing before a new one may start, so two replicas never write at once.
A leader that stops cleanly releases the Lease, and a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from hotload.errors import KubeConflictError, KubeError, KubeForbiddenError, KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from hotload_operator.workqueue import wait_for_cancellable

log = logging.getLogger("hotload_operator.leader")
JSON = dict[str, Any]
LEASE_API = "coordination.k8s.io/v1"


class LeadershipLostError(Exception):
    """The Lease could not be renewed within the renew deadline, or another replica holds it."""


def default_identity() -> str:
    """This replica's name in the Lease: the pod's name (POD_NAME), else host and process."""
    return (
        os.environ.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    )


def micro_time(moment: datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseSettings:
    """Where the Lease is and its timing (client-go's defaults)."""

    namespace: str
    name: str = "hotload-operator"
    identity: str = field(default_factory=default_identity)
    #: Seconds a standby waits, after the record last changed, before it takes the Lease.
    duration: float = 15.0
    #: Seconds after its last successful renewal at which the leader stops writing.
    renew_deadline: float = 10.0
    #: Seconds between renewals (and between a standby's attempts when it cannot watch).
    retry: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry < self.renew_deadline < self.duration:
            raise ValueError(
                "leader election needs 0 < retry < renew deadline < lease duration, got "
                f"{self.retry:g} s, {self.renew_deadline:g} s and {self.duration:g} s"
            )


@dataclass
class _Seen:
    """The Lease as last observed, and when (monotonic) that version was first seen."""

    lease: JSON | None
    version: str
    since: float


@dataclass
class LeaderElector:
    """Acquire, hold and release the operator's Lease."""

    kube: KubeClient
    settings: LeaseSettings
    clock: Callable[[], float] = time.monotonic
    #: Called with True when this replica starts leading, False when it stops.
    on_change: Callable[[bool], None] | None = None
    #: Called with True when the API server refuses the Lease watch (403), False once allowed.
    on_watch_refused: Callable[[bool], None] | None = None
    #: Whether the last Lease watch was refused (403): the replica polls instead.
    watch_refused: bool = False
    _renewed_at: float | None = None
    _lease: JSON | None = None
    _seen: _Seen | None = None
    #: Counts observations: a GET answered before a later one (a create's reply) is stale.
    _seen_count: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def path(self) -> str:
        """The Lease's API path."""
        s = self.settings
        return resource_path(LEASE_API, "leases", s.namespace, s.name)

    def leading(self) -> bool:
        """Whether this replica may write: it renewed the Lease less than `renew_deadline`
        seconds ago (measured from before it sent that renewal)."""
        return (
            self._renewed_at is not None
            and self.clock() < self._renewed_at + self.settings.renew_deadline
        )

    def window(self) -> float:
        """Seconds this replica may still write (0 when it does not lead): until the renew
        deadline of its last renewal, which a renewal meanwhile only extends."""
        if self._renewed_at is None:
            return 0.0
        return max(0.0, self._renewed_at + self.settings.renew_deadline - self.clock())

    def holder(self) -> str:
        """The identity holding the Lease as last seen ("" when free or unknown)."""
        lease = self._seen.lease if self._seen is not None else self._lease
        return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")

    async def acquire(self) -> None:
        """Return once this replica holds the Lease (watching it meanwhile, so it takes over as
        soon as the holder's Lease expires)."""
        watcher = asyncio.create_task(self._observe(), name="lease watch")
        try:
            announced = ""
            while True:
                if self._may_take() and await self._attempt():
                    return
                holder = self.holder()
                if holder and holder != announced:
                    log.info("standing by: %s holds lease %s", holder, self.settings.name)
                    announced = holder
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await wait_for_cancellable(self._changed.wait(), self._wait_seconds())
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def hold(self) -> None:
        """Renew the Lease every `retry` seconds; raise `LeadershipLostError` once it cannot be
        renewed within the renew deadline, or another replica took it."""
        while True:
            await asyncio.sleep(self.settings.retry)
            # A renewal that takes past the deadline is a lost one: a slow API server must not
            # keep this replica waiting on a request instead of stepping down.
            left = max(0.1, (self._renewed_at or 0.0) + self.settings.renew_deadline - self.clock())
            try:
                renewed = await wait_for_cancellable(self._try(), left)
            except (KubeError, TimeoutError) as err:
                log.warning(
                    "cannot renew lease %s: %s", self.settings.name, str(err) or "timed out"
                )
                renewed = False
            taken = self.holder() not in ("", self.settings.identity)
            if not renewed and (taken or not self.leading()):
                self._lost()
                raise LeadershipLostError(
                    f"lease {self.settings.namespace}/{self.settings.name} not renewed within "
                    f"{self.settings.renew_deadline:g} s (held by {self.holder() or 'nobody'})"
                )

    async def release(self) -> None:
        """Give the Lease up (a standby takes it at once); quiet when it is not held."""
        if self._lease is None or not self.leading():
            return
        spec = dict(self._lease.get("spec") or {})
        now = micro_time(datetime.now(UTC))
        spec.update(holderIdentity="", leaseDurationSeconds=1, renewTime=now)
        body = {**self._lease, "spec": spec}
        self._renewed_at = None
        try:
            await self.kube.replace(self.path, body)
        except KubeError as err:
            log.warning("cannot release lease %s: %s", self.settings.name, err)
        self._lost()

    # --- internals -----------------------------------------------------------------------------

    async def _attempt(self) -> bool:
        """One try at taking the Lease, bounded by two retry periods (False on failure)."""
        try:
            return await wait_for_cancellable(self._try(), 2 * self.settings.retry)
        except (KubeError, TimeoutError) as err:
            log.warning("cannot take lease %s: %s", self.settings.name, str(err) or "timed out")
            return False

    def _lost(self) -> None:
        was = self._renewed_at is not None or self._lease is not None
        self._renewed_at = None
        self._lease = None
        if was and self.on_change is not None:
            self.on_change(False)

    def _see(self, lease: JSON | None) -> None:
        version = str(((lease or {}).get("metadata") or {}).get("resourceVersion") or "")
        self._seen_count += 1
        if self._seen is None or self._seen.version != version or lease is None:
            self._seen = _Seen(lease, version, self.clock())
            self._changed.set()

    def _may_take(self) -> bool:
        """Whether the Lease is absent, free, ours, or unchanged for its whole duration."""
        seen = self._seen
        if seen is None or seen.lease is None:
            return True
        spec = seen.lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        if not holder or holder == self.settings.identity:
            return True
        duration = float(spec.get("leaseDurationSeconds") or self.settings.duration)
        return self.clock() >= seen.since + duration

    def _wait_seconds(self) -> float:
        """How long a standby waits before looking again: until the Lease it saw expires, and
        no longer than two retry periods (in case the watch missed something)."""
        cap = 2 * self.settings.retry
        seen = self._seen
        if seen is None or seen.lease is None:
            return self.settings.retry
        duration = float(
            (seen.lease.get("spec") or {}).get("leaseDurationSeconds") or self.settings.duration
        )
        return max(0.01, min(cap, seen.since + duration - self.clock()))

    async def _try(self) -> bool:
        """Take or renew the Lease once (optimistic concurrency); return whether we hold it."""
        s = self.settings
        sent = self.clock()
        now = micro_time(datetime.now(UTC))
        current = self._lease if self._lease is not None else (self._seen and self._seen.lease)
        try:
            if not current:
                body = {
                    "apiVersion": LEASE_API,
                    "kind": "Lease",
                    "metadata": {"name": s.name, "namespace": s.namespace},
                    "spec": {
                        "holderIdentity": s.identity,
                        "leaseDurationSeconds": round(s.duration),
                        "acquireTime": now,
                        "renewTime": now,
                        "leaseTransitions": 0,
                    },
                }
                stored = await self.kube.create(
                    resource_path(LEASE_API, "leases", s.namespace), body
                )
            else:
                spec = dict(current.get("spec") or {})
                if spec.get("holderIdentity") != s.identity:
                    spec["acquireTime"] = now
                    spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
                spec.update(
                    holderIdentity=s.identity,
                    leaseDurationSeconds=round(s.duration),
                    renewTime=now,
                )
                stored = await self.kube.replace(self.path, {**current, "spec": spec})
        except (KubeConflictError, KubeNotFoundError):
            # Someone else wrote it first (or it was deleted): read it again before deciding.
            self._lease = None
            with contextlib.suppress(KubeError):
                self._see(await self.kube.get(self.path))
            return False
        first = self._renewed_at is None
        self._lease = stored
        self._renewed_at = sent
        self._see(stored)
        if first:
            log.info("leading: holding lease %s/%s as %s", s.namespace, s.name, s.identity)
            if self.on_change is not None:
                self.on_change(True)
        return True

    async def _observe(self) -> None:
        """Keep `_seen` current: read the Lease, then watch it (GET again when that fails)."""
        s = self.settings
        selector = f"metadata.name={s.name}"
        collection = resource_path(LEASE_API, "leases", s.namespace)
        while True:
            try:
                before = self._seen_count
                try:
                    lease: JSON | None = await self.kube.get(self.path)
                except KubeNotFoundError:
                    lease = None
                # A GET answered before this replica's own create (or a renewal) can be handled
                # after it: `acquire` gets the create's reply a loop turn later (wait_for runs it
                # as a task) and cancels this watcher then, so a stale "not found" would stay
                # the last word and `holder()` say "" for a Lease this replica holds.
                if self._seen_count == before:
                    self._see(lease)
                version = str(((lease or {}).get("metadata") or {}).get("resourceVersion") or "")
                async for kind, obj in self.kube.watch(
                    collection,
                    resource_version=version or None,
                    field_selector=selector,
                    timeout_seconds=300,
                ):
                    self._watch_allowed()
                    self._see(None if kind == "DELETED" else obj)
                self._watch_allowed()  # the server's timeout ended it: allowed, watch again
            except asyncio.CancelledError:
                raise
            except KubeForbiddenError as err:
                self._watch_forbidden(err)
                await asyncio.sleep(s.retry)
            except KubeError as err:
                log.debug("lease watch: %s", err)
                await asyncio.sleep(s.retry)

    def _watch_forbidden(self, err: KubeForbiddenError) -> None:
        """Say once (a warning and `on_watch_refused`) that the Lease cannot be watched."""
        if self.watch_refused:
            return
        self.watch_refused = True
        s = self.settings
        log.warning(
            "cannot watch lease %s/%s (%s): this replica reads it every %g s instead, so as a "
            "standby it takes over up to that much later than the holder's lease expires; fix: "
            "grant the operator `watch` on leases (coordination.k8s.io) named %s in namespace "
            "%s (the chart's leader-election Role does)",
            s.namespace,
            s.name,
            err,
            s.retry,
            s.name,
            s.namespace,
        )
        if self.on_watch_refused is not None:
            self.on_watch_refused(True)

    def _watch_allowed(self) -> None:
        if not self.watch_refused:
            return
        self.watch_refused = False
        log.info("watching lease %s/%s again", self.settings.namespace, self.settings.name)
        if self.on_watch_refused is not None:
            self.on_watch_refused(False)
