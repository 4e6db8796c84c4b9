"""The running batch's KV cache: left-padded rows that step together.

Each row is one generation. Rows join with different lengths, so the batch keeps its KV as
`[rows, kv_heads, columns, head_dim]` per layer with each row's tokens right-aligned and
`pads[row]` unused columns on the left. A row that finishes is removed and the columns every
remaining row leaves unused are trimmed away, so the batch never carries dead width for long.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
KVCache = list[LayerKV]  # one (keys, values) pair per layer


def kv_length(kv: KVCache) -> int:
    """Number of positions (columns) in a KV cache."""
    return int(kv[0][0].shape[2]) if kv else 0


def crop(kv: KVCache, length: int) -> KVCache:
    """The first `length` positions of a single-row KV cache (views, no copy)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = (t.shape[0], t.shape[1], n, t.shape[3])
    return torch.cat([t.new_zeros(shape), t], dim=2)


@dataclass
class BatchKV:
    """Left-padded KV cache of the running batch, with each row's padding."""

    layers: KVCache = field(default_factory=list)
    pads: list[int] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Number of rows (generations) in the batch."""
        return len(self.pads)

    @property
    def columns(self) -> int:
        """Width of the cache: the longest row's length."""
        return kv_length(self.layers)

    def lengths(self) -> list[int]:
        """Real (unpadded) length of every row: the position of its next token."""
        width = self.columns
        return [width - p for p in self.pads]

    def add(self, kv: KVCache) -> None:
        """Append one row (a single-row cache without padding) to the batch."""
        length = kv_length(kv)
        if not self.pads:
            self.layers = list(kv)
            self.pads = [0]
            return
        width = max(self.columns, length)
        grow = width - self.columns
        self.layers = [
            (
                torch.cat([_left_pad(bk, grow), _left_pad(k, width - length)], dim=0),
                torch.cat([_left_pad(bv, grow), _left_pad(v, width - length)], dim=0),
            )
            for (bk, bv), (k, v) in zip(self.layers, kv, strict=True)
        ]
        self.pads = [p + grow for p in self.pads] + [width - length]

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order) and trim columns no remaining row uses."""
        if not rows:
            self.layers, self.pads = [], []
            return
        if rows == list(range(self.rows)):
            return
        index = torch.tensor(rows, device=self.layers[0][0].device)
        pads = [self.pads[r] for r in rows]
        trim = min(pads)
        self.layers = [
            (k.index_select(0, index)[:, :, trim:], v.index_select(0, index)[:, :, trim:])
            for k, v in self.layers
        ]
        self.pads = [p - trim for p in pads]

    def row(self, i: int) -> KVCache:
        """Row `i` as its own unpadded cache (a copy, so the batch's memory can be freed)."""
        p = self.pads[i]
        return [(k[i : i + 1, :, p:].clone(), v[i : i + 1, :, p:].clone()) for k, v in self.layers]
