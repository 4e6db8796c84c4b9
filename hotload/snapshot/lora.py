"""LoRA adapter snapshots: the PEFT layout, checksummed weights, their digest, engine copies.

An adapter snapshot is a folder with `adapter_config.json` and `adapter_model.safetensors` (or
sharded `adapter_model-XXXXX-of-YYYYY.safetensors`). Adapters are small and complete, so they
never chain: each one is published whole. hotload adds what PEFT leaves out so a replica never
loads bytes it did not verify:

- every weight file carries a per-tensor adler32 in its safetensors metadata (the same keys
  as a full shard), added by `add_checksums` when a trainer publishes a plain PEFT folder;
- the ledger entry's digest (`adapter_digest`) covers `adapter_config.json` and every weight
  file's header, so it pins the checksums, and the checksums pin the data. An operator can
  compute it from headers alone; a loader recomputes it and `verify_adapter` checks the data.

`merge_adapter` writes the single-file folder every engine reads (vLLM reads only
`adapter_model.safetensors`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from hotload.arc.checksum import adler32, format_checksum
from hotload.errors import ChecksumMismatchError, SnapshotError
from hotload.snapshot import layout
from hotload.snapshot.safetensors_io import RawTensor, SafetensorsFile, read_header
from hotload.snapshot.writer import META_CHECKSUMS, to_raw, write_shard_file

#: dtypes an adapter's LoRA factors may have.
ADAPTER_DTYPES = ("F32", "F16", "BF16")
#: PEFT prefixes every adapter tensor name with this; the rest is the target module's path.
PEFT_PREFIX = "base_model.model."


class Shaped(Protocol):
    """A tensor's header: a safetensors dtype and a shape (`RawTensor`, `TensorInfo`)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


T = TypeVar("T", bound=Shaped)


@dataclass(frozen=True)
class AdapterConfig:
    """What an engine needs from `adapter_config.json`."""

    base_model: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """The factor PEFT applies to `B @ A`: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def parse(cls, doc: object, where: str) -> AdapterConfig:
        """Read the fields hotload uses; `SnapshotError` naming `where` and the field."""
        if not isinstance(doc, dict):
            raise SnapshotError("must be a JSON object", path=where)
        base = doc.get("base_model_name_or_path")
        if not isinstance(base, str) or not base:
            raise SnapshotError(
                "must name the base model", path=where, field="base_model_name_or_path"
            )
        rank = doc.get("r")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise SnapshotError(f"must be a positive integer, got {rank!r}", path=where, field="r")
        alpha = doc.get("lora_alpha", rank)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
            raise SnapshotError(
                f"must be a positive number, got {alpha!r}", path=where, field="lora_alpha"
            )
        targets = doc.get("target_modules")
        if isinstance(targets, str):
            targets = [targets]
        if (
            not isinstance(targets, list)
            or not targets
            or not all(isinstance(t, str) and t for t in targets)
        ):
            raise SnapshotError(
                f"must be a non-empty list of module names, got {targets!r}",
                path=where,
                field="target_modules",
            )
        return cls(base, rank, float(alpha), tuple(targets), bool(doc.get("use_rslora", False)))


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """Parse `adapter_config.json` of the adapter folder `path`."""
    cfg = Path(path) / layout.ADAPTER_CONFIG_FILE
    try:
        doc = json.loads(cfg.read_bytes())
    except FileNotFoundError:
        raise SnapshotError("required file is missing", path=str(cfg)) from None
    except (ValueError, UnicodeDecodeError) as err:
        raise SnapshotError(f"not valid JSON: {err}", path=str(cfg)) from None
    return AdapterConfig.parse(doc, str(cfg))


def adapter_weight_files(path: str | Path) -> list[Path]:
    """The adapter's weight files (one, or PEFT-style shards), sorted by name."""
    root = Path(path)
    return sorted(
        p for p in root.iterdir() if p.is_file() and layout.ADAPTER_SHARD_RE.fullmatch(p.name)
    )


def _header_bytes(path: Path) -> bytes:
    """The length prefix and JSON header of a safetensors file, exactly as stored."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SnapshotError("file is too short to be safetensors", path=str(path))
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 * 1024 * 1024:
            raise SnapshotError(f"header of {length} bytes is not plausible", path=str(path))
        header = f.read(length)
    if len(header) < length:
        raise SnapshotError("header is truncated", path=str(path))
    return prefix + header


def adapter_digest(path: str | Path) -> str:
    """ "sha256:<hex>" over `adapter_config.json` and every weight file's header (name, bytes).

    Headers suffice because they hold each tensor's checksum: a changed byte of data fails
    `verify_adapter`, a changed checksum changes the digest. Works on a header-only copy."""
    root = Path(path)
    h = hashlib.sha256()
    parts = [(layout.ADAPTER_CONFIG_FILE, (root / layout.ADAPTER_CONFIG_FILE).read_bytes())]
    parts += [(w.name, _header_bytes(w)) for w in adapter_weight_files(root)]
    for name, data in parts:
        h.update(name.encode() + b"\0")
        h.update(data)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def _checksums(f: SafetensorsFile) -> dict[str, str] | None:
    raw = f.metadata.get(META_CHECKSUMS)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        raise SnapshotError(f"metadata {META_CHECKSUMS} is not JSON", path=str(f.path)) from None
    if not isinstance(doc, dict):
        raise SnapshotError(f"metadata {META_CHECKSUMS} is not an object", path=str(f.path))
    return {str(k): str(v) for k, v in doc.items()}


def verify_adapter(path: str | Path) -> int:
    """Check every tensor of the adapter at `path` against its checksum; return how many.

    Raises `ChecksumMismatchError` naming the file and tensor, or `SnapshotError` for a weight
    file without checksums (a plain PEFT folder: publish it with hotload, which adds them)."""
    files = adapter_weight_files(path)
    if not files:
        raise SnapshotError("adapter weights are missing", path=str(Path(path)))
    checked = 0
    for w in files:
        with SafetensorsFile(w) as f:
            sums = _checksums(f)
            if sums is None:
                raise SnapshotError(
                    f"carries no per-tensor checksums ({META_CHECKSUMS}); publish adapters with "
                    "hotload (Publisher.publish_adapter or hotload publish), which adds them",
                    path=str(w),
                )
            for name in f.tensors:
                want = sums.get(name)
                if want is None:
                    raise ChecksumMismatchError("has no checksum", shard=str(w), tensor=name)
                got = format_checksum(adler32(f.raw(name)))
                if got != want:
                    raise ChecksumMismatchError(
                        f"checksum {got} does not match the published {want}",
                        shard=str(w),
                        tensor=name,
                    )
                checked += 1
    return checked


def write_adapter_weights(path: str | Path, tensors: list[tuple[str, RawTensor]]) -> int:
    """Write one adapter weight file with per-tensor checksums (atomically); return its size.
    The same checksummed layout as a full shard."""
    return write_shard_file(path, tensors)


def write_adapter(
    path: str | Path,
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    config: Mapping[str, Any],
) -> Path:
    """Write a checksummed PEFT adapter folder: `adapter_config.json` (from `config`, which
    must name `base_model_name_or_path`, `r` and `target_modules`) and one weight file.

    `tensors` maps PEFT names (`base_model.model.<module>.lora_A.weight`) to torch or numpy
    tensors; names without the PEFT prefix get it. The folder appears whole (temp + rename)."""
    root = Path(path)
    AdapterConfig.parse(dict(config), f"{root}/{layout.ADAPTER_CONFIG_FILE}")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    raws = []
    for name, t in items:
        full = name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name
        raws.append((full, to_raw(full, t)))
    if not raws:
        raise SnapshotError("an adapter needs at least one tensor", path=str(root))
    tmp = root.with_name(root.name + ".tmp-adapter")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_adapter_weights(tmp / layout.ADAPTER_WEIGHTS_FILE, raws)
    # The config is written last: it is the file that commits an adapter snapshot.
    (tmp / layout.ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    if root.exists():
        shutil.rmtree(root)
    os.replace(tmp, root)
    return root


def add_checksums(src: str | Path, dst: str | Path) -> Path:
    """Copy the adapter folder `src` to `dst` with checksums in every weight file (files that
    already carry correct ones are hard-linked, not rewritten); other files are copied."""
    source, out = Path(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    weights = {w.name for w in adapter_weight_files(source)}
    for item in sorted(source.iterdir()):
        if not item.is_file():
            continue
        target = out / item.name
        if target.exists():
            target.unlink()
        if item.name not in weights:
            shutil.copy2(item, target)
            continue
        with SafetensorsFile(item) as f:
            has = _checksums(f) is not None
        if has:
            os.link(item, target)
            continue
        with SafetensorsFile(item) as f:
            tensors = [
                (i.name, RawTensor(i.dtype, i.shape, f.raw(i.name)))
                for i in sorted(f.tensors.values(), key=lambda i: i.begin)
            ]
            write_adapter_weights(target, tensors)
    verify_adapter(out)  # also refuses a folder without weights
    return out


def read_adapter_tensors(path: str | Path) -> dict[str, RawTensor]:
    """Every tensor of the adapter at `path`, copied out of its files (adapters are small)."""
    out: dict[str, RawTensor] = {}
    for w in adapter_weight_files(path):
        with SafetensorsFile(w) as f:
            for info in f.tensors.values():
                if info.name in out:
                    raise SnapshotError("appears in two weight files", path=str(w), field=info.name)
                out[info.name] = RawTensor(info.dtype, info.shape, f.raw(info.name).copy())
    return out


def merge_adapter(src: str | Path, dst: str | Path) -> Path:
    """Write the folder engines load: `adapter_config.json` and one checksummed
    `adapter_model.safetensors` (hard-linked when `src` has a single file)."""
    source, out = Path(src), Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    files = adapter_weight_files(source)
    target = out / layout.ADAPTER_WEIGHTS_FILE
    if target.exists():
        target.unlink()
    if len(files) == 1:
        os.link(files[0], target)
    else:
        tensors = read_adapter_tensors(source)
        write_adapter_weights(target, sorted(tensors.items()))
    shutil.copy2(source / layout.ADAPTER_CONFIG_FILE, out / layout.ADAPTER_CONFIG_FILE)
    return out


def lora_pairs(tensors: Mapping[str, T], where: str) -> dict[str, tuple[T, T]]:
    """Group PEFT tensors into target module path -> (lora_A, lora_B), checking the pairing
    and shapes (A is [r, in], B is [out, r]); `SnapshotError` naming `where` and the tensor."""
    halves: dict[str, dict[str, T]] = {}
    for name, t in tensors.items():
        stem = name.removeprefix(PEFT_PREFIX)
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if stem.endswith(suffix):
                halves.setdefault(stem[: -len(suffix)], {})[part] = t
                break
        else:
            raise SnapshotError(
                "is not a LoRA factor (expected ...lora_A.weight or ...lora_B.weight)",
                path=where,
                field=name,
            )
    pairs: dict[str, tuple[T, T]] = {}
    for module, got in sorted(halves.items()):
        if set(got) != {"A", "B"}:
            missing = "B" if "A" in got else "A"
            raise SnapshotError(f"lora_{missing} is missing", path=where, field=module)
        a, b = got["A"], got["B"]
        for label, t in (("lora_A", a), ("lora_B", b)):
            if t.dtype not in ADAPTER_DTYPES or len(t.shape) != 2:
                raise SnapshotError(
                    f"{label} must be a 2-D {'/'.join(ADAPTER_DTYPES)} tensor, is "
                    f"{t.dtype} {list(t.shape)}",
                    path=where,
                    field=module,
                )
        if a.shape[0] != b.shape[1]:
            raise SnapshotError(
                f"lora_A {list(a.shape)} and lora_B {list(b.shape)} disagree on the rank",
                path=where,
                field=module,
            )
        pairs[module] = (a, b)
    return pairs


def check_adapter_fits(path: str | Path, base_shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse (`SnapshotError` naming the tensor) an adapter whose factors do not fit the base
    model's linear layers, given the base's tensor shapes (its `tensor_map`). Some engines
    (vLLM 0.32) load a misfit adapter without complaint and then compute garbage."""
    root = Path(path)
    headers: dict[str, Any] = {}
    for w in adapter_weight_files(root):
        tensors, _, _ = read_header(w)
        headers.update(tensors)
    for module, (a, b) in lora_pairs(headers, str(root)).items():
        shape = base_shapes.get(f"{module}.weight")
        field = f"{PEFT_PREFIX}{module}"
        if shape is None:
            raise SnapshotError(
                "targets a layer the base model does not have", path=str(root), field=field
            )
        if len(shape) != 2:
            raise SnapshotError(
                f"targets a {len(shape)}-D weight; LoRA applies to linear layers",
                path=str(root),
                field=field,
            )
        out, inp = shape
        if a.shape[1] != inp or b.shape[0] != out:
            raise SnapshotError(
                f"lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the base layer "
                f"[{out}, {inp}]",
                path=str(root),
                field=field,
            )
