"""Benchmark: publish -> serving and the idle origin load, loaders polling the origin themselves
(every 2 s, as before issue 35) against the head handoff (the operator reads the ledger every
2 s and hands it over in the deployment's HotLoadHead; the loaders watch that object).

Set-up: the real control plane of `../shared/k8s` (started for the run), the CRDs, one namespace
per mode. The trainer publishes into a folder bucket without Snapshot objects (so neither mode
is helped by an admission). R loaders (default settings: 2 s polls, early fetch on) run in this
process, each with a reference engine (a tiny Llama); in the handoff mode the operator runs as a
cluster runs it (`python -m hotload_operator --standalone`, its own process, default settings:
head poll 2 s) and the kube-controller-manager creates the pods the loaders stand for. Origin
requests are counted per call on the loaders' `Bucket` objects (a folder has no door to count
at) over `--idle` seconds; the operator's, in another process, are not counted here: each of
its polls is one conditional GET and one LIST (tests/test_head_handoff.py counts them), shown
as 2 per 2 s. Then `--rounds` deltas, one at a time, each after a random pause (so the
publish falls anywhere in the poll cycle): publish (the ledger append) -> every loader serves it.

    .venv/bin/python benchmarks/bench_handoff.py                  # 2 replicas, 8 rounds
    .venv/bin/python benchmarks/bench_handoff.py --replicas 4 --rounds 5

Results: benchmarks/RESULTS-handoff.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hotload.bucket import Bucket, open_bucket  # noqa: E402
from hotload.kube import KubeClient, KubeConfig  # noqa: E402
from hotload.ledger import Ledger  # noqa: E402
from hotload_sidecar.config import Settings  # noqa: E402
from hotload_sidecar.engines import make_adapter  # noqa: E402
from hotload_sidecar.head_watch import HeadWatch  # noqa: E402
from hotload_sidecar.loader import Loader  # noqa: E402
from hotload_sidecar.status import LocalReporter  # noqa: E402
from support.cluster import cluster_script, install_crds, start_cluster, stop_cluster  # noqa: E402
from support.engines import serve  # noqa: E402
from support.fleet import Trainer  # noqa: E402
from support.operator import hld_body, hld_path, play_deployment_controller  # noqa: E402
from support.tiny_llm import TinyLLM, build_tiny_llm  # noqa: E402

JSON = dict[str, Any]
CALLS: list[str] = []


def count_bucket_calls() -> None:
    """Count every bucket call of this process (reads, writes, listings)."""
    local, call = Bucket._local, Bucket._call

    async def counted_local(self: Bucket, key: str, op: str, fn: Any) -> Any:
        CALLS.append(op)
        return await local(self, key, op, fn)

    async def counted_call(self: Bucket, key: str, op: str, fn: Any, **kw: Any) -> Any:
        CALLS.append(op)
        return await call(self, key, op, fn, **kw)

    Bucket._local = counted_local  # type: ignore[method-assign]
    Bucket._call = counted_call  # type: ignore[method-assign, assignment]


@contextlib.contextmanager
def operator_process(namespace: str, kubeconfig: Path, log: Path) -> Any:
    """The operator as a cluster runs it (its own process, standalone, default settings)."""
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "hotload_operator", "--standalone", "-n", namespace],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield
        finally:
            process.terminate()
            process.wait(60)


@contextlib.asynccontextmanager
async def loader(
    tiny: TinyLLM, root: Path, ledger_url: str, *, config: KubeConfig | None, ns: str, pod: str
) -> AsyncIterator[tuple[Loader, LocalReporter]]:
    """A loader and its reference engine; with `config`, the head handoff of `fleet`."""
    async with serve(tiny.snapshots[0], "boot", dtype="float32") as client:
        url = str(client.make_url(""))
        settings = Settings(
            ledger_url=ledger_url,
            weights_dir=root / "weights",
            engine_url=url,
            report="kubernetes" if config else "local",
            namespace=ns,
            pod_name=pod,
            deployment="fleet" if config else None,
        )
        heads = HeadWatch(KubeClient(config), ns, "fleet") if config else None
        bucket_url, name = ledger_url.rsplit("/", 1)
        reporter = LocalReporter()
        adapter = make_adapter("reference", url)
        running = Loader(
            settings,
            ledger=Ledger(open_bucket(bucket_url), name),
            adapter=adapter,
            reporter=reporter,
            heads=heads,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(running.run(stop))
        try:
            yield running, reporter
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
            await adapter.aclose()


async def until(check: Any, identity: str, timeout: float = 120) -> None:
    """Wait until `check()` holds (about `identity`)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {identity}")
        await asyncio.sleep(0.02)


async def run_mode(
    mode: str, kube: KubeClient, admin: Path, tiny: TinyLLM, *, work: Path, args: argparse.Namespace
) -> JSON:
    """One mode: idle requests per second, then publish -> serving per round."""
    ns = f"bench-{mode}"
    await kube.create("/api/v1/namespaces", {"metadata": {"name": ns}})
    bucket_dir = work / "bucket"
    trainer = Trainer(Ledger(open_bucket(str(bucket_dir)), "fleet"), tiny.snapshots, work, 1000)
    await asyncio.to_thread(trainer.publish, 0)
    handoff = mode == "handoff"
    async with contextlib.AsyncExitStack() as stack:
        if handoff:
            stack.enter_context(operator_process(ns, admin, work / "operator.log"))
            await kube.create(hld_path(ns), hld_body("fleet", bucket_dir, args.replicas))
            await asyncio.sleep(5)  # the operator applies the Deployment
            pods = await play_deployment_controller(kube, ns, "fleet")
        else:
            pods = [f"fleet-{i}" for i in range(args.replicas)]
        config = KubeConfig.from_kubeconfig(admin) if handoff else None
        replicas = [
            await stack.enter_async_context(
                loader(tiny, work / pod, f"{bucket_dir}/fleet", config=config, ns=ns, pod=pod)
            )
            for pod in pods
        ]
        reporters = [r for _, r in replicas]
        await until(lambda: all(r.status.identity == "step-000" for r in reporters), "step-000")
        await asyncio.sleep(3)
        mark, started = len(CALLS), time.monotonic()
        await asyncio.sleep(args.idle)
        idle = (len(CALLS) - mark) / (time.monotonic() - started)
        operator = 2 / 2.0 if handoff else 0.0  # one GET and one LIST per 2 s poll
        latencies, noticed = [], []
        for step in range(1, args.rounds + 1):
            await asyncio.sleep(random.uniform(0, 2.0))
            began = time.monotonic()
            await asyncio.to_thread(trainer.publish, step)
            name = Trainer.identity(step)
            await until(lambda s=step: all(_head(lo) == s for lo, _ in replicas), name)
            noticed.append(time.monotonic() - began)
            await until(lambda n=name: all(r.status.identity == n for r in reporters), name)
            latencies.append(time.monotonic() - began)
            print(f"  {mode} {name}: noticed {noticed[-1]:.2f} s, serving {latencies[-1]:.2f} s")
    return {
        "idle_loaders": idle,
        "idle_operator": operator,
        "latencies": latencies,
        "noticed": noticed,
    }


def _head(loader: Loader) -> int | None:
    """The head sequence of the loader's ledger copy."""
    head = loader.document.head if loader.document is not None else None
    return head.sequence - 1 if head is not None else None


async def main(args: argparse.Namespace) -> None:
    count_bucket_calls()
    work = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    script = cluster_script()
    if not script.is_file():
        raise SystemExit(f"the benchmark needs {script} (the shared control plane)")
    admin = await asyncio.to_thread(start_cluster, script, work / "k8s")
    os.environ["KUBECONFIG"] = str(admin)
    try:
        tiny = build_tiny_llm(work / "tiny", args.rounds, noise=0.01)
        results: dict[str, JSON] = {}
        async with KubeClient(KubeConfig.from_kubeconfig(admin)) as kube:
            await install_crds(kube)
            for mode in ("direct", "handoff"):
                results[mode] = await run_mode(mode, kube, admin, tiny, work=work / mode, args=args)
    finally:
        await asyncio.to_thread(stop_cluster, script, work / "k8s")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.strip()
    print(f"\ncommit {commit}, {platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()}")
    print(f"{args.replicas} replicas, {args.rounds} rounds, idle window {args.idle:g} s\n")
    print(
        "| mode | idle origin requests/s: loaders (counted) | operator (2 per poll) "
        "| publish -> every loader read it, p50 / max | publish -> serving p50 / max |"
    )
    print("| --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        lat = r["latencies"]
        print(
            f"| {mode} | {r['idle_loaders']:.2f} | {r['idle_operator']:.2f} | "
            f"{statistics.median(r['noticed']):.2f} / {max(r['noticed']):.2f} s | "
            f"{statistics.median(lat):.2f} / {max(lat):.2f} s |"
        )


def parse_args() -> argparse.Namespace:
    """The benchmark's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of the idle window")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
