"""The head handoff, loader side: watch our deployment's `HotLoadHead` (same name as the
deployment; its `spec` is a `Handoff` the operator writes after reading the ledger at the origin
once for its whole cluster) and decide what the loader itself must ask the origin for.

While the handoff is fresh (the watch runs and this loader saw the operator's `checked` move
less than `--head-stale-seconds` ago) an update costs the origin no small request: the loader
merges the handed entries into its copy of the ledger (`merge_handed`; the origin only when they
do not reach back to its copy, or disagree with it), takes the snapshot folders' listings and
the upload hints from the handoff (no LIST, no hint GET; hints too large for the object are
`hints_omitted`, and the loader keeps its early fetches until a read of the ledger lists them),
and reads the pin object only when the handed `pin` (the deployment's spec.pin) differs from the
pin it follows (at once, then backing off while the operator has not written the object yet).
Its own poll of the origin is the safety net: every `max(--safety-poll-seconds, --poll-seconds)`
jittered, and only while the watch is down, the handoff is missing or malformed, or `checked`
has not moved for `--head-stale-seconds` (the operator is gone or cannot read the ledger).
Freshness is judged by when this loader saw `checked` change, on its own monotonic clock, as
leader election judges a lease by when it saw the lease renewed: the operator's wall clock and
the loader's need not agree (the wall clock only keeps a handoff checked long ago from being
trusted on first sight). The first read at start-up is always the origin's. Without
`--deployment` (the demo, plain processes) none of this runs and the loader polls the origin
every `--poll-seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hotload.api.names import API_VERSION, HEAD_PLURAL, head_object_name
from hotload.errors import KubeError, KubeGoneError, LedgerError
from hotload.kube import KubeClient, resource_path
from hotload.ledger.handoff import Handoff
from hotload.ledger.hints import Hint
from hotload_sidecar.pacing import jittered

log = logging.getLogger("hotload_sidecar.head_watch")

#: Seconds a watch request lasts before it is renewed (the server ends it; we watch again).
WATCH_TIMEOUT_SECONDS = 300
#: Longest wait before the watch is tried again after a failure (doubling from 1 s).
MAX_RETRY_SECONDS = 30.0


@dataclass(frozen=True)
class OriginReads:
    """What one loader step takes from where."""

    #: Read the ledger at the origin.
    ledger: bool
    #: Read the pin object at the origin.
    pin: bool
    #: The upload hints handed over (None: LIST and read them at the origin, as without a
    #: handoff, but only in a step that reads the ledger).
    hints: tuple[Hint, ...] | None
    #: A fresh handoff whose counter differs from the loader's copy: merge it (the origin only
    #: when `merge_handed` cannot).
    handed: Handoff | None = None


#: A poll without a handoff: the ledger, the pin object and a LIST of the hints.
EVERYTHING = OriginReads(ledger=True, pin=True, hints=None)


class HeadWatch:
    """Watches one deployment's head handoff for the loader (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        deployment: str,
        *,
        ledger: str | None = None,
        poll_seconds: float = 2.0,
        safety_seconds: float = 30.0,
        stale_seconds: float = 90.0,
        jitter: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`ledger`: the ledger this loader follows (a handoff of another one is refused as
        malformed: the deployment and the loader disagree, and the origin decides)."""
        self.client = client
        self.namespace = namespace
        self.deployment = deployment
        #: The HotLoadHead watched (the deployment's own name).
        self.name = head_object_name(deployment)
        self.ledger = ledger
        self.poll_seconds = poll_seconds
        self.safety_seconds = max(safety_seconds, poll_seconds)
        self.stale_seconds = stale_seconds
        self.jitter = jitter
        self.clock = clock
        #: The wall clock, asked only on first sight of a handoff (see `_take`).
        self.now = now
        #: The handoff last read (None: none yet, deleted, or malformed).
        self.handoff: Handoff | None = None
        #: spec.pin as handed over (None: follow the head).
        self.spec_pin: str | None = None
        #: Whether the watch runs now (a failed request or a broken stream: down until it
        #: is established again).
        self.up = False
        #: Set when anything but `checked` changed in the handoff (the loader steps at once).
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: When (`clock`) the handoff's `checked` was last seen to change.
        self._checked_seen = float("-inf")
        self._safety_at = float("-inf")
        self._pin_at = float("-inf")
        self._pin_delay = poll_seconds
        self._down_logged = False
        #: The malformed document last warned about (warned once, not on every event).
        self._refused: str | None = None

    # --- what the loader asks ------------------------------------------------------------------

    def fresh(self) -> bool:
        """Whether the operator's handoff can be trusted now: the watch runs and this loader saw
        its `checked` change less than `stale_seconds` ago."""
        handoff = self.handoff
        if not self.up or handoff is None or handoff.checked is None:
            return False
        return self.clock() - self._checked_seen <= self.stale_seconds

    def current(self) -> Handoff | None:
        """The handoff when it is fresh (None: the loader asks the origin itself)."""
        return self.handoff if self.fresh() else None

    def plan(self, sequence: int | None, pin: str | None) -> OriginReads:
        """What this step takes from where, given the counter of the loader's copy of the
        ledger (None: not read yet) and the pin it follows."""
        now = self.clock()
        handoff = self.current()
        if sequence is None or (handoff is None and now >= self._safety_at):
            self._safety_at = now + jittered(self.safety_seconds, self.jitter)
            self._pin_delay = self.poll_seconds
            return EVERYTHING
        if handoff is None:
            return OriginReads(ledger=False, pin=False, hints=None)
        handed = handoff if handoff.sequence != sequence else None
        # Hints that did not fit the handoff are unknown, not absent: no early fetch is dropped.
        hints = None if handoff.hints_omitted else handoff.hints
        return OriginReads(ledger=False, pin=self._pin_due(now, pin), hints=hints, handed=handed)

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
        """Wait `seconds`, or less when `stop` is set or the handoff changed."""
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
        """Read the HotLoadHead, then watch it; on a failure mark the watch down (the loader's
        own origin poll takes over) and try again, backing off up to `MAX_RETRY_SECONDS`."""
        delay = 1.0
        collection = resource_path(API_VERSION, HEAD_PLURAL, self.namespace)
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
        """Take the HotLoadHead `obj` as it is now (None: deleted or not written yet)."""
        handoff = self._parse(obj) if obj is not None else None
        # `checked` alone (the heartbeat) wakes nobody.
        moved = (
            self.handoff is not None if handoff is None else not handoff.same_content(self.handoff)
        )
        if moved:
            self.changed.set()
        checked = handoff.checked if handoff is not None else None
        if checked is not None and (self.handoff is None or checked != self.handoff.checked):
            # On first sight nothing was seen move: one checked longer ago than a stale handoff
            # by the wall clock (an operator gone for an hour) waits for its next heartbeat.
            # A clock off by less than that changes nothing, and the wall clock never ages one.
            old = (self.now() - checked).total_seconds() > self.stale_seconds
            if self.handoff is not None or not old:
                self._checked_seen = self.clock()
        self.handoff = handoff
        self.spec_pin = handoff.pin if handoff is not None else None

    def _parse(self, obj: dict[str, Any]) -> Handoff | None:
        """The handoff in HotLoadHead `obj`; None, with one warning naming the object and the
        field, when it is missing or malformed (the loader's own poll takes over)."""
        where = f"hotloadhead {self.namespace}/{self.name} spec"
        spec = obj.get("spec")
        try:
            if not isinstance(spec, dict):
                raise LedgerError(f"{where}: missing (the operator writes it)")
            handoff = Handoff.loads(json.dumps(spec), where)
            if self.ledger is not None and handoff.ledger != self.ledger:
                raise LedgerError(
                    f"{where}: ledger: hands over ledger {handoff.ledger!r}, this loader follows "
                    f"{self.ledger!r}"
                )
        except LedgerError as err:
            if str(err) != self._refused:
                self._refused = str(err)
                log.warning(
                    "ignoring the head handoff: %s; polling the origin every %gs until it is valid",
                    err,
                    self.safety_seconds,
                )
            return None
        if self._refused is not None:
            log.info(
                "the head handoff in hotloadhead %s/%s is valid again", self.namespace, self.name
            )
            self._refused = None
        return handoff

    def _mark_up(self) -> None:
        if not self.up:
            log.info("watching hotloadhead %s/%s for the ledger head", self.namespace, self.name)
        self.up, self._down_logged = True, False

    def _mark_down(self, err: BaseException) -> None:
        self.up = False
        if not self._down_logged:
            log.warning(
                "cannot watch hotloadhead %s/%s (%s): polling the origin every %gs until the "
                "watch is back",
                self.namespace,
                self.name,
                err,
                self.safety_seconds,
            )
            self._down_logged = True
