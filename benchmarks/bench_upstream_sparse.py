"""Benchmark: hotload's sparse patch against vLLM's own `load_checkpoint_weight_patches` (the
weight-transfer API's SparseWeightPatch path, vllm 0.32), on the same model, the same change.

Both write checkpoint-coordinate changes through a vLLM-style model's own `load_weights`
(`tests/support/patch_models.ToyTPModel`: fused q/k/v and gate/up, padded vocabulary, tied
embedding), on the CPU, float32 weights from a bfloat16 checkpoint. What each does in the pause
(the call that writes the served weights), the memory it needs on top of the model (peak RSS
growth), and what it checks:

- hotload: staged while the old weights serve (positions mapped, old values gathered, new ones
  computed, the parent's and the result's checksums verified over the region sums), then in the
  pause only the writes (`Patcher.apply`);
- vLLM: `load_checkpoint_weight_patches(model, patches)`, which builds a full checkpoint-shaped
  tensor of NaNs per patched tensor, copies the changed values into it, and runs the model's
  loader with `copy_` replaced by `torch.where(isnan(src), dst, src)`: every element of every
  patched parameter is read and written. It checks NaNs, index bounds and duplicates; nothing
  about the weights it writes into, and it does not undo a partial failure.

Two stages, because vLLM is installed in its own venv and hotload is not:

    .venv/bin/python benchmarks/bench_upstream_sparse.py prepare WORK      # checkpoints, patch
    .venv-vllm/bin/python benchmarks/bench_upstream_sparse.py compare WORK  # both, timed

The second prints a table (the numbers in benchmarks/RESULTS-sparse-load.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

CONFIG = {
    "hidden": 1024,
    "q": 1024,
    "kv": 256,
    "inter": 4096,
    "vocab": 32000,
    "vocab_padding": 64,
    "layers": 8,
}
FRACTION = 0.015


def prepare(work: Path) -> None:
    """Parent and child checkpoints (bf16), the delta, the patch file (main venv)."""
    from hotload.arc.patch import prepare_patch
    from hotload.snapshot import write_snapshot
    from support.patch_models import ToyConfig, checkpoint_weights
    from support.snapshots import CONFIG as SNAPSHOT_CONFIG
    from support.tiny_llm import sparse_steps

    cfg = ToyConfig(**CONFIG)
    base = write_snapshot(
        work / "base", checkpoint_weights(cfg), config=SNAPSHOT_CONFIG, cast="BF16", overwrite=True
    ).path
    fulls, deltas = sparse_steps(base, work, 1, fraction=FRACTION, seed=5)
    stats = prepare_patch(None, deltas[1], work / "step-1.patch")
    (work / "prepared.json").write_text(
        json.dumps({"parent": str(fulls[0]), "child": str(fulls[1]), "changed": stats.changed})
    )
    print(f"prepared in {work}: {stats.changed} changed of {stats.elements}")


def rss_peak_reset() -> None:
    """Reset this process's peak RSS to its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def rss(field: str) -> int:
    """VmHWM or VmRSS of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def compare(work: Path) -> dict[str, Any]:
    """Both ways on the same model and patch (vLLM's venv)."""
    import torch
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from hotload_patch.checkpoint import checkpoint_specs
    from hotload_patch.format import PatchFile
    from hotload_patch.placement import LoaderHost
    from hotload_patch.session import Patcher
    from hotload_patch.staging import parameter_checksums
    from hotload_patch.verify import checks_of, verify
    from support.patch_models import ToyConfig, ToyTPModel, read_checkpoint

    torch.set_num_threads(1)
    meta = json.loads((work / "prepared.json").read_text())
    parent, child = Path(meta["parent"]), Path(meta["child"])
    cfg = ToyConfig(**CONFIG)
    tensors = read_checkpoint(parent)

    def fresh() -> ToyTPModel:
        model = ToyTPModel(cfg, dtype=torch.float32)
        model.load_weights(tensors.items())
        return model

    want = ToyTPModel(cfg, dtype=torch.float32)
    want.load_weights(read_checkpoint(child).items())
    expected = parameter_checksums(dict(want.named_parameters()))
    model_bytes = sum(p.numel() * p.element_size() for p in want.parameters())
    del want

    # hotload: stage (old weights serving), verify, then the pause: the writes.
    model = fresh()
    patcher = Patcher(LoaderHost(model), scrub_rate=0)
    patcher.weights_changed(checkpoint_specs(parent))
    served = patcher.served()
    rss_peak_reset()
    base = rss("VmRSS")
    t0 = time.perf_counter()
    staged = patcher.stage(str(work / "step-1.patch"), identity="step-1", parent="step-0").result()
    with PatchFile(work / "step-1.patch", runs=False) as pf:
        verify(checks_of(pf.tensors), served, staged.deltas)
    stage_s = time.perf_counter() - t0
    stage_peak = rss("VmHWM") - base
    staged_bytes = staged.held_bytes
    rss_peak_reset()
    base = rss("VmRSS")
    t0 = time.perf_counter()
    patcher.apply()
    hotload_pause = time.perf_counter() - t0
    hotload_pause_peak = rss("VmHWM") - base
    hotload_exact = parameter_checksums(dict(model.named_parameters())) == expected
    patcher.close()
    del model, patcher, staged

    # vLLM: absolute new values in checkpoint coordinates, written by its loader-driven path.
    model = fresh()
    with PatchFile(work / "step-1.patch") as pf:
        patches = []
        for t in pf.tensors:
            at, is_set, values = t.changes()
            if not at.size:
                continue
            old = tensors[t.name].reshape(-1).view(torch.int16).numpy().view(np.uint16)[at]
            new = t.new_bits(is_set, values, old)
            patches.append(
                CheckpointWeightPatch(
                    name=t.name,
                    shape=tuple(t.shape),
                    dtype=torch.bfloat16,
                    values=torch.from_numpy(new.view(np.int16)).view(torch.bfloat16),
                    indices=torch.from_numpy(at),
                )
            )
    rss_peak_reset()
    base = rss("VmRSS")
    t0 = time.perf_counter()
    load_checkpoint_weight_patches(model, patches)
    vllm_pause = time.perf_counter() - t0
    vllm_pause_peak = rss("VmHWM") - base
    vllm_exact = parameter_checksums(dict(model.named_parameters())) == expected
    return {
        "model_bytes": model_bytes,
        "changed": meta["changed"],
        "hotload": {
            "stage_and_verify_s": round(stage_s, 4),
            "stage_peak_bytes": stage_peak,
            "staged_bytes": staged_bytes,
            "pause_s": round(hotload_pause, 4),
            "pause_peak_bytes": hotload_pause_peak,
            "bit_exact": hotload_exact,
        },
        "vllm": {
            "pause_s": round(vllm_pause, 4),
            "pause_peak_bytes": vllm_pause_peak,
            "bit_exact": vllm_exact,
        },
    }


def main() -> None:
    """prepare (main venv) or compare (vLLM's venv)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "compare"])
    parser.add_argument("work", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "prepare":
        prepare(args.work)
        return
    r = compare(args.work)
    mib = 2**20
    print(json.dumps(r, indent=2))
    print(
        f"model {r['model_bytes'] / mib:.0f} MiB float32, {r['changed']} changed\n"
        f"hotload: staging {r['hotload']['stage_and_verify_s']:.3f} s (holds "
        f"{r['hotload']['staged_bytes'] / mib:.0f} MiB; peak RSS +"
        f"{r['hotload']['stage_peak_bytes'] / mib:.0f} MiB) while serving; pause "
        f"{r['hotload']['pause_s']:.4f} s (+{r['hotload']['pause_peak_bytes'] / mib:.0f} MiB); "
        f"bit-exact {r['hotload']['bit_exact']}\n"
        f"vLLM load_checkpoint_weight_patches: pause {r['vllm']['pause_s']:.4f} s (+"
        f"{r['vllm']['pause_peak_bytes'] / mib:.0f} MiB); bit-exact {r['vllm']['bit_exact']}"
    )


if __name__ == "__main__":
    main()
