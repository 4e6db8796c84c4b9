"""What the loader says when the ranks' region sums do not make up a tensor
(`hotload_patch.sums.distinct_regions`, `combine_regions`): part of `make mutate`'s `patch-sums`
selection (tests/README.md "Mutation testing"). The sums are made here from the bytes by
adler32's definition, not by the code under test.
"""

from __future__ import annotations

import zlib

import pytest

from hotload_patch import PatchError
from hotload_patch.sums import MOD, Region, RegionSum, combine_regions, distinct_regions

DATA = bytes(range(40, 52))  # tensor "t": 12 one-byte elements, held in two halves


def _half(data: bytes, start: int) -> RegionSum:
    piece = data[start : start + 6]
    a = sum(piece) % MOD
    b = sum((len(data) - start - i) * byte for i, byte in enumerate(piece)) % MOD
    return RegionSum("t", Region(start, (6,), (1,)), a, b)


def test_two_halves_make_the_tensors_adler32_and_a_replica_counts_once() -> None:
    halves = [_half(DATA, 0), _half(DATA, 6)]
    assert combine_regions(halves, {"t": (12, 12)}) == {"t": zlib.adler32(DATA)}
    replicated = [*halves, _half(DATA, 6)]
    assert distinct_regions(replicated) == {
        "t": {s.region: (s.a, s.b) for s in halves},
    }
    assert combine_regions(replicated, {"t": (12, 12)}) == {"t": zlib.adler32(DATA)}


def test_replicas_that_differ_say_so() -> None:
    other = bytes([0]) + DATA[1:]
    with pytest.raises(PatchError) as exc:
        distinct_regions([_half(DATA, 0), _half(DATA, 6), _half(other, 0)])
    assert (exc.value.reason, exc.value.tensor) == ("parent_mismatch", "t")
    assert exc.value.message == (
        "two replicas of the same part of this tensor hold different values"
    )


def test_a_tensor_held_in_part_says_how_much_is_held() -> None:
    with pytest.raises(PatchError) as exc:
        combine_regions([_half(DATA, 6)], {"t": (12, 12)})
    assert (exc.value.reason, exc.value.tensor) == ("weights_mismatch", "t")
    assert exc.value.message == "the engine holds 6 of its 12 elements"
