"""LoRA adapters: keep the newest adapters of the ledger loaded next to the base weights.

Adapters are complete snapshots published beside the base chain (`LedgerDocument.adapters`).
Every poll the loader calls `AdapterSync.sync(document)`, which makes the engine hold exactly
the newest `max_adapters` of them, each under its identity as model name:

1. unload the adapters the engine holds that are no longer wanted (first, so the engine's
   adapter slots never overflow), and remove their folders;
2. for each wanted adapter the engine lacks, newest first: download it into
   `.hotload/downloads/`, check its digest against the ledger entry and every tensor against
   its checksum (`verify_adapter`) and its shapes against the served base's layers, write the
   one-file folder engines read into
   `adapters/<identity>` (atomic rename), and ask the engine to load it.

The base weights are never touched. A failure leaves the adapter reported `failed` with why,
is retried with backoff, and never stops the other adapters or the base updates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from hotload.bucket import Bucket, MirroredBucket, download_snapshot_async
from hotload.errors import BucketError, EngineError, HotloadError
from hotload.ledger import LedgerDocument, LedgerEntry
from hotload.snapshot import Snapshot
from hotload.snapshot.lora import (
    adapter_digest,
    check_adapter_fits,
    merge_adapter,
    verify_adapter,
)
from hotload_sidecar.engines import EngineAdapter
from hotload_sidecar.status import AdapterStatus, EventType
from hotload_sidecar.weights import WeightsFolder, remove_tree

log = logging.getLogger("hotload_sidecar.adapters")

Event = Callable[[EventType, str, str], Awaitable[None]]
#: With every wanted adapter loaded, the engine's list is re-read this often (not every poll).
RELIST_SECONDS = 30.0


@dataclass
class _Retry:
    not_before: float
    delay: float


class AdapterSync:
    """Keeps one engine's LoRA adapters in step with one ledger (see the module docstring)."""

    def __init__(
        self,
        bucket: Bucket,
        weights: WeightsFolder,
        engine: EngineAdapter,
        *,
        max_adapters: int,
        retry_seconds: float = 30.0,
        event: Event | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.bucket = bucket
        self.weights = weights
        self.engine = engine
        self.max_adapters = max_adapters
        self.retry_seconds = retry_seconds
        self.event = event
        self.progress = progress
        #: What this replica reports, by identity (loaded, loading or failed).
        self.states: dict[str, AdapterStatus] = {}
        self._retries: dict[str, _Retry] = {}
        #: Whether the engine's own list was read since it (re)started, and when it last was.
        self._adopted = False
        self._listed_at = 0.0

    def statuses(self, document: LedgerDocument | None) -> tuple[AdapterStatus, ...]:
        """The adapters to report, newest first in ledger order."""
        order = [e.identity for e in document.adapters()] if document is not None else []
        rank = {identity: i for i, identity in enumerate(order)}
        return tuple(sorted(self.states.values(), key=lambda a: rank.get(a.identity, len(rank))))

    def engine_restarted(self) -> None:
        """Forget what the engine held: a restarted engine starts without adapters."""
        self._adopted = False

    async def sync(self, document: LedgerDocument) -> bool:
        """One pass (see the module docstring); True when anything changed."""
        wanted = document.adapters(self.max_adapters)
        wanted_ids = {e.identity for e in wanted}
        settled = set(self.states) == wanted_ids and all(
            a.status == "loaded" for a in self.states.values()
        )
        if self._adopted and settled and time.monotonic() - self._listed_at < RELIST_SECONDS:
            # Nothing to do: spare the engine a /v1/models call on every poll. A restarted
            # engine is noticed by the health check (`engine_restarted`), or at the next
            # re-list at the latest, so the replica still converges.
            return False
        before = dict(self.states)
        try:
            held = await self._held()
        except EngineError as err:
            log.warning("cannot list the engine's adapters: %s", err)
            return False
        for identity in sorted(held - wanted_ids):
            try:
                await self.engine.unload_adapter(identity)
            except EngineError as err:
                log.warning("unloading adapter %s failed: %s", identity, err)
                continue
            log.info("unloaded adapter %s (superseded)", identity)
            held.discard(identity)
        for identity in set(self.states) - wanted_ids:
            if identity not in held:
                del self.states[identity]
                self._retries.pop(identity, None)
        for identity in self.weights.local_adapters() - wanted_ids - held:
            remove_tree(self.weights.adapter_path(identity))
        for entry in wanted:
            if entry.identity in held:
                state = self.states.get(entry.identity)
                if state is None or state.status != "loaded":
                    self.states[entry.identity] = AdapterStatus(entry.identity, "loaded")
                continue
            retry = self._retries.get(entry.identity)
            if retry is not None and time.monotonic() < retry.not_before:
                continue
            await self._load(entry)
        return self.states != before

    async def _held(self) -> set[str]:
        """The adapters the engine holds; after a (re)start also adopts what it already had."""
        held = await self.engine.loaded_adapters()
        self._listed_at = time.monotonic()
        if not self._adopted:
            self._adopted = True
            # Loaded by an earlier run of this loader (adapters that are not ours are left).
            for identity in held:
                self.states.setdefault(identity, AdapterStatus(identity, "loaded"))
            for identity in [i for i, a in self.states.items() if i not in held]:
                if self.states[identity].status == "loaded":
                    del self.states[identity]
        return held

    async def _load(self, entry: LedgerEntry) -> None:
        identity = entry.identity
        self.states[identity] = AdapterStatus(identity, "loading")
        started = time.perf_counter()
        try:
            path = await self._materialize(entry)
            await self.engine.load_adapter(identity, str(path))
        except (HotloadError, OSError) as err:
            message = f"adapter {identity}: {err}"
            log.error("%s", message)
            retry = self._retries.get(identity)
            delay = min(retry.delay * 2, self.retry_seconds * 10) if retry else self.retry_seconds
            self._retries[identity] = _Retry(time.monotonic() + delay, delay)
            self.states[identity] = AdapterStatus(identity, "failed", message=message[:1024])
            if self.event is not None:
                await self.event("Warning", "AdapterLoadFailed", message)
            return
        seconds = time.perf_counter() - started
        self._retries.pop(identity, None)
        self.states[identity] = AdapterStatus(identity, "loaded", load_seconds=seconds)
        log.info("loaded adapter %s in %.2fs", identity, seconds)
        if self.event is not None:
            await self.event("Normal", "AdapterLoaded", f"adapter {identity} in {seconds:.2f}s")

    def _check_fits(self, adapter: Path) -> None:
        """Refuse an adapter whose factors do not fit the served base's layers."""
        current = self.weights.current()
        if current is None:
            return
        base = Snapshot(self.weights.path(current))
        check_adapter_fits(adapter, {n: t.shape for n, t in base.tensor_map.items()})

    async def _materialize(self, entry: LedgerEntry) -> Path:
        """The verified one-file folder of `entry` under `adapters/` (fetched if missing). A
        copy from a mirror that fails verification is rejected there (counted, an Event) and
        the adapter fetched again from the origin at once: a bad cache must not cost the
        adapter its retry backoff, and bytes from the origin that fail stay a failure."""
        final = self.weights.adapter_path(entry.identity)
        if final.is_dir():
            return final
        download = self.weights.download(f"adapter-{entry.identity}")
        staged = self.weights.staging(f"adapter-{entry.identity}")
        try:
            try:
                await self._fetch_verified(entry, download)
            except HotloadError as err:
                if not await self._rejected_mirror_copy(entry, err):
                    raise
                remove_tree(download)
                await self._fetch_verified(entry, download)
            await asyncio.to_thread(self._check_fits, download)
            await asyncio.to_thread(merge_adapter, download, staged)
            return self.weights.commit_adapter(staged, entry.identity)
        finally:
            remove_tree(download)
            remove_tree(staged)

    async def _fetch_verified(self, entry: LedgerEntry, download: Path) -> None:
        """Download `entry` into `download` and check it against the ledger: its digest covers
        the config and every weight file's header (which holds the tensors' checksums), and
        `verify_adapter` checks every tensor against its checksum."""
        await download_snapshot_async(self.bucket, entry.identity, download, progress=self.progress)
        digest = await asyncio.to_thread(adapter_digest, download)
        if digest != entry.manifest_digest:
            raise HotloadError(
                f"downloaded adapter has digest {digest}, the ledger admitted "
                f"{entry.manifest_digest}: the bucket copy changed after admission"
            )
        await asyncio.to_thread(verify_adapter, download)

    async def _rejected_mirror_copy(self, entry: LedgerEntry, err: HotloadError) -> bool:
        """Whether the failed copy of `entry` came (in part) from a mirror and was rejected
        there, so the origin is read next (False: nothing came from a mirror)."""
        bucket = self.bucket
        # A bucket error is the origin's (a mirror that fails is skipped): no copy to blame.
        if not isinstance(bucket, MirroredBucket) or isinstance(err, BucketError):
            return False
        labels = sorted(set(bucket.mirrored(entry.identity).values()))
        count = bucket.reject(entry.identity, err)
        if not count:
            return False
        if self.event is not None:
            await self.event(
                "Warning",
                "MirrorCopyRejected",
                f"{count} object(s) of adapter {entry.identity} from mirror(s) "
                f"{', '.join(labels)} failed verification ({err}); never loaded, fetched again "
                "from the origin",
            )
        return True
