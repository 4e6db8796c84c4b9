"""A checkpoint folder's tensors as the engine side reads them (`hotload_patch.checkpoint`): the
names, shapes and dtypes of every shard's header, and each header it refuses with the file and
tensor at fault: part of `make mutate`'s `patch-checkpoint` selection (tests/README.md "Mutation
testing").

The shards are written here by safetensors' documented layout (an 8-byte little-endian header
length, the JSON header, the data), so the expected specs are the headers' own.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from hotload_patch import PatchError
from hotload_patch.checkpoint import checkpoint_specs


def shard(path: Path, header: dict[str, Any], *, pad_to: int = 0) -> Path:
    """A safetensors file of `header`, padded with spaces to `pad_to` bytes, and data after it
    (bytes that are no JSON: a reader that read past the header would fail)."""
    text = json.dumps(header).encode()
    text += b" " * max(0, pad_to - len(text))
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\x00\xff" * 160)
    return path


def test_every_shards_tensors_are_read_with_their_shapes_and_dtypes(tmp_path: Path) -> None:
    # The metadata comes first, as safetensors writes it: the tensors after it count too.
    shard(
        tmp_path / "model-00001-of-00002.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "model.embed.weight": {"dtype": "BF16", "shape": [16, 8], "data_offsets": [0, 256]},
            "model.scale": {"dtype": "F32", "shape": [], "data_offsets": [256, 260]},
        },
    )
    shard(
        tmp_path / "model-00002-of-00002.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "lm_head.weight": {"dtype": "F8_E4M3", "shape": [16, 8], "data_offsets": [0, 128]},
            "model.ids": {"dtype": "I64", "shape": [3], "data_offsets": [128, 152]},
        },
    )
    (tmp_path / "config.json").write_text("{}")  # not a shard
    assert checkpoint_specs(str(tmp_path)) == {
        "model.embed.weight": ((16, 8), "BF16"),
        "model.scale": ((), "F32"),
        "lm_head.weight": ((16, 8), "F8_E4M3"),
        "model.ids": ((3,), "I64"),
    }


def test_a_folder_without_shards_is_a_weights_mismatch_naming_it(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(PatchError) as exc:
        checkpoint_specs(tmp_path)
    err = exc.value
    assert (err.message, err.reason, err.path, err.tensor) == (
        "no safetensors files",
        "weights_mismatch",
        str(tmp_path),
        None,
    )


@pytest.mark.parametrize("size", [0, 7])
def test_a_shard_shorter_than_its_length_field_is_truncated(tmp_path: Path, size: int) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x10" * size)
    with pytest.raises(PatchError) as exc:
        checkpoint_specs(tmp_path)
    err = exc.value
    assert (err.message, err.reason, err.path) == ("truncated", "weights_mismatch", str(path))


# 2**64 - 1: a length field whose top bit is set (the field is unsigned: no header is that long;
# read as signed, it would be -1, and the rest of the file read as the header).
@pytest.mark.parametrize("length", [100 * 1024 * 1024 + 1, 2**64 - 1])
def test_a_header_longer_than_100_mib_is_refused_before_it_is_read(
    tmp_path: Path, length: int
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", length) + b"{}")
    with pytest.raises(PatchError) as exc:
        checkpoint_specs(tmp_path)
    err = exc.value
    assert (err.message, err.reason, err.path) == (
        "header too large",
        "weights_mismatch",
        str(path),
    )


def test_a_header_of_exactly_100_mib_is_read(tmp_path: Path) -> None:
    header = {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    shard(tmp_path / "model.safetensors", header, pad_to=100 * 1024 * 1024)
    assert checkpoint_specs(tmp_path) == {"w": ((2,), "U8")}


@pytest.mark.parametrize(
    "info",
    [
        {"dtype": "F12", "shape": [2]},  # a dtype safetensors does not have
        {"shape": [2]},
        {"dtype": "F32", "shape": "2"},
        {"dtype": "F32"},
    ],
    ids=["unknown-dtype", "no-dtype", "shape-not-a-list", "no-shape"],
)
def test_a_tensor_with_a_bad_dtype_or_shape_is_refused_naming_it_and_its_shard(
    tmp_path: Path, info: dict[str, Any]
) -> None:
    shard(tmp_path / "a.safetensors", {"ok": {"dtype": "F32", "shape": [1]}})
    bad = shard(tmp_path / "b.safetensors", {"ok2": {"dtype": "F16", "shape": [1]}, "bad": info})
    with pytest.raises(PatchError) as exc:
        checkpoint_specs(tmp_path)
    err = exc.value
    assert (err.message, err.reason, err.path, err.tensor) == (
        "bad dtype or shape",
        "weights_mismatch",
        str(bad),
        "bad",
    )
