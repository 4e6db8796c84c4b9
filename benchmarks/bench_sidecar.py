"""Benchmark: ledger append -> engine serving, for an arc_v2 delta and for a full snapshot.

A Llama of about 1 GiB (bf16 snapshot, fp32 master weights taking Adam-like steps at lr 1e-6,
so ~3% of bf16 values change per step) is published to a real S3 server (SeaweedFS). One
replica (the loader `python -m hotload_sidecar` plus the reference engine `hotload serve`)
follows the ledger. For each update the time from the ledger append returning to the loader
reporting the engine on the new snapshot is split into detect (poll), fetch, rebuild, verify and
engine load; bytes fetched come from the loader, peak memory from the loader process (VmHWM).

    .venv/bin/python benchmarks/bench_sidecar.py            # ~1 GiB model
    .venv/bin/python benchmarks/bench_sidecar.py --scale 0.1  # quick smoke run

The run goes to benchmarks/RESULTS-sidecar.md, between its bench_sidecar markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from results import replace_section

from hotload.arc import encode
from hotload.bucket import open_bucket, upload_snapshot
from hotload.ledger import Ledger, NewEntry
from hotload.snapshot import describe_snapshot
from support.fleet import Replica
from support.seaweedfs import SeaweedFS
from support.tiny_llm import TOKENIZER_FILES, llama_config, tokenizer_dir

HERE = Path(__file__).resolve().parent


def layers_at(scale: float) -> int:
    """Layers of the benchmark model at `scale` (16 at scale 1)."""
    return max(1, round(16 * scale))


def model_config(work: Path, scale: float) -> tuple[Any, Path]:
    """The Llama config of a ~1 GiB (at scale 1, in bf16) model, and a folder holding it and the
    tokenizer files (what a snapshot copies beside its weights)."""
    config = llama_config(
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=layers_at(scale),
        num_attention_heads=12,
        num_key_value_heads=4,
    )
    return config, side_folder(work, config)


def side_folder(work: Path, config: Any) -> Path:
    """`work/_side`, holding `config` and the tokenizer files (what a snapshot copies beside
    its weights)."""
    side = work / "_side"
    side.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(side)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir() / name).is_file():
            shutil.copyfile(tokenizer_dir() / name, side / name)
    return side


def build_model(work: Path, scale: float) -> tuple[list[Path], int, int]:
    """Write steps 0..2 of a ~1 GiB (at scale 1) bf16 Llama; return folders, bytes, largest shard."""
    import torch
    from transformers import LlamaForCausalLM

    from hotload.snapshot import write_snapshot

    config, side = model_config(work, scale)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    masters = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    del model
    rng = np.random.default_rng(0)
    gains = {
        k: (np.abs(rng.standard_normal(v.shape, dtype=np.float32)).clip(0.05, 3.0) * 1e-6).astype(
            np.float32
        )
        for k, v in masters.items()
    }
    folders: list[Path] = []
    for step in range(3):
        if step:
            for k, w in masters.items():
                sign = rng.integers(0, 2, w.shape, dtype=np.int8).astype(np.float32) * 2 - 1
                np.subtract(w, gains[k] * sign, out=w)
        state = {k: torch.from_numpy(v) for k, v in masters.items()}
        written = write_snapshot(
            work / f"step-{step}", state, side_files_from=side, cast="BF16", overwrite=True
        )
        folders.append(written.path)
    desc = describe_snapshot(folders[0])
    largest = max((folders[0] / f).stat().st_size for f in desc.files)
    return folders, desc.full_bytes, largest


def publish(ledger: Ledger, folder: Path, identity: str) -> float:
    """Upload `folder` (not timed), append it to the ledger; return when the append returned."""
    desc = describe_snapshot(folder)
    upload_snapshot(
        folder, ledger.bucket, identity, files=desc.files, manifest_files=desc.manifest_files
    )
    return append(ledger, folder, identity)


def append(ledger: Ledger, folder: Path, identity: str) -> float:
    """Append the uploaded snapshot `folder` to the ledger; return when the append returned."""
    desc = describe_snapshot(folder)
    ledger.append(
        NewEntry(
            identity=identity,
            kind=desc.kind,
            manifest_digest=desc.manifest_digest,
            shipped_bytes=desc.shipped_bytes,
            full_bytes=desc.full_bytes,
            previous=desc.parent if desc.kind == "incremental" else None,
        )
    )
    return time.perf_counter()


def measure(replica: Replica, appended: float, identity: str) -> dict[str, Any]:
    """Wait for `identity` to be served; return the loader's split and the end-to-end time."""
    status = replica.wait_serving(identity, timeout=900)
    seen = time.perf_counter()
    last = status["last_load"]
    total = seen - appended
    inside = last["total_seconds"]
    return {
        "identity": identity,
        "append_to_serving_s": round(total, 3),
        "detect_s": round(max(0.0, total - inside), 3),
        "fetch_s": round(last["fetch_seconds"], 3),
        "rebuild_s": round(last["rebuild_seconds"], 3),
        "verify_s": round(last["verify_seconds"], 3),
        "engine_load_s": round(last["load_seconds"], 3),
        "bytes_fetched": last["bytes_fetched"],
    }


def proc_status_bytes(pid: int, field: str) -> int:
    """A size field of a running process's /proc status (`VmHWM`, `VmRSS`), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def vm_hwm(pid: int) -> int:
    """Peak resident set size of a running process, in bytes."""
    return proc_status_bytes(pid, "VmHWM")


def main() -> None:
    """Run the benchmark and write RESULTS-sidecar.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="1.0 = ~1 GiB model")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS-sidecar.md")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-sidecar-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"building the model in {work} ...", flush=True)
    folders, full_bytes, largest = build_model(work / "model", args.scale)
    delta_dir = work / "delta" / "step-1"
    if delta_dir.exists():
        shutil.rmtree(delta_dir)
    encode(folders[0], folders[1], delta_dir, parent_identity="step-0")
    delta_bytes = describe_snapshot(delta_dir).shipped_bytes
    print(f"model {full_bytes / 2**30:.2f} GiB, delta {delta_bytes / 2**20:.1f} MiB", flush=True)

    server = SeaweedFS.start(work / "seaweedfs")
    replica: Replica | None = None
    try:
        os.environ.update(server.env)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        url = server.url("bench")
        ledger = Ledger(open_bucket(url), "policy")
        replica = Replica(
            "bench",
            work / "replica",
            f"{url}/policy",
            env,
            loader_args=["--poll-seconds", "0.2", "--threads", "2"],
        )
        # Cold start: the loader materialises the full snapshot, then the engine boots from it.
        t0 = publish(ledger, folders[0], "step-0")
        replica.start_loader()
        replica.wait_started(timeout=900)
        cold_files = time.perf_counter() - t0
        replica.start_engine()
        replica.wait_serving("step-0", timeout=900)
        cold_serving = time.perf_counter() - t0
        rows = [measure(replica, publish(ledger, delta_dir, "step-1"), "step-1")]
        rows.append(measure(replica, publish(ledger, folders[2], "step-2"), "step-2"))
        assert replica.loader is not None
        peak = vm_hwm(replica.loader.pid)
        engine_peak = vm_hwm(replica.engine.pid) if replica.engine else 0
    finally:
        if replica is not None:
            replica.stop()
        server.stop()
    report(
        args, full_bytes, largest, delta_bytes, cold_files, cold_serving, rows, peak, engine_peak
    )
    print(args.out.read_text())


def report(  # noqa: PLR0917 - one call site, every value is a measurement
    args: argparse.Namespace,
    full_bytes: int,
    largest: int,
    delta_bytes: int,
    cold_files: float,
    cold_serving: float,
    rows: list[dict[str, Any]],
    peak: int,
    engine_peak: int,
) -> None:
    """Write the run into the results file (between its bench_sidecar markers)."""
    mib = 2**20
    lines = [
        f"Command: `python benchmarks/bench_sidecar.py{' --scale ' + str(args.scale) if args.scale != 1.0 else ''}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}. Shared and noisy: read the split, not the last digit.",
        "",
        f"Model: Llama-shaped, bf16, {full_bytes / 2**30:.2f} GiB of tensors, largest shard "
        f"{largest / mib:.0f} MiB. Bucket: SeaweedFS (S3 API) on loopback. Engine: the reference "
        "engine (`hotload serve`, float32 compute on CPU). Loader: poll every 0.2 s, 2 codec "
        "threads. The arc_v2 delta of one lr-1e-6 step is "
        f"{delta_bytes / mib:.1f} MiB ({delta_bytes / full_bytes:.1%} of the full snapshot).",
        "",
        "Times in seconds from the ledger append returning to the loader reporting the engine "
        "on the new snapshot. `detect` is the poll delay (append to the loader starting); "
        "fetch is time spent waiting for downloads, rebuild is arc_v2 decoding (which checks "
        "every tensor of parent and result), verify is the final checksum pass over the "
        "staged snapshot, engine load is the hot load through the adapter (confirmed).",
        "",
        "| update | append -> serving | detect | fetch | rebuild | verify | engine load | bytes fetched |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {"step-1": "arc_v2 delta", "step-2": "full snapshot"}
    for r in rows:
        lines.append(
            f"| {names[r['identity']]} | **{r['append_to_serving_s']:.2f}** | {r['detect_s']:.2f} "
            f"| {r['fetch_s']:.2f} | {r['rebuild_s']:.2f} | {r['verify_s']:.2f} "
            f"| {r['engine_load_s']:.2f} | {r['bytes_fetched'] / mib:.1f} MiB |"
        )
    lines += [
        "",
        f"Cold start (full snapshot, engine process boot included): files ready after "
        f"{cold_files:.1f} s, serving after {cold_serving:.1f} s.",
        "",
        f"Peak RSS of the loader process over the whole run: **{peak / mib:.0f} MiB** "
        f"({peak / largest:.1f}x the largest shard; the model is {full_bytes / mib:.0f} MiB). "
        f"The engine process peaked at {engine_peak / mib:.0f} MiB (it holds the float32 model).",
        "",
        "```json",
        json.dumps(rows, indent=2),
        "```",
    ]
    # Only the generated run: the hand-written figures and the other runs stay.
    replace_section(args.out, "bench_sidecar", "\n".join(lines))


if __name__ == "__main__":
    main()
