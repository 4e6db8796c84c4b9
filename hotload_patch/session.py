"""`Patcher`: one engine's sparse-load state, for whichever process holds the weights.

It keeps the checksums of the served weights: read in full in a background thread after a full
load (while the new weights serve), and after every patch *derived* from the patch (each region's
sums moved by what staging computed the patch changes there), so a patch costs what it changed,
never a re-read of the model. A rate-limited scrub (`scrub`) re-reads the weights in the
background and compares them with those sums; a mismatch is kept until the next full load, and
patches are refused meanwhile. The Patcher stages one patch at a time in its background thread,
writes it when asked (the engine pauses around that call), and keeps the last write's old
values until the next load so that a failure elsewhere (another rank, the confirmation) can put
them back. `counters` counts what all of that read and wrote.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hotload_patch.checkpoint import Specs
from hotload_patch.errors import PatchError
from hotload_patch.placement import Host
from hotload_patch.scrub import Scrubber, mismatch_error
from hotload_patch.scrub_defaults import DEFAULT_SCRUB_PERIOD, DEFAULT_SCRUB_RATE
from hotload_patch.served import Counters, Meter, served_sums
from hotload_patch.staging import Staged, apply, stage, undo
from hotload_patch.sums import MOD, Region, RegionSum


def derive(served: list[RegionSum], deltas: list[RegionSum]) -> list[RegionSum]:
    """The served region sums after a patch whose per-region changes are `deltas`."""
    moved: dict[tuple[str, Region], tuple[int, int]] = {}
    for d in deltas:
        a, b = moved.get((d.tensor, d.region), (0, 0))
        moved[(d.tensor, d.region)] = (a + d.a, b + d.b)
    out = []
    for s in served:
        da, db = moved.get((s.tensor, s.region), (0, 0))
        out.append(RegionSum(s.tensor, s.region, (s.a + da) % MOD, (s.b + db) % MOD))
    return out


class Patcher:
    """Served checksums, a staged patch, the last write and the scrub of one engine (see the
    module docstring)."""

    def __init__(
        self,
        host: Host,
        *,
        initializer: Callable[[], None] | None = None,
        scrub_rate: float = DEFAULT_SCRUB_RATE,
        scrub_period: float = DEFAULT_SCRUB_PERIOD,
    ) -> None:
        """`initializer` runs first in the background threads (an engine lowers their priority
        there, so that checksums, staging and the scrub yield the CPU to generation);
        `scrub_rate` bounds the scrub's reads in bytes per second (0: no scrub), and a scrub
        pass begins every `scrub_period` seconds."""
        self.host = host
        self.counters = Counters()
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hotload-patch", initializer=initializer
        )
        self._lock = threading.Lock()
        self._specs: Specs | None = None
        #: The folder the served weights were last loaded from in full (patches since then
        #: included), when the engine says: lets it notice a reload it was not told about.
        self.source: str | None = None
        self._served: Future[list[RegionSum]] | None = None
        self._staging: Future[Staged] | None = None
        self._applied: tuple[Staged, list[RegionSum]] | None = None
        self._epoch = 0
        self._writing = False
        self._expected: tuple[int, dict[tuple[str, Region], tuple[int, int]]] | None = None
        self._mismatch: dict[str, Any] | None = None
        self.scrubber = Scrubber(self, scrub_rate, initializer, period=scrub_period)
        self.scrubber.start()

    # --- the served weights' checksums -----------------------------------------------------------

    def weights_changed(
        self, specs: Specs | None = None, *, loaded: bool = True, source: str | None = None
    ) -> None:
        """The served weights changed (`loaded`: a full load from folder `source`, whose old
        values a rollback can no longer restore; else a change this Patcher did not derive):
        checksum them again in the background. `specs` names the checkpoint's tensors (kept
        from the last call when None)."""
        with self._lock:
            self._epoch += 2
            if loaded:
                self.source = source
                self._applied = None
                self._mismatch = None
            if specs is not None:
                self._specs = specs
            meter = Meter(self.counters, "checksum_bytes")
            self._served = (
                self._pool.submit(served_sums, self.host, self._specs, meter)
                if self._specs is not None
                else None
            )
        if loaded:
            self.scrubber.restart()

    def served(self, timeout: float | None = None) -> list[RegionSum]:
        """The served weights' region sums (waits for a background read); raises the
        `PatchError` that read met, or one saying the engine does not know its checkpoint."""
        with self._lock:
            served = self._served
        if served is None:
            raise PatchError(
                "the engine has no checksums of the weights it serves (it was not told which "
                "checkpoint they came from)",
                reason="parent_mismatch",
            )
        return served.result(timeout)

    # --- patches ---------------------------------------------------------------------------------

    def stage(self, path: str, *, identity: str, parent: str) -> Future[Staged]:
        """Start staging the patch at `path` in the background (after any checksum read that
        is under way); a patch staged before is dropped. Refused while a scrub mismatch
        stands (the parent check would rest on sums the weights no longer match)."""

        def run() -> Staged:
            with self._lock:
                found = self._mismatch
            if found is not None:
                raise mismatch_error(found)
            return stage(
                self.host,
                path,
                identity=identity,
                parent=parent,
                specs=self._specs,
                counters=self.counters,
            )

        with self._lock:
            self._staging = self._pool.submit(run)
            return self._staging

    def state(self) -> dict[str, Any]:
        """Where the background work stands, as JSON: `served` and `staging` are each "none"
        (also a job `close` cancelled before it ran), "pending", "ready" or "failed" (with
        `error`, the served read's first)."""
        out: dict[str, Any] = {}
        with self._lock:
            jobs = {"served": self._served, "staging": self._staging}
        for key, job in jobs.items():
            if job is None or job.cancelled():
                out[key] = "none"
            elif not job.done():
                out[key] = "pending"
            elif (exc := job.exception()) is not None:
                out[key] = "failed"
                out.setdefault("error", _error_json(exc, JOBS[key]))
            else:
                out[key] = "ready"
        return out

    def staged(self) -> Staged:
        """The staged patch, once staging finished; raises its `PatchError`, or `not_staged`."""
        with self._lock:
            job = self._staging
        if job is None or not job.done():
            raise PatchError("no patch is staged (or it is still staging)", reason="not_staged")
        return job.result()

    def apply(self) -> Staged:
        """Write the staged patch (the caller holds generation paused); on failure every value
        is put back and `PatchError` raised. The served checksums move by the patch's sums."""
        staged = self.staged()
        with self._lock:
            job = self._served
        served = job.result() if job is not None and job.done() and not job.exception() else None
        self._write(lambda: apply(staged, self.host.parameters()))
        with self._lock:
            self._staging = None
            if served is not None:
                self._applied = (staged, served)
                self._served = _done(derive(served, staged.deltas))
        self.counters.add(
            patches=1, patched_elements=staged.changed, patched_bytes=staged.written_bytes
        )
        if served is None:
            # Nothing to derive from (no parent sums were known): read them.
            self.weights_changed(loaded=False)
        return staged

    def rollback(self) -> bool:
        """Put back the values the last `apply` replaced (False when there is none to undo)."""
        with self._lock:
            applied, self._applied = self._applied, None
        if applied is None:
            return False
        staged, before = applied
        staged.written = list(staged.writes)
        self._write(lambda: undo(staged, self.host.parameters()))
        with self._lock:
            self._served = _done(before)
        return True

    def _write(self, write: Callable[[], None]) -> None:
        """Run a write of the weights with the epoch odd meanwhile (a scrub reading then is
        read again)."""
        with self._lock:
            self._epoch += 1
            self._writing = True
        try:
            write()
        finally:
            with self._lock:
                self._epoch += 1
                self._writing = False

    def discard(self) -> None:
        """Drop a staged patch (its arrays are freed)."""
        with self._lock:
            self._staging = None

    # --- the scrub -------------------------------------------------------------------------------

    def scrub_target(self) -> tuple[int, Specs, dict[tuple[str, Region], tuple[int, int]]] | None:
        """What a scrub compares against now: (epoch, specs, sums by tensor and region)."""
        with self._lock:
            epoch, job, specs = self._epoch, self._served, self._specs
            cached = self._expected
        if specs is None or job is None or not job.done() or job.exception() is not None:
            return None
        if cached is None or cached[0] != epoch:
            expected = {(s.tensor, s.region): (s.a, s.b) for s in job.result()}
            cached = (epoch, expected)
            with self._lock:
                if self._epoch == epoch:
                    self._expected = cached
        return epoch, specs, cached[1]

    def epoch(self) -> int:
        """Bumped before and after every write of the weights, and by every full load."""
        with self._lock:
            return self._epoch

    def busy(self) -> bool:
        """Whether a patch is staging or being written (a scrub waits meanwhile)."""
        with self._lock:
            staging = self._staging
            return self._writing or (staging is not None and not staging.done())

    def scrub_found(self, mismatch: dict[str, Any]) -> None:
        """Keep a scrub's mismatch (patches are refused until the next full load)."""
        with self._lock:
            if mismatch.get("epoch") == self._epoch:
                self._mismatch = mismatch

    def scrub_state(self) -> dict[str, Any]:
        """The scrub's state as JSON (rate, period, passes, the last pass, a standing
        mismatch)."""
        state = self.scrubber.snapshot()
        with self._lock:
            state["mismatch"] = self._mismatch
        return state

    def close(self) -> None:
        """Stop the background threads (work under way finishes first)."""
        self.scrubber.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _done(value: list[RegionSum]) -> Future[list[RegionSum]]:
    future: Future[list[RegionSum]] = Future()
    future.set_result(value)
    return future


#: What each background job does, for the message of an unexpected failure.
JOBS = {
    "served": "reading the served weights' checksums",
    "staging": "staging the patch",
}


def _error_json(exc: BaseException, job: str) -> dict[str, Any]:
    if isinstance(exc, PatchError):
        return exc.to_json()
    message = f"{job} failed: {type(exc).__name__}: {exc}"
    return {"reason": "stage_failed", "message": message, "tensor": None}
