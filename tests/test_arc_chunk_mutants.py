"""One arc_v2 chunk (`hotload.arc.chunk`), field by field: the focused test selection of
`make mutate`'s `arc-chunk` module (tests/README.md "Mutation testing").

Sparse chunks are made here from their positions and values as docs/arc_v2.md lays them out
(gaps split at `shift` into remainder and quotient byte planes, zigzagged differences in value
planes, every stream raw), so what a decode must give comes from the inputs, not from the
encoder. Dense, raw and sparse_exp chunks come from `encode_chunk`; what they must give is the
child they were made from. Then each field alone made wrong: refused with `CorruptDeltaError`
saying where (the caller's `what`) and which field, by the C kernel and the numpy decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hotload.arc import chunk as ck
from hotload.arc.checksum import adler32
from hotload.arc.encodings import FLOAT_LAYOUTS, WRITE_THROUGH_BYTES
from hotload.errors import CorruptDeltaError

WHAT = "m.safetensors: tensor 'w': elements 0..1000"
N = 1000
# Changes of a U16 chunk: position -> new minus old (wrapping). Gaps 0, 2, 296, 698 at
# shift 2: remainders and quotients both non-zero, the last element changed.
CHANGES = {0: 1, 3: -1, 300: 256, 999: 7}
SHIFT = 2

Meta = dict[str, Any]


def _planes(values: list[int], planes: int) -> list[bytes]:
    """`planes` byte planes of unsigned integers, least significant first."""
    return [bytes((v >> (8 * j)) & 0xFF for v in values) for j in range(planes)]


def _zigzag(diff: int) -> int:
    return 2 * diff if diff >= 0 else -2 * diff - 1


def _sparse(
    positions: list[int], diffs: list[int], shift: int, width: int, *, qp: int = 1, vp: int = 2
) -> tuple[Meta, bytes]:
    """A sparse chunk's fields and payload from its changed positions and differences."""
    gaps = [p - (positions[i - 1] + 1 if i else 0) for i, p in enumerate(positions)]
    rp = (shift + 7) // 8
    planes = (
        _planes([g & ((1 << shift) - 1) for g in gaps], rp)
        + _planes([g >> shift for g in gaps], qp)
        + _planes([_zigzag(d) for d in diffs], vp)
    )
    meta = {
        "encoding": "sparse",
        "count": len(positions),
        "shift": shift,
        "quotient_planes": qp,
        "value_planes": min(vp, width),
        "streams": [["raw", len(p), 8] for p in planes],
    }
    return meta, b"".join(planes)


def _old(width: int = 2, n: int = N) -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(0, 1 << (8 * width), n, dtype=np.dtype(f"<u{width}"))


def _child(old: np.ndarray, changes: dict[int, int]) -> np.ndarray:
    new = old.copy()
    for at, diff in changes.items():
        new[at] = (int(old[at]) + diff) % (1 << (8 * old.itemsize))
    return new


# --- what a chunk gives ---------------------------------------------------------------------------


@pytest.mark.usefixtures("arc_decoder")
def test_a_sparse_chunk_gives_its_changes_without_the_parent() -> None:
    old = _old()
    meta, payload = _sparse(list(CHANGES), list(CHANGES.values()), SHIFT, 2)
    for first in (0, 5000):
        kind, at, diffs = ck.chunk_changes(
            meta, memoryview(payload), N, old.dtype, WHAT, first=first
        )
        assert kind == "add" and at is not None and diffs is not None
        assert at.tolist() == [p + first for p in CHANGES]
        assert diffs.dtype == old.dtype
        assert diffs.tolist() == [d % 65536 for d in CHANGES.values()]


@pytest.mark.usefixtures("arc_decoder")
def test_a_sparse_chunk_rebuilds_the_child_every_way() -> None:
    old = _old()
    new = _child(old, CHANGES)
    meta, payload = _sparse(list(CHANGES), list(CHANGES.values()), SHIFT, 2)
    want = (adler32(old), adler32(new))
    data = memoryview(payload)

    patch = ck.decode_chunk(meta, data, old, WHAT)
    assert (patch.base_checksum, patch.target_checksum) == want
    assert patch.dense is None and not patch.written and patch.changed == len(CHANGES)
    assert patch.positions is not None and patch.values is not None
    assert patch.positions.tolist() == list(CHANGES)
    assert patch.values.tolist() == new[list(CHANGES)].tolist()

    out = np.zeros_like(old)
    built = ck.decode_chunk(meta, data, old, WHAT, out=out)
    assert built.dense is out and np.array_equal(out, new)
    assert (built.base_checksum, built.target_checksum) == want
    assert built.changed == len(CHANGES) and built.positions is None

    inplace = old.copy()
    patched = ck.decode_chunk(meta, data, inplace, WHAT, base=want[0], out=inplace)
    assert np.array_equal(inplace, new)
    assert (patched.base_checksum, patched.target_checksum) == want
    assert np.array_equal(old, _old())  # the parent given apart is never written


@pytest.mark.usefixtures("arc_decoder")
def test_a_sparse_chunk_changing_every_element_rebuilds_the_child() -> None:
    # count == the chunk's elements is the bound's upper end, and one more is refused.
    n = 16
    old = _old(2, n)
    changes = {i: i + 1 for i in range(n)}
    meta, payload = _sparse(list(changes), list(changes.values()), 0, 2)
    out = ck.decode_chunk(meta, memoryview(payload), old, WHAT, out=np.empty_like(old))
    assert out.dense is not None and np.array_equal(out.dense, _child(old, changes))
    assert out.changed == n


@pytest.mark.usefixtures("arc_decoder")
def test_a_gap_at_the_widest_shift_reads_back() -> None:
    # shift 56 (seven remainder planes) is the widest the format allows; 57 is refused below.
    old = _old()
    changes = {0: 1, 700: 2}
    meta, payload = _sparse(list(changes), list(changes.values()), 56, 2, qp=1)
    kind, at, diffs = ck.chunk_changes(meta, memoryview(payload), N, old.dtype, WHAT)
    assert kind == "add" and at is not None and diffs is not None
    assert at.tolist() == [0, 700] and diffs.tolist() == [1, 2]
    decoded = ck.decode_chunk(meta, memoryview(payload), old, WHAT, out=np.empty_like(old))
    assert decoded.dense is not None and np.array_equal(decoded.dense, _child(old, changes))


@pytest.mark.usefixtures("arc_decoder")
def test_the_same_dense_and_raw_chunks_give_the_child() -> None:
    old = _old()
    same = {"encoding": "same"}
    assert ck.chunk_changes(same, memoryview(b""), N, old.dtype, WHAT) == ("same", None, None)
    kept = ck.decode_chunk(same, memoryview(b""), old, WHAT)
    assert (kept.base_checksum, kept.target_checksum) == (adler32(old), adler32(old))
    assert kept.dense is None and kept.positions is None and kept.changed == 0
    given = ck.decode_chunk(same, memoryview(b""), old, WHAT, base=12345)
    assert (given.base_checksum, given.target_checksum) == (12345, 12345)

    plus_one = old + np.uint16(1)
    for new, encoding, kind in ((plus_one, "dense", "add"), (np.zeros_like(old), "raw", "set")):
        chunk = ck.encode_chunk(old, new)
        assert chunk.meta["encoding"] == encoding
        data = memoryview(b"".join(chunk.payload))
        got_kind, at, values = ck.chunk_changes(chunk.meta, data, N, old.dtype, WHAT)
        assert (got_kind, at) == (kind, None) and values is not None
        assert np.array_equal(values, new - old if kind == "add" else new)
        for out in (None, np.empty_like(old)):
            decoded = ck.decode_chunk(chunk.meta, data, old, WHAT, out=out)
            assert decoded.dense is not None and np.array_equal(decoded.dense, new)
            # With `out` the chunk is rebuilt there: the caller writes `out`, not a copy.
            assert out is None or decoded.dense is out
            assert (decoded.base_checksum, decoded.target_checksum) == (adler32(old), adler32(new))
            assert decoded.changed == N
        assert np.array_equal(old, _old())


def test_a_sparse_exp_chunk_needs_its_parent() -> None:
    old, new, chunk = _exp_chunk()
    data = memoryview(b"".join(chunk.payload))
    with pytest.raises(ck.NeedsParentError) as exc:
        ck.chunk_changes(chunk.meta, data, old.size, old.dtype, WHAT)
    assert str(exc.value) == f"{WHAT}: a sparse_exp chunk's positions follow the parent's exponents"
    decoded = ck.decode_chunk(chunk.meta, data, old, WHAT, "BF16")
    assert decoded.positions is not None and decoded.values is not None
    assert sorted(decoded.positions.tolist()) == np.flatnonzero(old != new).tolist()
    rebuilt = old.copy()
    rebuilt[decoded.positions] = decoded.values
    assert np.array_equal(rebuilt, new)
    assert (decoded.base_checksum, decoded.target_checksum) == (adler32(old), adler32(new))
    assert decoded.changed == int(np.count_nonzero(old != new))


def _exp_chunk(threshold_at: float = 0.1) -> tuple[np.ndarray, np.ndarray, ck.EncodedChunk]:
    """A BF16 chunk whose small weights change often: the encoder picks sparse_exp."""
    rng = np.random.default_rng(5)
    n = 4096
    w = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 2, n))).astype(np.float32)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    small = np.abs(w) < np.quantile(np.abs(w), threshold_at)
    moved = (small & (rng.random(n) < 0.6)) | (~small & (rng.random(n) < 0.002))
    new = old.copy()
    new[moved] += np.uint16(1)
    chunk = ck.encode_chunk(old, new, dtype="BF16", exponent_context=True)
    assert chunk.meta["encoding"] == "sparse_exp", chunk.meta["encoding"]
    return old, new, chunk


# --- how the parent is read -----------------------------------------------------------------------


def test_parent_use_follows_the_encoding_the_count_and_the_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nbytes = 4 * WRITE_THROUGH_BYTES
    assert ck.native is not None
    for encoding in ("same", "raw"):
        assert ck.parent_use({"encoding": encoding}, nbytes, to_file=True) == ck.READ
    for encoding in ("dense", "sparse_exp"):
        assert ck.parent_use({"encoding": encoding}, nbytes, to_file=True) == ck.COPY_FIRST
    # Written through while each change has WRITE_THROUGH_BYTES of the chunk to itself.
    assert ck.parent_use({"encoding": "sparse", "count": 4}, nbytes, to_file=True) == (
        ck.WRITE_THROUGH
    )
    assert ck.parent_use({"encoding": "sparse", "count": 5}, nbytes, to_file=True) == ck.BUILD
    assert ck.parent_use({"encoding": "sparse", "count": 1}, nbytes, to_file=False) == ck.BUILD
    assert ck.parent_use({"encoding": "sparse", "count": "1"}, nbytes, to_file=True) == ck.BUILD
    monkeypatch.setattr(ck, "native", None)
    assert ck.parent_use({"encoding": "sparse", "count": 1}, nbytes, to_file=True) == (
        ck.COPY_FIRST
    )


def test_write_through_needs_a_sparse_chunk(tmp_path: Any) -> None:
    old = _old()
    chunk = ck.encode_chunk(old, old + np.uint16(1))
    with (tmp_path / "out").open("wb") as f, pytest.raises(ValueError) as exc:
        ck.decode_chunk(
            chunk.meta, memoryview(b"".join(chunk.payload)), old, WHAT, write_to=(f.fileno(), 0)
        )
    assert str(exc.value) == "write_to needs a sparse chunk and the C kernel (see parent_use)"


# --- each field wrong -----------------------------------------------------------------------------

Edit = Callable[[Meta, bytes], tuple[Meta, bytes]]


def _field(key: str, value: Any) -> Edit:
    return lambda meta, payload: ({**meta, key: value}, payload)


def _stream(index: int, entry: Any) -> Edit:
    def edit(meta: Meta, payload: bytes) -> tuple[Meta, bytes]:
        streams = [list(s) for s in meta["streams"]]
        streams[index] = entry
        return {**meta, "streams": streams}, payload

    return edit


def _plane_byte(plane: int, index: int, value: int) -> Edit:
    """Set byte `index` of raw plane `plane` of the payload."""

    def edit(meta: Meta, payload: bytes) -> tuple[Meta, bytes]:
        at = sum(s[1] for s in meta["streams"][:plane]) + index
        data = bytearray(payload)
        data[at] = value
        return meta, bytes(data)

    return edit


# (what is wrong, the edit of the sparse chunk of CHANGES, the error's text after WHAT).
# Its planes: 0 remainders, 1 quotients, 2 and 3 the values' low and high bytes.
SPARSE_DAMAGE: list[tuple[str, Edit, str]] = [
    ("no streams", _field("streams", None), "expected 4 streams"),
    (
        "one stream short",
        lambda m, p: ({**m, "streams": m["streams"][:3]}, p),
        "expected 4 streams",
    ),
    ("entry of two", _stream(1, ["raw", 4]), "malformed stream entry ['raw', 4]"),
    ("entry not a list", _stream(1, ("raw", 4, 8)), "malformed stream entry ('raw', 4, 8)"),
    ("codec not text", _stream(1, [1, 4, 8]), "malformed stream entry [1, 4, 8]"),
    ("negative length", _stream(1, ["raw", -4, 8]), "malformed stream entry ['raw', -4, 8]"),
    ("length a bool", _stream(1, ["raw", True, 8]), "malformed stream entry ['raw', True, 8]"),
    ("bits 3", _stream(1, ["raw", 4, 3]), "malformed stream entry ['raw', 4, 3]"),
    ("bits 16", _stream(1, ["raw", 4, 16]), "malformed stream entry ['raw', 4, 16]"),
    ("bits a float", _stream(1, ["raw", 4, 8.0]), "malformed stream entry ['raw', 4, 8.0]"),
    (
        "stream past the end",
        _stream(3, ["raw", 5, 8]),
        "stream 3 runs past the end of the chunk payload",
    ),
    ("stray bytes", lambda m, p: (m, p + b"\0\0\0"), "3 stray bytes after the last stream"),
    ("count 0", _field("count", 0), "an empty run must have all fields 0"),
    (
        "count past the chunk",
        _field("count", N + 1),
        f"field 'count' must be an integer in [0, {N}], got {N + 1}",
    ),
    (
        "count negative",
        _field("count", -1),
        f"field 'count' must be an integer in [0, {N}], got -1",
    ),
    (
        "count a bool",
        _field("count", True),
        f"field 'count' must be an integer in [0, {N}], got True",
    ),
    ("count text", _field("count", "4"), f"field 'count' must be an integer in [0, {N}], got '4'"),
    ("shift 57", _field("shift", 57), "field 'shift' must be an integer in [0, 56], got 57"),
    ("shift -1", _field("shift", -1), "field 'shift' must be an integer in [0, 56], got -1"),
    (
        "quotient planes 0",
        _field("quotient_planes", 0),
        "field 'quotient_planes' must be an integer in [1, 8], got 0",
    ),
    (
        "quotient planes 9",
        _field("quotient_planes", 9),
        "field 'quotient_planes' must be an integer in [1, 8], got 9",
    ),
    (
        "value planes 0",
        _field("value_planes", 0),
        "field 'value_planes' must be an integer in [1, 2], got 0",
    ),
    (
        "value planes past the width",
        _field("value_planes", 3),
        "field 'value_planes' must be an integer in [1, 2], got 3",
    ),
    (
        "a remainder wider than its shift",
        _plane_byte(0, 1, 4),
        "a gap remainder does not fit its 2 bits",
    ),
    (
        "a quotient past the chunk",
        _plane_byte(1, 1, 250),
        "a gap between changed positions exceeds the chunk",
    ),
    (
        "the last position past the chunk",
        _plane_byte(1, 3, 175),
        f"a changed position lies past the chunk's {N} elements",
    ),
    ("unknown encoding", _field("encoding", "zip"), "unknown encoding 'zip' (supported: "),
]


@pytest.mark.parametrize(
    ("edit", "text"), [d[1:] for d in SPARSE_DAMAGE], ids=[d[0] for d in SPARSE_DAMAGE]
)
@pytest.mark.usefixtures("arc_decoder")
def test_a_sparse_chunk_with_a_wrong_field_is_refused_saying_which(edit: Edit, text: str) -> None:
    old = _old()
    meta, payload = edit(*_sparse(list(CHANGES), list(CHANGES.values()), SHIFT, 2))
    data = memoryview(payload)
    calls: list[Callable[[], object]] = [
        lambda: ck.chunk_changes(meta, data, N, old.dtype, WHAT),
        lambda: ck.decode_chunk(meta, data, old, WHAT),
        lambda: ck.decode_chunk(meta, data, old, WHAT, out=np.empty_like(old)),
    ]
    for call in calls:
        with pytest.raises(CorruptDeltaError) as exc:
            call()
        assert str(exc.value).startswith(f"{WHAT}: {text}"), str(exc.value)
    assert np.array_equal(old, _old())


def test_an_empty_sparse_chunk_is_refused() -> None:
    old = _old()
    meta = {"encoding": "sparse", "count": 0, "shift": 0, "quotient_planes": 0, "value_planes": 0}
    for call in (
        lambda: ck.chunk_changes({**meta, "streams": []}, memoryview(b""), N, old.dtype, WHAT),
        lambda: ck.decode_chunk({**meta, "streams": []}, memoryview(b""), old, WHAT),
    ):
        with pytest.raises(CorruptDeltaError) as exc:
            call()
        assert str(exc.value) == f"{WHAT}: a sparse chunk must change at least one element"


def test_a_same_chunk_with_a_payload_is_refused() -> None:
    old = _old()
    for call in (
        lambda: ck.chunk_changes({"encoding": "same"}, memoryview(b"x"), N, old.dtype, WHAT),
        lambda: ck.decode_chunk({"encoding": "same"}, memoryview(b"x"), old, WHAT),
    ):
        with pytest.raises(CorruptDeltaError) as exc:
            call()
        assert str(exc.value) == f"{WHAT}: a 'same' chunk must have no payload"


@pytest.mark.parametrize("planes", [0, 3])
def test_a_dense_chunk_with_value_planes_out_of_bounds_is_refused(planes: int) -> None:
    old = _old()
    chunk = ck.encode_chunk(old, old + np.uint16(1))
    meta = {**chunk.meta, "value_planes": planes}
    data = memoryview(b"".join(chunk.payload))
    for call in (
        lambda: ck.chunk_changes(meta, data, N, old.dtype, WHAT),
        lambda: ck.decode_chunk(meta, data, old, WHAT),
    ):
        with pytest.raises(CorruptDeltaError) as exc:
            call()
        assert str(exc.value) == (
            f"{WHAT}: field 'value_planes' must be an integer in [1, 2], got {planes}"
        )


def test_a_raw_chunk_with_a_plane_short_is_refused() -> None:
    old = _old()
    chunk = ck.encode_chunk(old, np.zeros_like(old))
    meta = {**chunk.meta, "streams": chunk.meta["streams"][:1]}
    with pytest.raises(CorruptDeltaError) as exc:
        ck.decode_chunk(meta, memoryview(b"".join(chunk.payload)), old, WHAT)
    assert str(exc.value) == f"{WHAT}: expected 2 streams"


def _exp_edit(key: str, value: Any) -> Callable[[Meta], Meta]:
    def edit(meta: Meta) -> Meta:
        if key in ("hot", "cold") and isinstance(value, dict):
            return {**meta, key: {**meta[key], **value}}
        return {**meta, key: value}

    return edit


HOT_BF16 = FLOAT_LAYOUTS["BF16"].max_exponent + 1

EXP_DAMAGE: list[tuple[str, Callable[[Meta], Meta], str | None, str]] = [
    ("an integer dtype", lambda m: m, "U16", "sparse_exp needs a floating-point dtype, not U16"),
    ("no dtype", lambda m: m, None, "sparse_exp needs a floating-point dtype, not None"),
    (
        "threshold 0",
        _exp_edit("threshold", 0),
        "BF16",
        f"field 'threshold' must be an integer in [1, {HOT_BF16}], got 0",
    ),
    (
        "threshold past the exponents",
        _exp_edit("threshold", HOT_BF16 + 1),
        "BF16",
        f"field 'threshold' must be an integer in [1, {HOT_BF16}], got {HOT_BF16 + 1}",
    ),
    ("no hot run", _exp_edit("hot", None), "BF16", "hot: run fields must be an object"),
    ("cold run text", _exp_edit("cold", "x"), "BF16", "cold: run fields must be an object"),
    (
        "a hot run past the hot set",
        _exp_edit("hot", {"count": 4096}),
        "BF16",
        "hot: field 'count' must be an integer in [0, ",
    ),
    (
        "a cold run past the cold set",
        _exp_edit("cold", {"count": 4096}),
        "BF16",
        "cold: field 'count' must be an integer in [0, ",
    ),
    (
        "both runs empty",
        lambda m: {
            **m,
            "hot": dict.fromkeys(m["hot"], 0),
            "cold": dict.fromkeys(m["cold"], 0),
            "streams": [],
        },
        "BF16",
        "a sparse chunk must change at least one element",
    ),
]


@pytest.mark.parametrize(
    ("edit", "dtype", "text"), [d[1:] for d in EXP_DAMAGE], ids=[d[0] for d in EXP_DAMAGE]
)
def test_a_sparse_exp_chunk_with_a_wrong_field_is_refused_saying_which(
    edit: Callable[[Meta], Meta], dtype: str | None, text: str
) -> None:
    old, _, chunk = _exp_chunk()
    with pytest.raises(CorruptDeltaError) as exc:
        ck.decode_chunk(edit(chunk.meta), memoryview(b"".join(chunk.payload)), old, WHAT, dtype)
    assert str(exc.value).startswith(f"{WHAT}: {text}"), str(exc.value)


def test_a_sparse_exp_threshold_at_its_upper_bound_passes_the_field_check() -> None:
    # Every finite exponent hot is the bound's upper end: allowed, whatever the runs then say.
    old, _, chunk = _exp_chunk()
    meta = {**chunk.meta, "threshold": HOT_BF16}
    try:
        ck.decode_chunk(meta, memoryview(b"".join(chunk.payload)), old, WHAT, "BF16")
    except CorruptDeltaError as exc:
        assert "'threshold'" not in str(exc), str(exc)


# A BF16 parent of 64 elements made for sparse_exp at threshold 120: every sixth element cold
# (exponent 127), the others hot (exponents 100..106, out of position order).
THRESHOLD = 120
COLD = list(range(0, 64, 6))


def _exp_parent() -> np.ndarray:
    exps = [127 if i in COLD else 100 + (i * 5) % 7 for i in range(64)]
    return np.array([(e << 7) | (i & 0x7F) | (i % 2) << 15 for i, e in enumerate(exps)], np.uint16)


def _exp_meta(hot: tuple[int, int], cold: tuple[int, int]) -> tuple[Meta, bytes]:
    """A sparse_exp chunk whose hot and cold runs (count, quotient of every gap) add 1 to each
    element they name (shift 0: the gaps are the quotients)."""
    runs: dict[str, Any] = {}
    planes: list[bytes] = []
    for key, (count, quotient) in (("hot", hot), ("cold", cold)):
        runs[key] = {"count": count, "shift": 0, "quotient_planes": 1, "value_planes": 1}
        if not count:
            runs[key] = dict.fromkeys(runs[key], 0)
            continue
        planes += [bytes([quotient]) * count, bytes([_zigzag(1)]) * count]
    meta = {"encoding": "sparse_exp", "threshold": THRESHOLD, **runs}
    meta["streams"] = [["raw", len(p), 8] for p in planes]
    return meta, b"".join(planes)


def test_a_sparse_exp_chunk_changing_only_hot_elements_rebuilds_the_child() -> None:
    old = _exp_parent()
    hot = [i for i in range(64) if i not in COLD]
    meta, payload = _exp_meta((len(hot), 0), (0, 0))
    decoded = ck.decode_chunk(meta, memoryview(payload), old, WHAT, "BF16")
    assert decoded.positions is not None and decoded.values is not None
    assert sorted(decoded.positions.tolist()) == hot
    rebuilt = old.copy()
    rebuilt[decoded.positions] = decoded.values
    assert np.array_equal(rebuilt, _child(old, dict.fromkeys(hot, 1)))
    assert decoded.changed == len(hot)


def test_a_sparse_exp_chunk_changing_only_cold_elements_rebuilds_the_child() -> None:
    old = _exp_parent()
    meta, payload = _exp_meta((0, 0), (len(COLD), 0))
    out = np.empty_like(old)
    decoded = ck.decode_chunk(meta, memoryview(payload), old, WHAT, "BF16", out=out)
    assert decoded.dense is out and np.array_equal(out, _child(old, dict.fromkeys(COLD, 1)))
    assert (decoded.base_checksum, decoded.target_checksum) == (adler32(old), adler32(out))


@pytest.mark.parametrize("run", ["hot", "cold"])
def test_a_sparse_exp_run_leaving_its_set_is_refused_naming_the_chunk(run: str) -> None:
    # One change 60 past the start of a set of 11 cold or 53 hot elements.
    old = _exp_parent()
    meta, payload = _exp_meta(
        (1, 60) if run == "hot" else (0, 0), (1, 60) if run == "cold" else (0, 0)
    )
    with pytest.raises(CorruptDeltaError) as exc:
        ck.decode_chunk(meta, memoryview(payload), old, WHAT, "BF16")
    assert str(exc.value) == f"{WHAT}: a gap between changed positions exceeds the chunk"


@pytest.mark.usefixtures("arc_decoder")
def test_a_remainder_carrying_a_gap_past_the_chunk_is_refused() -> None:
    # Shift 4 in a chunk of 1000: quotient 62 passes its own bound (999 >> 4), but with the
    # remainder 15 the gap is 62 * 16 + 15 = 1007, past the chunk's last element.
    old = _old()
    meta, payload = _sparse([1007], [1], 4, 2)
    for call in (
        lambda: ck.chunk_changes(meta, memoryview(payload), N, old.dtype, WHAT),
        lambda: ck.decode_chunk(meta, memoryview(payload), old, WHAT, out=np.empty_like(old)),
    ):
        with pytest.raises(CorruptDeltaError) as exc:
            call()
        # The kernel adds which change: "(change 0)".
        assert str(exc.value).startswith(
            f"{WHAT}: a gap between changed positions exceeds the chunk"
        )
