"""The `Bucket`: one small typed interface over obstore for a local folder, S3 and GCS.

Every method has an async form (`*_async`, the core) and a blocking twin for scripts and the
CLI. Keys are `/`-separated paths relative to the bucket URL (its prefix included).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import secrets
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import obstore
from obstore.exceptions import NotModifiedError
from obstore.store import GCSStore, LocalStore, S3Store

from hotload.bucket.retry import RetryPolicy, retrying, translate
from hotload.bucket.url import (
    GCS_SETTINGS,
    S3_SETTINGS,
    BucketURL,
    StoreSettings,
    load_settings,
    parse_bucket_url,
    read_secret_dir,
)
from hotload.errors import (
    BucketError,
    InvalidBucketURLError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
)

if TYPE_CHECKING:
    from obstore import ObjectMeta, PutMode, PutResult
    from obstore.store import ClientConfig, GCSConfig, S3Config, S3Credential

T = TypeVar("T")

#: Called with a byte count as data moves (negative to take back bytes of a failed attempt).
Progress = Callable[[int], None]

DEFAULT_PART_SIZE = 16 * 1024 * 1024
#: S3 refuses multipart parts under 5 MiB (except the last one).
MIN_UPLOAD_PART = 5 * 1024 * 1024
DEFAULT_CONCURRENCY = 8
# Local temp and lock files carry these markers so listings can hide them.
_TMP_MARK = ".hotload-tmp-"
_LOCK_SUFFIX = ".hotload-lock"
# Secret-file credentials are re-read this often, so a rotated Kubernetes Secret takes effect.
_CREDENTIAL_REFRESH = timedelta(minutes=5)


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one object: key (relative to the bucket URL), size, ETag, modification time.

    `etag` is an opaque revision token for conditional calls; it is None only in local-folder
    listings, where computing it would mean reading every file.
    """

    key: str
    size: int
    etag: str | None
    last_modified: datetime | None = None


@dataclass(frozen=True)
class ObjectData:
    """An object's bytes together with the ETag of exactly that revision."""

    key: str
    data: bytes
    etag: str | None


@dataclass(frozen=True)
class NotModified:
    """Result of a conditional read whose object still has the ETag the caller already holds."""

    key: str
    etag: str


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from blocking code (refuses inside a running event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "a blocking hotload bucket call was made inside a running event loop; "
        "await the matching *_async method instead"
    )


def check_key(key: str) -> str:
    """Validate an object key: `/`-separated, relative, no empty, `.` or `..` segments."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid object key {key!r}")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise ValueError(f"invalid object key {key!r}: segment {seg!r}")
    return key


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
        self._remote = store
        self._local_store: LocalStore | None = None

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
            return await self._local(key, "HEAD", lambda: _local_head(key, path))
        store = self._remote
        meta = await self._call(key, "HEAD", lambda: obstore.head_async(store, key))
        return self._info(meta)

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
                    if not _is_internal(m["path"])
                ),
                key=lambda i: i.key,
            )
        store = self._remote
        metas = await self._call(
            prefix, "LIST", lambda: obstore.list(store, clean).collect_async(), prefix=True
        )
        return sorted((self._info(m) for m in metas), key=lambda i: i.key)

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
            return await self._local(key, "GET", lambda: _local_get(key, path, etag))
        store = self._remote
        scheme = self.location.scheme

        async def attempt() -> ObjectData | NotModified:
            options: dict[str, Any] = {}
            if etag is not None:
                options["if_none_match"] = _split_token(etag)[0] if scheme == "gs" else etag
            try:
                result = await obstore.get_async(store, key, options=options or None)  # type: ignore[arg-type]
            except NotModifiedError:
                assert etag is not None
                return NotModified(key, etag)
            data = await result.bytes_async()
            return ObjectData(key, bytes(data), self._token(result.meta))

        return await self._call(key, "GET", attempt)

    async def get_range_async(self, key: str, start: int, end: int) -> bytes:
        """Read bytes `[start, end)` of `key`."""
        if end <= start:
            return b""
        if self._remote is None:
            path = self._path(key)
            return await self._local(key, "GET range", lambda: _pread(path, start, end - start))
        store = self._remote
        data = await self._call(
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
        tmp = target.with_name(f"{target.name}{_TMP_MARK}{secrets.token_hex(4)}")
        try:
            if self._remote is None:
                src = self._path(key)
                total = await self._local(key, "GET", lambda: _local_copy(src, tmp, progress))
            else:
                total = await self._download_remote(
                    key, tmp, size=size, etag=etag, progress=progress, semaphore=semaphore
                )
            await asyncio.to_thread(os.replace, tmp, target)
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
                    lambda: _local_put_conditional(
                        path, _as_bytes(source), create_only, if_match, url=url, key=key
                    ),
                )
            return await self._local(key, "PUT", lambda: _local_put(path, source, progress))
        return await self._put_remote(key, source, create_only, if_match, progress)

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
            await self._local(key, "DELETE", lambda: _unlink_quiet(path))
            return
        store = self._remote
        await self._call(key, "DELETE", lambda: obstore.delete_async(store, key))

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
        if key or not prefix:
            try:
                check_key(key)
            except ValueError as exc:
                raise BucketError(f"{op}: {exc}", url=self.url, key=key) from None
        return await retrying(self.retry, operation, url=self.url, key=key or None, op=op)

    async def _local(self, key: str, op: str, fn: Callable[[], T]) -> T:
        # Local file calls run in a worker thread so they never stall the event loop.
        try:
            return await asyncio.to_thread(fn)
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

    def _token(self, meta: ObjectMeta | PutResult) -> str | None:
        # GCS conditional writes need the generation, not the ETag: carry both in one token.
        etag, version = meta["e_tag"], meta["version"]
        if self.location.scheme == "gs" and etag is not None and version:
            return f"{etag}#{version}"
        return etag

    def _info(self, meta: ObjectMeta) -> ObjectInfo:
        return ObjectInfo(meta["path"], meta["size"], self._token(meta), meta["last_modified"])

    async def _put_remote(
        self,
        key: str,
        source: bytes | Path,
        create_only: bool,
        if_match: str | None,
        progress: Progress | None,
    ) -> str | None:
        store = self._remote
        assert store is not None
        mode: PutMode
        if create_only:
            mode = "create"
        elif if_match is not None:
            etag, version = _split_token(if_match)
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
                stream = source if progress is None else _file_chunks(source, chunk, report)
                result = await obstore.put_async(
                    store, key, stream, chunk_size=chunk, max_concurrency=self.concurrency
                )
                if progress is None:
                    report(size)
            return self._token(result)

        op = "PUT (create-only)" if create_only else ("PUT (if-match)" if if_match else "PUT")
        return await self._call(key, op, attempt)

    async def _download_remote(
        self,
        key: str,
        tmp: Path,
        *,
        size: int | None,
        etag: str | None,
        progress: Progress | None,
        semaphore: asyncio.Semaphore | None,
    ) -> int:
        store = self._remote
        assert store is not None
        if size is None:
            info = await self.head_async(key)
            size, etag = info.size, info.etag
        sem = semaphore or asyncio.Semaphore(self.concurrency)
        fd = await asyncio.to_thread(os.open, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            await asyncio.to_thread(os.ftruncate, fd, size)
            if size == 0:
                return 0

            async def part(start: int, end: int) -> None:
                async with sem:
                    options: dict[str, Any] = {"range": (start, end)}
                    if etag is not None and self.location.scheme == "s3":
                        options["if_match"] = (
                            etag  # a concurrent overwrite fails loudly, not silently mixed
                        )

                    async def fetch() -> bytes:
                        result = await obstore.get_async(store, key, options=options)  # type: ignore[arg-type]
                        return bytes(await result.bytes_async())

                    data = await self._call(key, "GET range", fetch)
                    if len(data) != end - start:
                        raise BucketError(
                            f"GET range: got {len(data)} bytes for range {start}-{end}; "
                            "the object changed or is truncated",
                            url=self.url,
                            key=key,
                        )
                    await asyncio.to_thread(_pwrite_all, fd, data, start)
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
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            await asyncio.to_thread(os.close, fd)
        return size


def open_bucket(
    url: str,
    *,
    credentials_dir: str | os.PathLike[str] | None = None,
    retry: RetryPolicy | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> Bucket:
    """Open a bucket from a URL: a folder path or `file:///path` (default), `s3://` or `gs://`.

    S3 endpoint, region and credentials come from `AWS_*` environment variables or from files of
    the same names in `credentials_dir` (default `$HOTLOAD_BUCKET_CREDENTIALS_DIR`, a mounted
    Kubernetes Secret), the files winning.
    """
    location = parse_bucket_url(url)
    policy = retry or RetryPolicy()
    if location.scheme == "file":
        return Bucket(location, retry=policy, part_size=part_size, concurrency=concurrency)
    store: S3Store | GCSStore
    if location.scheme == "s3":
        settings = load_settings(S3_SETTINGS, credentials_dir=credentials_dir)
        store = _s3_store(location, settings, policy)
    else:
        settings = load_settings(GCS_SETTINGS, credentials_dir=credentials_dir)
        store = GCSStore(
            location.bucket,
            prefix=location.prefix or None,
            config=gcs_config(settings),
            client_options=_client_options(False),
            retry_config=policy.obstore_config(),
        )
    return Bucket(location, store=store, retry=policy, part_size=part_size, concurrency=concurrency)


def s3_config(settings: StoreSettings) -> tuple[S3Config, bool]:
    """Build the obstore S3 configuration (credentials aside) and whether plain HTTP is allowed."""
    config: S3Config = {}
    endpoint = settings.get("AWS_ENDPOINT_URL_S3") or settings.get("AWS_ENDPOINT_URL")
    region = settings.get("AWS_REGION") or settings.get("AWS_DEFAULT_REGION")
    if endpoint:
        config["endpoint"] = endpoint
    if region:
        config["region"] = region
    elif endpoint:
        # S3-compatible servers ignore the region, but request signing still needs one.
        config["region"] = "us-east-1"
    if settings.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST") is not None:
        config["virtual_hosted_style_request"] = settings.flag("AWS_VIRTUAL_HOSTED_STYLE_REQUEST")
    if settings.flag("AWS_SKIP_SIGNATURE"):
        config["skip_signature"] = True
    # An explicit http:// endpoint is consent enough to talk plain HTTP.
    allow_http = settings.flag("AWS_ALLOW_HTTP") or bool(
        endpoint and endpoint.startswith("http://")
    )
    return config, allow_http


def gcs_config(settings: StoreSettings) -> GCSConfig:
    """Build the obstore GCS configuration from the merged settings."""
    config: GCSConfig = {}
    account = (
        settings.get("GOOGLE_SERVICE_ACCOUNT")
        or settings.get("GOOGLE_SERVICE_ACCOUNT_PATH")
        or settings.get("GOOGLE_APPLICATION_CREDENTIALS")
    )
    if settings.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        config["service_account_key"] = settings.values["GOOGLE_SERVICE_ACCOUNT_KEY"]
    elif account:
        config["service_account"] = account
    if settings.get("GOOGLE_BASE_URL"):
        config["base_url"] = settings.values["GOOGLE_BASE_URL"]
    if settings.flag("GOOGLE_SKIP_SIGNATURE"):
        config["skip_signature"] = True
    return config


class SecretFileCredentials:
    """S3 credentials read from a mounted Secret directory, re-read every few minutes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __call__(self) -> S3Credential:
        """Return the current access key, secret and session token from the Secret's files."""
        values = read_secret_dir(self.directory, S3_SETTINGS)
        key, secret = values.get("AWS_ACCESS_KEY_ID"), values.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            raise InvalidBucketURLError(
                "the credentials directory needs both an AWS_ACCESS_KEY_ID and an "
                "AWS_SECRET_ACCESS_KEY file",
                url=str(self.directory),
            )
        return {
            "access_key_id": key,
            "secret_access_key": secret,
            "token": values.get("AWS_SESSION_TOKEN"),
            "expires_at": datetime.now(UTC) + _CREDENTIAL_REFRESH,
        }


def _s3_store(location: BucketURL, settings: StoreSettings, policy: RetryPolicy) -> S3Store:
    config, allow_http = s3_config(settings)
    common: dict[str, Any] = {
        "prefix": location.prefix or None,
        "config": config,
        "client_options": _client_options(allow_http),
        "retry_config": policy.obstore_config(),
    }
    if settings.credentials_dir is not None and "AWS_ACCESS_KEY_ID" in settings.from_files:
        provider = SecretFileCredentials(settings.credentials_dir)
        provider()  # fail now, with a clear message, if the Secret is incomplete
        return S3Store(location.bucket, credential_provider=provider, **common)
    for name, option in (
        ("AWS_ACCESS_KEY_ID", "access_key_id"),
        ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
        ("AWS_SESSION_TOKEN", "session_token"),
    ):
        value = settings.get(name)
        if value:
            config[option] = value  # type: ignore[literal-required]
    return S3Store(location.bucket, **common)


def _client_options(allow_http: bool) -> ClientConfig:
    return {"allow_http": allow_http, "connect_timeout": "5s", "timeout": "120s"}


def _split_token(token: str) -> tuple[str, str | None]:
    etag, sep, version = token.rpartition("#")
    return (etag, version) if sep and etag else (token, None)


def _is_internal(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return _TMP_MARK in name or name.endswith(_LOCK_SUFFIX)


def _as_bytes(source: bytes | Path) -> bytes:
    return source if isinstance(source, bytes) else source.read_bytes()


def _file_chunks(path: Path, chunk: int, report: Progress) -> Iterator[bytes]:
    with path.open("rb") as f:
        while block := f.read(chunk):
            report(len(block))
            yield block


# --- the local folder ----------------------------------------------------------------------------


def local_etag(data: bytes) -> str:
    """The ETag of a local object: a content hash, so equal tokens mean equal bytes."""
    return "sha256-" + hashlib.sha256(data).hexdigest()[:32]


def _file_etag(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return "sha256-" + digest.hexdigest()[:32]


def _local_head(key: str, path: Path) -> ObjectInfo:
    st = path.stat()
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    return ObjectInfo(key, st.st_size, _file_etag(path), datetime.fromtimestamp(st.st_mtime, UTC))


def _local_get(key: str, path: Path, etag: str | None) -> ObjectData | NotModified:
    data = path.read_bytes()
    current = local_etag(data)
    if etag is not None and etag == current:
        return NotModified(key, etag)
    return ObjectData(key, data, current)


def _pread(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        return os.pread(f.fileno(), length, offset)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _unlink_quiet(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _tmp_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TMP_MARK}{secrets.token_hex(6)}")


def _copy_fd(src: int, dst: int, size: int, progress: Progress | None) -> None:
    # Within one filesystem copy_file_range keeps the bytes in the kernel (and reflinks where the
    # filesystem can); across filesystems the kernel falls back to a slow splice, so a plain
    # read/write loop through one reused buffer is faster there.
    same_fs = os.fstat(src).st_dev == os.fstat(dst).st_dev
    step = 16 * 1024 * 1024
    buffer = bytearray(0 if same_fs else step)
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        n = 0
        if same_fs:
            try:
                n = os.copy_file_range(src, dst, min(4 * step, size - offset), offset, offset)
            except OSError:
                same_fs = False
                buffer = bytearray(step)
                view = memoryview(buffer)
        if n <= 0:
            n = os.preadv(src, [view[: min(step, size - offset)]], offset)
            if n <= 0:
                raise OSError(f"unexpected end of file at byte {offset} of {size}")
            _pwrite_all(dst, view[:n], offset)
        offset += n
        if progress is not None:
            progress(n)


def _local_copy(src: Path, dst: Path, progress: Progress | None) -> int:
    with src.open("rb") as fin:
        size = os.fstat(fin.fileno()).st_size
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _copy_fd(fin.fileno(), fd, size, progress)
        finally:
            os.close(fd)
    return size


def _local_put(path: Path, source: bytes | Path, progress: Progress | None) -> str | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_for(path)
    try:
        if isinstance(source, bytes):
            tmp.write_bytes(source)
            etag: str | None = local_etag(source)
            if progress is not None:
                progress(len(source))
        else:
            _local_copy(source, tmp, progress)
            etag = None  # hashing a large shard only to return its ETag is not worth it
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return etag


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # One lock file per object, never deleted: deleting it would let two writers hold
    # "the" lock on different inodes.
    lock = path.with_name(f".{path.name}{_LOCK_SUFFIX}")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _local_put_conditional(
    path: Path, data: bytes, create_only: bool, if_match: str | None, *, url: str, key: str
) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        try:
            current: bytes | None = path.read_bytes()
        except FileNotFoundError:
            current = None
        if create_only and current is not None:
            raise ObjectExistsError(
                "PUT (create-only): the object already exists", url=url, key=key
            )
        if if_match is not None:
            if current is None:
                raise PreconditionFailedError(
                    f"PUT (if-match {if_match}): the object does not exist", url=url, key=key
                )
            if local_etag(current) != if_match:
                raise PreconditionFailedError(
                    f"PUT (if-match {if_match}): the object changed (now {local_etag(current)})",
                    url=url,
                    key=key,
                )
        tmp = _tmp_for(path)
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        _fsync_dir(path.parent)
    return local_etag(data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
