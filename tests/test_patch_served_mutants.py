"""What the served weights' checksums refuse and count (`hotload_patch.served`): part of
`make mutate`'s `patch-served` selection (tests/README.md "Mutation testing")."""

from __future__ import annotations

import pytest
import torch

from hotload_patch import PatchError
from hotload_patch.placement import Slot
from hotload_patch.served import Counters, _narrowed, held_dtype
from hotload_patch.sums import Region

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
