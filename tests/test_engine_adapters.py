"""Engine adapters against stub servers that implement each engine's HTTP contract.

* reference: the hot-load contract of `hotload.engine` (load, status, health, ready);
* SGLang: its documented `/update_weights_from_disk` request and response shapes (plus
  `/pause_generation`, `/continue_generation`, `/get_weight_version`, `/health`) — SGLang cannot
  run on these machines, so this is all that is tested of it;
* vLLM: the dev-mode call sequence per mode and policy, and its failure paths (the real vLLM
  runs in test_engine_vllm.py); sparse patches through `/collective_rpc` answered by the real
  hotload worker extension on simulated tensor-parallel ranks (test_engine_vllm_patch.py runs
  them in a real vLLM).

Error paths: engine down, timeout, rejected load — the old snapshot is still reported.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
import torch
from aiohttp import web

from hotload.arc.patch import prepare_patch
from hotload.errors import (
    EngineBusyError,
    EngineError,
    EngineLoadError,
    EngineUnavailableError,
    HotloadError,
)
from hotload.snapshot import write_snapshot
from hotload_patch import PROTOCOL
from hotload_patch import vllm as vllm_extension
from hotload_patch.checkpoint import checkpoint_specs
from hotload_patch.served import Counters, Meter, served_sums
from hotload_patch.staging import parameter_checksums
from hotload_patch.vllm import HotloadWorkerExtension
from hotload_sidecar.engines import (
    LoadRequest,
    PatchRefusedError,
    ReferenceAdapter,
    ServedSnapshot,
    SGLangAdapter,
    Timeouts,
    VLLMAdapter,
    check_loadable,
    make_adapter,
)
from support.patch_models import ToyConfig, ToyTPModel, checkpoint_weights, load_ranks
from support.patch_models import read_checkpoint as read_tensors
from support.snapshots import CONFIG, full, weights
from support.tiny_llm import sparse_steps

FAST = Timeouts(request=2.0, load=2.0, drain=2.0, probe=2.0, connect=1.0)


# --- a tiny stub-server harness ------------------------------------------------------------------


@dataclass
class Stub:
    """An aiohttp app on a loopback port that records every call it gets."""

    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None

    def record(self, request: web.Request, body: Any) -> None:
        query = f"?{request.query_string}" if request.query_string else ""
        self.calls.append((request.method, request.path + query, body))

    def paths(self) -> list[str]:
        """The calls as 'METHOD /path?query', in order (GETs included)."""
        return [f"{m} {p}" for m, p, _ in self.calls]

    def posts(self) -> list[str]:
        """The POST calls only."""
        return [f"{m} {p}" for m, p, _ in self.calls if m == "POST"]


async def start(stub: Stub, routes: list[web.RouteDef]) -> Stub:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    stub.url = f"http://127.0.0.1:{port}"
    stub.runner = runner
    return stub


async def body_of(request: web.Request) -> Any:
    text = await request.text()
    return json.loads(text) if text else None


def error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


@pytest.fixture
def snap_a(tmp_path: Path) -> Path:
    return full(tmp_path / "step-a", weights(1))


@pytest.fixture
def snap_b(tmp_path: Path) -> Path:
    return full(tmp_path / "step-b", weights(2))


def req(path: Path | str, identity: str, sequence: int, **kw: Any) -> LoadRequest:
    return LoadRequest(str(path), identity, sequence, **kw)


# --- the interface -------------------------------------------------------------------------------


def test_load_request_validates_its_fields() -> None:
    LoadRequest("/w/a", "step-1", 1, mode="sync", cache_policy="new_session")
    with pytest.raises(HotloadError, match="identity"):
        LoadRequest("/w/a", "bad/identity", 1)
    with pytest.raises(ValueError, match="mode"):
        LoadRequest("/w/a", "a", 1, mode="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_policy"):
        LoadRequest("/w/a", "a", 1, cache_policy="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequence"):
        LoadRequest("/w/a", "a", -1)
    with pytest.raises(ValueError, match="path"):
        LoadRequest("", "a", 1)


def test_make_adapter_builds_each_kind() -> None:
    assert isinstance(make_adapter("reference", "http://h:1/"), ReferenceAdapter)
    assert isinstance(make_adapter("vllm", "http://h:1", sync_in_flight="abort"), VLLMAdapter)
    assert isinstance(make_adapter("sglang", "http://h:1"), SGLangAdapter)
    assert make_adapter("vllm", "http://h:1/").url == "http://h:1"
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        make_adapter("tgi", "http://h:1")


def test_engine_errors_are_hotload_errors_naming_engine_url_and_step() -> None:
    err = EngineLoadError("boom", engine="vllm", url="http://e:8000", step="reload", serving="x")
    assert isinstance(err, EngineError) and isinstance(err, HotloadError)
    assert str(err) == "vllm engine at http://e:8000: reload: boom"
    assert err.serving == "x"
    assert issubclass(EngineBusyError, EngineLoadError)
    assert issubclass(EngineUnavailableError, EngineError)


def test_check_loadable_refuses_what_an_in_place_reload_cannot_take(
    tmp_path: Path, snap_a: Path, snap_b: Path
) -> None:
    check_loadable(str(snap_b), str(snap_a))
    with pytest.raises(HotloadError, match="does not exist"):
        check_loadable(str(tmp_path / "nope"), None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HotloadError, match=r"no config\.json"):
        check_loadable(str(tmp_path / "empty"), None)
    other = weights(3)
    other["model.layers.0.mlp.weight"] = other["model.layers.0.mlp.weight"][:, :32].copy()
    wrong = full(tmp_path / "wrong-shape", other)
    with pytest.raises(HotloadError, match=r"model\.layers\.0\.mlp\.weight.*differs"):
        check_loadable(str(wrong), str(snap_a))
    fewer = weights(3)
    del fewer["model.layers.2.mlp.weight"]
    with pytest.raises(HotloadError, match="missing"):
        check_loadable(str(full(tmp_path / "fewer", fewer)), str(snap_a))


def test_check_loadable_refuses_a_change_of_quantization(tmp_path: Path) -> None:
    """BF16 weights to a block-FP8 snapshot of them (or back, or another recipe): refused
    before the engine pauses, naming quantization_config and both sides."""

    from hotload.snapshot import build_from_folder
    from support.families import FAMILIES, save_family

    bf16 = save_family(FAMILIES["qwen3-moe"], tmp_path / "hf", seed=1)
    experts = build_from_folder(bf16, tmp_path / "experts", fp8="experts").path
    linear = build_from_folder(bf16, tmp_path / "linear", fp8="linear").path
    check_loadable(str(experts), str(experts))
    with pytest.raises(
        HotloadError,
        match=r"quantization_config: is fp8 \(recipe 'experts'\) "
        r"and the engine runs unquantized weights",
    ):
        check_loadable(str(experts), str(bf16))
    with pytest.raises(HotloadError, match=r"is unquantized and the engine runs fp8"):
        check_loadable(str(bf16), str(experts))
    with pytest.raises(HotloadError, match=r"recipe 'linear'.*runs fp8 \(recipe 'experts'\)"):
        check_loadable(str(linear), str(experts))


def test_check_loadable_refuses_a_delta(tmp_path: Path, snap_a: Path) -> None:
    from support.snapshots import delta, nudged

    child = full(tmp_path / "child-full", nudged(weights(1), 1))
    d = delta(snap_a, child, tmp_path / "step-d")
    with pytest.raises(HotloadError, match="incremental snapshot"):
        check_loadable(str(d), str(snap_a))


# --- reference engine ----------------------------------------------------------------------------

LOAD_FIELDS = {"path", "identity", "sequence", "mode", "cache_policy"}


@dataclass
class ReferenceStub(Stub):
    """The reference engine's hot-load contract, with switches for its failure answers."""

    identity: str | None = None
    sequence: int | None = None
    refuse: tuple[int, str, str] | None = None
    hang: bool = False
    busy: bool = False
    loads: int = 0

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/hotload/v1/load", self.load),
            web.get("/hotload/v1/status", self.status),
            web.get("/health", self.ok),
            web.get("/ready", self.ok),
        ]

    async def load(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        self.record(request, body)
        if not isinstance(body, dict) or set(body) != LOAD_FIELDS:
            return error(422, "invalid_request", f"fields must be {sorted(LOAD_FIELDS)}")
        if body["mode"] not in ("async", "sync") or body["cache_policy"] not in (
            "all",
            "none",
            "new_session",
        ):
            return error(422, "invalid_request", "bad mode or cache_policy")
        if self.busy:
            return error(409, "load_in_progress", "a load of step-x is in progress")
        while self.hang:  # until the test's teardown lets go
            await asyncio.sleep(0.05)
        if self.refuse is not None:
            status, kind, message = self.refuse
            return error(status, kind, message)
        self.identity, self.sequence = body["identity"], body["sequence"]
        self.loads += 1
        return web.json_response(
            {
                "identity": self.identity,
                "sequence": self.sequence,
                "load_seconds": 0.25,
                "pause_seconds": 0.01,
            }
        )

    async def status(self, request: web.Request) -> web.Response:
        self.record(request, None)
        return web.json_response(
            {
                "model": "tiny",
                "identity": self.identity,
                "sequence": self.sequence,
                "loading": False,
                "loads": self.loads,
                "last_load_seconds": 0.25,
                "last_error": None,
            }
        )

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


@pytest_asyncio.fixture
async def reference() -> AsyncIterator[ReferenceStub]:
    stub = ReferenceStub()
    await start(stub, stub.routes())
    try:
        yield stub
    finally:
        stub.hang = False
        assert stub.runner is not None
        await stub.runner.cleanup()


@pytest.mark.asyncio
async def test_reference_load_sends_the_contract_and_confirms(reference: ReferenceStub) -> None:
    async with ReferenceAdapter(reference.url, timeouts=FAST) as adapter:
        assert await adapter.current() is None
        reference.calls.clear()
        result = await adapter.load(req("/w/step-1", "step-1", 1, mode="sync", cache_policy="none"))
        assert result.served == ServedSnapshot("step-1", 1)
        assert result.pause_seconds == 0.01 and result.load_seconds > 0
        # The engine's own pause, as it reported it, inside the load call.
        assert result.steps["load.pause"] == 0.01
        assert list(result.steps) == ["load", "load.pause", "confirm"]
        assert not result.cache_reset
        _, _, body = reference.calls[0]
        assert body == {
            "path": "/w/step-1",
            "identity": "step-1",
            "sequence": 1,
            "mode": "sync",
            "cache_policy": "none",
        }
        assert reference.paths() == ["POST /hotload/v1/load", "GET /hotload/v1/status"]
        assert await adapter.current() == ServedSnapshot("step-1", 1)
        health = await adapter.health()
        assert health.live and health.ready


@pytest.mark.asyncio
@pytest.mark.parametrize("status", [400, 422, 500])
async def test_reference_rejected_load_keeps_the_old_snapshot(
    reference: ReferenceStub, status: int
) -> None:
    async with ReferenceAdapter(reference.url, timeouts=FAST) as adapter:
        await adapter.load(req("/w/step-1", "step-1", 1))
        reference.refuse = (status, "checksum_mismatch", "shard 2: tensor 'w' checksum mismatch")
        with pytest.raises(EngineLoadError) as info:
            await adapter.load(req("/w/step-2", "step-2", 2))
        err = info.value
        assert err.serving == "previous" and err.step == "load" and err.status == status
        assert reference.url in str(err)
        assert "checksum_mismatch: shard 2" in str(err)
        assert await adapter.current() == ServedSnapshot("step-1", 1)


@pytest.mark.asyncio
async def test_reference_busy_is_its_own_error(reference: ReferenceStub) -> None:
    reference.busy = True
    async with ReferenceAdapter(reference.url, timeouts=FAST) as adapter:
        with pytest.raises(EngineBusyError, match="load_in_progress"):
            await adapter.load(req("/w/step-2", "step-2", 2))


@pytest.mark.asyncio
async def test_reference_timeout_reports_unknown_then_status_tells(
    reference: ReferenceStub,
) -> None:
    async with ReferenceAdapter(reference.url, timeouts=FAST) as adapter:
        await adapter.load(req("/w/step-1", "step-1", 1))
        reference.hang = True
        quick = ReferenceAdapter(reference.url, timeouts=Timeouts(load=0.3))
        with pytest.raises(EngineLoadError, match=r"no answer within 0\.3 s") as info:
            await quick.load(req("/w/step-2", "step-2", 2))
        await quick.aclose()
        assert info.value.serving == "unknown" and info.value.step == "load"
        assert await adapter.current() == ServedSnapshot("step-1", 1)


@pytest.mark.asyncio
async def test_reference_engine_down(unused_tcp_port: int) -> None:
    url = f"http://127.0.0.1:{unused_tcp_port}"
    async with ReferenceAdapter(url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError, match=r"reference engine at .*: load: POST") as info:
            await adapter.load(req("/w/step-1", "step-1", 1))
        assert isinstance(info.value.__cause__, EngineUnavailableError)
        with pytest.raises(EngineUnavailableError, match=url):
            await adapter.current()
        health = await adapter.health()
        assert not health.live and not health.ready and url in health.detail


@pytest.mark.asyncio
async def test_reference_answer_for_other_snapshot_is_not_confirmed(
    reference: ReferenceStub,
) -> None:
    async with ReferenceAdapter(reference.url, timeouts=FAST) as adapter:
        await adapter.load(req("/w/step-1", "step-1", 1))

        async def lying_status(request: web.Request) -> web.Response:
            return web.json_response({"identity": "step-0", "sequence": 0, "loading": False})

        reference.status = lying_status  # type: ignore[method-assign]
        await reference.runner.cleanup()  # type: ignore[union-attr]
        await start(reference, reference.routes())
        adapter2 = ReferenceAdapter(reference.url, timeouts=FAST)
        with pytest.raises(EngineLoadError, match="status shows 'step-0'") as info:
            await adapter2.load(req("/w/step-2", "step-2", 2))
        await adapter2.aclose()
        assert info.value.serving == "unknown" and info.value.step == "confirm"


# --- SGLang --------------------------------------------------------------------------------------

#: UpdateWeightFromDiskReqInput's documented fields and their JSON types.
SGLANG_UPDATE_FIELDS: dict[str, tuple[type, ...]] = {
    "model_path": (str,),
    "load_format": (str, type(None)),
    "abort_all_requests": (bool,),
    "weight_version": (str, type(None)),
    "is_async": (bool,),
    "torch_empty_cache": (bool,),
    "keep_pause": (bool,),
    "recapture_cuda_graph": (bool,),
    "token_step": (int,),
    "flush_cache": (bool,),
}


@dataclass
class SGLangStub(Stub):
    """SGLang's documented weight-update API: request validation, answers, weight version."""

    weight_version: str = "default"
    model_path: str = "/models/base"
    paused: bool = False
    fail_paths: set[str] = field(default_factory=set)
    healthy: bool = True
    loras: dict[str, str] = field(default_factory=dict)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/load_lora_adapter", self.load_lora),
            web.post("/unload_lora_adapter", self.unload_lora),
            web.get("/v1/models", self.models),
            web.post("/update_weights_from_disk", self.update),
            web.post("/pause_generation", self.pause),
            web.post("/continue_generation", self.resume),
            web.get("/get_weight_version", self.version),
            web.get("/health", self.health),
        ]

    async def update(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        self.record(request, body)
        # FastAPI validation errors: SGLang answers 400 (it overrides the default 422).
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return web.json_response({"object": "error", "message": "model_path"}, status=400)
        for name, value in body.items():
            if name not in SGLANG_UPDATE_FIELDS:
                return web.json_response({"message": f"unknown field {name}"}, status=400)
            if not isinstance(value, SGLANG_UPDATE_FIELDS[name]):
                return web.json_response({"message": f"bad type for {name}"}, status=400)
        if body["model_path"] in self.fail_paths:
            # SGLang reloads its previous weights and says so.
            return web.json_response(
                {
                    "success": False,
                    "message": "Failed to update weights: shape mismatch.\n"
                    "Rolling back to original weights.",
                    "num_paused_requests": 0,
                },
                status=400,
            )
        self.model_path = body["model_path"]
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {self.weight_version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def load_lora(self, request: web.Request) -> web.Response:
        # LoadLoRAAdapterReqInput -> LoRAUpdateOutput (sglang/srt/managers/io_struct.py).
        body = await body_of(request)
        self.record(request, body)
        name, path = (body or {}).get("lora_name"), (body or {}).get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return web.json_response({"message": "lora_name, lora_path"}, status=400)
        if name in self.loras:
            return web.json_response(
                {
                    "success": False,
                    "error_message": f"Failed to load LoRA adapter {name} because it is "
                    "already loaded",
                    "loaded_adapters": dict(self.loras),
                },
                status=400,
            )
        if path in self.fail_paths:
            return web.json_response(
                {"success": False, "error_message": "rank 64 exceeds --max-lora-rank 16"},
                status=400,
            )
        self.loras[name] = path
        return web.json_response(
            {"success": True, "error_message": None, "loaded_adapters": dict(self.loras)}
        )

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        self.record(request, body)
        name = (body or {}).get("lora_name")
        if name not in self.loras:
            return web.json_response(
                {
                    "success": False,
                    "error_message": f"LoRA with name {name} does not exist. Loaded LoRAs: "
                    f"{list(self.loras)}",
                },
                status=400,
            )
        del self.loras[name]
        return web.json_response({"success": True, "loaded_adapters": dict(self.loras)})

    async def models(self, request: web.Request) -> web.Response:
        self.record(request, None)
        data = [{"id": "base", "object": "model", "root": self.model_path, "parent": None}]
        data += [
            {"id": n, "object": "model", "root": p, "parent": "base"} for n, p in self.loras.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def pause(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        self.record(request, body)
        if (body or {}).get("mode", "abort") not in ("abort", "retract", "in_place"):
            return web.json_response({"message": "Invalid mode"}, status=400)
        self.paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.record(request, await body_of(request))
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        self.record(request, None)
        return web.json_response({"weight_version": self.weight_version})

    async def health(self, request: web.Request) -> web.Response:
        self.record(request, None)
        return web.Response(status=200 if self.healthy else 503)


@pytest_asyncio.fixture
async def sglang() -> AsyncIterator[SGLangStub]:
    stub = SGLangStub()
    await start(stub, stub.routes())
    try:
        yield stub
    finally:
        assert stub.runner is not None
        await stub.runner.cleanup()


def update_bodies(stub: Stub) -> list[dict[str, Any]]:
    return [b for m, p, b in stub.calls if p == "/update_weights_from_disk"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("mode", "policy", "in_flight", "pause_body", "flush", "abort"),
    [
        ("sync", "all", "wait", None, True, False),
        ("sync", "none", "wait", None, False, False),
        ("sync", "new_session", "wait", None, True, False),
        ("sync", "all", "abort", None, True, True),
        ("async", "all", "wait", {"mode": "retract"}, True, False),
        ("async", "new_session", "wait", {"mode": "retract"}, True, False),
        ("async", "none", "wait", {"mode": "in_place"}, False, False),
        ("async", "none", "abort", {"mode": "in_place"}, False, False),
    ],
)
async def test_sglang_request_per_mode_and_policy(
    *,
    sglang: SGLangStub,
    snap_b: Path,
    mode: str,
    policy: str,
    in_flight: str,
    pause_body: dict[str, str] | None,
    flush: bool,
    abort: bool,
) -> None:
    adapter = SGLangAdapter(sglang.url, timeouts=FAST, sync_in_flight=in_flight)  # type: ignore[arg-type]
    async with adapter:
        result = await adapter.load(req(snap_b, "step-b", 7, mode=mode, cache_policy=policy))
        assert result.served == ServedSnapshot("step-b", 7)
        assert result.cache_reset is flush
        assert update_bodies(sglang) == [
            {
                "model_path": str(snap_b),
                "weight_version": "step-b",
                "flush_cache": flush,
                "abort_all_requests": abort,
            }
        ]
        expected = ["POST /update_weights_from_disk"]
        if pause_body is not None:
            expected = ["POST /pause_generation", *expected, "POST /continue_generation"]
            assert sglang.calls[0][2] == pause_body
        assert sglang.posts() == expected
        assert not sglang.paused
        # Confirmation: the weight version names the identity, and /health generated a token.
        assert sglang.paths()[-2:] == ["GET /get_weight_version", "GET /health"]
        assert await adapter.current() == ServedSnapshot("step-b", 7)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_sglang_failed_update_keeps_old_snapshot_and_resumes(
    sglang: SGLangStub, snap_a: Path, snap_b: Path, mode: str
) -> None:
    async with SGLangAdapter(sglang.url, timeouts=FAST) as adapter:
        await adapter.load(req(snap_a, "step-a", 1))
        sglang.fail_paths.add(str(snap_b))
        with pytest.raises(EngineLoadError, match="Rolling back to original weights") as info:
            await adapter.load(req(snap_b, "step-b", 2, mode=mode))
        assert info.value.serving == "previous" and info.value.step == "update"
        assert info.value.status == 400 and sglang.url in str(info.value)
        assert not sglang.paused, "continue_generation must follow a failed ASYNC update"
        assert await adapter.current() == ServedSnapshot("step-a", 1)
        assert (await adapter.health()).ready


@pytest.mark.asyncio
async def test_sglang_unconfirmed_version_is_unknown(sglang: SGLangStub, snap_b: Path) -> None:
    async def stale(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "default"})

    sglang.version = stale  # type: ignore[method-assign]
    await sglang.runner.cleanup()  # type: ignore[union-attr]
    await start(sglang, sglang.routes())
    async with SGLangAdapter(sglang.url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError, match="weight_version is 'default'") as info:
            await adapter.load(req(snap_b, "step-b", 2))
        assert info.value.serving == "unknown" and info.value.step == "confirm"
        assert await adapter.current() is None
        assert not (await adapter.health()).ready


@pytest.mark.asyncio
async def test_sglang_refuses_a_missing_folder_without_calling(
    sglang: SGLangStub, tmp_path: Path
) -> None:
    async with SGLangAdapter(sglang.url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError, match="does not exist") as info:
            await adapter.load(req(tmp_path / "gone", "step-x", 3))
        assert info.value.serving == "previous" and info.value.step == "check"
        assert sglang.calls == []


@pytest.mark.asyncio
async def test_sglang_engine_down(unused_tcp_port: int, snap_b: Path) -> None:
    url = f"http://127.0.0.1:{unused_tcp_port}"
    async with SGLangAdapter(url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError, match=r"sglang engine at .*: update: POST"):
            await adapter.load(req(snap_b, "step-b", 2, mode="sync"))
        assert not (await adapter.health()).live


# --- vLLM call sequences (the real engine: test_engine_vllm.py) -----------------------------------


class FakeWorker(HotloadWorkerExtension):
    """One rank of vLLM running the real hotload worker extension over a toy tensor-parallel
    model (vLLM-style fused, sharded, padded and tied parameters). `answers` replaces this
    rank's answer to a method (a failure injected); its first `pending_polls` polls report the
    staging as still under way."""

    def __init__(self, rank: int, model: ToyTPModel, folder: Path) -> None:
        self.rank = rank
        self.model = model
        # What the extension reads of vLLM's model runner: the model and its start-up folder.
        self.model_runner = SimpleNamespace(
            get_model=lambda: model,
            vllm_config=SimpleNamespace(model_config=SimpleNamespace(model=str(folder))),
        )
        self.answers: dict[str, dict[str, Any]] = {}
        self.pending_polls = 0

    def call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """What this rank answers `collective_rpc` `method`."""
        if method in self.answers:
            return {"rank": self.rank, **self.answers[method]}
        if method == "hotload_poll" and self.pending_polls > 0:
            self.pending_polls -= 1
            return {"rank": self.rank, "served": "ready", "staging": "pending"}
        answer: dict[str, Any] = getattr(self, method)(*args, **kwargs)
        return answer

    def checksums(self) -> dict[str, str]:
        """sha256 of this rank's parameters, as held."""
        return parameter_checksums(dict(self.model.named_parameters()))

    def close(self) -> None:
        """Stop the extension's background thread, if it started one."""
        patcher = self.__dict__.get("_hotload_patcher")
        if patcher is not None:
            patcher.close()


def no_such_method(method: str) -> web.Response:
    """vLLM 0.32's answer to a collective_rpc method its workers lack (no extension loaded)."""
    return error(
        500,
        "InternalServerError",
        "Call to collective_rpc method failed: Worker failed with error "
        f"''CPUWorker' object has no attribute '{method}'', please check the stack trace above "
        "for the root cause",
    )


@dataclass
class VLLMStub(Stub):
    """vLLM 0.32's dev-mode endpoints as the adapter uses them; `on` injects failures (keyed by
    endpoint, `rpc` for reload_weights, or a collective_rpc method name; a hook answering None
    lets the call through). With `workers`, `/collective_rpc` runs the hotload extension's
    methods on every one of them and reload_weights loads their models; without, vLLM has no
    extension and answers its methods with an HTTP 500."""

    root: str = ""
    version: str = "default"
    paused: bool = False
    loaded: str = ""
    on: dict[str, Callable[[], web.Response | None]] = field(default_factory=dict)
    pause_delay: float = 0.0
    workers: list[FakeWorker] = field(default_factory=list)
    # What each rank's extension finds that a patch cannot follow (kernel_problems), by rank.
    kernel_problems: dict[int, list[str]] = field(default_factory=dict)
    # The extension's answers, in order: (method, one result per rank).
    answered: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    # Whether the last hotload_poll before the pause had every rank ready (None: no pause).
    ready_at_pause: bool | None = None
    describe_delay: float = 0.0
    # Seconds a completion takes, and what ended when: "completion" as one is answered,
    # "pause" as a pause arrives.
    completion_delay: float = 0.0
    ended: list[str] = field(default_factory=list)

    def methods(self) -> list[str]:
        """The collective_rpc methods called, in order."""
        return [b["method"] for m, p, b in self.calls if p == "/collective_rpc"]

    def trace(self) -> list[str]:
        """Every call as 'METHOD /path', collective_rpc calls as 'rpc <method>'."""
        return [
            f"rpc {b['method']}" if p == "/collective_rpc" else f"{m} {p}" for m, p, b in self.calls
        ]

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/weight_info", self.weight_info),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/is_paused", self.is_paused),
            web.post("/pause", self.pause),
            web.post("/resume", self.resume),
            web.post("/collective_rpc", self.rpc),
            web.post("/reset_prefix_cache", self.reset),
            web.post("/update_weight_version", self.set_version),
            web.post("/v1/completions", self.completions),
        ]

    async def _call(self, request: web.Request, name: str) -> tuple[Any, web.Response | None]:
        body = await body_of(request)
        self.record(request, body)
        hook = self.on.get(name)
        return body, (hook() if hook else None)

    async def weight_info(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "weight_info")
        return hooked or web.json_response({"weight_version": self.version})

    async def models(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "models")
        return hooked or web.json_response({"data": [{"id": "tiny", "root": self.root}]})

    async def health(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "health")
        return hooked or web.Response()

    async def is_paused(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "is_paused")
        return hooked or web.json_response({"is_paused": self.paused})

    async def pause(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "pause")
        self.ended.append("pause")
        polls = [results for method, results in self.answered if method == "hotload_poll"]
        self.ready_at_pause = bool(polls) and all(
            r.get("served") == "ready" and r.get("staging") == "ready" for r in polls[-1]
        )
        self.paused = True
        await asyncio.sleep(self.pause_delay)
        return hooked or web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "resume")
        if hooked:
            return hooked
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def rpc(self, request: web.Request) -> web.Response:
        body = await body_of(request)
        self.record(request, body)
        method = body["method"]
        hook = self.on.get("rpc" if method == "reload_weights" else method)
        hooked = hook() if hook else None
        if method != "reload_weights":
            return hooked or await self.extension(method, body)
        if hooked and body["kwargs"]["weights_path"] != self.root:
            return hooked
        self.loaded = body["kwargs"]["weights_path"]
        if self.workers:
            tensors = read_tensors(Path(self.loaded))
            for w in self.workers:
                w.model.load_weights(tensors.items())
                # vLLM's in-place reload points its model config at the folder it read.
                w.model_runner.vllm_config.model_config.model = self.loaded
        return web.json_response({"results": [None] * max(1, len(self.workers))})

    async def extension(self, method: str, body: dict[str, Any]) -> web.Response:
        if method == "hotload_describe":
            await asyncio.sleep(self.describe_delay)
        if not self.workers or not method.startswith("hotload_"):
            return no_such_method(method)
        args, kwargs = body.get("args", []), body.get("kwargs", {})
        results = [w.call(method, args, kwargs) for w in self.workers]
        self.answered.append((method, results))
        return web.json_response({"results": results})

    async def reset(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "reset")
        return hooked or web.json_response({"success": True})

    async def set_version(self, request: web.Request) -> web.Response:
        body, hooked = await self._call(request, "set_version")
        if hooked:
            return hooked
        self.version = body["new_version"]
        return web.json_response({"success": True, "new_version": self.version})

    async def completions(self, request: web.Request) -> web.Response:
        _, hooked = await self._call(request, "completions")
        await asyncio.sleep(self.completion_delay)
        self.ended.append("completion")
        return hooked or web.json_response({"choices": [{"text": "x", "index": 0}]})


@pytest_asyncio.fixture
async def vllm(snap_a: Path) -> AsyncIterator[VLLMStub]:
    stub = VLLMStub(root=str(snap_a))
    await start(stub, stub.routes())
    try:
        yield stub
    finally:
        assert stub.runner is not None
        await stub.runner.cleanup()


def crash() -> web.Response:
    return error(500, "InternalServerError", "Worker failed with error 'boom'")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("mode", "policy", "in_flight", "pause_mode", "reset"),
    [
        ("async", "all", "wait", "keep", True),
        ("async", "none", "wait", "keep", False),
        ("async", "new_session", "wait", "keep", True),
        ("sync", "all", "wait", "wait", True),
        ("sync", "none", "abort", "abort", False),
    ],
)
async def test_vllm_calls_per_mode_and_policy(
    *,
    vllm: VLLMStub,
    snap_b: Path,
    mode: str,
    policy: str,
    in_flight: str,
    pause_mode: str,
    reset: bool,
) -> None:
    adapter = VLLMAdapter(vllm.url, timeouts=FAST, sync_in_flight=in_flight)  # type: ignore[arg-type]
    async with adapter:
        result = await adapter.load(req(snap_b, "step-b", 2, mode=mode, cache_policy=policy))
        expected = [
            f"POST /pause?mode={pause_mode}&clear_cache=false",
            "POST /collective_rpc",
            *(["POST /reset_prefix_cache?reset_running_requests=true"] if reset else []),
            "POST /update_weight_version",
            "POST /resume",
            "POST /v1/completions",
            # Once confirmed, the hotload extension is told (this vLLM has none: a 500).
            "POST /collective_rpc",
        ]
        assert vllm.posts() == expected
        rpc = next(b for m, p, b in vllm.calls if p == "/collective_rpc")
        assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(snap_b)}}
        assert vllm.methods() == ["reload_weights", "hotload_weights_changed"]
        assert result.served == ServedSnapshot("step-b", 2) and result.cache_reset is reset
        assert vllm.version == "step-b" and not vllm.paused
        assert await adapter.current() == ServedSnapshot("step-b", 2)
        # A sidecar restarted: the identity is known from the engine, the sequence is not.
        async with VLLMAdapter(vllm.url, timeouts=FAST) as fresh:
            assert await fresh.current() == ServedSnapshot("step-b", None)


@pytest.mark.asyncio
@pytest.mark.parametrize("failing", ["rpc", "reset", "set_version"])
async def test_vllm_failure_after_pause_rolls_back_and_resumes(
    vllm: VLLMStub, snap_a: Path, snap_b: Path, failing: str
) -> None:
    vllm.on[failing] = crash
    async with VLLMAdapter(vllm.url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError, match="Worker failed with error 'boom'") as info:
            await adapter.load(req(snap_b, "step-b", 2))
        assert info.value.serving == "previous"
        # The start-up folder (from /v1/models) was loaded back before resuming.
        assert vllm.loaded == str(snap_a) and not vllm.paused
        posts = vllm.posts()
        assert posts[-2:] == ["POST /resume", "POST /v1/completions"]
        # The failed write, the reload back, and the (absent) extension told of it.
        assert vllm.methods() == ["reload_weights", "reload_weights", "hotload_weights_changed"]
        assert await adapter.current() is None  # still the start-up weights
        assert (await adapter.health()).ready


@pytest.mark.asyncio
async def test_vllm_pause_timeout_still_resumes(vllm: VLLMStub, snap_b: Path) -> None:
    vllm.pause_delay = 0.6
    slow = Timeouts(request=0.3, drain=0.3, load=2.0, probe=2.0)
    async with VLLMAdapter(vllm.url, timeouts=slow) as adapter:
        with pytest.raises(EngineLoadError, match=r"pause: POST /pause got no answer") as info:
            await adapter.load(req(snap_b, "step-b", 2, mode="sync"))
        assert info.value.serving == "previous"
        assert "POST /resume" in vllm.posts() and "POST /collective_rpc" not in vllm.posts()


@pytest.mark.asyncio
async def test_vllm_unrecoverable_failure_is_unknown(vllm: VLLMStub, snap_b: Path) -> None:
    vllm.on["rpc"] = crash
    vllm.on["completions"] = crash
    async with VLLMAdapter(vllm.url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError) as info:
            await adapter.load(req(snap_b, "step-b", 2))
        assert info.value.serving == "unknown"
        assert await adapter.current() is None
        health = await adapter.health()
        assert health.live and not health.ready and "does not generate" in health.detail


@pytest.mark.asyncio
async def test_vllm_refuses_a_mismatched_snapshot_before_pausing(
    vllm: VLLMStub, tmp_path: Path
) -> None:
    other = weights(3)
    other["model.embed_tokens.weight"] = other["model.embed_tokens.weight"][:50].copy()
    wrong = full(tmp_path / "step-w", other)
    async with VLLMAdapter(vllm.url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError, match="refused before pausing") as info:
            await adapter.load(req(wrong, "step-w", 3))
        assert info.value.serving == "previous" and info.value.step == "check"
        assert vllm.posts() == []


@pytest.mark.asyncio
async def test_vllm_engine_down(unused_tcp_port: int, snap_b: Path) -> None:
    url = f"http://127.0.0.1:{unused_tcp_port}"
    async with VLLMAdapter(url, timeouts=FAST) as adapter:
        with pytest.raises(EngineLoadError, match=r"vllm engine at .*: prepare: GET /weight_info"):
            await adapter.load(req(snap_b, "step-b", 2))
        with pytest.raises(EngineUnavailableError):
            await adapter.current()
        assert not (await adapter.health()).live


@pytest.mark.asyncio
async def test_vllm_rollback_target_after_a_sidecar_restart(
    vllm: VLLMStub, tmp_path: Path, snap_b: Path
) -> None:
    # The engine serves step-b (loaded by an earlier sidecar); the stub fails any other reload.
    vllm.version, vllm.root = "step-b", str(snap_b)
    vllm.on["rpc"] = crash
    snap_c = full(tmp_path / "step-c", weights(3))
    async with VLLMAdapter(vllm.url, timeouts=FAST) as adapter:
        assert await adapter.current() == ServedSnapshot("step-b", None)
        with pytest.raises(EngineLoadError) as info:
            await adapter.load(req(snap_c, "step-c", 3))
        # Not knowing step-b's folder, the adapter cannot roll back: state unknown.
        assert info.value.serving == "unknown"
    vllm.calls.clear()
    async with VLLMAdapter(vllm.url, timeouts=FAST) as adapter:
        adapter.adopt(ServedSnapshot("step-b", 2), str(snap_b))
        with pytest.raises(EngineLoadError) as info:
            await adapter.load(req(snap_c, "step-c", 3))
        assert info.value.serving == "previous"
        assert vllm.loaded == str(snap_b)
        assert await adapter.current() == ServedSnapshot("step-b", 2)


@pytest.mark.asyncio
async def test_sglang_lora_adapters_follow_its_documented_api(sglang: SGLangStub) -> None:
    """SGLang's runtime LoRA routes (no /v1 prefix), `{"success": ...}` answers; an adapter
    already loaded or already gone is the state asked for; a refusal names the engine's reason."""
    async with SGLangAdapter(sglang.url) as adapter:
        assert await adapter.loaded_adapters() == set()
        await adapter.load_adapter("lora-1", "/w/adapters/lora-1")
        await adapter.load_adapter("lora-1", "/w/adapters/lora-1")  # idempotent
        assert await adapter.loaded_adapters() == {"lora-1"}
        sglang.fail_paths.add("/w/adapters/big")
        with pytest.raises(EngineLoadError, match="exceeds --max-lora-rank"):
            await adapter.load_adapter("big", "/w/adapters/big")
        await adapter.unload_adapter("lora-1")
        await adapter.unload_adapter("lora-1")  # already gone
        assert await adapter.loaded_adapters() == set()
    bodies = [(p, b) for m, p, b in sglang.calls if m == "POST"]
    assert bodies[0] == (
        "/load_lora_adapter",
        {"lora_name": "lora-1", "lora_path": "/w/adapters/lora-1"},
    )
    assert bodies[-1] == ("/unload_lora_adapter", {"lora_name": "lora-1"})


# --- vLLM sparse patches through the hotload worker extension (real vLLM: test_engine_vllm_patch)

TOY = ToyConfig()
#: What rank 1's extension answers when its loader puts a tensor where no patch can follow it.
UNMAPPABLE = {
    "reason": "unmappable",
    "message": "tensor 'model.layers.0.mlp.down_proj.weight': its loader writes values computed "
    "from the checkpoint into model.layers.0.mlp.down_proj.weight",
    "tensor": "model.layers.0.mlp.down_proj.weight",
}
WRITE_FAILED = {
    "reason": "write_failed",
    "message": "writing the patch failed in model.layers.1.mlp.gate_up_proj.weight: "
    "RuntimeError: boom",
    "tensor": None,
}


@dataclass(frozen=True)
class PatchChain:
    """Full snapshots `step-0` and `step-1` of the toy model (one training step moving 5% of
    every tensor by one ulp) and the patch file from the first to the second."""

    parent: Path
    child: Path
    patch: Path


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> PatchChain:
    root = tmp_path_factory.mktemp("vllm-patch")
    base = write_snapshot(
        root / "base", checkpoint_weights(TOY), config=CONFIG, overwrite=True
    ).path
    fulls, deltas = sparse_steps(base, root, 1, fraction=0.05)
    patch = root / "step-1.patch"
    prepare_patch(fulls[0], deltas[1], patch)
    return PatchChain(fulls[0], fulls[1], patch)


MakeStub = Callable[[int], Awaitable[VLLMStub]]


@pytest_asyncio.fixture
async def patching(chain: PatchChain, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MakeStub]:
    """Makes a vLLM stub serving `step-0` on `world` ranks, each running the real extension."""
    made: list[VLLMStub] = []

    def problems(model: torch.nn.Module) -> list[str]:
        # Without vLLM the extension cannot inspect its layers: the stub says what it finds.
        return list(made[-1].kernel_problems.get(getattr(model, "rank", 0), []))

    monkeypatch.setattr(vllm_extension, "kernel_problems", problems)

    async def make(world: int) -> VLLMStub:
        models = load_ranks(chain.parent, TOY, world, torch.float32)
        stub = VLLMStub(
            root=str(chain.parent),
            version="step-0",
            workers=[FakeWorker(r, m, chain.parent) for r, m in enumerate(models)],
        )
        made.append(stub)
        await start(stub, stub.routes())
        return stub

    try:
        yield make
    finally:
        for stub in made:
            for w in stub.workers:
                w.close()
            if stub.runner is not None:
                await stub.runner.cleanup()


def patch_req(chain: PatchChain, **kw: Any) -> LoadRequest:
    return req(chain.patch, "step-1", 1, **kw)


def held(folder: Path, world: int) -> list[dict[str, str]]:
    """sha256 of every parameter of every rank after a full load of `folder`."""
    return [
        parameter_checksums(dict(m.named_parameters()))
        for m in load_ranks(folder, TOY, world, torch.float32)
    ]


def rpc_body(stub: VLLMStub, method: str) -> Any:
    return next(b for _, p, b in stub.calls if p == "/collective_rpc" and b["method"] == method)


def answers(stub: VLLMStub, method: str) -> list[dict[str, Any]]:
    return next(results for m, results in stub.answered if m == method)


def after_pause(stub: VLLMStub) -> list[str]:
    trace = stub.trace()
    return trace[next(i for i, t in enumerate(trace) if t.startswith("POST /pause")) :]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("world", "mode", "policy", "pause_mode", "reset"),
    [
        (1, "async", "all", "keep", True),
        (2, "sync", "none", "wait", False),
        (2, "async", "new_session", "keep", True),
    ],
)
async def test_vllm_patch_stages_on_every_rank_then_pauses_writes_and_confirms(
    *,
    patching: MakeStub,
    chain: PatchChain,
    world: int,
    mode: str,
    policy: str,
    pause_mode: str,
    reset: bool,
) -> None:
    vllm = await patching(world)
    vllm.workers[-1].pending_polls = 2  # the last rank is still staging twice
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        result = await adapter.patch(
            patch_req(chain, mode=mode, cache_policy=policy), "step-0", folder=str(chain.child)
        )
        polls = vllm.methods().count("hotload_poll")
        assert polls >= 3
        assert vllm.trace() == [
            "GET /weight_info",
            "GET /v1/models",
            "rpc hotload_describe",
            "rpc hotload_stage",
            *["rpc hotload_poll"] * polls,
            f"POST /pause?mode={pause_mode}&clear_cache=false",
            "rpc hotload_apply",
            *(["POST /reset_prefix_cache?reset_running_requests=true"] if reset else []),
            "POST /update_weight_version",
            "POST /resume",
            "GET /health",
            "GET /weight_info",
        ]
        assert vllm.ready_at_pause is True, "paused before every rank had staged"
        assert rpc_body(vllm, "hotload_stage") == {
            "method": "hotload_stage",
            "args": [str(chain.patch), "step-1", "step-0"],
            "kwargs": {},
        }
        assert rpc_body(vllm, "hotload_describe") == {
            "method": "hotload_describe",
            "args": [],
            "kwargs": {},
        }
        assert [a["rank"] for a in answers(vllm, "hotload_apply")] == list(range(world))
        assert list(result.steps) == [
            "version",
            "models",
            "describe",
            "stage",
            "verify",
            "pause",
            "apply",
            *(["reset_prefix_cache"] if reset else []),
            "set_version",
            "resume",
            "confirm",
        ]
        assert result.served == ServedSnapshot("step-1", 1) and result.cache_reset is reset
        assert 0 < result.pause_seconds < result.load_seconds
        assert vllm.version == "step-1" and not vllm.paused
        assert await adapter.current() == ServedSnapshot("step-1", 1)
        # Every rank holds what a full load of step-1 gives, bit for bit.
        child = held(chain.child, world)
        assert [w.checksums() for w in vllm.workers] == child
        expected = {
            (f"rank{r}/" if r else "") + name: digest
            for r, sums in enumerate(child)
            for name, digest in sums.items()
        }
        assert await adapter.parameter_checksums() == expected
        # Every rank counted what it wrote; the adapter sums them. Nothing was re-read for the
        # served checksums after the patch: they were derived from it.
        report = await adapter.weights_report()
        assert report is not None and report.mismatch is None
        applied = answers(vllm, "hotload_apply")
        assert report.counters["patched_elements"] == sum(a["changed"] for a in applied) > 0
        assert report.counters["patches"] == world
        one_read = 0
        for w in vllm.workers:
            meter = Meter(Counters())
            served_sums(w._hotload().host, checkpoint_specs(chain.parent), meter)
            assert meter.counters is not None
            one_read += meter.counters.checksum_bytes
        assert report.counters["checksum_bytes"] == one_read  # the read at adoption, no other
        # The forward pass it was confirmed without: the probe the loader runs after reporting.
        assert adapter.deferred_probe
        calls = len(vllm.calls)
        await adapter.probe("step-1")
        assert vllm.trace()[calls:] == ["POST /v1/completions"]


@pytest.mark.asyncio
async def test_vllm_failed_probe_after_a_patch_refuses_patches_until_a_full_load(
    patching: MakeStub, chain: PatchChain
) -> None:
    """The probe fails in vLLM's words; no patch goes on top of weights that failed it, and a
    full load (confirmed with its own completion) lifts that."""
    vllm = await patching(1)
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        await adapter.patch(patch_req(chain), "step-0", folder=str(chain.child))
        vllm.on["completions"] = crash
        with pytest.raises(EngineError, match="Worker failed with error 'boom'") as info:
            await adapter.probe("step-1")
        assert info.value.step == "probe"
        with pytest.raises(PatchRefusedError) as refused:
            await adapter.patch(req(chain.patch, "step-2", 2), "step-1")
        assert refused.value.reason == "probe_failed" and "boom" in str(refused.value)
        assert vllm.trace()[-1] == "POST /v1/completions"  # refused before any engine call
        del vllm.on["completions"]
        loaded = await adapter.load(req(chain.child, "step-1", 3))
        assert "confirm" in loaded.steps and vllm.trace()[-2] == "POST /v1/completions"
        # Patches are taken again (this one is refused for its parent, not for the probe).
        with pytest.raises(PatchRefusedError) as refused:
            await adapter.patch(req(chain.patch, "step-2", 4), "step-0")
        assert refused.value.reason == "parent_not_served"


@pytest.mark.asyncio
async def test_vllm_load_waits_for_a_probe_under_way_before_pausing(
    patching: MakeStub, chain: PatchChain
) -> None:
    """A probe answers for the weights it was run for: the next load pauses only once it
    ended (the adapter's lock), never under it."""
    vllm = await patching(1)
    vllm.completion_delay = 0.5
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        await adapter.patch(patch_req(chain), "step-0", folder=str(chain.child))
        vllm.ended.clear()
        probing = asyncio.create_task(adapter.probe("step-1"))
        await asyncio.sleep(0.1)  # the probe's completion is under way
        await adapter.load(req(chain.parent, "step-0", 2))
        await probing
    assert vllm.ended[:3] == ["completion", "pause", "completion"], vllm.ended


@pytest.mark.asyncio
async def test_vllm_patch_step_times_are_each_steps_own(
    patching: MakeStub, chain: PatchChain
) -> None:
    """`LoadResult.steps` times each call: disjoint intervals within the whole load."""
    vllm = await patching(1)
    vllm.describe_delay = 0.3
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        result = await adapter.patch(patch_req(chain), "step-0")
    assert result.steps["describe"] >= 0.29
    assert result.steps["stage"] < result.steps["describe"], result.steps
    # (1 ms for the rounding of each step to the microsecond)
    assert sum(result.steps.values()) <= result.load_seconds + 0.001, result.steps


@pytest.mark.asyncio
async def test_vllm_without_the_extension_refuses_patches_and_is_not_asked_again(
    vllm: VLLMStub, snap_a: Path, snap_b: Path, tmp_path: Path
) -> None:
    vllm.version = "step-0"
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        with pytest.raises(PatchRefusedError) as info:
            await adapter.check_sparse()
        err = info.value
        assert err.reason == "engine_unsupported" and err.serving == "previous"
        assert "--worker-extension-cls hotload_patch.vllm.HotloadWorkerExtension" in str(err)
        assert "has no attribute 'hotload_describe'" in str(err)
        with pytest.raises(PatchRefusedError) as info:
            await adapter.patch(req(tmp_path / "step-1.patch", "step-1", 1), "step-0")
        assert info.value.reason == "engine_unsupported"
        assert vllm.posts() == ["POST /collective_rpc"] * 2 and not vllm.paused
        assert vllm.methods() == ["hotload_describe"] * 2
        # A full load still works, and does not tell an extension it knows is not there.
        result = await adapter.load(req(snap_b, "step-b", 2))
        assert result.served == ServedSnapshot("step-b", 2)
    assert vllm.methods() == ["hotload_describe", "hotload_describe", "reload_weights"]
    # An adapter that never asked tries once; the 500 tells it, and it does not try again.
    vllm.calls.clear()
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        adapter.adopt(ServedSnapshot("step-b", 2), str(snap_b))
        await adapter.load(req(snap_a, "step-a", 3))
        await adapter.load(req(snap_b, "step-b", 4))
    assert vllm.methods() == ["reload_weights", "hotload_weights_changed", "reload_weights"]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["kernel_format", "stale_protocol"])
async def test_vllm_extension_that_cannot_patch_is_refused_at_describe(
    patching: MakeStub, chain: PatchChain, case: str
) -> None:
    vllm = await patching(2)
    if case == "kernel_format":
        problem = "quantised weights (Fp8LinearMethod): 4 layer(s), e.g. model.layers.0.qkv_proj"
        vllm.kernel_problems[1] = [problem]
        reason, says = "kernel_format", f"rank 1: {problem}"
    else:
        vllm.workers[1].answers["hotload_describe"] = {"protocol": PROTOCOL + 1, "problems": []}
        reason, says = "engine_unsupported", f"rank 1 runs hotload_patch protocol {PROTOCOL + 1}"
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        with pytest.raises(PatchRefusedError) as info:
            await adapter.check_sparse()
        assert info.value.reason == reason and says in str(info.value)
        if case == "stale_protocol":
            assert "stale" in str(info.value)
        with pytest.raises(PatchRefusedError) as info:
            await adapter.patch(patch_req(chain), "step-0")
        assert info.value.reason == reason
    assert vllm.methods() == ["hotload_describe"] * 2
    assert vllm.posts() == ["POST /collective_rpc"] * 2 and vllm.ready_at_pause is None
    assert [a["rank"] for a in answers(vllm, "hotload_describe")] == [0, 1]


@pytest.mark.asyncio
async def test_vllm_patch_of_a_parent_not_served_calls_nothing(
    patching: MakeStub, chain: PatchChain
) -> None:
    vllm = await patching(1)
    vllm.version = "step-7"
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        with pytest.raises(PatchRefusedError, match="vLLM serves 'step-7'") as info:
            await adapter.patch(patch_req(chain), "step-0")
        assert info.value.reason == "parent_not_served"
    assert vllm.trace() == ["GET /weight_info", "GET /v1/models"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "answer"),
    [
        ("hotload_poll", {"served": "ready", "staging": "failed", "error": UNMAPPABLE}),
        ("hotload_stage", {"error": UNMAPPABLE}),
    ],
)
async def test_vllm_staging_refused_on_one_rank_discards_and_never_pauses(
    patching: MakeStub, chain: PatchChain, method: str, answer: dict[str, Any]
) -> None:
    vllm = await patching(2)
    vllm.workers[1].answers[method] = answer
    parent = [w.checksums() for w in vllm.workers]
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        with pytest.raises(PatchRefusedError) as info:
            await adapter.patch(patch_req(chain), "step-0")
        err = info.value
        assert err.reason == "unmappable" and err.serving == "previous"
        assert "staging refused on rank 1" in str(err) and "down_proj" in str(err)
        methods = vllm.methods()
        assert methods[:2] == ["hotload_describe", "hotload_stage"]
        assert methods[-1] == "hotload_discard" and "hotload_apply" not in methods
        assert vllm.posts() == ["POST /collective_rpc"] * len(methods)
        assert vllm.ready_at_pause is None and vllm.version == "step-0"
        # Rank 0 staged its part; the discard dropped it.
        assert vllm.workers[0].hotload_poll()["staging"] == "none"
        assert [w.checksums() for w in vllm.workers] == parent
        assert await adapter.current() == ServedSnapshot("step-0", None)


def bump_first_delta(answer: dict[str, Any]) -> None:
    """Make a rank's first sum change say something the patch does not do."""
    if answer.get("deltas"):
        answer["deltas"][0]["a"] = (answer["deltas"][0]["a"] + 1) % 65521


@pytest.mark.asyncio
@pytest.mark.parametrize(("world", "fault"), [(1, "weights"), (2, "weights"), (2, "deltas")])
async def test_vllm_patch_failing_verification_over_all_ranks_is_refused(
    patching: MakeStub, chain: PatchChain, world: int, fault: str
) -> None:
    vllm = await patching(world)
    last = vllm.workers[-1]
    if fault == "weights":
        # The last rank does not hold the parent: its own staging cannot tell, the sums can.
        param = dict(last.model.named_parameters())["model.layers.0.mlp.gate_up_proj.weight"]
        with torch.no_grad():
            param.view(-1)[5] += 1.0
        reason = "parent_mismatch"
    else:
        real = last.call

        def tampered(method: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
            out = real(method, args, kwargs)
            if method == "hotload_poll":
                bump_first_delta(out)
            return out

        last.call = tampered  # type: ignore[method-assign]
        reason = "checksum_mismatch"
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        with pytest.raises(PatchRefusedError, match="verifying the patch over all ranks") as info:
            await adapter.patch(patch_req(chain), "step-0")
        assert info.value.reason == reason
    assert all(r["staging"] == "ready" for r in vllm.answered[-2][1])  # every rank staged
    methods = vllm.methods()
    assert methods[-1] == "hotload_discard" and "hotload_apply" not in methods
    assert vllm.ready_at_pause is None and vllm.version == "step-0"


@pytest.mark.asyncio
async def test_vllm_patch_failing_on_one_rank_after_the_pause_rolls_back_every_rank(
    patching: MakeStub, chain: PatchChain
) -> None:
    vllm = await patching(2)
    parent = [w.checksums() for w in vllm.workers]
    vllm.workers[1].answers["hotload_apply"] = {"error": WRITE_FAILED}
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        adapter.adopt(ServedSnapshot("step-0", 0), str(chain.parent))
        with pytest.raises(EngineLoadError, match="boom") as info:
            await adapter.patch(patch_req(chain), "step-0", folder=str(chain.child))
        err = info.value
        assert err.serving == "previous" and "rank 1" in str(err)
        assert after_pause(vllm) == [
            "POST /pause?mode=keep&clear_cache=false",
            "rpc hotload_apply",
            "rpc hotload_rollback",
            "POST /update_weight_version",
            "POST /resume",
            "POST /v1/completions",
        ]
        assert vllm.calls[-3][2] == {"new_version": "step-0"}
        # Rank 0 wrote and put its old values back; rank 1 had written nothing.
        assert [r["rolled_back"] for r in answers(vllm, "hotload_rollback")] == [True, False]
        assert [w.checksums() for w in vllm.workers] == parent
        assert vllm.version == "step-0" and not vllm.paused
        assert await adapter.current() == ServedSnapshot("step-0", 0)
        assert (await adapter.health()).ready
        # The engine was paused and written to: a failed load, not a refusal before changing
        # anything (the loader counts those apart and trusts `serving` only on this error).
        assert not isinstance(err, PatchRefusedError), f"{type(err).__name__}: {err}"
        assert err.step == "apply"


@pytest.mark.asyncio
async def test_vllm_patch_whose_rollback_fails_on_a_rank_is_unknown(
    patching: MakeStub, chain: PatchChain
) -> None:
    """A rank that cannot put its old values back answers an error (the extension never
    raises): the weights are not known, whatever the other ranks did."""
    vllm = await patching(2)
    vllm.workers[1].answers["hotload_apply"] = {"error": WRITE_FAILED}
    vllm.workers[0].answers["hotload_rollback"] = {
        "error": {
            "reason": "write_failed",
            "message": "the old values of model.layers.0.mlp.gate_up_proj.weight could not be "
            "put back: the engine's weights are not known; load a full snapshot",
            "tensor": None,
        }
    }
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        adapter.adopt(ServedSnapshot("step-0", 0), str(chain.parent))
        with pytest.raises(EngineLoadError) as info:
            await adapter.patch(patch_req(chain), "step-0", folder=str(chain.child))
        assert vllm.methods()[-2:] == ["hotload_apply", "hotload_rollback"]
        assert not vllm.paused  # resumed all the same
        assert info.value.serving == "unknown"
        assert await adapter.current() is None
        assert not (await adapter.health()).ready


@pytest.mark.asyncio
async def test_vllm_patch_whose_version_fails_rolls_back_version_and_weights(
    patching: MakeStub, chain: PatchChain
) -> None:
    vllm = await patching(2)
    parent = [w.checksums() for w in vllm.workers]
    answered: list[bool] = []

    def set_then_fail() -> web.Response | None:
        if answered:
            return None
        answered.append(True)
        vllm.version = "step-1"  # it took the version, then its answer failed
        return crash()

    vllm.on["set_version"] = set_then_fail
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        with pytest.raises(EngineLoadError, match="boom") as info:
            await adapter.patch(patch_req(chain), "step-0", folder=str(chain.child))
        assert info.value.serving == "previous" and info.value.step == "set_version"
        assert not isinstance(info.value, PatchRefusedError)
        assert after_pause(vllm) == [
            "POST /pause?mode=keep&clear_cache=false",
            "rpc hotload_apply",
            "POST /reset_prefix_cache?reset_running_requests=true",
            "POST /update_weight_version",
            "rpc hotload_rollback",
            "POST /update_weight_version",
            "POST /resume",
            "POST /v1/completions",
        ]
        assert [r["rolled_back"] for r in answers(vllm, "hotload_rollback")] == [True, True]
        assert [w.checksums() for w in vllm.workers] == parent
        assert vllm.version == "step-0" and not vllm.paused
        assert await adapter.current() == ServedSnapshot("step-0", None)


@pytest.mark.asyncio
async def test_vllm_full_load_tells_the_extension(patching: MakeStub, chain: PatchChain) -> None:
    vllm = await patching(2)
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        await adapter.check_sparse()
        result = await adapter.load(req(chain.child, "step-1", 1))
        assert result.served == ServedSnapshot("step-1", 1)
        assert vllm.methods() == ["hotload_describe", "reload_weights", "hotload_weights_changed"]
        assert rpc_body(vllm, "hotload_weights_changed") == {
            "method": "hotload_weights_changed",
            "args": [],
            "kwargs": {"folder": str(chain.child)},
        }
        assert answers(vllm, "hotload_weights_changed") == [{"rank": 0}, {"rank": 1}]
        # Told after the load's confirmation, not while paused.
        assert vllm.trace()[-2:] == ["POST /v1/completions", "rpc hotload_weights_changed"]
        assert [w.checksums() for w in vllm.workers] == held(chain.child, 2)
    # An adapter that has not asked yet tells it too (the extension answers: it is there).
    vllm.calls.clear()
    adapter = VLLMAdapter(vllm.url, timeouts=FAST)
    async with adapter:
        await adapter.load(req(chain.parent, "step-0", 2))
        assert vllm.methods() == ["reload_weights", "hotload_weights_changed"]
        assert rpc_body(vllm, "hotload_weights_changed")["kwargs"] == {"folder": str(chain.parent)}
        # The extension's checksums follow the reloads: the patch of step-0 verifies.
        result = await adapter.patch(patch_req(chain), "step-0")
        assert result.served == ServedSnapshot("step-1", 1)
    assert [w.checksums() for w in vllm.workers] == held(chain.child, 2)


@pytest.mark.asyncio
async def test_sglang_refuses_sparse_patches_before_anything_is_fetched(snap_b: Path) -> None:
    """SGLang cannot take patches (docs/engines.md, "SGLang: full reloads"): the adapter says
    so without calling the engine, and the loader loads in full."""
    async with SGLangAdapter("http://127.0.0.1:9", timeouts=FAST) as adapter:
        for call in (adapter.check_sparse(), adapter.patch(req(snap_b, "step-b", 2), "step-a")):
            with pytest.raises(PatchRefusedError) as refused:
                await call
            assert refused.value.reason == "engine_unsupported"
            assert "whole tensors" in str(refused.value)
