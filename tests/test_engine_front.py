"""A replica's serving port answers the inference API only; the admin API stays on loopback.

Two ways, as the operator's pods use them:
- the reference engine splits its API itself: `hotload serve --admin-port` (real processes on a
  tiny Llama): through the public port completions work and every admin request is refused;
  the loader's adapter hot-loads through the loopback port;
- `hotload front` in front of an engine on loopback (vLLM, SGLang): against a stub engine, the
  relay is byte for byte (bodies, SSE chunks as they come, status codes, headers), path tricks
  do not get through, a dead engine is a 502; against the real reference engine, its answers
  equal the engine's own. vLLM behind the front: `tests/test_engine_front_vllm.py`.

The admin check proves itself: on the engine's full API (no restriction) it finds every admin
request reachable.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from hotload.router.front import EngineFront, FrontConfig, allowed_paths, create_front_app
from hotload_sidecar.engines import LoadRequest, ReferenceAdapter, ServedSnapshot
from support.fronts import (
    REFERENCE_ADMIN,
    VLLM_ADMIN,
    Server,
    admin_reachable,
    free_port,
    is_refusal,
    start_front,
)
from support.tiny_llm import TinyLLM, build_tiny_llm

# --- the front against a stub engine -------------------------------------------------------------

SSE_CHUNKS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
JSON_BODY = b'{"id":"cmpl-1","model":"policy@step-7",  "choices":[]}'


class StubEngine:
    """An engine-shaped server that records every request it gets."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.release = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.raw_path, dict(request.headers), body))
        status = request.headers.get("x-stub-status")
        if status:
            return web.json_response(
                {"error": {"type": "snapshot_unavailable", "served_sequence": 3}},
                status=int(status),
                headers={"Retry-After": "1", "x-hotload-snapshot": "step-3"},
            )
        if request.path == "/v1/chat/completions":  # SSE, held after the first chunk
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "x-hotload-sequence": "7"}
            )
            await response.prepare(request)
            await response.write(SSE_CHUNKS[0])
            await self.release.wait()
            for chunk in SSE_CHUNKS[1:]:
                await response.write(chunk)
            await response.write_eof()
            return response
        return web.Response(
            body=JSON_BODY,
            content_type="application/json",
            headers={"x-hotload-snapshot": "step-7", "x-hotload-sequence": "7", "X-Custom": "a"},
        )


@pytest_asyncio.fixture
async def stub() -> AsyncIterator[tuple[StubEngine, TestServer]]:
    """A stub engine and a front before it."""
    engine = StubEngine()
    server = TestServer(engine.app(), host="127.0.0.1")
    await server.start_server()
    front = await _front(str(server.make_url("")).rstrip("/"))
    try:
        yield engine, front
    finally:
        engine.release.set()
        await front.close()
        await server.close()


async def _front(engine_url: str, **config: Any) -> TestServer:
    server = TestServer(
        create_front_app(EngineFront(engine_url, FrontConfig(**config))), host="127.0.0.1"
    )
    await server.start_server()
    return server


@pytest.mark.asyncio
async def test_the_front_relays_answers_byte_for_byte(stub: tuple[StubEngine, TestServer]) -> None:
    engine, front = stub
    base = str(front.make_url("")).rstrip("/")
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.post(
            URL(base + "/v1/completions?api-version=2&x=%2F", encoded=True),
            data=b'{"prompt": "hi"}',
            headers={"Content-Type": "application/json", "x-multi-turn-session-id": "s1"},
        ) as resp:
            assert resp.status == 200
            assert await resp.read() == JSON_BODY
            assert resp.headers["x-hotload-snapshot"] == "step-7"
            assert resp.headers["x-hotload-sequence"] == "7"
            assert resp.headers["X-Custom"] == "a"
            assert resp.headers["Content-Type"] == "application/json"
        method, path_qs, headers, body = engine.seen[-1]
        # The request reached the engine as it came: path, raw query, body, headers.
        assert (method, path_qs, body) == (
            "POST",
            "/v1/completions?api-version=2&x=%2F",
            b'{"prompt": "hi"}',
        )
        assert headers["x-multi-turn-session-id"] == "s1"

        # SSE: the first chunk arrives while the engine still holds the rest (no buffering).
        async with http.post(base + "/v1/chat/completions", json={"stream": True}) as resp:
            assert resp.status == 200 and resp.headers["x-hotload-sequence"] == "7"
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=10)
            assert first == SSE_CHUNKS[0]
            engine.release.set()
            assert first + await resp.read() == b"".join(SSE_CHUNKS)

        # The engine's refusals pass as they are: status, Retry-After, snapshot headers.
        for status in (409, 425, 503):
            async with http.get(base + "/v1/models", headers={"x-stub-status": str(status)}) as r:
                assert r.status == status and r.headers["Retry-After"] == "1"
                assert r.headers["x-hotload-snapshot"] == "step-3"
                assert (await r.json())["error"]["served_sequence"] == 3


@pytest.mark.asyncio
async def test_the_front_refuses_every_other_path(stub: tuple[StubEngine, TestServer]) -> None:
    engine, front = stub
    base = str(front.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        for method, path, body in [*VLLM_ADMIN, *REFERENCE_ADMIN]:
            async with http.request(method, base + path, json=body) as resp:
                assert is_refusal(resp.status, await resp.json()), (method, path)
        async with http.get(base + "/front/healthz") as resp:
            assert resp.status == 200
    # Raw request lines, as a client may send them: dot segments, encodings, doubled
    # slashes, case and trailing slashes name no allowed path.
    port = front.port
    assert port is not None
    for target in (
        "/v1/completions/../../pause",
        "/v1/completions/%2e%2e/%2e%2e/pause",
        "/v1/%2e%2e/pause",
        "//pause",
        "/v1//completions",
        "/V1/completions",
        "/v1/completions/",
        "/v1/completions%2F..%2F..%2Fpause",
        "/v1/models/../load_lora_adapter",
        "http://127.0.0.1/pause",
    ):
        status, body = await _raw_post(port, target)
        assert status == 404 and is_refusal(status, json.loads(body)), (target, status, body)
    assert engine.seen == [], "a refused request reached the engine"


async def _raw_post(port: int, target: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            "Connection: close\r\n\r\n{}".encode()
        )
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.asyncio
async def test_a_dead_engine_is_a_502_with_retry_after() -> None:
    front = await _front(f"http://127.0.0.1:{free_port()}")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(str(front.make_url("/v1/completions")), json={}) as resp:
                assert resp.status == 502 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["type"] == "engine_unavailable"
            async with http.get(str(front.make_url("/front/healthz"))) as resp:
                assert resp.status == 200, "the front's liveness does not depend on the engine"
    finally:
        await front.close()


@pytest.mark.asyncio
async def test_a_connection_the_engine_dropped_is_retried_once() -> None:
    """An engine that closes a kept-alive connection as the next request arrives (uvicorn's
    keep-alive ends after 5 s): the request goes again on a new connection, once."""
    answered = 0

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        first = True
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length")
                ),
                0,
            )
            await reader.readexactly(length)
            if not first:  # the second request on this connection: drop it unanswered
                writer.close()
                return
            first = False
            answered += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
            )
            await writer.drain()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    front = await _front(f"http://127.0.0.1:{port}", keepalive_timeout=30.0)
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(str(front.make_url("/v1/completions")), json={}) as resp:
                    assert resp.status == 200, await resp.text()
        assert answered == 3
    finally:
        await front.close()
        server.close()


def test_extra_allowed_paths_are_exact() -> None:
    assert "/generate" in allowed_paths(["/generate"])
    assert "/v1/completions" in allowed_paths()
    for bad in ("generate", "/generate?x=1"):
        with pytest.raises(ValueError):
            allowed_paths([bad])


# --- the real reference engine -------------------------------------------------------------------


class Replica:
    """`hotload serve --admin-port` on s0 (as the operator starts it), plus a front in front of
    its full API (as vLLM's pods have it), all real processes."""

    def __init__(self, tiny: TinyLLM, root: Path) -> None:
        self.tiny = tiny
        port, admin = free_port(), free_port()
        self.public = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin}"
        self.engine = Server(
            [
                "serve", "--model", str(tiny.snapshots[0]), "--name", "policy",
                "--port", str(port), "--admin-port", str(admin), "--max-batch", "4",
            ],
            root / "engine.log",
        )  # fmt: skip
        self.front: Server | None = None
        self.fronted = ""

    def start(self) -> None:
        self.engine.start(self.public + "/ready", timeout=180)
        self.front, self.fronted = start_front(
            self.admin, self.engine.log_path.with_name("front.log")
        )

    def stop(self) -> None:
        for server in (self.front, self.engine):
            if server is not None:
                server.stop()


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    root = tmp_path_factory.mktemp("front")
    rep = Replica(build_tiny_llm(root / "tiny", 1), root)
    try:
        rep.start()
        yield rep
    finally:
        rep.stop()


async def _complete(http: aiohttp.ClientSession, base: str, **body: Any) -> dict[str, Any]:
    request = {"prompt": "the chef cooked", "max_tokens": 6, "return_token_ids": True, **body}
    async with http.post(base + "/v1/completions", json=request) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            return {"headers": dict(resp.headers), "body": await resp.json()}
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return {"headers": dict(resp.headers), "chunks": [json.loads(e) for e in events[:-1]]}


async def _status(http: aiohttp.ClientSession, replica: Replica) -> tuple[Any, ...]:
    async with http.get(replica.admin + "/hotload/v1/status") as resp:
        doc = await resp.json()
    return doc["identity"], doc["sequence"], doc["loads"], doc.get("adapters")


def _same_answer(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal but for the per-request id and creation time."""

    def strip(doc: Any) -> Any:
        return {k: v for k, v in doc.items() if k not in ("id", "created")}

    for name in ("x-hotload-snapshot", "x-hotload-sequence", "Content-Type"):
        assert a["headers"][name] == b["headers"][name], name
    if "body" in a:
        assert strip(a["body"]) == strip(b["body"])
    else:
        assert [strip(c) for c in a["chunks"]] == [strip(c) for c in b["chunks"]]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_reference_engine_serves_only_inference_on_its_public_port(
    replica: Replica,
) -> None:
    weights = str(replica.tiny.snapshots[1])
    async with aiohttp.ClientSession() as http:
        for base in (replica.public, replica.fronted):
            plain = await _complete(http, base)
            assert plain["body"]["model"] == "policy@s0"
            assert plain["headers"]["x-hotload-snapshot"] == "s0"
            streamed = await _complete(http, base, stream=True)
            assert [
                t for c in streamed["chunks"] for t in c["choices"][0].get("token_ids", [])
            ] == (plain["body"]["choices"][0]["token_ids"])
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            async with http.post(base + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200, await resp.text()
            for path in ("/v1/models", "/health", "/ready", "/metrics"):
                async with http.get(base + path) as resp:
                    assert resp.status == 200, path
            # A version demand the replica cannot meet: the engine's 409 comes through as is.
            async with http.post(
                base + "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"x-hotload-min-sequence": "5"},
            ) as resp:
                assert resp.status == 409 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["served_identity"] == "s0"
            # Every admin request is refused, with bodies that would have loaded s1.
            before = await _status(http, replica)
            assert await admin_reachable(base, REFERENCE_ADMIN, weights) == [], base
            # Nothing was loaded.
            assert await _status(http, replica) == before
        # Through the front, the engine's answers are its own.
        _same_answer(await _complete(http, replica.admin), await _complete(http, replica.fronted))
        direct = await _complete(http, replica.admin, stream=True)
        _same_answer(direct, await _complete(http, replica.fronted, stream=True))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_admin_check_finds_an_open_engine(replica: Replica) -> None:
    """Without the restriction (the engine's full API, as a replica exposed it before) the same
    check fails: it finds the admin requests reachable. Bodies name a folder that is not a
    snapshot, so nothing loads."""
    nowhere = str(replica.tiny.root / "not-a-snapshot")
    reachable = await admin_reachable(replica.admin, REFERENCE_ADMIN, nowhere)
    assert [r.split(" ->")[0] for r in reachable] == [f"{m} {p}" for m, p, _ in REFERENCE_ADMIN]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_loader_still_loads_through_loopback(replica: Replica) -> None:
    tiny = replica.tiny
    async with aiohttp.ClientSession() as http:
        before = await _complete(http, replica.public)
        async with ReferenceAdapter(replica.admin) as adapter:
            result = await adapter.load(LoadRequest(str(tiny.snapshots[1]), "s1", 1))
            assert result.served == ServedSnapshot("s1", 1)
            assert await adapter.current() == ServedSnapshot("s1", 1)
            after = await _complete(http, replica.public)
            assert after["body"]["model"] == "policy@s1"
            assert after["headers"]["x-hotload-snapshot"] == "s1"
            assert (
                after["body"]["choices"][0]["token_ids"]
                != before["body"]["choices"][0]["token_ids"]
            )
            # Back to s0 for the module's other tests.
            await adapter.load(LoadRequest(str(tiny.snapshots[0]), "s0", 2))
            assert await adapter.current() == ServedSnapshot("s0", 2)


def test_serve_refuses_the_same_port_twice(tmp_path: Path) -> None:
    import subprocess
    import sys

    tiny = build_tiny_llm(tmp_path / "tiny", 0)
    port = str(free_port())
    proc = subprocess.run(
        [sys.executable, "-m", "hotload", "serve", "--model", str(tiny.snapshots[0]),
         "--port", port, "--admin-port", port],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and "--admin-port must differ from --port" in proc.stderr
