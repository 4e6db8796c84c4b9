"""The head handoff, loader side: watch our own HotLoadDeployment's `status.ledgerHead` (the
operator reads the ledger at the origin once per cluster) and decide when the loader itself must
ask the origin.

The loader reads the ledger from the origin only when the handed head is newer than its copy,
the pin object only when `spec.pin` differs from the pin it follows (at once, then backing off
while the operator has not written the object yet), and the hints of the `uploading` identities
one by one (no LIST). Its own poll of the origin is the safety net: every
`max(--safety-poll-seconds, --poll-seconds)` jittered, and only while the watch is down or the
operator's `checkedTime` is older than `--head-stale-seconds` (the operator is gone or cannot
read the ledger). Without `--deployment` (the demo, plain processes) none of this runs and the
loader polls the origin every `--poll-seconds` as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL
from hotload.errors import KubeError, KubeGoneError
from hotload.kube import KubeClient, resource_path
from hotload.ledger import LedgerEntry
from hotload_sidecar.pacing import jittered

log = logging.getLogger("hotload_sidecar.head_watch")

#: Seconds a watch request lasts before it is renewed (the server ends it; we watch again).
WATCH_TIMEOUT_SECONDS = 300
#: Longest wait before the watch is tried again after a failure (doubling from 1 s).
MAX_RETRY_SECONDS = 30.0


@dataclass(frozen=True)
class HandedHead:
    """`status.ledgerHead` as the operator wrote it."""

    identity: str | None
    sequence: int | None
    checked: datetime | None
    uploading: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: Any) -> HandedHead | None:
        """The head in a status's `ledgerHead` (None when absent or malformed)."""
        if not isinstance(value, dict):
            return None
        sequence = value.get("sequence")
        try:
            checked = datetime.fromisoformat(str(value.get("checkedTime")))
        except ValueError:
            checked = None
        uploading = value.get("uploading") or []
        return cls(
            identity=value.get("identity") if isinstance(value.get("identity"), str) else None,
            sequence=sequence if isinstance(sequence, int) else None,
            checked=checked,
            uploading=tuple(u for u in uploading if isinstance(u, str)),
        )


@dataclass(frozen=True)
class OriginReads:
    """What one loader step asks the origin for."""

    ledger: bool
    pin: bool
    #: The identities whose hints to read one by one (None: LIST the hints, as without a
    #: handoff, but only in a step that reads the ledger).
    hinted: tuple[str, ...] | None


#: A poll without a handoff: the ledger, the pin object and a LIST of the hints.
EVERYTHING = OriginReads(ledger=True, pin=True, hinted=None)


class HeadWatch:
    """Watches one HotLoadDeployment for the loader (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        name: str,
        *,
        poll_seconds: float = 2.0,
        safety_seconds: float = 30.0,
        stale_seconds: float = 90.0,
        jitter: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.poll_seconds = poll_seconds
        self.safety_seconds = max(safety_seconds, poll_seconds)
        self.stale_seconds = stale_seconds
        self.jitter = jitter
        self.clock = clock
        self.now = now
        #: The head last handed over (None: none seen yet).
        self.head: HandedHead | None = None
        #: spec.pin as last seen, and whether the object was seen at all.
        self.spec_pin: str | None = None
        self.seen = False
        #: Whether the watch runs now (a failed request or a broken stream: down until it
        #: is established again).
        self.up = False
        #: Set when the head, uploading list or spec.pin changed (the loader steps at once).
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._safety_at = float("-inf")
        self._pin_at = float("-inf")
        self._pin_delay = poll_seconds
        self._down_logged = False

    # --- what the loader asks ------------------------------------------------------------------

    def fresh(self) -> bool:
        """Whether the operator's head can be trusted now: the watch runs and its checkedTime
        is younger than `stale_seconds`."""
        head = self.head
        if not self.up or head is None or head.checked is None:
            return False
        return (self.now() - head.checked).total_seconds() <= self.stale_seconds

    def plan(self, known: LedgerEntry | None, have_ledger: bool, pin: str | None) -> OriginReads:
        """What to read from the origin in this step, given the loader's copy of the head
        (`known`), whether it read the ledger at all yet, and the pin it follows."""
        now = self.clock()
        if not have_ledger or (not self.fresh() and now >= self._safety_at):
            self._safety_at = now + jittered(self.safety_seconds, self.jitter)
            self._pin_delay = self.poll_seconds
            return EVERYTHING
        if not self.fresh():
            return OriginReads(ledger=False, pin=False, hinted=None)
        head = self.head
        assert head is not None
        moved = head.sequence is not None and (
            known is None
            or head.sequence > known.sequence
            or (head.sequence == known.sequence and head.identity != known.identity)
        )
        return OriginReads(ledger=moved, pin=self._pin_due(now, pin), hinted=head.uploading)

    def _pin_due(self, now: float, pin: str | None) -> bool:
        """Read the pin object when spec.pin differs from the pin followed: at once, then
        doubling up to the safety interval (the operator writes the object after the spec
        changed; a pin it refuses to write must not cost a read every step)."""
        if self.spec_pin == pin:
            self._pin_delay = self.poll_seconds
            self._pin_at = float("-inf")
            return False
        if now < self._pin_at:
            return False
        self._pin_at = now + self._pin_delay
        self._pin_delay = min(self._pin_delay * 2, self.safety_seconds)
        return True

    async def wait(self, stop: asyncio.Event, seconds: float) -> None:
        """Wait `seconds`, or less when `stop` is set or the handed head changed."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.changed.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self.changed.clear()

    # --- the watch -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching (a background task until `close`)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="head watch")

    async def close(self) -> None:
        """Stop watching and close the API client (the watch owns it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        await self.client.aclose()

    async def run(self) -> None:
        """Read the object, then watch it; on a failure mark the watch down (the loader's own
        origin poll takes over) and try again, backing off up to `MAX_RETRY_SECONDS`."""
        delay = 1.0
        collection = resource_path(API_VERSION, DEPLOYMENT_PLURAL, self.namespace)
        selector = f"metadata.name={self.name}"
        while True:
            try:
                listed = await self.client.list(collection, field_selector=selector)
                version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                items = listed.get("items") or []
                self._take(items[0] if items else None)
                self._mark_up()
                delay = 1.0
                while True:
                    async for kind, obj in self.client.watch(
                        collection,
                        resource_version=version or None,
                        field_selector=selector,
                        timeout_seconds=WATCH_TIMEOUT_SECONDS,
                        allow_bookmarks=True,
                    ):
                        version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                        if kind in ("ADDED", "MODIFIED"):
                            self._take(obj)
                        elif kind == "DELETED":
                            self._take(None)
            except KubeGoneError:
                continue  # the version expired: list again
            except (KubeError, OSError, ValueError) as err:
                self._mark_down(err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_SECONDS)

    def _take(self, obj: dict[str, Any] | None) -> None:
        if obj is None:
            head, pin, seen = None, None, False
        else:
            head = HandedHead.parse((obj.get("status") or {}).get("ledgerHead"))
            pin = (obj.get("spec") or {}).get("pin")
            pin, seen = (pin if isinstance(pin, str) else None), True
        # checkedTime alone (the heartbeat) wakes nobody.
        if _moved(head, self.head) or pin != self.spec_pin:
            self.changed.set()
        self.head, self.spec_pin, self.seen = head, pin, seen

    def _mark_up(self) -> None:
        if not self.up:
            log.info("watching %s/%s for the ledger head", self.namespace, self.name)
        self.up, self._down_logged = True, False

    def _mark_down(self, err: BaseException) -> None:
        self.up = False
        if not self._down_logged:
            log.warning(
                "cannot watch hotloaddeployment %s/%s (%s): polling the origin every %gs until "
                "the watch is back",
                self.namespace,
                self.name,
                err,
                self.safety_seconds,
            )
            self._down_logged = True


def _moved(new: HandedHead | None, old: HandedHead | None) -> bool:
    """Whether the head or uploading list differ (checkedTime aside)."""
    if new is None or old is None:
        return (new is None) != (old is None)
    return (new.identity, new.sequence, new.uploading) != (
        old.identity,
        old.sequence,
        old.uploading,
    )
