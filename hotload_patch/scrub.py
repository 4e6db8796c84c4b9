"""The scrub: the served weights re-read once per period, at a bounded rate, and compared with
their checksums.

After a patch the engine's served checksums are derived from the patch (the region sums staging
computed), not re-read; what could make them wrong (a bit flipped in memory, a write nobody told
the engine about) is found by the scrub: a background thread that reads every region the engine
holds and compares its partial sums with the derived ones. Its job is to find such rot within a
bounded time, so it is scheduled by a period: a pass begins `period` seconds after the one
before began (or after the weights were loaded in full, whose own checksum read is as good as
a pass), reads at most `rate` bytes per second, and the thread rests in between. A model too
large to read within the period at that rate is read back to back (the cap wins; each pass's
`seconds` says so). It never delays a delta: it waits while a patch is staging, and a region a
write touched while it was being read is read again. A mismatch is kept (`ScrubState.mismatch`)
until the weights are loaded in full again; until then the engine refuses patches (their parent
check would rest on sums the weights no longer match).

A region the scrub cannot compare (no expected sums for it, or it cannot be read as its
checkpoint dtype) is not read and not counted: the pass ends `skipped` (not `ok`), names each
such tensor with its cause, and logs a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hotload_patch.checkpoint import Specs
from hotload_patch.dtypes import ELEMENT_SIZE
from hotload_patch.errors import PatchError
from hotload_patch.placement import Host, Slot
from hotload_patch.scrub_defaults import DEFAULT_SCRUB_PERIOD, DEFAULT_SCRUB_RATE
from hotload_patch.served import Counters, Meter, ReadStoppedError, slot_sum
from hotload_patch.sums import Region

log = logging.getLogger("hotload_patch.scrub")

#: Skipped regions a pass names (the count covers them all).
MAX_SKIPPED_NAMED = 16


class Subject(Protocol):
    """What a scrub reads: the weights, the sums they should have, and whether to wait."""

    host: Host
    counters: Counters

    def scrub_target(self) -> tuple[int, Specs, dict[tuple[str, Region], tuple[int, int]]] | None:
        """(epoch, specs, expected sums by tensor and region), or None while none are known."""

    def epoch(self) -> int:
        """Bumped before and after every change of the weights (odd while one is under way)."""

    def busy(self) -> bool:
        """Whether a patch is staging or being written (the scrub waits)."""

    def scrub_found(self, mismatch: dict[str, Any]) -> None:
        """A region's sums differ from the expected ones at an unchanged epoch."""


def check_schedule(rate: float, period: float) -> None:
    """Raise `ValueError` naming the setting when `rate` (bytes per second, 0: no scrub) or
    `period` (seconds between passes) cannot schedule a scrub."""
    if not rate >= 0:
        raise ValueError(f"the scrub's rate must be >= 0 bytes per second (0: off), not {rate!r}")
    if not period > 0 or period == float("inf"):
        raise ValueError(f"the scrub's period must be a positive number of seconds, not {period!r}")


@dataclass
class ScrubState:
    """What the scrub did: passes completed (by result: `mismatches` and `skips` of them did
    not end `ok`), regions it could not compare, the last pass, a mismatch if one was found,
    and when the next pass is due."""

    rate: float
    period: float = DEFAULT_SCRUB_PERIOD
    passes: int = 0
    mismatches: int = 0
    skips: int = 0
    skipped_regions: int = 0
    last: dict[str, Any] | None = None
    mismatch: dict[str, Any] | None = None
    started: float | None = None
    done_bytes: int = 0
    total_bytes: int = 0
    next_pass: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The state as JSON (times in seconds since the epoch)."""
        return {
            "rate_bytes_per_second": self.rate,
            "period_seconds": self.period,
            "passes": self.passes,
            "mismatches": self.mismatches,
            "skips": self.skips,
            "skipped_regions": self.skipped_regions,
            "last": self.last,
            "mismatch": self.mismatch,
            "next": self.next_pass,
            "current": None
            if self.started is None
            else {"started": self.started, "bytes": self.done_bytes, "total": self.total_bytes},
        }


@dataclass(frozen=True)
class _Verdict:
    """One region compared: `mismatch_epoch` (its sums differ, read at that epoch), or why it
    was `skipped` (not compared); neither when it matches."""

    mismatch_epoch: int | None = None
    skipped: str = ""


@dataclass
class Scrubber:
    """The scrub thread of one engine (rank): a pass every `period` seconds at most `rate`
    bytes per second; `rate` 0 turns it off."""

    subject: Subject
    rate: float = DEFAULT_SCRUB_RATE
    initializer: Callable[[], None] | None = None
    sleep: Callable[[float], None] = time.sleep
    period: float = DEFAULT_SCRUB_PERIOD
    state: ScrubState = field(init=False)

    def __post_init__(self) -> None:
        check_schedule(self.rate, self.period)
        self.state = ScrubState(self.rate, self.period)
        self._wake = threading.Condition()
        self._stop = False
        self._restart = False
        self._thread: threading.Thread | None = None
        # When the period runs from (monotonic): the last pass's start or full load; None
        # before either (the first pass then begins as soon as there are sums to compare).
        self._since: float | None = None

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hotload-scrub", daemon=True)
            self._thread.start()

    def set_rate(self, rate: float) -> None:
        """Read at most `rate` bytes per second from now on (0: stop scrubbing)."""
        self.set_schedule(rate=rate)

    def set_schedule(self, *, rate: float | None = None, period: float | None = None) -> None:
        """Change the cap (`rate`, bytes per second; 0: off) or the `period` (seconds from one
        pass's start to the next's); the next pass is due a new period after the last began."""
        with self._wake:
            rate = self.rate if rate is None else float(rate)
            period = self.period if period is None else float(period)
            check_schedule(rate, period)
            self.rate = self.state.rate = rate
            self.period = self.state.period = period
            self._wake.notify_all()

    def restart(self) -> None:
        """The weights were loaded in full (their checksums are read from them now): drop the
        pass under way; the next begins a period from now."""
        with self._wake:
            self._restart = True
            self._since = time.monotonic()
            self.state.mismatch = None
            self._wake.notify_all()

    def stop(self) -> None:
        """End the thread (a read under way stops at its next chunk)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def snapshot(self) -> dict[str, Any]:
        """The state as JSON."""
        with self._wake:
            return self.state.to_json()

    # --- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.initializer is not None:
            self.initializer()
        while True:
            if not self._rest():
                return
            try:
                self._pass()
            except ReadStoppedError:
                continue
            except Exception as exc:  # a failing read is reported, never kills the thread
                self._finish("failed", 0, time.time(), message=f"{type(exc).__name__}: {exc}")

    def _rest(self) -> bool:
        """Wait until a pass is due (on, no standing mismatch, a period since the last began);
        then start its clock. False when the thread must end."""
        with self._wake:
            while not self._stop:
                wait: float | None = None
                if self.rate > 0 and self.state.mismatch is None:
                    now = time.monotonic()
                    due = now if self._since is None else self._since + self.period
                    if due <= now:
                        break
                    wait = due - now
                    self.state.next_pass = time.time() + wait
                else:
                    self.state.next_pass = None
                self._wake.wait(wait)
            if self._stop:
                return False
            self._restart = False
            self._since = time.monotonic()
            self.state.next_pass = None
            return True

    def _pass(self) -> None:
        _, specs, _ = self._target()
        slots: list[tuple[Slot, tuple[int, ...], str, int]] = []
        for name, (shape, dtype) in specs.items():
            for slot in self.subject.host.place(name, shape, dtype):
                slots.append((slot, shape, dtype, slot.src.numel * ELEMENT_SIZE[dtype]))
        started = time.time()
        with self._wake:
            self.state.started = started
            self.state.done_bytes = 0
            self.state.total_bytes = sum(s[3] for s in slots)
        total = 0
        skipped: list[dict[str, Any]] = []
        clock = _Pace(self, time.monotonic())
        for slot, shape, dtype, nbytes in slots:
            verdict = self._compare(slot, shape, dtype, clock)
            if verdict.mismatch_epoch is not None:
                self._mismatch(slot, verdict.mismatch_epoch, started, total)
                return
            if verdict.skipped:
                skipped.append(
                    {
                        "tensor": slot.tensor,
                        "parameter": slot.param,
                        "bytes": nbytes,
                        "cause": verdict.skipped,
                    }
                )
                continue  # not read: not counted as read
            total += nbytes
            with self._wake:
                self.state.done_bytes = total
        if skipped:
            self._skipped(skipped, total, started)
        else:
            self._finish("ok", total, started)

    def _compare(self, slot: Slot, shape: tuple[int, ...], dtype: str, clock: _Pace) -> _Verdict:
        """Read one region and compare it with its expected sums."""
        while True:
            epoch, _, expected = self._target()
            if self._restarted():
                # A full load came after this pass began (the first pass of a thread started
                # before the load): it counts as the pass, so not a byte is read for this one.
                raise ReadStoppedError("the weights were loaded in full")
            want = expected.get((slot.tensor, slot.src))
            if want is None:
                return _Verdict(
                    skipped="no expected checksums for this region (the engine's checksums do "
                    "not cover it: a layout it no longer holds, or a load it was not told about)"
                )
            meter = Meter(
                self.subject.counters,
                "scrub_bytes",
                pace=clock.pacer(epoch),
                chunk_elements=max(1 << 16, int(self.rate) // 8),
            )
            try:
                got = slot_sum(self.subject.host, slot, shape, dtype, meter)
            except ReadStoppedError:
                if self._restarted():
                    raise
                continue  # the weights changed under the read: read the region again
            except PatchError as exc:
                if self.subject.epoch() != epoch:
                    continue  # changed under the read: read it again
                if exc.reason == "parent_mismatch":
                    return _Verdict(mismatch_epoch=epoch)
                return _Verdict(
                    skipped=f"cannot be read as its checkpoint's {dtype} ({exc.reason}): {exc}"
                )
            if self.subject.epoch() != epoch:
                continue
            return _Verdict(mismatch_epoch=epoch) if (got.a, got.b) != want else _Verdict()

    def _skipped(self, skipped: list[dict[str, Any]], nbytes: int, started: float) -> None:
        names = ", ".join(f"{s['tensor']!r} ({s['cause']})" for s in skipped[:MAX_SKIPPED_NAMED])
        more = len(skipped) - MAX_SKIPPED_NAMED
        message = (
            f"{len(skipped)} region(s) of the served weights were not compared, so this pass "
            f"proves nothing of them: {names}{f' and {more} more' if more > 0 else ''}; "
            "loading the snapshot in full checksums them again"
        )
        log.warning("scrub: %s", message)
        with self._wake:
            self.state.skips += 1
            self.state.skipped_regions += len(skipped)
        self._finish(
            "skipped",
            nbytes,
            started,
            message=message,
            tensor=skipped[0]["tensor"],
            skipped=skipped[:MAX_SKIPPED_NAMED],
            skipped_bytes=sum(int(s["bytes"]) for s in skipped),
        )

    def _target(self) -> tuple[int, Specs, dict[tuple[str, Region], tuple[int, int]]]:
        while True:
            target = self.subject.scrub_target()
            if target is not None and target[0] % 2 == 0:
                return target
            self._check_stop()
            with self._wake:  # the sums are being read (a full load): look again shortly
                if not self._stop and not self._restart:
                    self._wake.wait(0.2)

    def _restarted(self) -> bool:
        with self._wake:
            return self._restart or self._stop

    def _check_stop(self) -> None:
        if self._restarted():
            raise ReadStoppedError

    def _mismatch(self, slot: Slot, epoch: int, started: float, total: int) -> None:
        message = (
            f"tensor {slot.tensor!r} (parameter {slot.param}) does not hold what its checksums "
            "say: the weights changed in memory since they were last written (a flipped bit, or "
            "a write the engine was not told about); load the snapshot in full"
        )
        found: dict[str, Any] = {
            "tensor": slot.tensor,
            "parameter": slot.param,
            "message": message,
            "epoch": epoch,
        }
        self.subject.scrub_found(found)
        with self._wake:
            self.state.mismatch = found
            self.state.mismatches += 1
        self._finish("mismatch", total, started, message=message, tensor=slot.tensor)

    def _finish(
        self,
        result: str,
        nbytes: int,
        started: float,
        *,
        message: str = "",
        tensor: str | None = None,
        **more: Any,
    ) -> None:
        finished = time.time()
        with self._wake:
            if result != "failed":
                self.state.passes += 1
            self.state.last = {
                "result": result,
                "started": started,
                "finished": finished,
                "seconds": round(finished - started, 3),
                "bytes": nbytes,
                "tensor": tensor,
                "message": message,
                **more,
            }
            self.state.started = None


class _Pace:
    """Sleeps so that a pass reads at most `rate` bytes per second; stops the read when the
    weights change, a patch stages, or the scrub restarts."""

    def __init__(self, scrubber: Scrubber, began: float) -> None:
        self.scrubber = scrubber
        self.began = began
        self.budget = 0.0

    def pacer(self, epoch: int) -> Callable[[int], None]:
        def pace(nbytes: int) -> None:
            s = self.scrubber
            rate = s.rate
            if rate > 0:
                self.budget += nbytes / rate
                delay = self.began + self.budget - time.monotonic()
                if delay > 0:
                    s.sleep(delay)
            while s.subject.busy():
                s._check_stop()
                s.sleep(0.05)
                # Time spent waiting for a patch is not owed to the rate.
                self.began = time.monotonic() - self.budget
            s._check_stop()
            if s.subject.epoch() != epoch:
                raise ReadStoppedError

        return pace


def mismatch_error(found: dict[str, Any]) -> PatchError:
    """The refusal of a patch while a scrub mismatch stands."""
    return PatchError(
        f"a scrub found the served weights differ from their checksums ({found['message']})",
        reason="parent_mismatch",
        tensor=found.get("tensor"),
    )
