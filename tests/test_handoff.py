"""The head handoff document (pure): what the operator hands a deployment's loaders, and how a
loader merges it into its copy of the ledger without reading the origin."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from hotload.errors import LedgerError
from hotload.ledger import LedgerDocument, NewEntry
from hotload.ledger.handoff import (
    LISTED_SNAPSHOTS,
    MAX_HINTS,
    TAIL_ENTRIES,
    Handoff,
    build_handoff,
    merge_handed,
)
from hotload.ledger.hints import Hint, HintFile

DIGEST = "sha256:" + "cd" * 32
CHECKED = datetime(2026, 11, 27, 12, 0, 0, tzinfo=UTC)


def trained(steps: int, *, full_every: int = 25, adapters_every: int = 0) -> list[LedgerDocument]:
    """The ledger after each of `steps` publishes (index i: after i publishes), a full
    snapshot every `full_every`, a reset before every 7th full, an adapter every
    `adapters_every` steps (0: none)."""
    doc = LedgerDocument("policy")
    docs = [doc]
    parent: str | None = None
    for i in range(steps):
        identity = f"step-{i:05d}"
        if i % full_every == 0:
            if i and i % (7 * full_every) == 0:
                doc, _ = doc.with_reset("a bad run")
            doc, _ = doc.appended(NewEntry(identity, "full", DIGEST, 1000, 1000))
        else:
            doc, _ = doc.appended(
                NewEntry(identity, "incremental", DIGEST, 10, 1000, previous=parent)
            )
        parent = identity
        if adapters_every and i % adapters_every == 0:
            doc, _ = doc.appended(NewEntry(f"lora-{i:05d}", "lora", DIGEST, 5, 5))
        docs.append(doc)
    return docs


def test_a_handoff_survives_its_json_whole() -> None:
    doc = trained(30)[-1]
    files = {doc.entries[-1].identity: [HintFile("model.safetensors", 1234, '"e1"')]}
    hint = Hint("step-00030", "incremental", "step-00029", (HintFile("a.arc", 5, None),))
    hint = Hint(**{**hint.__dict__, "updated_time": CHECKED})
    handed = build_handoff(doc, checked=CHECKED, listings=files, hints=[hint], pin="step-00012")
    again = Handoff.loads(handed.dumps(), "cm/head.json")
    assert again == handed
    assert again.head == doc.head and again.uploading == ("step-00030",)
    assert again.files == {doc.entries[-1].identity: (HintFile("model.safetensors", 1234, '"e1"'),)}
    assert again.pin == "step-00012" and again.checked == CHECKED


def test_the_tail_is_the_newest_entries_and_every_entry_after_since() -> None:
    doc = trained(40)[-1]
    handed = build_handoff(doc, checked=CHECKED)
    assert handed.entries == doc.entries[-TAIL_ENTRIES:]
    assert handed.since == doc.entries[-TAIL_ENTRIES - 1].sequence
    assert [e for e in doc.entries if e.sequence > handed.since] == list(handed.entries)
    assert handed.sequence == doc.sequence


def test_the_tail_reaches_back_to_the_head_past_many_adapters() -> None:
    doc = trained(1)[-1]
    for i in range(TAIL_ENTRIES + 5):
        doc, _ = doc.appended(NewEntry(f"lora-{i}", "lora", DIGEST, 5, 5))
    handed = build_handoff(doc, checked=CHECKED)
    assert handed.head is not None and handed.head.identity == "step-00000"
    assert handed.since == 0 and len(handed.entries) == TAIL_ENTRIES + 6


def test_a_loader_up_to_a_tail_behind_catches_up_exactly_and_further_behind_reads_the_origin() -> (
    None
):
    docs = trained(60, adapters_every=4)
    origin = docs[-1]
    handed = build_handoff(origin, checked=CHECKED)
    merged_any = False
    for copy in docs:
        merged = merge_handed(copy, handed, history=256)
        if copy.sequence >= handed.since:
            assert merged is not None, copy.sequence
            assert merged.entries == origin.entries and merged.sequence == origin.sequence
            assert merged.head == origin.head
            merged_any = True
        else:
            assert merged is None, f"a copy at {copy.sequence} cannot be brought to the head"
    assert merged_any


def test_merge_refuses_a_counter_that_went_back_another_ledger_and_a_disagreement() -> None:
    docs = trained(10)
    handed = build_handoff(docs[5], checked=CHECKED)
    assert merge_handed(docs[8], handed, history=256) is None  # the counter went back
    other = build_handoff(LedgerDocument("other", docs[9].sequence), checked=CHECKED)
    assert merge_handed(docs[9], other, history=256) is None
    # The loader's copy names another snapshot at a sequence the handoff also names.
    forked = LedgerDocument("policy")
    for i in range(7):
        forked, _ = forked.appended(NewEntry(f"fork-{i}", "full", DIGEST, 1, 1))
    assert merge_handed(forked, build_handoff(docs[9], checked=CHECKED), history=256) is None


def test_a_merged_copy_stays_bounded_over_ten_thousand_steps_and_keeps_what_it_is_told() -> None:
    history = 64
    doc = LedgerDocument("policy")
    copy = doc
    parent = None
    longest = 0
    for i in range(10_000):
        identity = f"s{i}"
        if i % 25 == 0:
            doc, _ = doc.appended(NewEntry(identity, "full", DIGEST, 1, 1))
        else:
            doc, _ = doc.appended(NewEntry(identity, "incremental", DIGEST, 1, 1, previous=parent))
        parent = identity
        doc = doc.compacted(history)
        merged = merge_handed(
            copy, build_handoff(doc, checked=CHECKED), history=history, keep={"s3"}
        )
        assert merged is not None
        copy = merged
        longest = max(longest, len(copy.entries))
    assert longest <= history + 1  # the kept pin beyond the last `history` entries
    assert copy.find("s3") is not None and copy.head == doc.head
    assert copy.chain_to() == doc.chain_to()


def test_hints_admitted_are_not_handed_and_only_the_newest_are() -> None:
    doc = trained(3)[-1]
    hints = [Hint(f"up-{i}", "full") for i in range(MAX_HINTS + 2)]
    hints.insert(0, Hint("step-00002", "incremental", "step-00001"))  # admitted already
    handed = build_handoff(doc, checked=CHECKED, hints=hints)
    assert handed.uploading == tuple(f"up-{i}" for i in range(2, MAX_HINTS + 2))


def test_listings_are_handed_for_the_newest_admitted_snapshots_only() -> None:
    doc = trained(10)[-1]
    listings = {e.identity: [HintFile("f", 1)] for e in doc.entries}
    listings["not-admitted"] = [HintFile("f", 1)]
    handed = build_handoff(doc, checked=CHECKED, listings=listings)
    newest = [e.identity for e in reversed(doc.entries)][:LISTED_SNAPSHOTS]
    assert set(handed.files) == set(newest)


def test_an_oversized_handoff_drops_listings_then_hints_never_entries() -> None:
    doc = trained(5)[-1]
    many = [HintFile(f"shard-{i:05d}.safetensors", i) for i in range(3000)]
    hint = Hint("up", "full", None, tuple(many))
    listings = {doc.entries[-1].identity: many}
    handed = build_handoff(doc, checked=CHECKED, listings=listings, hints=[hint], max_bytes=250_000)
    assert handed.files == {} and handed.uploading == ("up",)
    handed = build_handoff(doc, checked=CHECKED, listings=listings, hints=[hint], max_bytes=20_000)
    assert handed.files == {} and handed.hints == () and handed.hints_omitted
    assert handed.entries == doc.entries and len(handed.dumps()) <= 20_000
    # Said in the document (loaders must not read "nothing uploading"), and read back.
    assert Handoff.loads(handed.dumps(), "head").hints_omitted
    # Hints go oldest first: the newest that fits stays, and the handoff says some are missing.
    small = Hint("next", "full", None, tuple(many[:10]))
    handed = build_handoff(
        doc, checked=CHECKED, listings=listings, hints=[hint, small], max_bytes=20_000
    )
    assert handed.hints == (small,) and handed.hints_omitted
    fits = build_handoff(doc, checked=CHECKED, hints=[small], max_bytes=20_000)
    assert fits.hints == (small,) and fits.to_json()["hintsOmitted"] is False
    # Nothing uploading: nothing omitted.
    assert not build_handoff(doc, checked=CHECKED, max_bytes=20_000).hints_omitted


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.update(formatVersion=99), "formatVersion"),
        (lambda d: d["files"].update({"step-00004": [{"name": "../x", "size": 1}]}), "step-00004"),
        (lambda d: d["entries"].reverse(), "out of order"),
        (lambda d: d.update(since=-1), "since"),
        (lambda d: d.update(checkedTime="yesterday"), "checkedTime"),
        (lambda d: d["entries"][0].update(identity="a/b"), "entries[0]"),
        (lambda d: d.update(hintsOmitted="yes"), "hintsOmitted"),
    ],
)
def test_a_malformed_handoff_is_refused_naming_the_field(change: object, named: str) -> None:
    doc = trained(5)[-1]
    raw = build_handoff(doc, checked=CHECKED).to_json()
    change(raw)  # type: ignore[operator]
    with pytest.raises(LedgerError, match=r"cm/head\.json") as err:
        Handoff.loads(json.dumps(raw), "cm/head.json")
    assert named in str(err.value)


def test_same_content_ignores_only_the_heartbeat() -> None:
    doc = trained(5)[-1]
    a = build_handoff(doc, checked=CHECKED)
    b = build_handoff(doc, checked=datetime(2026, 11, 27, 12, 0, 30, tzinfo=UTC))
    assert a.same_content(b) and not a.same_content(None)
    assert not a.same_content(build_handoff(doc, checked=CHECKED, pin="step-00001"))
