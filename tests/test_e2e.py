"""End to end through the operator: CRDs, the real kopf operator, a HotLoadDeployment whose pods
are played by real loader + reference-engine processes (the loaders report on their pods through
the API), a trainer publishing a chain with the SDK, clients sending requests the whole time,
and two corruptions in the middle of the chain: a delta that rots in the bucket after its
admission (every loader detects it, keeps serving, the Snapshot says LoadFailed with their
messages, wait_ready raises with them, and the trainer's next publish is full by itself), and a
replica's local copy that rots (it falls back to the full snapshot).

Runs on the session's API server (the real one of ../shared/k8s when it is there, or
HOTLOAD_E2E_KUBECONFIG's cluster; else the emulator); the replicas run here as processes, and
the test plays the kubelet for their pods (see tests/README.md).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hotload.api.names import snapshot_object_name
from hotload.kube import resource_path
from hotload.sdk import NotReadyError, Publisher
from hotload.snapshot import Snapshot
from support.cluster import install_crds
from support.fleet import PROMPT_IDS, Replica, free_port, http_json
from support.kubeapi import KubeAPI
from support.operator import (
    condition,
    create_fleet,
    eventually,
    hld_path,
    running_operator,
    snapshot_path,
)
from support.tiny_llm import TinyLLM, build_tiny_llm
from support.vllm_server import greedy_token_ids

STEPS = 7  # step-00000000 .. step-00000006, a full snapshot every 3 steps
ROT_STEP = 1  # its delta rots in the bucket after admission: step 2 is published full
LOCAL_ROT_STEP = 5  # a replica's copy of step 4 rots before step 5's delta arrives


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Seven snapshots of one tiny Llama, each a training step after the one before."""
    return build_tiny_llm(tmp_path_factory.mktemp("e2e"), STEPS - 1, noise=0.01)


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
                # As the operator starts them: the engine's admin API on loopback only, where
                # the loader reaches it; the serving port (clients, probes) inference only.
                replicas.append(
                    Replica(
                        pod,
                        tmp_path / pod,
                        f"{bucket_dir}/fleet",
                        env,
                        loader_args=report_args,
                        admin_port=free_port(),
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
                    for r in replicas:
                        # The serving port refuses hot loads; the loaders loaded via loopback.
                        load = {"path": str(r.weights / "current"), "identity": "x", "sequence": 99}
                        code, body = await asyncio.to_thread(
                            http_json, "POST", r.engine_url + "/hotload/v1/load", load
                        )
                        assert code == 404 and body["error"]["type"] == "not_found", body
                    # The fleet is up: from now on clients send requests the whole time.
                    clients = asyncio.create_task(traffic.run())
                    kinds = [first.kind]
                    for step in range(1, STEPS):
                        if step == ROT_STEP:
                            handle = await _rot_in_the_bucket(
                                kube, ns, pub, weights=chain.snapshots[step], step=step,
                                replicas=replicas, bucket_dir=bucket_dir,
                            )  # fmt: skip
                            kinds.append(handle.kind)
                            continue
                        if step == LOCAL_ROT_STEP:
                            # Bit rot in one replica's served snapshot, the parent of the next
                            # delta: it must fall back to the full snapshot and still end right.
                            _corrupt(replicas[1].weights / "current")
                        handle = await pub.publish_async(chain.snapshots[step], step=step)
                        kinds.append(handle.kind)
                        await pub.wait_ready_async(handle.identity, timeout=180)
                    # Step 2 would be a delta by the cadence; after the failed rollout of step 1
                    # the publisher made it full by itself.
                    assert kinds == [
                        "full", "incremental", "full", "full", "incremental",
                        "incremental", "full",
                    ]  # fmt: skip
                    await asyncio.sleep(1.0)  # a little traffic on the final snapshot
                finally:
                    tasks = [t for t in (clients, watching, kubelet) if t is not None]
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                # The observer polls in the background: one more look now, so that the last
                # snapshot is recorded however late its polls ran on a busy machine (every
                # replica serves it already: wait_ready returned).
                await seen.observe()
                last = f"step-{STEPS - 1:08d}"
                # Every replica moved forward through the chain, never back, and skipped only
                # the snapshot it could not verify.
                for r in replicas:
                    sequences = seen.sequences[r.name]
                    assert sequences == sorted(sequences) and sequences[-1] == STEPS, sequences
                    assert ROT_STEP + 1 not in sequences, sequences
                # No request failed while snapshots rolled through the fleet.
                assert traffic.failed == [], traffic.failed[:5]
                assert traffic.ok > 20
                fallback_events = (await kube.list(resource_path("v1", "events", ns)))["items"]
                assert any(
                    e["reason"] == "FellBackToFull"
                    and e["involvedObject"]["name"] == replicas[1].name
                    for e in fallback_events
                ), "the corrupted replica did not report its fallback"
                # Statuses: the fleet Ready on the last step with every replica on it; every
                # snapshot Ready but the rotten one, which a newer one replaced; only the last is
                # served now (replicasLoaded counts the replicas serving a snapshot).
                hld = await eventually(
                    "the fleet Ready on the last step",
                    lambda: _fleet_on(kube, ns, last),
                )
                assert hld["status"]["updatedReplicas"] == 2
                assert hld["status"]["readyReplicas"] == 2
                assert condition(hld, "Ready")["reason"] == "AllReplicasCurrent"
                assert condition(hld, "Degraded")["status"] == "False"
                snaps = await eventually(
                    "every Snapshot rolled up", lambda: _snapshots_rolled_up(kube, ns)
                )
                for step, snap in enumerate(snaps):
                    st = snap["status"]
                    assert condition(snap, "Accepted")["status"] == "True"
                    assert st["replicas"] == 2, st
                    if step == ROT_STEP:
                        assert condition(snap, "Ready")["status"] == "False", st
                        assert condition(snap, "Ready")["reason"] == "Superseded", st
                    else:
                        assert condition(snap, "Ready")["status"] == "True", st
                    assert st["replicasLoaded"] == (2 if step == STEPS - 1 else 0), st
                final = snaps[-1]["status"]
                assert sorted(x["pod"] for x in final["loads"]) == sorted(pods)
                assert all(x["totalSeconds"] > 0 for x in final["loads"]), final["loads"]
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


async def _rot_in_the_bucket(
    kube: Any,
    ns: str,
    pub: Publisher,
    *,
    weights: Path,
    step: int,
    replicas: list[Replica],
    bucket_dir: Path,
) -> Any:
    """Publish step `step` as a delta; once admitted, flip a byte of it in the bucket before
    any loader reads it (the loaders are held back meanwhile, as slow replicas would be). Every
    loader must detect it, keep serving, and say why; the Snapshot says LoadFailed with their
    messages and `wait_ready` raises with them at once."""
    served = replicas[0].status()["identity"]
    for r in replicas:
        await asyncio.to_thread(r.pause_loader)
    try:
        handle = await pub.publish_async(weights, step=step)
        assert handle.kind == "incremental"
        snap = await kube.get(snapshot_path(ns, snapshot_object_name("fleet", handle.identity)))
        assert condition(snap, "Accepted")["status"] == "True"  # admitted intact ...
        _corrupt_file(bucket_dir / handle.identity)  # ... then rots where it lies
    finally:
        for r in replicas:
            await asyncio.to_thread(r.resume_loader)
    started = asyncio.get_running_loop().time()
    with pytest.raises(NotReadyError) as failed:
        await pub.wait_ready_async(handle.identity, timeout=180)
    # Raised once the replicas failed, not after the timeout.
    assert asyncio.get_running_loop().time() - started < 120
    assert failed.value.reason == "LoadFailed"
    assert failed.value.failures, str(failed.value)
    for f in failed.value.failures:
        assert f"{f['pod']}: {f['message']}" in str(failed.value)

    async def both_failed() -> dict[str, Any] | None:
        obj = await kube.get(snapshot_path(ns, snapshot_object_name("fleet", handle.identity)))
        failures = (obj.get("status") or {}).get("failures") or []
        return obj if len(failures) == len(replicas) else None

    snap = await eventually("every replica to report the rotten delta", both_failed, 120)
    st, ready = snap["status"], condition(snap, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "LoadFailed"), st
    assert (st["replicas"], st["replicasLoaded"]) == (2, 0), st
    assert {f["pod"] for f in st["failures"]} == {r.name for r in replicas}
    for f in st["failures"]:
        assert f"{f['pod']}: {f['message']}" in ready["message"]
        # What the loader found: the bytes do not match their checksum (a chunk's CRC-32, or a
        # tensor's adler32), after a fallback to the full snapshot that needs the same delta.
        assert any(word in f["message"].lower() for word in ("checksum", "crc", "corrupt")), f
        assert handle.identity in f["message"], f
    # Every replica kept serving the snapshot before it, and counted what it detected.
    for r in replicas:
        doc = await asyncio.to_thread(r.status)
        assert doc["identity"] == served and doc["target_identity"] == handle.identity, doc
        # (It retries, as it would a bucket outage: the state may read fetching again.)
        assert doc["last_error"] and doc["state"] != "idle", doc
        metrics = await asyncio.to_thread(r.metrics)
        assert _sample(metrics, "hotload_loader_checksum_failures_total") >= 1, r.name
    hld = await eventually(
        "the fleet degraded by load failures",
        lambda: _hld_when(
            kube, ns, lambda h: condition(h, "Degraded").get("reason") == "LoadFailures"
        ),
    )
    assert hld["status"]["targetSnapshot"] == handle.identity
    assert (hld["status"]["readyReplicas"], hld["status"]["updatedReplicas"]) == (2, 0)
    return handle


async def _hld_when(kube: Any, ns: str, check: Any) -> dict[str, Any] | None:
    obj = await kube.get(hld_path(ns, "fleet"))
    return obj if obj.get("status") and check(obj) else None


async def _snapshots_rolled_up(kube: Any, ns: str) -> list[dict[str, Any]] | None:
    """Every step's Snapshot once the roll-up saw the fleet on the last step."""
    snaps = [
        await kube.get(snapshot_path(ns, snapshot_object_name("fleet", f"step-{s:08d}")))
        for s in range(STEPS)
    ]
    loaded = [(x.get("status") or {}).get("replicasLoaded") for x in snaps]
    return snaps if loaded == [0] * (STEPS - 1) + [2] else None


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _corrupt_file(snapshot: Path) -> None:
    """Flip one bit in the payload of the snapshot's largest shard (bit rot at rest)."""
    shard = max(snapshot.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10
    shard.write_bytes(bytes(data))


async def _fleet_on(kube: Any, ns: str, identity: str) -> dict[str, Any] | None:
    obj = await kube.get(hld_path(ns, "fleet"))
    st = obj.get("status") or {}
    ready = condition(obj, "Ready").get("status") == "True"
    # Every replica updated and its pod Ready (the kubelet's write may land a roll-up later).
    settled = st.get("updatedReplicas") == st.get("readyReplicas") == st.get("replicas")
    return obj if ready and settled and st.get("currentSnapshot") == identity else None


async def _play_kubelet(kube: Any, ns: str, replicas: list[Replica]) -> None:
    """The kubelet's part: a pod is Ready when its engine answers /ready and the readiness
    gate (the loader's SnapshotLoaded condition) is True."""
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
            await self.observe()
            await asyncio.sleep(0.1)

    async def observe(self) -> None:
        """Record what each loader serves now (skipping one that does not answer)."""
        for r in self.replicas:
            try:
                doc = await asyncio.to_thread(r.status)
            except (OSError, AssertionError):
                continue
            seq = doc.get("sequence")
            seen = self.sequences[r.name]
            if isinstance(seq, int) and (not seen or seen[-1] != seq):
                seen.append(seq)


def _corrupt(current: Path) -> None:
    snap = Snapshot(current.resolve())
    shard = snap.path / snap.weight_map["model.layers.1.mlp.up_proj.weight"]
    data = bytearray(shard.read_bytes())
    data[-11] ^= 0x20
    shard.write_bytes(bytes(data))
