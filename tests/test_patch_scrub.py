"""Served checksums that follow the patches, and the scrub that re-reads the weights.

After a patch a `Patcher` derives the served weights' region sums from the patch instead of
re-reading the model; the scrub reads them back at a bounded rate in the background and compares.
Real patch files from real arc_v2 deltas (`support.tiny_llm.sparse_steps`), real torch tensors.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hotload.arc.patch import prepare_patch
from hotload.snapshot import write_snapshot
from hotload_patch import PatchError
from hotload_patch.checkpoint import Specs, checkpoint_specs
from hotload_patch.dtypes import ELEMENT_SIZE
from hotload_patch.placement import IdentityHost
from hotload_patch.scrub import Scrubber
from hotload_patch.served import Meter, device_partial, region_partial, served_sums
from hotload_patch.session import Patcher
from hotload_patch.sums import Region, combine
from support.adler import by_definition
from support.fleet import wait_for
from support.patch_models import CFG, checkpoint_weights, read_checkpoint, same_bits
from support.patches import Chain, build_chain
from support.snapshots import CONFIG
from support.tiny_llm import sparse_steps


def _targets(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: t.to(dtype) for n, t in read_checkpoint(folder).items()}


def _f16_chain(root: Path) -> Chain:
    """`build_chain` for a float16 checkpoint."""
    weights = {n: a.astype(np.float16) for n, a in checkpoint_weights(CFG).items()}
    base = write_snapshot(root / "base", weights, config=CONFIG, overwrite=True).path
    fulls, deltas = sparse_steps(base, root, 1, fraction=0.05)
    prepare_patch(fulls[0], deltas[1], root / "step-1.patch")
    return Chain(fulls[0], fulls[1], root / "step-1.patch")


def _wait(what: str, check: Callable[[], object], timeout: float = 30.0) -> object:
    """`wait_for`, polling every 10 ms (a scrub pass takes milliseconds)."""
    return wait_for(what, check, timeout, interval=0.01)


@pytest.fixture
def patchers() -> Iterator[list[Patcher]]:
    made: list[Patcher] = []
    yield made
    for p in made:
        p.close()


@pytest.mark.parametrize(
    ("cast", "dtype"),
    [
        ("BF16", torch.bfloat16),
        ("BF16", torch.float32),
        (None, torch.float32),
        (None, torch.float64),
        ("F16", torch.float16),
    ],
)
def test_derived_sums_equal_a_full_reread_after_patches(
    tmp_path: Path, patchers: list[Patcher], cast: str | None, dtype: torch.dtype
) -> None:
    """Two patches in a row: the sums the Patcher derived are what reading the weights gives,
    and nothing was read for them (the counters say so); the scrub agrees."""
    first = _f16_chain(tmp_path) if cast == "F16" else build_chain(tmp_path, cast)
    targets = _targets(first.parent, dtype)
    patcher = Patcher(IdentityHost(lambda: targets), scrub_rate=0)
    patchers.append(patcher)
    specs = checkpoint_specs(first.parent)
    patcher.weights_changed(specs)
    patcher.served(timeout=30)
    model_bytes = sum(int(np.prod(s)) * ELEMENT_SIZE[d] for s, d in specs.values())
    assert patcher.counters.checksum_bytes == model_bytes

    patcher.stage(str(first.patch), identity="step-1", parent="step-0").result(timeout=30)
    staged = patcher.apply()
    derived = patcher.served(timeout=0)
    assert derived == served_sums(IdentityHost(lambda: targets), specs)
    child = read_checkpoint(first.child)
    assert all(same_bits(targets[n].to(child[n].dtype), child[n]) for n in child)
    counters = patcher.counters.to_json()
    assert counters["checksum_bytes"] == model_bytes  # nothing re-read after the patch
    assert counters["patches"] == 1 and counters["patched_elements"] == staged.changed > 0
    assert counters["patched_bytes"] == staged.changed * targets[next(iter(targets))].itemsize

    # The scrub, turned on, reads everything once and finds the derived sums right.
    patcher.scrubber.set_schedule(rate=1 << 30, period=0.01)
    _wait("a scrub pass", lambda: patcher.scrub_state()["passes"] >= 1)
    state = patcher.scrub_state()
    assert state["last"]["result"] == "ok" and state["mismatch"] is None
    assert state["last"]["bytes"] == model_bytes
    assert patcher.counters.scrub_bytes >= model_bytes


@pytest.mark.parametrize("low", [True, False], ids=["below-bf16", "in-bf16"])
def test_a_scrub_finds_a_flipped_bit_and_patches_are_refused_until_a_full_load(
    tmp_path: Path, patchers: list[Patcher], low: bool
) -> None:
    chain = build_chain(tmp_path, "BF16")
    targets = _targets(chain.parent, torch.float32)
    patcher = Patcher(IdentityHost(lambda: targets), scrub_rate=0)
    patchers.append(patcher)
    patcher.weights_changed(checkpoint_specs(chain.parent))
    patcher.served(timeout=30)
    # A bit flips in memory, behind the engine's back: in the bits the bfloat16 checkpoint
    # has, or (first) below them, where only the exact way back to bfloat16 can tell.
    name = "model.layers.1.mlp.down_proj.weight"
    flat = targets[name].view(-1).view(torch.int32)
    flat[5] ^= 1 << (3 if low else 20)
    patcher.scrubber.set_schedule(rate=1 << 30, period=0.01)
    state = _wait("the scrub's mismatch", lambda: patcher.scrub_state()["mismatch"])
    assert isinstance(state, dict) and state["tensor"] == name
    assert patcher.scrub_state()["last"]["result"] == "mismatch"
    # While the mismatch stands, a patch is refused: its parent check would be on sums the
    # weights no longer match.
    with pytest.raises(PatchError) as exc:
        patcher.stage(str(chain.patch), identity="step-1", parent="step-0").result(timeout=30)
    assert exc.value.reason == "parent_mismatch" and "scrub" in str(exc.value)
    # A full load clears it (the loader reloads the snapshot in full).
    fresh = _targets(chain.parent, torch.float32)
    targets.update(fresh)
    patcher.weights_changed(checkpoint_specs(chain.parent))
    patcher.served(timeout=30)
    assert patcher.scrub_state()["mismatch"] is None
    patcher.stage(str(chain.patch), identity="step-1", parent="step-0").result(timeout=30)
    patcher.apply()
    _wait("a clean scrub pass", lambda: patcher.scrub_state()["last"]["result"] == "ok")


def test_the_scrub_reads_at_its_rate_and_rereads_what_a_patch_changed_under_it(
    tmp_path: Path, patchers: list[Patcher]
) -> None:
    """The scrub asks to sleep as long as its rate needs (a recorded clock, no waiting), and a
    patch written while it reads a region makes it read that region again, not report it."""
    chain = build_chain(tmp_path, "BF16")
    targets = _targets(chain.parent, torch.bfloat16)
    patcher = Patcher(IdentityHost(lambda: targets), scrub_rate=0)
    patchers.append(patcher)
    specs = checkpoint_specs(chain.parent)
    patcher.weights_changed(specs)
    patcher.served(timeout=30)
    patcher.stage(str(chain.patch), identity="step-1", parent="step-0").result(timeout=30)
    slept: list[float] = []
    applied = threading.Event()

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if not applied.is_set():
            patcher.apply()  # a patch lands in the middle of the scrub's first read
            applied.set()

    rate = 4096.0
    patcher.scrubber.sleep = sleep
    patcher.scrubber.set_schedule(rate=rate, period=0.01)
    _wait("a scrub pass", lambda: patcher.scrub_state()["passes"] >= 1)
    state = patcher.scrub_state()
    assert state["last"]["result"] == "ok", state
    model_bytes = state["last"]["bytes"]
    # What it read, re-reads included, at `rate`: the sleeps add up to at least that long
    # (minus the time the reads themselves took, which the recorded clock does not skip).
    assert patcher.counters.scrub_bytes > model_bytes  # the region the patch hit, read twice
    assert sum(slept) >= model_bytes / rate - 5.0
    assert all(same_bits(targets[n], t) for n, t in read_checkpoint(chain.child).items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_sums_on_the_device_equal_zlibs(dtype: torch.dtype) -> None:
    """The device path (integer sums on the tensor's own device, used off the CPU) gives the
    partial sums zlib gives, for whole tensors, slices and column shards, in every chunking."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 29, generator=gen).to(dtype)
    ckpt = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}[dtype]
    total = weight.numel() * weight.element_size()
    at = torch.arange(37 * 29).reshape(37, 29)
    cases = [
        (weight, Region.whole((37, 29)), at),
        (weight[5:20], Region(5 * 29, (15, 29), (29, 1)), at[5:20]),
        (weight[:, 7:19], Region(7, (37, 12), (29, 1)), at[:, 7:19]),
    ]
    raw = weight.contiguous().view(torch.uint8).reshape(-1).numpy()
    assert combine(total, [by_definition(raw, at, weight.element_size())]) == zlib.adler32(raw)
    for view, region, elements in cases:
        want = region_partial(view, region, ckpt, total)
        assert want == by_definition(raw, elements, weight.element_size())
        assert device_partial(view, region, ckpt, total) == want
        for chunk in (1, 7, 64):
            import hotload_patch.served as served_module

            old = served_module.DEVICE_CHUNK_BYTES
            served_module.DEVICE_CHUNK_BYTES = chunk
            try:
                meter = Meter()
                assert device_partial(view, region, ckpt, total, meter) == want
            finally:
                served_module.DEVICE_CHUNK_BYTES = old


def _loaded(
    root: Path, patchers: list[Patcher], **options: float
) -> tuple[Patcher, dict[str, torch.Tensor], Specs]:
    """A Patcher over a bfloat16 checkpoint held as float32, its checksums read (a full load)."""
    chain = build_chain(root, "BF16")
    targets = _targets(chain.parent, torch.float32)
    patcher = Patcher(IdentityHost(lambda: targets), **options)
    patchers.append(patcher)
    specs = checkpoint_specs(chain.parent)
    patcher.weights_changed(specs)
    patcher.served(timeout=30)
    return patcher, targets, specs


def test_by_default_the_scrub_rests_an_hour_after_a_full_load(
    tmp_path: Path, patchers: list[Patcher]
) -> None:
    """Default settings: a full load's checksum read counts as a pass, so nothing is re-read
    until the period (an hour) is up: across an idle window the scrub reads no byte."""
    patcher, _, _ = _loaded(tmp_path, patchers)
    time.sleep(1.0)
    state = patcher.scrub_state()
    assert patcher.counters.scrub_bytes == 0 and state["passes"] == 0
    assert state["period_seconds"] == 3600 and state["rate_bytes_per_second"] == 64 << 20
    assert state["next"] > time.time() + 3500


def test_a_scrub_with_a_short_period_rests_between_passes_and_finds_a_flipped_bit_within_it(
    tmp_path: Path, patchers: list[Patcher]
) -> None:
    """One pass per period, the thread idle in between (the scrub's own byte counter does not
    move across the rest), and a bit flipped after a pass is found by the next one, which
    begins within a period of the flip."""
    period = 3.0
    patcher, targets, specs = _loaded(tmp_path, patchers, scrub_rate=1 << 30, scrub_period=period)
    model_bytes = sum(int(np.prod(s)) * ELEMENT_SIZE[d] for s, d in specs.values())
    _wait("the first pass", lambda: patcher.scrub_state()["passes"] >= 1, timeout=60)
    first = patcher.scrub_state()
    assert first["last"]["result"] == "ok" and first["last"]["bytes"] == model_bytes
    read = patcher.counters.scrub_bytes
    assert read >= model_bytes
    # Rest: until shortly before the next pass is due, nothing is read.
    idle = first["next"] - time.time() - 0.5
    assert idle > 1.0, first
    time.sleep(idle)
    assert patcher.counters.scrub_bytes == read
    assert patcher.scrub_state()["passes"] == 1

    name = "model.layers.1.mlp.down_proj.weight"
    flipped_at = time.time()
    targets[name].view(-1).view(torch.int32)[5] ^= 1 << 20
    found = _wait("the mismatch", lambda: patcher.scrub_state()["mismatch"], timeout=60)
    assert isinstance(found, dict) and found["tensor"] == name
    last = patcher.scrub_state()["last"]
    assert last["result"] == "mismatch" and patcher.scrub_state()["passes"] == 2
    assert last["started"] <= flipped_at + period
    # The next pass began a period after the first began, not sooner.
    assert last["started"] >= first["last"]["started"] + period - 0.05


class _Uncovered:
    """The real Patcher as a scrub sees it, except that its expected sums leave out one tensor:
    what the engine's checksums look like when they do not cover a region it holds. Injected:
    no engine reaches that state on purpose, and the scrub must still not call the pass ok."""

    def __init__(self, patcher: Patcher, tensor: str) -> None:
        self.patcher, self.tensor = patcher, tensor
        self.host, self.counters = patcher.host, patcher.counters

    def scrub_target(self) -> Any:
        target = self.patcher.scrub_target()
        if target is None:
            return None
        epoch, specs, expected = target
        return epoch, specs, {k: v for k, v in expected.items() if k[0] != self.tensor}

    def epoch(self) -> int:
        return self.patcher.epoch()

    def busy(self) -> bool:
        return self.patcher.busy()

    def scrub_found(self, mismatch: dict[str, Any]) -> None:
        self.patcher.scrub_found(mismatch)


@pytest.mark.parametrize("case", ["no_sums", "unreadable"])
def test_a_pass_that_skips_a_region_says_so_and_does_not_count_it_as_read(
    tmp_path: Path, patchers: list[Patcher], case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A region without expected sums, or one held in a dtype that cannot give back its
    checkpoint's bits (a write that replaced the tensor behind the engine's back), is not
    compared: the pass ends `skipped`, names the tensor and the cause, counts only the bytes it
    compared, and logs a warning."""
    patcher, targets, specs = _loaded(tmp_path, patchers, scrub_rate=0)
    name = "model.layers.1.mlp.down_proj.weight"
    shape, dtype = specs[name]
    skipped_bytes = int(np.prod(shape)) * ELEMENT_SIZE[dtype]
    model_bytes = sum(int(np.prod(s)) * ELEMENT_SIZE[d] for s, d in specs.values())
    if case == "no_sums":
        scrubber = Scrubber(_Uncovered(patcher, name), rate=1 << 30, period=0.01)
        cause = "no expected checksums"
    else:
        targets[name] = targets[name].to(torch.float16)  # float16 cannot hold bfloat16's bits
        scrubber = patcher.scrubber
        scrubber.set_schedule(rate=1 << 30, period=0.01)
        cause = "weights_mismatch"
    scrubber.start()
    try:
        with caplog.at_level("WARNING", logger="hotload_patch.scrub"):
            _wait("a pass", lambda: scrubber.snapshot()["passes"] >= 1)
        state = scrubber.snapshot()
    finally:
        if scrubber is not patcher.scrubber:
            scrubber.stop()
    last = state["last"]
    assert last["result"] == "skipped", last
    assert last["bytes"] == model_bytes - skipped_bytes
    assert last["skipped_bytes"] == skipped_bytes
    assert [s["tensor"] for s in last["skipped"]] == [name]
    assert cause in last["skipped"][0]["cause"] and name in last["message"]
    assert state["skips"] >= 1 and state["skipped_regions"] >= 1 and state["mismatch"] is None
    assert any(name in r.getMessage() and cause in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--scrub-period", "0"], "--scrub-period must be a positive number of seconds, not 0"),
        (["--scrub-period", "nan"], "--scrub-period must be a positive number of seconds"),
        (["--scrub-bytes-per-second", "-1"], "--scrub-bytes-per-second must be >= 0"),
    ],
)
def test_hotload_serve_refuses_a_scrub_schedule_it_cannot_keep(
    tmp_path: Path, args: list[str], says: str
) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "hotload", "serve", "--model", str(tmp_path), *args],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and says in proc.stderr, proc.stderr


def test_the_vllm_extension_reads_its_scrub_schedule_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hotload_patch import vllm as extension

    monkeypatch.delenv(extension.SCRUB_PERIOD_ENV, raising=False)
    assert extension.scrub_period() == 3600.0
    monkeypatch.setenv(extension.SCRUB_PERIOD_ENV, "90")
    assert extension.scrub_period() == 90.0
    for bad in ("0", "-5", "soon", "inf"):
        monkeypatch.setenv(extension.SCRUB_PERIOD_ENV, bad)
        with pytest.raises(ValueError, match=extension.SCRUB_PERIOD_ENV):
            extension.scrub_period()
    with pytest.raises(ValueError, match="period"):
        Scrubber(_Uncovered.__new__(_Uncovered), period=0)  # type: ignore[arg-type]
