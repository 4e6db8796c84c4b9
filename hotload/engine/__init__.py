"""The reference engine: an OpenAI-compatible server for Hugging Face causal LMs with hot loads.

Run it with `hotload serve --model SNAPSHOT_DIR [--name NAME] [--identity ID] [--sequence N]`.
It serves one model from a full hotload snapshot (an HF folder: config.json, tokenizer,
model.safetensors.index.json, model.weight.spec.json, shards) on CPU or CUDA.

HTTP API
    GET  /v1/models               {"data": [{"id": "<name>@<identity>", "root": name, ...}]}
    POST /v1/completions          prompt (string or token ids), max_tokens (16), temperature
    POST /v1/chat/completions     (0 = greedy, the default), top_p, seed, stop, stream, n=1,
                                  logprobs (chat: logprobs + top_logprobs), echo (completions);
                                  extensions: ignore_eos, return_token_ids, prompt_logprobs,
                                  include_routing_matrix (each token's MoE routes,
                                  docs/router-replay.md)
    POST /hotload/v1/load         {"path", "identity", "sequence", "mode": "async"|"sync",
                                  "cache_policy": "all"|"none"|"new_session"} -> 200
                                  {"identity", "sequence", "load_seconds", "pause_seconds", ...}
    POST /hotload/v1/patch        the load body plus "parent", with a patch file as "path": a
                                  delta's changes written into the served weights in place
                                  (docs/engines.md, "Sparse hot loads")
    GET  /hotload/v1/checksums    {"checksums": {name: sha256 of the weight as held}, ...}
    GET  /hotload/v1/status       model, identity, sequence, loading, loads, last_load_seconds,
                                  last_error, plus ready, running, queued, numerics, prefix_cache
    GET  /health, GET /ready, GET /metrics

Snapshot naming. Every response carries `model: "<name>@<identity at the end>"` and a `hotload`
object with `identity_start`, `identity_end`, `sequence_start`, `sequence_end` (and
`prefix_cached_tokens`); every SSE chunk's `model` names the weights that produced its token,
so a stream that spans an ASYNC swap changes `model` mid-stream. Responses also carry the
headers `x-hotload-snapshot` and `x-hotload-sequence` (for a stream: at its start).

Version constraints. `min_snapshot_sequence` / `snapshot_identity` in the body, the headers
`x-hotload-min-sequence` / `x-hotload-snapshot`, or `model: "<name>@<identity>"`. They are
checked when the request arrives and again when a queued request is admitted to the batch, so
an unmet constraint is always a 409 (`snapshot_unavailable`, `Retry-After: 1`, with
`served_identity` and `served_sequence`) before any token is sent. A generation already running
when an ASYNC swap lands continues on the new weights; `identity_end` reports it.

Hot loads. Staging (verify structure and checksums, compare config.json with the one the engine
started with, compare every tensor's name, shape and dtype with the served model, read all of
it into new tensors, reject NaN/Inf) runs in a thread while generation continues; it needs a
second copy of the weights in memory. The swap itself re-points parameters and takes
microseconds.
- ASYNC (default): applied between two decode steps; running generations continue on the new
  weights on the same connection; requests arriving meanwhile queue; nothing fails.
  `pause_seconds` = how long the decode loop was held (swap + KV recompute, see below).
- SYNC: after staging, new generation requests get 425 (`swap_in_progress`, `Retry-After`) and
  /ready 503; everything already accepted (running or queued) finishes on the old weights; then
  the swap. `pause_seconds` = how long requests were refused (drain included).
- Failures leave the old weights serving and set `last_error`: 400 bad body, 409
  `load_in_progress`, 422 `snapshot_invalid` (missing files, bad manifests, config differs),
  `checksum_mismatch`, `weights_mismatch` (names/shapes/dtypes vs the served model),
  `snapshot_unusable` (an arc_v2 delta, NaN/Inf values), 500 `load_failed`. Only full snapshots
  load; the loader rebuilds deltas first.

Sessions and the prompt-cache policy. `x-multi-turn-session-id` (preferred) or
`x-session-affinity` names a session; when it finishes, a generation leaves its KV cache in a
per-session LRU (bounded by tokens), and the session's next prompt reuses the longest common
token prefix. In exact numerics (below) this never changes outputs. On a swap:
- `all`: drop every session entry and recompute the KV of running generations with the new
  weights (their next tokens are exactly what the new weights give for the text so far);
- `none`: keep every entry and every running generation's KV (computed by the old weights);
- `new_session`: keep the entries of existing sessions and the KV of running generations that
  belong to a session; running generations without a session are recomputed; sessions that
  start after the swap start clean. (With a per-session cache there is no cross-session cache
  to flush, so for session traffic `new_session` behaves like `none`.)

Chat prompts use the tokenizer's chat template when it has one; otherwise the messages are
joined as "role: content\\n" lines followed by "assistant:" and tokenised with the tokenizer's
special tokens (the tokenizer of the snapshot the engine started with serves for its lifetime).

Numerics. `--numerics exact` (default on CPU) makes a request's tokens independent of batching
and of the prefix cache: BLAS rounds differently for a few small row counts, so a start-up probe
finds the row counts at which each row of every linear layer gets the same bits as in a large
block (`row_sizes`; `batch_invariant` in /hotload/v1/status says whether it succeeded) and
linear calls are padded with zero rows up to the nearest such count; attention runs one query
at a time over exactly its own keys. `--numerics fast` (default on CUDA) uses transformers' SDPA
attention with padding masks: outputs then agree only up to rounding across batch
compositions. Either way an engine that swapped to a snapshot holds bit-identical weights to one
started on it, so their outputs are equal under the same conditions.

Modules: `protocol` (requests and constraints, pure), `responses` (response bodies, pure),
`tokenizer` and `text` (incremental detokenisation), `sessions` (prefix cache), `metrics`,
`batch` (the running batch's KV), `exact` (batch-invariant numerics), `sampling`, `model`
(loading, staging and swapping weights; forward passes), `staging` (the thread a hot load
stages in, and its errors), `scheduler` (the worker thread), `engine` (the asyncio-side state
machine), `server` (`create_app`). torch and transformers are imported only by the modules
that need them; the rest of `hotload` never imports this package.

Limits: dense decoder-only models with full attention (tested with Llama; sliding-window and
soft-capped attention fall back to fast numerics; mixtures of experts: Qwen3-MoE, Qwen2-MoE,
Mixtral), n=1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hotload.engine.engine import Engine, EngineConfig
    from hotload.engine.server import create_app

__all__ = ["Engine", "EngineConfig", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy: `import hotload.engine` stays cheap until the engine is actually used.
    if name in ("Engine", "EngineConfig"):
        from hotload.engine import engine

        return getattr(engine, name)
    if name == "create_app":
        from hotload.engine.server import create_app

        return create_app
    raise AttributeError(f"module 'hotload.engine' has no attribute {name!r}")
