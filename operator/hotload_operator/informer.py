"""Watch-fed caches: the operator's view of the objects it rolls up, kept by list + watch.

An `Informer` lists one kind of object once (in pages, so 8,000 pods never sit in memory as one
response), then follows its watch. It keeps each object as a `transform` of it (only what the
operator reads), grouped by an index key, and calls `on_change` for every change, so that the
roll-up reads memory instead of asking the API server. A watch that ends or breaks resumes from
the last resourceVersion it saw (bookmarks keep that fresh); only an expired version (410 Gone)
or an unreadable stream lists again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from hotload.errors import KubeError, KubeGoneError, KubeUnavailableError
from hotload.kube import KubeClient, resource_path

log = logging.getLogger("hotload_operator.informer")

JSON = dict[str, Any]
#: An object's (namespace, name); the namespace is "" for cluster-scoped kinds.
Key = tuple[str, str]
T = TypeVar("T")

#: Objects per page of a list (the API server's own default chunk size).
PAGE_SIZE = 500
#: Seconds the server keeps one watch open before it ends it (the informer then resumes).
WATCH_SECONDS = 300
#: Seconds to wait before watching again after the API server could not be reached.
RETRY_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0


@dataclass
class InformerStats:
    """What an informer asked of the API server, for metrics, tests and benchmarks."""

    #: Full lists (the first, and each one after an expired or unreadable watch).
    lists: int = 0
    #: Watch requests (each resumes from the last resourceVersion seen).
    watches: int = 0
    #: Events applied to the cache (bookmarks excluded).
    events: int = 0


def object_key(obj: JSON) -> Key:
    """`(namespace, name)` of an API object."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


@dataclass
class Informer(Generic[T]):
    """One kind of object (in one namespace, or all), listed once and then watched.

    `transform(obj, previous)` turns an object into what the cache keeps (None leaves it out, as
    if deleted); it gets the record kept before, to reuse work that did not change. Each of
    `indexes` groups records by the key its function returns (None: not in that index), read
    with `indexed(name, key)`; `on_change(key, old, new)` runs for every change, with None for
    an absent side. Callbacks run in the informer's task and must not block."""

    kube: KubeClient
    api_version: str
    plural: str
    transform: Callable[[JSON, T | None], T | None]
    namespace: str | None = None
    label_selector: str | None = None
    indexes: Mapping[str, Callable[[T], Hashable | None]] = field(default_factory=dict)
    on_change: Callable[[Key, T | None, T | None], None] | None = None
    page_size: int = PAGE_SIZE
    watch_seconds: int = WATCH_SECONDS
    stats: InformerStats = field(default_factory=InformerStats)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    _objects: dict[Key, T] = field(default_factory=dict)
    #: index name -> group -> the records in it; and where each record sits, per index.
    _groups: dict[str, dict[Hashable, dict[Key, T]]] = field(default_factory=dict)
    _group_of: dict[str, dict[Key, Hashable]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        """The collection this informer follows."""
        return resource_path(self.api_version, self.plural, self.namespace)

    @property
    def name(self) -> str:
        """A short name for logs: the kind's plural and namespace."""
        return f"{self.plural} in {self.namespace or 'all namespaces'}"

    def get(self, key: Key) -> T | None:
        """The record of object `key`, if the cache has it."""
        return self._objects.get(key)

    def indexed(self, index: str, group: Hashable) -> Mapping[Key, T]:
        """The records that index `index` puts in `group` (empty when none)."""
        return self._groups.get(index, {}).get(group, {})

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._objects.values()))

    def __len__(self) -> int:
        return len(self._objects)

    async def run(self) -> None:
        """List, then follow the watch until cancelled."""
        delay = RETRY_SECONDS
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list()
                    self.synced.set()
                version = await self._watch(version)
                delay = RETRY_SECONDS
            except asyncio.CancelledError:
                raise
            except KubeGoneError:
                log.info("%s: watch expired (410 Gone): listing again", self.name)
                version = None
            except KubeUnavailableError as err:
                log.warning("%s: watch broke (%s); resuming in %.0f s", self.name, err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
            except KubeError as err:
                # Forbidden, an unreadable event, ...: nothing to resume from with confidence.
                log.warning("%s: %s; listing again in %.0f s", self.name, err, delay)
                version = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)

    async def _list(self) -> str:
        """Replace the cache with a fresh list (page by page); return its resourceVersion."""
        seen: set[Key] = set()
        token: str | None = None
        version = ""
        self.stats.lists += 1
        while True:
            page = await self.kube.list(
                self.path,
                label_selector=self.label_selector,
                limit=self.page_size,
                continue_token=token,
            )
            meta = page.get("metadata") or {}
            version = version or str(meta.get("resourceVersion") or "")
            for obj in page.get("items") or []:
                seen.add(self._put(object_key(obj), obj))
            token = meta.get("continue") or None
            if not token:
                break
        for key in [k for k in self._objects if k not in seen]:
            self._remove(key)
        return version

    async def _watch(self, version: str) -> str:
        """Follow one watch from `version`; return the last version seen when it ends."""
        self.stats.watches += 1
        async for kind, obj in self.kube.watch(
            self.path,
            resource_version=version,
            timeout_seconds=self.watch_seconds,
            label_selector=self.label_selector,
            allow_bookmarks=True,
        ):
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            self.stats.events += 1
            key = object_key(obj)
            if kind == "DELETED":
                self._remove(key)
            else:
                self._put(key, obj)
        return version

    def _put(self, key: Key, obj: JSON) -> Key:
        old = self._objects.get(key)
        new = self.transform(obj, old)
        if new is None:
            self._remove(key)
            return key
        self._objects[key] = new
        for index, group_of in self.indexes.items():
            group = group_of(new)
            placed = self._group_of.setdefault(index, {})
            before = placed.get(key)
            if before is not None and before != group:
                self._ungroup(index, key, before)
            if group is None:
                placed.pop(key, None)
                continue
            self._groups.setdefault(index, {}).setdefault(group, {})[key] = new
            placed[key] = group
        if self.on_change is not None:
            self.on_change(key, old, new)
        return key

    def _remove(self, key: Key) -> None:
        old = self._objects.pop(key, None)
        for index in self.indexes:
            group = self._group_of.get(index, {}).pop(key, None)
            if group is not None:
                self._ungroup(index, key, group)
        if old is not None and self.on_change is not None:
            self.on_change(key, old, None)

    def _ungroup(self, index: str, key: Key, group: Hashable) -> None:
        groups = self._groups.get(index, {})
        members = groups.get(group)
        if members is not None:
            members.pop(key, None)
            if not members:
                del groups[group]
