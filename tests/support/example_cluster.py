"""An example of `examples/` on a real API server, with exactly the needs its header states
(`support.examples`): where the test puts it (`Site`: its namespace, cluster-scoped names of
its own, its buckets on the session's SeaweedFS), the needs created (`create_needs`), and what
the API server and the operator made of it (`admission`, `accepted`)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotload.api.names import API_VERSION, DEPLOYMENT_KIND
from hotload.bucket import open_bucket, upload_snapshot_async
from hotload.errors import KubeNotFoundError
from hotload.kube import KubeClient, resource_path
from hotload.snapshot import describe_snapshot
from support.examples import (
    BUCKET_KEYS,
    LEVELS,
    THIRD_PARTY_CRDS,
    Example,
    deployments_in,
    hld_model,
)
from support.operator import condition, eventually, get_or_none
from support.snapshots import delta, full, lora, nudged, weights

JSON = dict[str, Any]
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
#: Kinds the test needs served that no example creates (a route's Gateway), with their CRDs.
STAND_INS = {
    **THIRD_PARTY_CRDS,
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateways.gateway.networking.k8s.io",
}
#: The label that marks the Pod Security level a namespace enforces.
ENFORCE = "pod-security.kubernetes.io/enforce"


@dataclass(frozen=True)
class Site:
    """Where one test applies examples: every namespace is the test's, cluster-scoped names
    end in the test's suffix, and a bucket URL `s3://B/P` is `<bucket_root>/B/P` on the test's
    object store, whose settings (`store`) every bucket Secret the test writes carries."""

    namespace: str
    suffix: str
    bucket_root: str
    store: Mapping[str, str]

    def local(self, namespaced: str) -> tuple[str, str]:
        """A header's `namespace/name`, here: (the test's namespace, name)."""
        return self.namespace, namespaced.split("/", 1)[1]

    def cluster(self, name: str) -> str:
        """A cluster-scoped name, here."""
        return f"{name}-{self.suffix}"

    def bucket(self, url: str) -> str:
        """A bucket URL (or a folder in one), here."""
        scheme, rest = url.split("://", 1)
        assert scheme in ("s3", "gs"), url
        return f"{self.bucket_root}/{rest}"

    def secret_values(self, keys: Iterable[str]) -> dict[str, str]:
        """Values for a Secret with `keys`: a bucket Secret reaches the test's store (its
        endpoint always included: the store is not AWS S3), a pull Secret is an empty Docker
        config."""
        keys = list(keys)
        if keys == [".dockerconfigjson"]:
            return {".dockerconfigjson": json.dumps({"auths": {}})}
        if keys and set(keys) <= BUCKET_KEYS:
            values = {k: self.store.get(k, "unused") for k in keys}
            return {**values, "AWS_ENDPOINT_URL": self.store["AWS_ENDPOINT_URL"]}
        return dict.fromkeys(keys, "example")

    def adapt(self, obj: JSON) -> JSON:
        """`obj` as the test applies it: namespaces, cluster-scoped names and bucket URLs
        moved here, a bucket Secret's values made the test store's."""
        out: JSON = self._walk(copy.deepcopy(obj))
        if out["kind"] == "Namespace":
            out["metadata"]["name"] = self.namespace
        if out["kind"] == DEPLOYMENT_KIND:
            out["spec"]["bucket"]["url"] = self.bucket(out["spec"]["bucket"]["url"])
        if out["kind"] == "Secret":
            keys = sorted({*(out.get("data") or {}), *(out.get("stringData") or {})})
            if set(keys) <= BUCKET_KEYS:
                out.pop("data", None)
                out["stringData"] = self.secret_values(keys)
        return out

    def _walk(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self._walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "namespace" and isinstance(value, str):
                out[key] = self.namespace
            elif key in ("priorityClassName", "storageClassName", "runtimeClassName") and value:
                out[key] = self.cluster(value)
            else:
                out[key] = self._walk(value)
        return out


def plan(target: Example, examples: Mapping[str, Example]) -> list[Example]:
    """The examples to apply for `target`, in order: those that create what it needs (its
    deployments, the Snapshots at its ledger heads), theirs first, then `target`."""
    hlds = deployments_in(examples.values())
    order: list[Example] = []

    def visit(example: Example) -> None:
        for deployment in example.needs.get("deployments", []):
            if deployment in hlds:
                visit(hlds[deployment][0])
        for deployment, identity in example.needs.get("ledgerHeads", {}).items():
            visit(_snapshot_example(examples, deployment, identity))
        if example.name not in [e.name for e in order]:
            order.append(example)

    visit(target)
    return order


def _snapshot_example(examples: Mapping[str, Example], deployment: str, identity: str) -> Example:
    for example in examples.values():
        for snap in example.of_kind("Snapshot"):
            meta, spec = snap["metadata"], snap["spec"]
            if (f"{meta['namespace']}/{spec['deployment']}", spec["identity"]) == (
                deployment,
                identity,
            ):
                return example
    raise AssertionError(f"no example creates Snapshot {identity} of {deployment}")


def combined(examples: list[Example], withhold: Iterable[str] = ()) -> JSON:
    """The needs of `examples` together (lists joined, mappings merged), less `withhold`; the
    Pod Security level is the least strict any of them names (one namespace holds them all)."""
    out: JSON = {}
    for example in examples:
        for key, value in example.needs.items():
            if key in withhold:
                continue
            if key == "operator":
                secrets = {*out.get(key, {}).get("bucketSecrets", []), *value["bucketSecrets"]}
                out[key] = {"bucketSecrets": sorted(secrets)}
            elif isinstance(value, dict):
                out.setdefault(key, {}).update(value)
            elif isinstance(value, list):
                out[key] = sorted({*out.get(key, []), *value})
            elif key == "podSecurity" and key in out:
                out[key] = min(out[key], value, key=LEVELS.index)
            else:
                out[key] = value
    return out


@dataclass
class Needs:
    """The needs of a plan, created on the API server (cluster-scoped ones removed after)."""

    kube: KubeClient
    site: Site
    needs: JSON
    #: Paths of cluster-scoped objects this test created, to delete afterwards.
    created: list[str] = field(default_factory=list)
    #: The default StorageClass claims without a class get (None when none was needed).
    default_class: str | None = None

    async def create(self, defined_secrets: set[str]) -> None:
        """Create every need but the operator and what the examples themselves create
        (`defined_secrets`: `namespace/name` of their Secrets)."""
        ns = self.site.namespace
        if level := self.needs.get("podSecurity"):
            body = {"metadata": {"labels": {ENFORCE: level}}}
            await self.kube.patch(resource_path("v1", "namespaces", None, ns), body, "merge")
        for name in self.needs.get("priorityClasses", []):
            body = {"metadata": {"name": self.site.cluster(name)}, "value": 1000}
            await self._cluster_object("scheduling.k8s.io/v1", "priorityclasses", body)
        for name in self.needs.get("storageClasses", []):
            await self._storage_class(self.site.cluster(name), default=False)
        if self.needs.get("defaultStorageClass"):
            await self._default_storage_class()
        for name in self.needs.get("runtimeClasses", []):
            body = {"metadata": {"name": self.site.cluster(name)}, "handler": "runc"}
            await self._cluster_object("node.k8s.io/v1", "runtimeclasses", body)
        for crd in self.needs.get("crds", []):
            await self._stand_in_crd(crd)
        for secret, keys in self.needs.get("secrets", {}).items():
            if secret not in defined_secrets:
                await self._secret(secret, keys)
        for name, keys in self.needs.get("configMaps", {}).items():
            body = {"metadata": {"name": self.site.local(name)[1]}, "data": dict.fromkeys(keys, "")}
            await self.kube.create(resource_path("v1", "configmaps", ns), body)
        for name in self.needs.get("serviceAccounts", []):
            body = {"metadata": {"name": self.site.local(name)[1]}}
            await self.kube.create(resource_path("v1", "serviceaccounts", ns), body)
        for name in self.needs.get("persistentVolumeClaims", []):
            claim = {
                "metadata": {"name": self.site.local(name)[1]},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
            await self.kube.create(resource_path("v1", "persistentvolumeclaims", ns), claim)
        if self.needs.get("gateways"):
            await self._stand_in_crd(STAND_INS[("gateway.networking.k8s.io/v1", "Gateway")])
        for name in self.needs.get("gateways", []):
            gateway = {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "Gateway",
                "metadata": {"name": self.site.local(name)[1]},
                "spec": {
                    "gatewayClassName": "example",
                    "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}],
                },
            }
            path = resource_path("gateway.networking.k8s.io/v1", "gateways", ns)
            await self.kube.create(path, gateway)

    async def remove(self) -> None:
        """Delete the cluster-scoped objects `create` made."""
        for path in reversed(self.created):
            with contextlib.suppress(KubeNotFoundError):
                await self.kube.delete(path)

    async def _cluster_object(self, api_version: str, plural: str, body: JSON) -> None:
        path = resource_path(api_version, plural)
        self.created.append(f"{path}/{body['metadata']['name']}")
        await self.kube.create(path, body)

    async def _storage_class(self, name: str, *, default: bool) -> None:
        body: JSON = {
            "metadata": {"name": name},
            # No provisioner runs here: claims stay Pending, as pods do.
            "provisioner": "example.com/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
        }
        if default:
            body["metadata"]["annotations"] = {
                "storageclass.kubernetes.io/is-default-class": "true"
            }
        await self._cluster_object("storage.k8s.io/v1", "storageclasses", body)

    async def _default_storage_class(self) -> None:
        classes = await self.kube.list(resource_path("storage.k8s.io/v1", "storageclasses"))
        for sc in classes["items"]:
            annotations = sc["metadata"].get("annotations") or {}
            if annotations.get("storageclass.kubernetes.io/is-default-class") == "true":
                self.default_class = sc["metadata"]["name"]  # a cluster of its own has one
                return
        self.default_class = self.site.cluster("default")
        await self._storage_class(self.default_class, default=True)

    async def _stand_in_crd(self, name: str) -> None:
        """Serve the kind of CRD `name` (group, version, kind, namespaced) with an open schema,
        unless the cluster already has that CRD (then it is left alone)."""
        if await get_or_none(self.kube, f"{CRDS}/{name}") is not None:
            return
        api_version, kind = next(k for k, v in STAND_INS.items() if v == name)
        plural, group = name.split(".", 1)
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {
                "name": name,
                # Groups under k8s.io need this; a stand-in says that it is not the real API.
                "annotations": {"api-approved.kubernetes.io": "unapproved, a test's stand-in"},
            },
            "spec": {
                "group": group,
                "scope": "Namespaced",
                "names": {"plural": plural, "kind": kind, "singular": kind.lower()},
                "versions": [
                    {
                        "name": api_version.split("/")[1],
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                ],
            },
        }
        self.created.append(f"{CRDS}/{name}")
        await self.kube.create(CRDS, crd)

        async def established() -> bool:
            got = await self.kube.get(f"{CRDS}/{name}")
            conditions = (got.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        await eventually(f"CRD {name} established", established)

    async def _secret(self, secret: str, keys: list[str]) -> None:
        namespace, name = self.site.local(secret)
        body: JSON = {"metadata": {"name": name}, "stringData": self.site.secret_values(keys)}
        if keys == [".dockerconfigjson"]:
            body["type"] = "kubernetes.io/dockerconfigjson"
        await self.kube.create(resource_path("v1", "secrets", namespace), body)


@dataclass
class BucketFiles:
    """Snapshot folders the test writes and uploads where a header's `bucketFiles` says."""

    work: Path
    credentials: Path
    #: The full folder each identity was built from (a delta's parent).
    fulls: dict[str, Path] = field(default_factory=dict)

    async def upload(self, site: Site, folder_url: str, kind: str, examples: list[Example]) -> None:
        """Write a small snapshot of `kind` and upload it to `folder_url` (moved to `site`)."""
        base_url, identity = folder_url.rstrip("/").rsplit("/", 1)
        if kind == "full":
            folder = full(self.work / "full" / identity, weights(0))
            self.fulls[identity] = folder
        elif kind == "incremental":
            snap = next(
                s["spec"]
                for e in examples
                for s in e.of_kind("Snapshot")
                if s["spec"]["identity"] == identity
            )
            parent = self.fulls[snap["previous"]]
            step = full(self.work / "full" / identity, nudged(weights(0), 1))
            folder = delta(parent, step, self.work / "delta" / identity)
        else:
            base_model = self._base_model(base_url, examples)
            folder = lora(self.work / "lora" / identity, 1, base_model=base_model)
        desc = describe_snapshot(folder)
        bucket = open_bucket(site.bucket(base_url), credentials_dir=self.credentials)
        await upload_snapshot_async(
            folder, bucket, identity, files=desc.files, manifest_files=desc.manifest_files
        )

    @staticmethod
    def _base_model(base_url: str, examples: list[Example]) -> str:
        for _, obj in deployments_in(examples).values():
            hld = hld_model(obj)
            if hld.spec.bucket.url.rstrip("/") == base_url and hld.spec.adapters.base_model:
                return hld.spec.adapters.base_model
        raise AssertionError(f"no deployment of these examples serves adapters from {base_url}")


@dataclass(frozen=True)
class Admission:
    """What became of a Deployment's pods: all created, or refused (the controller's words)."""

    pods: list[JSON]
    refused: str | None


async def admission(kube: KubeClient, namespace: str, name: str) -> Admission:
    """Wait until the Deployment `name` has all its pods, or until its ReplicaSet (or the
    Deployment) reports `ReplicaFailure` (the API server refused a pod)."""
    path = resource_path("apps/v1", "deployments", namespace, name)

    async def settled() -> Admission | None:
        deployment = await get_or_none(kube, path)
        if deployment is None:
            return None
        labels = deployment["spec"]["selector"]["matchLabels"]
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        sets = await kube.list(resource_path("apps/v1", "replicasets", namespace), selector)
        # Items of a list carry no kind of their own.
        owners = [("Deployment", deployment)] + [("ReplicaSet", rs) for rs in sets["items"]]
        for kind, obj in owners:
            failure = condition(obj, "ReplicaFailure")
            if failure.get("status") == "True":
                where = f"{kind} {obj['metadata']['name']}"
                return Admission([], f"{where}: {failure.get('reason')}: {failure.get('message')}")
        pods = await kube.list(resource_path("v1", "pods", namespace), selector)
        alive = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
        if len(alive) == deployment["spec"]["replicas"]:
            return Admission(alive, None)
        return None

    result: Admission = await eventually(f"the pods of Deployment {name}", settled, timeout=60)
    return result


async def accepted(kube: KubeClient, namespace: str, name: str) -> JSON:
    """The Snapshot `name` once the operator decides on it (its Accepted condition)."""
    path = resource_path(API_VERSION, "snapshots", namespace, name)

    async def decided() -> JSON | None:
        snap = await get_or_none(kube, path)
        status = condition(snap or {}, "Accepted").get("status")
        return snap if status in ("True", "False") else None

    result: JSON = await eventually(f"Snapshot {name} decided", decided, timeout=60)
    return result


async def claims(kube: KubeClient, namespace: str, pods: list[JSON]) -> list[JSON]:
    """The claims of the pods' generic ephemeral volumes, once the controller made them."""
    names = [
        f"{p['metadata']['name']}-{v['name']}"
        for p in pods
        for v in p["spec"].get("volumes") or []
        if "ephemeral" in v
    ]
    out = []
    for name in names:
        path = resource_path("v1", "persistentvolumeclaims", namespace, name)
        out.append(await eventually(f"claim {name}", lambda path=path: get_or_none(kube, path)))
    return out


@contextlib.asynccontextmanager
async def needs_in_place(
    kube: KubeClient, site: Site, needs: JSON, defined_secrets: set[str]
) -> AsyncIterator[Needs]:
    """`needs` created for the block (cluster-scoped ones removed after)."""
    made = Needs(kube, site, needs)
    try:
        await made.create(defined_secrets)
        yield made
    finally:
        await asyncio.shield(made.remove())
