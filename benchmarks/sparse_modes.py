"""The scaling and cadence runs of bench_sparse_load.py (issue 26: every update costs what
changed, whatever the model's size, and a replica keeps pace with a trainer).

Scaling: the same number of changed elements per step on the ~1 GiB model and on one 3x larger,
both engines, in one run; on the larger, once spread over all its tensors and once on the
tensors the smaller has (`local`: as many tensors, files and pages touched; only the model's
size differs). Per delta update: the loader's and the engine's CPU seconds (every
thread, background work included: from the ledger append until a few seconds after the engine
serves it, minus what the same processes burn idle over as long), the bytes the loader wrote to
the weights volume (its `lastLoad.volumeBytesWritten`), the bytes the engine read for checksums
(its own counter), publish -> serving (upload plus append -> serving).

Cadence: 30 deltas of the ~1 GiB model uploaded and appended back to back while one replica
follows: which deltas it served (as patches, skipping ahead), whether any update fell back to a
full reload, and the lag of the last delta against the first's.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_sidecar import append
from sparse_common import upload

from hotload.arc import encode
from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.snapshot import RawTensor, Snapshot, write_snapshot
from hotload.snapshot.safetensors_io import iter_file
from support.fleet import Replica, http_json, wait_for
from support.seaweedfs import SeaweedFS

#: Seconds after the engine serves an update that still count as the update's (background work:
#: before issue 26 the engine re-read every weight for its checksums here).
TAIL_SECONDS = 3.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of processes `pids` and every process below them."""
    total = 0.0
    for pid in _family(pids):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def _family(pids: list[int]) -> list[int]:
    out: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def idle_rate(pids: list[int], seconds: float = 3.0) -> float:
    """CPU seconds per second the processes burn with nothing to do (vLLM's loops, the scrub)."""
    c0 = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - c0) / seconds


def rolling_steps(
    base: Path, root: Path, steps: int, *, fraction: float, seed: int
) -> tuple[Path, list[Path], list[float]]:
    """`steps` training steps after full snapshot `base` (each moving `fraction` of every
    tensor's elements by one ulp) as arc_v2 deltas `root/delta/step-K`; only the last full
    snapshot stays on disk. Returns (the first full, the deltas, each one's encode seconds)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, RawTensor] = {}
    for shard in sorted(base.glob("*.safetensors")):
        for name, raw in iter_file(shard):
            tensors[name] = RawTensor(raw.dtype, raw.shape, np.array(raw.data))
    first = write_snapshot(root / "full" / "step-0", dict(tensors), side_files_from=base).path
    previous = first
    deltas: list[Path] = []
    encodes: list[float] = []
    for step in range(1, steps + 1):
        for raw in tensors.values():
            bits = raw.data.view("<u2")
            at = np.unique(rng.integers(0, bits.size, max(1, int(bits.size * fraction))))
            bits[at] += 1
        full = write_snapshot(
            root / "full" / f"step-{step}", dict(tensors), side_files_from=base
        ).path
        delta = root / "delta" / f"step-{step}"
        t0 = time.perf_counter()
        encode(previous, full, delta, parent_identity=previous.name, threads=2)
        encodes.append(time.perf_counter() - t0)
        deltas.append(delta)
        if previous != first:
            shutil.rmtree(previous)
        previous = full
    shutil.rmtree(previous)
    return first, deltas, encodes


def engine_counters(engine: Any, replica: Replica) -> dict[str, int]:
    """The engine's own counters (summed over vLLM's ranks)."""
    if engine.kind == "vllm":
        assert engine.server is not None
        body = http_json(
            "POST",
            engine.server.url + "/collective_rpc",
            {"method": "hotload_state", "args": [], "kwargs": {}},
        )[1]
        out: dict[str, int] = {}
        for rank in body["results"]:
            for key, value in rank["counters"].items():
                out[key] = out.get(key, 0) + int(value)
        return out
    return dict(http_json("GET", replica.full_api_url + "/hotload/v1/status")[1]["counters"])


def one_update(
    engine: Any,
    replica: Replica,
    ledger: Ledger,
    folder: Path,
    *,
    identity: str,
    pids: list[int],
) -> dict[str, Any]:
    """Publish one delta and measure its update (see the module docstring)."""
    rate = idle_rate(pids, 10.0)
    before, c0 = engine_counters(engine, replica), cpu_seconds(pids)
    uploaded = upload(ledger, folder, identity)
    t0 = time.perf_counter()
    appended = append(ledger, folder, identity)
    wait_for(
        f"the engine serving {identity}",
        lambda: engine.serving(replica) == identity,
        900,
        interval=0.02,
    )
    serving = time.perf_counter()
    status = replica.wait_serving(identity, timeout=900)
    time.sleep(max(0.0, serving + TAIL_SECONDS - time.perf_counter()))
    window = time.perf_counter() - t0
    spent = cpu_seconds(pids) - c0
    after = engine_counters(engine, replica)
    last = status["last_load"]
    return {
        "identity": identity,
        "method": last["method"],
        "fallback": last["sparse_fallback"],
        "upload_s": round(uploaded, 3),
        "publish_to_serving_s": round(uploaded + serving - appended, 3),
        "cpu_s": round(spent, 3),
        "idle_cpu_per_s": round(rate, 3),
        "window_s": round(window, 3),
        "net_cpu_s": round(spent - rate * window, 3),
        "volume_bytes_written": last["volume_bytes_written"],
        "checksum_bytes_read": after.get("checksum_bytes", 0) - before.get("checksum_bytes", 0),
        "scrub_bytes_read": after.get("scrub_bytes", 0) - before.get("scrub_bytes", 0),
        "patched_elements": after.get("patched_elements", 0) - before.get("patched_elements", 0),
        "fetch_s": round(last["fetch_seconds"], 3),
        "prepare_s": round(last["rebuild_seconds"], 3),
        "engine_s": round(last["load_seconds"], 3),
        "pause_s": round(last["pause_seconds"], 4),
        "engine_steps": last.get("engine_steps", {}),
    }


def scaling_size(
    server: SeaweedFS,
    engine: Any,
    fulls: list[Path],
    deltas: list[Path],
    *,
    name: str,
    bucket: str,
) -> list[dict[str, Any]]:
    """One engine, one model size (its own `bucket`: identities are immutable there): step-0
    cold, then each delta measured."""
    env = {**os.environ, **server.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    ledger = Ledger(open_bucket(server.url(bucket)), name)
    args = ["--threads", "2", "--poll-seconds", "0.1"]
    replica = engine.replica(name, f"{server.url(bucket)}/{name}", env, args)
    try:
        upload(ledger, fulls[0], "step-0")
        append(ledger, fulls[0], "step-0")
        engine.start(replica)
        replica.wait_serving("step-0", timeout=900)
        # The engine's first read of its weights (after the start) is not an update's: it
        # counts as it goes (a background thread of low priority), so wait for all of it.
        tensor_bytes = Snapshot(fulls[0]).full_bytes
        wait_for(
            "the engine's checksums of step-0",
            lambda: engine_counters(engine, replica).get("checksum_bytes", 0) >= tensor_bytes,
            900,
        )
        # Every process of the replica: the loader, the engine (vLLM: its server and the
        # engine core below it).
        assert replica.loader is not None
        root = (
            engine.server.process.pid if engine.kind == "vllm" else engine.pids(replica)["engine"]
        )
        pids = [replica.loader.pid, root]
        return [
            one_update(engine, replica, ledger, deltas[k], identity=f"step-{k}", pids=pids)
            for k in range(1, len(deltas))
        ]
    finally:
        replica.stop()


def cadence(
    server: SeaweedFS,
    engine: Any,
    first: Path,
    deltas: list[Path],
    *,
    name: str,
    encodes: list[float] | None,
    period: float | None = None,
) -> dict[str, Any]:
    """Publish every delta one after the other while one replica follows (module docstring):
    with `period`, a trainer appending one delta every `period` seconds (the upload inside
    it, never earlier); with `encodes`, each delta waits as long as it took to encode before
    its upload (the trainer's own loop: encode, upload, append, next); with neither, as fast
    as the bucket takes them (a burst)."""
    env = {**os.environ, **server.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    ledger = Ledger(open_bucket(server.url(f"cadence-{name}")), name)
    url = f"{server.url(f'cadence-{name}')}/{name}"
    replica = engine.replica(name, url, env, ["--threads", "2"])
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                served = engine.serving(replica)
            except Exception:  # the engine is restarting or busy: look again
                served = None
            if served and served not in seen:
                seen[served] = time.perf_counter()
            time.sleep(0.02)

    try:
        upload(ledger, first, "step-0")
        append(ledger, first, "step-0")
        engine.start(replica)
        replica.wait_serving("step-0", timeout=900)
        # What the start-up did (vLLM boots its own copy and is loaded once) is not the burst's.
        before = replica.metrics()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        published: dict[str, float] = {}
        uploads: list[float] = []
        start = time.perf_counter()
        for k, folder in enumerate(deltas, start=1):
            if period is not None:
                # A fixed clock, so that a slow upload does not stretch every later period.
                time.sleep(max(0.0, start + (k - 1) * period - time.perf_counter()))
            elif encodes is not None:
                time.sleep(encodes[k - 1])  # the trainer encoding it
            uploads.append(upload(ledger, folder, f"step-{k}"))
            published[f"step-{k}"] = append(ledger, folder, f"step-{k}")
        last = f"step-{len(deltas)}"
        replica.wait_serving(last, timeout=900)
        stop.set()
        watcher.join(timeout=5)
        metrics = replica.metrics()
        status = replica.status()
    finally:
        stop.set()
        replica.stop()
    served = [i for i in published if i in seen]
    # A delta is live once the engine serves it or anything after it (skipped ahead of, it
    # still reached the engine, in a patch of several).
    order = list(published)
    lags = {}
    for k, identity in enumerate(order):
        live = min((seen[j] for j in order[k:] if j in seen), default=None)
        if live is not None:
            lags[identity] = round(live - published[identity], 3)
    return {
        "paced": encodes is not None or period is not None,
        "period": period,
        "deltas": len(deltas),
        "publish_seconds": round(max(published.values()) - min(published.values()), 3),
        "upload_s_mean": round(sum(uploads) / len(uploads), 3),
        "encode_s_mean": round(sum(encodes) / len(encodes), 3) if encodes else 0.0,
        "served": served,
        "lags": lags,
        "sparse_loads": _grew(before, metrics, 'hotload_loader_loads_total{method="sparse"}'),
        "full_loads": _grew(before, metrics, 'hotload_loader_loads_total{method="full"}'),
        "prepared_ahead": _grew(before, metrics, "hotload_loader_patches_prepared_ahead_total"),
        "fallbacks": _fallbacks(metrics) - _fallbacks(before),
        "last_load": status["last_load"],
    }


def _sample(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _grew(before: str, after: str, sample: str) -> float:
    return _sample(after, sample) - _sample(before, sample)


def _fallbacks(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hotload_loader_sparse_fallbacks_total{")
    )
