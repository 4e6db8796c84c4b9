"""The served weights' checksums, read from the weights themselves.

`served_sums` reads every region an engine holds of each checkpoint tensor and returns its
partial adler32 sums (`sums`), converted back to the checkpoint's bits. It is what the parent
of the first patch after a full load is checked against, and what a scrub (`scrub`) compares
with the sums the patches since then were derived into.

Where the weights lie on the CPU, zlib sums them. Elsewhere (a GPU) the sums are computed on
the device with integer tensor operations, so nothing but two integers per chunk comes back to
the host: "read back to the host" stays O(1) per chunk, not O(model). `Meter` counts what was
read, and may pace the reads (a scrub's rate limit) or stop them.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hotload_patch.checkpoint import Specs
from hotload_patch.dtypes import ELEMENT_SIZE, from_torch, torch_dtype, uint_view_dtype
from hotload_patch.errors import PatchError
from hotload_patch.placement import Host, Slot
from hotload_patch.sums import MOD, Region, RegionSum, rows_partial, span_partial

#: Elements read at once when checksumming on the CPU (bounds the extra memory).
CHUNK_ELEMENTS = 1 << 24
#: Bytes summed at once on a device: the sums widen every byte to int64 (8x the chunk).
DEVICE_CHUNK_BYTES = 1 << 24
#: The torch integer type of each element width: bit patterns viewed without conversion
#: (torch has no unsigned 16, 32 or 64-bit views numpy can take).
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: (checkpoint dtype, held dtype) pairs whose conversion is exact and reversible.
EXACT_WIDENING = {("BF16", "F32"), ("F16", "F32"), ("BF16", "F64"), ("F16", "F64"), ("F32", "F64")}


@dataclass
class Counters:
    """What the engine side did to its weights, cumulative (thread-safe through `add`).

    `checksum_bytes`: checkpoint bytes read to checksum the served weights after full loads
    (not by scrubs); `scrub_bytes`: bytes read by scrubs; `host_bytes`: bytes copied from a
    device back to the host by patches and checksums; `patched_elements` / `patched_bytes`:
    elements written by patches and their bytes as held; `patches`: patches written."""

    checksum_bytes: int = 0
    scrub_bytes: int = 0
    host_bytes: int = 0
    patched_elements: int = 0
    patched_bytes: int = 0
    patches: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        """Add to the named counters."""
        with self._lock:
            for key, value in amounts.items():
                setattr(self, key, getattr(self, key) + value)

    def to_json(self) -> dict[str, int]:
        """The counters as JSON."""
        with self._lock:
            return {
                "checksum_bytes": self.checksum_bytes,
                "scrub_bytes": self.scrub_bytes,
                "host_bytes": self.host_bytes,
                "patched_elements": self.patched_elements,
                "patched_bytes": self.patched_bytes,
                "patches": self.patches,
            }


class ReadStoppedError(Exception):
    """A paced read was told to stop (its result would be stale)."""


@dataclass
class Meter:
    """Counts the bytes a read covers (`counter` names the `Counters` field) and the bytes it
    brought back from a device; `pace(nbytes)` runs after each chunk (it may sleep, or raise
    `ReadStoppedError`)."""

    counters: Counters | None = None
    counter: str = "checksum_bytes"
    pace: Callable[[int], None] | None = None
    chunk_elements: int | None = None

    def read(self, nbytes: int, host: int = 0) -> None:
        """Account for `nbytes` checkpoint bytes read, `host` of them copied to the host."""
        if self.counters is not None:
            self.counters.add(**{self.counter: nbytes, "host_bytes": host})
        if self.pace is not None:
            self.pace(nbytes)


def held_dtype(slot: Slot, param: torch.Tensor, ckpt: str) -> None:
    """Refuse a parameter whose dtype cannot give back the checkpoint's bits."""
    held = from_torch(param.dtype) or str(param.dtype)
    if held != ckpt and (ckpt, held) not in EXACT_WIDENING:
        raise PatchError(
            f"is held as {param.dtype} in {slot.param}, which cannot give back the checkpoint's "
            f"{ckpt} bits: its parent cannot be verified",
            reason="weights_mismatch",
            tensor=slot.tensor,
        )
    if not param.is_contiguous():
        raise PatchError(
            f"{slot.param} is not contiguous in the engine",
            reason="weights_mismatch",
            tensor=slot.tensor,
        )


def region_view(param: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements `region` of a parameter, as a view."""
    return param.detach().as_strided(
        region.sizes, region.strides, param.storage_offset() + region.offset
    )


def served_sums(host: Host, specs: Specs, meter: Meter | None = None) -> list[RegionSum]:
    """Partial adler32 sums of every checkpoint tensor the engine holds, per region, as held
    now (a full read of the weights: run it while they serve, not in a pause)."""
    out: list[RegionSum] = []
    for name, (shape, dtype) in specs.items():
        for slot in host.place(name, shape, dtype):
            out.append(slot_sum(host, slot, shape, dtype, meter))
    return out


def slot_sum(
    host: Host, slot: Slot, shape: tuple[int, ...], dtype: str, meter: Meter | None = None
) -> RegionSum:
    """The partial sums of one slot (a region of checkpoint tensor `slot.tensor`) as held."""
    param = host.parameters()[slot.param]
    held_dtype(slot, param, dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * ELEMENT_SIZE[dtype]
    with torch.no_grad():
        a, b = region_partial(region_view(param, slot.dst), slot.src, dtype, nbytes, meter)
    return RegionSum(slot.tensor, slot.src, a, b)


def region_partial(
    view: torch.Tensor, src: Region, ckpt: str, total: int, meter: Meter | None = None
) -> tuple[int, int]:
    """Partial sums of the held elements `view`, which are region `src` of a `total`-byte
    checkpoint tensor of dtype `ckpt`."""
    if view.device.type != "cpu":
        return device_partial(view, src, ckpt, total, meter)
    width = ELEMENT_SIZE[ckpt]
    step = (meter.chunk_elements if meter and meter.chunk_elements else None) or CHUNK_ELEMENTS
    flat = view.reshape(-1) if view.is_contiguous() else None
    span = src.span()
    if span is not None:
        adler = 1
        for first in range(0, src.numel, step):
            count = min(step, src.numel - first)
            chunk = _chunk(view, flat, first, count)
            adler = zlib.adler32(_bits(chunk, ckpt).view(np.uint8).data, adler)
            if meter is not None:
                meter.read(count * width)
        return span_partial(adler, span[0] * width, span[1] * width, total)
    # A strided region (a column shard): each run of contiguous checkpoint bytes is a row.
    run = src.sizes[-1] if src.sizes and src.strides[-1] == 1 else 1
    rows_per_chunk = max(1, step // run)
    a = b = 0
    for first_row in range(0, src.numel // run, rows_per_chunk):
        rows = min(rows_per_chunk, src.numel // run - first_row)
        chunk = _chunk(view, flat, first_row * run, rows * run)
        data = _bits(chunk, ckpt).view(np.uint8).reshape(rows, run * width)
        starts = src.element_offsets(first_row * run, rows * run)[::run] * width
        pa, pb = rows_partial(data, starts, total)
        a, b = (a + pa) % MOD, (b + pb) % MOD
        if meter is not None:
            meter.read(rows * run * width)
    return a, b


def device_partial(
    view: torch.Tensor, src: Region, ckpt: str, total: int, meter: Meter | None = None
) -> tuple[int, int]:
    """`region_partial` computed where the weights lie (any torch device, the CPU included):
    byte sums and position-weighted byte sums in int64 on the device, two integers per chunk
    back to the host."""
    width = ELEMENT_SIZE[ckpt]
    span = src.span()
    run = src.numel if span is not None else (src.sizes[-1] if src.strides[-1] == 1 else 1)
    run_bytes = run * width
    flat = view.reshape(-1) if view.is_contiguous() else None
    if span is not None:
        # One contiguous run: cut it into chunks, each a row at its own byte offset.
        piece = max(1, DEVICE_CHUNK_BYTES // width)
        a = b = 0
        for first in range(0, src.numel, piece):
            count = min(piece, src.numel - first)
            data = _device_bytes(_chunk(view, flat, first, count), ckpt).reshape(1, -1)
            starts = torch.tensor([(span[0] + first) * width], dtype=torch.int64)
            pa, pb = _rows_sums(data, starts.to(data.device), total)
            a, b = (a + pa) % MOD, (b + pb) % MOD
            if meter is not None:
                meter.read(count * width, host=16)
        return a, b
    rows_per_chunk = max(1, DEVICE_CHUNK_BYTES // run_bytes)
    nrows = src.numel // run
    a = b = 0
    for first_row in range(0, nrows, rows_per_chunk):
        rows = min(rows_per_chunk, nrows - first_row)
        chunk = _chunk(view, flat, first_row * run, rows * run)
        data = _device_bytes(chunk, ckpt).reshape(rows, run_bytes)
        starts_np = src.element_offsets(first_row * run, rows * run)[::run] * width
        pa, pb = _rows_sums(data, torch.from_numpy(starts_np).to(data.device), total)
        a, b = (a + pa) % MOD, (b + pb) % MOD
        if meter is not None:
            meter.read(rows * run_bytes, host=16)
    return a, b


_ARANGE: dict[tuple[str, int], torch.Tensor] = {}


def _rows_sums(data: torch.Tensor, starts: torch.Tensor, total: int) -> tuple[int, int]:
    """(a, b) of byte rows `data` (uint8, rows x L) lying at byte offsets `starts` of a
    `total`-byte buffer: byte j of a row weighs total - start - j in b."""
    length = data.shape[1]
    key = (str(data.device), length)
    ramp = _ARANGE.get(key)
    if ramp is None:
        ramp = torch.arange(length, dtype=torch.int64, device=data.device)
        _ARANGE.clear()  # one length at a time: chunks are mostly of one size
        _ARANGE[key] = ramp
    wide = data.to(torch.int64)
    sums = wide.sum(dim=1)
    tails = (wide * ramp).sum(dim=1)
    weight = torch.remainder(total - starts, MOD)
    a = int(sums.sum().item()) % MOD
    b = (int((weight * torch.remainder(sums, MOD)).sum().item()) - int(tails.sum().item())) % MOD
    return a, b


def _narrowed(values: torch.Tensor, ckpt: str) -> torch.Tensor:
    """Held values in the checkpoint's dtype, flat. Held in a wider dtype, they must convert
    back exactly: bits the checkpoint cannot represent (a flip in a float32's low mantissa of a
    bfloat16 weight) are a `PatchError` (parent_mismatch), since no checksum would see them."""
    t = values.detach().reshape(-1)
    dtype = torch_dtype(ckpt)
    if t.dtype == dtype:
        return t
    narrow = t.to(dtype)
    back = narrow.to(t.dtype)
    ints = INT_OF_WIDTH[t.element_size()]
    if not torch.equal(back.view(ints), t.view(ints)):
        raise PatchError(
            f"holds {t.dtype} values that {ckpt} cannot represent: they changed since they were "
            "loaded or patched",
            reason="parent_mismatch",
        )
    return narrow


def _device_bytes(values: torch.Tensor, ckpt: str) -> torch.Tensor:
    """Held values as the checkpoint's bytes, on their own device (flat uint8)."""
    t = _narrowed(values, ckpt)
    return t.view(INT_OF_WIDTH[t.element_size()]).view(torch.uint8)


def _bits(values: torch.Tensor, ckpt: str) -> np.ndarray:
    """Held CPU values as the checkpoint's unsigned bit patterns (numpy)."""
    t = _narrowed(values, ckpt)
    result: Any = t.view(INT_OF_WIDTH[t.element_size()]).numpy().view(uint_view_dtype(ckpt))
    return np.asarray(result)


def _chunk(view: torch.Tensor, flat: torch.Tensor | None, first: int, count: int) -> torch.Tensor:
    """Elements `first .. first + count` of a region in row-major order (a copy of those rows
    only, for a strided two-dimensional view: a column shard)."""
    if flat is not None:
        return flat[first : first + count]
    if view.dim() == 2 and view.shape[1] and not (first % view.shape[1] or count % view.shape[1]):
        run = view.shape[1]
        return view[first // run : (first + count) // run].reshape(-1)
    return view.reshape(-1)[first : first + count]
