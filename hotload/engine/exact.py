"""Exact numerics: a token's logits that do not depend on what else is computed with it.

BLAS picks other kernels, with other rounding, for a few row counts: `probe_row_sizes` finds
the row counts at which every row of a linear layer gets the same bits as in a large block, and
`pad_rows_linear` pads each linear call with zero rows up to the nearest one. Attention runs one
query at a time over exactly that query's keys (`EXACT_ATTENTION`, no padding, no masked
columns). See `hotload.engine.model` for how the runner uses them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

EXACT_ATTENTION = "hotload_exact"
SMALL_ROWS = 32  # row counts up to this are probed one by one (see `probe_row_sizes`)
MAX_ROWS = 128  # linear layers run on at most this many rows at a time

# Left padding of each row of the batch being run, for the exact attention below. Each engine
# runs its model on one worker thread, so a thread-local keeps engines in one process apart.
_LAYOUT = threading.local()


def set_row_pads(pads: list[int]) -> None:
    """Tell the exact attention how much left padding each row of the next forward pass has."""
    _LAYOUT.pads = pads


def _exact_attention(  # noqa: PLR0917 (transformers' attention signature)
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention one query at a time over exactly its own keys (see module docstring)."""
    pads: list[int] = _LAYOUT.pads
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    out = query.new_empty(batch, q_len, heads, dim)
    for b in range(batch):
        keys = key[b, :, pads[b] :]
        values = value[b, :, pads[b] :]
        past = keys.shape[1] - q_len
        for i in range(q_len):
            n = past + i + 1
            # Query heads h*group..h*group+group-1 share key/value head h (grouped-query attention).
            q = query[b, :, i].reshape(kv_heads, group, dim)
            scores = torch.matmul(q, keys[:, :n].transpose(1, 2)) * scale
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[b, i] = torch.matmul(weights, values[:, :n]).reshape(heads, dim)
    return out, None


def register_exact_attention() -> None:
    """Make `EXACT_ATTENTION` an attention implementation transformers models can use."""
    from transformers import AttentionInterface

    AttentionInterface.register(EXACT_ATTENTION, _exact_attention)


def pad_rows_linear(module: nn.Linear, sizes: Sequence[int], max_rows: int) -> None:
    """Make `module` compute in blocks of at most `max_rows` rows, a block of r rows padded with
    zero rows up to the smallest size in `sizes` (ascending) that is >= r."""
    weight_owner = module
    target = [next((s for s in sizes if s >= r), r) for r in range(max_rows + 1)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        outs = []
        for start in range(0, flat.shape[0], max_rows):
            chunk = flat[start : start + max_rows]
            rows = chunk.shape[0]
            if target[rows] > rows:
                chunk = torch.cat([chunk, chunk.new_zeros(target[rows] - rows, chunk.shape[1])])
            outs.append(nn.functional.linear(chunk, weight_owner.weight, weight_owner.bias)[:rows])
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    module.forward = forward  # type: ignore[method-assign,assignment]


def probe_row_sizes(
    weights: Sequence[torch.Tensor], max_rows: int = MAX_ROWS, small: int = SMALL_ROWS
) -> list[int] | None:
    """Block sizes at which `F.linear` gives each row the bits it gets in a block of `max_rows`.

    BLAS switches kernels (and rounding) among small row counts, so every size up to `small`
    is tried; larger blocks are spot-checked and stand for all sizes above `small` (the result
    then ends with `small + 1`). None when a large block already disagrees: no padding makes
    this BLAS batch-invariant.
    """
    gen = torch.Generator().manual_seed(0)
    good = set(range(1, small + 1))
    seen: set[tuple[tuple[int, ...], torch.dtype]] = set()
    # Smallest weights first: sizes they rule out are not tried again on the big ones.
    for w in sorted(weights, key=lambda t: t.numel()):
        sig = (tuple(w.shape), w.dtype)
        if sig in seen or w.ndim != 2:
            continue
        seen.add(sig)
        x = torch.randn(max_rows, w.shape[1], generator=gen).to(w.device, w.dtype)
        ref = nn.functional.linear(x, w)

        def same(
            m: int, offset: int, w: torch.Tensor = w, x: torch.Tensor = x, ref: torch.Tensor = ref
        ) -> bool:
            rows = slice(offset, offset + m)
            return torch.equal(nn.functional.linear(x[rows], w), ref[rows])

        large = [m for m in (small + 1, 50, 64, 100, max_rows - 5) if small < m <= max_rows - 5]
        if not all(same(m, offset) for m in large for offset in (0, 5)):
            return None
        # Offset 3: a block's rows must also match rows that sat elsewhere in the large block.
        good = {m for m in good if same(m, 3)}
    return [*sorted(good), small + 1]
