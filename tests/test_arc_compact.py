"""The compact mode (`sparse_exp`: the parent's exponent as context) round-trips and pays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from hotload.arc import decode, encode
from hotload.arc.chunk import FLOAT_LAYOUTS, SPARSE_EXP, decode_chunk, encode_chunk
from hotload.arc.container import read_header
from hotload.errors import ArcError
from support.snapshots import adam_like_step, write_bf16


def test_compact_delta_is_smaller_and_rebuilds_bit_for_bit(tmp_path: Path) -> None:
    a0, a1 = adam_like_step(300_000, 1)
    b0, b1 = adam_like_step(200_000, 2)
    write_bf16(tmp_path / "s0", {"layers.0.w": a0, "layers.1.w": b0})
    write_bf16(tmp_path / "s1", {"layers.0.w": a1, "layers.1.w": b1})
    plain = encode(tmp_path / "s0", tmp_path / "s1", tmp_path / "plain", chunk_elements=100_000)
    compact = encode(
        tmp_path / "s0", tmp_path / "s1", tmp_path / "compact", chunk_elements=100_000, compact=True
    )
    assert compact.delta_bytes < 0.9 * plain.delta_bytes
    encodings = set()
    for shard in (tmp_path / "compact").glob("model-*.safetensors"):
        for t in read_header(shard).fields["tensors"]:
            encodings |= {c["encoding"] for c in t["chunks"]}
    assert SPARSE_EXP in encodings
    decode(tmp_path / "s0", tmp_path / "compact", tmp_path / "rebuilt")
    for f in (tmp_path / "s1").iterdir():
        assert (tmp_path / "rebuilt" / f.name).read_bytes() == f.read_bytes()


@pytest.mark.parametrize("dtype", sorted(FLOAT_LAYOUTS))
@settings(max_examples=15, deadline=None)
@given(seed=hst.integers(0, 2**32 - 1), rate=hst.sampled_from([0.001, 0.02, 0.2]))
def test_sparse_exp_round_trips_random_bits(dtype: str, seed: int, rate: float) -> None:
    rng = np.random.default_rng(seed)
    width = FLOAT_LAYOUTS[dtype].total_bits // 8
    utype = np.dtype(f"<u{width}")
    n = int(rng.integers(1, 40_000))
    # Mostly small magnitudes, some specials: the threshold split must cover every exponent.
    old = rng.integers(0, np.iinfo(utype).max, n, dtype=utype, endpoint=True)
    old[rng.random(n) < 0.3] >>= utype.type(width * 8 // 2)
    new = old.copy()
    hits = rng.random(n) < rate
    new[hits] += rng.integers(1, 4, int(hits.sum()), dtype=utype)
    chunk = encode_chunk(old, new, dtype=dtype, exponent_context=True)
    out = decode_chunk(chunk.meta, memoryview(b"".join(chunk.payload)), old, "t", dtype)
    rebuilt = old.copy()
    if out.dense is not None:
        rebuilt = out.dense
    elif out.positions is not None and out.values is not None:
        rebuilt[out.positions] = out.values
    assert np.array_equal(rebuilt, new)
    assert out.target_checksum == chunk.target_checksum


def test_sparse_exp_needs_a_float_dtype() -> None:
    old, new = adam_like_step(50_000, 3)
    chunk = encode_chunk(old, new, dtype="BF16", exponent_context=True)
    assert chunk.meta["encoding"] == SPARSE_EXP
    with pytest.raises(ArcError, match="floating-point dtype"):
        decode_chunk(chunk.meta, memoryview(b"".join(chunk.payload)), old, "t", "I16")


def test_sparse_exp_rejects_a_hot_count_beyond_the_hot_set() -> None:
    old, new = adam_like_step(50_000, 4)
    chunk = encode_chunk(old, new, dtype="BF16", exponent_context=True)
    meta = dict(chunk.meta)
    meta["hot"] = dict(meta["hot"], count=10**9)
    with pytest.raises(ArcError, match="count"):
        decode_chunk(meta, memoryview(b"".join(chunk.payload)), old, "t", "BF16")


@pytest.mark.parametrize("dtype", sorted(FLOAT_LAYOUTS))
@pytest.mark.parametrize("threshold_at", [0.0, 0.5, 1.0])
def test_sparse_exp_every_threshold_round_trips(dtype: str, threshold_at: float) -> None:
    from hotload.arc.chunk import EncodedChunk, encode_sparse_exp

    layout = FLOAT_LAYOUTS[dtype]
    rng = np.random.default_rng(7)
    utype = np.dtype(f"<u{layout.total_bits // 8}")
    old = rng.integers(0, np.iinfo(utype).max, 5000, dtype=utype, endpoint=True)
    new = old.copy()
    hits = rng.random(old.size) < 0.05
    new[hits] ^= utype.type(1)
    idx = np.flatnonzero(old != new)
    threshold = max(1, round(threshold_at * (layout.max_exponent + 1)))
    meta, payload = encode_sparse_exp(old, new, idx, threshold=threshold, layout=layout, level=1)
    chunk = EncodedChunk(meta, payload)
    out = decode_chunk(meta, memoryview(b"".join(chunk.payload)), old, "t", dtype)
    assert out.positions is not None and out.values is not None
    rebuilt = old.copy()
    rebuilt[out.positions] = out.values
    assert np.array_equal(rebuilt, new)


def test_compact_delta_on_the_wrong_parent_says_so(tmp_path: Path) -> None:
    from hotload.errors import WrongParentError

    a0, a1 = adam_like_step(200_000, 5)
    other, _ = adam_like_step(200_000, 6)
    write_bf16(tmp_path / "s0", {"layers.0.w": a0})
    write_bf16(tmp_path / "s1", {"layers.0.w": a1})
    write_bf16(tmp_path / "x", {"layers.0.w": other})
    encode(tmp_path / "s0", tmp_path / "s1", tmp_path / "d", compact=True)
    with pytest.raises(WrongParentError, match="another snapshot"):
        decode(tmp_path / "x", tmp_path / "d", tmp_path / "out")
    assert not (tmp_path / "out").exists()
