"""`Patcher`: one engine's sparse-load state, for whichever process holds the weights.

It keeps the checksums of the served weights (computed in a background thread after every load
or patch, while they serve, so a patch never waits for a full read of the model), stages one
patch at a time in that same thread, writes it when asked (the engine pauses around that call),
and keeps the last write's old values until the next load so that a failure elsewhere (another
rank, the confirmation) can put them back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hotload_patch.checkpoint import Specs
from hotload_patch.errors import PatchError
from hotload_patch.placement import Host
from hotload_patch.staging import Staged, apply, served_sums, stage, undo
from hotload_patch.sums import RegionSum


class Patcher:
    """Served checksums, a staged patch and the last write of one engine (see module doc)."""

    def __init__(self, host: Host, *, initializer: Callable[[], None] | None = None) -> None:
        """`initializer` runs first in the background thread (an engine lowers its priority
        there, so that checksums and staging yield the CPU to generation)."""
        self.host = host
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
        self._applied: Staged | None = None

    def weights_changed(
        self, specs: Specs | None = None, *, loaded: bool = True, source: str | None = None
    ) -> None:
        """The served weights changed (`loaded`: a full load from folder `source`, whose old
        values a rollback can no longer restore; else a patch): checksum them again in the
        background. `specs` names the checkpoint's tensors (kept from the last call when
        None)."""
        with self._lock:
            if loaded:
                self.source = source
            if specs is not None:
                self._specs = specs
            if loaded:
                self._applied = None
            self._served = (
                self._pool.submit(served_sums, self.host, self._specs)
                if self._specs is not None
                else None
            )

    def served(self, timeout: float | None = None) -> list[RegionSum]:
        """The served weights' region sums (waits for the background read); raises the
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

    def stage(self, path: str, *, identity: str, parent: str) -> Future[Staged]:
        """Start staging the patch at `path` in the background (after any checksum read that
        is under way); a patch staged before is dropped."""
        with self._lock:
            self._staging = self._pool.submit(
                stage, self.host, path, identity=identity, parent=parent, specs=self._specs
            )
            return self._staging

    def state(self) -> dict[str, Any]:
        """Where the background work stands, as JSON: `served` and `staging` are each "none",
        "pending", "ready" or "failed" (with `error`)."""
        out: dict[str, Any] = {}
        with self._lock:
            jobs = {"served": self._served, "staging": self._staging}
        for key, job in jobs.items():
            if job is None:
                out[key] = "none"
            elif not job.done():
                out[key] = "pending"
            elif (exc := job.exception()) is not None:
                out[key] = "failed"
                out.setdefault("error", _error_json(exc))
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
        is put back and `PatchError` raised. The checksums are read again in the background."""
        staged = self.staged()
        apply(staged, self.host.parameters())
        with self._lock:
            self._applied = staged
            self._staging = None
        self.weights_changed(loaded=False)
        return staged

    def rollback(self) -> bool:
        """Put back the values the last `apply` replaced (False when there is none to undo)."""
        with self._lock:
            applied, self._applied = self._applied, None
        if applied is None:
            return False
        applied.written = list(applied.writes)
        undo(applied, self.host.parameters())
        self.weights_changed(loaded=False)
        return True

    def discard(self) -> None:
        """Drop a staged patch (its arrays are freed)."""
        with self._lock:
            self._staging = None

    def close(self) -> None:
        """Stop the background thread (work under way finishes first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _error_json(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, PatchError):
        return exc.to_json()
    return {"reason": "stage_failed", "message": f"{type(exc).__name__}: {exc}", "tensor": None}
