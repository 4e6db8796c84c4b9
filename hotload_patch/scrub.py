"""The scrub: the served weights re-read at a bounded rate and compared with their checksums.

After a patch the engine's served checksums are derived from the patch (the region sums staging
computed), not re-read; what could make them wrong (a bit flipped in memory, a write nobody told
the engine about) is found by the scrub: a background thread that reads every region the engine
holds, at most `rate` bytes per second, and compares its partial sums with the derived ones. It
never delays a delta: it waits while a patch is staging, and a region a write touched while it
was being read is read again. A mismatch is kept (`ScrubState.mismatch`) until the weights are
loaded in full again; until then the engine refuses patches (their parent check would rest on
sums the weights no longer match).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hotload_patch.checkpoint import Specs
from hotload_patch.dtypes import ELEMENT_SIZE
from hotload_patch.errors import PatchError
from hotload_patch.placement import Host, Slot
from hotload_patch.served import Counters, Meter, ReadStoppedError, slot_sum
from hotload_patch.sums import Region

#: Bytes per second a scrub reads when nobody says otherwise: a 1 GiB model is re-read every
#: 16 s, 140 GB (a 70B model in bfloat16, over all ranks) in under 40 min; on a CPU about a
#: twentieth of one core.
DEFAULT_SCRUB_RATE = 64 << 20
#: A pass takes at least this long (a small model would otherwise be re-read back to back,
#: its per-region overhead unbounded by the byte rate).
MIN_PASS_SECONDS = 1.0


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


@dataclass
class ScrubState:
    """What the scrub did: passes completed, the last one, and a mismatch if one was found."""

    rate: float
    passes: int = 0
    mismatches: int = 0
    last: dict[str, Any] | None = None
    mismatch: dict[str, Any] | None = None
    started: float | None = None
    done_bytes: int = 0
    total_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The state as JSON (times in seconds since the epoch)."""
        return {
            "rate_bytes_per_second": self.rate,
            "passes": self.passes,
            "mismatches": self.mismatches,
            "last": self.last,
            "mismatch": self.mismatch,
            "current": None
            if self.started is None
            else {"started": self.started, "bytes": self.done_bytes, "total": self.total_bytes},
        }


@dataclass
class Scrubber:
    """The scrub thread of one engine (rank); `rate` 0 turns it off."""

    subject: Subject
    rate: float = DEFAULT_SCRUB_RATE
    initializer: Callable[[], None] | None = None
    sleep: Callable[[float], None] = time.sleep
    state: ScrubState = field(init=False)

    def __post_init__(self) -> None:
        self.state = ScrubState(self.rate)
        self._wake = threading.Condition()
        self._stop = False
        self._restart = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hotload-scrub", daemon=True)
            self._thread.start()

    def set_rate(self, rate: float) -> None:
        """Read at most `rate` bytes per second from now on (0: stop scrubbing)."""
        with self._wake:
            self.rate = self.state.rate = max(0.0, float(rate))
            self._wake.notify_all()

    def restart(self) -> None:
        """The weights were loaded in full: start a new pass (the one under way is moot)."""
        with self._wake:
            self._restart = True
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
            with self._wake:
                while not self._stop and (self.rate <= 0 or self.state.mismatch is not None):
                    self._wake.wait(1.0)
                if self._stop:
                    return
                self._restart = False
            began = time.monotonic()
            try:
                self._pass()
            except ReadStoppedError:
                continue
            except Exception as exc:  # a failing read is reported, never kills the thread
                self._finish("failed", 0, time.time(), message=f"{type(exc).__name__}: {exc}")
                self._idle(5.0)
                continue
            self._idle(MIN_PASS_SECONDS - (time.monotonic() - began))

    def _idle(self, seconds: float) -> None:
        with self._wake:
            if not self._stop and not self._restart and seconds > 0:
                self._wake.wait(seconds)

    def _pass(self) -> None:
        target = self._target()
        epoch, specs, _ = target
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
        clock = _Pace(self, time.monotonic())
        for slot, shape, dtype, nbytes in slots:
            while True:
                epoch, _, expected = self._target()
                want = expected.get((slot.tensor, slot.src))
                if want is None:
                    break  # the engine no longer holds this region: nothing to compare
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
                    if exc.reason != "parent_mismatch" or self.subject.epoch() != epoch:
                        break  # the region changed its dtype or layout: the next load settles it
                    self._mismatch(slot, epoch, started, total)
                    return
                if self.subject.epoch() != epoch:
                    continue
                if (got.a, got.b) != want:
                    self._mismatch(slot, epoch, started, total)
                    return
                break
            total += nbytes
            with self._wake:
                self.state.done_bytes = total
        self._finish("ok", total, started)

    def _target(self) -> tuple[int, Specs, dict[tuple[str, Region], tuple[int, int]]]:
        while True:
            target = self.subject.scrub_target()
            if target is not None and target[0] % 2 == 0:
                return target
            self._check_stop()
            self._idle(0.2)

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
