"""Safetensors dtypes: element sizes, the unsigned view that carries a dtype's bit patterns, and
the torch dtype of each (torch imported only by `torch_dtype`)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: dtype name (as in a safetensors header) -> element size in bytes.
ELEMENT_SIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

_UINT_BY_SIZE: dict[int, type[np.unsignedinteger[Any]]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}

# Built once: the codec asks for one per chunk, and building a numpy dtype is not free.
_UINT_VIEW: dict[str, np.dtype[np.unsignedinteger[Any]]] = {
    name: np.dtype(_UINT_BY_SIZE[size]).newbyteorder("<") for name, size in ELEMENT_SIZE.items()
}

#: safetensors dtype -> the name of its torch dtype.
TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}


def uint_view_dtype(dtype: str) -> np.dtype[np.unsignedinteger[Any]]:
    """The little-endian unsigned integer numpy dtype with the element size of `dtype`."""
    return _UINT_VIEW[dtype]


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of safetensors dtype `dtype` (raises `KeyError` for an unknown one)."""
    import torch

    return getattr(torch, TORCH_NAMES[dtype])


def from_torch(dtype: Any) -> str | None:
    """The safetensors name of torch dtype `dtype` (None for one safetensors does not have)."""
    name = str(dtype).removeprefix("torch.")
    return next((k for k, v in TORCH_NAMES.items() if v == name), None)
