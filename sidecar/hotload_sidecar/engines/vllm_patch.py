"""Sparse hot loads into vLLM through the hotload_patch worker extension (`hotload_patch.vllm`).

vLLM must run with `--worker-extension-cls hotload_patch.vllm.HotloadWorkerExtension` (the
operator's pods do); its dev-mode `POST /collective_rpc` then calls the extension's methods on
every rank. One patch, while the old weights serve:

1. `hotload_describe` on every rank: the extension is there, speaks our protocol, and the
   model's weights are in checkpoint layout (not quantised, not repacked);
2. `hotload_stage` (each rank places, converts and checks the patch in a background thread),
   then `hotload_poll` until every rank is done: each returns its region sums of the served
   weights and how the patch moves them;
3. here, over all ranks: the served weights are the patch's parent and the patch gives the
   delta's result (`hotload_patch.staging.verify`, against the patch file's checksums).

Then the pause: `POST /pause`, `hotload_apply` on every rank, the prefix cache per policy, the
weight version, `POST /resume`, and the same confirmation as a full load. A refusal before the
pause is a `PatchRefusedError` with the extension's reason and nothing changed; a failure after
the writes puts the old values back on every rank (`hotload_rollback`) before resuming.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from hotload.api.names import VLLM_WORKER_EXTENSION
from hotload.errors import EngineError
from hotload_patch import PROTOCOL, PatchError
from hotload_patch.format import PatchFile
from hotload_patch.sums import RegionSum
from hotload_patch.verify import checks_of, verify
from hotload_sidecar.engines.base import EngineAdapter, LoadRequest, PatchRefusedError, StepTimer

#: How often the adapter asks whether the ranks finished staging.
POLL_SECONDS = 0.05


async def rpc(
    adapter: EngineAdapter,
    method: str,
    *,
    step: str,
    args: tuple[str, ...] = (),
    kwargs: dict[str, str] | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """Call `method` on every rank through `/collective_rpc`; one JSON object per rank."""
    answer = await adapter.http.request(
        "POST",
        "/collective_rpc",
        step=step,
        json_body={"method": method, "args": list(args), "kwargs": kwargs or {}},
        timeout=timeout,
    )
    body = answer.body
    results = body.get("results") if isinstance(body, dict) else None
    if answer.status != 200 or not isinstance(results, list) or not results:
        raise adapter.unexpected(answer, step=step, what=f"collective_rpc {method}")
    if not all(isinstance(r, dict) for r in results):
        raise adapter.unexpected(answer, step=step, what=f"collective_rpc {method} (not objects)")
    return results


def refused(adapter: EngineAdapter, reason: str, message: str) -> PatchRefusedError:
    """A `PatchRefusedError` of this engine (nothing changed)."""
    return PatchRefusedError(
        message, reason=reason, engine=adapter.kind, url=adapter.url, status=None
    )


def _raise_first_error(adapter: EngineAdapter, results: list[dict[str, Any]], what: str) -> None:
    for r in results:
        err = r.get("error")
        if isinstance(err, dict):
            rank = r.get("rank", "?")
            raise refused(
                adapter,
                str(err.get("reason") or "refused"),
                f"{what} refused on rank {rank}: {err.get('message')}",
            )


async def describe(adapter: EngineAdapter) -> list[dict[str, Any]]:
    """Every rank's extension answer; a `PatchRefusedError` when vLLM has no hotload extension,
    another protocol, or weights a patch cannot follow."""
    try:
        ranks = await rpc(adapter, "hotload_describe", step="describe")
    except EngineError as err:
        if err.status is None:
            raise
        raise refused(
            adapter,
            "engine_unsupported",
            f"vLLM answered no hotload extension (start it with --worker-extension-cls "
            f"{VLLM_WORKER_EXTENSION}, with hotload_patch on its PYTHONPATH): {err.message}",
        ) from err
    for r in ranks:
        if r.get("protocol") != PROTOCOL:
            raise refused(
                adapter,
                "engine_unsupported",
                f"rank {r.get('rank')} runs hotload_patch protocol {r.get('protocol')!r}, this "
                f"loader speaks {PROTOCOL}: the copy on the engine's PYTHONPATH is stale",
            )
        problems = r.get("problems")
        if problems:
            raise refused(
                adapter, "kernel_format", f"rank {r.get('rank')}: " + "; ".join(map(str, problems))
            )
    return ranks


async def stage(adapter: EngineAdapter, req: LoadRequest, parent: str, timer: StepTimer) -> None:
    """Stage `req.path` on every rank and verify it over all of them (old weights serve)."""
    began = time.monotonic()
    args = (req.path, req.identity, parent)
    started = await rpc(adapter, "hotload_stage", step="stage", args=args)
    _raise_first_error(adapter, started, "staging")
    deadline = time.monotonic() + adapter.timeouts.load
    while True:
        ranks = await rpc(adapter, "hotload_poll", step="stage")
        failed = [r for r in ranks if "failed" in (r.get("served"), r.get("staging"))]
        if failed:
            errors = [{"rank": r.get("rank"), "error": r.get("error")} for r in failed]
            _raise_first_error(adapter, errors, "staging")
        if all(r.get("served") == "ready" and r.get("staging") == "ready" for r in ranks):
            break
        if any(r.get("staging") == "none" for r in ranks):
            raise refused(adapter, "not_staged", "a rank dropped the staged patch")
        if time.monotonic() > deadline:
            raise refused(adapter, "not_staged", f"staging took over {adapter.timeouts.load:g} s")
        await asyncio.sleep(POLL_SECONDS)
    timer.steps["stage"] = round(time.monotonic() - began, 6)
    served = [RegionSum.from_json(s) for r in ranks for s in r.get("served_sums", [])]
    deltas = [RegionSum.from_json(d) for r in ranks for d in r.get("deltas", [])]
    try:
        await timer.run("verify", asyncio.to_thread(_verify, req.path, served, deltas))
    except PatchError as exc:
        raise refused(adapter, exc.reason, f"verifying the patch over all ranks: {exc}") from exc


def _verify(path: str, served: list[RegionSum], deltas: list[RegionSum]) -> None:
    with PatchFile(path, runs=False) as pf:
        checks = checks_of(pf.tensors)
    verify(checks, served, deltas)


async def discard(adapter: EngineAdapter) -> None:
    """Drop what the ranks staged (best effort: a patch is staged again from scratch)."""
    with contextlib.suppress(EngineError):
        await rpc(adapter, "hotload_discard", step="discard")


async def apply(adapter: EngineAdapter) -> None:
    """Write the staged patch on every rank; raise when any rank failed (a rank that failed put
    its own old values back; the caller rolls the others back)."""
    results = await rpc(adapter, "hotload_apply", step="apply", timeout=adapter.timeouts.load)
    _raise_first_error(adapter, results, "writing the patch")


async def rollback(adapter: EngineAdapter) -> None:
    """Put back what the last apply replaced, on every rank that wrote; raise `EngineError`
    when a rank could not (its weights are then not known)."""
    results = await rpc(adapter, "hotload_rollback", step="rollback", timeout=adapter.timeouts.load)
    for r in results:
        err = r.get("error")
        if isinstance(err, dict):
            raise EngineError(
                f"rank {r.get('rank', '?')} could not put its old values back: "
                f"{err.get('message')}",
                engine=adapter.kind,
                url=adapter.url,
                step="rollback",
            )


async def weights_changed(adapter: EngineAdapter, folder: str) -> bool:
    """After a full load from `folder`: the ranks checksum the new weights in the background,
    so that the next patch finds them ready. Best effort: False when vLLM has no extension."""
    try:
        await rpc(
            adapter, "hotload_weights_changed", step="weights_changed", kwargs={"folder": folder}
        )
    except EngineError as err:
        return err.status is None  # no answer at all says nothing about the extension
    return True
