"""A clean-room arc_v2 decoder, written only from docs/arc_v2.md.

It deliberately imports nothing from `hotload`: it exists to prove that the specification is
complete enough to rebuild a shard byte for byte. It favours clarity over speed and holds whole
shards in memory, which is fine for tests. Section numbers (§) refer to docs/arc_v2.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import zstandard

MAGIC = bytes.fromhex("8941524376320d0a")  # §3: b"\x89ARCv2\r\n"
PREFIX_LEN = 20  # §3: magic (8), u64 header-frame length, u32 CRC-32 of the header frame
HEADER_LIMIT = 64 * 1024 * 1024  # our choice of header limit (§3 lets a decoder pick one)
ADLER_MOD = 65521
SUPPORTED_VERSION = 1
CHECKSUM_NAMES = {"adler32", "alder32"}  # §4.1: "alder32" is an alias of adler32
MAX_CHUNK_ELEMENTS = 1 << 24  # §4.1
ENCODINGS = ("same", "sparse", "sparse_exp", "dense", "raw")
STREAM_BITS = (1, 2, 4, 8)
HEX8 = re.compile(r"[0-9a-f]{8}")  # §4.2, §4.3: checksums are exactly 8 lowercase hex digits

# §2.1: element width in bytes of every supported safetensors dtype.
ELEMENT_WIDTH: dict[str, int] = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64"), 8),
}

# §7.3, table "float layouts": (mantissa bits, total bits) of the dtypes `sparse_exp` accepts.
FLOAT_LAYOUTS: dict[str, tuple[int, int]] = {
    "BF16": (7, 16),
    "F16": (10, 16),
    "F32": (23, 32),
    "F64": (52, 64),
    "F8_E4M3": (3, 8),
    "F8_E5M2": (2, 8),
}


class SpecDecodeError(ValueError):
    """The delta (or its parent) is malformed, or a checksum does not match."""


class ChecksumError(SpecDecodeError):
    """A tensor's parent or rebuilt bytes do not have the checksum the delta promises."""


def _uint(width: int) -> np.dtype[Any]:
    """§5: elements are unsigned little-endian integers of the dtype's width."""
    return np.dtype(f"<u{width}")


# --- safetensors (§2.1, §9) --------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def width(self) -> int:
        """Element width in bytes."""
        return ELEMENT_WIDTH[self.dtype]

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_safetensors_header(header: bytes, data_len: int | None) -> dict[str, TensorEntry]:
    """Parse a safetensors JSON header; `data_len` bounds the offsets when known."""
    try:
        doc = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"safetensors header is not UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise SpecDecodeError("safetensors header is not a JSON object")
    tensors: dict[str, TensorEntry] = {}
    for name, spec in doc.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict):
            raise SpecDecodeError(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ELEMENT_WIDTH:
            raise SpecDecodeError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise SpecDecodeError(f"tensor {name!r}: bad shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
            or (data_len is not None and offsets[1] > data_len)
        ):
            raise SpecDecodeError(f"tensor {name!r}: bad data_offsets {offsets!r}")
        entry = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
        if entry.end - entry.begin != entry.numel * entry.width:
            raise SpecDecodeError(f"tensor {name!r}: data_offsets do not fit its shape")
        tensors[name] = entry
    return tensors


@dataclass(frozen=True)
class SafetensorsShard:
    """A full shard held in memory."""

    header: bytes
    tensors: dict[str, TensorEntry]
    data: bytes

    def elements(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's elements as unsigned integers (§5), read-only."""
        return np.frombuffer(
            self.data, dtype=_uint(entry.width), count=entry.numel, offset=entry.begin
        )


def read_safetensors(blob: bytes) -> SafetensorsShard:
    """Split a safetensors file into header bytes, tensor entries and the data section."""
    if len(blob) < 8:
        raise SpecDecodeError("parent shard is too short")
    (length,) = struct.unpack_from("<Q", blob, 0)
    if 8 + length > len(blob):
        raise SpecDecodeError("parent shard header runs past the end of the file")
    header = blob[8 : 8 + length]
    data = blob[8 + length :]
    return SafetensorsShard(header, parse_safetensors_header(header, len(data)), data)


# --- container and header (§3, §4) -------------------------------------------------------------


@dataclass(frozen=True)
class DeltaShard:
    """A delta shard: its decoded JSON header and its payload."""

    fields: dict[str, Any]
    payload: bytes


def _bounded_zstd(frame: bytes, limit: int, exact: bool, what: str) -> bytes:
    """Decompress one zstd frame, refusing it before allocation if it declares too much (§6.1)."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise SpecDecodeError(f"{what}: not a zstd frame ({exc})") from None
    if declared < 0:
        raise SpecDecodeError(f"{what}: zstd frame does not declare its content size")
    if declared > limit or (exact and declared != limit):
        raise SpecDecodeError(f"{what}: zstd frame declares {declared} bytes, allowed {limit}")
    try:
        out = zstandard.ZstdDecompressor().decompress(
            frame, max_output_size=declared, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise SpecDecodeError(f"{what}: corrupt zstd frame ({exc})") from None
    if len(out) != declared:
        raise SpecDecodeError(f"{what}: decoded {len(out)} bytes, frame declared {declared}")
    return out


def parse_delta(blob: bytes) -> DeltaShard:
    """Parse the container (§3) and check the version gate and the top-level fields (§10)."""
    if len(blob) < PREFIX_LEN or blob[:8] != MAGIC:
        raise SpecDecodeError("not an arc_v2 delta shard (bad magic or truncated)")
    frame_len, frame_crc = struct.unpack_from("<QI", blob, 8)
    if PREFIX_LEN + frame_len > len(blob):
        raise SpecDecodeError("header frame runs past the end of the file")
    frame = blob[PREFIX_LEN : PREFIX_LEN + frame_len]
    # §3: the CRC-32 of the frame's bytes is checked before the frame is parsed.
    if zlib.crc32(frame) != frame_crc:
        raise SpecDecodeError("header frame fails its CRC-32 (corrupted header)")
    raw = _bounded_zstd(frame, HEADER_LIMIT, False, "header")
    try:
        fields = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise SpecDecodeError("header is not a JSON object")
    if fields.get("format") != "arc_v2":
        raise SpecDecodeError(f"format {fields.get('format')!r} is not 'arc_v2'")
    version = fields.get("version")
    if not _is_int(version) or version != SUPPORTED_VERSION:
        raise SpecDecodeError(f"unsupported layout version {version!r}: upgrade the decoder")
    checksum = fields.get("checksum")
    if checksum not in CHECKSUM_NAMES:
        raise SpecDecodeError(f"unsupported checksum algorithm {checksum!r}")
    chunk_elements = fields.get("chunk_elements")
    if not _is_int(chunk_elements) or not 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS:
        raise SpecDecodeError(f"bad chunk_elements {chunk_elements!r}")
    if not isinstance(fields.get("target_header"), str):
        raise SpecDecodeError("target_header is missing or not a string")
    if not isinstance(fields.get("tensors"), list):
        raise SpecDecodeError("tensors is missing or not an array")
    return DeltaShard(fields, blob[PREFIX_LEN + frame_len :])


def read_delta_header(path: str | Path) -> dict[str, Any]:
    """Return the decoded JSON header of a delta shard file."""
    return parse_delta(Path(path).read_bytes()).fields


# --- streams (§6) ------------------------------------------------------------------------------


def _field(meta: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = meta.get(key)
    if not _is_int(value) or not lo <= value <= hi:
        raise SpecDecodeError(
            f"chunk field {key!r} must be an integer in [{lo}, {hi}], got {value!r}"
        )
    return value


def _unpack_symbols(packed: bytes, bits: int, count: int) -> np.ndarray:
    """§6.2: `8 // bits` symbols per byte, first symbol in the lowest bits."""
    data = np.frombuffer(packed, dtype=np.uint8)
    if bits == 8:
        return data[:count]
    per = 8 // bits
    mask = (1 << bits) - 1
    slots = [(data >> np.uint8(i * bits)) & np.uint8(mask) for i in range(per)]
    return np.stack(slots, axis=1).reshape(-1)[:count]


def _read_streams(meta: dict[str, Any], payload: bytes, symbols: list[int]) -> list[np.ndarray]:
    """Decode stream `i` of a chunk to `symbols[i]` symbols (§6, §10 step 7)."""
    streams = meta.get("streams")
    if not isinstance(streams, list) or len(streams) != len(symbols):
        raise SpecDecodeError(f"chunk needs exactly {len(symbols)} stream entries")
    out: list[np.ndarray] = []
    pos = 0
    for i, (entry, count) in enumerate(zip(streams, symbols, strict=True)):
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or not isinstance(entry[0], str)
            or not _is_int(entry[1])
            or entry[1] < 0
            or not _is_int(entry[2])
            or entry[2] not in STREAM_BITS
        ):
            raise SpecDecodeError(f"stream {i}: malformed entry {entry!r}")
        codec, stored, bits = entry
        if pos + stored > len(payload):
            raise SpecDecodeError(f"stream {i} runs past the end of its chunk")
        body = payload[pos : pos + stored]
        pos += stored
        expected = -(-count // (8 // bits))  # D = ceil(S / (8 / bits))
        if codec == "raw":
            if stored != expected:
                raise SpecDecodeError(
                    f"stream {i}: raw stream of {stored} bytes, expected {expected}"
                )
            raw = body
        elif codec == "zstd":
            raw = _bounded_zstd(body, expected, True, f"stream {i}")
        else:
            raise SpecDecodeError(f"stream {i}: unknown codec {codec!r}")
        out.append(_unpack_symbols(raw, bits, count))
    if pos != len(payload):
        raise SpecDecodeError(f"{len(payload) - pos} bytes after the chunk's last stream")
    return out


def _join_planes(planes: list[np.ndarray], count: int, dtype: np.dtype[Any]) -> np.ndarray:
    """§6.3: value = sum of plane_j << 8j; missing high planes are zero."""
    out = np.zeros(count, dtype=dtype)
    for j, plane in enumerate(planes):
        out |= plane.astype(dtype) << dtype.type(8 * j)
    return out


def _unzigzag(z: np.ndarray) -> np.ndarray:
    """§6.4: (z >> 1) XOR (0 - (z AND 1)), wrapping at the element width."""
    one = z.dtype.type(1)
    out: np.ndarray = (z >> one) ^ (np.zeros_like(z) - (z & one))
    return out


# --- chunks (§7) -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """§7.2: the fields of a run of changed elements (a `sparse` chunk, half a `sparse_exp`)."""

    count: int
    shift: int
    quotient_planes: int
    value_planes: int

    @property
    def n_streams(self) -> int:
        """R + Q + V streams, or none for an empty run."""
        return -(-self.shift // 8) + self.quotient_planes + self.value_planes


def _run(fields: object, m: int, width: int, min_count: int) -> Run:
    """Check a run's fields against an index space of `m` elements (§4.3)."""
    if not isinstance(fields, dict):
        raise SpecDecodeError("run fields must be a JSON object")
    k = _field(fields, "count", min_count, m)
    if k == 0:
        # §7.3: an empty run has every field 0 and no streams.
        for key in ("shift", "quotient_planes", "value_planes"):
            _field(fields, key, 0, 0)
        return Run(0, 0, 0, 0)
    shift = _field(fields, "shift", 0, 56)
    q_planes = _field(fields, "quotient_planes", 1, 8)
    v_planes = _field(fields, "value_planes", 1, width)
    return Run(k, shift, q_planes, v_planes)


def _decode_run(
    run: Run, planes: list[np.ndarray], m: int, dtype: np.dtype[Any]
) -> tuple[np.ndarray, np.ndarray]:
    """§7.2: a run's indices (strictly increasing, each < m) and its zigzagged values."""
    k, shift = run.count, run.shift
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=dtype)
    r_planes = -(-shift // 8)
    u64 = np.dtype("<u8")
    r = _join_planes(planes[:r_planes], k, u64)
    q = _join_planes(planes[r_planes : r_planes + run.quotient_planes], k, u64)
    if int(r.max()) >> shift:
        raise SpecDecodeError("a gap remainder does not fit in `shift` bits")
    # Compare the quotient before shifting it: q << shift must not wrap past 2**64.
    if int(q.max()) > (m - 1) >> shift:
        raise SpecDecodeError("a gap exceeds the index space")
    gaps = (q << np.uint64(shift)) | r
    if int(gaps.max()) >= m:
        raise SpecDecodeError("a gap exceeds the index space")
    # i_j = j + sum_{l <= j} g_l: gaps < m and k <= m <= 2**24 keep this far below 2**63.
    indices = np.cumsum(gaps.astype(np.int64)) + np.arange(k, dtype=np.int64)
    if int(indices[-1]) >= m:
        raise SpecDecodeError(f"an index lies past the run's {m} elements")
    values = _join_planes(planes[r_planes + run.quotient_planes :], k, dtype)
    return indices, values


def _hot_and_cold(old: np.ndarray, dtype: str, threshold: int) -> tuple[np.ndarray, np.ndarray]:
    """§7.3: the hot list (ordered by exponent, then position) and the cold list (by position)."""
    mantissa_bits, total_bits = FLOAT_LAYOUTS[dtype]
    wide = old.astype(np.uint64)
    magnitude = wide & np.uint64((1 << (total_bits - 1)) - 1)  # every bit but the sign
    exponent = magnitude >> np.uint64(mantissa_bits)
    is_hot = exponent < np.uint64(threshold)  # same as magnitude < threshold << mantissa_bits
    positions = np.arange(old.size, dtype=np.int64)
    hot = positions[is_hot]
    # np.lexsort sorts by its last key first: exponent, then position.
    hot = hot[np.lexsort((hot, exponent[is_hot]))]
    return hot, positions[~is_hot]


def _patch(old: np.ndarray, positions: np.ndarray, values: np.ndarray) -> np.ndarray:
    new = old.copy()
    new[positions] = old[positions] + _unzigzag(values)
    return new


def decode_chunk(
    meta: object, payload: bytes, old: np.ndarray, dtype: str | None = None
) -> np.ndarray:
    """Return the chunk's new elements, given its entry, its payload bytes and the parent's.

    `dtype` is the tensor's safetensors dtype; only `sparse_exp` needs it.
    """
    if not isinstance(meta, dict):
        raise SpecDecodeError("chunk entry is not an object")
    n = int(old.size)
    udtype = old.dtype
    width = udtype.itemsize
    encoding = meta.get("encoding")
    if encoding == "same":
        if payload:
            raise SpecDecodeError("a 'same' chunk must have no payload")
        return old.copy()
    if encoding == "sparse":
        run = _run(meta, n, width, 1)
        planes = _read_streams(meta, payload, [run.count] * run.n_streams)
        positions, values = _decode_run(run, planes, n, udtype)
        return _patch(old, positions, values)
    if encoding == "sparse_exp":
        if dtype not in FLOAT_LAYOUTS:
            raise SpecDecodeError(f"sparse_exp needs a float dtype, not {dtype!r}")
        mantissa_bits, total_bits = FLOAT_LAYOUTS[dtype]
        max_exponent = (1 << (total_bits - 1 - mantissa_bits)) - 1
        threshold = _field(meta, "threshold", 1, max_exponent + 1)
        hot, cold = _hot_and_cold(old, dtype, threshold)
        hot_run = _run(meta.get("hot"), hot.size, width, 0)
        cold_run = _run(meta.get("cold"), cold.size, width, 0)
        if hot_run.count + cold_run.count == 0:
            raise SpecDecodeError("a sparse_exp chunk must change at least one element")
        symbols = [hot_run.count] * hot_run.n_streams + [cold_run.count] * cold_run.n_streams
        planes = _read_streams(meta, payload, symbols)
        h_idx, h_val = _decode_run(hot_run, planes[: hot_run.n_streams], hot.size, udtype)
        c_idx, c_val = _decode_run(cold_run, planes[hot_run.n_streams :], cold.size, udtype)
        # Hot indices point into the hot list, cold ranks into the cold list.
        positions = np.concatenate([hot[h_idx], cold[c_idx]])
        return _patch(old, positions, np.concatenate([h_val, c_val]))
    if encoding == "dense":
        v_planes = _field(meta, "value_planes", 1, width)
        planes = _read_streams(meta, payload, [n] * v_planes)
        new_dense: np.ndarray = old + _unzigzag(_join_planes(planes, n, udtype))
        return new_dense
    if encoding == "raw":
        planes = _read_streams(meta, payload, [n] * width)
        return _join_planes(planes, n, udtype)
    raise SpecDecodeError(f"unknown chunk encoding {encoding!r}")


# --- checksums (§8.1) --------------------------------------------------------------------------


def adler32(data: bytes) -> int:
    """adler32 of a byte buffer (zlib's)."""
    return zlib.adler32(data) & 0xFFFFFFFF


def adler32_combine(first: int, second: int, second_len: int) -> int:
    """§8.1: the adler32 of X followed by Y from adler32(X), adler32(Y) and len(Y)."""
    a1, b1 = first & 0xFFFF, first >> 16
    a2, b2 = second & 0xFFFF, second >> 16
    a = (a1 + a2 - 1) % ADLER_MOD
    b = (b1 + b2 + second_len * (a1 - 1)) % ADLER_MOD
    return (b << 16) | a


def _parse_checksum(text: object, what: str) -> int:
    """§4.2, §4.3: exactly 8 lowercase hex digits, most significant first."""
    if not isinstance(text, str) or not HEX8.fullmatch(text):
        raise SpecDecodeError(f"{what}: malformed checksum {text!r}")
    return int(text, 16)


# --- shards (§9, §10) --------------------------------------------------------------------------


def decode_shard(
    parent_blob: bytes, delta_blob: bytes, *, expected_parent: str | None = None
) -> bytes:
    """Rebuild a full shard file from its parent's bytes and a delta shard's bytes."""
    delta = parse_delta(delta_blob)
    fields = delta.fields
    if expected_parent is not None and fields.get("parent") != expected_parent:
        raise SpecDecodeError(f"delta follows {fields.get('parent')!r}, not {expected_parent!r}")
    chunk_elements: int = fields["chunk_elements"]
    target_header = fields["target_header"].encode("utf-8")
    targets = parse_safetensors_header(target_header, None)
    entries = fields["tensors"]
    names = [e.get("name") if isinstance(e, dict) else None for e in entries]
    if not all(isinstance(x, str) for x in names) or len(set(names)) != len(names):
        raise SpecDecodeError("tensor entries must have distinct string names")
    if set(names) != set(targets):
        raise SpecDecodeError("tensor entries do not match the tensors of target_header")
    parent = read_safetensors(parent_blob)
    for name, info in targets.items():
        p = parent.tensors.get(name)
        if p is None or (p.dtype, p.shape) != (info.dtype, info.shape):
            raise SpecDecodeError(
                f"tensor {name!r}: the parent shard does not hold it "
                f"as {info.dtype}{list(info.shape)}"
            )

    # §10 step 6: every chunk's placement, before any decoding.
    payload = delta.payload
    for entry in entries:
        info = targets[entry["name"]]
        chunks = entry.get("chunks")
        expected = -(-info.numel // chunk_elements)
        if not isinstance(chunks, list) or len(chunks) != expected:
            raise SpecDecodeError(f"tensor {info.name!r}: expected {expected} chunk entries")
        for meta in chunks:
            off = meta.get("offset") if isinstance(meta, dict) else None
            length = meta.get("length") if isinstance(meta, dict) else None
            if not (_is_int(off) and _is_int(length)):
                raise SpecDecodeError(f"tensor {info.name!r}: chunk without integer offset/length")
            if off < 0 or length < 0 or off + length > len(payload):
                raise SpecDecodeError(f"tensor {info.name!r}: chunk lies outside the payload")

    data_len = max((t.end for t in targets.values()), default=0)
    out = bytearray(8 + len(target_header) + data_len)
    struct.pack_into("<Q", out, 0, len(target_header))
    out[8 : 8 + len(target_header)] = target_header
    data_start = 8 + len(target_header)
    for entry in entries:
        info = targets[entry["name"]]
        what = f"tensor {info.name!r}"
        old_all = parent.elements(parent.tensors[info.name])
        # §10 step 8: base checksum first (wrong parent), then the rebuilt tensor's.
        want_base = _parse_checksum(entry.get("base_checksum"), what)
        want = _parse_checksum(entry.get("checksum"), what)
        got_base = adler32(old_all.tobytes())
        if got_base != want_base:
            raise ChecksumError(
                f"{what}: parent checksum {got_base:08x} != base_checksum {want_base:08x} "
                "(wrong parent)"
            )
        rebuilt: list[np.ndarray] = []
        got = 1
        for i, meta in enumerate(entry["chunks"]):
            s = i * chunk_elements
            e = min(info.numel, s + chunk_elements)
            body = payload[meta["offset"] : meta["offset"] + meta["length"]]
            # §8.2: the chunk's stored bytes are checked before anything reads them.
            want_crc = _parse_checksum(meta.get("crc32"), f"{what}: elements {s}..{e}: crc32")
            if zlib.crc32(body) != want_crc:
                raise SpecDecodeError(
                    f"{what}: elements {s}..{e}: stored bytes fail their CRC-32 "
                    f"({zlib.crc32(body):08x}, the entry says {want_crc:08x})"
                )
            try:
                new = decode_chunk(meta, body, old_all[s:e], info.dtype)
            except SpecDecodeError as exc:
                raise SpecDecodeError(f"{what}: elements {s}..{e}: {exc}") from None
            got = adler32_combine(got, adler32(new.tobytes()), new.nbytes)
            rebuilt.append(new)
        if got != want:
            raise ChecksumError(f"{what}: rebuilt checksum {got:08x} != checksum {want:08x}")
        tensor_bytes = b"".join(c.tobytes() for c in rebuilt)
        out[data_start + info.begin : data_start + info.end] = tensor_bytes
    return bytes(out)


def decode_shard_file(
    parent_shard_path: str | Path,
    delta_shard_path: str | Path,
    *,
    expected_parent: str | None = None,
) -> bytes:
    """Return the bytes of the full shard that `delta_shard_path` rebuilds from its parent.

    Raises `ValueError` (a `SpecDecodeError`) on a malformed delta or any checksum mismatch.
    """
    return decode_shard(
        Path(parent_shard_path).read_bytes(),
        Path(delta_shard_path).read_bytes(),
        expected_parent=expected_parent,
    )


INHERITED_FILE = "hotload.inherited.json"  # §2.2
SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")  # §2


def untouched_shards(delta_folder: str | Path) -> dict[str, str]:
    """§2.2: the shards a delta folder leaves alone (name -> "sha256:<hex>" of the parent's
    shard header as stored); empty without a record. Refuses a malformed `untouched_shards`."""
    path = Path(delta_folder) / INHERITED_FILE
    if not path.is_file():
        return {}
    doc = json.loads(path.read_bytes())
    shards = doc.get("untouched_shards", {}) if isinstance(doc, dict) else None
    if not isinstance(shards, dict):
        raise SpecDecodeError(f"{path}: untouched_shards is not an object")
    for name, digest in shards.items():
        if not SHARD_NAME.fullmatch(name):
            raise SpecDecodeError(f"{path}: untouched_shards names {name!r}, not a shard")
        if not (
            isinstance(digest, str)
            and digest.startswith("sha256:")
            and re.fullmatch(r"[0-9a-f]{64}", digest[7:])
        ):
            raise SpecDecodeError(f"{path}: untouched_shards.{name} is not sha256:<64 hex>")
    return dict(shards)


def rebuild_shard(
    parent_folder: str | Path,
    delta_folder: str | Path,
    shard: str,
    *,
    expected_parent: str | None = None,
) -> bytes:
    """The bytes of full shard `shard` that a delta folder rebuilds from its parent folder:
    decoded from the delta's shard (§10), or, for a shard the delta leaves alone (§2.2), the
    parent's shard after its header's sha256 and its tensors' recorded checksums match."""
    parent = (Path(parent_folder) / shard).read_bytes()
    recorded = untouched_shards(delta_folder).get(shard)
    if recorded is None:
        return decode_shard_file(
            Path(parent_folder) / shard, Path(delta_folder) / shard, expected_parent=expected_parent
        )
    if (Path(delta_folder) / shard).exists():
        raise SpecDecodeError(f"{shard}: both shipped and named untouched")
    (header_len,) = struct.unpack_from("<Q", parent)
    got = "sha256:" + hashlib.sha256(parent[: 8 + header_len]).hexdigest()
    if got != recorded:
        raise ChecksumError(f"{shard}: wrong parent: header sha256 {got} != {recorded}")
    header = json.loads(parent[8 : 8 + header_len])
    sums = json.loads(header["__metadata__"]["hotload.checksums"])
    data_start = 8 + header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        got_sum = adler32(parent[data_start + begin : data_start + end])
        if got_sum != _parse_checksum(sums.get(name), f"{shard}: {name}"):
            raise ChecksumError(f"{shard}: {name}: parent checksum {got_sum:08x} != recorded")
    return parent
