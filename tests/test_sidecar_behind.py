"""The loader's series the alerts read: `hotload_loader_behind_seconds` (how long the engine has
not served its target), `hotload_loader_publish_to_serving_seconds`, and the label values that
read 0 from the start (so `increase()` in an alert sees the first failure)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

from hotload.ledger.fields import utc_now
from hotload_sidecar.board import BehindClock
from hotload_sidecar.metrics import FAILURE_STAGES, SPARSE_FALLBACK_REASONS, LoaderMetrics
from support.loaders import loader_with_engine_down
from support.metrics import scraped


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_behind_counts_from_the_first_target_not_served_since() -> None:
    clock = Clock()
    behind = BehindClock(clock)
    behind.observe(None, None)  # nothing to serve yet
    assert behind.seconds() == 0
    behind.observe(None, "s1")  # starting: unavailable, not behind
    clock.now += 5
    assert behind.seconds() == 0
    behind.observe("s1", "s1")
    assert behind.seconds() == 0

    # A fast ledger: s2 seen at 105, s3 at 110 while s2 loads; serving s2 leaves s3 pending,
    # counted from when s3 was seen, not from when s2 was served.
    behind.observe("s1", "s2")
    clock.now += 5
    behind.observe("s1", "s3")
    clock.now += 3
    behind.observe("s2", "s3")
    assert behind.seconds() == 3
    # Still never at the head: s4 arrives before s3 is served; serving s3 counts from s4.
    clock.now += 2
    behind.observe("s2", "s4")
    clock.now += 4
    assert behind.seconds() == 9
    behind.observe("s3", "s4")
    assert behind.seconds() == 4
    # Skipping to the head drops everything older.
    behind.observe("s4", "s4")
    assert behind.seconds() == 0


def test_behind_follows_a_pin_back_and_forgets_nothing_that_matters() -> None:
    clock = Clock()
    behind = BehindClock(clock)
    behind.observe("s9", "s9")
    behind.observe("s9", "s5")  # pinned to an older snapshot: behind until it serves s5
    clock.now += 7
    assert behind.seconds() == 7
    behind.observe("s5", "s5")
    assert behind.seconds() == 0
    # A replica stuck for longer than KEEP heads: still measured from the first one.
    start = clock.now
    for i in range(BehindClock.KEEP * 2):
        clock.now += 1
        behind.observe("s5", f"h{i}")
    assert behind.seconds() == clock.now - (start + 1)
    assert len(behind._pending) == BehindClock.KEEP


def test_label_values_start_at_zero_and_publish_to_serving_clamps_skew() -> None:
    metrics = LoaderMetrics()
    samples = scraped(metrics)
    for stage in FAILURE_STAGES:
        assert samples[("hotload_loader_failures_total", (("stage", stage),))] == 0
    for reason in SPARSE_FALLBACK_REASONS:
        assert samples[("hotload_loader_sparse_fallbacks_total", (("reason", reason),))] == 0
    for method in ("full", "sparse"):
        assert samples[("hotload_loader_loads_total", (("method", method),))] == 0
    metrics.observe_serving(1.0, utc_now() - timedelta(seconds=42))
    metrics.observe_serving(1.0, utc_now() + timedelta(seconds=30))  # a publisher's clock ahead
    samples = scraped(metrics)
    count = ("hotload_loader_publish_to_serving_seconds_count", ())
    assert samples[count] == 2
    total = samples[("hotload_loader_publish_to_serving_seconds_sum", ())]
    assert 42 <= total < 60


def test_a_loader_whose_engine_is_down_reads_behind_at_each_scrape(tmp_path: Path) -> None:
    """A real loader (folder bucket, engine gone after serving step-000): once a poll names a
    head the engine does not serve, behind_seconds grows between scrapes without another poll."""
    loader, trainer, _ = loader_with_engine_down(tmp_path)
    name = ("hotload_loader_behind_seconds", ())
    trainer.publish(0)

    async def serve_then_poll() -> None:
        await loader.board.publish()
        await loader.step()
        assert loader.status.target_identity == "step-000" and loader.status.identity is None
        assert scraped(loader.metrics)[name] == 0  # starting: not behind
        # As `_served` leaves the board once the engine confirmed step-000.
        await loader.board.set(identity="step-000", sequence=1, state="idle")
        assert scraped(loader.metrics)[name] == 0
        await asyncio.to_thread(trainer.publish, 1)
        await loader.step()

    asyncio.run(serve_then_poll())
    assert loader.status.target_identity == "step-001" and loader.status.identity == "step-000"
    first = scraped(loader.metrics)[name]
    assert first > 0
    # Later scrapes read later values with no poll between (a loader stuck in a long fetch
    # publishes nothing meanwhile).
    time.sleep(0.05)
    later = scraped(loader.metrics)[name]
    assert later >= first + 0.05, (first, later)
