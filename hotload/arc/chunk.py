"""Per-chunk encodings of arc_v2: how one run of elements of a tensor changed since the parent.

A tensor is cut into chunks of at most `chunk_elements` elements; each chunk picks the cheapest
exact encoding independently, which bounds memory and lets chunks be coded on all cores.

Encodings (values are unsigned integers of the element width; arithmetic wraps):
  same    the chunk equals the parent's; no payload.
  sparse  k changed elements: gaps between their positions, split at a bit `shift` into
          remainder and quotient byte planes (a Rice code whose halves zstd's Huffman stage
          codes), and zigzagged differences new - old (byte planes).
  dense   zigzagged differences new - old for every element (byte planes).
  raw     the new elements themselves (byte planes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hotload.arc import streams as st
from hotload.arc.checksum import adler32, adler32_sparse_update
from hotload.errors import CorruptDeltaError

SAME = "same"
SPARSE = "sparse"
DENSE = "dense"
RAW = "raw"
ENCODINGS = (SAME, SPARSE, DENSE, RAW)

# Try the sparse form below this fraction of changed elements, the dense forms above the next.
SPARSE_MAX_FRACTION = 0.5
DENSE_MIN_FRACTION = 1 / 16
RAW_MIN_FRACTION = 0.5


@dataclass
class EncodedChunk:
    """An encoded chunk: its header entry (without offset) and its stream bytes, in order."""

    meta: dict[str, Any]
    payload: list[bytes] = field(default_factory=list)
    target_checksum: int = 1
    base_checksum: int = 1

    @property
    def size(self) -> int:
        """Payload bytes of the chunk."""
        return sum(len(p) for p in self.payload)


Part = tuple[str, bytes, int]


def _streams(parts: list[Part]) -> tuple[list[list[Any]], list[bytes]]:
    return [[codec, len(data), bits] for codec, data, bits in parts], [d for _, d, _ in parts]


def _pack(plane: np.ndarray, level: int) -> Part:
    bits = st.pack_width(plane)
    codec, data = st.compress_stream(st.pack_symbols(plane, bits), level)
    return codec, data, bits


def _best_shift(gaps: np.ndarray) -> int:
    # A sample decides as well as the whole stream and keeps this O(1) per chunk.
    gaps = gaps[:: max(1, gaps.size // 65536)]
    mean = float(gaps.mean()) if gaps.size else 0.0
    guess = max(0, int(np.log2(mean * 0.69 + 1e-9)) if mean >= 1 else 0)
    candidates = sorted({max(0, guess + d) for d in (-1, 0, 1)})
    return min(candidates, key=lambda s: st.estimate_rice_bits(gaps, s))


def encode_sparse(
    old: np.ndarray, new: np.ndarray, idx: np.ndarray, level: int
) -> tuple[dict[str, Any], list[bytes]]:
    """Encode changed positions `idx` (sorted) and their new values as a sparse chunk."""
    k = int(idx.size)
    gaps = np.diff(idx.astype(np.uint64), prepend=np.uint64(0))
    if k:
        gaps[1:] -= np.uint64(1)  # g0 = p0, gi = pi - p(i-1) - 1
    shift = _best_shift(gaps)
    q, r = st.split_at_bit(gaps, shift)
    q_planes = st.bytes_needed(int(q.max())) if k else 1
    diffs = st.zigzag(new[idx] - old[idx])
    v_planes = st.bytes_needed(int(diffs.max())) if k else 1
    parts = [_pack(p, level) for p in st.split_planes(r, st.remainder_planes(shift))]
    parts += [_pack(p, level) for p in st.split_planes(q, q_planes)]
    parts += [_pack(p, level) for p in st.split_planes(diffs, v_planes)]
    streams, payload = _streams(parts)
    meta = {
        "encoding": SPARSE,
        "count": k,
        "shift": shift,
        "quotient_planes": q_planes,
        "value_planes": v_planes,
        "streams": streams,
    }
    return meta, payload


def encode_dense(
    old: np.ndarray, new: np.ndarray, level: int
) -> tuple[dict[str, Any], list[bytes]]:
    """Encode every element as a zigzagged difference from the parent."""
    diffs = st.zigzag(new - old)
    planes = st.bytes_needed(int(diffs.max())) if diffs.size else 1
    streams, payload = _streams([_pack(p, level) for p in st.split_planes(diffs, planes)])
    return {"encoding": DENSE, "value_planes": planes, "streams": streams}, payload


def encode_raw(new: np.ndarray, level: int) -> tuple[dict[str, Any], list[bytes]]:
    """Encode the new elements themselves, byte plane by byte plane."""
    width = new.dtype.itemsize
    streams, payload = _streams([_pack(p, level) for p in st.split_planes(new, width)])
    return {"encoding": RAW, "streams": streams}, payload


def encode_chunk(
    old: np.ndarray, new: np.ndarray, *, sparse_level: int = 1, dense_level: int = 3
) -> EncodedChunk:
    """Encode one chunk (unsigned integer views of equal dtype and length), cheapest form wins."""
    n = int(new.size)
    length = int(new.nbytes)
    target = adler32(new)
    idx = np.flatnonzero(old != new)
    k = int(idx.size)
    if k == 0:
        return EncodedChunk({"encoding": SAME}, [], target, target)
    options: list[tuple[dict[str, Any], list[bytes]]] = []
    base: int | None = None
    if k <= n * SPARSE_MAX_FRACTION:
        options.append(encode_sparse(old, new, idx, sparse_level))
        base = adler32_sparse_update(target, length, idx, new[idx], old[idx])
    if k >= n * DENSE_MIN_FRACTION:
        options.append(encode_dense(old, new, dense_level))
        if k >= n * RAW_MIN_FRACTION:
            options.append(encode_raw(new, dense_level))
    if base is None:
        base = adler32(old)
    meta, payload = min(options, key=lambda o: sum(len(p) for p in o[1]))
    return EncodedChunk(meta, payload, target, base)


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
    dense: np.ndarray | None = None  # whole new chunk (dense, raw)
    positions: np.ndarray | None = None  # sparse patch
    values: np.ndarray | None = None


def decode_chunk(
    meta: dict[str, Any], data: memoryview, old: np.ndarray, what: str
) -> DecodedChunk:
    """Decode one chunk against the parent's elements `old`; never reads past `data`."""
    encoding = meta.get("encoding")
    n = int(old.size)
    width = old.dtype.itemsize
    base = adler32(old)
    if encoding == SAME:
        return DecodedChunk(base, base)
    streams_raw: list[int]
    if encoding == SPARSE:
        k = _int_field(meta, "count", 1, n, what)
        shift = _int_field(meta, "shift", 0, 56, what)
        rp = st.remainder_planes(shift)
        qp = _int_field(meta, "quotient_planes", 1, 8, what)
        vp = _int_field(meta, "value_planes", 1, width, what)
        streams_raw = [k] * (rp + qp + vp)
    elif encoding == DENSE:
        vp = _int_field(meta, "value_planes", 1, width, what)
        streams_raw = [n] * vp
    elif encoding == RAW:
        streams_raw = [n] * width
    else:
        raise CorruptDeltaError(f"{what}: unknown encoding {encoding!r} (supported: {ENCODINGS})")
    streams = _check_streams(meta, streams_raw, what)
    decoded: list[np.ndarray] = []
    pos = 0
    for i, ((codec, stored, bits), count) in enumerate(zip(streams, streams_raw, strict=True)):
        if pos + stored > len(data):
            raise CorruptDeltaError(f"{what}: stream {i} runs past the end of the chunk payload")
        # The decoded size follows from the chunk's own element count: a frame that claims
        # more is a decompression bomb and is refused before anything is allocated.
        raw = st.decompress_stream(
            codec, data[pos : pos + stored], st.packed_len(count, bits), f"{what}: stream {i}"
        )
        decoded.append(st.unpack_symbols(raw, bits, count))
        pos += stored
    if pos != len(data):
        raise CorruptDeltaError(f"{what}: {len(data) - pos} stray bytes after the last stream")
    udtype = old.dtype
    if encoding == SPARSE:
        r = st.join_planes(decoded[:rp], k, np.dtype(np.uint64))
        q = st.join_planes(decoded[rp : rp + qp], k, np.dtype(np.uint64))
        gaps = (q << np.uint64(shift)) | r
        if k and int(gaps.max()) >= n:
            raise CorruptDeltaError(f"{what}: a gap between changed positions exceeds the chunk")
        positions = np.cumsum(gaps, dtype=np.uint64)
        positions += np.arange(k, dtype=np.uint64)  # undo the "- 1" of every gap after the first
        if k and int(positions[-1]) >= n:
            raise CorruptDeltaError(
                f"{what}: a changed position lies past the chunk's {n} elements"
            )
        idx = positions.astype(np.int64)
        vals = st.join_planes(decoded[rp + qp :], k, udtype)
        before = old[idx]
        after = before + st.unzigzag(vals)
        target = adler32_sparse_update(base, int(old.nbytes), idx, before, after)
        return DecodedChunk(base, target, positions=idx, values=after)
    if encoding == DENSE:
        new = old + st.unzigzag(st.join_planes(decoded, n, udtype))
    else:
        new = st.join_planes(decoded, n, udtype)
    return DecodedChunk(base, adler32(new), dense=new)
