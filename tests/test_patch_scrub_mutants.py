"""The scrub thread (`hotload_patch.scrub.Scrubber`) over a few small tensors whose expected sums
come from adler32's definition: what a pass records (ok, mismatch, skipped, failed), the mismatch
it keeps until a full load, the schedule's checks and changes, the pace it reads at, a read the
weights changed under, and the refusal a standing mismatch gives a patch: part of `make
mutate`'s `patch-scrub` selection (tests/README.md "Mutation testing").

The subject is a stand-in for the Patcher (`Held`): the scrub sees only its `Subject` protocol,
so each test sets the epoch, the busy flag and the expected sums the state it checks needs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hotload_patch import PatchError, scrub
from hotload_patch.placement import IdentityHost
from hotload_patch.scrub import (
    MAX_SKIPPED_NAMED,
    Scrubber,
    ScrubState,
    check_schedule,
    mismatch_error,
)
from hotload_patch.served import Counters
from hotload_patch.sums import Region
from support.fleet import wait_for

#: Adler-32's modulus.
MOD = 65521
#: The three float32 tensors most tests hold (4 bytes an element).
SHAPES = {"a.weight": (4, 6), "b.weight": (10,), "c.weight": (3, 3)}
MISMATCH = (
    "does not hold what its checksums say: the weights changed in memory since they were last "
    "written (a flipped bit, or a write the engine was not told about); load the snapshot in full"
)


def partial(t: torch.Tensor) -> tuple[int, int]:
    """Adler-32's partial sums of a whole tensor's little-endian bytes: their sum, and each byte
    times its distance from the end."""
    raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().astype(np.int64)
    return int(raw.sum()) % MOD, int((raw * np.arange(raw.size, 0, -1)).sum()) % MOD


def nbytes(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) * 4


class Held:
    """A `Subject`: float32 tensors behind an `IdentityHost`, their expected sums computed when
    made, an epoch and a busy flag the test sets, and the mismatches the scrub reports."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.host = IdentityHost(lambda: self.tensors)
        self.counters = Counters()
        self.specs = {n: (tuple(t.shape), "F32") for n, t in tensors.items()}
        self.expected = {(n, Region.whole(tuple(t.shape))): partial(t) for n, t in tensors.items()}
        self.at = 0
        self.known = True
        self.busy_for = 0  # how many more `busy()` calls say True
        self.busy_calls = 0
        self.found: list[dict[str, Any]] = []

    def scrub_target(self) -> Any:
        return (self.at, self.specs, self.expected) if self.known else None

    def epoch(self) -> int:
        return self.at

    def busy(self) -> bool:
        self.busy_calls += 1
        if self.busy_for > 0:
            self.busy_for -= 1
            return True
        return False

    def scrub_found(self, mismatch: dict[str, Any]) -> None:
        self.found.append(mismatch)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def flip(t: torch.Tensor, at: int) -> None:
    """Flip one bit of element `at`, behind the scrub's back."""
    t.view(-1).view(torch.int32)[at] ^= 1 << 20


@pytest.fixture
def scrubbers() -> Iterator[list[Scrubber]]:
    made: list[Scrubber] = []
    yield made
    for s in made:
        s.stop()


def started(
    made: list[Scrubber], subject: Any, *, rate: float = 1 << 30, period: float = 3600.0, **kw: Any
) -> Scrubber:
    scrubber = Scrubber(subject, rate=rate, period=period, **kw)
    made.append(scrubber)
    scrubber.start()
    return scrubber


def passes(scrubber: Scrubber, n: int = 1, timeout: float = 30.0) -> dict[str, Any]:
    """The state once `n` passes are done."""
    got = wait_for(
        f"{n} scrub pass(es)",
        lambda: (s := scrubber.snapshot())["passes"] >= n and s,
        timeout,
        interval=0.01,
    )
    assert isinstance(got, dict)
    return got


def test_a_schedule_it_cannot_keep_is_refused_naming_the_setting() -> None:
    for rate in (-1.0, float("nan")):
        with pytest.raises(ValueError) as exc:
            check_schedule(rate, 60.0)
        assert str(exc.value) == (
            f"the scrub's rate must be >= 0 bytes per second (0: off), not {rate!r}"
        )
    for period in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError) as exc:
            check_schedule(1.0, period)
        assert str(exc.value) == (
            f"the scrub's period must be a positive number of seconds, not {period!r}"
        )
    check_schedule(0.0, 1e-9)  # off, and the shortest period
    check_schedule(float("inf"), 1e9)


def test_a_fresh_state_and_one_under_way_as_json() -> None:
    state = ScrubState(5.0)
    assert state.to_json() == {
        "rate_bytes_per_second": 5.0,
        "period_seconds": 3600.0,
        "passes": 0,
        "mismatches": 0,
        "skips": 0,
        "skipped_regions": 0,
        "last": None,
        "mismatch": None,
        "next": None,
        "current": None,
    }
    state = ScrubState(1.0, 2.0, 3, 4, 5, 6, {"x": 1}, {"y": 2}, 7.0, 8, 9, 10.0)
    assert state.to_json() == {
        "rate_bytes_per_second": 1.0,
        "period_seconds": 2.0,
        "passes": 3,
        "mismatches": 4,
        "skips": 5,
        "skipped_regions": 6,
        "last": {"x": 1},
        "mismatch": {"y": 2},
        "next": 10.0,
        "current": {"started": 7.0, "bytes": 8, "total": 9},
    }


def test_a_pass_over_matching_weights_reads_each_byte_once_and_ends_ok(
    scrubbers: list[Scrubber],
) -> None:
    held = Held(tensors())
    total = sum(nbytes(s) for s in SHAPES.values())
    before = time.time()
    ran: list[str] = []
    scrubber = started(
        scrubbers, held, initializer=lambda: ran.append(threading.current_thread().name)
    )
    state = passes(scrubber)
    after = time.time()
    last = state["last"]
    assert set(last) == {"result", "started", "finished", "seconds", "bytes", "tensor", "message"}
    assert last["result"] == "ok" and last["bytes"] == total
    assert last["tensor"] is None and last["message"] == ""
    assert before <= last["started"] <= last["finished"] <= after
    assert last["seconds"] == round(last["finished"] - last["started"], 3)
    assert state["passes"] == 1 and state["mismatches"] == state["skips"] == 0
    assert state["current"] is None and state["mismatch"] is None
    assert held.counters.scrub_bytes == total and held.counters.checksum_bytes == 0
    assert ran == ["hotload-scrub"]
    # The next pass is due a period after this one began, and the thread rests until then.
    assert state["next"] == pytest.approx(last["started"] + 3600.0, abs=5.0)
    time.sleep(0.3)
    assert scrubber.snapshot()["passes"] == 1 and held.counters.scrub_bytes == total


def test_a_mismatch_names_the_tensor_and_parameter_and_stands_until_a_full_load(
    scrubbers: list[Scrubber],
) -> None:
    # "b.weight" ties to "a.weight"'s tensor: its parameter is "a.weight". Listed first, it is
    # read first, and its flipped bit ends the pass before "a.weight" is read.
    shared = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    held = Held({"b.weight": shared, "c.weight": torch.ones(3, 3)})
    held.tensors = {"a.weight": shared, "b.weight": shared, "c.weight": held.tensors["c.weight"]}
    held.at = 6
    flip(shared, 7)
    scrubber = started(scrubbers, held, period=0.05)
    state = passes(scrubber)
    message = f"tensor 'b.weight' (parameter a.weight) {MISMATCH}"
    found = {"tensor": "b.weight", "parameter": "a.weight", "message": message, "epoch": 6}
    assert held.found == [found]
    assert state["mismatch"] == found and state["mismatches"] == 1
    last = state["last"]
    assert (last["result"], last["tensor"], last["message"]) == ("mismatch", "b.weight", message)
    assert last["bytes"] == 0  # nothing compared before it
    # While it stands, no pass runs, however short the period.
    time.sleep(0.4)
    assert scrubber.snapshot()["passes"] == 1 and scrubber.snapshot()["next"] is None
    # A full load: the sums are read from the weights again, the mismatch goes, and the next
    # pass (a period later) finds them right.
    held.expected[("b.weight", Region.whole((4, 6)))] = partial(shared)
    scrubber.restart()
    assert scrubber.snapshot()["mismatch"] is None
    state = passes(scrubber, 2)
    assert state["last"]["result"] == "ok" and state["mismatches"] == 1
    assert state["last"]["bytes"] == nbytes((4, 6)) + nbytes((3, 3))


def test_a_mismatch_after_regions_that_matched_counts_the_bytes_compared(
    scrubbers: list[Scrubber],
) -> None:
    held = Held(tensors())
    flip(held.tensors["c.weight"], 0)
    state = passes(started(scrubbers, held))
    assert state["last"]["result"] == "mismatch" and state["last"]["tensor"] == "c.weight"
    assert state["last"]["bytes"] == nbytes((4, 6)) + nbytes((10,))


def test_a_patch_refused_while_a_mismatch_stands_says_why() -> None:
    err = mismatch_error({"tensor": "a.weight", "message": "it differs"})
    assert isinstance(err, PatchError)
    assert (err.reason, err.tensor) == ("parent_mismatch", "a.weight")
    assert (
        err.message == "a scrub found the served weights differ from their checksums (it differs)"
    )
    assert mismatch_error({"message": "m"}).tensor is None


def test_a_pass_names_at_most_sixteen_skipped_regions_and_counts_them_all(
    scrubbers: list[Scrubber], caplog: pytest.LogCaptureFixture
) -> None:
    many = {f"t{i:02}": torch.full((i + 1,), float(i)) for i in range(MAX_SKIPPED_NAMED + 2)}
    many["kept"] = torch.arange(5.0)
    held = Held(many)
    held.expected = {k: v for k, v in held.expected.items() if k[0] == "kept"}
    with caplog.at_level(logging.WARNING, logger="hotload_patch.scrub"):
        state = passes(started(scrubbers, held))
    last = state["last"]
    cause = (
        "no expected checksums for this region (the engine's checksums do not cover it: a "
        "layout it no longer holds, or a load it was not told about)"
    )
    names = ", ".join(f"'t{i:02}' ({cause})" for i in range(MAX_SKIPPED_NAMED))
    message = (
        f"{MAX_SKIPPED_NAMED + 2} region(s) of the served weights were not compared, so this "
        f"pass proves nothing of them: {names} and 2 more; loading the snapshot in full "
        "checksums them again"
    )
    assert last["result"] == "skipped" and last["message"] == message
    assert last["tensor"] == "t00" and last["bytes"] == nbytes((5,))
    assert last["skipped"] == [
        {"tensor": f"t{i:02}", "parameter": f"t{i:02}", "bytes": nbytes((i + 1,)), "cause": cause}
        for i in range(MAX_SKIPPED_NAMED)
    ]
    assert last["skipped_bytes"] == sum(nbytes((i + 1,)) for i in range(MAX_SKIPPED_NAMED + 2))
    assert (state["skips"], state["skipped_regions"], state["passes"]) == (1, 18, 1)
    assert state["mismatch"] is None and not held.found
    # The scrub's own logger: another test's leftovers (asyncio's warning about a session
    # collected late) may land in the same capture.
    said = [r.getMessage() for r in caplog.records if r.name == "hotload_patch.scrub"]
    assert said == [f"scrub: {message}"]


def test_one_skipped_region_is_named_without_a_count_of_more(scrubbers: list[Scrubber]) -> None:
    held = Held(tensors())
    held.tensors["b.weight"] = held.tensors["b.weight"].to(torch.float16)
    last = passes(started(scrubbers, held))["last"]
    assert last["result"] == "skipped" and last["tensor"] == "b.weight"
    (skipped,) = last["skipped"]
    assert skipped["cause"].startswith(
        "cannot be read as its checkpoint's F32 (weights_mismatch): "
    )
    assert last["message"].endswith(
        f"nothing of them: 'b.weight' ({skipped['cause']}); loading the snapshot in full "
        "checksums them again"
    )


def test_a_failed_pass_is_reported_not_counted_and_the_thread_goes_on(
    scrubbers: list[Scrubber],
) -> None:
    held = Held(tensors())
    calls: list[int] = []
    place = held.host.place

    def broken(name: str, shape: tuple[int, ...], dtype: str) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the engine went away")
        return place(name, shape, dtype)

    held.host.place = broken  # type: ignore[method-assign]
    scrubber = started(scrubbers, held, period=0.05)
    state = passes(scrubber)
    assert state["passes"] == 1 and state["last"]["result"] == "ok"
    assert scrubber._thread is not None and scrubber._thread.is_alive()


def test_a_failed_pass_says_why(scrubbers: list[Scrubber]) -> None:
    held = Held(tensors())

    def broken(name: str, shape: tuple[int, ...], dtype: str) -> Any:
        raise RuntimeError("the engine went away")

    held.host.place = broken  # type: ignore[method-assign]
    scrubber = started(scrubbers, held)
    last = wait_for("a failed pass", lambda: scrubber.snapshot()["last"], 30, interval=0.01)
    assert last["result"] == "failed" and last["bytes"] == 0 and last["tensor"] is None
    assert last["message"] == "RuntimeError: the engine went away"
    assert scrubber.snapshot()["passes"] == 0


def test_the_schedule_changes_take_effect_and_a_bad_one_changes_nothing(
    scrubbers: list[Scrubber],
) -> None:
    scrubber = Scrubber(Held(tensors()), rate=0, period=60.0)
    scrubber.set_schedule(period=30.0)
    assert (scrubber.rate, scrubber.period) == (0, 30.0)
    scrubber.set_rate(100)
    assert (scrubber.rate, scrubber.period) == (100.0, 30.0)
    assert scrubber.snapshot()["rate_bytes_per_second"] == 100.0
    assert scrubber.snapshot()["period_seconds"] == 30.0
    with pytest.raises(ValueError, match="period"):
        scrubber.set_schedule(period=0)
    assert (scrubber.rate, scrubber.period) == (100.0, 30.0)


def test_a_scrub_turned_on_later_begins_its_first_pass_then(scrubbers: list[Scrubber]) -> None:
    held = Held(tensors())
    scrubber = started(scrubbers, held, rate=0)
    time.sleep(0.3)
    assert scrubber.snapshot()["passes"] == 0 and held.counters.scrub_bytes == 0
    assert scrubber.snapshot()["next"] is None
    scrubber.set_rate(1 << 30)
    assert passes(scrubber)["last"]["result"] == "ok"


def test_a_restart_before_the_first_pass_puts_it_a_period_later(
    scrubbers: list[Scrubber],
) -> None:
    held = Held(tensors())
    scrubber = Scrubber(held, rate=1 << 30, period=3600.0)
    scrubbers.append(scrubber)
    scrubber.restart()  # a full load's checksum read: as good as a pass
    scrubber.start()
    time.sleep(0.3)
    state = scrubber.snapshot()
    assert state["passes"] == 0 and held.counters.scrub_bytes == 0
    assert state["next"] > time.time() + 3500


def test_no_pass_runs_while_no_sums_are_known_or_a_load_is_under_way(
    scrubbers: list[Scrubber],
) -> None:
    held = Held(tensors())
    held.known = False
    scrubber = started(scrubbers, held)
    time.sleep(0.3)
    assert scrubber.snapshot()["passes"] == 0 and held.counters.scrub_bytes == 0
    held.known, held.at = True, 3  # odd: a full load's checksum read under way
    time.sleep(0.3)
    assert scrubber.snapshot()["passes"] == 0 and held.counters.scrub_bytes == 0
    held.at = 4
    state = passes(scrubber)
    assert state["last"]["result"] == "ok" and held.found == []


@pytest.fixture
def still_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scrub's monotonic clock stands still (wall time runs on): a pace's sleep is then
    exactly what the bytes read so far owe the rate, however long the reads took."""
    monkeypatch.setattr(scrub, "time", SimpleNamespace(monotonic=lambda: 1000.0, time=time.time))


@pytest.mark.usefixtures("still_clock")
def test_the_scrub_sleeps_what_its_rate_needs_in_chunks_of_an_eighth_of_it(
    scrubbers: list[Scrubber],
) -> None:
    """At 2**20 bytes a second a read goes 2**17 elements a chunk (the eighth of the rate,
    above the 2**16 floor); each chunk asks for the sleep that keeps the pass at the rate."""
    held = Held({"big": torch.randn(3 << 17, generator=torch.Generator().manual_seed(2))})
    slept: list[float] = []
    state = passes(started(scrubbers, held, rate=float(1 << 20), sleep=slept.append))
    assert state["last"]["result"] == "ok"
    # One a chunk: 2**17 float32 elements are 2**19 bytes, half a second at the rate.
    assert slept == [0.5, 1.0, 1.5]


def test_a_pass_under_way_says_how_far_it_has_read(scrubbers: list[Scrubber]) -> None:
    """Seen from the rate's sleeps (one per chunk; a chunk per tensor here): the pass's start,
    the bytes of the regions compared so far, and the bytes of all of them."""
    gen = torch.Generator().manual_seed(4)
    held = Held(
        {"a": torch.randn(1 << 16, generator=gen), "b": torch.randn(1 << 16, generator=gen)}
    )
    seen: list[tuple[Any, Any]] = []
    scrubber = Scrubber(held, rate=float(1 << 19), period=3600.0)
    scrubbers.append(scrubber)
    scrubber.sleep = lambda _: seen.append(((snap := scrubber.snapshot())["current"], snap["next"]))
    scrubber.start()
    last = passes(scrubber)["last"]
    assert last["result"] == "ok"
    each = 4 << 16
    assert seen == [
        ({"started": last["started"], "bytes": 0, "total": 2 * each}, None),
        ({"started": last["started"], "bytes": each, "total": 2 * each}, None),
    ]


def test_the_pass_asks_where_each_tensor_lies_by_name_shape_and_dtype(
    scrubbers: list[Scrubber],
) -> None:
    held = Held(tensors())
    asked: list[tuple[str, tuple[int, ...], str]] = []
    place = held.host.place

    def recorded(name: str, shape: tuple[int, ...], dtype: str) -> Any:
        asked.append((name, shape, dtype))
        return place(name, shape, dtype)

    held.host.place = recorded  # type: ignore[method-assign]
    passes(started(scrubbers, held))
    assert asked[:3] == [(n, s, "F32") for n, s in SHAPES.items()]


@pytest.mark.usefixtures("still_clock")
def test_a_rate_of_one_byte_a_second_still_scrubs(scrubbers: list[Scrubber]) -> None:
    held = Held({"w": torch.arange(4.0)})
    slept: list[float] = []
    state = passes(started(scrubbers, held, rate=1.0, sleep=slept.append))
    assert state["last"]["result"] == "ok" and slept == [16.0]  # 4 float32 at 1 byte a second


def test_a_slow_rate_reads_in_chunks_of_at_least_65536_elements(
    scrubbers: list[Scrubber],
) -> None:
    held = Held({"big": torch.randn(3 << 16, generator=torch.Generator().manual_seed(2))})
    slept: list[float] = []
    passes(started(scrubbers, held, rate=1000.0, sleep=slept.append))
    assert len(slept) == 3


def test_the_scrub_waits_while_a_patch_stages_without_owing_the_rate_that_time(
    scrubbers: list[Scrubber],
) -> None:
    held = Held(tensors())
    held.busy_for = 5
    slept: list[float] = []
    scrubber = started(scrubbers, held, rate=1 << 30, sleep=slept.append)
    state = passes(scrubber)
    assert state["last"]["result"] == "ok"
    assert slept.count(0.05) == 5 and held.busy_for == 0
    assert held.counters.scrub_bytes == sum(nbytes(s) for s in SHAPES.values())


def test_a_region_whose_epoch_moved_under_the_read_is_read_again_not_reported(
    scrubbers: list[Scrubber],
) -> None:
    """The flipped bit and the epoch bump come together (a patch that wrote the element): the
    region read before the write is read again with the new sums, and nothing is reported."""
    held = Held(tensors())
    total = sum(nbytes(s) for s in SHAPES.values())
    calls: list[int] = []
    busy = held.busy

    def patched_once() -> bool:
        calls.append(1)
        if len(calls) == 1:
            flip(held.tensors["a.weight"], 2)
            held.expected[("a.weight", Region.whole((4, 6)))] = partial(held.tensors["a.weight"])
            held.at += 2
        return busy()

    held.busy = patched_once  # type: ignore[method-assign]
    state = passes(started(scrubbers, held))
    assert state["last"]["result"] == "ok" and held.found == []
    assert state["last"]["bytes"] == total
    assert held.counters.scrub_bytes == total + nbytes((4, 6))  # "a.weight" read twice


def test_stop_ends_the_thread(scrubbers: list[Scrubber]) -> None:
    held = Held(tensors())
    scrubber = started(scrubbers, held, rate=0)
    thread = scrubber._thread
    assert thread is not None and thread.is_alive()
    scrubber.start()  # idempotent: the same thread
    assert scrubber._thread is thread
    assert thread.daemon  # an engine exiting does not wait for a pass
    scrubber.stop()
    assert not thread.is_alive()
