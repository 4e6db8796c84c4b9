"""Snapshot bytes from nearer copies: a `Bucket` that reads immutable keys from mirrors first.

`MirroredBucket(origin, mirrors)` is a `Bucket`, so the loader's code paths (downloads, early
fetches, sparse loads, adapters) use it unchanged. What goes where:

- **Through the mirrors, in order, then the origin**: reads (HEAD, GET, ranged GET, downloads)
  of snapshot files, `<identity>/<file>`: published once and never overwritten, and every byte
  is verified against the ledger entry before it is loaded.
- **The origin only**: everything under `.hotload/` (ledgers, pins, hints, gc journals),
  conditional reads (`get_if_changed` with an ETag: only mutable objects are polled), every
  write and delete, and every listing not known already. A snapshot folder is listed at the
  origin, whose answer is the truth, while a read-through cache's lazy listing may be stale or
  empty (a SeaweedFS lazy mount without `-listingCacheTTL` lists nothing) and a partial
  mirror's listing would hide files the snapshot has.
- **From memory**: the listing of a snapshot folder handed over by `know_listing` (the loader
  gives it those of the operator's head handoff), so that an update costs the origin no LIST
  per replica. That is safe because an admitted snapshot folder is immutable (admission refuses
  a folder with other files than its manifests name, and nothing rewrites it), the listing came
  from the origin itself (the operator listed it there), and every byte downloaded is still
  verified against the ledger entry's `contentDigest`: a wrong listing can fail an update, never
  load other weights.

A mirror that misses (404 while the origin has the object), errs or times out is skipped for a
while (exponential backoff, capped), with one warning naming the cause when it starts failing;
the read goes to the next source. Bytes and requests are counted per source (`MirrorStats`,
read by the loader's metrics and reports). A snapshot whose mirrored copy fails verification is
`reject`ed: counted, and its objects (or the one the error names) are read from the origin only
from then on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from hotload.bucket.core import Bucket
from hotload.bucket.objects import NotModified, ObjectData, ObjectInfo, Progress
from hotload.bucket.retry import RetryPolicy
from hotload.bucket.stores import open_bucket
from hotload.bucket.url import S3_SETTINGS, load_settings, parse_bucket_url
from hotload.errors import BucketError, ObjectNotFoundError
from hotload.snapshot.layout import validate_identity

log = logging.getLogger("hotload.bucket.mirrors")

T = TypeVar("T")

#: The label of the origin in counters and metrics.
ORIGIN = "origin"
#: Keys under this folder are mutable state: never read from a mirror.
MUTABLE_PREFIX = ".hotload/"
#: A mirror request (a small one, or the start of a download) that takes longer is abandoned.
DEFAULT_TIMEOUT = 10.0
#: A mirrored download is abandoned when slower than this on average (bytes per second).
MIN_RATE = 4 * 1024 * 1024
#: Backoff of a failing mirror: the first skip lasts this long, doubling up to the cap.
BACKOFF_INITIAL = 2.0
BACKOFF_CAP = 120.0


class ListedFile(Protocol):
    """One file of a snapshot folder's listing (a `HintFile`: name relative to the folder)."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def etag(self) -> str | None: ...


def is_immutable(key: str) -> bool:
    """Whether `key` is a snapshot file (`<identity>/<file>`), which a mirror may serve."""
    return "/" in key and not key.startswith(".") and not key.startswith(MUTABLE_PREFIX)


def source_label(url: str, endpoint: str | None) -> str:
    """A short label for a mirror: its endpoint's host[:port] and bucket (`cache.eu:8333/models`),
    or its URL when the endpoint is implicit (the store's default, a local folder)."""
    location = parse_bucket_url(url)
    host = (endpoint or "").split("://", 1)[-1].rstrip("/")
    return f"{host}/{location.bucket}" if host and location.scheme != "file" else url


@dataclass
class SourceCounts:
    """What one source served: bytes of object data and requests (all, and those for snapshot
    files and listings of snapshot folders), and copies rejected by verification."""

    bytes: int = 0
    requests: int = 0
    snapshot_bytes: int = 0
    snapshot_requests: int = 0
    rejected: int = 0

    def add(self, requests: int, nbytes: int, *, snapshot: bool) -> None:
        """Count `requests` that returned `nbytes` (snapshot traffic when `snapshot`)."""
        self.requests += requests
        self.bytes += nbytes
        if snapshot:
            self.snapshot_requests += requests
            self.snapshot_bytes += nbytes


@dataclass
class MirrorStats:
    """Per-source counters since the loader started (origin first, then mirrors in order)."""

    sources: dict[str, SourceCounts] = field(default_factory=dict)

    def source(self, label: str) -> SourceCounts:
        """The counters of `label`, created at zero."""
        return self.sources.setdefault(label, SourceCounts())

    def totals(self) -> dict[str, int]:
        """Cumulative snapshot traffic in the lastLoad report's names (origin vs. all mirrors
        together): the ledger, pin and hint polls are left out, they are no update's cost."""
        origin = self.sources.get(ORIGIN, SourceCounts())
        mirrors = [c for label, c in self.sources.items() if label != ORIGIN]
        return {
            "bytesFromOrigin": origin.snapshot_bytes,
            "bytesFromMirrors": sum(c.snapshot_bytes for c in mirrors),
            "requestsToOrigin": origin.snapshot_requests,
            "requestsToMirrors": sum(c.snapshot_requests for c in mirrors),
            "mirrorRejected": sum(c.rejected for c in mirrors),
        }

    @staticmethod
    def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        """The difference of two `totals()`: what one update took from where."""
        return {name: after[name] - before.get(name, 0) for name in after}


@dataclass
class _Mirror:
    bucket: Bucket
    label: str
    failures: int = 0
    skip_until: float = 0.0


class MirroredBucket(Bucket):
    """The origin `Bucket` with `mirrors` tried first for snapshot files (see the module doc)."""

    def __init__(
        self,
        origin: Bucket,
        mirrors: Sequence[Bucket],
        *,
        labels: Sequence[str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        stats: MirrorStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            origin.location,
            retry=origin.retry,
            part_size=origin.part_size,
            concurrency=origin.concurrency,
        )
        # Anything not overridden below acts on the origin's store.
        self._remote = origin._remote
        self._local_store = origin._local_store
        self.origin = origin
        names = list(labels) if labels is not None else [m.url for m in mirrors]
        self.mirrors = [_Mirror(m, name) for m, name in zip(mirrors, names, strict=True)]
        self.timeout = timeout
        self.stats = stats or MirrorStats()
        self.stats.source(ORIGIN)
        for m in self.mirrors:
            self.stats.source(m.label)
        self._clock = clock
        #: Which mirror each snapshot file came from, and what is read from the origin only.
        self._provenance = _Provenance()
        #: Snapshot identity -> its folder's listing as handed over (`know_listing`).
        self._listings: OrderedDict[str, list[ObjectInfo]] = OrderedDict()

    def __repr__(self) -> str:
        return f"MirroredBucket({self.url!r}, mirrors={[m.label for m in self.mirrors]!r})"

    # --- provenance and rejection ----------------------------------------------------------

    def mirrored(self, identity: str) -> dict[str, str]:
        """The files of snapshot `identity` last read from a mirror: key -> mirror label."""
        return self._provenance.mirrored(identity)

    def reject(self, identity: str, error: BaseException | str) -> int:
        """A copy of `identity` failed verification: if any of its files came from a mirror,
        count and warn, and read the file the error names (else the whole snapshot) from the
        origin only from now on. Return how many mirrored objects were rejected (0: none of
        the snapshot came from a mirror, so the mirrors are not to blame)."""
        mirrored = self.mirrored(identity)
        if not mirrored:
            return 0
        text = str(error)
        named = {k: v for k, v in mirrored.items() if k.rsplit("/", 1)[-1] in text}
        if named:
            blamed = named
            self._provenance.origin_only(identity, set(named))
        else:
            blamed = mirrored
            self._provenance.origin_only(identity, None)
        for key, label in blamed.items():
            self.stats.source(label).rejected += 1
            self._provenance.cleared(key)
        log.warning(
            "snapshot %s: %d object(s) read from mirror(s) %s failed verification (%s); never "
            "loaded, reading %s from the origin %s",
            identity,
            len(blamed),
            ", ".join(sorted(set(blamed.values()))),
            text,
            ", ".join(sorted(blamed)) if named else "the whole snapshot",
            self.origin.url,
        )
        return len(blamed)

    # --- reads that may come from a mirror -------------------------------------------------

    async def head_async(self, key: str) -> ObjectInfo:
        """HEAD of `key`: a mirror's answer for a snapshot file, the origin's otherwise."""
        return await self._read(
            key, lambda b: b.head_async(key), lambda _i: 0, requests=lambda _i: 1
        )

    async def get_if_changed_async(self, key: str, etag: str | None) -> ObjectData | NotModified:
        """A conditional read always goes to the origin (only mutable objects are polled); a
        plain read of a snapshot file may come from a mirror."""
        if etag is not None:
            return await self._origin(key, self.origin.get_if_changed_async(key, etag), _size)
        return await self._read(key, lambda b: b.get_if_changed_async(key, None), _size)

    async def get_range_async(self, key: str, start: int, end: int) -> bytes:
        """Bytes `[start, end)` of `key`, from a mirror for a snapshot file."""
        return await self._read(
            key, lambda b: b.get_range_async(key, start, end), len, size=max(0, end - start)
        )

    async def download_file_async(
        self,
        key: str,
        dest: str | os.PathLike[str],
        *,
        size: int | None = None,
        etag: str | None = None,
        progress: Progress | None = None,
        semaphore: asyncio.Semaphore | None = None,
    ) -> int:
        """Copy `key` to `dest` from the first source that has it (`Bucket.download_file_async`).

        A mirror is read without the origin's ETag (its copy may carry another one, e.g. a
        multipart ETag); its bytes are verified later against the ledger instead. Progress is
        reported only for the copy that completed."""
        parts = 1 if size is None else max(1, math.ceil(size / self.part_size))
        direct = not self._may_mirror(key)

        def fetch(bucket: Bucket) -> Awaitable[int]:
            tag = etag if bucket is self.origin else None
            return bucket.download_file_async(
                key,
                dest,
                size=size,
                etag=tag,
                progress=progress if direct else None,
                semaphore=semaphore,
            )

        total = await self._read(
            key,
            fetch,
            lambda n: n,
            requests=lambda _n: parts + (1 if size is None else 0),
            size=size,
        )
        if progress is not None and not direct:
            progress(total)
        return total

    # --- origin only -----------------------------------------------------------------------

    async def root_exists_async(self) -> bool:
        """Whether the origin bucket exists."""
        return await self._origin(".hotload", self.origin.root_exists_async(), lambda _r: 0)

    def know_listing(self, identity: str, files: Iterable[ListedFile]) -> None:
        """Remember the listing of snapshot `identity`'s folder (`files`: name relative to the
        folder, size, ETag), as the origin gave it to someone trusted (the operator): listing
        exactly that folder is answered from it from now on (see the module docstring for
        why that is safe). The newest `TRACKED_SNAPSHOTS` listings are kept."""
        validate_identity(identity)
        infos = sorted(
            (ObjectInfo(f"{identity}/{f.name}", f.size, f.etag) for f in files),
            key=lambda i: i.key,
        )
        _touch(self._listings, identity, infos)
        self._listings[identity] = infos

    async def list_async(self, prefix: str = "") -> list[ObjectInfo]:
        """List at the origin (listings are the truth; a cache's listing may be stale), except
        a snapshot folder whose listing was handed over (`know_listing`): from memory."""
        known = self._listings.get(prefix.rstrip("/")) if prefix else None
        if known is not None:
            return list(known)
        return await self._origin(prefix, self.origin.list_async(prefix), lambda _r: 0)

    async def put_async(
        self,
        key: str,
        data: bytes | str | os.PathLike[str],
        *,
        create_only: bool = False,
        if_match: str | None = None,
        progress: Progress | None = None,
    ) -> str | None:
        """Write to the origin (mirrors are never written)."""
        return await self._origin(
            key,
            self.origin.put_async(
                key, data, create_only=create_only, if_match=if_match, progress=progress
            ),
            lambda _r: 0,
        )

    async def delete_async(self, key: str) -> None:
        """Delete at the origin."""
        await self._origin(key, self.origin.delete_async(key), lambda _r: 0)

    # --- internals ---------------------------------------------------------------------------

    async def _origin(self, key: str, call: Awaitable[T], size: Callable[[T], int]) -> T:
        counts = self.stats.source(ORIGIN)
        snapshot = is_immutable(key) or (bool(key) and not key.startswith("."))
        try:
            result = await call
        except BaseException:
            counts.add(1, 0, snapshot=snapshot)
            raise
        counts.add(1, size(result), snapshot=snapshot)
        self._provenance.cleared(key)
        return result

    async def _read(
        self,
        key: str,
        call: Callable[[Bucket], Awaitable[T]],
        nbytes: Callable[[T], int],
        *,
        requests: Callable[[T], int] = lambda _r: 1,
        size: int | None = None,
    ) -> T:
        missed: list[tuple[_Mirror, str]] = []
        if self._may_mirror(key):
            now = self._clock()
            for mirror in self.mirrors:
                if mirror.skip_until > now:
                    continue
                try:
                    result = await asyncio.wait_for(call(mirror.bucket), self._limit(size))
                except ObjectNotFoundError as err:
                    self.stats.source(mirror.label).add(1, 0, snapshot=True)
                    missed.append((mirror, f"it lacks {key} ({err})"))
                    continue
                except (BucketError, OSError, TimeoutError) as err:
                    self.stats.source(mirror.label).add(1, 0, snapshot=True)
                    cause = str(err) or f"no answer within {self._limit(size):.0f}s"
                    self._failed(mirror, f"{type(err).__name__}: {cause}")
                    continue
                self.stats.source(mirror.label).add(requests(result), nbytes(result), snapshot=True)
                self._provenance.served(key, mirror.label)
                self._recovered(mirror)
                return result
        counts = self.stats.source(ORIGIN)
        snapshot = is_immutable(key)
        try:
            result = await call(self.origin)
        except BaseException:
            counts.add(1, 0, snapshot=snapshot)
            raise
        counts.add(requests(result), nbytes(result), snapshot=snapshot)
        self._provenance.cleared(key)
        # Only now is a miss the mirror's fault: the origin has the object.
        for mirror, cause in missed:
            self._failed(mirror, cause)
        return result

    def _may_mirror(self, key: str) -> bool:
        if not self.mirrors or not is_immutable(key):
            return False
        return not self._provenance.is_origin_only(key)

    def _limit(self, size: int | None) -> float:
        return self.timeout + (size or 0) / MIN_RATE

    def _failed(self, mirror: _Mirror, cause: str) -> None:
        mirror.failures += 1
        wait = min(BACKOFF_CAP, BACKOFF_INITIAL * 2 ** (mirror.failures - 1))
        mirror.skip_until = self._clock() + wait
        if mirror.failures == 1:
            log.warning(
                "mirror %s failed: %s; reading from the next source (the origin %s last) and "
                "skipping this mirror for %.0fs, longer while it keeps failing",
                mirror.label,
                cause,
                self.origin.url,
                wait,
            )

    def _recovered(self, mirror: _Mirror) -> None:
        if mirror.failures:
            log.info("mirror %s serves again after %d failure(s)", mirror.label, mirror.failures)
        mirror.failures = 0
        mirror.skip_until = 0.0


def _size(result: ObjectData | NotModified) -> int:
    return len(result.data) if isinstance(result, ObjectData) else 0


def open_mirrored(
    origin: Bucket, mirrors: Iterable[tuple[str, str | None]], *, timeout: float = DEFAULT_TIMEOUT
) -> MirroredBucket:
    """A `MirroredBucket` over `origin` and the mirrors `(url, credentials_dir)` opened in
    order (each with a single attempt per read: a failing mirror is skipped, not retried).
    Without mirrors it reads the origin only and still counts what the origin served."""
    opened: list[Bucket] = []
    labels: list[str] = []
    for url, credentials_dir in mirrors:
        bucket = open_bucket(
            url,
            credentials_dir=credentials_dir,
            retry=RetryPolicy(attempts=1),
            part_size=origin.part_size,
            concurrency=origin.concurrency,
        )
        settings = load_settings(S3_SETTINGS, credentials_dir=credentials_dir)
        endpoint = settings.get("AWS_ENDPOINT_URL_S3") or settings.get("AWS_ENDPOINT_URL")
        labels.append(source_label(url, endpoint if bucket.location.scheme == "s3" else None))
        opened.append(bucket)
    return MirroredBucket(origin, opened, labels=labels, timeout=timeout)


#: Snapshots whose provenance and rejections (and handed listings) are kept, the newest read: a
#: build covers the chain it rebuilds (a full snapshot and the deltas after it), far fewer, and
#: an older snapshot is not read again; without a bound a loader following a ledger for 10,000
#: steps would keep every file it ever read.
TRACKED_SNAPSHOTS = 64

_V = TypeVar("_V")


class _Provenance:
    """Per snapshot (its identity): the mirror each of its files last came from, and whether
    it (or some of its files) must be read from the origin only; the newest
    `TRACKED_SNAPSHOTS` snapshots are kept."""

    def __init__(self) -> None:
        self._served: OrderedDict[str, dict[str, str]] = OrderedDict()
        #: identity -> the keys read from the origin only (None: the whole snapshot).
        self._origin: OrderedDict[str, set[str] | None] = OrderedDict()

    def served(self, key: str, label: str) -> None:
        """`key` came from the mirror `label`."""
        _touch(self._served, _identity(key), {})[key] = label

    def cleared(self, key: str) -> None:
        """`key` came from the origin (or its mirrored copy was rejected)."""
        files = self._served.get(_identity(key))
        if files is not None:
            files.pop(key, None)

    def mirrored(self, identity: str) -> dict[str, str]:
        """The files of `identity` last read from a mirror: key -> mirror label."""
        return dict(self._served.get(identity, {}))

    def origin_only(self, identity: str, keys: set[str] | None) -> None:
        """Read `keys` of `identity` (None: all of it) from the origin only from now on."""
        held = self._origin.pop(identity, set())
        merged = None if keys is None or held is None else held | keys
        _touch(self._origin, identity, merged)

    def is_origin_only(self, key: str) -> bool:
        """Whether `key` must not be read from a mirror (its copy there was rejected)."""
        identity = _identity(key)
        if identity not in self._origin:
            return False
        keys = self._origin[identity]
        return keys is None or key in keys


def _touch(table: OrderedDict[str, _V], identity: str, default: _V) -> _V:
    # The newest snapshot last; the oldest leaves once there are more than TRACKED_SNAPSHOTS.
    if identity not in table:
        table[identity] = default
        while len(table) > TRACKED_SNAPSHOTS:
            table.popitem(last=False)
    table.move_to_end(identity)
    return table[identity]


def _identity(key: str) -> str:
    return key.split("/", 1)[0]
