"""`hotload ledger gc`: delete the snapshot folders nothing can need any more (a dry run unless
`--apply`), saying for every folder why it goes or why it stays."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hotload.bucket import run_sync
from hotload.cli.common import print_json, progress_bar, stderr, stdout
from hotload.errors import HotloadError, LedgerError
from hotload.ledger import DEFAULT_HISTORY, open_ledger
from hotload.ledger.gc import GcResult, gc_async
from hotload.ledger.retention import (
    DEFAULT_GRACE,
    DEFAULT_ORPHAN_AGE,
    NO_GRACE,
    Verdict,
    human_age,
    parse_age,
)
from hotload.sdk.holders import deployment_holders_async
from hotload.units import human_bytes

_DESCRIPTION = (
    "Delete the snapshot folders of the bucket that nothing can need any more, and drop their "
    "entries from the ledger. A folder stays when it is among the last --keep entries, on the "
    "chain from the latest full snapshot, on the chain of a pinned snapshot (pins in the "
    "bucket) or of one a --deployment's replicas serve or target, named by another ledger of "
    "the bucket, or not in any ledger but written less than --orphan-age ago (a publish in "
    "flight or awaiting admission). Folders no ledger names (failed publishes, snapshots "
    "compacted away) and abandoned hints older than --orphan-age go. A dry run by default: "
    "it prints what would go and why the rest stays; --apply deletes. The ledger changes "
    "(compare-and-swap) before any folder goes, so an interrupted gc leaves only orphans that "
    "the next run removes."
)


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    common: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Add `ledger gc` to the `ledger` command group (`common`: its shared arguments)."""
    p = sub.add_parser(
        "gc",
        help="delete snapshot folders nothing needs any more (dry run unless --apply)",
        description=_DESCRIPTION,
        epilog="Exit codes: 0 done (or planned), 1 refused or failed (nothing deleted when it "
        "refuses: a deployment or pin that cannot be read, a ledger that does not exist).",
    )
    common(p)
    p.add_argument(
        "--keep",
        type=int,
        default=DEFAULT_HISTORY,
        metavar="N",
        help=f"entries to keep at least, beyond the chain from the latest full snapshot "
        f"(default: {DEFAULT_HISTORY})",
    )
    p.add_argument(
        "--orphan-age",
        type=_age,
        default=DEFAULT_ORPHAN_AGE,
        metavar="DURATION",
        help="folders no ledger names go only once their newest file is this old, e.g. 90s, "
        f"30m, 24h, 7d (default: {human_age(DEFAULT_ORPHAN_AGE)}); keep it well above the "
        "longest upload plus admission",
    )
    p.add_argument(
        "--grace",
        type=_age,
        default=None,
        metavar="DURATION",
        help="the folders of entries this gc drops from the ledger stay this long after (a "
        "replica that read the ledger before may still be fetching them; a later run deletes "
        f"them). Default: 0 with --deployment (its replicas are seen), "
        f"{human_age(DEFAULT_GRACE)} without",
    )
    p.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="[NAMESPACE/]NAME",
        help="a HotLoadDeployment whose replicas' served and target snapshots (and pin) must "
        "stay; repeat for every fleet that follows this bucket. gc refuses to delete anything "
        "if one cannot be read or has no status yet",
    )
    p.add_argument(
        "--namespace",
        "-n",
        default="default",
        help="namespace of a --deployment given without one (default: default)",
    )
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig (default: $KUBECONFIG)")
    p.add_argument(
        "--apply", action="store_true", help="delete (default: only print what would go)"
    )
    p.set_defaults(func=_gc)


def _age(text: str) -> timedelta:
    try:
        return parse_age(text)
    except HotloadError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _deployments(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = []
    for text in args.deployment:
        namespace, _, name = text.rpartition("/")
        if not name or "/" in namespace:
            raise LedgerError(f"--deployment {text!r}: expected NAME or NAMESPACE/NAME")
        out.append((namespace or args.namespace, name))
    return out


def _gc(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise LedgerError("--keep must be at least 1")
    ledger = open_ledger(args.ledger, credentials_dir=args.credentials_dir)
    deployments = _deployments(args)
    grace: timedelta = (
        args.grace if args.grace is not None else (NO_GRACE if deployments else DEFAULT_GRACE)
    )
    if not deployments and args.output == "text":
        stderr.print(
            "note: no --deployment given: only the ledger, its pins and other ledgers protect "
            "snapshots; a replica still serving an older one is not seen",
            soft_wrap=True,
            highlight=False,
        )

    def gone(verdict: Verdict) -> None:
        if args.output == "text":
            stderr.print(
                f"deleted {verdict.name} ({verdict.files} files, {human_bytes(verdict.size)})",
                soft_wrap=True,
                highlight=False,
            )

    async def run(advance: Callable[[int], None]) -> GcResult:
        holders = await deployment_holders_async(deployments, kubeconfig=args.kubeconfig)
        return await gc_async(
            ledger,
            keep=args.keep,
            orphan_age=args.orphan_age,
            grace=grace,
            holders=holders,
            apply=args.apply,
            progress=advance,
            on_folder=gone,
        )

    with progress_bar("gc: deleting", None, enabled=args.apply) as advance:
        result = run_sync(run(advance))
    if args.output == "json":
        print_json(_json(ledger.url, args.apply, result))
    else:
        _print(ledger.url, args.apply, result)
    return 0


def _json(url: str, applied: bool, result: GcResult) -> dict[str, Any]:
    return {
        "url": url,
        "dryRun": not applied,
        **result.plan.to_json(),
        "deleted": result.deleted,
        "deletedHints": result.deleted_hints,
        "spared": [{"name": n, "reason": r} for n, r in result.spared],
    }


def _print(url: str, applied: bool, result: GcResult) -> None:
    plan = result.plan
    say = _say
    verb = "deleted" if applied else "would delete"
    mode = "" if applied else " - dry run, nothing deleted (add --apply to delete)"
    say(f"gc of ledger {plan.ledger} ({url}){mode}")
    if plan.dropped:
        say(
            f"ledger: {'dropped' if applied else 'would drop'} {len(plan.dropped)} of "
            f"{len(plan.before.entries)} entries: " + ", ".join(e.identity for e in plan.dropped)
        )
    doomed = plan.doomed
    say(f"{verb} {len(doomed)} folder(s), {human_bytes(plan.freed)}:")
    for v in doomed:
        say(f"  - {v.name}  ({v.files} files, {human_bytes(v.size)})  {v.reason}")
    kept = [v for v in plan.folders if not v.delete]
    say(f"keeps {len(kept)} folder(s):")
    for v in kept:
        say(f"  = {v.name}  ({v.files} files, {human_bytes(v.size)})  {v.reason}")
    for h in plan.hints:
        say(f"  {'- ' + verb if h.delete else '= keeps'} hint {h.name}: {h.reason}")
    for name, why in result.spared:
        say(f"  spared {name}: {why}")
    for identity in plan.missing:
        stderr.print(
            f"warning: ledger entry {identity} has no complete folder in the bucket (its commit "
            "manifest is missing): replicas cannot fetch it; publish a new full snapshot",
            soft_wrap=True,
            highlight=False,
        )


def _say(message: str) -> None:
    stdout.print(message, soft_wrap=True, highlight=False)
