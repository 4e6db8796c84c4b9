"""Put the engine side of sparse hot loads (`hotload_patch`) where the engine can import it.

vLLM runs from its own image, where hotload is not installed. The operator starts it with
`--worker-extension-cls hotload_patch.vllm.HotloadWorkerExtension` and PYTHONPATH set to
`WEIGHTS/.hotload/python` (`hotload.api.names.ENGINE_PYTHONPATH_DIR`); the loader, which owns
the weights volume (the engine mounts it read-only), copies the `hotload_patch` package it runs
itself there at start-up, before its startup probe can pass, so the engine (which the kubelet
starts only after that probe) always imports the copy that matches the loader driving it:

```
WEIGHTS/.hotload/python/hotload_patch/   the package's `*.py` files and `py.typed`, nothing else
```

The copy is made in a temporary folder beside it and renamed into place; a copy already there
is replaced only when its bytes differ (a volume that outlives the pod, a `persistentVolumeClaim`,
keeps an older loader's copy), so a restarted loader with the same image writes nothing.
`WeightsFolder.prepare` never touches the folder, and it is not under `snapshots/`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hotload_patch
from hotload.errors import HotloadError
from hotload.fileio import fsync_dir
from hotload_sidecar.weights import WeightsFolder, remove_tree

log = logging.getLogger("hotload_sidecar.extension")

PACKAGE = hotload_patch.__name__
#: Engine kinds whose image lacks hotload and which import `hotload_patch` from the volume.
#: The reference engine is hotload (its image has the package); SGLang has no extension.
ENGINES_WITH_EXTENSION = frozenset({"vllm"})

_TMP_PREFIX = f".{PACKAGE}.tmp-"
_OLD_PREFIX = f".{PACKAGE}.old-"
# Readable by the engine whatever user it runs as (vLLM's images run as root, hardened ones as
# another user than the loader's); never writable by it.
_FILE_MODE = 0o644
_DIR_MODE = 0o755


class ExtensionCopyError(HotloadError):
    """The engine's extension could not be put on the weights volume; names the path."""


@dataclass(frozen=True)
class ExtensionCopy:
    """Where the engine's copy of `hotload_patch` is, its content digest, and whether this
    call wrote it (False: an identical copy was already there)."""

    path: Path
    digest: str
    copied: bool


def needs_extension(engine_kind: str) -> bool:
    """Whether the loader must copy `hotload_patch` onto the volume for `engine_kind`."""
    return engine_kind in ENGINES_WITH_EXTENSION


def package_source() -> Path:
    """The folder of the `hotload_patch` package this loader imports."""
    return Path(hotload_patch.__file__).resolve().parent


def package_files(folder: Path) -> list[Path]:
    """The files of the package in `folder` that the engine needs, relative and sorted: every
    `*.py` (subpackages included) and `py.typed`; no `__pycache__`, nothing else."""
    return sorted(
        path.relative_to(folder)
        for path in folder.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.relative_to(folder).parts
        and (path.suffix == ".py" or path.name == "py.typed")
    )


def package_digest(folder: Path) -> str:
    """sha256 over the names and bytes of `package_files(folder)`: equal digests, equal copies."""
    digest = hashlib.sha256()
    for rel in package_files(folder):
        data = (folder / rel).read_bytes()
        digest.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def install_engine_extension(
    weights_root: str | os.PathLike[str], *, source: Path | None = None
) -> ExtensionCopy:
    """Copy the `hotload_patch` package (`source`, default: the one imported here) into
    `<weights_root>/.hotload/python/hotload_patch/`, unless a byte-identical copy is there.

    The new copy is written into a temporary folder beside the target, flushed, and renamed
    into place; an older copy is renamed aside first and then deleted (the target is missing
    only between those two renames, and leftovers of an interrupted call are removed by the
    next). Files are made readable by every user, since the engine may run as another one.
    Raise `ExtensionCopyError` naming the path when the volume refuses (read-only, not ours,
    full).
    """
    python_root = WeightsFolder(weights_root).python_root
    target = python_root / PACKAGE
    source = package_source() if source is None else Path(source)
    try:
        files = package_files(source)
        if not files:
            raise ExtensionCopyError(f"no {PACKAGE} package to copy in {source}")
        digest = package_digest(source)
    except OSError as err:
        raise ExtensionCopyError(f"cannot read the {PACKAGE} package in {source}: {err}") from err
    try:
        if target.is_dir() and not target.is_symlink() and package_digest(target) == digest:
            return ExtensionCopy(target, digest, copied=False)
        python_root.mkdir(parents=True, exist_ok=True)
        for leftover in python_root.iterdir():
            if leftover.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
                remove_tree(leftover)
        _replace(source, files, target)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(target) else ""
        raise ExtensionCopyError(
            f"cannot copy the engine extension {PACKAGE} to {target}: "
            f"{err.strerror or err}{where}; the loader must be able to write to the weights volume "
            "(the engine imports the package from there)"
        ) from err
    return ExtensionCopy(target, digest, copied=True)


def _replace(source: Path, files: list[Path], target: Path) -> None:
    staged = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
    old = target.parent / f"{_OLD_PREFIX}{staged.name.removeprefix(_TMP_PREFIX)}"
    try:
        for rel in files:
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            _write(staged / rel, (source / rel).read_bytes())
        folders = [p for p in staged.rglob("*") if p.is_dir()]
        for folder in [*folders, staged]:
            os.chmod(folder, _DIR_MODE)  # mkdtemp's folder is private (0o700)
            fsync_dir(folder)
        if target.exists() or target.is_symlink():
            os.replace(target, old)
        try:
            os.replace(staged, target)
        except OSError:
            if old.exists() and not target.exists():
                os.replace(old, target)  # put the older copy back rather than none
            raise
        fsync_dir(target.parent)
    finally:
        remove_tree(staged)
    remove_tree(old)


def _write(path: Path, data: bytes) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(path, _FILE_MODE)


async def prepare_engine_extension(weights_root: Path, engine_kind: str) -> ExtensionCopy | None:
    """At start-up: copy `hotload_patch` for an engine that imports it from the volume (vLLM),
    in a thread, and log what was done; None for other engines (nothing is written)."""
    if not needs_extension(engine_kind):
        return None
    done = await asyncio.to_thread(install_engine_extension, weights_root)
    log.info(
        "%s the %s engine's extension %s (sha256 %s) at %s",
        "copied" if done.copied else "kept the identical copy of",
        engine_kind,
        PACKAGE,
        done.digest[:12],
        done.path,
    )
    return done
