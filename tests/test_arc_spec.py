"""docs/arc_v2.md is complete: a decoder written only from it rebuilds hotload's deltas exactly.

The decoder under test (`support.arc_spec_decoder`) imports nothing from hotload; hotload is used
here only to write full snapshots and to encode deltas.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from hotload.arc import encode
from hotload.arc.chunk import FLOAT_LAYOUTS as REFERENCE_FLOAT_LAYOUTS
from hotload.arc.chunk import encode_sparse_exp
from hotload.snapshot import RawTensor, write_snapshot
from support.arc_spec_decoder import (
    FLOAT_LAYOUTS,
    ChecksumError,
    SpecDecodeError,
    decode_chunk,
    decode_shard,
    decode_shard_file,
    parse_delta,
    read_delta_header,
    rebuild_shard,
    untouched_shards,
)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "arc_v2.md"
CONFIG = {"model_type": "toy", "hidden_size": 64}
SHARD = "model-00001-of-00001.safetensors"


# --- building snapshots ------------------------------------------------------------------------


def _bf16(x: np.ndarray) -> RawTensor:
    """Round float32 values to bfloat16 bit patterns (nearest even)."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return RawTensor("BF16", x.shape, rounded.astype(np.uint16).view(np.uint8))


def _fp8_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """E4M3-shaped bytes of bell-shaped values: a few exponents, random sign and mantissa."""
    sign = rng.integers(0, 2, n, dtype=np.uint8) << np.uint8(7)
    exponent = np.clip(np.rint(rng.normal(7, 1.2, n)), 1, 14).astype(np.uint8) << np.uint8(3)
    mantissa = rng.integers(0, 8, n, dtype=np.uint8)
    out: np.ndarray = sign | exponent | mantissa
    return out


def _ulp_nudge(
    rng: np.random.Generator, bits: np.ndarray, fraction: float, spread: int = 1
) -> np.ndarray:
    """Change about `fraction` of the elements by a few units in the last place (wrapping)."""
    out = bits.reshape(-1).copy()
    mask = rng.random(out.size) < fraction
    steps = rng.integers(1, spread + 1, int(mask.sum())).astype(bits.dtype)
    up = rng.random(int(mask.sum())) < 0.5
    out[mask] = np.where(up, out[mask] + steps, out[mask] - steps)
    return out.reshape(bits.shape)


def _weights(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A parent and a child state dict whose changes call for every chunk encoding."""
    rng = np.random.default_rng(seed)
    prev: dict[str, Any] = {}
    cur: dict[str, Any] = {}

    # Unchanged: every chunk `same`.
    embed = rng.standard_normal((40, 250), dtype=np.float32)
    prev["model.embed_tokens.weight"] = embed
    cur["model.embed_tokens.weight"] = embed.copy()

    # ~1% of F16 values move by 1 ulp: `sparse`.
    q = rng.standard_normal((100, 100)).astype(np.float16)
    prev["model.layers.0.self_attn.q_proj.weight"] = q
    cur["model.layers.0.self_attn.q_proj.weight"] = _ulp_nudge(rng, q.view(np.uint16), 0.01).view(
        np.float16
    )

    # ~0.1% of F32 values change arbitrarily: long gaps (shift >= 8), 4 value planes.
    k = rng.standard_normal(20_000, dtype=np.float32)
    k_new = k.copy()
    hit = rng.random(k.size) < 0.001
    k_new[hit] = rng.standard_normal(int(hit.sum()), dtype=np.float32)
    prev["model.layers.0.self_attn.k_proj.weight"] = k
    cur["model.layers.0.self_attn.k_proj.weight"] = k_new

    # ~0.05% of F32 values move by 1 ulp: gaps of thousands, remainders over two planes.
    v = rng.standard_normal(65_536, dtype=np.float32)
    prev["model.layers.0.self_attn.v_proj.weight"] = v
    cur["model.layers.0.self_attn.v_proj.weight"] = _ulp_nudge(rng, v.view(np.uint32), 0.0005).view(
        np.float32
    )

    # ~30% of BF16 values move by up to 3 ulps.
    up = rng.standard_normal((97, 127), dtype=np.float32)
    up_bf16 = _bf16(up)
    prev["model.layers.0.mlp.up_proj.weight"] = up_bf16
    cur["model.layers.0.mlp.up_proj.weight"] = RawTensor(
        "BF16",
        up_bf16.shape,
        _ulp_nudge(rng, up_bf16.data.view(np.uint16), 0.30, spread=3).view(np.uint8),
    )

    # ~90% of F32 values perturbed by a few ulps: `dense`.
    down = rng.standard_normal(9_000, dtype=np.float32)
    prev["model.layers.1.mlp.down_proj.weight"] = down
    cur["model.layers.1.mlp.down_proj.weight"] = _ulp_nudge(
        rng, down.view(np.uint32), 0.9, spread=4
    ).view(np.float32)

    # ~30% of I8 values change by small signed steps, wrapping past -128/127.
    norm = rng.integers(-128, 128, 3_000, dtype=np.int16).astype(np.int8)
    norm_new = norm.copy()
    hit = rng.random(norm.size) < 0.3
    norm_new[hit] = (norm_new[hit].astype(np.int16) + rng.integers(-3, 4, int(hit.sum()))).astype(
        np.int8
    )
    prev["model.layers.1.input_layernorm.weight"] = norm
    cur["model.layers.1.input_layernorm.weight"] = norm_new

    # ~1% of U8 values jump by 200 (wrapping arithmetic).
    codes = rng.integers(0, 256, 5_000, dtype=np.uint8)
    codes_new = codes.copy()
    hit = rng.random(codes.size) < 0.01
    codes_new[hit] += np.uint8(200)
    prev["model.layers.1.codes"] = codes
    cur["model.layers.1.codes"] = codes_new

    # FP8 weights redrawn from scratch: the new values beat the differences, `raw`.
    fp8_old = rng.integers(0, 256, 8_000, dtype=np.uint8)
    prev["model.layers.2.mlp.gate_proj.weight"] = RawTensor("F8_E4M3", (80, 100), fp8_old)
    cur["model.layers.2.mlp.gate_proj.weight"] = RawTensor(
        "F8_E4M3", (80, 100), _fp8_like(rng, 8_000)
    )

    # Fully random U8 bytes, old and new.
    noise = rng.integers(0, 256, 4_500, dtype=np.uint8)
    prev["model.layers.2.noise"] = noise
    cur["model.layers.2.noise"] = rng.integers(0, 256, 4_500, dtype=np.uint8)

    # One F32 tensor whose quarters change differently: several encodings in one tensor.
    mixed = rng.standard_normal(16_384, dtype=np.float32)
    quarters = np.split(mixed.view(np.uint32).copy(), 4)
    quarters[1] = _ulp_nudge(rng, quarters[1], 0.01)
    quarters[2] = _ulp_nudge(rng, quarters[2], 0.9, spread=2)
    quarters[3] = rng.standard_normal(quarters[3].size, dtype=np.float32).view(np.uint32)
    prev["model.layers.2.mixed"] = mixed
    cur["model.layers.2.mixed"] = np.concatenate(quarters).view(np.float32)

    # Edge shapes: a scalar that changes and an empty tensor.
    prev["lm_head.scale"] = np.array(1.5, dtype=np.float32)
    cur["lm_head.scale"] = np.array(-2.25, dtype=np.float32)
    prev["lm_head.empty"] = np.zeros((0, 8), dtype=np.float16)
    cur["lm_head.empty"] = np.zeros((0, 8), dtype=np.float16)
    return prev, cur


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A parent and a child full snapshot, written by hotload."""
    root = tmp_path_factory.mktemp("arc_spec")
    prev, cur = _weights(seed=7)
    write_snapshot(root / "step-1", prev, config=CONFIG)
    write_snapshot(root / "step-2", cur, config=CONFIG)
    return root / "step-1", root / "step-2"


def _shards(snapshot: Path) -> list[str]:
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def _header_names(shard: Path) -> set[str]:
    full = shard.read_bytes()
    (header_len,) = struct.unpack_from("<Q", full)
    return set(json.loads(full[8 : 8 + header_len])) - {"__metadata__"}


def _shipped(delta: Path) -> list[str]:
    """The shards a delta folder holds: §2.2 leaves out those the step did not touch."""
    return [s for s in _shards(delta) if s not in untouched_shards(delta)]


def _encode(snapshots: tuple[Path, Path], out: Path, chunk_elements: int) -> Path:
    prev, cur = snapshots
    encode(prev, cur, out, identity="step-2", chunk_elements=chunk_elements, threads=2)
    return out


def _chunks(fields: dict[str, Any]) -> list[dict[str, Any]]:
    return [chunk for tensor in fields["tensors"] for chunk in tensor["chunks"]]


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_elements", [1_000, 4_096])
def test_spec_decoder_rebuilds_every_shard_exactly(
    snapshots: tuple[Path, Path], tmp_path: Path, chunk_elements: int
) -> None:
    prev, cur = snapshots
    delta = _encode(snapshots, tmp_path / "delta", chunk_elements)
    shards = _shards(cur)
    assert len(shards) >= 4
    assert _shards(delta) == shards

    # §2: the manifests are those of the rebuilt snapshot, byte for byte.
    for manifest in ("model.safetensors.index.json", "model.weight.spec.json"):
        assert (delta / manifest).read_bytes() == (cur / manifest).read_bytes()

    encodings: Counter[str] = Counter()
    codecs: Counter[str] = Counter()
    bits: Counter[int] = Counter()
    shifts: set[int] = set()
    multi_chunk_tensors = 0
    per_tensor: dict[str, set[str]] = {}
    untouched = untouched_shards(delta)
    for shard in shards:
        rebuilt = rebuild_shard(prev, delta, shard, expected_parent="step-1")
        assert rebuilt == (cur / shard).read_bytes(), shard
        if shard in untouched:
            # §2.2: left alone, not shipped, and pinned by the parent's header as stored.
            assert not (delta / shard).exists()
            full = (prev / shard).read_bytes()
            (header_len,) = struct.unpack_from("<Q", full)
            assert (
                untouched[shard] == "sha256:" + hashlib.sha256(full[: 8 + header_len]).hexdigest()
            )
            continue

        fields = read_delta_header(delta / shard)
        assert fields["format"] == "arc_v2"
        assert fields["version"] == 1
        assert fields["parent"] == "step-1"
        assert fields["identity"] == "step-2"
        assert fields["checksum"] == "adler32"
        assert fields["chunk_elements"] == chunk_elements
        # §4.1: target_header is the rebuilt shard's header, padding included.
        full = (cur / shard).read_bytes()
        (header_len,) = struct.unpack_from("<Q", full)
        assert fields["target_header"].encode() == full[8 : 8 + header_len]
        multi_chunk_tensors += sum(len(t["chunks"]) > 1 for t in fields["tensors"])
        per_tensor.update(
            {t["name"]: {c["encoding"] for c in t["chunks"]} for t in fields["tensors"]}
        )
        for chunk in _chunks(fields):
            encodings[chunk["encoding"]] += 1
            for codec, _stored, width in chunk.get("streams", []):
                codecs[codec] += 1
                bits[width] += 1
            if chunk["encoding"] == "sparse":
                shifts.add(chunk["shift"])

    assert set(encodings) == {"same", "sparse", "dense", "raw"}, encodings
    # Each kind of change gets the encoding it was designed to trigger.
    # The unchanged embeddings' shard is left alone; `same` chunks show in the mixed tensor.
    embed = next(s for s in shards if "model.embed_tokens.weight" in _header_names(cur / s))
    assert set(untouched) == {embed}, untouched
    assert "model.embed_tokens.weight" not in per_tensor
    assert per_tensor["model.layers.0.self_attn.q_proj.weight"] == {"sparse"}  # ~1%
    assert per_tensor["model.layers.1.mlp.down_proj.weight"] == {"dense"}  # ~90%
    assert per_tensor["model.layers.2.mlp.gate_proj.weight"] == {"raw"}  # redrawn
    assert per_tensor["model.layers.2.mixed"] == {"same", "sparse", "dense", "raw"}
    assert per_tensor["lm_head.empty"] == set()  # no elements, no chunks
    assert set(codecs) == {"zstd", "raw"}, codecs
    assert set(bits) == {1, 2, 4, 8}, bits
    assert max(shifts) >= 8, shifts
    if chunk_elements >= 4_096:
        assert max(shifts) > 8, shifts  # remainders over two planes, the top one partial
    assert multi_chunk_tensors >= 5


def test_chunk_layout_matches_the_spec(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """§4.3/§5: chunk counts, contiguous offsets, lengths = sum of stored lengths."""
    _, cur = snapshots
    delta = _encode(snapshots, tmp_path / "delta", 1_000)
    spec = json.loads((cur / "model.weight.spec.json").read_text())["tensor_map"]
    for shard in _shipped(delta):
        parsed = parse_delta((delta / shard).read_bytes())
        offset = 0
        for tensor in parsed.fields["tensors"]:
            numel = int(np.prod(spec[tensor["name"]]["shape"], dtype=np.int64))
            assert len(tensor["chunks"]) == -(-numel // 1_000)
            for chunk in tensor["chunks"]:
                assert chunk["offset"] == offset
                assert chunk["length"] == sum(s[1] for s in chunk.get("streams", []))
                offset += chunk["length"]
        assert offset == len(parsed.payload)


# --- compact mode: `sparse_exp` on optimizer updates -------------------------------------------


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 bit patterns (nearest even), as uint16."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out: np.ndarray = rounded.astype(np.uint16)
    return out


def _adam_step(rng: np.random.Generator, bits: np.ndarray, dtype: str) -> np.ndarray:
    """One Adam-like step at lr 1e-6: w - lr·|N(0,1)|·sign in float32, rounded back to `dtype`.

    Only weights whose unit in the last place is below about 2·lr move, so the parent's exponent
    predicts which elements change: the case `sparse_exp` is built for.
    """
    if dtype == "BF16":
        w = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        w = bits.view(np.float16).astype(np.float32)
    sign = rng.integers(0, 2, bits.shape).astype(np.float32) * np.float32(2) - np.float32(1)
    step = np.float32(1e-6) * np.abs(rng.standard_normal(bits.shape, dtype=np.float32)) * sign
    moved = w - step
    if dtype == "BF16":
        return _bf16_bits(moved)
    out: np.ndarray = moved.astype(np.float16).view(np.uint16)
    return out


COMPACT_TENSORS = {
    # name: (dtype, shape); weights ~ N(0, 0.02)
    "model.layers.0.mlp.up_proj.weight": ("BF16", (256, 512)),
    "model.layers.0.self_attn.o_proj.weight": ("BF16", (300, 211)),
    "model.layers.1.mlp.down_proj.weight": ("F16", (128, 512)),
    "model.norm.weight": ("BF16", (512,)),
}


def _compact_chain(seed: int, steps: int) -> list[dict[str, Any]]:
    """State dicts of `steps + 1` consecutive training steps."""
    rng = np.random.default_rng(seed)
    bits: dict[str, np.ndarray] = {}
    for name, (dtype, shape) in COMPACT_TENSORS.items():
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        bits[name] = _bf16_bits(w) if dtype == "BF16" else w.astype(np.float16).view(np.uint16)
    # Not float-exponent shaped: 1% of F32 values nudged anywhere, and integer counters.
    k = rng.standard_normal(10_000, dtype=np.float32)
    counts = rng.integers(0, 1000, 5_000, dtype=np.int32)
    states: list[dict[str, Any]] = []
    for _ in range(steps + 1):
        state: dict[str, Any] = {
            name: RawTensor(dtype, shape, bits[name].reshape(-1).view(np.uint8).copy())
            for name, (dtype, shape) in COMPACT_TENSORS.items()
        }
        state["model.layers.1.self_attn.k_proj.weight"] = k.copy()
        state["model.layers.1.counts"] = counts.copy()
        states.append(state)
        for name, (dtype, _shape) in COMPACT_TENSORS.items():
            if name != "model.norm.weight":  # stays `same`
                bits[name] = _adam_step(rng, bits[name], dtype)
        k = _ulp_nudge(rng, k.view(np.uint32), 0.01).view(np.float32)
        hit = rng.random(counts.size) < 0.01
        counts[hit] += 1
    return states


@pytest.fixture(scope="module")
def compact_chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three consecutive full snapshots of Adam-like updates, written by hotload."""
    root = tmp_path_factory.mktemp("arc_spec_compact")
    paths = []
    for i, state in enumerate(_compact_chain(seed=11, steps=2)):
        write_snapshot(root / f"step-{i}", state, config=CONFIG)
        paths.append(root / f"step-{i}")
    return paths


@pytest.mark.parametrize("chunk_elements", [16_384, 1 << 17])
def test_spec_decoder_rebuilds_compact_deltas_exactly(
    compact_chain: list[Path], tmp_path: Path, chunk_elements: int
) -> None:
    """§7.3: `encode(..., compact=True)` writes `sparse_exp`; the spec rebuilds a chain of them."""
    dtypes: dict[str, str] = {}
    for tensor, spec in json.loads((compact_chain[0] / "model.weight.spec.json").read_text())[
        "tensor_map"
    ].items():
        dtypes[tensor] = spec["dtype"]
    encodings: Counter[str] = Counter()
    by_dtype: dict[str, set[str]] = {}
    both_runs = one_run = 0
    # Rebuild step-2 from step-0 through the rebuilt step-1, as a loader following a chain does.
    rebuilt: dict[str, bytes] = {
        s: (compact_chain[0] / s).read_bytes() for s in _shards(compact_chain[0])
    }
    for i in (1, 2):
        delta = tmp_path / f"delta-{i}"
        encode(
            compact_chain[i - 1],
            compact_chain[i],
            delta,
            identity=f"step-{i}",
            chunk_elements=chunk_elements,
            compact=True,
            threads=2,
        )
        for shard in _shards(compact_chain[i]):
            if shard in untouched_shards(delta):
                rebuilt[shard] = rebuild_shard(compact_chain[i - 1], delta, shard)
                assert rebuilt[shard] == (compact_chain[i] / shard).read_bytes(), (i, shard)
                encodings["untouched shard"] += 1
                continue
            blob = (delta / shard).read_bytes()
            rebuilt[shard] = decode_shard(rebuilt[shard], blob, expected_parent=f"step-{i - 1}")
            assert rebuilt[shard] == (compact_chain[i] / shard).read_bytes(), (i, shard)
            for tensor in parse_delta(blob).fields["tensors"]:
                for chunk in tensor["chunks"]:
                    encodings[chunk["encoding"]] += 1
                    by_dtype.setdefault(dtypes[tensor["name"]], set()).add(chunk["encoding"])
                    if chunk["encoding"] == "sparse_exp":
                        counts = (chunk["hot"]["count"], chunk["cold"]["count"])
                        both_runs += min(counts) > 0
                        one_run += min(counts) == 0
                        for run in (chunk["hot"], chunk["cold"]):
                            if run["count"] == 0:  # §7.3: an empty run is all zeros
                                assert run == dict.fromkeys(run, 0)

    assert encodings["sparse_exp"] >= 4, encodings
    assert both_runs >= 2, (both_runs, one_run)
    assert "sparse_exp" in by_dtype["BF16"] and "sparse_exp" in by_dtype["F16"], by_dtype
    # Only float dtypes may use it; integer changes, and F32 changes that the exponent does not
    # predict, stay `sparse`.
    assert by_dtype["I32"] == {"sparse"}, by_dtype
    assert by_dtype["F32"] == {"sparse"}, by_dtype
    # The unchanged tensors' shards are left alone (§2.2) rather than shipped all `same`.
    assert "sparse_exp" in encodings and encodings["untouched shard"] >= 1, encodings


def _random_float_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Any bit patterns (NaNs, infinities, subnormals, signed zeros), many of small magnitude."""
    udtype = np.dtype(f"<u{FLOAT_LAYOUTS[dtype][1] // 8}")
    old = rng.integers(0, np.iinfo(udtype).max, n, dtype=udtype, endpoint=True)
    small = rng.random(n) < 0.4
    old[small] >>= udtype.type(rng.integers(1, FLOAT_LAYOUTS[dtype][1] - 1))
    return old


@pytest.mark.parametrize("dtype", sorted(FLOAT_LAYOUTS))
def test_sparse_exp_chunks_match_the_reference_encoder(dtype: str) -> None:
    """§7.3 against hotload's encoder, for every float layout and every kind of threshold.

    Thresholds 1 and max_exponent + 1 make the hot list (nearly) empty and full; changes
    confined to one side leave the other run empty (count 0, no streams).
    """
    mantissa_bits, total_bits = FLOAT_LAYOUTS[dtype]
    reference = REFERENCE_FLOAT_LAYOUTS[dtype]
    assert (reference.mantissa_bits, reference.total_bits) == (mantissa_bits, total_bits)
    max_exponent = (1 << (total_bits - 1 - mantissa_bits)) - 1
    rng = np.random.default_rng(total_bits * 100 + mantissa_bits)
    empty_runs: Counter[str] = Counter()
    for case in range(24):
        n = int(rng.integers(1, 6_000))
        old = _random_float_bits(rng, dtype, n)
        threshold = [1, max_exponent + 1, int(rng.integers(1, max_exponent + 2))][case % 3]
        exponent = (old.astype(np.uint64) & np.uint64((1 << (total_bits - 1)) - 1)) >> np.uint64(
            mantissa_bits
        )
        hot = exponent < threshold
        hit = rng.random(n) < [0.001, 0.05, 0.3][case // 3 % 3]
        if case % 8 == 6:
            hit &= ~hot  # only cold elements change
        elif case % 8 == 7:
            hit &= hot  # only hot elements change
        if not hit.any():
            hit[int(rng.integers(0, n))] = True
        new = old.copy()
        steps = rng.integers(1, 1 << (total_bits - 1), int(hit.sum()), dtype=np.uint64)
        new[hit] += steps.astype(old.dtype)
        idx = np.flatnonzero(old != new)
        if idx.size == 0:
            continue
        meta, parts = encode_sparse_exp(
            old, new, idx, threshold=threshold, layout=reference, level=1
        )
        assert meta["hot"]["count"] == int(hot[idx].sum())
        assert meta["cold"]["count"] == int((~hot[idx]).sum())
        for side in ("hot", "cold"):
            empty_runs[side] += meta[side]["count"] == 0
        rebuilt = decode_chunk(meta, b"".join(parts), old, dtype)
        assert np.array_equal(rebuilt, new), (dtype, case, threshold)
    assert empty_runs["hot"] and empty_runs["cold"], empty_runs


# --- integrity ---------------------------------------------------------------------------------


def _crc_fixed(fields: dict[str, Any], payload: bytes) -> dict[str, Any]:
    """A copy of `fields` whose chunk `crc32`s match `payload` (where the chunk lies in it)."""
    copy: dict[str, Any] = json.loads(json.dumps(fields))
    for tensor in copy.get("tensors", []):
        for chunk in tensor.get("chunks", []) if isinstance(tensor, dict) else []:
            if not isinstance(chunk, dict):
                continue
            off, length = chunk.get("offset"), chunk.get("length")
            if isinstance(off, int) and isinstance(length, int) and off + length <= len(payload):
                chunk["crc32"] = f"{zlib.crc32(payload[off : off + length]):08x}"
    return copy


def _craft(fields: dict[str, Any], payload: bytes, *, fix_crc: bool = True) -> bytes:
    """A delta shard of `fields` and `payload` (§3), chunk CRCs recomputed unless told not to."""
    if fix_crc:
        fields = _crc_fixed(fields, payload)
    body = json.dumps(fields, separators=(",", ":")).encode()
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(body)
    return b"\x89ARCv2\r\n" + struct.pack("<QI", len(frame), zlib.crc32(frame)) + frame + payload


def _payload_start(blob: bytes) -> int:
    (frame_len,) = struct.unpack_from("<Q", blob, 8)
    return 20 + int(frame_len)


def _value_streams(chunk: dict[str, Any]) -> list[int]:
    """Indices of the chunk's value (or raw-element) streams, in stream order."""
    runs = {"sparse": [chunk], "sparse_exp": [chunk.get("hot"), chunk.get("cold")]}
    if chunk["encoding"] not in runs:
        return list(range(len(chunk["streams"])))
    out: list[int] = []
    first = 0
    for run in runs[chunk["encoding"]]:
        if run["count"]:
            first += -(-run["shift"] // 8) + run["quotient_planes"]
            out += range(first, first + run["value_planes"])
            first += run["value_planes"]
    return out


def _flip_target(chunk: dict[str, Any]) -> tuple[int, bool]:
    """Where in a chunk to flip bit 0 so that the tensor checksum alone is sure to notice.

    Flipping the first byte of a zstd stream breaks its magic (a structural error). In a raw
    stream of value (or raw-element) symbols it changes exactly one element by one symbol bit,
    which adler32 always detects. (Flipping a *gap* symbol moves every later position; adler32
    misses that whenever the byte changes sum to zero: see
    `test_crc32_catches_a_shifted_gap_that_adler32_misses`.) Returns the byte offset within
    the chunk and whether the checksum, rather than the structure, must catch it.
    """
    streams = chunk["streams"]
    values = _value_streams(chunk)
    target = next((i for i in values if streams[i][0] == "raw"), values[0])
    offset = sum(s[1] for s in streams[:target])
    return offset, streams[target][0] == "raw"


def _deltas(
    snapshots: tuple[Path, Path], compact_chain: list[Path], tmp_path: Path
) -> list[tuple[Path, Path]]:
    """(parent snapshot, delta) pairs covering every encoding, `sparse_exp` included."""
    plain = _encode(snapshots, tmp_path / "delta", 1_000)
    compact = tmp_path / "compact"
    encode(compact_chain[0], compact_chain[1], compact, chunk_elements=16_384, compact=True)
    return [(snapshots[0], plain), (compact_chain[0], compact)]


def test_flipped_payload_byte_is_refused(
    snapshots: tuple[Path, Path], compact_chain: list[Path], tmp_path: Path
) -> None:
    """§8.2: any flipped bit in a chunk's stored bytes fails its CRC-32, before decoding."""
    rng = np.random.default_rng(3)
    flips: Counter[str] = Counter()
    for prev, delta in _deltas(snapshots, compact_chain, tmp_path):
        for shard in _shipped(delta):
            blob = (delta / shard).read_bytes()
            parent = (prev / shard).read_bytes()
            start = _payload_start(blob)
            for chunk in _chunks(parse_delta(blob).fields):
                if chunk["encoding"] == "same":
                    continue
                bad = bytearray(blob)
                where = start + chunk["offset"] + int(rng.integers(0, chunk["length"]))
                bad[where] ^= 1 << int(rng.integers(0, 8))
                with pytest.raises(SpecDecodeError, match="CRC-32"):
                    decode_shard(parent, bytes(bad))
                flips[chunk["encoding"]] += 1
    assert set(flips) == {"sparse", "sparse_exp", "dense", "raw"}, flips
    assert sum(flips.values()) > 20

    # The same on disk, through the file API: the last payload byte of a changed shard.
    prev, delta = snapshots[0], tmp_path / "delta"
    shard = next(s for s in _shipped(delta) if "layers.1" in _tensor_names(delta / s))
    damaged = bytearray((delta / shard).read_bytes())
    damaged[-1] ^= 0xFF
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="CRC-32"):
        decode_shard_file(prev / shard, broken)


def test_tensor_checksums_catch_what_a_matching_crc_lets_through(
    snapshots: tuple[Path, Path], compact_chain: list[Path], tmp_path: Path
) -> None:
    """§8.1: with the chunk CRCs made to match, structure checks and adler32 still refuse."""
    flips: Counter[str] = Counter()
    for prev, delta in _deltas(snapshots, compact_chain, tmp_path):
        for shard in _shipped(delta):
            blob = (delta / shard).read_bytes()
            parent = (prev / shard).read_bytes()
            good = parse_delta(blob)
            for chunk in _chunks(good.fields):
                if chunk["encoding"] == "same":
                    continue
                where, by_checksum = _flip_target(chunk)
                bad = bytearray(good.payload)
                bad[chunk["offset"] + where] ^= 0x01
                expected = ChecksumError if by_checksum else SpecDecodeError
                with pytest.raises(expected) as caught:
                    decode_shard(parent, _craft(good.fields, bytes(bad)))
                assert "CRC-32" not in str(caught.value)
                flips[f"{chunk['encoding']}/{'checksum' if by_checksum else 'structure'}"] += 1
    assert {"sparse/checksum", "sparse_exp/checksum", "dense/structure"} <= set(flips), flips


def test_crc32_catches_a_shifted_gap_that_adler32_misses() -> None:
    """§8.3: +1 at one position and -1 at another, both moved by a flipped gap.

    The rebuilt bytes keep the target's adler32 (the byte changes sum to zero), so only the
    chunk's CRC-32 tells that the weights are wrong.
    """
    vectors = _doc_vectors()
    parent = vectors["parent"]
    good = parse_delta(vectors["delta"])
    old, _ = _doc_example_weights()
    new = old.copy()
    new[10] += np.uint16(1)
    new[20] -= np.uint16(1)
    fields: dict[str, Any] = json.loads(json.dumps(good.fields))
    tensor = fields["tensors"][0]
    tensor["checksum"] = f"{zlib.adler32(new.tobytes()):08x}"
    # Gaps [10, 9] (shift 0, one quotient plane) and zigzagged changes [2, 1], all raw.
    payload = bytes([10, 9, 2, 1])
    tensor["chunks"] = [
        {
            "encoding": "sparse",
            "count": 2,
            "shift": 0,
            "quotient_planes": 1,
            "value_planes": 1,
            "streams": [["raw", 2, 8], ["raw", 2, 8]],
            "offset": 0,
            "length": 4,
        }
    ]
    target = decode_shard(parent, _craft(fields, payload))
    assert target[-128:] == new.tobytes()

    flipped = bytes([11, 9, 2, 1])  # the first gap's bit 0: positions 11 and 21
    delta = _craft(_crc_fixed(fields, payload), flipped, fix_crc=False)
    with pytest.raises(SpecDecodeError, match="CRC-32"):
        decode_shard(parent, delta)
    # Without the CRC (here: one recomputed over the flipped bytes) the damage goes unseen.
    wrong = decode_shard(parent, _craft(fields, flipped))
    assert wrong != target
    assert zlib.adler32(wrong[-128:]) == zlib.adler32(new.tobytes())


def test_corrupted_chunk_crc32_is_refused() -> None:
    """§4.3, §8.2: a chunk entry's `crc32` must be 8 lowercase hex digits equal to the CRC."""
    vectors = _doc_vectors()
    parent = vectors["parent"]
    good = parse_delta(vectors["delta"])
    crc = _vector_chunk(good.fields)["crc32"]
    assert crc == f"{zlib.crc32(good.payload):08x}"
    cases = {
        f"{int(crc, 16) ^ 1:08x}": "CRC-32",  # one bit off
        crc.upper() if crc.upper() != crc else "ABCDEF01": "malformed",
        "0x" + crc[2:]: "malformed",
        crc[:7]: "malformed",
        None: "malformed",
    }
    for value, match in cases.items():
        fields: dict[str, Any] = json.loads(json.dumps(good.fields))
        if value is None:
            del _vector_chunk(fields)["crc32"]
        else:
            _vector_chunk(fields)["crc32"] = value
        with pytest.raises(SpecDecodeError, match=match):
            decode_shard(parent, _craft(fields, good.payload, fix_crc=False))


def test_corrupted_header_crc_is_refused() -> None:
    """§3: the u32 at offset 16 is the CRC-32 of the header frame; a mismatch is corruption."""
    vectors = _doc_vectors()
    parent, delta = vectors["parent"], vectors["delta"]
    (frame_len, frame_crc) = struct.unpack_from("<QI", delta, 8)
    assert zlib.crc32(delta[20 : 20 + frame_len]) == frame_crc
    for where in (16, 19, 20, 20 + frame_len // 2, 20 + frame_len - 1):
        bad = bytearray(delta)
        bad[where] ^= 0x10
        with pytest.raises(SpecDecodeError, match="CRC-32"):
            decode_shard(parent, bytes(bad))
    # A frame that still decompresses to a valid header is refused too: the CRC comes first.
    good = parse_delta(delta)
    altered: dict[str, Any] = json.loads(json.dumps(good.fields))
    altered["identity"] = "step-102"
    forged = bytearray(_craft(altered, good.payload))
    forged[16:20] = delta[16:20]
    with pytest.raises(SpecDecodeError, match="CRC-32"):
        decode_shard(parent, bytes(forged))
    # The layout without the CRC (magic, H, frame) is not a valid delta.
    no_crc = delta[:16] + delta[20:]
    with pytest.raises(SpecDecodeError):
        decode_shard(parent, no_crc)
    with pytest.raises(SpecDecodeError, match="truncated"):
        decode_shard(parent, delta[:19])


def _tensor_names(path: Path) -> str:
    return " ".join(t["name"] for t in read_delta_header(path)["tensors"])


def test_wrong_parent_is_refused(
    snapshots: tuple[Path, Path], compact_chain: list[Path], tmp_path: Path
) -> None:
    """§10 step 8: the base checksum is checked first and names a wrong parent.

    For `sparse_exp` this matters twice: the hot list comes from the parent's exponents, so a
    wrong parent would otherwise surface as malformed run counts.
    """
    for (_prev, delta), cur in zip(
        _deltas(snapshots, compact_chain, tmp_path), (snapshots[1], compact_chain[1]), strict=True
    ):
        changed = [
            s
            for s in _shipped(delta)
            if any(c["encoding"] != "same" for c in _chunks(read_delta_header(delta / s)))
        ]
        assert changed
        for shard in changed:
            with pytest.raises(ChecksumError, match="wrong parent"):
                decode_shard_file(cur / shard, delta / shard)
        with pytest.raises(SpecDecodeError, match="follows"):
            decode_shard_file(cur / changed[0], delta / changed[0], expected_parent="step-99")


# --- the document's own examples ---------------------------------------------------------------


def _doc_vectors() -> dict[str, bytes]:
    text = DOC.read_text()
    found = re.findall(
        r"<!-- test-vector: (\w+) \((\d+) bytes\) -->\n```text\n(.*?)```", text, re.S
    )
    vectors = {name: bytes.fromhex(body) for name, _size, body in found}
    for name, size, _body in found:
        assert len(vectors[name]) == int(size), name
    assert set(vectors) == {"parent", "delta", "target"}
    return vectors


def _doc_example_weights() -> tuple[np.ndarray, np.ndarray]:
    old = np.arange(64, dtype=np.uint16) * np.uint16(3)
    new = old.copy()
    for position, change in [(5, 1), (20, -1), (41, 2), (60, -300)]:
        new[position] = (int(new[position]) + change) % 65536
    return old, new


def test_doc_test_vector_decodes() -> None:
    vectors = _doc_vectors()
    assert (
        decode_shard(vectors["parent"], vectors["delta"], expected_parent="step-100")
        == (vectors["target"])
    )
    payload = parse_delta(vectors["delta"]).payload
    assert payload == bytes.fromhex("89 31 45 02 01 04 57 80")


def test_doc_test_vector_matches_the_encoder(tmp_path: Path) -> None:
    """The appendix is what hotload writes today (only the zstd bytes of the header may vary)."""
    vectors = _doc_vectors()
    old, new = _doc_example_weights()
    write_snapshot(tmp_path / "step-100", {"lm_head.weight": old}, config=CONFIG)
    write_snapshot(tmp_path / "step-101", {"lm_head.weight": new}, config=CONFIG)
    encode(
        tmp_path / "step-100",
        tmp_path / "step-101",
        tmp_path / "d",
        identity="step-101",
        chunk_elements=64,
    )
    assert (tmp_path / "step-100" / SHARD).read_bytes() == vectors["parent"]
    assert (tmp_path / "step-101" / SHARD).read_bytes() == vectors["target"]
    ours = parse_delta((tmp_path / "d" / SHARD).read_bytes())
    doc = parse_delta(vectors["delta"])
    assert ours.fields == doc.fields
    assert ours.payload == doc.payload
    text = DOC.read_text()
    shown = re.search(
        r"The decompressed header of\nthe delta is:\n\n```json\n(.*?)\n```", text, re.S
    )
    assert shown is not None
    assert json.loads(shown.group(1)) == doc.fields
    # §13 quotes the chunk entry and the file's sizes.
    entry = re.search(
        r"one chunk \(`n = 64`, `k = 4`\)\. Its entry:\n\n```json\n(.*?)\n```", text, re.S
    )
    assert entry is not None
    assert json.loads(entry.group(1)) == _vector_chunk(doc.fields)
    frame_len, frame_crc = struct.unpack_from("<QI", vectors["delta"], 8)
    flat = " ".join(text.split())
    facts = [
        f"the file is {len(vectors['delta'])} bytes, `H = {frame_len:#x} = {frame_len}`, "
        f"so `payload_start = {20 + frame_len}`",
        f"`C = {frame_crc:#010x}`",
        f'`"{zlib.crc32(doc.payload):08x}"`',
    ]
    for fact in facts:
        assert fact in flat, fact


# The §7.3 example: a BF16 chunk of 12 elements and the changes made to it.
EXAMPLE_OLD = [
    0x3C80, 0x3B00, 0xBC40, 0x3A80, 0xBB10, 0x3D00, 0x0000, 0x3F80, 0xBA00, 0x3C00, 0x3B7F, 0x3C90
]  # fmt: skip
EXAMPLE_CHANGES = [(1, -1), (4, 2), (6, 1), (7, -1), (11, 1)]


def _doc_sparse_exp_example() -> tuple[dict[str, Any], bytes]:
    text = DOC.read_text()
    chunk = re.search(r"<!-- sparse_exp example: chunk -->\n```json\n(.*?)\n```", text, re.S)
    payload = re.search(r"<!-- sparse_exp example: payload -->\n```text\n(.*?)\n```", text, re.S)
    assert chunk is not None and payload is not None
    meta: dict[str, Any] = json.loads(chunk.group(1))
    return meta, bytes.fromhex(payload.group(1))


def _example_weights() -> tuple[np.ndarray, np.ndarray]:
    old = np.array(EXAMPLE_OLD, dtype=np.uint16)
    new = old.copy()
    for position, change in EXAMPLE_CHANGES:
        new[position] = (int(new[position]) + change) % 65536
    return old, new


def test_doc_sparse_exp_example() -> None:
    """The worked `sparse_exp` chunk decodes as the text says and is what hotload writes."""
    meta, payload = _doc_sparse_exp_example()
    old, new = _example_weights()
    assert meta["length"] == len(payload)
    assert meta["crc32"] == f"{zlib.crc32(payload):08x}"
    assert np.array_equal(decode_chunk(meta, payload, old, "BF16"), new)
    idx = np.flatnonzero(old != new)
    ref_meta, parts = encode_sparse_exp(
        old, new, idx, threshold=meta["threshold"], layout=REFERENCE_FLOAT_LAYOUTS["BF16"], level=1
    )
    assert b"".join(parts) == payload
    assert {k: v for k, v in meta.items() if k not in ("offset", "length", "crc32")} == ref_meta


def _example_shard(tmp_path: Path) -> tuple[bytes, dict[str, Any], bytes, bytes]:
    """A BF16 parent shard holding the §7.3 example, a delta's fields for it, and the target."""
    old, new = _example_weights()
    write_snapshot(
        tmp_path / "p", {"w": RawTensor("BF16", (12,), old.view(np.uint8))}, config=CONFIG
    )
    parent = (tmp_path / "p" / SHARD).read_bytes()
    (header_len,) = struct.unpack_from("<Q", parent)
    header = parent[8 : 8 + header_len]
    meta, payload = _doc_sparse_exp_example()
    fields = {
        "format": "arc_v2",
        "version": 1,
        "parent": "p",
        "identity": None,
        "checksum": "adler32",
        "chunk_elements": 12,
        "target_header": header.decode(),
        "tensors": [
            {
                "name": "w",
                "checksum": f"{zlib.adler32(new.tobytes()):08x}",
                "base_checksum": f"{zlib.adler32(old.tobytes()):08x}",
                "chunks": [meta],
            }
        ],
    }
    return parent, fields, payload, parent[: 8 + header_len] + new.tobytes()


def test_crafted_sparse_exp_chunks_follow_the_obligations(tmp_path: Path) -> None:
    parent, fields, payload, target = _example_shard(tmp_path)
    assert decode_shard(parent, _craft(fields, payload)) == target

    def variant() -> tuple[dict[str, Any], dict[str, Any]]:
        copy: dict[str, Any] = json.loads(json.dumps(fields))
        chunk: dict[str, Any] = copy["tensors"][0]["chunks"][0]
        return copy, chunk

    refused: list[tuple[str, dict[str, Any]]] = []
    for threshold in (0, 257, True, "120"):  # BF16 allows 1 ... 256
        crafted, chunk = variant()
        chunk["threshold"] = threshold
        refused.append(("threshold", crafted))
    # The hot list comes from the parent: at 119 it still holds the exponents 0, 116, 117 and
    # three 118s, so the chunk decodes the same; at 118 only 3 members remain for indices up
    # to 4, and at 256 every element is hot, leaving no cold element for the cold run.
    crafted, chunk = variant()
    chunk["threshold"] = 119
    assert decode_shard(parent, _craft(crafted, payload)) == target
    crafted, chunk = variant()
    chunk["threshold"] = 118
    refused.append(("index", crafted))
    crafted, chunk = variant()
    chunk["threshold"] = 256
    refused.append(("count", crafted))
    # 6 of the 12 elements are hot at threshold 120: the hot run cannot hold 7.
    crafted, chunk = variant()
    chunk["hot"]["count"] = 7
    refused.append(("count", crafted))
    crafted, chunk = variant()
    chunk["cold"] = {"count": 0, "shift": 1, "quotient_planes": 0, "value_planes": 0}
    refused.append(("shift", crafted))
    crafted, chunk = variant()
    del chunk["hot"]
    refused.append(("run fields", crafted))
    crafted, chunk = variant()
    chunk["hot"]["value_planes"] = 3  # BF16 elements have 2 bytes
    refused.append(("value_planes", crafted))
    crafted, chunk = variant()
    chunk["streams"] = chunk["streams"][:3]
    refused.append(("stream entries", crafted))
    for match, crafted in refused:
        with pytest.raises(SpecDecodeError, match=match):
            decode_shard(parent, _craft(crafted, payload))

    # Both runs empty: no change at all is `same`, never `sparse_exp`.
    crafted, chunk = variant()
    chunk["hot"] = chunk["cold"] = dict.fromkeys(
        ("count", "shift", "quotient_planes", "value_planes"), 0
    )
    chunk["streams"], chunk["length"] = [], 0
    with pytest.raises(SpecDecodeError, match="at least one"):
        decode_shard(parent, _craft(crafted, b""))
    # `sparse_exp` is defined for float dtypes only (§7.3): on a U16 tensor it is refused.
    vectors = _doc_vectors()
    u16: dict[str, Any] = json.loads(json.dumps(parse_delta(vectors["delta"]).fields))
    u16["tensors"][0]["chunks"] = [{**fields["tensors"][0]["chunks"][0]}]
    with pytest.raises(SpecDecodeError, match="float dtype"):
        decode_shard(vectors["parent"], _craft(u16, payload))


# --- decoder obligations on crafted deltas -----------------------------------------------------


def _vector_chunk(fields: dict[str, Any]) -> dict[str, Any]:
    chunk: dict[str, Any] = fields["tensors"][0]["chunks"][0]
    return chunk


def test_crafted_deltas_follow_the_obligations() -> None:
    vectors = _doc_vectors()
    parent = vectors["parent"]
    good = parse_delta(vectors["delta"])

    def fields() -> dict[str, Any]:
        copy: dict[str, Any] = json.loads(json.dumps(good.fields))
        return copy

    # Re-wrapping the same header and payload (and the `alder32` alias, unknown fields) works.
    same = fields()
    same["checksum"] = "alder32"
    same["future_field"] = {"ignored": True}
    _vector_chunk(same)["future_field"] = [1, 2]
    assert decode_shard(parent, _craft(same, good.payload)) == vectors["target"]

    # A zstd stream holding the value plane decodes like the raw one.
    zfields = fields()
    plane = good.payload[3:7]
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(plane)
    _vector_chunk(zfields)["streams"][2] = ["zstd", len(frame), 8]
    _vector_chunk(zfields)["length"] = 4 + len(frame)
    zpayload = good.payload[:3] + frame + good.payload[7:]
    assert decode_shard(parent, _craft(zfields, zpayload)) == vectors["target"]

    refused: list[tuple[str, dict[str, Any], bytes]] = []

    future = fields()
    future["version"] = 2
    refused.append(("version", future, good.payload))
    boolean_version = fields()
    boolean_version["version"] = True
    refused.append(("version", boolean_version, good.payload))

    unknown = fields()
    _vector_chunk(unknown)["encoding"] = "xor"
    refused.append(("encoding", unknown, good.payload))

    # A frame declaring more than the derived 4 bytes: a bomb, refused before decompressing.
    bomb = fields()
    big = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 20))
    _vector_chunk(bomb)["streams"][2] = ["zstd", len(big), 8]
    _vector_chunk(bomb)["length"] = 4 + len(big)
    refused.append(("declares", bomb, good.payload[:3] + big + good.payload[7:]))

    # Trailing bytes after a zstd frame.
    trailing = fields()
    _vector_chunk(trailing)["streams"][2] = ["zstd", len(frame) + 1, 8]
    _vector_chunk(trailing)["length"] = 5 + len(frame)
    refused.append(("zstd", trailing, good.payload[:3] + frame + b"\0" + good.payload[7:]))

    # A raw stream whose stored length is not the derived length.
    short = fields()
    _vector_chunk(short)["streams"][2] = ["raw", 3, 8]
    _vector_chunk(short)["length"] = 7
    refused.append(("raw stream", short, good.payload[:6] + good.payload[7:]))

    # A quotient that puts the last position past the chunk's 64 elements.
    past = fields()
    refused.append(("gap|index", past, good.payload[:2] + b"\xf5" + good.payload[3:]))

    # A remainder that does not fit `shift` = 2 bits (its plane widened to 4-bit symbols).
    wide = fields()
    _vector_chunk(wide)["streams"][0] = ["raw", 2, 4]
    _vector_chunk(wide)["length"] = 9
    refused.append(("remainder", wide, b"\x21\x60" + good.payload[1:]))

    # A `sparse` chunk that changes nothing, and a `same` chunk with bytes.
    empty = fields()
    _vector_chunk(empty).update(count=0, streams=[], length=0)
    refused.append(("count", empty, b""))
    same_bytes = fields()
    _vector_chunk(same_bytes)["encoding"] = "same"
    refused.append(("no payload", same_bytes, good.payload))

    # Streams that do not fill the chunk's length, and a chunk outside the payload.
    stray = fields()
    _vector_chunk(stray)["length"] = 9
    refused.append(("after the chunk", stray, good.payload + b"\0"))
    outside = fields()
    _vector_chunk(outside)["offset"] = 1
    refused.append(("outside", outside, good.payload))

    # Booleans are not integers (`true` would otherwise read as 1).
    bool_offset = fields()
    _vector_chunk(bool_offset)["offset"] = False
    refused.append(("offset", bool_offset, good.payload))
    bool_planes = fields()
    _vector_chunk(bool_planes)["quotient_planes"] = True
    refused.append(("quotient_planes", bool_planes, good.payload))

    # chunk_elements is bounded (the sparse checksum update must stay exact).
    huge = fields()
    huge["chunk_elements"] = (1 << 24) + 1
    refused.append(("chunk_elements", huge, good.payload))

    # Tensor checksums are exactly 8 lowercase hex digits.
    for bad_checksum in ("068F1876", " 68f1876", "0x8f1876"):
        malformed = fields()
        malformed["tensors"][0]["checksum"] = bad_checksum
        refused.append(("malformed", malformed, good.payload))

    # Unknown codec and checksum algorithm.
    codec = fields()
    _vector_chunk(codec)["streams"][0][0] = "lz4"
    refused.append(("codec", codec, good.payload))
    algo = fields()
    algo["checksum"] = "crc32c"
    refused.append(("checksum algorithm", algo, good.payload))

    for match, crafted, payload in refused:
        with pytest.raises(SpecDecodeError, match=match):
            decode_shard(parent, _craft(crafted, payload))
