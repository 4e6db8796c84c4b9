"""`hotload publish`: upload a snapshot folder to a bucket, then append it to a ledger (or hand
it to the operator). A full snapshot folder becomes an arc_v2 delta against the ledger head
when the head's full weights can be rebuilt here."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hotload.bucket import TransferResult, download_snapshot, open_bucket, run_sync
from hotload.cli.common import print_json, progress_bar
from hotload.cli.ledger import say
from hotload.errors import HotloadError, SnapshotError
from hotload.ledger import PROMPT_CACHE_POLICIES, Ledger
from hotload.sdk import publish_folder
from hotload.snapshot import describe_snapshot, validate_identity
from hotload.units import human_bytes


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `publish` command."""
    p = sub.add_parser(
        "publish",
        help="publish a snapshot folder: a full one as a delta against the ledger head",
        description="Publish FOLDER under IDENTITY: upload its files to BUCKET/IDENTITY/, the "
        "manifests last, and only then append it to the ledger with compare-and-swap (--ledger) "
        "or create a Snapshot object for the operator to admit (--deployment). A FULL snapshot "
        "folder is published as an arc_v2 delta against the ledger head when the head's full "
        "weights can be rebuilt here: from --workdir (where the previous publish left its full "
        "copy, checked against the ledger entry and the recorded checksums) or else by "
        "downloading the head's chain and rebuilding it (verified tensor by tensor, in a "
        "temporary folder); when they cannot (an empty ledger, a pending reset, a broken chain) "
        "it goes as a full snapshot. --full always publishes it as a full snapshot. A delta "
        "folder is published as it is; a LoRA adapter folder (PEFT's adapter_config.json and "
        "adapter_model*.safetensors) gets per-tensor checksums added on the way, so replicas "
        "verify it (docs/lora.md). An interrupted upload is never visible; "
        "re-running the same command finishes it. A delta that cannot be admitted (wrong "
        "parent, or right after a reset) fails before any upload.",
        epilog="Exit codes: 0 published (and, with --wait, ready), 1 refused or failed (the "
        "message says why), 2 bad usage.",
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
        help="ledger name in the bucket: append to it directly, no cluster involved (with "
        "--deployment it must be the deployment's spec.ledger, which is the default)",
    )
    p.add_argument(
        "--deployment",
        metavar="NAME",
        help="HotLoadDeployment to publish to: upload, then create a Snapshot object and wait "
        "until the operator accepted it (instead of --ledger)",
    )
    p.add_argument(
        "--namespace",
        "-n",
        help="namespace of --deployment (default: the kubeconfig context's, as kubectl)",
    )
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig (default: $KUBECONFIG)")
    p.add_argument(
        "--full",
        action="store_true",
        help="publish a full FOLDER as a full snapshot, not as a delta against the ledger head",
    )
    p.add_argument(
        "--workdir",
        metavar="DIR",
        type=Path,
        help="keep the full copy of what was published here (hard links where possible), so "
        "the next publish with the same --workdir makes its delta without downloading the "
        "ledger head (default: a temporary folder, removed afterwards)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="with --deployment: also wait until the snapshot is Ready (served by the fleet); "
        "exit 1 with the replicas' reasons if it cannot become ready",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds --wait waits (default: 600)"
    )
    p.add_argument("--identity", help="snapshot identity (default: the folder's name)")
    p.add_argument(
        "--prompt-cache",
        choices=PROMPT_CACHE_POLICIES,
        default=None,
        help="prompt-cache policy replicas apply when loading it (default: all; none for a "
        "LoRA adapter, which leaves the base's caches valid)",
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
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="do not show progress bars (shown on stderr when it is a terminal)",
    )
    p.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")
    p.set_defaults(func=_publish)


def _publish(args: argparse.Namespace) -> int:
    folder: Path = args.folder
    if not folder.is_dir():
        raise SnapshotError("not a folder", path=str(folder))
    identity = validate_identity(args.identity or folder.resolve().name)
    if args.deployment is None and args.ledger is None:
        raise HotloadError("give --ledger (no cluster) or --deployment")
    if args.deployment is None and args.bucket is None:
        raise HotloadError("--ledger needs --bucket")
    from hotload.sdk.target import resolve_target

    # With --deployment, its spec names the bucket and the ledger (and the context the
    # namespace); the SDK's errors say what to do (no credentials, no such deployment, a
    # --bucket that is not the deployment's).
    target = resolve_target(
        args.bucket,
        deployment=args.deployment,
        ledger=args.ledger,
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
    )
    bucket_url, ledger_name = target.bucket_url, target.ledger
    args.namespace = target.namespace
    desc = describe_snapshot(folder)
    bucket = open_bucket(
        bucket_url, credentials_dir=args.credentials_dir, concurrency=max(1, args.concurrency)
    )
    ledger = Ledger(bucket, ledger_name)
    if args.prompt_cache is None:
        args.prompt_cache = "none" if desc.kind == "lora" else "all"
    if desc.kind == "lora":
        return _publish_adapter(args, folder, identity, bucket_url, ledger.name)
    if desc.kind == "full":
        existing = ledger.read().document.find(identity)
        if existing is None:
            return _publish_full(args, folder, identity, bucket_url, ledger.name)
        if existing.kind == "incremental":
            # A re-run of a full folder this command turned into a delta: done already if the
            # delta rebuilds exactly these shards.
            _check_published_delta(ledger, folder, identity)
            done = TransferResult(identity, 0, 0, already_present=True)
            if args.deployment is None:
                _print_ledger_result(args, bucket.url, ledger, existing, done)
                return 0
            # Through the operator as well: it reports the Snapshot accepted (and --wait waits).
            return _submit_existing(args, identity, bucket_url, ledger.name)
    if args.deployment is not None:
        return _submit_as_is(args, folder, identity, bucket_url, ledger.name)

    # A delta folder (or a re-run of a published one): as it is, straight to the ledger.
    with progress_bar(f"upload {identity}", desc.shipped_bytes, not args.no_progress) as advance:
        published = publish_folder(
            ledger, folder, identity=identity, prompt_cache=args.prompt_cache, progress=advance
        )
    entry, transfer = published.entry, published.transfer
    _print_ledger_result(args, bucket.url, ledger, entry, transfer)
    return 0


@contextmanager
def _publisher(
    args: argparse.Namespace, folder: Path, bucket_url: str, ledger_name: str
) -> Iterator[Any]:
    """The SDK's Publisher for this command; its work folder is --workdir (kept) or a
    temporary one beside FOLDER (same file system: the full copy is hard links, not a copy of
    every shard), removed afterwards."""
    from hotload.sdk import Publisher

    scratch = None
    workdir = args.workdir
    if workdir is None:
        try:
            scratch = Path(
                tempfile.mkdtemp(prefix=".hotload-publish-", dir=folder.resolve().parent)
            )
        except OSError:  # a read-only parent: the system's temp folder (copies if it must)
            scratch = Path(tempfile.mkdtemp(prefix="hotload-publish-"))
        workdir = scratch
    pub = Publisher(
        bucket_url,
        deployment=args.deployment,
        ledger=ledger_name,
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        credentials_dir=args.credentials_dir,
        workdir=workdir,
        progress=False if args.no_progress else None,
        rebuild_parent=True,
        concurrency=max(1, args.concurrency),
    )
    try:
        yield pub
    finally:
        pub.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _publish_full(
    args: argparse.Namespace, folder: Path, identity: str, bucket_url: str, ledger_name: str
) -> int:
    """A full folder through the SDK's Publisher: a delta on the head when it can be rebuilt."""
    return _through_publisher(
        args,
        folder,
        identity,
        bucket_url,
        ledger_name,
        publish=lambda pub: pub.publish_async(
            folder,
            step=0,
            identity=identity,
            reset_prompt_cache=args.prompt_cache,
            # False, not None: the SDK's every-N-steps cadence means nothing here.
            full=bool(args.full),
        ),
    )


def _publish_adapter(
    args: argparse.Namespace, folder: Path, identity: str, bucket_url: str, ledger_name: str
) -> int:
    """A LoRA adapter folder through the SDK (checksums added), to the ledger or the operator."""
    return _through_publisher(
        args,
        folder,
        identity,
        bucket_url,
        ledger_name,
        publish=lambda pub: pub.publish_adapter_async(
            folder, step=0, identity=identity, reset_prompt_cache=args.prompt_cache
        ),
    )


def _through_publisher(
    args: argparse.Namespace,
    folder: Path,
    identity: str,
    bucket_url: str,
    ledger_name: str,
    *,
    publish: Callable[[Any], Awaitable[Any]],
) -> int:
    """Run `publish(pub)` (returning a `PublishHandle`), wait with --wait, print the result."""

    async def run(pub: Any) -> tuple[Any, Any]:
        handle = await publish(pub)
        report = None
        if args.wait and args.deployment is not None:
            report = await pub.wait_ready_async(identity, timeout=args.timeout)
        return handle, report

    with _publisher(args, folder, bucket_url, ledger_name) as pub:
        handle, report = run_sync(run(pub))
    if args.deployment is None:
        _print_ledger_result(args, pub.bucket.url, pub.ledger, handle.entry, handle.transfer)
        return 0
    return _print_deployment_result(
        args,
        identity=identity,
        kind=handle.kind,
        previous=handle.previous,
        sequence=handle.sequence,
        report=report,
    )


def _submit_as_is(
    args: argparse.Namespace, folder: Path, identity: str, bucket_url: str, ledger_name: str
) -> int:
    """A delta folder (or a published one again) to the operator, as it is."""
    desc = describe_snapshot(folder)

    async def run(pub: Any) -> tuple[int | None, Any]:
        sequence = await pub.submit_folder_async(folder, identity, prompt_cache=args.prompt_cache)
        report = None
        if args.wait:
            report = await pub.wait_ready_async(identity, timeout=args.timeout)
        return sequence, report

    with _publisher(args, folder, bucket_url, ledger_name) as pub:
        sequence, report = run_sync(run(pub))
    previous = desc.parent if desc.kind == "incremental" else None
    return _print_deployment_result(
        args, identity=identity, kind=desc.kind, previous=previous, sequence=sequence, report=report
    )


def _check_published_delta(ledger: Ledger, folder: Path, identity: str) -> None:
    """Raise unless the delta published as `identity` rebuilds exactly `folder`'s shards (read
    on the bucket's shard headers alone: `hotload.sdk.published`)."""
    from hotload.sdk.published import first_difference

    differs = run_sync(first_difference(ledger.bucket, identity, folder))
    if differs is not None:
        raise HotloadError(
            f"{identity!r} is already published (an arc_v2 delta) with other weights "
            f"(first difference: {differs}); published snapshots are immutable, so publish "
            "this one under a new identity"
        )


def _submit_existing(
    args: argparse.Namespace, identity: str, bucket_url: str, ledger_name: str
) -> int:
    """A full folder already in the ledger as a delta (checked): submit the bucket's delta
    again, a no-op upload whose Snapshot the operator already accepted; --wait waits."""
    with tempfile.TemporaryDirectory(prefix="hotload-published-") as tmp:
        download_snapshot(open_bucket(bucket_url, credentials_dir=args.credentials_dir),
                          identity, tmp)  # fmt: skip
        return _submit_as_is(args, Path(tmp), identity, bucket_url, ledger_name)


def _print_ledger_result(
    args: argparse.Namespace, bucket_url: str, ledger: Ledger, entry: Any, transfer: Any
) -> None:
    if args.output == "json":
        print_json(
            {
                "identity": entry.identity,
                "bucket": bucket_url,
                "ledger": ledger.url,
                "uploaded": not transfer.already_present,
                "files": transfer.files,
                "bytes": transfer.bytes,
                "entry": entry.to_json(),
            }
        )
        return
    parent = f" on top of {entry.previous}" if entry.kind == "incremental" else ""
    uploaded = (
        "already in the bucket"
        if transfer.already_present
        else f"{transfer.files} files, {human_bytes(transfer.bytes)} uploaded"
    )
    say(
        f"published {entry.identity} ({entry.kind}{parent}) to {bucket_url}: {uploaded}; "
        f"ledger {ledger.name} sequence {entry.sequence}"
    )


def _print_deployment_result(
    args: argparse.Namespace,
    *,
    identity: str,
    kind: str,
    previous: str | None,
    sequence: int | None,
    report: Any,
) -> int:
    result: dict[str, object] = {
        "identity": identity,
        "kind": kind,
        "previous": previous,
        "sequence": sequence,
        "accepted": True,
    }
    if report is not None:
        result |= {
            "ready": True,
            "replicas": report.replicas,
            "loaded": report.loaded,
            "seconds": round(report.seconds, 3),
            "loads": report.loads,
        }
    if args.output == "json":
        print_json(result)
        return 0
    what = f"{kind} on top of {previous}" if previous else kind
    if report is not None:
        say(
            f"{identity} ({what}) accepted and ready: {report.loaded}/{report.replicas} "
            f"replicas serve it ({report.seconds:.1f}s)"
        )
    else:
        say(f"{identity} ({what}) accepted by the operator into {args.namespace}/{args.deployment}")
    return 0
