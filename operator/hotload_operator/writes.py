"""Status writes: merge patches of the `status` subresource that skip what would change nothing
and remember what they wrote (the watch-fed cache sees the operator's own write a moment later).
Like every write of the operator, they go out only while this replica leads (`fence`).
"""

from __future__ import annotations

import logging
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


def _version(value: str) -> int | None:
    """A resourceVersion as a number (etcd's revisions are), or None."""
    return int(value) if value.isdigit() else None


@dataclass
class _Written:
    status: JSON  # stored form, merged with what was there
    resource_version: str


@dataclass
class StatusWriter:
    """Writes the status of HotLoadDeployments and Snapshots for the operator.

    `write` compares the new status with the newest one known, the cache's or the one this
    writer last wrote, whichever the API server stored later, and sends nothing when they agree.
    `observed` tells a watch event of the writer's own write (nothing to do) from someone
    else's change (roll up again)."""

    kube: KubeClient
    writes: Counter | None = None
    _memory: dict[tuple[str, Key], _Written] = field(default_factory=dict)

    def previous(self, plural: str, key: Key, cached: JSON, cached_version: str) -> JSON:
        """The newest status known for object `key`: the cache's, or the last one written when
        the cache has not seen that write yet."""
        written = self._memory.get((plural, key))
        if written is None:
            return cached
        mine, theirs = _version(written.resource_version), _version(cached_version)
        if mine is not None and theirs is not None and theirs > mine:
            return cached
        return written.status

    def observed(self, plural: str, key: Key, status: JSON, version: str) -> bool:
        """Note a status the watch delivered; True when it is not what this writer last wrote
        (another writer changed it, so the roll-up should look again)."""
        written = self._memory.get((plural, key))
        if written is None:
            return False
        mine, theirs = _version(written.resource_version), _version(version)
        if mine is not None and theirs is not None and theirs <= mine:
            return False  # the echo of an older write, or of this one
        if stored_form(status) == written.status:
            return False
        del self._memory[(plural, key)]
        return True

    def forget(self, plural: str, key: Key) -> None:
        """Drop what was remembered of object `key` (deleted)."""
        self._memory.pop((plural, key), None)

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
        self._memory[(plural, key)] = _Written(stored_form(stored.get("status") or {}), version)
        return True
