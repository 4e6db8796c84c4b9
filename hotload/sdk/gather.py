"""Gathering a sharded model's tensors to the rank that writes each shard: one tensor at a time,
to that rank only, so that no rank ever holds more than one shard's full tensors; and the
collectives through which the ranks agree on each publish."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hotload.sdk.outcomes import ShardedPublishError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor

#: A model (its `state_dict()` is published), a state dict, or (name, tensor) pairs.
ShardedWeights = Any


class Held:
    """Counts the gathered bytes a rank holds right now, the peak, and the total gathered."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.gathered = 0

    def take(self, nbytes: int) -> None:
        """Count `nbytes` more held."""
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def drop(self, nbytes: int) -> None:
        """Count `nbytes` released."""
        self.now -= nbytes


def named_tensors(weights: ShardedWeights) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module's state dict, a mapping or an iterable of pairs."""
    import torch

    if isinstance(weights, torch.nn.Module):
        # FSDP2 leaves names as they are and returns each parameter as its sharded DTensor.
        weights = weights.state_dict()
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)):
            raise ShardedPublishError(
                "weights must be a torch module, a state dict or (name, tensor) pairs"
            )
    return pairs


def gather_to(
    tensor: torch.Tensor, owner: int, rank: int, group: ProcessGroup | None, held: Held
) -> torch.Tensor | None:
    """Return the full `tensor` on rank `owner` and None elsewhere; every rank must call it.

    An FSDP2 parameter (a DTensor sharded on dim 0 over the group) is gathered to the owner
    alone; a plain tensor is already whole; any other DTensor layout falls back to
    `full_tensor()`, which every rank receives and the non-owners drop at once.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor.detach() if rank == owner else None
    placements = tuple(tensor.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return tensor.to_local().detach() if rank == owner else None
    mesh = tensor.device_mesh
    if (
        mesh.ndim == 1
        and placements == (Shard(0),)
        and tensor.dim() > 0
        and dist.get_process_group_ranks(mesh.get_group())
        == dist.get_process_group_ranks(group or dist.group.WORLD)
    ):
        return gather_dim0(tensor, owner, rank, group, held)
    full = tensor.full_tensor().detach()
    held.take(full.nbytes)
    if rank == owner:
        held.gathered += full.nbytes
        return full
    held.drop(full.nbytes)
    return None


def gather_dim0(
    tensor: DTensor, owner: int, rank: int, group: ProcessGroup | None, held: Held
) -> torch.Tensor | None:
    """Gather a dim-0 sharded DTensor to `owner` with one `dist.gather`."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rows = tensor.shape[0]
    # DTensor's Shard(0) splits like torch.chunk: ceil(rows / world) rows each, the last ranks
    # short or empty. Padding every slice to that size lets one fixed-size gather carry them
    # into one buffer whose first `rows` rows are the tensor.
    chunk = -(-rows // world)
    local = tensor.to_local().detach()
    expected = max(0, min(rows, chunk * (rank + 1)) - chunk * rank)
    if local.shape[0] != expected:
        raise ShardedPublishError(
            f"rank {rank} holds {local.shape[0]} rows of a {list(tensor.shape)} tensor, "
            f"expected {expected} (torch.chunk layout)"
        )
    rest = tuple(tensor.shape[1:])
    if expected == chunk:
        send = local.contiguous()
    else:
        send = torch.zeros((chunk, *rest), dtype=local.dtype, device=local.device)
        send[:expected] = local
    dst = owner if group is None else dist.get_global_rank(group, owner)
    if rank != owner:
        dist.gather(send, None, dst=dst, group=group)
        return None
    buffer = torch.empty((chunk * world, *rest), dtype=local.dtype, device=local.device)
    held.take(buffer[:rows].nbytes)
    slots = [buffer[i * chunk : (i + 1) * chunk] for i in range(world)]
    dist.gather(send, slots, dst=dst, group=group)
    full = buffer[:rows]
    held.gathered += full.nbytes
    return full


def all_gather(group: ProcessGroup | None, world_size: int, obj: dict[str, Any]) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (a collective: all ranks call it)."""
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_first(group: ProcessGroup | None, obj: dict[str, Any]) -> dict[str, Any]:
    """The `obj` of the group's first rank, on every rank (a collective: all ranks call it)."""
    import torch.distributed as dist

    box: list[Any] = [obj]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    result: dict[str, Any] = box[0]
    return result
