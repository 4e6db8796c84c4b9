"""`hotload snapshot ...`: build, delta, apply, verify and inspect snapshot folders."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from hotload.cli.common import print_json, progress_bar, stdout
from hotload.errors import SnapshotError
from hotload.units import human_bytes, parse_size


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `snapshot` command group."""
    p = sub.add_parser(
        "snapshot",
        help="build, diff, rebuild, verify and inspect snapshot folders",
        description="Work with snapshot folders: full Hugging Face safetensors snapshots and "
        "arc_v2 incremental snapshots (deltas).",
    )
    s = p.add_subparsers(dest="snapshot_command", metavar="SUBCOMMAND", required=True)

    b = s.add_parser(
        "build",
        help="write a full snapshot from a Hugging Face model folder",
        description="Re-shard a Hugging Face model folder into a full snapshot: one layer per "
        "shard, non-layer tensors in their own shards, config and tokenizer copied, manifests "
        "(model.safetensors.index.json, model.weight.spec.json) written last.",
    )
    b.add_argument(
        "source", type=Path, help="Hugging Face model folder (config.json + *.safetensors)"
    )
    b.add_argument("out", type=Path, help="snapshot folder to create (its name is the identity)")
    b.add_argument("--dtype", choices=["bf16"], help="cast floating-point weights to this dtype")
    b.add_argument("--max-shard-size", default="5GB", help="shard size limit (default: 5GB)")
    b.add_argument(
        "--fp8",
        choices=["experts", "linear"],
        help="write these weights as block FP8 (F8_E4M3 plus an F32 weight_scale_inv per "
        "128x128 block) with the quantization_config: 'experts' the routed experts only, "
        "'linear' every linear layer (router gates, norms, embeddings and lm_head stay as they "
        "are); keep the same recipe for every snapshot of a run",
    )
    _finish(b, _build, force=True)

    d = s.add_parser(
        "delta",
        help="encode CUR as an arc_v2 delta against PREV",
        description="Write an incremental snapshot OUT that rebuilds the full snapshot CUR from "
        "the full snapshot PREV, bit for bit, with a checksum per tensor.",
    )
    _previous(d)
    d.add_argument("current", type=Path, metavar="CUR", help="new full snapshot folder")
    d.add_argument("out", type=Path, metavar="OUT", help="incremental snapshot folder to create")
    d.add_argument(
        "--parent-identity", help="identity recorded as the parent (default: PREV's folder name)"
    )
    d.add_argument("--identity", help="identity of the new snapshot (default: OUT's folder name)")
    _threads(d)
    d.add_argument(
        "--compact",
        action="store_true",
        help="use the parent's exponents as context for float tensors: about a quarter "
        "smaller on optimizer updates, about three times slower to rebuild (for fleets whose "
        "bottleneck is bandwidth or egress, not CPU)",
    )
    _finish(d, _delta, force=True)

    a = s.add_parser(
        "apply",
        help="rebuild the full snapshot of DELTA from PREV",
        description="Rebuild the full snapshot an incremental snapshot describes, verifying "
        "every tensor checksum. OUT appears only if everything verified.",
    )
    _previous(a)
    a.add_argument("delta", type=Path, metavar="DELTA", help="incremental snapshot folder")
    a.add_argument("out", type=Path, metavar="OUT", help="full snapshot folder to create")
    a.add_argument("--expected-parent", help="refuse the delta unless its parent identity is this")
    _threads(a)
    _finish(a, _apply, force=True)

    v = s.add_parser(
        "verify",
        help="validate a snapshot and check its tensor checksums",
        description="Validate the folder's structure. For a full snapshot, check every tensor "
        "against the checksums its shards record (a shard that records none fails, unless "
        "--allow-unchecked); for an incremental one with --previous, rebuild it in memory "
        "against PREV and check every tensor (nothing is written).",
    )
    v.add_argument("dir", type=Path, metavar="DIR")
    v.add_argument(
        "--previous", type=Path, metavar="PREV", help="parent full snapshot (for deltas)"
    )
    v.add_argument(
        "--base-config", type=Path, help="config.json the snapshot must be equivalent to"
    )
    v.add_argument("--identity", help="also check this identity is valid")
    _threads(v)
    v.add_argument(
        "--allow-unchecked",
        action="store_true",
        help="accept full shards that record no checksums (not written by hotload): they are "
        "listed as unchecked instead of failing the verification",
    )
    _finish(v, _verify)

    i = s.add_parser(
        "inspect",
        help="show a snapshot's kind, shards, tensors and sizes",
        description="Describe a snapshot folder: kind, parent, shards with their layers and "
        "sizes, and for deltas the encodings chosen and the size against the full snapshot.",
    )
    i.add_argument("dir", type=Path, metavar="DIR")
    _finish(i, _inspect)


def _previous(p: argparse.ArgumentParser) -> None:
    p.add_argument("previous", type=Path, metavar="PREV", help="parent full snapshot folder")


def _threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, help="worker threads (default: all cores)")


def _finish(
    p: argparse.ArgumentParser, func: Callable[[argparse.Namespace], int], *, force: bool = False
) -> None:
    """The options every subcommand ends with (`--force` where it writes OUT, then `-o`)."""
    if force:
        p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.set_defaults(func=func)


def _report(args: argparse.Namespace, doc: dict[str, Any], text: str) -> int:
    """Print `doc` as JSON (`-o json`) or `text`; the command succeeded."""
    if args.output == "json":
        print_json(doc)
    else:
        stdout.print(text)
    return 0


def _build(args: argparse.Namespace) -> int:
    from hotload.snapshot import build_from_folder, iter_model_folder

    total = sum(t.nbytes for _, t in iter_model_folder(args.source))
    with progress_bar("build", total, args.output == "text") as advance:
        written = build_from_folder(
            args.source,
            args.out,
            max_shard_bytes=parse_size(args.max_shard_size),
            cast="BF16" if args.dtype == "bf16" else None,
            overwrite=args.force,
            progress=advance,
            fp8=args.fp8,
        )
    doc = {
        "path": str(written.path),
        "shards": len(written.shards),
        "tensors": written.tensor_count,
        "bytes": written.total_bytes,
    }
    return _report(
        args,
        doc,
        f"wrote {written.path}: {written.tensor_count} tensors in {len(written.shards)} "
        f"shards, {human_bytes(written.total_bytes)}",
    )


def _codec_doc(stats: Any) -> dict[str, Any]:
    return {
        "full_bytes": stats.full_bytes,
        "delta_bytes": stats.delta_bytes,
        "ratio": stats.full_bytes / max(1, stats.delta_bytes),
        "changed_fraction": stats.changed / max(1, stats.elements),
        "seconds": stats.seconds,
        "shards": [
            {
                "name": s.name,
                "full_bytes": s.full_bytes,
                "delta_bytes": s.delta_bytes,
                "changed": s.changed,
                "elements": s.elements,
                "encodings": dict(s.encodings),
                "hardlinked": s.hardlinked,
            }
            for s in stats.shards
        ],
    }


def _delta(args: argparse.Namespace) -> int:
    from hotload.arc import encode
    from hotload.snapshot import Snapshot

    total = Snapshot(args.current).full_bytes
    with progress_bar("delta", total, args.output == "text") as advance:
        stats = encode(
            args.previous,
            args.current,
            args.out,
            parent_identity=args.parent_identity,
            identity=args.identity or args.out.name,
            threads=args.threads,
            compact=args.compact,
            overwrite=args.force,
            progress=advance,
        )
    doc = _codec_doc(stats)
    return _report(
        args,
        doc,
        f"wrote {args.out}: {human_bytes(stats.delta_bytes)} for a "
        f"{human_bytes(stats.full_bytes)} snapshot ({doc['ratio']:.1f}x smaller), "
        f"{doc['changed_fraction'] * 100:.3f}% of elements changed, {stats.seconds:.2f}s",
    )


def _apply(args: argparse.Namespace) -> int:
    from hotload.arc import decode
    from hotload.snapshot import Snapshot

    total = Snapshot(args.delta).full_bytes
    with progress_bar("apply", total, args.output == "text") as advance:
        stats = decode(
            args.previous,
            args.delta,
            args.out,
            expected_parent=args.expected_parent,
            threads=args.threads,
            overwrite=args.force,
            progress=advance,
        )
    linked = sum(s.hardlinked for s in stats.shards)
    return _report(
        args,
        _codec_doc(stats),
        f"rebuilt {args.out}: {len(stats.shards)} shards ({linked} unchanged, hard-linked), "
        f"every tensor verified, {stats.seconds:.2f}s",
    )


def _verify(args: argparse.Namespace) -> int:
    from hotload.arc import verify
    from hotload.snapshot import Snapshot, validate_snapshot
    from hotload.snapshot.manifests import load_json

    base = load_json(args.base_config) if args.base_config is not None else None
    snap = validate_snapshot(args.dir, identity=args.identity, base_config=base)
    # Tensor bytes are read only for a full snapshot, or for a delta rebuilt against --previous.
    reads = snap.kind == "full" or (snap.kind == "incremental" and args.previous is not None)
    total = Snapshot(args.dir).full_bytes if reads else 0
    with progress_bar("verify", total, args.output == "text" and reads) as advance:
        report = verify(
            args.dir,
            args.previous,
            threads=args.threads,
            allow_unchecked=args.allow_unchecked,
            progress=advance,
        )
    doc = {
        "path": str(args.dir),
        "kind": report.kind,
        "parent": report.parent,
        "shards_checked": report.shards_checked,
        "tensors_checked": report.tensors_checked,
        "unchecked_shards": report.unchecked_shards,
        "ok": True,
    }
    what = (
        f"{report.tensors_checked} tensor checksums verified"
        if report.tensors_checked
        else "structure valid (pass --previous to verify a delta's tensors)"
        if report.kind == "incremental"
        else "structure valid"
    )
    if report.unchecked_shards:
        what += (
            f"; {len(report.unchecked_shards)} shard(s) record no checksums and were NOT "
            f"verified: {', '.join(report.unchecked_shards)}"
        )
    return _report(args, doc, f"{args.dir}: {report.kind} snapshot OK, {what}")


def _inspect(args: argparse.Namespace) -> int:
    from hotload.arc.container import read_header
    from hotload.snapshot import describe_snapshot, layer_of
    from hotload.snapshot.reader import Snapshot

    snap = Snapshot(args.dir)
    desc = describe_snapshot(args.dir)
    shards: list[dict[str, Any]] = []
    for shard in snap.shard_files:
        path = snap.path / shard
        tensors = snap.tensors_of(shard)
        entry: dict[str, Any] = {
            "name": shard,
            "bytes": path.stat().st_size if path.exists() else None,
            "tensors": len(tensors),
            "layer": (layer_of(tensors[0]) if tensors else None) or "<non-layer>",
            "full_bytes": sum(snap.tensor_map[t].nbytes for t in tensors if t in snap.tensor_map),
        }
        if shard in snap.untouched_shards:
            entry["untouched"] = True  # left alone by the step: the parent's (arc_v2.md §2.2)
        elif desc.kind == "incremental":
            counts: dict[str, int] = {}
            for t in read_header(path).fields.get("tensors", []):
                for c in t.get("chunks", []):
                    counts[c.get("encoding", "?")] = counts.get(c.get("encoding", "?"), 0) + 1
            entry["encodings"] = counts
        shards.append(entry)
    doc: dict[str, Any] = {
        "path": str(snap.path),
        "kind": desc.kind,
        "parent": desc.parent,
        "files": len(desc.files),
        "tensors": len(snap.tensor_map),
        "shipped_bytes": desc.shipped_bytes,
        "full_bytes": desc.full_bytes,
        "manifest_digest": desc.manifest_digest,
        "content_digest": desc.content_digest,
        "shards": shards,
    }
    if desc.kind == "lora":
        doc["adapter_config"] = snap.config
    if args.output == "json":
        print_json(doc)
        return 0
    stdout.print(
        f"[bold]{snap.path}[/bold]: {desc.kind} snapshot"
        + (f" of parent {desc.parent}" if desc.parent else "")
        + f", {len(snap.tensor_map)} tensors, {human_bytes(desc.shipped_bytes)} on disk, "
        f"{human_bytes(desc.full_bytes)} full"
    )
    if shards:
        table = Table("shard", "layer", "tensors", "bytes", "full bytes", "encodings")
        for e in shards:
            enc = e.get("encodings")
            table.add_row(
                e["name"],
                e["layer"],
                str(e["tensors"]),
                human_bytes(e["bytes"] or 0),
                human_bytes(e["full_bytes"]),
                "untouched (the parent's)"
                if e.get("untouched")
                else json.dumps(enc)
                if enc
                else "",
            )
        stdout.print(table)
    if not snap.path.is_dir():
        raise SnapshotError("not a folder", path=str(snap.path))
    return 0
