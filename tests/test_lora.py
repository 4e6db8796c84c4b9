"""LoRA adapters end to end: the reference engine serving several adapters per request, the
loader keeping the newest adapters of a ledger loaded, and the operator's admission and
roll-up of adapter snapshots."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from support.engines import serve_engines
from support.tiny_llm import TinyLLM, build_tiny_llm, lora_prompt_logprobs, tiny_adapter

PROMPT = "the chef cooked the old boat and then"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """A tiny Llama (s0) and one training step of it (s1)."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-lora"), 1)


@pytest.fixture(scope="module")
def adapters(tiny: TinyLLM, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three adapters of the tiny Llama (different seeds)."""
    root = tmp_path_factory.mktemp("adapters")
    return [tiny_adapter(root / f"lora-{i}", tiny.config, seed=i) for i in range(3)]


async def complete(client: TestClient[Any, Any], model: str | None, **extra: Any) -> Any:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 12, "return_token_ids": True, **extra}
    if model is not None:
        body["model"] = model
    resp = await client.post("/v1/completions", json=body)
    return resp.status, await resp.json()


async def load(client: TestClient[Any, Any], name: str, path: Path) -> tuple[int, str]:
    resp = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
    )
    return resp.status, await resp.text()


@pytest.mark.asyncio
async def test_engine_serves_adapters_per_request_without_touching_the_base(
    tiny: TinyLLM, adapters: list[Path]
) -> None:
    a0, a1, _ = adapters
    async with serve_engines((tiny.snapshots[0], "s0")) as [client]:
        status, before = await complete(client, None)
        assert status == 200
        assert await load(client, "lora-0", a0) == (
            200,
            "Success: LoRA adapter 'lora-0' added successfully.",
        )
        assert (await load(client, "lora-1", a1))[0] == 200
        models = (await (await client.get("/v1/models")).json())["data"]
        assert [m["id"] for m in models] == ["policy@s0", "lora-0", "lora-1"]
        assert models[1]["parent"] == "policy@s0" and "parent" not in models[0]

        # The base is bit for bit what it was; each adapter answers differently, named as such.
        _, base = await complete(client, "policy")
        _, with0 = await complete(client, "lora-0")
        _, with1 = await complete(client, "lora-1@s0")  # an adapter with a snapshot constraint
        tokens = [r["choices"][0]["token_ids"] for r in (before, base, with0, with1)]
        assert tokens[0] == tokens[1]
        assert len({tuple(t) for t in tokens[1:]}) == 3
        assert with0["model"] == "lora-0@s0" and base["model"] == "policy@s0"

        # The adapter's numbers are transformers' with PEFT's unmerged LoRA, to float rounding.
        _, scored = await complete(client, "lora-0", prompt_logprobs=0, max_tokens=1)
        choice = scored["choices"][0]
        ids = choice["prompt_token_ids"]
        got = [
            entry[str(ids[i])]["logprob"] for i, entry in enumerate(choice["prompt_logprobs"]) if i
        ]
        want = lora_prompt_logprobs(tiny.snapshots[0], a0, ids)
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 2e-4
        base_want = lora_prompt_logprobs(tiny.snapshots[0], None, ids)
        assert max(abs(g - w) for g, w in zip(got, base_want, strict=True)) > 1e-2

        # In one batch, each request gets what it gets alone.
        together = await asyncio.gather(
            *(complete(client, m) for m in ("lora-0", "policy", "lora-1", "lora-0"))
        )
        assert [r["choices"][0]["token_ids"] for _, r in together] == [
            with0["choices"][0]["token_ids"],
            base["choices"][0]["token_ids"],
            with1["choices"][0]["token_ids"],
            with0["choices"][0]["token_ids"],
        ]

        # Unloaded: a 404 that lists what is served; the others keep working.
        resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-1"})
        assert resp.status == 200
        status, missing = await complete(client, "lora-1")
        assert status == 404 and "lora-0" in missing["error"]["message"]
        assert (await complete(client, "lora-0"))[1]["choices"][0]["token_ids"] == tokens[2]
        resp = await client.post("/v1/unload_lora_adapter", json={"lora_name": "lora-1"})
        assert resp.status == 404


@pytest.mark.asyncio
async def test_adapters_stay_loaded_across_a_base_hot_load(
    tiny: TinyLLM, adapters: list[Path]
) -> None:
    async with serve_engines((tiny.snapshots[0], "s0")) as [client]:
        assert (await load(client, "lora-2", adapters[2]))[0] == 200
        resp = await client.post(
            "/hotload/v1/load",
            json={"path": str(tiny.snapshots[1]), "identity": "s1", "sequence": 1},
        )
        assert resp.status == 200, await resp.text()
        _, scored = await complete(client, "lora-2", prompt_logprobs=0, max_tokens=1)
        assert scored["model"] == "lora-2@s1"
        choice = scored["choices"][0]
        ids = choice["prompt_token_ids"]
        got = [e[str(ids[i])]["logprob"] for i, e in enumerate(choice["prompt_logprobs"]) if i]
        want = lora_prompt_logprobs(tiny.snapshots[1], adapters[2], ids)
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 2e-4
        status = await (await client.get("/hotload/v1/status")).json()
        assert status["adapters"] == ["lora-2"] and status["identity"] == "s1"


@pytest.mark.asyncio
async def test_bad_adapters_are_refused_and_nothing_changes(
    tiny: TinyLLM, adapters: list[Path], tmp_path: Path
) -> None:
    from hotload.snapshot.lora import read_adapter_tensors, write_adapter

    corrupt = Path(shutil.copytree(adapters[0], tmp_path / "corrupt"))
    w = corrupt / "adapter_model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x20
    w.unlink()
    w.write_bytes(bytes(data))
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    tensors = {
        n: r.data.view("float32").reshape(r.shape)
        for n, r in read_adapter_tensors(adapters[0]).items()
    }
    wide = dict(tensors)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wide[name] = wide[name][:, :-1]  # one input column short
    wrong_shape = write_adapter(tmp_path / "wrong-shape", wide, config)
    stray = {k.replace("layers.0", "layers.9"): v for k, v in tensors.items() if "layers.0" in k}
    no_module = write_adapter(tmp_path / "no-module", stray, config)
    async with serve_engines((tiny.snapshots[0], "s0"), max_adapters=2) as [client]:
        _, before = await complete(client, None)
        for path, status, text in [
            (corrupt, 422, "checksum"),
            (wrong_shape, 422, "do not fit"),
            (no_module, 422, "does not have"),
            (tmp_path / "nowhere", 422, "does not exist"),
        ]:
            got, body = await load(client, "bad", path)
            assert got == status and text in body, (path, body)
        assert (await load(client, "lora-0", adapters[0]))[0] == 200
        got, body = await load(client, "lora-0", adapters[0])
        assert got == 400 and "already been loaded" in body
        assert (await load(client, "lora-1", adapters[1]))[0] == 200
        got, body = await load(client, "lora-2", adapters[2])
        assert got == 422 and "--max-adapters 2" in body
        models = (await (await client.get("/v1/models")).json())["data"]
        assert [m["id"] for m in models] == ["policy@s0", "lora-0", "lora-1"]
        _, after = await complete(client, None)
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        status, body = await complete(client, "bad")
        assert status == 404 and body["error"]["param"] == "model"
