"""How to start a reference engine: the `hotload serve` options as one frozen record."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hotload_patch.scrub_defaults import DEFAULT_SCRUB_PERIOD, DEFAULT_SCRUB_RATE

if TYPE_CHECKING:  # model.py imports torch, which only the 'engine' extra installs
    from hotload.engine.model import Numerics


@dataclass(frozen=True)
class EngineConfig:
    """How to start an engine (the `hotload serve` options)."""

    model_path: Path
    name: str = "model"
    identity: str | None = None  # default: the model folder's name
    sequence: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 8
    numerics: Numerics = "auto"
    session_max: int = 1024
    session_tokens: int = 1 << 18
    #: LoRA adapters loaded at once (`POST /v1/load_lora_adapter`); 0 refuses adapters.
    max_adapters: int = 8
    # Niceness of the thread that stages a hot load: generation keeps the CPU while the old
    # weights serve, and staging takes what is left (0: same priority as generation).
    stage_nice: int = 10
    #: The scrub re-reads the served weights to check the checksums that patches derive: a
    #: pass begins every `scrub_period_seconds` (after a full load: a period later) and reads
    #: at most `scrub_bytes_per_second` (0: no scrub); it rests in between.
    scrub_bytes_per_second: float = DEFAULT_SCRUB_RATE
    scrub_period_seconds: float = DEFAULT_SCRUB_PERIOD

    @property
    def initial_identity(self) -> str:
        """The identity of the snapshot the engine starts with."""
        return self.identity or Path(self.model_path).resolve().name
