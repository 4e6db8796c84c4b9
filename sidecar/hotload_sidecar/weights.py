"""The weights folder on the volume the loader shares with the engine.

```
<root>/current                  -> snapshots/<identity>   (symlink, swapped atomically)
<root>/snapshots/<identity>/    complete, verified full snapshots (never modified once here)
<root>/deltas/<identity>/       verified deltas (as published) of the snapshot the engine serves:
                                with the newest snapshot below them, the volume's copy of it
<root>/.hotload/staging/        snapshots being rebuilt (renamed into snapshots/ when verified)
<root>/.hotload/downloads/      deltas and full snapshots being fetched
<root>/.hotload/early/          the same two, for hinted snapshots not yet admitted (early fetch)
<root>/.hotload/python/         code the engine imports (vLLM's extension, `extension.py`): kept
<root>/adapters/<identity>/     verified LoRA adapters, one weight file each (what engines load)
```

A folder appears under `snapshots/` only by an atomic rename after every tensor verified (under
`deltas/` after its manifests and every chunk's CRC-32 did), so a loader restarted at any
moment finds either nothing or a whole snapshot (or delta) there, and leftovers in
`.hotload/`'s work folders are simply removed (never `.hotload/python/`: the engine imports from
it, and `extension.py` keeps it whole). The engine boots from `current`; the loader hot-loads
the stable `snapshots/<identity>` path.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from hotload.api.names import ENGINE_PYTHONPATH_DIR
from hotload.errors import HotloadError
from hotload.fileio import fsync_dir
from hotload.ledger import LedgerEntry
from hotload.snapshot import validate_identity

log = logging.getLogger("hotload_sidecar.weights")

CURRENT = "current"
SNAPSHOTS = "snapshots"
DELTAS = "deltas"
ADAPTERS = "adapters"
WORK = ".hotload"


class WeightsFolder:
    """The loader's view of its weights folder: verified snapshots, staging, the current link."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.snapshots = self.root / SNAPSHOTS
        self.deltas = self.root / DELTAS
        self.work = self.root / WORK
        self.staging_root = self.work / "staging"
        self.downloads_root = self.work / "downloads"
        #: Early fetch works apart (`early/downloads`, `early/staging`), so an update building
        #: the same identity the normal way never shares a folder with a background rebuild.
        self.early_root = self.work / "early"
        #: The engine's importable code (`extension.py`): not a work folder, so `prepare` keeps
        #: it, and not under `snapshots/`, so it is never taken for a snapshot.
        self.python_root = self.root / ENGINE_PYTHONPATH_DIR
        self.current_link = self.root / CURRENT
        self.adapters = self.root / ADAPTERS
        #: The serving floor, kept across restarts (`serving_gate.py`).
        self.floor_path = self.work / "floor.json"

    def prepare(self) -> None:
        """Create the layout and drop whatever an interrupted run left half-done."""
        for folder in (
            self.snapshots,
            self.deltas,
            self.staging_root,
            self.downloads_root,
            self.early_root,
            self.adapters,
        ):
            folder.mkdir(parents=True, exist_ok=True)
        for leftover in (self.staging_root, self.downloads_root, self.early_root):
            for child in leftover.iterdir():
                remove_tree(child)
        for folder in (self.snapshots, self.deltas):
            for child in folder.iterdir():
                # Only complete folders are renamed here; anything else is not ours to serve.
                if not child.is_dir() or child.name.startswith("."):
                    log.warning("removing unexpected %s from the weights folder", child)
                    remove_tree(child)
        link_tmp = self.root / f".{CURRENT}.tmp"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()

    def path(self, identity: str) -> Path:
        """Where the verified snapshot `identity` lives (whether or not it is there)."""
        return self.snapshots / validate_identity(identity)

    def has(self, identity: str) -> bool:
        """Whether a verified copy of `identity` is on disk."""
        return self.path(identity).is_dir()

    def delta_path(self, identity: str) -> Path:
        """Where the verified delta `identity` lives (whether or not it is there)."""
        return self.deltas / validate_identity(identity)

    def has_delta(self, identity: str) -> bool:
        """Whether a verified copy of the delta `identity` is on disk."""
        return self.delta_path(identity).is_dir()

    def local_deltas(self) -> set[str]:
        """Identities of the verified deltas on disk."""
        if not self.deltas.is_dir():
            return set()
        return {p.name for p in self.deltas.iterdir() if p.is_dir()}

    def commit_delta(self, folder: Path, identity: str) -> Path:
        """Move a checked delta folder into `deltas/` (atomic rename, then fsync); an existing
        copy is kept."""
        final = self.delta_path(identity)
        if final.exists():
            remove_tree(folder)
            return final
        os.replace(folder, final)
        fsync_dir(self.deltas)
        return final

    def drop_delta(self, identity: str) -> None:
        """Remove a delta from the volume (compacted into a snapshot, or found bad)."""
        remove_tree(self.delta_path(identity))

    def reach(self, chain: list[LedgerEntry]) -> tuple[int, int] | None:
        """Where the volume stands on `chain` (a ledger chain, from the full snapshot it
        starts at): (i, j) when chain[i] is the newest entry of it held as a snapshot and
        chain[i+1 .. j] are deltas held after it (j >= i); None when it holds no snapshot of it.
        The volume then holds chain[j], as a snapshot plus deltas."""
        i = max((k for k, e in enumerate(chain) if self.has(e.identity)), default=-1)
        if i < 0:
            return None
        j = i
        while (
            j + 1 < len(chain)
            and chain[j + 1].kind == "incremental"
            and self.has_delta(chain[j + 1].identity)
        ):
            j += 1
        return i, j

    def local(self) -> set[str]:
        """Identities of the verified snapshots on disk."""
        if not self.snapshots.is_dir():
            return set()
        return {p.name for p in self.snapshots.iterdir() if p.is_dir()}

    def staging(self, identity: str) -> Path:
        """A fresh, empty staging folder name for `identity` (not created)."""
        path = self.staging_root / validate_identity(identity)
        remove_tree(path)
        return path

    def download(self, identity: str) -> Path:
        """A fresh, empty download folder for `identity` (created)."""
        path = self.downloads_root / validate_identity(identity)
        remove_tree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, staged: Path, identity: str, *, replace: bool = False) -> Path:
        """Move a verified staged snapshot into `snapshots/` (atomic rename, then fsync).

        An existing copy is kept (identities are immutable) unless `replace`, used when that
        copy failed verification: it is moved aside first, so the engine's open files stay
        valid while `current` already resolves to the new folder.
        """
        final = self.path(identity)
        if final.exists():
            if not replace:
                remove_tree(staged)
                return final
            trash = self.work / f"trash-{identity}"
            remove_tree(trash)
            os.replace(final, trash)
            os.replace(staged, final)
            remove_tree(trash)
        else:
            os.replace(staged, final)
        fsync_dir(self.snapshots)
        return final

    def discard(self, identity: str) -> None:
        """Remove a verified copy that turned out bad (e.g. bit rot found by a later decode)."""
        if self.current() == identity:
            # The engine may still read it (it booted from `current`); leave it and only stop
            # trusting it as a parent: the caller rebuilds from a full snapshot instead.
            return
        remove_tree(self.path(identity))

    def adapter_path(self, identity: str) -> Path:
        """Where the verified LoRA adapter `identity` lives (whether or not it is there)."""
        return self.adapters / validate_identity(identity)

    def local_adapters(self) -> set[str]:
        """Identities of the verified adapters on disk."""
        if not self.adapters.is_dir():
            return set()
        return {p.name for p in self.adapters.iterdir() if p.is_dir()}

    def commit_adapter(self, staged: Path, identity: str) -> Path:
        """Move a verified adapter folder into `adapters/` (atomic rename; an existing copy of the
        immutable identity is kept)."""
        final = self.adapter_path(identity)
        if final.exists():
            remove_tree(staged)
            return final
        os.replace(staged, final)
        fsync_dir(self.adapters)
        return final

    def current(self) -> str | None:
        """The identity `current` points at, or None."""
        try:
            target = os.readlink(self.current_link)
        except OSError:
            return None
        name = Path(target).name
        return name if (self.snapshots / name).is_dir() else None

    def switch(self, identity: str) -> None:
        """Point `current` at `snapshots/<identity>` atomically (symlink, then rename over)."""
        if not self.has(identity):
            raise HotloadError(f"cannot switch to {identity!r}: it is not in {self.snapshots}")
        tmp = self.root / f".{CURRENT}.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(Path(SNAPSHOTS) / identity, tmp)
        os.replace(tmp, self.current_link)
        fsync_dir(self.root)

    def collect(
        self,
        keep: int,
        order: list[str],
        protect: Iterable[str] = (),
        deltas: Iterable[str] = (),
    ) -> list[str]:
        """Delete verified snapshots beyond the newest `keep` in ledger `order` (oldest first),
        never the ones in `protect` or the one `current` names, and every delta but `deltas`
        (the chain the engine serves, after the snapshot it starts from); return what was
        deleted."""
        wanted = set(deltas)
        for identity in sorted(self.local_deltas() - wanted):
            self.drop_delta(identity)
        keep_set = set(protect)
        if (cur := self.current()) is not None:
            keep_set.add(cur)
        local = self.local()
        ranked = [i for i in order if i in local]
        keep_set.update(ranked[-keep:] if keep > 0 else [])
        # Snapshots the ledger no longer names (compacted away, or a reset) go first.
        doomed = sorted(local - keep_set)
        for identity in doomed:
            remove_tree(self.path(identity))
        if doomed:
            log.info("garbage-collected %d snapshot(s): %s", len(doomed), ", ".join(doomed))
        return doomed


def written_bytes(path: Path) -> int:
    """Bytes of the files under `path` that were written for it: files hard-linked from
    elsewhere (the unchanged shards of a rebuild) share their bytes and are not counted."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if st.st_nlink == 1:
                total += st.st_size
    return total


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of folder `src` into folder `dst` (copied where links fail)."""
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copyfile(path, target)


def move_folder(src: Path, dest: Path) -> None:
    """Move folder `src` to `dest` on the same volume (one rename), replacing what is there."""
    remove_tree(dest)
    os.replace(src, dest)


def remove_tree(path: Path) -> None:
    """Remove a file, link or folder if it exists."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
