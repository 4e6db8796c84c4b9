"""Pins: a deployment told to serve one snapshot instead of following its ledger's head.

The operator writes a small JSON object per pinned deployment into the bucket, next to the
ledgers (`.hotload/pins/<namespace>/<name>/<uid>.json`), and deletes it when the pin is cleared;
every loader of the deployment polls it beside the ledger (one conditional GET). The object
lives in the bucket rather than in the pod spec so that pinning and unpinning reach running
loaders without a rolling restart and without giving loaders any new Kubernetes permissions;
the uid in the key keeps two clusters that share a bucket (and a deployment name) apart.

`pin_target` is the pure decision: which ledger entry a pinned or following replica serves, and
why a pin cannot be served when the ledger's retained history no longer holds its chain.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from hotload.bucket.core import Bucket
from hotload.bucket.objects import NotModified
from hotload.errors import InvalidIdentityError, LedgerError, ObjectNotFoundError
from hotload.ledger.fields import format_time, load_versioned, utc_now
from hotload.ledger.model import LedgerDocument, LedgerEntry
from hotload.snapshot.layout import validate_identity

#: Where pin objects live inside a bucket.
PIN_PREFIX = ".hotload/pins"
PIN_FORMAT_VERSION = 1

Mode = Literal["Following", "Pinned"]

# Namespaces are DNS labels, names DNS subdomains, uids UUIDs: all safe path segments.
_SEGMENT = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def pin_key(namespace: str, name: str, uid: str | None) -> str:
    """The object key of a deployment's pin: `.hotload/pins/<namespace>/<name>/<uid>.json`."""
    parts = [namespace, name, (uid or "no-uid").lower()]
    for part in parts:
        if not _SEGMENT.match(part) or len(part) > 253:
            raise LedgerError(f"{part!r} cannot name a pin object (not a DNS name or uid)")
    return f"{PIN_PREFIX}/{parts[0]}/{parts[1]}/{parts[2]}.json"


@dataclass(frozen=True)
class Pin:
    """A pin object: the snapshot to serve, for which deployment, since when."""

    identity: str
    deployment: str = ""
    updated_time: datetime | None = None

    def dumps(self) -> bytes:
        """The object as stored (camelCase JSON)."""
        doc = {
            "formatVersion": PIN_FORMAT_VERSION,
            "pin": self.identity,
            "deployment": self.deployment,
            "updatedTime": format_time(self.updated_time or utc_now()),
        }
        return json.dumps(doc, indent=2).encode() + b"\n"

    @classmethod
    def loads(cls, data: bytes, where: str) -> Pin:
        """Parse a stored pin; `LedgerError` naming `where` and the field when it is invalid."""
        doc = load_versioned(data, where, PIN_FORMAT_VERSION)
        identity = doc.get("pin")
        try:
            validate_identity(identity)
        except InvalidIdentityError:
            raise LedgerError(
                f"{where}: pin: not a valid snapshot identity: {identity!r}"
            ) from None
        return cls(str(identity), str(doc.get("deployment") or ""))


@dataclass(frozen=True)
class PinState:
    """A pin object as read: the pin and its ETag (both None: absent, so follow the head)."""

    pin: Pin | None
    etag: str | None


async def poll_pin_async(bucket: Bucket, key: str, known: PinState | None) -> PinState | None:
    """Read the pin object unless it is unchanged since `known` (then None); absent: no pin."""
    try:
        result = await bucket.get_if_changed_async(key, known.etag if known else None)
    except ObjectNotFoundError:
        unchanged = known is not None and known.pin is None
        return None if unchanged else PinState(None, None)
    if isinstance(result, NotModified):
        return None
    where = f"{bucket.url.rstrip('/')}/{key}"
    return PinState(Pin.loads(result.data, where), result.etag)


async def write_pin_async(bucket: Bucket, key: str, pin: Pin | None) -> bool:
    """Make the stored pin equal `pin` (None: delete it); return whether anything changed.

    The write is conditional on the pin as read (`PreconditionFailedError` when another writer
    changed it meanwhile: read it again), so a deposed leader's late pin never replaces the
    one its successor wrote."""
    etag: str | None = None
    try:
        stored = await bucket.get_async(key)
        etag = stored.etag
        current: Pin | None = Pin.loads(stored.data, key)
    except ObjectNotFoundError:
        current = None
    except LedgerError:
        current = Pin("-invalid-")  # garbage is replaced, never trusted
    if pin is None:
        if current is None:
            return False
        await bucket.delete_async(key)
        return True
    if current is not None and current.identity == pin.identity:
        return False
    if etag is None:
        await bucket.put_async(key, pin.dumps(), create_only=True)
    else:
        await bucket.put_async(key, pin.dumps(), if_match=etag)
    return True


@dataclass(frozen=True)
class Target:
    """What a replica should serve: `entry` (None when nothing can be), the mode, and, for a
    pin the ledger cannot build, `problem` saying why and what to do."""

    mode: Mode
    identity: str | None
    entry: LedgerEntry | None
    problem: str = ""


def pin_target(document: LedgerDocument | None, pin: str | None) -> Target:
    """The snapshot to serve: the ledger head when following, else the pinned entry, provided
    the retained history still holds it and the chain that rebuilds it."""
    if pin is None:
        head = document.head if document is not None else None
        return Target("Following", head.identity if head else None, head)
    if document is None:
        return Target("Pinned", pin, None)
    entry = document.find(pin)
    advice = (
        "re-publish its weights as a full snapshot under a new identity and pin that, or pin a "
        "snapshot the ledger still holds (hotload ledger show)"
    )
    if entry is None:
        dropped = (
            f"; entries up to sequence {document.compacted_through} were compacted away"
            if document.compacted_through
            else ""
        )
        return Target(
            "Pinned",
            pin,
            None,
            f"pinned snapshot {pin!r} is no longer in the history of ledger {document.name!r}"
            f"{dropped}; {advice}",
        )
    if entry.kind == "lora":
        return Target(
            "Pinned",
            pin,
            None,
            f"pinned snapshot {pin!r} is a LoRA adapter; pin a full or incremental snapshot "
            "(adapters load on top of the served base weights)",
        )
    try:
        document.chain_to(pin)
    except LedgerError as err:
        return Target(
            "Pinned",
            pin,
            None,
            f"pinned snapshot {pin!r} cannot be rebuilt from the history of ledger "
            f"{document.name!r} ({err}); {advice}",
        )
    return Target("Pinned", pin, entry)
