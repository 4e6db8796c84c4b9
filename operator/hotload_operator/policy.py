"""The ValidatingAdmissionPolicy that narrows every hotload loader to its own pod (shipped with
the chart, rendered by scripts/render_admission_policy.py)."""

from __future__ import annotations

from typing import Any

from hotload_operator.meta import LOADER_SA_SUFFIX, MANAGED_BY, VAP_NAME

JSON = dict[str, Any]

#: Pod status fields only the kubelet writes (all exist from Kubernetes 1.30; a field the
#: server's schema does not know would fail compilation and, with failurePolicy Fail, refuse
#: every loader update, so check before adding newer ones).
_KUBELET_STATUS_FIELDS = (
    "phase", "message", "reason", "nominatedNodeName", "hostIP", "hostIPs", "podIP", "podIPs",
    "startTime", "initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses",
    "qosClass",
)  # fmt: skip


def _present(side: str, path: str) -> str:
    parts = path.split(".")
    return " && ".join(f"has({side}.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def _unchanged(path: str) -> str:
    """CEL: `path` is present on both sides with equal values, or on neither."""
    new, old = _present("object", path), _present("oldObject", path)
    return f"(({new}) == ({old}) && (!({new}) || object.{path} == oldObject.{path}))"


def build_loader_admission_policy() -> list[JSON]:
    """The cluster-wide ValidatingAdmissionPolicy (and binding) that narrows every hotload
    loader to its own pod and to `hotload.dev/` labels, annotations and conditions.

    A loader is recognised by its service account name (`*-hotload-loader`); its own pod is
    the one named in its bound service-account token
    (`authentication.kubernetes.io/pod-name`).
    """
    is_loader = (
        "request.userInfo.username.startsWith('system:serviceaccount:') && "
        f"request.userInfo.username.endsWith('{LOADER_SA_SUFFIX}')"
    )

    def kept(field: str) -> str:
        # Every key outside hotload.dev/ keeps its value, and none appears or disappears.
        return (
            f"variables.old{field}.all(k, k.startsWith('hotload.dev/') || "
            f"(k in variables.new{field} && variables.new{field}[k] == variables.old{field}[k]))"
            f" && variables.new{field}.all(k, k.startsWith('hotload.dev/') || "
            f"k in variables.old{field})"
        )

    policy: JSON = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": VAP_NAME, "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["pods", "pods/status"],
                    }
                ]
            },
            "matchConditions": [{"name": "is-hotload-loader", "expression": is_loader}],
            "variables": [
                {
                    "name": "newLabels",
                    "expression": "has(object.metadata.labels) ? object.metadata.labels : {}",
                },
                {
                    "name": "oldLabels",
                    "expression": "has(oldObject.metadata.labels) ? oldObject.metadata.labels : {}",
                },
                {
                    "name": "newAnnotations",
                    "expression": "has(object.metadata.annotations) ? "
                    "object.metadata.annotations : {}",
                },
                {
                    "name": "oldAnnotations",
                    "expression": "has(oldObject.metadata.annotations) ? "
                    "oldObject.metadata.annotations : {}",
                },
                {
                    "name": "newConditions",
                    "expression": "has(object.status) && has(object.status.conditions) ? "
                    "object.status.conditions.filter(c, !c.type.startsWith('hotload.dev/')) : []",
                },
                {
                    "name": "oldConditions",
                    "expression": "has(oldObject.status) && has(oldObject.status.conditions) ? "
                    "oldObject.status.conditions.filter(c, !c.type.startsWith('hotload.dev/')) "
                    ": []",
                },
            ],
            "validations": [
                {
                    "expression": "'authentication.kubernetes.io/pod-name' in "
                    "request.userInfo.extra && "
                    "request.userInfo.extra['authentication.kubernetes.io/pod-name'][0] == "
                    "object.metadata.name",
                    "message": "a hotload loader may only change its own pod",
                    "reason": "Forbidden",
                },
                {
                    "expression": kept("Labels"),
                    "message": "a hotload loader may only change hotload.dev/ labels",
                    "reason": "Forbidden",
                },
                {
                    "expression": kept("Annotations"),
                    "message": "a hotload loader may only change hotload.dev/ annotations",
                    "reason": "Forbidden",
                },
                {
                    "expression": "variables.newConditions == variables.oldConditions",
                    "message": "a hotload loader may only change hotload.dev/ pod conditions",
                    "reason": "Forbidden",
                },
                {
                    "expression": "object.spec == oldObject.spec",
                    "message": "a hotload loader may not change a pod's spec",
                    "reason": "Forbidden",
                },
                {
                    # Kubernetes CEL cannot iterate a typed object's fields: name them.
                    "expression": _unchanged("metadata.finalizers")
                    + " && "
                    + _unchanged("metadata.ownerReferences"),
                    "message": "a hotload loader may not change its pod's finalizers or owner "
                    "references",
                    "reason": "Forbidden",
                },
                {
                    "expression": " && ".join(
                        _unchanged(f"status.{f}") for f in _KUBELET_STATUS_FIELDS
                    ),
                    "message": "a hotload loader may only change hotload.dev/ pod conditions in "
                    "its pod's status",
                    "reason": "Forbidden",
                },
            ],
        },
    }
    binding: JSON = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": VAP_NAME, "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {"policyName": VAP_NAME, "validationActions": ["Deny"]},
    }
    return [policy, binding]
