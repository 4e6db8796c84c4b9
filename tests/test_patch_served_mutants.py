"""What the served weights' checksums refuse and count (`hotload_patch.served`): part of
`make mutate`'s `patch-served` selection (tests/README.md "Mutation testing")."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hotload_patch import PatchError, served
from hotload_patch.placement import Slot
from hotload_patch.served import (
    Counters,
    Meter,
    _narrowed,
    device_partial,
    held_dtype,
    region_partial,
)
from hotload_patch.sums import Region
from support.adler import by_definition

SLOT = Slot("model.w", "layers.0.w", Region.whole((2, 3)), Region.whole((2, 3)))


def test_a_dtype_that_cannot_give_back_the_checkpoints_bits_is_refused_naming_the_tensor() -> None:
    with pytest.raises(PatchError) as exc:
        held_dtype(SLOT, torch.zeros(2, 3, dtype=torch.float16), "BF16")
    assert (exc.value.reason, exc.value.tensor) == ("weights_mismatch", "model.w")
    assert exc.value.message == (
        "is held as torch.float16 in layers.0.w, which cannot give back the checkpoint's BF16 "
        "bits: its parent cannot be verified"
    )
    held_dtype(SLOT, torch.zeros(2, 3, dtype=torch.float32), "BF16")  # an exact widening


def test_a_parameter_not_contiguous_is_refused_naming_it() -> None:
    with pytest.raises(PatchError) as exc:
        held_dtype(SLOT, torch.zeros(3, 2, dtype=torch.bfloat16).t(), "BF16")
    assert (exc.value.reason, exc.value.tensor) == ("weights_mismatch", "model.w")
    assert exc.value.message == "layers.0.w is not contiguous in the engine"


def test_widened_values_the_checkpoint_cannot_hold_are_a_parent_mismatch() -> None:
    held = torch.tensor([1.0, 1.0 + 2.0**-20])  # the second is no bfloat16
    with pytest.raises(PatchError) as exc:
        _narrowed(held, "BF16")
    assert exc.value.reason == "parent_mismatch"
    assert exc.value.message == (
        "holds torch.float32 values that BF16 cannot represent: they changed since they were "
        "loaded or patched"
    )


def test_counters_add_up_and_read_back_by_name() -> None:
    counters = Counters()
    counters.add(checksum_bytes=1, scrub_bytes=2, host_bytes=3)
    counters.add(patched_elements=4, patched_bytes=5, patches=6, host_bytes=10)
    assert counters.to_json() == {
        "checksum_bytes": 1,
        "scrub_bytes": 2,
        "host_bytes": 13,
        "patched_elements": 4,
        "patched_bytes": 5,
        "patches": 6,
    }


#: A 4 x 5 x 6 bfloat16 checkpoint tensor, no two elements alike, both bytes of each varied.
SHAPE = (4, 5, 6)
WEIGHT = ((torch.arange(120) * 263 + 7) % 32768).to(torch.int16).view(torch.bfloat16).reshape(SHAPE)
AT = torch.arange(120).reshape(SHAPE)
RAW = WEIGHT.contiguous().view(torch.uint8).reshape(-1).numpy()


def _strided_regions() -> dict[str, tuple[torch.Tensor, Region, torch.Tensor]]:
    """Held views that are no contiguous run of the checkpoint: each with its region (offset,
    sizes, strides in checkpoint elements, written from the slice) and its elements' indices."""
    flat = WEIGHT.reshape(20, 6)
    return {
        # A transposed tensor: its last stride is 6, each element a run of its own.
        "transposed": (flat.t(), Region(0, (6, 20), (1, 6)), AT.reshape(20, 6).t()),
        # Three dimensions whose middle size (3) does not divide the last (4): runs of 4.
        "three-dims": (WEIGHT[:, 1:4, 1:5], Region(7, (4, 3, 4), (30, 6, 1)), AT[:, 1:4, 1:5]),
        # A column shard: runs of 3 elements, one per row.
        "columns": (flat[:, 2:5], Region(2, (20, 3), (6, 1)), AT.reshape(20, 6)[:, 2:5]),
    }


def _reads(
    read: Callable[..., tuple[int, int]], view: torch.Tensor, region: Region, meter: Meter
) -> tuple[tuple[int, int], list[int]]:
    """The sums `read` gives for `view` and the bytes of each chunk it reported, in order."""
    paces: list[int] = []
    meter.pace = paces.append
    sums = read(view, region, "BF16", RAW.size, meter)
    return sums, paces


@pytest.mark.parametrize("case", ["transposed", "three-dims", "columns"])
@pytest.mark.parametrize("chunk", [1, 5, 13, 1000])
def test_a_strided_region_read_on_the_cpu_sums_as_adler32_and_counts_its_bytes(
    case: str, chunk: int
) -> None:
    """In any chunking, a region that is no contiguous run gives adler32's partial sums of its
    bytes and counts each byte once."""
    view, region, elements = _strided_regions()[case]
    want = by_definition(RAW, elements, 2)
    counters = Counters()
    sums, paces = _reads(
        region_partial, view, region, Meter(counters=counters, chunk_elements=chunk)
    )
    assert sums == want
    assert sum(paces) == counters.checksum_bytes == elements.numel() * 2
    assert counters.host_bytes == 0  # read where it lies: nothing copied back from a device
    if chunk < elements.numel():
        assert len(paces) > 1  # read in several chunks


@pytest.mark.parametrize("case", ["transposed", "three-dims", "columns"])
@pytest.mark.parametrize("chunk_bytes", [1, 10, 26, 1 << 20])
def test_a_strided_region_read_on_its_device_sums_as_adler32_and_counts_16_bytes_a_chunk(
    case: str, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device path (run here on the CPU) gives the same sums, and brings back two int64 sums
    (16 bytes) per chunk it reads."""
    monkeypatch.setattr(served, "DEVICE_CHUNK_BYTES", chunk_bytes)
    view, region, elements = _strided_regions()[case]
    counters = Counters()
    sums, paces = _reads(device_partial, view, region, Meter(counters=counters))
    assert sums == by_definition(RAW, elements, 2)
    assert sum(paces) == counters.checksum_bytes == elements.numel() * 2
    assert counters.host_bytes == 16 * len(paces)
    if chunk_bytes < elements.numel() * 2:
        assert len(paces) > 1


def test_a_contiguous_region_on_its_device_counts_16_bytes_a_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slice that is one run of the checkpoint, read on its device in chunks."""
    monkeypatch.setattr(served, "DEVICE_CHUNK_BYTES", 14)
    view, region, elements = WEIGHT[1:3], Region(30, (2, 5, 6), (30, 6, 1)), AT[1:3]
    counters = Counters()
    sums, paces = _reads(device_partial, view, region, Meter(counters=counters))
    assert sums == by_definition(RAW, elements, 2)
    assert sum(paces) == counters.checksum_bytes == 120
    assert len(paces) > 1 and counters.host_bytes == 16 * len(paces)
