"""Where a checkpoint tensor lives among an engine's parameters: its `Slot`s.

An engine may hold a checkpoint tensor whole (the reference engine: `IdentityHost`), or as a
slice of a fused parameter (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`), as one
tensor-parallel shard, or padded (a vocabulary rounded up). `LoaderHost` learns the layout from
the engine's own loader instead of re-implementing it: it runs the model's `load_weights` on a
*probe*, a meta-device tensor of the checkpoint tensor's shape and dtype, under a torch function
mode that records every `copy_` from a view of the probe into a view of a parameter (which
elements of the checkpoint go to which elements of the parameter) and performs none of them.
Loaders that compute new values from the checkpoint (a transpose into a new tensor, a
quantisation, a repacking) cannot be followed and make the tensor `unmappable`: those engines
take the full reload.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from hotload_patch.dtypes import torch_dtype
from hotload_patch.errors import PatchError
from hotload_patch.sums import Region


@dataclass(frozen=True)
class Slot:
    """Elements `src` of checkpoint tensor `tensor` are held as elements `dst` of parameter
    `param` (both regions list the same elements in the same row-major order)."""

    tensor: str
    param: str
    src: Region
    dst: Region


class Host(Protocol):
    """What an engine offers a patch: its live parameters, and where a checkpoint tensor goes."""

    def parameters(self) -> Mapping[str, torch.Tensor]:
        """The engine's parameters by name, as they serve now."""

    def place(self, name: str, shape: tuple[int, ...], dtype: str) -> list[Slot]:
        """Where checkpoint tensor `name` lives ([] when the engine does not load it); raises
        `PatchError` (unmappable, weights_mismatch) when no patch can follow it."""

    def problems(self) -> list[str]:
        """Why this engine cannot take patches at all (quantised or repacked weights), or []."""


class IdentityHost:
    """An engine whose parameters are the checkpoint's tensors under the same names, whole
    (tied names share one tensor; the first name of each stands for it), except the tensors
    `converted` places as regions of a parameter (a transformers mixture of experts stacks its
    per-expert checkpoint tensors into one parameter)."""

    def __init__(
        self,
        targets: Callable[[], Mapping[str, torch.Tensor]],
        converted: Callable[[], Mapping[str, list[Slot]]] | None = None,
    ) -> None:
        self._targets = targets
        self._converted = converted or (lambda: {})
        #: The first name of each held tensor (tied weights share one), by the tensor's id.
        self._owners: dict[int, str] = {}

    def parameters(self) -> Mapping[str, torch.Tensor]:
        """The targets by name."""
        return self._targets()

    def place(self, name: str, shape: tuple[int, ...], dtype: str) -> list[Slot]:
        """The whole tensor, when the engine holds one of that name and shape; its regions, when
        the engine holds it converted."""
        targets = self._targets()
        slots = self._converted().get(name)
        if slots is not None:
            if any(s.src != Region.whole(shape) for s in slots):
                raise PatchError(
                    f"shape {list(shape)} does not match the served checkpoint's",
                    reason="weights_mismatch",
                    tensor=name,
                )
            return list(slots)
        held = targets.get(name)
        if held is None:
            raise PatchError(
                "the served model has no such weight", reason="weights_mismatch", tensor=name
            )
        if tuple(held.shape) != tuple(shape):
            raise PatchError(
                f"shape {list(shape)} does not match the served model's {list(held.shape)}",
                reason="weights_mismatch",
                tensor=name,
            )
        whole = Region.whole(shape)
        return [Slot(name, self._owner(targets, held), whole, whole)]

    def _owner(self, targets: Mapping[str, torch.Tensor], held: torch.Tensor) -> str:
        """The first name under which `targets` holds `held` (its parameter: tied weights
        write one), from a map built once rather than a scan per tensor; rebuilt when the
        engine's tensors changed."""
        owner = self._owners.get(id(held))
        if owner is None or targets.get(owner) is not held:
            self._owners = {}
            for n, t in targets.items():
                self._owners.setdefault(id(t), n)
            owner = self._owners[id(held)]
        return owner

    def problems(self) -> list[str]:
        """None: the reference engine computes with the tensors it loads."""
        return []


class LoaderHost:
    """A model with a vLLM/SGLang-style `load_weights(iterable of (name, tensor))`: slots are
    learned from the model's own loader (see the module docstring) and cached."""

    def __init__(self, model: Any, problems: Callable[[], list[str]] | None = None) -> None:
        self.model = model
        self._problems = problems or (lambda: [])
        self._cache: dict[tuple[str, tuple[int, ...], str], list[Slot]] = {}
        self._lock = threading.Lock()

    def parameters(self) -> Mapping[str, torch.Tensor]:
        """The model's parameters with storage (empty ones hold nothing a patch could change)."""
        return {n: p for n, p in self.model.named_parameters() if p.numel()}

    def problems(self) -> list[str]:
        """What the engine's own check found (repacked or quantised layers)."""
        return self._problems()

    def place(self, name: str, shape: tuple[int, ...], dtype: str) -> list[Slot]:
        """Run the model's loader on a probe of `name` and return where it would write."""
        key = (name, tuple(shape), dtype)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._trace(name, tuple(shape), dtype)
            return self._cache[key]

    def _trace(self, name: str, shape: tuple[int, ...], dtype: str) -> list[Slot]:
        params = self.parameters()
        owners = {p.untyped_storage().data_ptr(): (n, p) for n, p in params.items()}
        probe = torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
        recorder = _Recorder(name, probe, owners)
        try:
            with torch.no_grad(), recorder:
                self.model.load_weights([(name, probe)])
        except PatchError:
            raise
        except Exception as exc:
            recorder.problems.append(f"its loader failed on a probe: {type(exc).__name__}: {exc}")
        if recorder.problems:
            raise PatchError(
                "; ".join(dict.fromkeys(recorder.problems)), reason="unmappable", tensor=name
            )
        return recorder.slots


# Conversions a loader applies to the tensor it was given before copying it: on the probe they
# change nothing that matters (which element goes where), so they hand the probe's view back.
_SAME_ELEMENTS = {
    "to",
    "cuda",
    "cpu",
    "float",
    "half",
    "bfloat16",
    "double",
    "contiguous",
    "clone",
    "detach",
    "type_as",
}
_CONSTANT_FILLS = {"fill_", "zero_"}


class _Recorder(TorchFunctionMode):
    """Records `copy_` from views of `probe` into views of the parameters; performs none."""

    def __init__(
        self, name: str, probe: torch.Tensor, owners: dict[int, tuple[str, torch.Tensor]]
    ) -> None:
        super().__init__()
        self.name = name
        self.probe = probe
        self.owners = owners
        self.slots: list[Slot] = []
        self.problems: list[str] = []

    def _probe_view(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and (t is self.probe or t._base is self.probe)

    def _owner(self, t: object) -> tuple[str, torch.Tensor] | None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        return self.owners.get(t.untyped_storage().data_ptr())

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        op = getattr(func, "__name__", "")
        first = args[0] if args else None
        if op in _SAME_ELEMENTS and self._probe_view(first):
            return first
        if self._probe_view(first) and (
            op == "__setitem__" or (op.endswith("_") and not op.endswith("__"))
        ):
            # The loader changes the checkpoint tensor before it places it (a scale folded in):
            # the engine then holds values computed from the checkpoint, not its elements.
            self.problems.append(f"its loader modifies the checkpoint tensor with {op}")
            return first if op != "__setitem__" else None
        owner = self._owner(first)
        if owner is not None and isinstance(first, torch.Tensor):
            if op == "copy_" and len(args) >= 2:
                self._record(owner, first, args[1])
                return first
            if op == "__setitem__" and len(args) == 3:
                view = first[args[1]]
                if view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                    # Advanced indexing gives a copy: where it writes is not a view's geometry.
                    self.problems.append(f"its loader writes {owner[0]} through advanced indexing")
                else:
                    self._record(owner, view, args[2])
                return None
        if op in _CONSTANT_FILLS and self._owner(first) is not None:
            # Padding (a vocabulary rounded up): constant, the same in every load, so a patch
            # leaves it as it is.
            return first
        if op.endswith("_") and not op.endswith("__") and self._owner(first) is not None:
            self.problems.append(f"its loader modifies a parameter with {op}")
            return first
        return func(*args, **kwargs)

    def _record(self, owner: tuple[str, torch.Tensor], dst: torch.Tensor, src: object) -> None:
        param_name, param = owner
        if not self._probe_view(src):
            self.problems.append(
                f"its loader writes values computed from the checkpoint into {param_name}"
            )
            return
        assert isinstance(src, torch.Tensor)
        if tuple(src.shape) != tuple(dst.shape):
            self.problems.append(
                f"its loader broadcasts {list(src.shape)} into {list(dst.shape)} of {param_name}"
            )
            return
        src_region = Region(int(src.storage_offset()), tuple(src.shape), tuple(src.stride()))
        dst_region = Region(
            int(dst.storage_offset()) - int(param.storage_offset()),
            tuple(dst.shape),
            tuple(dst.stride()),
        )
        if not (src_region.nested() and dst_region.nested()):
            self.problems.append(f"its loader writes {param_name} through an overlapping view")
            return
        self.slots.append(Slot(self.name, param_name, src_region, dst_region))
