"""The Kubernetes API for tests: a real API server, or an emulator on kmock.

`kube_api` (the fixture) yields a `KubeAPI`: `.url`, `.kubeconfig`, `.namespace` (a fresh one,
deleted afterwards), `.store` (read and write objects directly), `.client()`. It talks to the
session's lane (`support.cluster`): the real control plane of `../shared/k8s` when it is beside
the repository (or `$HOTLOAD_E2E_KUBECONFIG`'s cluster), else this module's emulator.
`kube_emulator` is the emulator in every lane (outages, injected faults, compaction, token
checks); `real_kube_api` is a real server only (server-side apply's managed fields).

Why kmock, and what is ours. DESIGN.md names kmock (0.8) as the emulator, and it carries the
HTTP side well: its server, request parsing and recording (`emulator.requests`), the API
discovery endpoints (`/api`, `/apis`, `/apis/g/v` with the bundled built-in resource list),
`Status` error bodies, and its DSL to inject faults in a test
(`kube_api.emulator["patch", re.compile(".*/status")] << 500`). Its own object store
(`KubernetesEmulator`) is a plain JSON dict store, and reworking it would mean overriding nearly
every method, so `KubeAPIEmulator` keeps kmock's scaffold (`KubernetesScaffold`) and puts its own
store behind a fallback reaction. That store adds what kmock lacks (see NOTES.md):

* uid, a global increasing resourceVersion, generation (bumped on spec changes only),
  creationTimestamp; 201 on create, namespace from the URL, generateName, no-op writes that
  change nothing (no new resourceVersion, no watch event);
* PUT with resourceVersion preconditions (409), the status subresource as a separate write
  path (status writes change only status; main writes ignore status) for kinds that have it;
* merge patch, JSON patch (failing `test` -> 422), strategic merge patch for built-in kinds
  (lists merged by their Kubernetes merge keys: conditions by `type`, containers by `name`,
  ...; `$patch` directives), server-side apply approximated as create-or-merge;
* label selectors (`=`, `==`, `!=`, `in`, `notin`, exists, `!`) and field selectors (any
  dotted field, `=`/`==`/`!=`) on lists and watches;
* watches that honour resourceVersion (only newer events; 410 when older than the kept
  history), MODIFIED/DELETED, objects entering/leaving a selector as ADDED/DELETED, bookmarks
  on request, `timeoutSeconds`;
* namespaces (objects need an existing namespace), finalizers and deletionTimestamp,
  owner-reference garbage collection (background, foreground and orphan propagation),
  namespace deletion removing its objects;
* CRDs: creating a CustomResourceDefinition registers its kind (discovery, serving, status
  subresource) and marks it Established; deleting it removes the kind and its objects;
* validation of label keys and values and of object names (422 like a real server);
* optional bearer-token checking (`emulator.tokens`) for auth and token-rotation tests;
* service-account identities (`support.kubeaccess`): TokenRequest
  (`POST .../serviceaccounts/NAME/token`, bound to a pod) and `add_service_account_token`
  give tokens whose requests authenticate as the account (the pod's name and uid in
  `userInfo.extra`), are authorized by RBAC (Roles, ClusterRoles and their bindings; real 403
  messages; an apply that creates is authorized as a create too; writing a Role or binding
  passes the escalation check) and die with their pod; every other request is the
  all-powerful admin;
* ValidatingAdmissionPolicies with their bindings, in CEL, on every create, update (patches and
  status writes included: `object` is the result) and delete that comes in over HTTP, with the
  real denial (`ValidatingAdmissionPolicy 'P' with binding 'B' denied request: ...`);
* what kubectl needs: `dryRun=All` (validated and admitted, nothing stored),
  `fieldValidation=Strict` (fields a custom resource's CRD schema does not declare are refused
  with the real `strict decoding error: unknown field "spec.x"`; built-in kinds carry no schema
  here), OpenAPI v3 (`/openapi/v3`: PATCH operations declaring `fieldValidation`, so kubectl
  leaves validation to the server, and CRD schemas for `kubectl explain`), Table output for
  custom resources (their printer columns, evaluated with a JSONPath subset; built-in kinds
  answer JSON and kubectl prints NAME and AGE), the scale subresource of CRDs that declare it,
  and discovery that lists subresources without short names or categories.

kmock cannot parse `/api/v1/namespaces` (its path parser fails before any reaction runs), so
`KubeAPIEmulator.__call__` routes that one path itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import copy
import dataclasses
import json
import re
import time
import uuid
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import pytest
import pytest_asyncio
import yaml
from kmock._internal import rendering

from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, KubeConfig, resource_path
from support.cluster import Lane, LaneError, namespaced_kubeconfig, planned_lane, session_lane
from support.kubeaccess import (
    ADMIN,
    AdmissionRequest,
    Attributes,
    BoundToken,
    UserInfo,
    admit,
    authorize,
    confirm_no_escalation,
    request_verb,
    service_account_user,
)

JSON = dict[str, Any]

CRD_GROUP = "apiextensions.k8s.io"

#: Who made the request being served: admission runs in the store's write methods, which
#: also serve direct test access (`put_object`) and garbage collection, where it is None.
_REQUEST_USER: contextvars.ContextVar[UserInfo | None] = contextvars.ContextVar(
    "hotload_kube_request_user", default=None
)
#: The request's `dryRun=All` (validate and admit, store nothing) and `fieldValidation=Strict`.
_DRY_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hotload_kube_dry_run", default=False
)
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("hotload_kube_strict", default=False)


def now_rfc3339() -> str:
    """The current time as Kubernetes writes it (seconds, UTC, `Z`)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- errors as the API server answers them ---------------------------------------------------


def api_error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    """A kmock error that renders as a Kubernetes `Status` with `reason` and `message`."""
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details)


def not_found(kind: str, name: str) -> kmock.KubernetesError:
    return api_error(404, "NotFound", f'{kind} "{name}" not found', name=name, kind=kind)


# --- paths -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """What a request path names: a collection or an object, maybe a subresource."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def parse_target(path: str, namespaced_plurals: set[str]) -> Target | None:
    """Parse an API path; None for anything that is not a resource path (discovery, /version)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    # /namespaces/x/<plural>... is namespaced; /namespaces, /namespaces/x[/status] is the
    # Namespace object itself.
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in namespaced_plurals:
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return Target(group, version, plural, namespace, name, subresource)


# --- selectors -------------------------------------------------------------------------------

_REQUIREMENT = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[^\s!=,()]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[^\s,()]*)|\s+(?P<setop>in|notin)\s*\((?P<set>[^)]*)\))?\s*$"
)


def _split_selector(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p for p in parts if p.strip()]


def label_matcher(selector: str | None) -> Any:
    """A predicate on a labels dict for a Kubernetes label selector string (400 when malformed)."""
    checks: list[Callable[..., bool]] = []
    for term in _split_selector(selector or ""):
        m = _REQUIREMENT.match(term)
        if m is None:
            raise api_error(400, "BadRequest", f"unable to parse requirement: {term!r}")
        key, neg, op, setop = m["key"], m["neg"], m["op"], m["setop"]
        if op:
            value = m["value"]
            equal = op != "!="
            checks.append(lambda labels, k=key, v=value, eq=equal: (labels.get(k) == v) == eq)
        elif setop:
            values = {v.strip() for v in m["set"].split(",") if v.strip()}
            if setop == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        else:
            checks.append(lambda labels, k=key, n=bool(neg): (k in labels) != n)
    return lambda labels: all(check(labels) for check in checks)


def field_matcher(selector: str | None) -> Any:
    """A predicate on an object for a field selector (`a.b=v`, `a.b==v`, `a.b!=v`, comma-joined)."""
    checks: list[Callable[[JSON], bool]] = []
    for term in _split_selector(selector or ""):
        m = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*([^\s,]*)\s*$", term)
        if m is None:
            raise api_error(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, value = m.group(1).split("."), m.group(2), m.group(3)

        def check(obj: JSON, path: list[str] = path, value: str = value, op: str = op) -> bool:
            current: Any = obj
            for part in path:
                current = current.get(part) if isinstance(current, dict) else None
            text = "" if current is None else str(current)
            if isinstance(current, bool):
                text = str(current).lower()
            return (text == value) == (op != "!=")

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


# --- validation ------------------------------------------------------------------------------

_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def validate_metadata(obj: JSON) -> None:
    """Raise 422 for invalid names and label keys or values, as the API server does."""
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    problems = []
    if name and (len(name) > 253 or not _DNS_SUBDOMAIN.match(name)):
        problems.append(f"metadata.name: Invalid value: {name!r}: must be a DNS subdomain")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if (
            not label
            or len(label) > 63
            or not _LABEL_NAME.match(label)
            or (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)))
        ):
            problems.append(f"metadata.labels: Invalid value: {key!r}: invalid label key")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_NAME.match(value):
            problems.append(f"metadata.labels: Invalid value: {value!r}: invalid label value")
    for key, value in (meta.get("annotations") or {}).items():
        if not isinstance(value, str):
            problems.append(f"metadata.annotations.{key}: Invalid value: must be a string")
    if problems:
        kind = obj.get("kind", "object")
        raise api_error(
            422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(problems), name=name
        )


# --- patches ---------------------------------------------------------------------------------


def merge_patch(original: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: maps merge, `null` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


#: List fields of built-in kinds and their strategic-merge keys (None: a merged set of scalars).
_MERGE_KEYS: dict[str, str | None] = {
    "conditions": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "resourceClaims": "name",
    "topologySpreadConstraints": "topologyKey",
    "finalizers": None,
}


def _merge_key(path: tuple[str, ...]) -> tuple[bool, str | None]:
    field = path[-1]
    if field == "ports":
        in_container = any(p in ("containers", "initContainers") for p in path)
        return True, "containerPort" if in_container else "port"
    if field in _MERGE_KEYS:
        return True, _MERGE_KEYS[field]
    return False, None


def strategic_merge(original: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """A strategic merge patch for built-in kinds: lists with a merge key merge by that key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue  # order and retainKeys hints change nothing these tests observe
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [x for x in result.get(name) or [] if x not in value]
            continue
        if value is None:
            result.pop(key, None)
            continue
        merged, merge_key = _merge_key((*path, key))
        if isinstance(value, list) and merged:
            result[key] = _merge_list(result.get(key) or [], value, merge_key, (*path, key))
        elif isinstance(value, dict):
            result[key] = strategic_merge(result.get(key), value, (*path, key))
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(
    original: list[Any], patch: list[Any], key: str | None, path: tuple[str, ...]
) -> Any:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    result = [copy.deepcopy(item) for item in original]
    if key is None:  # a set of scalars (finalizers)
        result += [item for item in patch if item not in result]
        return result
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise api_error(422, "Invalid", f"{'.'.join(path)}: each item needs {key!r}")
        index = next((i for i, old in enumerate(result) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(strategic_merge({}, item, path))
        else:
            result[index] = strategic_merge(result[index], item, path)
    return result


# --- printer columns and schemas -------------------------------------------------------------

_JSONPATH_STEP = re.compile(
    r"\.(?P<field>[A-Za-z0-9_$-]+)"
    r"|\[(?P<index>-?\d+|\*)\]"
    r"|\[\?\(@(?P<path>(?:\.[A-Za-z0-9_$-]+)+)\s*(?P<op>==|!=)\s*"
    r"(?P<value>\"[^\"]*\"|'[^']*'|-?\d+(?:\.\d+)?|true|false)\)\]"
)


def jsonpath(obj: Any, expression: str) -> list[Any]:
    """The values a printer-column JSONPath selects: `.a.b`, `[n]`, `[*]` and filters like
    `[?(@.type=="Ready")]` (the subset CRDs use; kubectl's `{}` braces are optional)."""
    text = expression.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    current = [obj]
    position = 0
    while position < len(text):
        m = _JSONPATH_STEP.match(text, position)
        if m is None:
            raise api_error(400, "BadRequest", f"unsupported JSONPath {expression!r}")
        position = m.end()
        nxt: list[Any] = []
        for value in current:
            if m["field"] is not None:
                if isinstance(value, dict) and m["field"] in value:
                    nxt.append(value[m["field"]])
            elif m["index"] is not None and isinstance(value, list):
                if m["index"] == "*":
                    nxt.extend(value)
                elif -len(value) <= int(m["index"]) < len(value):
                    nxt.append(value[int(m["index"])])
            elif m["path"] is not None and isinstance(value, list):
                wanted = json.loads(m["value"].replace("'", '"'))
                for item in value:
                    got = jsonpath(item, m["path"])
                    if bool(got and got[0] == wanted) == (m["op"] == "=="):
                        nxt.append(item)
        current = nxt
    return current


def human_duration(seconds: float) -> str:
    """Kubernetes' `duration.HumanDuration` (AGE columns): 5s, 3m10s, 5h, 2d3h, 1y."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes, hours = s // 60, s // 3600
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24 % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def _cell(type_: str, value: Any) -> Any:
    """A table cell as the server's CRD table convertor makes it (None when absent)."""
    if value is None:
        return None
    if type_ == "string":
        return value if isinstance(value, str) else json.dumps(value)
    if type_ == "integer" and isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    if type_ == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if type_ == "boolean" and isinstance(value, bool):
        return value
    if type_ == "date" and isinstance(value, str):
        try:
            moment = datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        except ValueError:
            return "<invalid>"
        return human_duration((datetime.now(UTC) - moment).total_seconds())
    return None


def _unknown_fields(value: Any, schema: JSON, path: str) -> list[str]:
    """Dotted paths of fields in `value` that `schema` (structural) does not declare."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
        "x-kubernetes-int-or-string"
    ):
        return []
    found: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if properties is not None and key in properties:
                found += _unknown_fields(item, properties[key], where)
            elif isinstance(extra, dict):
                found += _unknown_fields(item, extra, where)
            elif properties is not None or extra is False:
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += _unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


#: Map fields of built-in kinds that a real server drops when empty (Go maps with omitempty).
_DROPPED_WHEN_EMPTY = frozenset(
    {"labels", "annotations", "data", "binaryData", "stringData", "nodeSelector"}
)


def builtin_form(value: Any, key: str = "") -> Any:
    """A built-in object as a real server stores it: null fields dropped (nil pointers), empty
    omitempty maps dropped, and pod conditions carrying both timestamps (null when unset, as
    the real server serialises a zero `metav1.Time`)."""
    if isinstance(value, dict):
        out = {
            k: builtin_form(v, k)
            for k, v in value.items()
            if v is not None and not (k in _DROPPED_WHEN_EMPTY and v == {})
        }
        return out
    if isinstance(value, list):
        return [builtin_form(v, key) for v in value]
    return value


def _pod_conditions(pod: JSON) -> None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        condition.setdefault("lastProbeTime", None)
        condition.setdefault("lastTransitionTime", None)


#: What `structural_form` returns for a value the schema prunes.
_PRUNED: Any = object()


def structural_form(value: Any, schema: JSON) -> Any:
    """A custom resource's field as a real server stores it under its structural schema: null
    pruned unless `nullable`, undeclared fields pruned unless preserved, defaults filled in
    objects that are present. Returns `_PRUNED` for a value that is dropped."""
    if value is None:
        return None if schema.get("nullable") else _PRUNED
    if schema.get("x-kubernetes-int-or-string"):
        return value
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        out: JSON = {}
        for key, item in value.items():
            if properties is not None and key in properties:
                sub: JSON | None = properties[key]
            elif isinstance(extra, dict):
                sub = extra
            elif preserve or (properties is None and extra is None):
                out[key] = item
                continue
            else:
                continue  # pruned: the schema does not declare it
            kept = structural_form(item, sub or {})
            if kept is not _PRUNED:
                out[key] = kept
        for key, sub in (properties or {}).items():
            if key not in out and "default" in sub:
                out[key] = structural_form(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [structural_form(item, schema["items"]) for item in value]
    return value


# --- the emulator ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
    """One entry of the watch history."""

    rv: int
    group: str
    plural: str
    type: str  # ADDED, MODIFIED, DELETED
    old: JSON | None
    new: JSON


_BUNDLED: kmock.ResourcesArray | None = None


def _bundled_resources() -> kmock.ResourcesArray:
    global _BUNDLED  # noqa: PLW0603 - parsing the bundled list once per process saves ~20 ms a test
    if _BUNDLED is None:
        _BUNDLED = kmock.ResourcesArray()
        with warnings.catch_warnings():  # kmock 0.8 uses a deprecated importlib.resources call
            warnings.simplefilter("ignore", DeprecationWarning)
            _BUNDLED.load_bundled()
    return _BUNDLED


@attrs.define(kw_only=True)
class KubeAPIEmulator(kmock.KubernetesScaffold):
    """A stateful Kubernetes API server for tests (see the module docstring for the semantics)."""

    #: (group, plural, namespace or "", name) -> object as stored (apiVersion of the first write).
    objects: dict[tuple[str, str, str, str], JSON] = attrs.field(factory=dict, init=False)
    history: deque[Change] = attrs.field(factory=lambda: deque(maxlen=10_000), init=False)
    #: Accepted admin bearer tokens; empty accepts any request (with or without a token).
    tokens: set[str] = attrs.field(factory=set, init=False)
    #: Service-account tokens (`add_service_account_token`, TokenRequest): RBAC applies.
    service_account_tokens: dict[str, BoundToken] = attrs.field(factory=dict, init=False)
    #: How often an idle watch that asked for bookmarks gets one.
    bookmark_interval: float = 1.0
    _rv: int = attrs.field(default=100, init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _changed: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _closing: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _crds: dict[str, list[kmock.resource]] = attrs.field(factory=dict, init=False)
    _gc_tasks: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        bundled = _bundled_resources()
        for res in bundled:
            self.resources[res] = copy.deepcopy(bundled[res])
        self.fallback[self._is_resource_request] << self._serve
        self.fallback["get", re.compile(r"/openapi/v3(/.*)?")] << self._serve_openapi
        for name in ("default", "kube-system", "kube-public"):
            self.put_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    # --- kmock plumbing ------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") != "/api/v1/namespaces":
            return await super().__call__(raw_request)
        # kmock's path parser fails on this one path; build its request without that parser.
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        request = rendering.Request(
            id=len(self._requests),
            method=raw_request.method,
            url=raw_request.url,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode(errors="replace"),
            data=data,
            raw_request=raw_request,
        )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except rendering.StreamingError as exc:  # pragma: no cover - headers already sent
            raise exc.__cause__ or exc from None
        except Exception as exc:
            return await self._render_error(exc)

    async def _serve_version(self, request: rendering.Request) -> Any:
        """kmock's resource discovery, with subresources listed as the real server lists them:
        no short names or categories (else `kubectl get hld` warns of an ambiguity and
        `kubectl get hotload` tries to list `hotloaddeployments/status`)."""
        listing = await super()._serve_version(request)
        for entry in listing.get("resources") or [] if isinstance(listing, dict) else []:
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[], singularName="")
                entry["verbs"] = ["get", "patch", "update"]
                if entry["name"].endswith("/scale"):
                    entry.update(kind="Scale", group="autoscaling", version="v1")
        return listing

    def _namespaced_plurals(self) -> set[str]:
        return {
            res.plural for res in self.resources if self.resources[res].namespaced if res.plural
        }

    def _target(self, request: rendering.Request) -> Target | None:
        return parse_target(request.url.path, self._namespaced_plurals())

    def _is_resource_request(self, request: rendering.Request) -> bool:
        return self._target(request) is not None

    def _info(self, target: Target) -> kmock.ResourceInfo:
        res = kmock.resource(target.group, target.version, target.plural)
        if res not in self.resources:
            raise api_error(
                404,
                "NotFound",
                "the server could not find the requested resource",
                group=target.group,
                kind=target.plural,
            )
        return self.resources[res]

    def add_service_account_token(
        self,
        token: str,
        namespace: str,
        service_account: str,
        pod_name: str | None = None,
        *,
        pod_uid: str | None = None,
        expires: float | None = None,
    ) -> None:
        """Accept `token` as the service account `namespace/service_account`, bound to the pod
        `pod_name` (its name and uid land in `userInfo.extra`), as TokenRequest would issue it.

        Requests with it are refused (401) once the account, or the pod (of `pod_uid`, when
        given), is gone, or after `expires` (a `time.time()`); RBAC applies to them."""
        self.service_account_tokens[token] = BoundToken(
            namespace, service_account, pod_name, pod_uid, expires
        )

    def _authenticate(self, request: rendering.Request) -> UserInfo:
        auth = str(request.headers.get("Authorization", ""))
        token = auth[7:] if auth.startswith("Bearer ") else None
        bound = self.service_account_tokens.get(token) if token else None
        if bound is not None:
            return service_account_user(bound, self.objects, time.time())
        if self.tokens and token not in self.tokens:
            raise api_error(401, "Unauthorized", "Unauthorized")
        return ADMIN

    async def _serve(self, request: rendering.Request) -> Any:
        user = self._authenticate(request)
        target = self._target(request)
        assert target is not None
        method = request.method.value if request.method else "GET"
        params = request.params
        watch = params.get("watch") in ("true", "1")
        verb = request_verb(method, target.name is not None, watch)
        attrs = Attributes(
            verb,
            target.group,
            target.version,
            target.plural,
            target.subresource,
            target.namespace,
            target.name,
        )
        authorize(user, attrs, self.objects)
        info = self._info(target)
        reset = _REQUEST_USER.set(user)
        dry = _DRY_RUN.set(params.get("dryRun") == "All")
        strict = _STRICT.set(params.get("fieldValidation") == "Strict")
        try:
            return await self._serve_as(request, target, info, method, params)
        finally:
            _STRICT.reset(strict)
            _DRY_RUN.reset(dry)
            _REQUEST_USER.reset(reset)

    async def _serve_as(
        self,
        request: rendering.Request,
        target: Target,
        info: kmock.ResourceInfo,
        method: str,
        params: Any,
    ) -> Any:
        if (target.group, target.plural, target.subresource) == ("", "serviceaccounts", "token"):
            if method != "POST" or target.name is None:
                raise api_error(405, "MethodNotAllowed", f"{method} is not allowed on this path")
            token_request = json.loads(request.body) if request.body else {}
            payload = self._token_request(target, token_request)
            return rendering.Response(status=201, payload=payload)
        if target.subresource not in (None, "status", "scale") or (
            target.subresource and target.subresource not in info.subresources
        ):
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        if target.subresource == "scale":
            return rendering.Response(status=200, payload=self._scale(request, target, method))
        if method == "GET" and params.get("watch") in ("true", "1"):
            return rendering.Response(
                status=200,
                headers={"Content-Type": "application/json"},
                payload=self._watch(target, info, params),
            )
        body: Any = None
        if request.body:
            try:
                body = yaml.safe_load(request.body) if "yaml" in _ctype(request) else None
                body = json.loads(request.body) if body is None else body
            except ValueError as exc:
                raise api_error(400, "BadRequest", f"the body is not valid JSON: {exc}") from exc
        status, result = 200, None
        if method == "GET" and target.name is None:
            result = self._list(target, info, params)
        elif method == "GET":
            result = self._present(self._get(target, info), target)
        elif method == "POST" and target.name is None:
            status, result = 201, self._create(target, info, body)
        elif method == "PUT" and target.name is not None:
            result = self._replace(target, info, body)
        elif method == "PATCH" and target.name is not None:
            status, result = self._patch(target, info, body, _ctype(request), params)
        elif method == "DELETE" and target.name is not None:
            policy = (body or {}).get("propagationPolicy") or params.get("propagationPolicy")
            result = self._delete(target, info, policy or "Background")
        else:
            raise api_error(405, "MethodNotAllowed", f"{method} is not allowed on this path")
        if method == "GET" and "as=Table" in str(request.headers.get("Accept", "")):
            table = self._table(target, result)
            if table is not None:
                result = table
        return rendering.Response(status=status, payload=result)

    # --- the store -----------------------------------------------------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, group: str, plural: str, type_: str, old: JSON | None, new: JSON) -> None:
        self.history.append(Change(self._rv, group, plural, type_, old, copy.deepcopy(new)))
        if self.history.maxlen and len(self.history) == self.history.maxlen:
            self._compacted_rv = self.history[0].rv - 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def compact(self) -> None:
        """Forget the watch history, as etcd compaction does: older watches get 410 Gone."""
        self._compacted_rv = self._rv
        self.history.clear()

    def _key(self, target: Target, name: str | None = None) -> tuple[str, str, str, str]:
        return (target.group, target.plural, target.namespace or "", name or target.name or "")

    def _kind(self, info: kmock.ResourceInfo, target: Target) -> str:
        return info.kind or target.plural.capitalize()

    def _present(self, obj: JSON, target: Target) -> JSON:
        shown = copy.deepcopy(obj)
        shown["apiVersion"] = target.api_version
        return shown

    def _get(self, target: Target, info: kmock.ResourceInfo) -> JSON:
        obj = self.objects.get(self._key(target))
        if obj is None:
            raise not_found(target.plural, target.name or "")
        return obj

    def _matcher(self, target: Target, params: Any) -> Any:
        labels = label_matcher(params.get("labelSelector"))
        fields = field_matcher(params.get("fieldSelector"))

        def matches(obj: JSON) -> bool:
            meta = obj.get("metadata") or {}
            if target.namespace is not None and meta.get("namespace") != target.namespace:
                return False
            if target.name is not None and meta.get("name") != target.name:
                return False
            return bool(labels(meta.get("labels") or {}) and fields(obj))

        return matches

    def _list(self, target: Target, info: kmock.ResourceInfo, params: Any) -> JSON:
        matches = self._matcher(target, params)
        items = [
            self._present(obj, target)
            for (group, plural, _, _), obj in sorted(self.objects.items())
            if (group, plural) == (target.group, target.plural) and matches(obj)
        ]
        return {
            "apiVersion": target.api_version,
            "kind": f"{self._kind(info, target)}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def _check_namespace(self, target: Target, info: kmock.ResourceInfo) -> None:
        if info.namespaced and target.namespace is None:
            raise api_error(
                404, "NotFound", "the server could not find the requested resource (namespace)"
            )
        if target.namespace and ("", "namespaces", "", target.namespace) not in self.objects:
            raise not_found("namespaces", target.namespace)

    def _create(self, target: Target, info: kmock.ResourceInfo, body: Any) -> JSON:
        if not isinstance(body, dict):
            raise api_error(400, "BadRequest", "the body must be a JSON object")
        self._check_namespace(target, info)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if target.namespace:
            if meta.get("namespace") not in (None, target.namespace):
                raise api_error(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request",
                )
            meta["namespace"] = target.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        kind = self._kind(info, target)
        if not name:
            raise api_error(
                422,
                "Invalid",
                f"{kind} is invalid: metadata.name: Required value: name or "
                "generateName is required",
            )
        obj["apiVersion"], obj["kind"] = target.api_version, kind
        validate_metadata(obj)
        key = self._key(target, name)
        if key in self.objects:
            raise api_error(
                409, "AlreadyExists", f'{target.plural} "{name}" already exists', name=name
            )
        if "status" in info.subresources:
            obj.pop("status", None)  # status is written through /status only
        if target.plural == "namespaces" and not target.group:
            obj["status"] = {"phase": "Active"}
        meta.pop("resourceVersion", None)
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_rfc3339())
        self._check_fields(target, obj)
        obj = self._stored_form(target, obj)
        meta = obj["metadata"]
        self._admit("CREATE", target, info, obj, None)
        if _DRY_RUN.get():
            return self._present(obj, target)  # validated and admitted; nothing stored
        meta["resourceVersion"] = str(self._next_rv())
        if target.group == CRD_GROUP and target.plural == "customresourcedefinitions":
            self._register_crd(obj)
        self.objects[key] = obj
        self._record(target.group, target.plural, "ADDED", None, obj)
        return self._present(obj, target)

    def _write(self, target: Target, info: kmock.ResourceInfo, old: JSON, new: JSON) -> JSON:
        """Store `new` over `old` with the server's rules for subresources and bookkeeping."""
        new = copy.deepcopy(new)
        has_status = "status" in info.subresources
        if target.subresource == "status" and target.plural == "pods" and not target.group:
            # The pod status strategy resets the spec and owner references only: labels,
            # annotations and finalizers sent with a pods/status write are applied.
            new["spec"] = copy.deepcopy(old.get("spec"))
            new.setdefault("metadata", {})["ownerReferences"] = copy.deepcopy(
                old["metadata"].get("ownerReferences")
            )
        elif target.subresource == "status":
            # Elsewhere (custom resources included) a status write changes status only: spec
            # and metadata come from the stored object.
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
        elif has_status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        meta = new.setdefault("metadata", {})
        old_meta = old["metadata"]
        for field in ("uid", "creationTimestamp", "namespace", "name", "generation"):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        if "deletionTimestamp" in old_meta:
            meta["deletionTimestamp"] = old_meta["deletionTimestamp"]
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        meta["resourceVersion"] = old_meta["resourceVersion"]
        validate_metadata(new)
        if target.subresource is None:
            self._check_fields(target, new)
        new = self._stored_form(target, new)
        meta = new["metadata"]
        self._admit("UPDATE", target, info, new, old)
        if new == old:
            return old  # a no-op write: no new resourceVersion, no event
        if _DRY_RUN.get():
            return new
        if _spec_of(new) != _spec_of(old):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        meta["resourceVersion"] = str(self._next_rv())
        key = self._key(target)
        self.objects[key] = new
        self._record(target.group, target.plural, "MODIFIED", old, new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(key, target.group, target.plural)
        return new

    def _admit(
        self,
        operation: str,
        target: Target,
        info: kmock.ResourceInfo,
        new: JSON | None,
        old: JSON | None,
    ) -> None:
        """Run the validating admission policies on a write that came in over HTTP."""
        user = _REQUEST_USER.get()
        if user is None:
            return  # direct store access and garbage collection are not API requests
        verb = {"CREATE": "create", "UPDATE": "update", "DELETE": "delete"}[operation]
        attrs = Attributes(
            verb,
            target.group,
            target.version,
            target.plural,
            target.subresource,
            target.namespace,
            target.name,
        )
        request = AdmissionRequest(operation, attrs, self._kind(info, target), user, new, old)
        confirm_no_escalation(request, self.objects)
        admit(request, self.objects)

    def _token_request(self, target: Target, body: Any) -> JSON:
        """TokenRequest: a token for the service account, bound to a pod when asked, with the
        real server's checks (the pod exists, runs as that account, and has the given uid)."""
        ns, name = target.namespace or "", target.name or ""
        if ("", "serviceaccounts", ns, name) not in self.objects:
            raise not_found("serviceaccounts", name)
        spec = dict((body or {}).get("spec") or {}) if isinstance(body, dict) else {}
        seconds = int(spec.get("expirationSeconds") or 3600)
        if seconds < 600:
            raise api_error(
                422,
                "Invalid",
                f'TokenRequest.authentication.k8s.io "{name}" is invalid: spec.expirationSeconds: '
                f"Invalid value: {seconds}: may not specify a duration less than 10 minutes",
            )
        ref = spec.get("boundObjectRef")
        pod_name = pod_uid = None
        if ref:
            if (ref.get("apiVersion"), ref.get("kind")) != ("v1", "Pod"):
                raise api_error(
                    400,
                    "BadRequest",
                    f"cannot bind token to object of type {ref.get('apiVersion')}, "
                    f"Kind={ref.get('kind')} (the emulator binds to pods only)",
                )
            pod_name = str(ref.get("name", ""))
            pod = self.objects.get(("", "pods", ns, pod_name))
            if pod is None:
                raise not_found("pods", pod_name)
            if ((pod.get("spec") or {}).get("serviceAccountName") or "default") != name:
                raise api_error(
                    400,
                    "BadRequest",
                    f'cannot bind token for serviceaccount "{name}" to pod running with '
                    "different serviceaccount name.",
                )
            pod_uid = str(pod["metadata"]["uid"])
            if ref.get("uid") and ref["uid"] != pod_uid:
                raise api_error(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on Pod "{pod_name}": the UID in the bound '
                    f"object reference ({ref['uid']}) does not match the UID in record. The "
                    "object might have been deleted and then recreated",
                )
            spec["boundObjectRef"] = {**ref, "uid": pod_uid}
        token = f"emulated-sa-{uuid.uuid4().hex}"
        expires = time.time() + seconds
        self.add_service_account_token(token, ns, name, pod_name, pod_uid=pod_uid, expires=expires)
        spec["expirationSeconds"] = seconds
        spec.setdefault("audiences", ["https://kubernetes.default.svc.cluster.local"])
        return {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": None},
            "spec": spec,
            "status": {
                "token": token,
                "expirationTimestamp": datetime.fromtimestamp(expires, UTC).strftime(
                    "%Y-%m-%dT%H:%M:%SZ"
                ),
            },
        }

    def _replace(self, target: Target, info: kmock.ResourceInfo, body: Any) -> JSON:
        if not isinstance(body, dict):
            raise api_error(400, "BadRequest", "the body must be a JSON object")
        old = self._get(target, info)
        meta = body.get("metadata") or {}
        if meta.get("name") not in (None, target.name):
            raise api_error(400, "BadRequest", "the name of the object does not match the URL")
        rv = meta.get("resourceVersion")
        if not rv:
            raise api_error(
                422,
                "Invalid",
                f'{self._kind(info, target)} "{target.name}" is invalid: '
                "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
            )
        self._precondition(target, old, rv)
        return self._present(self._write(target, info, old, body), target)

    def _precondition(self, target: Target, old: JSON, rv: Any) -> None:
        if rv is not None and str(rv) != old["metadata"]["resourceVersion"]:
            raise api_error(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {target.plural} "{target.name}": the object '
                "has been modified; please apply your changes to the latest version and try again",
                name=target.name,
            )

    def _patch(
        self, target: Target, info: kmock.ResourceInfo, body: Any, ctype: str, params: Any
    ) -> tuple[int, JSON]:
        key = self._key(target)
        if "apply-patch" in ctype and key not in self.objects:
            user = _REQUEST_USER.get()
            if user is not None:
                # An apply that creates the object is authorized as a create as well.
                attrs = Attributes(
                    "create",
                    target.group,
                    target.version,
                    target.plural,
                    None,
                    target.namespace,
                    target.name,
                )
                authorize(user, attrs, self.objects)
            create = Target(
                target.group, target.version, target.plural, target.namespace, None, None
            )
            return 201, self._create(create, info, body)
        old = self._get(target, info)
        if "json-patch" in ctype:
            try:
                new = jsonpatch.apply_patch(old, body)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise api_error(422, "Invalid", f"the server rejected our request: {exc}") from exc
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise api_error(422, "Invalid", f"invalid JSON patch: {exc}") from exc
        elif not isinstance(body, dict):
            raise api_error(400, "BadRequest", "a merge patch must be a JSON object")
        elif "strategic-merge-patch" in ctype:
            if any(target.api_version == v for vs in self._crds.values() for v in _gvs(vs)):
                raise api_error(
                    415,
                    "UnsupportedMediaType",
                    "strategic merge patch is not supported for custom resources",
                )
            self._precondition(target, old, (body.get("metadata") or {}).get("resourceVersion"))
            new = strategic_merge(old, body)
        elif "merge-patch" in ctype or "apply-patch" in ctype:
            self._precondition(target, old, (body.get("metadata") or {}).get("resourceVersion"))
            new = merge_patch(old, body)
        else:
            raise api_error(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
        return 200, self._present(self._write(target, info, old, new), target)

    def _delete(self, target: Target, info: kmock.ResourceInfo, policy: str) -> JSON:
        key = self._key(target)
        obj = self._get(target, info)
        self._admit("DELETE", target, info, None, obj)
        if _DRY_RUN.get():
            return self._present(obj, target)
        meta = obj["metadata"]
        if policy == "Foreground":
            self._collect(meta["uid"], orphan=False)
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                new["metadata"]["resourceVersion"] = str(self._next_rv())
                self.objects[key] = new
                self._record(target.group, target.plural, "MODIFIED", obj, new)
                obj = new
            return self._present(obj, target)
        removed = self._remove(key, target.group, target.plural, orphan=policy == "Orphan")
        return self._present(removed, target)

    def _remove(
        self, key: tuple[str, str, str, str], group: str, plural: str, orphan: bool = False
    ) -> JSON:
        obj = copy.deepcopy(self.objects.pop(key))
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._record(group, plural, "DELETED", None, obj)
        if group == CRD_GROUP and plural == "customresourcedefinitions":
            self._unregister_crd(obj)
        if group == "" and plural == "namespaces":
            for other in [k for k in self.objects if k[2] == key[3]]:
                if other in self.objects:
                    self._remove(other, other[0], other[1])
        uid = obj["metadata"]["uid"]
        # Background propagation: dependents go after the owner, as the garbage collector does.
        task = asyncio.get_running_loop().create_task(self._collect_later(uid, orphan))
        self._gc_tasks.add(task)
        task.add_done_callback(self._gc_tasks.discard)
        return obj

    async def _collect_later(self, uid: str, orphan: bool) -> None:
        await asyncio.sleep(0)
        self._collect(uid, orphan)

    def _collect(self, uid: str, orphan: bool) -> None:
        """Delete (or orphan) the objects owned by `uid` once no other live owner remains."""
        live = {o["metadata"]["uid"] for o in self.objects.values()}
        for key, obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if key not in self.objects or not any(r.get("uid") == uid for r in refs):
                continue
            remaining = [r for r in refs if r.get("uid") != uid and r.get("uid") in live]
            if remaining or orphan:
                new = copy.deepcopy(obj)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                if not new["metadata"]["ownerReferences"]:
                    del new["metadata"]["ownerReferences"]
                new["metadata"]["resourceVersion"] = str(self._next_rv())
                self.objects[key] = new
                self._record(key[0], key[1], "MODIFIED", obj, new)
            elif obj["metadata"].get("finalizers"):
                if not obj["metadata"].get("deletionTimestamp"):
                    new = copy.deepcopy(obj)
                    new["metadata"]["deletionTimestamp"] = now_rfc3339()
                    new["metadata"]["resourceVersion"] = str(self._next_rv())
                    self.objects[key] = new
                    self._record(key[0], key[1], "MODIFIED", obj, new)
            else:
                self._remove(key, key[0], key[1])

    async def settle(self) -> None:
        """Wait until background garbage collection has finished."""
        while self._gc_tasks:
            await asyncio.gather(*list(self._gc_tasks))

    # --- what kubectl needs: field validation, tables, OpenAPI, scale ---------------------------

    def _scale(self, request: rendering.Request, target: Target, method: str) -> JSON:
        """The scale subresource of a custom resource (`kubectl scale`, autoscalers): an
        `autoscaling/v1` Scale read from and written to the CRD's replica paths."""
        version = self._crd_version(target.group, target.plural, target.version) or {}
        paths = (version.get("subresources") or {}).get("scale") or {}
        main = Target(
            target.group, target.version, target.plural, target.namespace, target.name, None
        )
        info = self._info(main)
        obj = self._get(main, info)

        def scale_of(obj: JSON) -> JSON:
            replicas = jsonpath(obj, paths.get("specReplicasPath", ".spec.replicas"))
            current = jsonpath(obj, paths.get("statusReplicasPath", ".status.replicas"))
            selector = (
                jsonpath(obj, paths["labelSelectorPath"]) if "labelSelectorPath" in paths else []
            )
            meta = obj["metadata"]
            return {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {
                    k: meta[k]
                    for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                    if k in meta
                },
                "spec": {"replicas": replicas[0] if replicas else 0},
                "status": {
                    "replicas": current[0] if current else 0,
                    **({"selector": selector[0]} if selector else {}),
                },
            }

        if method == "GET":
            return scale_of(obj)
        body = json.loads(request.body) if request.body else {}
        if method == "PUT":
            self._precondition(main, obj, (body.get("metadata") or {}).get("resourceVersion"))
            wanted = body
        elif method == "PATCH" and "json-patch" not in _ctype(request):
            wanted = merge_patch(scale_of(obj), body)
        else:
            raise api_error(405, "MethodNotAllowed", f"{method} is not supported on scale here")
        replicas = (wanted.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise api_error(422, "Invalid", f"Scale.spec.replicas: Invalid value: {replicas!r}")
        field = paths.get("specReplicasPath", ".spec.replicas").lstrip(".").split(".")
        new = copy.deepcopy(obj)
        node = new
        for key in field[:-1]:
            node = node.setdefault(key, {})
        node[field[-1]] = replicas
        return scale_of(self._write(main, info, obj, new))

    def _crd_version(self, group: str, plural: str, version: str) -> JSON | None:
        """The `spec.versions[]` entry of the CRD serving `group/version` `plural`, if any."""
        for (g, p, _, _), crd in self.objects.items():
            spec = crd.get("spec") or {}
            if (g, p) != (CRD_GROUP, "customresourcedefinitions") or spec.get("group") != group:
                continue
            if (spec.get("names") or {}).get("plural") != plural:
                continue
            for entry in spec.get("versions") or []:
                if entry.get("name") == version:
                    return dict(entry)
        return None

    def _stored_form(self, target: Target, obj: JSON) -> JSON:
        """`obj` as the real server would store it: custom resources pruned and defaulted by
        their structural schema, built-in kinds without nulls and empty omitempty maps."""
        meta = builtin_form(obj.get("metadata") or {})
        version = self._crd_version(target.group, target.plural, target.version)
        schema = ((version or {}).get("schema") or {}).get("openAPIV3Schema")
        if schema:
            body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
            pruned = structural_form(body, schema)
            return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": meta} | {
                k: v for k, v in pruned.items() if k not in ("apiVersion", "kind", "metadata")
            }
        out = builtin_form(obj)
        out["metadata"] = meta
        if target.plural == "pods" and not target.group:
            _pod_conditions(out)
        return dict(out)

    def _check_fields(self, target: Target, obj: JSON) -> None:
        """`fieldValidation=Strict` on a custom resource: fields its CRD's schema does not
        declare are refused as the real server refuses them (400, strict decoding error).
        Built-in kinds carry no schema here and are not checked."""
        if not _STRICT.get():
            return
        version = self._crd_version(target.group, target.plural, target.version)
        schema = ((version or {}).get("schema") or {}).get("openAPIV3Schema")
        if not schema:
            return
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        unknown = _unknown_fields(body, schema, "")
        if unknown:
            kind = obj.get("kind", target.plural)
            raise api_error(
                400,
                "BadRequest",
                f'{kind} in version "{target.version}" cannot be handled as a {kind}: strict '
                "decoding error: " + ", ".join(f'unknown field "{f}"' for f in unknown),
            )

    def _table(self, target: Target, result: JSON) -> JSON | None:
        """A `meta.k8s.io/v1` Table of a custom resource list or object, with the CRD's printer
        columns (or Name and Age when it declares none), as the server converts them for
        `kubectl get`. Built-in kinds keep their JSON (their server-side printers are not
        emulated)."""
        version = self._crd_version(target.group, target.plural, target.version)
        if version is None:
            return None
        columns = version.get("additionalPrinterColumns")
        if columns is None:
            columns = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        definitions = [
            {
                "name": "Name",
                "type": "string",
                "format": "name",
                "description": "Name must be unique within a namespace.",
                "priority": 0,
            }
        ] + [
            {
                "name": c["name"],
                "type": c.get("type", "string"),
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": int(c.get("priority", 0)),
            }
            for c in columns
        ]
        items = result.get("items") if "items" in result else [result]
        rows = []
        for obj in items or []:
            cells: list[Any] = [obj["metadata"]["name"]]
            for column in columns:
                found = jsonpath(obj, column["jsonPath"])
                cells.append(_cell(column.get("type", "string"), found[0] if found else None))
            meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
            rows.append(
                {
                    "cells": cells,
                    "object": {
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": meta,
                    },
                }
            )
        rv = (result.get("metadata") or {}).get("resourceVersion", str(self._rv))
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": rv},
            "columnDefinitions": definitions,
            "rows": rows,
        }

    async def _serve_openapi(self, request: rendering.Request) -> Any:
        """OpenAPI v3 as far as kubectl reads it: the index of group versions, and per group
        version its paths (PATCH declaring `fieldValidation`, so kubectl leaves validation to
        the server) and the schemas of its custom resources (`kubectl explain`)."""
        path = request.url.path.rstrip("/")
        versions: dict[str, list[tuple[kmock.resource, kmock.ResourceInfo]]] = {}
        for res in self.resources:
            if not res.plural or "/" in res.plural:
                continue
            key = f"apis/{res.group}/{res.version}" if res.group else f"api/{res.version}"
            versions.setdefault(key, []).append((res, self.resources[res]))
        if path == "/openapi/v3":
            return {
                "paths": {
                    key: {"serverRelativeURL": f"/openapi/v3/{key}?hash={self._rv}"}
                    for key in sorted(versions)
                }
            }
        key = path.removeprefix("/openapi/v3/")
        if key not in versions:
            raise api_error(404, "NotFound", f"the server could not find {path}")
        paths: JSON = {}
        schemas: JSON = {}
        for res, info in versions[key]:
            gvk = {"group": res.group, "version": res.version, "kind": info.kind}
            scope = "namespaces/{namespace}/" if info.namespaced else ""
            params = [
                {"name": n, "in": "query", "schema": {"type": "string"}}
                for n in ("dryRun", "fieldManager", "fieldValidation", "force")
            ]
            paths[f"/{key}/{scope}{res.plural}/{{name}}"] = {
                "patch": {
                    "operationId": f"patch{info.kind}",
                    "parameters": params,
                    "x-kubernetes-action": "patch",
                    "x-kubernetes-group-version-kind": gvk,
                }
            }
            version = self._crd_version(res.group, res.plural, res.version)
            schema = ((version or {}).get("schema") or {}).get("openAPIV3Schema")
            if schema:
                name = ".".join(reversed(res.group.split("."))) + f".{res.version}.{info.kind}"
                schemas[name] = {**schema, "x-kubernetes-group-version-kind": [gvk]}
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "v1.30.0"},
            "paths": paths,
            "components": {"schemas": schemas},
        }

    # --- CRDs ----------------------------------------------------------------------------------

    def _register_crd(self, crd: JSON) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        group, plural = spec.get("group"), names.get("plural")
        if not group or not plural or not names.get("kind"):
            raise api_error(422, "Invalid", "spec.group, spec.names.plural and kind are required")
        registered = []
        for version in spec.get("versions") or []:
            if not version.get("served", True):
                continue
            res = kmock.resource(group, version["name"], plural)
            self.resources[res] = kmock.ResourceInfo(
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                subresources={"status", "scale"} & set(version.get("subresources") or {}),
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
            registered.append(res)
        self._crds[crd["metadata"]["name"]] = registered
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "lastTransitionTime": now_rfc3339()}
                for t, r in (
                    ("NamesAccepted", "NoConflicts"),
                    ("Established", "InitialNamesAccepted"),
                )
            ],
        }

    def _unregister_crd(self, crd: JSON) -> None:
        for res in self._crds.pop(crd["metadata"]["name"], []):
            del self.resources[res]
            for key in [k for k in self.objects if (k[0], k[1]) == (res.group, res.plural)]:
                self._remove(key, key[0], key[1])

    # --- watches -------------------------------------------------------------------------------

    async def _watch(self, target: Target, info: kmock.ResourceInfo, params: Any) -> Any:
        yield b""  # send the headers now: a quiet watch must still look open to the client
        matches = self._matcher(
            Target(target.group, target.version, target.plural, target.namespace, None, None),
            params,
        )
        name_filter = target.name
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        rv = params.get("resourceVersion") or "0"
        if rv == "0":
            cursor = self._rv
            for (group, plural, _, name), obj in sorted(self.objects.items()):
                same = (group, plural) == (target.group, target.plural)
                if same and matches(obj) and name_filter in (None, name):
                    yield {"type": "ADDED", "object": self._present(obj, target)}
        else:
            cursor = int(rv)
            if cursor < self._compacted_rv:
                yield {
                    "type": "ERROR",
                    "object": {
                        "apiVersion": "v1",
                        "kind": "Status",
                        "status": "Failure",
                        "code": 410,
                        "reason": "Expired",
                        "message": f"too old resource version: {cursor} ({self._compacted_rv})",
                    },
                }
                return
        while not self._closing.is_set():
            changed = self._changed
            for change in list(self.history):
                if change.rv <= cursor:
                    continue
                cursor = change.rv
                if (change.group, change.plural) != (target.group, target.plural):
                    continue
                if name_filter and change.new["metadata"].get("name") != name_filter:
                    continue
                event = _watch_event(change, matches)
                if event is not None:
                    yield {"type": event, "object": self._present(change.new, target)}
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return
            wait = min(x for x in (left, self.bookmark_interval if bookmarks else None, 3600) if x)
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                done, _ = await asyncio.wait(
                    [asyncio.ensure_future(changed.wait()), closing],
                    timeout=wait,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                closing.cancel()
            if not done and bookmarks:
                yield {
                    "type": "BOOKMARK",
                    "object": {
                        "apiVersion": target.api_version,
                        "kind": self._kind(info, target),
                        "metadata": {"resourceVersion": str(self._rv)},
                    },
                }

    # --- direct access for tests ---------------------------------------------------------------

    def _target_of(self, api_version: str, plural: str, namespace: str | None, name: str) -> Target:
        group, _, version = api_version.rpartition("/")
        return Target(group, version, plural, namespace, name, None)

    def plural_of(self, api_version: str, kind: str) -> str:
        """The plural the API serves `kind` under (from discovery, CRDs included)."""
        group, _, version = api_version.rpartition("/")
        for res in self.resources:
            if (res.group, res.version) == (group, version) and self.resources[res].kind == kind:
                return str(res.plural)
        raise KeyError(f"{api_version} {kind} is not served")

    def get_object(
        self, api_version: str, plural: str, name: str, namespace: str | None = None
    ) -> JSON | None:
        """The stored object, or None."""
        target = self._target_of(api_version, plural, namespace, name)
        obj = self.objects.get(self._key(target))
        return None if obj is None else self._present(obj, target)

    def put_object(self, obj: JSON) -> JSON:
        """Store `obj` as it is, status included (create or overwrite), with watch events."""
        api_version, meta = obj["apiVersion"], obj["metadata"]
        target = self._target_of(
            api_version,
            self.plural_of(api_version, obj["kind"]),
            meta.get("namespace"),
            meta["name"],
        )
        key = self._key(target)
        old = self.objects.get(key)
        new = copy.deepcopy(obj)
        new_meta = new["metadata"]
        new_meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
        new_meta.setdefault(
            "creationTimestamp", old["metadata"]["creationTimestamp"] if old else now_rfc3339()
        )
        new_meta.setdefault("generation", old["metadata"].get("generation", 1) if old else 1)
        new_meta["resourceVersion"] = str(self._next_rv())
        if target.group == CRD_GROUP and target.plural == "customresourcedefinitions":
            self._register_crd(new)
        self.objects[key] = new
        self._record(target.group, target.plural, "MODIFIED" if old else "ADDED", old, new)
        return self._present(new, target)

    def remove_object(
        self, api_version: str, plural: str, name: str, namespace: str | None = None
    ) -> None:
        """Delete an object at once (finalizers ignored); dependents follow in the background."""
        target = self._target_of(api_version, plural, namespace, name)
        if self._key(target) in self.objects:
            self._remove(self._key(target), target.group, target.plural)

    def close_watches(self) -> None:
        """End every open watch (before the server stops, so that it stops at once)."""
        self._closing.set()

    def reopen(self) -> None:
        """Accept watches again after `close_watches`."""
        self._closing = asyncio.Event()


def _ctype(request: rendering.Request) -> str:
    return str(request.headers.get("Content-Type", "application/json")).lower()


def _gvs(resources: list[kmock.resource]) -> Iterator[str]:
    for res in resources:
        yield f"{res.group}/{res.version}"


def _spec_of(obj: JSON) -> JSON:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _watch_event(change: Change, matches: Any) -> str | None:
    new_ok = matches(change.new)
    if change.type == "MODIFIED":
        old_ok = change.old is not None and matches(change.old)
        if old_ok and new_ok:
            return "MODIFIED"
        if new_ok:
            return "ADDED"
        return "DELETED" if old_ok else None
    return change.type if new_ok else None


# --- the fixture's interface -----------------------------------------------------------------


class Store:
    """Direct object access for tests: the emulator's memory, or API calls on a real cluster."""

    def __init__(self, emulator: KubeAPIEmulator | None, client: KubeClient) -> None:
        self._emulator = emulator
        self._client = client

    async def get(
        self, api_version: str, plural: str, name: str, namespace: str | None = None
    ) -> JSON | None:
        """The object, or None."""
        if self._emulator is not None:
            return self._emulator.get_object(api_version, plural, name, namespace)
        try:
            return await self._client.get(resource_path(api_version, plural, namespace, name))
        except KubeNotFoundError:
            return None

    async def put(self, obj: JSON, plural: str | None = None) -> JSON:
        """Create or overwrite `obj`, status included."""
        if self._emulator is not None:
            return self._emulator.put_object(obj)
        plural = plural or _guess_plural(obj["kind"])
        meta = obj["metadata"]
        api, ns, name = obj["apiVersion"], meta.get("namespace"), meta["name"]
        existing = await self.get(api, plural, name, ns)
        if existing is None:
            stored = await self._client.create(resource_path(api, plural, ns), obj)
        else:
            body = copy.deepcopy(obj)
            body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
            stored = await self._client.replace(resource_path(api, plural, ns, name), body)
        if "status" in obj:
            body = copy.deepcopy(stored)
            body["status"] = obj["status"]
            try:
                path = resource_path(api, plural, ns, name, "status")
                stored = await self._client.replace(path, body)
            except KubeNotFoundError:
                pass  # the kind has no status subresource: the main write carried it
        return stored

    async def delete(
        self, api_version: str, plural: str, name: str, namespace: str | None = None
    ) -> None:
        """Delete the object if it exists."""
        if self._emulator is not None:
            self._emulator.remove_object(api_version, plural, name, namespace)
            return
        with contextlib.suppress(KubeNotFoundError):
            await self._client.delete(resource_path(api_version, plural, namespace, name))

    async def list(self, api_version: str, plural: str, namespace: str | None = None) -> list[JSON]:
        """All objects of a kind (in `namespace`, or everywhere)."""
        result = await self._client.list(resource_path(api_version, plural, namespace))
        return list(result["items"])


def _guess_plural(kind: str) -> str:
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    return lower[:-1] + "ies" if lower.endswith("y") else lower + "s"


@dataclasses.dataclass
class KubeAPI:
    """What a Kubernetes test needs: where the API is and a fresh namespace to work in."""

    url: str
    kubeconfig: Path
    namespace: str
    config: KubeConfig
    store: Store
    #: The emulator, or None on a real cluster (skip emulator-only tests then).
    emulator: KubeAPIEmulator | None = None
    #: The session's lane on a real cluster (None on the emulator).
    lane: Lane | None = None
    _server: kmock.Server | None = None
    _port: int = 0

    def client(self, **options: Any) -> KubeClient:
        """A new client for this API (use it as an async context manager)."""
        return KubeClient(self.config, **options)

    async def service_account_config(
        self,
        service_account: str,
        pod: str | None = None,
        *,
        namespace: str | None = None,
        expiration_seconds: int = 3600,
    ) -> KubeConfig:
        """Settings that authenticate as `service_account` (created when missing) with a token
        from the TokenRequest API, bound to `pod` when given (the pod must run as that account),
        as the kubelet mounts it: the same calls on the emulator and on a real cluster."""
        ns = namespace or self.namespace
        account = resource_path("v1", "serviceaccounts", ns, service_account)
        async with self.client() as kube:
            try:
                await kube.get(account)
            except KubeNotFoundError:
                body = {"metadata": {"name": service_account}}
                await kube.create(resource_path("v1", "serviceaccounts", ns), body)
            spec: JSON = {"expirationSeconds": expiration_seconds}
            if pod is not None:
                uid = (await kube.get(resource_path("v1", "pods", ns, pod)))["metadata"]["uid"]
                spec["boundObjectRef"] = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod,
                    "uid": uid,
                }
            request = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": spec,
            }
            answer = await kube.create(f"{account}/token", request)
        # Only the token authenticates: the admin's client certificate would win over it.
        return dataclasses.replace(
            self.config,
            namespace=ns,
            token=str(answer["status"]["token"]),
            token_file=None,
            client_cert_data=None,
            client_cert_file=None,
            client_key_data=None,
            client_key_file=None,
            source=f"service account {ns}/{service_account}",
            _token_cache=None,
        )

    async def service_account_kubeconfig(
        self, path: Path, service_account: str, pod: str | None = None, **options: Any
    ) -> Path:
        """`service_account_config` as a kubeconfig file at `path` (for subprocesses)."""
        config = await self.service_account_config(service_account, pod, **options)
        return write_kubeconfig(
            path,
            config.server,
            config.namespace,
            config.token,
            ca_data=config.ca_data,
            ca_file=config.ca_file,
            insecure=config.insecure_skip_tls_verify,
        )

    async def owners_collectable(self) -> None:
        """Wait until deleting a hotload object deletes what it owns: a real cluster's garbage
        collector learns a new kind up to 30 s after its CRD appears (`support.cluster`); the
        emulator collects at once."""
        if self.lane is None:
            return
        if not await asyncio.to_thread(self.lane.collector_ready.wait, 240):
            raise AssertionError(
                "the cluster's garbage collector never deleted what a hotload object owned"
            )

    async def stop(self) -> None:
        """Take the emulated API server down (an outage); `start()` brings it back."""
        if self.emulator is None or self._server is None:
            raise RuntimeError("outages need the emulator: take the kube_emulator fixture")
        self.emulator.close_watches()
        await self._server.__aexit__(None, None, None)
        self._server = None

    async def start(self) -> None:
        """Bring a stopped emulator back on the same port, with its objects as they were."""
        assert self.emulator is not None and self._server is None
        self.emulator.reopen()
        self._server = kmock.Server(self.emulator, port=self._port)
        await self._server.__aenter__()


def write_kubeconfig(
    path: Path,
    server: str,
    namespace: str,
    token: str | None,
    *,
    ca_data: str | None = None,
    ca_file: str | None = None,
    insecure: bool = False,
) -> Path:
    """Write a one-context kubeconfig for `server` (CA: PEM text or a file); return its path."""
    user: JSON = {"token": token} if token else {}
    cluster: JSON = {"server": server}
    if ca_data:
        cluster["certificate-authority-data"] = base64.b64encode(ca_data.encode()).decode()
    elif ca_file:
        cluster["certificate-authority"] = ca_file
    if insecure:
        cluster["insecure-skip-tls-verify"] = True
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": "test", "user": user}],
        "contexts": [
            {"name": "test", "context": {"cluster": "test", "user": "test", "namespace": namespace}}
        ],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


#: Server URLs of the emulators running now (see `emulated`).
EMULATED_SERVERS: set[str] = set()


def emulated(kube: KubeClient) -> bool:
    """Whether `kube` talks to an emulator of this module (no controllers, no scheduler)."""
    return kube.config.server in EMULATED_SERVERS


#: Where the session's lane is kept for the summary line.
LANE_KEY = pytest.StashKey[Lane]()


def pytest_report_header() -> str:
    """Say up front which API server the Kubernetes tests will talk to."""
    return f"kubernetes lane: {planned_lane()}"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line in the summary: which API server the Kubernetes tests ran against."""
    lane = config.stash.get(LANE_KEY, None)
    if lane is not None:
        terminalreporter.write_line(lane.summary)


@pytest.fixture(scope="session")
def kube_lane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lane]:
    """The session's Kubernetes API lane (see `support.cluster`); a real control plane is
    started on first use and stopped when the session ends."""
    try:
        with session_lane(tmp_path_factory.mktemp("k8s")) as lane:
            request.config.stash[LANE_KEY] = lane
            yield lane
    except LaneError as err:
        pytest.fail(str(err), pytrace=False)


@pytest_asyncio.fixture
async def kube_api(kube_lane: Lane, tmp_path: Path) -> AsyncIterator[KubeAPI]:
    """A Kubernetes API with a fresh namespace: the session's real API server, else the
    emulator (see `support.cluster` for how the lane is chosen)."""
    if kube_lane.kubeconfig is None:
        async with emulated_api(tmp_path) as api:
            yield api
        return
    async with real_api(kube_lane, tmp_path) as api:
        yield api


@pytest_asyncio.fixture
async def kube_emulator(tmp_path: Path) -> AsyncIterator[KubeAPI]:
    """The emulator in every lane: for what a real server cannot be made to do on demand
    (outages, injected errors, compaction, token checks)."""
    async with emulated_api(tmp_path) as api:
        yield api


@pytest_asyncio.fixture
async def real_kube_api(kube_lane: Lane, tmp_path: Path) -> AsyncIterator[KubeAPI]:
    """A real API server only: for server behaviour the emulator does not reproduce
    (server-side apply's managed fields and conflicts). Skipped on the emulator lane, which
    only a clone without ../shared/k8s uses (tests/README.md)."""
    if kube_lane.kubeconfig is None:
        pytest.skip(
            "needs a real API server (../shared/k8s/cluster.sh or $HOTLOAD_E2E_KUBECONFIG): "
            "the emulator does not reproduce this server behaviour (CRD validation rules, "
            "validation of built-in kinds, server-side apply's managed fields, tokens it issues)"
        )
    async with real_api(kube_lane, tmp_path) as api:
        yield api


@contextlib.asynccontextmanager
async def real_api(lane: Lane, tmp_path: Path) -> AsyncIterator[KubeAPI]:
    """A fresh namespace on a real API server, deleted afterwards; the kubeconfig handed to
    the test defaults to that namespace, as the emulator's does."""
    assert lane.kubeconfig is not None
    namespace = f"hotload-test-{uuid.uuid4().hex[:8]}"
    own = namespaced_kubeconfig(lane.kubeconfig, namespace, tmp_path / "kubeconfig")
    config = KubeConfig.from_kubeconfig(own)
    async with KubeClient(config) as client:
        await client.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
        try:
            yield KubeAPI(config.server, own, namespace, config, Store(None, client), lane=lane)
        finally:
            with contextlib.suppress(KubeNotFoundError):
                await client.delete(f"/api/v1/namespaces/{namespace}")


@contextlib.asynccontextmanager
async def emulated_api(tmp_path: Path) -> AsyncIterator[KubeAPI]:
    """The emulator on a free port with a fresh namespace."""
    namespace = f"hotload-test-{uuid.uuid4().hex[:8]}"
    async with KubeAPIEmulator() as emulator:
        emulator.put_object(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
        server = kmock.Server(emulator)
        await server.__aenter__()
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url, namespace, "test-token")
        config = KubeConfig.from_kubeconfig(kubeconfig)
        api = KubeAPI(url, kubeconfig, namespace, config, Store(emulator, KubeClient(config)))
        api.emulator, api._server, api._port = emulator, server, server.port
        EMULATED_SERVERS.add(url)
        try:
            yield api
        finally:
            EMULATED_SERVERS.discard(url)
            await api.store._client.aclose()
            await emulator.settle()
            if api._server is not None:
                await api.stop()
