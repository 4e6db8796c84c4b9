"""`hotload ledger ...`: show, reset, compact, gc and resolve a ledger in a bucket."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hotload.cli import ledger_gc
from hotload.cli.common import print_json, stdout
from hotload.errors import LedgerError
from hotload.ledger import (
    DEFAULT_HISTORY,
    Ledger,
    LedgerDocument,
    LedgerEntry,
    LedgerState,
    open_ledger,
)
from hotload.ledger.fields import format_time
from hotload.units import human_bytes

_URL_HELP = (
    "the ledger as BUCKET_URL/NAME: a folder path, file:///path, s3://bucket/prefix or "
    "gs://bucket/prefix, then the ledger name (e.g. s3://rl/policies/llama-grpo)"
)
_CREDENTIALS_HELP = (
    "folder of credential files named like the environment variables they replace "
    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, ...), e.g. a "
    "mounted Kubernetes Secret (default: $HOTLOAD_BUCKET_CREDENTIALS_DIR)"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `ledger` command group."""
    p = sub.add_parser(
        "ledger",
        help="show, reset, compact, gc or resolve a snapshot ledger",
        description="A ledger is the ordered, append-only list of published snapshots of one "
        "policy, kept at BUCKET/.hotload/ledgers/NAME.json and changed only by "
        "compare-and-swap. S3 settings come from AWS_ENDPOINT_URL, AWS_REGION, "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_ALLOW_HTTP), or from a credentials "
        "folder.",
    )
    s = p.add_subparsers(dest="ledger_command", metavar="SUBCOMMAND", required=True)

    show = s.add_parser(
        "show",
        help="print the ledger as a table (or JSON)",
        description="Print every retained entry: sequence, identity, kind, parent, sizes, "
        "prompt-cache policy and publication time, with resets in between.",
    )
    _common(show)
    show.set_defaults(func=_show)

    reset = s.add_parser(
        "reset",
        help="record an explicit reset; the next entry must be a full snapshot",
        description="Record a reset with its reason (for example a training restart from an "
        "older checkpoint). Nothing is deleted and the sequence keeps growing; deltas are "
        "refused until a full snapshot is published.",
    )
    _common(reset)
    reset.add_argument("--reason", required=True, help="why the chain is reset (recorded)")
    reset.set_defaults(func=_reset)

    compact = s.add_parser(
        "compact",
        help="drop old history, keeping the chain from the latest full snapshot",
        description="Drop the oldest entries, keeping at least the last --keep entries and "
        "always the latest full snapshot with every delta after it. Snapshot files in the "
        "bucket stay; `hotload ledger gc` deletes the folders nothing needs any more.",
    )
    _common(compact)
    compact.add_argument(
        "--keep",
        type=int,
        default=DEFAULT_HISTORY,
        help=f"entries to keep at least (default: {DEFAULT_HISTORY})",
    )
    compact.set_defaults(func=_compact)

    ledger_gc.register(s, _common)

    resolve = s.add_parser(
        "resolve",
        help="list the snapshots a replica must fetch to reach the head",
        description="Print the cheapest list of snapshots to fetch and apply, in order: only "
        "the deltas after --current when it is on the head's chain, else the latest full "
        "snapshot and the deltas after it.",
    )
    _common(resolve)
    resolve.add_argument("--current", help="identity the replica serves now (default: none)")
    resolve.add_argument("--target", help="identity to reach (default: the head)")
    resolve.set_defaults(func=_resolve)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("ledger", metavar="BUCKET_URL/NAME", help=_URL_HELP)
    p.add_argument("--credentials-dir", metavar="DIR", help=_CREDENTIALS_HELP)
    p.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")


def _open(args: argparse.Namespace) -> Ledger:
    return open_ledger(args.ledger, credentials_dir=args.credentials_dir)


def _existing(ledger: Ledger) -> LedgerState:
    # A typo in BUCKET_URL/NAME must not quietly create a new ledger.
    state = ledger.read()
    if not state.exists:
        raise LedgerError(f"{ledger.url}: no such ledger (nothing has been published to it yet)")
    return state


def _show(args: argparse.Namespace) -> int:
    ledger = _open(args)
    state = _existing(ledger)
    doc = state.document
    if args.output == "json":
        print_json({**doc.to_json(), "etag": state.etag, "url": ledger.url})
        return 0
    # Piped output is not wrapped at 80 columns: a table row stays one line for grep and awk.
    console = stdout if stdout.is_terminal else Console(width=200)
    console.print(_summary(ledger, doc))
    console.print(ledger_table(doc))
    return 0


def _summary(ledger: Ledger, doc: LedgerDocument) -> Text:
    head = doc.head
    text = Text()
    text.append(f"ledger {doc.name}", style="bold")
    text.append(f"  {ledger.url}\n", style="dim")
    text.append(f"head: {head.identity if head else '-'}   sequence: {doc.sequence}   ")
    text.append(f"entries: {len(doc.entries)}")
    if doc.compacted_through:
        text.append(f" (compacted through sequence {doc.compacted_through})")
    pending = doc.pending_reset
    if pending is not None:
        text.append(
            f"\nreset at sequence {pending.sequence}: {pending.reason} - "
            "the next entry must be a full snapshot",
            style="yellow",
        )
    return text


def ledger_table(doc: LedgerDocument) -> Table:
    """A rich table of a ledger's entries and resets, in sequence order."""
    table = Table(show_edge=False, header_style="bold")
    for column, justify in (
        ("SEQ", "right"),
        ("IDENTITY", "left"),
        ("KIND", "left"),
        ("PARENT", "left"),
        ("SHIPPED", "right"),
        ("FULL SIZE", "right"),
        ("PROMPT CACHE", "left"),
        ("PUBLISHED (UTC)", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    rows: list[tuple[int, list[Any]]] = []
    for e in doc.entries:
        rows.append(
            (
                e.sequence,
                [
                    str(e.sequence),
                    e.identity,
                    e.kind,
                    e.previous or "-",
                    human_bytes(e.shipped_bytes),
                    human_bytes(e.full_bytes),
                    e.prompt_cache,
                    _time(e.published_time),
                ],
            )
        )
    for r in doc.resets:
        rows.append(
            (
                r.sequence,
                [
                    str(r.sequence),
                    Text(f"reset: {r.reason}", style="yellow"),
                    Text("reset", style="yellow"),
                    r.previous_head or "-",
                    "",
                    "",
                    "",
                    _time(r.time),
                ],
            )
        )
    for _, cells in sorted(rows, key=lambda row: row[0]):
        table.add_row(*cells)
    return table


def _time(value: Any) -> str:
    return format_time(value).replace("T", " ")[:19]


def _reset(args: argparse.Namespace) -> int:
    ledger = _open(args)
    _existing(ledger)
    record = ledger.reset(args.reason)
    if args.output == "json":
        print_json({"url": ledger.url, "reset": record.to_json()})
    else:
        say(
            f"reset {ledger.name} at sequence {record.sequence} (head was "
            f"{record.previous_head or '-'}); the next entry must be a full snapshot"
        )
    return 0


def _compact(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise LedgerError("--keep must be at least 1")
    ledger = _open(args)
    before = _existing(ledger).document
    after = ledger.compact(args.keep)
    dropped = len(before.entries) - len(after.entries)
    if args.output == "json":
        print_json({"url": ledger.url, "dropped": max(0, dropped), "ledger": after.to_json()})
    else:
        say(
            f"compacted {ledger.name}: dropped {max(0, dropped)} and kept {len(after.entries)} "
            f"entries (compacted through sequence {after.compacted_through})"
        )
    return 0


def _resolve(args: argparse.Namespace) -> int:
    ledger = _open(args)
    chain: list[LedgerEntry] = _existing(ledger).document.resolve_chain(args.current, args.target)
    if args.output == "json":
        print_json(
            {"url": ledger.url, "current": args.current, "fetch": [e.to_json() for e in chain]}
        )
        return 0
    if not chain:
        say("nothing to fetch: already at the target")
        return 0
    total = sum(e.shipped_bytes for e in chain)
    say(f"fetch {len(chain)} snapshot(s), {human_bytes(total)} in all:")
    for e in chain:
        say(f"  {e.sequence:>6}  {e.identity}  ({e.kind}, {human_bytes(e.shipped_bytes)})")
    return 0


def say(message: str) -> None:
    """Print one plain message line on stdout, unwrapped (scripts may grep it)."""
    stdout.print(message, soft_wrap=True, highlight=False)
