"""hotload_patch: the engine side of sparse hot loads.

A sparse hot load writes only what a delta changed into the weights an engine serves, in place.
This package is what runs *inside* the engine's process to do that: it reads a patch file
(`format`), finds where each checkpoint tensor lives among the engine's parameters (`placement`:
fused projections, tensor-parallel shards and padded vocabularies included), checksums the
served weights in checkpoint terms (`sums`), stages the writes while the old weights serve and
writes them during a pause (`staging`). `vllm` is the vLLM worker extension built on it; the
reference engine (`hotload.engine`) uses the same modules in its own process.

It imports only the standard library, numpy and (where it touches weights) torch, never
`hotload`: the loader copies this package into the engine's container, where hotload is not
installed (docs/engines.md, "Sparse hot loads").
"""

from __future__ import annotations

from hotload_patch.errors import PatchError

#: The protocol between the loader and this package inside an engine; the loader refuses an
#: engine that speaks another one (a stale copy on the volume, a mismatched image).
PROTOCOL = 2

__all__ = ["PROTOCOL", "PatchError"]
