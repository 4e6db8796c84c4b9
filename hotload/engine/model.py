"""A Hugging Face causal LM loaded from a hotload snapshot, with in-place weight swaps.

`ModelRunner.load` builds the module from `config.json` without initialising weights and fills
every parameter through the same path a hot load uses (`stage` then `apply`), so an engine that
swapped to a snapshot and one started on it hold bit-identical weights.

`stage` does everything that can fail before anything changes: structure and checksum
verification (`hotload.arc.verify`), the config against the one the engine started with, every
tensor's name, shape and dtype against the served model, and a full read into new tensors
(finite values only). `apply` then only re-points parameters at the staged tensors (no copy, no
I/O; freeing the old tensors is most of its cost), so the swap pause barely grows with the model.

Numerics. With `numerics="exact"` (the default on CPU) a token's logits do not depend on what
else is computed with it: BLAS picks other kernels, with other rounding, for a few row counts,
so a start-up probe finds the row counts at which every row of a linear layer gets the same bits
(on the model's own weights) and each linear call is padded with zero rows up to the nearest
one (`row_sizes`; `batch_invariant` reports whether the probe succeeded); attention runs one
query at a time over exactly that query's keys (no padding, no masked columns). So a request
gives the same tokens alone or in any batch, and with or without a session's cached prefix.
`numerics="fast"` uses transformers' SDPA attention with a padding mask instead: faster,
outputs equal only up to rounding across batch compositions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from hotload.engine.batch import BatchKV, KVCache, crop
from hotload.engine.exact import (
    EXACT_ATTENTION,
    MAX_ROWS,
    SMALL_ROWS,
    pad_rows_linear,
    probe_row_sizes,
    register_exact_attention,
    set_row_pads,
)
from hotload.engine.fp8 import Fp8Store
from hotload.engine.layout import (
    SAFETENSORS_TO_TORCH,
    WeightsMismatchError,
    check_tensors,
    fill_converted,
)
from hotload.engine.lora import AdapterTable, set_rows
from hotload.errors import SnapshotError, SnapshotValidationError, ValidationProblem
from hotload.routes import RouteFormat, RoutesError, find_routers, route_format
from hotload.snapshot import layout
from hotload.snapshot.fp8 import fp8_block, fp8_weights, scale_of
from hotload_patch.placement import Slot

log = logging.getLogger(__name__)

Numerics = Literal["auto", "exact", "fast"]
NUMERICS: tuple[Numerics, ...] = ("auto", "exact", "fast")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` (a CUDA device must exist), or `auto`: the GPU when there is
    one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SnapshotError(f"device {name!r} requested but CUDA is not available", field="device")
    if device.type not in {"cpu", "cuda"}:
        raise SnapshotError(f"unsupported device {name!r} (use cpu or cuda)", field="device")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """`float32`, `bfloat16` or `float16` as a torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise SnapshotError(
            f"unsupported dtype {name!r} (use {', '.join(DTYPES)})", field="dtype"
        ) from None


# --- weights -----------------------------------------------------------------------------------


@dataclass
class StagedWeights:
    """A snapshot read and checked in full, ready to be swapped in by `ModelRunner.apply`."""

    path: Path
    tensors: dict[str, torch.Tensor]
    dtypes: dict[str, str]
    nbytes: int
    seconds: float
    #: Checkpoint tensors held as regions of a parameter (`hotload.engine.layout`).
    converted: dict[str, list[Slot]] = field(default_factory=dict)
    #: A block-FP8 snapshot's weights and scales as stored (`hotload.engine.fp8`).
    fp8: Fp8Store = field(default_factory=Fp8Store)


@dataclass
class ModelInfo:
    """Facts about the served model the rest of the engine needs."""

    model_type: str
    vocab_size: int
    max_positions: int
    eos_ids: frozenset[int]
    parameters: int
    nbytes: int
    numerics: str
    batch_invariant: bool
    row_sizes: tuple[int, ...] = ()


def _eos_ids(model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _exact_supported(config: Any) -> str | None:
    """Why the exact attention cannot serve this architecture, or None when it can."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        return f"sliding-window attention (sliding_window={window})"
    for name in ("attn_logit_softcapping", "attention_sink"):
        if getattr(config, name, None):
            return f"{name} is set"
    return None


@dataclass
class _TensorMap:
    """The part of a snapshot's tensor map that `check_tensors` compares with the model."""

    path: Path
    tensor_map: dict[str, Any]


class ModelRunner:
    """The model, its forward passes and its weight swaps; used by one worker thread."""

    def __init__(self, model: Any, config: dict[str, Any], device: torch.device, exact: bool):
        self.model = model
        self.base_config = config
        self.device = device
        self.exact = exact
        self.base_dtypes: dict[str, str] | None = None
        # Every state-dict name, grouped by the tensor it names (tied weights share one).
        state = model.state_dict(keep_vars=True)
        groups: dict[int, list[str]] = {}
        for name, tensor in state.items():
            groups.setdefault(id(tensor), []).append(name)
        self.targets: dict[str, torch.Tensor] = dict(state)
        #: Checkpoint tensors of the served snapshot held as regions of a parameter.
        self.converted: dict[str, list[Slot]] = {}
        #: The served snapshot's FP8 weights and scales as stored (empty without FP8).
        self.fp8 = Fp8Store()
        #: Every checkpoint tensor as held, by checkpoint name (`checkpoint_tensors`).
        self._held: tuple[dict[str, torch.Tensor], dict[str, list[Slot]]] = (self.targets, {})
        #: LoRA adapters installed on top of the weights (chosen per request).
        self.lora = AdapterTable(model)
        self.groups: list[list[str]] = list(groups.values())
        try:
            routers = find_routers(model)
            #: How this model's routes are laid out (None: no routers it can record).
            self.route_format: RouteFormat | None = route_format(routers)
            #: Why routes cannot be recorded ("" when they can, or the model is dense).
            self.routes_refused = ""
        except RoutesError as err:
            routers, self.route_format, self.routes_refused = [], None, str(err)
        #: The expert ids of the last forward that asked for them: [layers, rows, n, top_k].
        self.last_routes: torch.Tensor | None = None
        self._recording: list[torch.Tensor] | None = None
        for router in routers:
            router.register_forward_hook(self._record_route)
        self.info = ModelInfo(
            model_type=str(config.get("model_type", "?")),
            vocab_size=int(model.config.vocab_size),
            max_positions=int(getattr(model.config, "max_position_embeddings", 2048)),
            eos_ids=_eos_ids(model),
            parameters=sum(p.numel() for p in model.parameters()),
            nbytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            numerics="exact" if exact else "fast",
            batch_invariant=False,
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        numerics: Numerics = "auto",
    ) -> tuple[ModelRunner, StagedWeights]:
        """Build the model of snapshot `path` and load its weights through `stage`/`apply`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from hotload.snapshot import Snapshot

        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype)
        if numerics not in NUMERICS:
            raise SnapshotError(f"unknown numerics {numerics!r}", field="numerics")
        # `stage` below verifies everything; the model skeleton costs next to nothing before it.
        config_doc = Snapshot(path).config
        fp8_block(config_doc, str(path))  # FP8 it cannot dequantize is refused before the build
        hf_config = AutoConfig.from_pretrained(str(path))
        if hasattr(hf_config, "quantization_config"):
            # The engine dequantizes FP8 itself (`hotload.engine.fp8`) and computes in `dtype`:
            # the model is built plain, as from the BF16 checkpoint.
            del hf_config.quantization_config
        why_not = _exact_supported(hf_config)
        exact = numerics == "exact" or (numerics == "auto" and dev.type == "cpu")
        if exact and why_not:
            if numerics == "exact":
                raise SnapshotError(f"numerics=exact does not support {why_not}", field="numerics")
            log.warning("exact numerics unavailable (%s): using fast numerics", why_not)
            exact = False
        if exact:
            register_exact_attention()
            hf_config._attn_implementation = EXACT_ATTENTION
        model = _build_empty(hf_config, torch_dtype, dev, AutoModelForCausalLM)
        if exact:
            model.set_attn_implementation(EXACT_ATTENTION)
        runner = cls(model, config_doc, dev, exact)
        staged = runner.stage(path)
        runner.apply(staged)
        if exact:
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            with torch.no_grad():
                sizes = probe_row_sizes([m.weight for m in linears])
            runner.info.batch_invariant = sizes is not None
            if sizes is None:
                sizes = [SMALL_ROWS + 1]  # best effort: keep small blocks off the small kernels
                log.warning(
                    "linear layers are not row-invariant on this BLAS: batched and cached "
                    "outputs may differ from single runs in rare near-ties"
                )
            runner.info.row_sizes = tuple(sizes)
            for m in linears:
                pad_rows_linear(m, sizes, MAX_ROWS)
        return runner, staged

    # --- weight swaps ------------------------------------------------------------------------

    def stage(self, path: str | Path) -> StagedWeights:
        """Verify snapshot `path`, check it fits this model, and read all of it into new tensors.

        Raises `SnapshotValidationError` (structure, config), `ChecksumMismatchError`,
        `WeightsMismatchError` (names, shapes, dtypes) or `SnapshotError` (non-finite values,
        an incremental snapshot); the served weights are untouched either way.
        """
        from hotload.arc import verify
        from hotload.snapshot import Snapshot, check_config

        started = time.perf_counter()
        root = Path(path)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            # Before `verify` reads every tensor: FP8 this engine cannot dequantize is refused
            # at once (`verify` names a bad config.json).
            fp8_block(json.loads((root / layout.CONFIG_FILE).read_text()), str(root))
        verify(root)  # the FP8 rules included (`hotload.snapshot.fp8.fp8_problems`)
        snap = Snapshot(root)
        if snap.kind != "full":
            raise SnapshotError(
                f"is an {snap.kind} snapshot; the engine loads full snapshots only (the loader "
                "rebuilds deltas first: `hotload snapshot apply`)",
                path=str(root),
            )
        problems = check_config(snap.config, self.base_config, path=str(root / layout.CONFIG_FILE))
        if problems:
            raise SnapshotValidationError(problems)
        block = fp8_block(snap.config, str(root / layout.CONFIG_FILE))
        dtypes = {n: s.dtype for n, s in snap.tensor_map.items()}
        quantized = fp8_weights(dtypes) if block is not None else set()
        scales = {scale_of(n) for n in quantized}
        # An FP8 weight fills its parameter (dequantized); its scale is no weight of the model.
        model_map = _TensorMap(
            snap.path, {n: s for n, s in snap.tensor_map.items() if n not in scales}
        )
        placed = check_tensors(model_map, self.model, self.targets, self.groups, self.base_dtypes)
        load_as, primary, converted = placed.load_as, placed.primary, placed.layout.converted
        tensors: dict[str, torch.Tensor] = {}
        aliases: list[tuple[str, str, torch.Tensor]] = []
        fp8 = Fp8Store(block) if block is not None else Fp8Store()
        nbytes = 0

        def place(name: str, shard: str, t: torch.Tensor) -> None:
            dtype = self.targets[load_as[name]].dtype
            t = t.to(device=self.device, dtype=dtype)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise SnapshotError(
                    "tensor holds NaN or infinite values"
                    + (" (dequantized with its scale)" if name in quantized else ""),
                    path=str(root / shard),
                    field=name,
                )
            if name in converted:
                # A piece of a parameter (an expert of a stacked mixture of experts).
                fill_converted(tensors, self.targets, converted[name], t)
            elif name in primary:
                tensors[load_as[name]] = t
            else:
                aliases.append((name, shard, t))

        with torch.no_grad():
            shard_of: dict[str, str] = {}
            for shard in snap.shard_files:
                with snap.open_shard(shard) as f:
                    for name in snap.tensors_of(shard):
                        info = f.tensors[name]
                        # One copy out of the memory map; `.to` is a no-op when dtypes match.
                        raw = torch.from_numpy(f.raw(name).copy())
                        t = raw.view(SAFETENSORS_TO_TORCH[info.dtype]).reshape(info.shape)
                        nbytes += info.nbytes
                        if name in quantized or name in scales:
                            # Held as stored; computed with once its scale is in too (below).
                            fp8.stored[name] = t.to(device=self.device)
                            shard_of[name] = shard
                        else:
                            place(name, shard, t)
            for name in sorted(quantized):
                place(name, shard_of[name], fp8.dequantized(name, torch.float32))
            for name, shard, t in aliases:
                # A second name of a tied weight (lm_head = embeddings) must hold the same values.
                if not torch.equal(t, tensors[load_as[name]]):
                    raise WeightsMismatchError(
                        [
                            ValidationProblem(
                                str(root / shard),
                                name,
                                f"is tied to {load_as[name]} in the model but holds different "
                                "values",
                            )
                        ]
                    )
        seconds = time.perf_counter() - started
        return StagedWeights(root, tensors, dtypes, nbytes, seconds, converted, fp8)

    def apply(self, staged: StagedWeights) -> None:
        """Point every parameter at its staged tensor (buffers are copied); O(tensors), no I/O."""
        previous: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for name, new in staged.tensors.items():
                    target = self.targets[name]
                    if isinstance(target, nn.Parameter):
                        previous.append((target, target.data))
                        target.data = new
                    else:
                        previous.append((target, target.clone()))
                        target.copy_(new)
        except BaseException:
            with torch.no_grad():
                for target, old in reversed(previous):
                    if isinstance(target, nn.Parameter):
                        target.data = old
                    else:
                        target.copy_(old)
            raise
        if self.base_dtypes is None:
            self.base_dtypes = dict(staged.dtypes)
        self.converted = staged.converted
        self.fp8 = staged.fp8
        stored = self.fp8.stored
        self._held = (
            {**{n: t for n, t in self.targets.items() if n not in stored}, **stored},
            {n: slots for n, slots in self.converted.items() if n not in stored},
        )
        staged.tensors = {}  # the model owns them now

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor the engine holds whole, by checkpoint name: the parameters,
        with an FP8 snapshot's weights and scales as stored (what a patch writes and checksums
        read; their parameters compute with them dequantized)."""
        return self._held[0]

    def checkpoint_regions(self) -> dict[str, list[Slot]]:
        """The checkpoint tensors held as regions of a parameter (FP8 ones are held whole)."""
        return self._held[1]

    # --- forward passes ----------------------------------------------------------------------

    def _record_route(self, _module: nn.Module, _args: Any, output: Any) -> None:
        # Off (None) unless a forward asked: recording costs one small copy per layer.
        if self._recording is not None:
            self._recording.append(output[2].detach().to("cpu", torch.int32))

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache | None,
        pads: list[int],
        *,
        every_position: bool = False,
        adapters: Sequence[str | None] | None = None,
        routes: bool = False,
    ) -> tuple[torch.Tensor, KVCache]:
        """Run `tokens` ([rows, n]) after `kv`; return fp32 logits and the new KV.

        The logits are the last position's ([rows, vocab]), or with `every_position` every
        position's ([rows, n, vocab]). `adapters` names each row's LoRA adapter (None: base).
        With `routes`, `last_routes` holds the experts every MoE layer chose for each token.
        """
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()
        mask = None
        if self.exact:
            set_row_pads(pads)
        elif any(pads):
            width = (kv[0][0].shape[2] if kv else 0) + tokens.shape[1]
            cols = torch.arange(width, device=self.device)[None, :]
            mask = (cols >= torch.tensor(pads, device=self.device)[:, None]).long()
        set_rows(adapters)
        self.last_routes = None
        self._recording = [] if routes and self.route_format is not None else None
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=tokens,
                    position_ids=positions,
                    attention_mask=mask,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=0 if every_position else 1,
                )
            if self._recording is not None:
                rows, n = tokens.shape
                self.last_routes = torch.stack(self._recording).reshape(
                    len(self._recording), rows, n, -1
                )
        finally:
            set_rows(None)
            self._recording = None
        logits = out.logits.float() if every_position else out.logits[:, -1].float()
        layers: list[Any] = list(cache.layers)
        return logits, [(layer.keys, layer.values) for layer in layers]

    def prefill(
        self,
        tokens: Sequence[int],
        prefix: KVCache | None = None,
        reuse: int = 0,
        *,
        every_position: bool = False,
        adapter: str | None = None,
        routes: bool = False,
    ) -> tuple[torch.Tensor, KVCache]:
        """Prefill one sequence, reusing the first `reuse` positions of `prefix`; return logits.

        The logits are the last position's ([vocab]), or with `every_position` those of every
        position computed here ([n - reuse, vocab]); `adapter` is its LoRA adapter, if any;
        `routes`: see `forward`.
        """
        kv = crop(prefix, reuse) if prefix is not None and reuse > 0 else None
        start = reuse if kv is not None else 0
        ids = torch.tensor([list(tokens[start:])], dtype=torch.long, device=self.device)
        pos = torch.arange(start, len(tokens), device=self.device)[None, :]
        logits, new_kv = self.forward(
            ids, pos, kv, [0], every_position=every_position, adapters=[adapter], routes=routes
        )
        return logits[0], new_kv

    def decode(
        self,
        batch: BatchKV,
        tokens: Sequence[int],
        adapters: Sequence[str | None] | None = None,
        routes: bool = False,
    ) -> torch.Tensor:
        """One decode step of the whole batch: feed each row's next token (row i with LoRA
        adapter `adapters[i]`, if any); return [rows, vocab]. `routes`: see `forward`."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)[:, None]
        pos = torch.tensor(batch.lengths(), dtype=torch.long, device=self.device)[:, None]
        logits, batch.layers = self.forward(
            ids, pos, batch.layers, batch.pads, adapters=adapters, routes=routes
        )
        return logits


#: `no_init_weights` swaps torch's init functions for the whole process; two engines building
#: at once (threads of one process) could restore them in the wrong order and leave every later
#: random model uninitialised. One build at a time.
_NO_INIT_LOCK = threading.Lock()


def _build_empty(config: Any, dtype: torch.dtype, device: torch.device, auto: Any) -> Any:
    """The model module with uninitialised weights (they are all overwritten by the load)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: pay for a random initialisation instead
        model = auto.from_config(config, dtype=dtype)
    else:
        with _NO_INIT_LOCK, no_init_weights():
            model = auto.from_config(config, dtype=dtype)
    # transformers 5 ties the output head to the embeddings as part of the initialisation that
    # `no_init_weights` skips: tie them here, or a tied checkpoint (which saves one of the two)
    # would miss a weight.
    model.tie_weights()
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
