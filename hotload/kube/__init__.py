"""A small typed async Kubernetes API client (aiohttp, no `kubernetes` package) and its config."""

from hotload.errors import (
    KubeConflictError,
    KubeError,
    KubeFieldConflictError,
    KubeForbiddenError,
    KubeGoneError,
    KubeInvalidError,
    KubeNotFoundError,
    KubeUnavailableError,
)
from hotload.kube.client import KubeClient, PatchType, error_from_status, resource_path
from hotload.kube.config import SERVICE_ACCOUNT_DIR, KubeConfig

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "KubeClient",
    "KubeConfig",
    "KubeConflictError",
    "KubeError",
    "KubeFieldConflictError",
    "KubeForbiddenError",
    "KubeGoneError",
    "KubeInvalidError",
    "KubeNotFoundError",
    "KubeUnavailableError",
    "PatchType",
    "error_from_status",
    "resource_path",
]
