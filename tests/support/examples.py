"""The manifests in `examples/` and what each needs from a cluster: the list its header states
(the format is in `examples/README.md`) and the same list derived from the manifest itself
(and from the pods the operator builds from its HotLoadDeployments), so the two can be
compared."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hotload.api.models import HotLoadDeployment
from hotload.api.names import API_VERSION, DEPLOYMENT_KIND, SNAPSHOT_KIND
from hotload.bucket.url import GCS_SETTINGS, S3_SETTINGS
from hotload_operator.builders import build_children
from support.paths import REPO

JSON = dict[str, Any]
EXAMPLES_DIR = REPO / "examples"
#: The comment line that opens an example's list of needs.
NEEDS_START = "# Needs from the"
#: Other projects' kinds the examples use, and the name of each one's CRD.
THIRD_PARTY_CRDS = {
    (
        "inference.networking.k8s.io/v1",
        "InferencePool",
    ): "inferencepools.inference.networking.k8s.io",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes.gateway.networking.k8s.io",
}
#: Pod Security Standard levels, least strict first.
LEVELS = ("privileged", "baseline", "restricted")
#: Keys a bucket-credentials Secret may hold (what the operator and the loader read).
BUCKET_KEYS = frozenset(n.upper() for n in (*S3_SETTINGS, *GCS_SETTINGS))
#: Built-in kinds with a pod template at spec.template.
WORKLOADS = {
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "DaemonSet"),
    ("batch/v1", "Job"),
}
#: The header's keys and the type of each value (examples/README.md says what each means).
KEYS: dict[str, type] = {
    "namespaces": list,
    "operator": dict,
    "crds": list,
    "deployments": list,
    "ledgerHeads": dict,
    "gateways": list,
    "secrets": dict,
    "configMaps": dict,
    "serviceAccounts": list,
    "persistentVolumeClaims": list,
    "buckets": dict,
    "bucketFiles": dict,
    "priorityClasses": list,
    "storageClasses": list,
    "defaultStorageClass": bool,
    "runtimeClasses": list,
    "nodeLabels": dict,
    "tolerations": list,
    "gpus": dict,
    "podSecurity": str,
}


class NeedsError(ValueError):
    """An example's header has no list of needs, or one that does not follow the format."""


@dataclass(frozen=True)
class Example:
    """One file of `examples/`: its objects and the needs its header states."""

    path: Path
    objects: list[JSON]
    needs: JSON

    @property
    def name(self) -> str:
        """The file's name."""
        return self.path.name

    def of_kind(self, kind: str) -> list[JSON]:
        """The file's objects of `kind`."""
        return [o for o in self.objects if o["kind"] == kind]


def load_example(path: Path, text: str | None = None) -> Example:
    """The example at `path` (or `text`, as if it were that file's content)."""
    text = path.read_text() if text is None else text
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    return Example(path, objects, parse_needs(text, path.name))


def load_examples() -> dict[str, Example]:
    """Every example, by file name."""
    return {p.name: load_example(p) for p in sorted(EXAMPLES_DIR.glob("*.yaml"))}


def parse_needs(text: str, where: str) -> JSON:
    """The needs in the header of `text`: the comment lines after the one starting with
    `NEEDS_START` that start with '#' and two spaces, '#' removed, read as a YAML mapping."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(NEEDS_START)), None)
    if start is None:
        raise NeedsError(f"{where}: no line starting with {NEEDS_START!r} (examples/README.md)")
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith("#  "):
            break
        block.append(line[1:])
    try:
        needs = yaml.safe_load(textwrap.dedent("\n".join(block)))
    except yaml.YAMLError as err:
        raise NeedsError(f"{where}: the list of needs is not YAML: {err}") from err
    if not isinstance(needs, dict) or not needs:
        raise NeedsError(f"{where}: the list of needs is not a YAML mapping")
    for key, value in needs.items():
        if key not in KEYS:
            raise NeedsError(f"{where}: unknown need {key!r} (known: {', '.join(KEYS)})")
        if not isinstance(value, KEYS[key]):
            raise NeedsError(f"{where}: {key} must be a {KEYS[key].__name__}, not {value!r}")
    operator = needs.get("operator")
    if operator is not None and not isinstance(operator.get("bucketSecrets"), list):
        raise NeedsError(f"{where}: operator must be {{bucketSecrets: [namespace/name, ...]}}")
    level = needs.get("podSecurity")
    if level is not None and level not in LEVELS:
        raise NeedsError(f"{where}: podSecurity must be one of {', '.join(LEVELS)}")
    return dict(needs)


def hld_model(obj: JSON) -> HotLoadDeployment:
    """A HotLoadDeployment manifest as the operator parses it (with the uid a server adds)."""
    return HotLoadDeployment.model_validate({**obj, "metadata": {**obj["metadata"], "uid": "u"}})


def ref(namespace: str, name: str) -> str:
    """`namespace/name`, as the header writes a namespaced object."""
    return f"{namespace}/{name}"


def deployments_in(examples: Iterable[Example]) -> dict[str, tuple[Example, JSON]]:
    """Every HotLoadDeployment of `examples`, by `namespace/name`, with its file."""
    return {
        ref(o["metadata"]["namespace"], o["metadata"]["name"]): (ex, o)
        for ex in examples
        for o in ex.of_kind(DEPLOYMENT_KIND)
    }


def secret_keys(obj: JSON) -> list[str]:
    """The keys a Secret manifest holds."""
    return sorted({*(obj.get("data") or {}), *(obj.get("stringData") or {})})


@dataclass
class _Found:
    """What a manifest refers to, gathered object by object (`expected_needs`)."""

    needs: JSON
    #: (header key, namespace/name) of what the file, or the operator from it, creates.
    made: set[tuple[str, str]]
    #: Keys pods read, by (header key, namespace/name) of the Secret or ConfigMap.
    keys: dict[tuple[str, str], set[str]]
    pods: list[tuple[str, int, JSON]]

    def add(self, key: str, item: str) -> None:
        self.needs.setdefault(key, set()).add(item)

    def put(self, key: str, item: str, value: Any) -> None:
        self.needs.setdefault(key, {})[item] = value


def expected_needs(example: Example, examples: Mapping[str, Example]) -> JSON:
    """The needs `example`'s manifest implies, in the header's shape (lists sorted). Secrets'
    keys are those of the Secret where an example defines it (else of how pods use it), and an
    empty list where nothing says (a bucket Secret defined nowhere)."""
    found = _Found({}, _made(example), {}, [])
    everywhere = deployments_in(examples.values())
    defined = {
        ref(o["metadata"]["namespace"], o["metadata"]["name"]): secret_keys(o)
        for ex in examples.values()
        for o in ex.of_kind("Secret")
    }
    for obj in example.objects:
        _gather(obj, found, everywhere)
    for namespace, replicas, spec in found.pods:
        _pod_needs(namespace, replicas, spec, found)
    needs = found.needs
    for key in ("serviceAccounts", "persistentVolumeClaims"):
        needs[key] = {r for r in needs.get(key, set()) if (key, r) not in found.made}
    secrets = needs.pop("secrets", set()) | {r for kind, r in found.made if kind == "secrets"}
    needs["secrets"] = {
        s: sorted(set(defined.get(s, [])) | found.keys.get(("secrets", s), set())) for s in secrets
    }
    config_maps = {c for c in needs.pop("configMaps", set()) if ("configMaps", c) not in found.made}
    needs["configMaps"] = {c: sorted(found.keys.get(("configMaps", c), set())) for c in config_maps}
    out: JSON = {}
    for key, value in needs.items():
        if value in (set(), {}, None):
            continue
        out[key] = sorted(value) if isinstance(value, set) else value
    if "operator" in out:
        out["operator"] = {"bucketSecrets": sorted(out["operator"]["bucketSecrets"])}
    return out


def _made(example: Example) -> set[tuple[str, str]]:
    """What the file creates, and what the operator creates from its HotLoadDeployments."""
    made = set()
    for obj in example.objects:
        namespace = obj["metadata"].get("namespace")
        if namespace:
            made.add((_made_key(obj["kind"]), ref(namespace, obj["metadata"]["name"])))
        if obj["kind"] == DEPLOYMENT_KIND:
            for child in build_children(hld_model(obj)):
                made.add((_made_key(child["kind"]), ref(namespace, child["metadata"]["name"])))
    return made


def _gather(obj: JSON, found: _Found, everywhere: Mapping[str, tuple[Example, JSON]]) -> None:
    """What one object refers to."""
    kind, meta = obj["kind"], obj.get("metadata") or {}
    namespace, name = meta.get("namespace"), meta.get("name", "")
    if kind == "Namespace":
        found.add("namespaces", name)
    elif namespace:
        found.add("namespaces", namespace)
    if obj["apiVersion"] == API_VERSION:
        found.needs.setdefault("operator", {}).setdefault("bucketSecrets", set())
    if (obj["apiVersion"], kind) in THIRD_PARTY_CRDS:
        found.add("crds", THIRD_PARTY_CRDS[(obj["apiVersion"], kind)])
    spec = obj.get("spec") or {}
    if kind == DEPLOYMENT_KIND:
        hld = hld_model(obj)
        found.put("buckets", hld.spec.bucket.url, None)
        _bucket_secret(found, namespace, hld)
        for child in build_children(hld):
            if child["kind"] == "Deployment":
                template = child["spec"]["template"]["spec"]
                found.pods.append((namespace, child["spec"]["replicas"], template))
    elif kind == SNAPSHOT_KIND:
        deployment = ref(namespace, spec["deployment"])
        if ("hotloaddeployments", deployment) not in found.made:
            found.add("deployments", deployment)
        if deployment not in everywhere:
            raise NeedsError(f"Snapshot {name}: no example defines HotLoadDeployment {deployment}")
        hld = hld_model(everywhere[deployment][1])
        _bucket_secret(found, namespace, hld)
        folder = f"{hld.spec.bucket.url.rstrip('/')}/{spec['identity']}/"
        found.put("bucketFiles", folder, spec.get("kind") or "full")
        if spec.get("previous"):
            found.put("ledgerHeads", deployment, spec["previous"])
    elif (obj["apiVersion"], kind) in WORKLOADS:
        found.pods.append((namespace, int(spec.get("replicas", 1)), spec["template"]["spec"]))
    elif kind == "Pod":
        found.pods.append((namespace, 1, spec))
    elif kind == "PersistentVolumeClaim":
        _storage_class(found, spec)
    elif kind in ("RoleBinding", "ClusterRoleBinding"):
        for subject in obj.get("subjects") or []:
            if subject.get("namespace"):
                found.add("namespaces", subject["namespace"])
    elif kind == "InferencePool":
        selected = spec["selector"]["matchLabels"].get("hotload.dev/deployment")
        if selected and ("hotloaddeployments", ref(namespace, selected)) not in found.made:
            found.add("deployments", ref(namespace, selected))
    elif kind == "HTTPRoute":
        for parent in spec.get("parentRefs") or []:
            if parent.get("kind", "Gateway") == "Gateway":
                found.add("gateways", ref(parent.get("namespace", namespace), parent["name"]))


def _made_key(kind: str) -> str:
    """The header key a created object of `kind` would otherwise be listed under."""
    return {
        "ServiceAccount": "serviceAccounts",
        "PersistentVolumeClaim": "persistentVolumeClaims",
        "Secret": "secrets",
        "ConfigMap": "configMaps",
        DEPLOYMENT_KIND: "hotloaddeployments",
    }.get(kind, kind)


def _bucket_secret(found: _Found, namespace: str, hld: HotLoadDeployment) -> None:
    secret = hld.spec.bucket.credentials_secret
    if secret:
        found.needs["operator"]["bucketSecrets"].add(ref(namespace, secret))


def _storage_class(found: _Found, claim_spec: JSON) -> None:
    name = claim_spec.get("storageClassName")
    if name:
        found.add("storageClasses", name)
    elif name is None:  # "" asks for no class at all
        found.needs["defaultStorageClass"] = True


def _pod_needs(namespace: str, replicas: int, spec: JSON, found: _Found) -> None:
    """What one pod template refers to."""
    # Which level is the header's to say (and the real API server's to check).
    found.needs["podSecurity"] = True
    for volume in spec.get("volumes") or []:
        if "secret" in volume:
            found.add("secrets", ref(namespace, volume["secret"]["secretName"]))
        if "configMap" in volume:
            found.add("configMaps", ref(namespace, volume["configMap"]["name"]))
        for source in (volume.get("projected") or {}).get("sources") or []:
            for kind, key in (("secret", "secrets"), ("configMap", "configMaps")):
                if kind in source:
                    found.add(key, ref(namespace, source[kind]["name"]))
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            found.add("persistentVolumeClaims", ref(namespace, claim))
        if "ephemeral" in volume:
            _storage_class(found, volume["ephemeral"]["volumeClaimTemplate"]["spec"])
    per_pod: dict[str, int] = {}
    for container in [*(spec.get("initContainers") or []), *spec["containers"]]:
        _container_needs(namespace, container, found)
        for resource, count in ((container.get("resources") or {}).get("limits") or {}).items():
            if "/" in resource and not resource.startswith(("hugepages-", "kubernetes.io/")):
                per_pod[resource] = per_pod.get(resource, 0) + int(count)
    for resource, count in per_pod.items():
        gpus = found.needs.setdefault("gpus", {"resource": resource, "perPod": count, "pods": 0})
        if (gpus["resource"], gpus["perPod"]) != (resource, count):
            raise NeedsError("pods of one file need different devices: gpus cannot say so")
        gpus["pods"] += replicas
    for pull in spec.get("imagePullSecrets") or []:
        secret = ref(namespace, pull["name"])
        found.add("secrets", secret)
        found.keys.setdefault(("secrets", secret), set()).add(".dockerconfigjson")
    if spec.get("serviceAccountName"):
        found.add("serviceAccounts", ref(namespace, spec["serviceAccountName"]))
    for field, key in (
        ("priorityClassName", "priorityClasses"),
        ("runtimeClassName", "runtimeClasses"),
    ):
        if spec.get(field):
            found.add(key, spec[field])
    labels = found.needs.setdefault("nodeLabels", {})
    for label, value in (spec.get("nodeSelector") or {}).items():
        labels[label] = sorted({*labels.get(label, []), value})
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for expression in term.get("matchExpressions") or []:
            if expression["operator"] in ("In", "Exists", "Gt", "Lt"):
                values = expression.get("values") if expression["operator"] == "In" else []
                label = expression["key"]
                labels[label] = sorted({*labels.get(label, []), *(values or [])})
    for toleration in spec.get("tolerations") or []:
        text = toleration.get("key") or "*"
        if toleration.get("value"):
            text += f"={toleration['value']}"
        if toleration.get("effect"):
            text += f":{toleration['effect']}"
        found.add("tolerations", text)


def _container_needs(namespace: str, container: JSON, found: _Found) -> None:
    for env in container.get("env") or []:
        source = env.get("valueFrom") or {}
        for kind, key in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configMaps")):
            if kind in source:
                target = ref(namespace, source[kind]["name"])
                found.add(key, target)
                found.keys.setdefault((key, target), set()).add(source[kind]["key"])
    for env_from in container.get("envFrom") or []:
        for kind, key in (("secretRef", "secrets"), ("configMapRef", "configMaps")):
            if kind in env_from:
                found.add(key, ref(namespace, env_from[kind]["name"]))


def header_problems(example: Example, examples: Mapping[str, Example]) -> list[str]:
    """Where `example`'s header and its manifest disagree, one line each (empty: they agree)."""
    want = expected_needs(example, examples)
    have = example.needs
    problems = []
    for key in KEYS:
        if key == "podSecurity":
            if "podSecurity" in want and "podSecurity" not in have:
                problems.append("pods are created: name their podSecurity level")
            elif "podSecurity" in have and "podSecurity" not in want:
                problems.append("podSecurity is named but no pod is created")
            continue
        problems += _compare(key, have.get(key), want.get(key))
    return [f"{example.name}: {p}" for p in problems]


def _compare(key: str, have: Any, want: Any) -> list[str]:
    if key == "operator":
        have_secrets = sorted((have or {}).get("bucketSecrets", [])) if have is not None else None
        want_secrets = sorted(want["bucketSecrets"]) if want is not None else None
        if have_secrets != want_secrets:
            said = f"the header says {have_secrets}, the manifest uses {want_secrets}"
            return [f"operator.bucketSecrets: {said}"]
        return []
    if key == "buckets":
        problems = _compare_names(key, sorted(have or {}), sorted(want or {}))
        for url, access in (have or {}).items():
            if access not in ("read", "read-write"):
                problems.append(f"buckets: {url} must be read or read-write, not {access!r}")
        return problems
    if key == "secrets":
        problems = _compare_names(key, sorted(have or {}), sorted(want or {}))
        for secret, keys in (want or {}).items():
            listed = (have or {}).get(secret)
            if listed is None:
                continue
            if keys and sorted(listed) != keys:
                problems.append(f"secrets: {secret} holds {keys}, the header says {sorted(listed)}")
            if not keys and not (listed and set(listed) <= BUCKET_KEYS):
                problems.append(f"secrets: {secret}: list its keys, among {sorted(BUCKET_KEYS)}")
        return problems
    normal_have = sorted(have) if isinstance(have, list) else have
    if normal_have != want:
        return [f"{key}: the header says {have!r}, the manifest needs {want!r}"]
    return []


def _compare_names(key: str, have: list[str], want: list[str]) -> list[str]:
    problems = [f"{key}: {n} is used but not listed" for n in want if n not in have]
    return problems + [f"{key}: {n} is listed but not used" for n in have if n not in want]
