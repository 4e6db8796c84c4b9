"""Small real snapshots for bucket, ledger and publish tests (full, arc_v2 delta, LoRA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hotload.arc import encode
from hotload.arc.container import read_header
from hotload.bucket import open_bucket, upload_snapshot_async
from hotload.snapshot import RawTensor, describe_snapshot, write_snapshot

CONFIG = {"model_type": "toy", "hidden_size": 64}


def weights(seed: int, layers: int = 3, width: int = 64) -> dict[str, np.ndarray]:
    """A toy state dict: one weight per layer plus an embedding."""
    rng = np.random.default_rng(seed)
    w = {
        f"model.layers.{i}.mlp.weight": rng.standard_normal((width, width), dtype=np.float32)
        for i in range(layers)
    }
    w["model.embed_tokens.weight"] = rng.standard_normal((100, width), dtype=np.float32)
    return w


def nudged(base: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """A copy of `base` with a few values changed, like one training step."""
    out = {k: v.copy() for k, v in base.items()}
    out["model.layers.1.mlp.weight"][step % 64, :8] += 0.5
    return out


def full(path: Path, w: dict[str, np.ndarray]) -> Path:
    """Write a full snapshot folder at `path`."""
    write_snapshot(path, w, config=CONFIG, overwrite=True)
    return path


def delta(parent: Path, current_full: Path, out: Path) -> Path:
    """Write an incremental snapshot at `out` (identity: its folder name) against `parent`."""
    encode(parent, current_full, out, parent_identity=parent.name, overwrite=True, threads=1)
    return out


def lora(
    path: Path, seed: int, base_model: str = "tiny/base", layer: str = "model.layers.0.mlp"
) -> Path:
    """Write a minimal, checksummed LoRA adapter folder (PEFT layout) for `weights()`'s model:
    rank 8 on `layer` (a [64, 64] weight there)."""
    from hotload.snapshot.lora import write_adapter

    rng = np.random.default_rng(seed)
    return write_adapter(
        path,
        {
            f"base_model.model.{layer}.lora_A.weight": rng.standard_normal(
                (8, 64), dtype=np.float32
            ),
            f"base_model.model.{layer}.lora_B.weight": rng.standard_normal(
                (64, 8), dtype=np.float32
            ),
        },
        {
            "peft_type": "LORA",
            "base_model_name_or_path": base_model,
            "r": 8,
            "lora_alpha": 16,
            "target_modules": [layer.rsplit(".", 1)[1]],
        },
    )


def chain(root: Path, steps: int) -> list[Path]:
    """A full snapshot `s0` then `steps` deltas `s1..sN`, each against the one before."""
    base = weights(0)
    folders = [full(root / "s0", base)]
    fulls = root / "_fulls"
    previous_full = folders[0]
    current = base
    for i in range(1, steps + 1):
        current = nudged(current, i)
        cur_full = full(fulls / f"s{i}", current)
        folders.append(delta(previous_full, cur_full, root / f"s{i}"))
        previous_full = cur_full
    return folders


async def upload(bucket_dir: Path, folder: Path) -> None:
    """The trainer's part: every file of snapshot `folder` in the bucket (under the folder's
    name) before the Snapshot object exists."""
    desc = describe_snapshot(folder)
    await upload_snapshot_async(
        folder,
        open_bucket(str(bucket_dir)),
        folder.name,
        files=desc.files,
        manifest_files=desc.manifest_files,
    )


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns of `x` (rounded to nearest even), as uint16."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(
        16
    )
    return rounded.astype(np.uint16)


def adam_like_step(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A bf16 weight and the same weight after an Adam-like step at lr 1e-6."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    step = np.abs(rng.standard_normal(n, dtype=np.float32)).clip(0.05, 3) * np.float32(1e-6)
    sign = rng.integers(0, 2, n).astype(np.float32) * 2 - 1
    return bf16_bits(w), bf16_bits(w - step * sign)


def write_bf16(path: Path, weights: dict[str, np.ndarray]) -> None:
    """A full snapshot at `path` of flat bfloat16 tensors given as their bits (`bf16_bits`)."""
    write_snapshot(
        path,
        {k: RawTensor("BF16", (v.size,), v.view(np.uint8)) for k, v in weights.items()},
        config=CONFIG,
    )


def flip_payload_byte(delta: Path) -> None:
    """Flip one byte of the first delta shard that carries a payload."""
    for shard in sorted(delta.glob("*.safetensors")):
        header = read_header(shard)
        if header.file_size > header.payload_offset:
            data = bytearray(shard.read_bytes())
            data[header.payload_offset + 1] ^= 0xFF
            shard.write_bytes(bytes(data))
            return
    raise AssertionError("no payload")
