"""A small typed async Kubernetes API client (aiohttp) and its configuration, read with
kubernetes_asyncio's loader (merged KUBECONFIG, exec credential plugins, in-cluster accounts)."""

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
from hotload.kube.config import SERVICE_ACCOUNT_DIR, Credentials, KubeConfig

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "Credentials",
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
