"""Per-chunk encodings of arc_v2: how one run of elements of a tensor changed since the parent.

A tensor is cut into chunks of at most `chunk_elements` elements; each chunk picks the cheapest
exact encoding independently, which bounds memory and lets chunks be coded on all cores.

Encodings (values are unsigned integers of the element width; arithmetic wraps):
  same    the chunk equals the parent's; no payload.
  sparse  k changed elements: gaps between their positions, split at a bit `shift` into
          remainder and quotient byte planes (a Rice code whose halves zstd's Huffman stage
          codes), and zigzagged differences new - old (byte planes).
  sparse_exp  the same for floats, with the parent's exponent as context: elements of small
          magnitude ("hot", exponent below a threshold) in exponent order, the rest apart.
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
SPARSE_EXP = "sparse_exp"
DENSE = "dense"
RAW = "raw"
ENCODINGS = (SAME, SPARSE, SPARSE_EXP, DENSE, RAW)

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
    changed: int = 0

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


def _encode_run(
    indices: np.ndarray, diffs: np.ndarray, level: int
) -> tuple[dict[str, Any], list[Part]]:
    """Code a run: sorted indices (as gaps split at a bit) and their zigzagged differences."""
    k = int(indices.size)
    if k == 0:
        return {"count": 0, "shift": 0, "quotient_planes": 0, "value_planes": 0}, []
    # Chunks hold at most 2**24 elements, so gaps fit 32 bits: half the memory traffic of 64.
    gaps = np.diff(indices.astype(np.uint32), prepend=np.uint32(0))
    gaps[1:] -= np.uint32(1)  # g0 = i0, gj = ij - i(j-1) - 1
    shift = _best_shift(gaps)
    q, r = st.split_at_bit(gaps, shift)
    q_planes = st.bytes_needed(int(q.max()))
    v_planes = st.bytes_needed(int(diffs.max()))
    parts = [_pack(p, level) for p in st.split_planes(r, st.remainder_planes(shift))]
    parts += [_pack(p, level) for p in st.split_planes(q, q_planes)]
    parts += [_pack(p, level) for p in st.split_planes(diffs, v_planes)]
    fields = {"count": k, "shift": shift, "quotient_planes": q_planes, "value_planes": v_planes}
    return fields, parts


def encode_sparse(
    old: np.ndarray, new: np.ndarray, idx: np.ndarray, level: int
) -> tuple[dict[str, Any], list[bytes]]:
    """Encode changed positions `idx` (sorted) and their new values as a sparse chunk."""
    fields, parts = _encode_run(idx, st.zigzag(new[idx] - old[idx]), level)
    streams, payload = _streams(parts)
    return {"encoding": SPARSE, **fields, "streams": streams}, payload


@dataclass(frozen=True)
class FloatLayout:
    """Where the exponent of a floating-point dtype lies in its bit pattern."""

    mantissa_bits: int
    total_bits: int

    @property
    def magnitude_mask(self) -> int:
        """Every bit but the sign."""
        return (1 << (self.total_bits - 1)) - 1

    @property
    def max_exponent(self) -> int:
        """Largest value of the exponent field."""
        return (1 << (self.total_bits - 1 - self.mantissa_bits)) - 1


FLOAT_LAYOUTS = {
    "BF16": FloatLayout(7, 16),
    "F16": FloatLayout(10, 16),
    "F32": FloatLayout(23, 32),
    "F64": FloatLayout(52, 64),
    "F8_E4M3": FloatLayout(3, 8),
    "F8_E5M2": FloatLayout(2, 8),
}


def hot_mask(old: np.ndarray, layout: FloatLayout, threshold: int) -> np.ndarray:
    """Elements whose parent exponent is below `threshold` ("hot": small magnitudes)."""
    bound = threshold << layout.mantissa_bits
    mag = np.bitwise_and(old, old.dtype.type(layout.magnitude_mask))
    result: np.ndarray = np.less(mag, old.dtype.type(min(bound, layout.magnitude_mask + 1)))
    return result


def _hot_order(
    old: np.ndarray, hot: np.ndarray, layout: FloatLayout
) -> tuple[np.ndarray, np.ndarray]:
    """Hot positions in position order, and the permutation that orders them by exponent."""
    members = np.flatnonzero(hot)
    mmask, mbits = old.dtype.type(layout.magnitude_mask), old.dtype.type(layout.mantissa_bits)
    exps = ((old[members] & mmask) >> mbits).astype(np.uint16)
    return members, np.argsort(exps, kind="stable")


def _entropy_bits(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    out: np.ndarray = n * h
    return out


def choose_threshold(old: np.ndarray, idx: np.ndarray, layout: FloatLayout) -> int | None:
    """Pick the exponent below which elements are coded apart, or None when it does not pay.

    Adam moves small weights by more ulps than large ones, so the parent's exponent predicts
    which elements change; splitting at the best exponent is estimated from a sample.
    """
    n = int(old.size)
    step = max(1, n // 65536)
    mmask, mbits = old.dtype.type(layout.magnitude_mask), old.dtype.type(layout.mantissa_bits)
    size = layout.max_exponent + 1
    all_e = np.bincount(((old[::step] & mmask) >> mbits).astype(np.int64), minlength=size)
    chg_e = np.bincount(((old[idx] & mmask) >> mbits).astype(np.int64), minlength=size)
    n_le = np.cumsum(all_e).astype(np.float64) * (n / max(1, int(all_e.sum())))
    k_le = np.cumsum(chg_e).astype(np.float64)
    k = float(idx.size)
    n_hot, k_hot = n_le[:-1], k_le[:-1]  # threshold T = t + 1: hot means exponent <= t
    n_hot = np.maximum(n_hot, k_hot)
    cost = _entropy_bits(k_hot, n_hot) + _entropy_bits(k - k_hot, np.maximum(n - n_hot, k - k_hot))
    cost[n_hot > n / 8] = np.inf  # keep the hot set (and the decoder's work on it) small
    best = int(np.argmin(cost))
    plain = float(_entropy_bits(np.array([k]), np.array([float(n)]))[0])
    if not np.isfinite(cost[best]) or cost[best] > 0.9 * plain:
        return None
    return best + 1


def encode_sparse_exp(
    old: np.ndarray,
    new: np.ndarray,
    idx: np.ndarray,
    *,
    threshold: int,
    layout: FloatLayout,
    level: int,
) -> tuple[dict[str, Any], list[bytes]]:
    """Encode a sparse change with the parent's exponent as context.

    Hot elements (parent exponent below `threshold`) are indexed in (exponent, position) order,
    so elements with the same change rate sit together; cold ones by their rank among the cold.
    """
    hot = hot_mask(old, layout, threshold)
    members, order = _hot_order(old, hot, layout)
    is_hot = hot[idx]
    hot_pos, cold_pos = idx[is_hot], idx[~is_hot]
    # Index of each hot member in the exponent order: the inverse permutation of `order`.
    where = np.empty(members.size, dtype=np.int64)
    where[order] = np.arange(members.size, dtype=np.int64)
    hot_index = where[np.searchsorted(members, hot_pos)]
    by_index = np.argsort(hot_index)
    hot_index, hot_pos = hot_index[by_index], hot_pos[by_index]
    cold_rank = cold_pos - np.searchsorted(members, cold_pos)
    hot_fields, hot_parts = _encode_run(hot_index, st.zigzag(new[hot_pos] - old[hot_pos]), level)
    cold_fields, cold_parts = _encode_run(
        cold_rank, st.zigzag(new[cold_pos] - old[cold_pos]), level
    )
    streams, payload = _streams(hot_parts + cold_parts)
    meta = {
        "encoding": SPARSE_EXP,
        "threshold": threshold,
        "hot": hot_fields,
        "cold": cold_fields,
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
    old: np.ndarray,
    new: np.ndarray,
    *,
    dtype: str | None = None,
    exponent_context: bool = False,
    sparse_level: int = 1,
    dense_level: int = 3,
) -> EncodedChunk:
    """Encode one chunk (unsigned integer views of equal dtype and length), cheapest form wins.

    With `exponent_context` and a floating-point `dtype` (safetensors name), sparse changes may
    use `sparse_exp`: smaller on optimizer updates, slower to decode.
    """
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
        layout = FLOAT_LAYOUTS.get(dtype or "") if exponent_context else None
        threshold = choose_threshold(old, idx, layout) if layout is not None else None
        if layout is not None and threshold is not None:
            # The threshold comes from an estimate: keep plain sparse if it turns out smaller.
            options.append(
                encode_sparse_exp(
                    old, new, idx, threshold=threshold, layout=layout, level=sparse_level
                )
            )
        options.append(encode_sparse(old, new, idx, sparse_level))
        base = adler32_sparse_update(target, length, idx, new[idx], old[idx])
    if k >= n * DENSE_MIN_FRACTION:
        options.append(encode_dense(old, new, dense_level))
        if k >= n * RAW_MIN_FRACTION:
            options.append(encode_raw(new, dense_level))
    if base is None:
        base = adler32(old)
    meta, payload = min(options, key=lambda o: sum(len(p) for p in o[1]))
    return EncodedChunk(meta, payload, target, base, k)


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
) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild a run's sorted indices (< m) and zigzagged differences from its planes."""
    k, shift, qp, _ = shape
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=udtype)
    rp = st.remainder_planes(shift)
    r = st.join_planes(planes[:rp], k, np.dtype(np.uint64))
    q = st.join_planes(planes[rp : rp + qp], k, np.dtype(np.uint64))
    if shift and int(r.max()) >= 1 << shift:
        raise CorruptDeltaError(f"{what}: a gap remainder does not fit its {shift} bits")
    if shift and int(q.max()) >= 1 << (64 - shift):
        raise CorruptDeltaError(f"{what}: a gap quotient overflows 64 bits")
    gaps = (q << np.uint64(shift)) | r
    if int(gaps.max()) >= m:
        raise CorruptDeltaError(f"{what}: a gap between changed positions exceeds the chunk")
    indices = np.cumsum(gaps, dtype=np.uint64)
    indices += np.arange(k, dtype=np.uint64)  # undo the "- 1" of every gap after the first
    if int(indices[-1]) >= m:
        raise CorruptDeltaError(f"{what}: a changed position lies past the chunk's {m} elements")
    return indices.astype(np.int64), st.join_planes(planes[rp + qp :], k, udtype)


def decode_chunk(
    meta: dict[str, Any],
    data: memoryview,
    old: np.ndarray,
    what: str,
    dtype: str | None = None,
    *,
    base: int | None = None,
) -> DecodedChunk:
    """Decode one chunk against the parent's elements `old`; never reads past `data`.

    `base` is adler32(old) when the caller computed it already.
    """
    encoding = meta.get("encoding")
    n = int(old.size)
    width = old.dtype.itemsize
    udtype = old.dtype
    if base is None:
        base = adler32(old)
    if encoding == SAME:
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
        members, order = _hot_order(old, hot, layout)
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
    if encoding in (SPARSE, SPARSE_EXP):
        if encoding == SPARSE:
            idx, zz = _decode_run(decoded, shape, n, udtype, what)
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
        after = before + st.unzigzag(zz)
        target = adler32_sparse_update(base, int(old.nbytes), idx, before, after)
        return DecodedChunk(base, target, positions=idx, values=after)
    if encoding == DENSE:
        new = old + st.unzigzag(st.join_planes(decoded, n, udtype))
    else:
        new = st.join_planes(decoded, n, udtype)
    return DecodedChunk(base, adler32(new), dense=new)
