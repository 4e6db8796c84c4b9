"""The local folder as a bucket: atomic writes (temp file, then rename), content-hash ETags, and
conditional writes serialised by a lock file per object, with the folder synced before they
return (the ledger's compare-and-swap relies on them)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from hotload.bucket.objects import NotModified, ObjectData, ObjectInfo, Progress
from hotload.errors import ObjectExistsError, PreconditionFailedError
from hotload.fileio import fsync_dir, pwrite_all

# Local temp and lock files carry these markers so listings can hide them.
TMP_MARK = ".hotload-tmp-"
LOCK_SUFFIX = ".hotload-lock"


def is_internal(key: str) -> bool:
    """Tell whether a listed key is one of our temp or lock files (hidden from listings)."""
    name = key.rsplit("/", 1)[-1]
    return TMP_MARK in name or name.endswith(LOCK_SUFFIX)


def as_bytes(source: bytes | Path) -> bytes:
    """The bytes to write: `source` itself, or the contents of the file it names."""
    return source if isinstance(source, bytes) else source.read_bytes()


def local_etag(data: bytes) -> str:
    """The ETag of a local object: a content hash, so equal tokens mean equal bytes."""
    return "sha256-" + hashlib.sha256(data).hexdigest()[:32]


def _file_etag(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return "sha256-" + digest.hexdigest()[:32]


def local_head(key: str, path: Path) -> ObjectInfo:
    """Size, ETag (hashing the file) and modification time of a local object."""
    st = path.stat()
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    return ObjectInfo(key, st.st_size, _file_etag(path), datetime.fromtimestamp(st.st_mtime, UTC))


def local_get(key: str, path: Path, etag: str | None) -> ObjectData | NotModified:
    """Read a local object, or answer `NotModified` when its ETag is still `etag`."""
    data = path.read_bytes()
    current = local_etag(data)
    if etag is not None and etag == current:
        return NotModified(key, etag)
    return ObjectData(key, data, current)


def pread(path: Path, offset: int, length: int) -> bytes:
    """Read `length` bytes at `offset` of a file."""
    with path.open("rb") as f:
        return os.pread(f.fileno(), length, offset)


def unlink_quiet(path: Path) -> None:
    """Remove a file that may already be gone."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _tmp_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{secrets.token_hex(6)}")


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
            pwrite_all(dst, view[:n], offset)
        offset += n
        if progress is not None:
            progress(n)


def local_copy(src: Path, dst: Path, progress: Progress | None) -> int:
    """Copy a file (in the kernel where both lie on one filesystem); return its size."""
    with src.open("rb") as fin:
        size = os.fstat(fin.fileno()).st_size
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _copy_fd(fin.fileno(), fd, size, progress)
        finally:
            os.close(fd)
    return size


def local_put(path: Path, source: bytes | Path, progress: Progress | None) -> str | None:
    """Write an object atomically (temp file, then rename); return its ETag when known cheaply."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_for(path)
    try:
        if isinstance(source, bytes):
            tmp.write_bytes(source)
            etag: str | None = local_etag(source)
            if progress is not None:
                progress(len(source))
        else:
            local_copy(source, tmp, progress)
            etag = None  # hashing a large shard only to return its ETag is not worth it
        os.replace(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise
    return etag


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # One lock file per object, never deleted: deleting it would let two writers hold
    # "the" lock on different inodes.
    lock = path.with_name(f".{path.name}{LOCK_SUFFIX}")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def local_put_conditional(
    path: Path, data: bytes, create_only: bool, if_match: str | None, *, url: str, key: str
) -> str:
    """Write an object only if it does not exist (`create_only`) or still has the ETag
    `if_match`, under the object's lock; durable (file and folder synced) when it returns."""
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
            unlink_quiet(tmp)
            raise
        fsync_dir(path.parent)
    return local_etag(data)
