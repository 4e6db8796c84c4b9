"""The ledger in a bucket: read, poll, and change it only through compare-and-swap."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from hotload.bucket.core import Bucket
from hotload.bucket.objects import NotModified, run_sync
from hotload.errors import (
    LedgerConflictError,
    LedgerError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from hotload.ledger.fields import validate_ledger_name
from hotload.ledger.model import (
    LedgerDocument,
    LedgerEntry,
    NewEntry,
    ResetRecord,
    same_content,
)

T = TypeVar("T")

#: Where ledgers live inside a bucket.
LEDGER_PREFIX = ".hotload/ledgers"
#: Entries kept by automatic compaction (beyond the chain from the latest full snapshot).
DEFAULT_HISTORY = 256
#: How often the retrying helpers re-read and try again after losing a race.
DEFAULT_ATTEMPTS = 8


def ledger_key(name: str) -> str:
    """The object key of ledger `name`: `.hotload/ledgers/<name>.json`."""
    return f"{LEDGER_PREFIX}/{validate_ledger_name(name)}.json"


@dataclass(frozen=True)
class LedgerState:
    """A ledger as read: the document and the ETag it had (None when the ledger does not exist)."""

    document: LedgerDocument
    etag: str | None

    @property
    def exists(self) -> bool:
        """Whether the ledger object exists in the bucket."""
        return self.etag is not None


class Ledger:
    """One named ledger in a bucket; any number of read-only followers may poll it."""

    def __init__(self, bucket: Bucket, name: str, *, history: int = DEFAULT_HISTORY) -> None:
        self.bucket = bucket
        self.name = validate_ledger_name(name)
        self.key = ledger_key(name)
        self.history = max(1, history)
        self.url = f"{bucket.url.rstrip('/')}/{self.key}"

    def __repr__(self) -> str:
        return f"Ledger({self.url!r})"

    # --- reading ------------------------------------------------------------------------------

    async def read_async(self) -> LedgerState:
        """Read the ledger; a ledger that does not exist yet reads as empty (etag None)."""
        result = await self.poll_async(None)
        assert result is not None
        return result

    async def poll_async(
        self, etag: str | None, *, last_sequence: int | None = None
    ) -> LedgerState | None:
        """Return the ledger if it changed since `etag`, else None (one small conditional GET).

        With `last_sequence`, a ledger whose sequence went backwards (deleted and recreated, or
        restored from an old copy) raises `LedgerError` instead of being followed.
        """
        try:
            result = await self.bucket.get_if_changed_async(self.key, etag)
        except ObjectNotFoundError:
            if last_sequence:
                raise LedgerError(
                    f"{self.url}: the ledger disappeared (last seen at sequence {last_sequence})"
                ) from None
            return LedgerState(LedgerDocument(self.name), None)
        if isinstance(result, NotModified):
            return None
        document = LedgerDocument.loads(result.data, self.url)
        if document.name != self.name:
            raise LedgerError(f"{self.url}: holds ledger {document.name!r}, not {self.name!r}")
        if last_sequence is not None and document.sequence < last_sequence:
            raise LedgerError(
                f"{self.url}: sequence went back from {last_sequence} to {document.sequence}; "
                "a ledger never rewinds, so this copy is stale or was replaced"
            )
        return LedgerState(document, result.etag)

    async def resolve_chain_async(
        self, current: str | None, target: str | None = None
    ) -> list[LedgerEntry]:
        """Read the ledger and return the snapshots to fetch and apply to reach `target` (head)."""
        state = await self.read_async()
        return state.document.resolve_chain(current, target)

    # --- writing (compare-and-swap) ------------------------------------------------------------

    async def append_async(self, new: NewEntry, *, state: LedgerState | None = None) -> LedgerEntry:
        """Append one entry with compare-and-swap against `state` (or a fresh read).

        Raises `LedgerRejectedError` if the entry breaks a rule and `LedgerConflictError` if
        another writer changed the ledger since `state` was read.
        """
        state = state or await self.read_async()
        document, entry = state.document.appended(new)
        document = (
            document.compacted(self.history) if len(document.entries) > self.history else document
        )
        await self._write(state, document)
        return entry

    async def append_retrying_async(
        self, new: NewEntry, *, attempts: int = DEFAULT_ATTEMPTS
    ) -> LedgerEntry:
        """Append, re-reading and retrying after lost races while the entry is still valid.

        If the ledger already holds this identity with the same kind, manifest digest and content
        digest (`same_content`: an earlier attempt landed but its answer was lost), that entry
        is returned.
        """

        async def append(state: LedgerState) -> LedgerEntry:
            existing = state.document.find(new.identity)
            if existing is not None and existing.kind == new.kind and same_content(existing, new):
                return existing
            return await self.append_async(new, state=state)

        return await self._until_written(append, attempts)

    async def reset_async(self, reason: str, *, attempts: int = DEFAULT_ATTEMPTS) -> ResetRecord:
        """Record an explicit reset (with its reason); the next entry must be a full snapshot."""

        async def reset(state: LedgerState) -> ResetRecord:
            document, record = state.document.with_reset(reason)
            await self._write(state, document)
            return record

        return await self._until_written(reset, attempts)

    async def compact_async(
        self, keep: int | None = None, *, attempts: int = DEFAULT_ATTEMPTS
    ) -> LedgerDocument:
        """Drop old entries, keeping `keep` (default: the ledger's history setting) and always
        the chain from the latest full snapshot; return the compacted document."""

        async def compact(state: LedgerState) -> LedgerDocument:
            document = state.document.compacted(self.history if keep is None else keep)
            if document is not state.document:
                await self._write(state, document)
            return document

        return await self._until_written(compact, attempts)

    async def _until_written(
        self, change: Callable[[LedgerState], Awaitable[T]], attempts: int
    ) -> T:
        """Run `change` on a fresh read until its compare-and-swap wins, re-reading after each
        lost race (with a growing, jittered pause) up to `attempts` times."""
        for attempt in range(1, attempts + 1):
            state = await self.read_async()
            try:
                return await change(state)
            except LedgerConflictError:
                if attempt == attempts:
                    raise
                await asyncio.sleep(random.uniform(0.01, 0.05) * attempt)
        raise AssertionError("unreachable")

    async def _write(self, state: LedgerState, document: LedgerDocument) -> str | None:
        if document.sequence < state.document.sequence:
            raise LedgerError(f"{self.url}: refusing to rewind the sequence")  # a bug, never data
        data = document.dumps()
        try:
            if state.etag is None:
                return await self.bucket.put_async(self.key, data, create_only=True)
            return await self.bucket.put_async(self.key, data, if_match=state.etag)
        except PreconditionFailedError as exc:
            raise LedgerConflictError(
                f"{self.url}: another writer changed the ledger after it was read at sequence "
                f"{state.document.sequence}; re-read it and try again ({exc.reason})"
            ) from exc

    # --- blocking twins -----------------------------------------------------------------------

    def read(self) -> LedgerState:
        """Blocking `read_async`."""
        return run_sync(self.read_async())

    def poll(self, etag: str | None, *, last_sequence: int | None = None) -> LedgerState | None:
        """Blocking `poll_async`."""
        return run_sync(self.poll_async(etag, last_sequence=last_sequence))

    def resolve_chain(self, current: str | None, target: str | None = None) -> list[LedgerEntry]:
        """Blocking `resolve_chain_async`."""
        return run_sync(self.resolve_chain_async(current, target))

    def append(self, new: NewEntry, *, state: LedgerState | None = None) -> LedgerEntry:
        """Blocking `append_async`."""
        return run_sync(self.append_async(new, state=state))

    def append_retrying(self, new: NewEntry, *, attempts: int = DEFAULT_ATTEMPTS) -> LedgerEntry:
        """Blocking `append_retrying_async`."""
        return run_sync(self.append_retrying_async(new, attempts=attempts))

    def reset(self, reason: str) -> ResetRecord:
        """Blocking `reset_async`."""
        return run_sync(self.reset_async(reason))

    def compact(self, keep: int | None = None) -> LedgerDocument:
        """Blocking `compact_async`."""
        return run_sync(self.compact_async(keep))


def open_ledger(
    url: str, *, credentials_dir: str | None = None, history: int = DEFAULT_HISTORY
) -> Ledger:
    """Open a ledger from `BUCKET_URL/NAME` (e.g. `s3://bucket/prefix/policy`)."""
    from hotload.bucket import open_bucket, split_ledger_url

    bucket_url, name = split_ledger_url(url)
    return Ledger(open_bucket(bucket_url, credentials_dir=credentials_dir), name, history=history)
