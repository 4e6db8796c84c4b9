"""The engine's HTTP contract as pure functions: request parsing and constraints (the response
bodies are in `responses`).

Nothing here touches torch or the network, so every rule of the OpenAI-compatible API and of
the hot-load API is unit-testable on its own. Handlers in `server.py` call these and turn an
`ApiError` into the JSON error body `{"error": {"type", "message", ...}}`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hotload.errors import HotloadError
from hotload.snapshot.layout import validate_identity

TransitionMode = Literal["async", "sync"]
CachePolicy = Literal["all", "none", "new_session"]
RequestKind = Literal["completion", "chat"]

TRANSITION_MODES: tuple[TransitionMode, ...] = ("async", "sync")
CACHE_POLICIES: tuple[CachePolicy, ...] = ("all", "none", "new_session")

# Session headers, preferred first (the Gateway API inference extension's name, then the
# generic affinity header that routers such as llm-d and SGLang's router use).
SESSION_HEADERS = ("x-multi-turn-session-id", "x-session-affinity")
MIN_SEQUENCE_HEADER = "x-hotload-min-sequence"
SNAPSHOT_HEADER = "x-hotload-snapshot"
SEQUENCE_HEADER = "x-hotload-sequence"

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # chat has no OpenAI default; bounded so a run-on model stops
MAX_STOP_STRINGS = 4
# vLLM's default `max_logprobs`: one client can ask both engines for the same top-k.
MAX_PROMPT_LOGPROBS = 20
RETRY_AFTER_SECONDS = "1"


class ApiError(HotloadError):
    """An HTTP error answer: status, OpenAI-style error type and message, extra body fields."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"type", "message", "param"?, ...extra}}`."""
        err: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.param is not None:
            err["param"] = self.param
        err.update(self.extra)
        return {"error": err}


#: The inference API, exact paths: all a replica's serving port answers when the admin API
#: (hot loads, LoRA loading, vLLM's and SGLang's weight, pause and cache controls) is kept on
#: loopback. An allow-list, not a deny-list: an engine release that adds an admin route stays
#: closed. LoRA loading sits under /v1 in vLLM and here, hence exact paths, not a prefix.
INFERENCE_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
    }
)


def not_served_here(method: str, path: str) -> ApiError:
    """The 404 of a serving port for anything outside the inference API."""
    return ApiError(
        404,
        "not_found",
        f"{method} {path} is not served on this port: it answers the inference API only "
        f"({', '.join(sorted(INFERENCE_PATHS))}); the engine's admin API is reachable on "
        "loopback only",
    )


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 `invalid_request_error` naming the offending field."""
    return ApiError(400, "invalid_request_error", message, param=param)


@dataclass(frozen=True)
class ServedSnapshot:
    """The snapshot whose weights generate: its identity and ledger sequence number."""

    identity: str
    sequence: int


@dataclass(frozen=True)
class VersionConstraint:
    """What a request demands of the served snapshot: a minimum sequence and/or an identity."""

    min_sequence: int | None = None
    identity: str | None = None

    def unmet(self, served: ServedSnapshot) -> str | None:
        """Why `served` does not satisfy the constraint, or None when it does."""
        if self.identity is not None and served.identity != self.identity:
            return f"the request requires snapshot {self.identity!r}"
        if self.min_sequence is not None and served.sequence < self.min_sequence:
            return f"the request requires snapshot sequence >= {self.min_sequence}"
        return None


def snapshot_unavailable(reason: str, served: ServedSnapshot) -> ApiError:
    """The retryable 409 of a replica that cannot honour a version constraint."""
    return ApiError(
        409,
        "snapshot_unavailable",
        f"{reason}; this replica serves {served.identity} (sequence {served.sequence})",
        headers={"Retry-After": RETRY_AFTER_SECONDS},
        extra={"served_identity": served.identity, "served_sequence": served.sequence},
    )


def check_constraint(constraint: VersionConstraint, served: ServedSnapshot) -> None:
    """Raise the 409 `snapshot_unavailable` error when `served` does not meet `constraint`."""
    reason = constraint.unmet(served)
    if reason is not None:
        raise snapshot_unavailable(reason, served)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: temperature 0 is greedy (the default, for determinism)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A parsed `/v1/completions` or `/v1/chat/completions` request."""

    kind: RequestKind
    sampling: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = True
    return_token_ids: bool = False
    constraint: VersionConstraint = VersionConstraint()
    max_tokens_given: bool = False
    prompt_logprobs: int | None = None
    #: The LoRA adapter named as `model` (None: the base model).
    adapter: str | None = None
    #: Logprobs of each generated token and its `logprobs` most likely alternatives (None:
    #: not asked; completions' `logprobs`, chat's `logprobs` + `top_logprobs`).
    logprobs: int | None = None
    #: Completions' `echo`: the prompt's text (and, with `logprobs`, its tokens) first.
    echo: bool = False
    #: `include_routing_matrix`: each token's MoE routes on its logprobs entry.
    routes: bool = False

    def model_name(self, served_name: str) -> str:
        """The name responses give the model: the adapter's, or the served model's."""
        return self.adapter or served_name


@dataclass(frozen=True)
class LoadRequest:
    """A parsed `POST /hotload/v1/load` body, or `/hotload/v1/patch` (which names `parent`)."""

    path: str
    identity: str
    sequence: int
    mode: TransitionMode = "async"
    cache_policy: CachePolicy = "all"
    parent: str | None = None


# --- parsing helpers ---------------------------------------------------------------------------


def _int(body: Mapping[str, Any], key: str, *, minimum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer, got {json.dumps(value)}", key)
    if minimum is not None and value < minimum:
        raise bad_request(f"{key} must be >= {minimum}, got {value}", key)
    return value


def _float(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{key} must be a number, got {json.dumps(value)}", key)
    if not lo <= float(value) <= hi:
        raise bad_request(f"{key} must be between {lo} and {hi}, got {value}", key)
    return float(value)


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be true or false, got {json.dumps(value)}", key)
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(value)


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    value = body.get("prompt")
    # OpenAI accepts a batch of prompts; this engine takes one per request (n=1 semantics).
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return list(value)
    if isinstance(value, list) and len(value) > 1:
        raise bad_request("one prompt per request: send several requests instead", "prompt")
    raise bad_request("prompt must be a string or a non-empty list of token ids", "prompt")


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        content = msg.get("content")
        if isinstance(content, list):
            # The content-parts form: only text parts exist for a text-only model.
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported",
                        f"messages[{i}].content",
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": msg["role"], "content": content})
    return out


def parse_model_field(
    value: object, served_name: str, adapters: Collection[str] = ()
) -> tuple[str | None, str | None]:
    """Check the request's `model`: `<name>` or a loaded LoRA adapter's name, optionally with
    `@<identity>` (a snapshot constraint); return (adapter or None, identity or None)."""
    if value is None:
        return None, None
    if not isinstance(value, str):
        raise bad_request("model must be a string", "model")
    name, sep, identity = value.partition("@")
    if name != served_name and name not in adapters:
        loaded = f"; adapters: {', '.join(sorted(adapters))}" if adapters else ""
        raise ApiError(
            404,
            "model_not_found",
            f"model {value!r} is not served here; this engine serves {served_name!r} "
            f"(optionally {served_name}@<identity>){loaded}",
            param="model",
        )
    return (name if name != served_name else None), (identity if sep else None)


def parse_constraint(
    body: Mapping[str, Any], headers: Mapping[str, str], model_identity: str | None
) -> VersionConstraint:
    """Merge the body fields, the `x-hotload-*` headers and `model@identity` into one constraint."""
    min_seq = _int(body, "min_snapshot_sequence", minimum=0)
    raw = headers.get(MIN_SEQUENCE_HEADER)
    if raw is not None:
        try:
            header_min = int(raw.strip())
        except ValueError:
            raise bad_request(
                f"header {MIN_SEQUENCE_HEADER} must be an integer, got {raw!r}",
                MIN_SEQUENCE_HEADER,
            ) from None
        min_seq = header_min if min_seq is None else max(min_seq, header_min)
    identities = set()
    ident = body.get("snapshot_identity")
    if ident is not None:
        if not isinstance(ident, str) or not ident:
            raise bad_request("snapshot_identity must be a non-empty string", "snapshot_identity")
        identities.add(ident)
    header_ident = headers.get(SNAPSHOT_HEADER)
    if header_ident:
        identities.add(header_ident.strip())
    if model_identity:
        identities.add(model_identity)
    if len(identities) > 1:
        raise bad_request(
            f"conflicting snapshot identities requested: {', '.join(sorted(identities))}",
            "snapshot_identity",
        )
    return VersionConstraint(min_seq, identities.pop() if identities else None)


def parse_generation_request(
    body: object,
    kind: RequestKind,
    headers: Mapping[str, str],
    served_name: str,
    adapters: Collection[str] = (),
) -> GenerationRequest:
    """Validate an OpenAI completions/chat body (plus version headers) into a request;
    `adapters` are the LoRA adapters a request may name as its model."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    n = _int(body, "n", minimum=1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    best_of = _int(body, "best_of", minimum=1)
    if best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of")
    logprobs = _logprobs(body, kind)
    echo = _bool(body, "echo")
    if echo and kind == "chat":
        raise bad_request("echo is a /v1/completions option", "echo")
    routes = _bool(body, "include_routing_matrix")
    if routes and logprobs is None:
        raise bad_request(
            "include_routing_matrix needs logprobs (each token's routes are sent on its "
            "logprobs entry): add "
            + ('"logprobs": 0' if kind == "completion" else '"logprobs": true'),
            "include_routing_matrix",
        )
    prompt_logprobs = _int(body, "prompt_logprobs", minimum=0)
    if prompt_logprobs is not None and prompt_logprobs > MAX_PROMPT_LOGPROBS:
        raise bad_request(
            f"prompt_logprobs must be <= {MAX_PROMPT_LOGPROBS}, got {prompt_logprobs}",
            "prompt_logprobs",
        )
    adapter, model_identity = parse_model_field(body.get("model"), served_name, adapters)
    max_tokens = _int(body, "max_tokens", minimum=1)
    if kind == "chat" and max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", minimum=1)
    given = max_tokens is not None
    if max_tokens is None:
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS
    seed = _int(body, "seed")
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
    )
    if sampling.top_p == 0.0:
        raise bad_request("top_p must be greater than 0", "top_p")
    stream = _bool(body, "stream")
    if stream and prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported with stream", "prompt_logprobs")
    options = body.get("stream_options")
    include_usage = True
    if isinstance(options, dict) and "include_usage" in options:
        include_usage = _bool(options, "include_usage", True)
    return GenerationRequest(
        kind=kind,
        sampling=sampling,
        prompt=_prompt(body) if kind == "completion" else None,
        messages=_messages(body) if kind == "chat" else [],
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
        constraint=parse_constraint(body, headers, model_identity),
        max_tokens_given=given,
        prompt_logprobs=prompt_logprobs,
        adapter=adapter,
        logprobs=logprobs,
        echo=echo,
        routes=routes,
    )


def _logprobs(body: Mapping[str, Any], kind: RequestKind) -> int | None:
    """The top-k of generated tokens' logprobs (None: not asked): completions' `logprobs`
    (an integer), chat's `logprobs` (true/false) with `top_logprobs` (an integer)."""
    if kind == "chat":
        asked = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", minimum=0)
        if top is not None and not asked:
            raise bad_request('top_logprobs needs "logprobs": true', "top_logprobs")
        if top is not None and top > MAX_PROMPT_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be <= {MAX_PROMPT_LOGPROBS}, got {top}", "top_logprobs"
            )
        return (top or 0) if asked else None
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    top = _int(body, "logprobs", minimum=0)
    if top is not None and top > MAX_PROMPT_LOGPROBS:
        raise bad_request(f"logprobs must be <= {MAX_PROMPT_LOGPROBS}, got {top}", "logprobs")
    return top


def parse_load_request(body: object, *, patch: bool = False) -> LoadRequest:
    """Validate a `POST /hotload/v1/load` body, or with `patch` a `/hotload/v1/patch` body (a
    patch file and the `parent` it applies to); errors name the field (400)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    path = body.get("path")
    if not isinstance(path, str) or not path:
        what = "a patch file" if patch else "a snapshot folder"
        raise bad_request(f"path must be a non-empty string ({what})", "path")
    try:
        identity = validate_identity(body.get("identity"))
    except HotloadError as exc:
        raise bad_request(str(exc), "identity") from None
    parent = None
    if patch:
        try:
            parent = validate_identity(body.get("parent"))
        except HotloadError as exc:
            raise bad_request(
                f"parent (the snapshot the patch applies to): {exc}", "parent"
            ) from None
    sequence = _int(body, "sequence", minimum=0)
    if sequence is None:
        raise bad_request("sequence is required (the snapshot's ledger sequence)", "sequence")
    mode = body.get("mode", "async")
    if mode not in TRANSITION_MODES:
        raise bad_request(f"mode must be one of {', '.join(TRANSITION_MODES)}", "mode")
    policy = body.get("cache_policy", "all")
    if policy not in CACHE_POLICIES:
        raise bad_request(
            f"cache_policy must be one of {', '.join(CACHE_POLICIES)}", "cache_policy"
        )
    return LoadRequest(
        path=path,
        identity=identity,
        sequence=sequence,
        mode=mode,
        cache_policy=policy,
        parent=parent,
    )


def session_id(headers: Mapping[str, str]) -> str | None:
    """The request's session key: `x-multi-turn-session-id`, else `x-session-affinity`."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()
    return None


def render_chat_fallback(messages: Sequence[Mapping[str, str]]) -> str:
    """Prompt for a tokenizer without a chat template: "role: content" lines, then "assistant:"."""
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + "assistant:"
