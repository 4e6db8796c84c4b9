"""A real vLLM (CPU build, dev mode, runtime LoRA updating on) behind `hotload front`, as the
operator's pods run it: vLLM on loopback, the front on the serving port.

Through the front completions work (plain and streamed, token for token what vLLM answers
directly) and every admin route of vLLM is refused without reaching it (`/pause` leaves it
unpaused, `/collective_rpc` reloads nothing); on loopback the loader's adapter still hot-loads.
The same admin check on vLLM's own port finds the routes open. One server for the module
(start-up takes about a minute on 2 cores); never skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hotload_sidecar.engines import LoadRequest, ServedSnapshot, Timeouts, VLLMAdapter
from support.fronts import VLLM_ADMIN, Server, admin_reachable, start_front
from support.vllm_server import INSTALL_HINT, VLLMServer, vllm_python, write_tiny_llama

pytestmark = pytest.mark.slow

PROMPT = [101, 2023, 2003, 1037, 3231]


class World:
    """vLLM on loopback serving A, the front before it, and snapshot B."""

    def __init__(self, server: VLLMServer, front: Server, front_url: str, b: Path) -> None:
        self.server, self.front, self.front_url, self.b = server, front, front_url, b


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if vllm_python() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    root = tmp_path_factory.mktemp("vllm-front")
    a = write_tiny_llama(root / "step-a", seed=1)
    b = write_tiny_llama(root / "step-b", seed=2)
    try:
        server = VLLMServer.start(
            a,
            root / "vllm.log",
            extra_args=("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"),
            extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        )
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)
    try:
        front, url = start_front(server.url, root / "front.log")
    except BaseException:
        server.stop()
        raise
    try:
        yield World(server, front, url, b)
    finally:
        front.stop()
        server.stop()


async def _complete(http: aiohttp.ClientSession, base: str, model: str, **extra: Any) -> Any:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 6,
        "min_tokens": 6,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    async with http.post(base + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not extra.get("stream"):
            return (await resp.json())["choices"][0]["token_ids"]
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [ln[6:] for ln in (await resp.text()).split("\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [t for e in events[:-1] for t in json.loads(e)["choices"][0].get("token_ids") or []]


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(content_type=None)


@pytest.mark.asyncio
async def test_vllm_behind_the_front_serves_only_inference(world: World) -> None:
    direct, front, model = world.server.url, world.front_url, world.server.model
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        on_a = await _complete(http, direct, model)
        assert await _complete(http, front, model) == on_a
        assert await _complete(http, front, model, stream=True) == on_a
        assert (await _get(http, front + "/v1/models"))["data"][0]["id"] == model
        for path in ("/health", "/metrics"):
            async with http.get(front + path) as resp:
                assert resp.status == 200, path
        # Every admin route is refused, with bodies that would act (reload B, load an adapter).
        assert await admin_reachable(front, VLLM_ADMIN, str(world.b)) == []
        # None reached vLLM: not paused, not asleep, weights and version untouched.
        assert (await _get(http, direct + "/is_paused"))["is_paused"] is False
        assert (await _get(http, direct + "/is_sleeping"))["is_sleeping"] is False
        assert (await _get(http, direct + "/weight_info"))["weight_version"] == "default"
        assert await _complete(http, front, model) == on_a


@pytest.mark.asyncio
async def test_the_admin_check_finds_vllm_open_on_its_own_port(world: World) -> None:
    """Without the front, the same check fails: vLLM's own port answers its admin routes.
    Only harmless ones are sent here (reads), so the module's engine stays as it was."""
    reads = [r for r in VLLM_ADMIN if r[0] == "GET"]
    reachable = await admin_reachable(world.server.url, reads, str(world.b))
    assert [r.split(" ->")[0] for r in reachable] == [f"GET {p}" for _, p, _ in reads]


@pytest.mark.asyncio
async def test_the_loader_hot_loads_through_loopback(world: World) -> None:
    direct, front, model = world.server.url, world.front_url, world.server.model
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        before = await _complete(http, front, model)
        async with VLLMAdapter(direct, timeouts=Timeouts(probe=60.0)) as adapter:
            result = await adapter.load(LoadRequest(str(world.b), "step-b", 2))
            assert result.served == ServedSnapshot("step-b", 2)
        after = await _complete(http, front, model)
        assert after != before, "outputs through the front must change with the weights"
        assert after == await _complete(http, direct, model)
