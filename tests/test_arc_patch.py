"""Sparse patches from arc_v2 deltas: exactly what the delta changes, verified before they exist.

Real snapshots (safetensors written by `hotload.snapshot`), real deltas (`hotload.arc.encode`);
a patch applied to its parent's bits must give the child's bits, and a delta that does not
verify must leave no patch behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hotload.arc.container import read_header
from hotload.arc.patch import PatchTooDenseError, delta_changes, prepare_patch
from hotload.errors import ChecksumMismatchError, CorruptDeltaError, WrongParentError
from hotload.snapshot import Snapshot, write_snapshot
from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.safetensors_io import iter_file
from hotload_patch import PatchError
from hotload_patch.format import PatchFile
from support.snapshots import CONFIG, weights
from support.tiny_llm import sparse_steps


def _bits(snapshot: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a full snapshot as (dtype, its unsigned bit patterns)."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for shard in Snapshot(snapshot).shard_files:
        for name, raw in iter_file(snapshot / shard):
            out[name] = (raw.dtype, np.array(raw.data).view(uint_view_dtype(raw.dtype)))
    return out


def _chain(
    root: Path, dtype: str, steps: int = 2, fraction: float = 0.01
) -> tuple[list[Path], list[Path]]:
    cast = "BF16" if dtype == "BF16" else None
    w = weights(0, layers=3, width=96)
    base = write_snapshot(root / "base", w, config=CONFIG, cast=cast, overwrite=True).path
    return sparse_steps(base, root, steps, fraction=fraction, f16=dtype == "F16")


def _apply(parent: Path, patch: Path) -> dict[str, np.ndarray]:
    """The parent's bits with the patch written over them, the way an engine writes it."""
    bits = {name: b.copy() for name, (_, b) in _bits(parent).items()}
    with PatchFile(patch) as pf:
        for t in pf.tensors:
            flat = bits[t.name]
            flat[t.positions.astype(np.int64)] = t.values
            for r in t.ranges:
                flat[r.start : r.start + r.values.size] = r.values
    return bits


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_a_patch_turns_the_parent_into_the_child_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    fulls, deltas = _chain(tmp_path, dtype)
    out = tmp_path / "step-1.patch"
    stats = prepare_patch(fulls[0], deltas[1], out, threads=2)
    child = _bits(fulls[1])
    patched = _apply(fulls[0], out)
    assert all(np.array_equal(patched[n], b) for n, (_, b) in child.items())
    parent = _bits(fulls[0])
    differing = sum(int((parent[n][1] != b).sum()) for n, (_, b) in child.items())
    # Sparse chunks carry exactly the changed elements: the patch writes nothing else.
    assert stats.changed == differing and 0 < stats.changed < stats.elements // 50
    assert (stats.identity, stats.parent) == ("step-1", "step-0")
    assert delta_changes(deltas[1]) == (stats.changed, stats.elements)
    with PatchFile(out) as pf:
        assert (pf.identity, pf.parent, pf.changed) == ("step-1", "step-0", stats.changed)
        assert {t.dtype for t in pf.tensors} == {dtype}
    assert not out.with_name(out.name + ".tmp").exists()


def test_dense_chunks_become_whole_ranges(tmp_path: Path) -> None:
    """A step that changes every element is coded dense: the patch replaces whole ranges."""
    w0 = weights(0)
    w1 = {k: v + np.float32(0.25) for k, v in w0.items()}
    a = write_snapshot(tmp_path / "a", w0, config=CONFIG, overwrite=True).path
    b = write_snapshot(tmp_path / "b", w1, config=CONFIG, overwrite=True).path
    from hotload.arc import encode

    encode(a, b, tmp_path / "d" / "b")
    out = tmp_path / "b.patch"
    stats = prepare_patch(a, tmp_path / "d" / "b", out)
    with PatchFile(out) as pf:
        assert any(t.ranges for t in pf.tensors)
    assert stats.changed == stats.elements
    child = _bits(b)
    assert all(np.array_equal(_apply(a, out)[n], bits) for n, (_, bits) in child.items())


def _flip_payload_byte(delta: Path) -> None:
    """Flip one byte of the first delta shard that carries a payload."""
    for shard in sorted(delta.glob("*.safetensors")):
        header = read_header(shard)
        if header.file_size > header.payload_offset:
            data = bytearray(shard.read_bytes())
            data[header.payload_offset + 1] ^= 0xFF
            shard.write_bytes(bytes(data))
            return
    raise AssertionError("no payload")


def test_a_delta_that_does_not_verify_leaves_no_patch(tmp_path: Path) -> None:
    fulls, deltas = _chain(tmp_path, "BF16")
    out = tmp_path / "p.patch"
    leftovers = (out, out.with_name(out.name + ".tmp"))
    # The parent the engine serves is not the delta's parent: its checksums say so.
    with pytest.raises(WrongParentError):
        prepare_patch(fulls[1], deltas[1], out)
    assert not any(p.exists() for p in leftovers)
    # The ledger names another parent than the delta records.
    with pytest.raises(WrongParentError):
        prepare_patch(fulls[0], deltas[1], out, expected_parent="step-7")
    assert not any(p.exists() for p in leftovers)
    # Too dense to be worth writing in place: refused before anything is decoded.
    with pytest.raises(PatchTooDenseError, match="changes"):
        prepare_patch(fulls[0], deltas[1], out, max_changed_fraction=0.001)
    assert not any(p.exists() for p in leftovers)
    # A corrupted payload fails its CRC-32.
    _flip_payload_byte(deltas[1])
    with pytest.raises((CorruptDeltaError, ChecksumMismatchError)):
        prepare_patch(fulls[0], deltas[1], out)
    assert not any(p.exists() for p in leftovers)


def test_a_damaged_patch_file_does_not_open(tmp_path: Path) -> None:
    fulls, deltas = _chain(tmp_path, "F16", steps=1)
    out = tmp_path / "p.patch"
    prepare_patch(fulls[0], deltas[1], out)
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 7])
    with pytest.raises(PatchError, match="outside the file") as info:
        PatchFile(out)
    assert info.value.reason == "patch_corrupt"
    broken = bytearray(data)
    broken[-3] ^= 0x01  # inside the JSON header
    out.write_bytes(bytes(broken))
    with pytest.raises(PatchError, match="CRC-32"):
        PatchFile(out)
    with pytest.raises(PatchError, match="not found"):
        PatchFile(tmp_path / "missing.patch")
