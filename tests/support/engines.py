"""Reference engines started in the test's own event loop, behind real HTTP servers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from hotload.engine.engine import Engine, EngineConfig
from hotload.engine.server import create_app


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
