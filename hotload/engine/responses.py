"""The engine's response bodies as pure functions: `/v1/models`, completions and chat completions
(whole or as server-sent chunks), each naming the snapshot that produced it.

The other half of the HTTP contract, request parsing and constraints, is in `protocol`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hotload.engine.protocol import GenerationRequest, RequestKind, ServedSnapshot
from hotload.routes import RouteFormat


def served_model(name: str, identity: str) -> str:
    """The `model` string of a response: `<name>@<identity>`."""
    return f"{name}@{identity}"


def models_body(
    name: str, served: ServedSnapshot, created: int, adapters: Sequence[str] = ()
) -> dict[str, Any]:
    """The `/v1/models` list: the served model, named with its snapshot, then each LoRA adapter
    with the base as its `parent` (as vLLM lists them)."""
    base = served_model(name, served.identity)
    data: list[dict[str, Any]] = [
        {"id": base, "object": "model", "created": created, "owned_by": "hotload", "root": name}
    ]
    data += [
        {
            "id": adapter,
            "object": "model",
            "created": created,
            "owned_by": "hotload",
            "root": adapter,
            "parent": base,
        }
        for adapter in adapters
    ]
    return {"object": "list", "data": data}


def new_id(kind: RequestKind) -> str:
    """A fresh response id in OpenAI's style (`cmpl-...` or `chatcmpl-...`)."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


#: vLLM's `prompt_logprobs` entry of one prompt position: token id (as a string) -> logprob,
#: rank and token text; the first position has none (nothing precedes it).
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


@dataclass(frozen=True)
class TokenScore:
    """One token's logprobs entry: its logprob under the weights that produced it (None for a
    prompt's first token: nothing precedes it), the most likely alternatives, and with
    `include_routing_matrix` the experts each MoE layer chose in the pass where the token was
    the input (None for the last generated token, which is never fed)."""

    token_id: int
    text: str
    logprob: float | None
    top: tuple[tuple[int, str, float], ...] = ()
    routes: str | None = None


def logprob_entry(score: TokenScore, routes: bool) -> dict[str, Any]:
    """The `logprobs.content[j]` object of one token (OpenAI's chat form, plus `token_id`
    and, when asked, Fireworks' `routing_matrix`)."""
    entry: dict[str, Any] = {
        "token": score.text,
        "logprob": score.logprob,
        "bytes": list(score.text.encode()),
        "token_id": score.token_id,
        "top_logprobs": [
            {"token": text, "logprob": value, "bytes": list(text.encode()), "token_id": tid}
            for tid, text, value in score.top
        ],
    }
    if routes:
        entry["routing_matrix"] = score.routes
    return entry


def logprobs_body(req: GenerationRequest, scores: Sequence[TokenScore]) -> dict[str, Any]:
    """A choice's `logprobs`: `content` for both endpoints; completions also carry the legacy
    `tokens`, `token_logprobs` and `top_logprobs` lists."""
    body: dict[str, Any] = {"content": [logprob_entry(s, req.routes) for s in scores]}
    if req.kind == "completion":
        body["tokens"] = [s.text for s in scores]
        body["token_logprobs"] = [s.logprob for s in scores]
        body["top_logprobs"] = [
            {text: value for _tid, text, value in s.top} if s.logprob is not None else None
            for s in scores
        ]
    return body


@dataclass(frozen=True)
class Outcome:
    """Everything a finished generation reports."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    start: ServedSnapshot
    end: ServedSnapshot
    cached_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    # Computed by the prefill, i.e. with the weights of `start`.
    prompt_logprobs: PromptLogprobs | None = None
    #: The generated tokens' logprobs entries (None: not asked).
    scores: list[TokenScore] | None = None
    #: With `echo` and logprobs: the prompt's entries (by the prefill), and its text.
    prompt_scores: list[TokenScore] | None = None
    prompt_text: str = ""
    #: How routes are laid out (None: not asked).
    routes: RouteFormat | None = None


def hotload_block(
    start: ServedSnapshot,
    end: ServedSnapshot,
    cached_tokens: int,
    routes: RouteFormat | None = None,
) -> dict[str, Any]:
    """The `hotload` object of a response: the snapshots at generation start and end, and how
    its routes are laid out when it carries them."""
    block: dict[str, Any] = {
        "identity_start": start.identity,
        "identity_end": end.identity,
        "sequence_start": start.sequence,
        "sequence_end": end.sequence,
        "prefix_cached_tokens": cached_tokens,
    }
    if routes is not None:
        block["routes"] = routes.to_json()
    return block


def echo_text(req: GenerationRequest, out: Outcome) -> str:
    """The prompt as `echo` repeats it: the string sent, else the decoded token ids."""
    return req.prompt if isinstance(req.prompt, str) else out.prompt_text


def usage_block(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's `usage` object (with the prefix-cache hit as `prompt_tokens_details`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    req: GenerationRequest, name: str, response_id: str, created: int, out: Outcome
) -> dict[str, Any]:
    """The non-streaming response body of a completion or chat completion."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
    if req.kind == "chat":
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = (echo_text(req, out) if req.echo else "") + out.text
    if out.scores is not None:
        choice["logprobs"] = logprobs_body(req, (out.prompt_scores or []) + out.scores)
    if req.return_token_ids:
        choice["token_ids"] = list(out.token_ids)
        choice["prompt_token_ids"] = list(out.prompt_ids)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = out.prompt_logprobs
    return {
        "id": response_id,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": created,
        "model": served_model(name, out.end.identity),
        "choices": [choice],
        "usage": usage_block(out.prompt_tokens, len(out.token_ids), out.cached_tokens),
        "hotload": hotload_block(out.start, out.end, out.cached_tokens, out.routes),
    }


def stream_chunk(
    req: GenerationRequest,
    name: str,
    response_id: str,
    created: int,
    served: ServedSnapshot,
    *,
    text: str | None,
    token_id: int | None = None,
    finish_reason: str | None = None,
    role: bool = False,
    scores: Sequence[TokenScore] = (),
) -> dict[str, Any]:
    """One SSE chunk; `model` names the snapshot whose weights produced this chunk's token,
    `scores` are the logprobs entries of its tokens (when asked)."""
    logprobs = logprobs_body(req, scores) if scores else None
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if req.return_token_ids and token_id is not None:
        choice["token_ids"] = [token_id]
    return {
        "id": response_id,
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
        "created": created,
        "model": served_model(name, served.identity),
        "choices": [choice],
        "hotload": {"identity": served.identity, "sequence": served.sequence},
    }


def final_chunk(
    req: GenerationRequest, name: str, response_id: str, created: int, out: Outcome
) -> dict[str, Any]:
    """The last SSE chunk: finish reason, usage and the start/end snapshots of the generation."""
    chunk = stream_chunk(
        req,
        name,
        response_id,
        created,
        out.end,
        text="" if req.kind == "completion" else None,
        finish_reason=out.finish_reason,
    )
    if req.include_usage:
        chunk["usage"] = usage_block(out.prompt_tokens, len(out.token_ids), out.cached_tokens)
    chunk["hotload"] = hotload_block(out.start, out.end, out.cached_tokens, out.routes)
    return chunk


def sse(data: Mapping[str, Any] | str) -> bytes:
    """Encode one server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def now() -> int:
    """Unix time in whole seconds (the `created` field)."""
    return int(time.time())
