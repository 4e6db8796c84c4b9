"""The loader's status as the operator reads it: a failure stays with the snapshot it happened on.

In process: a real folder bucket and ledger, a loader whose engine is down (so a poll moves the
target without starting a rebuild), and the operator's pod parser on the annotation it writes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hotload.api.names import ANNOTATION_SNAPSHOT
from hotload_operator.reports import read_pod
from hotload_sidecar.status import LocalReporter
from support.loaders import loader_with_engine_down


def _pod(reporter: LocalReporter) -> dict[str, Any]:
    """The pod as the operator sees it, with the loader's annotation."""
    note = json.dumps(reporter.status.to_annotation())
    return {"metadata": {"name": "r0", "annotations": {ANNOTATION_SNAPSHOT: note}}}


def test_a_failure_is_not_reported_against_the_next_head(tmp_path: Path) -> None:
    loader, trainer, reporter = loader_with_engine_down(tmp_path)
    trainer.publish(0)
    trainer.publish(1)

    async def scenario() -> None:
        try:
            await steps()
        finally:
            await loader.adapter.aclose()

    async def steps() -> None:
        await loader.step()
        assert reporter.status.target_identity == "step-001"
        # The update to step-001 failed (as a rotten delta would make it).
        rot = OSError("stored bytes fail their CRC-32")
        await loader.failed("rebuild", rot, trainer.published[1])
        await loader.step()  # a poll with no new head: still failing step-001
        failing = read_pod(_pod(reporter))
        assert (failing.state, failing.target) == ("failed", "step-001")
        assert "step-001" in failing.message

        await asyncio.to_thread(trainer.publish, 2)
        await loader.step()  # the head moved on: the failure must not be pinned on step-002
        moved = read_pod(_pod(reporter))
        assert moved.target == "step-002"
        assert moved.state != "failed", reporter.status
        # What went wrong is still there to read, until an update succeeds.
        assert "step-001" in reporter.status.last_error

    asyncio.run(scenario())
