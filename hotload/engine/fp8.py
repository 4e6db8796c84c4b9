"""Block-FP8 snapshots in the reference engine: kept as stored, computed with dequantized.

A block-FP8 snapshot (`hotload.snapshot.fp8`, `docs/fp8.md`) holds a recipe's weights as
F8_E4M3 values plus one `weight_scale_inv` per block. The engine computes in its own dtype, so
each such weight's parameter holds `values * scale_inv` block by block, converted to that dtype
(`hotload.snapshot.fp8.dequantize`, the one definition the writer and the tests use too). The
values and scales themselves stay held as the snapshot stores them (`Fp8Store`): a sparse patch
writes the changed FP8 elements and scales there, where the checksums are the checkpoint's own,
and `Fp8Store.refresh` then recomputes only what those writes touch in the parameters (an element
whose value moved; every element of a block whose scale moved). The same multiplication in the
same order as a full load's, so a patched engine holds the bits a full load of the result gives.

Per-tensor FP8 (no `weight_block_size`) is refused by name: nothing here dequantizes it yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from hotload.snapshot.fp8 import SCALE_SUFFIX, dequantize, scale_of
from hotload_patch.placement import Slot
from hotload_patch.staging import region_view


@dataclass
class Fp8Store:
    """The FP8 weights and their scales as the snapshot stores them, by checkpoint name, and
    the block shape; empty for a snapshot without FP8."""

    block: tuple[int, int] = (128, 128)
    stored: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def weights(self) -> list[str]:
        """The FP8 weights held (their scales are held under `scale_of`)."""
        return [n for n in self.stored if n + SCALE_SUFFIX in self.stored]

    def dequantized(self, weight: str, dtype: torch.dtype) -> torch.Tensor:
        """FP8 weight `weight` as the engine computes with it, in `dtype`."""
        values, scale = self.stored[weight], self.stored[scale_of(weight)]
        weight_values: torch.Tensor = dequantize(values, scale, self.block)
        return weight_values.to(dtype)

    def refresh(
        self,
        written: Iterable[tuple[str, torch.Tensor]],
        targets: Mapping[str, torch.Tensor],
        converted: Mapping[str, list[Slot]],
    ) -> int:
        """Recompute the parameter elements that the writes (held name, flat positions written)
        into FP8 values and scales move: an element per value written, a whole block per scale
        written. `targets` and `converted` are the model's (`ModelRunner`). Returns the elements
        recomputed."""
        elements: dict[str, list[torch.Tensor]] = {}
        blocks: dict[str, list[torch.Tensor]] = {}
        for name, index in written:
            if name not in self.stored:
                continue
            weight = name.removesuffix(SCALE_SUFFIX) if name.endswith(SCALE_SUFFIX) else name
            if weight not in self.stored or scale_of(weight) not in self.stored:
                continue
            (blocks if name != weight else elements).setdefault(weight, []).append(index)
        done = 0
        with torch.no_grad():
            for weight in sorted(elements.keys() | blocks.keys()):
                views = self._views(weight, targets, converted)
                values, scale = self.stored[weight], self.stored[scale_of(weight)]
                cols = values.shape[1]
                for index in elements.get(weight, []):
                    flat = index.to(values.device).long()
                    rows, columns = flat // cols, flat % cols
                    # As `dequantize` computes each element: float32 value times float32 scale.
                    new = values[rows, columns].to(torch.float32) * scale[
                        rows // self.block[0], columns // self.block[1]
                    ].to(torch.float32)
                    for view in views:
                        view.index_put_((rows, columns), new.to(view.dtype))
                    done += int(flat.numel())
                for index in blocks.get(weight, []):
                    for position in sorted({int(p) for p in index.reshape(-1).tolist()}):
                        done += self._refresh_block(weight, position, scale.shape[1], views)
        return done

    def _refresh_block(
        self, weight: str, position: int, blocks_per_row: int, views: list[torch.Tensor]
    ) -> int:
        """Recompute block `position` (flat, in the scales) of `weight` in every view."""
        values, scale = self.stored[weight], self.stored[scale_of(weight)]
        br, bc = divmod(position, blocks_per_row)
        r0, c0 = br * self.block[0], bc * self.block[1]
        r1, c1 = min(r0 + self.block[0], values.shape[0]), min(c0 + self.block[1], values.shape[1])
        block = values[r0:r1, c0:c1].to(torch.float32) * scale[br, bc].to(torch.float32)
        for view in views:
            view[r0:r1, c0:c1].copy_(block.to(view.dtype))
        return (r1 - r0) * (c1 - c0)

    @staticmethod
    def _views(
        weight: str, targets: Mapping[str, torch.Tensor], converted: Mapping[str, list[Slot]]
    ) -> list[torch.Tensor]:
        """Where the model computes with `weight`: its parameter, or its regions of one."""
        slots = converted.get(weight)
        if slots:
            return [region_view(targets[s.param], s.dst) for s in slots]
        return [targets[weight]]
