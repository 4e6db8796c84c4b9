"""`docs/crds.md`, the field reference of the CRDs: names, printer columns, rules and one
table row per field of spec and status, taken from the generated schemas (so from the
models' descriptions)."""

from __future__ import annotations

import json
from typing import Any

from hotload.api import names
from hotload.api.crd_kinds import HEADER, WRITE_COMMAND
from hotload.api.crd_schema import Schema


def render_docs(crds: dict[str, dict[str, Any]]) -> str:
    """The field reference `docs/crds.md`: names, printer columns and one table row per field
    of spec and status, taken from the generated schemas (so from the models' descriptions)."""
    out = [
        "# Custom resources",
        "",
        HEADER.removeprefix("# ").replace("Generated", "<!-- Generated").rstrip() + " -->",
        "",
        f"hotload adds two namespaced kinds in the API group `{names.GROUP}`, version "
        f"`{names.VERSION}`: a platform team declares a **HotLoadDeployment** (a fleet of "
        "inference replicas following one ledger of policy snapshots), and a trainer creates "
        "a **Snapshot** for every snapshot it publishes into the deployment's bucket. "
        f"`kubectl get {names.CATEGORY}` lists both.",
        "",
        "Install the CRDs from a checkout with `kubectl apply -f crds/`, or from the installed "
        "package with `hotload crds generate | kubectl apply -f -`.",
        "",
        "## Regenerating",
        "",
        "The pydantic models in `hotload/api/models.py` are the single source of truth; "
        "`crds/*.yaml` and this page are generated from them. After changing a model, run "
        "from the repository root:",
        "",
        "```sh",
        WRITE_COMMAND + "    # or: hotload crds generate --out crds",
        "python -m hotload.api.crds --check    # or: hotload crds check; exit 1 when stale",
        "```",
        "",
        "`tests/test_api.py` fails while a committed file differs from the generated one, and "
        "validates the CRDs as an API server would (structural schema, defaults, examples).",
        "",
        "## Examples",
        "",
        "Only `spec.bucket.url` and `spec.engine.image` of a HotLoadDeployment and "
        "`spec.deployment` and `spec.identity` of a Snapshot are required; every other field "
        "is optional or has a default (tables below; `kubectl explain hotloaddeployment.spec` "
        "shows the same descriptions).",
        "",
        "```yaml",
        _EXAMPLES.strip(),
        "```",
        "",
        f"`Snapshot.spec` cannot change once created: publish a new snapshot instead. "
        f"`kubectl get {names.CATEGORY}` lists every kind, and the scale subresource lets "
        f"`kubectl scale {names.DEPLOYMENT_SHORT}/grpo --replicas 8` (or an autoscaler) resize "
        "a fleet.",
    ]
    out += _POD_TEMPLATE_DOCS
    for kind, crd in crds.items():
        out += _kind_docs(kind, crd)
    return "\n".join(out) + "\n"


_POD_TEMPLATE_DOCS = [
    "",
    "## The replicas' pod and `spec.podTemplate`",
    "",
    "The operator builds each replica's pod (the loader as a native sidecar, the engine, for "
    "vLLM and SGLang the engine front, their volumes, the readiness gate) and lays it over "
    "`spec.podTemplate`, which lies over secure defaults. Objects merge field by field; lists "
    "of named items merge by name "
    "(`containers`, `initContainers`, `volumes`, `env`, `imagePullSecrets`), `volumeMounts` by "
    "`mountPath`, `ports` by `containerPort`; any other list is replaced. So the template can "
    "set everything the operator leaves alone (`affinity`, `topologySpreadConstraints`, "
    "`priorityClassName`, `runtimeClassName`, `hostIPC`, `dnsConfig`, ...) and add containers, "
    "volumes, mounts and environment variables. The API server validates the merged pod when "
    "the operator applies the Deployment; a refusal shows as `Degraded=True`, `InvalidSpec`.",
    "",
    "| part of the pod | who wins |",
    "| --- | --- |",
    "| labels `app.kubernetes.io/*`, `hotload.dev/deployment`, `hotload.dev/component`; "
    "annotation `hotload.dev/template-hash` | the operator (selectors depend on them); other "
    "labels and annotations come from the template |",
    "| `serviceAccountName`, `readinessGates`, `terminationGracePeriodSeconds` | the operator |",
    "| `nodeSelector`, `tolerations`, `imagePullSecrets` | `spec.nodeSelector`, "
    "`spec.tolerations`, `spec.imagePullSecrets` when set (pull secrets merge by name); else "
    "the template |",
    "| the `loader` init container, the `engine` container and the `front` container: "
    "`image`, `command`, `ports`, "
    "probes, `restartPolicy`, the variables the operator sets, the mounts of `/weights`, "
    "`/var/run/hotload/bucket` and `/dev/shm`, the resources `spec.engine` and `spec.loader` "
    "set | the operator; the template adds variables, mounts, resources and other fields |",
    "| vLLM's engine: `--worker-extension-cls hotload_patch.vllm.HotloadWorkerExtension` in "
    "`command` (before `spec.engine.args`) and `PYTHONPATH` | the operator: `PYTHONPATH` starts "
    "with `/weights/.hotload/python`, where the loader copies hotload's extension (sparse hot "
    "loads) at start-up; a `PYTHONPATH` of `spec.engine.env` (else of the template) follows "
    "it, joined with `:`, in one variable (a template's `valueFrom` one is kept as "
    "`HOTLOAD_USER_PYTHONPATH` and named as `$(HOTLOAD_USER_PYTHONPATH)`) |",
    "| volumes `weights`, `bucket-credentials`, `dshm` | the operator (`spec.weightsVolume`, "
    "`spec.bucket.credentialsSecret`, `spec.engine.shmSize`) |",
    "| `securityContext` of the pod and of each container | defaults the template may change: "
    "`seccompProfile: RuntimeDefault`; for the loader `runAsNonRoot`, "
    "`readOnlyRootFilesystem`, no privilege escalation, every capability dropped; the same "
    "for the engine, with `runAsNonRoot` only for the reference engine (vLLM's and SGLang's "
    "images run as root: set `runAsNonRoot` and `runAsUser` in the template for the "
    "restricted Pod Security Standard) |",
    "| the `front` container's `resources` | a default the template may change: requests "
    "`cpu: 250m`, `memory: 128Mi`, no limits |",
    "",
    "Only the inference API reaches `spec.engine.port`, the pod's `http` port (the Service, the "
    "router, the probes): `/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`, "
    "`/v1/models`, `/health`, `/ready`, `/metrics`. The engine's admin API (hot loads, LoRA "
    "loading, vLLM's `/pause`, `/collective_rpc`, `/sleep`, SGLang's weight updates, ...) "
    "listens on 127.0.0.1:18000 (18001 when `spec.engine.port` is 18000), where only the "
    "pod's own containers reach it: the reference engine serves the two itself "
    "(`hotload serve --admin-port`); vLLM and SGLang listen on loopback only and the `front` "
    "container (`hotload front`, from the loader's image) serves the port, answering 404 to "
    "anything else. The engine's probes go through the front; the front's own liveness is "
    "`GET /front/healthz`.",
]


_EXAMPLES = f"""
apiVersion: {names.API_VERSION}
kind: {names.DEPLOYMENT_KIND}
metadata:
  name: grpo
spec:
  bucket:
    url: s3://rl-policies/grpo
    credentialsSecret: bucket-credentials
  engine:
    kind: vllm
    image: registry.example.com/vllm-dev:0.8
    gpus: 1
  replicas: 4
---
apiVersion: {names.API_VERSION}
kind: {names.SNAPSHOT_KIND}
metadata:
  name: grpo-step-00000210
spec:
  deployment: grpo
  identity: step-00000210
  previous: step-00000200
"""


def _kind_docs(kind: str, crd: dict[str, Any]) -> list[str]:
    spec = crd["spec"]
    version = spec["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    columns = version["additionalPrinterColumns"]
    plain = ", ".join(c["name"] for c in columns if not c.get("priority"))
    wide = ", ".join(c["name"] for c in columns if c.get("priority"))
    subresources = ", ".join(f"`{s}`" for s in version["subresources"]) or "none"
    out = [
        "",
        f"## {kind}",
        "",
        schema.get("description", ""),
        "",
        f"- plural `{spec['names']['plural']}`, short name "
        f"`{', '.join(spec['names']['shortNames'])}`, category "
        f"`{', '.join(spec['names']['categories'])}`; subresources {subresources}",
        f"- `kubectl get {spec['names']['shortNames'][0]}` shows {plain}; `-o wide` adds {wide}",
    ]
    out += [
        f"- rule `{r['rule']}`: {r['message']}." for r in schema.get("x-kubernetes-validations", [])
    ]
    out += [
        "",
        "| Column | JSONPath | |",
        "| --- | --- | --- |",
    ]
    out += [
        f"| {c['name']} | {_code(c['jsonPath'])} | {_cell(c.get('description', ''))} |"
        for c in columns
    ]
    for part in ("spec", "status"):
        node = schema["properties"].get(part)
        if node is None:
            continue  # HotLoadHead: written whole by the operator, no status
        out += ["", f"### {part}", ""]
        if node.get("description"):
            out += [node["description"], ""]
        for rule in node.get("x-kubernetes-validations", []):
            out += [f"Rule `{rule['rule']}`: {rule['message']}.", ""]
        out += [
            "| Field | Type | Required | Default | Validation | Description |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += _field_rows(node, part)
    return out


def _field_rows(node: Schema, path: str) -> list[str]:
    rows = []
    required = set(node.get("required", []))
    for name, prop in node.get("properties", {}).items():
        here = f"{path}.{name}"
        default = _code(_json(prop["default"])) if "default" in prop else ""
        rows.append(
            f"| {_code(here)} | {_type(prop)} | {'yes' if name in required else ''} | "
            f"{default} | {_validation(prop)} | {_cell(prop.get('description', ''))} |"
        )
        if prop.get("type") == "object":
            rows += _field_rows(prop, here)
        elif prop.get("type") == "array":
            rows += _field_rows(prop["items"], here + "[]")
    return rows


def _type(node: Schema) -> str:
    if node.get("type") == "array":
        return "[]" + _type(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        return "map[string]" + _type(node["additionalProperties"])
    return str(node.get("type", "any"))


def _validation(node: Schema) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(_code(_json(v)) for v in node["enum"]))
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None and high is not None:
        parts.append(f"{low}..{high}")
    elif low is not None:
        parts.append(f">= {low}")
    elif high is not None:
        parts.append(f"<= {high}")
    for key, label in (("minLength", "min length"), ("maxLength", "max length")):
        if key in node:
            parts.append(f"{label} {node[key]}")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    if "pattern" in node:
        parts.append("pattern " + _code(node["pattern"]))
    if node.get("x-kubernetes-list-type") == "map":
        keys = ", ".join(node.get("x-kubernetes-list-map-keys", []))
        parts.append(f"map keyed by `{keys}`")
    values = node.get("additionalProperties")
    if isinstance(values, dict) and _validation(values):
        parts.append("values: " + _validation(values))
    return "; ".join(parts)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


def _code(text: str) -> str:
    # GitHub tables split cells on `|` even inside code spans unless it is escaped.
    return "`" + text.replace("|", "\\|") + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- files -----------------------------------------------------------------------------------
