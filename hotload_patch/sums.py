"""adler32 in pieces: checksums of checkpoint tensors from the parts an engine holds.

The delta records the adler32 of every tensor of the parent and of the result. An engine holds a
checkpoint tensor in pieces: a slice of a fused projection, one shard per tensor-parallel rank,
rows of a padded vocabulary, a copy on every rank for a replicated weight. adler32 is linear in
the bytes (A = 1 + sum of bytes, B = n + sum of (n - i) * byte_i, both modulo 65521), so every
piece contributes partial sums (a, b) over its own bytes, weighted by their offsets in the whole
tensor, and the pieces combine into the tensor's adler32 wherever they meet: inside one engine,
or in the loader across the ranks of a tensor-parallel engine (`combine_regions`). A sparse
change moves the sums by what it changed alone (`delta_partial`).

Geometry is a `Region`: a strided view of a tensor's elements (flat offset, sizes, strides).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hotload_patch.errors import PatchError

MOD = 65521


@dataclass(frozen=True)
class Region:
    """A strided view of a tensor's elements: flat storage `offset`, `sizes`, `strides`."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Iterable[int]) -> Region:
        """Every element of a contiguous tensor of `shape`."""
        sizes = tuple(int(s) for s in shape)
        return cls(0, sizes, contiguous_strides(sizes))

    @classmethod
    def from_json(cls, value: Any) -> Region:
        """The region of `to_json` (raises `ValueError` for anything else)."""
        if not (isinstance(value, list) and len(value) == 3):
            raise ValueError(f"not a region: {value!r}")
        offset, sizes, strides = value
        if not (isinstance(offset, int) and isinstance(sizes, list) and isinstance(strides, list)):
            raise ValueError(f"not a region: {value!r}")
        if len(sizes) != len(strides) or not all(isinstance(x, int) for x in sizes + strides):
            raise ValueError(f"not a region: {value!r}")
        return cls(offset, tuple(sizes), tuple(strides))

    def to_json(self) -> list[Any]:
        """`[offset, sizes, strides]`."""
        return [self.offset, list(self.sizes), list(self.strides)]

    @property
    def numel(self) -> int:
        """Elements in the region."""
        return math.prod(self.sizes)

    def span(self) -> tuple[int, int] | None:
        """`(start, count)` when the region is the elements `start .. start + count` in order
        (a contiguous slice), else None."""
        expected = 1
        for size, stride in zip(reversed(self.sizes), reversed(self.strides), strict=True):
            if size != 1 and stride != expected:
                return None
            expected *= size
        return self.offset, self.numel

    def nested(self) -> bool:
        """Whether no two elements share an offset and each element's index can be read back
        from its offset: taking the dimensions by increasing stride, each stride exceeds the
        span of those before it (true of every view a slice, step, narrow, transpose or
        reshape of a contiguous tensor makes)."""
        dims = sorted((st, sz) for sz, st in zip(self.sizes, self.strides, strict=True) if sz != 1)
        extent = 0
        for stride, size in dims:
            if stride <= extent:
                return False
            extent += stride * (size - 1)
        return self.offset >= 0

    def locate(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For flat element positions of the tensor (int64): which lie in the region (a mask)
        and, for those, their index within the region in row-major order (int64)."""
        span = self.span()
        if span is not None:
            start, count = span
            inside = (flat >= start) & (flat < start + count)
            return inside, flat[inside] - start
        order = sorted(range(len(self.sizes)), key=lambda d: self.strides[d], reverse=True)
        rest = flat - self.offset
        inside = rest >= 0
        index = np.zeros_like(flat)
        row_major = contiguous_strides(self.sizes)
        for d in order:
            if self.sizes[d] == 1:
                continue
            step = rest // self.strides[d]
            rest = rest - step * self.strides[d]
            inside &= (step >= 0) & (step < self.sizes[d])
            index += step * row_major[d]
        inside &= rest == 0
        return inside, index[inside]

    def element_offsets(self, first: int, count: int) -> np.ndarray:
        """Flat offsets of the region's elements `first .. first + count` (row-major order)."""
        return self.offsets_of(np.arange(first, first + count, dtype=np.int64))

    def select(self, flat: np.ndarray) -> tuple[slice | np.ndarray, np.ndarray]:
        """`locate` for ascending positions: which lie in the region (for a contiguous region a
        slice, so that what lies inside is taken without a copy) and their row-major index in
        it."""
        span = self.span()
        if span is None:
            return self.locate(flat)
        start, count = span
        lo, hi = (int(i) for i in np.searchsorted(flat, (start, start + count)))
        inside = flat[lo:hi]
        return slice(lo, hi), inside - start if start else inside

    def offsets_of(self, index: np.ndarray) -> np.ndarray:
        """Flat offsets of the region's elements with row-major indices `index` (int64)."""
        span = self.span()
        if span is not None:
            return index + span[0]
        at = index.copy()
        out = np.full(index.shape, self.offset, dtype=np.int64)
        for size, stride in zip(reversed(self.sizes), reversed(self.strides), strict=True):
            out += (at % size) * stride
            at //= size
        return out


def contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of `sizes`."""
    strides = []
    step = 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def span_partial(adler: int, start: int, length: int, total: int) -> tuple[int, int]:
    """Partial sums (a, b) of the bytes `start .. start + length` of a `total`-byte buffer,
    from their own adler32 (which zlib computes fast)."""
    s1 = (adler & 0xFFFF) - 1
    s2 = (adler >> 16) - length
    return s1 % MOD, (s2 + (total - start - length) * s1) % MOD


def bytes_partial(data: Any, start: int, total: int) -> tuple[int, int]:
    """Partial sums of contiguous `data` (bytes-like) lying at byte `start` of `total` bytes."""
    view = memoryview(data).cast("B")
    return span_partial(zlib.adler32(view), start, len(view), total)


def rows_partial(rows: np.ndarray, starts: np.ndarray, total: int) -> tuple[int, int]:
    """Partial sums of byte rows (uint8, one row per run of contiguous bytes) lying at byte
    offsets `starts` of a `total`-byte buffer."""
    length = rows.shape[1]
    wide = rows.astype(np.int64)
    sums = wide.sum(axis=1)
    # Byte j of a row weighs (total - start - j): the row's part is w * sum - sum(j * byte).
    tails = wide @ np.arange(length, dtype=np.int64)
    weight = (total - starts) % MOD
    a = int(sums.sum()) % MOD
    b = (int((weight * (sums % MOD)).sum() % MOD) - int(tails.sum())) % MOD
    return a, b


#: The sum of the two bytes of every 16-bit value (a table gather is one pass over the values).
_BYTE_SUMS = ((np.arange(1 << 16) & 0xFF) + (np.arange(1 << 16) >> 8)).astype(np.int32)


def delta_partial(
    positions: np.ndarray, old: np.ndarray, new: np.ndarray, total: int
) -> tuple[int, int]:
    """How replacing elements at `positions` (int64) moves the partial sums of a
    `total`-byte tensor: `old` and `new` are the elements' bit patterns (one unsigned width)."""
    k = int(positions.size)
    if k == 0:
        return 0, 0
    width = old.dtype.itemsize
    # Byte j of element e lies at e*width + j and weighs (total - e*width - j) in B, so the
    # element moves B by (total - e*width) * sum_j d_j - sum_j j * d_j, with d_j the change of
    # its byte j (little-endian). `per` is sum_j d_j per element, within +-255 * width.
    if width % 2:
        per, tail = _byte_changes(old, new, k, width)
    else:
        per, tail = _half_changes(old, new, k, width)
    moved = int(per.sum(dtype=np.int64))
    # Positions times `per` fit in int64 unless the tensor is huge; then reduce them first.
    fits = int(positions.max()) * 255 * width * k < 2**62
    weights = positions if fits else positions % MOD
    weighted = int(np.dot(weights, per.astype(np.int64)))
    return moved % MOD, ((total % MOD) * moved - width * weighted - tail) % MOD


def _half_changes(old: np.ndarray, new: np.ndarray, k: int, width: int) -> tuple[np.ndarray, int]:
    """`per` and sum_j j * d_j for an even width, 16 bits at a time: half h holds bytes 2h and
    2h + 1, so it adds 2h * (its byte sum's change) + (its high byte's change) to the tail."""
    halves = width // 2
    old16 = np.ascontiguousarray(old).view(np.uint16).reshape(k, halves)
    new16 = np.ascontiguousarray(new).view(np.uint16).reshape(k, halves)
    per = np.zeros(k, dtype=np.int32)
    tail = 0
    for h in range(halves):
        o, n = old16[:, h], new16[:, h]
        d = _BYTE_SUMS[n]
        d -= _BYTE_SUMS[o]
        per += d
        high = int((n >> 8).sum(dtype=np.int64)) - int((o >> 8).sum(dtype=np.int64))
        tail += 2 * h * int(d.sum(dtype=np.int64)) + high
    return per, tail


def _byte_changes(old: np.ndarray, new: np.ndarray, k: int, width: int) -> tuple[np.ndarray, int]:
    """`per` and sum_j j * d_j a byte column at a time (odd widths: one-byte dtypes)."""
    old_b = np.ascontiguousarray(old).view(np.uint8).reshape(k, width)
    new_b = np.ascontiguousarray(new).view(np.uint8).reshape(k, width)
    per = np.zeros(k, dtype=np.int32)
    tail = 0
    for j in range(width):
        d = new_b[:, j].astype(np.int32)
        d -= old_b[:, j]
        per += d
        if j:
            tail += j * int(d.sum(dtype=np.int64))
    return per, tail


def combine(total: int, parts: Iterable[tuple[int, int]]) -> int:
    """The adler32 of a `total`-byte buffer from the partial sums of all its bytes."""
    a = b = 0
    for pa, pb in parts:
        a += pa
        b += pb
    return ((1 + a) % MOD) | (((total + b) % MOD) << 16)


def shift(adler: int, parts: Iterable[tuple[int, int]]) -> int:
    """`adler` moved by partial-sum changes (what a sparse edit does to a checksum)."""
    a, b = adler & 0xFFFF, adler >> 16
    for da, db in parts:
        a += da
        b += db
    return (a % MOD) | ((b % MOD) << 16)


@dataclass(frozen=True)
class RegionSum:
    """Partial sums (a, b) of one region of checkpoint tensor `tensor`, as an engine holds it."""

    tensor: str
    region: Region
    a: int
    b: int

    def to_json(self) -> dict[str, Any]:
        """`{"tensor", "region", "a", "b"}`."""
        return {"tensor": self.tensor, "region": self.region.to_json(), "a": self.a, "b": self.b}

    @classmethod
    def from_json(cls, value: Any) -> RegionSum:
        """The `RegionSum` of `to_json` (raises `ValueError` for anything else)."""
        if not isinstance(value, dict) or not isinstance(value.get("tensor"), str):
            raise ValueError(f"not a region sum: {value!r}")
        a, b = value.get("a"), value.get("b")
        if not isinstance(a, int) or not isinstance(b, int):
            raise ValueError(f"not a region sum: {value!r}")
        return cls(value["tensor"], Region.from_json(value.get("region")), a, b)


def distinct_regions(sums: Iterable[RegionSum]) -> dict[str, dict[Region, tuple[int, int]]]:
    """Per tensor, each region once: a replicated region (the same on several ranks) must carry
    the same sums everywhere, else the replicas differ (`PatchError` parent_mismatch)."""
    out: dict[str, dict[Region, tuple[int, int]]] = {}
    for s in sums:
        regions = out.setdefault(s.tensor, {})
        seen = regions.setdefault(s.region, (s.a, s.b))
        if seen != (s.a, s.b):
            raise PatchError(
                "two replicas of the same part of this tensor hold different values",
                reason="parent_mismatch",
                tensor=s.tensor,
            )
    return out


def combine_regions(sums: Iterable[RegionSum], sizes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """adler32 per checkpoint tensor from the region sums of every rank; `sizes` gives each
    tensor's (elements, bytes). Tensors no region covers are left out; a tensor covered only in
    part is a `PatchError` (weights_mismatch)."""
    out: dict[str, int] = {}
    for tensor, regions in distinct_regions(sums).items():
        numel, nbytes = sizes[tensor]
        covered = sum(r.numel for r in regions)
        if covered != numel:
            raise PatchError(
                f"the engine holds {covered} of its {numel} elements",
                reason="weights_mismatch",
                tensor=tensor,
            )
        out[tensor] = combine(nbytes, regions.values())
    return out
