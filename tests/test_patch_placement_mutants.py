"""Where a checkpoint tensor lies among an engine's parameters (`hotload_patch.placement`), on
tiny in-process models whose loaders are written here: part of `make mutate`'s
`patch-placement` selection (tests/README.md "Mutation testing").

Each expected `Slot` is worked out from the loader's own slicing (offsets and strides of the
row-major checkpoint tensor and parameter), never from the code under test.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, Mapping

import pytest
import torch
from torch import nn

from hotload_patch import PatchError
from hotload_patch.placement import IdentityHost, LoaderHost, Slot
from hotload_patch.sums import Region
from support.patch_models import ScriptedModel, bits, same_bits

# --- IdentityHost ---------------------------------------------------------------------------


def test_a_converted_tensor_of_another_shape_is_a_weights_mismatch_naming_it() -> None:
    """A tensor the engine stacks into a parameter (`converted`) but the patch gives another
    shape: refused as a weights mismatch naming the tensor, not placed."""
    expert = Slot("experts.1.w", "experts.w", Region.whole((2, 3)), Region(6, (2, 3), (3, 1)))
    host = IdentityHost(
        lambda: {"experts.w": torch.zeros(2, 2, 3)}, lambda: {expert.tensor: [expert]}
    )
    assert host.place("experts.1.w", (2, 3), "F32") == [expert]
    with pytest.raises(PatchError) as exc:
        host.place("experts.1.w", (3, 2), "F32")
    assert (exc.value.reason, exc.value.tensor) == ("weights_mismatch", "experts.1.w")
    assert exc.value.message == "shape [3, 2] does not match the served checkpoint's"


class _CountedTargets(Mapping[str, torch.Tensor]):
    """The engine's tensors by name, counting the scans of all of them (`items()`)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self._tensors = tensors
        self.scans = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def items(self) -> ItemsView[str, torch.Tensor]:
        self.scans += 1
        return super().items()


def test_tied_names_are_found_from_one_scan_of_the_engines_tensors() -> None:
    """Tied names write their first name's parameter, and the map of owners is built once for
    a model's many tensors, not by a scan of every tensor per tensor."""
    shared = torch.zeros(4, 2)
    targets = _CountedTargets(embed=shared, norm=torch.zeros(2), lm_head=shared)
    host = IdentityHost(lambda: targets)
    whole, norm = Region.whole((4, 2)), Region.whole((2,))
    for _ in range(3):
        assert host.place("lm_head", (4, 2), "BF16") == [Slot("lm_head", "embed", whole, whole)]
        assert host.place("embed", (4, 2), "BF16") == [Slot("embed", "embed", whole, whole)]
        assert host.place("norm", (2,), "BF16") == [Slot("norm", "norm", norm, norm)]
    assert targets.scans == 1


# --- LoaderHost -----------------------------------------------------------------------------


def _unmappable(model: nn.Module, shape: tuple[int, ...], dtype: str = "F32") -> str:
    """Probing checkpoint tensor "w" of `shape` and `dtype` is refused as unmappable, naming
    the tensor: the error's message."""
    with pytest.raises(PatchError) as exc:
        LoaderHost(model).place("w", shape, dtype)
    assert (exc.value.reason, exc.value.tensor) == ("unmappable", "w")
    return exc.value.message


def _bfloat16_only(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if loaded.dtype != torch.bfloat16:
        raise TypeError(f"this loader takes bfloat16 checkpoints, not {loaded.dtype}")
    param.data.copy_(loaded)


def test_the_probe_has_the_checkpoints_dtype() -> None:
    """A loader that reads the checkpoint tensor's dtype sees the checkpoint's: a BF16 tensor
    is placed, an F32 one is what the loader refuses."""
    model = ScriptedModel((6, 4), _bfloat16_only, dtype=torch.bfloat16)
    whole = Region.whole((6, 4))
    assert LoaderHost(model).place("w", (6, 4), "BF16") == [Slot("w", "weight", whole, whole)]
    assert _unmappable(model, (6, 4)) == (
        "its loader failed on a probe: TypeError: "
        "this loader takes bfloat16 checkpoints, not torch.float32"
    )


def _chunk_by_keyword(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded.chunk(3, dim=1)[1])


def _narrow_by_keywords_only(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(torch.narrow(input=loaded, dim=1, start=2, length=2))


@pytest.mark.parametrize("loader", [_chunk_by_keyword, _narrow_by_keywords_only])
def test_keyword_arguments_reach_the_loaders_torch_calls(
    loader: Callable[[nn.Parameter, torch.Tensor], None],
) -> None:
    """`chunk(3, dim=1)` and `torch.narrow(input=..., dim=1, ...)` (keywords only) take columns
    2..3 of a 4x6 checkpoint tensor into the 4x2 parameter, as a real load does."""
    model = ScriptedModel((4, 2), loader)
    expected = Slot("w", "weight", Region(2, (4, 2), (6, 1)), Region(0, (4, 2), (2, 1)))
    assert LoaderHost(model).place("w", (4, 6), "F32") == [expected]
    real = torch.randn(4, 6)
    model.load_weights([("w", real)])
    assert same_bits(model.weight.data, real[:, 2:4].contiguous())


def _computed_twice_then_scaled(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded * 2)
    param.data.copy_(loaded * 2)
    param.data.mul_(2)


def test_each_problem_of_a_loader_is_named_once_in_order() -> None:
    model = ScriptedModel((6, 4), _computed_twice_then_scaled)
    assert _unmappable(model, (6, 4)) == (
        "its loader writes values computed from the checkpoint into weight; "
        "its loader modifies a parameter with mul_"
    )


def _expanded_row(param: nn.Parameter, loaded: torch.Tensor) -> None:
    # Three rows of the checkpoint written over one row of the parameter: the last one wins.
    param.data[:1].expand(3, 4).copy_(loaded)


def test_a_write_through_an_overlapping_view_is_unmappable_naming_the_parameter() -> None:
    model = ScriptedModel((6, 4), _expanded_row)
    before = bits(model.weight).clone()
    assert _unmappable(model, (3, 4)) == "its loader writes weight through an overlapping view"
    assert torch.equal(bits(model.weight), before)


def _scaled_in_place(param: nn.Parameter, loaded: torch.Tensor) -> None:
    loaded.mul_(2)  # e.g. a loader folding a scale into the weight it was handed
    param.data.copy_(loaded)


def _zeroed_row_in_place(param: nn.Parameter, loaded: torch.Tensor) -> None:
    loaded[0] = 0  # e.g. a loader masking a row of the weight it was handed
    param.data.copy_(loaded)


@pytest.mark.parametrize("loader", [_scaled_in_place, _zeroed_row_in_place])
def test_a_loader_that_changes_the_checkpoint_tensor_in_place_is_unmappable(
    loader: Callable[[nn.Parameter, torch.Tensor], None],
) -> None:
    """Found by reading a placement mutant: such a loader was placed as a plain copy, and a patch
    would have written the checkpoint's values where the engine holds computed ones."""
    model = ScriptedModel((6, 4), loader)
    real = torch.ones(6, 4)
    model.load_weights([("w", real.clone())])
    assert not torch.equal(model.weight.data, real)  # the engine holds values computed from it
    with pytest.raises(PatchError) as exc:
        LoaderHost(model).place("w", (6, 4), "F32")
    assert exc.value.reason == "unmappable"
    assert "modifies the checkpoint tensor" in str(exc.value)


def _scaled_in_place_and_copied(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded.mul_(2))  # uses what the in-place op returns, as torch gives it


def test_an_in_place_change_whose_result_the_loader_uses_is_named_alone() -> None:
    """The probe hands back the tensor an in-place op returns, so the loader runs on and its one
    problem is named, not a failure of its own next call."""
    model = ScriptedModel((6, 4), _scaled_in_place_and_copied)
    assert _unmappable(model, (6, 4)) == "its loader modifies the checkpoint tensor with mul_"


def _through_a_scratch_tensor(param: nn.Parameter, loaded: torch.Tensor) -> None:
    scratch = torch.empty(6, 4)
    scratch.copy_(loaded)
    param.data.copy_(scratch)


def test_a_copy_into_a_tensor_that_is_no_parameter_is_not_a_placement() -> None:
    """A loader that copies the checkpoint into a scratch tensor of its own first: the copy is
    not where the engine holds a weight, and the probe (a meta tensor, no data) cannot follow the
    values through it."""
    model = ScriptedModel((6, 4), _through_a_scratch_tensor)
    assert _unmappable(model, (6, 4)).startswith(
        "its loader failed on a probe: NotImplementedError"
    )


def _rows_by_a_list(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data[[0, 2]] = loaded


def test_a_write_through_advanced_indexing_is_unmappable_naming_the_parameter() -> None:
    model = ScriptedModel((6, 4), _rows_by_a_list)
    assert _unmappable(model, (2, 4)) == "its loader writes weight through advanced indexing"
