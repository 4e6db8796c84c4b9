"""The snapshot's tokenizer (transformers' `AutoTokenizer`): prompts to token ids, with the chat
template when there is one, and ids back to text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hotload.engine.protocol import GenerationRequest, bad_request, render_chat_fallback


class TextCodec:
    """The snapshot's tokenizer: prompts to ids (with the chat template if any) and back."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(path))

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (else the plain fallback is used)."""
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's special tokens, like vLLM)."""
        return list(self._tok(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat: the tokenizer's template, else "role: content" lines."""
        if self.has_chat_template:
            text = self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return list(self._tok(text, add_special_tokens=False)["input_ids"])
        return self.encode(render_chat_fallback(messages))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids (special tokens dropped)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """One token's own text (its vocabulary entry, as vLLM's `decoded_token` shows it)."""
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        return piece if isinstance(piece, str) else ""

    def piece(self, token_id: int) -> str:
        """One token decoded on its own, special tokens included (a logprobs entry's text)."""
        return str(self._tok.decode([int(token_id)], skip_special_tokens=False))

    def prompt_ids(self, req: GenerationRequest, vocab: int) -> list[int]:
        """A request's prompt as token ids; a bad request (ids outside the vocabulary of `vocab`
        tokens, an empty prompt) raises the 400 naming the field."""
        if req.kind == "chat":
            ids = self.encode_chat(req.messages)
        elif isinstance(req.prompt, list):
            bad = [t for t in req.prompt if t >= vocab]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary (size {vocab})", "prompt"
                )
            ids = list(req.prompt)
        else:
            ids = self.encode(req.prompt or "")
        if not ids:
            raise bad_request("the prompt is empty after tokenisation", "prompt")
        return ids
