"""Benchmark: hotload's Kubernetes transport (`hotload.kube.KubeClient`) against the API client
of kubernetes_asyncio, the library that now reads hotload's kubeconfigs and credentials.

From the issue: "the transport can stay if a measurement says it should". Both clients run on
aiohttp, in this process, against the real kube-apiserver of ../shared/k8s (started with its
`cluster.sh` for the run, or `--kubeconfig` for a running one), over TLS with the admin's
token, for the calls hotload makes most:

- GET a HotLoadDeployment (a custom resource: the operator's reconciles, `hotload status`,
  the Publisher);
- LIST pods with a label selector (the operator's roll-up: 16 of 32 pods match);
- merge PATCH of a HotLoadDeployment's status (the roll-up's write);
- server-side apply of a Deployment (the operator's owned objects; the same body each time,
  as a reconcile that finds nothing to change).

Clients: `hotload` (KubeClient: plain dicts); `library` (kubernetes_asyncio's API classes as
their users call them: `CustomObjectsApi` returns dicts, `CoreV1Api` and `AppsV1Api` return
typed models such as `V1PodList`); `library raw` (the same calls with `_preload_content=False`
and the body parsed with `json.loads`: the library's transport without its models).

Measurement: after a warm-up, each round makes one call of the operation with each client,
in an order that rotates every round, so that the noise of the shared machine (2 cores) falls
on all alike; per call, the wall time and this process's CPU time (the server runs in other
processes; the calls are sequential, so the process's CPU during a call is the client's).
Reports p50 and p90 latency, mean CPU per call and the ratios to hotload's.

    .venv/bin/python benchmarks/bench_kube_client.py                 # 400 rounds per operation
    .venv/bin/python benchmarks/bench_kube_client.py --rounds 100    # quicker
    .venv/bin/python benchmarks/bench_kube_client.py --kubeconfig path/to/admin-kubeconfig

Results: benchmarks/RESULTS-kube-client.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import kubernetes_asyncio  # noqa: E402
from kubernetes_asyncio import client as k8s  # noqa: E402
from kubernetes_asyncio.config import load_kube_config  # noqa: E402

from hotload.kube import KubeClient, KubeConfig, resource_path  # noqa: E402
from support.cluster import cluster_script, install_crds, start_cluster, stop_cluster  # noqa: E402

NS = "bench-kube"
GROUP, VERSION, PLURAL = "hotload.dev", "v1alpha1", "hotloaddeployments"
SELECTOR = "app=bench,fleet=fleet"
Call = Callable[[], Awaitable[Any]]


def deployment_body() -> dict[str, Any]:
    """The Deployment the benchmark applies (a small version of the operator's)."""
    labels = {"app": "bench-apply"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "applied", "namespace": NS, "labels": labels},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "hotload-engine:dev",
                            "args": ["--port", "8000"],
                            "ports": [{"containerPort": 8000, "name": "http"}],
                            "env": [{"name": f"V{i}", "value": str(i)} for i in range(8)],
                        }
                    ]
                },
            },
        },
    }


async def setup(kube: KubeClient) -> None:
    """The namespace, the CRDs, a HotLoadDeployment and 32 pods (16 match the selector)."""
    await install_crds(kube)
    await kube.create("/api/v1/namespaces", {"metadata": {"name": NS}})
    await kube.create(
        resource_path(f"{GROUP}/{VERSION}", PLURAL, NS),
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "HotLoadDeployment",
            "metadata": {"name": "fleet"},
            "spec": {
                "replicas": 16,
                "bucket": {"url": "file:///tmp/bench"},
                "engine": {"image": "hotload-engine:dev"},
            },
        },
    )
    for i in range(32):
        fleet = "fleet" if i % 2 == 0 else "other"
        await kube.create(
            resource_path("v1", "pods", NS),
            {
                "metadata": {
                    "name": f"pod-{i:02d}",
                    "labels": {"app": "bench", "fleet": fleet},
                    "annotations": {"hotload.dev/status": json.dumps({"serving": "step-1"})},
                },
                "spec": {"containers": [{"name": "engine", "image": "hotload-engine:dev"}]},
            },
        )


def operations(kube: KubeClient, api: k8s.ApiClient) -> dict[str, dict[str, Call]]:
    """For each operation, one call per client."""
    custom = k8s.CustomObjectsApi(api)
    core = k8s.CoreV1Api(api)
    apps = k8s.AppsV1Api(api)
    hld = resource_path(f"{GROUP}/{VERSION}", PLURAL, NS, "fleet")
    pods = resource_path("v1", "pods", NS)
    applied = resource_path("apps/v1", "deployments", NS, "applied")
    body = deployment_body()
    counter = iter(range(10**9))
    merge = "application/merge-patch+json"
    apply = "application/apply-patch+yaml"

    def status() -> dict[str, Any]:
        return {"status": {"observedGeneration": 1, "readyReplicas": next(counter) % 17}}

    async def raw(call: Awaitable[Any]) -> Any:
        async with await call as response:  # an aiohttp response, not yet read
            return json.loads(await response.read())

    return {
        "GET a HotLoadDeployment": {
            "hotload": lambda: kube.get(hld),
            "library": lambda: custom.get_namespaced_custom_object(
                GROUP, VERSION, NS, PLURAL, "fleet"
            ),
            "library raw": lambda: raw(
                custom.get_namespaced_custom_object(
                    GROUP, VERSION, NS, PLURAL, "fleet", _preload_content=False
                )
            ),
        },
        "LIST pods by label (16 of 32)": {
            "hotload": lambda: kube.list(pods, label_selector=SELECTOR),
            "library": lambda: core.list_namespaced_pod(NS, label_selector=SELECTOR),
            "library raw": lambda: raw(
                core.list_namespaced_pod(NS, label_selector=SELECTOR, _preload_content=False)
            ),
        },
        "merge PATCH of status": {
            "hotload": lambda: kube.patch(f"{hld}/status", status(), "merge"),
            "library": lambda: custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, NS, PLURAL, "fleet", status(), _content_type=merge
            ),
            "library raw": lambda: raw(
                custom.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    NS,
                    PLURAL,
                    "fleet",
                    status(),
                    _content_type=merge,
                    _preload_content=False,
                )
            ),
        },
        "server-side apply of a Deployment": {
            "hotload": lambda: kube.patch(
                applied, body, "apply", field_manager="bench", force=True
            ),
            "library": lambda: apps.patch_namespaced_deployment(
                "applied", NS, body, field_manager="bench", force=True, _content_type=apply
            ),
            "library raw": lambda: raw(
                apps.patch_namespaced_deployment(
                    "applied",
                    NS,
                    body,
                    field_manager="bench",
                    force=True,
                    _content_type=apply,
                    _preload_content=False,
                )
            ),
        },
    }


async def measure(calls: dict[str, Call], rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """Rounds of one call per client, in rotating order; the summary per client."""
    names = list(calls)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            c0, w0 = time.process_time(), time.perf_counter()
            await calls[name]()
            w1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                wall[name].append(w1 - w0)
                cpu[name].append(c1 - c0)
    summary = {}
    for name in names:
        deciles = statistics.quantiles(wall[name], n=10)
        summary[name] = {
            "p50_ms": statistics.median(wall[name]) * 1e3,
            "p90_ms": deciles[8] * 1e3,
            "cpu_us": statistics.fmean(cpu[name]) * 1e6,
        }
    return summary


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """The Markdown table of `results`, with ratios to hotload's."""
    lines = [
        "| operation | client | p50 ms | p90 ms | CPU µs/call | p50 vs hotload | CPU vs hotload |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for op, clients in results.items():
        base = clients["hotload"]
        for name, row in clients.items():
            lines.append(
                f"| {op} | {name} | {row['p50_ms']:.2f} | {row['p90_ms']:.2f} | "
                f"{row['cpu_us']:.0f} | {row['p50_ms'] / base['p50_ms']:.2f}x | "
                f"{row['cpu_us'] / base['cpu_us']:.2f}x |"
            )
    return "\n".join(lines)


async def run(kubeconfig: Path, rounds: int, warmup: int, fresh: bool) -> None:
    config = KubeConfig.from_kubeconfig(kubeconfig)
    library_config = k8s.Configuration()
    await load_kube_config(
        config_file=str(kubeconfig), client_configuration=library_config, persist_config=False
    )
    async with KubeClient(config) as kube, k8s.ApiClient(library_config) as api:
        if fresh:
            await setup(kube)
        load = os.getloadavg()
        results = {}
        for op, calls in operations(kube, api).items():
            print(f"{op} ...", file=sys.stderr, flush=True)
            results[op] = await measure(calls, rounds, warmup)
        version = (await kube.get("/version"))["gitVersion"]
    print(
        f"kube-apiserver {version}; kubernetes_asyncio {kubernetes_asyncio.__version__}; "
        f"Python {platform.python_version()}; {os.cpu_count()} cores; {rounds} rounds per "
        f"operation after {warmup} of warm-up; load average {load[0]:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end\n"
    )
    print(table(results))


def main() -> None:
    """Start the shared control plane (or use `--kubeconfig`), set up, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--kubeconfig", type=Path, help="an admin kubeconfig of a running server")
    args = parser.parse_args()
    if args.kubeconfig is not None:
        asyncio.run(run(args.kubeconfig, args.rounds, args.warmup, fresh=True))
        return
    with tempfile.TemporaryDirectory(prefix="bench-kube-") as tmp:
        script = cluster_script()
        kubeconfig = start_cluster(script, Path(tmp))
        try:
            asyncio.run(run(kubeconfig, args.rounds, args.warmup, fresh=True))
        finally:
            stop_cluster(script, Path(tmp))


if __name__ == "__main__":
    main()
