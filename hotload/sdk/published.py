"""Whether the snapshot published under an identity holds exactly some full weights, read from
the bucket's shard headers alone: a safetensors shard's header carries every tensor's adler32,
an arc_v2 delta shard's the header of the shard it rebuilds (`target_header`), and an untouched
shard's record the sha256 of the header it kept. So a trainer that publishes a step again (a
retry, a restart) learns whether it is the same snapshot without downloading the weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from hotload.arc.container import MAGIC, PREFIX_LEN, header_from_bytes
from hotload.bucket import Bucket
from hotload.errors import ObjectNotFoundError
from hotload.snapshot import layout
from hotload.snapshot.inherited import header_digest
from hotload.snapshot.reader import MAX_DATA_HEADER, data_header


async def remote_data_header(bucket: Bucket, key: str) -> bytes:
    """The header of data file `key` as stored (what `reader.data_header` reads of a local
    file): two ranged reads, the prefix and then the header."""
    prefix = await bucket.get_range_async(key, 0, PREFIX_LEN)
    if prefix.startswith(MAGIC) and len(prefix) == PREFIX_LEN:
        (length,) = struct.unpack("<Q", prefix[len(MAGIC) : len(MAGIC) + 8])
        start = PREFIX_LEN
    else:
        (length,) = struct.unpack("<Q", prefix[:8])
        start = 8
    if length > MAX_DATA_HEADER:
        return prefix  # not a data file this check can match: it differs
    return prefix[:start] + await bucket.get_range_async(key, start, start + length)


async def first_difference(bucket: Bucket, identity: str, full_dir: Path) -> str | None:
    """The first shard of full snapshot folder `full_dir` whose weights differ from what
    `identity` holds in `bucket` (or a shard only one side has); None when every shard is the
    same."""
    prefix = f"{identity}/"
    sizes = {i.key.removeprefix(prefix): i.size for i in await bucket.list_async(identity)}
    untouched: dict[str, str] = {}
    if layout.INHERITED_FILE in sizes:
        try:
            doc = json.loads((await bucket.get_async(prefix + layout.INHERITED_FILE)).data)
            untouched = dict(doc.get("untouched_shards") or {})
        except (ObjectNotFoundError, ValueError, AttributeError):
            return layout.INHERITED_FILE
    local = sorted(p.name for p in full_dir.glob("*.safetensors"))
    remote = sorted(n for n in sizes if n.endswith(".safetensors") and "/" not in n)
    differ = (set(remote) | set(untouched)) ^ set(local)
    if differ:
        return sorted(differ)[0]
    for name in local:
        mine = data_header(full_dir / name)
        if name in untouched:
            if untouched[name] != header_digest(mine):
                return name
            continue
        theirs = await remote_data_header(bucket, prefix + name)
        if theirs.startswith(MAGIC):
            target = header_from_bytes(theirs, sizes[name], name).fields.get("target_header")
            if target != mine[8:].decode():
                return name
        elif theirs != mine:
            return name
    return None
