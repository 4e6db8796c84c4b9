"""Adapter for vLLM's OpenAI server in dev mode (`VLLM_SERVER_DEV_MODE=1`), checked on vLLM 0.32.

One load is: `POST /pause?mode=...&clear_cache=false`, `POST /collective_rpc` with
`{"method": "reload_weights", "kwargs": {"weights_path": PATH}}`, `POST /reset_prefix_cache`
(per the cache policy), `POST /update_weight_version` `{"new_version": IDENTITY}`,
`POST /resume`, then a confirmation: `GET /health`, `GET /weight_info` names the identity, and a
1-token completion works. The adapter records what it loaded only after all of that succeeded.

A sparse patch (`patch`) is confirmed without the completion: its values were verified against
the parent's and the result's checksums before the write, so `GET /health` and the weight
version confirm it, and the 1-token completion, a forward pass over the whole model, runs right
after as `probe` once the loader reported the patch served. The probe holds the adapter's lock:
the next load or patch waits for it before it stages or pauses (a probe answers for the patched
weights, never for weights written under it); after a failed probe patches are refused
(`probe_failed`) until a full load, which confirms with the completion again.

vLLM's `reload_weights` is in place and not transactional: when it fails part-way (a missing
folder, a tensor of the wrong shape) the model is left half-loaded and the next forward pass
crashes the engine. So the adapter refuses such folders before pausing (`check_loadable`), and
on a failure after the pause it reloads the previous folder (rollback), resumes, and confirms
with a completion; `EngineLoadError.serving` says whether the old weights are serving again.
See docs/engines.md for what was verified and how.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import ClassVar, Literal

from hotload.errors import EngineError, EngineLoadError, EngineUnavailableError, SnapshotError
from hotload_sidecar.engines import vllm_patch
from hotload_sidecar.engines.base import (
    EngineAdapter,
    EngineHealth,
    LoadRequest,
    LoadResult,
    PatchRefusedError,
    ServedSnapshot,
    StepTimer,
    Timeouts,
    WeightsReport,
    combine_reports,
    served_version,
)
from hotload_sidecar.engines.loadable import check_loadable

log = logging.getLogger("hotload_sidecar.engines.vllm")

#: vLLM's weight version before anyone sets one (`EngineCore._weight_version`).
DEFAULT_VERSION = "default"


class VLLMAdapter(EngineAdapter):
    """Loads snapshots into a running vLLM server through its dev-mode endpoints."""

    kind: ClassVar[str] = "vllm"
    sparse_loads: ClassVar[bool] = True
    deferred_probe: ClassVar[bool] = True

    def __init__(
        self,
        url: str,
        *,
        timeouts: Timeouts | None = None,
        sync_in_flight: Literal["wait", "abort"] = "wait",
        initial_path: str | None = None,
        check_path: bool = True,
        probe_prompt: list[int] | str | None = None,
    ) -> None:
        """`sync_in_flight`: what a SYNC load does with running requests (let them finish, or
        abort them); `initial_path`: the folder vLLM started with (default: what /v1/models
        reports); `check_path`: run `check_loadable` first (needs the weights volume mounted
        at the same path as in the engine); `probe_prompt`: the confirming completion's prompt.
        """
        super().__init__(url, timeouts=timeouts)
        if sync_in_flight not in ("wait", "abort"):
            raise ValueError(f"sync_in_flight must be 'wait' or 'abort', not {sync_in_flight!r}")
        self.sync_in_flight = sync_in_flight
        self.initial_path = initial_path
        self.check_path = check_path
        self.probe_prompt: list[int] | str = [0] if probe_prompt is None else probe_prompt
        self._served: ServedSnapshot | None = None
        self._loaded_path: str | None = None
        self._model: str | None = None
        self._root: str | None = None
        # Why the engine's state is unknown after a failed load (None: it is known).
        self._broken: str | None = None
        # Whether vLLM runs the hotload extension (None: not asked yet).
        self._extension: bool | None = None
        # Why the weights a patch wrote failed their liveness probe (None: they did not):
        # no patch goes on top of them until a full load confirms new weights.
        self._probe_failed: str | None = None

    def adopt(self, served: ServedSnapshot, path: str) -> None:
        """Record that the engine holds `served` from folder `path` (e.g. after a sidecar
        restart), so that a failed load can roll back to it and mismatches are refused."""
        self._served = served
        self._loaded_path = path

    # --- load ----------------------------------------------------------------------------------

    async def load(self, req: LoadRequest) -> LoadResult:
        """Pause, reload `req.path`, reset the prefix cache per policy, resume, and confirm."""
        async with self._lock:
            return await self._load(req)

    async def _load(self, req: LoadRequest) -> LoadResult:
        timer = StepTimer()
        version = await self._begin(timer)
        previous = self._previous_path(version)
        if self.check_path:
            try:
                await timer.run("check", asyncio.to_thread(check_loadable, req.path, previous))
            except SnapshotError as err:
                raise self.load_error(
                    f"refused before pausing: {err}", step="check", serving="previous"
                ) from err

        result = await self._swap(
            req,
            version,
            write=("reload", lambda: self._reload(req.path, step="reload")),
            undo=self._reload_back(previous),
            folder=req.path,
            timer=timer,
        )
        await self._weights_changed(req.path)
        return result

    async def _swap(
        self,
        req: LoadRequest,
        version: str | None,
        *,
        write: tuple[str, Callable[[], Awaitable[None]]],
        undo: Callable[[], Awaitable[None]],
        folder: str | None,
        timer: StepTimer,
        probe: bool = True,
    ) -> LoadResult:
        """Pause, `write` the new weights (a reload or a patch), reset the prefix cache per
        policy, set the weight version, resume and confirm (with the 1-token completion when
        `probe`); record that the engine serves `req` from `folder`. A failure once paused
        runs `undo` (if the write began), resumes and confirms the old weights
        (`EngineLoadError.serving` says how that went)."""
        pause_mode = "keep" if req.mode == "async" else self.sync_in_flight
        paused_at = time.monotonic()
        reset = False
        wrote = False
        step, do_write = write
        try:
            # The pause may have taken effect even if its answer never came: resume below.
            await timer.run("pause", self._pause(pause_mode))
            wrote = True  # from here a failure may leave the weights changed
            await timer.run(step, do_write())
            if req.cache_policy != "none":
                await timer.run("reset_prefix_cache", self._reset_prefix_cache())
                reset = True
            await timer.run("set_version", self._set_version(req.identity))
        except EngineError as err:
            serving = await self._recover(undo if wrote else None, version, timer=timer)
            failure: EngineError = err
            if isinstance(err, PatchRefusedError):
                # Refused once paused (a rank could not write): a failed load, not a refusal
                # before anything changed.
                failure = self.load_error(err.message, step=step, status=err.status)
            raise self._fail(failure, step=failure.step or step, serving=serving) from err

        try:
            await timer.run("resume", self._resume())
        except EngineError as err:
            # New weights are in but the engine may still be paused: not confirmed either way.
            self._broken = f"resume failed after the {step} of {req.identity!r}: {err}"
            raise self._fail(err, step="resume", serving="unknown") from err
        pause_seconds = time.monotonic() - paused_at

        try:
            await timer.run("confirm", self._confirm(req.identity, probe=probe))
        except EngineError as err:
            self._broken = f"could not confirm {req.identity!r} after its {step}: {err}"
            raise self._fail(err, step="confirm", serving="unknown") from err

        self._served = ServedSnapshot(req.identity, req.sequence)
        self._loaded_path = folder
        self._broken = None
        if probe:
            self._probe_failed = None
        return LoadResult(
            engine=self.kind,
            served=self._served,
            load_seconds=timer.elapsed(),
            pause_seconds=pause_seconds,
            steps=timer.steps,
            cache_reset=reset,
        )

    async def _begin(self, timer: StepTimer) -> str | None:
        """The weight version vLLM serves, and its model name (cached); a failure here changed
        nothing, so the engine serves what it served."""
        try:
            version: str | None = await timer.run("version", self._weight_version(step="prepare"))
            await timer.run("models", self._model_info(step="prepare"))
        except EngineError as err:
            raise self._fail(err, step=err.step or "prepare", serving="previous") from err
        return version

    def _previous_path(self, version: str | None) -> str | None:
        """The folder whose weights the engine holds now, when this adapter can know it."""
        if self._served is not None and version == self._served.identity:
            return self._loaded_path
        if version in (None, DEFAULT_VERSION):
            # Nobody reloaded since vLLM started: it holds its --model folder.
            return self.initial_path or self._root
        return None

    def _reload_back(self, previous: str | None) -> Callable[[], Awaitable[None]]:
        """Undo for a failed or finished `reload_weights`: load the previous folder again."""

        async def undo() -> None:
            if previous is None:
                raise EngineError(
                    "no previous folder to roll back to",
                    engine=self.kind,
                    url=self.url,
                    step="rollback",
                )
            await self._reload(previous, step="rollback")
            await self._weights_changed(previous)

        return undo

    async def _recover(
        self,
        undo: Callable[[], Awaitable[None]] | None,
        version: str | None,
        *,
        timer: StepTimer,
    ) -> str:
        """After a failure while paused: `undo` what changed the weights (None: nothing did),
        put the old weight version back, resume, and confirm with a completion."""
        undone = undo is None
        if undo is not None:
            # A failed or completed write leaves the model changed: put the old weights back
            # before any forward pass runs on a half-loaded model.
            try:
                await timer.run("rollback", undo())
                undone = True
                if version is not None:
                    await timer.run("rollback_version", self._set_version(version))
            except EngineError as err:
                log.error("vllm at %s: rollback failed: %s", self.url, err)
        try:
            await timer.run("resume", self._resume())
        except EngineError as err:
            log.error("vllm at %s: resume after a failed load failed: %s", self.url, err)
        if not undone:
            self._broken = "a failed load changed the weights and no rollback was possible"
            return "unknown"
        try:
            await timer.run("confirm", self._probe(step="confirm"))
        except EngineError as err:
            self._broken = f"the engine does not generate after a failed load: {err}"
            return "unknown"
        self._broken = None
        return "previous"

    def _fail(self, err: EngineError, *, step: str, serving: str) -> EngineLoadError:
        if isinstance(err, EngineLoadError):
            err.serving = serving
            return err
        return self.load_error(err.message, step=step, status=err.status, serving=serving)

    # --- sparse patches (hotload_patch's worker extension, see vllm_patch) ---------------------

    async def check_sparse(self) -> None:
        """Raise `PatchRefusedError` unless vLLM runs the hotload extension with weights a
        patch can follow (asked before the loader prepares a patch)."""
        try:
            await vllm_patch.describe(self)
        except PatchRefusedError as err:
            if err.reason == "engine_unsupported":
                self._extension = False
            raise
        self._extension = True

    async def patch(
        self, req: LoadRequest, parent: str, *, folder: str | None = None
    ) -> LoadResult:
        """Stage the patch file `req.path` on every rank while `parent` serves, verify it over
        all ranks, then pause, write, set the version, resume and confirm (vllm_patch's
        docstring). `folder`: where the full snapshot of `req.identity` will lie, for a later
        rollback to it."""
        async with self._lock:
            if self._probe_failed is not None:
                raise vllm_patch.refused(
                    self,
                    "probe_failed",
                    f"the weights served failed their liveness probe ({self._probe_failed}): "
                    "no patch goes on top of them until a full load",
                )
            timer = StepTimer()
            version = await self._begin(timer)
            if version != parent:
                raise vllm_patch.refused(
                    self,
                    "parent_not_served",
                    f"vLLM serves {version!r}, the patch applies to {parent!r}",
                )
            await timer.run("describe", vllm_patch.describe(self))
            self._extension = True
            try:
                await vllm_patch.stage(self, req, parent, timer)
            except (PatchRefusedError, EngineError) as err:
                await vllm_patch.discard(self)
                if isinstance(err, PatchRefusedError):
                    raise
                raise self._fail(err, step=err.step or "stage", serving="previous") from err
            return await self._swap(
                req,
                version,
                write=("apply", lambda: vllm_patch.apply(self)),
                undo=lambda: vllm_patch.rollback(self),
                folder=folder,
                timer=timer,
                probe=False,
            )

    async def probe(self, identity: str) -> None:
        """The 1-token completion a patch to `identity` was confirmed without (module doc);
        raises `EngineError` in vLLM's words, and patches are refused until a full load."""
        async with self._lock:
            if self._served is None or self._served.identity != identity:
                return  # a load since confirmed what the engine serves now
            try:
                await self._probe(step="probe")
            except EngineError as err:
                self._probe_failed = str(err)
                raise

    async def _weights_changed(self, folder: str) -> None:
        # Tried until vLLM answers that it has no extension: then never again.
        if self._extension is not False:
            self._extension = await vllm_patch.weights_changed(self, folder)

    async def weights_report(self) -> WeightsReport | None:
        """Every rank's scrub and counters (`hotload_state`), combined; None without the
        extension."""
        if self._extension is False:
            return None
        try:
            ranks = await vllm_patch.rpc(self, "hotload_state", step="state")
        except EngineError as err:
            if err.status is None:
                raise
            return None  # vLLM answered: it has no extension (or an older one)
        reports = [
            WeightsReport(r["scrub"], {k: int(v) for k, v in r["counters"].items()})
            for r in ranks
            if isinstance(r.get("scrub"), dict) and isinstance(r.get("counters"), dict)
        ]
        return combine_reports(reports) if len(reports) == len(ranks) else None

    async def parameter_checksums(self) -> dict[str, str]:
        """sha256 of every parameter as vLLM holds it, from the extension on every rank (rank
        0's names first; tensor-parallel ranks prefix theirs with `rank<N>/`)."""
        ranks = await vllm_patch.rpc(self, "hotload_parameter_checksums", step="checksums")
        out: dict[str, str] = {}
        for r in ranks:
            prefix = "" if not r.get("rank") else f"rank{r['rank']}/"
            out.update({prefix + k: str(v) for k, v in (r.get("checksums") or {}).items()})
        return out

    # --- the engine's calls --------------------------------------------------------------------

    async def _pause(self, mode: str) -> None:
        # clear_cache defaults to true in vLLM 0.32 (deprecated): the cache policy decides.
        answer = await self.http.request(
            "POST",
            "/pause",
            step="pause",
            params={"mode": mode, "clear_cache": "false"},
            timeout=self.timeouts.drain if mode == "wait" else self.timeouts.request,
        )
        if answer.status != 200:
            raise self.unexpected(answer, step="pause", what=f"POST /pause?mode={mode}")

    async def _reload(self, path: str, *, step: str) -> None:
        answer = await self.http.request(
            "POST",
            "/collective_rpc",
            step=step,
            json_body={"method": "reload_weights", "kwargs": {"weights_path": path}},
            timeout=self.timeouts.load,
        )
        if answer.status != 200:
            raise self.unexpected(answer, step=step, what=f"reload_weights from {path}")

    async def _reset_prefix_cache(self) -> None:
        # reset_running_requests=true: requests kept across an ASYNC pause hold KV blocks, and
        # vLLM refuses to reset while any block is held; preempted requests recompute their KV
        # with the new weights on resume, which is what dropping the cache means.
        answer = await self.http.request(
            "POST",
            "/reset_prefix_cache",
            step="reset_prefix_cache",
            params={"reset_running_requests": "true"},
        )
        ok = isinstance(answer.body, dict) and answer.body.get("success") is True
        if answer.status != 200 or not ok:
            raise self.unexpected(answer, step="reset_prefix_cache", what="prefix cache not reset")

    async def _set_version(self, version: str) -> None:
        answer = await self.http.request(
            "POST", "/update_weight_version", step="set_version", json_body={"new_version": version}
        )
        if answer.status != 200:
            raise self.unexpected(answer, step="set_version", what="POST /update_weight_version")

    async def _resume(self) -> None:
        answer = await self.http.request("POST", "/resume", step="resume")
        if answer.status != 200:
            raise self.unexpected(answer, step="resume", what="POST /resume")

    async def _weight_version(self, *, step: str) -> str | None:
        answer = await self.http.request("GET", "/weight_info", step=step)
        return self.weight_version(
            answer, step=step, what="GET /weight_info (is VLLM_SERVER_DEV_MODE=1 set?)"
        )

    async def _model_info(self, *, step: str) -> str:
        if self._model is None:
            answer = await self.http.request("GET", "/v1/models", step=step)
            data = answer.body.get("data") if isinstance(answer.body, dict) else None
            if answer.status != 200 or not isinstance(data, list) or not data:
                raise self.unexpected(answer, step=step, what="GET /v1/models")
            first = data[0] if isinstance(data[0], dict) else {}
            self._model = str(first.get("id"))
            root = first.get("root")
            self._root = root if isinstance(root, str) and root else None
        return self._model

    async def _probe(self, *, step: str) -> None:
        """One greedy token: proves the engine generates with whatever weights it holds."""
        model = await self._model_info(step=step)
        answer = await self.http.request(
            "POST",
            "/v1/completions",
            step=step,
            json_body={
                "model": model,
                "prompt": self.probe_prompt,
                "max_tokens": 1,
                "temperature": 0.0,
            },
            timeout=self.timeouts.probe,
        )
        choices = answer.body.get("choices") if isinstance(answer.body, dict) else None
        if answer.status != 200 or not isinstance(choices, list) or not choices:
            raise self.unexpected(answer, step=step, what="1-token completion")

    async def _confirm(self, identity: str, *, probe: bool = True) -> None:
        health = await self.http.request("GET", "/health", step="confirm")
        if health.status != 200:
            raise self.unexpected(health, step="confirm", what="GET /health")
        version = await self._weight_version(step="confirm")
        if version != identity:
            raise EngineError(
                f"weight_version is {version!r}, expected {identity!r}",
                engine=self.kind,
                url=self.url,
                step="confirm",
            )
        if probe:
            await self._probe(step="confirm")

    # --- current, health -----------------------------------------------------------------------

    async def current(self) -> ServedSnapshot | None:
        """What vLLM serves: its weight version, with the sequence when this adapter loaded it.

        None while it serves its start-up weights or after a load left its state unknown.
        """
        if self._broken is not None:
            return None
        version = await self._weight_version(step="current")
        return served_version(version, default=DEFAULT_VERSION, loaded=self._served)

    async def health(self) -> EngineHealth:
        """`GET /health` for liveness; ready when also not paused and no failed load is pending."""
        try:
            live = await self.http.request("GET", "/health", step="health")
            paused = await self.http.request("GET", "/is_paused", step="health")
        except EngineUnavailableError as err:
            return EngineHealth(self.kind, self.url, live=False, ready=False, detail=str(err))
        if live.status != 200:
            return EngineHealth(
                self.kind, self.url, live=False, ready=False, detail=f"/health: HTTP {live.status}"
            )
        is_paused = isinstance(paused.body, dict) and paused.body.get("is_paused") is True
        detail = self._broken or ("paused" if is_paused else "")
        return EngineHealth(
            self.kind,
            self.url,
            live=True,
            ready=not is_paused and self._broken is None,
            detail=detail,
        )
