"""The ledger document: entries, resets, the rules an append must obey, and chain resolution.

Everything here is pure (no I/O), so the rules can be tested and reused by any writer.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final, Literal, get_args

from hotload.errors import LedgerError, LedgerRejectedError
from hotload.ledger.fields import (
    DIGEST,
    check_increasing,
    choice_field,
    digest_field,
    format_time,
    identity_field,
    int_field,
    json_object,
    optional_digest_field,
    optional_identity_field,
    time_field,
    utc_now,
)
from hotload.snapshot.layout import validate_identity

FORMAT_VERSION: Final = 1

EntryKind = Literal["full", "incremental", "lora"]
PromptCachePolicy = Literal["all", "none", "new_session"]

ENTRY_KINDS: Final[tuple[str, ...]] = get_args(EntryKind)
PROMPT_CACHE_POLICIES: Final[tuple[str, ...]] = get_args(PromptCachePolicy)
#: Kinds that need nothing before them: a full snapshot, or a complete LoRA adapter.
SELF_CONTAINED: Final = ("full", "lora")
#: Kinds of the base-weight chain (a LoRA adapter rides on top of it and never moves its head).
BASE_KINDS: Final = ("full", "incremental")
#: Longest reset reason kept (a reason is for humans, not a log dump).
MAX_REASON = 1000


@dataclass(frozen=True)
class NewEntry:
    """What a publisher appends; the ledger assigns the sequence (and the time, unless given).

    `previous` is required for an incremental (its parent, which must be the head). For a full
    snapshot leave it None and the ledger records the head it follows; a LoRA adapter has no
    parent (adapters are complete and never chain).
    """

    identity: str
    kind: EntryKind
    manifest_digest: str
    shipped_bytes: int
    full_bytes: int
    previous: str | None = None
    prompt_cache: PromptCachePolicy = "all"
    published_time: datetime | None = None
    content_digest: str | None = None


@dataclass(frozen=True)
class LedgerEntry:
    """One published snapshot in the ledger."""

    sequence: int
    identity: str
    kind: EntryKind
    previous: str | None
    published_time: datetime
    prompt_cache: PromptCachePolicy
    manifest_digest: str
    shipped_bytes: int
    full_bytes: int
    #: Pins every file's bytes (`hotload.snapshot.reader.content_digest`); None in entries
    #: written before it existed, which keep the manifest check only.
    content_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry as the ledger stores it (camelCase keys; contentDigest only when known)."""
        doc: dict[str, Any] = {
            "sequence": self.sequence,
            "identity": self.identity,
            "kind": self.kind,
            "previous": self.previous,
            "publishedTime": format_time(self.published_time),
            "promptCache": self.prompt_cache,
            "manifestDigest": self.manifest_digest,
            "shippedBytes": self.shipped_bytes,
            "fullBytes": self.full_bytes,
        }
        if self.content_digest is not None:
            doc["contentDigest"] = self.content_digest
        return doc

    @classmethod
    def from_json(cls, doc: object, where: str) -> LedgerEntry:
        """Parse one stored entry; `where` names it in error messages."""
        d = json_object(doc, where)
        return cls(
            sequence=int_field(d, "sequence", where, minimum=1),
            identity=identity_field(d, "identity", where),
            kind=choice_field(d, "kind", where, ENTRY_KINDS),  # type: ignore[arg-type]
            previous=optional_identity_field(d, "previous", where),
            published_time=time_field(d, "publishedTime", where),
            prompt_cache=choice_field(d, "promptCache", where, PROMPT_CACHE_POLICIES),  # type: ignore[arg-type]
            manifest_digest=digest_field(d, "manifestDigest", where),
            shipped_bytes=int_field(d, "shippedBytes", where, minimum=0),
            full_bytes=int_field(d, "fullBytes", where, minimum=0),
            content_digest=optional_digest_field(d, "contentDigest", where),
        )


def same_content(existing: LedgerEntry, new: NewEntry) -> bool:
    """Whether `new` describes the snapshot `existing` holds: same manifest digest, and the same
    content digest when both have one (an older entry without it is matched on manifests)."""
    if existing.manifest_digest != new.manifest_digest:
        return False
    if existing.content_digest is None or new.content_digest is None:
        return True
    return existing.content_digest == new.content_digest


@dataclass(frozen=True)
class ResetRecord:
    """An explicit reset: when, why, and what the head was; the next entry must be full."""

    sequence: int
    time: datetime
    reason: str
    previous_head: str | None

    def to_json(self) -> dict[str, Any]:
        """The reset as the ledger stores it."""
        return {
            "sequence": self.sequence,
            "time": format_time(self.time),
            "reason": self.reason,
            "previousHead": self.previous_head,
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> ResetRecord:
        """Parse one stored reset record."""
        d = json_object(doc, where)
        reason = d.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise LedgerError(f"{where}.reason: must be a non-empty string")
        return cls(
            sequence=int_field(d, "sequence", where, minimum=1),
            time=time_field(d, "time", where),
            reason=reason,
            previous_head=optional_identity_field(d, "previousHead", where),
        )


@dataclass(frozen=True)
class LedgerDocument:
    """The whole ledger: retained entries (oldest first), resets, and the sequence counter.

    `sequence` is the last sequence number handed out (to an entry or a reset); it only grows.
    `compacted_through` is the highest sequence dropped by compaction (0 if none).
    """

    name: str
    sequence: int = 0
    entries: tuple[LedgerEntry, ...] = ()
    resets: tuple[ResetRecord, ...] = ()
    compacted_through: int = 0
    updated_time: datetime | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    # --- queries ------------------------------------------------------------------------------

    @property
    def head(self) -> LedgerEntry | None:
        """The newest base-weight entry (full or incremental): what replicas serve. LoRA
        adapters are published beside the chain and never move it (see `adapters`)."""
        for entry in reversed(self.entries):
            if entry.kind in BASE_KINDS:
                return entry
        return None

    @property
    def last(self) -> LedgerEntry | None:
        """The newest entry of any kind (an adapter included), or None for an empty ledger."""
        return self.entries[-1] if self.entries else None

    def adapters(self, limit: int | None = None) -> list[LedgerEntry]:
        """The retained LoRA adapter entries, newest first (at most `limit` of them)."""
        found = [e for e in reversed(self.entries) if e.kind == "lora"]
        return found if limit is None else found[: max(0, limit)]

    @property
    def pending_reset(self) -> ResetRecord | None:
        """The reset that forces the next entry to be full, if no entry has followed it yet."""
        if not self.resets:
            return None
        last = self.resets[-1]
        head = self.head
        return last if head is None or last.sequence > head.sequence else None

    def find(self, identity: str) -> LedgerEntry | None:
        """The retained entry with this identity, if any."""
        for entry in reversed(self.entries):
            if entry.identity == identity:
                return entry
        return None

    def latest_root(self) -> LedgerEntry | None:
        """The newest full snapshot: where the base-weight chain to the head starts."""
        for entry in reversed(self.entries):
            if entry.kind == "full":
                return entry
        return None

    # --- rules --------------------------------------------------------------------------------

    def check(self, new: NewEntry) -> None:
        """Raise `LedgerRejectedError` (saying why) unless `new` may be appended now."""
        validate_identity(new.identity)
        where = f"ledger {self.name!r}"
        if new.kind not in ENTRY_KINDS:
            raise LedgerRejectedError(f"{where}: kind {new.kind!r} is not one of {ENTRY_KINDS}")
        if new.prompt_cache not in PROMPT_CACHE_POLICIES:
            raise LedgerRejectedError(
                f"{where}: prompt-cache policy {new.prompt_cache!r} is not one of "
                f"{PROMPT_CACHE_POLICIES}"
            )
        if not isinstance(new.manifest_digest, str) or not DIGEST.match(new.manifest_digest):
            raise LedgerRejectedError(
                f"{where}: manifest digest {new.manifest_digest!r} is not 'sha256:' + 64 hex digits"
            )
        if new.content_digest is not None and (
            not isinstance(new.content_digest, str) or not DIGEST.match(new.content_digest)
        ):
            raise LedgerRejectedError(
                f"{where}: content digest {new.content_digest!r} is not 'sha256:' + 64 hex digits"
            )
        for label, value in (("shipped", new.shipped_bytes), ("full", new.full_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LedgerRejectedError(f"{where}: {label} bytes must be a non-negative integer")
        existing = self.find(new.identity)
        if existing is not None:
            raise LedgerRejectedError(
                f"{where}: snapshot {new.identity!r} is already in the ledger at sequence "
                f"{existing.sequence}; identities are unique"
            )
        head = self.head
        pending = self.pending_reset
        if new.kind == "incremental":
            if pending is not None:
                raise LedgerRejectedError(
                    f"{where}: was reset at sequence {pending.sequence} ({pending.reason!r}); the "
                    f"next entry must be a full snapshot, but {new.identity!r} is incremental"
                )
            if head is None:
                raise LedgerRejectedError(
                    f"{where}: is empty, so incremental {new.identity!r} has no parent to apply "
                    "to; publish a full snapshot first"
                )
            if new.previous is None:
                raise LedgerRejectedError(
                    f"{where}: incremental {new.identity!r} does not name its parent snapshot"
                )
        if new.kind == "lora":
            if new.previous is not None:
                raise LedgerRejectedError(
                    f"{where}: LoRA adapter {new.identity!r} names a parent ({new.previous!r}); "
                    "adapters are complete and have none"
                )
            return
        expected = None if pending is not None else (head.identity if head else None)
        if new.previous is not None and new.previous != expected:
            raise LedgerRejectedError(
                f"{where}: {new.identity!r} was made on top of {new.previous!r}, but the head is "
                f"{expected!r}; a {new.kind} entry must follow the current head"
            )

    def appended(
        self, new: NewEntry, now: datetime | None = None
    ) -> tuple[LedgerDocument, LedgerEntry]:
        """Return the document with `new` appended (after `check`) and the stored entry."""
        self.check(new)
        when = now or utc_now()
        pending = self.pending_reset
        head = self.head
        previous = new.previous
        if previous is None and new.kind == "full" and pending is None and head is not None:
            previous = head.identity
        entry = LedgerEntry(
            sequence=self.sequence + 1,
            identity=new.identity,
            kind=new.kind,
            previous=previous,
            published_time=new.published_time or when,
            prompt_cache=new.prompt_cache,
            manifest_digest=new.manifest_digest,
            shipped_bytes=new.shipped_bytes,
            full_bytes=new.full_bytes,
            content_digest=new.content_digest,
        )
        doc = replace(
            self, sequence=entry.sequence, entries=(*self.entries, entry), updated_time=when
        )
        return doc, entry

    def with_reset(
        self, reason: str, now: datetime | None = None
    ) -> tuple[LedgerDocument, ResetRecord]:
        """Return the document with a reset recorded; the next entry will have to be full."""
        text = reason.strip() if isinstance(reason, str) else ""
        if not text:
            raise LedgerRejectedError(f"ledger {self.name!r}: a reset needs a reason")
        if len(text) > MAX_REASON:
            raise LedgerRejectedError(
                f"ledger {self.name!r}: reset reason is {len(text)} characters; "
                f"keep it under {MAX_REASON}"
            )
        when = now or utc_now()
        head = self.head
        record = ResetRecord(self.sequence + 1, when, text, head.identity if head else None)
        doc = replace(
            self, sequence=record.sequence, resets=(*self.resets, record), updated_time=when
        )
        return doc, record

    def compacted(
        self, keep: int, now: datetime | None = None, *, also: Collection[str] = ()
    ) -> LedgerDocument:
        """Drop old history, keeping the last `keep` entries (adapters count) and always the
        chain from the latest full snapshot (so the head stays resolvable); adapters older than
        the last `keep` entries go even from inside that chain's span. Entries named in `also`
        stay wherever they are (retention keeps the chains of pinned and served snapshots). The
        sequence is unchanged."""
        keep = max(1, keep)
        if len(self.entries) <= keep:
            return self
        recent = len(self.entries) - keep
        start = recent
        root = self.latest_root()
        if root is not None:
            start = min(start, self.entries.index(root))
        kept = tuple(
            e
            for i, e in enumerate(self.entries)
            if i >= recent or (i >= start and e.kind != "lora") or e.identity in also
        )
        if len(kept) == len(self.entries):
            return self
        first_kept = kept[0].sequence
        # Entries are dropped from the front (the counter below) and, for old adapters, from
        # inside the kept span too; the counter covers what went before the first kept one.
        before = [e.sequence for e in self.entries if e.sequence < first_kept]
        through = max([self.compacted_through, *before])
        pending = self.pending_reset
        resets = tuple(r for r in self.resets if r.sequence > first_kept or r is pending)
        through = max([through, *(r.sequence for r in self.resets if r not in resets)])
        return replace(
            self,
            entries=kept,
            resets=resets,
            compacted_through=through,
            updated_time=now or utc_now(),
        )

    # --- chain resolution ---------------------------------------------------------------------

    def chain_to(self, target: str | None = None) -> list[LedgerEntry]:
        """The entries needed to build `target` (default: the head) from nothing: the latest
        self-contained entry before it, then every delta up to it."""
        if target is None:
            head = self.head
            if head is None:
                return []
            target = head.identity
        index = {e.identity: i for i, e in enumerate(self.entries)}
        if target in index:
            i = index[target]
        else:
            raise LedgerError(f"ledger {self.name!r}: snapshot {target!r} is not in the ledger")
        chain: list[LedgerEntry] = []
        while True:
            entry = self.entries[i]
            chain.append(entry)
            if entry.kind in SELF_CONTAINED:
                break
            parent = entry.previous
            if parent is None or parent not in index or index[parent] >= i:
                raise LedgerError(
                    f"ledger {self.name!r}: the chain to {chain[0].identity!r} is broken: parent "
                    f"{parent!r} of {entry.identity!r} is not in the retained history"
                )
            i = index[parent]
        chain.reverse()
        return chain

    def resolve_chain(self, current: str | None, target: str | None = None) -> list[LedgerEntry]:
        """The cheapest list of snapshots to fetch and apply, in order, to go from `current`
        (what a replica serves now, or None) to `target` (default: the head).

        Empty when `current` is already the target; only the deltas after `current` when it is on
        the target's chain; otherwise the latest full snapshot plus every delta after it.
        """
        chain = self.chain_to(target)
        if current is not None:
            for i, entry in enumerate(chain):
                if entry.identity == current:
                    return chain[i + 1 :]
        return chain

    # --- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The document as stored (`formatVersion` first, camelCase keys)."""
        doc: dict[str, Any] = {
            "formatVersion": FORMAT_VERSION,
            "name": self.name,
            "sequence": self.sequence,
            "head": self.head.identity if self.head else None,
            "latestAdapter": adapters[0].identity if (adapters := self.adapters(1)) else None,
            "resetPending": self.pending_reset is not None,
            "compactedThrough": self.compacted_through,
            "updatedTime": format_time(self.updated_time) if self.updated_time else None,
            "entries": [e.to_json() for e in self.entries],
            "resets": [r.to_json() for r in self.resets],
        }
        # Fields written by a newer minor revision survive a round trip through this one.
        for key, value in self.extra.items():
            doc.setdefault(key, value)
        return doc

    def dumps(self) -> bytes:
        """Serialize to the bytes stored in the bucket."""
        return (json.dumps(self.to_json(), indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, doc: object, where: str) -> LedgerDocument:
        """Parse and check a stored document; errors name `where` and the offending field."""
        d = json_object(doc, where)
        version = d.get("formatVersion")
        if not isinstance(version, int) or isinstance(version, bool):
            raise LedgerError(f"{where}: formatVersion: missing or not an integer")
        if version > FORMAT_VERSION:
            raise LedgerError(
                f"{where}: formatVersion {version} is newer than this hotload understands "
                f"({FORMAT_VERSION}); upgrade hotload"
            )
        if version < 1:
            raise LedgerError(f"{where}: formatVersion {version} is not valid")
        name = d.get("name")
        if not isinstance(name, str):
            raise LedgerError(f"{where}: name: must be a string")
        raw_entries = d.get("entries", [])
        raw_resets = d.get("resets", [])
        if not isinstance(raw_entries, list):
            raise LedgerError(f"{where}: entries: must be a list")
        if not isinstance(raw_resets, list):
            raise LedgerError(f"{where}: resets: must be a list")
        entries = tuple(
            LedgerEntry.from_json(e, f"{where}: entries[{i}]") for i, e in enumerate(raw_entries)
        )
        resets = tuple(
            ResetRecord.from_json(r, f"{where}: resets[{i}]") for i, r in enumerate(raw_resets)
        )
        sequence = int_field(d, "sequence", where, minimum=0)
        compacted = int_field(d, "compactedThrough", where, minimum=0, default=0)
        check_increasing(entries, f"{where}: entries", compacted, sequence)
        check_increasing(resets, f"{where}: resets", 0, sequence)
        seen: set[str] = set()
        for i, e in enumerate(entries):
            if e.identity in seen:
                raise LedgerError(f"{where}: entries[{i}].identity: {e.identity!r} appears twice")
            seen.add(e.identity)
        updated = d.get("updatedTime")
        known = {
            "formatVersion",
            "name",
            "sequence",
            "head",
            "latestAdapter",
            "resetPending",
            "compactedThrough",
            "updatedTime",
            "entries",
            "resets",
        }
        return cls(
            name=name,
            sequence=sequence,
            entries=entries,
            resets=resets,
            compacted_through=compacted,
            updated_time=time_field(d, "updatedTime", where) if updated is not None else None,
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def loads(cls, data: bytes, where: str) -> LedgerDocument:
        """Parse stored bytes; a malformed ledger raises `LedgerError` naming `where`."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LedgerError(f"{where}: not valid JSON: {exc}") from None
        return cls.from_json(doc, where)
