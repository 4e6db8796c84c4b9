"""Encoding one chunk of arc_v2: find what changed since the parent, code it in every form that
may win, keep the smallest (`encode_chunk`). The forms are listed in `encodings`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hotload.arc import streams as st
from hotload.arc.checksum import adler32, adler32_sparse_update
from hotload.arc.encodings import (
    DENSE,
    DENSE_ALWAYS_FRACTION,
    DENSE_CLUSTER_FACTOR,
    DENSE_MIN_FRACTION,
    FLOAT_LAYOUTS,
    RAW,
    RAW_MIN_FRACTION,
    SAME,
    SPARSE,
    SPARSE_EXP,
    SPARSE_MAX_FRACTION,
    SPARSE_UPDATE_BYTES,
    FloatLayout,
    hot_mask,
    hot_order,
    scratch,
)


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
    members, order = hot_order(old, hot, layout)
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
