"""Block-FP8 snapshots (issue 50, part 1): written deterministically by `hotload snapshot build
--fp8` and `Publisher(fp8=...)`, refused at validation (what admission runs) when the guide's
rules are broken, naming the tensor, and carried exactly by arc_v2 deltas.

Expected values come from the inputs: the scales are recomputed here with numpy from the BF16
weights (largest magnitude per 128x128 block over 448), the bytes of untouched blocks from the
unmodified tensor, the rebuilt snapshots compared byte for byte with the ones written.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hotload.arc import decode, encode
from hotload.cli.main import run
from hotload.errors import SnapshotValidationError
from hotload.snapshot import Snapshot, build_from_folder, validate_snapshot, write_snapshot
from hotload.snapshot.fp8 import dequantize, quantize
from hotload.snapshot.safetensors_io import iter_file
from hotload.snapshot.validate import validate_transition
from support.families import FAMILIES, save_family

EXPERT = "model.layers.0.mlp.experts.1.down_proj.weight"
ATTENTION = "model.layers.0.self_attn.q_proj.weight"
GATE = "model.layers.0.mlp.gate.weight"


def _tensors(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of a snapshot folder: dtype, shape and bytes."""
    out = {}
    for shard in Snapshot(folder).shard_files:
        for name, raw in iter_file(folder / shard):
            out[name] = (raw.dtype, tuple(raw.shape), bytes(raw.data))
    return out


def _f32(dtype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    if dtype == "BF16":
        bits = np.frombuffer(data, "<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(shape)
    assert dtype == "F32"
    return np.frombuffer(data, "<f4").reshape(shape)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_family(FAMILIES["qwen3-moe"], tmp_path_factory.mktemp("moe") / "hf", seed=4)


def test_quantizing_a_block_depends_on_that_block_alone() -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=gen) * 0.02).to(torch.bfloat16)
    values, scale = quantize(w)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == (math.ceil(300 / 128), math.ceil(260 / 128)) == (3, 3)
    ref = w.float().numpy()
    for i in range(3):
        for j in range(3):
            block = ref[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert float(scale[i, j]) == pytest.approx(np.abs(block).max() / 448.0, rel=1e-6)
    back = dequantize(values, scale).numpy()
    # E4M3 keeps 3 mantissa bits: within half a step of 2**-3 relative, or the block's
    # smallest subnormal step.
    per_element = np.repeat(np.repeat(scale.numpy(), 128, 0), 128, 1)[:300, :260]
    tolerance = np.maximum(np.abs(ref) * 2.0**-4, per_element * 2.0**-9)
    assert np.all(np.abs(back - ref) <= tolerance * 1.0001)
    # One element of block (1, 2) moves: only that block's bytes and scale may change.
    moved = w.clone()
    moved[200, 258] = moved[200, 258] * 40
    values2, scale2 = quantize(moved)
    a, b = values.view(torch.uint8).numpy(), values2.view(torch.uint8).numpy()
    changed = np.argwhere(a != b)
    assert len(changed) and all(r // 128 == 1 and c // 128 == 2 for r, c in changed)
    assert [(i, j) for i in range(3) for j in range(3) if scale[i, j] != scale2[i, j]] == [(1, 2)]
    again_values, again_scale = quantize(w)
    assert torch.equal(again_values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(again_scale, scale)


@pytest.mark.parametrize("recipe", ["experts", "linear"])
def test_the_build_writes_the_recipe_and_its_quantization_config(
    moe_folder: Path, tmp_path: Path, recipe: str
) -> None:
    out = tmp_path / f"fp8-{recipe}"
    assert run(["snapshot", "build", str(moe_folder), str(out), "--fp8", recipe, "-o", "json"]) == 0
    source = _tensors(_plain(moe_folder, tmp_path))
    written = _tensors(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["weight_block_size"]) == ("fp8", "e4m3", [128, 128])
    expected = {
        n
        for n in source
        if ".experts." in n
        or (recipe == "linear" and "self_attn" in n and n.endswith("_proj.weight"))
    }
    fp8 = {n for n, (d, _s, _b) in written.items() if d == "F8_E4M3"}
    assert fp8 == expected and EXPERT in fp8 and GATE not in fp8
    assert (ATTENTION in fp8) == (recipe == "linear")
    for name in fp8:
        rows, cols = source[name][1]
        dtype, shape, _ = written[name + "_scale_inv"]
        assert (dtype, shape) == ("F32", (math.ceil(rows / 128), math.ceil(cols / 128)))
    # Everything else is byte for byte what the model folder held.
    for name, value in source.items():
        if name not in fp8:
            assert written[name] == value, name
    assert set(qc["modules_to_not_convert"]) >= {GATE.removesuffix(".weight"), "lm_head"}
    validate_snapshot(out)


def _plain(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "plain"
    if not out.exists():
        build_from_folder(folder, out)
    return out


def _written(tmp_path: Path, name: str, tensors: dict[str, Any], qc: Any) -> Path:
    """A snapshot of `tensors` whose config.json has quantization_config `qc` (None: none)."""
    config: dict[str, Any] = {"model_type": "llama"}
    if qc is not None:
        config["quantization_config"] = qc
    return write_snapshot(tmp_path / name, tensors, config=config).path


QC = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _fp8_layer() -> dict[str, Any]:
    import torch

    w = torch.randn(256, 200) * 0.02
    values, scale = quantize(w)
    return {
        "model.layers.0.mlp.experts.0.up_proj.weight": values,
        "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv": scale,
        "model.layers.0.input_layernorm.weight": torch.ones(200),
    }


@pytest.mark.parametrize(
    ("case", "field", "message"),
    [
        ("scale missing", "up_proj.weight_scale_inv", "cannot be dequantized without its scale"),
        (
            "scale shape",
            "up_proj.weight_scale_inv",
            "needs a float scale (F32, BF16 or F16) of shape [2, 2]",
        ),
        ("scale dtype", "up_proj.weight_scale_inv", "is I32[2, 2]"),
        (
            "per-tensor scale missing",
            "up_proj.weight_scale",
            "cannot be dequantized without its scale",
        ),
        ("nothing quantized", "tensor_map", "no tensor is F8_E4M3: nothing to dequantize"),
        ("no config", "quantization_config", "missing: 1 tensors are block FP8 with scales"),
        ("block size", "quantization_config.weight_block_size", "two positive integers"),
        ("format", "quantization_config.fmt", "only e4m3"),
        ("orphan scale", "norm.weight_scale_inv", "a scale without an F8_E4M3 weight"),
    ],
)
def test_each_fp8_rule_refuses_its_bad_snapshot_naming_the_tensor(
    tmp_path: Path, case: str, field: str, message: str
) -> None:
    import torch

    tensors, qc = _fp8_layer(), dict(QC)
    scale = "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"
    if case == "scale missing":
        del tensors[scale]
    elif case == "scale shape":
        tensors[scale] = torch.ones(2, 3)
    elif case == "scale dtype":
        tensors[scale] = tensors[scale].to(torch.int32)
    elif case == "per-tensor scale missing":
        del tensors[scale]
        del qc["weight_block_size"]
    elif case == "nothing quantized":
        tensors = {"model.layers.0.input_layernorm.weight": torch.ones(200)}
    elif case == "no config":
        qc = None
    elif case == "block size":
        qc["weight_block_size"] = [128]
    elif case == "format":
        qc["fmt"] = "e5m2"
    elif case == "orphan scale":
        tensors["model.layers.0.input_layernorm.weight_scale_inv"] = torch.ones(1, 2)
    folder = _written(tmp_path, "bad", tensors, qc)
    with pytest.raises(SnapshotValidationError) as info:
        validate_snapshot(folder)
    found = [p for p in info.value.problems if p.field is not None and p.field.endswith(field)]
    assert found and message in found[0].message, info.value.problems
    # The well-formed one passes, with F32 scales or, as Qwen's FP8 releases store them,
    # BF16 ones; and per-tensor FP8 (no blocks) with each weight's `weight_scale`.
    validate_snapshot(_written(tmp_path, "good", _fp8_layer(), QC))
    bf16 = {n: t.to(torch.bfloat16) if n == scale else t for n, t in _fp8_layer().items()}
    validate_snapshot(_written(tmp_path, "good-bf16", bf16, QC))
    per_tensor = {n: t for n, t in _fp8_layer().items() if n != scale}
    per_tensor["model.layers.0.mlp.experts.0.up_proj.weight_scale"] = torch.ones(())
    per_tensor_qc = {k: v for k, v in QC.items() if k != "weight_block_size"}
    validate_snapshot(_written(tmp_path, "good-per-tensor", per_tensor, per_tensor_qc))


def test_a_delta_keeps_its_parents_recipe_and_dtypes(moe_folder: Path, tmp_path: Path) -> None:
    experts = tmp_path / "experts"
    linear = tmp_path / "linear"
    build_from_folder(moe_folder, experts, fp8="experts")
    build_from_folder(moe_folder, linear, fp8="linear")
    with pytest.raises(SnapshotValidationError) as info:
        validate_transition(experts, linear)
    fields = {p.field for p in info.value.problems}
    assert "quantization_config" in fields
    assert f"tensor_map.{ATTENTION}.dtype" in fields  # BF16 -> F8_E4M3
    validate_transition(experts, experts)


def test_fp8_deltas_rebuild_exactly_and_move_only_what_the_step_moved(
    moe_folder: Path, tmp_path: Path
) -> None:
    """Step 1 moves one expert's weights; its FP8 delta rebuilds step 1 byte for byte, and no
    other tensor's FP8 bytes or scales changed (quantizing is a function of the block)."""
    from hotload.snapshot.fp8 import as_torch
    from hotload.snapshot.writer import iter_model_folder

    state = {n: as_torch(n, t).clone() for n, t in iter_model_folder(moe_folder)}
    config = json.loads((moe_folder / "config.json").read_text())
    step0 = write_snapshot(tmp_path / "s0", state, config=config, fp8="experts").path
    moved = dict(state)
    moved[EXPERT] = (state[EXPERT].float() * 1.5).to(state[EXPERT].dtype)
    step1 = write_snapshot(tmp_path / "s1", moved, config=config, fp8="experts").path
    delta = tmp_path / "d1"
    encode(step0, step1, delta, parent_identity="s0", identity="s1")
    validate_snapshot(delta)
    rebuilt = tmp_path / "r1"
    decode(step0, delta, rebuilt)
    assert _tensors(rebuilt) == _tensors(step1)
    before, after = _tensors(step0), _tensors(step1)
    differ = sorted(n for n in after if after[n] != before[n])
    assert differ == [EXPERT, EXPERT + "_scale_inv"]
    shutil.rmtree(rebuilt)


def _state(moe_folder: Path) -> dict[str, Any]:
    from hotload.snapshot.fp8 import as_torch
    from hotload.snapshot.writer import iter_model_folder

    return {n: as_torch(n, t).clone() for n, t in iter_model_folder(moe_folder)}


def test_the_publisher_writes_every_step_with_its_recipe(moe_folder: Path, tmp_path: Path) -> None:
    """`Publisher(fp8="experts")`: a full FP8 snapshot, then a delta of the next step, both
    valid FP8 snapshots in the bucket, the delta rebuilding the step's FP8 weights."""
    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from hotload.sdk import Publisher

    state = _state(moe_folder)
    config = json.loads((moe_folder / "config.json").read_text())
    bucket = tmp_path / "bucket"
    publisher = Publisher(
        str(bucket),
        ledger="moe",
        config=config,
        workdir=tmp_path / "work",
        fp8="experts",
        progress=False,
    )
    publisher.publish(state, step=0)
    moved = dict(state)
    moved[EXPERT] = (state[EXPERT].float() * 1.5).to(state[EXPERT].dtype)
    publisher.publish(moved, step=1)
    entries = Ledger(open_bucket(str(bucket)), "moe").read().document.entries
    assert [e.kind for e in entries] == ["full", "incremental"]
    first, second = (bucket / e.identity for e in entries)
    validate_snapshot(first)
    validate_snapshot(second)
    rebuilt = tmp_path / "rebuilt"
    decode(first, second, rebuilt)
    expected = write_snapshot(tmp_path / "expected", moved, config=config, fp8="experts").path
    assert _tensors(rebuilt) == _tensors(expected)
    assert _tensors(rebuilt)[EXPERT][0] == "F8_E4M3"
    with pytest.raises(Exception, match="fp8='fp4'"):
        Publisher(str(bucket), ledger="moe", fp8="fp4")  # type: ignore[arg-type]


def test_operator_admission_takes_fp8_chains_and_refuses_a_recipe_change(
    moe_folder: Path, tmp_path: Path
) -> None:
    """The operator's admission (`admit`, on a folder bucket) accepts an FP8 full snapshot and
    its delta, refuses a delta that changes the recipe and a full snapshot missing a scale,
    each naming the field or tensor."""
    import asyncio

    from hotload.api.models import HotLoadDeployment
    from hotload.api.models import Snapshot as SnapshotCR
    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from hotload_operator.admission import admit

    bucket_dir = tmp_path / "bucket"
    bucket = open_bucket(str(bucket_dir))
    ledger = Ledger(bucket, "fleet")
    hld = HotLoadDeployment.model_validate(
        {
            "metadata": {"name": "fleet", "namespace": "ml", "uid": "u-1", "generation": 1},
            "spec": {
                "bucket": {"url": f"file://{bucket_dir}"},
                "engine": {"image": "registry.example/engine:1"},
            },
        }
    )
    state = _state(moe_folder)
    config = json.loads((moe_folder / "config.json").read_text())
    moved = dict(state)
    moved[EXPERT] = (state[EXPERT].float() * 1.5).to(state[EXPERT].dtype)
    s0 = write_snapshot(tmp_path / "f" / "step-000", state, config=config, fp8="experts").path
    s1 = write_snapshot(tmp_path / "f" / "step-001", moved, config=config, fp8="experts").path

    def submit(identity: str, folder: Path) -> Any:
        shutil.copytree(folder, bucket_dir / identity)
        cr = SnapshotCR.model_validate(
            {"metadata": {"name": identity}, "spec": {"deployment": "fleet", "identity": identity}}
        )
        return asyncio.run(admit(cr, hld, bucket, ledger))

    assert submit("step-000", s0).accepted
    # The encoder refuses a recipe change; a delta whose config.json was edited afterwards
    # reaches admission, which refuses it too.
    other = tmp_path / "d" / "step-001x"
    encode(s0, s1, other, parent_identity="step-000")
    doc = json.loads((other / "config.json").read_text())
    doc["quantization_config"]["hotload_recipe"] = "linear"
    (other / "config.json").unlink()  # a hard link to step-001's own: replaced, not edited
    (other / "config.json").write_text(json.dumps(doc))
    changed = submit("step-001x", other)
    assert not changed.accepted and "quantization_config: changed from" in changed.message
    encode(s0, s1, tmp_path / "d" / "step-001", parent_identity="step-000")
    delta = submit("step-001", tmp_path / "d" / "step-001")
    assert delta.accepted and delta.entry is not None and delta.entry.kind == "incremental"
    broken = dict(state)
    broken_dir = write_snapshot(
        tmp_path / "f" / "step-002", broken, config=config, fp8="experts"
    ).path
    scale = f"{EXPERT}_scale_inv"
    _drop_tensor(broken_dir, scale)
    refused = submit("step-002", broken_dir)
    assert not refused.accepted and scale in refused.message
    assert "cannot be dequantized without its scale" in refused.message


def _drop_tensor(folder: Path, name: str) -> None:
    """Remove tensor `name` from a snapshot folder (its shard rewritten, manifests updated)."""
    from hotload.snapshot.safetensors_io import RawTensor, write_safetensors

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(name)
    index_path.write_text(json.dumps(index))
    spec_path = folder / "model.weight.spec.json"
    spec = json.loads(spec_path.read_text())
    spec["tensor_map"].pop(name)
    spec_path.write_text(json.dumps(spec))
    kept = [
        (n, RawTensor(raw.dtype, tuple(raw.shape), np.array(raw.data)))
        for n, raw in iter_file(folder / shard)
        if n != name
    ]
    write_safetensors(folder / shard, kept)


def _dequantized(folder: Path) -> dict[str, Any]:
    """Every tensor of snapshot `folder` as float32, FP8 weights times their block scales
    (computed here from the file's bytes, as the FineGrainedFP8 layout defines it)."""
    import torch

    block = json.loads((folder / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ]
    kinds = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "BF16": torch.bfloat16}
    raw = {
        name: torch.frombuffer(bytearray(data), dtype=kinds[dtype]).reshape(shape)
        for name, (dtype, shape, data) in _tensors(folder).items()
    }
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        scale = raw.get(name + "_scale_inv")
        if scale is None:
            out[name] = t.to(torch.float32)
            continue
        rows, cols = t.shape
        for r in range(0, rows, block[0]):
            for c in range(0, cols, block[1]):
                assert scale[r // block[0], c // block[1]] > 0
        full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        out[name] = t.to(torch.float32) * full[:rows, :cols]
    return out


def _stored_digests(folder: Path) -> dict[str, str]:
    """sha256 of each FP8 weight's and scale's bytes in the snapshot's files."""
    import hashlib

    tensors = _tensors(folder)
    fp8 = [n for n, (dtype, _, _) in tensors.items() if dtype == "F8_E4M3"]
    names = fp8 + [n + "_scale_inv" for n in fp8]
    return {f"{n} (stored)": hashlib.sha256(tensors[n][2]).hexdigest() for n in names}


PROMPT = [101, 2023, 2003, 1037]


@pytest.mark.asyncio
@pytest.mark.parametrize(("recipe", "dtype"), [("experts", "float32"), ("linear", "bfloat16")])
async def test_the_reference_engine_serves_an_fp8_snapshot_as_its_dequantized_weights(
    moe_folder: Path, tmp_path: Path, recipe: str, dtype: str
) -> None:
    """An engine started on an FP8 snapshot holds, bit for bit, the weights (and gives the
    tokens and logprobs) of an engine started on the float32 snapshot of those weights
    dequantized; it keeps the FP8 values and scales as the files store them."""
    from support.engines import checksums, complete, serve

    config = json.loads((moe_folder / "config.json").read_text())
    fp8 = build_from_folder(moe_folder, tmp_path / "fp8", fp8=recipe).path  # type: ignore[arg-type]
    plain = write_snapshot(tmp_path / "deq", _dequantized(fp8), config=config).path
    answers, sums = [], []
    for path in (fp8, plain):
        async with serve(path, path.name, 1, dtype=dtype, numerics="fast") as client:
            sums.append(await checksums(client))
            answers.append(await complete(client, PROMPT, 6, logprobs=2))
    stored = {n: d for n, d in sums[0].items() if n.endswith(" (stored)")}
    assert stored == _stored_digests(fp8)
    assert len(stored) >= 2 * (24 if recipe == "experts" else 32)
    assert {n: d for n, d in sums[0].items() if n not in stored} == sums[1]
    assert answers[0].status == answers[1].status == 200
    assert answers[0].tokens == answers[1].tokens
    # By token id: the float32 copy is written without the tokenizer, so it has no token text.
    assert _numbers(answers[0].body["choices"][0]["logprobs"]["content"]) == _numbers(
        answers[1].body["choices"][0]["logprobs"]["content"]
    )


def _numbers(content: list[dict[str, Any]]) -> list[Any]:
    """Each position's (token id, logprob, its top alternatives' ids and logprobs)."""
    return [
        (c["token_id"], c["logprob"], [(t["token_id"], t["logprob"]) for t in c["top_logprobs"]])
        for c in content
    ]


def _step(state: dict[str, Any], moved: list[str]) -> dict[str, Any]:
    """The next training step: the first weight of `moved` grows by half (its scales move,
    every element of the block recomputed), the others get their median-sized element halved
    (an FP8 value moves; the block's largest, hence its scale, does not)."""
    out = dict(state)
    first, *others = moved
    out[first] = (state[first].float() * 1.5).to(state[first].dtype)
    for name in others:
        w = state[name].float().clone()
        order = w.abs().reshape(-1).argsort()
        w.view(-1)[int(order[order.numel() // 2])] *= 0.5
        out[name] = w.to(state[name].dtype)
    return out


async def _patch(client: Any, path: Path, identity: str, sequence: int, parent: str) -> Any:
    body = {"path": str(path), "identity": identity, "sequence": sequence, "parent": parent}
    resp = await client.post("/hotload/v1/patch", json=body)
    return resp.status, await resp.json()


@pytest.mark.asyncio
@pytest.mark.parametrize(("recipe", "dtype"), [("experts", "float32"), ("linear", "bfloat16")])
async def test_fp8_patches_give_the_bits_a_full_load_of_the_step_gives(
    moe_folder: Path, tmp_path: Path, recipe: str, dtype: str
) -> None:
    """Two FP8 deltas patched in place (step 0 -> 1 -> 2: a weight whose scale moved, weights
    whose FP8 values moved) leave the engine with the parameters and stored FP8 bytes a full
    load of step 2 gives, and its answers; only the moved weights changed."""
    from hotload.arc.patch import prepare_patch
    from support.engines import checksums, complete, load, serve

    config = json.loads((moe_folder / "config.json").read_text())
    moves = [
        [EXPERT, "model.layers.1.mlp.experts.2.up_proj.weight"],
        ["model.layers.0.mlp.experts.3.gate_proj.weight", EXPERT],
    ]
    if recipe == "linear":
        moves[0].append(ATTENTION)
        moves[1].append("model.layers.1.self_attn.o_proj.weight")
    states = [_state(moe_folder)]
    for moved in moves:
        states.append(_step(states[-1], moved))
    fulls = [
        write_snapshot(tmp_path / f"s{k}", s, config=config, fp8=recipe).path  # type: ignore[arg-type]
        for k, s in enumerate(states)
    ]
    patches = []
    for k in (1, 2):
        delta = tmp_path / f"d{k}"
        encode(fulls[k - 1], fulls[k], delta, parent_identity=f"s{k - 1}", identity=f"s{k}")
        patches.append(prepare_patch(fulls[k - 1], delta, tmp_path / f"{k}.patch", threads=2))
    async with serve(fulls[0], "s0", dtype=dtype, numerics="fast") as client:
        start = await checksums(client)
        for k, stats in enumerate(patches, start=1):
            status, body = await _patch(client, stats.path, f"s{k}", k, f"s{k - 1}")
            assert status == 200, body
            assert body["identity"] == f"s{k}"
        patched = await checksums(client)
        after_patch = await complete(client, PROMPT, 6)
        assert (await load(client, fulls[2], "s2-full", 3))[0] == 200
        full = await checksums(client)
        after_full = await complete(client, PROMPT, 6)
    assert patched == full
    assert {n: d for n, d in full.items() if n.endswith(" (stored)")} == _stored_digests(fulls[2])
    # Exactly the FP8 bytes the two files differ in moved, and those are the moved weights'.
    first, last = _stored_digests(fulls[0]), _stored_digests(fulls[2])
    differ = {n for n in first if first[n] != last[n]}
    assert {n for n in first if start[n] != patched[n]} == differ
    touched = {n.removesuffix(" (stored)").removesuffix("_scale_inv") for n in differ}
    assert touched == {n for step in moves for n in step}
    assert start != patched
    assert after_patch.tokens == after_full.tokens


def test_the_dequantized_copy_holds_each_weight_times_its_scales_across_shards(
    moe_folder: Path, tmp_path: Path
) -> None:
    """`dequantized_folder` of an FP8 snapshot with a weight's scales in another shard than the
    weight holds every tensor dequantized as this test computes
    it from the file's bytes, and no scale or quantization_config."""
    import torch

    from hotload.snapshot.fp8 import dequantized_folder
    from hotload.snapshot.safetensors_io import RawTensor, write_safetensors

    config = json.loads((moe_folder / "config.json").read_text())
    fp8 = write_snapshot(tmp_path / "fp8", _state(moe_folder), config=config, fp8="experts").path
    # As some published FP8 checkpoints are cut: one weight's scales in another shard.
    index_path = fp8 / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    scale = f"{EXPERT}_scale_inv"
    home = index["weight_map"][scale]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != home)
    held = {
        shard: [
            (n, RawTensor(t.dtype, tuple(t.shape), np.array(t.data)))
            for n, t in iter_file(fp8 / shard)
        ]
        for shard in (home, other)
    }
    held[other] += [(n, t) for n, t in held[home] if n == scale]
    held[home] = [(n, t) for n, t in held[home] if n != scale]
    for shard, tensors in held.items():
        write_safetensors(fp8 / shard, tensors)
    index["weight_map"][scale] = other
    index_path.write_text(json.dumps(index))
    plain = dequantized_folder(fp8, tmp_path / "plain")
    expected = _dequantized(fp8)
    got = {
        name: torch.frombuffer(
            bytearray(data), dtype={"F32": torch.float32, "BF16": torch.bfloat16}[dtype]
        )
        .reshape(shape)
        .to(torch.float32)
        for name, (dtype, shape, data) in _tensors(plain).items()
    }
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())


NUMERICS_SEQUENCES = [[*PROMPT, 3231, 102], [101, 7592, 2088, 999, 1996, 4937, 2938, 2006]]


def _own_token_logprobs(folder: Path) -> list[list[float]]:
    """transformers' float32 logprob of each sequence's next token, position by position."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    out = []
    for ids in NUMERICS_SEQUENCES:
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        out.append([float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)])
    return out


@pytest.mark.asyncio
async def test_numerics_reports_the_divergence_of_fp8_serving_from_the_bf16_trainer(
    moe_folder: Path, tmp_path: Path
) -> None:
    """`hotload numerics` with the trainer's BF16 model against an engine serving its FP8
    snapshot reports the divergence the quantization makes (computed here with transformers:
    the BF16 model against the F32 model of the FP8 weights dequantized), and next to none
    with the FP8 snapshot itself as the reference (loaded dequantized; transformers alone
    cannot load FP8 without an accelerator)."""
    from hotload.sdk.numerics import numerics_check_async
    from support.engines import serve

    config = json.loads((moe_folder / "config.json").read_text())
    fp8 = build_from_folder(moe_folder, tmp_path / "fp8", fp8="linear").path
    plain = write_snapshot(tmp_path / "deq", _dequantized(fp8), config=config).path
    trainer, served = _own_token_logprobs(moe_folder), _own_token_logprobs(plain)
    pairs = zip(trainer, served, strict=True)
    expected = max(abs(a - b) for s, t in pairs for a, b in zip(s, t, strict=True))
    async with serve(fp8, "fp8", 1, dtype="float32", numerics="fast") as client:
        url = str(client.make_url("")).rstrip("/")
        against_bf16 = await numerics_check_async(moe_folder, [url], NUMERICS_SEQUENCES, top_k=5)
        against_fp8 = await numerics_check_async(fp8, [url], NUMERICS_SEQUENCES, top_k=5)
    [bf16_replica], [fp8_replica] = against_bf16.replicas, against_fp8.replicas
    assert bf16_replica.error is None and fp8_replica.error is None
    assert list(bf16_replica.snapshots) == ["fp8"]
    reported = bf16_replica.divergence
    assert expected > 1e-3  # FP8 moves the answers: a replica serving BF16 would fail below
    assert reported.max_abs_diff == pytest.approx(expected, abs=1e-4)
    assert reported.kl_max > 0
    assert fp8_replica.divergence.max_abs_diff < 1e-4
    assert fp8_replica.divergence.max_abs_diff < reported.max_abs_diff / 10


@pytest.mark.asyncio
async def test_a_bf16_engine_refuses_an_fp8_snapshot_naming_the_dtype_and_keeps_serving(
    moe_folder: Path, tmp_path: Path
) -> None:
    """The recipe cannot change under a running engine: a hot load of an FP8 snapshot into one
    started on BF16 weights is a 422 naming a converted weight's dtype; the old weights serve
    on. Per-tensor FP8 (no blocks) is refused at start, naming the field."""
    from hotload.engine.engine import Engine, EngineConfig
    from hotload.errors import SnapshotError
    from support.engines import complete, load, serve

    plain = _plain(moe_folder, tmp_path)
    fp8 = build_from_folder(moe_folder, tmp_path / "fp8", fp8="experts").path
    async with serve(plain, "plain", 1, dtype="float32") as client:
        status, body = await load(client, fp8, "fp8", 2)
        after = await complete(client, [101, 2023], 2)
    assert status == 422, body
    assert "dtype F8_E4M3 differs from the BF16 the engine started with" in str(body)
    assert after.status == 200 and after.hotload["identity_end"] == "plain"
    config_path = fp8 / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]["weight_block_size"]
    config_path.write_text(json.dumps(config))
    engine = Engine(EngineConfig(model_path=fp8, name="tiny", identity="fp8", dtype="float32"))
    with pytest.raises(SnapshotError, match="weight_block_size: is per-tensor FP8"):
        await engine.start()


@pytest.mark.asyncio
async def test_the_operator_admits_an_fp8_chain_on_the_api_server_and_refuses_bad_ones(
    kube_api: Any, moe_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the running operator and the session's API server (the real one in CI): an FP8
    full snapshot and its delta, uploaded and named by Snapshot objects, are accepted into the
    ledger; a delta that changes the recipe and a full snapshot missing a scale are refused,
    their conditions naming the field and the tensor, the ledger untouched."""
    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from support.cluster import install_crds
    from support.operator import (
        condition,
        eventually,
        get_or_none,
        hld_body,
        hld_path,
        running_operator,
        snapshot_body,
        snapshot_path,
    )
    from support.snapshots import upload

    monkeypatch.setenv("KUBECONFIG", str(kube_api.kubeconfig))
    ns = kube_api.namespace
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    state = _state(moe_folder)
    config = json.loads((moe_folder / "config.json").read_text())
    moved = _step(state, [EXPERT, "model.layers.1.mlp.experts.2.up_proj.weight"])
    s0 = write_snapshot(tmp_path / "f" / "step-000", state, config=config, fp8="experts").path
    s1_full = write_snapshot(tmp_path / "full" / "step-001", moved, config=config, fp8="experts")
    s1 = tmp_path / "f" / "step-001"
    encode(s0, s1_full.path, s1, parent_identity="step-000", identity="step-001")
    recipe = tmp_path / "f" / "step-002"
    encode(s0, s1_full.path, recipe, parent_identity="step-001", identity="step-002")
    doc = json.loads((recipe / "config.json").read_text())
    doc["quantization_config"]["hotload_recipe"] = "linear"
    (recipe / "config.json").unlink()  # a hard link to step-001's own: replaced, not edited
    (recipe / "config.json").write_text(json.dumps(doc))
    unscaled = write_snapshot(tmp_path / "f" / "step-003", moved, config=config, fp8="experts")
    scale = f"{EXPERT}_scale_inv"
    _drop_tensor(unscaled.path, scale)

    async def outcome(kube: Any, name: str) -> dict[str, Any]:
        async def decided() -> dict[str, Any] | None:
            obj = await get_or_none(kube, snapshot_path(ns, name))
            return obj if obj and condition(obj, "Accepted") else None

        obj = await eventually(f"{name} decided", decided)
        return dict(obj["status"])

    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            await kube.create(hld_path(ns), hld_body("fleet", bucket_dir))
            statuses = {}
            for folder in (s0, s1, recipe, unscaled.path):
                await upload(bucket_dir, folder)
                await kube.create(snapshot_path(ns), snapshot_body(folder.name, "fleet"))
                statuses[folder.name] = await outcome(kube, folder.name)
    first, delta = statuses["step-000"], statuses["step-001"]
    assert condition({"status": first}, "Accepted")["status"] == "True", first
    assert first["kind"] == "full" and first["sequence"] == 1
    assert condition({"status": delta}, "Accepted")["status"] == "True", delta
    assert delta["kind"] == "incremental" and delta["sequence"] == 2
    changed = condition({"status": statuses["step-002"]}, "Accepted")
    assert changed["status"] == "False", changed
    assert changed["reason"] == "InvalidSnapshot"
    assert "quantization_config: changed from" in changed["message"]
    missing = condition({"status": statuses["step-003"]}, "Accepted")
    assert missing["status"] == "False" and missing["reason"] == "InvalidSnapshot"
    assert scale in missing["message"] and "without its scale" in missing["message"]
    head = (await Ledger(open_bucket(str(bucket_dir)), "fleet").read_async()).document
    assert head.sequence == 2 and head.head is not None and head.head.identity == "step-001"


def test_a_loader_follows_an_fp8_run_with_patches_that_give_a_full_loads_bits(
    moe_folder: Path, tmp_path: Path, env: dict[str, str], replicas: list[Any]
) -> None:
    """The product's path: a trainer publishes an FP8 run (a full snapshot, then two arc_v2
    deltas) to a bucket; a real loader and reference engine (processes) follow its ledger. Each
    delta is taken as a sparse patch, and the engine then holds, stored FP8 bytes included,
    the checksums of an engine started on that step's full snapshot."""
    import asyncio

    from hotload.bucket import open_bucket
    from hotload.ledger import Ledger
    from support.engines import checksums, serve
    from support.fleet import Replica, Trainer, free_port, http_json

    config = json.loads((moe_folder / "config.json").read_text())
    states = [_state(moe_folder)]
    states.append(_step(states[-1], [EXPERT, "model.layers.1.mlp.experts.2.up_proj.weight"]))
    states.append(_step(states[-1], ["model.layers.0.mlp.experts.3.gate_proj.weight", EXPERT]))
    fulls = [
        write_snapshot(tmp_path / f"full-{k}", s, config=config, fp8="experts").path
        for k, s in enumerate(states)
    ]
    bucket = tmp_path / "bucket"
    trainer = Trainer(Ledger(open_bucket(str(bucket)), "policy"), fulls, tmp_path / "t", 100)
    trainer.publish(0)
    r = Replica("r0", tmp_path / "r0", f"{bucket}/policy", env, admin_port=free_port())
    replicas.append(r)
    r.start()
    r.wait_serving("step-000", timeout=180)
    for k in (1, 2):
        trainer.publish(k)
        status = r.wait_serving(f"step-{k:03d}")
        assert status["last_load"]["method"] == "sparse", status["last_load"]
    code, body = http_json("GET", r.full_api_url + "/hotload/v1/checksums")
    assert code == 200, body

    async def full_load() -> dict[str, str]:
        async with serve(fulls[2], "step-002") as client:
            return await checksums(client)

    served = dict(body["checksums"])
    assert served == asyncio.run(full_load())
    assert {n: d for n, d in served.items() if n.endswith(" (stored)")} == _stored_digests(fulls[2])
