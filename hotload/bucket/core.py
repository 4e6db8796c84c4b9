"""The `Bucket`: one small typed interface over obstore for a local folder, S3 and GCS.

Every method has an async form (`*_async`, the core) and a blocking twin for scripts and the
CLI. Keys are `/`-separated paths relative to the bucket URL (its prefix included). The value
types are in `objects`, the local folder's file work in `local`, and `stores.open_bucket` opens
one from a URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import obstore
from obstore.exceptions import NotModifiedError
from obstore.store import GCSStore, LocalStore, S3Store

from hotload.bucket.local import (
    TMP_MARK,
    as_bytes,
    is_internal,
    local_copy,
    local_get,
    local_head,
    local_put,
    local_put_conditional,
    pread,
    unlink_quiet,
)
from hotload.bucket.objects import (
    NotModified,
    ObjectData,
    ObjectInfo,
    Progress,
    WriteGate,
    check_key,
    run_sync,
)
from hotload.bucket.remote import RemoteStore, call_checked, in_thread, split_token
from hotload.bucket.retry import RetryPolicy, translate
from hotload.bucket.url import BucketURL
from hotload.errors import BucketError, ObjectNotFoundError
from hotload.faults import crash_point

if TYPE_CHECKING:
    pass

T = TypeVar("T")

DEFAULT_PART_SIZE = 16 * 1024 * 1024
DEFAULT_CONCURRENCY = 8


class Bucket:
    """A bucket (local folder, S3 or GCS) with ranged, parallel and conditional operations."""

    def __init__(
        self,
        location: BucketURL,
        *,
        store: S3Store | GCSStore | None = None,
        retry: RetryPolicy | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.location = location
        self.url = str(location)
        self.retry = retry or RetryPolicy()
        self.part_size = part_size
        self.concurrency = max(1, concurrency)
        self._remote = (
            None
            if store is None
            else RemoteStore(
                store,
                scheme=location.scheme,
                url=self.url,
                retry=self.retry,
                part_size=part_size,
                concurrency=self.concurrency,
            )
        )
        self._local_store: LocalStore | None = None
        #: What each attempt of a write passes (None: nothing; see `gated`).
        self.gate: WriteGate | None = None

    def gated(self, gate: WriteGate) -> Bucket:
        """This bucket (the same store and settings) with every attempt of every write, each
        retry included, passing `gate` first."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.gate = gate
        return copy

    def __repr__(self) -> str:
        return f"Bucket({self.url!r})"

    @property
    def is_local(self) -> bool:
        """True for a local folder."""
        return self.location.scheme == "file"

    # --- metadata -----------------------------------------------------------------------------

    async def head_async(self, key: str) -> ObjectInfo:
        """Return size and ETag of `key`; on a local folder this hashes the file for its ETag."""
        if self._remote is None:
            path = self._path(key)
            return await self._local(key, "HEAD", lambda: local_head(key, path))
        return await self._remote.head(key)

    async def exists_async(self, key: str) -> bool:
        """Return whether `key` exists."""
        if self._remote is None:
            path = self._path(key)
            return await asyncio.to_thread(path.is_file)
        try:
            await self.head_async(key)
        except ObjectNotFoundError:
            return False
        return True

    async def root_exists_async(self) -> bool:
        """Whether the bucket itself (a local folder: the folder) exists, as opposed to a key in
        it: a missing key and a missing bucket both read as not found."""
        if self._remote is None:
            return await asyncio.to_thread(self._root().is_dir)
        remote = self._remote
        try:
            # One page of a prefix that holds at most the ledgers: a missing bucket is a 404.
            await self._call(
                ".hotload",
                "LIST",
                lambda: obstore.list(remote.store, ".hotload", chunk_size=1).collect_async(),
                prefix=True,
            )
        except ObjectNotFoundError:
            return False
        return True

    async def list_async(self, prefix: str = "") -> list[ObjectInfo]:
        """List every object under `prefix` (a folder-like prefix: `a/b` lists `a/b/...`)."""
        if prefix:
            check_key(prefix.rstrip("/"))
        clean = prefix.rstrip("/") or None
        if self._remote is None:
            root = self._root()
            if not root.is_dir():
                return []
            local = self._local_obstore()
            metas = await self._call(
                prefix, "LIST", lambda: obstore.list(local, clean).collect_async(), prefix=True
            )
            return sorted(
                (
                    ObjectInfo(m["path"], m["size"], None, m["last_modified"])
                    for m in metas
                    if not is_internal(m["path"])
                ),
                key=lambda i: i.key,
            )
        remote = self._remote
        metas = await self._call(
            prefix, "LIST", lambda: obstore.list(remote.store, clean).collect_async(), prefix=True
        )
        return sorted((remote.info(m) for m in metas), key=lambda i: i.key)

    # --- reads --------------------------------------------------------------------------------

    async def get_async(self, key: str) -> ObjectData:
        """Read a whole (small) object with its ETag."""
        result = await self.get_if_changed_async(key, None)
        assert isinstance(result, ObjectData)
        return result

    async def get_if_changed_async(self, key: str, etag: str | None) -> ObjectData | NotModified:
        """Read `key` unless its ETag still equals `etag` (one small request when unchanged)."""
        if self._remote is None:
            path = self._path(key)
            return await self._local(key, "GET", lambda: local_get(key, path, etag))
        remote = self._remote
        store, scheme = remote.store, remote.scheme

        async def attempt() -> ObjectData | NotModified:
            options: dict[str, Any] = {}
            if etag is not None:
                options["if_none_match"] = split_token(etag)[0] if scheme == "gs" else etag
            try:
                result = await obstore.get_async(store, key, options=options or None)  # type: ignore[arg-type]
            except NotModifiedError:
                assert etag is not None
                return NotModified(key, etag)
            data = await result.bytes_async()
            return ObjectData(key, bytes(data), remote.token(result.meta))

        return await remote.call(key, "GET", attempt)

    async def get_range_async(self, key: str, start: int, end: int) -> bytes:
        """Read bytes `[start, end)` of `key`."""
        if end <= start:
            return b""
        if self._remote is None:
            path = self._path(key)
            return await self._local(key, "GET range", lambda: pread(path, start, end - start))
        store = self._remote.store
        data = await self._remote.call(
            key, "GET range", lambda: obstore.get_range_async(store, key, start=start, end=end)
        )
        return bytes(data)

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
        """Copy `key` to the local file `dest` atomically (temp file, then rename); return its size.

        Large objects are read as parallel ranged requests (`part_size` each, at most
        `concurrency` in flight, or as many as `semaphore` allows when several files share it).
        `size` and `etag` (from a listing) save a HEAD request; on S3 every range is read with
        `If-Match`, so an object replaced mid-download fails instead of mixing two versions.
        """
        target = Path(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}{TMP_MARK}{secrets.token_hex(4)}")
        try:
            if self._remote is None:
                src = self._path(key)
                total = await self._local(key, "GET", lambda: local_copy(src, tmp, progress))
            else:
                total = await self._remote.download(
                    key, tmp, size=size, etag=etag, progress=progress, semaphore=semaphore
                )
            crash_point("download-write")  # the bytes are in the temp file, not yet renamed
            await in_thread(os.replace, tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return total

    # --- writes -------------------------------------------------------------------------------

    async def put_async(
        self,
        key: str,
        data: bytes | str | os.PathLike[str],
        *,
        create_only: bool = False,
        if_match: str | None = None,
        progress: Progress | None = None,
    ) -> str | None:
        """Write `data` (bytes, or a local file path) to `key` atomically; return the new ETag.

        `create_only` fails with `ObjectExistsError` if the key exists; `if_match` fails with
        `PreconditionFailedError` unless the current ETag equals it. Large files go up as
        multipart uploads (`part_size` parts, at least 5 MiB, `concurrency` in flight); a
        failed upload leaves nothing visible.
        """
        if create_only and if_match is not None:
            raise ValueError("create_only and if_match exclude each other")
        source = data if isinstance(data, bytes) else Path(data)
        if self._remote is None:
            path = self._path(key)
            if create_only or if_match is not None:
                url = self.url
                return await self._local(
                    key,
                    "PUT",
                    lambda: local_put_conditional(
                        path, as_bytes(source), create_only, if_match, url=url, key=key
                    ),
                    write=True,
                )
            return await self._local(
                key, "PUT", lambda: local_put(path, source, progress), write=True
            )
        return await self._remote.put(key, source, create_only, if_match, progress, gate=self.gate)

    async def upload_file_async(
        self,
        src: str | os.PathLike[str],
        key: str,
        *,
        create_only: bool = False,
        progress: Progress | None = None,
    ) -> str | None:
        """Upload the local file `src` to `key` (multipart when large); return the new ETag."""
        return await self.put_async(key, Path(src), create_only=create_only, progress=progress)

    async def delete_async(self, key: str) -> None:
        """Delete `key`; deleting a missing key is not an error."""
        if self._remote is None:
            path = self._path(key)
            await self._local(key, "DELETE", lambda: unlink_quiet(path), write=True)
            return
        store = self._remote.store
        await self._remote.call(
            key, "DELETE", lambda: obstore.delete_async(store, key), gate=self.gate
        )

    # --- blocking twins -----------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        """Blocking `head_async`."""
        return run_sync(self.head_async(key))

    def exists(self, key: str) -> bool:
        """Blocking `exists_async`."""
        return run_sync(self.exists_async(key))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Blocking `list_async`."""
        return run_sync(self.list_async(prefix))

    def get(self, key: str) -> ObjectData:
        """Blocking `get_async`."""
        return run_sync(self.get_async(key))

    def get_if_changed(self, key: str, etag: str | None) -> ObjectData | NotModified:
        """Blocking `get_if_changed_async`."""
        return run_sync(self.get_if_changed_async(key, etag))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Blocking `get_range_async`."""
        return run_sync(self.get_range_async(key, start, end))

    def download_file(
        self,
        key: str,
        dest: str | os.PathLike[str],
        *,
        size: int | None = None,
        progress: Progress | None = None,
    ) -> int:
        """Blocking `download_file_async`."""
        return run_sync(self.download_file_async(key, dest, size=size, progress=progress))

    def put(
        self,
        key: str,
        data: bytes | str | os.PathLike[str],
        *,
        create_only: bool = False,
        if_match: str | None = None,
        progress: Progress | None = None,
    ) -> str | None:
        """Blocking `put_async`."""
        return run_sync(
            self.put_async(key, data, create_only=create_only, if_match=if_match, progress=progress)
        )

    def upload_file(
        self,
        src: str | os.PathLike[str],
        key: str,
        *,
        create_only: bool = False,
        progress: Progress | None = None,
    ) -> str | None:
        """Blocking `upload_file_async`."""
        return run_sync(
            self.upload_file_async(src, key, create_only=create_only, progress=progress)
        )

    def delete(self, key: str) -> None:
        """Blocking `delete_async`."""
        run_sync(self.delete_async(key))

    # --- internals ----------------------------------------------------------------------------

    async def _call(
        self,
        key: str,
        op: str,
        operation: Callable[[], Coroutine[Any, Any, T]],
        *,
        prefix: bool = False,
    ) -> T:
        return await call_checked(
            self.retry, operation, url=self.url, key=key, op=op, prefix=prefix
        )

    async def _local(self, key: str, op: str, fn: Callable[[], T], *, write: bool = False) -> T:
        # Local file calls run in a worker thread so they never stall the event loop, awaited
        # to their end when the caller is cancelled (`in_thread`): a cancelled download's copy
        # ran on into a folder its build had already removed, and left it behind. A write
        # passes the gate first (a folder write is one quick call: no retries to gate).
        try:
            if write and self.gate is not None:
                what = f"{op} {self.url.rstrip('/')}/{key}"
                async with self.gate.attempt(what, bounded=False):
                    return await in_thread(fn)
            return await in_thread(fn)
        except BucketError:
            raise
        except Exception as exc:
            error = translate(exc, url=self.url, key=key, op=op)
            if error is None:
                raise
            raise error from exc

    def _root(self) -> Path:
        assert self.location.root is not None
        return self.location.root

    def _path(self, key: str) -> Path:
        try:
            check_key(key)
        except ValueError as exc:
            raise BucketError(str(exc), url=self.url, key=key) from None
        return self._root().joinpath(*key.split("/"))

    def _local_obstore(self) -> LocalStore:
        if self._local_store is None:
            self._local_store = LocalStore(self._root())
        return self._local_store
