"""Adler-32's partial sums computed from the definition, the expected values of the tests of
`hotload_patch.served` (never from the code under test)."""

from __future__ import annotations

import numpy as np
import torch

from hotload_patch.sums import MOD


def by_definition(raw: np.ndarray, elements: torch.Tensor, width: int) -> tuple[int, int]:
    """Adler-32's partial sums of the bytes of `elements` (indices into the little-endian
    buffer `raw`), from the definition: the bytes' sum, and each byte times its distance from
    the buffer's end."""
    at = (elements.reshape(-1, 1).numpy() * width + np.arange(width)).reshape(-1)
    held = raw[at].astype(np.int64)
    return int(held.sum()) % MOD, int((held * (raw.size - at)).sum()) % MOD
