"""What publishing answers: the handle of a publish, the report of a wait, and the errors that
say what went wrong (shared by `Publisher` and `ShardedPublisher`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotload.bucket import TransferResult
from hotload.errors import HotloadError
from hotload.ledger import LedgerEntry, PromptCachePolicy


class PublishError(HotloadError):
    """Publishing failed; the message says what to do."""


class SnapshotRejectedError(PublishError):
    """The operator refused the snapshot (`reason` and `message` are its `Accepted` condition)."""

    def __init__(self, identity: str, reason: str, message: str) -> None:
        self.identity, self.reason, self.detail = identity, reason, message
        super().__init__(f"snapshot {identity!r} was refused ({reason}): {message}")


class NotReadyError(PublishError):
    """`wait_ready` gave up: the snapshot will not become ready (`reason` is the Snapshot's
    `Ready` reason: LoadFailed, Superseded, DeploymentPinned, NotAccepted) or it timed out
    (`reason` "Timeout"); `failures` holds what replicas reported ({"pod", "message"})."""

    def __init__(
        self, message: str, failures: list[dict[str, Any]], reason: str = "Timeout"
    ) -> None:
        self.failures = failures
        self.reason = reason
        super().__init__(message)


class ShardedPublishError(PublishError):
    """A sharded publish failed on some rank; every rank raises it, nothing was committed."""


@dataclass(frozen=True)
class PublishHandle:
    """What one `publish` did."""

    identity: str
    step: int
    kind: str
    previous: str | None
    shipped_bytes: int
    full_bytes: int
    seconds: float
    #: The ledger entry when the publisher appended it itself (no cluster).
    entry: LedgerEntry | None = None
    #: Its ledger sequence (known once appended or admitted).
    sequence: int | None = None
    #: What the upload moved (files, bytes, whether it was all there already).
    transfer: TransferResult | None = None


@dataclass(frozen=True)
class ReadyReport:
    """`wait_ready`'s answer: replicas serving the snapshot and their timings."""

    identity: str
    replicas: int
    loaded: int
    seconds: float
    loads: list[dict[str, Any]] = field(default_factory=list)


def prompt_cache_policy(value: bool | PromptCachePolicy) -> PromptCachePolicy:
    """The ledger's prompt-cache policy for `reset_prompt_cache`: True is "all", False "none"."""
    if value is True:
        return "all"
    if value is False:
        return "none"
    return value
