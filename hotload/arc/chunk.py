"""One chunk of arc_v2, decoded: check its fields and streams, rebuild it against the parent's
elements, and sum both checksums on the way (`decode_chunk`; `parent_use` says how the parent's
bytes are read). Sparse runs go through the C kernel when it is built.

A tensor is cut into chunks of at most `chunk_elements` elements; each chunk picks the cheapest
exact encoding independently (`chunk_encode`, re-exported here), which bounds memory and lets
chunks be coded on all cores. The encodings are described in `encodings`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from hotload.arc import streams as st
from hotload.arc.checksum import adler32, adler32_shift, adler32_sparse_update
from hotload.arc.chunk_encode import EncodedChunk, encode_chunk, encode_sparse_exp
from hotload.arc.encodings import (
    DENSE,
    ENCODINGS,
    FLOAT_LAYOUTS,
    RAW,
    SAME,
    SPARSE,
    SPARSE_EXP,
    SPARSE_UPDATE_BYTES,
    WRITE_THROUGH_BYTES,
    hot_mask,
    hot_order,
    scratch,
)
from hotload.errors import CorruptDeltaError

try:
    # The decoder's C kernel for sparse runs (hotload/arc/_native.c), built at install when a
    # C compiler is there; the numpy code below is the reference and the fallback.
    import hotload.arc._native as _native_module

    native: Any = _native_module if sys.byteorder == "little" else None
except ImportError:  # pragma: no cover - `make test` requires the kernel (test_arc_native.py)
    native = None


def _check_streams(meta: dict[str, Any], symbols: list[int], what: str) -> list[list[Any]]:
    streams = meta.get("streams")
    if not isinstance(streams, list) or len(streams) != len(symbols):
        raise CorruptDeltaError(f"{what}: expected {len(symbols)} streams")
    for s in streams:
        if (
            not isinstance(s, list)
            or len(s) != 3
            or not isinstance(s[0], str)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s[1:])
            or s[2] not in (1, 2, 4, 8)
        ):
            raise CorruptDeltaError(f"{what}: malformed stream entry {s!r}")
    return streams


def _int_field(meta: dict[str, Any], key: str, lo: int, hi: int, what: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptDeltaError(
            f"{what}: field {key!r} must be an integer in [{lo}, {hi}], got {value!r}"
        )
    return value


@dataclass
class DecodedChunk:
    """What decoding a chunk produced: checksums, and the new data or a sparse patch."""

    base_checksum: int
    target_checksum: int
    dense: np.ndarray | None = None  # whole new chunk (dense, raw; every form with `out`)
    written: bool = False  # the changes went straight to the output file (`write_to`)
    positions: np.ndarray | None = None  # sparse patch
    values: np.ndarray | None = None
    changed: int = 0  # elements coded as changed (every element of a dense or raw chunk)


def _run_shape(run: object, m: int, width: int, what: str) -> tuple[int, int, int, int]:
    """Check a run's fields against an index space of `m` elements: (count, shift, qp, vp)."""
    if not isinstance(run, dict):
        raise CorruptDeltaError(f"{what}: run fields must be an object")
    k = _int_field(run, "count", 0, m, what)
    if k == 0:
        if any(run.get(f) != 0 for f in ("shift", "quotient_planes", "value_planes")):
            raise CorruptDeltaError(f"{what}: an empty run must have all fields 0")
        return 0, 0, 0, 0
    shift = _int_field(run, "shift", 0, 56, what)
    qp = _int_field(run, "quotient_planes", 1, 8, what)
    vp = _int_field(run, "value_planes", 1, width, what)
    return k, shift, qp, vp


def _run_streams(shape: tuple[int, int, int, int]) -> list[int]:
    k, shift, qp, vp = shape
    return [k] * (st.remainder_planes(shift) + qp + vp) if k else []


def _decode_run(
    planes: list[np.ndarray],
    shape: tuple[int, int, int, int],
    m: int,
    udtype: np.dtype[Any],
    what: str,
    *,
    index_out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild a run's sorted indices (< m) and zigzagged differences from its planes.

    With `index_out` (int64, at least `count` elements) the indices are built there.
    """
    k, shift, qp, _ = shape
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=udtype)
    rp = st.remainder_planes(shift)
    # Every check runs on values joined at a width that cannot wrap (up to 8 planes: 64 bits);
    # once they pass, gaps and indices are below m <= 2**24, so int64 holds their sums.
    r = st.join_planes(planes[:rp], k, _JOIN_DTYPES[rp]) if rp else None
    q = st.join_planes(planes[rp : rp + qp], k, _JOIN_DTYPES[qp])
    if r is not None and int(r.max()) >= 1 << shift:
        raise CorruptDeltaError(f"{what}: a gap remainder does not fit its {shift} bits")
    if int(q.max()) > (m - 1) >> shift:
        # q << shift alone would reach m: the gap cannot fit the run's index space (and a
        # larger quotient could wrap a fixed-width shift, so it is refused before shifting).
        raise CorruptDeltaError(f"{what}: a gap between changed positions exceeds the chunk")
    if index_out is None:
        indices = q.astype(np.int64)
    else:
        indices = index_out[:k]
        np.copyto(indices, q, casting="unsafe")
    if shift:
        indices <<= shift
    if r is not None:
        # A 64-bit remainder passed its check, so it is below 2**56 and fits int64.
        indices |= r.view(np.int64) if r.dtype.itemsize == 8 else r
    if int(indices.max()) >= m:
        raise CorruptDeltaError(f"{what}: a gap between changed positions exceeds the chunk")
    indices += 1  # i_j = sum of (g_l + 1) for l <= j, minus 1
    np.cumsum(indices, out=indices)
    indices -= 1
    if int(indices[-1]) >= m:
        raise CorruptDeltaError(f"{what}: a changed position lies past the chunk's {m} elements")
    return indices, st.join_planes(planes[rp + qp :], k, udtype)


# The narrowest unsigned type that holds a value joined from this many byte planes.
_JOIN_DTYPES = {
    n: np.dtype("<u1" if n == 1 else "<u2" if n == 2 else "<u4" if n <= 4 else "<u8")
    for n in range(1, 9)
}


def _read_streams(
    meta: dict[str, Any], data: memoryview, streams_raw: list[int], what: str
) -> tuple[list[list[Any]], list[bytes]]:
    """A chunk's stream entries, checked, and each stream decompressed (still bit-packed)."""
    streams = _check_streams(meta, streams_raw, what)
    packed: list[bytes] = []
    pos = 0
    for i, ((codec, stored, bits), count) in enumerate(zip(streams, streams_raw, strict=True)):
        if pos + stored > len(data):
            raise CorruptDeltaError(f"{what}: stream {i} runs past the end of the chunk payload")
        # The decoded size follows from the chunk's own element count: a frame that claims
        # more is a decompression bomb and is refused before anything is allocated.
        packed.append(
            st.decompress_stream(
                codec, data[pos : pos + stored], st.packed_len(count, bits), f"{what}: stream {i}"
            )
        )
        pos += stored
    if pos != len(data):
        raise CorruptDeltaError(f"{what}: {len(data) - pos} stray bytes after the last stream")
    return streams, packed


class NeedsParentError(CorruptDeltaError):
    """A chunk whose changed positions depend on the parent's values (`sparse_exp`: the
    parent's exponents order them), asked for without the parent."""


def chunk_changes(
    meta: dict[str, Any],
    data: memoryview,
    n: int,
    udtype: np.dtype[Any],
    what: str,
    *,
    first: int = 0,
) -> tuple[str, np.ndarray | None, np.ndarray | None]:
    """What one chunk of `n` elements changes, without its parent: ("same", None, None);
    ("add", positions (each plus `first`, the chunk's first element) or None for every
    element, wrapping differences new - old) for a sparse or dense chunk; ("set", None, new
    elements) for a raw one. Every field and stream is checked as in `decode_chunk`; a
    `sparse_exp` chunk raises `NeedsParentError`."""
    encoding = meta.get("encoding")
    width = udtype.itemsize
    if encoding == SAME:
        if len(data):
            raise CorruptDeltaError(f"{what}: a 'same' chunk must have no payload")
        return SAME, None, None
    if encoding == SPARSE_EXP:
        raise NeedsParentError(
            f"{what}: a sparse_exp chunk's positions follow the parent's exponents"
        )
    if encoding == SPARSE:
        shape = _run_shape(meta, n, width, what)
        if shape[0] == 0:
            raise CorruptDeltaError(f"{what}: a sparse chunk must change at least one element")
        streams_raw = _run_streams(shape)
    elif encoding == DENSE:
        streams_raw = [n] * _int_field(meta, "value_planes", 1, width, what)
    elif encoding == RAW:
        streams_raw = [n] * width
    else:
        raise CorruptDeltaError(f"{what}: unknown encoding {encoding!r} (supported: {ENCODINGS})")
    streams, packed = _read_streams(meta, data, streams_raw, what)
    if encoding == SPARSE and native is not None:
        # One call in place of some thirty array operations: on a model of thousands of
        # chunks their fixed costs, not the changes, would set the cost of a patch.
        at = np.empty(shape[0], dtype=np.int64)
        diffs = np.empty(shape[0], dtype=udtype)
        try:
            native.sparse_changes(
                at, diffs, n, first, width, packed, [s[2] for s in streams], *shape
            )
        except ValueError as exc:
            raise CorruptDeltaError(f"{what}: {exc}") from None
        return "add", at, diffs
    decoded = [
        st.unpack_symbols(raw, s[2], count)
        for raw, s, count in zip(packed, streams, streams_raw, strict=True)
    ]
    if encoding == SPARSE:
        idx, zz = _decode_run(decoded, shape, n, udtype, what)
        if first:
            idx += first
        return "add", idx, st.unzigzag(zz)
    if encoding == DENSE:
        return "add", None, st.unzigzag(st.join_planes(decoded, n, udtype))
    return "set", None, st.join_planes(decoded, n, udtype)


# How the decoder reads a chunk's parent elements (`parent_use`).
READ = "read"  # summed where they lie (same, raw: nothing else reads them)
BUILD = "build"  # read once by the C kernel as it rebuilds; both checksums from the result
COPY_FIRST = "copy_first"  # copied into the output buffer, summed there, rebuilt in place
WRITE_THROUGH = "write_through"  # summed, written to the output file, changes written over


def parent_use(meta: dict[str, Any], nbytes: int, *, to_file: bool) -> str:
    """How to rebuild a chunk of `nbytes` bytes from its parent (READ, BUILD, COPY_FIRST, or
    WRITE_THROUGH when writing to an output file); see `decode_chunk` and the codec."""
    encoding = meta.get("encoding")
    if encoding in (SAME, RAW):
        return READ
    if encoding != SPARSE or native is None:
        return COPY_FIRST
    count = meta.get("count")
    if to_file and isinstance(count, int) and count * WRITE_THROUGH_BYTES <= nbytes:
        return WRITE_THROUGH
    return BUILD


def decode_chunk(
    meta: dict[str, Any],
    data: memoryview,
    old: np.ndarray,
    what: str,
    dtype: str | None = None,
    *,
    base: int | None = None,
    out: np.ndarray | None = None,
    write_to: tuple[int, int] | None = None,
) -> DecodedChunk:
    """Decode one chunk against the parent's elements `old`; never reads past `data`.

    `base` is adler32(old) when the caller computed it already (or None). With `out` (a
    writable array like `old`: `old` itself, rebuilt in place, or one not overlapping it),
    every encoding but `same` writes the whole rebuilt chunk there and returns it as `dense`;
    without it a sparse chunk returns only its patch. With `write_to` (file descriptor, byte
    offset; only where `parent_use` says WRITE_THROUGH) the caller has written the parent's
    bytes there and each changed element is written over them.
    """
    encoding = meta.get("encoding")
    n = int(old.size)
    width = old.dtype.itemsize
    udtype = old.dtype
    if encoding == SAME:
        base = adler32(old) if base is None else base
        if len(data):
            raise CorruptDeltaError(f"{what}: a 'same' chunk must have no payload")
        return DecodedChunk(base, base)
    streams_raw: list[int]
    hot: np.ndarray | None = None
    members = by_exp = np.zeros(0, dtype=np.int64)
    if encoding == SPARSE:
        shape = _run_shape(meta, n, width, what)
        if shape[0] == 0:
            raise CorruptDeltaError(f"{what}: a sparse chunk must change at least one element")
        streams_raw = _run_streams(shape)
    elif encoding == SPARSE_EXP:
        layout = FLOAT_LAYOUTS.get(dtype or "")
        if layout is None:
            raise CorruptDeltaError(f"{what}: sparse_exp needs a floating-point dtype, not {dtype}")
        threshold = _int_field(meta, "threshold", 1, layout.max_exponent + 1, what)
        hot = hot_mask(old, layout, threshold)
        members, order = hot_order(old, hot, layout)
        by_exp = members[order]
        hot_shape = _run_shape(meta.get("hot"), int(members.size), width, what + ": hot")
        cold_shape = _run_shape(meta.get("cold"), n - int(members.size), width, what + ": cold")
        if hot_shape[0] + cold_shape[0] == 0:
            raise CorruptDeltaError(f"{what}: a sparse chunk must change at least one element")
        streams_raw = _run_streams(hot_shape) + _run_streams(cold_shape)
    elif encoding == DENSE:
        vp = _int_field(meta, "value_planes", 1, width, what)
        streams_raw = [n] * vp
    elif encoding == RAW:
        streams_raw = [n] * width
    else:
        raise CorruptDeltaError(f"{what}: unknown encoding {encoding!r} (supported: {ENCODINGS})")
    streams, packed = _read_streams(meta, data, streams_raw, what)
    if encoding == SPARSE and (out is not None or write_to is not None) and native is not None:
        fd, offset = write_to if write_to is not None else (None, 0)
        try:
            da, db = native.sparse_patch(
                old,
                out if fd is None else fd,
                width,
                packed,
                [s[2] for s in streams],
                *shape,
                offset,
            )
        except ValueError as exc:
            raise CorruptDeltaError(f"{what}: {exc}") from None
        if base is None and out is not None:
            # Summing the rebuilt chunk while it is in cache spares a pass over the parent in
            # memory; the parent's checksum follows from it by undoing the changes.
            target = adler32(out)
            base = adler32_shift(target, -da, -db)
        else:
            base = adler32(old) if base is None else base
            target = adler32_shift(base, da, db)
        if fd is not None:
            return DecodedChunk(base, target, written=True, changed=shape[0])
        return DecodedChunk(base, target, dense=out, changed=shape[0])
    if write_to is not None:
        raise ValueError("write_to needs a sparse chunk and the C kernel (see parent_use)")
    base = adler32(old) if base is None else base
    decoded = [
        st.unpack_symbols(raw, s[2], count)
        for raw, s, count in zip(packed, streams, streams_raw, strict=True)
    ]
    if encoding in (SPARSE, SPARSE_EXP):
        if encoding == SPARSE:
            # With `out` the positions live only until the patch is applied: build them in a
            # reused buffer (a fresh one costs page faults comparable to the decoding itself).
            reuse = scratch("positions", shape[0], np.dtype(np.int64)) if out is not None else None
            idx, zz = _decode_run(decoded, shape, n, udtype, what, index_out=reuse)
        else:
            split = len(_run_streams(hot_shape))
            h_idx, h_zz = _decode_run(decoded[:split], hot_shape, int(members.size), udtype, what)
            c_rank, c_zz = _decode_run(
                decoded[split:], cold_shape, n - int(members.size), udtype, what
            )
            # The r-th cold element sits after every hot member that has at most r cold
            # elements before it.
            cold_before = members - np.arange(members.size, dtype=np.int64)
            c_idx = c_rank + np.searchsorted(cold_before, c_rank, side="right")
            idx = np.concatenate([by_exp[h_idx], c_idx])
            zz = np.concatenate([h_zz, c_zz])
        before = old[idx]
        after = st.unzigzag(zz)
        after += before
        k = int(idx.size)
        if out is None:
            target = adler32_sparse_update(base, int(old.nbytes), idx, before, after)
            return DecodedChunk(base, target, positions=idx, values=after, changed=k)
        if out is not old:
            np.copyto(out, old)
        out[idx] = after
        # The O(k) update costs a few ns per change; zlib-ng rereads the fresh copy (in cache)
        # at tens of GB/s, so past a change every ~128 bytes rereading is cheaper.
        if k * SPARSE_UPDATE_BYTES < old.nbytes:
            target = adler32_sparse_update(base, int(old.nbytes), idx, before, after)
        else:
            target = adler32(out)
        return DecodedChunk(base, target, dense=out, changed=k)
    if encoding == DENSE:
        diffs = st.unzigzag(st.join_planes(decoded, n, udtype))
        new = np.add(old, diffs, out=diffs if out is None else out)
    else:
        new = st.join_planes(decoded, n, udtype, out=out)
    return DecodedChunk(base, adler32(new), dense=new, changed=n)


__all__ = [
    "BUILD",
    "COPY_FIRST",
    "DENSE",
    "ENCODINGS",
    "FLOAT_LAYOUTS",
    "RAW",
    "READ",
    "SAME",
    "SPARSE",
    "SPARSE_EXP",
    "WRITE_THROUGH",
    "DecodedChunk",
    "EncodedChunk",
    "NeedsParentError",
    "chunk_changes",
    "decode_chunk",
    "encode_chunk",
    "encode_sparse_exp",
    "native",
    "parent_use",
]
