"""One engine's sparse-load state (`hotload_patch.session.Patcher`): what it says when nothing is
loaded or staged, the folder it was loaded from, its one background thread (a patch stages after
the checksum read under way), a write holding it busy, a patch written after a failed checksum
read, and `close` letting the work under way finish: part of `make mutate`'s `patch-session`
selection (tests/README.md "Mutation testing").

A real patch file between two real snapshots (arc_v2 delta, `prepare_patch`), real torch tensors
behind an `IdentityHost`; the expected checksums are zlib's adler32 of the child's bytes.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from hotload.arc import encode
from hotload.arc.patch import prepare_patch
from hotload.snapshot import write_snapshot
from hotload_patch import PatchError
from hotload_patch.checkpoint import checkpoint_specs
from hotload_patch.placement import IdentityHost
from hotload_patch.session import Patcher
from hotload_patch.sums import combine_regions
from support.patch_models import read_checkpoint, same_bits
from support.patches import Chain
from support.snapshots import CONFIG

#: The elements the step moves by one ulp, by tensor (flat positions).
MOVED = {"model.layers.0.mlp.weight": [0, 9, 63], "model.norm.weight": [5]}
SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.mlp.weight": (8, 8),
    "model.norm.weight": (8,),
}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    """Snapshots `s0`, `s1` (float32; `MOVED` elements one ulp up) and the patch between them."""
    root = tmp_path_factory.mktemp("session")
    rng = np.random.default_rng(11)
    w0 = {n: rng.standard_normal(s, dtype=np.float32) for n, s in SHAPES.items()}
    w1 = {n: a.copy() for n, a in w0.items()}
    for name, at in MOVED.items():
        w1[name].reshape(-1).view(np.uint32)[at] += 1
    s0 = write_snapshot(root / "s0", w0, config=CONFIG, overwrite=True).path
    s1 = write_snapshot(root / "s1", w1, config=CONFIG, overwrite=True).path
    encode(s0, s1, root / "delta" / "s1", parent_identity="s0", overwrite=True, threads=1)
    prepare_patch(s0, root / "delta" / "s1", root / "s1.patch")
    return Chain(s0, s1, root / "s1.patch")


class Weights:
    """The engine's weights (the parent's tensors), handed out through a hook that a test sets
    to see, block or fail the Patcher's reads and writes."""

    def __init__(self, folder: Path) -> None:
        self.targets = read_checkpoint(folder)
        self.hook: Callable[[], None] | None = None

    def block_first_read(self) -> tuple[threading.Event, threading.Event]:
        """Hold the next read until the second event is set; the first is set once it waits."""
        entered, release = threading.Event(), threading.Event()

        def block() -> None:
            self.hook = None
            entered.set()
            assert release.wait(30)

        self.hook = block
        return entered, release

    def __call__(self) -> Mapping[str, torch.Tensor]:
        if self.hook is not None:
            self.hook()
        return self.targets


#: Makes a Patcher over the weights (and initializer) given, with the scrub off so that only
#: the test's calls read them; each is closed after the test.
MakePatcher = Callable[..., Patcher]


@pytest.fixture
def patcher_over() -> Iterator[MakePatcher]:
    made: list[Patcher] = []

    def make(weights: Weights, initializer: Callable[[], None] | None = None) -> Patcher:
        made.append(Patcher(IdentityHost(weights), initializer=initializer, scrub_rate=0))
        return made[-1]

    yield make
    for patcher in made:
        patcher.close()


def _adler(t: torch.Tensor) -> int:
    return zlib.adler32(t.contiguous().numpy().tobytes())


def _sizes() -> dict[str, tuple[int, int]]:
    return {n: (int(np.prod(s)), int(np.prod(s)) * 4) for n, s in SHAPES.items()}


def test_without_checksums_or_a_staged_patch_the_errors_say_which(
    chain: Chain, patcher_over: MakePatcher
) -> None:
    patcher = patcher_over(Weights(chain.parent))
    with pytest.raises(PatchError) as exc:
        patcher.served()
    assert exc.value.reason == "parent_mismatch"
    assert exc.value.message == (
        "the engine has no checksums of the weights it serves (it was not told which "
        "checkpoint they came from)"
    )
    with pytest.raises(PatchError) as exc:
        patcher.staged()
    assert exc.value.reason == "not_staged"
    assert exc.value.message == "no patch is staged (or it is still staging)"


def test_the_source_is_the_folder_of_the_last_full_load(
    chain: Chain, patcher_over: MakePatcher
) -> None:
    patcher = patcher_over(Weights(chain.parent))
    assert patcher.source is None  # nothing loaded yet: no folder to compare a reload with
    specs = checkpoint_specs(chain.parent)
    patcher.weights_changed(specs, source=str(chain.parent))
    assert patcher.source == str(chain.parent)
    patcher.weights_changed(loaded=False)  # a change it did not derive: the same folder
    assert patcher.source == str(chain.parent)
    patcher.weights_changed(specs)  # a full load the engine names no folder for
    assert patcher.source is None


def test_the_background_work_runs_in_one_thread_a_patch_after_the_read_under_way(
    chain: Chain, patcher_over: MakePatcher
) -> None:
    weights = Weights(chain.parent)
    entered, release = weights.block_first_read()
    threads: list[str] = []
    patcher = patcher_over(
        weights, initializer=lambda: threads.append(threading.current_thread().name)
    )
    patcher.weights_changed(checkpoint_specs(chain.parent))
    assert entered.wait(30)
    try:
        job = patcher.stage(str(chain.patch), identity="s1", parent="s0")
        assert patcher.state() == {"served": "pending", "staging": "pending"}
        assert patcher.busy() is True  # a patch staging: the scrub waits
        with pytest.raises(PatchError) as exc:
            patcher.staged()
        assert exc.value.reason == "not_staged"
    finally:
        release.set()
    staged = job.result(timeout=30)
    assert staged.changed == sum(len(at) for at in MOVED.values())
    assert patcher.state() == {"served": "ready", "staging": "ready"}
    assert patcher.busy() is False  # staged, not being written
    # The initializer ran once, in the Patcher's one named thread (the scrub's runs apart).
    assert [t for t in threads if t != "hotload-scrub"] == ["hotload-patch_0"]


def test_a_write_holds_the_patcher_busy_with_the_epoch_odd(
    chain: Chain, patcher_over: MakePatcher
) -> None:
    weights = Weights(chain.parent)
    patcher = patcher_over(weights)
    patcher.weights_changed(checkpoint_specs(chain.parent))
    patcher.stage(str(chain.patch), identity="s1", parent="s0").result(timeout=30)
    seen: list[tuple[bool, int]] = []
    weights.hook = lambda: seen.append((patcher.busy(), patcher.epoch() % 2))
    patcher.apply()
    assert seen == [(True, 1)]  # the write takes the weights once, busy and odd
    assert (patcher.busy(), patcher.epoch() % 2) == (False, 0)
    assert patcher.rollback() is True
    assert len(seen) > 1 and set(seen) == {(True, 1)}  # each take of the undo's write too
    assert (patcher.busy(), patcher.epoch() % 2) == (False, 0)


def test_a_failed_checksum_read_is_reported_and_a_patch_is_written_then_read_again(
    chain: Chain, patcher_over: MakePatcher
) -> None:
    weights = Weights(chain.parent)

    def fail_once() -> None:
        weights.hook = None
        raise RuntimeError("the engine's weights are not ready")

    weights.hook = fail_once
    patcher = patcher_over(weights)
    patcher.weights_changed(checkpoint_specs(chain.parent))
    patcher.stage(str(chain.patch), identity="s1", parent="s0").result(timeout=30)
    assert patcher.state() == {
        "served": "failed",
        "staging": "ready",
        "error": {
            "reason": "stage_failed",
            "message": "reading the served weights' checksums failed: RuntimeError: the "
            "engine's weights are not ready",
            "tensor": None,
        },
    }

    patcher.apply()  # no parent sums to derive from: written, then read again
    child = read_checkpoint(chain.child)
    assert all(same_bits(weights.targets[n], child[n]) for n in child)
    served = patcher.served(timeout=30)
    assert combine_regions(served, _sizes()) == {n: _adler(t) for n, t in child.items()}
    moved = sum(len(at) for at in MOVED.values())
    total = sum(n for _, n in _sizes().values())
    assert patcher.counters.to_json() == {
        "checksum_bytes": total,  # the read after the patch; the failed one read nothing
        "scrub_bytes": 0,
        "host_bytes": 0,
        "patched_elements": moved,
        "patched_bytes": moved * 4,
        "patches": 1,
    }


def test_close_lets_the_read_under_way_finish(chain: Chain, patcher_over: MakePatcher) -> None:
    weights = Weights(chain.parent)
    entered = threading.Event()

    def slow_first_read() -> None:
        weights.hook = None
        entered.set()
        time.sleep(0.5)

    weights.hook = slow_first_read
    patcher = patcher_over(weights)
    patcher.weights_changed(checkpoint_specs(chain.parent))
    assert entered.wait(30)
    patcher.close()
    assert patcher.state() == {"served": "ready", "staging": "none"}


def test_a_stage_that_close_cancelled_reads_as_none(
    chain: Chain, patcher_over: MakePatcher
) -> None:
    """A stage queued behind the read under way when `close` runs is cancelled: the state says
    nothing is staged, and asking it raises nothing."""
    weights = Weights(chain.parent)
    entered, release = weights.block_first_read()
    patcher = patcher_over(weights)
    patcher.weights_changed(checkpoint_specs(chain.parent))
    assert entered.wait(30)
    job = patcher.stage(str(chain.patch), identity="s1", parent="s0")
    closing = threading.Thread(target=patcher.close)
    closing.start()
    while not job.cancelled() and closing.is_alive():  # close cancels the queue, then waits
        time.sleep(0.01)
    release.set()
    closing.join(30)
    assert job.cancelled()
    assert patcher.state() == {"served": "ready", "staging": "none"}
