"""Write full snapshots: layer-pure shards under a size limit, manifests last, atomically.

The writer holds at most one shard's worth of tensor references, so a model given as an
iterator of (name, tensor) is never materialised twice.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hotload.arc.checksum import ADLER32, adler32, format_checksum
from hotload.errors import SnapshotError
from hotload.snapshot import layout
from hotload.snapshot.dtypes import NUMPY_TO_SAFETENSORS, TORCH_TO_SAFETENSORS
from hotload.snapshot.finite import check_finite
from hotload.snapshot.fp8 import Fp8Recipe, quantization_config, quantize_items
from hotload.snapshot.manifests import parse_weight_map
from hotload.snapshot.safetensors_io import RawTensor, iter_file, write_safetensors

# Metadata keys a full shard carries so that `verify` can check it without a parent.
META_CHECKSUM_FORMAT = "hotload.checksum"
META_CHECKSUMS = "hotload.checksums"

ProgressFn = Callable[[int], None]


def to_raw(name: str, tensor: Any, cast: str | None = None) -> RawTensor:
    """Convert a torch tensor, numpy array or `RawTensor` to a `RawTensor` (zero-copy if possible).

    `cast` may be "BF16" to round floating-point tensors to bfloat16 (round to nearest even).
    """
    if isinstance(tensor, RawTensor):
        raw = tensor
    elif isinstance(tensor, np.ndarray):
        key = tensor.dtype.name
        if key not in NUMPY_TO_SAFETENSORS:
            raise SnapshotError(f"numpy dtype {key} has no safetensors equivalent", field=name)
        arr = np.ascontiguousarray(tensor)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        raw = RawTensor(NUMPY_TO_SAFETENSORS[key], tuple(arr.shape), arr.reshape(-1).view(np.uint8))
    elif type(tensor).__module__.startswith("torch"):
        import torch

        t = tensor.detach().to("cpu")
        if cast == "BF16" and t.dtype in (torch.float32, torch.float16, torch.float64):
            # torch's own conversion: bit for bit what `.to(torch.bfloat16)` gives, NaNs included.
            t = t.to(torch.bfloat16)
        t = t.contiguous()
        key = str(t.dtype)
        if key not in TORCH_TO_SAFETENSORS:
            raise SnapshotError(f"torch dtype {key} has no safetensors equivalent", field=name)
        data = t.reshape(-1).view(torch.uint8).numpy()
        raw = RawTensor(TORCH_TO_SAFETENSORS[key], tuple(t.shape), data)
    else:
        raise SnapshotError(
            f"unsupported tensor type {type(tensor).__name__} (use torch, numpy or RawTensor)",
            field=name,
        )
    if cast is not None and cast != raw.dtype:
        raw = cast_tensor(name, raw, cast)
    return raw


def cast_tensor(name: str, raw: RawTensor, dtype: str) -> RawTensor:
    """Cast a floating-point tensor to BF16 (F32/F16/F64 in); other tensors pass unchanged."""
    if dtype != "BF16":
        raise SnapshotError(f"casting to {dtype} is not supported (only BF16)", field=name)
    if raw.dtype not in {"F32", "F16", "F64"}:
        return raw
    src = {"F32": np.float32, "F16": np.float16, "F64": np.float64}[raw.dtype]
    f32 = raw.data.view(src).astype(np.float32)
    bits = f32.view(np.uint32)
    # Round to nearest even on the 16 dropped bits; NaNs keep a quiet-NaN payload.
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(
        16
    )
    nan = np.isnan(f32)
    out = rounded.astype(np.uint16)
    out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return RawTensor("BF16", raw.shape, out.view(np.uint8))


def write_shard_file(path: str | Path, tensors: Sequence[tuple[str, RawTensor]]) -> int:
    """Write one full shard with its per-tensor adler32 checksums in the metadata; return its size.

    The entry point for writers that cut shards themselves (a sharded trainer writes the shards
    its rank owns under names agreed by every rank), so their shards verify like ours.
    """
    checksums = {n: format_checksum(adler32(t.data)) for n, t in tensors}
    metadata = {
        "format": "pt",
        META_CHECKSUM_FORMAT: ADLER32,
        META_CHECKSUMS: json.dumps(checksums, separators=(",", ":")),
    }
    return write_safetensors(Path(path), tensors, metadata)


def write_manifests(
    folder: str | Path,
    shards: Sequence[tuple[str, Sequence[str]]],
    spec: Mapping[str, Mapping[str, Any]],
    total_bytes: int,
) -> None:
    """Write the index (tensor -> shard, in `shards` order) and the spec (tensor -> shape, dtype).

    `shards` pairs each final shard file name with its tensor names; the shard files themselves
    need not be in `folder` (in a sharded publish other ranks hold them).
    """
    root = Path(folder)
    weight_map = {t: name for name, tensors in shards for t in tensors}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (root / layout.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (root / layout.SPEC_FILE).write_text(json.dumps({"tensor_map": dict(spec)}, indent=2) + "\n")


@dataclass
class WrittenSnapshot:
    """Summary of a written snapshot folder."""

    path: Path
    shards: list[str] = field(default_factory=list)
    tensor_count: int = 0
    total_bytes: int = 0


class SnapshotWriter:
    """Build a full snapshot in a temporary folder and move it into place on `finish`."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        max_shard_bytes: int = layout.DEFAULT_MAX_SHARD_BYTES,
        cast: str | None = None,
        overwrite: bool = False,
        progress: ProgressFn | None = None,
        finite: bool = False,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.finite = finite
        if self.out_dir.exists() and not overwrite:
            raise SnapshotError("output folder already exists", path=str(self.out_dir))
        if max_shard_bytes <= 0:
            raise SnapshotError("must be positive", field="max_shard_bytes")
        self.max_shard_bytes = max_shard_bytes
        self.cast = cast
        self.overwrite = overwrite
        self.progress = progress
        self.tmp_dir = self.out_dir.with_name(f".{self.out_dir.name}.tmp-{os.getpid()}")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True)
        self._pending: list[tuple[str, RawTensor]] = []
        self._pending_group: str | None = None
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # temp name, tensor names
        self._spec: dict[str, dict[str, Any]] = {}
        self._total = 0

    def add(self, name: str, tensor: Any) -> None:
        """Add one tensor; shards are cut at layer boundaries and at the size limit."""
        if not isinstance(name, str) or not name:
            raise SnapshotError("tensor names must be non-empty strings", field=repr(name))
        if name in self._spec:
            raise SnapshotError("tensor appears twice", field=name)
        raw = to_raw(name, tensor, self.cast)
        if self.finite:
            check_finite(name, raw)
        group = layout.layer_of(name) or "<non-layer>"
        if self._pending and (
            group != self._pending_group or self._pending_bytes + raw.nbytes > self.max_shard_bytes
        ):
            self._flush()
        self._pending.append((name, raw))
        self._pending_group = group
        self._pending_bytes += raw.nbytes
        self._spec[name] = {"shape": list(raw.shape), "dtype": raw.dtype}

    def _flush(self) -> None:
        if not self._pending:
            return
        tmp_name = f"shard-{len(self._shards):05d}.tmp"
        write_shard_file(self.tmp_dir / tmp_name, self._pending)
        self._shards.append((tmp_name, [n for n, _ in self._pending]))
        self._total += self._pending_bytes
        if self.progress:
            self.progress(self._pending_bytes)
        self._pending = []
        self._pending_bytes = 0

    def copy_file(self, src: str | Path, name: str | None = None) -> None:
        """Copy a side file (config, tokenizer) into the snapshot."""
        src = Path(src)
        shutil.copyfile(src, self.tmp_dir / (name or src.name))

    def write_json(self, name: str, doc: Mapping[str, Any]) -> None:
        """Write a side JSON file (for example `config.json`)."""
        (self.tmp_dir / name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")

    def finish(self) -> WrittenSnapshot:
        """Name the shards, write the manifests last, and move the folder into place."""
        self._flush()
        if not self._shards:
            raise SnapshotError("a snapshot needs at least one tensor", path=str(self.out_dir))
        if not (self.tmp_dir / layout.CONFIG_FILE).exists():
            raise SnapshotError(
                "a snapshot needs a config.json (pass config= or a model folder)",
                path=str(self.out_dir),
            )
        total = len(self._shards)
        named: list[tuple[str, list[str]]] = []
        for i, (tmp_name, tensors) in enumerate(self._shards, start=1):
            final = layout.shard_name(i, total)
            os.replace(self.tmp_dir / tmp_name, self.tmp_dir / final)
            named.append((final, tensors))
        write_manifests(self.tmp_dir, named, self._spec, self._total)
        names = [final for final, _ in named]
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp_dir, self.out_dir)
        return WrittenSnapshot(self.out_dir, names, len(self._spec), self._total)

    def abort(self) -> None:
        """Throw away everything written so far."""
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def _items(weights: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(weights, Mapping):
        yield from weights.items()
    else:
        for item in weights:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise SnapshotError("weights must be a mapping or an iterable of (name, tensor)")
            yield item


def write_side_files(
    folder: Path, *, side_files_from: str | Path | None, config: Mapping[str, Any] | None
) -> list[str]:
    """Put `config.json` and the tokenizer files into `folder`: copied from the model folder
    `side_files_from`, an explicit `config` winning. Return the names written, sorted."""
    names = []
    if side_files_from is not None:
        src = Path(side_files_from)
        for name in (layout.CONFIG_FILE, *layout.TOKENIZER_FILES):
            if (src / name).is_file():
                shutil.copyfile(src / name, folder / name)
                names.append(name)
    if config is not None:
        text = json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
        (folder / layout.CONFIG_FILE).write_text(text)
        if layout.CONFIG_FILE not in names:
            names.append(layout.CONFIG_FILE)
    return sorted(names)


def write_snapshot(
    out_dir: str | Path,
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    config: Mapping[str, Any] | None = None,
    side_files_from: str | Path | None = None,
    max_shard_bytes: int = layout.DEFAULT_MAX_SHARD_BYTES,
    cast: str | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    finite: bool = False,
    fp8: Fp8Recipe | None = None,
) -> WrittenSnapshot:
    """Write a full snapshot from a state dict or an iterator of (name, tensor).

    `config` is written as config.json; `side_files_from` copies config and tokenizer files
    from a model folder (an explicit `config` wins). With `finite`, a tensor holding NaN or Inf
    is refused (`NonFiniteWeightsError`) and nothing is written. With `fp8`, that recipe's
    weights are written as block FP8 with their scales, and config.json gets the
    `quantization_config` (`hotload.snapshot.fp8`).
    """
    writer = SnapshotWriter(
        out_dir,
        max_shard_bytes=max_shard_bytes,
        cast=cast,
        overwrite=overwrite,
        progress=progress,
        finite=finite,
    )
    try:
        write_side_files(writer.tmp_dir, side_files_from=side_files_from, config=config)
        items: Iterable[tuple[str, Any]] = _items(weights)
        kept: list[str] = []
        done: list[str] = []
        if fp8 is not None:
            if not (writer.tmp_dir / layout.CONFIG_FILE).is_file():
                raise SnapshotError(
                    "an FP8 snapshot needs a config.json for its quantization_config: pass "
                    "config= or side_files_from=",
                    field="fp8",
                )
            if cast is not None:
                raise SnapshotError(
                    f"cast={cast!r} and fp8={fp8!r} together: the recipe's weights are FP8, "
                    "cast the rest before publishing",
                    field="fp8",
                )
            items = quantize_items(items, fp8, kept, done)
        for name, tensor in items:
            writer.add(name, tensor)
        if fp8 is not None and not done:
            raise SnapshotError(
                f"fp8={fp8!r} converted no tensor: the recipe takes 2-D weights named as in a "
                "checkpoint (experts: ...experts.<N>.gate_proj/up_proj/down_proj.weight), not "
                "stacked 3-D experts; publish the family's checkpoint names (Publisher does, "
                "from a transformers state dict)",
                field="fp8",
            )
        if fp8 is not None:
            path = writer.tmp_dir / layout.CONFIG_FILE
            doc = json.loads(path.read_text())
            doc["quantization_config"] = quantization_config(fp8, kept)
            path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


def iter_model_folder(src: str | Path) -> Iterator[tuple[str, RawTensor]]:
    """Yield the tensors of a Hugging Face model folder (sharded or single safetensors) lazily."""
    src = Path(src)
    index = src / layout.INDEX_FILE
    if index.exists():
        files = sorted(set(parse_weight_map(index).values()))
    elif (src / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in src.glob("*.safetensors"))
        if not found:
            raise SnapshotError(
                "no safetensors weights found (expected model.safetensors or an index)",
                path=str(src),
            )
        files = found
    for name in files:
        yield from iter_file(src / name)


def build_from_folder(
    src: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = layout.DEFAULT_MAX_SHARD_BYTES,
    cast: str | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    fp8: Fp8Recipe | None = None,
) -> WrittenSnapshot:
    """Re-shard a Hugging Face model folder into a hotload snapshot (config and tokenizer kept;
    `fp8`: see `write_snapshot`)."""
    src = Path(src)
    if not (src / layout.CONFIG_FILE).is_file():
        raise SnapshotError("model folder has no config.json", path=str(src))
    return write_snapshot(
        out_dir,
        iter_model_folder(src),
        side_files_from=src,
        max_shard_bytes=max_shard_bytes,
        cast=cast,
        overwrite=overwrite,
        progress=progress,
        fp8=fp8,
    )
