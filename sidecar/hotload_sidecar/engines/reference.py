"""Adapter for hotload's reference engine (`hotload.engine`): one hot-load endpoint does it all.

Contract: `POST /hotload/v1/load` with the load request as JSON answers 200 with the served
identity, sequence, `load_seconds` and `pause_seconds` once the new weights serve; 400/422/500
with `{"error": {"type", "message"}}` when it refused or failed (the old weights keep serving);
409 `load_in_progress` while another load runs. `POST /hotload/v1/patch` takes the same body
plus `parent` and a patch file as `path` (a sparse hot load, docs/engines.md); 409
`parent_not_served` and 422 mean it refused the patch and nothing changed.
`GET /hotload/v1/status` names the served snapshot; `GET /health` is liveness, `GET /ready`
readiness.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hotload.errors import EngineBusyError, EngineError, EngineUnavailableError
from hotload_sidecar.engines.base import (
    Answer,
    EngineAdapter,
    EngineHealth,
    LoadRequest,
    LoadResult,
    PatchRefusedError,
    ServedSnapshot,
    StepTimer,
    Timeouts,
    WeightsReport,
)

LOAD_PATH = "/hotload/v1/load"
PATCH_PATH = "/hotload/v1/patch"
STATUS_PATH = "/hotload/v1/status"


class ReferenceAdapter(EngineAdapter):
    """Loads snapshots into the reference engine through its hot-load endpoint."""

    kind: ClassVar[str] = "reference"
    sparse_loads: ClassVar[bool] = True

    def __init__(self, url: str, *, timeouts: Timeouts | None = None) -> None:
        super().__init__(url, timeouts=timeouts)

    async def load(self, req: LoadRequest) -> LoadResult:
        """Ask the engine to load `req` and confirm through its status that it serves it."""
        return await self._hot_load(LOAD_PATH, req, None)

    async def patch(
        self, req: LoadRequest, parent: str, *, folder: str | None = None
    ) -> LoadResult:
        """`POST /hotload/v1/patch`: the engine checks the patch against the weights it serves
        (`parent`), writes the changed elements in place at a pause point, and serves
        `req.identity`; confirmed through its status like a load."""
        return await self._hot_load(PATCH_PATH, req, parent)

    async def _hot_load(self, route: str, req: LoadRequest, parent: str | None) -> LoadResult:
        step = "patch" if parent is not None else "load"
        async with self._lock:
            timer = StepTimer()
            body: dict[str, Any] = {
                "path": req.path,
                "identity": req.identity,
                "sequence": req.sequence,
                "mode": req.mode,
                "cache_policy": req.cache_policy,
            }
            if parent is not None:
                body["parent"] = parent
            try:
                answer: Answer = await timer.run(
                    step,
                    self.http.request(
                        "POST", route, step=step, json_body=body, timeout=self.timeouts.load
                    ),
                )
            except EngineUnavailableError as err:
                # No answer: the load may or may not have happened; only a later status can say.
                raise self.load_error(err.message, step=step, serving="unknown") from err
            if parent is not None:
                self._check_patch_answer(answer)
            if answer.status == 409:
                raise EngineBusyError(
                    f"another load is in progress: {answer.error_message()}",
                    engine=self.kind,
                    url=self.url,
                    step=step,
                    status=409,
                )
            if answer.status in (400, 422, 500):
                # The contract: a refused or failed load leaves the old weights serving.
                raise self.load_error(
                    f"{step} of {req.identity!r} refused (HTTP {answer.status}): "
                    f"{answer.error_message()}",
                    step=step,
                    status=answer.status,
                )
            if answer.status != 200 or not isinstance(answer.body, dict):
                raise self.load_error(
                    f"unexpected answer HTTP {answer.status}: {answer.error_message()}",
                    step=step,
                    status=answer.status,
                    serving="unknown",
                )
            reported = answer.body
            if reported.get("identity") != req.identity or reported.get("sequence") != req.sequence:
                raise self.load_error(
                    f"engine answered {reported.get('identity')!r}#{reported.get('sequence')} "
                    f"to a {step} of {req.identity!r}#{req.sequence}",
                    step=step,
                    serving="unknown",
                )
            # What the engine measured inside its call (the call's own step times it whole).
            for inside in ("stage", "pause"):
                seconds = reported.get(f"{inside}_seconds")
                if isinstance(seconds, (int, float)):
                    timer.steps[f"{step}.{inside}"] = round(float(seconds), 6)
            served = await timer.run("confirm", self._confirm(req))
            return LoadResult(
                engine=self.kind,
                served=served,
                load_seconds=timer.elapsed(),
                pause_seconds=_seconds(reported.get("pause_seconds")),
                steps=timer.steps,
                cache_reset=req.cache_policy != "none",
            )

    def _check_patch_answer(self, answer: Answer) -> None:
        """Raise `PatchRefusedError` for the answers that mean "patch refused, nothing changed"
        (an engine without the route answers 404 or 405; 409 `parent_not_served`; 422)."""
        kind = ""
        if isinstance(answer.body, dict) and isinstance(answer.body.get("error"), dict):
            kind = str(answer.body["error"].get("type") or "")
        if answer.status in (404, 405):
            kind = "engine_unsupported"
        elif not (answer.status == 422 or (answer.status == 409 and kind == "parent_not_served")):
            return
        raise PatchRefusedError(
            f"patch refused (HTTP {answer.status}): {answer.error_message()}",
            reason=kind or "refused",
            engine=self.kind,
            url=self.url,
            status=answer.status,
        )

    async def _confirm(self, req: LoadRequest) -> ServedSnapshot:
        try:
            status = await self._status(step="confirm")
        except EngineError as err:
            raise self.load_error(
                err.message, step="confirm", status=err.status, serving="unknown"
            ) from err
        if status.get("identity") != req.identity or status.get("sequence") != req.sequence:
            raise self.load_error(
                f"status shows {status.get('identity')!r}#{status.get('sequence')} after "
                f"loading {req.identity!r}#{req.sequence}",
                step="confirm",
                serving="unknown",
            )
        return ServedSnapshot(req.identity, req.sequence)

    async def _status(self, *, step: str) -> dict[str, Any]:
        answer = await self.http.request("GET", STATUS_PATH, step=step)
        if answer.status != 200 or not isinstance(answer.body, dict):
            raise self.unexpected(answer, step=step, what=f"GET {STATUS_PATH}")
        return answer.body

    async def weights_report(self) -> WeightsReport | None:
        """The scrub and counters the engine's status shows (None: an engine without them)."""
        status = await self._status(step="status")
        scrub, counters = status.get("scrub"), status.get("counters")
        if not isinstance(scrub, dict) or not isinstance(counters, dict):
            return None
        return WeightsReport(scrub, {k: int(v) for k, v in counters.items()})

    async def current(self) -> ServedSnapshot | None:
        """The snapshot the engine's status names (None before its first hot-load)."""
        status = await self._status(step="status")
        identity, sequence = status.get("identity"), status.get("sequence")
        if not isinstance(identity, str) or not identity:
            return None
        return ServedSnapshot(identity, sequence if isinstance(sequence, int) else None)

    async def health(self) -> EngineHealth:
        """`GET /health` for liveness and `GET /ready` for readiness."""
        try:
            live = await self.http.request("GET", "/health", step="health")
            ready = await self.http.request("GET", "/ready", step="ready")
        except EngineUnavailableError as err:
            return EngineHealth(self.kind, self.url, live=False, ready=False, detail=str(err))
        detail = "" if ready.status == 200 else f"/ready: HTTP {ready.status}"
        if live.status != 200:
            detail = f"/health: HTTP {live.status}"
        return EngineHealth(
            self.kind,
            self.url,
            live=live.status == 200,
            ready=live.status == 200 and ready.status == 200,
            detail=detail,
        )


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
