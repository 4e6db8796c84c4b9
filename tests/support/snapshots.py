"""Small real snapshots for bucket, ledger and publish tests (full, arc_v2 delta, LoRA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hotload.arc import encode
from hotload.bucket import open_bucket, upload_snapshot_async
from hotload.snapshot import describe_snapshot, write_snapshot

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
