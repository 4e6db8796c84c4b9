"""The manifests of a snapshot folder: `model.safetensors.index.json` (tensor -> shard) and
`model.weight.spec.json` (tensor -> shape and dtype), parsed with errors that name the file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotload.errors import SnapshotError
from hotload.snapshot.dtypes import ELEMENT_SIZE


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor, as `model.weight.spec.json` records it."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        n = ELEMENT_SIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def load_json(path: Path) -> Any:
    """Read a JSON file, raising `SnapshotError` that names the file when it is missing or bad."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SnapshotError("required file is missing", path=str(path)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"not valid JSON ({exc})", path=str(path)) from None


def parse_weight_map(path: Path) -> dict[str, str]:
    """Parse `model.safetensors.index.json` and return its `weight_map` (tensor -> shard file)."""
    doc = load_json(path)
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise SnapshotError("must be a non-empty object", path=str(path), field="weight_map")
    for name, file in wm.items():
        if not isinstance(file, str) or "/" in file or file in {"", ".", ".."}:
            raise SnapshotError(
                f"tensor {name!r} maps to {file!r}, not a file name in this folder",
                path=str(path),
                field="weight_map",
            )
    return dict(wm)


def parse_tensor_map(path: Path) -> dict[str, TensorSpec]:
    """Parse `model.weight.spec.json` and return its `tensor_map` (tensor -> shape and dtype)."""
    doc = load_json(path)
    tm = doc.get("tensor_map") if isinstance(doc, dict) else None
    if not isinstance(tm, dict) or not tm:
        raise SnapshotError("must be a non-empty object", path=str(path), field="tensor_map")
    out: dict[str, TensorSpec] = {}
    for name, spec in tm.items():
        field = f"tensor_map.{name}"
        if not isinstance(spec, dict):
            raise SnapshotError(
                "must be an object with shape and dtype", path=str(path), field=field
            )
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SnapshotError(f"bad shape {shape!r}", path=str(path), field=field + ".shape")
        if dtype not in ELEMENT_SIZE:
            raise SnapshotError(f"unknown dtype {dtype!r}", path=str(path), field=field + ".dtype")
        out[name] = TensorSpec(tuple(shape), dtype)
    return out
