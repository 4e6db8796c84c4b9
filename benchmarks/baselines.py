"""Baselines the arc_v2 codec is measured against, and the entropy estimate of a delta.

All work per tensor on the raw bit patterns of a parent and a child shard:
  zstd_full  zstd (level 3) of the child's shard files: what shipping a checkpoint costs.
  xor_zstd   child XOR parent per tensor, zstd level 3: the usual "binary diff" trick.
  pulse      PULSE-style sparse patch (Miahi & Belilovsky, 2026): changed indices,
             delta-encoded and downcast to the smallest unsigned type that holds the largest
             gap, followed by the raw new values, zstd level 3.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import zstandard

from hotload.snapshot.dtypes import uint_view_dtype
from hotload.snapshot.safetensors_io import SafetensorsFile

LEVEL = 3


def _pairs(prev: Path, cur: Path):  # type: ignore[no-untyped-def]
    for shard in sorted(p.name for p in cur.glob("model-*.safetensors")):
        with SafetensorsFile(prev / shard) as a, SafetensorsFile(cur / shard) as b:
            for name, info in sorted(b.tensors.items(), key=lambda kv: kv[1].begin):
                dt = uint_view_dtype(info.dtype)
                yield shard, name, a.raw(name).view(dt), b.raw(name).view(dt)


def zstd_full(cur: Path) -> int:
    """Bytes of zstd(level 3) over every shard file of a full snapshot."""
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    return sum(len(cctx.compress(p.read_bytes())) for p in sorted(cur.glob("model-*.safetensors")))


def xor_zstd_encode(prev: Path, cur: Path, out: Path) -> int:
    """Write per shard: the child's header, then per tensor one zstd frame of child XOR parent."""
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for shard in sorted(p.name for p in cur.glob("model-*.safetensors")):
        with (
            SafetensorsFile(prev / shard) as a,
            SafetensorsFile(cur / shard) as b,
            (out / shard).open("wb") as f,
        ):
            frames = [cctx.compress(b.header_bytes)]
            for name in sorted(b.tensors, key=lambda n: b.tensors[n].begin):
                frames.append(cctx.compress(np.bitwise_xor(a.raw(name), b.raw(name)).tobytes()))
            for frame in frames:
                f.write(len(frame).to_bytes(8, "little"))
                f.write(frame)
                total += len(frame) + 8
    return total


def xor_zstd_decode(prev: Path, delta: Path, out: Path) -> None:
    """Rebuild the child's shard files from the parent and `xor_zstd_encode`'s output."""
    dctx = zstandard.ZstdDecompressor()
    out.mkdir(parents=True, exist_ok=True)
    for shard in sorted(p.name for p in delta.glob("model-*.safetensors")):
        with (
            SafetensorsFile(prev / shard) as a,
            (delta / shard).open("rb") as src,
            (out / shard).open("wb") as f,
        ):

            def frame() -> bytes:
                n = int.from_bytes(src.read(8), "little")
                return dctx.decompress(src.read(n))

            header = frame()
            f.write(len(header).to_bytes(8, "little") + header)
            for info in sorted(a.tensors.values(), key=lambda i: i.begin):
                x = np.frombuffer(frame(), dtype=np.uint8)
                f.write(np.bitwise_xor(x, a.raw(info.name)).tobytes())


def pulse(prev: Path, cur: Path) -> int:
    """Bytes of a PULSE-style patch: delta-encoded downcast indices + raw values, zstd level 3."""
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    total = 0
    for _, _, a, b in _pairs(prev, cur):
        idx = np.flatnonzero(a != b)
        if idx.size == 0:
            continue
        gaps = np.diff(idx, prepend=0)
        top = int(gaps.max())
        gtype = (
            np.uint8
            if top < 2**8
            else np.uint16
            if top < 2**16
            else np.uint32
            if top < 2**32
            else np.uint64
        )
        blob = gaps.astype(gtype).tobytes() + b[idx].tobytes()
        total += len(cctx.compress(blob)) + 16  # + a small per-tensor header (count, dtype)
    return total


def _h(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def entropy_estimate(prev: Path, cur: Path) -> tuple[int, int, float]:
    """Return (changed elements, total elements, estimated bytes) of the parent -> child delta.

    Per tensor: n * H(changed fraction) for the changed-mask plus k * H(values) for the
    changed values, where values are the wrapping integer differences of the bit patterns
    (order-0 empirical entropies). An order-0 bound: a coder may beat it using context.
    """
    bits = 0.0
    changed = 0
    total = 0
    for _, _, a, b in _pairs(prev, cur):
        n = int(a.size)
        idx = np.flatnonzero(a != b)
        k = int(idx.size)
        total += n
        changed += k
        if k == 0 or n == 0:
            continue
        q = k / n
        bits += n * _h(np.array([q, 1 - q]))
        diffs = b[idx] - a[idx]
        _, counts = np.unique(diffs, return_counts=True)
        bits += k * _h(counts / k)
    return changed, total, bits / 8


def dir_bytes(path: Path) -> int:
    """Bytes of the shard files in a folder."""
    return sum(os.path.getsize(p) for p in path.glob("model-*.safetensors"))
