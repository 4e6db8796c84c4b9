"""One worker thread runs every forward pass: admission, micro-batched decoding and swaps.

Concurrent requests share a batch: each is prefilled on its own when it is admitted (so its
prompt's keys and values never depend on its neighbours), then all rows step together, one
token per row per decode step, with left padding in the batch's KV cache. Finished rows leave
after the step that finished them and waiting requests take their places.

Between two decode steps lies the pause point where swaps happen:

- ASYNC: the swap is applied at the next pause point; running generations continue on the new
  weights in the same batch and on the same connection, requests that arrive meanwhile wait in
  the queue; nothing fails. Under cache policy `all` the running rows' KV is recomputed with the
  new weights before the next step (`new_session` recomputes rows without a session, `none`
  keeps every row's KV).
- SYNC: the engine stops accepting requests (425) before it hands the swap over; the worker
  keeps generating until the queue and the batch are empty, i.e. everything accepted finishes on
  the old weights, and only then swaps.

Results go back to the asyncio side through a thread-safe `sink` per request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from hotload.engine.batch import BatchKV, KVCache
from hotload.engine.lora import StagedAdapter
from hotload.engine.metrics import EngineMetrics
from hotload.engine.model import ModelRunner, StagedWeights
from hotload.engine.patching import StagedPatch
from hotload.engine.protocol import (
    ApiError,
    CachePolicy,
    SamplingParams,
    ServedSnapshot,
    TransitionMode,
    VersionConstraint,
    snapshot_unavailable,
)
from hotload.engine.responses import Outcome, PromptLogprobs, TokenScore
from hotload.engine.sampling import pick_token, prompt_logprobs, prompt_scores, token_score
from hotload.engine.sessions import SessionCache
from hotload.engine.text import TextAssembler
from hotload.engine.tokenizer import TextCodec
from hotload.routes import encode_routes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, the text it releases and the snapshot that produced it."""

    token_id: int
    text: str
    served: ServedSnapshot
    #: Its logprobs entry (None: not asked); with routes, sent once the token was fed.
    score: TokenScore | None = None


@dataclass(frozen=True)
class PromptEvent:
    """With `echo`: the prompt's text and, with logprobs, its tokens' entries, sent after the
    prefill and before the first generated token."""

    text: str
    scores: list[TokenScore]
    served: ServedSnapshot


@dataclass(frozen=True)
class DoneEvent:
    """The generation finished; `tail` is text released only at the end (held-back characters)."""

    outcome: Outcome
    tail: str = ""


@dataclass(frozen=True)
class ErrorEvent:
    """The generation could not start or failed; `error` is the HTTP answer."""

    error: ApiError


Event = TokenEvent | PromptEvent | DoneEvent | ErrorEvent
EventSink = Callable[[Event], None]


@dataclass(eq=False)
class Job:
    """A generation request handed to the worker (the HTTP side only sets `cancelled`)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    sink: EventSink
    session: str | None = None
    constraint: VersionConstraint = field(default_factory=VersionConstraint)
    prompt_logprobs: int | None = None  # top-k of vLLM's `prompt_logprobs`; None: not asked
    adapter: str | None = None  # the LoRA adapter the request named as its model
    logprobs: int | None = None  # top-k of the generated tokens' logprobs; None: not asked
    echo: bool = False  # the prompt's text (and its logprobs entries) first
    routes: bool = False  # each token's routes on its logprobs entry
    cancelled: bool = False


@dataclass(eq=False)
class _Row:
    """Worker-private state of one running generation."""

    job: Job
    start: ServedSnapshot
    last: ServedSnapshot
    assembler: TextAssembler
    gen: torch.Generator | None
    cached_tokens: int
    generated: list[int] = field(default_factory=list)
    finish: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    scores: list[TokenScore] | None = None
    prompt_scores: list[TokenScore] | None = None
    #: With routes: the last token, held until the pass that feeds it records its routes.
    pending: TokenEvent | None = None


@dataclass(eq=False)
class SwapOrder:
    """A staged snapshot (whole, or a patch of the served one) to swap in at the next pause
    point (ASYNC) or once drained (SYNC)."""

    staged: StagedWeights | StagedPatch
    target: ServedSnapshot
    mode: TransitionMode
    policy: CachePolicy
    future: concurrent.futures.Future[float] = field(default_factory=concurrent.futures.Future)


@dataclass(eq=False)
class CallOrder:
    """A function run on the worker between two decode steps (a consistent view of the weights)."""

    fn: Callable[[], object]
    future: concurrent.futures.Future[object] = field(default_factory=concurrent.futures.Future)


@dataclass(eq=False)
class AdapterOrder:
    """Install a staged LoRA adapter, or remove one by name, at the next pause point."""

    install: StagedAdapter | None = None
    remove: str | None = None
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


class Scheduler:
    """The worker thread and its queue; see the module docstring for the semantics."""

    def __init__(
        self,
        runner: ModelRunner,
        codec: TextCodec,
        served: ServedSnapshot,
        *,
        max_batch: int = 8,
        sessions: SessionCache[KVCache] | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.runner = runner
        self.codec = codec
        self.max_batch = max_batch
        self.sessions: SessionCache[KVCache] = sessions if sessions is not None else SessionCache()
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self._served = served
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._orders: collections.deque[SwapOrder] = collections.deque()
        self._adapter_orders: collections.deque[AdapterOrder | CallOrder] = collections.deque()
        #: Adapters unloaded while running rows still use them: removed once those finish.
        self._retiring: set[str] = set()
        self._rows: list[_Row] = []
        self._batch = BatchKV()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hotload-engine-worker", daemon=True)
        self.steps = 0

    # --- called from other threads -----------------------------------------------------------

    @property
    def served(self) -> ServedSnapshot:
        """The snapshot whose weights generate now (swapped by the worker)."""
        return self._served

    @property
    def running(self) -> int:
        """Generations in the batch."""
        return len(self._rows)

    @property
    def queued(self) -> int:
        """Generations waiting for a batch slot."""
        return len(self._pending)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker; waiting requests and pending swaps fail with 503."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        gone = ApiError(503, "shutting_down", "the engine is shutting down")
        for job in list(self._pending) + [r.job for r in self._rows]:
            job.sink(ErrorEvent(gone))
        for order in self._orders:
            order.future.set_exception(gone)
        self._pending.clear()
        self._orders.clear()
        self._rows = []

    def submit(self, job: Job) -> None:
        """Queue a generation (thread-safe)."""
        with self._cond:
            self._pending.append(job)
            self._cond.notify_all()

    def swap(self, order: SwapOrder) -> concurrent.futures.Future[float]:
        """Hand a swap to the worker; the future gives the seconds generation was paused."""
        with self._cond:
            self._orders.append(order)
            self._cond.notify_all()
        return order.future

    def adapters(self, order: AdapterOrder) -> concurrent.futures.Future[None]:
        """Hand an adapter install or removal to the worker (applied between two steps)."""
        with self._cond:
            self._adapter_orders.append(order)
            self._cond.notify_all()
        return order.future

    def between_steps(self, fn: Callable[[], object]) -> concurrent.futures.Future[object]:
        """Run `fn` on the worker between two decode steps (no swap can be under way then)."""
        order = CallOrder(fn)
        with self._cond:
            self._adapter_orders.append(order)
            self._cond.notify_all()
        return order.future

    def has_adapter(self, name: str) -> bool:
        """Whether requests may name adapter `name` now."""
        return name in self.runner.lora.adapters and name not in self._retiring

    def wake(self) -> None:
        """Let the worker notice cancelled requests promptly."""
        with self._cond:
            self._cond.notify_all()

    # --- the worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            order: SwapOrder | None = None
            admit: list[Job] = []
            with self._cond:
                while not (
                    self._stop
                    or self._pending
                    or self._rows
                    or self._orders
                    or self._adapter_orders
                ):
                    self._cond.wait()
                if self._stop:
                    return
                adapter_orders = list(self._adapter_orders)
                self._adapter_orders.clear()
                if self._orders:
                    head = self._orders[0]
                    # SYNC waits until everything accepted before the swap has finished.
                    if head.mode == "async" or not (self._pending or self._rows):
                        order = self._orders.popleft()
                if order is None:
                    while self._pending and len(self._rows) + len(admit) < self.max_batch:
                        admit.append(self._pending.popleft())
            # Adapter changes never touch the queue or the batch: applied first, outside the lock.
            for adapter_order in adapter_orders:
                self._apply_adapter_order(adapter_order)
            try:
                if order is not None:
                    self._swap(order)
                    continue
                for job in admit:
                    self._admit(job)
                if self._rows:
                    self._step()
            except Exception as exc:  # a bug must not kill the worker: fail what is running
                log.exception("engine worker step failed")
                self._fail_all(ApiError(500, "internal_error", f"generation failed: {exc}"))
            finally:
                self.metrics.running.set(len(self._rows))
                self.metrics.queued.set(len(self._pending))

    def _apply_adapter_order(self, order: AdapterOrder | CallOrder) -> None:
        if isinstance(order, CallOrder):
            try:
                order.future.set_result(order.fn())
            except Exception as exc:
                order.future.set_exception(exc)
            return
        try:
            if order.install is not None:
                self._retiring.discard(order.install.name)
                self.runner.lora.install(order.install)
            if order.remove is not None:
                self._retiring.add(order.remove)
                self._drop_retired()
        except Exception as exc:
            order.future.set_exception(exc)
            return
        order.future.set_result(None)

    def _drop_retired(self) -> None:
        in_use = {r.job.adapter for r in self._rows}
        for name in [n for n in self._retiring if n not in in_use]:
            self.runner.lora.remove(name)
            self._retiring.discard(name)

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            return
        if job.adapter is not None and not self.has_adapter(job.adapter):
            job.sink(
                ErrorEvent(
                    ApiError(
                        404,
                        "model_not_found",
                        f"adapter {job.adapter!r} was unloaded before the request started",
                        param="model",
                    )
                )
            )
            return
        served = self._served
        reason = job.constraint.unmet(served)
        if reason is not None:  # checked again here: a swap may have happened while queued
            job.sink(ErrorEvent(snapshot_unavailable(reason, served)))
            return
        echo_scores = job.echo and job.logprobs is not None
        wants_logprobs = job.prompt_logprobs is not None or echo_scores
        # Prompt logprobs need every prompt position's logits: a cached prefix would skip some.
        hit = None if wants_logprobs else self.sessions.lookup(job.session, job.prompt_ids)
        if job.session is not None and not wants_logprobs:
            (self.metrics.prefix_hits if hit else self.metrics.prefix_misses).inc()
        reuse = hit.length if hit else 0
        if reuse:
            self.metrics.prefix_tokens.inc(reuse)
        try:
            logits, kv = self.runner.prefill(
                job.prompt_ids,
                hit.kv if hit else None,
                reuse,
                every_position=wants_logprobs,
                adapter=job.adapter,
                routes=job.routes and echo_scores,
            )
            scored, echoed = None, None
            if job.prompt_logprobs is not None:
                scored = prompt_logprobs(
                    logits, job.prompt_ids, job.prompt_logprobs, self.codec.token_text
                )
            if echo_scores:
                assert job.logprobs is not None
                echoed = prompt_scores(logits, job.prompt_ids, job.logprobs, self.codec.piece)
                if job.routes:
                    echoed = self._routed(echoed, self.runner.last_routes, row=0, positions=True)
            if wants_logprobs:
                logits = logits[-1]
        except Exception as exc:
            log.exception("prefill failed")
            job.sink(ErrorEvent(ApiError(500, "internal_error", f"prefill failed: {exc}")))
            return
        self.metrics.tokens.labels("prompt").inc(len(job.prompt_ids))
        seed = job.sampling.seed
        gen = None
        if job.sampling.temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else secrets.randbits(63))
        row = _Row(
            job=job,
            start=served,
            last=served,
            assembler=TextAssembler(self.codec.decode, job.sampling.stop),
            gen=gen,
            cached_tokens=reuse,
            prompt_logprobs=scored,
            scores=[] if job.logprobs is not None else None,
            prompt_scores=echoed,
        )
        if job.echo:
            job.sink(PromptEvent(self.codec.decode(job.prompt_ids), echoed or [], served))
        self._batch.add(kv)
        self._rows.append(row)
        self._take_token(row, logits, served)
        self._retire()

    def _step(self) -> None:
        live = [i for i, r in enumerate(self._rows) if not r.job.cancelled]
        if len(live) != len(self._rows):
            self._rows = [self._rows[i] for i in live]
            self._batch.keep(live)
            if not self._rows:
                return
        served = self._served
        routes = any(r.job.routes for r in self._rows)
        logits = self.runner.decode(
            self._batch,
            [r.generated[-1] for r in self._rows],
            [r.job.adapter for r in self._rows],
            routes=routes,
        )
        self.steps += 1
        for i, row in enumerate(self._rows):
            if row.pending is not None:
                self._send(row, self.runner.last_routes, i)
            self._take_token(row, logits[i], served)
        self._retire()

    def _routed(
        self, scores: list[TokenScore], routes: torch.Tensor | None, *, row: int, positions: bool
    ) -> list[TokenScore]:
        """`scores` with the routes of `row` attached: `routes` is [layers, rows, n, top_k];
        with `positions`, score j takes position j's, else the one score takes position 0's."""
        fmt = self.runner.route_format
        if routes is None or fmt is None:
            return scores
        out = []
        for j, score in enumerate(scores):
            ids = routes[:, row, j if positions else 0, :].reshape(-1).tolist()
            out.append(replace(score, routes=encode_routes(ids, fmt)))
        return out

    def _send(self, row: _Row, routes: torch.Tensor | None, index: int) -> None:
        """Send the token held for its routes, with those of batch row `index` (None: the
        token was never fed, it ends the generation)."""
        event, row.pending = row.pending, None
        assert event is not None
        if routes is not None and event.score is not None:
            (score,) = self._routed([event.score], routes, row=index, positions=False)
            event = replace(event, score=score)
        if row.scores is not None and event.score is not None:
            row.scores.append(event.score)
        row.job.sink(event)

    def _take_token(self, row: _Row, logits: torch.Tensor, served: ServedSnapshot) -> None:
        params = row.job.sampling
        token = pick_token(logits, params, row.gen)
        score = None
        if row.job.logprobs is not None:
            score = token_score(logits, token, row.job.logprobs, self.codec.piece)
        row.generated.append(token)
        row.last = served
        text = row.assembler.add(row.generated)
        total = len(row.job.prompt_ids) + len(row.generated)
        eos = token in self.runner.info.eos_ids and not params.ignore_eos
        if row.assembler.stopped or eos:
            row.finish = "stop"
        elif len(row.generated) >= params.max_tokens or total >= self.runner.info.max_positions:
            row.finish = "length"
        self.metrics.tokens.labels("completion").inc()
        row.pending = TokenEvent(token, text, served, score)
        if not row.job.routes:
            self._send(row, None, 0)

    def _retire(self) -> None:
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            if row.job.cancelled:
                continue
            if row.finish is None:
                keep.append(i)
                continue
            if row.pending is not None:
                self._send(row, None, i)
            if row.job.session is not None:
                # The KV covers the prompt and every generated token but the last (never fed).
                fed = row.job.prompt_ids + row.generated[:-1]
                kv = self._batch.row(i)
                if len(fed) == kv[0][0].shape[2]:
                    self.sessions.store(row.job.session, fed, kv, self._served.identity)
            tail = row.assembler.finish()
            outcome = Outcome(
                text=row.assembler.text,
                token_ids=list(row.generated),
                finish_reason=row.finish,
                prompt_tokens=len(row.job.prompt_ids),
                start=row.start,
                end=row.last,
                cached_tokens=row.cached_tokens,
                prompt_ids=list(row.job.prompt_ids),
                prompt_logprobs=row.prompt_logprobs,
                scores=row.scores,
                prompt_scores=row.prompt_scores,
                prompt_text=self.codec.decode(row.job.prompt_ids) if row.job.echo else "",
                routes=self.runner.route_format if row.job.routes else None,
            )
            row.job.sink(DoneEvent(outcome, tail))
        if len(keep) != len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            self._batch.keep(keep)
            if self._retiring:
                self._drop_retired()

    def _swap(self, order: SwapOrder) -> None:
        started = time.perf_counter()
        try:
            if isinstance(order.staged, StagedPatch):
                order.staged.apply()
            else:
                self.runner.apply(order.staged)
        except Exception as exc:  # both roll back: the old weights still serve
            order.future.set_exception(exc)
            return
        self._served = order.target
        self.metrics.set_served(order.target.identity, order.target.sequence)
        self.sessions.apply_policy(order.policy)
        if order.policy == "all":
            stale = list(range(len(self._rows)))
        elif order.policy == "new_session":
            stale = [i for i, r in enumerate(self._rows) if r.job.session is None]
        else:
            stale = []
        if stale:
            try:
                self._recompute(set(stale))
            except Exception as exc:  # the swap itself succeeded; only the running rows fail
                log.exception("recomputing the running batch after a swap failed")
                self._fail_all(ApiError(500, "internal_error", f"generation failed: {exc}"))
        order.future.set_result(time.perf_counter() - started)

    def _recompute(self, stale: set[int]) -> None:
        """Rebuild the KV of rows in `stale` with the current weights (the others are kept)."""
        batch = BatchKV()
        for i, row in enumerate(self._rows):
            if i in stale:
                _, kv = self.runner.prefill(
                    row.job.prompt_ids + row.generated[:-1], adapter=row.job.adapter
                )
            else:
                kv = self._batch.row(i)
            batch.add(kv)
        self._batch = batch

    def _fail_all(self, error: ApiError) -> None:
        for row in self._rows:
            row.job.sink(ErrorEvent(error))
        self._rows = []
        self._batch = BatchKV()
