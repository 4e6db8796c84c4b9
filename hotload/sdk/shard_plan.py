"""The shard plan of a sharded publish: which tensors go to which shard file and which rank
writes each, computed alike on every rank from names, shapes and dtypes (no communication)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hotload.sdk.outcomes import ShardedPublishError
from hotload.snapshot import layout
from hotload.snapshot.dtypes import TORCH_TO_SAFETENSORS, element_size

if TYPE_CHECKING:
    import torch

_CASTABLE = {"F32", "F16", "F64"}


@dataclass(frozen=True)
class PlannedShard:
    """One shard file of the plan: its name, tensors (in order), size and owning rank."""

    name: str
    tensors: tuple[str, ...]
    nbytes: int
    owner: int


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which shard file, and which rank writes each file."""

    world_size: int
    shards: tuple[PlannedShard, ...]
    #: tensor -> {"shape": [...], "dtype": "F32"}, as written to `model.weight.spec.json`.
    spec: Mapping[str, Mapping[str, Any]]

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors of the snapshot."""
        return sum(s.nbytes for s in self.shards)

    def owned_by(self, rank: int) -> list[PlannedShard]:
        """The shards `rank` writes and uploads."""
        return [s for s in self.shards if s.owner == rank]

    @property
    def digest(self) -> str:
        """A short fingerprint that differs when any name, shape, dtype or owner differs."""
        doc = [[s.name, list(s.tensors), s.owner] for s in self.shards], dict(self.spec)
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def plan_shards(
    tensors: Iterable[tuple[str, Sequence[int], str]],
    *,
    world_size: int,
    max_shard_bytes: int = layout.DEFAULT_MAX_SHARD_BYTES,
) -> ShardPlan:
    """Cut (name, shape, safetensors dtype) triples into layer-pure shards and assign owners.

    Shards are cut exactly as `SnapshotWriter` cuts them (at layer boundaries and at the size
    limit, in the given order); each shard goes to the rank with the fewest bytes so far (lowest
    rank on ties), so every rank computes the same plan without talking to the others.
    """
    if world_size < 1:
        raise ShardedPublishError("world_size must be at least 1")
    if max_shard_bytes <= 0:
        raise ShardedPublishError("max_shard_bytes must be positive")
    spec: dict[str, dict[str, Any]] = {}
    groups: list[tuple[list[str], int]] = []
    current: list[str] = []
    current_group: str | None = None
    current_bytes = 0
    for name, shape, dtype in tensors:
        if name in spec:
            raise ShardedPublishError(f"tensor {name!r} appears twice")
        nbytes = element_size(dtype)
        for dim in shape:
            nbytes *= int(dim)
        group = layout.layer_of(name) or "<non-layer>"
        if current and (group != current_group or current_bytes + nbytes > max_shard_bytes):
            groups.append((current, current_bytes))
            current, current_bytes = [], 0
        current.append(name)
        current_group = group
        current_bytes += nbytes
        spec[name] = {"shape": [int(d) for d in shape], "dtype": dtype}
    if current:
        groups.append((current, current_bytes))
    if not groups:
        raise ShardedPublishError("a snapshot needs at least one tensor")
    load = [0] * world_size
    shards = []
    for i, (names, nbytes) in enumerate(groups, start=1):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += nbytes
        shards.append(PlannedShard(layout.shard_name(i, len(groups)), tuple(names), nbytes, owner))
    return ShardPlan(world_size, tuple(shards), spec)


def safetensors_dtype(tensor: torch.Tensor, cast: str | None = None) -> str:
    """The safetensors dtype `tensor` is written as (after `cast`, which only "BF16" supports)."""
    key = str(tensor.dtype)
    if key not in TORCH_TO_SAFETENSORS:
        raise ShardedPublishError(f"torch dtype {key} has no safetensors equivalent")
    dtype = TORCH_TO_SAFETENSORS[key]
    if cast is not None:
        if cast != "BF16":
            raise ShardedPublishError(f"casting to {cast} is not supported (only BF16)")
        if dtype in _CASTABLE:
            return "BF16"
    return dtype
