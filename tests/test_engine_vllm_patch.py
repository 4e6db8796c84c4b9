"""Sparse hot loads into a real vLLM (CPU build, dev mode) through hotload_patch's worker
extension: a patch written in place gives, bit for bit, the weights a full reload of the same
snapshot gives (per-parameter sha256 read back through the extension), and a patch that does
not verify, or an engine that cannot take one, changes nothing and says why.

One vLLM server per fixture: the extension on its PYTHONPATH as the loader ships it (a copy of
the package alone, without hotload), bfloat16 checkpoints served as float32 (exact widening) of
a tiny Llama with fused qkv/gate_up projections and a padded vocabulary, training steps that
move ~1% of the elements by one ulp (`support.tiny_llm.sparse_steps`). Never skipped: a missing
`.venv-vllm` fails with the install command.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import hotload_patch
from hotload.arc.patch import prepare_patch
from hotload_patch.format import PatchFile
from hotload_sidecar.engines import (
    LoadRequest,
    PatchRefusedError,
    ServedSnapshot,
    Timeouts,
    VLLMAdapter,
)
from hotload_sidecar.loader import Loader
from hotload_sidecar.status import EventType, ReplicaStatus
from support.fleet import Trainer, wait_until
from support.patches import flip_first_difference, rewrite_patch
from support.tiny_llm import sparse_steps
from support.vllm_server import INSTALL_HINT, VLLMServer, vllm_python, write_tiny_llama

pytestmark = pytest.mark.slow

PROMPTS = [[101, 2023, 2003, 1037, 3231], [101, 7592, 2088]]
NEW_TOKENS = 8
EXTENSION_ARGS = ("--worker-extension-cls", "hotload_patch.vllm.HotloadWorkerExtension")


class World:
    """A vLLM server, the full snapshots of three training steps and the patches between them."""

    def __init__(self, server: VLLMServer, fulls: list[Path], patches: list[Path]) -> None:
        self.server, self.fulls, self.patches = server, fulls, patches

    def outputs(self) -> list[list[int]]:
        return [self.server.completion_ids(p, NEW_TOKENS) for p in PROMPTS]

    def adapter(self) -> VLLMAdapter:
        return VLLMAdapter(self.server.url, timeouts=Timeouts(probe=60.0))


def shipped_extension(root: Path) -> Path:
    """A folder holding a copy of the hotload_patch package alone, as on a replica's volume."""
    src = Path(hotload_patch.__file__).parent
    shutil.copytree(src, root / "hotload_patch", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def chain(root: Path) -> tuple[list[Path], list[Path]]:
    """Full snapshots step-0..2 (bfloat16) and the patch files of step-1 and step-2."""
    base = write_tiny_llama(root / "base", seed=1, cast="BF16")
    fulls, deltas = sparse_steps(base, root, 2, fraction=0.01)
    patches = [
        prepare_patch(fulls[k - 1], deltas[k], root / f"step-{k}.patch").path for k in (1, 2)
    ]
    return fulls, patches


def start(root: Path, fulls: list[Path], **env: str) -> VLLMServer:
    if vllm_python() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    ext = shipped_extension(root / "ext")
    try:
        return VLLMServer.start(
            fulls[0],
            root / "vllm.log",
            extra_args=EXTENSION_ARGS,
            extra_env={"PYTHONPATH": str(ext), **env},
        )
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("vllm-patch")
    fulls, patches = chain(root)
    server = start(root, fulls)
    try:
        yield World(server, fulls, patches)
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_patches_give_the_weights_a_full_reload_gives(world: World) -> None:
    """step-0 (full) -> patch -> patch, then a full reload of step-2: the same bits and the
    same greedy tokens; the pause covers only the writes."""
    async with world.adapter() as adapter:
        await adapter.load(LoadRequest(str(world.fulls[0]), "step-0", 0, mode="sync"))
        start_sums = await adapter.parameter_checksums()
        on_step0 = world.outputs()
        await adapter.check_sparse()
        for k in (1, 2):
            req = LoadRequest(str(world.patches[k - 1]), f"step-{k}", k, cache_policy="all")
            result = await adapter.patch(req, f"step-{k - 1}", folder=str(world.fulls[k]))
            assert result.served == ServedSnapshot(f"step-{k}", k)
            assert list(result.steps)[:4] == ["version", "models", "describe", "stage"]
            assert {"verify", "pause", "apply", "set_version", "resume", "confirm"} <= set(
                result.steps
            )
            assert result.pause_seconds < result.load_seconds
            assert result.cache_reset
            assert await adapter.current() == ServedSnapshot(f"step-{k}", k)
        patched = await adapter.parameter_checksums()
        after_patches = world.outputs()
        await adapter.load(LoadRequest(str(world.fulls[2]), "step-2-full", 3, mode="sync"))
        full = await adapter.parameter_checksums()
        after_full = world.outputs()
        # And back: a full reload of step-0 gives step-0's bits again.
        await adapter.load(LoadRequest(str(world.fulls[0]), "step-0", 4, mode="sync"))
        assert await adapter.parameter_checksums() == start_sums
        assert world.outputs() == on_step0
    # Every parameter (fused qkv/gate_up, padded embeddings, norms) moved and matches.
    assert set(patched) == set(full) and len(full) >= 10
    assert patched == full
    assert all(start_sums[name] != patched[name] for name in full)
    assert after_patches == after_full


@pytest.mark.asyncio
async def test_a_patch_that_does_not_verify_changes_nothing(world: World, tmp_path: Path) -> None:
    async with world.adapter() as adapter:
        await adapter.load(LoadRequest(str(world.fulls[0]), "step-0", 10, mode="sync"))
        before = await adapter.parameter_checksums()
        outputs = world.outputs()

        # The engine serves another snapshot than the patch's parent.
        with pytest.raises(PatchRefusedError) as refused:
            await adapter.patch(LoadRequest(str(world.patches[1]), "step-2", 11), "step-1")
        assert refused.value.reason == "parent_not_served"

        # One changed value in the patch: the predicted result is not the delta's.
        with PatchFile(world.patches[0]) as pf:
            name = next(t.name for t in pf.tensors if t.add is not None)
        bad = rewrite_patch(world.patches[0], tmp_path / "bad.patch", name, flip_first_difference)
        with pytest.raises(PatchRefusedError) as refused:
            await adapter.patch(LoadRequest(str(bad), "step-1", 12), "step-0")
        assert refused.value.reason == "checksum_mismatch", refused.value
        assert name in str(refused.value)

        # A truncated file.
        bad.write_bytes(world.patches[0].read_bytes()[:-100])
        with pytest.raises(PatchRefusedError) as refused:
            await adapter.patch(LoadRequest(str(bad), "step-1", 13), "step-0")
        assert refused.value.reason == "patch_corrupt", refused.value
        assert await adapter.parameter_checksums() == before
        assert world.outputs() == outputs
        assert await adapter.current() == ServedSnapshot("step-0", 10)

        # Other weights under the parent's name: the served checksums are not the parent's.
        await adapter.load(LoadRequest(str(world.fulls[1]), "step-0", 14, mode="sync"))
        other = await adapter.parameter_checksums()
        with pytest.raises(PatchRefusedError) as refused:
            await adapter.patch(LoadRequest(str(world.patches[0]), "step-1", 15), "step-0")
        assert refused.value.reason == "parent_mismatch", refused.value
        assert await adapter.parameter_checksums() == other

        # Still takes a good patch afterwards.
        await adapter.load(LoadRequest(str(world.fulls[0]), "step-0", 16, mode="sync"))
        result = await adapter.patch(LoadRequest(str(world.patches[0]), "step-1", 17), "step-0")
        assert result.served == ServedSnapshot("step-1", 17)
        assert (await adapter.health()).ready


def test_the_loader_patches_vllm_and_folds_the_volume(world: World, tmp_path: Path) -> None:
    """`python -m hotload_sidecar --engine vllm` follows a ledger: the full snapshot is loaded,
    the next step (an arc_v2 delta of it) goes to vLLM as a sparse patch (the delta kept on the
    volume, then folded into a full snapshot: told to fold at once); the engine then holds what
    a full reload of it gives."""
    import os

    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from support.fleet import Replica, Trainer, wait_for
    from support.metrics import metric

    bucket = tmp_path / "bucket"
    trainer = Trainer(
        Ledger(open_bucket(str(bucket)), "policy"), world.fulls, tmp_path / "t", full_every=100
    )
    trainer.publish(0, full=True)
    replica = Replica(
        "vllm",
        tmp_path / "replica",
        f"{bucket}/policy",
        {**os.environ, "PYTHONUNBUFFERED": "1"},
        loader_args=["--engine", "vllm", "--compact-fraction", "0.0001"],
        engine_port=int(world.server.url.rsplit(":", 1)[1]),
    )
    try:
        replica.start_loader()
        replica.wait_started()
        replica.wait_serving("step-000", timeout=180)
        trainer.publish(1)
        status = replica.wait_serving("step-001", timeout=180)
        assert status["last_load"]["method"] == "sparse", status["last_load"]
        # vLLM's ranks counted the patch's elements themselves (hotload_state).
        assert status["last_load"]["engine_patched_elements"] > 0, status["last_load"]
        assert metric(replica.metrics(), 'hotload_loader_loads_total{method="sparse"}') == 1
        current = replica.weights / "current"
        wait_for("step-001 folded", lambda: os.readlink(current) == "snapshots/step-001", 120)
        deltas = replica.weights / "deltas"
        wait_for("the delta collected", lambda: not any(deltas.iterdir()), 60)
    finally:
        replica.stop()

    async def patched_then_full() -> tuple[dict[str, str], dict[str, str]]:
        async with world.adapter() as adapter:
            patched = await adapter.parameter_checksums()
            await adapter.load(LoadRequest(str(world.fulls[1]), "step-1-full", 30, mode="sync"))
            return patched, await adapter.parameter_checksums()

    patched, full = asyncio.run(patched_then_full())
    assert patched == full


@pytest.mark.asyncio
async def test_vllm_kernels_that_repack_weights_refuse_patches(tmp_path: Path) -> None:
    """With vLLM's own CPU kernels (HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS=0) the linear weights live
    only in oneDNN's packed layout: the extension says so before anything is staged, and a
    full reload still works."""
    fulls, patches = chain(tmp_path)
    server = start(tmp_path, fulls, HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS="0")
    try:
        async with VLLMAdapter(server.url, timeouts=Timeouts(probe=60.0)) as adapter:
            await adapter.load(LoadRequest(str(fulls[0]), "step-0", 0, mode="sync"))
            with pytest.raises(PatchRefusedError) as refused:
                await adapter.check_sparse()
            assert refused.value.reason == "kernel_format"
            assert "repacked for vLLM's CPU kernels" in str(refused.value)
            with pytest.raises(PatchRefusedError) as refused:
                await adapter.patch(LoadRequest(str(patches[0]), "step-1", 1), "step-0")
            assert refused.value.reason == "kernel_format"
            assert await adapter.current() == ServedSnapshot("step-0", 0)
            await adapter.load(LoadRequest(str(fulls[1]), "step-1", 2, mode="sync"))
            assert await adapter.current() == ServedSnapshot("step-1", 2)
    finally:
        server.stop()


class _Recorder:
    """A loader's reporter that keeps every status it published (and the Events), and can run
    a hook on each status before the loader goes on."""

    def __init__(self, hook: Callable[[ReplicaStatus], Awaitable[None]] | None = None) -> None:
        from hotload_sidecar.status import LocalReporter

        self.local = LocalReporter(keep_events=500)
        self.history: list[ReplicaStatus] = []
        self.hook = hook

    @property
    def in_sync(self) -> bool:
        return True

    async def report(self, status: ReplicaStatus) -> None:
        self.history.append(status)
        await self.local.report(status)
        if self.hook is not None:
            await self.hook(status)

    async def event(self, type_: EventType, reason: str, message: str) -> None:
        await self.local.event(type_, reason, message)

    async def aclose(self) -> None:
        await self.local.aclose()


async def _until(what: str, check: Callable[[], Any], timeout: float = 240.0) -> Any:
    """`wait_until` with four minutes' patience (a vLLM on the CPU is slow)."""
    return await wait_until(what, check, timeout, interval=0.05)


async def _completions_done(url: str) -> float:
    """vLLM's own count of finished requests (`vllm:request_success_total`, every reason)."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


@contextlib.asynccontextmanager
async def _loader(
    world: World, root: Path, reporter: _Recorder, probe_seconds: float
) -> AsyncIterator[tuple[Loader, Trainer]]:
    """An in-process loader following a folder ledger into the module's vLLM."""
    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from hotload_sidecar.config import Settings

    ledger = Ledger(open_bucket(str(root / "bucket")), "policy")
    trainer = Trainer(ledger, world.fulls, root / "trainer", full_every=100)
    await asyncio.to_thread(trainer.publish, 0)
    settings = Settings(
        ledger_url=f"{root / 'bucket'}/policy",
        weights_dir=root / "weights",
        engine_url=world.server.url,
        poll_seconds=0.2,
        hint_ttl_seconds=0,
        retry_seconds=0.5,
    )
    adapter = VLLMAdapter(settings.engine_url, timeouts=Timeouts(probe=probe_seconds))
    loader = Loader(settings, ledger=ledger, adapter=adapter, reporter=reporter)
    stop = asyncio.Event()
    running = asyncio.create_task(loader.run(stop))
    try:
        await _until("step-000 served", lambda: loader.status.identity == "step-000")
        yield loader, trainer
    finally:
        stop.set()
        await running
        await adapter.aclose()


@pytest.mark.asyncio
async def test_the_loader_reports_a_patch_before_its_probe_runs(
    world: World, tmp_path: Path
) -> None:
    """After a verified patch the replica reports the new snapshot at once: when the loader
    publishes it, vLLM has not answered a completion since before the patch; the 1-token probe
    runs right after and its result lands in the status later."""
    seen: dict[str, float] = {}

    async def at_report(status: ReplicaStatus) -> None:
        if status.identity == "step-001" and "reported" not in seen:
            seen["reported"] = await _completions_done(world.server.url)

    reporter = _Recorder(at_report)
    async with _loader(world, tmp_path, reporter, 60.0) as (loader, trainer):
        await _until("a quiet engine", lambda: loader.status.state == "idle")
        before = await _completions_done(world.server.url)
        await asyncio.to_thread(trainer.publish, 1)
        probed = await _until(
            "the probe of step-001",
            lambda: (p := loader.status.last_probe) and p["identity"] == "step-001" and p,
        )
    assert probed["result"] == "ok", probed
    served_at = next(i for i, s in enumerate(reporter.history) if s.identity == "step-001")
    served = reporter.history[served_at]
    assert served.last_load is not None and served.last_load.method == "sparse"
    assert served.ready and served.reason == "Current" and served.last_probe is None
    # Published before the probe's completion was answered (none since the patch began) ...
    assert seen["reported"] == before
    # ... and the probe's result after it.
    probed_at = next(
        i for i, s in enumerate(reporter.history) if s.last_probe and s.last_probe["result"]
    )
    assert probed_at > served_at
    assert await _completions_done(world.server.url) >= before + 1
    assert "confirm" in served.last_load.engine_steps


@pytest.mark.asyncio
async def test_a_failed_probe_marks_the_replica_degraded_and_reloads_it_in_full(
    world: World, tmp_path: Path
) -> None:
    """vLLM is paused behind the loader's back (by another client) as the patch is reported:
    the probe gets no token within its timeout, the replica turns Degraded (ProbeFailed, with
    what to check), and the loader reloads step-001 in full, which confirms with a completion
    (the reload's own pause and resume let the engine generate again)."""
    import aiohttp

    paused: list[str] = []

    async def pause_once(status: ReplicaStatus) -> None:
        if status.identity == "step-001" and not paused:
            paused.append(status.identity)
            async with (
                aiohttp.ClientSession() as session,
                session.post(world.server.url + "/pause", params={"mode": "keep"}) as resp,
            ):
                assert resp.status == 200, await resp.text()

    reporter = _Recorder(pause_once)
    async with _loader(world, tmp_path, reporter, 5.0) as (loader, trainer):
        await asyncio.to_thread(trainer.publish, 1)
        degraded = await _until(
            "the Degraded report", lambda: next((s for s in reporter.history if s.degraded), None)
        )
        assert degraded.identity == "step-001" and not degraded.ready
        assert degraded.reason == "Degraded" and degraded.degraded_reason == "ProbeFailed"
        assert "got no answer within 5 s" in degraded.degraded
        assert "check the engine's log" in degraded.degraded
        assert degraded.last_probe is not None and degraded.last_probe["result"] == "failed"
        events = [e for e in reporter.local.events if e["reason"] == "ProbeFailed"]
        assert len(events) == 1 and "step-001" in events[0]["message"]
        await _until(
            "the full reload",
            lambda: (
                (s := loader.status).identity == "step-001"
                and not s.degraded
                and s.last_load is not None
                and s.last_load.method == "full"
            ),
        )
        status = loader.status
        assert status.ready and status.reason == "Current" and status.degraded_reason == ""
        metrics = loader.metrics.render().decode()
        assert "hotload_loader_probe_failures_total 1.0" in metrics
        assert "hotload_loader_degraded 0.0" in metrics
    assert paused == ["step-001"]
    assert world.outputs()  # vLLM generates (not left paused)


@pytest.mark.asyncio
async def test_an_fp8_snapshot_is_refused_before_the_pause_and_the_weights_serve_on(
    world: World, tmp_path: Path
) -> None:
    """vLLM builds its layers for one quantization at start, so a hot reload cannot change it:
    a block-FP8 snapshot of the served model is refused before the engine pauses, naming
    quantization_config and both sides; the weights, the answers and the version stay."""
    from hotload.snapshot import build_from_folder
    from hotload_sidecar.engines import EngineLoadError

    fp8 = build_from_folder(world.fulls[0], tmp_path / "fp8", fp8="linear").path
    async with world.adapter() as adapter:
        await adapter.load(LoadRequest(str(world.fulls[0]), "step-0", 20, mode="sync"))
        before = await adapter.parameter_checksums()
        outputs = world.outputs()
        with pytest.raises(EngineLoadError) as refused:
            await adapter.load(LoadRequest(str(fp8), "step-0-fp8", 21, mode="sync"))
        assert refused.value.step == "check", refused.value
        assert (
            "quantization_config: is fp8 (recipe 'linear') and the engine runs unquantized "
            "weights" in str(refused.value)
        )
        assert await adapter.parameter_checksums() == before
        assert world.outputs() == outputs
        assert await adapter.current() == ServedSnapshot("step-0", 20)
