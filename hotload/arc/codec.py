"""arc_v2 encode, decode and verify, shard by shard and for whole snapshot folders.

Shards stream through a few lanes (one thread each, up to MAX_SHARDS_IN_FLIGHT shards under
way); a lane codes its shard's chunks itself and helps with other shards' chunks when it has
none (numpy, zlib-ng, zstd and file writes release the GIL).
Decoding copies unchanged chunks with copy_file_range, assembles every other chunk in a reused
per-thread buffer written with one pwrite (a very sparse chunk: the parent's bytes written from
their map, the changed elements over them; see `chunk.parent_use`), and checks every tensor's
adler32: the parent's against the delta's base checksum (wrong parent) and the result against
the target checksum.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hotload.arc import chunk as ck
from hotload.arc.checksum import (
    ADLER32,
    CHECKSUM_ALIASES,
    adler32,
    adler32_combine,
    crc32,
    format_checksum,
    parse_checksum,
)
from hotload.arc.container import (
    FORMAT,
    LAYOUT_VERSION,
    ArcHeader,
    read_header,
    write_prefix,
)
from hotload.errors import (
    ArcError,
    ChecksumMismatchError,
    CorruptDeltaError,
    HotloadError,
    SnapshotError,
    WrongParentError,
)
from hotload.snapshot import layout
from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.parse_cache import parse_once, parsed, remember
from hotload.snapshot.safetensors_io import SafetensorsFile, TensorInfo, parse_header

DEFAULT_CHUNK_ELEMENTS = 1 << 23
# The sparse checksum update sums in int64; chunks up to 2**24 elements of 8 bytes stay exact.
MAX_CHUNK_ELEMENTS = 1 << 24

ProgressFn = Callable[[int], None]


@dataclass
class ShardStats:
    """What coding one shard did: sizes, changed elements and the encodings chosen."""

    name: str
    full_bytes: int = 0
    delta_bytes: int = 0
    elements: int = 0
    changed: int = 0
    encodings: Counter[str] = field(default_factory=Counter)
    hardlinked: bool = False
    seconds: float = 0.0


@dataclass
class CodecStats:
    """Totals over the shards of one snapshot encode or decode."""

    shards: list[ShardStats] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def full_bytes(self) -> int:
        """Bytes of the full shards."""
        return sum(s.full_bytes for s in self.shards)

    @property
    def delta_bytes(self) -> int:
        """Bytes of the delta shards."""
        return sum(s.delta_bytes for s in self.shards)

    @property
    def elements(self) -> int:
        """Elements in all tensors."""
        return sum(s.elements for s in self.shards)

    @property
    def changed(self) -> int:
        """Elements that differ from the parent (known when encoding and when decoding)."""
        return sum(s.changed for s in self.shards)


def default_threads() -> int:
    """Worker threads used when a caller does not say: every core."""
    return max(1, os.cpu_count() or 1)


class ChunkRunner(Protocol):
    """What runs a shard's chunk tasks: a `concurrent.futures.Executor`, or the lanes of
    `encode` and `decode`. `map` returns the results in the order of `items`."""

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], /) -> Iterable[Any]:
        """Apply `fn` to every item; raise the first (in item order) exception raised."""
        ...


class _Inline:
    """Runs chunk tasks in the calling thread, in order (one thread: nothing to hand off)."""

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], /) -> list[Any]:
        return [fn(item) for item in items]


class _SharedTasks:
    """The chunk tasks of one shard, taken one at a time by every thread that helps."""

    def __init__(self, fn: Callable[[Any], Any], items: list[Any]) -> None:
        self.fn, self.items = fn, items
        self.results: list[tuple[bool, Any]] = [(False, None)] * len(items)
        self._lock = threading.Lock()
        self._taken = 0
        self._left = len(items)
        self.done = threading.Event()
        if not items:
            self.done.set()

    def unstarted(self) -> bool:
        """Tell whether some task has not been taken yet (another thread may take it first)."""
        return self._taken < len(self.items)

    def _take(self) -> int | None:
        with self._lock:
            if self._taken >= len(self.items):
                return None
            self._taken += 1
            return self._taken - 1

    def work(self) -> None:
        """Run tasks until none is left to take."""
        while (i := self._take()) is not None:
            try:
                self.results[i] = (True, self.fn(self.items[i]))
            except Exception as exc:  # handed to the shard's own thread, which raises it
                self.results[i] = (False, exc)
            finally:
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self.done.set()

    def cancel(self) -> None:
        """Let no thread take another task (those under way finish)."""
        with self._lock:
            self._taken = len(self.items)

    def outcome(self) -> list[Any]:
        """The results in item order, or the first exception in item order."""
        for ok, value in self.results:
            if not ok:
                raise value
        return [value for _, value in self.results]


# Shards under way at once: each holds its files mapped, so this bounds memory to a few
# shards (plus a chunk buffer per thread) however many threads there are; threads beyond it
# help with those shards' chunks.
MAX_SHARDS_IN_FLIGHT = 4


class _Lanes:
    """`threads` threads sharing the shards of one encode or decode, and their chunks.

    Each lane (the caller's thread and threads - 1 others) takes the next shard, while fewer
    than MAX_SHARDS_IN_FLIGHT are under way, and runs its chunk tasks itself; a lane that
    cannot take a shard helps with the chunks of the shards under way. Threads hand no task to
    each other: with Python's GIL every hand-off (a pool's queue, a future's result) is a
    wake-up that then waits for the GIL, and with a task per chunk those cost more than
    decoding small chunks. Measured on the MiniLM lr 1e-5 chain: a ThreadPoolExecutor of one
    worker decoded about 10% slower than running inline, and two workers barely faster than
    one; lanes are faster in both cases.
    """

    def __init__(self, threads: int | None) -> None:
        self.threads = max(1, threads or default_threads())
        self._open: list[_SharedTasks] = []
        self._cond = threading.Condition()
        self._stop = False

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], /) -> list[Any]:
        """Run one shard's chunk tasks in this thread, with help from idle lanes."""
        tasks = _SharedTasks(fn, list(items))
        with self._cond:
            self._open.append(tasks)
            self._cond.notify_all()
        try:
            tasks.work()
            tasks.done.wait()  # a helper may still be running a task it took
        except BaseException:  # Ctrl-C: helpers take no more of this shard's tasks
            tasks.cancel()
            raise
        finally:
            with self._cond:
                self._open.remove(tasks)
        return tasks.outcome()

    def each_shard(
        self, shards: list[str], fn: Callable[[str, ChunkRunner], ShardStats]
    ) -> list[ShardStats]:
        """Run `fn(shard, runner)` for every shard; return the stats in shard order.

        On a failure no new shard starts, the shards under way finish, and the error of the
        first failing shard (in shard order) is raised. Every thread has ended when this
        returns or raises, so a caller that removes the output never races a writer.
        """
        if self.threads == 1:
            inline = _Inline()
            return [fn(shard, inline) for shard in shards]
        results: list[tuple[bool, Any]] = [(False, None)] * len(shards)
        state = {"next": 0, "in_flight": 0}

        def take() -> int | _SharedTasks | None:
            """The next shard index to code, or chunk tasks to help with; None when done."""
            with self._cond:
                while True:
                    if self._stop:
                        return None
                    if state["next"] < len(shards) and state["in_flight"] < MAX_SHARDS_IN_FLIGHT:
                        state["next"] += 1
                        state["in_flight"] += 1
                        return state["next"] - 1
                    tasks = next((t for t in self._open if t.unstarted()), None)
                    if tasks is not None:
                        return tasks
                    if state["next"] >= len(shards) and state["in_flight"] == 0:
                        return None
                    # Wake when a shard ends or a shard's chunk tasks open.
                    self._cond.wait()

        def lane() -> None:
            while (job := take()) is not None:
                if isinstance(job, _SharedTasks):
                    job.work()
                    continue
                try:
                    results[job] = (True, fn(shards[job], self))
                except Exception as exc:
                    results[job] = (False, exc)
                    with self._cond:
                        self._stop = True
                finally:
                    with self._cond:
                        state["in_flight"] -= 1
                        self._cond.notify_all()

        others = [
            threading.Thread(target=lane, name=f"hotload-arc-lane-{n}", daemon=True)
            for n in range(1, self.threads)
        ]
        for t in others:
            t.start()
        try:
            lane()
        finally:
            # Ctrl-C lands in this thread: stop the others from starting shards, let the
            # shards under way finish, and only then let the exception through.
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            for t in others:
                t.join()
        for ok, value in results:
            if not ok:  # the first failure in shard order; shards after it never started
                raise value
        return [value for _, value in results]


@contextmanager
def _released_scratch() -> Iterator[None]:
    # The caller's thread may live on (a loader's worker thread): do not keep its chunk
    # buffers after the call. The lanes' own threads release theirs when they end.
    try:
        yield
    finally:
        ck.release_scratch()


def _chunk_bounds(n: int, chunk_elements: int) -> list[tuple[int, int]]:
    return [(s, min(n, s + chunk_elements)) for s in range(0, n, chunk_elements)]


def _combine(parts: list[tuple[int, int]]) -> int:
    """Combine (checksum, byte length) pairs of consecutive chunks into one adler32."""
    total = 1
    for value, length in parts:
        total = adler32_combine(total, value, length)
    return total


def _elements(f: SafetensorsFile, info: TensorInfo) -> np.ndarray:
    return f.raw(info.name).view(uint_view_dtype(info.dtype))


# --- encoding ---------------------------------------------------------------------------------


def encode_shard(
    previous: Path,
    current: Path,
    out: Path,
    *,
    parent: str | None,
    identity: str | None = None,
    pool: ChunkRunner,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    exponent_context: bool = False,
    sparse_level: int = 1,
    dense_level: int = 3,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> ShardStats:
    """Encode `current` (a full shard) as an arc_v2 delta against `previous`, written to `out`."""
    started = time.perf_counter()
    name = current.name
    if not 0 < chunk_elements <= MAX_CHUNK_ELEMENTS:
        raise ArcError(f"chunk_elements must be in 1..{MAX_CHUNK_ELEMENTS}", shard=name)
    stats = ShardStats(name)
    with SafetensorsFile(previous) as prev, SafetensorsFile(current) as cur:
        for tname, info in cur.tensors.items():
            p = prev.tensors.get(tname)
            if p is None:
                raise ArcError("tensor is not in the parent shard", shard=name, tensor=tname)
            if (p.dtype, p.shape) != (info.dtype, info.shape):
                raise ArcError(
                    f"parent has {p.dtype}{list(p.shape)}, current has {info.dtype}"
                    f"{list(info.shape)}: a delta cannot change dtype or shape",
                    shard=name,
                    tensor=tname,
                )
        extra = set(prev.tensors) - set(cur.tensors)
        if extra:
            raise ArcError(f"tensors {sorted(extra)} of the parent are missing", shard=name)
        ordered = sorted(cur.tensors.values(), key=lambda i: i.begin)
        tasks: list[tuple[TensorInfo, int, int]] = [
            (info, s, e) for info in ordered for s, e in _chunk_bounds(info.numel, chunk_elements)
        ]

        def run(task: tuple[TensorInfo, int, int]) -> ck.EncodedChunk:
            info, s, e = task
            res = ck.encode_chunk(
                _elements(prev, prev.tensors[info.name])[s:e],
                _elements(cur, info)[s:e],
                dtype=info.dtype,
                exponent_context=exponent_context,
                sparse_level=sparse_level,
                dense_level=dense_level,
            )
            if progress:
                progress((e - s) * (info.nbytes // max(1, info.numel)))
            return res

        results = list(pool.map(run, tasks))
        entries: list[dict[str, Any]] = []
        payload: list[bytes] = []
        offset = 0
        by_tensor: dict[str, list[tuple[tuple[TensorInfo, int, int], ck.EncodedChunk]]] = {}
        for task, res in zip(tasks, results, strict=True):
            by_tensor.setdefault(task[0].name, []).append((task, res))
        for info in ordered:
            chunks_meta = []
            targets: list[tuple[int, int]] = []
            bases: list[tuple[int, int]] = []
            width = info.nbytes // max(1, info.numel)
            for (_, s, e), res in by_tensor.get(info.name, []):
                meta = dict(res.meta)
                meta["offset"] = offset
                meta["length"] = res.size
                meta["crc32"] = format_checksum(crc32(b"".join(res.payload)))
                chunks_meta.append(meta)
                payload.extend(res.payload)
                offset += res.size
                targets.append((res.target_checksum, (e - s) * width))
                bases.append((res.base_checksum, (e - s) * width))
                stats.encodings[meta["encoding"]] += 1
                stats.changed += res.changed
            entries.append(
                {
                    "name": info.name,
                    "checksum": format_checksum(_combine(targets)),
                    "base_checksum": format_checksum(_combine(bases)),
                    "chunks": chunks_meta,
                }
            )
            stats.elements += info.numel
        header = {
            "format": FORMAT,
            "version": LAYOUT_VERSION,
            "parent": parent,
            "identity": identity,
            "checksum": ADLER32,
            "chunk_elements": chunk_elements,
            "target_header": _header_text(cur.header_bytes, name),
            "tensors": entries,
        }
        stats.full_bytes = cur.file_size
    prefix = write_prefix(header)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(prefix)
            for part in payload:
                f.write(part)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    stats.delta_bytes = len(prefix) + offset
    stats.seconds = time.perf_counter() - started
    return stats


def _header_text(raw: bytes, shard: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ArcError("safetensors header is not UTF-8", shard=shard) from None


# --- decoding ---------------------------------------------------------------------------------


def _target(header: ArcHeader, shard: str) -> tuple[bytes, dict[str, TensorInfo], int]:
    text = header.fields.get("target_header")
    if not isinstance(text, str):
        raise CorruptDeltaError("header has no target_header", shard=shard)
    known: tuple[bytes, dict[str, TensorInfo], int] | None = parsed("target", text)
    if known is not None:
        return known
    raw = text.encode()
    try:
        infos, _ = parse_header(raw, None, shard)
    except SnapshotError as exc:
        raise CorruptDeltaError(f"target_header is invalid: {exc.message}", shard=shard) from None
    data_len = max((i.end for i in infos.values()), default=0)
    remember("target", text, (raw, infos, data_len))
    return raw, infos, data_len


def target_tensors(path: Path) -> dict[str, TensorInfo]:
    """Tensors (dtype, shape, offsets) of the full shard a delta shard rebuilds."""
    return target_tensors_of(read_header(path), path.name)


def target_tensors_of(header: ArcHeader, shard: str) -> dict[str, TensorInfo]:
    """Like `target_tensors`, from a delta shard's header already read."""
    return _target(header, shard)[1]


def _copy_range(src: int, dst: int, count: int, src_off: int, dst_off: int) -> None:
    while count > 0:
        try:
            done = os.copy_file_range(src, dst, count, src_off, dst_off)
        except OSError:
            done = 0
        if done <= 0:  # unsupported here: plain reads and writes
            os.lseek(src, src_off, os.SEEK_SET)
            data = os.read(src, min(count, 1 << 24))
            if not data:
                raise OSError("unexpected end of parent shard")
            done = os.pwrite(dst, data, dst_off)
        count -= done
        src_off += done
        dst_off += done


@dataclass
class _ChunkResult:
    """One decoded chunk: parent checksum, rebuilt checksum (None on error), changed count."""

    base: int
    target: int | None
    changed: int
    error: ArcError | None


def _pwrite_all(fd: int, data: np.ndarray | bytes, offset: int) -> None:
    view = data.view(np.uint8).data if isinstance(data, np.ndarray) else memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view = view[done:]
        offset += done


def decode_shard(
    previous: Path,
    delta: Path,
    out: Path | None,
    *,
    expected_parent: str | None = None,
    pool: ChunkRunner,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> ShardStats:
    """Rebuild a full shard from its parent and an arc_v2 delta, verifying every tensor.

    With `out=None` nothing is written: the shard is only verified. The output appears under
    its final name only after every checksum matched. `durable=False` skips the fsync, for a
    caller that syncs a whole staging folder once.
    """
    started = time.perf_counter()
    shard = delta.name
    stats = ShardStats(shard)
    header = read_header(delta)
    if expected_parent is not None and header.parent != expected_parent:
        raise WrongParentError(
            f"delta was made against {header.parent!r}, not {expected_parent!r}", shard=shard
        )
    fmt = header.fields.get("checksum")
    if not isinstance(fmt, str) or fmt.lower() not in CHECKSUM_ALIASES:
        raise ArcError(
            f"unsupported checksum format {fmt!r} (supported: adler32, alias alder32)", shard=shard
        )
    chunk_elements = header.fields.get("chunk_elements")
    if (
        not isinstance(chunk_elements, int)
        or isinstance(chunk_elements, bool)
        or not 0 < chunk_elements <= MAX_CHUNK_ELEMENTS
    ):
        raise CorruptDeltaError(f"bad chunk_elements {chunk_elements!r}", shard=shard)
    target_raw, infos, data_len = _target(header, shard)
    entries = header.fields.get("tensors")
    if not isinstance(entries, list):
        raise CorruptDeltaError("header has no tensor list", shard=shard)
    names = [e.get("name") if isinstance(e, dict) else None for e in entries]
    if sorted(map(str, names)) != sorted(infos) or len(set(names)) != len(names):
        raise CorruptDeltaError("tensor list does not match target_header", shard=shard)
    payload_len = header.file_size - header.payload_offset
    with SafetensorsFile(previous) as prev:
        for tname, info in infos.items():
            p = prev.tensors.get(tname)
            if p is None:
                raise WrongParentError(
                    "tensor is not in the parent shard", shard=shard, tensor=tname
                )
            if (p.dtype, p.shape) != (info.dtype, info.shape):
                raise ArcError(
                    f"delta rebuilds {info.dtype}{list(info.shape)} but the parent holds "
                    f"{p.dtype}{list(p.shape)}: a delta cannot change dtype or shape",
                    shard=shard,
                    tensor=tname,
                )
        # Validate every chunk's placement before touching any output.
        plan: list[tuple[TensorInfo, int, int, dict[str, Any]]] = []
        all_same = True
        for entry in entries:
            info = infos[entry["name"]]
            bounds = _chunk_bounds(info.numel, chunk_elements)
            chunks = entry.get("chunks")
            if not isinstance(chunks, list) or len(chunks) != len(bounds):
                raise CorruptDeltaError(
                    f"expected {len(bounds)} chunks", shard=shard, tensor=info.name
                )
            for (s, e), meta in zip(bounds, chunks, strict=True):
                if not isinstance(meta, dict):
                    raise CorruptDeltaError(
                        "chunk entry is not an object", shard=shard, tensor=info.name
                    )
                off, length = meta.get("offset"), meta.get("length")
                if (
                    not isinstance(off, int)
                    or not isinstance(length, int)
                    or isinstance(off, bool)
                    or isinstance(length, bool)
                    or off < 0
                    or length < 0
                    or off + length > payload_len
                ):
                    raise CorruptDeltaError(
                        f"chunk at elements {s}..{e} points outside the payload "
                        f"({payload_len} bytes): the file is truncated or corrupted",
                        shard=shard,
                        tensor=info.name,
                    )
                all_same = all_same and meta.get("encoding") == ck.SAME
                plan.append((info, s, e, meta))
        stats.full_bytes = 8 + len(target_raw) + data_len
        stats.delta_bytes = header.file_size
        stats.elements = sum(i.numel for i in infos.values())
        link = (
            out is not None
            and all_same
            and target_raw == prev.header_bytes
            and prev.file_size == stats.full_bytes
        )
        tmp = out.with_name(out.name + ".tmp") if out is not None else None
        out_fd: int | None = None
        prev_fd: int | None = None
        delta_file = delta.open("rb")
        delta_map = mmap.mmap(delta_file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if tmp is not None and not link:
                out_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                prefix = struct.pack("<Q", len(target_raw)) + target_raw
                _pwrite_all(out_fd, prefix, 0)
                # Sized up front: bytes no tensor covers read as zeros (§9 of the spec).
                os.ftruncate(out_fd, stats.full_bytes)
                prev_fd = os.open(previous, os.O_RDONLY)
            data_start = 8 + len(target_raw)

            def run(item: tuple[TensorInfo, int, int, dict[str, Any]]) -> _ChunkResult:
                # One task per chunk does all of its work (parent checksum, CRC, decode, write),
                # so no stage waits for the slowest chunk of another stage.
                info, s, e, meta = item
                udtype = uint_view_dtype(info.dtype)
                width = udtype.itemsize
                ptensor = prev.tensors[info.name]
                old = _elements(prev, ptensor)[s:e]
                encoding = meta.get("encoding")
                buf = None
                out_off = data_start + info.begin + s * width
                how = ck.parent_use(meta, old.nbytes, to_file=out_fd is not None)
                if how == ck.COPY_FIRST:
                    # The rebuilt chunk is assembled in a reused per-thread buffer and written
                    # with one pwrite (patching a shared file map instead costs a page fault per
                    # touched page). Copied first, the parent's bytes are summed from cache
                    # rather than read from the page cache twice.
                    buf = ck.scratch("chunk", e - s, udtype)
                    np.copyto(buf, old)
                    base = adler32(buf)
                    old = buf
                elif how == ck.BUILD:
                    base = None  # summed by decode_chunk, from the rebuilt chunk
                else:
                    base = adler32(old)
                write_to: tuple[int, int] | None = None
                if how == ck.WRITE_THROUGH:
                    assert out_fd is not None
                    _pwrite_all(out_fd, old, out_off)  # the changed elements go over it
                    write_to = (out_fd, out_off)
                try:
                    begin = header.payload_offset + meta["offset"]
                    data = memoryview(delta_map)[begin : begin + meta["length"]]
                    # A CRC over the stored bytes catches what adler32 of the result cannot: a
                    # flipped gap moves every later position, which keeps the bytes' sums.
                    want_crc = parse_checksum(meta.get("crc32"), shard=shard, tensor=info.name)
                    if crc32(data) != want_crc:
                        raise CorruptDeltaError(
                            f"elements {s}..{e}: stored bytes fail their CRC-32 "
                            "(corrupted payload)",
                            shard=shard,
                            tensor=info.name,
                        )
                    what = f"{shard}: tensor {info.name!r}: elements {s}..{e}"
                    if buf is None and encoding != ck.SAME and write_to is None:
                        buf = ck.scratch("chunk", e - s, udtype)
                    res = ck.decode_chunk(
                        meta, data, old, what, info.dtype, base=base, out=buf, write_to=write_to
                    )
                except ArcError as exc:
                    # Chunk decoders know no shard or tensor: attach them for callers. The error
                    # is raised only after every parent checksum was compared (wrong parent first).
                    exc.shard, exc.tensor = exc.shard or shard, exc.tensor or info.name
                    parent_sum = base if base is not None else adler32(old)
                    return _ChunkResult(parent_sum, None, 0, exc)
                if out_fd is not None and not res.written:
                    if res.dense is not None:
                        _pwrite_all(out_fd, res.dense, out_off)
                    else:  # same: the kernel copies the parent's bytes, no pass in this process
                        assert prev_fd is not None
                        _copy_range(
                            prev_fd,
                            out_fd,
                            (e - s) * width,
                            prev.data_start + ptensor.begin + s * width,
                            out_off,
                        )
                if progress:
                    progress((e - s) * width)
                return _ChunkResult(res.base_checksum, res.target_checksum, res.changed, None)

            results = list(pool.map(run, plan))
            parent_parts: dict[str, list[tuple[int, int]]] = {}
            per_tensor: dict[str, list[tuple[int, int]]] = {}
            for (info, s, e, meta), res in zip(plan, results, strict=True):
                width = info.nbytes // max(1, info.numel)
                parent_parts.setdefault(info.name, []).append((res.base, (e - s) * width))
                if res.target is not None:
                    per_tensor.setdefault(info.name, []).append((res.target, (e - s) * width))
                stats.changed += res.changed
                stats.encodings[str(meta.get("encoding"))] += 1
            # A delta applied to the wrong parent is reported as such, not as the corruption
            # decoding it looks like: parents first, then chunk errors, then results.
            for entry in entries:
                tname = entry["name"]
                want_base = parse_checksum(entry.get("base_checksum"), shard=shard, tensor=tname)
                got_base = _combine(parent_parts.get(tname, []))
                if got_base != want_base:
                    raise WrongParentError(
                        f"the parent's data differ from the delta's base (checksum "
                        f"{format_checksum(got_base)}, delta expects {format_checksum(want_base)}):"
                        " this delta was made against another snapshot",
                        shard=shard,
                        tensor=tname,
                    )
            for res in results:
                if res.error is not None:
                    raise res.error
            for entry in entries:
                tname = entry["name"]
                want = parse_checksum(entry.get("checksum"), shard=shard, tensor=tname)
                got = _combine(per_tensor.get(tname, []))
                if got != want:
                    raise ChecksumMismatchError(
                        f"rebuilt tensor has checksum {format_checksum(got)}, the delta promises "
                        f"{format_checksum(want)}: the payload is corrupted",
                        shard=shard,
                        tensor=tname,
                    )
            if tmp is not None and out is not None:
                if link:
                    stats.hardlinked = _link_or_copy(previous, tmp)
                elif durable:
                    assert out_fd is not None
                    os.fsync(out_fd)
                os.replace(tmp, out)
        finally:
            if prev_fd is not None:
                os.close(prev_fd)
            if out_fd is not None:
                os.close(out_fd)
            # A traceback may still hold views into the map: then it is freed with it.
            with contextlib.suppress(BufferError):
                delta_map.close()
            delta_file.close()
            if tmp is not None:
                tmp.unlink(missing_ok=True)
    stats.seconds = time.perf_counter() - started
    return stats


# --- snapshot folders -------------------------------------------------------------------------


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link src to dst (snapshot files are never modified in place, only replaced), or
    copy it where the filesystem cannot link; True when linked."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


def _copy_side_files(src: Path, dst: Path, shards: list[str]) -> None:
    """Link or copy what is neither a shard nor a manifest (config, tokenizer files) to dst."""
    skip = set(shards) | set(layout.MANIFEST_FILES)
    for path in sorted(src.rglob("*")):
        name = str(path.relative_to(src))
        if path.is_file() and name not in skip and not path.name.startswith("."):
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(path, dst / name)


def _copy_manifests(src: Path, dst: Path) -> None:
    """Copy the manifests, last: a folder with them names every shard it needs."""
    for name in layout.MANIFEST_FILES:
        shutil.copyfile(src / name, dst / name)


@contextmanager
def _staging(out: Path, overwrite: bool) -> Iterator[Path]:
    if out.exists() and not overwrite:
        raise SnapshotError("output folder already exists", path=str(out))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def encode(
    previous: str | Path,
    current: str | Path,
    out: str | Path,
    *,
    parent_identity: str | None = None,
    identity: str | None = None,
    threads: int | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    compact: bool = False,
    sparse_level: int = 1,
    dense_level: int = 3,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> CodecStats:
    """Write an incremental snapshot at `out` that rebuilds `current` from `previous`.

    Both inputs must be valid full snapshots with the same weight map and dtypes. The parent
    identity recorded in every shard defaults to the name of the `previous` folder. `compact`
    lets float tensors use the parent's exponents as context (`sparse_exp`): about a quarter
    smaller on optimizer updates, about three times slower to decode.
    """
    from hotload.snapshot.validate import validate_snapshot, validate_transition

    started = time.perf_counter()
    prev_path, cur_path, out_path = Path(previous), Path(current), Path(out)
    parent_identity = layout.validate_identity(parent_identity or prev_path.name)
    if identity is not None:
        layout.validate_identity(identity)
    prev = validate_snapshot(prev_path)
    cur = validate_snapshot(cur_path)
    for snap, role in ((prev, "previous"), (cur, "current")):
        if snap.kind == "lora":
            raise SnapshotError(
                f"the {role} snapshot is a LoRA adapter: adapters are published whole, never "
                "as arc_v2 deltas (an adapter is small, and no delta chain exists for it)",
                path=str(snap.path),
            )
        if snap.kind != "full":
            raise SnapshotError(
                f"the {role} snapshot must be full, it is {snap.kind}", path=str(snap.path)
            )
    validate_transition(prev, cur)
    stats = CodecStats()
    with _staging(out_path, overwrite) as tmp, _released_scratch():
        _copy_side_files(cur_path, tmp, cur.shard_files)
        stats.shards = _Lanes(threads).each_shard(
            cur.shard_files,
            lambda shard, runner: encode_shard(
                prev_path / shard,
                cur_path / shard,
                tmp / shard,
                parent=parent_identity,
                identity=identity,
                pool=runner,
                chunk_elements=chunk_elements,
                exponent_context=compact,
                sparse_level=sparse_level,
                dense_level=dense_level,
                progress=progress,
                durable=durable,
            ),
        )
        _copy_manifests(cur_path, tmp)
    stats.seconds = time.perf_counter() - started
    return stats


def decode(
    previous: str | Path,
    delta: str | Path,
    out: str | Path | None,
    *,
    expected_parent: str | None = None,
    threads: int | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    durable: bool = True,
) -> CodecStats:
    """Rebuild the full snapshot of `delta` from `previous` into `out`, verifying every tensor.

    With `out=None` the delta is only verified. Nothing appears at `out` unless every shard
    rebuilt and verified.
    """
    with parse_once():
        return _decode(
            Path(previous),
            Path(delta),
            None if out is None else Path(out),
            expected_parent=expected_parent,
            threads=threads,
            overwrite=overwrite,
            progress=progress,
            durable=durable,
        )


def _decode(
    prev_path: Path,
    delta_path: Path,
    out: Path | None,
    *,
    expected_parent: str | None,
    threads: int | None,
    overwrite: bool,
    progress: ProgressFn | None,
    durable: bool,
) -> CodecStats:
    from hotload.snapshot.validate import validate_snapshot, validate_transition

    started = time.perf_counter()
    prev = validate_snapshot(prev_path)
    if prev.kind != "full":
        raise SnapshotError(
            f"the previous snapshot must be full, it is {prev.kind}", path=str(prev_path)
        )
    dsnap = validate_snapshot(delta_path)
    if dsnap.kind != "incremental":
        raise SnapshotError(
            f"expected an incremental snapshot, found {dsnap.kind}", path=str(delta_path)
        )
    validate_transition(prev, dsnap)
    stats = CodecStats()
    lanes = _Lanes(threads)
    with _released_scratch():
        if out is None:
            stats.shards = lanes.each_shard(
                dsnap.shard_files,
                lambda shard, runner: decode_shard(
                    prev_path / shard,
                    delta_path / shard,
                    None,
                    expected_parent=expected_parent,
                    pool=runner,
                    progress=progress,
                ),
            )
        else:
            with _staging(Path(out), overwrite) as tmp:
                _copy_side_files(delta_path, tmp, dsnap.shard_files)
                stats.shards = lanes.each_shard(
                    dsnap.shard_files,
                    lambda shard, runner: decode_shard(
                        prev_path / shard,
                        delta_path / shard,
                        tmp / shard,
                        expected_parent=expected_parent,
                        pool=runner,
                        progress=progress,
                        durable=durable,
                    ),
                )
                _copy_manifests(delta_path, tmp)
    stats.seconds = time.perf_counter() - started
    return stats


@dataclass
class VerifyReport:
    """Result of `verify`: what was checked, and the full shards that could not be."""

    kind: str
    tensors_checked: int = 0
    shards_checked: int = 0
    parent: str | None = None
    unchecked_shards: list[str] = field(default_factory=list)


def verify(
    path: str | Path,
    previous: str | Path | None = None,
    *,
    threads: int | None = None,
    allow_unchecked: bool = False,
    progress: ProgressFn | None = None,
) -> VerifyReport:
    """Verify a snapshot: structure always; tensor checksums of a full snapshot or a LoRA
    adapter, or of a delta rebuilt (in memory, nothing written) against `previous`.

    A full shard without recorded checksums (`hotload.checksums` metadata: shards not written
    by hotload) cannot be verified. It raises `SnapshotError` naming the shard, unless
    `allow_unchecked` is set: then the shard is listed in `unchecked_shards` and skipped, so a
    caller never mistakes an unverified snapshot for a verified one. `progress` receives the
    bytes of tensor data as they are checked (skipped shards count as done).
    """
    from hotload.snapshot.validate import validate_snapshot
    from hotload.snapshot.writer import META_CHECKSUMS

    snap = validate_snapshot(path)
    report = VerifyReport(snap.kind, parent=snap.parent)
    if snap.kind == "incremental":
        if previous is not None:
            stats = decode(previous, path, None, threads=threads, progress=progress)
            report.shards_checked = len(stats.shards)
            report.tensors_checked = len(snap.tensor_map)
        return report
    if snap.kind == "lora":
        from hotload.snapshot.lora import adapter_weight_files, verify_adapter

        # Adapters always record checksums (validation refuses them otherwise): check the data.
        report.tensors_checked = verify_adapter(snap.path)
        report.shards_checked = len(adapter_weight_files(snap.path))
        return report
    for shard in snap.shard_files:
        with snap.open_shard(shard) as f:
            raw = f.metadata.get(META_CHECKSUMS)
            if raw is None:
                if not allow_unchecked:
                    raise SnapshotError(
                        f"records no tensor checksums (no __metadata__.{META_CHECKSUMS}), so its "
                        "tensors cannot be verified; rebuild the snapshot with hotload "
                        "(`hotload snapshot build`), or accept it unverified "
                        "(allow_unchecked=True, `--allow-unchecked`)",
                        path=str(snap.path / shard),
                    )
                report.unchecked_shards.append(shard)
                if progress:
                    progress(sum(i.nbytes for i in f.tensors.values()))
                continue
            try:
                sums = json.loads(raw)
            except json.JSONDecodeError:
                sums = None
            if not isinstance(sums, dict):
                raise SnapshotError(
                    "checksum metadata is not a JSON object",
                    path=str(snap.path / shard),
                    field=f"__metadata__.{META_CHECKSUMS}",
                )
            for tname, info in f.tensors.items():
                want = parse_checksum(sums.get(tname), shard=shard, tensor=tname)
                got = adler32(f.raw(info.name))
                if got != want:
                    raise ChecksumMismatchError(
                        f"tensor data has checksum {format_checksum(got)}, the shard records "
                        f"{format_checksum(want)}",
                        shard=shard,
                        tensor=tname,
                    )
                report.tensors_checked += 1
                if progress:
                    progress(info.nbytes)
            report.shards_checked += 1
    return report


__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "CodecStats",
    "HotloadError",
    "ShardStats",
    "VerifyReport",
    "decode",
    "decode_shard",
    "encode",
    "encode_shard",
    "target_tensors",
    "target_tensors_of",
    "verify",
]
