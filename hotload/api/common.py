"""Types and pieces shared by the custom resources' models (`hotload.api.models`): identities,
quantities, conditions, and the Pod-spec fragments a HotLoadDeployment carries."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from hotload.api.names import IDENTITY_PATTERN

Identity = Annotated[
    str,
    Field(
        pattern=IDENTITY_PATTERN,
        min_length=1,
        max_length=128,
        description="A snapshot identity: one path segment of 1-128 characters from "
        "A-Z a-z 0-9 . _ - starting with a letter or digit.",
    ),
]
Quantity = Annotated[
    str,
    Field(
        pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$",
        max_length=32,
        description="A Kubernetes quantity, e.g. 500m, 2, 16Gi.",
    ),
]
TransitionMode = Literal["async", "sync"]
PromptCachePolicy = Literal["all", "none", "new_session"]
EngineKind = Literal["reference", "vllm", "sglang"]
SnapshotKind = Literal["full", "incremental", "lora"]
ConditionStatus = Literal["True", "False", "Unknown"]


class ApiModel(BaseModel):
    """The base of every model of the API: camelCase on the wire, unknown fields refused (the
    API server prunes them anyway)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False
    )

    def to_json(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --- shared pieces --------------------------------------------------------------------------


class Condition(ApiModel):
    """A condition in the Kubernetes API conventions' shape."""

    type: str = Field(max_length=316, description="Condition type, e.g. Ready.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        max_length=1024,
        pattern=r"^([A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?)?$",
        description="One CamelCase word saying why (documented constants in hotload.api.names).",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable detail.")
    last_transition_time: str = Field(
        description="When the status last changed (RFC 3339).", max_length=64
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="The .metadata.generation the condition was set from."
    )


class ResourceRequirements(ApiModel):
    """Compute resources of a container, as in a Pod spec."""

    requests: dict[str, Quantity] | None = Field(
        default=None, description="Minimum resources, e.g. {cpu: '4', memory: 32Gi}."
    )
    limits: dict[str, Quantity] | None = Field(
        default=None, description="Maximum resources, e.g. {memory: 64Gi}."
    )


class EnvVar(ApiModel):
    """A plain environment variable."""

    name: str = Field(min_length=1, max_length=256, description="Variable name.")
    value: str = Field(default="", max_length=32768, description="Variable value.")


class Toleration(ApiModel):
    """A toleration, as in a Pod spec."""

    key: str | None = Field(default=None, max_length=316, description="Taint key to match.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (default Equal)."
    )
    value: str | None = Field(default=None, max_length=63, description="Taint value to match.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match (empty: all)."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )


# --- HotLoadDeployment ------------------------------------------------------------------------


class ObjectMetaOverlay(ApiModel):
    """Labels and annotations for every replica pod."""

    labels: dict[str, Annotated[str, Field(max_length=63)]] | None = Field(
        default=None, description="Added to the pod's labels (the operator's own keys win)."
    )
    annotations: dict[str, str] | None = Field(
        default=None, description="Added to the pod's annotations (the operator's own keys win)."
    )


class PodTemplateOverlay(ApiModel):
    """Pod settings the operator has no field for, laid under the pod it builds."""

    metadata: ObjectMetaOverlay | None = Field(
        default=None, description="Labels and annotations for the pods."
    )
    spec: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
        description="A partial Pod spec (affinity, topologySpreadConstraints, "
        "priorityClassName, runtimeClassName, securityContext, volumes, extra containers, "
        "...). The operator's pod is merged over it: lists of named items (containers, "
        "initContainers, volumes, env, imagePullSecrets) by name, volumeMounts by mountPath, "
        "ports by containerPort, other lists replaced; fields the operator sets win (a "
        "variable it sets replaces the template's whole), except "
        "the securityContexts, which are defaults the template may change. The API server "
        "validates the result when the operator applies the Deployment (a refusal shows as "
        "Degraded=True, InvalidSpec).",
    )


class ServiceAccountSpec(ApiModel):
    """The replicas' service account (the loader's identity)."""

    annotations: dict[str, str] | None = Field(
        default=None,
        description="Annotations of the service account, e.g. eks.amazonaws.com/role-arn (IRSA) "
        "or iam.gke.io/gcp-service-account (GKE Workload Identity) for bucket access.",
    )


class LocalObjectReference(ApiModel):
    """A reference to an object in the same namespace."""

    name: str = Field(min_length=1, max_length=253, description="The object's name.")
