"""LoRA adapters in the reference engine: several at once, chosen per request, base untouched.

An adapter is staged off the worker thread (`stage_adapter`: checksums, pairing, shapes against
the served model's linear layers) and installed at a pause point (`AdapterTable.install`), like
a weight swap. Every linear layer an adapter targets gets a thin wrapper that, after the base
layer, adds `scale * B(A(x))` to the rows of the batch whose request named that adapter; the
rows of each forward pass say which adapter they use through `set_rows`. The base weights are
never modified, so requests without an adapter are unaffected, bit for bit.

Each row's LoRA term is computed on that row alone, so a request's output does not depend on
which other requests share its batch (the engine's exact-numerics promise; see `model`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hotload.errors import SnapshotError

# Which adapter each row of the running forward pass uses (None: the base model). One worker
# thread runs each engine's forward passes, so a thread-local keeps engines in one process apart.
_ROWS = threading.local()

#: safetensors dtype names of LoRA factors -> torch dtypes.
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def set_rows(adapters: Sequence[str | None] | None) -> None:
    """Declare, for the next forward passes on this thread, each batch row's adapter."""
    _ROWS.adapters = list(adapters) if adapters and any(adapters) else None


@dataclass(frozen=True)
class LoraFactors:
    """One target module's LoRA: `A` [r, in], `B` [out, r] in the model's dtype, and the scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class StagedAdapter:
    """An adapter read, verified and shaped for the served model, ready to install."""

    name: str
    path: Path
    base_model: str
    rank: int
    factors: dict[str, LoraFactors]
    nbytes: int
    seconds: float


def stage_adapter(model: nn.Module, name: str, path: str | Path) -> StagedAdapter:
    """Verify the adapter folder `path` and turn it into factors for `model`'s linear layers.

    Raises `SnapshotError` (or `ChecksumMismatchError`) naming the file and tensor when the
    adapter is corrupt, targets a module the model lacks or that is not linear, or has factors
    whose shapes do not fit; nothing is installed either way."""
    from hotload.snapshot.lora import (
        PEFT_PREFIX,
        lora_pairs,
        read_adapter_config,
        read_adapter_tensors,
        verify_adapter,
    )

    started = time.perf_counter()
    root = Path(path)
    if not root.is_dir():
        raise SnapshotError(
            "adapter folder does not exist (or is not visible here)", path=str(root)
        )
    config = read_adapter_config(root)
    verify_adapter(root)
    raws = read_adapter_tensors(root)
    pairs = lora_pairs(raws, str(root))
    param = next(model.parameters())
    factors: dict[str, LoraFactors] = {}
    nbytes = 0
    for module_path, (a_raw, b_raw) in pairs.items():
        target = _linear(model, module_path, str(root))
        rank = a_raw.shape[0]
        if a_raw.shape[1] != target.in_features or b_raw.shape[0] != target.out_features:
            raise SnapshotError(
                f"lora_A {list(a_raw.shape)} / lora_B {list(b_raw.shape)} do not fit the model's "
                f"layer [{target.out_features}, {target.in_features}]",
                path=str(root),
                field=PEFT_PREFIX + module_path,
            )
        a = _tensor(a_raw).to(device=param.device, dtype=param.dtype)
        b = _tensor(b_raw).to(device=param.device, dtype=param.dtype)
        for label, t in (("lora_A", a), ("lora_B", b)):
            if not bool(torch.isfinite(t).all()):
                raise SnapshotError(
                    f"{label} holds NaN or infinite values",
                    path=str(root),
                    field=PEFT_PREFIX + module_path,
                )
        # PEFT scales by alpha / r of the adapter's config; a per-module rank is the factors'.
        scale = config.scaling if rank == config.rank else config.alpha / rank
        factors[module_path] = LoraFactors(a, b, scale)
        nbytes += a_raw.data.nbytes + b_raw.data.nbytes
    return StagedAdapter(
        name, root, config.base_model, config.rank, factors, nbytes, time.perf_counter() - started
    )


def _tensor(raw: Any) -> torch.Tensor:
    return torch.from_numpy(raw.data.copy()).view(_DTYPES[raw.dtype]).reshape(raw.shape)


def _linear(model: nn.Module, module_path: str, where: str) -> nn.Linear:
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        raise SnapshotError(
            "targets a module the served model does not have", path=where, field=module_path
        ) from None
    if not isinstance(module, nn.Linear):
        raise SnapshotError(
            f"targets a {type(module).__name__}; only linear layers take LoRA here",
            path=where,
            field=module_path,
        )
    return module


@dataclass
class AdapterTable:
    """The installed adapters of one model; changed only on the worker thread."""

    model: nn.Module
    limit: int = 8
    adapters: dict[str, StagedAdapter] = field(default_factory=dict)
    #: Per wrapped module: adapter name -> its factors there.
    _slots: dict[str, dict[str, LoraFactors]] = field(default_factory=dict)

    def names(self) -> list[str]:
        """The installed adapters, in installation order."""
        return list(self.adapters)

    def install(self, staged: StagedAdapter) -> None:
        """Make `staged` usable by requests (replacing nothing: names are unique)."""
        if staged.name in self.adapters:
            return
        if len(self.adapters) >= self.limit:
            raise SnapshotError(
                f"{len(self.adapters)} adapters are loaded, the engine's limit "
                f"(--max-adapters {self.limit}); unload one first",
                field="lora_name",
            )
        for module_path, f in staged.factors.items():
            slot = self._slots.get(module_path)
            if slot is None:
                slot = self._slots[module_path] = {}
                _wrap(self.model.get_submodule(module_path), slot)
            slot[staged.name] = f
        self.adapters[staged.name] = staged

    def remove(self, name: str) -> None:
        """Forget adapter `name` (its factors are freed once no forward pass uses them)."""
        staged = self.adapters.pop(name, None)
        if staged is None:
            return
        for module_path in staged.factors:
            self._slots[module_path].pop(name, None)


def _wrap(module: nn.Module, slot: dict[str, LoraFactors]) -> None:
    """Give `module` the LoRA terms of the adapters in `slot` (read at every call)."""
    base: Callable[[torch.Tensor], torch.Tensor] = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = base(x)
        rows: list[str | None] | None = getattr(_ROWS, "adapters", None)
        if rows is None or not slot:
            return y
        for i, name in enumerate(rows):
            f = slot.get(name) if name is not None else None
            if f is not None:
                # One row at a time: its result never depends on its neighbours in the batch.
                y[i] += nn.functional.linear(nn.functional.linear(x[i], f.a), f.b) * f.scale
        return y

    module.forward = forward
