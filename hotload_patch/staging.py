"""Stage a patch while the old weights serve, verify it, write it in a pause, undo it.

`stage` reads the patch file (`format`), places every changed checkpoint element in the engine's
parameters (`placement`), reads the values held there, computes the new ones (a difference is added
to the held value, a set value replaces it) and converts them to the parameters' dtype and device.
It keeps the positions and the new values, and the values they replace only where the patch sets
values: an added difference is undone by subtracting it again (`undo` reads it from the patch file
once more), so staging holds what the patch itself holds. It also computes, per region of each
tensor the engine holds, how the patch moves the tensor's adler32 (`sums.delta_partial`), from the
old values as the engine holds them. `verify` then checks, wherever every rank's results meet, that
the served weights are the patch's parent (their checksums, read by `served.served_sums` or derived
from the patches since, equal the delta's parent checksums) and that the served weights with the
patch's changes give the delta's result checksums.
`apply` only writes.

Dtypes: an engine may hold a tensor in a wider floating dtype than its checkpoint (float32 for
bfloat16 weights). The new values are converted as a full load converts them (`Tensor.to`), and
the held values convert back to the checkpoint's bits exactly, so the checksums still apply. A
narrower dtype cannot give the parent's bits back: such a patch is refused.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hotload_patch.checkpoint import Specs
from hotload_patch.dtypes import torch_dtype, uint_view_dtype
from hotload_patch.errors import PatchError
from hotload_patch.format import PatchFile, PatchTensor
from hotload_patch.placement import Host, Slot
from hotload_patch.served import INT_OF_WIDTH, Counters, held_dtype, region_view
from hotload_patch.sums import Region, RegionSum, delta_partial
from hotload_patch.verify import TensorCheck

__all__ = ["Part", "Staged", "Write", "apply", "held_dtype", "region_view", "stage", "undo"]

_NP_INT_OF_WIDTH: dict[int, Any] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass(frozen=True)
class Part:
    """The elements of `Write.index[start:stop]`: slot `slot` of checkpoint tensor `tensor` (in
    `Host.place` order), and the values they replace when the patch sets any of them (None: all
    are added differences, whose old values `undo` computes from the patch file)."""

    tensor: str
    slot: int
    start: int
    stop: int
    old: torch.Tensor | None


@dataclass
class Write:
    """The writes into one parameter: flat positions, new values, and how to put back the values
    they replace (`parts`)."""

    param: str
    index: torch.Tensor
    new: torch.Tensor
    parts: list[Part]


@dataclass
class Staged:
    """A patch placed and converted for this engine (one rank of it), ready for `apply`."""

    path: str
    identity: str
    parent: str
    writes: list[Write]
    deltas: list[RegionSum]
    checks: dict[str, TensorCheck]
    changed: int
    nbytes: int
    seconds: float
    #: The engine it was staged for (`undo` places the patch's tensors again).
    host: Host | None = None
    written: list[Write] = field(default_factory=list)

    @property
    def written_bytes(self) -> int:
        """Bytes the writes cover, as held."""
        return sum(w.index.numel() * w.new.element_size() for w in self.writes)

    @property
    def held_bytes(self) -> int:
        """Bytes the staged writes hold (positions, new values, old values where set)."""
        return sum(
            w.index.numel() * w.index.element_size()
            + w.new.numel() * w.new.element_size()
            + sum(p.old.numel() * p.old.element_size() for p in w.parts if p.old is not None)
            for w in self.writes
        )

    def summary(self) -> dict[str, Any]:
        """What the stage found, as JSON (counts and timings, no arrays)."""
        return {
            "identity": self.identity,
            "parent": self.parent,
            "changed": self.changed,
            "parameters": len(self.writes),
            "patch_bytes": self.nbytes,
            "staged_bytes": self.held_bytes,
            "stage_seconds": round(self.seconds, 6),
        }


def as_bits(values: torch.Tensor, ckpt: str) -> np.ndarray:
    """Held values as the checkpoint's unsigned bit patterns, on the CPU (a copy)."""
    t = values.detach()
    dtype = torch_dtype(ckpt)
    if t.dtype != dtype:
        t = t.to(dtype)
    t = t.reshape(-1).cpu()
    return t.view(INT_OF_WIDTH[t.element_size()]).numpy().view(uint_view_dtype(ckpt))


def from_bits(bits: np.ndarray, ckpt: str, like: torch.Tensor) -> torch.Tensor:
    """Checkpoint bit patterns as `like`'s dtype and device, converted as a full load does."""
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(_NP_INT_OF_WIDTH[bits.dtype.itemsize]))
    return raw.view(torch_dtype(ckpt)).to(device=like.device, dtype=like.dtype)


# --- staging and writing -------------------------------------------------------------------------


def stage(
    host: Host,
    path: str | Path,
    *,
    identity: str,
    parent: str,
    specs: Specs | None = None,
    counters: Counters | None = None,
    threads: int | None = None,
) -> Staged:
    """Place, convert and check the patch at `path` for this engine (see the module docstring);
    `specs`, the served checkpoint's tensors, must be the patch's, with the same shapes and
    dtypes; `counters` counts the bytes brought back from a device; `threads` stage tensors at
    once (default: `STAGE_THREADS` for weights on an accelerator, one on the CPU). Raises
    `PatchError` and changes nothing."""
    started = time.perf_counter()
    where = str(path)
    problems = host.problems()
    if problems:
        raise PatchError("; ".join(problems), reason="kernel_format", path=where)
    params = host.parameters()
    workers = max(1, _stage_threads(params) if threads is None else threads)
    with PatchFile(path, threads=workers) as pf:
        for what, want, got in (
            ("produces", identity, pf.identity),
            ("applies to", parent, pf.parent),
        ):
            if got is not None and got != want:
                raise PatchError(
                    f"the patch {what} {got!r}, not {want!r}", reason="wrong_patch", path=where
                )
        if specs is not None:
            _check_specs(pf.tensors, pf.kept, specs, where)
        parts: dict[str, list[_Item]] = {}
        deltas: list[RegionSum] = []
        checks: dict[str, TensorCheck] = {}
        changed = 0
        jobs: list[tuple[PatchTensor, list[Slot]]] = []
        for t in pf.tensors:
            slots = host.place(t.name, t.shape, t.dtype)
            if not slots:
                continue  # the engine does not load this tensor (a full load skips it too)
            checks[t.name] = TensorCheck(t.numel, t.nbytes, t.base_checksum, t.checksum)
            if t.changed:
                jobs.append((t, slots))
            # else nothing to place or convert: a tensor the step left alone costs its check
            # (`verify`: parent checksum held, result promised equal), no more.
        if min(workers, len(jobs)) > 1:
            with ThreadPoolExecutor(
                min(workers, len(jobs)), thread_name_prefix="hotload-stage"
            ) as pool:
                # `map` gives the results in the tensors' order and raises the first tensor's
                # error in that order, as staging them one by one would.
                staged = list(
                    pool.map(lambda j: _stage_tensor(j[0], j[1], params, counters, where), jobs)
                )
        else:
            staged = [_stage_tensor(t, slots, params, counters, where) for t, slots in jobs]
        for tensor_deltas, items, count in staged:
            deltas.extend(tensor_deltas)
            for param_name, item in items:
                parts.setdefault(param_name, []).append(item)
            changed += count
        writes = [_merge(name, items) for name, items in parts.items()]
        nbytes = Path(path).stat().st_size
    seconds = time.perf_counter() - started
    return Staged(where, identity, parent, writes, deltas, checks, changed, nbytes, seconds, host)


#: Threads that stage a patch's tensors at once when the weights are on an accelerator. Staging
#: is host work over each tensor's changes (decode, gather the old values, add, check, sum):
#: 35 ns per changed element on one core, 4.1 s for an 8B model's 1.5% on an H200 (benchmarks/
#: RESULTS-sparse-load.md), while the host's cores are otherwise idle. On a CPU engine those
#: cores serve requests meanwhile, so staging keeps to one there.
STAGE_THREADS = max(1, min(8, os.cpu_count() or 1))


def _stage_threads(params: Mapping[str, torch.Tensor]) -> int:
    """`STAGE_THREADS` where the weights live on an accelerator, else 1."""
    on_device = any(p.device.type != "cpu" for p in params.values())
    return STAGE_THREADS if on_device else 1


def _stage_tensor(
    t: PatchTensor,
    slots: list[Slot],
    params: Mapping[str, torch.Tensor],
    counters: Counters | None,
    where: str,
) -> tuple[list[RegionSum], list[tuple[str, _Item]], int]:
    """Stage one changed tensor in each of its slots: its region sums, its items by parameter
    and the elements it changes (run in a staging thread or inline)."""
    deltas: list[RegionSum] = []
    items: list[tuple[str, _Item]] = []
    changed = 0
    with torch.no_grad():  # grad mode is per thread
        positions, is_set, values = t.changes()
        for number, slot in enumerate(slots):
            param = params[slot.param]
            held_dtype(slot, param, t.dtype)
            inside, local = slot.src.select(positions)
            at = positions[inside]
            sets = is_set[inside]
            dst = slot.dst.offsets_of(local)
            index = torch.from_numpy(dst).to(param.device)
            # The values a difference applies to are the engine's own (checked to be the
            # parent's by the served checksums), read back as checkpoint bits.
            old = param.detach().view(-1).index_select(0, index)
            if counters is not None and old.device.type != "cpu":
                counters.add(host_bytes=old.numel() * old.element_size())
            old_bits = as_bits(old, t.dtype)
            new_bits = t.new_bits(sets, values[inside], old_bits)
            new = from_bits(new_bits, t.dtype, param)
            if not _finite(new, new_bits, t.dtype):
                raise PatchError(
                    "the patch writes NaN or infinite values",
                    reason="not_finite",
                    tensor=t.name,
                    path=where,
                )
            da, db = delta_partial(at, old_bits, new_bits, t.nbytes)
            deltas.append(RegionSum(t.name, slot.src, da, db))
            kept = old if bool(sets.any()) else None
            items.append((slot.param, _Item(slot, number, dst, new, kept)))
            changed += int(at.size)
            del old
    return deltas, items, changed


#: Checkpoint dtypes whose bit patterns say finiteness (exponent bits, with the sign masked
#: off): values at or above the first infinity's pattern are infinite or NaN.
_INFINITY_BITS = {"BF16": 0x7F80, "F16": 0x7C00, "F32": 0x7F800000, "F64": 0x7FF0000000000000}
#: Engine dtypes that hold every finite value of these checkpoint dtypes finite (a conversion
#: to a narrower range, such as F32 to float16, can overflow: checked on the converted values).
_WIDE_ENOUGH = {
    torch.float32: {"BF16", "F16", "F32"},
    torch.float64: {"BF16", "F16", "F32", "F64"},
    torch.bfloat16: {"BF16", "F16"},
    torch.float16: {"F16"},
}


def _finite(new: torch.Tensor, bits: np.ndarray, ckpt: str) -> bool:
    """Whether the staged values `new` (from checkpoint bit patterns `bits`) are all finite;
    from the narrower bit patterns where the conversion cannot overflow (one pass over half
    the bytes or fewer)."""
    if not new.is_floating_point():
        return True
    infinity = _INFINITY_BITS.get(ckpt)
    if infinity is None or ckpt not in _WIDE_ENOUGH.get(new.dtype, ()) or not bits.size:
        # torch has no isfinite for its float8 types (an FP8 checkpoint held as such: it raised
        # NotImplementedError); float32 keeps every NaN and infinity of them.
        return bool(torch.isfinite(new.float() if new.element_size() == 1 else new).all())
    sign = bits.dtype.type(1 << (8 * bits.dtype.itemsize - 1))
    magnitude = np.bitwise_and(bits, ~sign)
    return int(magnitude.max()) < infinity


@dataclass
class _Item:
    """One slot's staged writes before they are merged per parameter."""

    slot: Slot
    number: int
    dst: np.ndarray
    new: torch.Tensor
    old: torch.Tensor | None


def _check_specs(
    tensors: list[PatchTensor],
    kept: dict[str, tuple[tuple[int, ...], str]],
    specs: Specs,
    where: str,
) -> None:
    """Refuse a patch that is not for the served checkpoint: every tensor it changes or keeps
    (`kept`: a shard the deltas left alone) held with its shape and dtype, and none missing."""
    described = [(t.name, tuple(t.shape), t.dtype) for t in tensors]
    described += [(tname, shape, dtype) for tname, (shape, dtype) in kept.items()]
    for tname, shape, dtype in described:
        held = specs.get(tname)
        if held is None:
            raise PatchError(
                "the served checkpoint has no such tensor",
                reason="weights_mismatch",
                tensor=tname,
                path=where,
            )
        if held != (shape, dtype):
            raise PatchError(
                f"shape/dtype {list(shape)} {dtype} differs from the served checkpoint's "
                f"{list(held[0])} {held[1]}",
                reason="weights_mismatch",
                tensor=tname,
                path=where,
            )
    names = {name for name, _, _ in described}
    missing = sorted(specs.keys() - names)
    if missing:
        raise PatchError(
            f"missing from the patch ({len(missing)} tensor(s) the served checkpoint has)",
            reason="weights_mismatch",
            tensor=missing[0],
            path=where,
        )


def _merge(param: str, items: list[_Item]) -> Write:
    """One parameter's writes from all its slots. Two slots over the same elements (tied
    weights: one tensor under two checkpoint names) must write the same values."""
    kept: list[_Item] = []
    for item in items:
        twin = next((k for k in kept if k.slot.dst == item.slot.dst), None)
        if twin is None:
            kept.append(item)
        elif not (np.array_equal(twin.dst, item.dst) and torch.equal(twin.new, item.new)):
            raise PatchError(
                f"is tied to {twin.slot.tensor} in the model but the patch changes it differently",
                reason="weights_mismatch",
                tensor=item.slot.tensor,
            )
    if len(kept) > 1 and not _disjoint([k.slot.dst for k in kept]):
        raise PatchError(
            f"two checkpoint tensors overlap in {param}",
            reason="unmappable",
            tensor=kept[0].slot.tensor,
        )
    parts: list[Part] = []
    start = 0
    for k in kept:
        parts.append(Part(k.slot.tensor, k.number, start, start + k.dst.size, k.old))
        start += k.dst.size
    if len(kept) == 1:  # the usual case: no copies
        return Write(param, _index(kept[0].dst, kept[0].new.device), kept[0].new, parts)
    index = torch.cat([_index(k.dst, k.new.device) for k in kept])
    return Write(param, index, torch.cat([k.new for k in kept]), parts)


def _index(offsets: np.ndarray, device: torch.device) -> torch.Tensor:
    """Flat offsets as the staged index: 32-bit where they fit (half the memory staging holds;
    the writes widen them, per parameter, where a kernel needs 64)."""
    narrow = offsets.astype(np.int32) if offsets.size and offsets.max() < 2**31 else offsets
    return torch.from_numpy(narrow).to(device)


def _disjoint(regions: list[Region]) -> bool:
    spans = [r.span() for r in regions]
    if any(s is None for s in spans):
        # Strided shards of one parameter do not occur in the engines we place; refuse rather
        # than risk two writes to one element.
        return False
    ordered = sorted(s for s in spans if s is not None)
    return all(a[0] + a[1] <= b[0] for a, b in pairwise(ordered))


def apply(staged: Staged, params: Mapping[str, torch.Tensor]) -> None:
    """Write a staged patch; on any failure put back every value and raise `PatchError`
    (write_failed). Only writes: nothing here allocates much or reads the file."""
    # Any write may have begun when one fails (they run side by side): undo counts them all,
    # and putting an old value back where nothing was written yet changes nothing.
    staged.written = list(staged.writes)
    try:
        _scatter_all([(params[w.param], w.index, w.new) for w in staged.writes])
    except Exception as exc:
        message = f"writing the patch failed: {type(exc).__name__}: {exc}"
        try:
            undo(staged, params)
        except PatchError as restore:
            message += f"; {restore.message}"
        raise PatchError(message, reason="write_failed", path=staged.path) from exc


def undo(staged: Staged, params: Mapping[str, torch.Tensor]) -> None:
    """Put back the values a (possibly partial) `apply` replaced. Every write is undone that
    can be; raises `PatchError` (write_failed) naming the parameters that could not be."""
    failed: list[str] = []
    patch: PatchFile | None = None
    for w in reversed(staged.written):
        try:
            if patch is None and any(p.old is None for p in w.parts):
                patch = PatchFile(staged.path)
            _scatter_all([(params[w.param], w.index, _old_values(staged, w, params, patch))])
        except Exception:
            failed.append(w.param)
    staged.written = []
    if failed:
        raise PatchError(
            f"the old values of {', '.join(failed)} could not be put back: the engine's weights "
            "are not known; load a full snapshot",
            reason="write_failed",
            path=staged.path,
        )


def _old_values(
    staged: Staged, w: Write, params: Mapping[str, torch.Tensor], patch: PatchFile | None
) -> torch.Tensor:
    """The values write `w` replaced: kept where the patch sets values, else the new values
    less the patch's differences (wrapping, in the checkpoint's bits: exactly what `stage`
    added), read from the patch file again."""
    if all(p.old is not None for p in w.parts):
        return torch.cat([p.old for p in w.parts if p.old is not None])
    if patch is None or staged.host is None:
        raise PatchError("the old values are not kept", reason="write_failed", path=staged.path)
    tensors = {t.name: t for t in patch.tensors}
    pieces: list[torch.Tensor] = []
    for part in w.parts:
        if part.old is not None:
            pieces.append(part.old)
            continue
        t = tensors[part.tensor]
        slot = staged.host.place(t.name, t.shape, t.dtype)[part.slot]
        positions, is_set, values = t.changes()
        inside, _ = slot.src.locate(positions)
        if int(inside.sum()) != part.stop - part.start or bool(is_set[inside].any()):
            raise PatchError(
                "the patch file changed after it was staged",
                reason="write_failed",
                tensor=t.name,
                path=staged.path,
            )
        new_bits = as_bits(w.new[part.start : part.stop], t.dtype)
        old_bits = (new_bits - values[inside]).astype(new_bits.dtype, copy=False)
        pieces.append(from_bits(old_bits, t.dtype, params[w.param]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


#: Threads for writes on the CPU: a scattered write is bound by memory latency, and a few
#: threads keep more misses in flight (two took a 7.4 M-element write from 77 to 55 ms here).
#: The engine computes nothing during the pause, so its cores are free.
WRITE_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Writes of fewer elements than this are not split.
_SPLIT = 1 << 20


def _any_cpu() -> None:
    """Let a write thread run on every CPU the container has: vLLM's CPU workers pin
    themselves to their compute cores (one of two here), which would put every write thread
    on one core while the others wait out the pause (the benchmark's patch, its process pinned
    to one of two cores: 120 -> 77 ms)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


@functools.cache
def _write_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(
        WRITE_THREADS, thread_name_prefix="hotload-write", initializer=_any_cpu
    )


# A process forked after a write inherits the pool but none of its threads: its first split
# write would wait forever. The child makes a pool of its own.
os.register_at_fork(after_in_child=_write_pool.cache_clear)


def _scatter_all(writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """`flat(param)[index] = values` for each write; CPU writes split across threads."""
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for param, index, values in writes:
            flat = param.data.view(-1)
            if flat.device.type != "cpu":
                flat.index_copy_(0, index.long(), values)
                continue
            if not index.numel():
                continue
            parts = WRITE_THREADS if index.numel() >= _SPLIT else 1
            step = -(-index.numel() // parts)
            for lo in range(0, index.numel(), step):
                pieces.append((flat, index[lo : lo + step], values[lo : lo + step]))
    if len(pieces) <= 1 or WRITE_THREADS == 1:
        for piece in pieces:
            _scatter(*piece)
        return
    for done in [_write_pool().submit(_scatter, *piece) for piece in pieces]:
        done.result()


def _scatter(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """`flat[index] = values` on the CPU, through numpy views of the bit patterns (numpy's loop
    holds the pause about a third shorter than `index_copy_` here, has no bfloat16 type, hence
    the integer views, and lets go of the GIL)."""
    ints = INT_OF_WIDTH[flat.element_size()]
    flat.view(ints).numpy()[index.numpy()] = values.view(ints).numpy()


def parameter_checksums(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every parameter's bytes as held (its own dtype and layout): two engines with
    equal digests hold bit-identical weights."""
    digests: dict[str, str] = {}
    with torch.no_grad():
        for name, tensor in params.items():
            t = tensor.detach().contiguous().reshape(-1)
            if t.device.type != "cpu":
                t = t.cpu()
            raw = t.view(INT_OF_WIDTH[t.element_size()]).numpy()
            digests[name] = hashlib.sha256(raw.view(np.uint8).data).hexdigest()
    return digests
