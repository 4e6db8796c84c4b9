"""Patch files for tests: a real one between two snapshots of the toy model (`build_chain`), and
ones edited on purpose: a patch like a real one with one tensor's changes altered, written by
the real writer (so its planes and CRCs are valid and only the content is wrong)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hotload.arc.patch import prepare_patch
from hotload.arc.patch_file import PatchWriter, tensor_entry
from hotload.snapshot import write_snapshot
from hotload_patch.format import PatchFile, PatchTensor, Run
from support.patch_models import CFG, ToyConfig, checkpoint_weights
from support.snapshots import CONFIG
from support.tiny_llm import sparse_steps


def rewrite_patch(src: Path, dst: Path, tensor: str, edit: Callable[[PatchTensor], None]) -> Path:
    """Copy the patch `src` to `dst` with `edit` applied to tensor `tensor`'s changes."""
    with PatchFile(src) as pf:
        header, tensors = pf.header, pf.tensors
    with PatchWriter(dst) as writer:
        entries = []
        for t in tensors:
            if t.name == tensor:
                edit(t)
            entries.append(tensor_entry(writer, t))
        meta = {k: v for k, v in header.items() if k not in ("format", "version", "tensors")}
        writer.finish({**meta, "tensors": entries})
    return dst


def set_first(bits: int) -> Callable[[PatchTensor], None]:
    """An edit that makes the tensor's first added change set the bit pattern `bits` instead."""

    def edit(t: PatchTensor) -> None:
        assert t.add is not None and t.add.count
        first = t.add.positions[:1]
        t.set = Run(first, np.array([bits], dtype=t.add.values.dtype))
        t.add = Run(t.add.positions[1:], t.add.values[1:]) if t.add.count > 1 else None

    return edit


def flip_first_difference(t: PatchTensor) -> None:
    """An edit that changes the tensor's first difference by one (a corrupted value)."""
    assert t.add is not None and t.add.count
    t.add.values[0] ^= t.add.values.dtype.type(2)


@dataclass
class Chain:
    """A parent and a child full snapshot, and the patch from one to the other."""

    parent: Path
    child: Path
    patch: Path


def build_chain(
    root: Path, cast: str | None, cfg: ToyConfig = CFG, fraction: float = 0.05
) -> Chain:
    """Full snapshots `step-0`, `step-1` of the toy model (one training step moving `fraction`
    of every tensor by one ulp), the arc_v2 delta between them and its patch file."""
    base = write_snapshot(
        root / "base", checkpoint_weights(cfg), config=CONFIG, cast=cast, overwrite=True
    ).path
    fulls, deltas = sparse_steps(base, root, 1, fraction=fraction)
    patch = root / "step-1.patch"
    prepare_patch(fulls[0], deltas[1], patch)
    return Chain(fulls[0], fulls[1], patch)
