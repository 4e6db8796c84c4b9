"""The file work of the codec: a staging folder that appears whole, hard links, and ranged
copies between files."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from hotload.errors import ChecksumMismatchError, SnapshotError
from hotload.snapshot import layout
from hotload.snapshot.inherited import InheritedRecord, read_inherited, write_inherited


def copy_range(src: int, dst: int, count: int, src_off: int, dst_off: int) -> None:
    """Copy `count` bytes between open files, in the kernel where it can (copy_file_range)."""
    while count > 0:
        try:
            done = os.copy_file_range(src, dst, count, src_off, dst_off)
        except OSError:
            done = 0
        if done <= 0:  # unsupported here: plain reads and writes
            os.lseek(src, src_off, os.SEEK_SET)
            data = os.read(src, min(count, 1 << 24))
            if not data:
                raise OSError("unexpected end of parent shard")
            done = os.pwrite(dst, data, dst_off)
        count -= done
        src_off += done
        dst_off += done


def link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link src to dst (snapshot files are never modified in place, only replaced), or
    copy it where the filesystem cannot link; True when linked."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


def side_files(folder: Path, shards: Sequence[str]) -> list[str]:
    """The side files of a snapshot folder (config, tokenizer files): what is neither a shard,
    a manifest, a hidden file nor a delta's record of inherited files; sorted relative names."""
    skip = {*shards, *layout.MANIFEST_FILES, layout.INHERITED_FILE}
    return [
        name
        for path in sorted(folder.rglob("*"))
        if path.is_file()
        and not path.name.startswith(".")
        and (name := path.relative_to(folder).as_posix()) not in skip
    ]


def ship_side_files(parent: Path, current: Path, dst: Path, shards: Sequence[str]) -> list[str]:
    """Link or copy into delta folder `dst` the side files of `current` that its `parent` does
    not hold byte for byte; record the others in `layout.INHERITED_FILE` with their sha256 (a
    Llama-3 tokenizer.json, ~9 MB, is not shipped again with every delta). config.json is always
    shipped: every snapshot's checks read it. Returns the inherited names."""
    inherited: dict[str, str] = {}
    for name in side_files(current, shards):
        src, old = current / name, parent / name
        same_size = old.is_file() and old.stat().st_size == src.stat().st_size
        digest = _sha256(src) if name != layout.CONFIG_FILE and same_size else None
        if digest is not None and digest == _sha256(old):
            inherited[name] = digest
        else:
            _place(src, dst / name)
    write_inherited(dst, InheritedRecord(inherited))
    return sorted(inherited)


def side_file_sums(folder: Path, names: Sequence[str]) -> dict[str, str]:
    """The sha256 ("sha256:<hex>") of each of `names` in `folder`: what a publisher that keeps
    no parent folder remembers of a step's side files, to inherit them in the next delta."""
    return {name: _sha256(folder / name) for name in names}


def inherit_side_files(
    folder: Path, current: Mapping[str, str], parent: Mapping[str, str]
) -> list[str]:
    """In delta folder `folder`, holding the side files `current` (name -> sha256, from
    `side_file_sums`), replace by a `layout.INHERITED_FILE` record each one whose sha256 equals
    the parent's (`parent`, the same for the parent snapshot); config.json stays. Returns the
    names still shipped, sorted."""
    inherited = {
        name: digest
        for name, digest in current.items()
        if name != layout.CONFIG_FILE and parent.get(name) == digest
    }
    for name in inherited:
        (folder / name).unlink()
    write_inherited(folder, InheritedRecord(inherited, read_inherited(folder).untouched_shards))
    return sorted(set(current) - set(inherited))


def changed_side_files(delta: Path, shards: Sequence[str]) -> list[str]:
    """The side files other than config.json that delta folder `delta` ships although it records
    inherited ones: its publisher inherits what did not change, so these changed (a tokenizer,
    a chat template). Empty for a delta that records nothing (it ships every side file)."""
    if not inherited_files(delta):
        return []
    return [n for n in side_files(delta, shards) if n != layout.CONFIG_FILE]


def rebuild_side_files(
    parent: Path, deltas: Sequence[Path], dst: Path | None, shards: Sequence[str]
) -> None:
    """Give `dst` the side files of the snapshot `deltas[-1]` rebuilds from full snapshot
    `parent` through every delta in order: each delta's own, and the ones it inherits from the
    snapshot before it, checked against their recorded sha256 (`ChecksumMismatchError` naming
    the file: a local parent that rotted is fetched again by the loader's fallback). With
    `dst=None` only checks. A malformed record is a `CorruptDeltaError` naming it."""
    have = {name: parent / name for name in side_files(parent, shards)}
    digests: dict[Path, str] = {}  # a file inherited down a chain is hashed once
    for delta in deltas:
        now = {name: delta / name for name in side_files(delta, shards)}
        for name, digest in inherited_files(delta).items():
            src = have.get(name)
            if src is None:
                raise ChecksumMismatchError(
                    f"inherits {name!r} from its parent, which has no such file",
                    shard=str(delta / layout.INHERITED_FILE),
                )
            got = digests.get(src) or digests.setdefault(src, _sha256(src))
            if got != digest:
                raise ChecksumMismatchError(
                    f"inherits {name!r} with {digest}, the parent's copy {src} has {got}",
                    shard=str(delta / layout.INHERITED_FILE),
                )
            now[name] = src
        have = now
    if dst is not None:
        for name, src in sorted(have.items()):
            _place(src, dst / name)


def inherited_files(delta: Path) -> dict[str, str]:
    """A delta folder's record of inherited side files (name -> "sha256:<hex>"); empty when it
    ships every side file. `CorruptDeltaError` naming the record when it is malformed."""
    return read_inherited(delta).side_files


def _place(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    link_or_copy(src, dst)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def copy_manifests(src: Path, dst: Path) -> None:
    """Copy the manifests, last: a folder with them names every shard it needs."""
    for name in layout.MANIFEST_FILES:
        shutil.copyfile(src / name, dst / name)


@contextmanager
def staging(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder next to `out` that replaces it when the block ends without an
    error, and is removed otherwise: a reader never sees half a snapshot at `out`."""
    if out.exists() and not overwrite:
        raise SnapshotError("output folder already exists", path=str(out))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
