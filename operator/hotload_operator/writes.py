"""Status writes: merge patches of the `status` subresource that skip what would change nothing
and remember what they wrote (the watch-fed cache sees the operator's own write a moment later).
Like every write of the operator, they go out only while this replica leads (`fence`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from hotload.api.names import API_VERSION
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from hotload_operator.conditions import stored_form
from hotload_operator.informer import Key

log = logging.getLogger("hotload_operator")
JSON = dict[str, Any]


#: Seconds a write's own watch event may take to arrive before the cache is trusted again
#: without it (a watch that re-listed after it expired delivers the newest state, never the
#: echo of each write in between).
ECHO_TIMEOUT = 60.0


@dataclass
class _Written:
    status: JSON  # stored form, merged with what was there
    resource_version: str
    at: float  # when written (`StatusWriter.clock`)
    #: Whether the watch delivered this write yet: from then on the cache is as new or newer.
    echoed: bool = False


@dataclass
class StatusWriter:
    """Writes the status of HotLoadDeployments and Snapshots for the operator.

    `write` compares the new status with the newest one known, the cache's or the one this
    writer last wrote, and sends nothing when they agree. `observed` tells a watch event of the
    writer's own write (nothing to do) from someone else's change (roll up again).

    resourceVersions are opaque (the API conventions): they are only ever compared for
    equality. What orders them is the watch, which delivers one object's changes in order: until
    the event of a write arrives (its echo), the cache holds an older state and the write is the
    newest known; once it has, the cache is (`ECHO_TIMEOUT` bounds the wait for an echo that a
    re-listing watch skipped)."""

    kube: KubeClient
    writes: Counter | None = None
    clock: Callable[[], float] = time.monotonic
    _memory: dict[tuple[str, Key], _Written] = field(default_factory=dict)

    def _current(self, plural: str, key: Key, cached_version: str) -> _Written | None:
        """The last write of `key` while it is newer than the cache (else None, forgotten)."""
        written = self._memory.get((plural, key))
        if written is None:
            return None
        if cached_version == written.resource_version:
            written.echoed = True
        if written.echoed or self.clock() - written.at > ECHO_TIMEOUT:
            return None
        return written

    def previous(self, plural: str, key: Key, cached: JSON, cached_version: str) -> JSON:
        """The newest status known for object `key`: the cache's, or the last one written when
        the cache has not seen that write yet."""
        written = self._current(plural, key, cached_version)
        return cached if written is None else written.status

    def observed(self, plural: str, key: Key, status: JSON, version: str) -> bool:
        """Note a status the watch delivered; True when it is not what this writer last wrote
        (another writer changed it, so the roll-up should look again)."""
        written = self._memory.get((plural, key))
        if written is None:
            return False
        if version == written.resource_version:
            written.echoed = True  # the echo of the last write
            return False
        if not written.echoed and self.clock() - written.at <= ECHO_TIMEOUT:
            return False  # an event from before the last write, still on its way
        if stored_form(status) == written.status:
            return False
        del self._memory[(plural, key)]
        return True

    def forget(self, plural: str, key: Key) -> None:
        """Drop what was remembered of object `key` (deleted)."""
        self._memory.pop((plural, key), None)

    def __len__(self) -> int:
        """Entries kept (`hotload_operator_cached_entries`)."""
        return len(self._memory)

    async def write(
        self, plural: str, key: Key, status: JSON, cached: JSON, cached_version: str
    ) -> bool:
        """Merge-patch `status` into object `key`'s status unless the newest known status
        already holds it (top-level nulls remove fields); return whether it wrote.

        Raises `NotLeadingError` (from the client's fence) when this replica may not write."""
        before = self.previous(plural, key, cached, cached_version)
        wanted = stored_form(status)
        if wanted == stored_form({k: before.get(k) for k in status}):
            return False
        path = resource_path(API_VERSION, plural, key[0] or None, key[1], "status")
        try:
            stored = await self.kube.patch(path, {"status": status}, "merge")
        except KubeNotFoundError:
            self.forget(plural, key)
            return False
        if self.writes is not None:
            self.writes.labels(plural).inc()
        version = str((stored.get("metadata") or {}).get("resourceVersion") or "")
        written = _Written(stored_form(stored.get("status") or {}), version, self.clock())
        self._memory[(plural, key)] = written
        return True
