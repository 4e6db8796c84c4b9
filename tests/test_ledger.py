"""The ledger: its rules and chain resolution (pure), and compare-and-swap on a real local folder
and a real S3 server (racing writers, stale writers, resets, compaction, polling)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotload.bucket import open_bucket
from hotload.errors import (
    InvalidIdentityError,
    LedgerConflictError,
    LedgerError,
    LedgerRejectedError,
)
from hotload.ledger import (
    FORMAT_VERSION,
    Ledger,
    LedgerDocument,
    LedgerEntry,
    LedgerState,
    NewEntry,
    ledger_key,
    open_ledger,
)

DIGEST = "sha256:" + "ab" * 32


def full(identity: str, size: int = 1000) -> NewEntry:
    return NewEntry(identity, "full", DIGEST, size, size)


def delta(identity: str, parent: str, size: int = 10) -> NewEntry:
    return NewEntry(identity, "incremental", DIGEST, size, 1000, previous=parent)


def build(*ops: NewEntry | str) -> LedgerDocument:
    """Apply entries (and `"reset"` strings) to an empty document."""
    doc = LedgerDocument("policy")
    for op in ops:
        if isinstance(op, str):
            doc, _ = doc.with_reset(op)
        else:
            doc, _ = doc.appended(op)
    return doc


def ids(entries: list[LedgerEntry]) -> list[str]:
    return [e.identity for e in entries]


# --- rules (pure) ---------------------------------------------------------------------------------


def test_sequences_times_and_previous_are_assigned() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    doc, first = LedgerDocument("policy").appended(full("s0"), now=when)
    doc, second = doc.appended(delta("s1", "s0"))
    doc, third = doc.appended(full("s2"))
    assert [e.sequence for e in doc.entries] == [1, 2, 3] and doc.sequence == 3
    assert first.published_time == when and first.previous is None
    assert second.previous == "s0"
    assert third.previous == "s1"  # a full snapshot records the head it replaced
    assert doc.head == third


@pytest.mark.parametrize(
    ("ops", "new", "message"),
    [
        ((), delta("s1", "s0"), "is empty"),
        ((full("s0"),), delta("s1", "elsewhere"), "the head is 's0'"),
        ((full("s0"), delta("s1", "s0")), delta("s2", "s0"), "the head is 's1'"),
        ((full("s0"),), full("s0"), "already in the ledger"),
        ((full("s0"),), NewEntry("s1", "incremental", DIGEST, 1, 1), "does not name its parent"),
        ((full("s0"), "trainer restarted"), delta("s1", "s0"), "must be a full snapshot"),
        ((full("s0"),), NewEntry("s1", "full", "md5:abc", 1, 1), "manifest digest"),
        ((full("s0"),), NewEntry("s1", "full", DIGEST, -1, 1), "non-negative"),
        ((full("s0"),), NewEntry("s1", "delta", DIGEST, 1, 1), "kind"),  # type: ignore[arg-type]
        ((full("s0"),), NewEntry("s1", "full", DIGEST, 1, 1, prompt_cache="some"), "prompt-cache"),  # type: ignore[arg-type]
    ],
)
def test_rejections_say_why(ops: tuple[NewEntry | str, ...], new: NewEntry, message: str) -> None:
    doc = build(*ops)
    with pytest.raises(LedgerRejectedError, match=message):
        doc.appended(new)


def test_identity_must_be_a_path_segment() -> None:
    with pytest.raises(InvalidIdentityError):
        build(full("a/b"))


def test_reset_then_delta_rejected_then_full_accepted() -> None:
    doc = build(full("s0"), delta("s1", "s0"), "restarted from step 0")
    reset = doc.pending_reset
    assert reset is not None and reset.sequence == 3 and reset.previous_head == "s1"
    with pytest.raises(
        LedgerRejectedError, match=r"reset at sequence 3 \('restarted from step 0'\)"
    ):
        doc.appended(delta("s2", "s1"))
    doc, entry = doc.appended(full("s2"))
    assert entry.sequence == 4 and entry.previous is None  # the chain was broken on purpose
    assert doc.pending_reset is None
    doc, after = doc.appended(delta("s3", "s2"))
    assert after.sequence == 5
    with pytest.raises(LedgerRejectedError, match="needs a reason"):
        doc.with_reset("   ")


def test_chain_resolution() -> None:
    doc = build(
        full("f0"),
        delta("d1", "f0"),
        delta("d2", "d1"),
        full("f3"),
        delta("d4", "f3"),
        delta("d5", "d4"),
    )
    # A new replica: the latest full snapshot plus every delta after it.
    assert ids(doc.resolve_chain(None)) == ["f3", "d4", "d5"]
    # One step behind: just the last delta.
    assert ids(doc.resolve_chain("d4")) == ["d5"]
    assert ids(doc.resolve_chain("f3")) == ["d4", "d5"]
    # Far behind (before the latest full): start again from the full snapshot.
    assert ids(doc.resolve_chain("d1")) == ["f3", "d4", "d5"]
    assert ids(doc.resolve_chain("unknown-or-compacted")) == ["f3", "d4", "d5"]
    # Up to date: nothing to do.
    assert doc.resolve_chain("d5") == []
    # A pinned older target.
    assert ids(doc.resolve_chain(None, target="d2")) == ["f0", "d1", "d2"]
    assert ids(doc.resolve_chain("d1", target="d2")) == ["d2"]
    with pytest.raises(LedgerError, match="not in the ledger"):
        doc.resolve_chain(None, target="nope")
    assert LedgerDocument("empty").resolve_chain(None) == []


def test_lora_adapters_ride_beside_the_base_chain() -> None:
    doc = build(
        full("f0"),
        NewEntry("a1", "lora", DIGEST, 5, 5),
        delta("d1", "f0"),  # an adapter never moves the head a delta follows
        NewEntry("a2", "lora", DIGEST, 5, 5),
        "base retrained",
        NewEntry("a3", "lora", DIGEST, 5, 5),  # adapters may follow a reset ...
    )
    assert doc.head is not None and doc.head.identity == "d1"
    assert doc.last is not None and doc.last.identity == "a3"
    assert ids(doc.adapters()) == ["a3", "a2", "a1"] and ids(doc.adapters(2)) == ["a3", "a2"]
    assert ids(doc.resolve_chain(None)) == ["f0", "d1"]
    assert ids(doc.resolve_chain("a1", target="a3")) == ["a3"]  # complete: no chain
    assert doc.find("a1") is not None and doc.find("a1").previous is None  # type: ignore[union-attr]
    # ... but the reset still forces the next base entry to be full.
    assert doc.pending_reset is not None
    with pytest.raises(LedgerRejectedError, match="must be a full snapshot"):
        doc.check(delta("d2", "d1"))
    with pytest.raises(LedgerRejectedError, match="adapters are complete"):
        doc.check(NewEntry("a4", "lora", DIGEST, 5, 5, previous="a3"))
    doc, _ = doc.appended(full("f2"))
    assert doc.pending_reset is None and doc.find("f2").previous is None  # type: ignore[union-attr]
    assert doc.to_json()["head"] == "f2" and doc.to_json()["latestAdapter"] == "a3"
    # Compaction keeps the base chain whatever the adapters published since.
    for i in range(5, 10):
        doc, _ = doc.appended(NewEntry(f"a{i}", "lora", DIGEST, 5, 5))
    assert ids(doc.compacted(keep=2).entries) == ["f2", "a8", "a9"]


def test_compaction_keeps_the_chain_from_the_latest_full() -> None:
    doc = build(
        full("f0"), delta("d1", "f0"), "oops", full("f2"), delta("d3", "f2"), delta("d4", "d3")
    )
    assert doc.sequence == 6
    compacted = doc.compacted(keep=1)
    assert ids(list(compacted.entries)) == ["f2", "d3", "d4"]  # never cut into the live chain
    assert compacted.compacted_through == 3  # the dropped entries and the old reset
    assert compacted.resets == ()
    assert compacted.sequence == 6  # the sequence never rewinds
    assert ids(compacted.resolve_chain(None)) == ids(doc.resolve_chain(None))
    assert ids(doc.compacted(keep=4).entries) == ["d1", "f2", "d3", "d4"]
    assert doc.compacted(keep=10) is doc
    _, entry = compacted.appended(delta("d5", "d4"))
    assert entry.sequence == 7


def test_compaction_keeps_a_pending_reset() -> None:
    doc = build(full("f0"), full("f1"), full("f2"), "rolled back")
    compacted = doc.compacted(keep=1)
    assert ids(list(compacted.entries)) == ["f2"]
    assert compacted.pending_reset is not None
    with pytest.raises(LedgerRejectedError, match="must be a full"):
        compacted.appended(delta("d3", "f2"))


def test_json_round_trip_and_format() -> None:
    doc = build(full("f0"), delta("d1", "f0"), "why not")
    stored = json.loads(doc.dumps())
    assert stored["formatVersion"] == FORMAT_VERSION
    assert list(stored["entries"][1]) == [
        "sequence",
        "identity",
        "kind",
        "previous",
        "publishedTime",
        "promptCache",
        "manifestDigest",
        "shippedBytes",
        "fullBytes",
    ]
    assert stored["entries"][1]["publishedTime"].endswith("Z")
    assert stored["head"] == "d1" and stored["resetPending"] is True
    again = LedgerDocument.loads(doc.dumps(), "test")
    assert again == doc
    stored["futureField"] = {"kept": True}
    assert json.loads(LedgerDocument.from_json(stored, "t").dumps())["futureField"] == {
        "kept": True
    }


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(formatVersion=99), "newer than this hotload"),
        (lambda d: d.pop("formatVersion"), "formatVersion"),
        (
            lambda d: d["entries"][1].update(sequence=1),
            r"entries\[1\].sequence: 1 does not increase",
        ),
        (lambda d: d["entries"][0].update(kind="weird"), r"entries\[0\].kind"),
        (lambda d: d["entries"][0].update(publishedTime="yesterday"), "publishedTime"),
        (lambda d: d["entries"][1].update(identity="f0"), "appears twice"),
        (lambda d: d.update(sequence=1), "beyond the ledger's sequence"),
        (lambda d: d.update(entries={}), "entries: must be a list"),
    ],
)
def test_malformed_documents_are_refused(mutate: object, message: str) -> None:
    stored = json.loads(build(full("f0"), delta("d1", "f0")).dumps())
    mutate(stored)  # type: ignore[operator]
    with pytest.raises(LedgerError, match=message):
        LedgerDocument.from_json(stored, "bucket/.hotload/ledgers/policy.json")
    with pytest.raises(LedgerError, match="not valid JSON"):
        LedgerDocument.loads(b"{nope", "x")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["full", "delta", "reset", "compact", "bad-delta"]), max_size=40))
def test_invariants_hold_for_any_history(ops: list[str]) -> None:
    doc = LedgerDocument("policy")
    last_sequence = 0
    for n, op in enumerate(ops):
        head = doc.head
        try:
            if op == "full":
                doc, _ = doc.appended(full(f"s{n}"))
            elif op == "delta":
                doc, _ = doc.appended(delta(f"s{n}", head.identity if head else "none"))
            elif op == "bad-delta":
                doc, _ = doc.appended(delta(f"s{n}", "not-the-head"))
            elif op == "reset":
                doc, _ = doc.with_reset("test")
            else:
                doc = doc.compacted(keep=2)
        except LedgerRejectedError:
            assert op in ("delta", "bad-delta")
            if op == "delta":
                assert head is None or doc.pending_reset is not None
        assert doc.sequence >= last_sequence
        last_sequence = doc.sequence
        seqs = [e.sequence for e in doc.entries]
        assert seqs == sorted(set(seqs)) and all(s > doc.compacted_through for s in seqs)
        chain = doc.resolve_chain(None)
        if doc.entries:
            assert chain[0].kind == "full" and chain[-1] == doc.head
            for earlier, later in itertools.pairwise(chain):
                assert later.kind == "incremental" and later.previous == earlier.identity
            for i, entry in enumerate(chain):
                assert doc.resolve_chain(entry.identity) == chain[i + 1 :]


# --- a ledger in a real bucket --------------------------------------------------------------------


def test_append_read_and_where_it_lives(bucket_url: str) -> None:
    bucket = open_bucket(bucket_url)
    ledger = Ledger(bucket, "policy")
    empty = ledger.read()
    assert not empty.exists and empty.document.entries == ()
    ledger.append(full("s0"))
    ledger.append(delta("s1", "s0"))
    stored = json.loads(bucket.get(".hotload/ledgers/policy.json").data)
    assert stored["formatVersion"] == 1 and stored["name"] == "policy"
    assert [e["identity"] for e in stored["entries"]] == ["s0", "s1"]
    state = ledger.read()
    assert state.exists and state.document.sequence == 2
    assert ledger_key("policy") == ".hotload/ledgers/policy.json"
    same = open_ledger(f"{bucket_url}/policy").read()
    assert same.document == state.document and same.etag == state.etag


def test_stale_writer_gets_a_conflict_and_rereads(bucket_url: str) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    ledger.append(full("s0"))
    stale = ledger.read()
    ledger.append(full("s1"))  # another writer moves on
    with pytest.raises(LedgerConflictError, match="another writer changed the ledger"):
        ledger.append(full("s2"), state=stale)
    entry = ledger.append_retrying(full("s2"))
    assert entry.sequence == 3
    # A writer whose entry already landed (answer lost) gets it back instead of an error.
    assert ledger.append_retrying(full("s2")) == entry
    # Creating a ledger is a compare-and-swap too.
    fresh = Ledger(open_bucket(bucket_url), "other")
    never_read = fresh.read()
    fresh.append(full("a"))
    with pytest.raises(LedgerConflictError):
        fresh.append(full("b"), state=never_read)


def test_two_writers_race_for_the_same_sequence(bucket_url: str) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    ledger.append(full("s0"))
    for round_ in range(3):
        state = ledger.read()
        barrier = threading.Barrier(2)
        results: dict[str, str] = {}

        def writer(
            name: str,
            state: LedgerState = state,
            barrier: threading.Barrier = barrier,
            results: dict[str, str] = results,
        ) -> None:
            barrier.wait()
            try:
                entry = ledger.append(full(name), state=state)
                results[name] = f"won {entry.sequence}"
            except LedgerConflictError:
                results[name] = "conflict"

        names = [f"r{round_}-a", f"r{round_}-b"]
        threads = [threading.Thread(target=writer, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes = sorted(results.values())
        assert outcomes == ["conflict", f"won {round_ + 2}"], results
        assert ledger.read().document.sequence == round_ + 2


def test_racing_writers_lose_nothing(bucket_url: str) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(5):
                ledger.append_retrying(full(f"w{w}-{i}"), attempts=50)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    doc = ledger.read().document
    assert [e.sequence for e in doc.entries] == list(range(1, 21))
    assert sorted(ids(list(doc.entries))) == sorted(f"w{w}-{i}" for w in range(4) for i in range(5))


def test_racing_processes_lose_nothing(bucket_url: str, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from hotload.bucket import open_bucket
        from hotload.ledger import Ledger, NewEntry
        url, who = sys.argv[1], sys.argv[2]
        ledger = Ledger(open_bucket(url), "policy")
        for i in range(4):
            ledger.append_retrying(
                NewEntry(f"{who}-{i}", "full", "sha256:" + "cd" * 32, 1, 1), attempts=50
            )
        # As the CLI does: obstore may abort during interpreter teardown after the work is done.
        from hotload.cli.main import exit_now
        exit_now(0)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, bucket_url, f"p{n}"], stderr=subprocess.PIPE
        )
        for n in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    doc = Ledger(open_bucket(bucket_url), "policy").read().document
    assert [e.sequence for e in doc.entries] == list(range(1, 9))
    assert len({e.identity for e in doc.entries}) == 8


def test_racing_deltas_on_one_head(bucket_url: str) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    ledger.append(full("s0"))
    barrier = threading.Barrier(2)
    results: dict[str, str] = {}

    def writer(name: str) -> None:
        barrier.wait()
        try:
            ledger.append_retrying(delta(name, "s0"))
            results[name] = "won"
        except LedgerRejectedError as exc:
            results[name] = str(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winner = [n for n, r in results.items() if r == "won"]
    assert len(winner) == 1, results
    loser = next(r for r in results.values() if r != "won")
    assert f"the head is '{winner[0]}'" in loser  # re-read, then refused: its parent moved on


def test_reset_then_delta_is_rejected(bucket_url: str) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    ledger.append(full("s0"))
    ledger.append(delta("s1", "s0"))
    record = ledger.reset("trainer restarted from step-0 checkpoint")
    assert record.sequence == 3 and record.previous_head == "s1"
    with pytest.raises(LedgerRejectedError, match="must be a full snapshot"):
        ledger.append(delta("s2", "s1"))
    with pytest.raises(LedgerRejectedError, match="must be a full snapshot"):
        ledger.append_retrying(delta("s2", "s1"))
    doc = ledger.read().document
    assert doc.sequence == 3 and doc.resets[0].reason == "trainer restarted from step-0 checkpoint"
    assert ledger.append(full("s2")).sequence == 4
    assert ledger.append(delta("s3", "s2")).sequence == 5


def test_compaction_in_the_bucket(bucket_url: str) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy", history=3)
    ledger.append(full("f0"))
    for i in range(1, 4):
        ledger.append(delta(f"d{i}", f"d{i - 1}" if i > 1 else "f0"))
    ledger.append(full("f4"))
    for i in range(5, 8):
        ledger.append(delta(f"d{i}", f"d{i - 1}" if i > 5 else "f4"))
    doc = ledger.read().document
    # Automatic compaction keeps `history` entries, and the whole chain from the latest full.
    assert ids(list(doc.entries)) == ["f4", "d5", "d6", "d7"]
    assert doc.sequence == 8 and doc.compacted_through == 4
    assert ids(ledger.resolve_chain(None)) == ["f4", "d5", "d6", "d7"]
    compacted = ledger.compact(keep=1)
    assert ids(list(compacted.entries)) == ["f4", "d5", "d6", "d7"]
    assert ledger.append(full("f8")).sequence == 9
    assert ids(list(ledger.compact(keep=1).entries)) == ["f8"]
    assert ledger.read().document.sequence == 9


def test_chain_resolution_for_replicas(bucket_url: str) -> None:
    ledger = Ledger(open_bucket(bucket_url), "policy")
    ledger.append(full("f0"))
    ledger.append(delta("d1", "f0"))
    ledger.append(full("f2"))
    for i in range(3, 7):
        ledger.append(delta(f"d{i}", f"d{i - 1}" if i > 3 else "f2"))
    assert ids(ledger.resolve_chain(None)) == ["f2", "d3", "d4", "d5", "d6"]  # a new replica
    assert ids(ledger.resolve_chain("d5")) == ["d6"]  # one step behind
    assert ids(ledger.resolve_chain("d1")) == ["f2", "d3", "d4", "d5", "d6"]  # far behind
    assert ids(ledger.resolve_chain("d3")) == ["d4", "d5", "d6"]
    assert ledger.resolve_chain("d6") == []


def test_followers_poll_cheaply_and_detect_rewinds(bucket_url: str) -> None:
    writer = Ledger(open_bucket(bucket_url), "policy")
    follower = Ledger(open_bucket(bucket_url), "policy")  # its own client, read-only
    writer.append(full("s0"))
    seen = follower.read()
    assert follower.poll(seen.etag) is None  # unchanged
    writer.append(delta("s1", "s0"))
    changed = follower.poll(seen.etag, last_sequence=seen.document.sequence)
    assert changed is not None and changed.document.head is not None
    assert changed.document.head.identity == "s1"
    assert follower.poll(changed.etag) is None
    # Someone restores an old copy: the follower refuses to go back in time.
    writer.bucket.put(writer.key, seen.document.dumps())
    with pytest.raises(LedgerError, match="sequence went back from 2 to 1"):
        follower.poll(changed.etag, last_sequence=changed.document.sequence)


def test_corrupt_ledger_names_the_object(bucket_url: str) -> None:
    bucket = open_bucket(bucket_url)
    bucket.put(".hotload/ledgers/policy.json", b"{not json")
    ledger = Ledger(bucket, "policy")
    with pytest.raises(LedgerError) as err:
        ledger.read()
    assert ".hotload/ledgers/policy.json" in str(err.value) and "not valid JSON" in str(err.value)
    bucket.put(".hotload/ledgers/other.json", build(full("x")).dumps())
    with pytest.raises(LedgerError, match="holds ledger 'policy'"):
        Ledger(bucket, "other").read()


def test_bad_ledger_names() -> None:
    for name in ("", "a/b", ".hidden", "x" * 200):
        with pytest.raises(LedgerError):
            ledger_key(name)
