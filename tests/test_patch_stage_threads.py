"""Staging a patch's tensors in threads (`staging.stage(threads=N)`, the default for weights on
an accelerator): the same staged writes, sums and result as one thread, and the same error (the
first failing tensor in the patch's order)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hotload_patch import PatchError, staging
from hotload_patch.format import PatchFile
from hotload_patch.placement import LoaderHost
from support.patch_models import CFG, bits, load_ranks, same_bits
from support.patches import build_chain, rewrite_patch, set_first
from support.threads import ThreadsSeen


def _same_staged(a: staging.Staged, b: staging.Staged) -> None:
    assert (a.changed, a.checks) == (b.changed, b.checks)
    assert [(d.tensor, d.region, d.a, d.b) for d in a.deltas] == [
        (d.tensor, d.region, d.a, d.b) for d in b.deltas
    ]
    assert [w.param for w in a.writes] == [w.param for w in b.writes]
    for wa, wb in zip(a.writes, b.writes, strict=True):
        assert torch.equal(wa.index, wb.index)
        assert same_bits(wa.new, wb.new)
        assert [(p.tensor, p.slot, p.start, p.stop) for p in wa.parts] == [
            (p.tensor, p.slot, p.start, p.stop) for p in wb.parts
        ]


@pytest.mark.parametrize("world", [1, 2])
def test_staging_in_threads_stages_what_one_thread_stages(tmp_path: Path, world: int) -> None:
    chain = build_chain(tmp_path, "BF16")
    children = load_ranks(chain.child, CFG, world, torch.float32)
    for rank, model in enumerate(load_ranks(chain.parent, CFG, world, torch.float32)):
        host = LoaderHost(model)
        one = staging.stage(host, chain.patch, identity="step-1", parent="step-0", threads=1)
        four = staging.stage(host, chain.patch, identity="step-1", parent="step-0", threads=4)
        assert len({d.tensor for d in four.deltas}) > 1  # several tensors: the pool ran
        _same_staged(one, four)
        staging.apply(four, host.parameters())
        child = dict(children[rank].named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(bits(param), bits(child[name])), name


def test_a_threaded_stage_refuses_with_the_first_failing_tensor(tmp_path: Path) -> None:
    chain = build_chain(tmp_path, "BF16")
    host = LoaderHost(load_ranks(chain.parent, CFG, 1, torch.float32)[0])
    with PatchFile(chain.patch) as pf:
        # Changed tensors the engine holds, in the patch's order.
        held = [t.name for t in pf.tensors if t.changed and host.place(t.name, t.shape, t.dtype)]
    first, last = held[0], held[-1]
    nan = 0x7FC0
    once = rewrite_patch(chain.patch, tmp_path / "once.patch", last, set_first(nan))
    both = rewrite_patch(once, tmp_path / "both.patch", first, set_first(nan))
    for patch, expected in ((once, last), (both, first)):
        with pytest.raises(PatchError) as exc:
            staging.stage(host, patch, identity="step-1", parent="step-0", threads=4)
        assert (exc.value.reason, exc.value.tensor) == ("not_finite", expected)


def test_threads_default_to_one_for_weights_on_the_cpu() -> None:
    # A CPU engine serves on those cores while a patch stages.
    params = {"w": torch.zeros(4)}
    assert staging._stage_threads(params) == 1
    assert staging.STAGE_THREADS >= 1


@pytest.mark.parametrize("threads", [1, 2])
def test_staging_runs_in_the_callers_thread_or_in_as_many_named_threads_as_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """One thread stages in the caller's thread; more stage in that many threads at most (a
    CPU engine serves on the other cores meanwhile), named for a profile or a stack dump."""
    chain = build_chain(tmp_path, "BF16")
    (model,) = load_ranks(chain.parent, CFG, 1, torch.float32)
    seen = ThreadsSeen(staging._stage_tensor, pooled=threads > 1, linger=0.02)
    monkeypatch.setattr(staging, "_stage_tensor", seen)
    staging.stage(
        LoaderHost(model), chain.patch, identity="step-1", parent="step-0", threads=threads
    )
    assert len(seen.names) > 2
    if threads == 1:
        assert set(seen.names) == {threading.current_thread().name}
    else:
        assert set(seen.names) == {"hotload-stage_0", "hotload-stage_1"}


def _first_plane_offset(entry: object) -> int | None:
    """The data offset of the first plane named anywhere in a tensor's header entry."""
    if isinstance(entry, dict):
        planes = entry.get("planes")
        if isinstance(planes, list) and planes:
            return int(planes[0][0])
        for value in entry.values():
            found = _first_plane_offset(value)
            if found is not None:
                return found
    return None


def test_a_patch_decoded_in_threads_reads_what_one_thread_reads(tmp_path: Path) -> None:
    chain = build_chain(tmp_path, "BF16")
    with PatchFile(chain.patch) as one, PatchFile(chain.patch, threads=4) as four:
        assert [t.name for t in one.tensors] == [t.name for t in four.tensors]
        for a, b in zip(one.tensors, four.tensors, strict=True):
            for pa, pb in zip(a.changes(), b.changes(), strict=True):
                assert pa.tolist() == pb.tolist(), a.name
    # Damaged planes in two tensors: the first in the file's order is the error, as with one.
    with PatchFile(chain.patch, runs=False) as pf:
        entries = {e["name"]: e for e in pf.header["tensors"]}
        changed = [t.name for t in pf.tensors if _first_plane_offset(entries[t.name]) is not None]
    first, last = changed[0], changed[-1]
    data = bytearray(chain.patch.read_bytes())
    for name in (last, first):
        at = _first_plane_offset(entries[name])
        assert at is not None
        data[at] ^= 0xFF
        damaged = tmp_path / f"damaged-{name}.patch"
        damaged.write_bytes(data)
        for threads in (1, 4):
            with pytest.raises(PatchError) as exc:
                PatchFile(damaged, threads=threads)
            assert (exc.value.reason, exc.value.tensor) == ("patch_corrupt", name)
