"""Pipelined patches: while the engine takes one patch, the loader prepares the next from the
deltas published meanwhile, and sends it as soon as the engine answers; a patch prepared for a
parent the engine then does not serve is deleted unsent.

In one process: the loader (`Loader.run`), a real reference engine behind its aiohttp server
(`support.engines.serve`), a folder bucket with a real ledger, real arc_v2 deltas of a tiny Llama.
The engine's patch route is held at a gate (the adapter waits before calling it), so the test
decides when the engine answers: the deltas after it land while it is busy.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from hotload.arc import patch as arc_patch
from hotload.bucket import open_bucket
from hotload.errors import EngineLoadError
from hotload.ledger import Ledger
from hotload_sidecar.engines import LoadRequest, LoadResult, ReferenceAdapter
from hotload_sidecar.sparse import Prepared
from hotload_sidecar.status import LocalReporter
from support.engines import engine_of, serve
from support.fleet import Trainer
from support.metrics import scraped
from support.pipeline import GatedAdapter, gated_loader, step_0_published, until
from support.tiny_llm import bf16_training_steps


async def step_2_while_the_engine_takes_step_1(
    trainer: Trainer, adapter: GatedAdapter, reporter: LocalReporter
) -> None:
    """Once the loader serves step-000: publish step-001, wait until its patch waits at the
    adapter's gate, and publish step-002 meanwhile."""
    await until(lambda: reporter.status.identity == "step-000")
    await asyncio.to_thread(trainer.publish, 1)
    await until(lambda: adapter.asked == ["step-001"])
    await asyncio.to_thread(trainer.publish, 2)


@pytest.fixture(scope="module")
def fulls(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four training steps of a tiny bf16 Llama, each moving 1% of the elements."""
    return bf16_training_steps(tmp_path_factory.mktemp("pipeline"), 3, seed=4)


@pytest.mark.asyncio
async def test_the_next_patch_is_prepared_while_the_engine_takes_one(
    fulls: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # How each patch was written: by how many threads, at what niceness (the real writer runs).
    written: dict[str, tuple[int | None, int]] = {}

    def prepare_patch(*args: Any, **kwargs: Any) -> Any:
        niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        written[kwargs["identity"]] = (kwargs["threads"], niceness)
        return arc_patch.prepare_patch(*args, **kwargs)

    monkeypatch.setattr("hotload_sidecar.sparse.prepare_patch", prepare_patch)
    base_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    trainer, staging = await step_0_published(fulls, tmp_path)
    async with serve(fulls[0], "step-000", dtype="bfloat16", numerics="fast") as client:
        engine = engine_of(client)
        loader, adapter, reporter = gated_loader(client, trainer, tmp_path, threads=2)
        stop = asyncio.Event()
        running = asyncio.create_task(loader.run(stop))
        try:
            # Step 1's patch goes to the engine, which does not answer yet; step 2 lands
            # meanwhile: its patch is written while the engine is busy.
            await step_2_while_the_engine_takes_step_1(trainer, adapter, reporter)
            await until(lambda: any(staging.glob("step-002.*.patch")))
            assert engine.served.identity == "step-000"
            assert (tmp_path / "weights" / "deltas" / "step-002").is_dir()

            adapter.gate.set()
            await until(lambda: reporter.status.identity == "step-002")
            ahead = [e["message"] for e in reporter.events if e["reason"] == "SnapshotLoaded"]
            # Step 3 after that, the engine idle: prepared as usual.
            await asyncio.to_thread(trainer.publish, 3)
            await until(lambda: reporter.status.identity == "step-003")
        finally:
            stop.set()
            await running
            await adapter.aclose()

    # Step 2's patch was sent as written, once: nothing prepared twice.
    assert adapter.asked == ["step-001", "step-002", "step-003"]
    assert engine.served.identity == "step-003"
    assert engine.patches is not None and engine.patches.report()["counters"]["patches"] == 3
    last = reporter.status.last_load
    assert last is not None and (last.method, last.steps) == ("sparse", 1)
    metrics = scraped(loader.metrics)
    assert metrics[("hotload_loader_patches_prepared_ahead_total", ())] == 1
    assert metrics[("hotload_loader_loads_total", (("method", "sparse"),))] == 3
    assert metrics[("hotload_loader_loads_total", (("method", "full"),))] == 0
    assert "prepared while the engine took the one before" in ahead[-1]
    assert "prepared while" not in ahead[0]
    loaded = [e["message"] for e in reporter.events if e["reason"] == "SnapshotLoaded"]
    assert "prepared while" not in loaded[-1]
    assert list(staging.glob("*.patch")) == []  # sent and deleted
    # Written ahead: one thread, less urgent than the engine's update under way; otherwise the
    # loader's threads at its own priority.
    assert written == {
        "step-001": (2, base_nice),
        "step-002": (1, min(base_nice + 10, 19)),
        "step-003": (2, base_nice),
    }


@pytest.mark.asyncio
async def test_a_loader_stopped_mid_patch_leaves_no_patch_prepared_ahead(
    fulls: list[Path], tmp_path: Path
) -> None:
    """Cancelled while the engine holds a patch and the next one is written: the loader waits
    for that writing and removes it; the delta it fetched stays committed on the volume."""
    trainer, staging = await step_0_published(fulls, tmp_path)
    async with serve(fulls[0], "step-000", dtype="bfloat16", numerics="fast") as client:
        loader, adapter, reporter = gated_loader(client, trainer, tmp_path)
        running = asyncio.create_task(loader.run(asyncio.Event()))
        try:
            await step_2_while_the_engine_takes_step_1(trainer, adapter, reporter)
            ahead = loader.flow.ahead
            assert ahead is not None
            await until(lambda: ahead.held is not None)
            running.cancel()  # the engine has not answered; the next patch is being written
            with pytest.raises(asyncio.CancelledError):
                await running
        finally:
            await adapter.aclose()
    assert list(staging.glob("*.patch*")) == []
    assert (tmp_path / "weights" / "deltas" / "step-002").is_dir()


def test_a_patch_prepared_for_another_parent_does_not_fit(
    fulls: list[Path], tmp_path: Path
) -> None:
    """A patch prepared ahead is sent only from the parent it was made for, and only while the
    deltas it holds begin the ones still to serve."""
    trainer = Trainer(
        Ledger(open_bucket(str(tmp_path / "b")), "policy"), fulls, tmp_path / "t", 100
    )
    for step in range(4):
        trainer.publish(step)
    e = trainer.published
    patch = tmp_path / "x.patch"
    patch.write_bytes(b"patch")
    ready = Prepared(e[2:4], "step-001", patch, None, 0, 0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]
    assert ready.fits(e[2:4])
    assert not ready.fits(e[2:3])  # it serves more than is left: nothing to send
    assert not ready.fits(e[1:4])  # the engine serves step-000, not the patch's parent
    first = Prepared(e[2:3], "step-001", patch, None, 0, 0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]
    assert first.fits(e[2:4])  # its first part: sent, the rest after it
    ready.discard()
    assert not patch.exists()


class RefusingAdapter(GatedAdapter):
    """A gated adapter whose engine refuses step-001, as a patch and in full, and records each
    patch it is sent: (identity, parent, the patch file)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.sent: list[tuple[str, str, str]] = []

    async def patch(self, req: LoadRequest, parent: str) -> LoadResult:
        self.asked.append(req.identity)
        await self.gate.wait()
        self.sent.append((req.identity, parent, Path(req.path).name))
        if req.identity == "step-001":
            raise EngineLoadError("refused step-001", engine="reference", url=self.url)
        return await ReferenceAdapter.patch(self, req, parent)

    async def load(self, req: LoadRequest) -> LoadResult:
        if req.identity == "step-001":
            raise EngineLoadError("refused step-001", engine="reference", url=self.url)
        return await super().load(req)


@pytest.mark.asyncio
async def test_a_patch_prepared_ahead_that_no_longer_fits_is_deleted_unsent(
    fulls: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real `PatchesAhead.take`: step-002's patch is written ahead from step-001 while the
    engine takes step-001, which it then refuses (as a patch and in full): the engine still serves
    step-000, so the next update needs step-001 and step-002 in one patch from step-000. The
    patch written ahead does not begin those deltas: it is deleted without being sent, and
    the patch from step-000 to the same target is a file of its own (named by its first
    delta), which the deletion of the one written ahead never touches."""
    discarded: list[tuple[str, str, str]] = []
    discard = Prepared.discard

    def watched(self: Prepared) -> None:
        discarded.append((self.parent, self.steps[-1].identity, self.patch.name))
        discard(self)

    monkeypatch.setattr(Prepared, "discard", watched)
    trainer, staging = await step_0_published(fulls, tmp_path)
    async with serve(fulls[0], "step-000", dtype="bfloat16", numerics="fast") as client:
        engine = engine_of(client)
        loader, adapter, reporter = gated_loader(client, trainer, tmp_path, kind=RefusingAdapter)
        assert isinstance(adapter, RefusingAdapter)
        running = asyncio.create_task(loader.run(asyncio.Event()))
        try:
            await step_2_while_the_engine_takes_step_1(trainer, adapter, reporter)
            await until(lambda: any(staging.glob("step-002.*.patch")))
            adapter.gate.set()
            await until(lambda: reporter.status.identity == "step-002")
        finally:
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            await adapter.aclose()
    assert engine.served.identity == "step-002"
    # Sent: step-001 (refused), then one patch of both deltas from step-000; never the patch
    # written ahead from step-001.
    assert [(i, p) for i, p, _ in adapter.sent] == [
        ("step-001", "step-000"),
        ("step-002", "step-000"),
    ]
    ahead = [
        name for parent, target, name in discarded if (parent, target) == ("step-001", "step-002")
    ]
    assert ahead, discarded
    assert not set(ahead) & {name for _, _, name in adapter.sent}, (ahead, adapter.sent)
    assert list(staging.glob("*.patch*")) == []
    assert scraped(loader.metrics)[("hotload_loader_patches_prepared_ahead_total", ())] == 0
