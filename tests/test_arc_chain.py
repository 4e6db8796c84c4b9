"""One pass through a chain of deltas: the full snapshot at its end, written once, verified.

Real snapshots and deltas (`hotload.arc.encode`): sparse, dense and compact-encoded steps in one
chain; the result must be the last step's bytes, file for file, and a chain that does not
hold together must leave nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hotload.arc import encode
from hotload.arc.chain import decode_chain
from hotload.errors import ChecksumMismatchError, CorruptDeltaError, WrongParentError
from hotload.snapshot import write_snapshot
from support.snapshots import CONFIG, flip_payload_byte, weights
from support.tiny_llm import sparse_steps


def _steps(root: Path) -> tuple[list[Path], list[Path]]:
    """Full snapshots s0..s4 and their deltas: 5% sparse, 5% sparse, a dense step (every
    element moved), a compact 5% step."""
    w = weights(0, layers=3, width=96)
    base = write_snapshot(root / "base", w, config=CONFIG, cast="BF16", overwrite=True).path
    fulls, deltas = sparse_steps(base, root / "a", 2, fraction=0.05, seed=1)
    dense, _ = sparse_steps(fulls[-1], root / "b", 1, fraction=1.0, seed=2)
    last, _ = sparse_steps(dense[1], root / "c", 1, fraction=0.05, seed=3)
    fulls = [*fulls, dense[1], last[1]]
    chain = [deltas[1], deltas[2]]
    for k in (3, 4):
        out = root / "d" / f"step-{k}"
        encode(fulls[k - 1], fulls[k], out, parent_identity=fulls[k - 1].name, compact=k == 4)
        chain.append(out)
    return fulls, chain


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_a_chain_rebuilds_its_last_snapshot_in_one_pass(tmp_path: Path) -> None:
    fulls, chain = _steps(tmp_path)
    out = tmp_path / "out"
    stats = decode_chain(fulls[0], chain, out, threads=2)
    assert _same_files(out, fulls[4])
    assert stats.deltas == 4 and stats.changed > 0
    full_bytes = sum(p.stat().st_size for p in fulls[4].glob("*.safetensors"))
    assert stats.written <= full_bytes  # each shard written once (or linked)
    # A chain of one is a decode.
    decode_chain(fulls[0], chain[:1], tmp_path / "one")
    assert _same_files(tmp_path / "one", fulls[1])


def test_a_chain_that_does_not_hold_leaves_nothing(tmp_path: Path) -> None:
    fulls, chain = _steps(tmp_path)
    out = tmp_path / "out"
    # Out of order: the second delta's parent checksums are not the first's result.
    with pytest.raises(WrongParentError):
        decode_chain(fulls[0], [chain[1], chain[0]], out)
    assert not out.exists()
    # Headers name the parents: checked when asked.
    with pytest.raises(WrongParentError):
        decode_chain(fulls[0], chain[:2], out, parents=["step-0", "step-9"])
    assert not out.exists()
    # A corrupted payload in the middle of the chain.
    flip_payload_byte(chain[2])
    with pytest.raises((CorruptDeltaError, ChecksumMismatchError)):
        decode_chain(fulls[0], chain, out)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
