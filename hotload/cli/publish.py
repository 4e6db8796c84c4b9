"""`hotload publish`: upload a snapshot folder to a bucket, then append it to a ledger."""

from __future__ import annotations

import argparse
from pathlib import Path

from hotload.bucket import open_bucket
from hotload.cli.common import human_bytes, print_json, progress_bar
from hotload.cli.ledger import say
from hotload.errors import SnapshotError
from hotload.ledger import PROMPT_CACHE_POLICIES, Ledger
from hotload.sdk import publish_folder
from hotload.snapshot import describe_snapshot, validate_identity


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `publish` command."""
    p = sub.add_parser(
        "publish",
        help="upload a snapshot folder to a bucket and append it to a ledger",
        description="Upload every shard and file of FOLDER to BUCKET/IDENTITY/, the manifests "
        "last, and only then append the snapshot to the ledger with compare-and-swap. An "
        "interrupted upload is never visible; re-running the same command finishes it. The "
        "ledger is checked before uploading, so a delta that cannot be admitted (wrong parent, "
        "or right after a reset) fails fast.",
    )
    p.add_argument(
        "folder", type=Path, metavar="FOLDER", help="snapshot folder (full, delta or LoRA)"
    )
    p.add_argument(
        "--bucket",
        required=True,
        metavar="URL",
        help="bucket URL: a folder path, file:///path, s3://bucket/prefix or gs://bucket/prefix",
    )
    p.add_argument("--ledger", required=True, metavar="NAME", help="ledger name in the bucket")
    p.add_argument("--identity", help="snapshot identity (default: the folder's name)")
    p.add_argument(
        "--prompt-cache",
        choices=PROMPT_CACHE_POLICIES,
        default="all",
        help="prompt-cache policy replicas apply when loading it (default: all)",
    )
    p.add_argument(
        "--credentials-dir",
        metavar="DIR",
        help="folder of credential files named like the AWS_* variables they replace, e.g. a "
        "mounted Kubernetes Secret (default: $HOTLOAD_BUCKET_CREDENTIALS_DIR)",
    )
    p.add_argument(
        "--concurrency", type=int, default=8, help="parallel part uploads per file (default: 8)"
    )
    p.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")
    p.set_defaults(func=_publish)


def _publish(args: argparse.Namespace) -> int:
    folder: Path = args.folder
    if not folder.is_dir():
        raise SnapshotError("not a folder", path=str(folder))
    identity = validate_identity(args.identity or folder.resolve().name)
    shipped = describe_snapshot(folder).shipped_bytes
    bucket = open_bucket(
        args.bucket, credentials_dir=args.credentials_dir, concurrency=max(1, args.concurrency)
    )
    ledger = Ledger(bucket, args.ledger)
    with progress_bar(f"upload {identity}", shipped, not args.no_progress) as advance:
        published = publish_folder(
            ledger, folder, identity=identity, prompt_cache=args.prompt_cache, progress=advance
        )
    entry, transfer = published.entry, published.transfer

    if args.output == "json":
        print_json(
            {
                "identity": identity,
                "bucket": bucket.url,
                "ledger": ledger.url,
                "uploaded": not transfer.already_present,
                "files": transfer.files,
                "bytes": transfer.bytes,
                "entry": entry.to_json(),
            }
        )
        return 0
    parent = f" on top of {entry.previous}" if entry.kind == "incremental" else ""
    uploaded = (
        "already in the bucket"
        if transfer.already_present
        else f"{transfer.files} files, {human_bytes(transfer.bytes)} uploaded"
    )
    say(
        f"published {identity} ({entry.kind}{parent}) to {bucket.url}: {uploaded}; "
        f"ledger {ledger.name} sequence {entry.sequence}"
    )
    return 0
