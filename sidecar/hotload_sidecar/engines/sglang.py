"""Adapter for SGLang's HTTP server, written against its documented API (not run here).

SGLang cannot run on the project's CPU-only machines, so this adapter is tested against a stub
that implements the documented request and response shapes (docs/engines.md lists the sources).

One load is `POST /update_weights_from_disk` with `model_path`, `weight_version` (the snapshot
identity), `flush_cache` and `abort_all_requests`:
  * SYNC: that call alone. SGLang takes its model-update writer lock, so requests in flight
    finish on the old weights first (or are aborted, with `sync_in_flight="abort"`).
  * ASYNC: `POST /pause_generation` (`mode` "retract", or "in_place" when the cache is kept),
    the update, then `POST /continue_generation`: requests in flight continue on the new
    weights instead of holding the swap back. `continue_generation` is also sent after a
    failure so the engine never stays paused.
Then `GET /get_weight_version` must name the identity and `GET /health` (which generates one
token in SGLang) must answer 200. On a failed update SGLang reloads its previous weights itself
and answers 400 `{"success": false, "message": ...}`.

LoRA adapters (`--enable-lora`): `POST /load_lora_adapter` and `POST /unload_lora_adapter` with
`lora_name` and `lora_path`, answered `{"success": ..., "error_message": ...}`; requests name an
adapter as their `model` (shared with the other adapters: see `EngineAdapter.load_adapter`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar, Literal

from hotload.errors import EngineError, EngineUnavailableError, SnapshotError
from hotload_sidecar.engines.base import (
    SGLANG_LORA_ROUTES,
    EngineAdapter,
    EngineHealth,
    LoadRequest,
    LoadResult,
    LoraRoutes,
    ServedSnapshot,
    StepTimer,
    Timeouts,
    served_version,
)
from hotload_sidecar.engines.loadable import check_loadable

#: SGLang's weight version before anyone sets one (`ServerArgs.weight_version`).
DEFAULT_VERSION = "default"


class SGLangAdapter(EngineAdapter):
    """Loads snapshots into a running SGLang server with `/update_weights_from_disk`."""

    kind: ClassVar[str] = "sglang"
    lora_routes: ClassVar[LoraRoutes] = SGLANG_LORA_ROUTES
    no_sparse_loads: ClassVar[str] = (
        "SGLang's weight-update APIs take whole tensors, and a custom weight loader reports "
        "nothing back: every snapshot is loaded in full (docs/engines.md, 'SGLang: full "
        "reloads')"
    )

    def __init__(
        self,
        url: str,
        *,
        timeouts: Timeouts | None = None,
        sync_in_flight: Literal["wait", "abort"] = "wait",
        check_path: bool = True,
    ) -> None:
        """`sync_in_flight`: whether a SYNC load lets running requests finish or aborts them;
        `check_path`: refuse folders that are not full snapshots before calling the engine.
        """
        super().__init__(url, timeouts=timeouts)
        if sync_in_flight not in ("wait", "abort"):
            raise ValueError(f"sync_in_flight must be 'wait' or 'abort', not {sync_in_flight!r}")
        self.sync_in_flight = sync_in_flight
        self.check_path = check_path
        self._served: ServedSnapshot | None = None
        self._broken: str | None = None

    def update_body(self, req: LoadRequest) -> dict[str, Any]:
        """The JSON body of `/update_weights_from_disk` for `req`."""
        return {
            "model_path": req.path,
            "weight_version": req.identity,
            # SGLang's radix cache has no sessions: new_session drops it all, like "all".
            "flush_cache": req.cache_policy != "none",
            "abort_all_requests": req.mode == "sync" and self.sync_in_flight == "abort",
        }

    async def load(self, req: LoadRequest) -> LoadResult:
        """Update SGLang's weights from `req.path` and confirm its weight version and health."""
        async with self._lock:
            timer = StepTimer()
            if self.check_path:
                try:
                    await timer.run("check", asyncio.to_thread(check_loadable, req.path, None))
                except SnapshotError as err:
                    raise self.load_error(f"refused: {err}", step="check") from err
            body = self.update_body(req)
            paused_at = time.monotonic()
            paused = False
            try:
                if req.mode == "async":
                    # retract re-queues running requests so the cache can be flushed; in_place
                    # keeps their KV, which SGLang only allows when the cache is kept.
                    mode = "retract" if body["flush_cache"] else "in_place"
                    paused = True
                    await timer.run(
                        "pause", self._post("/pause_generation", {"mode": mode}, step="pause")
                    )
                await timer.run("update", self._update(body))
            except EngineError as err:
                serving = "previous"
                if isinstance(err, EngineUnavailableError) and err.step == "update":
                    # No answer: SGLang may still be loading; only its version can tell later.
                    serving = "unknown"
                    self._broken = f"no answer to the update of {req.identity!r}"
                if paused:
                    await self._continue(timer)
                raise self.load_error(
                    err.message, step=err.step or "update", status=err.status, serving=serving
                ) from err
            if paused:
                await self._continue(timer, required=True)
            pause_seconds = time.monotonic() - paused_at
            try:
                await timer.run("confirm", self._confirm(req.identity))
            except EngineError as err:
                self._broken = f"could not confirm {req.identity!r}: {err}"
                raise self.load_error(
                    err.message, step="confirm", status=err.status, serving="unknown"
                ) from err
            self._served = ServedSnapshot(req.identity, req.sequence)
            self._broken = None
            return LoadResult(
                engine=self.kind,
                served=self._served,
                load_seconds=timer.elapsed(),
                pause_seconds=pause_seconds,
                steps=timer.steps,
                cache_reset=bool(body["flush_cache"]),
            )

    async def _post(self, path: str, body: dict[str, Any], *, step: str) -> None:
        answer = await self.http.request("POST", path, step=step, json_body=body)
        if answer.status != 200:
            raise self.unexpected(answer, step=step, what=f"POST {path}")

    async def _update(self, body: dict[str, Any]) -> None:
        answer = await self.http.request(
            "POST",
            "/update_weights_from_disk",
            step="update",
            json_body=body,
            timeout=self.timeouts.load,
        )
        ok = isinstance(answer.body, dict) and answer.body.get("success") is True
        if answer.status != 200 or not ok:
            raise self.unexpected(
                answer, step="update", what=f"update_weights_from_disk({body['model_path']})"
            )

    async def _continue(self, timer: StepTimer, *, required: bool = False) -> None:
        try:
            await timer.run("continue", self._post("/continue_generation", {}, step="continue"))
        except EngineError as err:
            self._broken = f"continue_generation failed: {err}"
            if required:
                raise self.load_error(err.message, step="continue", serving="unknown") from err

    async def _weight_version(self, *, step: str) -> str | None:
        answer = await self.http.request("GET", "/get_weight_version", step=step)
        return self.weight_version(answer, step=step, what="GET /get_weight_version")

    async def _confirm(self, identity: str) -> None:
        version = await self._weight_version(step="confirm")
        if version != identity:
            raise EngineError(
                f"weight_version is {version!r}, expected {identity!r}",
                engine=self.kind,
                url=self.url,
                step="confirm",
            )
        # SGLang's /health runs a 1-token generation: it is the generation check.
        health = await self.http.request(
            "GET", "/health", step="confirm", timeout=self.timeouts.probe
        )
        if health.status != 200:
            raise self.unexpected(health, step="confirm", what="GET /health")

    async def current(self) -> ServedSnapshot | None:
        """What SGLang serves: its weight version, with the sequence when this adapter loaded it."""
        version = await self._weight_version(step="current")
        return served_version(version, default=DEFAULT_VERSION, loaded=self._served)

    async def health(self) -> EngineHealth:
        """`GET /health` (200 healthy, 503 starting or unhealthy)."""
        try:
            answer = await self.http.request(
                "GET", "/health", step="health", timeout=self.timeouts.probe
            )
        except EngineUnavailableError as err:
            return EngineHealth(self.kind, self.url, live=False, ready=False, detail=str(err))
        ok = answer.status == 200
        return EngineHealth(
            self.kind,
            self.url,
            live=ok,
            ready=ok and self._broken is None,
            detail=self._broken or ("" if ok else f"/health: HTTP {answer.status}"),
        )
