"""The JSON of the small documents the ledger keeps in the bucket (the ledger, pins, hints):
times as RFC 3339 in UTC, format versions, and fields checked with errors that name them."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from hotload.errors import LedgerError

#: A manifest digest; a ledger name or snapshot identity (one safe path segment).
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_ledger_name(name: str) -> str:
    """Return `name` if it is a valid ledger name (one safe path segment), else raise."""
    if not isinstance(name, str) or not NAME.match(name):
        raise LedgerError(
            f"{name!r} is not a valid ledger name: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "starting with a letter or digit"
        )
    return name


def utc_now() -> datetime:
    """The current time in UTC, to the microsecond."""
    return datetime.now(UTC)


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with a `Z` suffix, as every time in the ledger is written."""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def load_versioned(data: bytes, where: str, newest: int) -> dict[str, Any]:
    """Parse a small stored JSON object (a pin, a hint) whose `formatVersion` this hotload
    understands (at most `newest`); `LedgerError` naming `where` otherwise."""
    try:
        doc: Any = json.loads(data)
    except ValueError as exc:
        raise LedgerError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise LedgerError(f"{where}: must be a JSON object")
    version = doc.get("formatVersion")
    if not isinstance(version, int) or version > newest:
        raise LedgerError(f"{where}: formatVersion {version!r} is not supported")
    return doc


def json_object(doc: object, where: str) -> dict[str, Any]:
    """`doc` if it is a JSON object, else a `LedgerError` naming `where`."""
    if not isinstance(doc, dict):
        raise LedgerError(f"{where}: must be a JSON object")
    return doc


def int_field(
    d: Mapping[str, Any], key: str, where: str, *, minimum: int, default: int | None = None
) -> int:
    """`d[key]` (or `default`), an integer of at least `minimum`."""
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LedgerError(f"{where}.{key}: must be an integer >= {minimum}, got {value!r}")
    return value


def choice_field(d: Mapping[str, Any], key: str, where: str, choices: Sequence[str]) -> str:
    """`d[key]`, one of `choices`."""
    value = d.get(key)
    if value not in choices:
        raise LedgerError(f"{where}.{key}: must be one of {', '.join(choices)}, got {value!r}")
    assert isinstance(value, str)
    return value


def identity_field(d: Mapping[str, Any], key: str, where: str) -> str:
    """`d[key]`, a snapshot identity."""
    value = d.get(key)
    if not isinstance(value, str) or not NAME.match(value):
        raise LedgerError(f"{where}.{key}: not a valid snapshot identity: {value!r}")
    return value


def optional_identity_field(d: Mapping[str, Any], key: str, where: str) -> str | None:
    """`d[key]`, a snapshot identity or absent (None)."""
    return None if d.get(key) is None else identity_field(d, key, where)


def digest_field(d: Mapping[str, Any], key: str, where: str) -> str:
    """`d[key]`, a manifest digest (`sha256:` and 64 hex digits)."""
    value = d.get(key)
    if not isinstance(value, str) or not DIGEST.match(value):
        raise LedgerError(f"{where}.{key}: must be 'sha256:' + 64 hex digits, got {value!r}")
    return value


def optional_digest_field(d: Mapping[str, Any], key: str, where: str) -> str | None:
    """`d[key]` as a digest when present and not null, else None (a field added later)."""
    return None if d.get(key) is None else digest_field(d, key, where)


def time_field(d: Mapping[str, Any], key: str, where: str) -> datetime:
    """`d[key]`, an RFC 3339 time with a zone, in UTC."""
    value = d.get(key)
    if not isinstance(value, str):
        raise LedgerError(f"{where}.{key}: must be an RFC 3339 time string")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise LedgerError(f"{where}.{key}: {value!r} is not an RFC 3339 time") from None
    if parsed.tzinfo is None:
        raise LedgerError(f"{where}.{key}: {value!r} has no time zone")
    return parsed.astimezone(UTC)


class Sequenced(Protocol):
    """A ledger record: an entry or a reset, each with its sequence number."""

    @property
    def sequence(self) -> int:
        """The record's place in the ledger."""
        ...


def check_increasing(items: Sequence[Sequenced], where: str, floor: int, ceiling: int) -> None:
    """Refuse records (`where[i]`) whose sequence numbers do not increase from `floor`, or
    that go past the document's own sequence `ceiling`."""
    last = floor
    for i, item in enumerate(items):
        if item.sequence <= last:
            raise LedgerError(
                f"{where}[{i}].sequence: {item.sequence} does not increase (previous {last}); "
                "the sequence never rewinds"
            )
        if item.sequence > ceiling:
            raise LedgerError(
                f"{where}[{i}].sequence: {item.sequence} is beyond the ledger's sequence {ceiling}"
            )
        last = item.sequence
