"""Decoding one arc_v2 delta shard (`hotload.arc.decoder`), path by path, in well under a few
seconds: the focused test selection of `make mutate`'s `arc-decoder` module (the codec's
whole suite took its 300 s before the first mutant: tests/README.md "Mutation testing").

One small shard holds a tensor for every encoding and every way the decoder reads a chunk's
parent (`chunk.parent_use`: read, built by the C kernel, copied first, written through), a
float64 and an empty tensor. The child and the parent are written here, so what a decode must
give comes from them: the child's bytes, the count of elements that differ, the checksums of
the parent's data. Then each damage alone: a payload byte, a parent byte, a forged checksum,
a chunk whose fields lie; each refused naming the shard and the tensor, nothing written.
"""

from __future__ import annotations

import mmap
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hotload.arc import chunk as ck
from hotload.arc.checksum import adler32, format_checksum
from hotload.arc.container import read_header, write_prefix
from hotload.arc.decoder import decode_shard, stored_chunk
from hotload.arc.encoder import encode_shard
from hotload.arc.lanes import Inline, Lanes
from hotload.arc.plan import ShardStats, check_delta, plan_chunks
from hotload.errors import (
    ArcError,
    ChecksumMismatchError,
    CorruptDeltaError,
    WrongParentError,
)
from hotload.snapshot.safetensors_io import RawTensor, write_safetensors
from hotload.snapshot.safetensors_io import read_header as read_st_header

SHARD = "model-00001-of-00001.safetensors"
CHUNK = 2048
# name -> (dtype, element width); each tensor's parent and child data are made in `_weights`.
DTYPES = {
    "a.same": ("F32", 4),
    "b.sparse": ("F32", 4),
    "c.dense": ("BF16", 2),
    "d.raw": ("U8", 1),
    "e.f64": ("F64", 8),
    "f.empty": ("F32", 4),
    "g.exp": ("F32", 4),
}


def _weights() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Parent and child elements (unsigned views), shaped so the encoder picks every encoding."""
    rng = np.random.default_rng(3)
    n = 2 * CHUNK

    def f32(values: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)

    def bumped(u: np.ndarray, idx: Any) -> np.ndarray:
        v = u.copy()
        v[idx] += v.dtype.type(1)
        return v

    sparse = f32(rng.standard_normal(4 * CHUNK))
    bf16 = (f32(rng.standard_normal(n)) >> 16).astype(np.uint16)
    f64 = rng.standard_normal(1000).view(np.uint64)
    # Small weights change often, large ones seldom: the parent's exponents predict the
    # changes, so `sparse_exp` wins.
    w = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 2, n))).astype(np.float32)
    small = np.abs(w) < np.quantile(np.abs(w), 0.1)
    moved = (small & (rng.random(n) < 0.6)) | (~small & (rng.random(n) < 0.002))
    w2 = w.copy()
    w2[moved] *= np.float32(1.001)
    prev = {
        "a.same": f32(rng.standard_normal(n)),
        "b.sparse": sparse,
        "c.dense": bf16,
        "d.raw": rng.integers(0, 256, n, dtype=np.uint8),
        "e.f64": f64,
        "f.empty": np.zeros(0, np.uint32),
        "g.exp": w.view(np.uint32),
    }
    cur = dict(prev)
    # Chunks of b.sparse: 54 and 53 changes (built by the kernel), 1 (written through), none.
    cur["b.sparse"] = bumped(sparse, [7, 5000, *range(100, 4000, 37)])
    cur["c.dense"] = bumped(bf16, np.flatnonzero(rng.random(n) < 0.5))
    cur["d.raw"] = np.zeros(n, np.uint8)  # new values cheaper than the differences: raw
    cur["e.f64"] = bumped(f64, [0, 999])
    cur["g.exp"] = w2.view(np.uint32)
    return prev, cur


def _write(
    path: Path, weights: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = [
        (name, RawTensor(DTYPES[name][0], (int(u.size),), u.view(np.uint8)))
        for name, u in weights.items()
    ]
    write_safetensors(path, tensors, metadata)


@dataclass
class Case:
    prev: Path
    cur: Path
    delta: Path
    out_dir: Path
    prev_w: dict[str, np.ndarray]
    cur_w: dict[str, np.ndarray]

    @property
    def out(self) -> Path:
        return self.out_dir / SHARD

    def fields(self) -> dict[str, Any]:
        return read_header(self.delta).fields

    def entry(self, tensor: str) -> dict[str, Any]:
        return next(e for e in self.fields()["tensors"] if e["name"] == tensor)

    def decode(self, out: Path | None = None, **kw: Any) -> ShardStats:
        return decode_shard(self.prev, self.delta, out, pool=Inline(), **kw)


def _encode(tmp: Path, prev_w: dict[str, np.ndarray], cur_w: dict[str, np.ndarray]) -> Case:
    case = Case(
        tmp / "prev" / SHARD, tmp / "cur" / SHARD, tmp / "delta" / SHARD, tmp / "out", prev_w, cur_w
    )
    _write(case.prev, prev_w)
    _write(case.cur, cur_w)
    case.delta.parent.mkdir()
    case.out_dir.mkdir()
    encode_shard(
        case.prev,
        case.cur,
        case.delta,
        parent="prev",
        pool=Inline(),
        chunk_elements=CHUNK,
        exponent_context=True,
    )
    return case


@pytest.fixture
def case(tmp_path: Path) -> Case:
    return _encode(tmp_path, *_weights())


def _rewrite(delta: Path, edit: Any) -> None:
    """Apply `edit` to the delta's header fields and write the shard again, payload unchanged."""
    header = read_header(delta)
    payload = delta.read_bytes()[header.payload_offset :]
    fields = header.fields
    edit(fields)
    delta.write_bytes(write_prefix(fields) + payload)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def _parent_offset(case: Case, tensor: str, element: int) -> int:
    tensors, _, start = read_st_header(case.prev)
    return start + tensors[tensor].begin + element * DTYPES[tensor][1]


def _chunk_offset(case: Case, tensor: str, index: int) -> int:
    """Where chunk `index` of `tensor` starts in the delta file."""
    header = read_header(case.delta)
    offset: int = case.entry(tensor)["chunks"][index]["offset"]
    return header.payload_offset + offset


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _coded_changes(case: Case) -> int:
    """The elements a decode counts as changed: those that differ in a sparse chunk, every
    element of a dense or raw one (`DecodedChunk.changed`)."""
    total = 0
    for entry in case.fields()["tensors"]:
        old, new = case.prev_w[entry["name"]], case.cur_w[entry["name"]]
        for i, chunk in enumerate(entry["chunks"]):
            s, e = i * CHUNK, min((i + 1) * CHUNK, old.size)
            if chunk["encoding"] in ("dense", "raw"):
                total += e - s
            else:
                total += int(np.count_nonzero(old[s:e] != new[s:e]))
    return total


def _refused(case: Case, error: type[Exception], tensor: str) -> Exception:
    """Decode to a file and verify only: both refuse with `error` naming SHARD and `tensor`,
    and nothing appears in the output folder."""
    for out in (case.out, None):
        with pytest.raises(error) as exc:
            case.decode(out)
        assert (exc.value.shard, exc.value.tensor) == (SHARD, tensor), exc.value  # type: ignore[attr-defined]
        assert SHARD in str(exc.value) and tensor in str(exc.value)
        assert _listing(case.out_dir) == []
    return exc.value


# --- the fixture ----------------------------------------------------------------------------------


def test_the_shard_exercises_every_encoding_and_parent_path(case: Case) -> None:
    encodings = {e["name"]: [c["encoding"] for c in e["chunks"]] for e in case.fields()["tensors"]}
    assert encodings == {
        "a.same": ["same", "same"],
        "b.sparse": ["sparse", "sparse", "sparse", "same"],
        "c.dense": ["dense", "dense"],
        "d.raw": ["raw", "raw"],
        "e.f64": ["sparse"],
        "f.empty": [],
        "g.exp": ["sparse_exp", "sparse_exp"],
    }
    assert ck.native is not None
    uses = {
        ck.parent_use(c, CHUNK * DTYPES[e["name"]][1], to_file=True)
        for e in case.fields()["tensors"]
        for c in e["chunks"]
    }
    assert uses == {ck.READ, ck.BUILD, ck.COPY_FIRST, ck.WRITE_THROUGH}


# --- decoding -------------------------------------------------------------------------------------


def test_decode_rebuilds_the_child_byte_for_byte(case: Case, arc_decoder: str) -> None:
    seen: list[int] = []
    stats = case.decode(case.out, progress=seen.append)
    assert case.out.read_bytes() == case.cur.read_bytes()
    assert _listing(case.out_dir) == [SHARD]  # no temporary file left beside it
    umask = os.umask(0)
    os.umask(umask)
    assert case.out.stat().st_mode & 0o777 == 0o644 & ~umask
    assert case.out.stat().st_ino != case.prev.stat().st_ino and not stats.hardlinked
    # What the stats say comes from the inputs: the elements that differ, the chunks' encodings
    # as the header lists them, the sizes of the files.
    assert stats.name == SHARD
    assert stats.changed == _coded_changes(case)
    assert stats.elements == sum(int(u.size) for u in case.cur_w.values())
    assert stats.encodings == Counter(
        c["encoding"] for e in case.fields()["tensors"] for c in e["chunks"]
    )
    assert stats.full_bytes == case.cur.stat().st_size
    assert stats.delta_bytes == case.delta.stat().st_size
    assert 0 <= stats.seconds < 60
    # Progress in tensor bytes, one call per chunk.
    assert sum(seen) == sum(u.nbytes for u in case.cur_w.values())
    assert len(seen) == sum(len(e["chunks"]) for e in case.fields()["tensors"])


def test_decode_without_fsync_and_on_threads_gives_the_same_bytes(case: Case) -> None:
    decode_shard(case.prev, case.delta, case.out, pool=Lanes(2), durable=False)
    assert case.out.read_bytes() == case.cur.read_bytes()


def test_verify_only_writes_nothing_and_counts_the_same(case: Case, arc_decoder: str) -> None:
    seen: list[int] = []
    stats = case.decode(None, progress=seen.append)
    assert _listing(case.out_dir) == []
    assert stats.changed == _coded_changes(case)
    assert stats.full_bytes == case.cur.stat().st_size and not stats.hardlinked
    assert sum(seen) == sum(u.nbytes for u in case.cur_w.values())


def test_an_unchanged_shard_is_linked_to_its_parent(tmp_path: Path) -> None:
    prev_w, _ = _weights()
    case = _encode(tmp_path, prev_w, prev_w)
    stats = case.decode(case.out)
    assert stats.hardlinked and stats.changed == 0
    assert case.out.stat().st_ino == case.prev.stat().st_ino
    assert _listing(case.out_dir) == [SHARD]
    assert stats.encodings == Counter(
        {"same": sum(len(e["chunks"]) for e in case.fields()["tensors"])}
    )


def test_unchanged_data_under_another_header_is_written_not_linked(tmp_path: Path) -> None:
    # Every chunk is `same`, but the child's header differs (metadata): linking the parent
    # would give the parent's header.
    prev_w, _ = _weights()
    case = Case(
        tmp_path / "prev" / SHARD,
        tmp_path / "cur" / SHARD,
        tmp_path / "delta" / SHARD,
        tmp_path / "out",
        prev_w,
        prev_w,
    )
    _write(case.prev, prev_w)
    _write(case.cur, prev_w, {"step": "2"})
    case.delta.parent.mkdir()
    case.out_dir.mkdir()
    encode_shard(
        case.prev, case.cur, case.delta, parent="prev", pool=Inline(), chunk_elements=CHUNK
    )
    stats = case.decode(case.out)
    assert not stats.hardlinked
    assert case.out.read_bytes() == case.cur.read_bytes()
    assert case.out.stat().st_ino != case.prev.stat().st_ino


# --- damage ---------------------------------------------------------------------------------------

# A chunk of each encoding and parent path: (tensor, chunk index, its first element).
CHUNKS = [
    ("b.sparse", 1, 2048),  # sparse, built by the kernel
    ("b.sparse", 2, 4096),  # sparse, written through
    ("c.dense", 0, 0),
    ("d.raw", 1, 2048),
    ("e.f64", 0, 0),
    ("g.exp", 1, 2048),
]


@pytest.mark.parametrize(("tensor", "index", "first"), CHUNKS)
def test_a_damaged_payload_byte_is_refused_naming_the_tensor(
    case: Case, arc_decoder: str, tensor: str, index: int, first: int
) -> None:
    length = case.entry(tensor)["chunks"][index]["length"]
    _flip(case.delta, _chunk_offset(case, tensor, index) + length // 2)
    err = _refused(case, CorruptDeltaError, tensor)
    last = min(first + CHUNK, case.cur_w[tensor].size)
    assert f"elements {first}..{last}" in str(err) and "CRC-32" in str(err)


@pytest.mark.parametrize(
    ("tensor", "element"),
    [
        ("a.same", 9),
        ("b.sparse", 4096 + 5),
        ("b.sparse", 100),
        ("c.dense", 3),
        ("d.raw", 2100),
        ("e.f64", 500),
        ("g.exp", 7),
    ],
)
def test_a_parent_with_other_data_is_a_wrong_parent(
    case: Case, arc_decoder: str, tensor: str, element: int
) -> None:
    _flip(case.prev, _parent_offset(case, tensor, element))
    parent = case.prev_w[tensor].copy().view(np.uint8)
    parent[element * DTYPES[tensor][1]] ^= 0x5A
    err = _refused(case, WrongParentError, tensor)
    # Both checksums named: the parent's as read, the one the delta was made against.
    assert format_checksum(adler32(parent)) in str(err)
    assert case.entry(tensor)["base_checksum"] in str(err)
    assert str(err).endswith(": this delta was made against another snapshot")


def test_a_delta_for_another_parent_is_refused_naming_the_shard(case: Case) -> None:
    with pytest.raises(WrongParentError) as exc:
        case.decode(case.out, expected_parent="step-9")
    assert exc.value.shard == SHARD and "'prev', not 'step-9'" in str(exc.value)
    assert _listing(case.out_dir) == []


def test_a_chunk_pointing_past_the_payload_is_refused_naming_the_shard(case: Case) -> None:
    def edit(fields: dict[str, Any]) -> None:
        next(e for e in fields["tensors"] if e["name"] == "d.raw")["chunks"][1]["length"] += 10**6

    _rewrite(case.delta, edit)
    err = _refused(case, CorruptDeltaError, "d.raw")
    assert "points outside the payload" in str(err)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ("dtype", ArcError, "delta rebuilds F64[1000] but the parent holds I64[1000]"),
        ("shape", ArcError, "delta rebuilds F64[1000] but the parent holds F64[10, 100]"),
        ("missing", WrongParentError, "tensor is not in the parent shard"),
    ],
)
def test_a_parent_holding_the_tensor_otherwise_is_refused_naming_it(
    case: Case, change: str, error: type[Exception], message: str
) -> None:
    tensors = [
        (name, RawTensor(DTYPES[name][0], (int(u.size),), u.view(np.uint8)))
        for name, u in case.prev_w.items()
    ]
    at = next(i for i, (name, _) in enumerate(tensors) if name == "e.f64")
    raw = tensors[at][1]
    if change == "missing":
        del tensors[at]
    else:
        dtype, shape = ("I64", raw.shape) if change == "dtype" else ("F64", (10, 100))
        tensors[at] = ("e.f64", RawTensor(dtype, shape, raw.data))
    write_safetensors(case.prev, tensors)
    assert message in str(_refused(case, error, "e.f64"))


def test_a_failing_progress_callback_ends_the_decode_with_its_own_error(case: Case) -> None:
    # The error's traceback holds views into the delta's map: its close must not replace the
    # caller's error with a BufferError.
    def progress(nbytes: int) -> None:
        raise RuntimeError("stopped by the caller")

    for out in (case.out, None):
        with pytest.raises(RuntimeError, match="stopped by the caller"):
            case.decode(out, progress=progress)
        assert _listing(case.out_dir) == []


def test_the_wrong_parent_is_named_before_a_damaged_chunk(case: Case, arc_decoder: str) -> None:
    _flip(case.delta, _chunk_offset(case, "b.sparse", 0) + 3)
    _flip(case.prev, _parent_offset(case, "e.f64", 10))
    _refused(case, WrongParentError, "e.f64")


def test_a_damaged_chunk_with_its_parent_right_is_no_wrong_parent(
    case: Case, arc_decoder: str
) -> None:
    # The damaged chunk's own parent elements are summed even though it failed: else its
    # tensor's parent would not match and the damage would read as a wrong parent.
    _flip(case.delta, _chunk_offset(case, "e.f64", 0) + 3)
    _refused(case, CorruptDeltaError, "e.f64")


@pytest.mark.parametrize(("tensor", "index", "first"), [CHUNKS[0], CHUNKS[1], CHUNKS[4]])
def test_a_chunk_whose_fields_lie_is_refused_naming_its_elements(
    case: Case, arc_decoder: str, tensor: str, index: int, first: int
) -> None:
    # The stored bytes pass their CRC; the chunk claims far more changes than they hold.
    def edit(fields: dict[str, Any]) -> None:
        entry = next(e for e in fields["tensors"] if e["name"] == tensor)
        entry["chunks"][index]["count"] += 500

    _rewrite(case.delta, edit)
    err = _refused(case, CorruptDeltaError, tensor)
    last = min(first + CHUNK, case.cur_w[tensor].size)
    assert f"{SHARD}: tensor {tensor!r}: elements {first}..{last}" in str(err)


def _forge_checksum(case: Case, tensor: str, key: str, weights: np.ndarray) -> str:
    """Rewrite `tensor`'s `key` checksum in the delta's header to one that `weights` fail."""
    forged = format_checksum(adler32(weights.view(np.uint8)) ^ 1)

    def edit(fields: dict[str, Any]) -> None:
        next(e for e in fields["tensors"] if e["name"] == tensor)[key] = forged

    _rewrite(case.delta, edit)
    return forged


@pytest.mark.parametrize("tensor", ["a.same", "b.sparse", "d.raw", "f.empty"])
def test_a_forged_result_checksum_is_a_checksum_mismatch(case: Case, tensor: str) -> None:
    forged = _forge_checksum(case, tensor, "checksum", case.cur_w[tensor])
    err = _refused(case, ChecksumMismatchError, tensor)
    assert forged in str(err)
    assert format_checksum(adler32(case.cur_w[tensor].view(np.uint8))) in str(err)


@pytest.mark.parametrize("tensor", ["a.same", "c.dense", "f.empty"])
def test_a_forged_base_checksum_is_a_wrong_parent(case: Case, tensor: str) -> None:
    forged = _forge_checksum(case, tensor, "base_checksum", case.prev_w[tensor])
    err = _refused(case, WrongParentError, tensor)
    assert forged in str(err)


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        ("crc32", "nothex!!", CorruptDeltaError, "malformed checksum 'nothex!!'"),
        ("checksum", None, CorruptDeltaError, "malformed checksum None"),
        ("base_checksum", "12345", CorruptDeltaError, "malformed checksum '12345'"),
    ],
)
def test_a_malformed_checksum_is_refused_naming_the_tensor(
    case: Case, key: str, value: Any, error: type[Exception], message: str
) -> None:
    def edit(fields: dict[str, Any]) -> None:
        entry = next(e for e in fields["tensors"] if e["name"] == "c.dense")
        (entry["chunks"][1] if key == "crc32" else entry)[key] = value

    _rewrite(case.delta, edit)
    assert message in str(_refused(case, error, "c.dense"))


def test_a_crc_failure_does_not_pin_the_delta_map(case: Case) -> None:
    # The error keeps `stored_chunk`'s frame: a view still alive in it would keep the map from
    # closing (and its file descriptor open) while the error lives.
    _flip(case.delta, _chunk_offset(case, "c.dense", 0) + 3)
    header = read_header(case.delta)
    checked = check_delta(header, SHARD, None)
    plan, _ = plan_chunks(checked, SHARD)
    item = next(t for t in plan if t[0].name == "c.dense")
    with case.delta.open("rb") as f:
        delta_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with pytest.raises(CorruptDeltaError) as exc:
            stored_chunk(delta_map, header.payload_offset, item, SHARD)
        assert exc.value.tensor == "c.dense"
        delta_map.close()  # BufferError if a view were still exported
        assert delta_map.closed
