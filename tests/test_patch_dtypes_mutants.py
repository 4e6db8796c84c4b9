"""Safetensors dtypes on the engine side (`hotload_patch.dtypes`): each name's torch dtype and
back, the unsigned view of its bit patterns, and the dtypes safetensors does not have: part of
`make mutate`'s `patch-dtypes` selection (tests/README.md "Mutation testing").

The expected pairs are the safetensors format's dtype names and torch's dtypes, written out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotload_patch.dtypes import ELEMENT_SIZE, from_torch, torch_dtype, uint_view_dtype

PAIRS = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}


@pytest.mark.parametrize(("name", "dtype"), PAIRS.items(), ids=list(PAIRS))
def test_each_safetensors_dtype_has_its_torch_dtype_and_back(name: str, dtype: torch.dtype) -> None:
    assert torch_dtype(name) is dtype
    assert from_torch(dtype) == name
    assert ELEMENT_SIZE[name] == torch.empty(0, dtype=dtype).element_size()


@pytest.mark.parametrize("name", list(PAIRS))
def test_the_bit_pattern_view_is_little_endian_unsigned_of_the_element_size(name: str) -> None:
    view = uint_view_dtype(name)
    assert view.kind == "u" and view.itemsize == ELEMENT_SIZE[name]
    assert view.byteorder in ("<", "|") or (view.byteorder == "=" and np.little_endian)


def test_a_torch_dtype_safetensors_does_not_have_is_none() -> None:
    for dtype in (torch.complex64, torch.qint8, torch.float8_e4m3fnuz):
        assert from_torch(dtype) is None


def test_an_unknown_safetensors_dtype_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        torch_dtype("F12")
