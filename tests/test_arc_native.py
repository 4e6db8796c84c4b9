"""The decoder's C kernel (hotload/arc/_native.c) against the numpy reference and zlib.

Every way the codec rebuilds a sparse chunk must give the same bytes and checksums: the numpy
path, the kernel building into a separate buffer, patching in place, and writing the changed
elements through to a file. Corrupted runs are refused by both paths.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotload.arc import chunk as ck
from hotload.arc import decode, encode
from hotload.arc import streams as streams_mod
from hotload.arc.checksum import adler32
from hotload.errors import CorruptDeltaError
from hotload.snapshot import RawTensor, write_snapshot

NATIVE = ck.native


def test_the_c_kernel_is_built() -> None:
    # `make test` installs the package with its C kernel; without a compiler the install falls
    # back to the numpy decoder, which is correct but slower, so the suite insists on it.
    assert NATIVE is not None, (
        "hotload.arc._native was not built: install a C compiler and the Python headers "
        "(Debian: apt install gcc python3-dev) and reinstall (rm .venv/.installed; make venv)"
    )


def _sparse_case(width: int, n: int, seed: int, fraction: float) -> tuple[Any, ...]:
    udtype = np.dtype(f"<u{width}")
    rng = np.random.default_rng(seed)
    old = np.frombuffer(rng.bytes(n * width), dtype=udtype).copy()
    changed = rng.random(n) < fraction
    changed[[0, n - 1]] = rng.random(2) < 0.5  # gaps of 0 and up to the end, sometimes
    if not changed.any():
        changed[n // 2] = True
    new = old.copy()
    new[changed] = np.frombuffer(rng.bytes(int(changed.sum()) * width), dtype=udtype)
    new[changed & (new == old)] += udtype.type(1)
    res = ck.encode_chunk(old, new)
    return old, new, res.meta, b"".join(res.payload)


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 20000),
    seed=st.integers(0, 2**32 - 1),
    fraction=st.sampled_from([0.0001, 0.002, 0.01, 0.05, 0.2]),
)
def test_every_rebuild_path_gives_the_same_bytes_and_checksums(
    width: int, n: int, seed: int, fraction: float
) -> None:
    assert NATIVE is not None
    old, new, meta, payload = _sparse_case(width, n, seed, fraction)
    if meta["encoding"] != ck.SPARSE:
        return  # dense or raw won: not the kernel's business
    want = (adler32(old), adler32(new))
    data = memoryview(payload)

    # The kernel, building into a separate buffer (both checksums taken from the result).
    out = np.empty_like(old)
    built = ck.decode_chunk(meta, data, old, "c", out=out)
    np.testing.assert_array_equal(built.dense, new)
    assert (built.base_checksum, built.target_checksum) == want

    # The kernel, patching in place, with the parent's checksum given.
    inplace = old.copy()
    patched = ck.decode_chunk(meta, data, inplace, "c", base=want[0], out=inplace)
    np.testing.assert_array_equal(inplace, new)
    assert (patched.base_checksum, patched.target_checksum) == want

    # The kernel, writing the changed elements over the parent's bytes in a file.
    with tempfile.TemporaryFile() as f:
        f.write(b"\xaa" * 7 + old.tobytes() + b"\xbb" * 5)
        f.flush()
        through = ck.decode_chunk(meta, data, old, "c", write_to=(f.fileno(), 7))
        f.seek(0)
        assert f.read() == b"\xaa" * 7 + new.tobytes() + b"\xbb" * 5
    assert through.written and (through.base_checksum, through.target_checksum) == want

    # The numpy reference.
    ck.native = None
    try:
        ref = ck.decode_chunk(meta, data, old, "c", out=np.empty_like(old))
    finally:
        ck.native = NATIVE
    np.testing.assert_array_equal(ref.dense, new)
    assert (ref.base_checksum, ref.target_checksum) == want
    assert ref.changed == built.changed == through.changed == int(np.count_nonzero(old != new))


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 20000),
    seed=st.integers(0, 2**32 - 1),
    fraction=st.sampled_from([0.0001, 0.002, 0.01, 0.05]),
    first=st.sampled_from([0, 1, 8388608]),
)
def test_changes_without_the_parent_are_the_same_on_both_paths(
    width: int, n: int, seed: int, fraction: float, first: int
) -> None:
    """What a patch takes from a sparse chunk (positions from the chunk's first element, the
    wrapping differences), from the kernel and from the numpy reference: the inputs' changes."""
    old, new, meta, payload = _sparse_case(width, n, seed, fraction)
    if meta["encoding"] != ck.SPARSE:
        return
    want_at = np.flatnonzero(old != new) + first
    want_diff = new - old  # wrapping, in the unsigned type
    results = {}
    for path in ("kernel", "numpy"):
        ck.native = NATIVE if path == "kernel" else None
        try:
            results[path] = ck.chunk_changes(
                meta, memoryview(payload), n, old.dtype, "c", first=first
            )
        finally:
            ck.native = NATIVE
    for kind, at, diff in results.values():
        assert kind == "add" and at is not None and diff is not None
        np.testing.assert_array_equal(at, want_at)
        np.testing.assert_array_equal(diff, want_diff[want_at - first])
        assert diff.dtype == old.dtype


def _run_args(gaps: list[int], shift: int, values: list[int]) -> tuple[list[bytes], list[int], int]:
    """Planes of a hand-made run (8-bit symbols: remainders, quotients, one value plane), their
    symbol bits and the number of quotient planes."""
    g = np.array(gaps, dtype=np.uint64)
    rp = streams_mod.remainder_planes(shift)
    q, r = g >> np.uint64(shift), g & np.uint64((1 << shift) - 1)
    qp = max(1, streams_mod.bytes_needed(int(q.max())))
    planes = [((r >> np.uint64(8 * j)) & np.uint64(255)).astype(np.uint8) for j in range(rp)]
    planes += [((q >> np.uint64(8 * j)) & np.uint64(255)).astype(np.uint8) for j in range(qp)]
    planes += [np.array(values, dtype=np.uint8)]
    return [p.tobytes() for p in planes], [8] * len(planes), qp


@pytest.mark.parametrize(
    ("gaps", "shift", "text"),
    [
        ([3, 100], 0, "a gap between changed positions exceeds the chunk"),
        ([60, 60], 0, "a changed position lies past the chunk's 100 elements"),
        ([0, 99], 0, "a changed position lies past the chunk's 100 elements"),
    ],
)
def test_the_kernel_refuses_runs_that_leave_the_chunk(
    gaps: list[int], shift: int, text: str
) -> None:
    assert NATIVE is not None
    planes, bits, qp = _run_args(gaps, shift, [2, 4])
    old = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match=text):
        NATIVE.sparse_patch(old, np.empty_like(old), 1, planes, bits, len(gaps), shift, qp, 1)


@pytest.mark.parametrize(
    ("gaps", "shift", "text"),
    [
        ([100], 0, "a gap between changed positions exceeds the chunk"),
        ([60, 60], 0, "a changed position lies past the chunk's 100 elements"),
        ([0, 99], 0, "a changed position lies past the chunk's 100 elements"),
    ],
)
def test_the_kernel_refuses_changes_that_leave_the_chunk(
    gaps: list[int], shift: int, text: str
) -> None:
    assert NATIVE is not None
    planes, bits, qp = _run_args(gaps, shift, [2, 4])
    at, values = np.empty(2, dtype=np.int64), np.empty(2, dtype=np.uint8)
    with pytest.raises(ValueError, match=text):
        NATIVE.sparse_changes(at, values, 100, 0, 1, planes, bits, len(gaps), shift, qp, 1)
    with pytest.raises(ValueError, match="must hold count elements"):
        NATIVE.sparse_changes(
            at[: len(gaps) - 1], values, 100, 0, 1, planes, bits, len(gaps), shift, qp, 1
        )


def test_the_kernel_refuses_a_remainder_wider_than_its_shift() -> None:
    assert NATIVE is not None
    old = np.zeros(1000, dtype=np.uint16)
    # shift 3: remainders must be below 8; a stored remainder of 9 is corrupt.
    planes = [bytes([9]), bytes([0]), bytes([1]), bytes([0])]
    with pytest.raises(ValueError, match="a gap remainder does not fit its 3 bits"):
        NATIVE.sparse_patch(old, np.empty_like(old), 2, planes, [8, 8, 8, 8], 1, 3, 1, 2)


def test_the_kernel_refuses_planes_shorter_than_the_run() -> None:
    assert NATIVE is not None
    old = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="shorter than its symbols"):
        NATIVE.sparse_patch(old, np.empty_like(old), 1, [b"\x01", b"\x02"], [8, 8], 2, 0, 1, 1)


def test_a_failed_write_through_raises_oserror(tmp_path: Path) -> None:
    assert NATIVE is not None
    old, _, meta, payload = _sparse_case(2, 50000, 3, 0.0005)
    assert meta["encoding"] == ck.SPARSE
    path = tmp_path / "ro"
    path.write_bytes(old.tobytes())
    fd = os.open(path, os.O_RDONLY)  # writes fail with EBADF
    try:
        with pytest.raises(OSError):
            ck.decode_chunk(meta, memoryview(payload), old, "c", write_to=(fd, 0))
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_both_decoders_reject_a_corrupted_gap(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old, _, meta, _ = _sparse_case(1, 100, 5, 0.05)
    planes, _, qp = _run_args([10, 95], 0, [1, 1])
    bad = dict(meta, count=2, shift=0, quotient_planes=qp, value_planes=1)
    bad["streams"] = [["raw", len(p), 8] for p in planes]
    if path == "numpy":
        monkeypatch.setattr(ck, "native", None)
    with pytest.raises(CorruptDeltaError, match=r"^where: a changed position lies past"):
        ck.decode_chunk(bad, memoryview(b"".join(planes)), old, "where", out=np.empty_like(old))


def _f32(a: np.ndarray) -> RawTensor:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return RawTensor("F32", a.shape, a.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("decoder", ["kernel", "numpy"])
def test_a_snapshot_decodes_the_same_on_both_paths(
    tmp_path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(11)
    prev = {
        "model.embed.weight": rng.standard_normal((512, 128)),  # 256 KiB, 2 changes: through
        "model.layers.0.proj": rng.standard_normal((64, 64)),  # 1% changed: built
        "model.layers.0.norm": np.ones(64),  # unchanged
        "model.layers.1.dense": rng.standard_normal((32, 32)),  # 70% changed: dense
    }
    cur = {k: v.copy() for k, v in prev.items()}
    cur["model.embed.weight"].reshape(-1)[[17, 60000]] += 1.0
    cur["model.layers.0.proj"].reshape(-1)[::97] *= 1.5
    tensors = {k: _f32(v) for k, v in cur.items()}
    bits = tensors["model.layers.1.dense"].data.view(np.uint32)
    bits[rng.random(bits.size) < 0.7] += 1  # one ulp: small differences, coded dense
    write_snapshot(tmp_path / "prev", {k: _f32(v) for k, v in prev.items()}, config={"a": 1})
    write_snapshot(tmp_path / "cur", tensors, config={"a": 1})
    encode(tmp_path / "prev", tmp_path / "cur", tmp_path / "delta", threads=1)
    if decoder == "numpy":  # as an install without the kernel runs
        monkeypatch.setattr(ck, "native", None)
    uses = []
    real = ck.parent_use

    def spy(meta: dict[str, Any], nbytes: int, *, to_file: bool) -> str:
        uses.append(real(meta, nbytes, to_file=to_file))
        return uses[-1]

    monkeypatch.setattr(ck, "parent_use", spy)
    stats = decode(tmp_path / "prev", tmp_path / "delta", tmp_path / "out", threads=1)
    for path in (tmp_path / "cur").iterdir():
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes(), path.name
    assert stats.changed >= 2 + 64 * 64 // 97
    if decoder == "kernel":
        assert {ck.WRITE_THROUGH, ck.BUILD, ck.COPY_FIRST} <= set(uses)
    else:
        assert ck.WRITE_THROUGH not in uses and ck.BUILD not in uses
