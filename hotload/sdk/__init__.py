"""The trainer-facing side: publishing snapshots to a bucket, its ledger and the fleet."""

from hotload.sdk.publish import Published, publish_folder, publish_folder_async
from hotload.sdk.publisher import (
    NotReadyError,
    Publisher,
    PublishError,
    PublishHandle,
    ReadyReport,
    SnapshotRejectedError,
)

__all__ = [
    "NotReadyError",
    "PublishError",
    "PublishHandle",
    "Published",
    "Publisher",
    "ReadyReport",
    "SnapshotRejectedError",
    "publish_folder",
    "publish_folder_async",
]
