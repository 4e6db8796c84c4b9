"""Engine adapters: one interface (`load`, `current`, `health`) for the reference engine, vLLM and
SGLang. `make_adapter(kind, url, ...)` builds the one a deployment names."""

from typing import Any

from hotload.errors import EngineBusyError, EngineError, EngineLoadError, EngineUnavailableError
from hotload_sidecar.engines.base import (
    CACHE_POLICIES,
    ENGINE_KINDS,
    MODES,
    CachePolicy,
    EngineAdapter,
    EngineHealth,
    EngineKind,
    LoadRequest,
    LoadResult,
    Mode,
    PatchRefusedError,
    ServedSnapshot,
    Timeouts,
    WeightsReport,
)
from hotload_sidecar.engines.loadable import check_loadable
from hotload_sidecar.engines.reference import ReferenceAdapter
from hotload_sidecar.engines.sglang import SGLangAdapter
from hotload_sidecar.engines.vllm import VLLMAdapter

__all__ = [
    "CACHE_POLICIES",
    "ENGINE_KINDS",
    "MODES",
    "CachePolicy",
    "EngineAdapter",
    "EngineBusyError",
    "EngineError",
    "EngineHealth",
    "EngineKind",
    "EngineLoadError",
    "EngineUnavailableError",
    "LoadRequest",
    "LoadResult",
    "Mode",
    "PatchRefusedError",
    "ReferenceAdapter",
    "SGLangAdapter",
    "ServedSnapshot",
    "Timeouts",
    "VLLMAdapter",
    "WeightsReport",
    "check_loadable",
    "make_adapter",
]


def make_adapter(kind: str, url: str, **options: Any) -> EngineAdapter:
    """Build the adapter for engine `kind` ("reference", "vllm" or "sglang") at `url`."""
    # Here rather than in `base`: the base module is what every adapter builds on, so it
    # cannot also name them.
    adapters: dict[str, type[EngineAdapter]] = {
        "reference": ReferenceAdapter,
        "vllm": VLLMAdapter,
        "sglang": SGLangAdapter,
    }
    adapter = adapters.get(kind)
    if adapter is None:
        raise ValueError(f"unknown engine kind {kind!r}: use one of {ENGINE_KINDS}")
    return adapter(url, **options)
