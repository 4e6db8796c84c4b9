"""Benchmark: sparse hot loads against today's full reload, on the reference engine and vLLM.

A bf16 Llama-shaped model (about 1 GiB at scale 1) takes training steps that move a fraction of
its elements by one ulp (what an RL step does to bf16 weights); steps 1 and 2 are published as
arc_v2 deltas, step 3 as a full snapshot, to a real S3 server (SeaweedFS). For each engine, one
replica (the loader `python -m hotload_sidecar` beside the engine: the reference engine `hotload
serve` with its full API on a loopback admin port, or vLLM's CPU build with hotload's worker
extension, copied onto the weights volume by the loader as in the operator's pods) follows the
ledger twice in one run: with sparse hot loads (the default), then with `--sparse-max-changed 0`
(today's path: rebuild, verify, full reload). For each update: the time from the ledger append
returning to the engine serving it, the engine's pause (the loader's `last_load.pause_seconds`),
and peak RSS of the loader and the engine during the delta updates (`VmHWM`, reset after the
cold start through `/proc/PID/clear_refs`; vLLM: its engine-core process, which holds the
weights). Uploads are timed apart (publish-to-serving is upload plus append-to-serving). One
vLLM server serves both of its phases (a second start would add minutes, not information).

    .venv/bin/python benchmarks/bench_sparse_load.py                      # ~1 GiB, both engines
    .venv/bin/python benchmarks/bench_sparse_load.py --scale 0.1          # quick smoke run
    .venv/bin/python benchmarks/bench_sparse_load.py --engines reference  # one engine
    .venv/bin/python benchmarks/bench_sparse_load.py --mode issue26       # scaling + cadence

`--mode scaling` and `--mode cadence` (both: `--mode issue26`) measure what issues 26 and 38
ask: per-update cost at two model sizes (and on the larger with the change on the smaller's
tensors), and on a pair with the same tensors and files and 3x the bytes (`--sizes`),
and a trainer publishing deltas back to back
(`sparse_modes.py`, `sparse_runs.py`); their sections of the results file are rewritten, the
others kept.

Each mode writes only its run in benchmarks/RESULTS-sparse-load.md, between its markers
(`bench_sparse_load-compare`, `-scaling`, `-cadence`; benchmarks/results.py). The work
folder (models, the bucket, the volumes: up to 26 GiB for `--mode issue26`, checked before starting) is a temporary folder
removed at the end, unless `--workdir` or `--keep` is given.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_sidecar import append, proc_status_bytes, vm_hwm
from results import replace_section
from sparse_common import build_model, upload

from hotload.arc.patch import prepare_patch
from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.snapshot import describe_snapshot
from support.fleet import Replica, free_port, http_json, wait_for
from support.seaweedfs import SeaweedFS
from support.vllm_server import INSTALL_HINT, VLLMServer, vllm_python

HERE = Path(__file__).resolve().parent
DELTAS = ("step-1", "step-2")
FULL = "step-3"


def reset_hwm(pid: int) -> None:
    """Reset a process's peak RSS (VmHWM) to its current RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class Engine:
    """The engine under test: how to start it beside a loader, ask what it serves, and which
    process holds its weights."""

    kind = "reference"

    def __init__(self, work: Path, *, scrub: bool = True) -> None:
        self.work = work
        #: Whether the engine scrubs its weights (at its default rate) while measured.
        self.scrub = scrub

    def replica(self, name: str, ledger_url: str, env: dict[str, str], args: list[str]) -> Replica:
        """A replica for one phase (not started)."""
        return Replica(name, self.work / f"replica-{name}", ledger_url, env, **self.wiring(args))

    def wiring(self, args: list[str]) -> dict[str, Any]:
        """How the replica's loader reaches its engine: the reference engine beside it."""
        engine_args = [] if self.scrub else ["--scrub-bytes-per-second", "0"]
        return {"loader_args": args, "admin_port": free_port(), "engine_args": engine_args}

    def start(self, replica: Replica) -> None:
        """Start the loader and the engine."""
        replica.start(timeout=900)

    def serving(self, replica: Replica) -> str | None:
        """The identity the engine serves now."""
        status = http_json("GET", replica.full_api_url + "/hotload/v1/status")[1]
        return status.get("identity")

    def pids(self, replica: Replica) -> dict[str, int]:
        """The loader's and the engine's process ids."""
        assert replica.loader is not None and replica.engine is not None
        return {"loader": replica.loader.pid, "engine": replica.engine.pid}

    def close(self) -> None:
        """Stop what outlives one phase."""


class VLLMEngine(Engine):
    """vLLM's CPU build with hotload's worker extension; one server for both phases."""

    kind = "vllm"

    def __init__(self, work: Path, *, scrub: bool = True) -> None:
        super().__init__(work, scrub=scrub)
        self.server: VLLMServer | None = None
        self.port = free_port()
        #: Greedy decode tokens/s of one request, by how vLLM holds its linear weights.
        self.decode: dict[str, float] = {}

    def packed_decode_rate(self, model: Path) -> None:
        """Decode speed with vLLM's own CPU kernels (weights repacked), for comparison."""
        from hotload.api.names import VLLM_WORKER_EXTENSION

        server = VLLMServer.start(
            model,
            self.work / "vllm-packed.log",
            extra_args=("--worker-extension-cls", VLLM_WORKER_EXTENSION),
            extra_env={"PYTHONPATH": str(HERE.parent), "HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS": "0"},
        )
        try:
            self.decode["vLLM's packed kernels (HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS=0)"] = decode_rate(
                server
            )
        finally:
            server.stop()

    def wiring(self, args: list[str]) -> dict[str, Any]:
        """A loader only, pointed at the vLLM server (its port is chosen up front)."""
        return {"loader_args": ["--engine", "vllm", *args], "engine_port": self.port}

    def start(self, replica: Replica) -> None:
        """Start the loader; the first time, vLLM on what it materialised, as in a pod (the
        kubelet starts the engine once the loader's startup probe passes)."""
        replica.start_loader()
        replica.wait_started(timeout=900)
        if self.server is None:
            from hotload.api.names import ENGINE_PYTHONPATH_DIR, VLLM_WORKER_EXTENSION

            self.server = VLLMServer.start(
                replica.weights / "current",
                self.work / "vllm.log",
                port=self.port,
                extra_args=("--worker-extension-cls", VLLM_WORKER_EXTENSION),
                extra_env={
                    "PYTHONPATH": str(replica.weights / ENGINE_PYTHONPATH_DIR),
                    **({} if self.scrub else {"HOTLOAD_SCRUB_BYTES_PER_SECOND": "0"}),
                },
            )
            print(f"vLLM started in {self.server.start_seconds:.0f}s", flush=True)
            self.decode["plain weights (hotload's extension)"] = decode_rate(self.server)

    def serving(self, replica: Replica) -> str | None:
        """vLLM's weight version."""
        assert self.server is not None
        return http_json("GET", self.server.url + "/weight_info")[1].get("weight_version")

    def pids(self, replica: Replica) -> dict[str, int]:
        """The loader and vLLM's engine-core process: of vLLM's processes, the largest (the
        one that holds the weights; the API server and helpers are small)."""
        assert replica.loader is not None and self.server is not None
        family = [self.server.process.pid, *descendants(self.server.process.pid)]
        return {"loader": replica.loader.pid, "engine": max(family, key=vm_rss)}

    def close(self) -> None:
        """Stop vLLM."""
        if self.server is not None:
            self.server.stop()


def decode_rate(server: VLLMServer, tokens: int = 64, runs: int = 3) -> float:
    """Best greedy decode rate (tokens/s) of one request of `tokens` tokens over `runs`."""
    best = 0.0
    for _ in range(runs):
        t0 = time.perf_counter()
        server.completion_ids([101, 2023, 2003, 1037, 3231], tokens)
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (int(c) for c in (task / "children").read_text().split()):
            found += [child, *descendants(child)]
    return found


def vm_rss(pid: int) -> int:
    """Resident set size of a running process, in bytes (0 when it is gone)."""
    try:
        return proc_status_bytes(pid, "VmRSS")
    except OSError:
        return 0


def measure(engine: Engine, replica: Replica, appended: float, identity: str) -> dict[str, Any]:
    """Wait for the engine to serve `identity`, then for the loader to be done with it (for a
    sparse load: the full snapshot rebuilt on the volume); return the split and both times."""
    wait_for(
        f"the engine serving {identity}",
        lambda: engine.serving(replica) == identity,
        900,
        interval=0.02,
    )
    serving = time.perf_counter()
    status = replica.wait_serving(identity, timeout=900)
    # On the volume: as a snapshot (a full load), or as a delta after one (a sparse load).
    while (
        os.readlink(replica.weights / "current") != f"snapshots/{identity}"
        and not (replica.weights / "deltas" / identity).is_dir()
    ):
        time.sleep(0.05)
    settled = time.perf_counter()
    last = status["last_load"]
    return {
        "identity": identity,
        "method": last["method"],
        "fallback": last["sparse_fallback"],
        "append_to_serving_s": round(serving - appended, 3),
        "append_to_volume_s": round(settled - appended, 3),
        "pause_s": last["pause_seconds"],
        "engine_load_s": round(last["load_seconds"], 3),
        "fetch_s": round(last["fetch_seconds"], 3),
        "prepare_or_rebuild_s": round(last["rebuild_seconds"], 3),
        "verify_s": round(last["verify_seconds"], 3),
        "bytes_fetched": last["bytes_fetched"],
    }


def phase(
    server: SeaweedFS,
    engine: Engine,
    fulls: list[Path],
    deltas: list[Path],
    *,
    name: str,
    loader_args: list[str],
) -> dict[str, Any]:
    """Follow a fresh ledger through step-0 (cold), two deltas and a full snapshot."""
    env = {**os.environ, **server.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    ledger = Ledger(open_bucket(server.url("bench")), name)
    args = ["--poll-seconds", "0.2", "--threads", "2", *loader_args]
    replica = engine.replica(name, f"{server.url('bench')}/{name}", env, args)
    try:
        append(ledger, fulls[0], "step-0")
        engine.start(replica)
        replica.wait_serving("step-0", timeout=900)
        pids = engine.pids(replica)
        for pid in pids.values():
            reset_hwm(pid)
        rows = []
        for k, identity in enumerate(DELTAS, start=1):
            # Returns once the volume holds the snapshot too: the next delta's parent.
            rows.append(measure(engine, replica, append(ledger, deltas[k], identity), identity))
        peaks = {k: vm_hwm(pid) for k, pid in pids.items()}
        rows.append(measure(engine, replica, append(ledger, fulls[3], FULL), FULL))
        return {"rows": rows, "delta_peaks": peaks}
    finally:
        replica.stop()


def main() -> None:
    """Run the benchmark and write RESULTS-sparse-load.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode",
        default="compare",
        choices=["compare", "scaling", "cadence", "issue26"],
        help="compare: sparse against full loads (issue 20); scaling: ~1 GiB against 3x; "
        "cadence: 30 deltas back to back; issue26: scaling then cadence",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="1.0 = ~1 GiB model")
    parser.add_argument(
        "--large-scale", type=float, default=3.5, help="scaling: the larger model (3.5: ~3x)"
    )
    parser.add_argument("--fraction", type=float, default=0.015, help="elements moved per step")
    parser.add_argument(
        "--sizes",
        default="small,large,local,narrow,wide",
        help="scaling: the models, comma-separated, each after its baseline: small (the ~1 GiB "
        "model), large (3x its layers) and local (large, the change on small's tensors) against "
        "small; narrow (2 layers, hidden 1024) and wide (hidden 2304: the same tensors and "
        "files, 3x the bytes) against narrow",
    )
    parser.add_argument("--cadence-deltas", type=int, default=30)
    parser.add_argument(
        "--periods",
        default="",
        help="cadence: trainer periods in seconds, comma-separated (e.g. 1.0,1.5): one run per "
        "period and engine, a delta appended every period, instead of the paced and burst runs",
    )
    parser.add_argument("--engines", default="reference,vllm", help="comma-separated")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where models, bucket and volumes go (kept; default: a temporary folder, removed "
        "at the end unless --keep)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS-sparse-load.md")
    args = parser.parse_args()
    args.sizes = [z.strip() for z in args.sizes.split(",") if z.strip()]
    try:
        args.periods = [float(p) for p in args.periods.split(",") if p.strip()]
    except ValueError:
        parser.error(f"--periods: seconds, comma-separated, not {args.periods!r}")
    if any(p <= 0 for p in args.periods):
        parser.error(f"--periods: each above 0 s, not {args.periods}")
    if not args.sizes or set(args.sizes) - {"small", "large", "local", "narrow", "wide"}:
        parser.error(f"--sizes: small, large, local, narrow and/or wide, not {args.sizes}")
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    unknown = set(kinds) - {"reference", "vllm"}
    if unknown or not kinds:
        parser.error(f"--engines: reference and/or vllm, not {sorted(unknown) or kinds}")
    if "vllm" in kinds and vllm_python() is None:
        parser.error(INSTALL_HINT)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-sparse-"))
    work.mkdir(parents=True, exist_ok=True)
    check_disk(work, args)
    try:
        run(args, kinds, work)
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work folder kept: {work}", flush=True)


#: Disk a run at the default scales filled at most (measured, GiB): models, bucket, volumes.
DISK_GIB = {"compare": 12, "scaling": 26, "cadence": 12, "issue26": 26}


def check_disk(work: Path, args: argparse.Namespace) -> None:
    """Stop before starting when `work`'s disk cannot hold the run (a full disk shows up late,
    as a bucket's HTTP 500 or a failed write in a replica)."""
    scale = max(args.scale, args.large_scale / 3.5 if args.mode in ("scaling", "issue26") else 0)
    need = DISK_GIB[args.mode] * max(scale, 0.1) * 2**30
    free = shutil.disk_usage(work).free
    if free < need:
        sys.exit(
            f"bench_sparse_load: {free / 2**30:.1f} GiB free under {work}, this run needs about "
            f"{need / 2**30:.0f} GiB: free some space or give --workdir on a larger disk"
        )


def run(args: argparse.Namespace, kinds: list[str], work: Path) -> None:
    """The chosen mode, in `work`."""
    if args.mode != "compare":
        from sparse_runs import run_issue26

        run_issue26(args, kinds, work, {"reference": Engine, "vllm": VLLMEngine})
        return
    print(f"building the model in {work} ...", flush=True)
    t0 = time.perf_counter()
    fulls, deltas, full_bytes = build_model(work / "model", args.scale, args.fraction)
    delta_bytes = [describe_snapshot(deltas[k]).shipped_bytes for k in (1, 2)]
    # What a loader writes for step-1: the memory goal allows "today's plus the patch size".
    patch_bytes = prepare_patch(fulls[0], deltas[1], work / "step-1.patch").bytes
    print(f"built in {time.perf_counter() - t0:.0f}s", flush=True)
    server = SeaweedFS.start(work / "seaweedfs")
    results: dict[str, dict[str, Any]] = {}
    try:
        os.environ.update(server.env)
        bucket_ledger = Ledger(open_bucket(server.url("bench")), "uploads")
        uploads = {
            "step-0": upload(bucket_ledger, fulls[0], "step-0"),
            "step-1": upload(bucket_ledger, deltas[1], "step-1"),
            "step-2": upload(bucket_ledger, deltas[2], "step-2"),
            FULL: upload(bucket_ledger, fulls[3], FULL),
        }
        for kind in kinds:
            engine = (VLLMEngine if kind == "vllm" else Engine)(work / kind)
            if isinstance(engine, VLLMEngine):
                engine.packed_decode_rate(fulls[0])
            try:
                print(f"{kind}: sparse loads on", flush=True)
                sparse = phase(server, engine, fulls, deltas, name=f"{kind}-sparse", loader_args=[])
                print(f"{kind}: sparse loads off", flush=True)
                full = phase(
                    server,
                    engine,
                    fulls,
                    deltas,
                    name=f"{kind}-full",
                    loader_args=["--sparse-max-changed", "0"],
                )
            finally:
                engine.close()
            results[kind] = {"sparse": sparse, "full": full}
            if isinstance(engine, VLLMEngine):
                results[kind]["decode_tokens_per_second"] = engine.decode
    finally:
        server.stop()
    report(
        args,
        full_bytes=full_bytes,
        delta_bytes=delta_bytes,
        patch_bytes=patch_bytes,
        uploads=uploads,
        results=results,
    )
    print(args.out.read_text())


def report(
    args: argparse.Namespace,
    *,
    full_bytes: int,
    delta_bytes: list[int],
    patch_bytes: int,
    uploads: dict[str, float],
    results: dict[str, dict[str, Any]],
) -> None:
    """Write the compare run into the results file (between its bench_sparse_load-compare markers)."""
    mib = 2**20
    command = "python benchmarks/bench_sparse_load.py"
    if args.scale != 1.0:
        command += f" --scale {args.scale}"
    if args.fraction != 0.015:
        command += f" --fraction {args.fraction}"
    if args.engines != "reference,vllm":
        command += f" --engines {args.engines}"
    lines = [
        f"Command: `nice -n 10 {command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}. Shared and noisy: compare "
        "ratios within this run, not the last digit.",
        "",
        f"Model: Llama-shaped, bf16, {full_bytes / 2**30:.2f} GiB of tensors, random weights; "
        f"each step moves {args.fraction:.1%} of every tensor's elements by one ulp. Deltas: "
        + ", ".join(f"{b / mib:.1f} MiB" for b in delta_bytes)
        + f"; step-1's patch file: {patch_bytes / mib:.1f} MiB. Bucket: SeaweedFS (S3 API) on loopback. Engines: the reference engine (`hotload "
        "serve`, float32 compute on CPU, full API on a loopback admin port) and vLLM's CPU build "
        "(float32, hotload's worker extension from the weights volume, plain linear weights: "
        "docs/engines.md). Loader: poll every 0.2 s, 2 codec threads. For each engine one run "
        "follows the same snapshots with sparse loads (the default), then with "
        "`--sparse-max-changed 0` (today's full reload).",
        "",
        "Times in seconds. append -> serving: the ledger append returning to the engine naming "
        "the snapshot (its status, or vLLM's weight version; polled every 20 ms; publish -> "
        "serving adds the upload); append -> on the volume: to the loader done with it, "
        "`current` moved (for a sparse load: the full snapshot rebuilt and verified after the "
        "engine serves it). pause: how long the engine held generation (the loader's "
        "`last_load.pause_seconds`). engine load: the adapter's whole call (staging, checks, "
        "pause, confirmation). prepare / rebuild: for a sparse load the patch preparation "
        "(every chunk and tensor checked), else the arc_v2 rebuild.",
        "",
        "| engine | loader | update | method | upload | append -> serving | publish -> serving "
        "| pause ms | engine load | fetch | prepare / rebuild | verify | append -> on the volume "
        "| bytes fetched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, result in results.items():
        for label, phase_rows in (
            ("sparse on", result["sparse"]["rows"]),
            ("sparse off", result["full"]["rows"]),
        ):
            for r in phase_rows:
                up = uploads[r["identity"]]
                method = r["method"] + (f" ({r['fallback']})" if r["fallback"] else "")
                lines.append(
                    f"| {kind} | {label} | {r['identity']} | {method} | {up:.2f} "
                    f"| **{r['append_to_serving_s']:.2f}** | {up + r['append_to_serving_s']:.2f} "
                    f"| **{r['pause_s'] * 1000:.1f}** | {r['engine_load_s']:.2f} "
                    f"| {r['fetch_s']:.2f} | {r['prepare_or_rebuild_s']:.2f} | {r['verify_s']:.2f} "
                    f"| {r['append_to_volume_s']:.2f} | {r['bytes_fetched'] / mib:.1f} MiB |"
                )
    lines += ["", "Goals, as ratios within this run:", ""]
    for kind, result in results.items():
        lines += goals(kind, result, uploads, delta_bytes, patch_bytes)
    lines += [
        "",
        "Peak RSS during the two delta updates (VmHWM reset after the cold start):",
        "",
        "| engine | loader | loader process | engine process |",
        "|---|---|---|---|",
    ]
    for kind, result in results.items():
        for label, key in (("sparse on", "sparse"), ("sparse off", "full")):
            peaks = result[key]["delta_peaks"]
            lines.append(
                f"| {kind} | {label} | {peaks['loader'] / mib:.0f} MiB "
                f"| {peaks['engine'] / mib:.0f} MiB |"
            )
    for kind, result in results.items():
        rates = result.get("decode_tokens_per_second")
        if rates:
            lines += ["", f"{kind}: greedy decode of one 64-token request, best of 3:", ""]
            lines += [f"- {how}: {rate:.1f} tokens/s" for how, rate in rates.items()]
    lines += [
        "",
        "```json",
        json.dumps(
            {
                "sizes": {"full": full_bytes, "deltas": delta_bytes, "patch": patch_bytes},
                "uploads": uploads,
                "results": results,
            },
            indent=2,
        ),
        "```",
    ]
    # Only the generated run: the hand-written figures and the reading of the numbers stay (to
    # be checked against the new numbers).
    replace_section(args.out, "bench_sparse_load-compare", "\n".join(lines))


def goals(
    kind: str,
    result: dict[str, Any],
    uploads: dict[str, float],
    delta_bytes: list[int],
    patch_bytes: int,
) -> list[str]:
    """The issue's goals for one engine, computed from its rows."""
    sparse, full = result["sparse"], result["full"]
    sp = [r for r in sparse["rows"] if r["identity"] in DELTAS]
    fu = [r for r in full["rows"] if r["identity"] in DELTAS]
    pause_ratio = sum(r["pause_s"] for r in sp) / max(1e-9, sum(r["pause_s"] for r in fu))
    full_rows = [sparse["rows"][-1], full["rows"][-1]]
    full_snap = uploads[FULL] + sum(r["append_to_serving_s"] for r in full_rows) / 2
    delta_pts = [uploads[r["identity"]] + r["append_to_serving_s"] for r in sp]
    # The bucket's read throughput, measured by the full snapshots fetched in the same run.
    throughput = sum(r["bytes_fetched"] for r in full_rows) / max(
        1e-9, sum(r["fetch_s"] for r in full_rows)
    )
    bounds = [
        3 * (b / throughput + r["prepare_or_rebuild_s"] + r["pause_s"])
        for b, r in zip(delta_bytes, sp, strict=True)
    ]
    peak = {key: result[key]["delta_peaks"] for key in ("sparse", "full")}
    mib = 2**20
    rss_met = all(
        peak["sparse"][proc] <= peak["full"][proc] + patch_bytes for proc in ("loader", "engine")
    )
    return [
        f"- {kind}: pause of a sparse patch / pause of the full reload of the same deltas: "
        f"**{pause_ratio:.1%}** (goal <= 10%)",
        f"- {kind}: publish -> serving of a delta as a sparse patch: "
        + ", ".join(f"{x:.2f} s" for x in delta_pts)
        + f"; of a full snapshot (mean of both phases): {full_snap:.2f} s: "
        f"**{max(delta_pts) / full_snap:.0%}** of it (goal < 100%)",
        f"- {kind}: publish -> serving of each delta against 3x (delta bytes / bucket read "
        f"throughput ({throughput / 2**20:.0f} MiB/s) + patch preparation + pause): "
        + ", ".join(f"{x:.2f} s <= {b:.2f} s" for x, b in zip(delta_pts, bounds, strict=True))
        + f": **{'met' if all(x <= b for x, b in zip(delta_pts, bounds, strict=True)) else 'missed'}**",
        f"- {kind}: peak RSS with patches against today's plus the patch "
        f"({patch_bytes / mib:.1f} MiB): "
        + ", ".join(
            f"{proc} {peak['sparse'][proc] / mib:.0f} MiB <= "
            f"{(peak['full'][proc] + patch_bytes) / mib:.0f} MiB"
            for proc in ("loader", "engine")
        )
        + f": **{'met' if rss_met else 'missed'}**",
    ]


if __name__ == "__main__":
    main()
