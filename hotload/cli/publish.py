"""`hotload publish`: upload a snapshot folder to a bucket, then append it to a ledger."""

from __future__ import annotations

import argparse
from pathlib import Path

from hotload.bucket import open_bucket
from hotload.cli.common import human_bytes, print_json, progress_bar
from hotload.cli.ledger import say
from hotload.errors import HotloadError, SnapshotError
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
        metavar="URL",
        help="bucket URL: a folder path, file:///path, s3://bucket/prefix or gs://bucket/prefix "
        "(with --deployment: default the deployment's spec.bucket.url)",
    )
    p.add_argument(
        "--ledger",
        metavar="NAME",
        help="ledger name in the bucket: append to it directly, no cluster involved",
    )
    p.add_argument(
        "--deployment",
        metavar="NAME",
        help="HotLoadDeployment to publish to: upload, then create a Snapshot object and wait "
        "until the operator accepted it (instead of --ledger)",
    )
    p.add_argument("--namespace", "-n", default="default", help="namespace of --deployment")
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig (default: $KUBECONFIG)")
    p.add_argument(
        "--wait",
        action="store_true",
        help="with --deployment: also wait until the snapshot is Ready (served by the fleet)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds --wait waits (default: 600)"
    )
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
    if (args.deployment is None) == (args.ledger is None):
        raise HotloadError("give exactly one of --ledger (no cluster) or --deployment")
    if args.deployment is not None:
        return _publish_to_deployment(args, folder, identity)
    if args.bucket is None:
        raise HotloadError("--ledger needs --bucket")
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


def _publish_to_deployment(args: argparse.Namespace, folder: Path, identity: str) -> int:
    from hotload.api.names import API_VERSION, DEPLOYMENT_PLURAL
    from hotload.bucket import run_sync
    from hotload.kube import KubeClient, KubeConfig, resource_path
    from hotload.sdk import Publisher

    async def run() -> dict[str, object]:
        bucket_url = args.bucket
        if bucket_url is None:
            async with KubeClient(KubeConfig.auto(args.kubeconfig)) as kube:
                hld = await kube.get(
                    resource_path(API_VERSION, DEPLOYMENT_PLURAL, args.namespace, args.deployment)
                )
            bucket_url = hld["spec"]["bucket"]["url"]
        pub = Publisher(
            bucket_url,
            deployment=args.deployment,
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            credentials_dir=args.credentials_dir,
        )
        try:
            await pub.submit_folder_async(folder, identity, prompt_cache=args.prompt_cache)
            result: dict[str, object] = {"identity": identity, "accepted": True}
            if args.wait:
                report = await pub.wait_ready_async(identity, timeout=args.timeout)
                result |= {
                    "ready": True,
                    "replicas": report.replicas,
                    "loaded": report.loaded,
                    "seconds": round(report.seconds, 3),
                }
            return result
        finally:
            pub.close()

    result = run_sync(run())
    if args.output == "json":
        print_json(result)
    elif args.wait:
        say(
            f"{identity} accepted and ready: {result['loaded']}/{result['replicas']} replicas "
            f"serve it ({result['seconds']}s)"
        )
    else:
        say(f"{identity} accepted by the operator into {args.namespace}/{args.deployment}")
    return 0
