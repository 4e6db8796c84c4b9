"""Whether a staged patch may be written (`hotload_patch.verify`), check by check, on region sums
computed here from the bytes themselves: part of `make mutate`'s `patch-verify` selection
(tests/README.md "Mutation testing").

Tensor "x" is held in two halves (two ranks), "y" whole and unchanged, "z" by no rank. The
checksums the checks promise are zlib's adler32 of the parent's and the child's bytes, and each
region's partial sums follow adler32's definition (A = 1 + sum of bytes, B = n + sum of
(n - i) * byte_i), so nothing here is computed by the code under test.
"""

from __future__ import annotations

import zlib

import pytest

from hotload_patch import PatchError
from hotload_patch.sums import MOD, Region, RegionSum
from hotload_patch.verify import TensorCheck, checks_of, verify

X_OLD = bytes(range(16))
X_NEW = bytes([0, 1, 2, 200, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 99, 15])
Y = bytes([7, 7, 1, 0])
Z = bytes(8)


def _part(data: bytes, start: int, length: int) -> tuple[int, int]:
    """adler32's partial sums of bytes `start .. start + length` of `data`."""
    piece = data[start : start + length]
    a = sum(piece) % MOD
    b = sum((len(data) - start - i) * byte for i, byte in enumerate(piece)) % MOD
    return a, b


def _region(start: int, length: int) -> Region:
    return Region(start, (length,), (1,))


def _served(x: bytes = X_OLD) -> list[RegionSum]:
    """Every rank's sums: x in two halves (two ranks), y whole on the first rank."""
    return [
        RegionSum("x", _region(0, 8), *_part(x, 0, 8)),
        RegionSum("x", _region(8, 8), *_part(x, 8, 8)),
        RegionSum("y", _region(0, 4), *_part(Y, 0, 4)),
        # A tensor the patch does not list: left out of the checks, never an error.
        RegionSum("other", _region(0, 2), 1, 2),
    ]


def _deltas(new: bytes = X_NEW) -> list[RegionSum]:
    """How the patch moves each half of x's sums: the new bytes' sums minus the old ones'."""
    out = []
    for start in (0, 8):
        (oa, ob), (na, nb) = _part(X_OLD, start, 8), _part(new, start, 8)
        out.append(RegionSum("x", _region(start, 8), (na - oa) % MOD, (nb - ob) % MOD))
    return out


def _checks(**override: TensorCheck) -> dict[str, TensorCheck]:
    checks = {
        "x": TensorCheck(16, 16, zlib.adler32(X_OLD), zlib.adler32(X_NEW)),
        "y": TensorCheck(4, 4, zlib.adler32(Y), zlib.adler32(Y)),
        "z": TensorCheck(8, 8, zlib.adler32(Z), zlib.adler32(Z)),
    }
    return {**checks, **override}


def _refused(
    checks: dict[str, TensorCheck], served: list[RegionSum], deltas: list[RegionSum]
) -> PatchError:
    with pytest.raises(PatchError) as exc:
        verify(checks, served, deltas)
    return exc.value


def test_a_patch_on_its_parent_giving_the_promised_result_passes() -> None:
    verify(_checks(), _served(), _deltas())
    # Nothing changed and nothing promised: passes too.
    verify(_checks(x=TensorCheck(16, 16, zlib.adler32(X_OLD), zlib.adler32(X_OLD))), _served(), [])


def test_served_weights_other_than_the_parent_are_a_parent_mismatch() -> None:
    other = bytes([1]) + X_OLD[1:]
    err = _refused(_checks(), _served(other), _deltas())
    assert (err.reason, err.tensor) == ("parent_mismatch", "x")
    assert err.message == (
        f"the served weights have checksum {zlib.adler32(other):08x}, the patch's parent "
        f"{zlib.adler32(X_OLD):08x}: the engine does not hold the parent"
    )


def test_a_change_to_weights_no_rank_checksums_is_a_parent_mismatch() -> None:
    served = [s for s in _served() if s.tensor != "x"]
    err = _refused(_checks(), served, _deltas())
    assert (err.reason, err.tensor) == ("parent_mismatch", "x")
    assert err.message == "the engine has no checksum of the weights it serves here"


def test_a_tensor_the_patch_leaves_alone_must_keep_its_checksum() -> None:
    promised = zlib.adler32(Y)
    err = _refused(_checks(y=TensorCheck(4, 4, promised, promised ^ 1)), _served(), _deltas())
    assert (err.reason, err.tensor) == ("checksum_mismatch", "y")
    assert err.message == (
        f"the patch changes nothing here, the delta promises checksum {promised ^ 1:08x} after "
        f"{promised:08x}: the patch is corrupted"
    )


def test_changes_that_do_not_give_the_promised_result_are_a_checksum_mismatch() -> None:
    wrong = X_NEW[:15] + bytes([16])
    err = _refused(_checks(), _served(), _deltas(wrong))
    assert (err.reason, err.tensor) == ("checksum_mismatch", "x")
    assert err.message == (
        f"the patch's changes would give checksum {zlib.adler32(wrong):08x}, the delta promises "
        f"{zlib.adler32(X_NEW):08x}: the patch is corrupted"
    )


def test_the_parent_is_checked_before_the_result() -> None:
    # Both wrong: the parent is named (a wrong result on a wrong parent says nothing more).
    err = _refused(_checks(), _served(bytes(16)), _deltas(bytes(16)))
    assert err.reason == "parent_mismatch"


def test_checks_of_reads_each_tensors_promises() -> None:
    class Tensor:
        def __init__(self, name: str, numel: int, nbytes: int, base: int, target: int) -> None:
            self.name, self.numel, self.nbytes = name, numel, nbytes
            self.base_checksum, self.checksum = base, target

    tensors = [Tensor("a", 3, 6, 11, 12), Tensor("b", 1, 4, 21, 22)]
    assert checks_of(tensors) == {  # type: ignore[arg-type]
        "a": TensorCheck(3, 6, 11, 12),
        "b": TensorCheck(1, 4, 21, 22),
    }
