"""Block-FP8 snapshots in the reference engine: kept as stored, computed with dequantized.

A block-FP8 snapshot (`hotload.snapshot.fp8`, `docs/fp8.md`) holds a recipe's weights as
F8_E4M3 values plus one `weight_scale_inv` per block. The engine computes in its own dtype, so
each such weight's parameter holds `values * scale_inv` block by block, converted to that dtype
(`hotload.snapshot.fp8.dequantize`, the one definition the writer and the tests use too). The
values and scales themselves stay held as the snapshot stores them (`Fp8Store`): a sparse patch
writes the changed FP8 elements and scales there, where the checksums are the checkpoint's own.
While the patch stages (the old weights serving), `Fp8Store.plan` computes the parameter elements
those writes move (an element whose value moved; every element of a block whose scale moved) from
the values and scales the patch will leave; at the pause `Fp8Refresh.apply` only writes them. The
same multiplication in the same order as a full load's, so a patched engine holds the bits a full
load of the result gives. Work and memory follow the changed elements and blocks, not the model.

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

    def plan(
        self,
        writes: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
        targets: Mapping[str, torch.Tensor],
        converted: Mapping[str, list[Slot]],
    ) -> Fp8Refresh:
        """The parameter elements that a patch's writes (held name, flat positions, new values)
        into FP8 values and scales move, with their new values; reads only, so it runs while the
        old weights serve. `targets` and `converted` are the model's (`ModelRunner`)."""
        values_in: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        scales_in: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, index, new in writes:
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight not in self.stored or scale_of(weight) not in self.stored:
                continue  # not an FP8 weight or its scale: the patch writes the parameter itself
            into = scales_in if name != weight else values_in
            into.setdefault(weight, []).append((index.reshape(-1).long(), new.reshape(-1)))
        refresh = Fp8Refresh()
        with torch.no_grad():
            for weight in sorted(values_in.keys() | scales_in.keys()):
                values, scale = self.stored[weight], self.stored[scale_of(weight)]
                dtype = self._views(weight, targets, converted)[0].dtype
                new_scale, blocks = scale, torch.empty(0, dtype=torch.long, device=scale.device)
                if weight in scales_in:
                    blocks = torch.cat([i for i, _ in scales_in[weight]])
                    new_scale = scale.clone()  # a block's share of the weight: small
                    new_scale.view(-1)[blocks] = torch.cat([v for _, v in scales_in[weight]])
                positions = [i for i, _ in values_in.get(weight, [])]
                flat = torch.unique(torch.cat([*positions, self._block_elements(blocks, values)]))
                # The values the patch leaves at those positions: as held, then the written ones.
                moved = values.reshape(-1)[flat]
                for index, new in values_in.get(weight, []):
                    moved[torch.searchsorted(flat, index)] = new
                rows, cols = flat // values.shape[1], flat % values.shape[1]
                # As `dequantize` computes each element: float32 value times float32 scale.
                scales = new_scale[rows // self.block[0], cols // self.block[1]]
                result = (moved.to(torch.float32) * scales.to(torch.float32)).to(dtype)
                refresh.writes.append((weight, rows, cols, result))
        return refresh

    def _block_elements(self, blocks: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The flat positions in `values` of every element of the given blocks (flat positions
        in the scales), clipped at the weight's edges."""
        rows, cols = values.shape
        per_row = -(-cols // self.block[1])
        r = (blocks // per_row)[:, None, None] * self.block[0]
        c = (blocks % per_row)[:, None, None] * self.block[1]
        r = r + torch.arange(self.block[0], device=blocks.device)[None, :, None]
        c = c + torch.arange(self.block[1], device=blocks.device)[None, None, :]
        inside = (r < rows) & (c < cols)
        return (r * cols + c)[inside]

    @staticmethod
    def _views(
        weight: str, targets: Mapping[str, torch.Tensor], converted: Mapping[str, list[Slot]]
    ) -> list[torch.Tensor]:
        """Where the model computes with `weight`: its parameter, or its regions of one."""
        slots = converted.get(weight)
        if slots:
            return [region_view(targets[s.param], s.dst) for s in slots]
        return [targets[weight]]


@dataclass
class Fp8Refresh:
    """What a patch moves in an FP8 snapshot's parameters, computed before the pause
    (`Fp8Store.plan`): per FP8 weight, the positions (rows, columns) and their new values."""

    writes: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def apply(
        self, targets: Mapping[str, torch.Tensor], converted: Mapping[str, list[Slot]]
    ) -> None:
        """Write the new values where the model computes with each weight (at the pause)."""
        with torch.no_grad():
            for weight, rows, cols, values in self.writes:
                for view in Fp8Store._views(weight, targets, converted):
                    view.index_put_((rows, cols), values)
