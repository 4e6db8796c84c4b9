"""The arc_v2 codec: exact, checksummed, per-tensor deltas between full snapshots."""

from hotload.arc.checksum import normalize_checksum_format
from hotload.arc.codec import (
    DEFAULT_CHUNK_ELEMENTS,
    CodecStats,
    ShardStats,
    VerifyReport,
    decode,
    decode_shard,
    encode,
    encode_shard,
    verify,
)
from hotload.arc.container import MAGIC, is_arc_file

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MAGIC",
    "CodecStats",
    "ShardStats",
    "VerifyReport",
    "decode",
    "decode_shard",
    "encode",
    "encode_shard",
    "is_arc_file",
    "normalize_checksum_format",
    "verify",
]
