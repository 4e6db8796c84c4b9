"""The file work of the codec: a staging folder that appears whole, hard links, and ranged
copies between files."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hotload.errors import SnapshotError
from hotload.snapshot import layout


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


def copy_side_files(src: Path, dst: Path, shards: list[str]) -> None:
    """Link or copy what is neither a shard nor a manifest (config, tokenizer files) to dst."""
    skip = set(shards) | set(layout.MANIFEST_FILES)
    for path in sorted(src.rglob("*")):
        name = str(path.relative_to(src))
        if path.is_file() and name not in skip and not path.name.startswith("."):
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(path, dst / name)


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
