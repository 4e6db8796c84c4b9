"""The numerics check: does the fleet compute the trainer's log-probabilities?

The same token sequences go through the trainer's model (transformers, float32, on this
machine) and through every replica (`/v1/completions` with vLLM's `prompt_logprobs: K`
extension, `max_tokens: 1`; the reference engine answers it too). For every prompt position
after the first the report compares:

- the log-probability of the sequence's own token (`|trainer - replica|`, max and mean);
- the log-probabilities of every token the replica reported (its top-k), max `|difference|`;
- whether both sides rank the same token first;
- KL(trainer || replica) of the next-token distribution.

Replicas return only their top-k (vLLM allows at most 20 by default), so the KL is computed on
the distributions coarse-grained to the tokens the replica reported (its top-k and the
sequence's own token) plus one bucket holding all other tokens. Every probability in it is
known exactly: the trainer's side has the full distribution, and the replica's bucket is one
minus what it reported. By the data-processing inequality this never exceeds the full KL,
and it equals it when the reported tokens carry all the mass; with two distributions that
agree to rounding it is ~0 either way.

Results are grouped per replica and, within it, per snapshot identity: the reference engine
names the snapshot that computed the prompt in every answer (`hotload.identity_start`, or
`model: "<name>@<identity>"`); for vLLM the weight version (`GET /weight_info`, dev mode,
which the loader sets to the identity) is read before and after each request.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from hotload.errors import HotloadError

LogProbs = npt.NDArray[np.float64]

#: What a trainer-side callable returns for one sequence: logits or log-probabilities
#: ([n, vocab], row i is the distribution of token i+1), a torch tensor or nested lists.
Reference = str | Path | Callable[[list[int]], Any]

#: vLLM's default `max_logprobs`: the most prompt logprobs a default vLLM server returns.
DEFAULT_TOP_K = 20
DEFAULT_TIMEOUT = 120.0
#: The weight version vLLM reports before any hot load (`EngineCore._weight_version`).
VLLM_DEFAULT_VERSION = "default"


class NumericsError(HotloadError):
    """The numerics check could not run: bad sequences, an unreadable model, a replica's answer."""


# --- the report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """Differences over a set of prompt positions (log-probabilities in nats)."""

    positions: int = 0
    max_abs_diff: float = 0.0  # of the sequence's own token
    mean_abs_diff: float = 0.0
    topk_max_abs_diff: float = 0.0  # over every token the replica reported
    kl_max: float = 0.0
    kl_mean: float = 0.0
    top1_agreement: float = 1.0  # fraction of positions where both rank the same token first

    @staticmethod
    def of(positions: Sequence[PositionResult]) -> Divergence:
        """Summarise per-position results (an empty list gives zero positions)."""
        n = len(positions)
        if n == 0:
            return Divergence()
        return Divergence(
            positions=n,
            max_abs_diff=max(p.abs_diff for p in positions),
            mean_abs_diff=sum(p.abs_diff for p in positions) / n,
            topk_max_abs_diff=max(p.topk_max_abs_diff for p in positions),
            kl_max=max(p.kl for p in positions),
            kl_mean=sum(p.kl for p in positions) / n,
            top1_agreement=sum(p.top1_agree for p in positions) / n,
        )


@dataclass(frozen=True)
class PositionResult:
    """One prompt position: the trainer's and the replica's logprob of its token, and the KL."""

    position: int
    token: int
    trainer_logprob: float
    replica_logprob: float
    topk_max_abs_diff: float
    kl: float
    top1_agree: bool

    @property
    def abs_diff(self) -> float:
        """`|trainer - replica|` of the position's own token."""
        return abs(self.trainer_logprob - self.replica_logprob)


@dataclass(frozen=True)
class SequenceResult:
    """One sequence on one replica, and the snapshot that computed it (None: unknown)."""

    index: int
    snapshot: str | None
    positions: list[PositionResult]

    @property
    def divergence(self) -> Divergence:
        """The summary of this sequence's positions."""
        return Divergence.of(self.positions)


@dataclass(frozen=True)
class ReplicaReport:
    """One replica: its sequences, their summary per snapshot, or why it could not be checked."""

    endpoint: str
    sequences: list[SequenceResult] = field(default_factory=list)
    error: str | None = None

    @property
    def divergence(self) -> Divergence:
        """The summary over every position this replica computed."""
        return Divergence.of([p for s in self.sequences for p in s.positions])

    @property
    def snapshots(self) -> dict[str, Divergence]:
        """The summary per snapshot identity that served the sequences (`"unknown"`: not named)."""
        return _by_snapshot(self.sequences)


@dataclass(frozen=True)
class NumericsReport:
    """The whole check: per replica, per snapshot across replicas, and in total."""

    reference: str
    top_k: int
    sequences: int
    replicas: list[ReplicaReport]

    @property
    def divergence(self) -> Divergence:
        """The summary over every position of every replica."""
        return Divergence.of([p for r in self.replicas for s in r.sequences for p in s.positions])

    @property
    def snapshots(self) -> dict[str, Divergence]:
        """The summary per snapshot identity, across replicas."""
        return _by_snapshot([s for r in self.replicas for s in r.sequences])

    @property
    def failed(self) -> list[ReplicaReport]:
        """Replicas that could not be checked (their `error` says why)."""
        return [r for r in self.replicas if r.error is not None]

    def to_json(self) -> dict[str, Any]:
        """A JSON document of the report: summaries per replica and snapshot, per-position data."""
        return {
            "reference": self.reference,
            "top_k": self.top_k,
            "sequences": self.sequences,
            "kl": "KL(trainer || replica) over the replica's reported tokens plus one bucket for "
            "the rest (a lower bound of the full-vocabulary KL)",
            "divergence": asdict(self.divergence),
            "snapshots": {k: asdict(v) for k, v in self.snapshots.items()},
            "replicas": [
                {
                    "endpoint": r.endpoint,
                    "error": r.error,
                    "divergence": asdict(r.divergence),
                    "snapshots": {k: asdict(v) for k, v in r.snapshots.items()},
                    "sequences": [
                        {
                            "index": s.index,
                            "snapshot": s.snapshot,
                            "abs_diff": [p.abs_diff for p in s.positions],
                            "kl": [p.kl for p in s.positions],
                        }
                        for s in r.sequences
                    ],
                }
                for r in self.replicas
            ],
        }


UNKNOWN_SNAPSHOT = "unknown"


def _by_snapshot(sequences: Iterable[SequenceResult]) -> dict[str, Divergence]:
    groups: dict[str, list[PositionResult]] = {}
    for s in sequences:
        groups.setdefault(s.snapshot or UNKNOWN_SNAPSHOT, []).extend(s.positions)
    return {k: Divergence.of(v) for k, v in sorted(groups.items())}


# --- comparing one position ----------------------------------------------------------------------


def compare_position(
    position: int, token: int, trainer: LogProbs, replica: dict[int, float], top1: int | None
) -> PositionResult:
    """Compare the trainer's full log-distribution at one position with the replica's entries.

    `trainer` holds the trainer's logprob of every vocabulary token, `replica` the replica's
    logprob of each token it reported (its own token included), `top1` the token it ranked
    first. The KL is the coarse-grained one described in the module docstring (float64).
    """
    if token not in replica:
        raise NumericsError(f"position {position}: the replica did not report token {token}")
    reported = sorted(replica)
    vocab = len(trainer)
    bad = [t for t in reported if not 0 <= t < vocab]
    if bad:
        raise NumericsError(
            f"position {position}: the replica reported token {bad[0]}, outside the trainer's "
            f"vocabulary of {vocab}"
        )
    mine = [float(trainer[t]) for t in reported]
    p = [math.exp(v) for v in mine]
    q = [math.exp(replica[t]) for t in reported]
    # Both "rest" buckets as 1 minus the reported mass, so each side sums to 1 exactly and the
    # first-order rounding terms cancel (a rest bucket of ~1 otherwise shows ~1e-8 of fake KL).
    p_rest, q_rest = max(0.0, 1.0 - math.fsum(p)), max(0.0, 1.0 - math.fsum(q))
    kl = math.fsum(pi * (v - replica[t]) for pi, v, t in zip(p, mine, reported, strict=True))
    if p_rest > 0.0:
        # A replica that reports (to rounding) all the mass leaves ~0 for the rest: floor it so a
        # rest the trainer gives ~1e-9 costs ~1e-8, not infinity.
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-12)))
    trainer_top = int(np.argmax(trainer))
    return PositionResult(
        position=position,
        token=token,
        trainer_logprob=float(trainer[token]),
        replica_logprob=float(replica[token]),
        topk_max_abs_diff=max(abs(v - replica[t]) for v, t in zip(mine, reported, strict=True)),
        kl=max(0.0, kl),
        top1_agree=top1 is None or top1 == trainer_top,
    )


# --- the trainer's side --------------------------------------------------------------------------


def _load_model(path: Path, auto: Any) -> Any:
    """The model folder `path` in float32; a block-FP8 snapshot is loaded dequantized
    (`hotload.snapshot.fp8.dequantized_folder`), as the engines compute with it, since
    transformers loads FP8 only on an accelerator."""
    import json
    import tempfile

    import torch

    from hotload.snapshot.fp8 import dequantized_folder, fp8_block

    try:
        config = json.loads((path / "config.json").read_text())
        fp8 = isinstance(config, dict) and fp8_block(config, str(path / "config.json")) is not None
    except (OSError, ValueError) as err:
        raise NumericsError(f"{path / 'config.json'}: {err}") from err
    if not fp8:
        return auto.from_pretrained(str(path), dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="hotload-fp8-") as tmp:
        return auto.from_pretrained(str(dequantized_folder(path, Path(tmp))), dtype=torch.float32)


def _trainer_logprobs(
    reference: Reference, sequences: Sequence[list[int]]
) -> tuple[str, list[LogProbs]]:
    """The trainer's float32 log-probabilities of every sequence ([n, vocab]), and its name."""
    import torch

    fn: Callable[[list[int]], Any]
    if isinstance(reference, str | Path):
        from transformers import AutoModelForCausalLM

        path = Path(reference)
        if not (path / "config.json").is_file():
            raise NumericsError(f"{path}: not a model folder (no config.json)")
        model: Any = _load_model(path, AutoModelForCausalLM)
        model.eval()

        def forward(ids: list[int]) -> Any:
            with torch.inference_mode():
                return model(torch.tensor([ids])).logits[0]

        fn, name = forward, str(path)
    else:
        fn = reference
        name = getattr(reference, "__name__", type(reference).__name__)
    out = []
    for ids in sequences:
        with torch.inference_mode():
            value = fn(list(ids))
            logits = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            # float32 as in training; log_softmax leaves log-probabilities as they are.
            logprobs = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
        if logprobs.ndim != 2 or logprobs.shape[0] != len(ids):
            raise NumericsError(
                f"the reference returned shape {list(logprobs.shape)} for a sequence of "
                f"{len(ids)} tokens; expected [{len(ids)}, vocab]"
            )
        out.append(logprobs.double().numpy())
    return name, out


# --- the replicas' side --------------------------------------------------------------------------


async def _json(session: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> Any:
    async with session.request(method, url, **kw) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise NumericsError(f"{method} {url}: HTTP {resp.status}: {text[:500]}")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise NumericsError(f"{method} {url}: not JSON: {text[:200]}") from None


async def _weight_version(session: aiohttp.ClientSession, base: str) -> str | None:
    """vLLM's weight version (dev mode), or None where the engine has no such endpoint."""
    try:
        async with session.get(base + "/weight_info") as resp:
            if resp.status != 200:
                return None
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, json.JSONDecodeError, ValueError):
        return None
    version = body.get("weight_version") if isinstance(body, dict) else None
    return version if isinstance(version, str) else None


def _named_snapshot(body: dict[str, Any]) -> str | None:
    """The snapshot a reference-engine answer names for its prompt (prefill) weights."""
    block = body.get("hotload")
    if isinstance(block, dict) and isinstance(block.get("identity_start"), str):
        return str(block["identity_start"])
    model = body.get("model")
    if isinstance(model, str) and "@" in model:
        return model.rpartition("@")[2]
    return None


def _entries(body: Any, ids: list[int], base: str) -> list[dict[int, float]]:
    """Per-position `{token: logprob}` of a `prompt_logprobs` answer, checked against `ids`."""
    try:
        choice = body["choices"][0]
        raw = choice["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise NumericsError(
            f"{base}: the answer has no choices[0].prompt_logprobs (does the engine support "
            "vLLM's prompt_logprobs?)"
        ) from None
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != ids:
        raise NumericsError(f"{base}: the engine scored other prompt tokens than it was sent")
    if not isinstance(raw, list) or len(raw) != len(ids):
        raise NumericsError(
            f"{base}: prompt_logprobs has {len(raw) if isinstance(raw, list) else 'no'} entries "
            f"for {len(ids)} prompt tokens"
        )
    out: list[dict[int, float]] = []
    for entry in raw[1:]:
        if not isinstance(entry, dict):
            raise NumericsError(f"{base}: a prompt_logprobs entry is not an object")
        out.append({int(t): float(v["logprob"]) for t, v in entry.items()})
    return out


def _rank1(body: dict[str, Any], position: int) -> int | None:
    entry = body["choices"][0]["prompt_logprobs"][position]
    for token, value in entry.items():
        if isinstance(value, dict) and value.get("rank") == 1:
            return int(token)
    return None


async def _check_replica(
    session: aiohttp.ClientSession,
    endpoint: str,
    sequences: Sequence[list[int]],
    trainer: Sequence[LogProbs],
    top_k: int,
) -> ReplicaReport:
    base = endpoint.rstrip("/")
    try:
        models = await _json(session, "GET", base + "/v1/models")
        # The bare name: `<name>@<identity>` would pin one snapshot and refuse the others.
        model = str(models["data"][0]["id"]).partition("@")[0]
    except (NumericsError, aiohttp.ClientError, KeyError, IndexError, TypeError) as err:
        return ReplicaReport(endpoint, error=f"GET {base}/v1/models: {err}")
    results: list[SequenceResult] = []
    try:
        for index, ids in enumerate(sequences):
            before = await _weight_version(session, base)
            body = await _json(
                session,
                "POST",
                base + "/v1/completions",
                json={
                    "model": model,
                    "prompt": ids,
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "prompt_logprobs": top_k,
                    "return_token_ids": True,
                },
            )
            snapshot = _named_snapshot(body)
            if snapshot is None and before is not None:
                after = await _weight_version(session, base)
                # A version that changed during the request leaves the snapshot unknown.
                snapshot = before if before == after else None
            entries = _entries(body, ids, base)
            positions = [
                compare_position(i, ids[i], trainer[index][i - 1], entries[i - 1], _rank1(body, i))
                for i in range(1, len(ids))
            ]
            results.append(SequenceResult(index, snapshot, positions))
    except (TimeoutError, NumericsError, aiohttp.ClientError) as err:
        return ReplicaReport(endpoint, results, error=str(err) or type(err).__name__)
    return ReplicaReport(endpoint, results)


# --- entry points --------------------------------------------------------------------------------


def check_sequences(sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """Validate token sequences (each at least 2 non-negative ids); return them as lists."""
    out: list[list[int]] = []
    if not sequences:
        raise NumericsError("no token sequences to check")
    for i, seq in enumerate(sequences):
        ids = list(seq)
        if len(ids) < 2:
            raise NumericsError(f"sequence {i} has {len(ids)} tokens; at least 2 are needed")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise NumericsError(f"sequence {i} must hold non-negative integer token ids")
        out.append(ids)
    return out


def default_sequences(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Built-in sequences: 4 seeded pseudo-random token sequences of 8 to 64 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in (8, 16, 32, 64)]


async def numerics_check_async(
    reference: Reference,
    endpoints: Sequence[str],
    sequences: Sequence[Sequence[int]],
    *,
    top_k: int = DEFAULT_TOP_K,
    timeout: float = DEFAULT_TIMEOUT,
) -> NumericsReport:
    """`numerics_check` for code already inside an event loop (the model runs in a thread)."""
    if not endpoints:
        raise NumericsError("no replica endpoints to check")
    if not 0 <= top_k <= DEFAULT_TOP_K:
        raise NumericsError(f"top_k must be between 0 and {DEFAULT_TOP_K}, got {top_k}")
    seqs = check_sequences(sequences)
    name, trainer = await asyncio.to_thread(_trainer_logprobs, reference, seqs)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        replicas = await asyncio.gather(
            *(_check_replica(session, e, seqs, trainer, top_k) for e in endpoints)
        )
    return NumericsReport(name, top_k, len(seqs), list(replicas))


def numerics_check(
    reference: Reference,
    endpoints: Sequence[str],
    sequences: Sequence[Sequence[int]],
    *,
    top_k: int = DEFAULT_TOP_K,
    timeout: float = DEFAULT_TIMEOUT,
) -> NumericsReport:
    """Run `sequences` through the trainer's model and every replica; report the differences.

    `reference` is the trainer's model folder (loaded with transformers in float32) or a
    callable returning logits or log-probabilities [n, vocab] of a token list; `endpoints` are
    replica base URLs. A replica that cannot be checked is reported with its `error`.
    """
    from hotload.bucket import run_sync

    return run_sync(
        numerics_check_async(reference, endpoints, sequences, top_k=top_k, timeout=timeout)
    )


__all__ = [
    "DEFAULT_TOP_K",
    "Divergence",
    "NumericsError",
    "NumericsReport",
    "PositionResult",
    "ReplicaReport",
    "SequenceResult",
    "compare_position",
    "default_sequences",
    "numerics_check",
    "numerics_check_async",
]
