"""The replica status a loader keeps (`hotload_sidecar.board.StatusBoard`), rule by rule: part of
`make mutate`'s `board` selection (tests/README.md "Mutation testing"). Each expected status is
written from the changes the test makes, never read back from the board first."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest

from hotload.errors import HotloadError
from hotload_sidecar.board import QUIET_SECONDS, StatusBoard
from hotload_sidecar.materialize import BuildResult
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.status import LoadTimings, LocalReporter, ReplicaStatus
from support.operator import ledger_entries

ENTRIES = ledger_entries(4, datetime(2026, 11, 29, 12, 0, tzinfo=UTC), digits=3)


def _logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the loader's logger said (not another test's leftovers, such as asyncio's warning
    about a session collected late)."""
    return [r.getMessage() for r in caplog.records if r.name == "hotload_sidecar.loader"]


def _board() -> tuple[StatusBoard, LocalReporter]:
    reporter = LocalReporter()
    return StatusBoard(reporter, LoaderMetrics()), reporter


@pytest.mark.asyncio
async def test_a_target_sets_its_identity_and_sequence() -> None:
    board, reporter = _board()
    await board.set(identity="step-001", sequence=2, state="idle", target=ENTRIES[3])
    s = reporter.status
    assert (s.target_identity, s.target_sequence) == ("step-003", ENTRIES[3].sequence)
    assert s.staleness == ENTRIES[3].sequence - 2


@pytest.mark.asyncio
async def test_a_failure_is_published_with_its_message_and_reason_until_cleared() -> None:
    board, reporter = _board()
    await board.set(identity="step-001", sequence=2, state="idle", target=ENTRIES[2])
    await board.failed("fetch of step-002 failed: 503", "FetchFailed")
    s = reporter.status
    assert (s.state, s.message, s.last_error, s.failure_reason) == (
        "failed",
        "fetch of step-002 failed: 503",
        "fetch of step-002 failed: 503",
        "FetchFailed",
    )
    # A later success clears the error: its reason goes with it.
    await board.set(state="idle", last_error="")
    assert (reporter.status.last_error, reporter.status.failure_reason) == ("", "")


@pytest.mark.asyncio
async def test_a_failure_is_about_its_target_and_reads_idle_once_the_target_moves() -> None:
    board, reporter = _board()
    await board.set(identity="step-001", sequence=2, state="idle", target=ENTRIES[2])
    await board.failed("rebuild of step-002 failed", "RebuildFailed")
    # A change that names no state and no new target keeps the failure.
    await board.set(last_poll_time="t")
    assert reporter.status.state == "failed"
    # The head moved on: the pod must not read as failing the new target.
    await board.set(target=ENTRIES[3])
    assert (reporter.status.state, reporter.status.target_identity) == ("idle", "step-003")
    assert reporter.status.last_error == "rebuild of step-002 failed"  # kept until a success


@pytest.mark.asyncio
async def test_a_failure_while_serving_the_target_reads_idle() -> None:
    """A failure reported for a target the engine already serves (a probe after the load) does
    not make the replica read as failing its target."""
    board, reporter = _board()
    await board.set(identity="step-002", sequence=3, state="failed", target=ENTRIES[2])
    assert (reporter.status.state, reporter.status.loaded) == ("idle", True)


@pytest.mark.asyncio
async def test_an_engine_down_may_not_serve_once_the_replica_served_something() -> None:
    board, _ = _board()
    await board.set(identity="step-001", sequence=2, state="idle", target=ENTRIES[1])
    assert board.may_serve().serve
    board.engine_live = False
    verdict = board.may_serve()
    assert not verdict.serve
    assert "the engine went down" in verdict.reason


class _Refusing(LocalReporter):
    """A reporter whose API refuses every report (a transient failure it must survive)."""

    async def report(self, status: ReplicaStatus) -> None:
        raise HotloadError("the API server answered 503")


@pytest.mark.asyncio
async def test_a_report_that_fails_is_logged_and_never_stops_the_loader(
    caplog: pytest.LogCaptureFixture,
) -> None:
    board = StatusBoard(_Refusing(), LoaderMetrics())
    with caplog.at_level(logging.WARNING, logger="hotload_sidecar.loader"):
        await board.set(identity="step-001", sequence=2, state="idle", target=ENTRIES[1])
    assert board.status.identity == "step-001"  # kept, published again on the next change
    assert _logged(caplog) == ["report failed: the API server answered 503"]


@pytest.mark.asyncio
async def test_a_build_resumed_from_the_volume_is_reported_with_its_check(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    board, reporter = _board()
    built = BuildResult(
        "step-002", 3, tmp_path, None, timings=LoadTimings(verify_seconds=1.23456), resumed=True
    )
    with caplog.at_level(logging.INFO, logger="hotload_sidecar.loader"):
        await board.record_build(built)
    assert (reporter.status.resumed_from, reporter.status.resume_verify_seconds) == (
        "step-002",
        1.235,
    )
    (event,) = reporter.events
    assert (event["type"], event["reason"]) == ("Normal", "ResumedFromVolume")
    assert event["message"] == (
        "step-002 (sequence 3) was on the volume from an earlier run and verified in 1.23s: "
        "nothing downloaded"
    )
    assert _logged(caplog) == [f"built {event['message']}"]


@pytest.mark.asyncio
async def test_a_build_not_resumed_changes_no_status_and_sends_no_event(tmp_path: Path) -> None:
    board, reporter = _board()
    await board.record_build(BuildResult("step-002", 3, tmp_path, "step-001"))
    assert (reporter.status.resumed_from, reporter.events) == (None, [])


class _Recording(LocalReporter):
    """A reporter that keeps every status it is handed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[ReplicaStatus] = []
        self.synced = True

    @property
    def in_sync(self) -> bool:
        return self.synced

    async def report(self, status: ReplicaStatus) -> None:
        self.reports.append(status)
        await super().report(status)


@pytest.mark.asyncio
async def test_scrub_progress_alone_is_reported_at_most_once_a_quiet_interval() -> None:
    """A scrub moving on every step (its last pass, the engine's counters) while nothing else
    changes: the reporter gets news once per `QUIET_SECONDS`, each time the newest pass, and
    the counters alone never move `updatedTime`; any other change is reported at once."""
    clock = [0.0]
    reporter = _Recording()
    board = StatusBoard(reporter, LoaderMetrics(), clock=lambda: clock[0])
    await board.set(identity="step-001", sequence=2, state="idle", target=ENTRIES[1])
    steps = 180
    for second in range(1, steps + 1):  # one loader step a second
        clock[0] = float(second)
        await board.set(last_scrub={"passes": second}, engine_counters={"scrub_bytes": second})
        await board.republish()
    news = [s for i, s in enumerate(reporter.reports) if i == 0 or s != reporter.reports[i - 1]]
    assert len(news) == 1 + steps // int(QUIET_SECONDS), [s.last_scrub for s in news]
    assert [s.last_scrub for s in news[1:]] == [
        {"passes": n} for n in range(int(QUIET_SECONDS), steps + 1, int(QUIET_SECONDS))
    ]
    assert board.status.engine_counters == {"scrub_bytes": steps}  # the local /status has it
    stamped = board.status.updated_time
    await board.set(engine_counters={"scrub_bytes": steps + 1})
    assert board.status.updated_time == stamped  # counters are no news
    clock[0] += 1
    await board.set(target=ENTRIES[2])  # the head moved: at once
    assert reporter.reports[-1].target_identity == ENTRIES[2].identity
    # A reporter whose last write failed is never held back: the scrub's news goes at once.
    reporter.synced = False
    clock[0] += 1
    await board.set(last_scrub={"passes": steps + 1})
    assert reporter.reports[-1].last_scrub == {"passes": steps + 1}


@pytest.mark.asyncio
async def test_a_report_that_failed_is_handed_over_again_at_the_next_step() -> None:
    """Level-triggered: a status whose report raised is handed to the reporter again by the
    next `republish`, though nothing changed since."""

    class _Flaky(_Recording):
        down = True

        async def report(self, status: ReplicaStatus) -> None:
            if self.down:
                raise HotloadError("the API server answered 503")
            await super().report(status)

    reporter = _Flaky()
    board = StatusBoard(reporter, LoaderMetrics())
    await board.set(identity="step-001", sequence=2, state="idle", target=ENTRIES[1])
    assert reporter.reports == []
    reporter.down = False
    await board.republish()
    assert [s.identity for s in reporter.reports] == ["step-001"]
