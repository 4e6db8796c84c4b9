"""Object-store access for hotload: a local folder (default), S3-compatible stores and GCS.

`open_bucket(url)` returns a `Bucket` with plain, ranged, parallel and conditional reads and
writes; `upload_snapshot`/`download_snapshot` move whole snapshot folders in publishing order.
"""

from hotload.bucket.core import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, Bucket
from hotload.bucket.local import local_etag
from hotload.bucket.mirrors import MirroredBucket, MirrorStats, open_mirrored
from hotload.bucket.objects import (
    NotModified,
    ObjectData,
    ObjectInfo,
    Progress,
    WriteGate,
    check_key,
    run_sync,
)
from hotload.bucket.retry import RetryPolicy
from hotload.bucket.stores import SecretFileCredentials, gcs_config, open_bucket, s3_config
from hotload.bucket.transfer import (
    COMMIT_FILES,
    MANIFEST_NAMES,
    TransferResult,
    commit_file,
    download_skeleton_async,
    download_snapshot,
    download_snapshot_async,
    manifest_order,
    snapshot_files_async,
    snapshot_present,
    snapshot_present_async,
    upload_snapshot,
    upload_snapshot_async,
)
from hotload.bucket.url import (
    CREDENTIALS_DIR_ENV,
    BucketURL,
    StoreSettings,
    load_settings,
    parse_bucket_url,
    split_ledger_url,
)

__all__ = [
    "COMMIT_FILES",
    "CREDENTIALS_DIR_ENV",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "MANIFEST_NAMES",
    "Bucket",
    "BucketURL",
    "MirrorStats",
    "MirroredBucket",
    "NotModified",
    "ObjectData",
    "ObjectInfo",
    "Progress",
    "RetryPolicy",
    "SecretFileCredentials",
    "StoreSettings",
    "TransferResult",
    "WriteGate",
    "check_key",
    "commit_file",
    "download_skeleton_async",
    "download_snapshot",
    "download_snapshot_async",
    "gcs_config",
    "load_settings",
    "local_etag",
    "manifest_order",
    "open_bucket",
    "open_mirrored",
    "parse_bucket_url",
    "run_sync",
    "s3_config",
    "snapshot_files_async",
    "snapshot_present",
    "snapshot_present_async",
    "split_ledger_url",
    "upload_snapshot",
    "upload_snapshot_async",
]
