"""Retention: which snapshot folders of a bucket nothing can need any more, and why the rest
stays.

A folder may go when it is not on the chain from the latest full snapshot, not among the last
`keep` entries, not on the chain of a pinned snapshot or of one a replica serves or targets,
and not named by another ledger of the bucket. Folders that no ledger names (orphans: a
publish that failed half-way, a snapshot compaction dropped, a gc that crashed) go once their
newest file is older than the orphan age, so that a publish in flight, whose files land before
its ledger entry, is never taken. The files of an entry a gc drops from the ledger stay for a
grace period after it left (the gc journal records when): a loader that read the ledger just
before may still be fetching them to rebuild a chain. `plan_retention` is that decision, pure;
`hotload.ledger.gc` reads the bucket for it and carries the plan out in the order that keeps a
crash harmless.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Literal

from hotload.bucket.objects import ObjectInfo
from hotload.errors import HotloadError, InvalidIdentityError, LedgerError
from hotload.ledger.fields import format_time
from hotload.ledger.hints import Hint
from hotload.ledger.model import LedgerDocument, LedgerEntry
from hotload.snapshot.layout import (
    ADAPTER_CONFIG_FILE,
    CONFIG_FILE,
    INDEX_FILE,
    SPEC_FILE,
    validate_identity,
)

#: Orphans younger than this stay: a publish may take long to upload and be admitted.
DEFAULT_ORPHAN_AGE: Final = timedelta(hours=24)
#: How long the files of an entry dropped from the ledger stay, where nothing sees what the
#: replicas fetch (the Publisher's `retain=` without a deployment): longer than a loader takes
#: from reading the ledger to having fetched a chain's files (a lagging replica rebuilding it).
DEFAULT_GRACE: Final = timedelta(minutes=10)
#: No grace: a gc told what every replica serves and targets deletes dropped entries at once.
NO_GRACE: Final = timedelta(0)
#: Files that make a folder one of hotload's snapshots (or a half-written one).
SNAPSHOT_FILES: Final = (INDEX_FILE, SPEC_FILE, ADAPTER_CONFIG_FILE, CONFIG_FILE)
#: Files whose presence makes a snapshot visible; deleted first so a half-deleted folder is
#: never taken for a complete snapshot.
COMMIT_FILES: Final = (INDEX_FILE, ADAPTER_CONFIG_FILE)

Category = Literal["entry", "orphan", "other"]

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> timedelta:
    """Parse a duration such as `90s`, `30m`, `24h`, `7d`, `2w` or `3600` (seconds)."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise HotloadError(f"cannot read duration {text!r} (examples: 90s, 30m, 24h, 7d, 3600)")
    return timedelta(seconds=float(m.group(1)) * _UNIT_SECONDS[m.group(2) or "s"])


def human_age(age: timedelta) -> str:
    """A duration as people read it: `45s`, `12m`, `5.5h`, `24h`, `3d`."""
    seconds = age.total_seconds()
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.3g}h"
    return f"{seconds / 86400:.3g}d"


@dataclass(frozen=True)
class Holder:
    """Something that needs a snapshot: a pin, a deployment's target, a replica serving it."""

    identity: str
    reason: str


@dataclass(frozen=True)
class Folder:
    """One top-level folder of the bucket as listed: its objects (keys, sizes, times)."""

    name: str
    objects: tuple[ObjectInfo, ...]

    @property
    def size(self) -> int:
        """Bytes of its objects."""
        return sum(o.size for o in self.objects)

    @property
    def newest(self) -> datetime | None:
        """When its newest object was written (None when the store gives no times)."""
        times = [o.last_modified for o in self.objects if o.last_modified is not None]
        return max(times, default=None)

    @property
    def files(self) -> tuple[str, ...]:
        """File names relative to the folder."""
        return tuple(o.key.removeprefix(f"{self.name}/") for o in self.objects)

    @property
    def is_snapshot(self) -> bool:
        """Whether it looks like one of hotload's snapshot folders (complete or half-written):
        a safetensors file or a snapshot manifest in it, and a valid identity as its name."""
        try:
            validate_identity(self.name)
        except InvalidIdentityError:
            return False
        return any(f.endswith(".safetensors") or f in SNAPSHOT_FILES for f in self.files)

    @property
    def committed(self) -> bool:
        """Whether its commit manifest is there (a complete snapshot, not a failed upload)."""
        return any(f in COMMIT_FILES for f in self.files)


@dataclass(frozen=True)
class HintObject:
    """A hint object of the ledger being collected (`hint` None: it cannot be parsed)."""

    key: str
    identity: str
    hint: Hint | None
    last_modified: datetime | None


@dataclass(frozen=True)
class Journal:
    """What an earlier gc of this ledger retired from it and had not finished deleting."""

    key: str
    retired: Mapping[str, datetime]
    #: The stored journal's ETag as read (its next write is conditional on it).
    etag: str | None = None

    def to_json(self, ledger: str, written: datetime) -> dict[str, Any]:
        """The journal as stored, written at `written` (which gives each write an ETag of its
        own: a conditional write never mistakes another writer's journal for the one it read)."""
        return {
            "formatVersion": 1,
            "ledger": ledger,
            "writtenTime": format_time(written),
            "retired": [
                {"identity": i, "time": format_time(t)} for i, t in sorted(self.retired.items())
            ],
        }


@dataclass(frozen=True)
class BucketView:
    """Everything a retention plan is made from, read from the bucket at one moment."""

    document: LedgerDocument
    etag: str | None
    others: Mapping[str, LedgerDocument]
    folders: Mapping[str, Folder]
    hints: Sequence[HintObject] = ()
    pins: Sequence[Holder] = ()
    journal: Journal | None = None


@dataclass(frozen=True)
class Verdict:
    """What happens to one folder (or hint object) and why."""

    name: str
    delete: bool
    reason: str
    category: Category
    files: int = 0
    size: int = 0

    def to_json(self) -> dict[str, Any]:
        """The verdict in `-o json` output."""
        return {
            "name": self.name,
            "delete": self.delete,
            "reason": self.reason,
            "category": self.category,
            "files": self.files,
            "bytes": self.size,
        }


@dataclass(frozen=True)
class RetentionPlan:
    """A gc of one ledger: the ledger after it, the entries it drops, and a verdict for every
    folder and hint object of the bucket it looked at."""

    ledger: str
    keep: int
    orphan_age: timedelta
    before: LedgerDocument
    after: LedgerDocument
    etag: str | None
    entries: tuple[tuple[LedgerEntry, str], ...]
    dropped: tuple[LedgerEntry, ...]
    folders: tuple[Verdict, ...]
    hints: tuple[Verdict, ...]
    missing: tuple[str, ...]
    journal: Journal | None = None
    #: The folders as listed (the objects of those that go are deleted one by one).
    listing: Mapping[str, Folder] = field(default_factory=dict, repr=False)
    #: Identities this plan takes out of the ledger (journaled with the time before the ledger
    #: changes: their folders go once the grace has passed, and a crash leaves them to the next
    #: run whatever their age).
    retiring: tuple[str, ...] = field(default=())
    #: How long the folders of dropped entries stay after they left the ledger.
    grace: timedelta = NO_GRACE
    #: The journal after this run: retired identities whose folders stay for their grace, with
    #: when they left the ledger (the newly retiring ones are stamped when the gc writes it).
    waiting: Mapping[str, datetime] = field(default_factory=dict)

    @property
    def doomed(self) -> tuple[Verdict, ...]:
        """The folders that go."""
        return tuple(v for v in self.folders if v.delete)

    @property
    def freed(self) -> int:
        """Bytes the folders that go hold."""
        return sum(v.size for v in self.doomed)

    def to_json(self) -> dict[str, Any]:
        """The plan in `-o json` output."""
        return {
            "ledger": self.ledger,
            "keep": self.keep,
            "orphanAgeSeconds": self.orphan_age.total_seconds(),
            "entries": [
                {"identity": e.identity, "sequence": e.sequence, "reason": why}
                for e, why in self.entries
            ],
            "droppedEntries": [
                {"identity": e.identity, "sequence": e.sequence} for e in self.dropped
            ],
            "folders": [v.to_json() for v in self.folders],
            "hints": [v.to_json() for v in self.hints],
            "missing": list(self.missing),
            "deleteFolders": len(self.doomed),
            "deleteBytes": self.freed,
        }


def plan_retention(
    view: BucketView,
    *,
    keep: int,
    orphan_age: timedelta = DEFAULT_ORPHAN_AGE,
    holders: Iterable[Holder] = (),
    now: datetime,
    grace: timedelta = NO_GRACE,
) -> RetentionPlan:
    """Decide what a gc of `view.document`'s ledger deletes: the entries it drops from the
    ledger (not among the last `keep`, not on the chain from the latest full snapshot, not on
    the chain of a pinned snapshot or of one `holders` need, not the newest adapter), their
    folders (unless another ledger names them) once `grace` has passed since they left the
    ledger, the orphans older than `orphan_age`, and the hints that were admitted or abandoned;
    with the reason for every verdict."""
    if keep < 1:
        raise LedgerError("keep must be at least 1")
    doc = view.document
    held: dict[str, list[str]] = {}
    for h in (*view.pins, *holders):
        held.setdefault(h.identity, []).append(h.reason)
    also = _held_chains(doc, held)
    after = doc.compacted(keep, now=now, also=also)
    named = {e.identity for e in after.entries}
    dropped = tuple(e for e in doc.entries if e.identity not in named)
    entries = tuple((e, _why_entry(doc, e, keep, also)) for e in after.entries)
    why_kept = {e.identity: why for e, why in entries}
    others: dict[str, str] = {}
    for name, other in sorted(view.others.items()):
        for e in other.entries:
            others.setdefault(e.identity, name)
    uploading = {
        h.identity: age
        for h in view.hints
        if (age := _hint_age(h, now)) is not None and age < orphan_age
    }
    retired = dict(view.journal.retired) if view.journal else {}
    dropped_ids = {e.identity for e in dropped}
    waiting: dict[str, datetime] = {}
    verdicts: list[Verdict] = []
    for name in sorted(view.folders):
        folder = view.folders[name]

        def verdict(delete: bool, reason: str, category: Category, f: Folder = folder) -> Verdict:
            return Verdict(f.name, delete, reason, category, len(f.objects), f.size)

        age = now - folder.newest if folder.newest is not None else None
        if not folder.is_snapshot:
            verdicts.append(verdict(False, "not a snapshot folder (left alone)", "other"))
        elif name in why_kept:
            verdicts.append(verdict(False, f"in the ledger: {why_kept[name]}", "entry"))
        elif name in others:
            verdicts.append(verdict(False, f"in ledger {others[name]!r}", "entry"))
        elif name in held:
            verdicts.append(verdict(False, "; ".join(held[name]), "orphan"))
        elif name in uploading:
            verdicts.append(
                verdict(
                    False,
                    f"an upload in flight (its hint was written {human_age(uploading[name])} ago)",
                    "orphan",
                )
            )
        elif name in dropped_ids:
            why = (
                f"dropped from the ledger: not among the last {keep} entries, not on the chain "
                "from the latest full snapshot, not pinned, served or targeted"
            )
            if grace > timedelta(0):
                waiting[name] = now
                why += f"; its files go after a grace of {human_age(grace)} ({_GRACE_WHY})"
            verdicts.append(verdict(grace <= timedelta(0), why, "entry"))
        elif name in retired and (folder.newest is None or folder.newest <= retired[name]):
            left = now - retired[name]
            if left < grace:
                waiting[name] = retired[name]
                verdicts.append(
                    verdict(
                        False,
                        f"left the ledger {human_age(left)} ago; its files go once "
                        f"{human_age(grace)} have passed ({_GRACE_WHY})",
                        "orphan",
                    )
                )
            else:
                verdicts.append(
                    verdict(
                        True,
                        f"left the ledger {human_age(left)} ago, past its grace of "
                        f"{human_age(grace)}"
                        if grace
                        else "retired from the ledger by an earlier gc that stopped before "
                        "deleting it",
                        "orphan",
                    )
                )
        elif age is not None and age < orphan_age:
            verdicts.append(
                verdict(
                    False,
                    f"in no ledger, newest file {human_age(age)} old: a publish not yet admitted "
                    f"or in flight (goes once older than {human_age(orphan_age)})",
                    "orphan",
                )
            )
        else:
            what = (
                "a complete snapshot in no ledger (compacted away or never admitted)"
                if folder.committed
                else "a failed publish (no commit manifest)"
            )
            old = f", newest file {human_age(age)} old" if age is not None else ""
            verdicts.append(verdict(True, f"an orphan: {what}{old}", "orphan"))
    hints = tuple(_hint_verdict(h, doc, orphan_age, now) for h in view.hints)
    present = {n for n, f in view.folders.items() if f.committed}
    doomed = {v.name for v in verdicts if v.delete}
    missing = tuple(e.identity for e in after.entries if e.identity not in present)
    return RetentionPlan(
        ledger=doc.name,
        keep=keep,
        orphan_age=orphan_age,
        before=doc,
        after=after,
        etag=view.etag,
        entries=entries,
        dropped=dropped,
        folders=tuple(verdicts),
        hints=hints,
        missing=missing,
        journal=view.journal,
        listing=view.folders,
        retiring=tuple(e.identity for e in dropped if e.identity in doomed | set(waiting)),
        grace=grace,
        waiting=waiting,
    )


_GRACE_WHY = "a loader that read the ledger before may still be fetching them"


def _held_chains(doc: LedgerDocument, held: Mapping[str, list[str]]) -> dict[str, str]:
    """{identity: why} of the entries gc keeps in the ledger beyond compaction: the chains that
    rebuild every held snapshot, and the newest LoRA adapter (replicas load it)."""
    also: dict[str, str] = {}
    for identity, reasons in held.items():
        entry = doc.find(identity)
        if entry is None:
            continue
        try:
            chain = doc.chain_to(identity)
        except LedgerError:
            chain = [entry]  # broken already: keep what is there, rebuild nothing new
        for link in chain:
            why = "; ".join(reasons)
            also.setdefault(
                link.identity, why if link is chain[-1] else f"on the chain of {identity} ({why})"
            )
    for adapter in doc.adapters(1):
        also.setdefault(adapter.identity, "the newest LoRA adapter")
    return also


def _why_entry(doc: LedgerDocument, entry: LedgerEntry, keep: int, also: Mapping[str, str]) -> str:
    reasons = []
    root = doc.latest_root()
    if root is not None and entry.kind != "lora" and entry.sequence >= root.sequence:
        reasons.append(f"on the chain from the latest full snapshot {root.identity}")
    if entry in doc.entries[-keep:]:
        reasons.append(f"among the last {keep} entries")
    if entry.identity in also:
        reasons.append(also[entry.identity])
    return "; ".join(reasons) or "kept"


def _hint_age(h: HintObject, now: datetime) -> timedelta | None:
    when = h.hint.updated_time if h.hint is not None and h.hint.updated_time else h.last_modified
    return now - when if when is not None else None


def _hint_verdict(
    h: HintObject, doc: LedgerDocument, orphan_age: timedelta, now: datetime
) -> Verdict:
    age = _hint_age(h, now)
    if doc.find(h.identity) is not None:
        return Verdict(h.key, True, "its snapshot was admitted", "other")
    if age is None or age >= orphan_age:
        what = "unreadable" if h.hint is None else "never admitted"
        old = f", written {human_age(age)} ago" if age is not None else ""
        return Verdict(h.key, True, f"abandoned: {what}{old}", "orphan")
    return Verdict(h.key, False, f"an upload in flight (written {human_age(age)} ago)", "orphan")
