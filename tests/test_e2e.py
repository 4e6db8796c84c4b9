"""End to end through the operator: CRDs, the real kopf operator, a HotLoadDeployment whose pods
are played by real loader + reference-engine processes (the loaders report on their pods through
the API), a trainer publishing a chain with the SDK, clients sending requests the whole time,
and a corrupted local snapshot in the middle of the chain that a replica must recover from.

Runs on the emulated API server; with HOTLOAD_E2E_KUBECONFIG the API calls go to a real
cluster, but the replicas still run here as processes (see tests/README.md).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hotload.kube import resource_path
from hotload.sdk import Publisher
from hotload.snapshot import Snapshot
from support.fleet import Replica
from support.kubeapi import KubeAPI
from support.operator import (
    create_fleet,
    eventually,
    hld_path,
    install_crds,
    running_operator,
    snapshot_path,
)
from support.tiny_llm import TinyLLM, build_tiny_llm
from support.vllm_server import greedy_token_ids

PROMPT_IDS = [101, 1996, 7570, 2001, 2019, 2214, 102]
STEPS = 7  # step-00000000 .. step-00000006, a full snapshot every 3 steps


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Seven snapshots of one tiny Llama, each a training step after the one before."""
    return build_tiny_llm(tmp_path_factory.mktemp("e2e"), STEPS - 1, noise=0.01)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    """Condition `type_` of `obj`'s status ({} if absent)."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


@pytest.mark.asyncio
async def test_a_fleet_follows_a_chain_through_the_operator(
    kube_api: KubeAPI,
    chain: TinyLLM,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    replicas: list[Replica] = []
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = await create_fleet(kube, ns, bucket_dir)
            pub = Publisher(
                str(bucket_dir),
                deployment="fleet",
                namespace=ns,
                kubeconfig=kube_api.kubeconfig,
                full_every=3,
                workdir=tmp_path / "trainer",
            )
            first = await pub.publish_async(chain.snapshots[0], step=0)
            for pod in pods:
                # Each loader reports on its own pod, as `--report kubernetes` does in a cluster.
                report_args = ["--report", "kubernetes", "--kubeconfig", str(kube_api.kubeconfig)]
                report_args += ["--pod-name", pod, "--namespace", ns]
                replicas.append(
                    Replica(
                        pod, tmp_path / pod, f"{bucket_dir}/fleet", env, loader_args=report_args
                    )
                )
            try:
                for r in replicas:
                    await asyncio.to_thread(r.start_loader)
                for r in replicas:
                    await asyncio.to_thread(r.wait_started)
                    await asyncio.to_thread(r.start_engine)
                kubelet = asyncio.create_task(_play_kubelet(kube, ns, replicas))
                seen = _Observer(replicas)
                watching = asyncio.create_task(seen.run())
                traffic = _Traffic(replicas)
                clients: asyncio.Task[None] | None = None
                try:
                    report = await pub.wait_ready_async(first.identity, timeout=180)
                    assert report.loaded == 2
                    # The fleet is up: from now on clients send requests the whole time.
                    clients = asyncio.create_task(traffic.run())
                    kinds = [first.kind]
                    for step in range(1, STEPS):
                        if step == 5:
                            # Bit rot in one replica's served snapshot, the parent of the next
                            # delta: it must fall back to the full snapshot and still end right.
                            _corrupt(replicas[1].weights / "current")
                        handle = await pub.publish_async(chain.snapshots[step], step=step)
                        kinds.append(handle.kind)
                        await pub.wait_ready_async(handle.identity, timeout=180)
                    assert kinds == [
                        "full", "incremental", "incremental", "full", "incremental",
                        "incremental", "full",
                    ]  # fmt: skip
                    await asyncio.sleep(1.0)  # a little traffic on the final snapshot
                finally:
                    tasks = [t for t in (clients, watching, kubelet) if t is not None]
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                last = f"step-{STEPS - 1:08d}"
                # Every replica moved forward through the chain, never back.
                for r in replicas:
                    sequences = seen.sequences[r.name]
                    assert sequences == sorted(sequences) and sequences[-1] == STEPS, sequences
                # No request failed while snapshots rolled through the fleet.
                assert traffic.failed == [], traffic.failed[:5]
                assert traffic.ok > 20
                fallback_events = (await kube.list(resource_path("v1", "events", ns)))["items"]
                assert any(
                    e["reason"] == "FellBackToFull"
                    and e["involvedObject"]["name"] == replicas[1].name
                    for e in fallback_events
                ), "the corrupted replica did not report its fallback"
                # Statuses: the fleet Ready on the last step, every snapshot Ready.
                hld = await eventually(
                    "the fleet Ready on the last step",
                    lambda: _fleet_on(kube, ns, last),
                )
                assert hld["status"]["updatedReplicas"] == 2
                assert condition(hld, "Ready")["reason"] == "AllReplicasCurrent"
                for step in range(STEPS):
                    snap = await kube.get(snapshot_path(ns, f"step-{step:08d}"))
                    assert condition(snap, "Accepted")["status"] == "True"
                    assert condition(snap, "Ready")["status"] == "True", snap["status"]
                # And they serve the trainer's weights.
                expected = greedy_token_ids(chain.snapshots[-1], PROMPT_IDS, 8)
                for r in replicas:
                    body = await asyncio.to_thread(r.complete_ids, PROMPT_IDS, 8)
                    assert body["model"] == f"tiny@{last}"
                    assert body["choices"][0]["token_ids"] == expected
            finally:
                for r in replicas:
                    await asyncio.to_thread(r.stop)
                pub.close()


async def _fleet_on(kube: Any, ns: str, identity: str) -> dict[str, Any] | None:
    obj = await kube.get(hld_path(ns, "fleet"))
    st = obj.get("status") or {}
    ready = condition(obj, "Ready").get("status") == "True"
    return obj if ready and st.get("currentSnapshot") == identity else None


async def _play_kubelet(kube: Any, ns: str, replicas: list[Replica]) -> None:
    """The kubelet's part: a pod is Ready when its engine answers /ready and the readiness
    gate (the loader's SnapshotLoaded condition) is True."""
    from support.fleet import http_json

    while True:
        for r in replicas:
            try:
                code, _ = await asyncio.to_thread(
                    http_json, "GET", r.engine_url + "/ready", None, 2
                )
            except OSError:
                code = 0
            pod = await kube.get(resource_path("v1", "pods", ns, r.name))
            gate = condition(pod, "hotload.dev/SnapshotLoaded").get("status") == "True"
            ready = "True" if code == 200 and gate else "False"
            if condition(pod, "Ready").get("status") != ready:
                await kube.patch(
                    resource_path("v1", "pods", ns, r.name, "status"),
                    {"status": {"conditions": [{"type": "Ready", "status": ready}]}},
                    "strategic",
                )
        await asyncio.sleep(0.3)


class _Traffic:
    """Clients sending completions to every replica all the time; failures are recorded."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.ok = 0
        self.failed: list[str] = []

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await asyncio.gather(*(self._one(http, r) for r in self.replicas))

    async def _one(self, http: aiohttp.ClientSession, r: Replica) -> None:
        body = {"prompt": PROMPT_IDS, "max_tokens": 4, "return_token_ids": True}
        while True:
            try:
                async with http.post(r.engine_url + "/v1/completions", json=body) as resp:
                    if resp.status == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.name}: HTTP {resp.status} {await resp.text()}")
            except aiohttp.ClientError as err:
                self.failed.append(f"{r.name}: {err!r}")
            await asyncio.sleep(0.05)


class _Observer:
    """Polls each loader's status and records the sequence of snapshots it served."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.sequences: dict[str, list[int]] = {r.name: [] for r in replicas}

    async def run(self) -> None:
        while True:
            for r in self.replicas:
                try:
                    doc = await asyncio.to_thread(r.status)
                except (OSError, AssertionError):
                    continue
                seq = doc.get("sequence")
                seen = self.sequences[r.name]
                if isinstance(seq, int) and (not seen or seen[-1] != seq):
                    seen.append(seq)
            await asyncio.sleep(0.1)


def _corrupt(current: Path) -> None:
    snap = Snapshot(current.resolve())
    shard = snap.path / snap.weight_map["model.layers.1.mlp.up_proj.weight"]
    data = bytearray(shard.read_bytes())
    data[-11] ^= 0x20
    shard.write_bytes(bytes(data))
