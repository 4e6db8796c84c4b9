"""The engine adapter interface: load a snapshot into a running engine, say what it serves.

Every adapter talks HTTP (aiohttp) to one engine at `url`. `load` returns only after the engine
serves the new weights and that was confirmed; on any failure it raises `EngineLoadError`, whose
`serving` attribute says whether the old weights were confirmed to keep serving. A verified
patch may be confirmed without a forward pass (`deferred_probe`): the caller reports it served
and runs `probe` right after, off the critical path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Final, Literal, get_args

import aiohttp

from hotload.errors import EngineError, EngineLoadError, EngineUnavailableError

log = logging.getLogger("hotload_sidecar.engines")

Mode = Literal["async", "sync"]
CachePolicy = Literal["all", "none", "new_session"]
EngineKind = Literal["reference", "vllm", "sglang"]
MODES: Final[tuple[str, ...]] = get_args(Mode)
CACHE_POLICIES: Final[tuple[str, ...]] = get_args(CachePolicy)
ENGINE_KINDS: Final[tuple[str, ...]] = get_args(EngineKind)


@dataclass(frozen=True)
class LoadRequest:
    """Load the snapshot folder `path` (its ledger `identity` and `sequence`) into the engine.

    `mode` is the deployment's transition mode and `cache_policy` the snapshot's prompt-cache
    policy; each adapter maps them to its engine's calls (see docs/engines.md).
    """

    path: str
    identity: str
    sequence: int
    mode: Mode = "async"
    cache_policy: CachePolicy = "all"

    def __post_init__(self) -> None:
        from hotload.snapshot import validate_identity

        if not self.path:
            raise ValueError("LoadRequest.path must not be empty")
        validate_identity(self.identity)
        if isinstance(self.sequence, bool) or not isinstance(self.sequence, int):
            raise ValueError(f"LoadRequest.sequence must be an int, not {self.sequence!r}")
        if self.sequence < 0:
            raise ValueError(f"LoadRequest.sequence must be >= 0, not {self.sequence}")
        if self.mode not in MODES:
            raise ValueError(f"LoadRequest.mode must be one of {MODES}, not {self.mode!r}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(
                f"LoadRequest.cache_policy must be one of {CACHE_POLICIES}, "
                f"not {self.cache_policy!r}"
            )


class PatchRefusedError(EngineLoadError):
    """The engine did not take a sparse patch and serves its previous weights, unchanged;
    `reason` says why in one word (`engine_unsupported`, `parent_not_served`,
    `parent_mismatch`, `checksum_mismatch`, ...): load the full snapshot instead."""

    def __init__(self, message: str, *, reason: str, engine: str, url: str, status: int | None):
        super().__init__(message, engine=engine, url=url, step="patch", status=status)
        self.reason = reason


@dataclass(frozen=True)
class ServedSnapshot:
    """The snapshot an engine serves.

    `sequence` is None when the engine names an identity this adapter did not load itself
    (e.g. after a sidecar restart); the caller resolves it from the ledger.
    """

    identity: str
    sequence: int | None


@dataclass(frozen=True)
class LoadResult:
    """What a successful load did: the snapshot now served and how long it took.

    `load_seconds` is the adapter's end-to-end time (first request to confirmation);
    `pause_seconds` is how long the engine did not schedule generation (for the reference
    engine, as it reports it); `steps` times each engine call in order.
    """

    engine: str
    served: ServedSnapshot
    load_seconds: float
    pause_seconds: float
    steps: dict[str, float] = field(default_factory=dict)
    cache_reset: bool = False


@dataclass(frozen=True)
class WeightsReport:
    """What an engine says of the weights it serves (engines with sparse loads): its scrub
    (`hotload_patch.scrub`: rate, passes, the last pass, a standing `mismatch`) and cumulative
    counters of what checksums read and patches wrote (`hotload_patch.served.Counters`),
    summed over every rank."""

    scrub: dict[str, Any]
    counters: dict[str, int]

    @property
    def mismatch(self) -> dict[str, Any] | None:
        """The scrub's standing mismatch (the weights differ from their checksums), or None."""
        found = self.scrub.get("mismatch")
        return found if isinstance(found, dict) else None


def combine_reports(ranks: list[WeightsReport]) -> WeightsReport:
    """One report for an engine of several ranks: counters summed, the scrub as its slowest
    rank's (fewest passes) with the first mismatch any rank found."""
    if len(ranks) == 1:
        return ranks[0]
    counters: dict[str, int] = {}
    for r in ranks:
        for key, value in r.counters.items():
            counters[key] = counters.get(key, 0) + int(value)
    slowest = min(ranks, key=lambda r: int(r.scrub.get("passes") or 0))
    scrub = dict(slowest.scrub)
    found = next((r.mismatch for r in ranks if r.mismatch is not None), None)
    if found is not None:
        scrub["mismatch"] = found
        scrub["last"] = next(r.scrub.get("last") for r in ranks if r.mismatch is found)
    return WeightsReport(scrub, counters)


@dataclass(frozen=True)
class EngineHealth:
    """Whether the engine process answers (`live`) and can take requests (`ready`), and why not."""

    engine: str
    url: str
    live: bool
    ready: bool
    detail: str = ""


@dataclass(frozen=True)
class Timeouts:
    """Seconds allowed per kind of call (aiohttp total timeouts)."""

    #: Quick calls: health, status, pause in async mode, resume, cache reset, version.
    request: float = 30.0
    #: The weight load itself (vLLM reload_weights, SGLang update, reference load).
    load: float = 900.0
    #: A SYNC pause that waits for in-flight requests to finish.
    drain: float = 600.0
    #: The confirming 1-token completion.
    probe: float = 120.0
    #: Establishing a TCP connection.
    connect: float = 5.0


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, parsed JSON body (None when not JSON) and raw text."""

    status: int
    body: Any
    text: str

    def error_message(self) -> str:
        """The engine's own error message, whichever of the usual shapes it came in."""
        b = self.body
        if isinstance(b, dict):
            err = b.get("error")
            if isinstance(err, dict) and err.get("message"):
                kind = err.get("type")
                return f"{kind}: {err['message']}" if kind else str(err["message"])
            if isinstance(err, str):
                return err
            for key in ("message", "detail"):
                if b.get(key):
                    return str(b[key])
        text = self.text.strip()
        return text[:500] if text else f"HTTP {self.status}"


class EngineHTTP:
    """A small aiohttp client for one engine: per-call timeouts, errors that name URL and step."""

    def __init__(self, engine: str, url: str, timeouts: Timeouts) -> None:
        self.engine = engine
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # One connection per call: vLLM closes a connection after a 500 from collective_rpc,
            # and the next call on a pooled one fails with "Can not write request body" —
            # exactly the rollback call that must not fail. A few calls per load cost nothing.
            # No session-wide timeout: every call passes its own.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        step: str,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Answer:
        """Send one request and return its answer; raise `EngineUnavailableError` if none came."""
        limit = self.timeouts.request if timeout is None else timeout
        client_timeout = aiohttp.ClientTimeout(
            total=limit, connect=min(self.timeouts.connect, limit)
        )
        try:
            async with self._get_session().request(
                method, self.url + path, json=json_body, params=params, timeout=client_timeout
            ) as resp:
                text = await resp.text(errors="replace")
                try:
                    body: Any = json.loads(text) if text else None
                except ValueError:
                    body = None
                return Answer(resp.status, body, text)
        except TimeoutError as err:
            raise EngineUnavailableError(
                f"{method} {path} got no answer within {limit:g} s",
                engine=self.engine,
                url=self.url,
                step=step,
            ) from err
        except aiohttp.ClientError as err:
            raise EngineUnavailableError(
                f"{method} {path} failed: {type(err).__name__}: {err}",
                engine=self.engine,
                url=self.url,
                step=step,
            ) from err

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(frozen=True)
class LoraRoutes:
    """Where an engine loads and unloads LoRA adapters at run time (JSON bodies with
    `lora_name` and `lora_path`)."""

    load: str
    unload: str


#: vLLM's routes (with VLLM_ALLOW_RUNTIME_LORA_UPDATING), which the reference engine serves too.
OPENAI_LORA_ROUTES: Final = LoraRoutes("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
#: SGLang's routes (with --enable-lora).
SGLANG_LORA_ROUTES: Final = LoraRoutes("/load_lora_adapter", "/unload_lora_adapter")

# How engines say "that name is already loaded" / "no adapter by that name"; both are the state
# we asked for, since an adapter identity never changes content.
_ALREADY = ("already", "exists")
_MISSING = ("cannot be found", "not found", "does not exist", "no lora", "not loaded")


class EngineAdapter(ABC):
    """One running engine: load snapshots into it, ask what it serves, check its health."""

    kind: ClassVar[str]
    #: Where this engine loads LoRA adapters at run time.
    lora_routes: ClassVar[LoraRoutes] = OPENAI_LORA_ROUTES
    #: Whether `patch` writes sparse patches (else a loader does not prepare any).
    sparse_loads: ClassVar[bool] = False
    #: Why not, when it does not (the refusal's message).
    no_sparse_loads: ClassVar[str] = "this adapter does not write sparse patches"
    #: Whether `patch` returns before the engine's liveness probe (a forward pass), which the
    #: caller then runs with `probe` once it reported the patch served; else `patch` confirms
    #: in full itself, and `probe` has nothing to do.
    deferred_probe: ClassVar[bool] = False

    def __init__(self, url: str, *, timeouts: Timeouts | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeouts = timeouts or Timeouts()
        self.http = EngineHTTP(self.kind, self.url, self.timeouts)
        # One load at a time: a second caller waits rather than interleaving engine calls.
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        """Whether a load or patch of the loader's is talking to the engine now (what the engine
        says meanwhile is of that work, not of a restart)."""
        return self._lock.locked()

    @abstractmethod
    async def load(self, req: LoadRequest) -> LoadResult:
        """Load `req.path` and return once the engine serves it (confirmed); else raise."""

    async def weights_report(self) -> WeightsReport | None:
        """The engine's scrub and counters (None: this engine keeps none). Raises
        `EngineError` when the engine does not answer."""
        return None

    async def check_sparse(self) -> None:
        """Raise `PatchRefusedError` when this engine cannot take sparse patches now (asked
        before a patch is prepared, so a refusal costs no download)."""
        if not self.sparse_loads:
            raise self._no_patches()

    async def patch(
        self, req: LoadRequest, parent: str, *, folder: str | None = None
    ) -> LoadResult:
        """Write the patch file `req.path` (a delta's changes to `parent`, which the engine must
        serve) into the served weights in place; return once it serves `req.identity`
        (confirmed). `folder` is where the full snapshot of `req.identity` will lie once the
        loader rebuilt it (engines that roll back by reloading a folder keep it). Raises
        `PatchRefusedError` when the engine refused it unchanged (engines without sparse loads
        always do), `EngineLoadError` on any other failure."""
        raise self._no_patches()

    async def probe(self, identity: str) -> None:
        """Run the liveness probe a patch to `identity` was confirmed without (one greedy token:
        the engine generates with the patched weights); raise `EngineError` in the engine's
        words when it does not. Nothing to do when `identity` is no longer what this adapter
        loaded, or for adapters without `deferred_probe`."""
        return  # their loads and patches confirmed in full already

    def _no_patches(self) -> PatchRefusedError:
        return PatchRefusedError(
            f"{self.kind}: {self.no_sparse_loads}",
            reason="engine_unsupported",
            engine=self.kind,
            url=self.url,
            status=None,
        )

    @abstractmethod
    async def current(self) -> ServedSnapshot | None:
        """The snapshot the engine serves now, or None when unknown (e.g. its start-up weights)."""

    @abstractmethod
    async def health(self) -> EngineHealth:
        """Liveness and readiness of the engine; never raises."""

    async def aclose(self) -> None:
        """Release the HTTP connection pool."""
        await self.http.close()

    # --- LoRA adapters -----------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> float:
        """Load the LoRA adapter folder `path` (one `adapter_model.safetensors`) so requests
        for model `name` use it; return the seconds it took. Already loaded counts as done."""
        t0 = time.monotonic()
        async with self._lock:
            answer = await self.http.request(
                "POST",
                self.lora_routes.load,
                step="load_adapter",
                json_body={"lora_name": name, "lora_path": path},
                timeout=self.timeouts.load,
            )
        if not self._lora_ok(answer, _ALREADY):
            raise self.load_error(
                f"loading adapter {name!r} from {path}: HTTP {answer.status}: "
                f"{answer.error_message()}",
                step="load_adapter",
                status=answer.status,
            )
        return time.monotonic() - t0

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`; one the engine does not hold counts as unloaded."""
        async with self._lock:
            answer = await self.http.request(
                "POST",
                self.lora_routes.unload,
                step="unload_adapter",
                json_body={"lora_name": name},
            )
        if not self._lora_ok(answer, _MISSING):
            raise self.unexpected(answer, step="unload_adapter", what=f"unloading adapter {name!r}")

    async def loaded_adapters(self) -> set[str]:
        """The adapters the engine holds now: `/v1/models` entries that name a parent model."""
        answer = await self.http.request("GET", "/v1/models", step="list_adapters")
        if answer.status != 200 or not isinstance(answer.body, dict):
            raise self.unexpected(answer, step="list_adapters", what="listing models")
        return {
            str(m["id"])
            for m in answer.body.get("data") or []
            if isinstance(m, dict) and m.get("parent") and m.get("id")
        }

    @staticmethod
    def _lora_ok(answer: Answer, benign: tuple[str, ...]) -> bool:
        # SGLang answers 200 with {"success": false, ...} as well as 400.
        body = answer.body
        if answer.status == 200 and not (isinstance(body, dict) and body.get("success") is False):
            return True
        text = answer.error_message().lower()
        if isinstance(body, dict) and body.get("error_message"):
            text = str(body["error_message"]).lower()
        return any(word in text for word in benign)

    async def __aenter__(self) -> EngineAdapter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- helpers for implementations ---------------------------------------------------------

    def load_error(
        self,
        message: str,
        *,
        step: str,
        status: int | None = None,
        serving: str = "previous",
    ) -> EngineLoadError:
        """An `EngineLoadError` for this engine."""
        return EngineLoadError(
            message, engine=self.kind, url=self.url, step=step, status=status, serving=serving
        )

    def unexpected(self, answer: Answer, *, step: str, what: str) -> EngineError:
        """An `EngineError` for an answer that is not what the engine's API promises."""
        return EngineError(
            f"{what}: HTTP {answer.status}: {answer.error_message()}",
            engine=self.kind,
            url=self.url,
            step=step,
            status=answer.status,
        )

    def weight_version(self, answer: Answer, *, step: str, what: str) -> str | None:
        """The `weight_version` an answer names (vLLM and SGLang name their weights so), or
        None; an `EngineError` for an answer that is not a 200 with a JSON object."""
        if answer.status != 200 or not isinstance(answer.body, dict):
            raise self.unexpected(answer, step=step, what=what)
        version = answer.body.get("weight_version")
        return version if isinstance(version, str) else None


def served_version(
    version: str | None, *, default: str, loaded: ServedSnapshot | None
) -> ServedSnapshot | None:
    """What an engine serves, by its weight version: None for its start-up weights (no version,
    or `default`); the snapshot this adapter loaded (with its sequence) when the version names
    it; else the version alone (loaded by someone else, sequence unknown)."""
    if version is None or version == default:
        return None
    if loaded is not None and loaded.identity == version:
        return loaded
    return ServedSnapshot(version, None)


class StepTimer:
    """Times named steps of one load, in order."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.steps: dict[str, float] = {}

    async def run(self, name: str, coro: Any) -> Any:
        """Await `coro` and record how long it took under `name`."""
        t = time.monotonic()
        try:
            return await coro
        finally:
            self.steps[name] = round(time.monotonic() - t, 6)

    def elapsed(self) -> float:
        """Seconds since the timer started."""
        return time.monotonic() - self.t0
