"""Validate snapshots, parent -> child transitions and LoRA adapters, naming file and field.

Validators collect every problem they find and raise one `SnapshotValidationError` listing them
all, so a trainer fixes a bad snapshot in one round trip.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hotload.arc.container import ArcHeader, is_arc_file
from hotload.arc.container import read_header as read_arc_header
from hotload.errors import (
    HotloadError,
    InvalidIdentityError,
    SnapshotError,
    SnapshotValidationError,
    ValidationProblem,
)
from hotload.snapshot import layout
from hotload.snapshot.dtypes import CHANGE_FIX
from hotload.snapshot.fp8 import fp8_problems
from hotload.snapshot.lora import (
    AdapterConfig,
    adapter_weight_files,
    lora_pairs,
)
from hotload.snapshot.manifests import TensorSpec, load_json
from hotload.snapshot.reader import Snapshot
from hotload.snapshot.safetensors_io import TensorInfo, parse_target_header, read_header
from hotload.snapshot.writer import META_CHECKSUMS

# Fields that legitimately differ between a snapshot's config.json and the deployment's base.
DEFAULT_IGNORED_CONFIG_FIELDS = frozenset(
    {"_name_or_path", "transformers_version", "quantization_config", "torch_dtype", "dtype"}
)


class _Problems:
    def __init__(self) -> None:
        self.items: list[ValidationProblem] = []

    def add(self, path: Path | str, field: str | None, message: str) -> None:
        self.items.append(ValidationProblem(str(path), field, message))

    def raise_if_any(self) -> None:
        if self.items:
            raise SnapshotValidationError(self.items)


def _shard_tensors(path: Path, delta: ArcHeader | None) -> dict[str, TensorSpec]:
    """Tensors stored in a shard: full (safetensors), or the target header of a delta shard."""
    infos: dict[str, TensorInfo]
    if delta is not None:
        infos = parse_target_header(delta.fields.get("target_header"), path.name)[1]
    else:
        infos, _, _ = read_header(path)
    return {n: TensorSpec(i.shape, i.dtype) for n, i in infos.items()}


def check_config(
    config: Mapping[str, Any],
    base_config: Mapping[str, Any],
    *,
    path: str = layout.CONFIG_FILE,
    ignore_fields: Iterable[str] = (),
) -> list[ValidationProblem]:
    """Compare a config with the deployment's base config; one problem per differing field."""
    ignored = DEFAULT_IGNORED_CONFIG_FIELDS | set(ignore_fields)
    problems = []
    for key in sorted((set(config) | set(base_config)) - ignored):
        if key not in config:
            problems.append(ValidationProblem(path, key, "missing (the base config sets it)"))
        elif key not in base_config:
            problems.append(ValidationProblem(path, key, "not in the base config"))
        elif config[key] != base_config[key]:
            problems.append(
                ValidationProblem(
                    path,
                    key,
                    f"{json.dumps(config[key])} differs from the base config's "
                    f"{json.dumps(base_config[key])}",
                )
            )
    return problems


def validate_snapshot(
    path: str | Path,
    *,
    identity: str | None = None,
    base_config: Mapping[str, Any] | None = None,
    ignore_config_fields: Iterable[str] = (),
    arc_headers: dict[str, ArcHeader] | None = None,
) -> Snapshot:
    """Check a full or incremental snapshot folder's structure; return it opened, or raise.

    Checks required files, that `weight_map`, `tensor_map` and the shards agree, that no shard
    mixes layers, the identity, and (with `base_config`) config.json against the base.
    `arc_headers` receives each delta shard's header read on the way (by shard name), so that
    a caller uses them rather than reading every header again; a shard's header already there
    (read by the caller) is used, not read.
    """
    root = Path(path)
    problems = _Problems()
    if identity is not None:
        try:
            layout.validate_identity(identity)
        except InvalidIdentityError as exc:
            problems.add(root, "identity", exc.message)
    if not root.is_dir():
        problems.add(root, None, "snapshot folder does not exist")
        problems.raise_if_any()
    if (root / layout.ADAPTER_CONFIG_FILE).exists():
        try:
            adapter = validate_adapter(root)
        except SnapshotValidationError as exc:
            problems.items += exc.problems
        problems.raise_if_any()
        return adapter
    missing = [
        n
        for n in (layout.CONFIG_FILE, layout.INDEX_FILE, layout.SPEC_FILE)
        if not (root / n).is_file()
    ]
    for name in missing:
        problems.add(root / name, None, "required file is missing")
    if missing:  # an identity problem alone does not stop the checks below
        problems.raise_if_any()
    try:
        snap = Snapshot(root)
    except SnapshotError as exc:
        problems.add(exc.path or root, exc.field, exc.message)
        problems.raise_if_any()
        raise
    index_path = root / layout.INDEX_FILE
    spec_path = root / layout.SPEC_FILE
    for name in sorted(set(snap.weight_map) - set(snap.tensor_map)):
        problems.add(spec_path, f"tensor_map.{name}", "missing (weight_map names this tensor)")
    for name in sorted(set(snap.tensor_map) - set(snap.weight_map)):
        problems.add(index_path, f"weight_map.{name}", "missing (tensor_map names this tensor)")
    shards = snap.shard_files
    totals = set()
    numbers = []
    for shard in shards:
        m = layout.SHARD_RE.fullmatch(shard)
        if not m:
            problems.add(
                index_path,
                "weight_map",
                f"shard file {shard!r} is not named model-XXXXX-of-YYYYY.safetensors",
            )
            continue
        numbers.append(int(m.group(1)))
        totals.add(int(m.group(2)))
    if numbers and (totals != {len(shards)} or sorted(numbers) != list(range(1, len(shards) + 1))):
        problems.add(
            index_path, "weight_map", f"shard names do not count 1..{len(shards)} of {len(shards)}"
        )
    on_disk = {p.name for p in root.glob("model-*.safetensors")}
    for stray in sorted(on_disk - set(shards)):
        problems.add(root / stray, None, "shard file is not named in weight_map")
    try:
        config = snap.config
    except SnapshotError as exc:
        problems.add(exc.path or root, exc.field, exc.message)
        config = None
    if config is not None:
        problems.items += fp8_problems(
            config,
            snap.tensor_map,
            config_path=str(root / layout.CONFIG_FILE),
            spec_path=str(spec_path),
        )
    if config is not None and base_config is not None:
        problems.items += check_config(
            config,
            base_config,
            path=str(root / layout.CONFIG_FILE),
            ignore_fields=ignore_config_fields,
        )
    kinds = set()
    parents: dict[str, str | None] = {}
    untouched = _untouched(snap, shards, problems)
    for shard in shards:
        shard_path = root / shard
        if shard in untouched:
            if shard_path.exists():
                problems.add(
                    shard_path,
                    None,
                    f"is shipped, yet {layout.INHERITED_FILE} leaves it out",
                )
            continue
        if not shard_path.is_file():
            problems.add(shard_path, None, "shard named in weight_map is missing")
            continue
        delta: ArcHeader | None = arc_headers.get(shard) if arc_headers is not None else None
        is_delta = delta is not None or is_arc_file(shard_path)
        kinds.add(is_delta)
        if is_delta and delta is None:
            try:
                delta = read_arc_header(shard_path)
            except HotloadError as exc:
                problems.add(shard_path, None, f"unreadable: {exc}")
                continue
            if arc_headers is not None:
                arc_headers[shard] = delta
        if delta is not None:
            parents[shard] = delta.parent
        try:
            stored = _shard_tensors(shard_path, delta)
        except HotloadError as exc:
            problems.add(shard_path, None, f"unreadable: {exc}")
            continue
        expected = set(snap.tensors_of(shard))
        for name in sorted(expected - set(stored)):
            problems.add(shard_path, name, "missing from the shard (weight_map puts it here)")
        for name in sorted(set(stored) - expected):
            problems.add(shard_path, name, "stored in the shard but weight_map puts it elsewhere")
        for name in sorted(expected & set(stored)):
            spec = snap.tensor_map.get(name)
            if spec is not None and stored[name] != spec:
                problems.add(
                    shard_path,
                    name,
                    f"stored as {stored[name].dtype}{list(stored[name].shape)}, tensor_map says "
                    f"{spec.dtype}{list(spec.shape)}",
                )
        groups = {layout.layer_of(n) for n in stored}
        if len(groups) > 1:
            labels = sorted(g or "<non-layer>" for g in groups)
            problems.add(
                shard_path, None, f"shard mixes weights of several layers: {', '.join(labels)}"
            )
    if len(kinds) > 1:
        problems.add(root, None, "some shards are arc_v2 deltas and others full tensors")
    if untouched and kinds != {True}:
        problems.add(
            root / layout.INHERITED_FILE,
            "untouched_shards",
            "a delta that records untouched shards ships at least one arc_v2 delta shard "
            "(its header names the parent)",
        )
    if len(set(parents.values())) > 1:
        listed = ", ".join(f"{s}: {p!r}" for s, p in sorted(parents.items()))
        problems.add(root, "parent", f"delta shards name different parents ({listed})")
    problems.raise_if_any()
    return snap


def _untouched(snap: Snapshot, shards: list[str], problems: _Problems) -> set[str]:
    """The shards the folder's record says the step left alone (not shipped); one the weight
    map does not name is a problem, and a malformed record a `CorruptDeltaError`, as a
    corrupted delta shard is (a loader fetches it again)."""
    record = snap.path / layout.INHERITED_FILE
    untouched = set(snap.untouched_shards)  # a malformed record raises `CorruptDeltaError`
    for name in sorted(untouched - set(shards)):
        problems.add(record, f"untouched_shards.{name}", "is not a shard of the weight map")
    return untouched & set(shards)


def validate_transition(parent: str | Path | Snapshot, child: str | Path | Snapshot) -> None:
    """Check that `child` can follow `parent`: same weight_map, shard count, tensor sets, dtypes."""
    p = parent if isinstance(parent, Snapshot) else Snapshot(parent)
    c = child if isinstance(child, Snapshot) else Snapshot(child)
    problems = _Problems()
    index = c.path / layout.INDEX_FILE
    if len(p.shard_files) != len(c.shard_files):
        problems.add(
            index,
            "weight_map",
            f"{len(c.shard_files)} shard files, the parent has {len(p.shard_files)}",
        )
    for name in sorted(set(p.weight_map) | set(c.weight_map)):
        pf, cf = p.weight_map.get(name), c.weight_map.get(name)
        if pf is None:
            problems.add(index, f"weight_map.{name}", "tensor is not in the parent")
        elif cf is None:
            problems.add(index, f"weight_map.{name}", "tensor of the parent is missing")
        elif pf != cf:
            problems.add(index, f"weight_map.{name}", f"moved from {pf} to {cf}")
    spec = c.path / layout.SPEC_FILE
    recipes = [_quantization(s) for s in (p, c)]
    if recipes[0] != recipes[1]:
        problems.add(
            c.path / layout.CONFIG_FILE,
            "quantization_config",
            f"changed from {json.dumps(recipes[0])} to {json.dumps(recipes[1])}: a delta keeps "
            "its parent's quantization recipe. Publish with the parent's recipe (the same "
            "Publisher(fp8=...) or `hotload snapshot build --fp8`), or publish a full snapshot to "
            "change it (publish(..., full=True); `hotload publish --full`)",
        )
    for name in sorted(set(p.tensor_map) & set(c.tensor_map)):
        ps, cs = p.tensor_map[name], c.tensor_map[name]
        if ps.dtype != cs.dtype:
            problems.add(
                spec,
                f"tensor_map.{name}.dtype",
                f"changed from {ps.dtype} to {cs.dtype}: a delta cannot change dtypes. "
                + CHANGE_FIX,
            )
        if ps.shape != cs.shape:
            problems.add(
                spec,
                f"tensor_map.{name}.shape",
                f"changed from {list(ps.shape)} to {list(cs.shape)}: a delta cannot change "
                "shapes. " + CHANGE_FIX,
            )
    problems.raise_if_any()


def _quantization(snap: Snapshot) -> Any:
    """A snapshot's `quantization_config` (None: none, or no readable config.json)."""
    try:
        return snap.config.get("quantization_config")
    except SnapshotError:
        return None


def validate_adapter(path: str | Path, *, base_model: str | None = None) -> Snapshot:
    """Check a PEFT LoRA adapter folder (adapter_config.json plus adapter weights); return it."""
    root = Path(path)
    problems = _Problems()
    cfg_path = root / layout.ADAPTER_CONFIG_FILE
    try:
        cfg = load_json(cfg_path)
    except SnapshotError as exc:
        problems.add(cfg_path, None, exc.message)
        problems.raise_if_any()
        raise
    if not isinstance(cfg, dict):
        problems.add(cfg_path, None, "must be a JSON object")
        problems.raise_if_any()
    for key in ("peft_type", "base_model_name_or_path", "r", "target_modules"):
        if key not in cfg:
            problems.add(cfg_path, key, "required field is missing")
    if "peft_type" in cfg and cfg["peft_type"] != "LORA":
        problems.add(cfg_path, "peft_type", f"{cfg['peft_type']!r} is not LORA")
    if "r" in cfg and not (
        isinstance(cfg["r"], int) and not isinstance(cfg["r"], bool) and cfg["r"] > 0
    ):
        problems.add(cfg_path, "r", f"must be a positive integer, got {cfg['r']!r}")
    if base_model is not None and cfg.get("base_model_name_or_path") != base_model:
        problems.add(
            cfg_path,
            "base_model_name_or_path",
            f"{cfg.get('base_model_name_or_path')!r} is not the deployment's base model "
            f"{base_model!r}",
        )
    if not problems.items:
        try:
            AdapterConfig.parse(cfg, str(cfg_path))
        except SnapshotError as exc:
            problems.add(cfg_path, exc.field, exc.message)
    weights = adapter_weight_files(root) if root.is_dir() else []
    if not weights:
        problems.add(root / layout.ADAPTER_WEIGHTS_FILE, None, "adapter weights are missing")
    headers: dict[str, Any] = {}
    for w in weights:
        if is_arc_file(w):
            problems.add(w, None, "adapters are complete snapshots; arc_v2 deltas are not accepted")
            continue
        try:
            tensors, metadata, _ = read_header(w)
        except SnapshotError as exc:
            problems.add(w, None, exc.message)
            continue
        if not tensors:
            problems.add(w, None, "holds no tensors")
        if META_CHECKSUMS not in metadata:
            problems.add(
                w,
                META_CHECKSUMS,
                "no per-tensor checksums: publish adapters with hotload (Publisher.publish_adapter "
                "or hotload publish), which adds them",
            )
        for name, info in tensors.items():
            if "lora_" not in name:
                problems.add(w, name, "is not a LoRA weight (expected lora_A/lora_B)")
            elif name in headers:
                problems.add(w, name, "appears in two weight files")
            else:
                headers[name] = (w, info)
    if headers and not problems.items:
        try:
            lora_pairs({n: info for n, (_, info) in headers.items()}, str(root))
        except SnapshotError as exc:
            owner = next((w for n, (w, _) in headers.items() if exc.field and exc.field in n), root)
            problems.add(owner, exc.field, exc.message)
    problems.raise_if_any()
    return Snapshot(root)
