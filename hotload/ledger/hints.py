"""Hints: a snapshot announced while it uploads, so replicas can fetch it before it is admitted.

A publisher writes `.hotload/hints/<ledger>/<identity>.json` next to the ledger when an upload
starts and rewrites it as each file lands (name, size, ETag) and once more, `complete` with the
manifest digest, when the last manifest is in. Loaders list the folder while they poll and
download (and, once complete, rebuild and verify) hinted snapshots whose parent they hold. A
hint never changes what a replica serves: only a ledger entry with the same manifest digest
does; an unadmitted hint is ignored after `HINT_TTL_SECONDS` and deleted by the next publisher.

`prefetch_decision` is the pure part: what a loader does with one hint.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Literal

from hotload.bucket.core import Bucket
from hotload.errors import InvalidIdentityError, LedgerError, ObjectNotFoundError
from hotload.ledger.fields import format_time, load_versioned, time_field, utc_now
from hotload.ledger.model import LedgerDocument
from hotload.snapshot.layout import validate_identity

#: Where hint objects live inside a bucket.
HINT_PREFIX = ".hotload/hints"
HINT_FORMAT_VERSION = 1
#: A hint not rewritten for this long and not admitted is abandoned (a crashed publisher).
HINT_TTL_SECONDS = 600.0

HintKind = Literal["full", "incremental"]
Decision = Literal["prefetch", "wait", "ignore", "drop"]


def hints_prefix(ledger: str) -> str:
    """The folder of a ledger's hints: `.hotload/hints/<ledger>`."""
    return f"{HINT_PREFIX}/{ledger}"


def hint_key(ledger: str, identity: str) -> str:
    """The object key of one hint: `.hotload/hints/<ledger>/<identity>.json`."""
    return f"{hints_prefix(ledger)}/{validate_identity(identity)}.json"


@dataclass(frozen=True)
class HintFile:
    """One landed file of a hinted snapshot (name relative to the snapshot folder)."""

    name: str
    size: int
    etag: str | None = None


@dataclass(frozen=True)
class Hint:
    """A snapshot being uploaded: which, on which parent, the files landed so far."""

    identity: str
    kind: HintKind = "incremental"
    previous: str | None = None
    files: tuple[HintFile, ...] = ()
    complete: bool = False
    #: The manifest digest (set once complete); the ledger entry must record the same one.
    manifest_digest: str = ""
    updated_time: datetime | None = None

    def with_file(self, landed: HintFile) -> Hint:
        """This hint with `landed` recorded (replacing an earlier record of the same name)."""
        files = (*tuple(f for f in self.files if f.name != landed.name), landed)
        return replace(self, files=files, updated_time=utc_now())

    def dumps(self) -> bytes:
        """The object as stored (camelCase JSON)."""
        doc = {
            "formatVersion": HINT_FORMAT_VERSION,
            "identity": self.identity,
            "kind": self.kind,
            "previous": self.previous,
            "files": [{"name": f.name, "size": f.size, "etag": f.etag} for f in self.files],
            "complete": self.complete,
            "manifestDigest": self.manifest_digest,
            "updatedTime": format_time(self.updated_time or utc_now()),
        }
        return json.dumps(doc, indent=2).encode() + b"\n"

    @classmethod
    def loads(cls, data: bytes, where: str) -> Hint:
        """Parse a stored hint; `LedgerError` naming `where` and the field when it is invalid."""
        doc = load_versioned(data, where, HINT_FORMAT_VERSION)
        try:
            identity = validate_identity(doc.get("identity"))
            previous = doc.get("previous")
            if previous is not None:
                previous = validate_identity(previous)
        except InvalidIdentityError as err:
            raise LedgerError(f"{where}: {err}") from None
        kind = doc.get("kind")
        if kind not in ("full", "incremental") or (kind == "incremental") != (previous is not None):
            raise LedgerError(f"{where}: kind {kind!r} with previous {previous!r} is not valid")
        files = parse_files(doc.get("files") or [], f"{where}: files")
        updated = time_field(doc, "updatedTime", where) if doc.get("updatedTime") else None
        return cls(
            identity,
            kind,
            previous,
            files,
            bool(doc.get("complete")),
            str(doc.get("manifestDigest") or ""),
            updated,
        )


def parse_files(raw: object, where: str) -> tuple[HintFile, ...]:
    """A stored list of snapshot files (`[{name, size, etag}]`); `LedgerError` naming `where`
    and the file when one is invalid."""
    if not isinstance(raw, list):
        raise LedgerError(f"{where}: must be a list")
    files = []
    for item in raw:
        name = item.get("name") if isinstance(item, dict) else None
        size = item.get("size") if isinstance(item, dict) else None
        # Names become local paths on every replica: one plain segment, nothing else.
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise LedgerError(f"{where}: invalid name {name!r}")
        if not isinstance(size, int) or size < 0:
            raise LedgerError(f"{where}: {name}: invalid size {size!r}")
        etag = item.get("etag")
        files.append(HintFile(name, size, str(etag) if etag else None))
    return tuple(files)


def expired(hint: Hint, *, now: datetime | None = None, ttl: float = HINT_TTL_SECONDS) -> bool:
    """Whether `hint` was last rewritten more than `ttl` seconds ago (an abandoned upload)."""
    updated = hint.updated_time
    return updated is not None and (now or utc_now()) - updated > timedelta(seconds=ttl)


@dataclass(frozen=True)
class Plan:
    """What to do with one hint, and why (for logs)."""

    decision: Decision
    reason: str = ""


def prefetch_decision(
    hint: Hint,
    document: LedgerDocument | None,
    local: Collection[str],
    *,
    now: datetime | None = None,
    ttl: float = HINT_TTL_SECONDS,
) -> Plan:
    """What a loader holding the verified snapshots `local` does with `hint`: prefetch it (its
    parent is on disk, or it is full), wait (its parent is admitted but not built here yet),
    ignore it (the ledger already decides), or drop it (abandoned, or off this replica's
    chain)."""
    if document is not None and document.find(hint.identity) is not None:
        return Plan("ignore", "the ledger names it: the normal update path takes over")
    if hint.identity in local:
        return Plan("ignore", "already on disk")
    if expired(hint, now=now, ttl=ttl):
        return Plan("drop", f"not updated for over {ttl:g}s and never admitted")
    if hint.kind == "full":
        return Plan("prefetch", "a full snapshot needs no parent")
    assert hint.previous is not None
    if hint.previous in local:
        return Plan("prefetch", f"its parent {hint.previous} is on disk")
    head = document.head if document is not None else None
    if document is not None and document.find(hint.previous) is not None:
        if head is not None and head.identity != hint.previous:
            # The ledger moved past the parent: this delta can never be admitted on it.
            return Plan("drop", f"the ledger head {head.identity} is past its parent")
        return Plan("wait", f"its parent {hint.previous} is admitted but not built here yet")
    return Plan("drop", f"its parent {hint.previous} is not on this replica's chain")


@dataclass
class HintWriter:
    """Keeps one hint object up to date while its snapshot uploads (rewrites are serialised by
    the caller's single task or by `landed` being awaited in order)."""

    bucket: Bucket
    ledger: str
    hint: Hint
    writes: int = field(default=0)

    @property
    def key(self) -> str:
        """The hint's object key."""
        return hint_key(self.ledger, self.hint.identity)

    async def start(self) -> None:
        """Write the hint (no files yet)."""
        await self._write()

    async def landed(self, name: str, size: int, etag: str | None) -> None:
        """Record one landed file."""
        self.hint = self.hint.with_file(HintFile(name, size, etag))
        await self._write()

    async def finish(self, manifest_digest: str) -> None:
        """Mark the hint complete: every file, manifests included, is in the bucket."""
        self.hint = replace(
            self.hint, complete=True, manifest_digest=manifest_digest, updated_time=utc_now()
        )
        await self._write()

    async def _write(self) -> None:
        await self.bucket.put_async(self.key, self.hint.dumps())
        self.writes += 1


async def read_hint_async(bucket: Bucket, ledger: str, identity: str) -> Hint | None:
    """The stored hint of `identity` (None when there is none)."""
    key = hint_key(ledger, identity)
    try:
        data = (await bucket.get_async(key)).data
    except ObjectNotFoundError:
        return None
    return Hint.loads(data, f"{bucket.url.rstrip('/')}/{key}")


async def write_hint_async(bucket: Bucket, ledger: str, hint: Hint) -> None:
    """Store `hint` (replacing an earlier version)."""
    await bucket.put_async(hint_key(ledger, hint.identity), hint.dumps())


async def list_hints_async(bucket: Bucket, ledger: str) -> dict[str, str | None]:
    """The hinted identities of `ledger` with each hint object's ETag (one LIST request)."""
    prefix = hints_prefix(ledger)
    out: dict[str, str | None] = {}
    for info in await bucket.list_async(prefix):
        name = info.key.removeprefix(prefix + "/")
        if "/" not in name and name.endswith(".json"):
            out[name.removesuffix(".json")] = info.etag
    return out


async def prune_hints_async(bucket: Bucket, ledger: str, document: LedgerDocument) -> list[str]:
    """Delete the hints the ledger already admitted or that were abandoned; return them."""
    doomed = []
    for identity in await list_hints_async(bucket, ledger):
        try:
            hint = await read_hint_async(bucket, ledger, identity)
        except (LedgerError, InvalidIdentityError):
            hint = None  # garbage: nobody can use it
        if document.find(identity) is not None or hint is None or expired(hint):
            try:
                await bucket.delete_async(hint_key(ledger, identity))
            except (ObjectNotFoundError, InvalidIdentityError):
                continue
            doomed.append(identity)
    return doomed
