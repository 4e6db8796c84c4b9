"""Reference engines started in the test's own event loop, behind real HTTP servers, and the
requests tests send them (`complete`, `load`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from hotload.engine.engine import Engine, EngineConfig
from hotload.engine.server import ENGINE, create_app
from support.fleet import free_port
from support.tiny_llm import TinyLLM


@asynccontextmanager
async def serve_engines(
    *snapshots: tuple[Path, str], **options: Any
) -> AsyncIterator[list[TestClient[Any, Any]]]:
    """Started engines (named "policy") on `(folder, identity)` pairs; `options` go to
    `EngineConfig`. Yields one aiohttp test client per engine."""
    options.setdefault("name", "policy")
    async with AsyncExitStack() as stack:
        clients: list[TestClient[Any, Any]] = []
        for path, identity in snapshots:
            engine = Engine(EngineConfig(model_path=path, identity=identity, **options))
            client: TestClient[Any, Any] = TestClient(
                TestServer(create_app(engine), host="127.0.0.1")
            )
            await client.start_server()
            stack.push_async_callback(client.close)
            await engine.start()
            clients.append(client)
        yield clients


#: Prompts in the tiny Llama's vocabulary (`support.tiny_llm`), of several lengths.
PROMPTS = [
    "the chef cooked the old boat",
    "a pilot found a red door in the garden",
    "my neighbour",
    "the teacher sold a wooden table to the doctor and then",
    "our team built the new bridge",
    "a sailor",
]


@dataclass
class Result:
    """One generation as a client saw it."""

    status: int
    body: dict[str, Any]
    chunks: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        """Generated token ids (requests ask for `return_token_ids`)."""
        if self.chunks:
            return [t for c in self.chunks for t in c["choices"][0].get("token_ids", [])]
        return list(self.body["choices"][0]["token_ids"])

    @property
    def text(self) -> str:
        """The completion text (concatenated deltas when streamed)."""
        if self.chunks:
            return "".join(c["choices"][0].get("text", "") for c in self.chunks)
        return str(self.body["choices"][0]["text"])

    @property
    def hotload(self) -> dict[str, Any]:
        """The `hotload` object: the snapshots at generation start and end."""
        source = self.chunks[-1] if self.chunks else self.body
        return dict(source["hotload"])


@asynccontextmanager
async def serve(path: Path, identity: str, sequence: int = 0, **options: Any) -> AsyncIterator[Any]:
    """A started engine on `path` behind a real aiohttp server; yields a test client.

    Staging runs at normal priority here (`stage_nice=0`): these tests time swaps against
    running generations and must not depend on how busy the machine is.
    """
    options.setdefault("stage_nice", 0)
    engine = Engine(
        EngineConfig(model_path=path, name="tiny", identity=identity, sequence=sequence, **options)
    )
    client = TestClient(TestServer(create_app(engine), host="127.0.0.1"))
    await client.start_server()
    try:
        await engine.start()
        yield client
    finally:
        await client.close()


def engine_of(client: Any) -> Engine:
    """The engine behind a test client."""
    return client.server.app[ENGINE]


async def complete(
    client: Any,
    prompt: str | list[int],
    max_tokens: int = 16,
    *,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> Result:
    """POST /v1/completions (greedy, token ids returned) and read the answer or the SSE stream."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True, **extra}
    if stream:
        body["stream"] = True
    resp = await client.post("/v1/completions", json=body, headers=headers or {})
    if resp.status != 200 or not stream:
        return Result(resp.status, await resp.json(), headers=dict(resp.headers))
    result = Result(resp.status, {}, headers=dict(resp.headers))
    done = False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            break
        result.chunks.append(json.loads(data))
        result.times.append(time.perf_counter())
    assert done, "stream ended without [DONE]"
    return result


async def load(client: Any, path: Path, identity: str, sequence: int, **extra: Any) -> Any:
    """POST /hotload/v1/load; returns the response (status and JSON)."""
    body = {"path": str(path), "identity": identity, "sequence": sequence, **extra}
    resp = await client.post("/hotload/v1/load", json=body)
    return resp.status, await resp.json()


@dataclass
class EngineReplica:
    """A reference engine behind a real aiohttp server on a fixed loopback port."""

    engine: Engine
    port: int
    server: TestServer | None = None

    @property
    def url(self) -> str:
        """Its base URL."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Serve on its port and start the engine."""
        self.server = TestServer(create_app(self.engine), host="127.0.0.1", port=self.port)
        await self.server.start_server()
        await self.engine.start()

    async def stop(self) -> None:
        """Close its server (the engine's requests end with it)."""
        if self.server is not None:
            await self.server.close()
            self.server = None

    def count(self, code: int, endpoint: str = "/v1/completions") -> int:
        """Requests to `endpoint` the engine answered with `code`."""
        value = self.engine.metrics.registry.get_sample_value(
            "hotload_engine_requests_total", {"endpoint": endpoint, "code": str(code)}
        )
        return int(value or 0)


def new_engine_replica(tiny: TinyLLM) -> EngineReplica:
    """A replica (not started) of `tiny`'s first snapshot, as s0, on a free port."""
    engine = Engine(
        EngineConfig(
            model_path=tiny.snapshots[0], name="tiny", identity="s0", sequence=0, stage_nice=0
        )
    )
    return EngineReplica(engine, free_port())


async def checksums(client: Any) -> dict[str, str]:
    """GET /hotload/v1/checksums: sha256 of every weight as the engine holds it."""
    resp = await client.get("/hotload/v1/checksums")
    assert resp.status == 200
    body = await resp.json()
    assert body["algorithm"] == "sha256"
    return dict(body["checksums"])
