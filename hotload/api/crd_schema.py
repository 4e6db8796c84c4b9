"""Pydantic JSON schemas rewritten as Kubernetes structural schemas: every reference inlined,
`Optional[X]` unions folded, defaults of default factories spelled out, list-map semantics,
and the keys in a readable order. `hotload.api.crd_kinds` builds the CRDs with it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

Schema = dict[str, Any]

#: Lists of these models are maps keyed by these fields (server-side apply merges by key).
_LIST_MAP_KEYS: dict[str, list[str]] = {"Condition": ["type"]}

# Keys of a JSON schema node in the order they are written, for readable YAML and diffs.
_KEY_ORDER = (
    "description",
    "type",
    "format",
    "nullable",
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minItems",
    "maxItems",
    "default",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
    "required",
    "properties",
    "items",
    "additionalProperties",
)
# JSON Schema keywords that the Kubernetes schema dialect lacks or that only add noise.
_DROPPED = {"title", "examples", "$schema", "readOnly", "writeOnly", "deprecated"}


def structural_schema(model: type[BaseModel]) -> Schema:
    """A model's JSON schema (camelCase) as a Kubernetes structural schema; raises ValueError
    for constructs that have none, such as unions of two types."""
    raw = model.model_json_schema(by_alias=True, schema_generator=_ExpandDefaults)
    return _Structural(raw.get("$defs", {})).convert(raw)


class _ExpandDefaults(GenerateJsonSchema):
    """Writes the values of `default_factory` fields as defaults, without unset optionals.

    The API server only defaults a nested field when its parent object exists, so an optional
    object needs its whole default spelled out (this also lets `kubectl explain` show it)."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        """The static default, or the default factory's value when it needs no data."""
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            return factory()  # type: ignore[call-arg]
        return schema.get("default", NoDefault)

    def encode_default(self, dft: Any) -> Any:
        """Encode a default as the API server would store it (camelCase, no nulls)."""
        if isinstance(dft, BaseModel):
            return dft.model_dump(by_alias=True, exclude_none=True, mode="json")
        return super().encode_default(dft)


class _Structural:
    """Rewrites a pydantic JSON schema into a Kubernetes structural schema."""

    def __init__(self, defs: dict[str, Schema]) -> None:
        self.defs = defs

    def convert(self, node: Schema, path: str = "") -> Schema:
        """The structural form of one schema node (`path` only names it in errors)."""
        node = dict(node)
        if "$ref" in node:
            # Siblings of a reference (the field's description or default) win over the
            # referenced model's own.
            target = self.defs[node.pop("$ref").rsplit("/", 1)[-1]]
            node = {**target, **node}
        if "anyOf" in node or "oneOf" in node:
            branches = node.pop("anyOf", None) or node.pop("oneOf")
            rest = [b for b in branches if b.get("type") != "null"]
            if len(rest) != 1:
                raise ValueError(
                    f"{path or '<root>'}: unions other than Optional[X] have no structural "
                    "schema; use one type"
                )
            return self.convert({**rest[0], **node}, path)
        if "const" in node:
            node["enum"] = [node.pop("const")]
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema 2020 makes these numbers; OpenAPI v3.0 (Kubernetes) makes them flags.
            if isinstance(node.get(bound), int | float) and not isinstance(node[bound], bool):
                node["minimum" if bound == "exclusiveMinimum" else "maximum"] = node[bound]
                node[bound] = True
        if node.get("default", 0) is None:
            del node["default"]
        if node.get("additionalProperties") is False:
            # Structural schemas prune unknown fields; `false` would only add a second rule.
            del node["additionalProperties"]
        if node.get("x-kubernetes-preserve-unknown-fields") and node.get(
            "additionalProperties"
        ) in (True, {}):
            # A free-form object (dict[str, Any]): kept as it is, validated by whoever reads it.
            del node["additionalProperties"]
        for key in _DROPPED:
            node.pop(key, None)
        node.pop("$defs", None)
        if "properties" in node:
            required = set(node.get("required", []))
            node["properties"] = {
                name: self._property(prop, f"{path}.{name}", required=name in required)
                for name, prop in node["properties"].items()
            }
            if not node.get("required"):
                node.pop("required", None)
        if isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = self.convert(node["additionalProperties"], f"{path}.*")
        if "items" in node:
            items = node["items"]
            ref = items.get("$ref", "").rsplit("/", 1)[-1]
            node["items"] = self.convert(items, f"{path}[]")
            if ref in _LIST_MAP_KEYS:
                node["x-kubernetes-list-type"] = "map"
                node["x-kubernetes-list-map-keys"] = list(_LIST_MAP_KEYS[ref])
        if "type" not in node:
            raise ValueError(f"{path or '<root>'}: no type (structural schemas need one)")
        return ordered(node)

    def _property(self, prop: Schema, path: str, *, required: bool) -> Schema:
        converted = self.convert(prop, path)
        allows_null = any(b.get("type") == "null" for b in prop.get("anyOf", []))
        # Leaving out an optional field already means None, and the API server drops null
        # values of non-nullable fields; only a required field, or one whose default is not
        # None, needs null kept (to tell "explicitly None" from "missing" or "the default").
        if allows_null and (required or prop.get("default") is not None):
            converted["nullable"] = True
            converted = ordered(converted)
        return converted


def ordered(node: Schema) -> Schema:
    """`node` with its keys in the order CRDs are written (readable YAML and diffs)."""
    known = {k: node[k] for k in _KEY_ORDER if k in node}
    return {**known, **{k: v for k, v in node.items() if k not in known}}


# --- docs ------------------------------------------------------------------------------------
