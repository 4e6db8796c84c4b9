"""Checkpoints as the model families publish them, through the whole path, on both engines.

For each family of `support.families` (a tiny model from the family's own transformers
configuration class, saved with `save_pretrained` in bfloat16): `hotload snapshot build` of that
folder is published to a bucket on SeaweedFS as step 0, two training steps (1% of the elements
moved by one ulp) go out with `hotload publish` as arc_v2 deltas; then the trainer publishes
its own `model.state_dict()` (tied names included, a mixture of experts' stacked experts) with
the SDK's `Publisher`: a full snapshot after one AdamW step and two deltas after two more.

Two replicas follow that ledger, each a real loader process (`python -m hotload_sidecar`): one
with the reference engine (`python -m hotload serve`), one with vLLM's CPU build and hotload's
worker extension, started as the operator's pods start them (on the folder the loader
materialised, the extension from the weights volume). Every delta of the served snapshot must
reach both as a sparse patch; after each step both answer completions and their per-parameter
sha256 are kept; at the end each engine loads every step's full snapshot (the published
folders, and for the trainer's steps `save_pretrained` of its model, built into a snapshot)
and must hold the same bits the patches gave.

One vLLM start per family, in eager mode (`--enforce-eager`: 25-35 s instead of 60-100 s here;
compiled mode is what `tests/test_engine_vllm_patch.py` runs). Never skipped: a missing
`.venv-vllm` or SeaweedFS fails with the install command.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import ENGINE_PYTHONPATH_DIR, VLLM_WORKER_EXTENSION
from hotload.bucket import open_bucket
from hotload.cli.main import run
from hotload.sdk import Publisher
from hotload_sidecar.engines import LoadRequest, ReferenceAdapter, Timeouts, VLLMAdapter
from support.families import FAMILIES, Family, copy_tokenizer, save_family
from support.fleet import Replica, free_port, http_json
from support.metrics import metric
from support.seaweedfs import SeaweedFS
from support.tiny_llm import sparse_steps
from support.vllm_server import INSTALL_HINT, VLLMServer, post_json, vllm_python

pytestmark = pytest.mark.slow

PROMPT_IDS = [101, 2023, 2003, 1037, 3231]
#: Steps 1-2 come from `hotload publish`, 3-5 from the trainer's Publisher (3: a full snapshot).
CLI_STEPS = (1, 2)
SDK_STEPS = (3, 4, 5)
#: AdamW's learning rate for the trainer: an RL-sized step, which moves a few percent of the
#: bfloat16 values (a patch; the loader's limit is 10%).
LR = 2e-6


def identity(step: int) -> str:
    """The ledger identity of a step (as `support.fleet.Trainer` names them)."""
    return f"step-{step:03d}"


@dataclass
class Chain:
    """One family's ledger and, for every step, the full snapshot its engines must match."""

    family: Family
    root: Path
    url: str
    hf: Path
    truth: dict[int, Path] = field(default_factory=dict)


class Trainer:
    """The family's model in float32 with AdamW, as a trainer holds it."""

    def __init__(self, family: Family, seed: int) -> None:
        import torch

        self.torch = torch
        self.model = family.model(seed).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.gen = torch.Generator().manual_seed(seed + 7)

    def step(self) -> None:
        """One optimizer step on random token sequences."""
        ids = self.torch.randint(1000, 29000, (4, 24), generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def saved(self, folder: Path) -> Path:
        """What the family's publisher would publish now: `save_pretrained` in bfloat16."""
        copy.deepcopy(self.model).to(self.torch.bfloat16).save_pretrained(folder)
        copy_tokenizer(folder)
        return folder


def cli(*args: str) -> None:
    """Run one `hotload` command in this process; it must succeed."""
    assert run([*args]) == 0, args


# --- the replicas ----------------------------------------------------------------------------


class Fleet:
    """A reference-engine replica and a vLLM replica following one ledger."""

    def __init__(self, chain: Chain, env: dict[str, str]) -> None:
        ledger = f"{chain.url}/{chain.family.name}"
        self.reference = Replica("reference", chain.root / "reference", ledger, env)
        self.vllm = Replica(
            "vllm",
            chain.root / "vllm",
            ledger,
            env,
            loader_args=["--engine", "vllm"],
            engine_port=free_port(),
        )
        self.server: VLLMServer | None = None

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        """Both loaders; then the engines on what the loaders materialised (as the kubelet
        starts a pod's engine once its loader's startup probe passed)."""
        for r in (self.reference, self.vllm):
            r.start_loader()
        for r in (self.reference, self.vllm):
            r.wait_started(timeout=300)
        self.reference.start_engine()
        self.server = start_vllm(self.vllm, extra_env or {})

    def stop(self) -> None:
        """Every process, whatever happened."""
        for r in (self.reference, self.vllm):
            r.stop()
        if self.server is not None:
            self.server.stop()

    def logs(self) -> str:
        """The tail of every log, for a failure's message."""
        text = self.reference.logs() + "\n" + self.vllm.logs()
        if self.server is not None:
            text += "\n--- vllm ---\n" + self.server.log_tail(60)
        return text


def start_vllm(replica: Replica, extra_env: dict[str, str]) -> VLLMServer:
    """vLLM on the replica's volume with the extension the loader shipped there."""
    if vllm_python() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    try:
        return VLLMServer.start(
            replica.weights / "current",
            replica.root / "vllm.log",
            port=replica.engine_port,
            extra_args=("--worker-extension-cls", VLLM_WORKER_EXTENSION, "--enforce-eager"),
            extra_env={"PYTHONPATH": str(replica.weights / ENGINE_PYTHONPATH_DIR), **extra_env},
        )
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)


def stop_loader(replica: Replica) -> None:
    """Stop a replica's loader only (its engine keeps serving)."""
    assert replica.loader is not None
    replica.loader.terminate()
    replica.loader.wait(timeout=30)


def vllm_tokens(server: VLLMServer) -> list[int]:
    """A greedy completion of `PROMPT_IDS` (8 tokens unless the model ends it)."""
    answer = post_json(
        server.url + "/v1/completions",
        {
            "model": server.model,
            "prompt": PROMPT_IDS,
            "max_tokens": 8,
            "temperature": 0.0,
            "return_token_ids": True,
        },
    )
    return [int(t) for t in answer["choices"][0]["token_ids"]]


async def vllm_checksums(url: str) -> dict[str, str]:
    """sha256 of every parameter vLLM holds (through the extension)."""
    async with VLLMAdapter(url, timeouts=Timeouts(probe=60.0)) as adapter:
        return await adapter.parameter_checksums()


def reference_checksums(replica: Replica) -> dict[str, str]:
    """sha256 of every weight the reference engine holds."""
    code, body = http_json("GET", replica.engine_url + "/hotload/v1/checksums")
    assert code == 200, body
    return dict(body["checksums"])


# --- the chain --------------------------------------------------------------------------------


def publish_cli_steps(chain: Chain, root: Path) -> None:
    """Step 0 built from the family's folder, steps 1-2 as training steps, each published with
    `hotload publish` (deltas against the ledger head, from the workdir's copy)."""
    base = root / "built" / identity(0)
    cli("snapshot", "build", str(chain.hf), str(base), "-o", "json")
    fulls, _ = sparse_steps(base, root / "steps", max(CLI_STEPS), fraction=0.01, seed=3)
    chain.truth[0] = base
    for step, full in enumerate(fulls[1:], start=1):
        chain.truth[step] = full


def publish(chain: Chain, step: int, workdir: Path) -> None:
    """`hotload publish` of step `step`'s full snapshot (step 0 full, the others as deltas)."""
    cli(
        "publish", str(chain.truth[step]), "--bucket", chain.url, "--ledger", chain.family.name,
        "--identity", identity(step), "--workdir", str(workdir), "--no-progress", "-o", "json",
    )  # fmt: skip


def wait_both(fleet: Fleet, step: int) -> dict[str, dict[str, Any]]:
    """Both replicas serving `step`; their loaders' statuses."""
    try:
        return {
            r.name: r.wait_serving(identity(step), timeout=300)
            for r in (fleet.reference, fleet.vllm)
        }
    except AssertionError as err:
        raise AssertionError(f"{err}\n{fleet.logs()}") from None


# --- the test ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_through_the_whole_path(
    name: str, tmp_path: Path, s3_env: SeaweedFS, env: dict[str, str]
) -> None:
    family = FAMILIES[name]
    chain = Chain(
        family,
        tmp_path,
        s3_env.url(f"families-{uuid.uuid4().hex[:8]}"),
        save_family(family, tmp_path / "hf", seed=11),
    )
    published_names = _names(chain.hf)
    publish_cli_steps(chain, tmp_path)
    workdir = tmp_path / "publish-workdir"
    publish(chain, 0, workdir)
    fleet = Fleet(chain, {**env, **s3_env.env})
    served: dict[str, list[dict[str, str]]] = {"reference": [], "vllm": []}
    try:
        fleet.start()
        wait_both(fleet, 0)
        assert fleet.server is not None
        start = {
            "reference": reference_checksums(fleet.reference),
            "vllm": asyncio.run(vllm_checksums(fleet.server.url)),
        }
        trainer = Trainer(family, seed=11)
        publisher = Publisher(
            chain.url,
            ledger=family.name,
            cast="BF16",
            side_files_from=chain.hf,
            workdir=tmp_path / "trainer",
            identity_format="step-{step:03d}",
            full_every=100,
            progress=False,
        )
        for step in range(1, max(SDK_STEPS) + 1):
            if step in CLI_STEPS:
                publish(chain, step, workdir)
            else:
                trainer.step()
                handle = publisher.publish(trainer.model.state_dict(), step=step, full=step == 3)
                assert handle.kind == ("full" if step == 3 else "incremental"), handle
                chain.truth[step] = _built(trainer.saved(tmp_path / "saved" / str(step)))
                # The trainer's state dict went out under the names the family publishes.
                assert set(_spec(chain.url, identity(step))) == published_names
            statuses = wait_both(fleet, step)
            for engine, status in statuses.items():
                method = status["last_load"]["method"]
                expected = "full" if step == 3 else "sparse"
                assert method == expected, (engine, step, status["last_load"], fleet.logs())
            served["reference"].append(reference_checksums(fleet.reference))
            served["vllm"].append(asyncio.run(vllm_checksums(fleet.server.url)))
            assert fleet.reference.complete("the chef cooked", 4)["choices"][0]["token_ids"]
            assert vllm_tokens(fleet.server)
        if family.name == "qwen3-moe":
            # vLLM computes these experts with the extension's plain GEMMs: the tokens are
            # transformers' own (greedy, float32).
            assert vllm_tokens(fleet.server) == greedy_tokens(chain.truth[max(SDK_STEPS)])
        for r in (fleet.reference, fleet.vllm):
            stop_loader(r)  # the comparison below loads behind its back
        fulls = asyncio.run(_full_loads(fleet, chain))
    finally:
        fleet.stop()
    for engine in ("reference", "vllm"):
        for k, step in enumerate(range(1, max(SDK_STEPS) + 1)):
            patched, full = served[engine][k], fulls[engine][step]
            differ = sorted(n for n in full if patched.get(n) != full[n])
            assert set(patched) == set(full) and not differ, (engine, step, differ)
        # The training steps moved every parameter (norms, biases and padded rows included),
        # so none was left out of the patches that matched.
        moved = served[engine][max(CLI_STEPS) - 1]
        assert all(start[engine][n] != moved[n] for n in moved), engine


async def _full_loads(fleet: Fleet, chain: Chain) -> dict[str, dict[int, dict[str, str]]]:
    """Each engine's sha256 after a full load of every step's snapshot."""
    out: dict[str, dict[int, dict[str, str]]] = {"reference": {}, "vllm": {}}
    assert fleet.server is not None
    steps = range(1, max(SDK_STEPS) + 1)
    async with ReferenceAdapter(fleet.reference.engine_url) as ref:
        for step in steps:
            await ref.load(LoadRequest(str(chain.truth[step]), f"full-{step}", 100 + step))
            out["reference"][step] = reference_checksums(fleet.reference)
    async with VLLMAdapter(fleet.server.url, timeouts=Timeouts(probe=60.0)) as vllm:
        for step in steps:
            await vllm.load(LoadRequest(str(chain.truth[step]), f"full-{step}", 100 + step))
            out["vllm"][step] = await vllm.parameter_checksums()
    return out


def greedy_tokens(folder: Path) -> list[int]:
    """`vllm_tokens`'s completion from transformers on a snapshot folder (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT_IDS]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    return [int(t) for t in out[0, len(PROMPT_IDS) :]]


def _built(folder: Path) -> Path:
    """`hotload snapshot build` of a model folder, beside it."""
    out = folder.with_name(folder.name + "-snapshot")
    cli("snapshot", "build", str(folder), str(out), "-o", "json")
    return out


def _names(folder: Path) -> set[str]:
    """The tensor names of a model folder's safetensors files."""
    from hotload_patch.checkpoint import checkpoint_specs

    return set(checkpoint_specs(folder))


def _spec(url: str, ident: str) -> dict[str, Any]:
    """The tensor map of a snapshot in the bucket."""
    raw = open_bucket(url).get(f"{ident}/model.weight.spec.json").data
    return dict(json.loads(raw)["tensor_map"])


def test_vllm_experts_it_cannot_patch_load_in_full_naming_the_tensor(
    tmp_path: Path, s3_env: SeaweedFS, env: dict[str, str]
) -> None:
    """vLLM's own CPU kernels (HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS=0) prepack a mixture of experts'
    weights, which no patch can follow: the loader learns it from the extension before it
    fetches anything, loads the delta's full snapshot instead, and says why, naming the layer
    and a checkpoint tensor it holds."""
    family = FAMILIES["qwen3-moe"]
    chain = Chain(
        family,
        tmp_path,
        s3_env.url(f"families-{uuid.uuid4().hex[:8]}"),
        save_family(family, tmp_path / "hf", seed=5),
    )
    publish_cli_steps(chain, tmp_path)
    workdir = tmp_path / "publish-workdir"
    publish(chain, 0, workdir)
    replica = Fleet(chain, {**env, **s3_env.env}).vllm
    server = None
    try:
        replica.start_loader()
        replica.wait_started(timeout=300)
        server = start_vllm(replica, {"HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS": "0"})
        replica.wait_serving(identity(0), timeout=300)
        before = metric(replica.metrics(), "hotload_loader_bytes_fetched_total")
        publish(chain, 1, workdir)
        status = replica.wait_serving(identity(1), timeout=300)
        last = status["last_load"]
        assert (last["method"], last["sparse_fallback"]) == ("full", "kernel_format"), last
        fell_back = [e["message"] for e in status["events"] if e["reason"] == "SparseLoadFellBack"]
        assert len(fell_back) == 1, status["events"]
        assert "expert weights prepacked for vLLM's CPU kernels" in fell_back[0]
        assert "model.layers.0.mlp.experts" in fell_back[0]
        assert "checkpoint tensor model.layers.0.mlp.experts." in fell_back[0]
        # Decided before anything was fetched: the delta came down once, for the full load.
        fetched = metric(replica.metrics(), "hotload_loader_bytes_fetched_total") - before
        shipped = sum(o.size for o in open_bucket(chain.url).list(identity(1)))
        assert fetched == shipped, (fetched, shipped)
    finally:
        replica.stop()
        if server is not None:
            server.stop()
