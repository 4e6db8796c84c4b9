"""Benchmark: sparse hot loads against today's full reload, on the reference engine.

A bf16 Llama-shaped model (about 1 GiB at scale 1) takes training steps that move a fraction of
its elements by one ulp (what an RL step does to bf16 weights); steps 1 and 2 are published as
arc_v2 deltas, step 3 as a full snapshot, to a real S3 server (SeaweedFS). One replica (the
loader `python -m hotload_sidecar` and the reference engine `hotload serve`, full API on a
loopback admin port) follows the ledger twice in one run: with sparse hot loads (the default),
then with `--sparse-max-changed 0` (today's path: rebuild, verify, full reload). For each update:
the time from the ledger append returning to the loader reporting the engine on it, the engine's
pause, and peak RSS of the loader and the engine during the delta updates (`VmHWM`, reset after
the cold start through `/proc/PID/clear_refs`). Uploads are timed apart (publish-to-serving is
upload plus append-to-serving).

    .venv/bin/python benchmarks/bench_sparse_load.py              # ~1 GiB model
    .venv/bin/python benchmarks/bench_sparse_load.py --scale 0.1  # quick smoke run

Results go to benchmarks/RESULTS-sparse-load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_sidecar import append, model_config, vm_hwm

from hotload.bucket import open_bucket, upload_snapshot
from hotload.ledger import Ledger
from hotload.snapshot import describe_snapshot, write_snapshot
from support.fleet import Replica, free_port, http_json, wait_for
from support.seaweedfs import SeaweedFS
from support.tiny_llm import sparse_steps

HERE = Path(__file__).resolve().parent
DELTAS = ("step-1", "step-2")
FULL = "step-3"


def build_model(work: Path, scale: float, fraction: float) -> tuple[list[Path], list[Path], int]:
    """Steps 0..3 of a bf16 Llama (random weights, ~1 GiB at scale 1) and their deltas."""
    import torch
    from transformers import LlamaForCausalLM

    config, side = model_config(work, scale)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)

    def tensors() -> Any:
        for name, shape in shapes.items():
            yield name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    base = write_snapshot(work / "base", tensors(), side_files_from=side, overwrite=True).path
    fulls, deltas = sparse_steps(base, work, 3, fraction=fraction, seed=1)
    return fulls, deltas, describe_snapshot(fulls[0]).full_bytes


def upload(ledger: Ledger, folder: Path, identity: str) -> float:
    """Upload a snapshot folder under `identity`; return the seconds it took."""
    desc = describe_snapshot(folder)
    t0 = time.perf_counter()
    upload_snapshot(
        folder, ledger.bucket, identity, files=desc.files, manifest_files=desc.manifest_files
    )
    return time.perf_counter() - t0


def reset_hwm(pid: int) -> None:
    """Reset a process's peak RSS (VmHWM) to its current RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def measure(replica: Replica, appended: float, identity: str) -> dict[str, Any]:
    """Wait for the engine to serve `identity`, then for the loader to be done with it (for a
    sparse load: the full snapshot rebuilt on the volume); return the split and both times."""
    status_url = replica.full_api_url + "/hotload/v1/status"

    def engine_serves() -> bool:
        return http_json("GET", status_url)[1].get("identity") == identity

    wait_for(f"the engine serving {identity}", engine_serves, 900, interval=0.02)
    serving = time.perf_counter()
    status = replica.wait_serving(identity, timeout=900)
    while os.readlink(replica.weights / "current") != f"snapshots/{identity}":
        time.sleep(0.05)
    settled = time.perf_counter()
    engine = http_json("GET", status_url)[1]
    last = status["last_load"]
    return {
        "identity": identity,
        "method": last["method"],
        "append_to_serving_s": round(serving - appended, 3),
        "append_to_volume_s": round(settled - appended, 3),
        "pause_s": engine["last_pause_seconds"],
        "engine_load_s": round(last["load_seconds"], 3),
        "fetch_s": round(last["fetch_seconds"], 3),
        "prepare_or_rebuild_s": round(last["rebuild_seconds"], 3),
        "verify_s": round(last["verify_seconds"], 3),
        "bytes_fetched": last["bytes_fetched"],
    }


def phase(
    server: SeaweedFS,
    work: Path,
    fulls: list[Path],
    deltas: list[Path],
    *,
    name: str,
    loader_args: list[str],
) -> dict[str, Any]:
    """Follow a fresh ledger through step-0 (cold), two deltas and a full snapshot."""
    env = {**os.environ, **server.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    ledger = Ledger(open_bucket(server.url("bench")), name)
    replica = Replica(
        name,
        work / f"replica-{name}",
        f"{server.url('bench')}/{name}",
        env,
        loader_args=["--poll-seconds", "0.2", "--threads", "2", *loader_args],
        admin_port=free_port(),
    )
    try:
        append(ledger, fulls[0], "step-0")
        replica.start(timeout=900)
        replica.wait_serving("step-0", timeout=900)
        assert replica.loader is not None and replica.engine is not None
        pids = {"loader": replica.loader.pid, "engine": replica.engine.pid}
        for pid in pids.values():
            reset_hwm(pid)
        rows = []
        for k, identity in enumerate(DELTAS, start=1):
            # Returns once the volume holds the snapshot too: the next delta's parent.
            rows.append(measure(replica, append(ledger, deltas[k], identity), identity))
        peaks = {k: vm_hwm(pid) for k, pid in pids.items()}
        rows.append(measure(replica, append(ledger, fulls[3], FULL), FULL))
        return {"rows": rows, "delta_peaks": peaks}
    finally:
        replica.stop()


def main() -> None:
    """Run the benchmark and write RESULTS-sparse-load.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="1.0 = ~1 GiB model")
    parser.add_argument("--fraction", type=float, default=0.015, help="elements moved per step")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS-sparse-load.md")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-sparse-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"building the model in {work} ...", flush=True)
    t0 = time.perf_counter()
    fulls, deltas, full_bytes = build_model(work / "model", args.scale, args.fraction)
    delta_bytes = [describe_snapshot(deltas[k]).shipped_bytes for k in (1, 2)]
    print(f"built in {time.perf_counter() - t0:.0f}s", flush=True)
    server = SeaweedFS.start(work / "seaweedfs")
    try:
        os.environ.update(server.env)
        bucket_ledger = Ledger(open_bucket(server.url("bench")), "uploads")
        uploads = {
            "step-0": upload(bucket_ledger, fulls[0], "step-0"),
            "step-1": upload(bucket_ledger, deltas[1], "step-1"),
            "step-2": upload(bucket_ledger, deltas[2], "step-2"),
            FULL: upload(bucket_ledger, fulls[3], FULL),
        }
        sparse = phase(server, work, fulls, deltas, name="sparse", loader_args=[])
        full = phase(
            server, work, fulls, deltas, name="full", loader_args=["--sparse-max-changed", "0"]
        )
    finally:
        server.stop()
    report(
        args,
        full_bytes=full_bytes,
        delta_bytes=delta_bytes,
        uploads=uploads,
        sparse=sparse,
        full=full,
    )
    print(args.out.read_text())


def report(
    args: argparse.Namespace,
    *,
    full_bytes: int,
    delta_bytes: list[int],
    uploads: dict[str, float],
    sparse: dict[str, Any],
    full: dict[str, Any],
) -> None:
    """Write the markdown results."""
    mib = 2**20
    command = "python benchmarks/bench_sparse_load.py"
    if args.scale != 1.0:
        command += f" --scale {args.scale}"
    if args.fraction != 0.015:
        command += f" --fraction {args.fraction}"
    lines = [
        "# Sparse hot loads: benchmark",
        "",
        f"Command: `nice -n 10 {command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}. Shared and noisy: compare "
        "ratios within this run, not the last digit.",
        "",
        f"Model: Llama-shaped, bf16, {full_bytes / 2**30:.2f} GiB of tensors, random weights; "
        f"each step moves {args.fraction:.1%} of every tensor's elements by one ulp. Deltas: "
        + ", ".join(f"{b / mib:.1f} MiB" for b in delta_bytes)
        + ". Bucket: SeaweedFS (S3 API) on loopback. Engine: the reference engine (`hotload "
        "serve`, float32 compute on CPU, full API on a loopback admin port). Loader: poll every "
        "0.2 s, 2 codec threads. One run: the same snapshots followed with sparse loads (the "
        "default), then with `--sparse-max-changed 0` (today's full reload).",
        "",
        "Times in seconds. append -> serving: the ledger append returning to the engine's "
        "status naming the snapshot (polled every 20 ms; publish -> serving adds the upload); "
        "append -> on the volume: to the loader done with it, `current` moved (for a sparse "
        "load: the full snapshot rebuilt and verified after the engine serves it). pause: how "
        "long the engine held generation (its `last_pause_seconds`). prepare / rebuild: for a "
        "sparse load the patch preparation (every chunk and tensor checked), else the arc_v2 "
        "rebuild.",
        "",
        "| loader | update | method | upload | append -> serving | publish -> serving "
        "| pause ms | engine load | fetch | prepare / rebuild | verify | append -> on the volume "
        "| bytes fetched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, phase_rows in (("sparse on", sparse["rows"]), ("sparse off", full["rows"])):
        for r in phase_rows:
            up = uploads[r["identity"]]
            lines.append(
                f"| {label} | {r['identity']} | {r['method']} | {up:.2f} "
                f"| **{r['append_to_serving_s']:.2f}** | {up + r['append_to_serving_s']:.2f} "
                f"| **{r['pause_s'] * 1000:.1f}** | {r['engine_load_s']:.2f} | {r['fetch_s']:.2f} "
                f"| {r['prepare_or_rebuild_s']:.2f} | {r['verify_s']:.2f} "
                f"| {r['append_to_volume_s']:.2f} | {r['bytes_fetched'] / mib:.1f} MiB |"
            )
    sp = [r for r in sparse["rows"] if r["identity"] in DELTAS]
    fu = [r for r in full["rows"] if r["identity"] in DELTAS]
    pause_ratio = sum(r["pause_s"] for r in sp) / max(1e-9, sum(r["pause_s"] for r in fu))
    full_snap = (
        uploads[FULL]
        + (sparse["rows"][-1]["append_to_serving_s"] + full["rows"][-1]["append_to_serving_s"]) / 2
    )
    delta_pts = [uploads[r["identity"]] + r["append_to_serving_s"] for r in sp]
    lines += [
        "",
        "Goals, as ratios within this run:",
        "",
        f"- pause of a sparse patch / pause of the full reload of the same deltas: "
        f"**{pause_ratio:.1%}** (goal <= 10%)",
        "- publish -> serving of a delta as a sparse patch: "
        + ", ".join(f"{x:.2f} s" for x in delta_pts)
        + f"; of a full snapshot (mean of both phases): {full_snap:.2f} s: "
        f"**{max(delta_pts) / full_snap:.0%}** of it (goal < 100%)",
        "",
        "Peak RSS during the two delta updates (VmHWM reset after the cold start):",
        "",
        "| loader | loader process | engine process |",
        "|---|---|---|",
        f"| sparse on | {sparse['delta_peaks']['loader'] / mib:.0f} MiB "
        f"| {sparse['delta_peaks']['engine'] / mib:.0f} MiB |",
        f"| sparse off | {full['delta_peaks']['loader'] / mib:.0f} MiB "
        f"| {full['delta_peaks']['engine'] / mib:.0f} MiB |",
        "",
        "```json",
        json.dumps({"uploads": uploads, "sparse": sparse, "full": full}, indent=2),
        "```",
        "",
    ]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
