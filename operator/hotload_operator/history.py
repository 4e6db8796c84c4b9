"""Which Snapshot objects of one deployment may go: a pure decision over what the caches hold,
so that a trainer publishing every 30 seconds for days leaves a bounded number of objects in
etcd, in every operator's informer cache and in `hotload status NAME`.

A Snapshot object goes when its ledger entry left the ledger (retention, `hotload ledger gc`,
dropped it: its folder is gone or going), or when it is older than the newest
`spec.snapshotHistory` objects. It stays, whatever its age, while its admission is undecided,
while a replica serves or targets it, while it is the ledger head or `spec.pin`: what an SRE
reads about the fleet now is never deleted under them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SnapshotObject:
    """What the decision reads of one Snapshot object."""

    name: str
    identity: str
    #: `status.sequence`: its ledger sequence once admitted (None: refused or undecided).
    sequence: int | None
    #: Whether admission decided it (`Accepted` True or False).
    decided: bool
    #: `metadata.creationTimestamp` (RFC 3339 in UTC, so it sorts as text).
    created: str


@dataclass(frozen=True)
class Deletion:
    """One Snapshot object to delete, and why (for the log)."""

    name: str
    identity: str
    why: str


def expired_snapshots(
    objects: Iterable[SnapshotObject],
    *,
    keep: int,
    first_sequence: int | None,
    protected: frozenset[str],
) -> list[Deletion]:
    """The Snapshot objects to delete, oldest first: of the decided ones, all but the newest
    `keep` (`spec.snapshotHistory`) and those whose entries left the ledger, sparing the
    `protected` identities (served, targeted, the head, the pin). `first_sequence` is the oldest
    sequence the ledger still holds (None: the ledger was not read, so no object is judged by
    it)."""
    decided = [o for o in objects if o.decided]
    # Newest first: by creation, then by ledger sequence and name (a second's resolution).
    newest = sorted(decided, key=lambda o: (o.created, o.sequence or 0, o.name), reverse=True)
    out: list[Deletion] = []
    kept = 0
    for o in newest:
        left = first_sequence is not None and o.sequence is not None and o.sequence < first_sequence
        if not left and kept < keep:
            kept += 1  # one of the newest `keep` (named or not)
        elif o.identity in protected:
            continue  # older, or its entry gone, but what the fleet names now stays
        elif left:
            out.append(
                Deletion(
                    o.name,
                    o.identity,
                    f"its ledger entry (sequence {o.sequence}) left the ledger, whose oldest "
                    f"entry is now sequence {first_sequence}",
                )
            )
        else:
            out.append(
                Deletion(o.name, o.identity, f"older than the newest {keep} (spec.snapshotHistory)")
            )
    out.reverse()
    return out
