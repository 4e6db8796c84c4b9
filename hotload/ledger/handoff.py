"""The head handoff: what the operator, having read a ledger at the origin once for its whole
cluster, hands every loader of a deployment through one small object of the API server (the
ConfigMap `<deployment>-head`, key `head.json`), so that a loader asks the origin nothing for an
update while the operator is there.

A `Handoff` carries the ledger's counter and every entry after `since` (the newest
`TAIL_ENTRIES`, reaching back to the head), the file listings of the newest admitted snapshots'
folders (they are immutable once admitted), the upload hints of the snapshots on their way, the
deployment's `spec.pin`, and when the operator last read the origin (`checked`: a loader takes
an old one as the operator being gone and polls the origin itself). A loader merges the entries
into its own copy of the ledger (`merge_handed`) when they reach back to what it holds, and
reads the origin as before when they do not (it just started, it fell behind, or the two
disagree). Every byte a loader downloads is still verified against the entry (`contentDigest`);
the entries come from the origin through the operator, which the loader trusts as it trusts its
own pod spec.

Everything here is pure (no I/O).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final

from hotload.errors import LedgerError
from hotload.ledger.fields import format_time, json_object, load_versioned, validate_ledger_name
from hotload.ledger.hints import Hint, HintFile, parse_files
from hotload.ledger.model import BASE_KINDS, LedgerDocument, LedgerEntry
from hotload.snapshot.layout import validate_identity

HANDOFF_FORMAT_VERSION: Final = 1
#: The key of the handoff document in the ConfigMap's `data`.
HEAD_KEY: Final = "head.json"
#: Entries handed over: a loader more than this many entries behind reads the origin.
TAIL_ENTRIES: Final = 16
#: Snapshot folders whose listing is handed over (the newest admitted base snapshots): a
#: watching loader remembers the listings of earlier handoffs, so it rarely needs older ones.
LISTED_SNAPSHOTS: Final = 4
#: Upload hints handed over (the newest).
MAX_HINTS: Final = 4
#: The largest `head.json` written: every watching loader receives the whole object on each
#: change. Over it, listings go first, then hints, oldest first (`hints_omitted`: the loaders
#: then keep their early fetches and read hints only when they read the ledger).
MAX_BYTES: Final = 256 * 1024


@dataclass(frozen=True)
class Handoff:
    """One ledger's state as the operator read it at the origin (see the module docstring)."""

    ledger: str
    #: The ledger's counter (`LedgerDocument.sequence`): every entry up to it is known.
    sequence: int
    #: `entries` holds every retained entry whose sequence is above this one.
    since: int
    entries: tuple[LedgerEntry, ...] = ()
    #: When the operator last read the ledger at the origin (None: never).
    checked: datetime | None = None
    #: Snapshot identity -> the files of its folder at the origin.
    files: Mapping[str, tuple[HintFile, ...]] = field(default_factory=dict)
    #: Hints of snapshots uploading now (not admitted), newest last.
    hints: tuple[Hint, ...] = ()
    #: The deployment's `spec.pin` (None: it follows the head).
    pin: str | None = None
    #: Hints of uploads on their way did not fit `MAX_BYTES` (the oldest were dropped): `hints`
    #: is not every upload, and a loader must not take a missing one as "no longer uploading".
    hints_omitted: bool = False

    @property
    def head(self) -> LedgerEntry | None:
        """The newest base-weight entry handed over (what a follower serves)."""
        for entry in reversed(self.entries):
            if entry.kind in BASE_KINDS:
                return entry
        return None

    @property
    def uploading(self) -> tuple[str, ...]:
        """The identities being uploaded, newest last."""
        return tuple(h.identity for h in self.hints)

    def same_content(self, other: Handoff | None) -> bool:
        """Whether `other` hands over the same thing (`checked` aside: a heartbeat)."""
        return other is not None and replace(self, checked=None) == replace(other, checked=None)

    # --- JSON -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The document as the ConfigMap stores it (camelCase keys)."""
        return {
            "formatVersion": HANDOFF_FORMAT_VERSION,
            "ledger": self.ledger,
            "head": self.head.identity if self.head else None,
            "sequence": self.sequence,
            "since": self.since,
            "checkedTime": format_time(self.checked) if self.checked else None,
            "pin": self.pin,
            "entries": [e.to_json() for e in self.entries],
            "files": {
                identity: [_file_json(f) for f in files] for identity, files in self.files.items()
            },
            "hints": [json.loads(h.dumps()) for h in self.hints],
            "hintsOmitted": self.hints_omitted,
        }

    def dumps(self) -> str:
        """The document as one compact JSON string (the ConfigMap value)."""
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, data: str | bytes, where: str) -> Handoff:
        """Parse a stored handoff; `LedgerError` naming `where` and the field when invalid."""
        raw = data.encode() if isinstance(data, str) else data
        doc = load_versioned(raw, where, HANDOFF_FORMAT_VERSION)
        ledger = validate_ledger_name(doc.get("ledger"))  # type: ignore[arg-type]
        sequence, since = doc.get("sequence"), doc.get("since")
        if not isinstance(sequence, int) or not isinstance(since, int) or since < 0:
            raise LedgerError(f"{where}: sequence and since must be integers of at least 0")
        entries = tuple(
            LedgerEntry.from_json(e, f"{where}: entries[{i}]")
            for i, e in enumerate(_list(doc, "entries", where))
        )
        previous = since
        for entry in entries:
            if entry.sequence <= previous or entry.sequence > sequence:
                raise LedgerError(
                    f"{where}: entries: sequence {entry.sequence} is out of order (since "
                    f"{since}, ledger sequence {sequence})"
                )
            previous = entry.sequence
        files_doc = json_object(doc.get("files") or {}, f"{where}: files")
        files: dict[str, tuple[HintFile, ...]] = {}
        for identity, listed in files_doc.items():
            validate_identity(identity)
            files[identity] = parse_files(listed, f"{where}: files: {identity}")
        hints = tuple(
            Hint.loads(json.dumps(h).encode(), f"{where}: hints[{i}]")
            for i, h in enumerate(_list(doc, "hints", where))
        )
        checked_text = doc.get("checkedTime")
        try:
            checked = datetime.fromisoformat(checked_text) if checked_text else None
        except (TypeError, ValueError):
            raise LedgerError(f"{where}: checkedTime {checked_text!r} is not a time") from None
        pin = doc.get("pin")
        if pin is not None:
            validate_identity(pin)
        omitted = doc.get("hintsOmitted", False)
        if not isinstance(omitted, bool):
            raise LedgerError(f"{where}: hintsOmitted must be true or false")
        return cls(ledger, sequence, since, entries, checked, files, hints, pin, omitted)


def build_handoff(
    document: LedgerDocument,
    *,
    checked: datetime | None,
    listings: Mapping[str, Iterable[HintFile]] = {},
    hints: Sequence[Hint] = (),
    pin: str | None = None,
    tail: int = TAIL_ENTRIES,
    max_bytes: int = MAX_BYTES,
) -> Handoff:
    """The handoff of `document`: its newest `tail` entries (reaching back to the head), the
    `listings` of its newest `LISTED_SNAPSHOTS` admitted base snapshots among those given, the
    newest `MAX_HINTS` of `hints` the ledger has not admitted, and `pin`. Kept under
    `max_bytes` by dropping the listings, then the hints oldest first (`hints_omitted` once
    one is dropped)."""
    entries = document.entries
    start = max(0, len(entries) - max(1, tail))
    head = document.head
    if head is not None:
        start = min(start, entries.index(head))
    since = entries[start - 1].sequence if start > 0 else 0
    handed = entries[start:]
    bases = [e.identity for e in reversed(handed) if e.kind in BASE_KINDS]
    files = {
        identity: tuple(listings[identity])
        for identity in bases[:LISTED_SNAPSHOTS]
        if identity in listings
    }
    uploading = tuple(h for h in hints if document.find(h.identity) is None)[-MAX_HINTS:]
    result = Handoff(
        document.name, document.sequence, since, handed, checked, files, uploading, pin
    )
    if len(result.dumps()) > max_bytes:
        result = replace(result, files={})
    while result.hints and len(result.dumps()) > max_bytes:
        result = replace(result, hints=result.hints[1:], hints_omitted=True)
    return result


def merge_handed(
    document: LedgerDocument,
    handoff: Handoff,
    *,
    history: int,
    keep: Collection[str] = (),
) -> LedgerDocument | None:
    """`document` (a loader's copy of the ledger) brought up to `handoff`, or None when the
    handoff cannot do it and the origin must be read: another ledger, a counter that went back,
    entries that do not reach back to what the copy holds, or an entry the two disagree on.
    Old history beyond `history` entries is dropped as the publishers' compaction does, except
    the chain from the latest full snapshot and the identities in `keep` (what the replica
    serves and its pin), so the copy stays bounded however long the loader follows."""
    if handoff.ledger != document.name or handoff.sequence < document.sequence:
        return None
    if document.sequence < handoff.since:
        return None
    held = {e.sequence: e for e in document.entries}
    for entry in handoff.entries:
        if entry.sequence <= document.sequence and held.get(entry.sequence, entry) != entry:
            return None
    new = tuple(e for e in handoff.entries if e.sequence > document.sequence)
    if not new and handoff.sequence == document.sequence:
        return document
    merged = replace(
        document,
        sequence=handoff.sequence,
        entries=document.entries + new,
        updated_time=handoff.checked or document.updated_time,
    )
    return merged.compacted(history, merged.updated_time, also=keep)


def _file_json(f: HintFile) -> dict[str, Any]:
    return {"name": f.name, "size": f.size, "etag": f.etag}


def _list(doc: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = doc.get(key) or []
    if not isinstance(value, list):
        raise LedgerError(f"{where}: {key} must be a list")
    return value
