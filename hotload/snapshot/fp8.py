"""Block-FP8 snapshots: a recipe's weights written as F8_E4M3 with one F32 scale per 128x128
block, in the DeepSeek-V3 / transformers FineGrainedFP8 layout, and the rules that admit them.

`X.weight` (2-D) becomes `X.weight` as F8_E4M3 plus `X.weight_scale_inv` (F32, shape
`[ceil(rows/128), ceil(cols/128)]`); the weight is `fp8 * scale_inv` block by block. A block's
scale is its largest magnitude over 448 (E4M3's largest finite value), so quantizing is a pure
function of the block: a block a training step did not move gives the same bytes and costs
nothing in the delta. `config.json` gets the matching `quantization_config`.

Recipes (`RECIPES`): `experts`, the routed experts' projections only (the hot-load guide's
GLM/Kimi case); `linear`, every linear layer. Router gates, norms, embeddings and `lm_head`
stay as they are in both. The recipe must stay the same across a run (a change of dtype or of
`quantization_config` between a delta and its parent is refused), so the delta chain stays
valid.

`fp8_problems` is the admission rule set, applied by `validate_snapshot` to every snapshot
whose config.json or tensors say FP8, naming the tensor or field.
"""

from __future__ import annotations

import math
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from hotload.errors import SnapshotError, ValidationProblem
from hotload.snapshot.manifests import TensorSpec

Fp8Recipe = Literal["experts", "linear"]
RECIPES: tuple[Fp8Recipe, ...] = ("experts", "linear")

BLOCK = (128, 128)
#: The largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
FP8_DTYPE = "F8_E4M3"
#: Scale dtypes engines dequantize with (Qwen's FP8 releases store BF16 or F16 scales).
SCALE_DTYPES = frozenset({"F32", "BF16", "F16"})
SCALE_SUFFIX = "_scale_inv"

#: A routed expert's projection in a checkpoint: Qwen3-MoE / DeepSeek / GLM
#: (`mlp.experts.E.gate_proj`), Mixtral (`block_sparse_moe.experts.E.w1`).
_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
#: 2-D weights no recipe converts: embeddings, the output head, norms, router gates.
_KEPT = re.compile(
    r"(embed|lm_head|norm|\.mlp\.gate\.|\.block_sparse_moe\.gate\.|\.router\.|shared_expert_gate)"
)


def quantizes(recipe: Fp8Recipe, name: str, shape: tuple[int, ...]) -> bool:
    """Whether `recipe` writes tensor `name` of `shape` as block FP8."""
    if len(shape) != 2 or not name.endswith(".weight") or _KEPT.search(name):
        return False
    return recipe == "linear" or bool(_EXPERT.search(name))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The shape of the scales of a weight of `shape`: one per block, partial blocks included."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def quantize(weight: Any, block: tuple[int, int] = BLOCK) -> tuple[Any, Any]:
    """`weight` (a 2-D torch tensor) as (F8_E4M3 values, F32 `scale_inv`), block by block."""
    import torch

    w = weight.detach().to(torch.float32)
    rows, cols = w.shape
    br, bc = scale_shape((rows, cols), block)
    padded = torch.zeros(br * block[0], bc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(br, block[0], bc, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    # An all-zero block keeps the scale 1: any scale gives zeros, this one is fixed.
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    values = q.reshape(br * block[0], bc * block[1])[:rows, :cols].to(torch.float8_e4m3fn)
    return values.contiguous(), scale.contiguous()


def dequantize(values: Any, scale_inv: Any, block: tuple[int, int] = BLOCK) -> Any:
    """The float32 weight of block-FP8 `values` and their `scale_inv`."""
    import torch

    rows, cols = values.shape
    expanded = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return values.to(torch.float32) * expanded[:rows, :cols]


def quantization_config(recipe: Fp8Recipe, kept: Iterable[str]) -> dict[str, Any]:
    """The `quantization_config` of a snapshot written with `recipe`; `kept` are the linear
    modules it left unconverted (their names without `.weight`)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": sorted(set(kept)),
        "hotload_recipe": recipe,
    }


def quantize_items(
    items: Iterable[tuple[str, Any]], recipe: Fp8Recipe, kept: list[str], done: list[str]
) -> Iterator[tuple[str, Any]]:
    """`items` (name, tensor) with `recipe`'s weights as FP8 values followed by their scales;
    the names of 2-D weights left as they were are appended to `kept`, the converted ones to
    `done`."""
    if recipe not in RECIPES:
        raise SnapshotError(f"unknown FP8 recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    for name, tensor in items:
        # Decided on the shape: a tensor that passes through is never converted or copied.
        shape = tuple(int(d) for d in tensor.shape)
        if not quantizes(recipe, name, shape):
            if len(shape) == 2 and name.endswith(".weight"):
                kept.append(name.removesuffix(".weight"))
            yield name, tensor
            continue
        values, scale = quantize(as_torch(name, tensor))
        done.append(name)
        yield name, values
        yield name + SCALE_SUFFIX, scale


def as_torch(name: str, tensor: Any) -> Any:
    """`tensor` (a float weight to quantize) as a torch tensor; a `RawTensor` read from a
    model folder is viewed, not copied. Another dtype raises `SnapshotError` naming it."""
    import torch

    from hotload.snapshot.safetensors_io import RawTensor

    kinds = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    if isinstance(tensor, RawTensor):
        if tensor.dtype not in kinds:
            already = " (already FP8: build from the BF16 model)" if "F8" in tensor.dtype else ""
            raise SnapshotError(
                f"cannot quantize a {tensor.dtype} tensor{already}; the recipe converts "
                f"{', '.join(kinds)} weights",
                field=name,
            )
        with warnings.catch_warnings():  # a read-only memory map: it is only read here
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(tensor.data)
        return flat.view(kinds[tensor.dtype]).reshape(tensor.shape)
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.as_tensor(tensor)
    if tensor.dtype not in kinds.values():
        raise SnapshotError(
            f"cannot quantize a {tensor.dtype} tensor; the recipe converts float32, bfloat16 "
            "and float16 weights",
            field=name,
        )
    return tensor


def fp8_block(config: Mapping[str, Any], path: str) -> tuple[int, int] | None:
    """The block shape of a block-FP8 snapshot's `config` (None: not an FP8 snapshot); raises
    `SnapshotError` naming `quantization_config` for FP8 hotload cannot dequantize."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    block = qc.get("weight_block_size")
    if block is None:
        raise SnapshotError(
            "is per-tensor FP8 (no weight_block_size): hotload dequantizes block "
            'FP8 only; write the snapshot with hotload\'s recipes ("weight_block_size": '
            "[128, 128], docs/fp8.md)",
            path=path,
            field="quantization_config.weight_block_size",
        )
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise SnapshotError(
            f"{block!r}: must be two positive integers (rows, columns of a block)",
            path=path,
            field="quantization_config.weight_block_size",
        )
    return int(block[0]), int(block[1])


def fp8_weights(tensor_dtypes: Mapping[str, str]) -> set[str]:
    """The FP8 weights of a tensor map (name -> safetensors dtype): those with a scale."""
    return {
        n for n, d in tensor_dtypes.items() if d == FP8_DTYPE and n + SCALE_SUFFIX in tensor_dtypes
    }


def scale_of(weight: str) -> str:
    """The name of FP8 weight `weight`'s block scales."""
    return weight + SCALE_SUFFIX


def dequantized_folder(src: Path, dest: Path) -> Path:
    """Write model folder `src` to `dest` as a plain model (each FP8 weight times its block
    scales in F32, the scales and `quantization_config` dropped, every other tensor and file as
    stored), which transformers loads on any device: what an FP8-serving engine should compute.
    Returns `dest`."""
    import json

    import numpy as np
    import torch

    from hotload.snapshot.safetensors_io import RawTensor, iter_file, write_safetensors

    config = json.loads((src / "config.json").read_text())
    block = fp8_block(config, str(src / "config.json"))
    if block is None:
        raise SnapshotError("not an FP8 snapshot (no fp8 quantization_config)", path=str(src))
    del config["quantization_config"]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        # The tokenizer and generation config; the tensor files are rewritten below.
        kept = extra.suffix in (".json", ".txt", ".model", ".jinja") and extra.is_file()
        if kept and extra.name != "config.json" and not extra.name.endswith(".index.json"):
            shutil.copyfile(extra, dest / extra.name)
    kinds = {"F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32}
    kinds |= {"BF16": torch.bfloat16, "F16": torch.float16}

    def view(t: RawTensor) -> Any:
        flat = torch.from_numpy(np.array(t.data))  # a copy: the memory map is read-only
        return flat.view(kinds[t.dtype]).reshape(t.shape)

    shards = {shard: dict(iter_file(shard)) for shard in sorted(src.glob("*.safetensors"))}
    # A weight's scales may lie in another shard than the weight (zero-copy views until read).
    every = {name: t for tensors in shards.values() for name, t in tensors.items()}
    weight_map: dict[str, str] = {}
    for shard, tensors in shards.items():
        out: list[tuple[str, RawTensor]] = []
        for name, stored in tensors.items():
            scale = every.get(scale_of(name))
            if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in every:
                continue
            if stored.dtype == FP8_DTYPE and scale is not None:
                values = dequantize(view(stored), view(scale).float(), block).contiguous()
                flat = values.view(torch.uint8).reshape(-1).numpy()
                out.append((name, RawTensor("F32", stored.shape, flat)))
            else:
                out.append((name, stored))
            weight_map[name] = shard.name
        write_safetensors(dest / shard.name, out, {"format": "pt"})
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest


def fp8_problems(
    config: Mapping[str, Any] | None,
    tensors: Mapping[str, TensorSpec],
    *,
    config_path: str,
    spec_path: str,
) -> list[ValidationProblem]:
    """The guide's FP8 rules: a `quantization_config` needs dequantizable tensors; every FP8
    weight its F32 scale of the block shape; every scale its FP8 weight; FP8 tensors need the
    `quantization_config`. One problem per tensor or field."""
    problems: list[ValidationProblem] = []
    qc = config.get("quantization_config") if config is not None else None
    fp8 = sorted(n for n, s in tensors.items() if s.dtype == FP8_DTYPE)
    if qc is None or (isinstance(qc, dict) and qc.get("quant_method") != "fp8"):
        scaled = [n for n in fp8 if n + SCALE_SUFFIX in tensors]
        if scaled:
            problems.append(
                ValidationProblem(
                    config_path,
                    "quantization_config",
                    f"missing: {len(scaled)} tensors are block FP8 with scales ({scaled[0]}, "
                    "...), which engines dequantize only with a quantization_config "
                    '{"quant_method": "fp8", "weight_block_size": [128, 128], ...}',
                )
            )
        return problems
    if not isinstance(qc, dict):
        return [ValidationProblem(config_path, "quantization_config", "must be an object")]
    if qc.get("fmt", "e4m3") != "e4m3":
        problems.append(
            ValidationProblem(
                config_path,
                "quantization_config.fmt",
                f"{qc.get('fmt')!r}: only e4m3 (F8_E4M3 weights) is supported",
            )
        )
    block = qc.get("weight_block_size")
    if block is None:
        # Per-tensor FP8 (AutoFP8's `weight_scale`, no blocks): each weight needs its scale.
        return problems + _per_tensor_problems(fp8, tensors, spec_path)
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        problems.append(
            ValidationProblem(
                config_path,
                "quantization_config.weight_block_size",
                f"{block!r}: must be two positive integers (rows, columns of a block), e.g. "
                "[128, 128]",
            )
        )
        return problems
    if not fp8:
        problems.append(
            ValidationProblem(
                spec_path,
                "tensor_map",
                "quantization_config says fp8 but no tensor is F8_E4M3: nothing to dequantize "
                "(write the snapshot with an FP8 recipe, or drop the quantization_config)",
            )
        )
    for name in fp8:
        scale = tensors.get(name + SCALE_SUFFIX)
        shape = tensors[name].shape
        field = f"tensor_map.{name}{SCALE_SUFFIX}"
        if scale is None:
            problems.append(
                ValidationProblem(
                    spec_path,
                    field,
                    f"missing: {name} is F8_E4M3 and cannot be dequantized without its scale",
                )
            )
            continue
        if len(shape) != 2:
            problems.append(
                ValidationProblem(
                    spec_path, f"tensor_map.{name}", f"F8_E4M3 but {len(shape)}-D: blocks are 2-D"
                )
            )
            continue
        want = scale_shape((int(shape[0]), int(shape[1])), (block[0], block[1]))
        if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != want:
            problems.append(
                ValidationProblem(
                    spec_path,
                    field,
                    f"is {scale.dtype}{list(scale.shape)}; a {list(shape)} weight in blocks of "
                    f"{block} needs a float scale (F32, BF16 or F16) of shape {list(want)}",
                )
            )
    for name in sorted(n for n in tensors if n.endswith(SCALE_SUFFIX)):
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in tensors or tensors[weight].dtype != FP8_DTYPE:
            problems.append(
                ValidationProblem(
                    spec_path,
                    f"tensor_map.{name}",
                    f"a scale without an F8_E4M3 weight {weight}",
                )
            )
    return problems


def _per_tensor_problems(
    fp8: list[str], tensors: Mapping[str, TensorSpec], spec_path: str
) -> list[ValidationProblem]:
    """Per-tensor FP8: every F8_E4M3 weight has a `weight_scale` or `weight_scale_inv`."""
    problems = []
    if not fp8:
        problems.append(
            ValidationProblem(
                spec_path,
                "tensor_map",
                "quantization_config says fp8 but no tensor is F8_E4M3: nothing to dequantize",
            )
        )
    for name in fp8:
        if not any(name + suffix in tensors for suffix in (SCALE_SUFFIX, "_scale")):
            problems.append(
                ValidationProblem(
                    spec_path,
                    f"tensor_map.{name}_scale",
                    f"missing: {name} is F8_E4M3 and cannot be dequantized without its scale",
                )
            )
    return problems
