"""Benchmark: one sparse patch on a GPU, from a published delta to bit-exact served weights.

Self-contained (torch, numpy and hotload only; no server processes, no downloads): builds a
Llama-shaped bfloat16 model (8B-shaped by default, Llama-3-8B's sizes), writes it as a full
snapshot, moves a fraction of every tensor's elements by one ulp (an RL step on bf16 weights),
publishes that as an arc_v2 delta and a patch file, and then plays the engine side on the
device with hotload_patch, as the reference engine and vLLM's worker extension do:

    cold load            the snapshot read and copied to the device, served sums read there
    stage + verify       the patch staged against the served weights (old values gathered on
                         the device, O(changed) bytes to the host) and verified
    pause                the writes (index_copy_ per parameter), synchronised
    served checksums     after the patch: derived from it (what hotload does), against a full
                         re-read of every weight (what it did before)
    bytes to the host    counted by hotload_patch (device-to-host copies)
    bit-exact            every tensor against a full load of the child on the device
    for scale            an in-place copy of the whole model from pinned host memory

    python benchmarks/bench_patch_gpu.py                                 # 8B-shaped, CUDA
    python benchmarks/bench_patch_gpu.py --device cpu --shape tiny       # seconds; the tests run it

The 8B shape needs about 35 GB of GPU memory (the served model and the full load it is compared
with), about 40 GB of host memory and 35 GB of disk in --workdir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hotload.arc import encode
from hotload.arc.patch import prepare_patch
from hotload.snapshot import Snapshot, describe_snapshot, write_snapshot
from hotload.snapshot.safetensors_io import iter_file
from hotload_patch.checkpoint import checkpoint_specs
from hotload_patch.format import PatchFile
from hotload_patch.placement import IdentityHost
from hotload_patch.served import Counters, Meter, served_sums
from hotload_patch.session import Patcher, derive
from hotload_patch.staging import STAGE_THREADS, stage
from hotload_patch.verify import checks_of, verify


@dataclass(frozen=True)
class Shape:
    """A Llama's sizes."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int


SHAPES = {
    # Llama-3-8B: 8.03 B parameters, 15.0 GiB in bfloat16.
    "8b": Shape(4096, 32, 14336, 32, 8, 128256),
    # Llama-3.2-3B's sizes with untied embeddings: 3.61 B parameters.
    "3b": Shape(3072, 28, 8192, 24, 8, 128256),
    # Llama-3.2-1B's sizes with untied embeddings: 1.50 B parameters (a CPU-sized run).
    "1b": Shape(2048, 16, 8192, 32, 8, 128256),
    "tiny": Shape(64, 2, 160, 4, 2, 512),
}


def tensor_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (Hugging Face Llama) and shapes."""
    head = s.hidden // s.heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (s.hidden,)
        out[f"{p}.self_attn.q_proj.weight"] = (s.heads * head, s.hidden)
        out[f"{p}.self_attn.k_proj.weight"] = (s.kv_heads * head, s.hidden)
        out[f"{p}.self_attn.v_proj.weight"] = (s.kv_heads * head, s.hidden)
        out[f"{p}.self_attn.o_proj.weight"] = (s.hidden, s.heads * head)
        out[f"{p}.post_attention_layernorm.weight"] = (s.hidden,)
        out[f"{p}.mlp.gate_proj.weight"] = (s.intermediate, s.hidden)
        out[f"{p}.mlp.up_proj.weight"] = (s.intermediate, s.hidden)
        out[f"{p}.mlp.down_proj.weight"] = (s.hidden, s.intermediate)
    out["model.norm.weight"] = (s.hidden,)
    out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


def config_of(s: Shape) -> dict[str, Any]:
    """A config.json for the shape (a snapshot carries one)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "intermediate_size": s.intermediate,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "vocab_size": s.vocab,
        "torch_dtype": "bfloat16",
    }


def build(work: Path, shape: Shape, fraction: float, device: str) -> tuple[Path, Path, Path]:
    """Write the base snapshot and the child (a fraction of every tensor moved by one ulp), and
    publish the child as a delta of the base. Random values are drawn on `device` (fast on a
    GPU); one copy of the model is in host memory at a time."""
    shapes = tensor_shapes(shape)
    gen = torch.Generator(device=device).manual_seed(0)
    weights: dict[str, np.ndarray] = {}
    for name, dims in shapes.items():
        t = (torch.randn(dims, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        weights[name] = t.cpu().view(torch.int16).numpy().view(np.uint16)
    cfg = config_of(shape)
    base = _write(work / "base", weights, cfg)
    rng = np.random.default_rng(1)
    for bits in weights.values():
        flat = bits.reshape(-1)
        at = np.unique(rng.integers(0, flat.size, max(1, int(flat.size * fraction))))
        flat[at] += 1  # one ulp away from zero: finite stays finite
    child = _write(work / "child", weights, cfg)
    del weights
    return base, child, work / "delta"


def _write(folder: Path, weights: dict[str, np.ndarray], cfg: dict[str, Any]) -> Path:
    from hotload.snapshot import RawTensor

    raw = {n: RawTensor("BF16", a.shape, a.reshape(-1).view(np.uint8)) for n, a in weights.items()}
    return write_snapshot(folder, raw, config=cfg, overwrite=True).path


def load(folder: Path, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of a full snapshot on `device` (what an engine's full load does)."""
    out: dict[str, torch.Tensor] = {}
    for shard in Snapshot(folder).shard_files:
        for name, raw in iter_file(folder / shard):
            host = torch.from_numpy(np.array(raw.data)).view(torch.bfloat16).reshape(raw.shape)
            out[name] = host.to(device)
    return out


def sync(device: str) -> None:
    """Wait for the device's queued work (timings end there)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Any, label: str = "") -> tuple[Any, float]:
    """Run `fn()`; return its result and the seconds it took, the device synchronised. A
    labelled step prints its time to stderr as it ends (the 8B run takes minutes)."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    seconds = time.perf_counter() - t0
    if label:
        print(f"  {label}: {seconds:.3f} s", file=sys.stderr, flush=True)
    return result, seconds


def pinned_copy_seconds(targets: dict[str, torch.Tensor], device: str) -> float:
    """An in-place copy of the whole model from pinned host memory (the cost a full reload of
    weights already in host memory cannot go below)."""
    pin = device.startswith("cuda")
    hosts = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in targets.items()}
    spare = {n: torch.empty_like(t) for n, t in list(targets.items())[:1]}  # warm the path
    for n, t in spare.items():
        t.copy_(hosts[n], non_blocking=True)
    _, seconds = timed(
        device, lambda: [t.copy_(hosts[n], non_blocking=True) for n, t in targets.items()]
    )
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark; returns its numbers."""
    device = args.device
    shape = SHAPES[args.shape]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-patch-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    threads = os.cpu_count() or 1
    try:
        (base, child, delta), build_s = timed(
            "cpu", lambda: build(work, shape, args.fraction, device), "build"
        )
        _, encode_s = timed("cpu", lambda: encode(base, child, delta, threads=threads), "encode")
        patch = work / "child.patch"
        stats, prepare_s = timed(
            "cpu",
            lambda: prepare_patch(None, delta, patch, identity="child", expected_parent="base"),
            "prepare_patch",
        )
        specs = checkpoint_specs(base)
        targets, load_s = timed(device, lambda: load(base, device), "cold load")
        patcher = Patcher(IdentityHost(lambda: targets), scrub_rate=0)
        try:
            patcher.weights_changed(specs)
            _, sums_s = timed(device, patcher.served, "served sums")
            served = patcher.served()
            after_load = patcher.counters.to_json()
            # The same staging on one thread and on `--stage-threads`, for comparison (staging
            # only reads the weights).
            many = args.stage_threads or STAGE_THREADS
            _, stage_one_s = timed(
                device,
                lambda: stage(
                    IdentityHost(lambda: targets), patch, identity="child", parent="base",
                    threads=1,
                ),
                "stage, one thread",
            )  # fmt: skip
            _, stage_many_s = timed(
                device,
                lambda: stage(
                    IdentityHost(lambda: targets), patch, identity="child", parent="base",
                    threads=many,
                ),
                f"stage, {many} threads",
            )  # fmt: skip
            staged, stage_s = timed(
                device,
                lambda: patcher.stage(str(patch), identity="child", parent="base").result(),
                "stage",
            )
            with PatchFile(patch, runs=False) as pf:
                checks = checks_of(pf.tensors)
            _, verify_s = timed(device, lambda: verify(checks, served, staged.deltas), "verify")
            _, pause_s = timed(device, patcher.apply, "pause")
            derived, derive_s = timed(device, lambda: derive(served, staged.deltas))
            meter = Meter(Counters())
            reread, reread_s = timed(
                device, lambda: served_sums(IdentityHost(lambda: targets), specs, meter)
            )
            counters = patcher.counters.to_json()
        finally:
            patcher.close()
        full, full_s = timed(device, lambda: load(child, device), "full load of the child")
        exact = all(
            torch.equal(targets[n].view(torch.int16), full[n].view(torch.int16)) for n in full
        )
        del full
        copy_s = pinned_copy_seconds(targets, device)
        numel = sum(math.prod(s) for s, _ in specs.values())
        return {
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "shape": args.shape,
            "parameters": numel,
            "model_bytes": numel * 2,
            "fraction": args.fraction,
            "changed": stats.changed,
            "delta_bytes": describe_snapshot(delta).shipped_bytes,
            "patch_bytes": stats.bytes,
            "seconds": {
                "build": round(build_s, 3),
                "encode": round(encode_s, 3),
                "prepare_patch": round(prepare_s, 3),
                "cold_load": round(load_s, 3),
                "served_sums_after_load": round(sums_s, 3),
                "stage": round(stage_s, 3),
                "stage_one_thread": round(stage_one_s, 3),
                "stage_threaded": round(stage_many_s, 3),
                "stage_threads": many,
                "engine_stage_threads": STAGE_THREADS if device.startswith("cuda") else 1,
                "verify": round(verify_s, 3),
                "pause": round(pause_s, 6),
                "served_sums_derived": round(derive_s, 6),
                "served_sums_reread": round(reread_s, 3),
                "full_load_of_child": round(full_s, 3),
                "pinned_copy_of_model": round(copy_s, 4),
            },
            "host_bytes": {
                "after_load_sums": after_load["host_bytes"],
                "stage_and_patch": counters["host_bytes"] - after_load["host_bytes"],
                "reread": meter.counters.host_bytes if meter.counters else 0,
            },
            "staged_bytes": staged.held_bytes,
            "derived_equals_reread": derived == reread,
            "bit_exact": exact,
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(r: dict[str, Any]) -> str:
    """The numbers as a markdown table."""
    s, mib = r["seconds"], 2**20
    lines = [
        f"Device: {r['device']}; {platform.machine()}, {os.cpu_count()} cores; shape {r['shape']}: "
        f"{r['parameters'] / 1e6:,.1f} M parameters ({r['model_bytes'] / mib:,.1f} MiB bf16); "
        f"{r['fraction']:.1%} of the elements moved ({r['changed']} changed).",
        "",
        "| step | seconds |",
        "| --- | ---: |",
        f"| encode the delta ({r['delta_bytes'] / mib:.1f} MiB) | {s['encode']:.2f} |",
        f"| prepare_patch ({r['patch_bytes'] / mib:.1f} MiB, "
        f"{r['patch_bytes'] / r['delta_bytes']:.2f}x the delta) | {s['prepare_patch']:.2f} |",
        f"| cold load (read + copy to the device) | {s['cold_load']:.2f} |",
        f"| served sums after the load (on the device) | {s['served_sums_after_load']:.2f} |",
        f"| stage the patch while serving (the engine's {s['engine_stage_threads']} threads) | "
        f"{s['stage']:.3f} |",
        f"| (the same staging on one thread) | {s['stage_one_thread']:.3f} |",
        f"| (the same staging on {s['stage_threads']} threads) | {s['stage_threaded']:.3f} |",
        f"| verify over the region sums | {s['verify']:.3f} |",
        f"| **the pause (writes only)** | **{s['pause']:.4f}** |",
        f"| served checksums after the patch: derived | {s['served_sums_derived']:.4f} |",
        f"| (the same by a full re-read of every weight) | {s['served_sums_reread']:.2f} |",
        f"| for scale: in-place copy of the model from pinned host memory | "
        f"{s['pinned_copy_of_model']:.3f} |",
        "",
        f"Bytes to the host: {r['host_bytes']['stage_and_patch']} while staging and patching "
        f"(O(changed): the old values of the changed elements), "
        f"{r['host_bytes']['after_load_sums']} for the sums after the load, "
        f"{r['host_bytes']['reread']} for a full re-read (two integers per chunk). "
        f"Staging held {r['staged_bytes'] / mib:.1f} MiB (positions and new values; old values "
        "only where the patch sets values). "
        f"Derived sums equal a re-read: {r['derived_equals_reread']}. "
        f"Bit-exact with a full load of the child: {r['bit_exact']}.",
    ]
    return "\n".join(lines)


def main() -> None:
    """Parse the options, run, print the table (and the JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--fraction", type=float, default=0.015)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument(
        "--stage-threads",
        type=int,
        default=0,
        help="threads for the threaded staging row (default: the engines' STAGE_THREADS)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or --device cpu --shape tiny")
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    print(report(result))
    if not (result["bit_exact"] and result["derived_equals_reread"]):
        raise SystemExit("the patched weights are not what a full load gives")


if __name__ == "__main__":
    main()
