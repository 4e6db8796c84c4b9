"""Sparse hot loads: when the engine serves an ancestor of the target through deltas only, send it
only what changed, and keep the volume's copy by adding the deltas, not rewriting the model.

`SparseLoads.plan(document, target, served)` says which ledger entries lie between what the
engine serves and the target (one delta in the steady state; several when the loader fell behind
or the engine restarted on an older snapshot), or None when a full load is needed.
`SparseLoads.load(steps, ...)` takes each delta from the volume (`deltas/`) or fetches it, checks
its manifest digest against the ledger's and every chunk's CRC-32, commits it to `deltas/` (so a
restarted loader never fetches it again), composes them into one patch file
(`hotload.arc.patch.prepare_patch`: nothing of the parent read) and asks the engine to write it
into the weights it serves (`EngineAdapter.patch`; the engine checks the patch against its own
weights: the parent's checksums, and the result's). All of that happens while the old weights
serve; the engine pauses only for the writes. Any refusal (too dense, a delta that fails its
checks, an engine that holds other weights or cannot patch) is an `Outcome` with a reason, and
the caller loads the full snapshot instead.

The volume's copy of the served snapshot is then the newest full snapshot under `snapshots/`
plus the deltas after it under `deltas/`: an update writes the delta (and a transient patch
file), never the model. `Compaction` folds the deltas into a new full snapshot in one pass when
they add up to a share of the model (amortised, that too costs what changed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotload.arc.files import changed_side_files
from hotload.arc.patch import (
    DeltaFolder,
    ParentChain,
    PatchNeedsParentError,
    PatchStats,
    PatchTooDenseError,
    check_delta_files,
    delta_changes,
    prepare_patch,
)
from hotload.bucket import Bucket, download_snapshot_async
from hotload.errors import BucketError, EngineError, EngineLoadError, HotloadError, LedgerError
from hotload.faults import crash_point
from hotload.ledger import LedgerDocument, LedgerEntry
from hotload.parse_cache import parse_once
from hotload.process import run_in_thread
from hotload.snapshot import Snapshot, validate_identity
from hotload_sidecar.engines import (
    CachePolicy,
    EngineAdapter,
    LoadRequest,
    LoadResult,
    Mode,
    PatchRefusedError,
)
from hotload_sidecar.materialize import EarlyFiles, check_digest, is_corruption
from hotload_sidecar.status import LoadTimings
from hotload_sidecar.weights import WeightsFolder, move_folder, remove_tree, written_bytes

log = logging.getLogger("hotload_sidecar.sparse")

#: The suffix of a delta's download kept for the full path after it proved too dense to patch.
TOO_DENSE = ".too-dense"
#: The most volume deltas walked back to find what a compact delta's parent values are made of
#: (compaction folds the volume's deltas long before; a longer walk is a volume to distrust).
MAX_PARENT_CHAIN = 1000


def _prepare_patch(
    chain: Callable[[str], ParentChain | None],
    parent: str,
    folders: list[DeltaFolder],
    out: Path,
    **kwargs: Any,
) -> PatchStats:
    """`prepare_patch` of `folders`, whose first delta applies to `parent`, with what the
    volume holds of that parent (`chain`: walked in this worker thread, and only when a
    compact delta's chunk needs it: the walk reads a header per delta on the volume)."""
    return prepare_patch(functools.partial(chain, parent), folders, out, **kwargs)


#: Called as a patch goes to the engine, with the entry it serves and the engine's pending
#: answer: work to overlap with the engine's (`SparseLoads.send`).
Meanwhile = Callable[[LedgerEntry, "asyncio.Future[LoadResult]"], None]


@dataclass
class Patched:
    """Deltas the engine serves as one patch: the engine's answer and the timings."""

    entry: LedgerEntry
    parent: str
    result: LoadResult
    timings: LoadTimings
    changed: int
    elements: int
    steps: list[str] = field(default_factory=list)
    #: Prepared while the engine applied the patch before it (`SparseLoads.prepare`).
    ahead: bool = False

    def summary(self) -> str:
        """One line for the log and the Event."""
        t = self.timings
        share = self.changed / self.elements if self.elements else 0.0
        over = f" over {len(self.steps)} deltas" if len(self.steps) > 1 else ""
        over += " (prepared while the engine took the one before)" if self.ahead else ""
        return (
            f"serving {self.entry.identity} (sequence {self.entry.sequence}) after "
            f"{t.total_seconds:.2f}s: sparse patch of {self.parent}{over} ({self.changed} of "
            f"{self.elements} elements, {share:.2%}), {t.bytes_fetched} bytes fetched, engine "
            f"pause {self.result.pause_seconds:.4f}s"
        )


@dataclass
class Outcome:
    """What a sparse load attempt did: `patched`, or why the full snapshot must be loaded
    (`reason`, one word for metrics; `message` for people). `serving_unknown`: the engine did
    not say what it serves now."""

    patched: Patched | None = None
    reason: str = ""
    message: str = ""
    corruption: bool = False
    serving_unknown: bool = False


@dataclass
class Prepared:
    """A patch file written for the engine, not yet sent: the deltas it holds (from the served
    snapshot `parent` on), what fetching and writing it cost, and when that began."""

    steps: list[LedgerEntry]
    parent: str
    patch: Path
    stats: PatchStats
    fetched: int
    wrote: int
    fetch_seconds: float
    prepare_seconds: float
    began: float

    def fits(self, steps: list[LedgerEntry]) -> bool:
        """Whether this patch serves the first of `steps` onwards (the deltas after what the
        engine serves now), so sending it moves toward their end."""
        ours = [e.identity for e in self.steps]
        return [e.identity for e in steps[: len(ours)]] == ours and steps[0].previous == self.parent

    def discard(self) -> None:
        """Remove the patch file (harmless when gone)."""
        remove_tree(self.patch)


class SparseLoads:
    """Prepares and sends sparse patches for one engine from one bucket (see the module doc)."""

    def __init__(
        self,
        bucket: Bucket,
        weights: WeightsFolder,
        adapter: EngineAdapter,
        *,
        max_changed: float,
        threads: int | None = None,
        progress: Callable[[int], None] | None = None,
        written: Callable[[int], None] | None = None,
        early: EarlyFiles | None = None,
    ) -> None:
        """`early(entry, folder)`: moves a delta downloaded before admission into `folder`
        (the early fetch's `for_patch`), its bytes; None when it must be fetched."""
        self.bucket = bucket
        self.early = early
        self.weights = weights
        self.adapter = adapter
        self.max_changed = max_changed
        self.threads = threads
        self.progress = progress
        #: Told the bytes written to the volume (deltas, patch files).
        self.written = written

    def plan(
        self, document: LedgerDocument, target: LedgerEntry, served: str | None
    ) -> list[LedgerEntry] | None:
        """The deltas from the snapshot the engine serves to `target`, in order, when every
        entry between them is one (else None: a full snapshot on the way, a rollback, an
        engine serving nothing known)."""
        if served is None or target.kind != "incremental" or served == target.identity:
            return None
        try:
            chain = document.chain_to(target.identity)
        except LedgerError:
            return None
        at = next((i for i, e in enumerate(chain) if e.identity == served), None)
        if at is None:
            return None
        steps = chain[at + 1 :]
        return steps if steps and all(e.kind == "incremental" for e in steps) else None

    async def load(
        self,
        steps: list[LedgerEntry],
        mode: Mode,
        policy: CachePolicy,
        *,
        started: float,
        ready: Prepared | None = None,
        meanwhile: Meanwhile | None = None,
    ) -> Outcome:
        """Fetch (or take from the volume), check, commit and send `steps` as one patch of
        their first parent, which the engine serves. `ready`: a patch of a first part of
        `steps` prepared ahead (`prepare`, while the engine took the previous one), sent as
        it is; one that does not fit `steps` is dropped. `meanwhile`: see `send`."""
        if ready is not None and not ready.fits(steps):
            ready.discard()
            ready = None
        refusal = None
        try:
            # Before anything is fetched: an engine that cannot take patches costs no download.
            await self.adapter.check_sparse()
        except PatchRefusedError as err:
            refusal = self._refused(steps[-1], err.reason, err)
        except EngineError as err:
            refusal = self._refused(steps[-1], "engine_failed", err)
        if refusal is not None:
            if ready is not None:
                ready.discard()
            return refusal
        got = ready if ready is not None else await self.prepare(steps)
        if isinstance(got, Outcome):
            return got
        out = await self.send(got, mode, policy, started=started, meanwhile=meanwhile)
        if out.patched is not None:
            out.patched.ahead = ready is not None
        return out

    async def prepare(
        self, steps: list[LedgerEntry], *, nice: int = 0, threads: int | None = None
    ) -> Prepared | Outcome:
        """Fetch (or take from the volume), check and commit `steps` and write their patch
        (of as many of them as one patch may change): what `send` gives the engine, or why
        not (an `Outcome` with a reason). `nice`: the patch is written in threads that much
        less urgent (a patch prepared ahead yields the CPU to the engine's update under way);
        `threads`: how many write it (default: the loader's `--threads`)."""
        # Each delta's headers are read once, when it arrives (or is taken from the volume),
        # and handed to the checks, the density count and the patch (a delta is a file per
        # layer, so a re-read is per-file work); the manifests' JSON is parsed once too.
        with parse_once():
            return await self._prepare(steps, nice, threads or self.threads)

    def _patch_file(self, steps: list[LedgerEntry]) -> Path:
        """Where the patch of `steps` is written: named by its target and its first delta's
        sequence, so that a patch prepared ahead from another first delta and left to finish
        (`PatchesAhead.take`) never writes or removes the file an update is sending."""
        return self.weights.staging_root / f"{steps[-1].identity}.{steps[0].sequence}.patch"

    async def _prepare(
        self, steps: list[LedgerEntry], nice: int, threads: int | None
    ) -> Prepared | Outcome:
        target, parent = steps[-1], steps[0].previous
        assert parent is not None
        t0 = time.perf_counter()
        patch = self._patch_file(steps)
        folders: list[DeltaFolder] = []
        fetched = wrote = 0
        self._drop_stale(steps)
        try:
            # Fetched side by side (a burst of deltas is one round trip, not one per delta).
            got_all = await asyncio.gather(
                *(self._delta(entry) for entry in steps), return_exceptions=True
            )
            expected = (BucketError, HotloadError, OSError)
            for got in got_all:
                if isinstance(got, BaseException) and not isinstance(got, expected):
                    raise got
            for i, got in enumerate(got_all):
                if isinstance(got, BaseException) and i > 0:
                    # The deltas before it are on the volume, checked: patch them now (after an
                    # engine restart, back to what the replica served) and meet this one again
                    # as the next update's first, which falls back if it still fails.
                    log.warning(
                        "%s cannot be patched in (%s): patching the %d delta(s) before it now",
                        steps[i].identity,
                        got,
                        i,
                    )
                    steps = steps[:i]
                    target = steps[-1]
                    patch = self._patch_file(steps)
                    break
                if isinstance(got, BucketError):
                    return self._refused(target, "fetch_failed", got)
                if isinstance(got, PatchTooDenseError):
                    return self._refused(target, "too_dense", got)
                if isinstance(got, HotloadError):
                    return self._refused(target, "delta_not_verified", got)
                if isinstance(got, OSError):
                    # The volume refused the download (full, over quota, a file size limit):
                    # a failed update whose status says so, never the loop's crash; the full
                    # load that follows fails the same way if the volume is still full.
                    return self._refused(target, "write_failed", got)
                assert not isinstance(got, BaseException)
                folder, nbytes, new, earlier = got
                folders.append(folder)
                fetched += nbytes
                # Bytes an early fetch wrote were counted in the metric when they arrived; the
                # update still wrote them, so its report includes them (whichever path won the
                # race to the delta, the update reports the same bytes).
                wrote += self._wrote(new) + earlier
            fetch_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            # Deltas that together change too much for one patch: the longest run of them that
            # does not, now; the rest from the volume next time (never a full load because the
            # loader fell behind).
            keep = await asyncio.to_thread(self._within_density, folders)
            if keep < len(steps):
                log.info(
                    "%d deltas queued: patching the first %d now, the rest after",
                    len(steps),
                    keep,
                )
                steps, folders = steps[:keep], folders[:keep]
                target = steps[-1]
                patch = self._patch_file(steps)
            crash_point("patch")
            try:
                write = functools.partial(
                    _prepare_patch,
                    self._parent_chain,
                    parent,
                    folders,
                    patch,
                    identity=target.identity,
                    expected_parent=parent,
                    threads=threads,
                    max_changed_fraction=self.max_changed,
                )
                stats = await run_in_thread(write, nice=nice, name="hotload-patch")
            except PatchTooDenseError as err:
                return self._refused(target, "too_dense", err)
            except PatchNeedsParentError as err:
                return self._refused(target, "needs_parent", err)
            except (HotloadError, OSError) as err:
                self._distrust(steps, err)
                return self._refused(target, "delta_not_verified", err)
        except BaseException:
            remove_tree(patch)
            raise
        wrote += self._wrote(stats.bytes)
        return Prepared(
            steps,
            parent,
            patch,
            stats,
            fetched,
            wrote,
            fetch_seconds,
            time.perf_counter() - t1,
            t0,
        )

    async def send(
        self,
        ready: Prepared,
        mode: Mode,
        policy: CachePolicy,
        *,
        started: float,
        meanwhile: Meanwhile | None = None,
    ) -> Outcome:
        """Ask the engine to write the prepared patch into the weights it serves (the patch
        file is removed either way). `meanwhile(target, patching)` is started beside the
        engine's work (the loader prepares the next patch then)."""
        target = ready.steps[-1]
        try:
            crash_point("engine")
            engine_before = await self._engine_patched()
            t2 = time.perf_counter()
            req = LoadRequest(str(ready.patch), target.identity, target.sequence, mode, policy)
            patching = asyncio.ensure_future(self.adapter.patch(req, ready.parent))
            if meanwhile is not None:
                meanwhile(target, patching)
            try:
                result = await patching
            except PatchRefusedError as err:
                return self._refused(target, err.reason, err)
            except EngineLoadError as err:
                out = self._refused(target, "engine_failed", err)
                out.serving_unknown = err.serving != "previous"
                return out
            except EngineError as err:
                return self._refused(target, "engine_failed", err)
        finally:
            ready.discard()
        load_seconds = time.perf_counter() - t2
        crash_point("served")
        engine_after = await self._engine_patched()
        timings = LoadTimings(
            fetch_seconds=ready.fetch_seconds,
            rebuild_seconds=ready.prepare_seconds,
            load_seconds=load_seconds,
            pause_seconds=result.pause_seconds,
            # A patch prepared ahead counts from when its preparation began.
            total_seconds=time.perf_counter() - min(started, ready.began),
            bytes_fetched=ready.fetched,
            steps=len(ready.steps),
            method="sparse",
            volume_bytes_written=ready.wrote,
            engine_patched_elements=max(0, engine_after - engine_before),
            skipped=len(ready.steps) - 1,
            engine_steps=dict(result.steps),
        )
        done = Patched(
            target,
            ready.parent,
            result,
            timings,
            ready.stats.changed,
            ready.stats.elements,
            [e.identity for e in ready.steps],
        )
        return Outcome(patched=done)

    def _within_density(self, folders: list[DeltaFolder]) -> int:
        """How many of `folders` (deltas in order) to compose at once: as many as change, all
        together, at most `max_changed` of the elements (counted from their chunk headers,
        an upper bound of what their composition changes), and at least one."""
        budget, count = None, 0
        for folder in folders:
            changed, total = delta_changes(folder)
            budget = self.max_changed * total if budget is None else budget
            if count and changed > budget:
                break
            budget -= changed
            count += 1
        return count

    async def _delta(self, entry: LedgerEntry) -> tuple[DeltaFolder, int, int, int]:
        """The delta `entry` on the volume: (its folder as read, bytes fetched, bytes written, bytes
        written before, by an early fetch or an earlier try, and counted then). One
        already there is used as it is (checked when it arrived, and at
        start-up); else it is fetched, refused when too dense (`PatchTooDenseError`: the full
        path takes it, and its files, see `hand_over`), its manifests and chunks checked, and
        committed."""
        if self.weights.has_delta(entry.identity):
            held = self.weights.delta_path(entry.identity)
            return await asyncio.to_thread(DeltaFolder.read, held), 0, 0, 0
        folder = self.weights.download(entry.identity)
        try:
            crash_point("fetch")
            # A download set aside earlier (a patch prepared ahead found it too dense), or the
            # early fetch's (which raises `PatchTooDenseError` when it rebuilt it for a full load).
            early = await self.hand_over(entry, folder)
            if early is None and self.early is not None:
                early = await self.early(entry, folder)
            fetched = 0
            if early is None:
                got = await download_snapshot_async(
                    self.bucket, entry.identity, folder, progress=self.progress
                )
                fetched = got.bytes
            stored: dict[str, bytes] = {}
            check_digest(entry, folder, stored)
            opened = await asyncio.to_thread(DeltaFolder.read, folder, stored)
            changed, total = await asyncio.to_thread(delta_changes, opened)
            refusal = self.density_refusal(entry.identity, changed, total)
            if refusal:
                self._set_aside(entry.identity, folder, count=early is None)
                raise PatchTooDenseError(refusal)
            await asyncio.to_thread(check_delta_files, opened, entry.previous)
            changed_side = changed_side_files(folder, opened.snapshot.shard_files)
            if changed_side:
                # Engines keep the tokenizer and chat template they started with (a patch or a
                # hot full load replaces weights only): say so rather than serve them silently.
                log.warning(
                    "%s changes %s: the engine keeps the tokenizer and chat template it started "
                    "with; restart the pod to serve them",
                    entry.identity,
                    ", ".join(changed_side),
                )
            # Bytes fetched early were counted (fetched, written) when they arrived.
            new = written_bytes(folder) if early is None else 0
            earlier = written_bytes(folder) if early is not None else 0
            crash_point("commit")
            kept = self.weights.has_delta(entry.identity)  # then its files, not these, stay
            committed = self.weights.commit_delta(folder, entry.identity)
            if kept:
                opened = await asyncio.to_thread(DeltaFolder.read, committed)
            return opened.moved(committed), fetched, new, earlier
        except BaseException:
            remove_tree(folder)
            raise

    def _parent_chain(self, identity: str) -> ParentChain | None:
        """Where the values of snapshot `identity` (the one the engine serves) are on the
        volume, for a compact delta's `sparse_exp` chunks: a snapshot and the deltas after it,
        walked back from `identity` through each delta's parent; None when the volume does not
        hold it so. The volume's deltas were checked when they were committed, and the engine
        checks the patch against the weights it serves."""
        deltas: list[Path] = []
        at: str | None = identity
        while at is not None and not self.weights.has(at):
            if not self.weights.has_delta(at) or len(deltas) >= MAX_PARENT_CHAIN:
                return None
            deltas.append(self.weights.delta_path(at))
            at = Snapshot(deltas[-1]).parent
        return None if at is None else ParentChain(self.weights.path(at), deltas[::-1])

    def density_refusal(self, identity: str, changed: int, total: int) -> str:
        """Why a delta changing `changed` of `total` elements is too dense for a patch ("" when
        it is not)."""
        if changed <= self.max_changed * total:
            return ""
        return (
            f"{identity} changes {changed} of {total} elements ({changed / total:.0%}), more "
            f"than the {self.max_changed:.0%} a patch is worth"
        )

    def _aside(self, identity: str) -> Path:
        return self.weights.staging_root / f"{validate_identity(identity)}{TOO_DENSE}"

    def _set_aside(self, identity: str, folder: Path, *, count: bool) -> None:
        """Keep the download of a delta too dense for a patch for the full path, which loads it
        next, or for another try of the patch (`hand_over`; `_drop_stale` removes it later)."""
        if count:
            self._wrote(written_bytes(folder))
        move_folder(folder, self._aside(identity))

    def _drop_stale(self, steps: list[LedgerEntry]) -> None:
        """Remove the downloads set aside for deltas other than `steps` (the full load that
        followed did not take them: a fallback, a head that moved on)."""
        keep = {f"{e.identity}{TOO_DENSE}" for e in steps}
        for aside in self.weights.staging_root.glob(f"*{TOO_DENSE}"):
            if aside.name not in keep:
                remove_tree(aside)

    async def hand_over(self, entry: LedgerEntry, dest: Path) -> int | None:
        """Move the files of `entry`, fetched for a patch and found too dense for one, into the
        empty folder `dest` (the full path's download, or another try's): their bytes; None
        when there are none. Counted (fetched, written) when they arrived; checked again."""
        aside = self._aside(entry.identity)
        if not aside.is_dir():
            return None
        size = written_bytes(aside)
        try:
            move_folder(aside, dest)  # one rename
        except OSError as err:
            log.warning("cannot take the set-aside download of %s: %s", entry.identity, err)
            return None
        log.info("%s: the full load takes the %d bytes fetched for a patch", entry.identity, size)
        return size

    def _distrust(self, steps: list[LedgerEntry], err: BaseException) -> None:
        """Deltas whose bytes failed a check are not kept: the full path fetches them again."""
        if is_corruption(err):
            for entry in steps:
                self.weights.drop_delta(entry.identity)

    def _wrote(self, nbytes: int) -> int:
        if self.written is not None:
            self.written(nbytes)
        return nbytes

    async def _engine_patched(self) -> int:
        """The elements the engine counted as written by patches so far (0 when it does not
        say): the loader reports the difference an update made, from the engine's side."""
        try:
            report = await self.adapter.weights_report()
        except EngineError:
            return 0
        return int(report.counters.get("patched_elements", 0)) if report is not None else 0

    def _refused(self, entry: LedgerEntry, reason: str, err: BaseException) -> Outcome:
        message = f"sparse load of {entry.identity} refused ({reason}): {err}"
        log.warning("%s; loading the full snapshot", message)
        return Outcome(reason=reason, message=message, corruption=is_corruption(err))
