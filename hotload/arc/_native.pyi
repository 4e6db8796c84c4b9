"""Types of the decoder's optional C kernel (hotload/arc/_native.c)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def sparse_patch(
    old: Buffer,
    out: Buffer | int,
    width: int,
    planes: Sequence[Buffer],
    bits: Sequence[int],
    count: int,
    shift: int,
    quotient_planes: int,
    value_planes: int,
    offset: int = 0,
    /,
) -> tuple[int, int]:
    """Rebuild a chunk from `old` and a sparse run into `out` (a buffer, or a file descriptor
    receiving only the changed elements at `offset` plus their position); return (da, db)."""

def sparse_changes(
    positions: Buffer,
    values: Buffer,
    m: int,
    first: int,
    width: int,
    planes: Sequence[Buffer],
    bits: Sequence[int],
    count: int,
    shift: int,
    quotient_planes: int,
    value_planes: int,
    /,
) -> None:
    """Decode a sparse run of a chunk of `m` elements without its parent: `first` plus each
    changed position into `positions` (int64), each wrapping difference into `values`."""
