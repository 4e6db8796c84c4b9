"""Engine adapters: one interface (`load`, `current`, `health`) for the reference engine, vLLM and
SGLang. `make_adapter(kind, url, ...)` builds the one a deployment names."""

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
    ServedSnapshot,
    Timeouts,
    check_loadable,
    make_adapter,
)
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
    "ReferenceAdapter",
    "SGLangAdapter",
    "ServedSnapshot",
    "Timeouts",
    "VLLMAdapter",
    "check_loadable",
    "make_adapter",
]
