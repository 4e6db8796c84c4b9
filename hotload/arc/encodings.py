"""The vocabulary shared by arc_v2's chunk encoder and decoder: the encodings and when each is
tried, where a float's exponent lies (the context of `sparse_exp`), and per-thread buffers.

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

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

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


def hot_order(
    old: np.ndarray, hot: np.ndarray, layout: FloatLayout
) -> tuple[np.ndarray, np.ndarray]:
    """Hot positions in position order, and the permutation that orders them by exponent."""
    members = np.flatnonzero(hot)
    mmask, mbits = old.dtype.type(layout.magnitude_mask), old.dtype.type(layout.mantissa_bits)
    exps = ((old[members] & mmask) >> mbits).astype(np.uint16)
    return members, np.argsort(exps, kind="stable")
