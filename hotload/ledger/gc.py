"""`gc`: read what a retention plan needs from the bucket, and carry the plan out in the order
that makes a crash harmless.

Order: the journal (`.hotload/gc/<ledger>.json`, the identities this run retires, with when)
is written, then the ledger drops their entries (compare-and-swap), and only then are folders
deleted, each commit manifest first (so a half-deleted folder is never taken for a snapshot),
those of entries that left the ledger once their grace has passed; the journal goes last (or
keeps the identities still within their grace). A crash anywhere leaves folders that no ledger
names: orphans that the next run deletes (once their grace has passed when the journal retired
them, else once older than the orphan age), never a ledger entry without its files. Before
each folder goes, the bucket's ledgers are polled again (one conditional GET each) so a folder
a ledger took in the meantime is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

from hotload.bucket.core import Bucket
from hotload.bucket.local import LOCK_SUFFIX
from hotload.bucket.objects import NotModified, ObjectInfo, Progress, run_sync
from hotload.errors import (
    HotloadError,
    LedgerConflictError,
    LedgerError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from hotload.faults import crash_point
from hotload.ledger.fields import load_versioned, time_field, utc_now
from hotload.ledger.hints import HINT_PREFIX, Hint
from hotload.ledger.ledger import DEFAULT_ATTEMPTS, LEDGER_PREFIX, Ledger
from hotload.ledger.model import LedgerDocument
from hotload.ledger.pins import PIN_PREFIX, Pin
from hotload.ledger.retention import (
    COMMIT_FILES,
    DEFAULT_ORPHAN_AGE,
    NO_GRACE,
    BucketView,
    Folder,
    HintObject,
    Holder,
    Journal,
    RetentionPlan,
    Verdict,
    plan_retention,
)

T = TypeVar("T")

log = logging.getLogger("hotload.ledger.gc")

#: Where gc journals live inside a bucket.
GC_PREFIX = ".hotload/gc"
#: The bucket's own folder (ledgers, pins, hints, journals): never a snapshot.
INTERNAL = ".hotload"


def journal_key(ledger: str) -> str:
    """The object key of a ledger's gc journal: `.hotload/gc/<ledger>.json`."""
    return f"{GC_PREFIX}/{ledger}.json"


@dataclass
class GcResult:
    """What a gc did: its plan, whether it was carried out, and what went or was spared."""

    plan: RetentionPlan
    applied: bool = False
    deleted: list[str] = field(default_factory=list)
    deleted_hints: list[str] = field(default_factory=list)
    #: Folders the plan doomed but a ledger named by the time they were reached, with why.
    spared: list[tuple[str, str]] = field(default_factory=list)


async def gc_async(
    ledger: Ledger,
    *,
    keep: int,
    orphan_age: timedelta = DEFAULT_ORPHAN_AGE,
    holders: Iterable[Holder] = (),
    apply: bool = False,
    progress: Progress | None = None,
    on_folder: Callable[[Verdict], None] | None = None,
    attempts: int = DEFAULT_ATTEMPTS,
    grace: timedelta = NO_GRACE,
) -> GcResult:
    """Plan a gc of `ledger` (see `plan_retention`) and, with `apply`, carry it out; a lost
    compare-and-swap race re-reads the bucket and plans again. `holders` are the snapshots
    replicas serve or target (pins in the bucket are read here); `progress` gets the bytes of
    each deleted object, `on_folder` each folder once it is gone; `grace` how long the folders of
    entries dropped from the ledger stay after they left it."""
    wanted = list(holders)
    for attempt in range(1, attempts + 1):
        view, watch = await read_view_async(ledger)
        plan = plan_retention(
            view, keep=keep, orphan_age=orphan_age, holders=wanted, now=utc_now(), grace=grace
        )
        if not apply:
            return GcResult(plan)
        try:
            return await _carry_out(ledger, plan, watch, progress, on_folder)
        except LedgerConflictError:
            if attempt == attempts:
                raise
            await asyncio.sleep(random.uniform(0.01, 0.05) * attempt)
    raise AssertionError("unreachable")


def gc(
    ledger: Ledger,
    *,
    keep: int,
    orphan_age: timedelta = DEFAULT_ORPHAN_AGE,
    holders: Iterable[Holder] = (),
    apply: bool = False,
    grace: timedelta = NO_GRACE,
) -> GcResult:
    """Blocking `gc_async`."""
    return run_sync(
        gc_async(
            ledger, keep=keep, orphan_age=orphan_age, holders=holders, apply=apply, grace=grace
        )
    )


# --- reading ------------------------------------------------------------------------------------


async def read_view_async(ledger: Ledger) -> tuple[BucketView, _Watch]:
    """List the bucket and read the ledger, the other ledgers, pins, this ledger's hints and
    its gc journal. An unreadable ledger or pin raises: gc never guesses what they protect."""
    bucket = ledger.bucket
    # Listed before the ledgers are read: a folder admitted after the listing is in the read.
    listing = await bucket.list_async("")
    folders: dict[str, list[ObjectInfo]] = {}
    internal: list[ObjectInfo] = []
    for info in listing:
        top, sep, _ = info.key.partition("/")
        if top == INTERNAL:
            internal.append(info)
        elif sep:
            folders.setdefault(top, []).append(info)
    state = await ledger.read_async()
    if not state.exists:
        raise LedgerError(f"{ledger.url}: no such ledger (nothing has been published to it yet)")
    watch = _Watch(bucket)
    watch.add(ledger.key, state.etag, state.document)
    others: dict[str, LedgerDocument] = {}
    pins: list[Holder] = []
    hints: list[HintObject] = []
    journal: Journal | None = None
    hint_folder = f"{HINT_PREFIX}/{ledger.name}/"
    for info in internal:
        key = info.key
        where = f"{bucket.url.rstrip('/')}/{key}"
        if key.startswith(f"{LEDGER_PREFIX}/") and key.endswith(".json") and key != ledger.key:
            data = await _get(bucket, key)
            if data is None:
                continue
            other = _refusing(LedgerDocument.loads, data[0], where)
            others[other.name] = other
            watch.add(key, data[1], other)
        elif key.startswith(f"{PIN_PREFIX}/") and key.endswith(".json"):
            data = await _get(bucket, key)
            if data is not None:
                pin = _refusing(Pin.loads, data[0], where)
                by = f"deployment {pin.deployment}" if pin.deployment else key
                pins.append(Holder(pin.identity, f"pinned by {by}"))
        elif key.startswith(hint_folder) and key.endswith(".json"):
            identity = key.removeprefix(hint_folder).removesuffix(".json")
            data = await _get(bucket, key)
            if data is None or "/" in identity:
                continue
            hint: Hint | None
            try:
                hint = Hint.loads(data[0], where)
            except HotloadError:
                hint = None  # garbage: nobody can use it; it goes once old
            hints.append(HintObject(key, identity, hint, info.last_modified))
        elif key == journal_key(ledger.name):
            data = await _get(bucket, key)
            journal = _journal(key, data[0], data[1], where) if data is not None else None
    return (
        BucketView(
            document=state.document,
            etag=state.etag,
            others=others,
            folders={name: Folder(name, tuple(infos)) for name, infos in folders.items()},
            hints=tuple(hints),
            pins=tuple(pins),
            journal=journal,
        ),
        watch,
    )


async def _get(bucket: Bucket, key: str) -> tuple[bytes, str | None] | None:
    try:
        data = await bucket.get_async(key)
    except ObjectNotFoundError:
        return None  # deleted since the listing
    return data.data, data.etag


def _refusing(parse: Callable[[bytes, str], T], data: bytes, where: str) -> T:
    try:
        return parse(data, where)
    except HotloadError as err:
        raise LedgerError(
            f"gc refuses to delete anything: {err}. It cannot tell which snapshots {where} "
            "protects; repair or remove that object, then run gc again"
        ) from None


def _journal(key: str, data: bytes, etag: str | None, where: str) -> Journal:
    try:
        doc = load_versioned(data, where, 1)
        retired = {
            str(item["identity"]): time_field(item, "time", where)
            for item in doc.get("retired") or []
        }
    except (HotloadError, KeyError, TypeError) as err:
        # Only a shortcut: without it the retired folders still go, once old enough.
        log.warning("ignoring the unreadable gc journal %s: %s", where, err)
        return Journal(key, {}, etag)  # replaced by this run's (conditionally, as any)
    return Journal(key, retired, etag)


class _Watch:
    """The bucket's ledgers as last read, re-polled cheaply before each folder is deleted."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.ledgers: dict[str, tuple[str | None, frozenset[str]]] = {}

    def add(self, key: str, etag: str | None, document: LedgerDocument) -> None:
        self.ledgers[key] = (etag, frozenset(e.identity for e in document.entries))

    async def named_by(self, identity: str) -> str | None:
        """The key of a ledger that names `identity` now, or None."""
        for key, (etag, _) in list(self.ledgers.items()):
            try:
                got = await self.bucket.get_if_changed_async(key, etag)
            except ObjectNotFoundError:
                continue
            if not isinstance(got, NotModified):
                self.add(key, got.etag, LedgerDocument.loads(got.data, key))
            if identity in self.ledgers[key][1]:
                return key
        return None


# --- carrying out -----------------------------------------------------------------------------


async def _carry_out(
    ledger: Ledger,
    plan: RetentionPlan,
    watch: _Watch,
    progress: Progress | None,
    on_folder: Callable[[Verdict], None] | None,
) -> GcResult:
    bucket = ledger.bucket
    result = GcResult(plan, applied=True)
    journal = _JournalWriter(ledger, plan.journal)
    now = utc_now()
    if plan.after is not plan.before:
        pending: dict[str, datetime] = dict(plan.journal.retired) if plan.journal else {}
        pending.update(plan.waiting)
        pending.update((i, now) for i in plan.retiring if i not in plan.waiting)
        if pending:
            await journal.write(pending)
        crash_point("gc-ledger")  # journaled, the ledger not changed yet
        etag = await _swap(ledger, plan)
        watch.add(ledger.key, etag, plan.after)
    semaphore = asyncio.Semaphore(bucket.concurrency)
    for verdict in plan.doomed:
        owner = await watch.named_by(verdict.name)
        if owner is not None:
            result.spared.append((verdict.name, f"named by {owner} since gc read the bucket"))
            continue
        await _delete_folder(bucket, plan, verdict.name, semaphore, progress)
        result.deleted.append(verdict.name)
        if on_folder is not None:
            on_folder(verdict)
    for hint in plan.hints:
        if hint.delete:
            await bucket.delete_async(hint.name)
            result.deleted_hints.append(hint.name)
    if bucket.is_local:
        await asyncio.to_thread(_sweep_local_husks, bucket, plan)
    waiting = {i: t for i, t in plan.waiting.items() if i not in result.deleted}
    if waiting:
        await journal.write(waiting)
    elif plan.journal is not None or plan.retiring:
        await bucket.delete_async(journal.key)
    return result


class _JournalWriter:
    """This run's writes of the gc journal, each conditional on the last one seen (the one
    read, then this run's own): another gc's journal in between (a deposed leader's run waking
    late, or its successor's) makes the write fail as a lost race, and this run plans again."""

    def __init__(self, ledger: Ledger, journal: Journal | None) -> None:
        self.ledger = ledger
        self.key = journal_key(ledger.name)
        self.etag = journal.etag if journal is not None else None
        self.stored = dict(journal.retired) if journal is not None else None

    async def write(self, retired: dict[str, datetime]) -> None:
        """Store `retired` as the journal, unless it already says that."""
        if retired == self.stored:
            return
        body = Journal(self.key, retired).to_json(self.ledger.name, utc_now())
        data = (json.dumps(body, indent=2) + "\n").encode()
        bucket = self.ledger.bucket
        try:
            if self.etag is None:
                self.etag = await bucket.put_async(self.key, data, create_only=True)
            else:
                self.etag = await bucket.put_async(self.key, data, if_match=self.etag)
            self.stored = dict(retired)
        except (PreconditionFailedError, ObjectNotFoundError) as exc:  # gone, or rewritten
            raise LedgerConflictError(
                f"{self.ledger.url}: another gc wrote the journal {self.key} while this one "
                "planned; re-reading"
            ) from exc


async def _swap(ledger: Ledger, plan: RetentionPlan) -> str | None:
    """Write the ledger without the dropped entries, only if nobody changed it since it was
    read (the same compare-and-swap as every ledger write)."""
    if plan.after.sequence < plan.before.sequence:
        raise LedgerError(f"{ledger.url}: refusing to rewind the sequence")  # a bug, never data
    try:
        return await ledger.bucket.put_async(ledger.key, plan.after.dumps(), if_match=plan.etag)
    except PreconditionFailedError as exc:
        raise LedgerConflictError(
            f"{ledger.url}: another writer changed the ledger while gc planned; re-reading"
        ) from exc


async def _delete_folder(
    bucket: Bucket,
    plan: RetentionPlan,
    name: str,
    semaphore: asyncio.Semaphore,
    progress: Progress | None,
) -> None:
    objects = plan.listing[name].objects

    async def delete(info: ObjectInfo) -> None:
        async with semaphore:
            await bucket.delete_async(info.key)
        crash_point("gc-delete")  # part of a folder gone, the rest still there
        if progress is not None:
            progress(info.size)

    def commits(info: ObjectInfo) -> bool:
        return info.key.rsplit("/", 1)[-1] in COMMIT_FILES

    # The commit manifest first: from then on readers see no snapshot, only leftovers.
    for info in filter(commits, objects):
        await delete(info)
    await asyncio.gather(*(delete(info) for info in objects if not commits(info)))
    if bucket.is_local:
        await asyncio.to_thread(_remove_local_folder, bucket, name)


def _remove_local_folder(bucket: Bucket, name: str) -> None:
    # A folder bucket keeps empty directories and the lock files of conditional writes after
    # its objects are deleted: remove them, deepest first, or the bucket fills with husks. A
    # directory still holding a file (a write's hidden temp file included) stays.
    root = bucket.location.root
    top = Path(root) / name if root is not None else None
    if top is None or not top.is_dir():
        return
    for dirpath, _, filenames in os.walk(top, topdown=False):
        for f in filenames:
            if f.endswith(LOCK_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(dirpath, f))
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def _sweep_local_husks(bucket: Bucket, plan: RetentionPlan) -> None:
    # The empty directories a gc interrupted on a folder bucket left (they list as nothing):
    # gone when the journal retired them or they are older than the orphan age. A younger one
    # may be a publish that just made its folder.
    root = bucket.location.root
    if root is None or not Path(root).is_dir():
        return
    retired = plan.journal.retired if plan.journal is not None else {}
    cutoff = time.time() - plan.orphan_age.total_seconds()
    for top in Path(root).iterdir():
        if top.name == INTERNAL or top.name in plan.listing or not top.is_dir():
            continue
        with contextlib.suppress(OSError):
            if top.name in retired or top.stat().st_mtime < cutoff:
                _remove_local_folder(bucket, top.name)
