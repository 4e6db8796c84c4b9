"""Sparse patches from arc_v2 deltas: exactly what the deltas change, read without the parent.

Real snapshots (safetensors written by `hotload.snapshot`), real deltas (`hotload.arc.encode`);
a patch applied to its parent's bits must give the child's bits (several deltas composed into
one patch too), it costs at most about what the delta does, and a delta that does not pass its
checks must leave no patch behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hotload.arc.container import read_header
from hotload.arc.patch import (
    ParentChain,
    PatchNeedsParentError,
    PatchTooDenseError,
    delta_changes,
    prepare_patch,
)
from hotload.errors import CorruptDeltaError, WrongParentError
from hotload.snapshot import Snapshot, describe_snapshot, write_snapshot
from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.safetensors_io import iter_file
from hotload_patch import PatchError
from hotload_patch.format import PatchFile
from support.snapshots import (
    CONFIG,
    adam_like_step,
    bf16_bits,
    flip_payload_byte,
    weights,
    write_bf16,
)
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
            at, is_set, values = t.changes()
            flat[at] = t.new_bits(is_set, values, flat[at])
    return bits


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_a_patch_turns_the_parent_into_the_child_bit_for_bit(tmp_path: Path, dtype: str) -> None:
    fulls, deltas = _chain(tmp_path, dtype)
    out = tmp_path / "step-1.patch"
    # No parent: the patch is made from the delta alone.
    stats = prepare_patch(None, deltas[1], out, threads=2)
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


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_deltas_in_a_row_compose_into_one_patch(tmp_path: Path, dtype: str) -> None:
    """Three steps, one patch: the parent's bits become the last child's, and the patch
    changes what the three changed together (a position two steps moved counts once)."""
    fulls, deltas = _chain(tmp_path, dtype, steps=3, fraction=0.05)
    out = tmp_path / "steps.patch"
    stats = prepare_patch(None, deltas[1:], out, threads=2)
    patched = _apply(fulls[0], out)
    last, first = _bits(fulls[3]), _bits(fulls[0])
    assert all(np.array_equal(patched[n], b) for n, (_, b) in last.items())
    differing = sum(int((first[n][1] != b).sum()) for n, (_, b) in last.items())
    assert stats.changed == differing and stats.deltas == 3
    assert (stats.identity, stats.parent) == ("step-3", "step-0")
    with PatchFile(out) as pf:
        assert pf.header["deltas"] == ["step-1", "step-2", "step-3"]
    # Out of order, the chain does not link: refused, nothing left behind.
    with pytest.raises(WrongParentError):
        prepare_patch(None, [deltas[2], deltas[1]], out)


def test_a_patch_is_about_the_size_of_its_delta(tmp_path: Path) -> None:
    """1.5% of a bfloat16 model moved by one ulp (the benchmark's step): no more bytes than the
    delta (benchmarks/RESULTS-sparse-load.md: 0.96-0.99x; this input gives 0.96x)."""
    w = weights(0, layers=4, width=256)
    base = write_snapshot(tmp_path / "base", w, config=CONFIG, cast="BF16", overwrite=True).path
    _, deltas = sparse_steps(base, tmp_path, 1, fraction=0.015)
    stats = prepare_patch(None, deltas[1], tmp_path / "p.patch")
    shipped = describe_snapshot(deltas[1]).shipped_bytes
    assert stats.bytes <= shipped, (stats.bytes, shipped)


def test_dense_and_raw_chunks_change_every_element(tmp_path: Path) -> None:
    """A step that changes every element is coded dense (differences) or raw (values): the
    patch changes every element, and gives the child's bits."""
    w0 = weights(0)
    rng = np.random.default_rng(3)
    w1 = {k: v + np.float32(0.25) for k, v in w0.items()}
    w1 = {
        k: (rng.standard_normal(v.shape).astype(np.float32) if i % 2 else v)
        for i, (k, v) in enumerate(w1.items())
    }
    a = write_snapshot(tmp_path / "a", w0, config=CONFIG, overwrite=True).path
    b = write_snapshot(tmp_path / "b", w1, config=CONFIG, overwrite=True).path
    from hotload.arc import encode

    encode(a, b, tmp_path / "d" / "b")
    out = tmp_path / "b.patch"
    stats = prepare_patch(None, tmp_path / "d" / "b", out)
    with PatchFile(out) as pf:
        assert any(t.add is not None and t.add.count == t.numel for t in pf.tensors)
        assert any(t.set is not None and t.set.count == t.numel for t in pf.tensors)
    assert stats.changed == stats.elements
    child = _bits(b)
    assert all(np.array_equal(_apply(a, out)[n], bits) for n, (_, bits) in child.items())


def test_compact_deltas_need_their_parent(tmp_path: Path) -> None:
    """A delta encoded with `compact` orders changes by the parent's exponents
    (`sparse_exp`): made from the delta alone it is refused; with the parent it is exact."""
    from hotload.arc import encode

    a0, a1 = adam_like_step(300_000, 1)
    write_bf16(tmp_path / "s0", {"layers.0.w": a0})
    write_bf16(tmp_path / "s1", {"layers.0.w": a1})
    compact = tmp_path / "compact"
    encode(tmp_path / "s0", tmp_path / "s1", compact, chunk_elements=100_000, compact=True)
    kinds = {
        c.get("encoding")
        for shard in Snapshot(compact).shard_files
        for e in read_header(compact / shard).fields["tensors"]
        for c in e["chunks"]
    }
    assert "sparse_exp" in kinds
    out = tmp_path / "c.patch"
    with pytest.raises(PatchNeedsParentError):
        prepare_patch(None, compact, out)
    assert not out.exists()
    prepare_patch(tmp_path / "s0", compact, out)
    child = _bits(tmp_path / "s1")
    patched = _apply(tmp_path / "s0", out)
    assert all(np.array_equal(patched[n], b) for n, (_, b) in child.items())


def _adam_chain(root: Path, steps: int, n: int = 300_000) -> list[Path]:
    """Full bf16 snapshots s0..s<steps> of two layers, each step an Adam-like move at lr 1e-6
    of every element of both (the kind of step `compact` deltas are for)."""
    rng = np.random.default_rng(5)
    w = {
        f"layers.{k}.w": rng.standard_normal(n, dtype=np.float32) * np.float32(0.02) for k in (0, 1)
    }
    fulls = []
    for i in range(steps + 1):
        if i:
            for name, value in list(w.items()):
                step = np.abs(rng.standard_normal(n, dtype=np.float32)).clip(0.05, 3)
                sign = rng.integers(0, 2, n).astype(np.float32) * 2 - 1
                w[name] = value - step * np.float32(1e-6) * sign
        write_bf16(root / f"s{i}", {name: bf16_bits(v) for name, v in w.items()})
        fulls.append(root / f"s{i}")
    return fulls


def test_a_compact_delta_after_deltas_is_patched_from_the_chain_to_its_parent(
    tmp_path: Path,
) -> None:
    """The engine serves s1 (s0 plus a delta): a compact delta of s1 takes its parent's values
    from s0's chunks through the first delta, alone and composed with the next compact one."""
    from hotload.arc import encode

    fulls = _adam_chain(tmp_path, 3)
    deltas = []
    for k in (1, 2, 3):
        out = tmp_path / "d" / f"s{k}"  # a delta folder is named as the snapshot it rebuilds
        encode(fulls[k - 1], fulls[k], out, chunk_elements=100_000, compact=k > 1)
        deltas.append(out)
    kinds = {
        c.get("encoding")
        for shard in Snapshot(deltas[1]).shard_files
        for e in read_header(deltas[1] / shard).fields["tensors"]
        for c in e["chunks"]
    }
    assert "sparse_exp" in kinds
    with pytest.raises(PatchNeedsParentError):
        prepare_patch(None, deltas[1], tmp_path / "none.patch")
    for composed, child in (([deltas[1]], fulls[2]), (deltas[1:], fulls[3])):
        out = tmp_path / f"{len(composed)}.patch"
        prepare_patch(ParentChain(fulls[0], [deltas[0]]), composed, out)
        patched = _apply(fulls[1], out)
        assert all(np.array_equal(patched[n], b) for n, (_, b) in _bits(child).items())
    # A chain that does not end at the delta's parent never gives the child in silence: the
    # hot lists from its exponents do not fit the runs, or the values differ (and the engine's
    # parent and result checksums refuse that patch).
    wrong = tmp_path / "wrong.patch"
    try:
        prepare_patch(ParentChain(fulls[0]), deltas[1], wrong)
    except CorruptDeltaError:
        assert not wrong.exists()
    else:
        patched = _apply(fulls[1], wrong)
        assert not all(np.array_equal(patched[n], b) for n, (_, b) in _bits(fulls[2]).items())


def test_a_parent_given_as_a_function_is_asked_once_and_only_for_a_compact_delta(
    tmp_path: Path,
) -> None:
    """A loader hands `prepare_patch` a function that walks its volume for the chain: a plain
    delta never calls it; a compact one calls it once, however many chunks in however many
    threads need parent values at the same time."""
    from hotload.arc import encode

    fulls = _adam_chain(tmp_path, 2, n=600_000)
    plain, compact = tmp_path / "d" / "s1", tmp_path / "d" / "s2"
    encode(fulls[0], fulls[1], plain, chunk_elements=50_000)
    encode(fulls[1], fulls[2], compact, chunk_elements=50_000, compact=True)
    asked: list[int] = []

    def chain(deltas: list[Path]) -> Callable[[], ParentChain]:
        def walk() -> ParentChain:
            asked.append(len(deltas))
            time.sleep(0.2)  # a walk takes a while: other chunks need it meanwhile
            return ParentChain(fulls[0], deltas)

        return walk

    prepare_patch(chain([]), plain, tmp_path / "plain.patch", threads=4)
    assert asked == []
    out = tmp_path / "compact.patch"
    prepare_patch(chain([plain]), compact, out, threads=4)
    assert asked == [1]
    patched = _apply(fulls[1], out)
    assert all(np.array_equal(patched[n], b) for n, (_, b) in _bits(fulls[2]).items())


def test_a_delta_that_does_not_pass_its_checks_leaves_no_patch(tmp_path: Path) -> None:
    _, deltas = _chain(tmp_path, "BF16")
    out = tmp_path / "p.patch"
    leftovers = (out, out.with_name(out.name + ".tmp"))
    # The ledger names another parent than the delta records. (Whether the weights an engine
    # holds are the parent, the engine checks against its own checksums.)
    with pytest.raises(WrongParentError):
        prepare_patch(None, deltas[1], out, expected_parent="step-7")
    assert not any(p.exists() for p in leftovers)
    # Too dense to be worth writing in place: refused before anything is decoded.
    with pytest.raises(PatchTooDenseError, match="changes"):
        prepare_patch(None, deltas[1], out, max_changed_fraction=0.001)
    assert not any(p.exists() for p in leftovers)
    # A corrupted payload fails its CRC-32.
    flip_payload_byte(deltas[1])
    with pytest.raises(CorruptDeltaError):
        prepare_patch(None, deltas[1], out)
    assert not any(p.exists() for p in leftovers)


def test_a_damaged_patch_file_does_not_open(tmp_path: Path) -> None:
    _, deltas = _chain(tmp_path, "F16", steps=1)
    out = tmp_path / "p.patch"
    prepare_patch(None, deltas[1], out)
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


def test_a_damaged_plane_is_refused_naming_its_tensor(tmp_path: Path) -> None:
    """A flipped byte in the data section fails that plane's CRC-32 (not only the header's)."""
    _, deltas = _chain(tmp_path, "BF16", steps=1)
    out = tmp_path / "p.patch"
    prepare_patch(None, deltas[1], out)
    with PatchFile(out) as pf:
        entry = next(e for e in pf.header["tensors"] if "add" in e)
    offset, stored, codec, _ = next(
        p for p in entry["add"]["positions"]["planes"] if p[2] != "zero"
    )
    assert stored > 0 and codec in ("raw", "zlib")
    data = bytearray(out.read_bytes())
    data[offset] ^= 0x10
    out.write_bytes(bytes(data))
    with pytest.raises(PatchError, match="CRC-32") as info:
        PatchFile(out)
    assert (info.value.reason, info.value.tensor) == ("patch_corrupt", entry["name"])
