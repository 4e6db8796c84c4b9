"""Where a checkpoint tensor lives in the reference engine's transformers model.

Most checkpoint tensors are model parameters under the same name, whole. Since transformers 5,
some families' models hold several checkpoint tensors in one parameter: a mixture of experts
saves one tensor per expert (`mlp.experts.3.gate_proj.weight`) and computes with all experts
stacked (`mlp.experts.gate_up_proj` [experts, 2 * intermediate, hidden]). transformers converts
at load (`from_pretrained`) and back at save (`save_pretrained`) with its conversion mapping;
the engine builds its model without `from_pretrained`, so it follows the same mapping itself.

Rather than copy transformers' per-family rules, `checkpoint_layout` asks transformers which
conversion a checkpoint name takes (`get_model_conversion_mapping`, `rename_source_key`, as
`from_pretrained` does) and interprets the conversion's operations on the positions of the
elements instead of their values: stacking a list (`MergeModulelist`) and concatenating
(`Concatenate`) only move elements, so every checkpoint tensor lands as one strided region of
the parameter (a `Slot`). A full load copies each tensor into its region; a sparse patch writes
the changed elements there (`hotload_patch.placement.IdentityHost`). A conversion that computes
new values cannot be followed: such a checkpoint is refused, naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hotload.errors import SnapshotValidationError, ValidationProblem
from hotload.snapshot import layout as files
from hotload_patch.placement import Slot
from hotload_patch.staging import region_view
from hotload_patch.sums import Region, contiguous_strides

SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,  # block-FP8 weights (`hotload.engine.fp8`)
    "BOOL": torch.bool,
}


class WeightsMismatchError(SnapshotValidationError):
    """The snapshot's tensors do not fit the served model: names, shapes or dtypes differ."""


#: One stacked or concatenated piece: a checkpoint tensor, its shape, and for each dimension of
#: the value it is part of either (its own dimension, offset) or (None, a fixed index).
_Axis = tuple[int | None, int]


@dataclass
class _Value:
    """A converted tensor known by where its elements come from, not by its values."""

    shape: tuple[int, ...]
    pieces: list[tuple[str, tuple[int, ...], list[_Axis]]]


class LayoutError(ValueError):
    """A checkpoint tensor the engine cannot place (`tensor` names it)."""

    def __init__(self, message: str, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


@dataclass
class Layout:
    """The checkpoint tensors transformers converts: where each lands (`converted`, by
    checkpoint name), and which parameters they fill (`fused`, parameter -> the names)."""

    converted: dict[str, list[Slot]] = field(default_factory=dict)
    fused: dict[str, list[str]] = field(default_factory=dict)


def checkpoint_layout(model: Any, shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """Where transformers' conversion mapping puts each checkpoint tensor of `shapes` (name ->
    shape) in `model`; names it does not convert are left out (they load whole, by name).
    Raises `LayoutError` for a conversion the engine cannot follow."""
    transforms = _conversions(model)
    if not transforms:
        return Layout()
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    params = dict(model.state_dict(keep_vars=True))
    # As `from_pretrained` collects them: names in natural order, each converted parameter
    # gathering one list of checkpoint tensors per source pattern.
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    layout = Layout()
    for name in sorted(shapes, key=dot_natural_key):
        if name in params:
            continue  # loaded whole under its own name (a state dict saved as it is)
        target, pattern = rename_source_key(name, renamings, converters)
        if target not in params:
            continue  # the model has no such weight: the load names it
        if pattern is None:  # renamed only (Mixtral's block_sparse_moe is the model's mlp)
            if tuple(params[target].shape) != tuple(shapes[name]):
                continue  # a shape mismatch, which the load names
            whole = Region.whole(shapes[name])
            layout.converted[name] = [Slot(name, target, whole, whole)]
            layout.fused[target] = [name]
            continue
        converter, lists = groups.setdefault(target, (by_pattern[pattern], {}))
        lists.setdefault(pattern, []).append(name)
    for target, (converter, lists) in groups.items():
        value = _interpret(converter, lists, shapes)
        slots = _slots(value, target, tuple(params[target].shape))
        for slot in slots:
            layout.converted.setdefault(slot.tensor, []).append(slot)
        layout.fused[target] = [s.tensor for s in slots]
    return layout


def _conversions(model: Any) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: models hold checkpoint tensors as they are saved
        return []
    return list(get_model_conversion_mapping(model, add_legacy=False))


def _interpret(
    converter: Any, lists: dict[str, list[str]], shapes: Mapping[str, tuple[int, ...]]
) -> _Value:
    """Run `converter`'s operations on element positions (see the module docstring)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    first = next(iter(lists.values()))[0]
    state: dict[str, list[_Value] | _Value] = {
        pattern: [_leaf(n, tuple(shapes[n])) for n in names] for pattern, names in lists.items()
    }
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            state = {
                p: _stack(v if isinstance(v, list) else [v], op.dim, first)
                for p, v in state.items()
            }
        elif isinstance(op, Concatenate):
            parts: list[_Value] = []
            for pattern in converter.source_patterns:
                v = state.get(pattern)
                if v is not None:
                    parts.extend(v if isinstance(v, list) else [v])
            state = {"": _cat(parts, op.dim, first)}
        else:
            raise LayoutError(
                f"transformers converts it with {type(op).__name__}, which computes new values: "
                "the engine cannot place it",
                first,
            )
    values = list(state.values())
    if len(values) != 1 or isinstance(values[0], list):
        raise LayoutError("transformers' conversion leaves more than one tensor", first)
    return values[0]


def _leaf(name: str, shape: tuple[int, ...]) -> _Value:
    return _Value(shape, [(name, shape, [(d, 0) for d in range(len(shape))])])


def _stack(values: list[_Value], dim: int, name: str) -> _Value:
    shape = values[0].shape
    if any(v.shape != shape for v in values):
        raise LayoutError("the tensors stacked with it differ in shape", name)
    d = dim if dim >= 0 else dim + len(shape) + 1
    pieces = [
        (n, s, [*axes[:d], (None, k), *axes[d:]])
        for k, v in enumerate(values)
        for n, s, axes in v.pieces
    ]
    return _Value((*shape[:d], len(values), *shape[d:]), pieces)


def _cat(values: list[_Value], dim: int, name: str) -> _Value:
    shape = values[0].shape
    d = dim if dim >= 0 else dim + len(shape)
    if any(
        len(v.shape) != len(shape) or v.shape[:d] + v.shape[d + 1 :] != shape[:d] + shape[d + 1 :]
        for v in values
    ):
        raise LayoutError("the tensors concatenated with it differ in shape", name)
    pieces = []
    at = 0
    for v in values:
        for n, s, axes in v.pieces:
            src, offset = axes[d]
            pieces.append((n, s, [*axes[:d], (src, offset + at), *axes[d + 1 :]]))
        at += v.shape[d]
    return _Value((*shape[:d], at, *shape[d + 1 :]), pieces)


def _slots(value: _Value, param: str, shape: tuple[int, ...]) -> list[Slot]:
    """Each piece of `value` as a region of parameter `param` (contiguous, of `shape`)."""
    if value.shape != shape:
        name = value.pieces[0][0]
        raise LayoutError(
            f"converts to shape {list(value.shape)}, but the model's {param} is {list(shape)}",
            name,
        )
    strides = contiguous_strides(shape)
    slots = []
    covered = 0
    for name, own, axes in value.pieces:
        offset = sum(off * strides[i] for i, (_, off) in enumerate(axes))
        own_strides = [0] * len(own)
        for i, (src, _) in enumerate(axes):
            if src is not None:
                own_strides[src] = strides[i]
        slots.append(Slot(name, param, Region.whole(own), Region(offset, own, tuple(own_strides))))
        covered += math.prod(own)
    if covered != math.prod(shape):
        raise LayoutError(
            f"its conversion fills {covered} of {param}'s elements", value.pieces[0][0]
        )
    return slots


@dataclass
class Placed:
    """A snapshot's tensors checked against the model: the model name each loads into (tied
    names share one; a converted tensor names its parameter), the names loaded (one per tied
    group; the others are compared), and the converted ones' regions."""

    load_as: dict[str, str]
    primary: set[str]
    layout: Layout


def check_tensors(
    snap: Any,
    model: Any,
    targets: Mapping[str, torch.Tensor],
    groups: list[list[str]],
    base_dtypes: Mapping[str, str] | None,
) -> Placed:
    """Compare snapshot `snap`'s tensor map with the model (`targets` by name, `groups` of tied
    names); raises `WeightsMismatchError` naming every tensor that does not fit."""
    spec_path = str(Path(snap.path) / files.SPEC_FILE)
    try:
        found = checkpoint_layout(model, {n: tuple(s.shape) for n, s in snap.tensor_map.items()})
    except LayoutError as exc:
        raise WeightsMismatchError([ValidationProblem(spec_path, exc.tensor, str(exc))]) from None
    problems: list[ValidationProblem] = []
    names = set(snap.tensor_map) - found.converted.keys()
    for name in sorted(names - set(targets)):
        problems.append(ValidationProblem(spec_path, name, "the served model has no such weight"))
    load_as = {n: slots[0].param for n, slots in found.converted.items()}
    primary: set[str] = set()
    for group in groups:
        present = [n for n in group if n in names]
        pieces = [n for n in group if n in found.fused]
        if present and pieces:
            problems.append(
                ValidationProblem(
                    spec_path, present[0], f"is also given in pieces ({found.fused[pieces[0]][0]})"
                )
            )
        elif not present and not pieces:
            problems.append(
                ValidationProblem(spec_path, group[0], "missing (the served model needs it)")
            )
        if present:
            primary.add(present[0])
            load_as.update((n, group[0]) for n in present)
    for name in sorted(names & set(targets)):
        spec, target = snap.tensor_map[name], targets[name]
        if tuple(spec.shape) != tuple(target.shape):
            problems.append(
                ValidationProblem(
                    spec_path,
                    name,
                    f"shape {list(spec.shape)} does not match the served model's "
                    f"{list(target.shape)}",
                )
            )
    for name in sorted(snap.tensor_map):
        dtype = snap.tensor_map[name].dtype
        if dtype not in SAFETENSORS_TO_TORCH:
            problems.append(ValidationProblem(spec_path, name, f"unsupported dtype {dtype}"))
        elif base_dtypes is not None and dtype != base_dtypes.get(name):
            problems.append(
                ValidationProblem(
                    spec_path,
                    name,
                    f"dtype {dtype} differs from the {base_dtypes.get(name)} the engine started "
                    "with",
                )
            )
    if problems:
        raise WeightsMismatchError(problems)
    return Placed(load_as, primary, found)


def fill_converted(
    tensors: dict[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    slots: list[Slot],
    value: torch.Tensor,
) -> None:
    """Copy checkpoint tensor `value` into its regions of the new parameters in `tensors`
    (each made on first use, shaped as its target)."""
    for slot in slots:
        new = tensors.get(slot.param)
        if new is None:
            shape = targets[slot.param].shape
            new = tensors[slot.param] = torch.empty(shape, dtype=value.dtype, device=value.device)
        region_view(new, slot.dst).copy_(value)
