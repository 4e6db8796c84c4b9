"""Who may do what on the emulated API server: authentication, RBAC and admission policies.

The emulator (`support.kubeapi`) calls into this module on every resource request; it keeps
the request path of a real API server: authenticate the bearer token, authorize the request
with RBAC, build the new object, then run the `ValidatingAdmissionPolicy`s that match it.

* Authentication: tokens bound to a service account (and optionally a pod) name a
  `UserInfo` as the real server builds it, `extra` with the bound pod's name and uid
  included. Any other request is the all-powerful admin (`system:masters`).
* RBAC: Role, ClusterRole, RoleBinding and ClusterRoleBinding with the real rule matching
  (`*`, `*/subresource`, resourceNames); a refusal is the real 403 `Status`. Writing a Role or
  a binding runs the real escalation check: grant only what you hold, unless you have
  `escalate` (roles) or `bind` (the bound role).
* Admission: `admissionregistration.k8s.io/v1` policies and bindings: matchConstraints and
  binding matchResources (resourceRules with subresources, operations and scope,
  excludeResourceRules, namespaceSelector, objectSelector), matchConditions, variables,
  validations (message, messageExpression, reason), failurePolicy and the Deny action, with
  CEL from `common-expression-language` (the cel-rust interpreter). Not emulated: paramKind
  (a misconfiguration that failurePolicy decides), Warn and Audit (they never refuse),
  auditAnnotations, CEL optionals (`a.?b`) and the Kubernetes CEL extension libraries.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import cel
import kmock

JSON = dict[str, Any]
#: The emulator's store: (group, plural, namespace or "", name) -> object.
Objects = Mapping[tuple[str, str, str, str], JSON]

RBAC_GROUP = "rbac.authorization.k8s.io"
ADMISSION_GROUP = "admissionregistration.k8s.io"
EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"
EXTRA_CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"

#: Admission never applies to its own configuration, so that a bad policy cannot lock it in.
_EXEMPT = {
    "validatingadmissionpolicies",
    "validatingadmissionpolicybindings",
    "mutatingadmissionpolicies",
    "mutatingadmissionpolicybindings",
    "validatingwebhookconfigurations",
    "mutatingwebhookconfigurations",
}
_REASON_CODES = {"Forbidden": 403, "Unauthorized": 401, "RequestEntityTooLarge": 413}


def error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    """A kmock error that renders as a Kubernetes `Status`."""
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details)


# --- authentication --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UserInfo:
    """The authenticated user of a request, as admission's `request.userInfo` shows it."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def is_admin(self) -> bool:
        """Whether RBAC lets this user do anything (`system:masters`, like the real server)."""
        return "system:masters" in self.groups

    def to_json(self) -> JSON:
        """`request.userInfo` for CEL."""
        return {
            "username": self.username,
            "uid": self.uid,
            "groups": list(self.groups),
            "extra": {k: list(v) for k, v in self.extra.items()},
        }


ADMIN = UserInfo("kubernetes-admin", groups=("system:masters", "system:authenticated"))


@dataclasses.dataclass
class BoundToken:
    """A service-account token as TokenRequest issues it, optionally bound to a pod."""

    namespace: str
    service_account: str
    pod_name: str | None = None
    #: The bound pod's uid; None accepts whichever pod has that name now.
    pod_uid: str | None = None
    #: `time.time()` after which the token is refused; None never expires.
    expires: float | None = None
    credential_id: str = dataclasses.field(default_factory=lambda: f"JTI={uuid.uuid4()}")


def service_account_user(token: BoundToken, objects: Objects, now: float) -> UserInfo:
    """The user a bound token authenticates as; 401 when it expired or what it is bound to
    (the service account, the pod of that uid) no longer exists, as the real server checks."""
    ns, name = token.namespace, token.service_account
    account = objects.get(("", "serviceaccounts", ns, name))
    pod = objects.get(("", "pods", ns, token.pod_name)) if token.pod_name else None
    expired = token.expires is not None and now >= token.expires
    pod_gone = token.pod_name is not None and (
        pod is None or token.pod_uid not in (None, pod["metadata"].get("uid"))
    )
    if account is None or expired or pod_gone:
        raise error(401, "Unauthorized", "Unauthorized")
    extra: dict[str, tuple[str, ...]] = {EXTRA_CREDENTIAL_ID: (token.credential_id,)}
    if pod is not None:
        extra[EXTRA_POD_NAME] = (str(pod["metadata"]["name"]),)
        extra[EXTRA_POD_UID] = (str(pod["metadata"].get("uid", "")),)
    return UserInfo(
        username=f"system:serviceaccount:{ns}:{name}",
        uid=str(account["metadata"].get("uid", "")),
        groups=("system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"),
        extra=extra,
    )


# --- authorization (RBAC) --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Attributes:
    """What RBAC and admission see of a resource request."""

    verb: str
    group: str
    version: str
    resource: str
    subresource: str | None
    namespace: str | None
    name: str | None

    @property
    def qualified(self) -> str:
        """`resource.group` as errors name it (`pods`, `deployments.apps`)."""
        return f"{self.resource}.{self.group}" if self.group else self.resource

    @property
    def full_resource(self) -> str:
        """`resource/subresource` as RBAC rules name it."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def request_verb(method: str, has_name: bool, watch: bool) -> str:
    """The RBAC verb of an HTTP request on a resource path."""
    if method == "GET":
        return "watch" if watch else ("get" if has_name else "list")
    if method == "DELETE":
        return "delete" if has_name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def _subject_matches(subject: JSON, user: UserInfo, binding_namespace: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_namespace
        return user.username == f"system:serviceaccount:{ns}:{name}"
    if kind == "User":
        return user.username == name
    return kind == "Group" and name in user.groups


def _rules(user: UserInfo, namespace: str | None, objects: Objects) -> Iterator[JSON]:
    for (group, plural, ns, _), binding in objects.items():
        if group != RBAC_GROUP or plural not in ("rolebindings", "clusterrolebindings"):
            continue
        if plural == "rolebindings" and ns != namespace:
            continue  # a RoleBinding grants only in its own namespace
        if not any(_subject_matches(s, user, ns) for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        if ref.get("kind") == "Role" and plural == "rolebindings":
            role = objects.get((RBAC_GROUP, "roles", ns, ref.get("name", "")))
        elif ref.get("kind") == "ClusterRole":
            role = objects.get((RBAC_GROUP, "clusterroles", "", ref.get("name", "")))
        else:
            role = None
        yield from (role or {}).get("rules") or []


def _rule_allows(rule: JSON, attrs: Attributes) -> bool:
    verbs, groups = rule.get("verbs") or [], rule.get("apiGroups") or []
    if not ("*" in verbs or attrs.verb in verbs) or not ("*" in groups or attrs.group in groups):
        return False
    resources = rule.get("resources") or []
    if not any(
        r in ("*", attrs.full_resource) or (attrs.subresource and r == f"*/{attrs.subresource}")
        for r in resources
    ):
        return False
    names = rule.get("resourceNames") or []
    return not names or attrs.name in names


def authorize(user: UserInfo, attrs: Attributes, objects: Objects) -> None:
    """Raise the real server's 403 unless the user's RBAC rules allow the request."""
    if user.is_admin or any(_rule_allows(r, attrs) for r in _rules(user, attrs.namespace, objects)):
        return
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    reason = (
        f'User "{user.username}" cannot {attrs.verb} resource "{attrs.full_resource}" '
        f'in API group "{attrs.group}" {where}'
    )
    subject = f'{attrs.qualified} "{attrs.name}"' if attrs.name else attrs.qualified
    details: JSON = {"group": attrs.group, "kind": attrs.resource}
    if attrs.name:
        details["name"] = attrs.name
    raise error(403, "Forbidden", f"{subject} is forbidden: {reason}", **details)


def _rule_permissions(rule: JSON) -> Iterator[tuple[str, str, str, str | None]]:
    """(group, resource, verb, resourceName or None) for every combination a rule grants."""
    for group in rule.get("apiGroups") or []:
        for resource in rule.get("resources") or []:
            for verb in rule.get("verbs") or []:
                for name in rule.get("resourceNames") or [None]:
                    yield group, resource, verb, name


def _held(user: UserInfo, namespace: str | None, objects: Objects, permission: Any) -> bool:
    group, resource, verb, name = permission
    res, _, sub = resource.partition("/")
    attrs = Attributes(verb, group, "", res, sub or None, namespace, name)
    return user.is_admin or any(_rule_allows(r, attrs) for r in _rules(user, namespace, objects))


def _not_held(rule: JSON) -> str:
    """A rule as the real server prints it in an escalation refusal."""
    parts = []
    for key, field in (
        ("APIGroups", "apiGroups"),
        ("Resources", "resources"),
        ("ResourceNames", "resourceNames"),
        ("Verbs", "verbs"),
    ):
        if rule.get(field):
            parts.append(f"{key}:[" + " ".join(f'"{v}"' for v in rule[field]) + "]")
    return "{" + ", ".join(parts) + "}"


def confirm_no_escalation(request: AdmissionRequest, objects: Objects) -> None:
    """RBAC's escalation check on writes of Roles, ClusterRoles and their bindings, as the real
    server runs it for every user: a Role may only grant what its author holds in that
    namespace (unless the author has `escalate` on it), a binding may only bind a role whose
    every permission its author holds (unless the author has `bind` on that role). Raises the
    real 403."""
    a, user, obj = request.attrs, request.user, request.object
    if a.group != RBAC_GROUP or a.subresource or obj is None or user.is_admin:
        return
    namespace = a.namespace if a.resource in ("roles", "rolebindings") else None
    if a.resource in ("roles", "clusterroles"):
        if _held(user, namespace, objects, (RBAC_GROUP, a.resource, "escalate", request.name)):
            return
        rules = obj.get("rules") or []
    elif a.resource in ("rolebindings", "clusterrolebindings"):
        ref = obj.get("roleRef") or {}
        kind, role_name = ref.get("kind"), str(ref.get("name") or "")
        plural = "roles" if kind == "Role" else "clusterroles"
        if _held(user, namespace, objects, (RBAC_GROUP, plural, "bind", role_name)):
            return
        role_namespace = (namespace or "") if kind == "Role" else ""
        role = objects.get((RBAC_GROUP, plural, role_namespace, role_name))
        rules = (role or {}).get("rules") or []
    else:
        return
    missing = [
        rule
        for rule in rules
        if rule.get("nonResourceURLs")
        or not all(_held(user, namespace, objects, p) for p in _rule_permissions(rule))
    ]
    if not missing:
        return
    groups = " ".join(f'"{g}"' for g in user.groups)
    raise error(
        403,
        "Forbidden",
        f'{a.qualified} "{request.name}" is forbidden: user "{user.username}" '
        f"(groups=[{groups}]) is attempting to grant RBAC permissions not currently held:\n"
        + "\n".join(_not_held(rule) for rule in missing),
        name=request.name,
        group=a.group,
        kind=a.resource,
    )


# --- admission (ValidatingAdmissionPolicy) ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdmissionRequest:
    """One write as validating admission sees it: `object` after the change, `oldObject`
    before it (None on CREATE and DELETE respectively)."""

    operation: str  # CREATE, UPDATE or DELETE
    attrs: Attributes
    kind: str
    user: UserInfo
    object: JSON | None
    old_object: JSON | None

    @property
    def name(self) -> str:
        """The object's name (from the body on CREATE)."""
        obj = self.object or self.old_object or {}
        return str(self.attrs.name or (obj.get("metadata") or {}).get("name") or "")

    def to_json(self) -> JSON:
        """`request` for CEL (an `admission.k8s.io/v1` AdmissionRequest)."""
        a = self.attrs
        kind = {"group": a.group, "version": a.version, "kind": self.kind}
        resource = {"group": a.group, "version": a.version, "resource": a.resource}
        return {
            "uid": str(uuid.uuid4()),
            "kind": kind,
            "resource": resource,
            "subResource": a.subresource or "",
            "requestKind": kind,
            "requestResource": resource,
            "requestSubResource": a.subresource or "",
            "name": self.name,
            "namespace": a.namespace or "",
            "operation": self.operation,
            "userInfo": self.user.to_json(),
            "dryRun": False,
        }


class _CelError(Exception):
    """An expression that failed to compile or evaluate."""


_PROGRAMS: dict[str, Any] = {}


def _run(expression: str, activation: JSON) -> Any:
    program = _PROGRAMS.get(expression)
    try:
        if program is None:
            program = _PROGRAMS[expression] = cel.compile(expression)
        return program.execute(cel.Context(activation))
    # cel-rust reports failures as ValueError, KeyError, TypeError, ZeroDivisionError, ...
    except Exception as exc:
        raise _CelError(f"expression '{expression}' resulted in error: {exc}") from exc


def _selector_matches(selector: JSON | None, labels: Mapping[str, str]) -> bool:
    if not selector:
        return True  # an empty selector matches everything
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator"), expr.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and key in labels and labels[key] in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _labels(obj: JSON | None) -> Mapping[str, str]:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}


def _rule_matches(rule: JSON, request: AdmissionRequest) -> bool:
    a = request.attrs
    ops, groups = rule.get("operations") or [], rule.get("apiGroups") or []
    versions, names = rule.get("apiVersions") or [], rule.get("resourceNames") or []
    if not ("*" in ops or request.operation in ops) or not ("*" in groups or a.group in groups):
        return False
    if not ("*" in versions or a.version in versions) or (names and request.name not in names):
        return False
    scope = rule.get("scope", "*")
    if (scope == "Cluster" and a.namespace) or (scope == "Namespaced" and not a.namespace):
        return False
    for entry in rule.get("resources") or []:
        # Admission splits `pods/status` in two: `*` alone matches no subresource, `*/*` all.
        res, _, sub = entry.partition("/")
        if res in ("*", a.resource) and sub in ("*", a.subresource or ""):
            return True
    return False


def _resources_match(match: JSON | None, request: AdmissionRequest, objects: Objects) -> bool:
    match = match or {}
    rules = match.get("resourceRules")
    if rules is not None and not any(_rule_matches(r, request) for r in rules):
        return False
    if any(_rule_matches(r, request) for r in match.get("excludeResourceRules") or []):
        return False
    a = request.attrs
    if a.namespace or (a.group, a.resource) == ("", "namespaces"):
        ns_name = a.namespace or request.name
        ns_obj = objects.get(("", "namespaces", "", ns_name)) or request.object
        # The real server labels every namespace with its name (and allows no other value).
        ns_labels = {**_labels(ns_obj), "kubernetes.io/metadata.name": ns_name}
        if not _selector_matches(match.get("namespaceSelector"), ns_labels):
            return False
    object_selector = match.get("objectSelector")
    return not object_selector or any(
        obj is not None and _selector_matches(object_selector, _labels(obj))
        for obj in (request.object, request.old_object)
    )


@dataclasses.dataclass(frozen=True)
class _Denial:
    message: str
    reason: str


def _evaluate(policy: JSON, request: AdmissionRequest, objects: Objects) -> _Denial | None:
    """The policy's first failed validation on `request`, or None when it admits it."""
    spec = policy.get("spec") or {}
    fail = spec.get("failurePolicy", "Fail") == "Fail"
    a = request.attrs
    namespace = objects.get(("", "namespaces", "", a.namespace)) if a.namespace else None
    activation: JSON = {
        "object": request.object,
        "oldObject": request.old_object,
        "request": request.to_json(),
        "namespaceObject": namespace,
        "params": None,
        "variables": {},
    }

    def failed(message: str) -> _Denial | None:
        return _Denial(message, "Invalid") if fail else None

    if spec.get("paramKind"):
        return failed("paramKind is not supported by the emulated API server")
    errors = []
    for condition in spec.get("matchConditions") or []:
        try:
            matched = _run(condition["expression"], activation)
        except _CelError as exc:
            errors.append(f"failed to evaluate matchCondition {condition.get('name')}: {exc}")
            continue
        if matched is False:
            return None  # one false condition skips the policy, whatever errors others had
        if matched is not True:
            errors.append(f"matchCondition {condition.get('name')} must evaluate to bool")
    if errors:
        return failed("; ".join(errors))
    variables: JSON = activation["variables"]
    broken: dict[str, str] = {}
    for variable in spec.get("variables") or []:
        name = variable["name"]
        try:
            variables[name] = _run(variable["expression"], activation)
        except _CelError as exc:
            broken[name] = str(exc)
    for validation in spec.get("validations") or []:
        expression = validation["expression"]
        used = set(re.findall(r"\bvariables\.([A-Za-z_]\w*)", expression)) & broken.keys()
        try:
            if used:
                name = sorted(used)[0]
                raise _CelError(f'composited variable "{name}" fails: {broken[name]}')
            ok = _run(expression, activation)
        except _CelError as exc:
            if fail:
                return _Denial(str(exc), "Invalid")
            continue
        if ok is True:
            continue
        if ok is not False:
            if fail:
                return _Denial(f"expression '{expression}' must evaluate to bool", "Invalid")
            continue
        message = validation.get("message") or f"failed expression: {expression.strip()}"
        if validation.get("messageExpression"):
            try:
                custom = _run(validation["messageExpression"], activation)
            except _CelError:
                custom = None  # the real server falls back to `message` too
            if isinstance(custom, str) and custom.strip():
                message = custom
        return _Denial(message, validation.get("reason") or "Invalid")
    return None


def admit(request: AdmissionRequest, objects: Objects) -> None:
    """Run every bound ValidatingAdmissionPolicy that matches `request`; raise the real
    server's error (`ValidatingAdmissionPolicy 'P' with binding 'B' denied request: ...`) for
    the first denial of a binding with the Deny action."""
    a = request.attrs
    if a.group == ADMISSION_GROUP and a.resource in _EXEMPT:
        return
    policies = {
        key[3]: obj
        for key, obj in objects.items()
        if key[:2] == (ADMISSION_GROUP, "validatingadmissionpolicies")
    }
    bindings = sorted(
        (key[3], obj)
        for key, obj in objects.items()
        if key[:2] == (ADMISSION_GROUP, "validatingadmissionpolicybindings")
    )
    for binding_name, binding in bindings:
        spec = binding.get("spec") or {}
        policy = policies.get(spec.get("policyName", ""))
        if policy is None or "Deny" not in (spec.get("validationActions") or []):
            continue  # a binding to a missing policy is ignored; Warn and Audit never refuse
        constraints = (policy.get("spec") or {}).get("matchConstraints")
        if not _resources_match(constraints, request, objects):
            continue
        if spec.get("matchResources") and not _resources_match(
            spec["matchResources"], request, objects
        ):
            continue
        denial = _evaluate(policy, request, objects)
        if denial is None:
            continue
        cause = (
            f"ValidatingAdmissionPolicy '{policy['metadata']['name']}' with binding "
            f"'{binding_name}' denied request: {denial.message}"
        )
        subject = f'{a.qualified} "{request.name}"' if request.name else a.qualified
        raise error(
            _REASON_CODES.get(denial.reason, 422),
            denial.reason,
            f"{subject} is forbidden: {cause}",
            name=request.name,
            group=a.group,
            kind=a.resource,
            causes=[{"message": cause}],
        )
