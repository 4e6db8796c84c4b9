"""Router Replay (R3) for the trainer: the experts the engine routed each token to, forced on
the trainer's own routers in its training forward.

A rollout asked with `"logprobs": 0, "echo": true, "include_routing_matrix": true` carries,
per token j, the experts each MoE layer chose in the pass where token j was the input
(`docs/router-replay.md`). `RolloutRoutes.from_response` (or `from_chunks` for a stream)
reads them with the snapshot that produced them; `replay_routes` forces a transformers MoE
model's routers to them while the routing weights are still the softmax of the live logits at
those experts, so the router keeps its gradient:

    routes = RolloutRoutes.from_response(body)
    with replay_routes(model, routes, snapshot=policy_identity):
        logits = model(torch.tensor([routes.token_ids])).logits

Routes are valid only for the weights that produced them: a sample generated across a hot
load (`identity_start` != `identity_end`), or one from another snapshot than `snapshot`, is
refused (`RoutesError`), as are routes of another model shape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hotload.routes import RouteFormat, RoutesError, decode_routes, find_routers, route_format

#: One token's routes: expert ids per MoE layer (`[layers][top_k]`), None where the engine
#: recorded none (the last generated token is never fed: its outputs reach no loss).
TokenRoutes = list[list[int]] | None


@dataclass(frozen=True)
class RolloutRoutes:
    """One sample's tokens (prompt then completion), each one's routes and the engine's
    logprob of it (None for the first prompt token), from `snapshot`."""

    snapshot: str
    token_ids: list[int]
    routes: list[TokenRoutes]
    layout: RouteFormat
    prompt_tokens: int
    logprobs: list[float | None]

    @classmethod
    def from_response(cls, body: Mapping[str, Any]) -> RolloutRoutes:
        """Read a non-streamed completion asked with logprobs, echo and include_routing_matrix;
        anything missing raises `RoutesError` naming what to ask for."""
        choices = body.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise RoutesError("the response must have exactly one choice")
        return cls._build(choices[0].get("logprobs"), body.get("hotload"), body.get("usage"))

    @classmethod
    def from_chunks(cls, chunks: Sequence[Mapping[str, Any]]) -> RolloutRoutes:
        """Read a streamed completion's SSE chunks (parsed JSON, `[DONE]` left out): each
        chunk's logprobs entries in order, the last chunk's `hotload` and `usage`."""
        content: list[Any] = []
        for chunk in chunks:
            for choice in chunk.get("choices") or []:
                logprobs = choice.get("logprobs")
                if isinstance(logprobs, dict):
                    content.extend(logprobs.get("content") or [])
        if not chunks:
            raise RoutesError("no chunks: the stream ended before its first token")
        last = chunks[-1]
        return cls._build({"content": content}, last.get("hotload"), last.get("usage"))

    @classmethod
    def _build(cls, logprobs: object, block: object, usage: object) -> RolloutRoutes:
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("content"), list):
            raise RoutesError('the response has no logprobs: ask with "logprobs": 0')
        if not isinstance(block, dict):
            raise RoutesError("the response has no hotload block: is it a hotload engine's?")
        start, end = block.get("identity_start"), block.get("identity_end")
        if start != end:
            raise RoutesError(
                f"the sample was generated across a hot load ({start} -> {end}): its routes "
                "are not one snapshot's; drop it, or pin the snapshot with snapshot_identity"
            )
        if "routes" not in block:
            raise RoutesError('the response has no routes: ask with "include_routing_matrix": true')
        layout = RouteFormat.from_json(block["routes"])
        content = logprobs["content"]
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(prompt_tokens, int) or not isinstance(completion, int):
            raise RoutesError("the response has no usage counts (prompt_tokens, completion_tokens)")
        if len(content) != prompt_tokens + completion:
            raise RoutesError(
                f"logprobs cover {len(content)} tokens, the prompt and completion "
                f'{prompt_tokens} + {completion}: ask with "echo": true so the prompt\'s routes '
                "come back too"
            )
        token_ids: list[int] = []
        routes: list[TokenRoutes] = []
        values: list[float | None] = []
        for j, entry in enumerate(content):
            token_id = entry.get("token_id") if isinstance(entry, dict) else None
            if not isinstance(token_id, int):
                raise RoutesError(f"logprobs.content[{j}] has no token_id")
            if "routing_matrix" not in entry:
                raise RoutesError(f"logprobs.content[{j}] has no routing_matrix")
            raw = entry["routing_matrix"]
            if raw is not None and not isinstance(raw, str):
                raise RoutesError(f"logprobs.content[{j}].routing_matrix must be base64 or null")
            try:
                routes.append(decode_routes(raw, layout) if raw is not None else None)
            except RoutesError as err:
                raise RoutesError(f"logprobs.content[{j}]: {err}") from None
            token_ids.append(token_id)
            value = entry.get("logprob")
            values.append(float(value) if isinstance(value, int | float) else None)
        return cls(str(start), token_ids, routes, layout, prompt_tokens, values)


@contextmanager
def replay_routes(
    model: Any, samples: RolloutRoutes | Sequence[RolloutRoutes], *, snapshot: str
) -> Iterator[None]:
    """While open, every forward of `model` (a batch of `samples`' tokens, equal lengths, no
    KV cache) routes each token to the experts its sample names, with the routing weights
    computed from the live router logits; `snapshot` is the policy the trainer holds, which
    every sample must come from."""
    import torch

    batch = [samples] if isinstance(samples, RolloutRoutes) else list(samples)
    if not batch:
        raise RoutesError("no samples to replay")
    routers = find_routers(model)
    layout = route_format(routers)
    if layout is None:
        raise RoutesError("the model has no mixture-of-experts router to replay")
    for k, sample in enumerate(batch):
        if sample.snapshot != snapshot:
            raise RoutesError(
                f"sample {k}'s routes come from snapshot {sample.snapshot}, the trainer holds "
                f"{snapshot}: routes are valid only for the weights that produced them"
            )
        theirs = (sample.layout.layers, sample.layout.top_k, sample.layout.experts)
        ours = (layout.layers, layout.top_k, layout.experts)
        if theirs != ours:
            raise RoutesError(
                f"sample {k}'s routes are for {theirs[0]} MoE layers of top-{theirs[1]} of "
                f"{theirs[2]} experts; the model has {ours[0]} of top-{ours[1]} of {ours[2]}"
            )
    lengths = sorted({len(s.token_ids) for s in batch})
    if len(lengths) != 1:
        raise RoutesError(f"samples have {lengths} tokens: replay a batch of equal lengths")
    free = [[-1] * layout.top_k] * layout.layers
    forced = torch.tensor([[r if r is not None else free for r in s.routes] for s in batch])
    # [batch, tokens, layers, top_k] -> per layer [batch * tokens, top_k]
    per_layer = [forced[:, :, i, :].reshape(-1, layout.top_k) for i in range(layout.layers)]

    def hook_for(index: int) -> Any:
        def hook(router: Any, _args: Any, output: Any) -> Any:
            logits, scores, live = output
            if logits.shape[0] != per_layer[index].shape[0]:
                raise RoutesError(
                    f"the forward routes {logits.shape[0]} token rows; the routes cover "
                    f"{len(batch)} sample(s) of {lengths[0]} tokens (one forward over the whole "
                    "sequence, no KV cache)"
                )
            want = per_layer[index].to(live.device)
            chosen = torch.where(want < 0, live, want)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if getattr(router, "norm_topk_prob", True):
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(scores.dtype), chosen

        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
