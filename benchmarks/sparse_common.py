"""What bench_sparse_load.py, sparse_runs.py and sparse_modes.py share: the models they build and
how a snapshot is uploaded (one module they all import, so that none imports another)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench_sidecar import model_config, side_folder

from hotload.ledger import Ledger
from hotload.snapshot import describe_snapshot, write_snapshot
from support.tiny_llm import llama_config, sparse_steps

#: The hidden sizes of the wider pair (issue 38): two layers each, the same tensors and files,
#: about 3x the bytes (the embeddings and the head grow with the hidden size).
NARROW_HIDDEN = 1024
WIDE_HIDDEN = 2304


def build_model(
    work: Path, scale: float, fraction: float, *, hidden: int | None = None
) -> tuple[list[Path], list[Path], int]:
    """Steps 0..3 of a bf16 Llama (random weights) and their deltas, each step moving `fraction`
    of every tensor's elements by one ulp: bench_sidecar's model at `scale` (~1 GiB at 1), or
    with `hidden`, a two-layer one of that hidden size (`wide_config`)."""
    import torch
    from transformers import LlamaForCausalLM

    config, side = model_config(work, scale) if hidden is None else wide_config(work, hidden)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)

    def tensors() -> Any:
        for name, shape in shapes.items():
            yield name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    base = write_snapshot(work / "base", tensors(), side_files_from=side, overwrite=True).path
    fulls, deltas = sparse_steps(base, work, 3, fraction=fraction, seed=1)
    return fulls, deltas, describe_snapshot(fulls[0]).full_bytes


def wide_config(work: Path, hidden: int) -> tuple[Any, Path]:
    """A two-layer Llama config of hidden size `hidden` (a multiple of 128: heads of 128, two
    key-value heads, an MLP 2.75x as wide), and a folder holding it and the tokenizer files."""
    config = llama_config(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=2,
        num_attention_heads=hidden // 128,
        num_key_value_heads=2,
    )
    return config, side_folder(work, config)


def upload(ledger: Ledger, folder: Path, identity: str) -> float:
    """Upload a snapshot folder under `identity`; return the seconds it took."""
    from hotload.bucket import upload_snapshot

    desc = describe_snapshot(folder)
    t0 = time.perf_counter()
    upload_snapshot(
        folder, ledger.bucket, identity, files=desc.files, manifest_files=desc.manifest_files
    )
    return time.perf_counter() - t0
