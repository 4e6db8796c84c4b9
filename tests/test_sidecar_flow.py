"""The loader's update flow (`updates.UpdateFlow`) and its paths, driven directly: which path an
update takes (one sparse patch, a full load), where each fallback leads, the scrub's full
reload, resuming from the volume at start-up, compaction after a patch, and the patch prepared
ahead (`ahead.PatchesAhead`).

In one process, for real: a folder bucket with a real ledger, real arc_v2 deltas of a tiny bf16
Llama, the reference engine behind its aiohttp server (`support.engines.serve`) and a real
`Loader` as the flow's `Replica` (the production one). The loader's own loop serves step-000,
then stops; each test publishes and calls the flow itself, so nothing else moves meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hotload.api.names import LoadFailureReasons
from hotload.bucket import Bucket, open_bucket
from hotload.engine import Engine
from hotload.ledger import Ledger, LedgerEntry
from hotload_sidecar import sparse as sparse_module
from hotload_sidecar.ahead import PatchesAhead
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import ReferenceAdapter
from hotload_sidecar.engines.base import PatchRefusedError
from hotload_sidecar.loader import Loader
from hotload_sidecar.sparse import Prepared, SparseLoads
from hotload_sidecar.status import LocalReporter, ReplicaStatus
from support.engines import engine_of, serve
from support.fleet import Trainer, wait_until
from support.metrics import scraped
from support.snapshots import flip_payload_byte
from support.tiny_llm import bf16_training_steps


@pytest.fixture(scope="module")
def fulls(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four training steps of a tiny bf16 Llama, each moving 1% of the elements."""
    return bf16_training_steps(tmp_path_factory.mktemp("flow"), 3, seed=7)


class RefusingPatches(ReferenceAdapter):
    """The reference engine's adapter, whose engine says it cannot take patches now."""

    async def check_sparse(self) -> None:
        raise PatchRefusedError(
            "the engine takes no patches now",
            reason="engine_unsupported",
            engine="reference",
            url=self.url,
            status=None,
        )


class StateLog(LocalReporter):
    """A reporter that also keeps the state and target of every status published: the
    transient states (`fetching`, `loading`) are replaced before a test could read them."""

    def __init__(self) -> None:
        super().__init__(keep_events=500)
        self.states: list[tuple[str, str | None]] = []

    async def report(self, status: ReplicaStatus) -> None:
        """Note `status`'s state and target, then keep it as the latest."""
        self.states.append((status.state, status.target_identity))
        await super().report(status)

    def since(self, start: int) -> list[tuple[str, str | None]]:
        """The states published from the `start`-th on, each repeat of the one before left out."""
        out: list[tuple[str, str | None]] = []
        for state in self.states[start:]:
            if not out or out[-1] != state:
                out.append(state)
        return out


@dataclass
class Served:
    """A loader whose engine serves step-000, its trainer, engine and reporter."""

    loader: Loader
    trainer: Trainer
    engine: Engine
    reporter: StateLog
    url: str
    tmp_path: Path

    async def publish(self, step: int, *, full: bool = False) -> LedgerEntry:
        """Publish `step` (a delta of the step before unless `full`) and bring the loader's
        copy of the ledger up to it."""
        await asyncio.to_thread(self.trainer.publish, step, full=full)
        await self.loader.refresh_ledger()
        return self.trainer.published[-1]

    def loads(self) -> dict[str, float]:
        """The loader's confirmed loads by method, and its sparse fallbacks by reason."""
        out: dict[str, float] = {}
        for (name, labels), value in scraped(self.loader.metrics).items():
            if name == "hotload_loader_loads_total":
                out[dict(labels)["method"]] = value
            elif name == "hotload_loader_sparse_fallbacks_total" and value:
                out["fallback:" + dict(labels)["reason"]] = value
        return out

    def another(self, weights: Path, **options: Any) -> Loader:
        """A second loader for the same engine and ledger on the weights folder `weights`."""
        settings = _settings(self.tmp_path, self.url, weights=weights, **options)
        adapter = ReferenceAdapter(self.url)
        return Loader(
            settings, ledger=self.trainer.ledger, adapter=adapter, reporter=LocalReporter()
        )


def _settings(tmp_path: Path, url: str, *, weights: Path | None = None, **options: Any) -> Settings:
    return Settings(
        ledger_url=f"{tmp_path / 'bucket'}/policy",
        weights_dir=weights or tmp_path / "weights",
        engine_url=url,
        hint_ttl_seconds=0,
        poll_seconds=0.05,
        retry_seconds=30.0,
        **options,
    )


@asynccontextmanager
async def serving_step_0(
    fulls: list[Path],
    tmp_path: Path,
    *,
    kind: type[ReferenceAdapter] = ReferenceAdapter,
    **options: Any,
) -> AsyncIterator[Served]:
    """A loader (`Settings` `options`) whose engine serves step-000, its own loop stopped."""
    trainer = Trainer(
        Ledger(open_bucket(str(tmp_path / "bucket")), "policy"), fulls, tmp_path / "t", 100
    )
    await asyncio.to_thread(trainer.publish, 0)
    async with serve(fulls[0], "step-000", dtype="bfloat16", numerics="fast") as client:
        url = str(client.make_url("")).rstrip("/")
        adapter = kind(url)
        reporter = StateLog()
        loader = Loader(
            _settings(tmp_path, url, **options),
            ledger=trainer.ledger,
            adapter=adapter,
            reporter=reporter,
        )
        stop = asyncio.Event()
        running = asyncio.create_task(loader.run(stop))
        try:
            await wait_until(
                "step-000 served", lambda: reporter.status.identity == "step-000", 60.0
            )
        finally:
            stop.set()
            await running
        try:
            yield Served(loader, trainer, engine_of(client), reporter, url, tmp_path)
        finally:
            await adapter.aclose()


def _events(served: Served) -> list[str]:
    return [e["reason"] for e in served.reporter.events]


def _event(served: Served, reason: str) -> tuple[str, str]:
    """The type and message of the last Event of `reason`."""
    last = [e for e in served.reporter.events if e["reason"] == reason][-1]
    return last["type"], last["message"]


@pytest.mark.asyncio
async def test_the_deltas_after_the_served_snapshot_go_as_one_sparse_patch(
    fulls: list[Path], tmp_path: Path
) -> None:
    async with serving_step_0(fulls, tmp_path) as s:
        await s.publish(1)
        head = await s.publish(2)
        start = len(s.reporter.states)
        await s.loader.flow.update(head)
        assert s.engine.served.identity == "step-002"
        assert s.loads() == {"full": 0, "sparse": 1}
        # Fetching the deltas, the engine taking the patch, then done: each names the head.
        assert s.reporter.since(start) == [
            ("fetching", "step-002"),
            ("loading", "step-002"),
            ("idle", "step-002"),
        ]
        status = s.reporter.status
        assert (status.identity, status.state) == ("step-002", "idle")
        assert status.last_load is not None and status.last_load.method == "sparse"
        weights = s.loader.weights
        # Kept as deltas after the snapshot, nothing rebuilt.
        assert weights.local_deltas() == {"step-001", "step-002"}
        assert not weights.has("step-002")
        assert weights.current() == "step-000"
        kind, message = _event(s, "SnapshotLoaded")
        assert kind == "Normal" and message.startswith("serving step-002 ")
        assert "sparse patch of step-000 over 2 deltas" in message


@pytest.mark.asyncio
async def test_a_full_snapshot_on_the_way_is_loaded_in_full(
    fulls: list[Path], tmp_path: Path
) -> None:
    async with serving_step_0(fulls, tmp_path) as s:
        head = await s.publish(1, full=True)
        start = len(s.reporter.states)
        await s.loader.flow.update(head)
        assert s.engine.served.identity == "step-001"
        assert s.loads() == {"full": 1, "sparse": 0}
        assert s.reporter.since(start) == [
            ("fetching", "step-001"),
            ("loading", "step-001"),
            ("idle", "step-001"),
        ]
        last = s.reporter.status.last_load
        assert last is not None and (last.method, last.sparse_fallback) == ("full", "")
        assert s.loader.weights.current() == "step-001"
        assert "SparseLoadFellBack" not in _events(s)


@pytest.mark.asyncio
async def test_a_delta_too_dense_for_one_patch_is_loaded_in_full(
    fulls: list[Path], tmp_path: Path
) -> None:
    """1% of the elements changed, a patch may change one in a billion: the full load."""
    async with serving_step_0(fulls, tmp_path, sparse_max_changed=1e-9) as s:
        head = await s.publish(1)
        await s.loader.flow.update(head)
        assert s.engine.served.identity == "step-001"
        assert s.loads() == {"full": 1, "sparse": 0, "fallback:too_dense": 1}
        last = s.reporter.status.last_load
        assert last is not None and (last.method, last.sparse_fallback) == ("full", "too_dense")
        kind, message = _event(s, "SparseLoadFellBack")
        assert kind == "Normal" and "step-001" in message
        assert s.loader.weights.current() == "step-001"


@pytest.mark.asyncio
async def test_a_patch_the_engine_refuses_is_loaded_in_full(
    fulls: list[Path], tmp_path: Path
) -> None:
    async with serving_step_0(fulls, tmp_path, kind=RefusingPatches) as s:
        head = await s.publish(1)
        await s.loader.flow.update(head)
        assert s.engine.served.identity == "step-001"
        assert s.loads() == {"full": 1, "sparse": 0, "fallback:engine_unsupported": 1}
        last = s.reporter.status.last_load
        assert last is not None and last.sparse_fallback == "engine_unsupported"


@pytest.mark.asyncio
async def test_a_full_volume_fails_the_update_and_says_so(
    fulls: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every download refused by the volume (ENOSPC): the sparse load falls back, the full
    load fails, the engine keeps step-000 and the status names the full volume; with room
    again, the next update serves the head. (Once the loop crashed on it.)"""
    async with serving_step_0(fulls, tmp_path) as s:
        head = await s.publish(1)
        real = Bucket.download_file_async

        async def full(self: Bucket, *args: Any, **kwargs: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(Bucket, "download_file_async", full)
        await s.loader.flow.update(head)
        assert s.engine.served.identity == "step-000"
        assert s.loads().get("fallback:write_failed") == 1
        status = s.reporter.status
        assert status.failure_reason == LoadFailureReasons.VOLUME_FULL
        assert "No space left on device" in status.last_error
        monkeypatch.setattr(Bucket, "download_file_async", real)
        await s.loader.flow.update(head)
        assert s.engine.served.identity == "step-001"


@pytest.mark.asyncio
async def test_a_patch_folds_the_deltas_once_they_add_up(fulls: list[Path], tmp_path: Path) -> None:
    async with serving_step_0(fulls, tmp_path, compact_fraction=1e-9) as s:
        head = await s.publish(1)
        await s.loader.flow.update(head)
        assert s.loads()["sparse"] == 1
        await s.loader.volume.settle()
        weights = s.loader.weights
        assert weights.has("step-001") and weights.current() == "step-001"
        assert _event(s, "VolumeCompacted") == (
            "Normal",
            "the deltas on the volume were folded into step-001",
        )
        assert weights.local_deltas() == set()  # folded, then collected


@pytest.mark.asyncio
async def test_a_fold_that_fails_is_reported_and_the_engine_keeps_serving(
    fulls: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """step-001's delta rotten on the volume and gone from the bucket once step-001 is
    served: the fold after step-002's patch cannot be made. The loader counts a compact
    failure, raises a Warning naming the fold and logs it; the engine serves step-002, the
    status is not failed (the update succeeded) and `current` stays step-000."""
    async with serving_step_0(fulls, tmp_path) as s:
        first = await s.publish(1)
        await s.loader.flow.update(first)  # the default fraction: nothing folded yet
        weights = s.loader.weights
        assert weights.local_deltas() == {"step-001"}
        flip_payload_byte(weights.delta_path("step-001"))
        bucket = tmp_path / "bucket"
        for stored in list(bucket.rglob("*")):
            if stored.is_file() and "step-001" in stored.relative_to(bucket).parts:
                stored.unlink()
        s.loader.volume.compact_fraction = 1e-9
        head = await s.publish(2)
        with caplog.at_level(logging.ERROR, "hotload_sidecar.loader"):
            await s.loader.flow.update(head)
            await s.loader.volume.settle()
        assert s.engine.served.identity == "step-002"
        assert s.loads() == {"full": 0, "sparse": 2}
        failures = scraped(s.loader.metrics)
        assert failures[("hotload_loader_failures_total", (("stage", "compact"),))] == 1
        kind, message = _event(s, "CompactionFailed")
        assert kind == "Warning"
        assert message.startswith("compacting the deltas on the volume into step-002 failed: ")
        assert "step-001" in message  # the error says which delta it could not read
        assert message in caplog.text
        assert "VolumeCompacted" not in _events(s)
        status = s.reporter.status
        assert (status.identity, status.state) == ("step-002", "idle")
        # Engine restarts still boot the snapshot the volume verified.
        assert not weights.has("step-002") and weights.current() == "step-000"


@pytest.mark.asyncio
async def test_a_scrub_reload_loads_the_served_snapshot_in_full(
    fulls: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving_step_0(fulls, tmp_path) as s:
        before = s.engine.loads
        with caplog.at_level(logging.WARNING, "hotload_sidecar.loader"):
            assert await s.loader.flow.reload_served("its weights changed")
        assert "reloading step-000 in full: its weights changed" in caplog.text
        assert s.engine.loads == before + 1
        assert s.loads() == {"full": 1, "sparse": 0}
        # A snapshot backing off after a failure is not reloaded until its retry is due.
        s.loader.backoff.failed("step-000")
        assert not await s.loader.flow.reload_served("again")
        assert s.engine.loads == before + 1
        # A loader that serves nothing yet has nothing to reload.
        idle = s.another(tmp_path / "idle")
        idle.weights.prepare()
        await idle.refresh_ledger()
        assert idle.status.identity is None
        assert not await idle.flow.reload_served("its weights changed")
        assert s.engine.loads == before + 1
        await idle.adapter.aclose()


@pytest.mark.asyncio
async def test_start_up_resumes_from_the_volume_else_builds_the_head(
    fulls: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving_step_0(fulls, tmp_path) as s:
        head = await s.publish(1)
        await s.loader.flow.update(head)
        assert s.loader.weights.local_deltas() == {"step-001"}
        # A restarted loader on the same volume: step-000 plus the delta, nothing fetched.
        again = s.another(tmp_path / "weights")
        again.weights.prepare()
        await again.refresh_ledger()
        started = time.perf_counter()
        with caplog.at_level(logging.INFO, "hotload_sidecar.loader"):
            assert await again.flow.start(head)
        elapsed = time.perf_counter() - started
        assert again.status.resumed_from == "step-001"
        assert scraped(again.metrics)[("hotload_loader_bytes_fetched_total", ())] == 0
        said = f"step-001 (sequence {head.sequence}) was on the volume from an earlier run "
        said += "(snapshot step-000 plus 1 delta(s))"
        assert any(r.getMessage().startswith(f"resumed: {said}") for r in caplog.records)
        assert isinstance(again.reporter, LocalReporter)
        resumed = [e for e in again.reporter.events if e["reason"] == "ResumedFromVolume"]
        assert [(e["type"], e["message"].startswith(said)) for e in resumed] == [("Normal", True)]
        # The checks' seconds, within the start's own, are the ones the Event reports.
        verify = again.status.resume_verify_seconds
        assert verify is not None and 0 <= verify <= round(elapsed, 3)
        # The message rounds the seconds to 2 places, the status to 3 (0.0049 reads 0.00 there
        # and 0.005 here): the same measure within the message's rounding.
        shown = re.search(r" and verified in (\d+\.\d\d)s: ", resumed[0]["message"])
        assert shown is not None, resumed[0]["message"]
        assert abs(float(shown.group(1)) - verify) <= 0.0051
        # A loader on an empty volume builds the head (its engine runs: `current` is set).
        fresh = s.another(tmp_path / "fresh")
        fresh.weights.prepare()
        await fresh.refresh_ledger()
        assert await fresh.flow.start(head)
        assert fresh.status.resumed_from is None
        assert fresh.weights.has("step-001")
        assert scraped(fresh.metrics)[("hotload_loader_bytes_fetched_total", ())] > 0
        # Pinned to step-001 with the volume holding deltas up to the head step-002: it
        # resumes to the pin, not the head.
        await s.loader.flow.update(await s.publish(2))
        assert s.loader.weights.local_deltas() == {"step-001", "step-002"}
        pinned = s.another(tmp_path / "weights", pin="step-001")
        pinned.weights.prepare()
        await pinned.refresh_ledger()
        target = pinned.target().entry
        assert target is not None and target.identity == "step-001"
        assert await pinned.flow.start(target)
        assert pinned.status.resumed_from == "step-001"
        for loader in (again, fresh, pinned):
            await loader.adapter.aclose()


def _ahead(s: Served) -> PatchesAhead:
    ahead = s.loader.flow.ahead
    assert ahead is not None
    return ahead


def _sparse(s: Served) -> SparseLoads:
    sparse = s.loader.sparse
    assert sparse is not None
    return sparse


@pytest.mark.asyncio
async def test_the_ledger_is_followed_while_the_engine_takes_a_patch(
    fulls: list[Path], tmp_path: Path
) -> None:
    """With the head two deltas past step-000 while the engine takes step-001, the follower
    prepares step-002's patch from step-001; with the head at step-001, it only waits."""
    async with serving_step_0(fulls, tmp_path) as s:
        first = await s.publish(1)
        ahead = _ahead(s)
        patching: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ahead.look_ahead(first, patching)
        await asyncio.sleep(0.2)  # a few polls: nothing past step-001 yet
        assert ahead.held is None
        second = await s.publish(2)
        await wait_until("step-002 prepared", lambda: ahead.held is not None, 30.0)
        assert ahead.held is not None and ahead.held[0] == "step-002"
        patching.cancel()
        await ahead.stop_following(cancel=False)
        got = await ahead.take([second])
        assert isinstance(got, Prepared)
        assert ([e.identity for e in got.steps], got.parent) == (["step-002"], "step-001")
        assert got.patch.is_file()
        got.discard()


@pytest.mark.asyncio
async def test_a_patch_prepared_ahead_is_taken_only_when_it_begins_the_deltas(
    fulls: list[Path], tmp_path: Path
) -> None:
    async with serving_step_0(fulls, tmp_path) as s:
        first = await s.publish(1)
        second = await s.publish(2)
        ahead = _ahead(s)
        sparse = _sparse(s)
        staging = s.loader.weights.staging_root
        assert await ahead.take([first, second]) is None  # nothing prepared
        # Written from step-001 while the engine still serves step-000: it does not fit, and
        # is waited for and removed.
        ahead.held = ("step-002", asyncio.create_task(sparse.prepare([second])))
        assert await ahead.take([first, second]) is None
        assert ahead.held is None
        assert list(staging.glob("*.patch*")) == []
        # The same patch when the engine serves step-001: it is the update's.
        ahead.held = ("step-002", asyncio.create_task(sparse.prepare([second])))
        got = await ahead.take([second])
        assert isinstance(got, Prepared) and got.patch.is_file()
        got.discard()
        # Stopping removes a patch still held.
        ahead.held = ("step-002", asyncio.create_task(sparse.prepare([second])))
        await ahead.drop()
        assert ahead.held is None
        assert list(staging.glob("*.patch*")) == []


@pytest.mark.asyncio
async def test_an_update_sends_the_patch_prepared_ahead_for_its_deltas(
    fulls: list[Path], tmp_path: Path
) -> None:
    """A patch of step-001 written ahead while the engine serves step-000: the update of
    step-001 sends it as it is (counted as prepared ahead) and it is gone from staging."""
    async with serving_step_0(fulls, tmp_path) as s:
        first = await s.publish(1)
        await _update_beside_a_patch_ahead(s, first, first)
        assert scraped(s.loader.metrics)[("hotload_loader_patches_prepared_ahead_total", ())] == 1
        assert _ahead(s).held is None


async def _update_beside_a_patch_ahead(s: Served, ahead: LedgerEntry, target: LedgerEntry) -> None:
    """Hold the patch of the delta `ahead` as prepared ahead (under way), update to `target`:
    the engine serves it and no patch file is left in staging."""
    _ahead(s).held = (ahead.identity, asyncio.create_task(_sparse(s).prepare([ahead])))
    await s.loader.flow.update(target)
    assert s.engine.served.identity == target.identity
    assert list(s.loader.weights.staging_root.glob("*.patch*")) == []


@pytest.mark.asyncio
async def test_a_target_backing_off_is_not_prepared_ahead(
    fulls: list[Path], tmp_path: Path
) -> None:
    """The head step-002 failed a moment ago and waits for its retry: following the ledger
    while the engine takes step-001 prepares nothing for it."""
    async with serving_step_0(fulls, tmp_path) as s:
        first = await s.publish(1)
        ahead = _ahead(s)
        s.loader.backoff.failed("step-002")
        await s.publish(2)
        patching: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ahead.look_ahead(first, patching)
        await asyncio.sleep(0.5)  # ten polls
        assert ahead.held is None
        patching.cancel()
        await ahead.stop_following(cancel=False)
        assert ahead.held is None


@pytest.mark.asyncio
async def test_a_failure_ahead_is_logged_and_never_the_updates(
    fulls: list[Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Following the ledger fails with an error the loop does not expect, and the patch
    written ahead fails: each is a warning naming the error, `take` hands the update no
    patch (it prepares its own) and nothing is left in staging. Stopping while the follower
    still runs ends it."""
    async with serving_step_0(fulls, tmp_path) as s:
        first = await s.publish(1)
        second = await s.publish(2)
        ahead = _ahead(s)
        sparse = _sparse(s)

        async def broken() -> None:
            raise RuntimeError("the ledger copy broke")

        real = s.loader.refresh_ledger
        monkeypatch.setattr(s.loader, "refresh_ledger", broken)
        patching: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with caplog.at_level(logging.WARNING, "hotload_sidecar.loader"):
            ahead.look_ahead(first, patching)
            await asyncio.sleep(0.05)  # its first read of the ledger
            patching.cancel()
            await ahead.stop_following(cancel=False)
        assert "following the ledger ahead failed: the ledger copy broke" in caplog.text
        monkeypatch.setattr(s.loader, "refresh_ledger", real)

        def writer_broke(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the patch writer broke")

        monkeypatch.setattr(sparse_module, "prepare_patch", writer_broke)
        ahead.held = ("step-002", asyncio.create_task(sparse.prepare([second])))
        with caplog.at_level(logging.WARNING, "hotload_sidecar.loader"):
            assert await ahead.take([second]) is None
        assert "preparing the next patch ahead failed: the patch writer broke" in caplog.text
        assert list(s.loader.weights.staging_root.glob("*.patch*")) == []
        # The loader stops while the follower waits for the engine: it ends, nothing held.
        patching = asyncio.get_running_loop().create_future()
        ahead.look_ahead(first, patching)
        await asyncio.sleep(0.1)
        await ahead.drop()
        assert ahead.held is None
        patching.cancel()


@pytest.mark.asyncio
async def test_a_patch_prepared_ahead_that_does_not_fit_spoils_no_download_of_the_update(
    fulls: list[Path], tmp_path: Path
) -> None:
    """A patch of step-002 written from step-001 while the engine still serves step-000 (the
    patch to step-001 failed) is still fetching step-002 when the update of step-002 begins:
    the update's own patch of both deltas serves step-002, never a full load. (Left to run
    beside the update, the two fetches of step-002 shared one download folder and the update
    fell back to a full load, write_failed or delta_not_verified, in 2 of 3 runs.)"""
    async with serving_step_0(fulls, tmp_path) as s:
        await s.publish(1)
        second = await s.publish(2)
        await _update_beside_a_patch_ahead(s, second, second)
        assert s.loads() == {"full": 0, "sparse": 1}


@pytest.mark.asyncio
async def test_a_restart_boots_a_resumed_snapshot_only_when_no_engine_runs(
    fulls: list[Path], tmp_path: Path
) -> None:
    """The volume holds the head step-001 (a full snapshot, built) while `current` still
    names step-000, which the engine serves (the previous run stopped before loading it). A
    restarted loader resumes step-001 either way; with its engine running, `current` stays
    what the engine serves; with no engine up, `current` moves to step-001, which the engine
    then boots."""
    async with serving_step_0(fulls, tmp_path) as s:
        head = await s.publish(1, full=True)
        document = s.loader.document
        assert document is not None
        await s.loader.materializer.build(document, head.identity)
        weights = s.loader.weights
        assert weights.has("step-001") and weights.current() == "step-000"
        live = s.another(tmp_path / "weights")
        await live.refresh_ledger()
        assert await live.flow.start(head)
        assert live.status.resumed_from == "step-001"
        assert weights.current() == "step-000"
        await live.adapter.aclose()
        # The same volume, the engine down (nothing listens on its port).
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            down = f"http://127.0.0.1:{sock.getsockname()[1]}"
        settings = _settings(tmp_path, down, weights=tmp_path / "weights")
        booting = Loader(
            settings,
            ledger=s.trainer.ledger,
            adapter=ReferenceAdapter(down),
            reporter=LocalReporter(),
        )
        await booting.refresh_ledger()
        assert await booting.flow.start(head)
        assert booting.status.resumed_from == "step-001"
        assert weights.current() == "step-001"
        await booting.adapter.aclose()


@pytest.mark.asyncio
async def test_a_patch_ahead_that_could_not_be_made_leaves_the_update_its_own_attempt(
    fulls: list[Path], tmp_path: Path
) -> None:
    """A patch may change one element in a billion: the patch of step-001 written ahead is
    refused as too dense (an `Outcome`, not a patch). The update is handed no patch, makes
    its own attempt, falls back for the same reason and loads step-001 in full."""
    async with serving_step_0(fulls, tmp_path, sparse_max_changed=1e-9) as s:
        first = await s.publish(1)
        await _update_beside_a_patch_ahead(s, first, first)
        assert s.loads() == {"full": 1, "sparse": 0, "fallback:too_dense": 1}
        last = s.reporter.status.last_load
        assert last is not None and (last.method, last.sparse_fallback) == ("full", "too_dense")
        assert scraped(s.loader.metrics)[("hotload_loader_patches_prepared_ahead_total", ())] == 0


@pytest.mark.asyncio
async def test_a_failed_update_still_keeps_the_volume_to_its_snapshots(
    fulls: list[Path], tmp_path: Path
) -> None:
    """The loader serves full snapshot step-001 (step-000 still kept: `--keep 2`); its deltas
    are too dense to patch, and step-003's is corrupt in the bucket, so the full build of
    step-003 fails, having committed step-002 on the way. The volume still holds the newest
    two snapshots only: collecting is part of every update, not only of one that succeeded
    (the 1,000-step soak held three full snapshots while its replicas failed behind a
    corrupted delta)."""
    async with serving_step_0(fulls, tmp_path, sparse_max_changed=1e-9) as s:
        await s.loader.flow.update(await s.publish(1, full=True))
        weights = s.loader.weights
        assert weights.local() == {"step-000", "step-001"} and weights.current() == "step-001"
        await s.publish(2)
        head = await s.publish(3)
        flip_payload_byte(tmp_path / "bucket" / "step-003")
        await s.loader.flow.update(head)
        assert s.engine.served.identity == "step-001"
        assert s.reporter.status.last_error  # the update failed, and says so
        assert "step-002" in weights.local()  # the build got that far
        assert len(weights.local()) <= s.loader.settings.keep
        assert {"step-001", "step-002"} <= weights.local() and weights.current() == "step-001"
