"""Open a snapshot folder lazily: manifests parsed up front, shards memory-mapped on demand."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hotload.arc.container import MAGIC, PREFIX_LEN, header_from_bytes, is_arc_file, read_header
from hotload.errors import ChecksumMismatchError, SnapshotError
from hotload.snapshot import layout
from hotload.snapshot.inherited import read_inherited
from hotload.snapshot.lora import adapter_digest
from hotload.snapshot.manifests import TensorSpec, load_json, parse_tensor_map, parse_weight_map
from hotload.snapshot.safetensors_io import RawTensor, SafetensorsFile

SnapshotKind = Literal["full", "incremental", "lora"]


class Snapshot:
    """A snapshot folder on disk: manifests in memory, shards opened one at a time when asked."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise SnapshotError("snapshot folder does not exist", path=str(self.path))
        self.is_adapter = (self.path / layout.ADAPTER_CONFIG_FILE).exists()
        self.weight_map: dict[str, str] = {}
        self.tensor_map: dict[str, TensorSpec] = {}
        self._untouched: dict[str, str] | None = None  # read on first use (`untouched_shards`)
        if not self.is_adapter:
            self.weight_map = parse_weight_map(self.path / layout.INDEX_FILE)
            self.tensor_map = parse_tensor_map(self.path / layout.SPEC_FILE)

    @property
    def config(self) -> dict[str, Any]:
        """The parsed `config.json` (or `adapter_config.json` for an adapter)."""
        name = layout.ADAPTER_CONFIG_FILE if self.is_adapter else layout.CONFIG_FILE
        doc = load_json(self.path / name)
        if not isinstance(doc, dict):
            raise SnapshotError("must be a JSON object", path=str(self.path / name))
        return doc

    @property
    def shard_files(self) -> list[str]:
        """Shard file names named by the weight map, sorted."""
        return sorted(set(self.weight_map.values()))

    @property
    def untouched_shards(self) -> dict[str, str]:
        """The shards an incremental snapshot does not ship because the step left them alone
        (name -> sha256 of the parent's shard header, docs/arc_v2.md §2.2); empty otherwise."""
        if self._untouched is None:
            self._untouched = {} if self.is_adapter else read_inherited(self.path).untouched_shards
        return self._untouched

    @property
    def shipped_shards(self) -> list[str]:
        """The shard files the folder holds: every shard of the weight map but the untouched
        ones, sorted."""
        untouched = self.untouched_shards
        return [s for s in self.shard_files if s not in untouched]

    def tensors_of(self, shard: str) -> list[str]:
        """Names of the tensors the weight map assigns to `shard`."""
        return [n for n, f in self.weight_map.items() if f == shard]

    @property
    def kind(self) -> SnapshotKind:
        """`lora` for an adapter folder, `incremental` for arc_v2 delta shards, else `full`."""
        if self.is_adapter:
            return "lora"
        if self.untouched_shards:
            return "incremental"
        files = self.shard_files
        return "incremental" if files and is_arc_file(self.path / files[0]) else "full"

    @property
    def parent(self) -> str | None:
        """Identity of the parent snapshot of an incremental snapshot, else None."""
        if self.kind != "incremental":
            return None
        return read_header(self.path / self.shipped_shards[0]).parent

    def open_shard(self, shard: str) -> SafetensorsFile:
        """Memory-map one full shard."""
        return SafetensorsFile(self.path / shard)

    def iter_tensors(self) -> Iterator[tuple[str, RawTensor]]:
        """Yield every tensor of a full snapshot, shard by shard, as zero-copy views."""
        for shard in self.shard_files:
            f = self.open_shard(shard)
            for info in sorted(f.tensors.values(), key=lambda i: i.begin):
                yield info.name, RawTensor(info.dtype, info.shape, f.raw(info.name))

    @property
    def full_bytes(self) -> int:
        """Bytes of the tensors of the full snapshot this folder holds or rebuilds."""
        return sum(spec.nbytes for spec in self.tensor_map.values())

    def files(self) -> list[str]:
        """Every regular file in the folder, relative and sorted (manifests included)."""
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())


@dataclass(frozen=True)
class SnapshotDescription:
    """What a publisher needs to know about a snapshot folder before uploading it."""

    kind: SnapshotKind
    parent: str | None
    files: list[str]
    manifest_files: list[str]
    manifest_digest: str
    shipped_bytes: int
    full_bytes: int
    #: `content_digest` of the folder: pins every byte a loader may read (the ledger's
    #: contentDigest).
    content_digest: str


#: Largest data-file header hashed (a bigger one is no safetensors or arc_v2 header).
MAX_DATA_HEADER = 100 * 1024 * 1024


def data_header(path: Path) -> bytes:
    """The header of a data file exactly as stored: an arc_v2 delta's magic, length, CRC and
    zstd frame, or a safetensors file's length prefix and JSON header."""
    with path.open("rb") as f:
        prefix = f.read(PREFIX_LEN)
        if prefix.startswith(MAGIC) and len(prefix) == PREFIX_LEN:
            (length,) = struct.unpack("<Q", prefix[len(MAGIC) : len(MAGIC) + 8])
            start = PREFIX_LEN
        elif len(prefix) >= 8:
            (length,) = struct.unpack("<Q", prefix[:8])
            start = 8
        else:
            raise SnapshotError("file is too short to be safetensors or arc_v2", path=str(path))
        if length > MAX_DATA_HEADER:
            raise SnapshotError(f"header of {length} bytes is not plausible", path=str(path))
        f.seek(start)
        body = f.read(length)
    if len(body) != length:
        raise SnapshotError("header is truncated", path=str(path))
    return prefix[:start] + body


def content_digest(path: str | Path, headers: dict[str, bytes] | None = None) -> str:
    """Return "sha256:<hex>" over every file of the snapshot folder, by sorted relative name:
    the name and, for a data file (`*.safetensors`: a full shard, an adapter's weights or an
    arc_v2 delta shard), the sha256 of its header; for any other file the sha256 of its bytes.

    A header stands for its data because verification checks the data against it: a
    safetensors header's `__metadata__` holds `hotload.checksums` (each tensor's adler32,
    checked by `hotload.arc.verify` and refused when absent unless a publisher opted out),
    and an arc_v2 header's zstd frame (itself under the prefix's CRC-32) holds each chunk's
    `crc32` and each rebuilt tensor's `checksum`, checked by the decoder. So a file with other
    bytes either changes this digest or fails its checksums; it reads headers only for data,
    and gives the same answer on a header-only (skeleton) copy. `headers` receives each data
    file's header bytes as read (by relative name), for a caller that checks them next."""
    root = Path(path)
    h = hashlib.sha256()
    for name in sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()):
        file = root / name
        if name.endswith(".safetensors"):
            part = data_header(file)
            if headers is not None:
                headers[name] = part
        else:
            part = file.read_bytes()
        h.update(name.encode() + b"\0" + hashlib.sha256(part).hexdigest().encode() + b"\n")
    return "sha256:" + h.hexdigest()


def check_content(
    path: str | Path, expected: str | None, identity: str, *, got: str | None = None
) -> None:
    """Raise `ChecksumMismatchError` naming the snapshot unless the folder's `content_digest`
    is `expected` (the ledger entry's); an entry without one (an older ledger) passes. `got`:
    the folder's digest when already computed (`describe_snapshot`), so no header is re-read."""
    if expected is None:
        return
    got = got if got is not None else content_digest(path)
    if got != expected:
        raise ChecksumMismatchError(
            f"files of {identity!r} have content digest {got}, the ledger recorded {expected}: "
            "a file or a shard's checksums differ from what was published"
        )


def manifest_digest(path: Path, files: list[str]) -> str:
    """Return "sha256:<hex>" over the named manifest files (name and bytes, in order)."""
    return digest_of_manifests([(name, (path / name).read_bytes()) for name in files])


def digest_of_manifests(contents: list[tuple[str, bytes]]) -> str:
    """`manifest_digest` over manifests already in memory, as (name, bytes) in upload order."""
    h = hashlib.sha256()
    for name, data in contents:
        h.update(name.encode() + b"\0")
        h.update(data)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def describe_snapshot(
    path: str | Path, headers: dict[str, bytes] | None = None
) -> SnapshotDescription:
    """Describe a snapshot folder: kind, parent, files, manifests (uploaded last) and sizes.
    `headers` receives each data file's header bytes as read (`content_digest`)."""
    snap = Snapshot(path)
    files = snap.files()
    if snap.is_adapter:
        manifests = [layout.ADAPTER_CONFIG_FILE]
        full = sum((snap.path / f).stat().st_size for f in files)
    else:
        manifests = list(layout.MANIFEST_FILES)
        others = sum(
            (snap.path / f).stat().st_size for f in files if f not in snap.weight_map.values()
        )
        full = snap.full_bytes + others
    shipped = sum((snap.path / f).stat().st_size for f in files)
    # An adapter's weights are small and have no tensor_map: its digest pins their headers
    # (and through them the per-tensor checksums) as well as the config.
    digest = adapter_digest(snap.path) if snap.is_adapter else manifest_digest(snap.path, manifests)
    seen: dict[str, bytes] = {} if headers is None else headers
    content = content_digest(snap.path, seen)
    # The kind and the parent from the first shard's header as the digest read it: each data
    # header is read once here (`Snapshot.kind` and `.parent` would read it twice more).
    shards = snap.shipped_shards
    raw = seen.get(shards[0]) if shards and not snap.is_adapter else None
    if raw is None:
        kind, parent = snap.kind, snap.parent
    elif raw.startswith(MAGIC):
        first = snap.path / shards[0]
        kind, parent = (
            "incremental",
            header_from_bytes(raw, first.stat().st_size, first.name).parent,
        )
    else:
        kind, parent = "full", None
    return SnapshotDescription(
        kind=kind,
        parent=parent,
        files=files,
        manifest_files=manifests,
        manifest_digest=digest,
        shipped_bytes=shipped,
        full_bytes=full,
        content_digest=content,
    )
