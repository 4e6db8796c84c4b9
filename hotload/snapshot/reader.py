"""Open a snapshot folder lazily: manifests parsed up front, shards memory-mapped on demand."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hotload.arc.container import is_arc_file, read_header
from hotload.errors import SnapshotError
from hotload.snapshot import layout
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

    def tensors_of(self, shard: str) -> list[str]:
        """Names of the tensors the weight map assigns to `shard`."""
        return [n for n, f in self.weight_map.items() if f == shard]

    @property
    def kind(self) -> SnapshotKind:
        """`lora` for an adapter folder, `incremental` for arc_v2 delta shards, else `full`."""
        if self.is_adapter:
            return "lora"
        files = self.shard_files
        return "incremental" if files and is_arc_file(self.path / files[0]) else "full"

    @property
    def parent(self) -> str | None:
        """Identity of the parent snapshot of an incremental snapshot, else None."""
        if self.kind != "incremental":
            return None
        return read_header(self.path / self.shard_files[0]).parent

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


def describe_snapshot(path: str | Path) -> SnapshotDescription:
    """Describe a snapshot folder: kind, parent, files, manifests (uploaded last) and sizes."""
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
    return SnapshotDescription(
        kind=snap.kind,
        parent=snap.parent,
        files=files,
        manifest_files=manifests,
        manifest_digest=digest,
        shipped_bytes=shipped,
        full_bytes=full,
    )
