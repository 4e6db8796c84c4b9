"""The engine side of sparse hot loads (`hotload_patch`), without an engine.

Geometry (`sums.Region`) against torch's own `as_strided`; adler32 in pieces (`sums`) against
`zlib.adler32` of the whole; `placement.LoaderHost` on small torch models whose `load_weights`
behave like vLLM's (fused q/k/v and gate/up, padded vocabularies, tensor-parallel shards,
replicated norms, a tied lm_head: `support.patch_models`); then real patch files
(`hotload.arc.patch.prepare_patch` over real snapshots and arc_v2 deltas) staged, verified and
written on several simulated ranks, which must then hold, bit for bit, what a full load of the
child snapshot through the same loaders gives. Then `session.Patcher` over an `IdentityHost`,
and the vLLM worker extension's JSON protocol on simulated ranks (no vLLM needed).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hotload.arc import encode
from hotload.arc.patch import prepare_patch
from hotload.snapshot import write_snapshot
from hotload_patch import PROTOCOL, PatchError, served, staging
from hotload_patch import vllm as vllm_extension
from hotload_patch.checkpoint import checkpoint_specs
from hotload_patch.format import PatchFile, PatchTensor
from hotload_patch.placement import IdentityHost, LoaderHost, Slot
from hotload_patch.session import Patcher, derive
from hotload_patch.staging import Staged, region_view
from hotload_patch.sums import (
    MOD,
    Region,
    RegionSum,
    bytes_partial,
    combine,
    combine_regions,
    delta_partial,
    rows_partial,
    shift,
    span_partial,
)
from hotload_patch.verify import TensorCheck, checks_of, verify
from hotload_patch.vllm import HotloadWorkerExtension
from support.patch_models import (
    CFG,
    INT_OF_WIDTH,
    ScriptedModel,
    ToyConfig,
    ToyTPModel,
    bits,
    checkpoint_weights,
    load_ranks,
    read_checkpoint,
    same_bits,
)
from support.patches import Chain, build_chain, flip_first_difference, rewrite_patch, set_first
from support.snapshots import CONFIG

_NP_UINTS: dict[int, np.dtype[Any]] = {w: np.dtype(f"<u{w}") for w in (1, 2, 4, 8)}


def param_bits(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's bits, by name."""
    return {n: bits(p).clone() for n, p in model.named_parameters()}


# --- 1. Region geometry against as_strided ------------------------------------------------------


@st.composite
def views(draw: st.DrawFn, steps: bool) -> torch.Tensor:
    """A view of `arange` (each element's value is its storage position) made by narrow,
    transpose, select and unsqueeze, and with `steps` by step slices too."""
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim))
    view = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    kinds = ["narrow", "transpose", "select", "unsqueeze"] + (["step"] if steps else [])
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(kinds))
        dim = draw(st.integers(0, view.dim() - 1))
        size = view.shape[dim]
        if kind == "narrow":
            start = draw(st.integers(0, size - 1))
            view = view.narrow(dim, start, draw(st.integers(1, size - start)))
        elif kind == "transpose":
            view = view.transpose(dim, draw(st.integers(0, view.dim() - 1)))
        elif kind == "select" and view.dim() > 1:
            view = view.select(dim, draw(st.integers(0, size - 1)))
        elif kind == "unsqueeze":
            view = view.unsqueeze(dim)
        elif kind == "step":
            index: list[slice] = [slice(None)] * view.dim()
            index[dim] = slice(draw(st.integers(0, size - 1)), None, draw(st.integers(2, 5)))
            view = view[tuple(index)]
    return view


def region_of(view: torch.Tensor) -> Region:
    """The `Region` of a view of a contiguous tensor."""
    return Region(int(view.storage_offset()), tuple(view.shape), tuple(view.stride()))


def _check_region(view: torch.Tensor) -> Region:
    base = view._base if view._base is not None else view
    region = region_of(view)
    # Ground truth: torch's own as_strided over the storage positions.
    truth = base.reshape(-1).as_strided(region.sizes, region.strides, region.offset)
    assert torch.equal(truth, view)
    values = view.reshape(-1).numpy()
    assert region.numel == values.size

    index = np.arange(region.numel, dtype=np.int64)
    np.testing.assert_array_equal(region.offsets_of(index), values)
    first = region.numel // 3
    np.testing.assert_array_equal(
        region.element_offsets(first, region.numel - first), values[first:]
    )

    consecutive = bool(np.array_equal(values, values[0] + index))
    assert (
        (region.span() == (int(values[0]), values.size)) if consecutive else region.span() is None
    )

    nested = region.nested()
    if nested:
        assert np.unique(values).size == values.size
        positions = np.arange(-3, base.numel() + 3, dtype=np.int64)
        inside, where = region.locate(positions)
        np.testing.assert_array_equal(inside, np.isin(positions, values))
        row_major = np.empty(base.numel(), dtype=np.int64)
        row_major[values] = index
        np.testing.assert_array_equal(where, row_major[positions[inside]])
        # `select` (ascending positions) takes the same elements, as a slice when it can.
        chosen, local = region.select(positions)
        np.testing.assert_array_equal(positions[chosen], positions[inside])
        np.testing.assert_array_equal(local, where)
    assert Region.from_json(region.to_json()) == region
    return region


@settings(max_examples=150, deadline=None)
@given(view=views(steps=False))
def test_region_of_narrow_transpose_select_views_matches_as_strided(view: torch.Tensor) -> None:
    """Every view a narrow, transpose, select or unsqueeze makes is nested, and its region
    reads offsets, spans and positions back exactly as torch lays the view out."""
    assert _check_region(view).nested()


@settings(max_examples=150, deadline=None)
@given(view=views(steps=True))
def test_region_of_any_slice_view_matches_as_strided(view: torch.Tensor) -> None:
    """With step slices too: what nested() accepts is one-to-one and locate() inverts it."""
    _check_region(view)


@pytest.mark.parametrize(
    ("shape", "index"),
    [
        ((4, 6), (slice(None), slice(None, None, 5))),  # sizes (4, 2), strides (6, 5)
        ((5, 3), (slice(None), slice(None, None, 2))),  # odd width, every other column
        ((7,), (slice(1, None, 4),)),
    ],
)
def test_nested_accepts_step_slices(shape: tuple[int, ...], index: tuple[slice, ...]) -> None:
    """`Region.nested` says it is true of every view a slice makes (its docstring): step slices
    of a contiguous tensor are one-to-one and `locate` inverts them, so they must count."""
    view = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)[index]
    region = _check_region(view)
    inside, where = region.locate(view.reshape(-1).numpy())
    assert inside.all()
    np.testing.assert_array_equal(where, np.arange(region.numel))
    assert region.nested()


def test_region_whole_and_overlap() -> None:
    whole = Region.whole((3, 4))
    assert (whole.span(), whole.nested(), whole.numel) == ((0, 12), True, 12)
    # A broadcast (stride 0) or an overlapping view is not nested.
    assert not Region(0, (3, 4), (0, 1)).nested()
    assert not Region(0, (3, 4), (2, 1)).nested()
    for bad in ([0, [1], [1, 2]], [0, (1,), [1]], "x", [0, [1], ["a"]]):
        with pytest.raises(ValueError, match="not a region"):
            Region.from_json(bad)


# --- 2. adler32 in pieces ----------------------------------------------------------------------


def _cuts(data: st.DataObject, n: int, pieces: int) -> list[tuple[int, int]]:
    """`pieces` (at most `n`) consecutive non-empty ranges that cover 0 .. n."""
    inner = data.draw(
        st.lists(st.integers(1, n - 1), unique=True, max_size=min(pieces, n) - 1)
        if n > 1
        else st.just([])
    )
    bounds = [0, *sorted(inner), n]
    return list(pairwise(bounds))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 70),
    width=st.sampled_from([1, 2, 4]),
    pieces=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_partial_sums_of_shards_combine_into_adler32(
    *, rows: int, cols: int, width: int, pieces: int, seed: int, data: st.DataObject
) -> None:
    """A tensor of rows x cols elements of `width` bytes, cut three ways: row blocks
    (column-parallel shards), column blocks of every row (row-parallel shards), and whole
    (a replicated weight, on two ranks). Each way combines into the adler32 of the whole."""
    buf = np.random.default_rng(seed).integers(0, 256, rows * cols * width, dtype=np.uint8)
    total = buf.size
    want = zlib.adler32(buf.tobytes())
    grid = buf.reshape(rows, cols * width)
    sums: list[RegionSum] = []

    for r0, r1 in _cuts(data, rows, pieces):
        block = grid[r0:r1]
        a, b = span_partial(zlib.adler32(block.tobytes()), r0 * cols * width, block.size, total)
        assert (a, b) == bytes_partial(block.tobytes(), r0 * cols * width, total)
        sums.append(RegionSum("column", Region(r0 * cols, (r1 - r0, cols), (cols, 1)), a, b))

    for c0, c1 in _cuts(data, cols, pieces):
        starts = np.arange(rows, dtype=np.int64) * cols * width + c0 * width
        a, b = rows_partial(grid[:, c0 * width : c1 * width], starts, total)
        sums.append(RegionSum("row", Region(c0, (rows, c1 - c0), (cols, 1)), a, b))

    a, b = bytes_partial(buf, 0, total)
    sums += [RegionSum("replicated", Region.whole((rows, cols)), a, b)] * 2

    sizes = dict.fromkeys(("column", "row", "replicated"), (rows * cols, total))
    assert combine_regions(sums, sizes) == dict.fromkeys(sizes, want)
    assert combine(total, [(a, b)]) == want
    # Round trip through JSON, as the loader receives them from every rank.
    again = [RegionSum.from_json(s.to_json()) for s in sums]
    assert combine_regions(again, sizes) == dict.fromkeys(sizes, want)


def _shards(buf: np.ndarray, rows: int, cols: int) -> list[RegionSum]:
    total = buf.size
    half = rows // 2 * cols
    return [
        RegionSum(
            "t", Region(0, (rows // 2, cols), (cols, 1)), *bytes_partial(buf[:half], 0, total)
        ),
        RegionSum(
            "t",
            Region(half, (rows - rows // 2, cols), (cols, 1)),
            *bytes_partial(buf[half:], half, total),
        ),
    ]


def test_replicas_that_differ_are_a_parent_mismatch_and_gaps_a_weights_mismatch() -> None:
    buf = np.random.default_rng(1).integers(0, 256, 96, dtype=np.uint8)
    sizes = {"t": (96, 96)}
    shards = _shards(buf, 8, 12)
    assert combine_regions(shards, sizes) == {"t": zlib.adler32(buf.tobytes())}
    # The same shard on a second rank (a replica) agrees: fine.
    assert combine_regions([*shards, shards[0]], sizes) == {"t": zlib.adler32(buf.tobytes())}
    other = buf.copy()
    other[3] ^= 1
    replica = RegionSum("t", shards[0].region, *bytes_partial(other[:48], 0, 96))
    with pytest.raises(PatchError) as exc:
        combine_regions([*shards, replica], sizes)
    assert (exc.value.reason, exc.value.tensor) == ("parent_mismatch", "t")
    with pytest.raises(PatchError) as exc:
        combine_regions(shards[:1], sizes)
    assert (exc.value.reason, exc.value.tensor) == ("weights_mismatch", "t")
    # A tensor nobody holds is left out, not an error.
    assert combine_regions(shards, {**sizes, "u": (5, 5)}) == {"t": zlib.adler32(buf.tobytes())}


@settings(max_examples=80, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 40000),
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(0, 64),
)
def test_delta_partial_moves_adler32_as_the_edit_does(
    width: int, n: int, seed: int, k: int
) -> None:
    """Sparse edits in two pieces (two ranks' regions): shift() by their delta_partial sums is
    the adler32 of the edited buffer."""
    rng = np.random.default_rng(seed)
    dtype = _NP_UINTS[width]
    old = rng.integers(0, 2 ** (8 * width), n, dtype=np.uint64).astype(dtype)
    at = np.unique(rng.integers(0, n, k)).astype(np.int64)
    new = rng.integers(0, 2 ** (8 * width), at.size, dtype=np.uint64).astype(dtype)
    new[: at.size // 4] = old[at[: at.size // 4]]  # some "changes" write the value already there
    edited = old.copy()
    edited[at] = new
    total = n * width
    half = at.size // 2
    parts = [
        delta_partial(at[:half], old[at[:half]], new[:half], total),
        delta_partial(at[half:], old[at[half:]], new[half:], total),
    ]
    assert shift(zlib.adler32(old.tobytes()), parts) == zlib.adler32(edited.tobytes())


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_delta_partial_of_a_tensor_too_big_to_build(width: int) -> None:
    """Positions far past 2**32 (where position times change no longer fits 64 bits) move the
    sums as the definition says, computed here byte by byte in Python integers."""
    rng = np.random.default_rng(width)
    dtype = _NP_UINTS[width]
    at = np.sort(rng.choice(2**45, 5000, replace=False)).astype(np.int64) + 2**45
    # Every byte from 0 to 255: the products add up on one side instead of cancelling.
    old = np.zeros(at.size, dtype=dtype)
    new = np.full(at.size, 2 ** (8 * width) - 1, dtype=np.uint64).astype(dtype)
    total = (2**46 + 1) * width
    a = b = 0
    before_bytes, after_bytes = (v.view(np.uint8).reshape(-1, width) for v in (old, new))
    rows = zip(at.tolist(), before_bytes, after_bytes, strict=True)
    for e, before, after in rows:
        for j in range(width):
            d = int(after[j]) - int(before[j])
            a += d
            b += (total - e * width - j) * d
    assert delta_partial(at, old, new, total) == (a % MOD, b % MOD)


# --- 3. LoaderHost on vLLM-style loaders -------------------------------------------------------


def assert_slots_hold(model: nn.Module, name: str, tensor: torch.Tensor, slots: list[Slot]) -> None:
    """After a real load of `tensor`, each slot's dst elements of its parameter are its src
    elements of `tensor`, in the same order."""
    params = dict(model.named_parameters())
    flat = tensor.reshape(-1)
    for slot in slots:
        assert slot.tensor == name
        held = region_view(params[slot.param], slot.dst)
        want = flat.as_strided(slot.src.sizes, slot.src.strides, slot.src.offset)
        assert same_bits(held, want.to(held.dtype)), slot


@pytest.mark.parametrize(
    ("rank", "world", "cfg"),
    [
        (0, 1, CFG),
        (0, 2, CFG),
        (1, 2, CFG),
        (3, 4, CFG),
        # vLLM pads 40 to 64: rank 3 of 4 holds padding only.
        (3, 4, ToyConfig(vocab=40, vocab_padding=64)),
    ],
    ids=["1of1", "1of2", "2of2", "4of4", "4of4-padding-only"],
)
def test_loader_host_follows_fused_sharded_padded_and_tied_weights(
    rank: int, world: int, cfg: ToyConfig
) -> None:
    ckpt = {n: torch.from_numpy(a) for n, a in checkpoint_weights(cfg).items()}
    model = ToyTPModel(cfg, rank=rank, world=world)
    model.load_weights(ckpt.items())
    before = param_bits(model)
    host = LoaderHost(model)
    slots = {n: host.place(n, tuple(t.shape), "F32") for n, t in ckpt.items()}
    # Probing writes nothing.
    assert all(torch.equal(before[n], bits(p)) for n, p in model.named_parameters())
    assert slots["lm_head.weight"] == []
    for name, found in slots.items():
        assert_slots_hold(model, name, ckpt[name], found)
    h, n = cfg.hidden, world
    q, kv, inter = cfg.q // n, cfg.kv // n, cfg.inter // n
    attn = "model.layers.0.self_attn"
    qkv, qkv_bias = f"{attn}.qkv_proj.weight", f"{attn}.qkv_proj.bias"
    assert slots[f"{attn}.k_proj.weight"] == [
        Slot(
            f"{attn}.k_proj.weight",
            qkv,
            Region(rank * kv * h, (kv, h), (h, 1)),
            Region(q * h, (kv, h), (h, 1)),
        )
    ]
    assert slots[f"{attn}.v_proj.bias"] == [
        Slot(
            f"{attn}.v_proj.bias",
            qkv_bias,
            Region(rank * kv, (kv,), (1,)),
            Region(q + kv, (kv,), (1,)),
        )
    ]
    up = "model.layers.1.mlp.up_proj.weight"
    assert slots[up] == [
        Slot(
            up,
            "model.layers.1.mlp.gate_up_proj.weight",
            Region(rank * inter * h, (inter, h), (h, 1)),
            Region(inter * h, (inter, h), (h, 1)),
        )
    ]
    # Row-parallel: this rank's columns of every row.
    o = f"{attn}.o_proj.weight"
    assert slots[o] == [Slot(o, o, Region(rank * q, (h, q), (cfg.q, 1)), Region(0, (h, q), (q, 1)))]
    # Replicated: the whole tensor on every rank.
    norm = "model.norm.weight"
    assert slots[norm] == [Slot(norm, norm, Region(0, (h,), (1,)), Region(0, (h,), (1,)))]
    # The padded vocabulary: this rank's rows of the checkpoint, the padding written by none.
    per_rank = cfg.padded_vocab // n
    first = min(rank * per_rank, cfg.vocab)
    rows = min(per_rank, cfg.vocab - first)
    embed = "model.embed_tokens.weight"
    assert slots[embed] == [
        Slot(
            embed,
            embed,
            Region(first * h, (rows, h), (h, 1)),
            Region(0, (rows, h), (h, 1)),
        )
    ]
    # Every element of every parameter is written by exactly one slot, or is padding.
    params = host.parameters()
    cover = {p: np.zeros(t.numel(), dtype=np.int64) for p, t in params.items()}
    for found in slots.values():
        for slot in found:
            cover[slot.param][slot.dst.element_offsets(0, slot.dst.numel)] += 1
    pad = cover.pop(embed)
    assert all((c == 1).all() for c in cover.values())
    assert (pad[: rows * h] == 1).all() and (pad[rows * h :] == 0).all()


def _transposed(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded.t().contiguous())


def _setitem_rows(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data[2:5] = loaded


def _converted_narrow(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.narrow(0, 1, 3).copy_(loaded.narrow(0, 0, 3).to(param.dtype).clone().detach())


def _chunked(param: nn.Parameter, loaded: torch.Tensor) -> None:
    top, bottom = loaded.chunk(2, dim=0)
    param.data[3:].copy_(top)
    param.data[:3].copy_(bottom)


@pytest.mark.parametrize(
    ("loader", "param_shape", "probe_shape", "dtype"),
    [
        (_transposed, (4, 6), (6, 4), "F32"),
        (_setitem_rows, (6, 4), (3, 4), "F32"),
        (_converted_narrow, (6, 4), (5, 4), "BF16"),
        (_chunked, (6, 4), (6, 4), "F32"),
    ],
)
def test_loader_host_follows_views_of_the_checkpoint(
    loader: Callable[[nn.Parameter, torch.Tensor], None],
    param_shape: tuple[int, ...],
    probe_shape: tuple[int, ...],
    dtype: str,
) -> None:
    """Transposes, `__setitem__`, dtype conversions, clones and chunks move no value: the
    slots say where each checkpoint element lands, as a real load puts it there."""
    model = ScriptedModel(param_shape, loader)
    before = param_bits(model)
    slots = LoaderHost(model).place("w", probe_shape, dtype)
    assert slots and all(s.param == "weight" for s in slots)
    assert torch.equal(before["weight"], bits(model.weight))
    real = torch.randn(probe_shape).to(torch.bfloat16 if dtype == "BF16" else torch.float32)
    model.load_weights([("w", real)])
    assert_slots_hold(model, "w", real, slots)


def _times_two(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded * 2)


def _concatenated(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(torch.cat([loaded, loaded]))


def _mul_in_place(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)
    param.data.mul_(2)


def _imul(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)
    param.data *= 2


def _add_in_place(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.add_(loaded)


def _broadcast(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded[:1])


def _permuted_rows(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded[torch.tensor([2, 0, 1, 3, 5, 4])])


@pytest.mark.parametrize(
    ("loader", "probe_shape", "why"),
    [
        (_times_two, (6, 4), "computed from the checkpoint"),
        (_concatenated, (3, 4), "computed from the checkpoint"),
        (_mul_in_place, (6, 4), "modifies a parameter with mul_"),
        (_imul, (6, 4), "modifies a parameter with mul_"),
        (_add_in_place, (6, 4), "modifies a parameter with add_"),
        (_broadcast, (6, 4), "broadcasts"),
        (_permuted_rows, (6, 4), "computed from the checkpoint"),
    ],
)
def test_loader_host_refuses_loaders_that_compute_values(
    loader: Callable[[nn.Parameter, torch.Tensor], None], probe_shape: tuple[int, ...], why: str
) -> None:
    """New values from the checkpoint (arithmetic, cat, a gather, a broadcast) or a parameter
    changed in place by another op: no patch can follow them, and the probe changes nothing."""
    model = ScriptedModel((6, 4), loader)
    before = param_bits(model)
    with pytest.raises(PatchError) as exc:
        LoaderHost(model).place("w", probe_shape, "F32")
    assert (exc.value.reason, exc.value.tensor) == ("unmappable", "w")
    assert why in str(exc.value)
    assert torch.equal(before["weight"], bits(model.weight))


def _index_tensor_rows(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data[torch.arange(2, 5)] = loaded


def test_loader_host_places_setitem_through_an_index_tensor_where_it_writes() -> None:
    """`param[index_tensor] = loaded` (advanced indexing) writes rows 2..4: the slots must say
    so, or the tensor must be refused as unmappable. Never another place."""
    model = ScriptedModel((6, 4), _index_tensor_rows)
    host = LoaderHost(model)
    try:
        slots = host.place("w", (3, 4), "F32")
    except PatchError as exc:
        assert exc.reason == "unmappable"
    else:
        real = torch.randn(3, 4)
        model.load_weights([("w", real)])
        assert_slots_hold(model, "w", real, slots)


def test_a_host_with_problems_is_a_kernel_format_refusal(tmp_path: Path) -> None:
    chain = build_chain(tmp_path, None)
    model = load_ranks(chain.parent, CFG, 1, torch.float32)[0]
    host = LoaderHost(model, lambda: ["weights repacked for the CPU kernels"])
    with pytest.raises(PatchError) as exc:
        staging.stage(host, chain.patch, identity="step-1", parent="step-0")
    assert exc.value.reason == "kernel_format"


# --- 4. real patches on simulated tensor-parallel ranks -----------------------------------------


def patch_checks(patch: Path) -> dict[str, TensorCheck]:
    """What the patch promises of each tensor (the loader reads this from the patch file)."""
    with PatchFile(patch) as pf:
        return checks_of(pf.tensors)


@dataclass
class Ranks:
    """Every rank of one engine with its staged patch and served sums."""

    models: list[ToyTPModel]
    hosts: list[LoaderHost]
    staged: list[Staged]
    served: list[RegionSum]

    @property
    def deltas(self) -> list[RegionSum]:
        """Every rank's sum changes."""
        return [d for s in self.staged for d in s.deltas]

    def apply(self) -> None:
        """Write the staged patch on every rank."""
        for host, staged in zip(self.hosts, self.staged, strict=True):
            staging.apply(staged, host.parameters())

    def undo(self) -> None:
        """Put back what `apply` wrote, on every rank."""
        for host, staged in zip(self.hosts, self.staged, strict=True):
            staging.undo(staged, host.parameters())


def stage_ranks(models: list[ToyTPModel], chain: Chain, patch: Path | None = None) -> Ranks:
    """Stage the patch and checksum the served weights on every rank, as the engine does."""
    hosts = [LoaderHost(m) for m in models]
    specs = checkpoint_specs(chain.parent)
    staged = [
        staging.stage(h, patch or chain.patch, identity="step-1", parent="step-0") for h in hosts
    ]
    sums = [s for h in hosts for s in served.served_sums(h, specs)]
    return Ranks(models, hosts, staged, sums)


def assert_models_equal(got: list[ToyTPModel], want: list[ToyTPModel]) -> None:
    for a, b in zip(got, want, strict=True):
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert pa.keys() == pb.keys()
        for name, param in pa.items():
            assert same_bits(param, pb[name]), (a.rank, name)


@pytest.mark.parametrize(
    ("cast", "dtype", "world", "transpose_down", "cfg", "fraction"),
    [
        ("BF16", torch.bfloat16, 2, False, CFG, 0.05),
        ("BF16", torch.float32, 2, False, CFG, 0.05),  # exact widening: bf16 held as float32
        (None, torch.float32, 2, True, CFG, 0.05),  # down_proj held transposed (strided)
        (None, torch.float32, 1, False, CFG, 0.05),
        # Four ranks, the last of which holds nothing but vocabulary padding.
        ("BF16", torch.bfloat16, 4, True, ToyConfig(vocab=40, vocab_padding=64), 0.05),
        # A denser step: the delta codes some chunks dense, the patch replaces whole ranges.
        ("BF16", torch.float32, 2, True, CFG, 0.3),
    ],
    ids=[
        "bf16-2ranks",
        "bf16-as-f32-2ranks",
        "f32-transposed-2ranks",
        "f32-1rank",
        "bf16-4ranks-padding-only-rank",
        "bf16-as-f32-dense-ranges",
    ],
)
def test_a_patch_on_every_rank_gives_what_a_full_load_of_the_child_gives(
    *,
    tmp_path: Path,
    cast: str | None,
    dtype: torch.dtype,
    world: int,
    transpose_down: bool,
    cfg: ToyConfig,
    fraction: float,
) -> None:
    chain = build_chain(tmp_path, cast, cfg, fraction)
    with PatchFile(chain.patch) as pf:
        # A dense chunk adds a difference to every element of it.
        dense = any(t.add is not None and t.add.count == t.numel for t in pf.tensors)
        assert dense or fraction < 0.1
    models = load_ranks(chain.parent, cfg, world, dtype, transpose_down=transpose_down)
    parent = [param_bits(m) for m in models]
    ranks = stage_ranks(models, chain)
    # Staging wrote nothing.
    assert all(
        torch.equal(parent[r][n], bits(p))
        for r, m in enumerate(models)
        for n, p in m.named_parameters()
    )
    checks = patch_checks(chain.patch)
    sizes = {n: (c.numel, c.nbytes) for n, c in checks.items()}
    held = combine_regions(ranks.served, sizes)
    assert held == {n: c.base for n, c in checks.items() if n != "lm_head.weight"}
    verify(checks, ranks.served, ranks.deltas)
    before = [served.served_sums(h, checkpoint_specs(chain.parent)) for h in ranks.hosts]

    ranks.apply()
    want = load_ranks(chain.child, cfg, world, dtype, transpose_down=transpose_down)
    assert_models_equal(models, want)
    for r, model in enumerate(models):
        assert any(not torch.equal(parent[r][n], bits(p)) for n, p in model.named_parameters())
    # The served weights now checksum as the delta's result.
    after = [s for h in ranks.hosts for s in served.served_sums(h, checkpoint_specs(chain.child))]
    assert combine_regions(after, sizes) == {n: c.target for n, c in checks.items() if n in held}
    # ... and the sums each rank derives from the patch, region by region, are what a re-read
    # gives.
    derived = [s for b, st in zip(before, ranks.staged, strict=True) for s in derive(b, st.deltas)]
    assert derived == after

    # Undo puts the parent back, bit for bit.
    ranks.undo()
    for r, model in enumerate(models):
        assert all(torch.equal(parent[r][n], bits(p)) for n, p in model.named_parameters())


class Flaky(Mapping[str, torch.Tensor]):
    """Parameters by name, where looking up `name` fails the first `times` times."""

    def __init__(self, params: Mapping[str, torch.Tensor], name: str, times: int) -> None:
        self.params, self.name, self.times = dict(params), name, times

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == self.name and self.times > 0:
            self.times -= 1
            raise RuntimeError(f"{key} is not there now")
        return self.params[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


@pytest.mark.parametrize("times", [1, 2])
def test_a_failed_write_puts_every_value_back(tmp_path: Path, times: int) -> None:
    """`apply` fails on its last parameter: every value written before is put back, and the
    error is a `PatchError` (write_failed). With `times=2` the failing parameter fails again
    while `undo` puts the values back (the cause of a write failure often persists)."""
    chain = build_chain(tmp_path, "BF16")
    models = load_ranks(chain.parent, CFG, 1, torch.bfloat16)
    parent = param_bits(models[0])
    ranks = stage_ranks(models, chain)
    staged = ranks.staged[0]
    assert len(staged.writes) > 1
    params = Flaky(ranks.hosts[0].parameters(), staged.writes[-1].param, times)
    with pytest.raises(PatchError) as exc:
        staging.apply(staged, params)
    assert exc.value.reason == "write_failed"
    assert all(torch.equal(parent[n], bits(p)) for n, p in models[0].named_parameters())


def test_staging_keeps_old_values_only_where_the_patch_sets_them(tmp_path: Path) -> None:
    """Staging holds positions and new values; the values they replace only where the patch sets
    values (raw chunks). Added differences are undone from the patch file: apply then undo gives
    the parent bit for bit on every rank, and without the file the writes that need it are named
    as not put back (the ones with kept values are)."""
    w0 = checkpoint_weights(CFG)
    rng = np.random.default_rng(5)

    def step(i: int, v: np.ndarray) -> np.ndarray:
        if i % 2:  # new random values: raw chunks, set
            return rng.standard_normal(v.shape).astype(np.float32)
        moved = v.copy()
        moved.reshape(-1)[::20] *= np.float32(1.01)  # about one bfloat16 ulp: added
        return moved

    w1 = {k: step(i, v) for i, (k, v) in enumerate(w0.items())}
    a = write_snapshot(tmp_path / "step-0", w0, config=CONFIG, cast="BF16", overwrite=True).path
    b = write_snapshot(tmp_path / "step-1", w1, config=CONFIG, cast="BF16", overwrite=True).path
    encode(a, b, tmp_path / "d" / "step-1")
    patch = tmp_path / "mixed.patch"
    prepare_patch(None, tmp_path / "d" / "step-1", patch)
    chain = Chain(a, b, patch)
    with PatchFile(patch) as pf:
        assert any(t.set is not None for t in pf.tensors)
        assert any(t.add is not None and t.set is None for t in pf.tensors)

    models = load_ranks(chain.parent, CFG, 2, torch.float32)
    parent = [param_bits(m) for m in models]
    ranks = stage_ranks(models, chain)
    parts = [p for s in ranks.staged for w in s.writes for p in w.parts]
    assert any(p.old is None for p in parts) and any(p.old is not None for p in parts)
    for st_ in ranks.staged:
        positions_and_new = sum(
            w.index.numel() * w.index.element_size() + w.new.numel() * w.new.element_size()
            for w in st_.writes
        )
        kept = sum(p.old.numel() * 4 for w in st_.writes for p in w.parts if p.old is not None)
        assert st_.held_bytes == positions_and_new + kept
        assert kept < positions_and_new

    ranks.apply()
    assert any(
        not torch.equal(parent[r][n], bits(p))
        for r, m in enumerate(models)
        for n, p in m.named_parameters()
    )
    ranks.undo()
    for r, model in enumerate(models):
        assert all(torch.equal(parent[r][n], bits(p)) for n, p in model.named_parameters())

    # Without the patch file, added differences cannot be taken back: named, not guessed.
    ranks.apply()
    patch.unlink()
    staged, host = ranks.staged[0], ranks.hosts[0]
    with pytest.raises(PatchError) as exc:
        staging.undo(staged, host.parameters())
    assert exc.value.reason == "write_failed"
    lost = [w.param for w in staged.writes if any(p.old is None for p in w.parts)]
    assert lost and all(name in exc.value.message for name in lost)
    restored = [w for w in staged.writes if all(p.old is not None for p in w.parts)]
    assert restored
    for w in restored:
        param = dict(models[0].named_parameters())[w.param]
        assert torch.equal(parent[0][w.param], bits(param))


def test_served_sums_do_not_depend_on_how_much_is_read_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served weights are read in chunks (contiguous regions and strided ones alike):
    chunks of a few elements give the same sums as one read."""
    chain = build_chain(tmp_path, "BF16")
    models = load_ranks(chain.parent, CFG, 2, torch.float32, transpose_down=True)
    specs = checkpoint_specs(chain.parent)
    whole = [served.served_sums(LoaderHost(m), specs) for m in models]
    monkeypatch.setattr(served, "CHUNK_ELEMENTS", 5)
    assert [served.served_sums(LoaderHost(m), specs) for m in models] == whole


def test_a_float32_checkpoint_held_as_bfloat16_is_refused(tmp_path: Path) -> None:
    chain = build_chain(tmp_path, None)
    models = load_ranks(chain.parent, CFG, 2, torch.bfloat16)
    host = LoaderHost(models[0])
    with pytest.raises(PatchError) as exc:
        staging.stage(host, chain.patch, identity="step-1", parent="step-0")
    assert exc.value.reason == "weights_mismatch"
    with pytest.raises(PatchError) as exc:
        served.served_sums(host, checkpoint_specs(chain.parent))
    assert exc.value.reason == "weights_mismatch"


def _bump(param: torch.Tensor, at: int = 0) -> None:
    """One ulp more at flat element `at`."""
    flat = param.data.view(-1).view(INT_OF_WIDTH[param.element_size()])
    flat[at] += 1


@pytest.mark.parametrize(
    ("case", "tensor"),
    [
        # Rank 1 serves the child, not the parent (a replicated norm disagrees first).
        ("child", None),
        # One bit of rank 1's shard of a row-parallel weight.
        ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"),
        # One bit of a replicated weight on rank 1 only.
        ("model.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"),
        # The first row of rank 1's fused gate_up: row `inter/2` of gate_proj.
        ("model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate_proj.weight"),
    ],
)
def test_a_rank_not_serving_the_parent_is_a_parent_mismatch(
    tmp_path: Path, case: str, tensor: str | None
) -> None:
    chain = build_chain(tmp_path, "BF16")
    models = load_ranks(chain.parent, CFG, 2, torch.bfloat16)
    if case == "child":
        models[1] = load_ranks(chain.child, CFG, 2, torch.bfloat16)[1]
    else:
        _bump(dict(models[1].named_parameters())[case])
    before = [param_bits(m) for m in models]
    ranks = stage_ranks(models, chain)
    with pytest.raises(PatchError) as exc:
        verify(patch_checks(chain.patch), ranks.served, ranks.deltas)
    assert exc.value.reason == "parent_mismatch"
    if tensor is not None:
        assert exc.value.tensor == tensor
    assert all(
        torch.equal(before[r][n], bits(p))
        for r, m in enumerate(models)
        for n, p in m.named_parameters()
    )


def test_a_flipped_value_in_the_patch_is_a_checksum_mismatch(tmp_path: Path) -> None:
    chain = build_chain(tmp_path, "BF16")
    models = load_ranks(chain.parent, CFG, 2, torch.bfloat16)
    q = "model.layers.0.self_attn.q_proj.weight"
    edited = rewrite_patch(chain.patch, tmp_path / "edited.patch", q, flip_first_difference)
    ranks = stage_ranks(models, chain, edited)
    with pytest.raises(PatchError) as exc:
        verify(patch_checks(edited), ranks.served, ranks.deltas)
    assert (exc.value.reason, exc.value.tensor) == ("checksum_mismatch", q)


def _drop_changes(t: PatchTensor) -> None:
    t.add = t.set = None


def test_a_tensor_whose_changes_are_lost_from_the_patch_is_a_checksum_mismatch(
    tmp_path: Path,
) -> None:
    # Staging skips a tensor the patch leaves alone; its promised result must then be its parent.
    chain = build_chain(tmp_path, "BF16")
    models = load_ranks(chain.parent, CFG, 2, torch.bfloat16)
    q = "model.layers.0.self_attn.q_proj.weight"
    edited = rewrite_patch(chain.patch, tmp_path / "edited.patch", q, _drop_changes)
    ranks = stage_ranks(models, chain, edited)
    assert not any(d.tensor == q for d in ranks.deltas)
    with pytest.raises(PatchError) as exc:
        verify(patch_checks(edited), ranks.served, ranks.deltas)
    assert (exc.value.reason, exc.value.tensor) == ("checksum_mismatch", q)


@pytest.mark.parametrize(
    ("cast", "nan", "held"),
    [
        ("BF16", 0x7FC0, torch.bfloat16),
        ("BF16", 0xFF80, torch.bfloat16),  # -inf
        ("BF16", 0xFFC1, torch.float32),  # a negative NaN, held widened
        ("BF16", 0x7F80, torch.float32),  # +inf, held widened
        (None, 0x7FC00000, torch.float32),
        (None, 0xFF800000, torch.float32),
    ],
    ids=["BF16-nan", "BF16-neg-inf", "BF16-neg-nan-as-f32", "BF16-inf-as-f32", "F32", "F32-inf"],
)
def test_a_patch_writing_nan_is_refused_on_every_rank(
    tmp_path: Path, cast: str | None, nan: int, held: torch.dtype
) -> None:
    chain = build_chain(tmp_path, cast)
    norm = "model.norm.weight"
    edited = rewrite_patch(chain.patch, tmp_path / "edited.patch", norm, set_first(nan))
    for model in load_ranks(chain.parent, CFG, 2, held):
        with pytest.raises(PatchError) as exc:
            staging.stage(LoaderHost(model), edited, identity="step-1", parent="step-0")
        assert (exc.value.reason, exc.value.tensor) == ("not_finite", norm)


def test_a_patch_for_another_snapshot_is_a_wrong_patch(tmp_path: Path) -> None:
    chain = build_chain(tmp_path, None)
    host = LoaderHost(load_ranks(chain.parent, CFG, 1, torch.float32)[0])
    for identity, parent in (("step-2", "step-0"), ("step-1", "step-9")):
        with pytest.raises(PatchError) as exc:
            staging.stage(host, chain.patch, identity=identity, parent=parent)
        assert exc.value.reason == "wrong_patch"


# --- 5. Patcher over an IdentityHost -------------------------------------------------------------

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tied_chain(root: Path, same_change: bool) -> Chain:
    """Snapshots `s0`, `s1` of a model whose lm_head equals its embedding; the step changes
    both the same way (`same_change`) or each differently."""
    rng = np.random.default_rng(7)
    embed = rng.standard_normal((40, 8), dtype=np.float32)
    w0 = {
        EMBED: embed,
        "model.layers.0.mlp.weight": rng.standard_normal((8, 8), dtype=np.float32),
        "model.norm.weight": rng.standard_normal(8, dtype=np.float32),
        HEAD: embed.copy(),
    }
    w1 = {n: a.copy() for n, a in w0.items()}
    for name, at in ((EMBED, [3, 50, 200]), (HEAD, [3, 50, 200] if same_change else [4, 51])):
        w1[name].reshape(-1).view(np.uint32)[at] += 1
    w1["model.layers.0.mlp.weight"].reshape(-1).view(np.uint32)[[0, 9]] += 1
    s0 = write_snapshot(root / "s0", w0, config=CONFIG, overwrite=True).path
    s1 = write_snapshot(root / "s1", w1, config=CONFIG, overwrite=True).path
    encode(s0, s1, root / "delta" / "s1", parent_identity="s0", overwrite=True, threads=1)
    patch = root / "s1.patch"
    prepare_patch(s0, root / "delta" / "s1", patch)
    return Chain(s0, s1, patch)


def tied_targets(folder: Path) -> dict[str, torch.Tensor]:
    """The reference engine's weights: the checkpoint's tensors, lm_head tied to the embedding."""
    ckpt = read_checkpoint(folder)
    targets = {EMBED: ckpt.pop(EMBED)}
    targets.update({n: t for n, t in ckpt.items() if n != HEAD})
    targets[HEAD] = targets[EMBED]
    return targets


@pytest.fixture
def patcher_of() -> Iterator[Callable[[dict[str, torch.Tensor]], Patcher]]:
    made: list[Patcher] = []

    def make(targets: dict[str, torch.Tensor]) -> Patcher:
        made.append(Patcher(IdentityHost(lambda: targets)))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_patcher_stages_verifies_applies_and_rolls_back(
    tmp_path: Path, patcher_of: Callable[[dict[str, torch.Tensor]], Patcher]
) -> None:
    chain = tied_chain(tmp_path, same_change=True)
    targets = tied_targets(chain.parent)
    parent = {n: bits(t).clone() for n, t in targets.items()}
    child = read_checkpoint(chain.child)
    patcher = patcher_of(targets)
    checks = patch_checks(chain.patch)
    sizes = {n: (c.numel, c.nbytes) for n, c in checks.items()}

    with pytest.raises(PatchError) as exc:
        patcher.served()
    assert exc.value.reason == "parent_mismatch"
    with pytest.raises(PatchError) as exc:
        patcher.staged()
    assert exc.value.reason == "not_staged"
    assert patcher.state() == {"served": "none", "staging": "none"}

    patcher.weights_changed(checkpoint_specs(chain.parent))
    served = patcher.served(timeout=30)
    assert combine_regions(served, sizes) == {n: c.base for n, c in checks.items()}
    patcher.stage(str(chain.patch), identity="s1", parent="s0").result(timeout=30)
    assert patcher.state() == {"served": "ready", "staging": "ready"}
    staged = patcher.staged()
    assert staged.summary()["changed"] == staged.changed == 8  # 3 + 3 tied, 2 in the layer
    verify(checks, served, staged.deltas)
    # Nothing written before apply.
    assert all(torch.equal(parent[n], bits(t)) for n, t in targets.items())

    assert patcher.apply() is staged
    assert targets[HEAD] is targets[EMBED]
    assert all(same_bits(targets[n], child[n]) for n in child)
    assert combine_regions(patcher.served(timeout=30), sizes) == {
        n: c.target for n, c in checks.items()
    }
    with pytest.raises(PatchError) as exc:
        patcher.staged()
    assert exc.value.reason == "not_staged"

    assert patcher.rollback() is True
    assert all(torch.equal(parent[n], bits(t)) for n, t in targets.items())
    assert combine_regions(patcher.served(timeout=30), sizes) == {
        n: c.base for n, c in checks.items()
    }
    assert patcher.rollback() is False

    # A full load after an apply: the old values are no longer there to put back.
    patcher.stage(str(chain.patch), identity="s1", parent="s0").result(timeout=30)
    patcher.apply()
    patcher.weights_changed(checkpoint_specs(chain.child))
    assert patcher.rollback() is False
    assert all(same_bits(targets[n], child[n]) for n in child)


def test_tied_names_patched_differently_are_a_weights_mismatch(
    tmp_path: Path, patcher_of: Callable[[dict[str, torch.Tensor]], Patcher]
) -> None:
    chain = tied_chain(tmp_path, same_change=False)
    targets = tied_targets(chain.parent)
    parent = {n: bits(t).clone() for n, t in targets.items()}
    patcher = patcher_of(targets)
    patcher.weights_changed(checkpoint_specs(chain.parent))
    job = patcher.stage(str(chain.patch), identity="s1", parent="s0")
    with pytest.raises(PatchError):
        job.result(timeout=30)
    state = patcher.state()
    assert state["staging"] == "failed"
    assert state["error"]["reason"] == "weights_mismatch"
    with pytest.raises(PatchError) as exc:
        patcher.staged()
    assert exc.value.reason == "weights_mismatch"
    assert exc.value.tensor in {EMBED, HEAD}
    with pytest.raises(PatchError) as exc:
        patcher.apply()
    assert exc.value.reason == "weights_mismatch"
    assert all(torch.equal(parent[n], bits(t)) for n, t in targets.items())


def test_identity_host_refuses_unknown_and_reshaped_weights() -> None:
    targets = {"a": torch.zeros(2, 3)}
    host = IdentityHost(lambda: targets)
    assert host.place("a", (2, 3), "F32") == [
        Slot("a", "a", Region.whole((2, 3)), Region.whole((2, 3)))
    ]
    for name, shape in (("b", (2, 3)), ("a", (3, 2))):
        with pytest.raises(PatchError) as exc:
            host.place(name, shape, "F32")
        assert (exc.value.reason, exc.value.tensor) == ("weights_mismatch", name)


# --- the vLLM worker extension, on simulated ranks ---------------------------------------------


@dataclass
class FakeRunner:
    """What the extension reads of vLLM's model runner: the model and its folder."""

    model: nn.Module
    folder: Path

    def get_model(self) -> nn.Module:
        return self.model

    @property
    def vllm_config(self) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(model=str(self.folder)))


class FakeWorker(HotloadWorkerExtension):
    """A vLLM worker as the extension sees it: a rank and a model runner."""

    def __init__(self, rank: int, runner: FakeRunner) -> None:
        self.rank = rank
        self.model_runner = runner


def poll_all(workers: list[FakeWorker]) -> list[dict[str, Any]]:
    """`hotload_poll` on every rank until none is pending."""
    deadline = time.monotonic() + 30
    while True:
        states = [w.hotload_poll() for w in workers]
        pending = any("pending" in (s["served"], s["staging"]) for s in states)
        if not pending or time.monotonic() > deadline:
            return states
        time.sleep(0.01)


def test_the_worker_extension_patches_every_rank_over_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's side of the protocol, over the extension's JSON answers from two ranks:
    stage, poll, verify over all ranks, apply, compare with a full load, roll back."""
    chain = build_chain(tmp_path, "BF16")
    models = load_ranks(chain.parent, CFG, 2, torch.bfloat16)
    workers = [FakeWorker(r, FakeRunner(m, chain.parent)) for r, m in enumerate(models)]
    # Without vLLM the extension cannot tell which layers vLLM repacked: it refuses patches.
    described = workers[0].hotload_describe()
    assert described["protocol"] == PROTOCOL and described["problems"]
    assert workers[0].hotload_stage(str(chain.patch), "step-1", "step-0")["state"] == "pending"
    assert poll_all(workers[:1])[0]["error"]["reason"] == "kernel_format"
    workers[0]._hotload().close()

    monkeypatch.setattr(vllm_extension, "kernel_problems", lambda model: [])
    workers = [FakeWorker(r, FakeRunner(m, chain.parent)) for r, m in enumerate(models)]
    assert [w.hotload_describe()["problems"] for w in workers] == [[], []]
    parent = [w.hotload_parameter_checksums()["checksums"] for w in workers]
    for w in workers:
        assert w.hotload_stage(str(chain.patch), "step-1", "step-0") == {
            "rank": w.rank,
            "state": "pending",
        }
    states = poll_all(workers)
    assert [(s["rank"], s["served"], s["staging"]) for s in states] == [
        (0, "ready", "ready"),
        (1, "ready", "ready"),
    ]
    served = [RegionSum.from_json(x) for s in states for x in s["served_sums"]]
    deltas = [RegionSum.from_json(x) for s in states for x in s["deltas"]]
    verify(patch_checks(chain.patch), served, deltas)

    applied = [w.hotload_apply() for w in workers]
    assert [(a["rank"], a["identity"], a["parent"]) for a in applied] == [
        (0, "step-1", "step-0"),
        (1, "step-1", "step-0"),
    ]
    want = load_ranks(chain.child, CFG, 2, torch.bfloat16)
    child = [staging.parameter_checksums(dict(m.named_parameters())) for m in want]
    assert [w.hotload_parameter_checksums()["checksums"] for w in workers] == child

    assert [w.hotload_rollback()["rolled_back"] for w in workers] == [True, True]
    assert [w.hotload_parameter_checksums()["checksums"] for w in workers] == parent
    assert workers[0].hotload_rollback()["rolled_back"] is False
    # Nothing staged: apply answers an error, it does not raise.
    assert workers[0].hotload_apply()["error"]["reason"] == "not_staged"
    for w in workers:
        w._hotload().close()


def test_write_threads_run_on_every_cpu_of_a_pinned_process() -> None:
    """vLLM pins its CPU workers to their compute cores; the threads that write a patch during
    the pause may still use every core (the engine computes nothing then)."""
    code = (
        "import os; os.sched_setaffinity(0, {0}); from hotload_patch import staging; "
        "print(*staging._write_pool().submit(os.sched_getaffinity, 0).result())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    # Every CPU this test may use (pinned to CPU 0 alone, the threads would report just it).
    assert {int(cpu) for cpu in run.stdout.split()} >= os.sched_getaffinity(0), run.stdout
