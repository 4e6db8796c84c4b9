"""The arc_v2 codec: exact, checksummed, per-tensor deltas between full snapshots.

The names below are imported on first use. The snapshot format reads this package's container
(`checksum`, `container`) while the codec reads snapshots: importing the codec eagerly here
would pull all of it into the middle of any snapshot module's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name == "normalize_checksum_format":
        from hotload.arc import checksum

        return checksum.normalize_checksum_format
    if name in ("MAGIC", "is_arc_file"):
        from hotload.arc import container

        return getattr(container, name)
    if name in __all__:
        from hotload.arc import codec

        return getattr(codec, name)
    raise AttributeError(f"module 'hotload.arc' has no attribute {name!r}")
