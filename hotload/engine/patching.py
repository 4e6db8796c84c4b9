"""Sparse hot loads: a verified patch file (`hotload.arc.patch_file`) written into the served
weights in place, and per-parameter checksums to prove the result.

`stage_patch` runs in the staging thread while the old weights serve and does everything that
can fail: it maps the patch, checks that it produces the snapshot asked for from the one served,
that it covers every tensor of the model with the shapes and checkpoint dtypes the engine holds,
verifies the adler32 of every tensor *as the engine holds it* against the parent checksum the
delta recorded (so the engine's weights are the patch's parent, bit for bit), predicts every
tensor's checksum after the writes from the changed elements alone (adler32 is linear in the
bytes) and compares it with the delta's, refuses NaN and infinite values as a full load does,
and converts positions and values to tensors on the engine's device and in its dtype, keeping
the old values for a rollback. `apply_patch`, at a pause point, then only writes.

An engine holding a tensor in a wider dtype than its checkpoint (float32 on bfloat16 weights)
converts the new values exactly as a full load converts the whole tensor (`Tensor.to`), so both
paths give the same bits. A narrower one (bfloat16 on float32 weights) cannot verify its parent
and refuses the patch.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hotload.arc.checksum import adler32, adler32_sparse_update, format_checksum
from hotload.arc.patch_file import CorruptPatchError, PatchFile, PatchTensor
from hotload.engine.model import SAFETENSORS_TO_TORCH, ModelRunner, WeightsMismatchError
from hotload.errors import (
    ChecksumMismatchError,
    SnapshotError,
    ValidationProblem,
    WrongParentError,
)
from hotload.snapshot.dtypes import uint_view_dtype

#: (checkpoint dtype, engine dtype) pairs whose conversion is exact and reversible, so the
#: engine's tensor converted back gives the checkpoint's bits (and its checksum).
EXACT_WIDENING = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_OF_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass
class TensorWrite:
    """The writes into one served tensor: sparse changes and whole ranges, old values kept."""

    target: torch.Tensor
    index: torch.Tensor | None = None
    new: torch.Tensor | None = None
    old: torch.Tensor | None = None
    ranges: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class StagedPatch:
    """A patch checked against the served weights, ready for `apply_patch`."""

    path: Path
    identity: str
    parent: str
    writes: list[TensorWrite]
    changed: int
    nbytes: int
    seconds: float


def checkpoint_bits(held: torch.Tensor, dtype: str) -> np.ndarray:
    """A served tensor's elements as the checkpoint's unsigned bit patterns (no copy when the
    engine holds the checkpoint dtype on the CPU)."""
    t = held.detach()
    ckpt = SAFETENSORS_TO_TORCH[dtype]
    if t.dtype != ckpt:
        t = t.to(ckpt)
    t = t.reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.view(_INT_OF_WIDTH[t.element_size()]).numpy().view(uint_view_dtype(dtype))


def _as_engine(bits: np.ndarray, dtype: str, like: torch.Tensor) -> torch.Tensor:
    """New elements (checkpoint bit patterns) as `like`'s dtype and device, converted as a full
    load converts a tensor."""
    width = bits.dtype.itemsize
    raw = torch.from_numpy(np.array(bits).view(_NP_INT_OF_WIDTH[width]))
    return raw.view(SAFETENSORS_TO_TORCH[dtype]).to(device=like.device, dtype=like.dtype)


def stage_patch(
    runner: ModelRunner, path: str | Path, *, identity: str, parent: str
) -> StagedPatch:
    """Check the patch at `path` against the served weights (see the module docstring) and
    prepare its writes. Raises `WeightsMismatchError` (names, shapes, dtypes),
    `WrongParentError` (the served weights are not the patch's parent), `ChecksumMismatchError`
    or `CorruptPatchError` (the patch is damaged) or `SnapshotError`; nothing changes."""
    started = time.perf_counter()
    where = str(path)
    with PatchFile(path) as pf:
        for what, want, got in (
            ("produces", identity, pf.identity),
            ("applies to", parent, pf.parent),
        ):
            if got is not None and got != want:
                raise SnapshotError(f"the patch {what} {got!r}, not {want!r}", path=where)
        _check_names(runner, pf, where)
        writes = [_stage_tensor(runner, t, where) for t in _untied(runner, pf, where)]
        changed = pf.changed
        nbytes = Path(path).stat().st_size
    return StagedPatch(
        Path(path), identity, parent, writes, changed, nbytes, time.perf_counter() - started
    )


def _check_names(runner: ModelRunner, pf: PatchFile, where: str) -> None:
    names = [t.name for t in pf.tensors]
    problems: list[ValidationProblem] = []
    if len(set(names)) != len(names):
        problems.append(ValidationProblem(where, None, "names a tensor twice"))
    for name in sorted(set(names) - set(runner.targets)):
        problems.append(ValidationProblem(where, name, "the served model has no such weight"))
    for group in runner.groups:
        if not any(n in names for n in group):
            problems.append(ValidationProblem(where, group[0], "missing (the served model has it)"))
    base = runner.base_dtypes or {}
    for t in pf.tensors:
        target = runner.targets.get(t.name)
        if target is None:
            continue
        ckpt = SAFETENSORS_TO_TORCH.get(t.dtype)
        if tuple(t.shape) != tuple(target.shape):
            problems.append(
                ValidationProblem(
                    where,
                    t.name,
                    f"shape {list(t.shape)} does not match the served model's {list(target.shape)}",
                )
            )
        elif base.get(t.name) != t.dtype:
            problems.append(
                ValidationProblem(
                    where, t.name, f"dtype {t.dtype} differs from the {base.get(t.name)} served"
                )
            )
        elif ckpt is None or (ckpt != target.dtype and (ckpt, target.dtype) not in EXACT_WIDENING):
            problems.append(
                ValidationProblem(
                    where,
                    t.name,
                    f"is held as {target.dtype}, which cannot give back the checkpoint's "
                    f"{t.dtype} bits: its parent cannot be verified (load the full snapshot)",
                )
            )
        elif not target.is_contiguous():
            problems.append(ValidationProblem(where, t.name, "is not contiguous in the engine"))
    if problems:
        raise WeightsMismatchError(problems)


def _untied(runner: ModelRunner, pf: PatchFile, where: str) -> list[PatchTensor]:
    """The patch's tensors, one per tied group (lm_head = embeddings): the model holds a tied
    weight once, so the patch must change every name of it alike (a full load compares them)."""
    first_of = {name: group[0] for group in runner.groups for name in group}
    kept: dict[str, PatchTensor] = {}
    for t in pf.tensors:
        seen = kept.setdefault(first_of[t.name], t)
        if seen is not t and not _same_changes(seen, t):
            problem = f"is tied to {seen.name} in the model but the patch changes it differently"
            raise WeightsMismatchError([ValidationProblem(where, t.name, problem)])
    return list(kept.values())


def _same_changes(a: PatchTensor, b: PatchTensor) -> bool:
    return (
        (a.base_checksum, a.checksum) == (b.base_checksum, b.checksum)
        and np.array_equal(a.positions, b.positions)
        and np.array_equal(a.values, b.values)
        and len(a.ranges) == len(b.ranges)
        and all(
            x.start == y.start and np.array_equal(x.values, y.values)
            for x, y in zip(a.ranges, b.ranges, strict=True)
        )
    )


def _stage_tensor(runner: ModelRunner, t: PatchTensor, where: str) -> TensorWrite:
    target = runner.targets[t.name]
    bits = checkpoint_bits(target, t.dtype)
    base = adler32(bits)
    if base != t.base_checksum:
        raise WrongParentError(
            f"the served weights have checksum {format_checksum(base)}, the patch's parent "
            f"{format_checksum(t.base_checksum)}: the engine does not hold the patch's parent",
            shard=where,
            tensor=t.name,
        )
    write = TensorWrite(target)
    predicted = base
    flat = target.detach().view(-1)
    if t.positions.size:
        positions = t.positions.astype(np.int64)
        if int(positions.max()) >= t.numel:
            raise CorruptPatchError("a position lies past the tensor", shard=where, tensor=t.name)
        predicted = adler32_sparse_update(
            predicted, bits.nbytes, positions, bits[positions], t.values
        )
        write.index = torch.from_numpy(positions).to(target.device)
        write.new = _as_engine(t.values, t.dtype, target)
        write.old = flat.index_select(0, write.index)
        _check_finite(write.new, t.name, where)
    for r in t.ranges:
        end = r.start + r.values.size
        at = np.arange(r.start, end, dtype=np.int64)
        predicted = adler32_sparse_update(predicted, bits.nbytes, at, bits[r.start : end], r.values)
        new = _as_engine(r.values, t.dtype, target)
        _check_finite(new, t.name, where)
        write.ranges.append((r.start, new, flat[r.start : end].clone()))
    if predicted != t.checksum:
        raise ChecksumMismatchError(
            f"the patch's changes would give checksum {format_checksum(predicted)}, the delta "
            f"promises {format_checksum(t.checksum)}: the patch is corrupted",
            shard=where,
            tensor=t.name,
        )
    return write


def _check_finite(values: torch.Tensor, name: str, where: str) -> None:
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        raise SnapshotError("the patch writes NaN or infinite values", path=where, field=name)


def apply_patch(staged: StagedPatch) -> None:
    """Write a staged patch into the served tensors; on any failure restore every value written
    so far and re-raise (the old weights serve). Only writes: the staged arrays are released
    by the caller, after the pause."""
    done: list[TensorWrite] = []
    with torch.no_grad():
        try:
            for w in staged.writes:
                done.append(w)
                flat = w.target.data.view(-1)
                if w.index is not None and w.new is not None:
                    _scatter(flat, w.index, w.new)
                for start, new, _ in w.ranges:
                    flat[start : start + new.numel()].copy_(new)
        except BaseException:
            for w in reversed(done):
                flat = w.target.data.view(-1)
                for start, _, old in w.ranges:
                    flat[start : start + old.numel()].copy_(old)
                if w.index is not None and w.old is not None:
                    _scatter(flat, w.index, w.old)
            raise


def _scatter(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """`flat[index] = values`. On the CPU through numpy views of the bit patterns: a scattered
    write is bound by memory, and numpy's loop holds the pause about a third shorter than
    `index_copy_` does here (and has no bfloat16 type, hence the integer views)."""
    if flat.device.type != "cpu":
        flat.index_copy_(0, index, values)
        return
    ints = _INT_OF_WIDTH[flat.element_size()]
    flat.view(ints).numpy()[index.numpy()] = values.view(ints).numpy()


def weight_checksums(runner: ModelRunner) -> dict[str, str]:
    """sha256 of every state-dict tensor's bytes as the engine holds them (its dtype), by name:
    two engines with equal digests hold bit-identical weights."""
    digests: dict[str, str] = {}
    with torch.no_grad():
        for name, tensor in runner.targets.items():
            t = tensor.detach().contiguous().reshape(-1)
            if t.device.type != "cpu":
                t = t.cpu()
            raw = t.view(_INT_OF_WIDTH[t.element_size()]).numpy()
            digests[name] = hashlib.sha256(raw.view(np.uint8).data).hexdigest()
    return digests
