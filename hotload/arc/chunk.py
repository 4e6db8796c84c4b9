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

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hotload.arc import streams as st
from hotload.arc.checksum import adler32, adler32_shift, adler32_sparse_update
from hotload.errors import CorruptDeltaError

try:
    # The decoder's C kernel for sparse runs (hotload/arc/_native.c), built at install when a
    # C compiler is there; the numpy code below is the reference and the fallback.
    import hotload.arc._native as _native_module

    native: Any = _native_module if sys.byteorder == "little" else None
except ImportError:  # pragma: no cover - `make test` requires the kernel (test_arc_native.py)
    native = None

SAME = "same"
SPARSE = "sparse"
SPARSE_EXP = "sparse_exp"
DENSE = "dense"
RAW = "raw"
ENCODINGS = (SAME, SPARSE, SPARSE_EXP, DENSE, RAW)

# Try the sparse form below this fraction of changed elements, the dense forms above the next
# (between DENSE_MIN_FRACTION and DENSE_ALWAYS_FRACTION only when changes cluster; see
# `dense_worth_trying`).
SPARSE_MAX_FRACTION = 0.5
DENSE_MIN_FRACTION = 1 / 16
DENSE_ALWAYS_FRACTION = 1 / 4
DENSE_CLUSTER_FACTOR = 2.0
RAW_MIN_FRACTION = 0.5
# Below one change per this many bytes, a rebuilt chunk's adler32 is updated from its parent's
# in O(changed) work; above, recomputing it over the rebuilt bytes is faster.
SPARSE_UPDATE_BYTES = 128
# Below one change per this many bytes (and with the C kernel), a sparse chunk is rebuilt in the
# output file: the parent's bytes written straight from its map, then each changed element
# (a pwrite of a few bytes costs about what copying 8 KiB through a buffer does).
WRITE_THROUGH_BYTES = 8192


_scratch_local = threading.local()


def scratch(name: str, count: int, dtype: np.dtype[Any]) -> np.ndarray:
    """A per-thread buffer of `count` elements named `name`, reused from call to call.

    Reuse matters: a fresh array of a few hundred KiB or more is mapped anew by malloc and
    costs a page fault per 4 KiB on first write, which doubled the time of decoding a chunk.
    The contents are undefined, and valid only until the same thread asks for `name` again.
    """
    buffers: dict[str, np.ndarray] = _scratch_local.__dict__.setdefault("buffers", {})
    need = count * dtype.itemsize
    buf = buffers.get(name)
    if buf is None or buf.nbytes < need:
        buf = np.empty(need, dtype=np.uint8)
        buffers[name] = buf
    return buf[:need].view(dtype)


def release_scratch() -> None:
    """Free this thread's `scratch` buffers."""
    _scratch_local.__dict__.pop("buffers", None)


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
    costs = st.estimate_rice_bits(gaps, candidates)
    return candidates[costs.index(min(costs))]


def _encode_run(
    indices: np.ndarray, diffs: np.ndarray, level: int
) -> tuple[dict[str, Any], list[Part]]:
    """Code a run: sorted indices (as gaps split at a bit) and their zigzagged differences."""
    k = int(indices.size)
    if k == 0:
        return {"count": 0, "shift": 0, "quotient_planes": 0, "value_planes": 0}, []
    # Chunks hold at most 2**24 elements, so gaps fit 32 bits: half the memory traffic of 64.
    gaps = np.empty(k, dtype=np.uint32)
    gaps[0] = indices[0]
    np.subtract(indices[1:], indices[:-1], out=gaps[1:], casting="unsafe")
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
    return _encode_sparse_values(idx, old[idx], new[idx], level)


def _encode_sparse_values(
    idx: np.ndarray, old_v: np.ndarray, new_v: np.ndarray, level: int
) -> tuple[dict[str, Any], list[bytes]]:
    fields, parts = _encode_run(idx, st.zigzag(new_v - old_v), level)
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
    idx = changed_positions(old, new)
    k = int(idx.size)
    if k == 0:
        return EncodedChunk({"encoding": SAME}, [], target, target)
    options: list[tuple[dict[str, Any], list[bytes]]] = []
    base: int | None = None
    if k <= n * SPARSE_MAX_FRACTION:
        old_v, new_v = old[idx], new[idx]
        layout = FLOAT_LAYOUTS.get(dtype or "") if exponent_context else None
        threshold = choose_threshold(old, idx, layout) if layout is not None else None
        if layout is not None and threshold is not None:
            # The threshold comes from an estimate: keep plain sparse if it turns out smaller.
            options.append(
                encode_sparse_exp(
                    old, new, idx, threshold=threshold, layout=layout, level=sparse_level
                )
            )
        options.append(_encode_sparse_values(idx, old_v, new_v, sparse_level))
        if k * SPARSE_UPDATE_BYTES < length:
            base = adler32_sparse_update(target, length, idx, new_v, old_v)
    if dense_worth_trying(idx, n):
        options.append(encode_dense(old, new, dense_level))
        if k >= n * RAW_MIN_FRACTION:
            options.append(encode_raw(new, dense_level))
    if base is None:
        base = adler32(old)
    meta, payload = min(options, key=lambda o: sum(len(p) for p in o[1]))
    return EncodedChunk(meta, payload, target, base, k)


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Positions where `old` and `new` differ, ascending (int64): `flatnonzero(old != new)`.

    numpy finds the True entries of a boolean array with a memchr scan per entry when at most
    a tenth are True, and branch-free above: at 4-10% True (optimizer steps at lr 1e-5) the
    scan costs 2-4 times the branch-free pass. Appending a few True entries past the end to
    lift the density just above a tenth selects the fast pass; they are cut off again. (Only
    speed depends on numpy's choice: the result is the same either way.)
    """
    n = int(old.size)
    pad_max = n // 12 + 1  # enough to lift 4% to 11%
    buf = scratch("changed", n + pad_max, np.dtype(np.bool_))
    ne = buf[:n]
    np.not_equal(old, new, out=ne)
    k = int(np.count_nonzero(ne))
    if not 0.04 * n < k <= 0.1 * n:
        result: np.ndarray = np.flatnonzero(ne)
        return result
    pad = min(pad_max, int((0.11 * n - k) / 0.89) + 1)
    buf[n : n + pad] = True
    return np.flatnonzero(buf[: n + pad])[:k]


def dense_worth_trying(idx: np.ndarray, n: int) -> bool:
    """Tell whether `dense` may beat the sparse forms for changed positions `idx` of `n`.

    Coding both costs about twice the time, so `dense` is tried only where it can win. Measured
    on optimizer steps and synthetic changes, sparse stays smaller up to about a third of the
    elements changed when changes fall independently (`dense` pays at least a bit per element
    for the mask), and `dense` only wins below that when changes cluster into runs (zstd's
    matches then code its zero runs cheaply): with half of the changes next to another change at
    a tenth changed, `dense` came out 5% smaller.
    """
    k = int(idx.size)
    if k < n * DENSE_MIN_FRACTION:
        return False
    if k >= n * DENSE_ALWAYS_FRACTION:
        return True
    # Independent changes at rate p have a changed neighbour with probability p; runs raise it.
    adjacent = int(np.count_nonzero(np.diff(idx) == 1))
    return adjacent >= DENSE_CLUSTER_FACTOR * (k - 1) * (k / n)


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
