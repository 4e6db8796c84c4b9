"""Safetensors dtypes: element sizes and the unsigned integer view used to diff bit patterns."""

from __future__ import annotations

import numpy as np

# dtype name (as in a safetensors header) -> element size in bytes.
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

_UINT_BY_SIZE: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}


def element_size(dtype: str) -> int:
    """Return the size in bytes of one element of a safetensors dtype, or raise `KeyError`."""
    return ELEMENT_SIZE[dtype]


# Built once: the decoder asks for one per chunk, and building a numpy dtype is not free.
_UINT_VIEW: dict[str, np.dtype[np.unsignedinteger]] = {
    name: np.dtype(_UINT_BY_SIZE[size]).newbyteorder("<") for name, size in ELEMENT_SIZE.items()
}


def uint_view_dtype(dtype: str) -> np.dtype[np.unsignedinteger]:
    """Return the little-endian unsigned integer numpy dtype with the element size of `dtype`."""
    return _UINT_VIEW[dtype]


# torch dtype name -> safetensors dtype name (torch is never imported here).
TORCH_TO_SAFETENSORS: dict[str, str] = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.float8_e8m0fnu": "F8_E8M0",
    "torch.int16": "I16",
    "torch.uint16": "U16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.uint32": "U32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.uint64": "U64",
    "torch.float64": "F64",
}

NUMPY_TO_SAFETENSORS: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
}
