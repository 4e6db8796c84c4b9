"""The engine as the HTTP layer sees it: admission rules, hot loads and status.

`Engine` lives on the asyncio event loop. It owns the model runner (built in a thread at start),
the scheduler's worker thread, the metrics and the load state machine:

    idle --POST load--> staging (old weights serve) --> [SYNC: gate closed, 425s, drain]
         --> swap at a pause point --> idle (new identity)     any failure --> idle (old identity)

Staging (verify, check, read) runs in a thread while generation continues; only the swap itself
touches the model, on the worker thread, between two decode steps. A patch (`POST patch`, a
delta's changes to the snapshot served) goes through the same states: staging checks it against
the served weights (`patching`), the swap writes the changed elements in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from hotload._extras import needs_extra
from hotload.engine.boot import boot_forward, volume_deltas
from hotload.engine.config import EngineConfig
from hotload.engine.metrics import EngineMetrics
from hotload.engine.protocol import (
    RETRY_AFTER_SECONDS,
    ApiError,
    GenerationRequest,
    LoadRequest,
    ServedSnapshot,
    bad_request,
    check_constraint,
)
from hotload.engine.sessions import SessionCache
from hotload.engine.tokenizer import TextCodec
from hotload.snapshot.layout import validate_identity

# These import torch, which only the 'engine' extra installs.
with needs_extra("engine", "hotload's reference engine"):
    from hotload.engine.batch import KVCache
    from hotload.engine.lora import stage_adapter
    from hotload.engine.model import ModelRunner, StagedWeights
    from hotload.engine.patching import EnginePatches, StagedPatch
    from hotload.engine.scheduler import (
        AdapterOrder,
        ErrorEvent,
        Event,
        Job,
        Scheduler,
        SwapOrder,
    )
    from hotload.engine.staging import load_error, lower_priority, run_in_thread

log = logging.getLogger(__name__)

#: What a hot load stages: a whole snapshot, or a patch of the served one.
Staged = TypeVar("Staged", "StagedWeights", "StagedPatch")


class GenerationStream:
    """The asyncio end of one generation: events in order, and cancellation."""

    def __init__(self, job: Job, queue: asyncio.Queue[Event], scheduler: Scheduler) -> None:
        self.job = job
        self._queue = queue
        self._scheduler = scheduler

    async def next(self) -> Event:
        """The next event (token, done or error)."""
        return await self._queue.get()

    def cancel(self) -> None:
        """Stop generating (the client went away); harmless after the end."""
        if not self.job.cancelled:
            self.job.cancelled = True
            self._scheduler.wake()


class Engine:
    """One served model with hot loads; see the module docstring."""

    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None) -> None:
        validate_identity(config.initial_identity)
        self.config = config
        self.name = config.name
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.runner: ModelRunner | None = None
        self.patches: EnginePatches | None = None
        self.scheduler: Scheduler | None = None
        self.codec: TextCodec | None = None  # the event loop's tokenizer (the worker has its own)
        self.sessions: SessionCache[KVCache] = SessionCache(
            config.session_max, config.session_tokens
        )
        self.created = int(time.time())
        self.loading = False
        self.loading_identity: str | None = None
        self.loads = 0
        self.last_load_seconds: float | None = None
        self.last_pause_seconds: float | None = None
        self.last_error: str | None = None
        self.sync_gate: ServedSnapshot | None = None  # the target of a SYNC swap in progress
        self._start_task: asyncio.Task[None] | None = None
        #: What the engine does before it serves, after its weights loaded (booting forward).
        self.boot_note: str | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def begin(self) -> asyncio.Task[None]:
        """Start loading the initial weights in the background (idempotent); return the task."""
        if self._start_task is None:
            self._start_task = asyncio.get_running_loop().create_task(self._start())
        return self._start_task

    async def start(self) -> None:
        """Load the initial weights and start the worker; raises when the model cannot load."""
        await self.begin()

    async def _start(self) -> None:
        cfg = self.config
        self.loading = True
        self.loading_identity = cfg.initial_identity
        started = time.perf_counter()
        try:
            runner, _ = await asyncio.to_thread(
                ModelRunner.load,
                cfg.model_path,
                device=cfg.device,
                dtype=cfg.dtype,
                numerics=cfg.numerics,
            )
            worker_codec = await asyncio.to_thread(TextCodec, cfg.model_path)
            self.codec = await asyncio.to_thread(TextCodec, cfg.model_path)
        except BaseException as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.loading = False
            self.loading_identity = None
        served = ServedSnapshot(cfg.initial_identity, cfg.sequence)
        runner.lora.limit = cfg.max_adapters
        self.runner = runner
        self.patches = EnginePatches(
            runner,
            initializer=lambda: lower_priority(cfg.stage_nice),
            scrub_rate=cfg.scrub_bytes_per_second,
            scrub_period=cfg.scrub_period_seconds,
        )
        self.patches.loaded(cfg.model_path)
        if volume_deltas(cfg.model_path) is not None:
            # Not ready until it serves what the replica served: the deltas the loader kept on
            # the volume after the snapshot it booted (a restart must not go back in time).
            self.boot_note = f"applying the deltas on the volume after {served.identity}"
            try:
                forward = await asyncio.to_thread(
                    boot_forward, cfg.model_path, served.identity, self.patches
                )
            finally:
                self.boot_note = None
            if forward is not None:
                served = ServedSnapshot(forward, cfg.sequence)
        self.scheduler = Scheduler(
            runner,
            worker_codec,
            served,
            max_batch=cfg.max_batch,
            sessions=self.sessions,
            metrics=self.metrics,
        )
        self.scheduler.start()
        self.metrics.set_served(served.identity, served.sequence)
        self.last_load_seconds = time.perf_counter() - started
        fp8 = runner.fp8.weights
        held = f", {len(fp8)} block-FP8 weights computed dequantized in {self.config.dtype}"
        log.info(
            "serving %s@%s (sequence %d) on %s, %s numerics, batch-invariant: %s%s",
            self.name,
            served.identity,
            served.sequence,
            runner.device,
            runner.info.numerics,
            runner.info.batch_invariant,
            held if fp8 else "",
        )

    async def close(self) -> None:
        """Stop the worker (waiting requests get 503)."""
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(BaseException):
                await self._start_task
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
        if self.patches is not None:
            await asyncio.to_thread(self.patches.close)

    # --- state ---------------------------------------------------------------------------------

    @property
    def served(self) -> ServedSnapshot | None:
        """The snapshot serving now, or None before the initial weights are loaded."""
        return self.scheduler.served if self.scheduler is not None else None

    def ready(self) -> tuple[bool, str]:
        """Readiness and why not: weights loaded and no SYNC swap refusing requests."""
        if self.scheduler is None:
            if self.boot_note is not None:
                return False, self.boot_note
            return False, "the initial weights are not loaded yet"
        if self.sync_gate is not None:
            return False, f"a SYNC swap to {self.sync_gate.identity} is in progress"
        return True, "ready"

    def status(self) -> dict[str, Any]:
        """The `/hotload/v1/status` document."""
        served = self.served
        info = self.runner.info if self.runner is not None else None
        stats = self.sessions.stats
        return {
            "model": self.name,
            "identity": served.identity if served else None,
            "sequence": served.sequence if served else None,
            "loading": self.loading,
            "loading_identity": self.loading_identity,
            "loads": self.loads,
            "last_load_seconds": self.last_load_seconds,
            "last_pause_seconds": self.last_pause_seconds,
            "last_error": self.last_error,
            "ready": self.ready()[0],
            "sync_swap_in_progress": self.sync_gate is not None,
            "running": self.scheduler.running if self.scheduler else 0,
            "queued": self.scheduler.queued if self.scheduler else 0,
            "device": str(self.runner.device) if self.runner is not None else self.config.device,
            "dtype": self.config.dtype,
            "max_batch": self.config.max_batch,
            "numerics": info.numerics if info else None,
            "batch_invariant": info.batch_invariant if info else None,
            "adapters": self.adapter_names(),
            **(self.patches.report() if self.patches is not None else {}),
            "prefix_cache": {
                "sessions": len(self.sessions),
                "tokens": self.sessions.tokens,
                "hits": stats.hits,
                "misses": stats.misses,
                "reused_tokens": stats.reused_tokens,
                "dropped": stats.dropped,
                "evicted": stats.evicted,
            },
        }

    # --- generation ------------------------------------------------------------------------------

    def submit(self, req: GenerationRequest, session: str | None) -> GenerationStream:
        """Admit a generation or raise its HTTP error: 503 not ready, 425 SYNC swap, 409, 400."""
        scheduler, runner, codec = self.scheduler, self.runner, self.codec
        if scheduler is None or runner is None or codec is None:
            raise ApiError(
                503,
                "not_ready",
                "the engine is still loading its initial weights"
                + (f" ({self.boot_note})" if self.boot_note else ""),
                headers={"Retry-After": RETRY_AFTER_SECONDS},
            )
        if self.sync_gate is not None:
            served = scheduler.served
            raise ApiError(
                425,
                "swap_in_progress",
                f"a SYNC swap from {served.identity} (sequence {served.sequence}) to "
                f"{self.sync_gate.identity} (sequence {self.sync_gate.sequence}) is in progress; "
                "retry shortly",
                headers={"Retry-After": RETRY_AFTER_SECONDS},
                extra={"target_identity": self.sync_gate.identity},
            )
        if req.adapter is not None and not scheduler.has_adapter(req.adapter):
            raise self.unknown_model(str(req.adapter))
        check_constraint(req.constraint, scheduler.served)
        if req.routes and runner.route_format is None:
            why = runner.routes_refused or (
                f"{runner.info.model_type} is not a mixture of experts: it has no router"
            )
            raise bad_request(f"include_routing_matrix: {why}", "include_routing_matrix")
        prompt_ids = codec.prompt_ids(req, runner.info.vocab_size)
        limit = runner.info.max_positions
        max_tokens = req.sampling.max_tokens
        if len(prompt_ids) >= limit:
            raise bad_request(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit}",
                "prompt" if req.kind == "completion" else "messages",
            )
        if len(prompt_ids) + max_tokens > limit:
            if req.max_tokens_given:
                raise bad_request(
                    f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
                    f"the model's context of {limit} tokens",
                    "max_tokens",
                )
            max_tokens = limit - len(prompt_ids)
        sampling = req.sampling
        if max_tokens != sampling.max_tokens:
            from dataclasses import replace

            sampling = replace(sampling, max_tokens=max_tokens)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            # Called on the worker thread; the loop may be gone when a client vanished at exit.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, event)

        if session is not None and req.adapter is not None:
            # A cached prefix is only valid under the adapter that computed it.
            session = f"{req.adapter}\x1f{session}"
        job = Job(
            prompt_ids=prompt_ids,
            sampling=sampling,
            sink=sink,
            session=session,
            constraint=req.constraint,
            prompt_logprobs=req.prompt_logprobs,
            adapter=req.adapter,
            logprobs=req.logprobs,
            echo=req.echo,
            routes=req.routes,
        )
        scheduler.submit(job)
        return GenerationStream(job, queue, scheduler)

    # --- LoRA adapters ---------------------------------------------------------------------------

    def adapter_names(self) -> list[str]:
        """The LoRA adapters requests may name as their model now."""
        scheduler = self.scheduler
        if scheduler is None:
            return []
        return [n for n in scheduler.runner.lora.names() if scheduler.has_adapter(n)]

    def unknown_model(self, model: str) -> ApiError:
        """The 404 for a request naming a model this engine does not serve."""
        loaded = self.adapter_names()
        adapters = f"; adapters: {', '.join(loaded)}" if loaded else ""
        return ApiError(
            404,
            "model_not_found",
            f"model {model!r} is not served here; this engine serves {self.name!r} (optionally "
            f"{self.name}@<identity>){adapters}",
            param="model",
        )

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Stage the LoRA adapter folder `path` and install it as model `name` between two
        decode steps; on failure raise `ApiError` (nothing changes)."""
        scheduler, runner = self.scheduler, self.runner
        if scheduler is None or runner is None:
            raise ApiError(503, "not_ready", "the engine is still loading its initial weights")
        if name == self.name or "@" in name or not name:
            raise bad_request(f"lora_name {name!r} is not a valid adapter name", "lora_name")
        if scheduler.has_adapter(name):
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if self.config.max_adapters <= 0:
            raise bad_request("this engine serves no adapters (--max-adapters 0)", "lora_name")
        started = time.perf_counter()
        try:
            staged = await run_in_thread(
                lambda: stage_adapter(runner.model, name, path), nice=self.config.stage_nice
            )
            await asyncio.wrap_future(scheduler.adapters(AdapterOrder(install=staged)))
        except Exception as exc:
            err = load_error(exc)
            self.metrics.load_failures.labels(err.type).inc()
            log.warning("loading adapter %s from %s failed: %s", name, path, err.message)
            raise err from exc
        seconds = time.perf_counter() - started
        log.info("loaded LoRA adapter %s (rank %d) in %.3fs", name, staged.rank, seconds)
        return {"lora_name": name, "lora_path": path, "rank": staged.rank, "seconds": seconds}

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (requests already running on it finish first)."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.has_adapter(name):
            raise ApiError(
                404,
                "NotFoundError",
                f"The lora adapter '{name}' cannot be found.",
                param="lora_name",
            )
        await asyncio.wrap_future(scheduler.adapters(AdapterOrder(remove=name)))
        log.info("unloaded LoRA adapter %s", name)

    # --- hot loads -----------------------------------------------------------------------------

    async def load(self, req: LoadRequest) -> dict[str, Any]:
        """Stage and swap in `req`'s snapshot; on failure raise `ApiError` (old weights serve)."""
        runner = self._idle_runner()
        staged = await self._swap_in(req, lambda: runner.stage(req.path))
        if self.patches is not None:  # the next patch's parent: checksummed while it serves
            self.patches.loaded(req.path)
        return {**self._loaded(req), "stage_seconds": staged.seconds}

    async def patch(self, req: LoadRequest) -> dict[str, Any]:
        """Write the patch file `req.path` (made from a delta of the snapshot served now,
        `req.parent`) into the served weights in place and serve `req.identity`; on failure
        raise `ApiError` (the old weights serve, none of them changed)."""
        self._idle_runner()
        served, patches, parent = self.served, self.patches, req.parent
        assert patches is not None and parent is not None
        if served is None or served.identity != parent:
            raise ApiError(
                409,
                "parent_not_served",
                f"the patch applies to {req.parent}, but this engine serves "
                f"{served.identity if served else 'nothing yet'}: load the full snapshot",
            )
        staged = await self._swap_in(
            req, lambda: patches.stage(req.path, identity=req.identity, parent=parent)
        )
        return {
            **self._loaded(req),
            "stage_seconds": staged.seconds,
            "patched_elements": staged.changed,
            "patch_bytes": staged.nbytes,
        }

    async def weight_checksums(self) -> dict[str, Any]:
        """sha256 of every weight as the engine holds it, read between two decode steps."""
        scheduler, patches = self.scheduler, self.patches
        if scheduler is None or patches is None:
            raise ApiError(503, "not_ready", "the engine is still loading its initial weights")

        def read() -> tuple[Any, Any]:
            # The identity with the digests, in the same pause: read after the await, a swap
            # between the two could name snapshot N beside N-1's weights (the soak saw it).
            return patches.checksums(), scheduler.served

        digests, served = cast(
            "tuple[Any, Any]", await asyncio.wrap_future(scheduler.between_steps(read))
        )
        return {
            "identity": served.identity,
            "sequence": served.sequence,
            "dtype": self.config.dtype,
            "algorithm": "sha256",
            "checksums": digests,
        }

    def _idle_runner(self) -> ModelRunner:
        """The runner, when no load is under way (else 409)."""
        if self.loading or self.scheduler is None or self.runner is None:
            what = self.loading_identity or "the initial weights"
            raise ApiError(
                409,
                "load_in_progress",
                f"a load of {what} is in progress; retry after it finishes",
                headers={"Retry-After": RETRY_AFTER_SECONDS},
            )
        return self.runner

    async def _swap_in(self, req: LoadRequest, stage: Callable[[], Staged]) -> Staged:
        """Stage in a thread (old weights serve), then swap at a pause point (SYNC: once
        drained); record the outcome. Any failure is an `ApiError` and changes nothing."""
        scheduler = self.scheduler
        assert scheduler is not None
        self.loading = True
        self.loading_identity = req.identity
        started = time.perf_counter()
        target = ServedSnapshot(req.identity, req.sequence)
        what = "patch" if req.parent is not None else "load"
        try:
            try:
                staged = await run_in_thread(stage, nice=self.config.stage_nice)
            except Exception as exc:
                raise load_error(exc) from exc
            staged_at = time.perf_counter()
            if req.mode == "sync":
                self.sync_gate = target
            try:
                order = SwapOrder(staged, target, req.mode, req.cache_policy)
                worker_pause = await asyncio.wrap_future(scheduler.swap(order))
            except Exception as exc:
                raise load_error(exc) from exc
            finally:
                self.sync_gate = None
            done = time.perf_counter()
            pause = done - staged_at if req.mode == "sync" else worker_pause
        except ApiError as err:
            self.last_error = f"{req.path}: {err.type}: {err.message}"
            self.metrics.load_failures.labels(err.type).inc()
            log.warning("%s of %s failed (%s): %s", what, req.identity, err.type, err.message)
            raise
        finally:
            self.loading = False
            self.loading_identity = None
        self.loads += 1
        self.last_error = None
        self.last_load_seconds = done - started
        self.last_pause_seconds = pause
        self.metrics.load_seconds.observe(self.last_load_seconds)
        self.metrics.swap_pause.observe(pause)
        log.info(
            "now serving %s (sequence %d): %s %s, load %.3fs, pause %.4fs, cache policy %s",
            req.identity,
            req.sequence,
            req.mode,
            what,
            self.last_load_seconds,
            pause,
            req.cache_policy,
        )
        return staged

    def _loaded(self, req: LoadRequest) -> dict[str, Any]:
        return {
            "identity": req.identity,
            "sequence": req.sequence,
            "load_seconds": self.last_load_seconds,
            "pause_seconds": self.last_pause_seconds,
            "mode": req.mode,
            "cache_policy": req.cache_policy,
        }


__all__ = ["Engine", "EngineConfig", "ErrorEvent", "GenerationStream"]
