"""The vLLM worker extension: sparse hot loads inside vLLM's workers.

Start vLLM with `--worker-extension-cls hotload_patch.vllm.HotloadWorkerExtension` (this
package on its PYTHONPATH: the operator's pods have the loader copy it onto the weights volume).
vLLM mixes the class into every worker, and its dev-mode `POST /collective_rpc` calls these
methods on every rank, returning one result per rank. The loader's vLLM adapter drives them:

    hotload_describe          protocol, rank, why this engine cannot take patches (if it cannot)
    hotload_weights_changed   after a full load: checksum the served weights in the background
    hotload_stage             stage a patch file in the background (returns at once)
    hotload_poll              the background work's state; once done, the served region sums and
                              the patch's sum changes, for the adapter to verify over all ranks
    hotload_apply             write the staged patch (the adapter has paused generation)
    hotload_rollback          put back what the last apply replaced
    hotload_discard           drop a staged patch
    hotload_state             the scrub (rate, last pass, a mismatch) and the counters of what
                              checksums read and patches wrote
    hotload_parameter_checksums   sha256 of every parameter as held (tests, audits)

After a patch each rank's served checksums are derived from the patch; a scrub re-reads the
weights in the background once every HOTLOAD_SCRUB_PERIOD_SECONDS (default 3600; a full load
restarts the period), at most HOTLOAD_SCRUB_BYTES_PER_SECOND fast (default 64 MiB/s, 0: off),
resting in between, and compares them (`hotload_patch.scrub`).

Every method answers a JSON object and never raises for a refused patch: `{"error": {"reason",
"message", "tensor"}}` says why, and the weights are unchanged.

On the CPU, vLLM repacks linear weights for its GEMM kernels (oneDNN) and frees the originals,
which leaves nothing a patch could write into, and prepacks a mixture of experts' weights for
its grouped GEMM. With this extension loaded, vLLM keeps both as they are and multiplies with
`torch.nn.functional.linear` instead (set HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS=0 to keep vLLM's
kernels; patches are then refused with `kernel_format` and the loader reloads in full). GPUs
compute with the weights as loaded.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.nn import functional

from hotload_patch import PROTOCOL
from hotload_patch.checkpoint import Specs, checkpoint_specs
from hotload_patch.errors import PatchError
from hotload_patch.placement import LoaderHost
from hotload_patch.scrub_defaults import DEFAULT_SCRUB_PERIOD, DEFAULT_SCRUB_RATE
from hotload_patch.session import Patcher
from hotload_patch.staging import parameter_checksums

PLAIN_ENV = "HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS"
SCRUB_ENV = "HOTLOAD_SCRUB_BYTES_PER_SECOND"
SCRUB_PERIOD_ENV = "HOTLOAD_SCRUB_PERIOD_SECONDS"


def _env_number(name: str, default: float, unit: str) -> float:
    """The number in environment variable `name` (`default` when unset); one that is not a
    number is refused naming the variable."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of {unit}") from None


def scrub_rate() -> float:
    """The scrub's cap from HOTLOAD_SCRUB_BYTES_PER_SECOND (bytes per second; 0 turns it off);
    the default when unset; anything but a number >= 0 is refused naming the variable."""
    rate = _env_number(SCRUB_ENV, DEFAULT_SCRUB_RATE, "bytes per second")
    if not rate >= 0:
        raise ValueError(f"{SCRUB_ENV}={os.environ[SCRUB_ENV]!r} must not be negative")
    return rate


def scrub_period() -> float:
    """The scrub's period from HOTLOAD_SCRUB_PERIOD_SECONDS (seconds from one pass's start to
    the next's); the default when unset; anything but a positive number is refused naming the
    variable."""
    period = _env_number(SCRUB_PERIOD_ENV, DEFAULT_SCRUB_PERIOD, "seconds")
    if not 0 < period < float("inf"):
        raise ValueError(
            f"{SCRUB_PERIOD_ENV}={os.environ[SCRUB_PERIOD_ENV]!r} must be a positive number of "
            f"seconds (to turn the scrub off: {SCRUB_ENV}=0)"
        )
    return period


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    return functional.linear(x, weight, bias)


def _keep_weights(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Stands in for vLLM's `dispatch_cpu_unquantized_gemm`: keep the weight, plain GEMM."""
    # vLLM's CPU linear methods call `layer.cpu_linear(x, weight, bias)`.
    layer.__dict__["cpu_linear"] = _plain_linear


def _keep_expert_weights(experts: Any, layer: torch.nn.Module) -> None:
    """Stands in for vLLM's CPU mixture-of-experts weight processing (which pads the
    intermediate size and prepacks every expert for its grouped GEMM): keep them as loaded."""


def _plain_experts(  # noqa: PLR0917 (vLLM's signature)
    experts: Any,
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Any,
    global_num_experts: int,
    expert_map: torch.Tensor | None,
    a1q_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    expert_tokens_meta: Any,
    apply_router_weight_on_input: bool,
) -> None:
    """vLLM's CPU experts' `apply` on the weights as loaded: each routed expert's tokens
    through `w1` (gate and up), vLLM's own activation, `w2`, weighted by the router and summed
    into `output` (what `cpu_fused_moe` computes from its prepacked copy)."""
    from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation

    tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map[ids].long()  # global -> local expert, -1 for another rank's
    rows = torch.arange(tokens, device=ids.device).repeat_interleave(k)
    weights = topk_weights.reshape(-1, 1).to(hidden_states.dtype)
    b1, b2 = experts.w1_bias, experts.w2_bias
    output.zero_()
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        picked = (ids == e).nonzero().squeeze(1)
        at = rows[picked]
        gate_up = functional.linear(hidden_states[at], w1[e], None if b1 is None else b1[e])
        width = gate_up.shape[-1] // 2 if activation.is_gated else gate_up.shape[-1]
        act = gate_up.new_empty(gate_up.shape[0], width)
        apply_moe_activation(activation, act, gate_up)
        out = functional.linear(act, w2[e], None if b2 is None else b2[e])
        if not apply_router_weight_on_input:  # else already applied to the inputs
            out = out * weights[picked]
        output.index_add_(0, at, out.to(output.dtype))


def keep_plain_cpu_weights() -> bool:
    """On vLLM's CPU platform (unless HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS=0), make layers loaded
    from now on keep their weights unpacked, linear layers and experts of a mixture of experts;
    True when it did. Runs when vLLM imports this module, which it does while building its
    workers, before it loads the model."""
    if os.environ.get(PLAIN_ENV, "1") == "0":
        return False
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        import vllm.model_executor.layers.utils as layer_utils
    except ImportError:
        return False
    layer_utils.dispatch_cpu_unquantized_gemm = _keep_weights
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:
        return True
    # Also a fix: vLLM 0.32 prepacks the experts at the first load only; `reload_weights`
    # (every full hot load) leaves them as loaded while its kernel still reads them as packed,
    # and the model answers wrong tokens from then on.
    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = _keep_expert_weights
    cpu_moe.CPUUnquantizedExperts.apply = _plain_experts
    return True


PLAIN_CPU_WEIGHTS = keep_plain_cpu_weights()


def _repacked_experts(method: Any) -> bool:
    """Whether a mixture-of-experts layer's method prepacks its experts (vLLM's CPU kernels,
    when this extension does not keep them as loaded)."""
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if experts is None:
        return False
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return False
    process = type(experts).process_weights_after_loading
    return isinstance(experts, CPUUnquantizedExperts) and process is not _keep_expert_weights


def kernel_problems(model: torch.nn.Module) -> list[str]:
    """Why vLLM holds some weights in a format a patch cannot follow: quantised layers, linear
    layers or experts repacked for the CPU kernels. One line per kind, with an example layer."""
    try:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )
    except ImportError as exc:
        return [f"this vLLM lacks the layers the extension knows: {exc}"]
    found: dict[str, list[str]] = {}
    plain = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase | VocabParallelEmbedding):
            if method is not None and not isinstance(method, plain):
                found.setdefault(f"quantised weights ({type(method).__name__})", []).append(name)
            linear = getattr(module, "cpu_linear", None)
            if linear is not None and linear is not _plain_linear:
                kind = "weights repacked for vLLM's CPU kernels (HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS=0)"
                found.setdefault(kind, []).append(name)
        elif method is not None and _repacked_experts(method):
            kind = (
                "expert weights prepacked for vLLM's CPU kernels (HOTLOAD_VLLM_CPU_PLAIN_WEIGHTS=0)"
            )
            found.setdefault(kind, []).append(name)
        elif method is not None and type(method).__name__.startswith(("Unquantized", "BaseKV")):
            continue
        elif method is not None and hasattr(module, "weight"):
            found.setdefault(f"layers a patch cannot follow ({type(method).__name__})", []).append(
                name
            )
    return [f"{kind}: {len(names)} layer(s), e.g. {names[0]}" for kind, names in found.items()]


def naming_tensors(lines: list[str], host: LoaderHost, specs: Specs) -> list[str]:
    """`kernel_problems` lines with the checkpoint tensor their example layer holds (from the
    placement of `specs`, the checkpoint vLLM serves), so a refusal names the family's tensor."""
    out = []
    for line in lines:
        _, sep, layer = line.rpartition(", e.g. ")
        tensor = _held_in(layer, host, specs) if sep else None
        out.append(f"{line} (checkpoint tensor {tensor})" if tensor else line)
    return out


def _held_in(layer: str, host: LoaderHost, specs: Specs) -> str | None:
    for name, (shape, dtype) in specs.items():
        try:
            slots = host.place(name, shape, dtype)
        except PatchError:
            continue
        if any(slot.param.startswith(layer + ".") for slot in slots):
            return name
    return None


class HotloadWorkerExtension:
    """Methods vLLM adds to its worker class (see the module docstring). State lives on the
    worker instance under one attribute, so nothing clashes with vLLM's own names."""

    def _hotload(self) -> Patcher:
        patcher = self.__dict__.get("_hotload_patcher")
        if patcher is None:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]

            def problems() -> list[str]:
                lines = kernel_problems(model)
                if not lines:
                    return []
                return naming_tensors(lines, host, checkpoint_specs(self._hotload_folder()))

            host = LoaderHost(model, problems)
            patcher = Patcher(host, scrub_rate=scrub_rate(), scrub_period=scrub_period())
            self.__dict__["_hotload_patcher"] = patcher
        return patcher

    def _hotload_current(self) -> Patcher:
        """The patcher, its served checksums read again when vLLM holds weights from another
        folder than they stand for (it started, or reloaded without telling this extension)."""
        patcher = self._hotload()
        folder = self._hotload_folder()
        if patcher.source != folder:
            patcher.weights_changed(checkpoint_specs(folder), source=folder)
        return patcher

    def _hotload_folder(self) -> str:
        return str(self.model_runner.vllm_config.model_config.model)  # type: ignore[attr-defined]

    def _hotload_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def hotload_describe(self) -> dict[str, Any]:
        """The protocol, this rank, and why patches cannot be taken here ([] when they can)."""
        try:
            problems = self._hotload_current().host.problems()
        except PatchError as exc:
            problems = [str(exc)]
        return {
            "protocol": PROTOCOL,
            "rank": self._hotload_rank(),
            "plain_cpu_weights": PLAIN_CPU_WEIGHTS,
            "problems": problems,
        }

    def hotload_weights_changed(self, folder: str | None = None) -> dict[str, Any]:
        """The weights were loaded in full (from `folder`, default vLLM's model path): read
        their checksums again in the background."""
        return _answer(self._hotload_rank(), lambda: self._hotload_changed(folder))

    def _hotload_changed(self, folder: str | None) -> dict[str, Any]:
        folder = folder or self._hotload_folder()
        self._hotload().weights_changed(checkpoint_specs(folder), source=folder)
        return {"rank": self._hotload_rank()}

    def hotload_stage(self, path: str, identity: str, parent: str) -> dict[str, Any]:
        """Stage the patch file `path` in the background; poll with `hotload_poll`."""
        return _answer(self._hotload_rank(), lambda: self._hotload_stage(path, identity, parent))

    def _hotload_stage(self, path: str, identity: str, parent: str) -> dict[str, Any]:
        self._hotload_current().stage(path, identity=identity, parent=parent)
        return {"rank": self._hotload_rank(), "state": "pending"}

    def hotload_poll(self) -> dict[str, Any]:
        """The background work's state; when both the served checksums and the staging are
        ready, their region sums too."""
        patcher = self._hotload()
        state = patcher.state()
        state["rank"] = self._hotload_rank()
        if state["served"] == "ready" and state["staging"] == "ready":
            staged = patcher.staged()
            state["served_sums"] = [s.to_json() for s in patcher.served()]
            state["deltas"] = [d.to_json() for d in staged.deltas]
            state["stage"] = staged.summary()
        return state

    def hotload_apply(self) -> dict[str, Any]:
        """Write the staged patch; the old values come back on any failure."""
        return _answer(
            self._hotload_rank(),
            lambda: {"rank": self._hotload_rank(), **self._hotload().apply().summary()},
        )

    def hotload_rollback(self) -> dict[str, Any]:
        """Put back what the last apply replaced."""
        return _answer(
            self._hotload_rank(),
            lambda: {"rank": self._hotload_rank(), "rolled_back": self._hotload().rollback()},
        )

    def hotload_discard(self) -> dict[str, Any]:
        """Drop a staged patch."""
        self._hotload().discard()
        return {"rank": self._hotload_rank()}

    def hotload_state(self) -> dict[str, Any]:
        """The scrub's state and the counters of this rank."""
        patcher = self._hotload()
        return {
            "rank": self._hotload_rank(),
            "scrub": patcher.scrub_state(),
            "counters": patcher.counters.to_json(),
        }

    def hotload_parameter_checksums(self) -> dict[str, Any]:
        """sha256 of every parameter with storage, as held."""
        params = self._hotload().host.parameters()
        return {"rank": self._hotload_rank(), "checksums": parameter_checksums(params)}


def _answer(rank: int, call: Any) -> dict[str, Any]:
    try:
        result: dict[str, Any] = call()
        return result
    except PatchError as exc:
        return {"rank": rank, "error": exc.to_json()}
