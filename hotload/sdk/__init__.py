"""The trainer-facing side: publishing snapshots to a bucket and its ledger."""

from hotload.sdk.publish import Published, publish_folder, publish_folder_async

__all__ = ["Published", "publish_folder", "publish_folder_async"]
