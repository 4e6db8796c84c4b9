"""The arc_v2 shard container: magic, a zstd-compressed JSON header, then chunk payloads.

Layout (all integers little-endian), specified byte for byte in docs/arc_v2.md:
    0   8 bytes  magic b"\\x89ARCv2\\r\\n"
    8   u64      H, the length of the header frame
    16  u32      CRC-32 (zlib) of the H header-frame bytes
    20  H bytes  a zstd frame holding the UTF-8 JSON header
    20+H ...     payload: chunk streams, addressed by offsets relative to this point
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from hotload.arc import streams as st
from hotload.errors import CorruptDeltaError, PayloadTooLargeError
from hotload.parse_cache import parsed, remember

MAGIC = b"\x89ARCv2\r\n"
FORMAT = "arc_v2"
LAYOUT_VERSION = 1
PREFIX_LEN = len(MAGIC) + 8 + 4
# A header that claims more than this is refused before it is decompressed.
MAX_HEADER_BYTES = 64 * 1024 * 1024


def is_arc_file(path: Path) -> bool:
    """Tell whether `path` starts with the arc_v2 magic."""
    try:
        with path.open("rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


@dataclass
class ArcHeader:
    """The decoded header of one delta shard, plus where its payload starts in the file."""

    fields: dict[str, Any]
    payload_offset: int
    file_size: int

    @property
    def parent(self) -> str | None:
        """Identity of the snapshot this delta was made against."""
        value = self.fields.get("parent")
        return value if isinstance(value, str) else None

    @property
    def identity(self) -> str | None:
        """Identity of the snapshot this delta rebuilds, when the encoder knew it."""
        value = self.fields.get("identity")
        return value if isinstance(value, str) else None


def write_prefix(header: dict[str, Any]) -> bytes:
    """Serialize magic + header length + compressed header for `header`."""
    body = json.dumps(header, separators=(",", ":")).encode()
    frame = zstandard.ZstdCompressor(level=9, write_content_size=True).compress(body)
    return MAGIC + struct.pack("<QI", len(frame), zlib.crc32(frame)) + frame


def read_header(path: Path) -> ArcHeader:
    """Read and check the header of a delta shard; errors name the file."""
    name = path.name
    try:
        with path.open("rb") as f:
            prefix = f.read(PREFIX_LEN)
            if len(prefix) < PREFIX_LEN or prefix[: len(MAGIC)] != MAGIC:
                raise CorruptDeltaError("not an arc_v2 delta (bad magic or truncated)", shard=name)
            (frame_len,) = struct.unpack("<Q", prefix[len(MAGIC) : len(MAGIC) + 8])
            f.seek(0, 2)
            size = f.tell()
            if PREFIX_LEN + frame_len > size:
                raise CorruptDeltaError(
                    "header runs past the end of the file (truncated)", shard=name
                )
            f.seek(PREFIX_LEN)
            frame = f.read(frame_len)
    except FileNotFoundError:
        raise CorruptDeltaError("file not found", shard=name) from None
    return header_from_bytes(prefix + frame, size, name)


def header_from_bytes(stored: bytes, size: int, name: str) -> ArcHeader:
    """Check and parse the header of a delta shard of `size` bytes from `stored`, its bytes as
    the file holds them (magic, length, CRC-32 and frame: what `data_header` reads), so a
    header read once for a digest is not read again; errors name the shard `name`."""
    prefix = stored[:PREFIX_LEN]
    if len(prefix) < PREFIX_LEN or prefix[: len(MAGIC)] != MAGIC:
        raise CorruptDeltaError("not an arc_v2 delta (bad magic or truncated)", shard=name)
    frame_len, frame_crc = struct.unpack("<QI", prefix[len(MAGIC) :])
    frame = stored[PREFIX_LEN:]
    if PREFIX_LEN + frame_len > size or len(frame) != frame_len:
        raise CorruptDeltaError("header runs past the end of the file (truncated)", shard=name)
    if zlib.crc32(frame) != frame_crc:
        raise CorruptDeltaError("header is corrupted (CRC-32 mismatch)", shard=name)
    known = parsed("header", frame)
    if known is not None:
        return ArcHeader(known, PREFIX_LEN + frame_len, size)
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CorruptDeltaError(f"header is not a zstd frame ({exc})", shard=name) from None
    if declared < 0:
        raise CorruptDeltaError("header frame does not declare its size", shard=name)
    if declared > MAX_HEADER_BYTES:
        raise PayloadTooLargeError(
            f"header declares {declared} bytes (limit {MAX_HEADER_BYTES})", shard=name
        )
    raw = st.decompress_stream(st.CODEC_ZSTD, frame, declared, f"{name}: header")
    try:
        fields = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptDeltaError(f"header is not valid JSON ({exc})", shard=name) from None
    if not isinstance(fields, dict):
        raise CorruptDeltaError("header is not a JSON object", shard=name)
    if fields.get("format") != FORMAT:
        raise CorruptDeltaError(
            f"format is {fields.get('format')!r}, expected {FORMAT!r}", shard=name
        )
    version = fields.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version != LAYOUT_VERSION:
        raise CorruptDeltaError(
            f"layout version {fields.get('version')!r} is not supported (this build reads "
            f"{LAYOUT_VERSION}); upgrade hotload",
            shard=name,
        )
    remember("header", frame, fields)
    return ArcHeader(fields, PREFIX_LEN + frame_len, size)
