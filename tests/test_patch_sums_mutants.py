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


@pytest.mark.parametrize(
    ("sizes", "strides"),
    [
        ((2, 3), (3, 1)),  # rows of a contiguous matrix
        ((3, 2), (1, 3)),  # its transpose
        ((2, 3), (4, 1)),  # a column slice: gaps between rows
        ((2, 3), (2, 1)),  # rows of 3 two apart: offset 2 is in both
        ((3, 2), (1, 2)),  # the same, transposed
        ((2, 2), (1, 1)),  # every offset twice
    ],
)
def test_nested_is_whether_no_two_elements_share_an_offset(
    sizes: tuple[int, int], strides: tuple[int, int]
) -> None:
    offsets = [i * strides[0] + j * strides[1] for i in range(sizes[0]) for j in range(sizes[1])]
    assert Region(0, sizes, strides).nested() == (len(set(offsets)) == len(offsets))
