"""LoRA adapters end to end: the reference engine serving several adapters per request, the
loader keeping the newest adapters of a ledger loaded, and the operator's admission and
roll-up of adapter snapshots."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from hotload.bucket import open_bucket, upload_snapshot
from hotload.errors import HotloadError
from hotload.ledger import Ledger, NewEntry
from hotload.sdk import publish_folder
from support.engines import serve_engines
from support.fleet import Replica, Trainer, http_json, wait_for
from support.seaweedfs import SeaweedFS
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


# --- the loader: the newest adapters of the ledger, loaded next to the base --------------------


def adapter_states(replica: Replica) -> dict[str, str]:
    """identity -> status of the adapters the loader reports."""
    return {a["identity"]: a["status"] for a in replica.status()["adapters"]}


def engine_adapters(replica: Replica) -> list[str]:
    return engine_adapters_at(replica.engine_url)


def model_tokens(replica: Replica, model: str) -> list[int]:
    code, body = http_json(
        "POST",
        replica.engine_url + "/v1/completions",
        {"model": model, "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True},
    )
    assert code == 200, body
    return list(body["choices"][0]["token_ids"])


def test_loaders_keep_the_newest_adapters_loaded_and_recover_from_a_corrupt_one(
    tiny: TinyLLM, adapters: list[Path], tmp_path: Path, s3_env: SeaweedFS
) -> None:
    from hotload.snapshot import describe_snapshot

    env = {**os.environ, **s3_env.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    url = s3_env.url(f"lora-{uuid.uuid4().hex[:8]}")
    ledger = Ledger(open_bucket(url), "policy")
    trainer = Trainer(ledger, tiny.snapshots, tmp_path / "trainer")
    trainer.publish(0)
    fleet = [
        Replica(f"r{i}", tmp_path / f"r{i}", f"{url}/policy", env, ["--max-adapters", "2"])
        for i in range(2)
    ]
    try:
        for r in fleet:
            r.start()
        for r in fleet:
            r.wait_serving("step-000")
        base_tokens = fleet[0].complete(PROMPT)["choices"][0]["token_ids"]
        for i, path in enumerate(adapters):
            publish_folder(ledger, path, identity=f"lora-{i}")
        for r in fleet:
            wait_for(
                f"{r.name} with the two newest adapters",
                lambda r=r: adapter_states(r) == {"lora-2": "loaded", "lora-1": "loaded"},
                90,
            )
            assert sorted(engine_adapters(r)) == ["lora-1", "lora-2"]  # lora-0 was unloaded
            assert [a["identity"] for a in r.status()["adapters"]] == ["lora-2", "lora-1"]
            assert not (r.weights / "adapters" / "lora-0").exists()
        # Adapters ride on the base, which is untouched; each replica answers the same.
        assert fleet[1].complete(PROMPT)["choices"][0]["token_ids"] == base_tokens
        with2 = model_tokens(fleet[0], "lora-2")
        assert with2 != base_tokens and model_tokens(fleet[1], "lora-2") == with2

        # `hotload status` shows each replica's adapters.
        loaders = ",".join(r.loader_url for r in fleet)
        command = [sys.executable, "-m", "hotload", "status", "--ledger", f"{url}/policy"]
        shown = subprocess.run(
            [*command, "--replicas", loaders],
            check=False,
            env={**env, "COLUMNS": "250"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        assert "ADAPTERS" in shown.stdout and shown.stdout.count("lora-2, lora-1") == 2

        # A base update keeps the adapters; it changes what they answer.
        trainer.publish(1)
        for r in fleet:
            r.wait_serving("step-001")
            assert adapter_states(r) == {"lora-2": "loaded", "lora-1": "loaded"}
        assert model_tokens(fleet[0], "lora-2") != with2

        # An adapter whose bytes rotted in the bucket after admission: refused by its checksum,
        # reported, retried; once the bucket holds the right bytes again it loads.
        good = adapters[0]
        bad = Path(shutil.copytree(good, tmp_path / "rotten"))
        weights_file = bad / "adapter_model.safetensors"
        data = bytearray(weights_file.read_bytes())
        data[-5] ^= 0x10
        weights_file.unlink()
        weights_file.write_bytes(bytes(data))
        desc = describe_snapshot(good)
        assert describe_snapshot(bad).manifest_digest == desc.manifest_digest  # headers agree
        upload_snapshot(
            bad, ledger.bucket, "lora-3", files=desc.files, manifest_files=["adapter_config.json"]
        )
        ledger.append(
            NewEntry("lora-3", "lora", desc.manifest_digest, desc.shipped_bytes, desc.full_bytes)
        )
        for r in fleet:
            wait_for(
                f"{r.name} reporting lora-3 failed",
                lambda r=r: adapter_states(r).get("lora-3") == "failed",
                60,
            )
            message = next(a for a in r.status()["adapters"] if a["identity"] == "lora-3")
            assert "checksum" in message["message"], message
            assert "lora-3" not in engine_adapters(r)
            assert model_tokens(r, "lora-2")  # the others keep serving
        ledger.bucket.put(
            "lora-3/adapter_model.safetensors", (good / "adapter_model.safetensors").read_bytes()
        )
        for r in fleet:
            wait_for(
                f"{r.name} loading lora-3 after the repair",
                lambda r=r: adapter_states(r) == {"lora-3": "loaded", "lora-2": "loaded"},
                90,
            )
        assert model_tokens(fleet[0], "lora-3") == model_tokens(fleet[1], "lora-3")

        # A restarted loader adopts what the engine holds instead of loading it again.
        fleet[0].kill_loader()
        fleet[0].start_loader()
        fleet[0].wait_started()
        wait_for(
            "the restarted loader to adopt the adapters",
            lambda: adapter_states(fleet[0]) == {"lora-3": "loaded", "lora-2": "loaded"},
            60,
        )
        assert all(a["load_seconds"] is None for a in fleet[0].status()["adapters"])
    except BaseException:
        for r in fleet:
            print(r.logs())
        raise
    finally:
        for r in fleet:
            r.stop()


# --- the real vLLM CPU engine ------------------------------------------------------------------

#: vLLM CPU float32 against transformers float32 with unmerged LoRA: measured equal to about
#: 1e-6 (docs/numerics.md); the bound leaves room for other CPUs' kernels.
VLLM_LORA_MAX_ABS_DIFF = 1e-4


def test_the_loader_serves_adapters_through_a_real_vllm(tmp_path: Path) -> None:
    """vLLM CPU with runtime LoRA updating: the loader loads the newest adapters into it, vLLM's
    numbers equal transformers with the adapter, superseded adapters are unloaded, and an adapter
    that does not fit the base is refused before vLLM sees it (vLLM 0.32 takes it silently)."""
    from support.vllm_server import INSTALL_HINT, VLLMServer, vllm_python, write_tiny_llama

    if vllm_python() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    base = write_tiny_llama(tmp_path / "base", seed=3)
    config = json.loads((base / "config.json").read_text())
    made = [tiny_adapter(tmp_path / f"a{i}", config, seed=10 + i) for i in range(3)]
    misfit = tiny_adapter(tmp_path / "misfit", {**config, "head_dim": 16}, seed=20)
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    trainer = Trainer(ledger, [base], tmp_path / "trainer")
    trainer.publish(0)
    server = VLLMServer.start(
        base,
        tmp_path / "vllm.log",
        extra_args=("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    replica = Replica(
        "vllm",
        tmp_path / "replica",
        f"{tmp_path / 'bucket'}/policy",
        {**os.environ, "PYTHONUNBUFFERED": "1"},
        loader_args=["--engine", "vllm", "--max-adapters", "2"],
        engine_port=int(server.url.rsplit(":", 1)[1]),
    )
    prompt = [101, 2023, 2001, 1037, 2204, 2154, 1998]

    def scored(model: str) -> list[float]:
        code, body = http_json(
            "POST",
            server.url + "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0},
        )
        assert code == 200, body
        entries = body["choices"][0]["prompt_logprobs"]
        return [e[str(prompt[i])]["logprob"] for i, e in enumerate(entries) if i]

    try:
        replica.start_loader()
        replica.wait_started()
        replica.wait_serving("step-000", timeout=180)
        for i, path in enumerate(made):
            publish_folder(ledger, path, identity=f"adapter-{i}")
        wait_for(
            "the two newest adapters in vLLM",
            lambda: adapter_states(replica) == {"adapter-2": "loaded", "adapter-1": "loaded"},
            180,
        )
        assert sorted(engine_adapters_at(server.url)) == ["adapter-1", "adapter-2"]
        base_scores = scored(server.model)
        for i in (1, 2):
            got = scored(f"adapter-{i}")
            want = lora_prompt_logprobs(base, made[i], prompt)
            assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < VLLM_LORA_MAX_ABS_DIFF
            assert max(abs(g - b) for g, b in zip(got, base_scores, strict=True)) > 1e-2
        assert base_scores == pytest.approx(lora_prompt_logprobs(base, None, prompt), abs=1e-4)

        publish_folder(ledger, misfit, identity="misfit")
        wait_for(
            "the misfit adapter refused",
            lambda: adapter_states(replica).get("misfit") == "failed",
            120,
        )
        report = next(a for a in replica.status()["adapters"] if a["identity"] == "misfit")
        assert "do not fit the base layer" in report["message"], report
        assert "misfit" not in engine_adapters_at(server.url)
        assert scored("adapter-2") == pytest.approx(
            lora_prompt_logprobs(base, made[2], prompt), abs=VLLM_LORA_MAX_ABS_DIFF
        )
    except BaseException:
        print(replica.logs())
        print(server.log_tail(60))
        raise
    finally:
        replica.stop()
        server.stop()


def engine_adapters_at(url: str) -> list[str]:
    code, body = http_json("GET", url + "/v1/models")
    assert code == 200, body
    return [m["id"] for m in body["data"] if m.get("parent")]


# --- the trainer's side --------------------------------------------------------------------------


def test_publisher_publishes_peft_folders_and_tensors_as_verified_adapters(
    tiny: TinyLLM, adapters: list[Path], tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    from hotload import Publisher
    from hotload.bucket import download_snapshot
    from hotload.snapshot.lora import read_adapter_tensors, verify_adapter

    # A folder as PEFT's save_pretrained writes it: no checksums anywhere.
    plain = tmp_path / "peft"
    plain.mkdir()
    tensors = {
        n: r.data.view("float32").reshape(r.shape)
        for n, r in read_adapter_tensors(adapters[0]).items()
    }
    save_file(tensors, str(plain / "adapter_model.safetensors"))
    shutil.copy(adapters[0] / "adapter_config.json", plain / "adapter_config.json")
    config = json.loads((plain / "adapter_config.json").read_text())

    bucket = tmp_path / "bucket"
    with Publisher(str(bucket), ledger="policy", workdir=tmp_path / "work") as pub:
        pub.publish(tiny.snapshots[0], step=0)
        from_folder = pub.publish_adapter(plain, step=1)
        from_tensors = pub.publish_adapter(tensors, step=2, config=config, identity="lora-t")
        with pytest.raises(HotloadError, match="needs its config"):
            pub.publish_adapter(tensors, step=3)
    assert (from_folder.kind, from_folder.previous) == ("lora", None)
    document = Ledger(open_bucket(str(bucket)), "policy").read().document
    assert [(e.identity, e.kind) for e in document.entries] == [
        ("step-00000000", "full"),
        ("step-00000001", "lora"),
        ("lora-t", "lora"),
    ]
    assert document.head is not None and document.head.identity == "step-00000000"
    assert document.find("lora-t").prompt_cache == "none"  # type: ignore[union-attr]
    for handle in (from_folder, from_tensors):
        out = tmp_path / "check" / handle.identity
        download_snapshot(open_bucket(str(bucket)), handle.identity, out)
        assert verify_adapter(out) == len(tensors)
    assert not (plain / "adapter_model.safetensors.tmp").exists()

    # The CLI does the same with a PEFT folder; a re-run is a no-op, not a second entry.
    from hotload.cli.main import run

    for _ in range(2):
        args = ["publish", str(plain), "--bucket", str(bucket), "--ledger", "policy"]
        assert run([*args, "--identity", "lora-cli", "--no-progress"]) == 0
    document = Ledger(open_bucket(str(bucket)), "policy").read().document
    entry = document.find("lora-cli")
    assert entry is not None and (entry.kind, entry.prompt_cache) == ("lora", "none")
    assert [e.identity for e in document.entries].count("lora-cli") == 1
    out = tmp_path / "check" / "lora-cli"
    download_snapshot(open_bucket(str(bucket)), "lora-cli", out)
    assert verify_adapter(out) == len(tensors)
