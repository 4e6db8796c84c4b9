"""A delta's record of what it takes from its parent instead of shipping it (docs/arc_v2.md §2.2):
side files with the parent's bytes, and weight shards the step left alone.

The record (`layout.INHERITED_FILE`) is read by the format (which shard files a folder must hold)
and by the codec (which parent files it takes after checking them), so it lives here, under both.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from hotload.errors import CorruptDeltaError
from hotload.snapshot import layout


@dataclass(frozen=True)
class InheritedRecord:
    """What a delta folder takes from its parent: side files (name -> sha256 of their bytes) and
    untouched shards (name -> sha256 of the parent's shard header as stored, length prefix
    included). Both empty for a delta that ships everything (no record file)."""

    side_files: dict[str, str] = field(default_factory=dict)
    untouched_shards: dict[str, str] = field(default_factory=dict)


def read_inherited(delta: Path) -> InheritedRecord:
    """The record of delta folder `delta`, empty when it has none; `CorruptDeltaError` naming
    the record and the field when it is malformed."""
    path = delta / layout.INHERITED_FILE
    if not path.is_file():
        return InheritedRecord()
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptDeltaError(f"is not JSON: {err}", shard=str(path)) from None
    files = doc.get("from_parent") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise CorruptDeltaError('has no "from_parent" object', shard=str(path))
    shards = doc.get("untouched_shards", {})
    if not isinstance(shards, dict):
        raise CorruptDeltaError('"untouched_shards" is not an object', shard=str(path))
    for name, digest in files.items():
        parts = PurePosixPath(name).parts
        if (
            not name
            or name.startswith("/")
            or ".." in parts
            or name in (layout.CONFIG_FILE, layout.INHERITED_FILE, *layout.MANIFEST_FILES)
            or name.endswith(".safetensors")
        ):
            raise CorruptDeltaError(f"names {name!r}, which no delta may inherit", shard=str(path))
        _check_digest(digest, repr(name), path)
    for name, digest in shards.items():
        if not layout.SHARD_RE.fullmatch(name):
            raise CorruptDeltaError(
                f"untouched_shards names {name!r}, not a model-XXXXX-of-YYYYY.safetensors shard",
                shard=str(path),
            )
        _check_digest(digest, f"untouched shard {name!r}", path)
    return InheritedRecord(dict(files), dict(shards))


def write_inherited(folder: Path, record: InheritedRecord) -> None:
    """Write `record` into delta folder `folder` (sorted, stable bytes), or nothing when it is
    empty: a delta that takes nothing from its parent has no record."""
    if not record.side_files and not record.untouched_shards:
        (folder / layout.INHERITED_FILE).unlink(missing_ok=True)
        return
    doc: dict[str, object] = {"from_parent": dict(sorted(record.side_files.items()))}
    if record.untouched_shards:
        doc["untouched_shards"] = dict(sorted(record.untouched_shards.items()))
    (folder / layout.INHERITED_FILE).write_text(json.dumps(doc, indent=1) + "\n")


def header_digest(raw: bytes) -> str:
    """The "sha256:<hex>" an untouched shard is recorded with: of a safetensors shard's header as
    stored (its 8-byte length and JSON, `reader.data_header`), which holds every tensor's
    adler32, so it pins the shard's data for a reader that verifies it."""
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def untouched_of(record: Mapping[str, str], shards: list[str]) -> list[str]:
    """The shards of `shards` that a record's `untouched_shards` names, in `shards`' order."""
    return [s for s in shards if s in record]


def _check_digest(digest: object, where: str, path: Path) -> None:
    hexpart = digest.removeprefix("sha256:") if isinstance(digest, str) else ""
    if not (
        isinstance(digest, str)
        and digest.startswith("sha256:")
        and len(hexpart) == 64
        and all(c in "0123456789abcdef" for c in hexpart)
    ):
        raise CorruptDeltaError(
            f"records {digest!r} for {where}, not sha256:<64 hex digits>", shard=str(path)
        )
