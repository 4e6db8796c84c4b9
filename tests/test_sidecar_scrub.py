"""A scrub that finds the served weights changed behind the engine's back: the replica says so
(Degraded, with the tensor) and its loader reloads the snapshot in full.

In process, for real: a folder bucket and ledger, the loader (`Loader.run`), the reference
engine behind a real aiohttp server with its scrub on, a tiny Llama whose steps move 1% of the
elements (`support.tiny_llm`). The bit is flipped in the engine's own tensor, as a memory error
would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import make_adapter
from hotload_sidecar.loader import Loader
from hotload_sidecar.status import LocalReporter, ReplicaStatus
from support.engines import engine_of, serve
from support.fleet import Trainer, wait_until
from support.tiny_llm import build_tiny_llm, sparse_steps


class Recorder(LocalReporter):
    """Keeps every status the loader published, not just the last."""

    def __init__(self) -> None:
        super().__init__(keep_events=500)
        self.history: list[ReplicaStatus] = []

    async def report(self, status: ReplicaStatus) -> None:
        """Remember `status` too."""
        self.history.append(status)
        await super().report(status)


async def until(what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
    """`wait_until` with two minutes' patience (the loader runs in the same loop)."""
    return await wait_until(what, check, timeout, interval=0.05)


@pytest.mark.asyncio
async def test_a_flipped_bit_marks_the_replica_degraded_and_reloads_it_in_full(
    tmp_path: Path,
) -> None:
    base = build_tiny_llm(tmp_path / "m", 0, cast="BF16").snapshots[0]
    fulls, _ = sparse_steps(base, tmp_path / "s", 1, fraction=0.01)
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    trainer = Trainer(ledger, fulls, tmp_path / "trainer", full_every=100)
    await asyncio.to_thread(trainer.publish, 0)
    async with serve(
        fulls[0], "step-000", scrub_bytes_per_second=1 << 30, scrub_period_seconds=0.5
    ) as client:
        engine = engine_of(client)
        settings = Settings(
            ledger_url=f"{tmp_path / 'bucket'}/policy",
            weights_dir=tmp_path / "weights",
            engine_url=str(client.make_url("")).rstrip("/"),
            poll_seconds=0.1,
            hint_ttl_seconds=0,
            retry_seconds=0.2,
        )
        reporter = Recorder()
        adapter = make_adapter("reference", settings.engine_url)
        loader = Loader(settings, ledger=ledger, adapter=adapter, reporter=reporter)
        stop = asyncio.Event()
        running = asyncio.create_task(loader.run(stop))
        try:
            await until("step-000 served", lambda: loader.status.identity == "step-000")
            await asyncio.to_thread(trainer.publish, 1)
            await until("step-001 served", lambda: loader.status.identity == "step-001")
            assert loader.status.last_load is not None
            assert loader.status.last_load.method == "sparse"
            # The engine counted the patch's writes itself; the loader reports them.
            assert loader.status.last_load.engine_patched_elements > 0
            clean = await until(
                "a clean scrub after the patch",
                lambda: (s := loader.status.last_scrub) and s["result"] == "ok" and s,
            )
            assert clean["bytes"] > 0 and loader.status.reason == "Current"
            loads = engine.loads

            # A bit flips in the engine's memory.
            name = "model.layers.0.mlp.down_proj.weight"
            with torch.no_grad():
                engine.runner.targets[name].view(-1).view(torch.int32)[7] ^= 1 << 27

            degraded = await until(
                "the Degraded report",
                lambda: next((s for s in reporter.history if s.degraded), None),
            )
            assert degraded.reason == "Degraded" and not degraded.ready
            assert degraded.degraded_reason == "ScrubMismatch"
            assert name in degraded.degraded
            events = [e for e in reporter.events if e["reason"] == "WeightsDegraded"]
            assert len(events) == 1 and name in events[0]["message"]
            # The loader reloads step-001 in full; the replica is healthy again.
            await until(
                "the full reload",
                lambda: engine.loads > loads and not loader.status.degraded,
            )
            status = loader.status
            assert status.identity == "step-001" and status.reason == "Current" and status.ready
            assert status.last_load is not None and status.last_load.method == "full"
            assert engine.patches is not None
            assert engine.patches.patcher.scrub_state()["mismatch"] is None
            metrics = loader.metrics.render().decode()
            assert "hotload_loader_scrub_mismatches_total 1.0" in metrics
            assert "hotload_loader_degraded 0.0" in metrics
            # The reloaded weights are step-001's, bit for bit: the scrub agrees again.
            await until(
                "a clean scrub after the reload",
                lambda: (s := loader.status.last_scrub) and s["result"] == "ok",
            )
        finally:
            stop.set()
            await running
            await adapter.aclose()
