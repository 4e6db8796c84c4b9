"""The router against real reference-engine replicas (tiny Llama, in-process, real HTTP servers).

Each test starts engines on loopback ports and a router in front of them; clients talk to the
router over HTTP. Which replica answered comes from the router's `x-hotload-replica` header and
is checked against the engines' own counters (prefix-cache hits, request metrics). A few tests
use small fake replicas where a failure has to happen at an exact moment (a stream held open, a
connection dropped before or after the first byte).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hotload.api.names import ANNOTATION_SNAPSHOT, LABEL_IDENTITY, LABEL_SEQUENCE
from hotload.kube import resource_path
from hotload.router.discovery import KubeDiscovery, StaticDiscovery, replica_from_pod
from hotload.router.proxy import REPLICA_HEADER, Router, create_router_app
from support.engines import EngineReplica, new_engine_replica
from support.fleet import free_port, wait_until
from support.kubeapi import KubeAPI
from support.paths import REPO
from support.tiny_llm import TinyLLM, build_tiny_llm

POLL = 0.1  # static discovery poll interval in these tests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Base snapshot s0 and perturbed snapshots s1, s2 of one tiny Llama."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-llm"), 2)


@asynccontextmanager
async def replicas(
    tiny: TinyLLM, n: int, started: int | None = None
) -> AsyncIterator[list[EngineReplica]]:
    """`n` replicas on s0 (sequence 0); the first `started` (default all) are running."""
    fleet = [new_engine_replica(tiny) for _ in range(n)]
    try:
        # One at a time: the engine builds its model inside transformers' `no_init_weights`,
        # which patches torch's init functions process-wide; overlapping builds in one process
        # can leave them patched for good (later random models come out uninitialised).
        for r in fleet[: n if started is None else started]:
            await r.start()
        yield fleet
    finally:
        for r in fleet:
            await r.stop()


@asynccontextmanager
async def router_for(
    urls: list[str], cooldown: float = 2.0
) -> AsyncIterator[tuple[Router, TestClient]]:
    """A router over a static list (polled every POLL seconds), and a client to it."""
    router = Router(StaticDiscovery(urls, interval=POLL, cooldown=cooldown))
    client = TestClient(TestServer(create_router_app(router), host="127.0.0.1"))
    await client.start_server()
    try:
        yield router, client
    finally:
        await client.close()


@dataclass
class Answer:
    status: int
    replica: str | None
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


async def complete(
    client: TestClient,
    session: str | None = None,
    *,
    prompt: str = "the chef cooked the old boat",
    max_tokens: int = 2,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> Answer:
    hdrs = dict(headers or {})
    if session is not None:
        hdrs["x-multi-turn-session-id"] = session
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra}
    resp = await client.post("/v1/completions", json=body, headers=hdrs)
    payload = await resp.json(content_type=None)
    return Answer(resp.status, resp.headers.get(REPLICA_HEADER), payload, dict(resp.headers))


def metric(router: Router, name: str, labels: dict[str, str] | None = None) -> float:
    return router.metrics.registry.get_sample_value(name, labels or {}) or 0.0


# --- session affinity ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_thirty_sessions_stay_on_their_replicas(tiny: TinyLLM) -> None:
    async with replicas(tiny, 3) as fleet, router_for([r.url for r in fleet]) as (router, client):
        by_url = {r.url: r for r in fleet}
        sessions = [f"traj-{i}" for i in range(30)]
        homes: dict[str, str] = {}
        for round_ in range(3):
            answers = await asyncio.gather(
                *(
                    complete(client, s, prompt=f"the chef {s} cooked the boat " * (round_ + 1))
                    for s in sessions
                )
            )
            for s, a in zip(sessions, answers, strict=True):
                assert a.status == 200, a.body
                assert a.body["model"] == "tiny@s0"
                assert a.replica is not None
                assert homes.setdefault(s, a.replica) == a.replica, f"{s} moved in round {round_}"
        spread = Counter(homes.values())
        assert len(spread) == 3, spread
        # The engines agree: each served exactly its sessions' 90 requests, and rounds 2 and 3
        # of every session reused the prefix its replica cached in the previous round.
        for url, r in by_url.items():
            assert r.count(200) == 3 * spread[url]
            assert r.engine.sessions.stats.hits == 2 * spread[url]
        assert metric(router, "hotload_router_session_moves_total") == 0
        # Its metrics count the same: requests per replica, and the latency it added to each.
        for url in by_url:
            assert metric(
                router, "hotload_router_requests_total", {"replica": url, "code": "200"}
            ) == 3 * spread[url]  # fmt: skip
        added = "hotload_router_added_latency_seconds"
        assert metric(router, f"{added}_count") == 90
        assert metric(router, f"{added}_bucket", {"le": "+Inf"}) == 90
        # Something was added, but little: the mean is far below a request's own time.
        assert 0 < metric(router, f"{added}_sum") / 90 < 0.25
        text = (await (await client.get("/metrics")).text()).splitlines()
        assert sum(1 for ln in text if ln.startswith("hotload_router_requests_total{")) == 3
        # A second, independent router copy makes the same choices (stateless routing).
        async with router_for([r.url for r in fleet]) as (_, twin):
            answers = await asyncio.gather(*(complete(twin, s) for s in sessions))
            assert {s: a.replica for s, a in zip(sessions, answers, strict=True)} == homes


@pytest.mark.asyncio
async def test_requests_without_a_session_spread_by_load(tiny: TinyLLM) -> None:
    async with replicas(tiny, 3) as fleet, router_for([r.url for r in fleet]) as (_, client):
        answers = await asyncio.gather(*(complete(client) for _ in range(12)))
        assert all(a.status == 200 for a in answers)
        spread = Counter(a.replica for a in answers)
        assert set(spread) == {r.url for r in fleet}
        assert max(spread.values()) - min(spread.values()) <= 2, spread


@pytest.mark.asyncio
async def test_removing_and_adding_a_replica_moves_about_one_in_n(tiny: TinyLLM) -> None:
    """4 running replicas and a 5th listed but down: stop one (its sessions, and only those,
    move), then start the 5th (about 1/4 of the sessions move to it, and only to it)."""
    # Enough sessions that the 1/N shares are far from the bounds whatever the replica names
    # (their URLs carry random ports, so the hashes differ from run to run).
    sessions = [f"s-{i}" for i in range(300)]

    async def assignment(client: TestClient) -> dict[str, str]:
        answers = await asyncio.gather(*(complete(client, s, max_tokens=1) for s in sessions))
        assert all(a.status == 200 and a.replica for a in answers), [a.body for a in answers]
        return {s: str(a.replica) for s, a in zip(sessions, answers, strict=True)}

    async with (
        replicas(tiny, 5, started=4) as fleet,
        router_for([r.url for r in fleet]) as (router, client),
    ):
        before = await assignment(client)
        assert set(before.values()) == {r.url for r in fleet[:4]}
        gone = fleet[1]
        await gone.stop()
        await wait_until(
            "the router to see the stopped replica",
            lambda: not next(x for x in router.discovery.replicas() if x.name == gone.url).healthy,
        )
        after_remove = await assignment(client)
        moved = {s for s in sessions if before[s] != after_remove[s]}
        assert moved == {s for s in sessions if before[s] == gone.url}
        assert 0.5 / 4 <= len(moved) / len(sessions) <= 1.6 / 4, len(moved)
        assert metric(router, "hotload_router_session_moves_total") == len(moved)

        await fleet[4].start()
        await wait_until(
            "the router to see the new replica",
            lambda: next(x for x in router.discovery.replicas() if x.name == fleet[4].url).healthy,
        )
        after_add = await assignment(client)
        moved_in = {s for s in sessions if after_remove[s] != after_add[s]}
        assert all(after_add[s] == fleet[4].url for s in moved_in)
        assert 0.5 / 5 <= len(moved_in) / len(sessions) <= 1.6 / 5, len(moved_in)


# --- version constraints -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_impossible_constraint_gets_503_at_once(tiny: TinyLLM) -> None:
    async with replicas(tiny, 2) as fleet, router_for([r.url for r in fleet]) as (router, client):
        cases: list[dict[str, Any]] = [
            {"headers": {"x-hotload-min-sequence": "99"}},
            {"min_snapshot_sequence": 99},
            {"snapshot_identity": "step-999"},
            {"headers": {"x-hotload-snapshot": "step-999"}},
        ]
        for case in cases:
            started = time.perf_counter()
            a = await complete(client, "traj-1", **case)
            assert time.perf_counter() - started < 0.5
            assert a.status == 503, a.body
            assert a.headers.get("Retry-After") == "1"
            assert a.body["error"]["reason"] == "constraint_unmet"
            assert "s0 (sequence 0)" in a.body["error"]["message"]
        a = await complete(client, "traj-1", model="tiny@step-999")
        assert a.status == 503 and a.body["error"]["reason"] == "constraint_unmet"
        # Malformed constraints are the client's error, named as the engine names them.
        bad = await complete(client, "traj-1", headers={"x-hotload-min-sequence": "soon"})
        assert bad.status == 400 and bad.body["error"]["param"] == "x-hotload-min-sequence"
        assert all(r.count(200) + r.count(409) + r.count(400) == 0 for r in fleet)
        assert (
            metric(router, "hotload_router_unavailable_total", {"reason": "constraint_unmet"}) == 5
        )
        # A satisfiable constraint goes through.
        ok = await complete(client, "traj-1", headers={"x-hotload-min-sequence": "0"})
        assert ok.status == 200 and ok.body["hotload"]["sequence_start"] == 0


@pytest.mark.asyncio
async def test_min_sequence_never_reaches_a_stale_replica_during_a_rolling_load(
    tiny: TinyLLM,
) -> None:
    """While s1 (sequence 1) rolls through the fleet one replica at a time, constrained
    requests land only on replicas that serve it (or get 503), and no engine ever answers 409."""
    async with replicas(tiny, 3) as fleet, router_for([r.url for r in fleet]) as (_, client):
        results: list[tuple[str, Answer, float]] = []
        rolling = True
        styles: list[tuple[str, dict[str, Any]]] = [
            ("header", {"headers": {"x-hotload-min-sequence": "1"}}),
            ("body", {"min_snapshot_sequence": 1}),
            ("model", {"model": "tiny@s1"}),
            ("none", {}),
        ]

        async def client_loop(worker: int) -> None:
            i = 0
            while rolling:
                style, extra = styles[(worker + i) % len(styles)]
                a = await complete(client, f"w{worker}-{i % 7}", max_tokens=1, **extra)
                results.append((style, a, time.monotonic()))
                i += 1

        async def roll() -> float:
            for r in fleet:
                await asyncio.sleep(0.4)
                resp = await client.session.post(
                    r.url + "/hotload/v1/load",
                    json={"path": str(tiny.snapshots[1]), "identity": "s1", "sequence": 1},
                )
                assert resp.status == 200, await resp.text()
            return time.monotonic()

        workers = [asyncio.create_task(client_loop(w)) for w in range(4)]
        try:
            rolled_at = await roll()
            await asyncio.sleep(0.4)
        finally:
            rolling = False
            await asyncio.gather(*workers)

        for style, a, _ in results:
            if style == "none":
                assert a.status == 200, a.body
                continue
            assert a.status in (200, 503), a.body
            if a.status == 200:
                assert a.body["hotload"]["sequence_start"] >= 1
                assert a.body["hotload"]["identity_start"] == "s1"
            else:
                assert a.body["error"]["reason"] == "constraint_unmet"
                assert a.headers.get("Retry-After") == "1"
        assert all(r.count(409) == 0 for r in fleet), [r.count(409) for r in fleet]
        constrained = [(a, t) for s, a, t in results if s != "none"]
        # Mid-roll, constrained requests were served by the replicas already updated...
        assert any(a.status == 200 and t < rolled_at for a, t in constrained)
        # ... and refused before the first replica had updated.
        assert any(a.status == 503 for a, _ in constrained)
        # Once everyone serves s1, they all go through.
        for style, extra in styles:
            a = await complete(client, f"after-{style}", max_tokens=1, **extra)
            assert a.status == 200 and a.body["hotload"]["sequence_start"] == 1


# --- streaming -----------------------------------------------------------------------------------


async def read_sse(resp: aiohttp.ClientResponse) -> list[tuple[float, str]]:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append((time.perf_counter(), line[len("data: ") :]))
    return events


@pytest.mark.asyncio
async def test_sse_from_a_real_engine_arrives_token_by_token(tiny: TinyLLM) -> None:
    async with replicas(tiny, 2) as fleet, router_for([r.url for r in fleet]) as (_, client):
        body = {
            "model": "tiny",
            "prompt": "the chef cooked",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.perf_counter()
        resp = await client.post(
            "/v1/completions", json=body, headers={"x-session-affinity": "stream-1"}
        )
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
        assert events[-1][1] == "[DONE]"
        chunks = [json.loads(e) for _, e in events[:-1]]
        assert len(chunks) >= 40 and all(c["model"] == "tiny@s0" for c in chunks)
        # Token chunks arrive spread over the generation, not in one burst at the end.
        times = [t for t, _ in events]
        assert times[-1] - times[0] > 0.3 * (times[-1] - sent), (times[0] - sent, times[-1] - sent)
        assert len({round(t, 3) for t in times}) > 10
        # The same text as asking the replica directly.
        direct = await client.session.post(
            str(resp.headers[REPLICA_HEADER]) + "/v1/completions", json=body
        )
        direct_chunks = [json.loads(e) for _, e in (await read_sse(direct))[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == "".join(c["choices"][0]["text"] for c in direct_chunks)


# --- fake replicas: exact failure timing ---------------------------------------------------------


@dataclass
class Fake:
    """A replica that reports `sequence` and answers completions with `behaviour`."""

    behaviour: str
    sequence: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    hits: int = 0
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "identity": f"s{self.sequence}",
                "sequence": self.sequence,
                "loading": False,
                "ready": True,
            }
        )

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.behaviour == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.behaviour == "stale":  # a 409 the router could not foresee
            return web.json_response(
                {
                    "error": {
                        "type": "snapshot_unavailable",
                        "message": "behind",
                        "served_identity": "s0",
                        "served_sequence": 0,
                    }
                },
                status=409,
                headers={"Retry-After": "1"},
            )
        if self.behaviour == "ok":
            return web.json_response(
                {"ok": True}, headers={"x-hotload-sequence": str(self.sequence)}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        if self.behaviour == "die-mid":
            assert request.transport is not None
            request.transport.close()
            return resp
        await self.gate.wait()
        await resp.write(b"data: second\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def fakes(*specs: tuple[str, int]) -> AsyncIterator[list[Fake]]:
    made = [Fake(behaviour, sequence) for behaviour, sequence in specs]
    async with AsyncExitStack() as stack:
        for fake in made:
            app = web.Application()
            app.router.add_get("/hotload/v1/status", fake.status)
            app.router.add_post("/v1/completions", fake.complete)
            fake.server = TestServer(app, host="127.0.0.1")
            await fake.server.start_server()
            stack.push_async_callback(fake.server.close)
        yield made


@pytest.mark.asyncio
async def test_sse_is_forwarded_without_buffering() -> None:
    """The first event reaches the client while the replica still holds the stream open."""
    async with fakes(("stream", 0)) as (fake,), router_for([fake.url]) as (_, client):
        resp = await client.post("/v1/completions", json={"stream": True})
        first = await asyncio.wait_for(resp.content.readline(), timeout=5)
        assert first == b"data: first\n"
        assert not fake.gate.is_set()
        fake.gate.set()
        rest = await asyncio.wait_for(resp.content.read(), timeout=5)
        assert rest == b"\ndata: second\n\ndata: [DONE]\n\n"


@pytest.mark.asyncio
async def test_a_replica_failing_before_the_answer_is_retried_once_elsewhere() -> None:
    async with (
        fakes(("drop", 0), ("ok", 0)) as (bad, good),
        # A cooldown the four requests cannot outlast, however slowly a busy machine runs them.
        router_for([bad.url, good.url], cooldown=300) as (router, client),
    ):
        answers = [await complete(client) for _ in range(4)]
        assert all(a.status == 200 and a.replica == good.url for a in answers)
        assert bad.hits == 1  # then held out for the cooldown
        assert metric(router, "hotload_router_retries_total", {"cause": "connection"}) == 1


@pytest.mark.asyncio
async def test_a_409_is_retried_elsewhere_and_corrects_the_view() -> None:
    async with (
        fakes(("stale", 1), ("ok", 1)) as (stale, good),
        router_for([stale.url, good.url]) as (router, client),
    ):
        answers = [
            await complete(client, headers={"x-hotload-min-sequence": "1"}) for _ in range(6)
        ]
        assert all(a.status == 200 and a.replica == good.url for a in answers), answers
        assert stale.hits >= 1
        assert metric(router, "hotload_router_retries_total", {"cause": "status_409"}) == stale.hits


@pytest.mark.asyncio
async def test_nothing_is_retried_once_streaming_started() -> None:
    async with (
        fakes(("die-mid", 0), ("die-mid", 0)) as (a, b),
        router_for([a.url, b.url]) as (
            router,
            client,
        ),
    ):
        resp = await client.post("/v1/completions", json={"stream": True})
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.content.read()
        assert a.hits + b.hits == 1
        assert metric(router, "hotload_router_retries_total", {"cause": "connection"}) == 0


@pytest.mark.asyncio
async def test_every_replica_down_is_503_unhealthy() -> None:
    port = free_port()
    async with router_for([f"http://127.0.0.1:{port}"]) as (_, client):
        a = await complete(client, "s")
        assert a.status == 503 and a.body["error"]["reason"] == "unhealthy"
        assert a.headers["Retry-After"] == "1"
        ready = await client.get("/ready")
        assert ready.status == 503
        text = await (await client.get("/metrics")).text()
        assert 'hotload_router_unavailable_total{reason="unhealthy"} 1.0' in text


# --- Kubernetes discovery ------------------------------------------------------------------------


def pod_manifest(
    name: str, port: int, deployment: str = "policy", component: str = "engine"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"hotload.dev/deployment": deployment, "hotload.dev/component": component},
        },
        "spec": {
            "schedulingGates": [{"name": "hotload.dev/test"}],
            "containers": [
                {
                    "name": "engine",
                    "image": "registry.invalid/engine:1",
                    "ports": [{"name": "http", "containerPort": port}],
                }
            ],
        },
    }


def report(identity: str, sequence: int, state: str = "idle") -> dict[str, Any]:
    annotation = {"identity": identity, "sequence": sequence, "state": state}
    return {
        "metadata": {
            "annotations": {ANNOTATION_SNAPSHOT: json.dumps(annotation)},
            "labels": {LABEL_IDENTITY: identity, LABEL_SEQUENCE: str(sequence)},
        }
    }


READY = {"status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.mark.asyncio
async def test_kubernetes_discovery_follows_the_deployments_pods(
    tiny: TinyLLM, kube_api: KubeAPI
) -> None:
    ns = kube_api.namespace
    pods = resource_path("v1", "pods", ns)
    async with replicas(tiny, 2) as fleet, kube_api.client() as kube:
        names = ["policy-a", "policy-b"]
        for name, r in zip(names, fleet, strict=True):
            await kube.create(pods, pod_manifest(name, r.port))
            await kube.patch(resource_path("v1", "pods", ns, name), report("s0", 0), "strategic")
            await kube.patch(resource_path("v1", "pods", ns, name, "status"), READY, "strategic")
        # Pods of another deployment, and the router's own pod, are not replicas.
        await kube.create(pods, pod_manifest("other-a", fleet[0].port, deployment="other"))
        await kube.create(pods, pod_manifest("policy-router", fleet[0].port, component="router"))

        discovery = KubeDiscovery(kube, ns, "policy")
        router = Router(discovery)
        client = TestClient(TestServer(create_router_app(router), host="127.0.0.1"))
        await client.start_server()
        try:
            view = {r.name: r for r in discovery.replicas()}
            assert set(view) == set(names)
            assert view["policy-a"].address == f"127.0.0.1:{fleet[0].port}"
            assert (view["policy-b"].identity, view["policy-b"].sequence) == ("s0", 0)
            answers = await asyncio.gather(
                *(complete(client, f"t{i}", max_tokens=1) for i in range(12))
            )
            assert {a.replica for a in answers} == set(names)

            # policy-b hot-loads s1; its loader reports "loading", then the new snapshot.
            b = resource_path("v1", "pods", ns, "policy-b")
            await kube.patch(b, report("s0", 0, "loading"), "strategic")
            await wait_until(
                "policy-b loading", lambda: any(r.loading for r in discovery.replicas())
            )
            answers = await asyncio.gather(
                *(complete(client, f"t{i}", max_tokens=1) for i in range(12))
            )
            assert {a.replica for a in answers} == {"policy-a"}
            resp = await client.session.post(
                fleet[1].url + "/hotload/v1/load",
                json={"path": str(tiny.snapshots[1]), "identity": "s1", "sequence": 1},
            )
            assert resp.status == 200
            await kube.patch(b, report("s1", 1), "strategic")
            await wait_until(
                "policy-b on s1",
                lambda: any(r.sequence == 1 and not r.loading for r in discovery.replicas()),
            )
            answers = await asyncio.gather(
                *(
                    complete(client, f"t{i}", max_tokens=1, headers={"x-hotload-min-sequence": "1"})
                    for i in range(8)
                )
            )
            assert all(a.status == 200 and a.replica == "policy-b" for a in answers)
            assert all(a.body["hotload"]["sequence_start"] == 1 for a in answers)

            # A pod that stops being Ready leaves the pool; a deleted pod is forgotten.
            not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
            await kube.patch(
                resource_path("v1", "pods", ns, "policy-a", "status"), not_ready, "strategic"
            )
            await wait_until("policy-a unready", lambda: not discovery.replicas()[0].healthy)
            a = await complete(client, "t1", max_tokens=1)
            assert a.status == 200 and a.replica == "policy-b"
            await kube.delete(b)
            await wait_until("policy-b gone", lambda: len(discovery.replicas()) == 1)
            a = await complete(client, "t1", max_tokens=1)
            assert a.status == 503 and a.body["error"]["reason"] == "unhealthy"
        finally:
            await client.close()


def test_replica_from_pod_reads_labels_when_the_annotation_is_missing() -> None:
    pod = {
        "metadata": {"name": "p", "labels": {LABEL_IDENTITY: "step-7", LABEL_SEQUENCE: "7"}},
        "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    r = replica_from_pod(pod, 9000)
    assert r is not None
    assert (r.name, r.address, r.identity, r.sequence, r.healthy, r.loading) == (
        "p",
        "10.1.2.3:9000",
        "step-7",
        7,
        True,
        False,
    )
    assert replica_from_pod({"metadata": {"name": "q"}, "status": {}}) is None
    deleting = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2030-01-01T00:00:00Z"}}
    assert replica_from_pod(deleting) is not None and not replica_from_pod(deleting).healthy  # type: ignore[union-attr]


# --- the command ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_hotload_router_command_serves_and_stops(tiny: TinyLLM) -> None:
    async with replicas(tiny, 1) as fleet:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hotload", "router", "--replicas", fleet[0].url,
            "--port", str(port), "--log-level", "warning",
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        try:
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{port}"
                # A Python process starting on a busy 2-core machine: seconds, not a fixed few.
                deadline = time.monotonic() + 120
                while True:
                    try:
                        async with http.get(url + "/ready") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    assert proc.returncode is None, "the router exited"
                    assert time.monotonic() < deadline, "the router did not become ready"
                    await asyncio.sleep(0.1)
                async with http.post(
                    url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}
                ) as resp:
                    assert resp.status == 200
                    assert resp.headers[REPLICA_HEADER] == fleet[0].url
                async with http.get(url + "/router/v1/replicas") as resp:
                    doc = await resp.json()
                    assert doc["replicas"][0]["identity"] == "s0"
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
        assert proc.returncode == 0, out.decode()


def test_router_help_and_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from hotload.cli.main import build_parser, run

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["router", "--help"])
    assert exc.value.code == 0
    assert "--kubernetes" in capsys.readouterr().out
    assert run(["router", "--kubernetes", "--namespace", "rl"]) == 1
    assert "--deployment" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router"])  # neither --replicas nor --kubernetes


@pytest.mark.asyncio
@pytest.mark.parametrize("limit", [None, 64 * 1024], ids=["read", "too-large-relisted"])
async def test_kubernetes_discovery_survives_an_oversized_watch_event(
    kube_api: KubeAPI, monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    """A pod whose watch event is over aiohttp's 512 KiB line default (a 600 KB environment
    variable) is read; and where an event is over even the client's limit, the discovery lists
    again instead of dying on a frozen pod list: pods created afterwards still arrive."""
    from hotload.kube import client as kube_client

    if limit is not None:
        monkeypatch.setattr(kube_client, "MAX_WATCH_EVENT_BYTES", limit)
    ns = kube_api.namespace
    pods = resource_path("v1", "pods", ns)

    async def running(body: dict[str, Any]) -> None:  # a pod with an IP, as a kubelet makes it
        await kube.create(pods, body)
        name = body["metadata"]["name"]
        await kube.patch(resource_path("v1", "pods", ns, name, "status"), READY, "strategic")

    async with kube_api.client() as kube:
        await running(pod_manifest("policy-a", 8000))
        discovery = KubeDiscovery(kube, ns, "policy")
        await discovery.start()
        try:
            big = pod_manifest("policy-big", 8001)
            big["spec"]["containers"][0]["env"] = [{"name": "BLOB", "value": "x" * 600_000}]
            await running(big)
            await running(pod_manifest("policy-c", 8002))
            names = {"policy-a", "policy-big", "policy-c"}
            await wait_until(
                "every pod, the big one included",
                lambda: {r.name for r in discovery.replicas()} == names,
                timeout=30,
            )
            assert discovery._task is not None and not discovery._task.done()
        finally:
            await discovery.aclose()
