"""NaN and Inf in weights, counted on their bits: a step that diverged must not reach the
fleet by default (`Publisher(allow_nonfinite=...)`), and the check costs one pass over bytes
the publisher writes anyway, with no framework needed (bf16 and fp8 included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hotload.errors import NonFiniteWeightsError
from hotload.snapshot.safetensors_io import RawTensor


@dataclass(frozen=True)
class _Bits:
    """Where a float format keeps its exponent and mantissa."""

    view: type[np.unsignedinteger]
    exponent: int
    mantissa: int
    #: Whether an all-ones exponent with a zero mantissa is Inf (IEEE) rather than a number.
    has_inf: bool = True


_FORMATS = {
    "F64": _Bits(np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F32": _Bits(np.uint32, 0x7F800000, 0x007FFFFF),
    "F16": _Bits(np.uint16, 0x7C00, 0x03FF),
    "BF16": _Bits(np.uint16, 0x7F80, 0x007F),
    "F8_E5M2": _Bits(np.uint8, 0x7C, 0x03),
    # E4M3 (fn) has no Inf and one NaN pattern per sign: every exponent and mantissa bit set.
    "F8_E4M3": _Bits(np.uint8, 0x7F, 0x7F, has_inf=False),
    # E8M0 (the scales of microscaling formats): 0xFF is its NaN.
    "F8_E8M0": _Bits(np.uint8, 0xFF, 0xFF, has_inf=False),
}

#: Elements looked at per pass (bounds the temporary masks to a few tens of megabytes).
_CHUNK = 1 << 23


@dataclass(frozen=True)
class NonFinite:
    """What a tensor holds that is not a finite number."""

    nan: int = 0
    inf: int = 0
    #: Flat index of the first such element (-1: none).
    first: int = -1

    def __bool__(self) -> bool:
        return bool(self.nan or self.inf)


def count_nonfinite(raw: RawTensor) -> NonFinite:
    """The NaN and Inf elements of `raw` (integer and bool tensors hold none)."""
    bits = _FORMATS.get(raw.dtype)
    if bits is None or not raw.nbytes:
        return NonFinite()
    values = raw.data.view(bits.view)
    exponent, mantissa = bits.view(bits.exponent), bits.view(bits.mantissa)
    nan = inf = 0
    first = -1
    for start in range(0, values.size, _CHUNK):
        part = values[start : start + _CHUNK]
        special = (part & exponent) == exponent
        if not special.any():
            continue
        if bits.has_inf:
            nans = special & ((part & mantissa) != 0)
            infs = special & ~nans
        else:
            nans = (part & mantissa) == mantissa
            infs = np.zeros_like(nans)
        bad = nans | infs
        if first < 0 and bad.any():
            first = start + int(np.argmax(bad))
        nan += int(nans.sum())
        inf += int(infs.sum())
    return NonFinite(nan, inf, first)


def check_finite(name: str, raw: RawTensor) -> None:
    """Raise `NonFiniteWeightsError` naming tensor `name` if it holds a NaN or an Inf."""
    found = count_nonfinite(raw)
    if not found:
        return
    elements = raw.nbytes // np.dtype(_FORMATS[raw.dtype].view).itemsize
    raise NonFiniteWeightsError(
        f"holds {found.nan} NaN and {found.inf} Inf value(s) among its {elements} (the first at "
        f"flat index {found.first}): a diverged step? Nothing was published. Publish a step "
        "whose weights are finite, or pass allow_nonfinite=True to publish it anyway",
        field=name,
    )
