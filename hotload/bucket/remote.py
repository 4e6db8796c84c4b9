"""An S3 or GCS store as the bucket drives it: every call checked and retried, revision tokens
(ETag, and the generation GCS needs for conditional writes), uploads in parts or as one
conditional request, and parallel ranged downloads that fail rather than mix two revisions."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import obstore
from obstore.store import GCSStore, S3Store

from hotload.bucket.objects import ObjectInfo, Progress, WriteGate, check_key
from hotload.bucket.retry import RetryPolicy, retrying
from hotload.errors import BucketError
from hotload.fileio import pwrite_all

if TYPE_CHECKING:
    from obstore import ObjectMeta, PutMode, PutResult

T = TypeVar("T")

#: S3 refuses multipart parts under 5 MiB (except the last one).
MIN_UPLOAD_PART = 5 * 1024 * 1024


async def call_checked(
    policy: RetryPolicy,
    operation: Callable[[], Coroutine[Any, Any, T]],
    *,
    url: str,
    key: str,
    op: str,
    prefix: bool = False,
) -> T:
    """Check `key` (an empty one only where `prefix` lists the whole bucket), then run one store
    operation with retries; errors become hotload `BucketError`s naming the URL and key."""
    if key or not prefix:
        try:
            check_key(key)
        except ValueError as exc:
            raise BucketError(f"{op}: {exc}", url=url, key=key) from None
    return await retrying(policy, operation, url=url, key=key or None, op=op)


@dataclass(frozen=True)
class RemoteStore:
    """The obstore store of a bucket on S3 or GCS, with the settings its transfers use."""

    store: S3Store | GCSStore
    scheme: str
    url: str
    retry: RetryPolicy
    part_size: int
    concurrency: int

    async def call(
        self,
        key: str,
        op: str,
        operation: Callable[[], Coroutine[Any, Any, T]],
        *,
        gate: WriteGate | None = None,
    ) -> T:
        """`call_checked` with this store's retry policy and URL; every attempt of a write
        passes `gate` (a retry after a backoff asks it again, and a refusal is not retried)."""
        if gate is not None:
            what = f"{op.split(' ', 1)[0]} {self.url.rstrip('/')}/{key}"
            inner = operation

            async def operation() -> T:
                async with gate.attempt(what):
                    return await inner()

        return await call_checked(self.retry, operation, url=self.url, key=key, op=op)

    async def head(self, key: str) -> ObjectInfo:
        """Size and revision token of `key`."""
        store = self.store
        return self.info(await self.call(key, "HEAD", lambda: obstore.head_async(store, key)))

    def token(self, meta: ObjectMeta | PutResult) -> str | None:
        """The revision token of an object: its ETag (with the generation on GCS)."""
        # GCS conditional writes need the generation, not the ETag: carry both in one token.
        etag, version = meta["e_tag"], meta["version"]
        if self.scheme == "gs" and etag is not None and version:
            return f"{etag}#{version}"
        return etag

    def info(self, meta: ObjectMeta) -> ObjectInfo:
        """An `ObjectInfo` from obstore's metadata."""
        return ObjectInfo(meta["path"], meta["size"], self.token(meta), meta["last_modified"])

    async def put(
        self,
        key: str,
        source: bytes | Path,
        create_only: bool,
        if_match: str | None,
        progress: Progress | None,
        *,
        gate: WriteGate | None = None,
    ) -> str | None:
        """Write `source` to `key`; return the new token. A conditional write (create-only or
        if-match) goes up as one request, a large plain one in `part_size` parts; each attempt
        passes `gate`."""
        store = self.store
        mode: PutMode
        if create_only:
            mode = "create"
        elif if_match is not None:
            etag, version = split_token(if_match)
            mode = {"e_tag": etag, "version": version} if version else {"e_tag": etag}
        else:
            mode = "overwrite"
        conditional = mode != "overwrite"
        if isinstance(source, Path):
            size = await asyncio.to_thread(lambda: source.stat().st_size)
        else:
            size = len(source)
        sent = 0
        chunk = max(self.part_size, MIN_UPLOAD_PART)

        def report(n: int) -> None:
            nonlocal sent
            sent += n
            if progress is not None:
                progress(n)

        async def attempt() -> str | None:
            nonlocal sent
            if sent:
                report(-sent)  # a retry starts over: take back what the failed attempt counted
            if conditional or size <= chunk:
                body = (
                    source
                    if isinstance(source, bytes)
                    else await asyncio.to_thread(source.read_bytes)
                )
                result = await obstore.put_async(store, key, body, mode=mode, use_multipart=False)
                report(size)
            else:
                assert isinstance(source, Path)
                # Without a progress callback obstore reads the file itself, without Python copies.
                stream = source if progress is None else file_chunks(source, chunk, report)
                result = await obstore.put_async(
                    store, key, stream, chunk_size=chunk, max_concurrency=self.concurrency
                )
                if progress is None:
                    report(size)
            return self.token(result)

        op = "PUT (create-only)" if create_only else ("PUT (if-match)" if if_match else "PUT")
        return await self.call(key, op, attempt, gate=gate)

    async def download(
        self,
        key: str,
        tmp: Path,
        *,
        size: int | None,
        etag: str | None,
        progress: Progress | None,
        semaphore: asyncio.Semaphore | None,
    ) -> int:
        """Read `key` into the file `tmp` as parallel ranged requests; return its size."""
        store = self.store
        if size is None:
            info = await self.head(key)
            size, etag = info.size, info.etag
        sem = semaphore or asyncio.Semaphore(self.concurrency)
        fd = await in_thread(
            os.open, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, abandoned=os.close
        )
        try:
            await in_thread(os.ftruncate, fd, size)
            if size == 0:
                return 0

            async def part(start: int, end: int) -> None:
                async with sem:
                    options: dict[str, Any] = {"range": (start, end)}
                    if etag is not None and self.scheme == "s3":
                        options["if_match"] = (
                            etag  # a concurrent overwrite fails loudly, not silently mixed
                        )

                    async def fetch() -> bytes:
                        result = await obstore.get_async(store, key, options=options)  # type: ignore[arg-type]
                        return bytes(await result.bytes_async())

                    data = await self.call(key, "GET range", fetch)
                    if len(data) != end - start:
                        raise BucketError(
                            f"GET range: got {len(data)} bytes for range {start}-{end}; "
                            "the object changed or is truncated",
                            url=self.url,
                            key=key,
                        )
                    await in_thread(pwrite_all, fd, data, start)
                if progress is not None:
                    progress(end - start)

            tasks = [
                asyncio.ensure_future(part(s, min(s + self.part_size, size)))
                for s in range(0, size, self.part_size)
            ]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                # Every part ends before the fd is closed, even if we are cancelled again.
                cancelled = await settle(tasks)
                for t in tasks:
                    if not t.cancelled():
                        t.exception()  # retrieved: the first failure is the one raised
                if cancelled is not None:
                    raise cancelled from None
                raise
        finally:
            await in_thread(os.close, fd)
        return size


async def settle(
    futures: Iterable[asyncio.Future[Any]],
) -> asyncio.CancelledError | None:
    """Wait until every one of `futures` is done, also through cancellations of the caller;
    return the last such cancellation (None if there was none) for the caller to raise once it
    has cleaned up."""
    cancelled: asyncio.CancelledError | None = None
    pending = {f for f in futures if not f.done()}
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError as err:
            cancelled = err
            pending = {f for f in pending if not f.done()}
    return cancelled


async def in_thread(
    fn: Callable[..., T], *args: Any, abandoned: Callable[[T], object] | None = None
) -> T:
    """`fn(*args)` in a worker thread, awaited to its end even when the caller is cancelled
    meanwhile; the cancellation is raised after it, and `abandoned` gets the result nobody will
    use. A thread cannot be stopped: `asyncio.to_thread` cancelled while the thread runs
    `os.open` loses the fd it opened (a download cancelled there held its deleted temp file
    open for good: 13 fds after one corrupted step in a 200-step soak), and a cancelled write
    would run on after the caller closed its fd (on a reused number, into another file)."""
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = await settle([job])
    if cancelled is None:
        return job.result()
    if not job.cancelled() and job.exception() is None and abandoned is not None:
        abandoned(job.result())
    raise cancelled


def split_token(token: str) -> tuple[str, str | None]:
    """Split a revision token into its ETag and GCS generation (None elsewhere)."""
    etag, sep, version = token.rpartition("#")
    return (etag, version) if sep and etag else (token, None)


def file_chunks(path: Path, chunk: int, report: Progress) -> Iterator[bytes]:
    """Yield a file's bytes in `chunk`-sized blocks, reporting each as it is read."""
    with path.open("rb") as f:
        while block := f.read(chunk):
            report(len(block))
            yield block
