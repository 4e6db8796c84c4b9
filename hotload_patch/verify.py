"""Whether a staged patch may be written: the engine holds its parent, and it gives the delta's
result (torch-free, so the loader verifies a tensor-parallel engine's ranks with it too)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hotload_patch.errors import PatchError
from hotload_patch.format import PatchTensor, format_checksum
from hotload_patch.sums import RegionSum, combine_regions, distinct_regions, shift


@dataclass(frozen=True)
class TensorCheck:
    """What the delta promises of one checkpoint tensor: size, parent and result checksums."""

    numel: int
    nbytes: int
    base: int
    target: int


def checks_of(tensors: list[PatchTensor]) -> dict[str, TensorCheck]:
    """The checksum promises of a patch's tensors, by name."""
    return {t.name: TensorCheck(t.numel, t.nbytes, t.base_checksum, t.checksum) for t in tensors}


def verify(
    checks: Mapping[str, TensorCheck], served: list[RegionSum], deltas: list[RegionSum]
) -> None:
    """Check, over every rank's results, that the engine holds the patch's parent and that the
    patch gives the delta's result; raises `PatchError` (parent_mismatch, checksum_mismatch)."""
    sizes = {n: (c.numel, c.nbytes) for n, c in checks.items()}
    held = combine_regions([s for s in served if s.tensor in sizes], sizes)
    for name, check in checks.items():
        if name not in held:
            if any(d.tensor == name for d in deltas):
                raise PatchError(
                    "the engine has no checksum of the weights it serves here",
                    reason="parent_mismatch",
                    tensor=name,
                )
            continue
        if held[name] != check.base:
            raise PatchError(
                f"the served weights have checksum {format_checksum(held[name])}, the patch's "
                f"parent {format_checksum(check.base)}: the engine does not hold the parent",
                reason="parent_mismatch",
                tensor=name,
            )
    moved = distinct_regions(deltas)
    for name, check in checks.items():
        # A tensor the patch does not change must keep its checksum (staging skips it).
        if name in held and name not in moved and check.base != check.target:
            raise PatchError(
                f"the patch changes nothing here, the delta promises checksum "
                f"{format_checksum(check.target)} after {format_checksum(check.base)}: the "
                "patch is corrupted",
                reason="checksum_mismatch",
                tensor=name,
            )
    for name, regions in moved.items():
        predicted = shift(held[name], regions.values())
        if predicted != checks[name].target:
            raise PatchError(
                f"the patch's changes would give checksum {format_checksum(predicted)}, the "
                f"delta promises {format_checksum(checks[name].target)}: the patch is corrupted",
                reason="checksum_mismatch",
                tensor=name,
            )
