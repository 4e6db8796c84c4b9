"""The tensors of a checkpoint folder (names, shapes, dtypes), from its safetensors headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from hotload_patch.dtypes import ELEMENT_SIZE
from hotload_patch.errors import PatchError

#: checkpoint tensor name -> (shape, safetensors dtype)
Specs = dict[str, tuple[tuple[int, ...], str]]

_MAX_HEADER = 100 * 1024 * 1024


def checkpoint_specs(folder: str | Path) -> Specs:
    """Every tensor of the `*.safetensors` files in `folder` (names, shapes, dtypes)."""
    root = Path(folder)
    specs: Specs = {}
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise PatchError("no safetensors files", reason="weights_mismatch", path=str(root))
    for shard in shards:
        with shard.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise PatchError("truncated", reason="weights_mismatch", path=str(shard))
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER:
                raise PatchError("header too large", reason="weights_mismatch", path=str(shard))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = info.get("dtype"), info.get("shape")
            if dtype not in ELEMENT_SIZE or not isinstance(shape, list):
                raise PatchError(
                    "bad dtype or shape", reason="weights_mismatch", path=str(shard), tensor=name
                )
            specs[name] = (tuple(int(d) for d in shape), dtype)
    return specs
