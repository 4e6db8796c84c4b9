"""Safetensors dtypes: element sizes and the unsigned integer view used to diff bit patterns."""

from __future__ import annotations

# The table and the unsigned views live with the engine side of patches (`hotload_patch`, which
# imports nothing of hotload), so both halves read the same dtypes.
from hotload_patch.dtypes import ELEMENT_SIZE, uint_view_dtype

__all__ = [
    "ELEMENT_SIZE",
    "NUMPY_TO_SAFETENSORS",
    "TORCH_TO_SAFETENSORS",
    "element_size",
    "uint_view_dtype",
]


def element_size(dtype: str) -> int:
    """Return the size in bytes of one element of a safetensors dtype, or raise `KeyError`."""
    return ELEMENT_SIZE[dtype]


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


#: What to do about a tensor whose dtype or shape changed between two steps (a delta cannot
#: carry it).
CHANGE_FIX = (
    "Publish the same dtypes as the parent (Publisher(cast='BF16') casts F32/F16 tensors to "
    "BF16), or publish a full snapshot to change them (publish(..., full=True); "
    "`hotload publish --full`); the fleet must accept the new dtype or shape"
)
