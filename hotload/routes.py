"""Router Replay's shared parts: which modules of a mixture-of-experts model route tokens, and
the wire form of one token's routes (the experts each MoE layer chose for it).

The engine records routes with `find_routers` and `encode_routes`; the trainer's SDK
(`hotload.sdk.replay`) decodes them with `decode_routes` and forces the same routers to the
same experts. One token's routes travel as the Fireworks `routing_matrix`: base64 of a
row-major `[num_moe_layers, top_k]` array of expert ids, uint8 while every id fits (fewer than
256 experts), else little-endian uint16 (Kimi K2's 384 experts). The dtype is named beside the
routes (`RouteFormat`), never guessed from the length.

Supported routers: transformers' `TopKRouter` modules that return `(logits, scores, indices)`
(Qwen3-MoE, Qwen2-MoE, Mixtral). torch is not imported here: models are walked as objects.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hotload.errors import HotloadError

RouteDtype = Literal["uint8", "uint16"]

#: Router classes whose forward returns (router_logits, routing_weights, expert_indices) and
#: whose routing weights are the softmax of the logits at the chosen experts (renormalised
#: over them when `norm_topk_prob`, always for Mixtral).
ROUTER_CLASSES = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter"})

#: How many experts an id of each dtype can name.
DTYPE_LIMITS: dict[RouteDtype, int] = {"uint8": 256, "uint16": 65536}


class RoutesError(HotloadError):
    """Routes that cannot be recorded or replayed: an unsupported router, a malformed
    routing matrix, or routes from another snapshot or model shape than the one given."""


@dataclass(frozen=True)
class RouteFormat:
    """How the routes of one model are laid out: `layers` MoE layers, `top_k` experts each,
    ids below `experts`, sent as `dtype`."""

    layers: int
    top_k: int
    experts: int
    dtype: RouteDtype

    @property
    def nbytes(self) -> int:
        """Bytes of one token's routes before base64."""
        return self.layers * self.top_k * (1 if self.dtype == "uint8" else 2)

    def to_json(self) -> dict[str, Any]:
        """The `routes` object of a response."""
        return {
            "num_moe_layers": self.layers,
            "top_k": self.top_k,
            "num_experts": self.experts,
            "dtype": self.dtype,
        }

    @classmethod
    def from_json(cls, raw: object) -> RouteFormat:
        """Parse a response's `hotload.routes` object; a malformed one names its field."""
        if not isinstance(raw, dict):
            raise RoutesError("hotload.routes must be an object (the response has no routes)")
        values: dict[str, int] = {}
        for key in ("num_moe_layers", "top_k", "num_experts"):
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RoutesError(f"hotload.routes.{key} must be a positive integer, got {value!r}")
            values[key] = value
        dtype = raw.get("dtype")
        if dtype not in DTYPE_LIMITS:
            raise RoutesError(f"hotload.routes.dtype must be uint8 or uint16, got {dtype!r}")
        return cls(values["num_moe_layers"], values["top_k"], values["num_experts"], dtype)


def route_dtype(experts: int) -> RouteDtype:
    """The narrowest dtype that names every one of `experts` experts."""
    return "uint8" if experts <= DTYPE_LIMITS["uint8"] else "uint16"


def find_routers(model: Any) -> list[Any]:
    """The model's MoE routers in layer order (empty for a dense model); an MoE router of a
    family replay does not support raises `RoutesError` naming its class."""
    routers = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ROUTER_CLASSES:
            routers.append(module)
        elif kind.endswith(("Router", "TopkRouter", "TopKRouter")) and hasattr(module, "weight"):
            raise RoutesError(
                f"{name} is a {kind}: routes are recorded and replayed for "
                f"{', '.join(sorted(ROUTER_CLASSES))} only"
            )
    return routers


def route_format(routers: Sequence[Any]) -> RouteFormat | None:
    """The layout of the routes of `routers` (None: no routers, a dense model)."""
    if not routers:
        return None
    tops = {int(r.top_k) for r in routers}
    counts = {int(r.num_experts) for r in routers}
    if len(tops) != 1 or len(counts) != 1:
        raise RoutesError(f"MoE layers differ in top_k {sorted(tops)} or experts {sorted(counts)}")
    experts = counts.pop()
    return RouteFormat(len(routers), tops.pop(), experts, route_dtype(experts))


def encode_routes(experts: Iterable[int], fmt: RouteFormat) -> str:
    """One token's routes (layer-major expert ids, `layers * top_k` of them) as base64."""
    ids = list(experts)
    if len(ids) != fmt.layers * fmt.top_k:
        raise RoutesError(f"{len(ids)} expert ids for {fmt.layers} layers of top-{fmt.top_k}")
    width = 1 if fmt.dtype == "uint8" else 2
    raw = b"".join(int(i).to_bytes(width, "little") for i in ids)
    return base64.b64encode(raw).decode("ascii")


def decode_routes(encoded: str, fmt: RouteFormat) -> list[list[int]]:
    """A `routing_matrix` back to `[layers][top_k]` expert ids; a wrong length or an id out of
    range raises `RoutesError`."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (ValueError, TypeError) as err:
        raise RoutesError(f"routing_matrix is not base64: {err}") from None
    if len(raw) != fmt.nbytes:
        raise RoutesError(
            f"routing_matrix has {len(raw)} bytes; {fmt.layers} layers of top-{fmt.top_k} "
            f"as {fmt.dtype} take {fmt.nbytes}"
        )
    width = 1 if fmt.dtype == "uint8" else 2
    ids = [int.from_bytes(raw[i : i + width], "little") for i in range(0, len(raw), width)]
    if any(i >= fmt.experts for i in ids):
        raise RoutesError(f"routing_matrix names expert {max(ids)}; the model has {fmt.experts}")
    return [ids[layer * fmt.top_k : (layer + 1) * fmt.top_k] for layer in range(fmt.layers)]
