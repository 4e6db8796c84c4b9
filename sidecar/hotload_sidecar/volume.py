"""The weights volume as a chain: the newest full snapshot plus the deltas after it.

A sparse update adds its delta to `deltas/` and rewrites nothing (`sparse`); what the volume
holds of a ledger entry is then a verified snapshot under `snapshots/` on the entry's chain and
every delta after it under `deltas/` (`WeightsFolder.reach`). `Volume` answers what it holds,
what a restarted loader may resume from without fetching anything (`resume`: the snapshot's
checksums and every delta's manifests and CRC-32 checked once), which deltas must be kept, and
folds the deltas into a new full snapshot in one pass when they add up to `compact_fraction` of
the snapshot's bytes (`Compaction`, in the background: the loader keeps patching meanwhile).
Amortised over the updates between two compactions, that costs about what they changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hotload.arc.patch import check_delta_files
from hotload.errors import HotloadError, LedgerError
from hotload.ledger import LedgerDocument, LedgerEntry
from hotload_sidecar.materialize import Materializer, check_digest, is_corruption
from hotload_sidecar.weights import WeightsFolder

log = logging.getLogger("hotload_sidecar.volume")


@dataclass(frozen=True)
class Position:
    """Where the volume stands on a ledger chain: `chain[base]` is held as a snapshot and
    `chain[base + 1 .. head]` as deltas."""

    chain: list[LedgerEntry]
    base: int
    head: int

    @property
    def snapshot(self) -> LedgerEntry:
        """The snapshot the chain starts from on the volume."""
        return self.chain[self.base]

    @property
    def deltas(self) -> list[LedgerEntry]:
        """The deltas the volume holds after it."""
        return self.chain[self.base + 1 : self.head + 1]

    @property
    def last(self) -> LedgerEntry:
        """The newest entry the volume holds on this chain."""
        return self.chain[self.head]


@dataclass(frozen=True)
class Resumed:
    """What a restarted loader found on the volume: `last`, as snapshot `base` plus deltas."""

    base: str
    last: LedgerEntry
    deltas: int
    seconds: float
    corruptions: int

    def summary(self) -> str:
        """One line for the log and the Event."""
        held = f"snapshot {self.base} plus {self.deltas} delta(s)" if self.deltas else self.base
        return (
            f"{self.last.identity} (sequence {self.last.sequence}) was on the volume from an "
            f"earlier run ({held}) and verified in {self.seconds:.2f}s: nothing downloaded"
        )


class Volume:
    """The volume's chains for one loader (see the module docstring)."""

    def __init__(
        self,
        weights: WeightsFolder,
        materializer: Materializer,
        *,
        compact_fraction: float,
    ) -> None:
        self.weights = weights
        self.materializer = materializer
        self.compact_fraction = compact_fraction
        self._compaction: asyncio.Task[None] | None = None
        #: The snapshot a compaction under way builds (its folder is in `.hotload/staging`).
        self._folding: str | None = None
        #: The deltas a compaction under way reads (never collected meanwhile).
        self._compacting: set[str] = set()

    def position(self, document: LedgerDocument | None, identity: str) -> Position | None:
        """Where the volume stands on the chain of `identity` (None: it holds nothing of it)."""
        if document is None:
            return None
        try:
            chain = document.chain_to(identity)
        except LedgerError:
            return None
        reach = self.weights.reach(chain)
        return Position(chain, *reach) if reach is not None else None

    def holds(self, document: LedgerDocument | None, identity: str) -> bool:
        """Whether the volume holds `identity`, as a snapshot or a snapshot plus deltas."""
        pos = self.position(document, identity)
        return pos is not None and pos.last.identity == identity

    def wanted_deltas(self, document: LedgerDocument | None, identities: list[str]) -> set[str]:
        """The deltas to keep: those the volume holds on the chains of `identities` (what the
        engine serves, the target), and those a compaction under way reads."""
        keep = set(self._compacting)
        for identity in identities:
            pos = self.position(document, identity)
            if pos is not None:
                keep.update(e.identity for e in pos.deltas)
        return keep

    async def resume(self, document: LedgerDocument | None, target: str) -> Resumed | None:
        """What a restarted loader holds on `target`'s chain, checked: the snapshot's tensors
        against their checksums (one full read), every delta after it against the ledger's
        manifest digest and its chunks' CRC-32 (a delta that fails is dropped, with every one
        after it). None when the volume holds nothing of the chain (or its snapshot fails)."""
        pos = self.position(document, target)
        if pos is None:
            return None
        started = time.perf_counter()
        if not await self.materializer.check_local(pos.snapshot):
            self.weights.discard(pos.snapshot.identity)
            return None
        head, corruptions = pos.base, 0
        for entry in pos.deltas:
            folder = self.weights.delta_path(entry.identity)
            try:
                check_digest(entry, folder)
                await asyncio.to_thread(check_delta_files, folder, entry.previous)
            except HotloadError as err:
                log.warning("delta %s on the volume does not verify (%s): dropped", entry, err)
                corruptions += is_corruption(err)
                for later in pos.chain[pos.chain.index(entry) :]:
                    self.weights.drop_delta(later.identity)
                break
            head += 1
        return Resumed(
            pos.snapshot.identity,
            pos.chain[head],
            head - pos.base,
            time.perf_counter() - started,
            corruptions,
        )

    # --- compaction ------------------------------------------------------------------------------

    def compaction_due(self, document: LedgerDocument | None, identity: str) -> bool:
        """Whether the deltas the volume holds on `identity`'s chain add up to
        `compact_fraction` of their snapshot's bytes (and no compaction runs)."""
        if self.compact_fraction <= 0 or self.compacting:
            return False
        pos = self.position(document, identity)
        if pos is None or not pos.deltas:
            return False
        snapshot = sum(
            f.stat().st_size for f in self.weights.path(pos.snapshot.identity).glob("*.safetensors")
        )
        deltas = sum(
            f.stat().st_size
            for e in pos.deltas
            for f in self.weights.delta_path(e.identity).iterdir()
            if f.is_file()
        )
        return deltas >= self.compact_fraction * snapshot

    @property
    def compacting(self) -> bool:
        """Whether a compaction runs now."""
        return self._compaction is not None and not self._compaction.done()

    @property
    def folding(self) -> str | None:
        """The snapshot a compaction under way builds in `.hotload/staging` while the loader is
        otherwise idle (the status shows it as `compacting`), or None."""
        return self._folding if self.compacting else None

    def start_compaction(
        self,
        document: LedgerDocument,
        identity: str,
        done: Callable[[str, BaseException | None], Awaitable[None]],
    ) -> None:
        """Fold the deltas of `identity`'s chain into its full snapshot, in the background;
        `done(identity, error)` runs after (the caller moves `current` and collects)."""
        pos = self.position(document, identity)
        if pos is None or not pos.deltas:
            return
        self._compacting = {e.identity for e in pos.deltas}
        self._folding = identity

        async def run() -> None:
            error: BaseException | None = None
            try:
                await self.materializer.build(document, identity)
            except (HotloadError, OSError) as err:
                error = err
            finally:
                self._compacting = set()
                self._folding = None
            await done(identity, error)

        log.info("compacting %d delta(s) into %s", len(pos.deltas), identity)
        self._compaction = asyncio.create_task(run(), name=f"compact {identity}")

    async def settle(self) -> None:
        """Wait for a compaction under way (the full path must not build beside it)."""
        if self._compaction is not None:
            await asyncio.gather(self._compaction, return_exceptions=True)
