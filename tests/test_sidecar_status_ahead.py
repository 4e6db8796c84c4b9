"""What a loader's status says while the next patch is prepared ahead (issue 36: the 300-step
soak saw every loader hold `staging/step-00016.11.patch` while its status said `idle` on step 9,
target step 9, for seconds).

In one process: the loader (`Loader.run`, polling the ledger every `POLL` seconds, no head
handoff: as during the soak's API-server outage), a real reference engine, a folder bucket with
a real ledger and real arc_v2 deltas of a tiny Llama. The engine's patches wait at the gate of
`GatedAdapter`, and the patch writer (`prepare_patch`, the real one) is held by the test, so the
test decides when the engine answers and when the patch prepared ahead is finished: the engine
answers step-001 while the patch of step-002..003 is still being prepared.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hotload.arc import patch as arc_patch
from hotload_operator.reports import read_pod
from hotload_operator.rollup import rollup_deployment
from hotload_sidecar.board import Ahead, StatusBoard
from hotload_sidecar.kube_report import build_pod_metadata_patch
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.status import LocalReporter, ReplicaStatus
from support.engines import engine_of, serve
from support.operator import deployment, ledger_entries
from support.operator import status_condition as cond
from support.pipeline import gated_loader, step_0_published, until
from support.tiny_llm import bf16_training_steps

#: The loader's poll interval: what an update ready to go waits for without a head handoff.
POLL = 0.5


class Statuses(LocalReporter):
    """A reporter that keeps every status the board publishes, with when (monotonic)."""

    def __init__(self) -> None:
        super().__init__(keep_events=500)
        self.seen: list[tuple[float, ReplicaStatus]] = []

    async def report(self, status: ReplicaStatus) -> None:
        """Note `status` and when, then keep it as the latest."""
        self.seen.append((time.monotonic(), status))
        await super().report(status)

    def states(self, start: int) -> list[tuple[str, str | None, str | None]]:
        """(state, served identity, target) of each status published from the `start`-th on,
        each repeat of the one before left out."""
        out: list[tuple[str, str | None, str | None]] = []
        for _, s in self.seen[start:]:
            now = (s.state, s.identity, s.target_identity)
            if not out or out[-1] != now:
                out.append(now)
        return out


class HeldWriter:
    """`prepare_patch` as the loader calls it (the real writer), held at two points: the patch
    of step-001 before it is written (so that the deltas after it land first), the patch of
    step-003 after it is written (the preparation ahead stays under way, its file in staging)."""

    def __init__(self) -> None:
        self.before_first = threading.Event()
        self.after_ahead = threading.Event()
        self.entered: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        identity = kwargs["identity"]
        self.entered.append(identity)
        if identity == "step-001":
            self.before_first.wait(60)
        stats = arc_patch.prepare_patch(*args, **kwargs)
        if identity == "step-003":
            self.after_ahead.wait(60)
        return stats

    def release(self) -> None:
        """Let every held writer go (the test ends, or failed)."""
        self.before_first.set()
        self.after_ahead.set()


@pytest.mark.asyncio
async def test_a_replica_preparing_its_next_patch_says_so_not_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine answers step-001 while the patch of step-002 and step-003 (published while it
    took step-001) is being prepared: from that answer until step-003 is served, every status
    says the replica serves step-001 and is on its way to step-003 (`fetching`, then `loading`),
    never `idle` on step-001 (before the fix: idle, target step-001, until the next poll)."""
    # Four training steps of a tiny bf16 Llama, each moving 1% of the elements.
    fulls = await asyncio.to_thread(bf16_training_steps, tmp_path / "steps", 3, seed=5)
    writer = HeldWriter()
    monkeypatch.setattr("hotload_sidecar.sparse.prepare_patch", writer)
    trainer, staging = await step_0_published(fulls, tmp_path)
    async with serve(fulls[0], "step-000", dtype="bfloat16", numerics="fast") as client:
        engine = engine_of(client)
        reporter = Statuses()
        loader, adapter, _ = gated_loader(
            client, trainer, tmp_path, reporter=reporter, poll_seconds=POLL, poll_jitter=0.0
        )
        stop = asyncio.Event()
        running = asyncio.create_task(loader.run(stop))
        try:
            await until(lambda: reporter.status.identity == "step-000")
            await asyncio.to_thread(trainer.publish, 1)
            # Step-001's patch is being written: the two deltas after it land meanwhile, so the
            # loader's first look at the ledger while the engine takes step-001 sees both.
            await until(lambda: "step-001" in writer.entered)
            await asyncio.to_thread(trainer.publish, 2)
            await asyncio.to_thread(trainer.publish, 3)
            writer.before_first.set()
            await until(lambda: adapter.asked == ["step-001"])
            await until(lambda: any(staging.glob("step-003.*.patch")))
            adapter.gate.set()  # the engine answers step-001; step-003's patch is still held
            await until(lambda: reporter.status.identity == "step-001")
            answered = time.monotonic()
            # Several polls pass with the preparation under way, its patch in staging.
            await asyncio.sleep(4 * POLL)
            assert any(staging.glob("step-003.*.patch")), sorted(staging.iterdir())
            assert "step-003" in writer.entered and not writer.after_ahead.is_set()
            writer.after_ahead.set()
            await until(lambda: reporter.status.identity == "step-003")
            assert loader.board.ahead is None  # taken by the update that sent it
        finally:
            writer.release()
            stop.set()
            await running
            await adapter.aclose()

    # From the poll that read step-001 on (the polls before it published idle on step-000).
    start = next(i for i, (_, s) in enumerate(reporter.seen) if s.target_identity == "step-001")
    # Seconds from the engine's answer to step-001, and what each status said.
    timeline = "\n".join(
        f"{t - answered:+.3f}s {s.state} serving {s.identity} target {s.target_identity}"
        for t, s in reporter.seen[start:]
    )
    # The patch written ahead was sent as it was: the engine was asked for two patches.
    assert adapter.asked == ["step-001", "step-003"], timeline
    assert engine.served.identity == "step-003"
    assert list(staging.glob("*.patch")) == []
    assert reporter.states(start) == [
        ("idle", "step-000", "step-001"),  # the poll that read step-001, its update next
        ("fetching", "step-000", "step-001"),
        ("loading", "step-000", "step-001"),
        ("fetching", "step-001", "step-003"),
        ("loading", "step-001", "step-003"),
        ("idle", "step-003", "step-003"),
    ], timeline
    # The engine's answer: serving step-001, updating to step-003: not loaded, its condition
    # says Updating.
    held = next(s for _, s in reporter.seen if s.identity == "step-001")
    assert (held.state, held.identity, held.target_identity) == ("fetching", "step-001", "step-003")
    assert (held.loaded, held.ready, held.reason) == (False, True, "Updating")
    assert held.staleness == 2

    # The operator's roll-up of that pod: the replica serves step-001 and is fetching step-003,
    # it is not counted as updated, and the roll-out is in progress.
    meta: dict[str, Any] = {"name": "r0", "labels": {"hotload.dev/deployment": "fleet"}}
    meta.update(build_pod_metadata_patch(held)["metadata"])
    pod = read_pod(
        {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    entries = ledger_entries(4, datetime(2026, 11, 28, 12, 0, tzinfo=UTC), digits=3)
    rolled = rollup_deployment(
        deployment(replicas=1), [pod], entries[-1], entries, now=entries[-1].published_time
    )
    replica = rolled["replicaStatuses"][0]
    assert (replica["snapshot"], replica["state"], replica["loaded"]) == (
        "step-001",
        "fetching",
        False,
    )
    assert rolled["updatedReplicas"] == 0 and rolled["targetSnapshot"] == "step-003"
    assert cond(rolled, "Progressing")["status"] == "True"
    assert "1 replica(s) loading step-003" in cond(rolled, "Progressing")["message"]


@pytest.mark.asyncio
async def test_the_board_shows_a_patch_prepared_ahead_only_while_it_is_the_next_update() -> None:
    """The board's rule alone: `idle` on the snapshot a patch prepared ahead begins at reads
    `fetching` towards that patch's target; `idle` again once the target is what is served
    (a pin back to it), and never for a patch of another parent or once the patch is taken."""
    e = ledger_entries(4, datetime(2026, 11, 28, 12, 0, tzinfo=UTC), digits=3)
    reporter = LocalReporter()
    board = StatusBoard(reporter, LoaderMetrics())

    async def look(**changes: Any) -> tuple[str, str | None, str | None]:
        await board.set(**changes)
        s = reporter.status
        return s.state, s.identity, s.target_identity

    assert await look(identity="step-001", sequence=2, state="loading", target=e[1]) == (
        "loading", "step-001", "step-001",
    )  # fmt: skip
    board.ahead = Ahead("step-001", e[3])
    # Loading still: the rule changes only what would read idle.
    assert await look(message="") == ("loading", "step-001", "step-001")
    assert await look(state="idle") == ("fetching", "step-001", "step-003")
    assert reporter.status.reason == "Updating"
    # A change that says nothing of the state keeps it.
    assert await look(last_poll_time="t") == ("fetching", "step-001", "step-003")
    # The target moved back to what the engine serves (pinned): idle, current.
    assert await look(target=e[1]) == ("idle", "step-001", "step-001")
    assert reporter.status.reason == "Current"
    # An explicit failed state is kept.
    assert await look(target=e[3], state="failed") == ("failed", "step-001", "step-003")
    # A patch of another parent than the one served is not the next update.
    board.ahead = Ahead("step-002", e[3])
    assert await look(state="idle") == ("idle", "step-001", "step-003")
    board.ahead = Ahead("step-001", e[3])
    assert await look(state="idle") == ("fetching", "step-001", "step-003")
    # Taken (or dropped): the next status without a state of its own reads idle again.
    board.ahead = None
    assert await look(last_poll_time="u") == ("idle", "step-001", "step-003")
