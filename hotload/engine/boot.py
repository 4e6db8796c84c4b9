"""Booting forward: a restarted engine serves what its replica served, not an older snapshot.

The loader keeps a replica that follows by sparse patches as the newest full snapshot
(`WEIGHTS/current`, what the engine boots from) plus the verified deltas after it
(`WEIGHTS/deltas/<identity>`). An engine restarted from `current` alone would answer from that
older snapshot until the loader patched it again (the first soak saw clients go from step 113
back to step 100). So before it reports ready, an engine booted from the loader's `current`
link composes the deltas on the volume that continue its snapshot into one patch
(`prepare_patch`: every chunk's CRC-32 checked) and writes it in, verified against the parent's
and the result's checksums like any patch: it starts serving the newest snapshot the volume
holds on its chain. Until then `/ready` and generation answer 503 naming the work. Anything
that fails there is logged with its cause and the engine serves the snapshot it booted (the
loader then patches or loads it as after any restart).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from hotload.arc.patch import prepare_patch
from hotload.errors import HotloadError
from hotload.snapshot import Snapshot
from hotload_patch.errors import PatchError

if TYPE_CHECKING:  # patching imports torch, which only the 'engine' extra installs
    from hotload.engine.patching import EnginePatches

log = logging.getLogger("hotload.engine.boot")

#: The loader's names in its weights folder (`hotload_sidecar.weights`): the link the engine
#: boots from, and the folder of the deltas kept after it.
CURRENT = "current"
DELTAS = "deltas"


def volume_deltas(model_path: Path) -> Path | None:
    """The loader's deltas folder when the engine boots from the loader's `current` link (the
    operator's pods, a local fleet), else None: a plain snapshot folder boots as it is."""
    if model_path.name != CURRENT or not model_path.is_symlink():
        return None
    folder = model_path.parent / DELTAS
    return folder if folder.is_dir() else None


def chain_after(deltas: Path, identity: str) -> list[Path]:
    """The delta folders in `deltas` that continue `identity`, in order (each one's parent the
    folder before it); stops where none or several continue it (the loader decides there)."""
    following: dict[str, list[Path]] = {}
    for folder in sorted(deltas.iterdir()):
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        try:
            parent = Snapshot(folder).parent
        except (HotloadError, OSError) as err:
            log.warning("ignoring %s on the volume: %s", folder, err)
            continue
        if parent is not None:
            following.setdefault(parent, []).append(folder)
    chain: list[Path] = []
    at, seen = identity, {identity}
    while len(following.get(at, [])) == 1:
        folder = following[at][0]
        if folder.name in seen:
            break
        chain.append(folder)
        at = folder.name
        seen.add(at)
    return chain


def boot_forward(
    model_path: Path, identity: str, patches: EnginePatches, *, threads: int | None = None
) -> str | None:
    """Write the deltas the volume holds after `identity` (the snapshot just loaded from
    `model_path`) into the engine's weights; return the identity served then, or None when
    there is nothing to apply or it failed (logged: the booted snapshot serves). Blocking."""
    deltas = volume_deltas(model_path)
    chain = chain_after(deltas, identity) if deltas is not None else []
    if not chain:
        return None
    target = chain[-1].name
    with tempfile.TemporaryDirectory(prefix="hotload-boot-") as tmp:
        try:
            stats = prepare_patch(
                model_path,
                chain,
                Path(tmp) / "boot.patch",
                identity=target,
                expected_parent=identity,
                threads=threads,
            )
            patches.stage(str(stats.path), identity=target, parent=identity).apply()
        except (HotloadError, PatchError, OSError) as err:
            log.warning(
                "serving %s as booted: the %d delta(s) after it on the volume (up to %s) could "
                "not be applied: %s",
                identity,
                len(chain),
                target,
                err,
            )
            return None
    log.info(
        "booted %s and applied the %d delta(s) after it on the volume: serving %s, what this "
        "replica served before the restart",
        identity,
        len(chain),
        target,
    )
    return target
