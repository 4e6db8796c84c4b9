"""What a weight-loading engine can take: a full snapshot with the tensors of the one it holds.

`check_loadable` runs before an engine is paused, so that a folder an in-place reload cannot
take is refused while the old weights serve.
"""

from __future__ import annotations

from pathlib import Path

from hotload.errors import SnapshotError


def weight_specs(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, dtype) of a model folder, from its spec manifest or shard headers."""
    from hotload.snapshot import SPEC_FILE
    from hotload.snapshot.manifests import parse_tensor_map
    from hotload.snapshot.safetensors_io import read_header

    folder = Path(path)
    if (folder / SPEC_FILE).is_file():
        return {n: (s.shape, s.dtype) for n, s in parse_tensor_map(folder / SPEC_FILE).items()}
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors, _, _ = read_header(shard)
        for name, info in tensors.items():
            specs[name] = (tuple(info.shape), info.dtype)
    return specs


def check_loadable(path: str, previous: str | None) -> None:
    """Refuse, before the engine sees it, a folder an in-place reload cannot take.

    The folder must be a full snapshot (config, weights; not an arc_v2 delta or a LoRA adapter)
    and, when the folder the engine loaded last is known and readable, have the same tensor
    names, shapes and dtypes: vLLM's in-place reload leaves a half-loaded model on a mismatch.
    Raises `SnapshotError` naming the file and tensor.
    """
    from hotload.snapshot import CONFIG_FILE, INDEX_FILE, Snapshot

    folder = Path(path)
    if not folder.is_dir():
        raise SnapshotError("snapshot folder does not exist (or is not visible here)", path=path)
    if not (folder / CONFIG_FILE).is_file():
        raise SnapshotError("no config.json: not a model folder", path=path)
    if (folder / INDEX_FILE).is_file():
        kind = Snapshot(folder).kind
        if kind != "full":
            raise SnapshotError(
                f"is a {kind} snapshot; engines load full snapshots (reconstruct it first)",
                path=path,
            )
    elif not any(folder.glob("*.safetensors")):
        raise SnapshotError("no safetensors weights", path=path)
    if previous is None or not Path(previous).is_dir():
        return
    _same_quantization(folder, Path(previous))
    new, old = weight_specs(folder), weight_specs(previous)
    missing, extra = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    if missing:
        raise SnapshotError(
            f"{len(missing)} tensor(s) of the loaded model are missing, e.g. {missing[0]!r}",
            path=path,
        )
    if extra:
        raise SnapshotError(
            f"{len(extra)} tensor(s) the loaded model does not have, e.g. {extra[0]!r}",
            path=path,
        )
    for name in sorted(new):
        if new[name] != old[name]:
            raise SnapshotError(
                f"shape/dtype {new[name]} differs from the loaded model's {old[name]}",
                path=path,
                field=name,
            )


def _quantization(folder: Path) -> str:
    """How a model folder's weights are stored, in words: its `quantization_config`'s method
    and recipe, or "unquantized"."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "unknown"
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        return "unquantized"
    recipe = qc.get("hotload_recipe")
    return f"{qc.get('quant_method')}" + (f" (recipe {recipe!r})" if recipe else "")


def _same_quantization(folder: Path, previous: Path) -> None:
    """Refuse a folder whose quantization differs from the loaded one's: an engine builds its
    layers for one quantization at start, and an in-place reload cannot change it."""
    new, old = _quantization(folder), _quantization(previous)
    if "unknown" not in (new, old) and new != old:
        raise SnapshotError(
            f"is {new} and the engine runs {old} weights: an engine cannot change quantization "
            "in a hot reload. Restart the engine on this snapshot, or publish with the "
            "quantization the fleet started with (docs/fp8.md)",
            path=str(folder / "config.json"),
            field="quantization_config",
        )
