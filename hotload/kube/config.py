"""Where the Kubernetes API is and how to authenticate: kubeconfig files and in-cluster accounts.

Supported: server URL, CA (data or file), `insecure-skip-tls-verify`, bearer token (inline or
file), client certificate and key (data or files). Not supported: `exec` and `auth-provider`
credential plugins (cloud CLIs); such a context raises a `KubeError` that says so.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hotload.errors import KubeError

#: Where Kubernetes mounts a pod's service-account credentials.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: A token file is read again at least this often, changed or not.
TOKEN_REREAD_SECONDS = 60.0


@dataclass
class KubeConfig:
    """Connection settings for one API server; build it with one of the class methods."""

    server: str
    namespace: str = "default"
    ca_data: str | None = None  # PEM
    ca_file: str | None = None
    insecure_skip_tls_verify: bool = False
    token: str | None = None
    #: Read again whenever it changes: bound service-account tokens rotate (about hourly).
    token_file: str | None = None
    client_cert_data: str | None = None  # PEM
    client_cert_file: str | None = None
    client_key_data: str | None = None  # PEM
    client_key_file: str | None = None
    #: Where these settings came from, for error messages.
    source: str = ""
    _token_cache: tuple[tuple[int, int, int], str, float] | None = field(default=None, repr=False)

    def bearer_token(self) -> str | None:
        """The token to send now: the inline one, or the token file's current content."""
        if self.token_file is None:
            return self.token
        try:
            stat = os.stat(self.token_file)
        except OSError as exc:
            raise KubeError(f"cannot read the token file {self.token_file}: {exc}") from exc
        # A stat per request is cheap and shows a rotation at once (the kubelet swaps in a new
        # file: new inode); the periodic re-read covers in-place rewrites within one mtime tick.
        now = time.monotonic()
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        cache = self._token_cache
        if cache is None or cache[0] != stamp or now - cache[2] > TOKEN_REREAD_SECONDS:
            token = Path(self.token_file).read_text().strip()
            cache = self._token_cache = (stamp, token, now)
        return cache[1]

    @classmethod
    def in_cluster(cls, directory: str | Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
        """The pod's own service account: `KUBERNETES_SERVICE_HOST`/`_PORT` and its token."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        folder = Path(directory)
        token_file = folder / "token"
        if not host or not token_file.is_file():
            raise KubeError(
                "not running in a Kubernetes pod: KUBERNETES_SERVICE_HOST is unset or "
                f"{token_file} is missing"
            )
        if ":" in host:  # an IPv6 address needs brackets in a URL
            host = f"[{host}]"
        ca_file = folder / "ca.crt"
        ns_file = folder / "namespace"
        namespace = ns_file.read_text().strip() if ns_file.is_file() else "default"
        return cls(
            server=f"https://{host}:{port}",
            namespace=namespace or "default",
            ca_file=str(ca_file) if ca_file.is_file() else None,
            token_file=str(token_file),
            source=f"in-cluster service account ({folder})",
        )

    @classmethod
    def from_kubeconfig(cls, path: str | Path, context: str | None = None) -> KubeConfig:
        """The settings of `context` (default: the file's current context) in a kubeconfig file."""
        file = Path(path).expanduser()
        try:
            doc = yaml.safe_load(file.read_text())
        except OSError as exc:
            raise KubeError(f"cannot read kubeconfig {file}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise KubeError(f"kubeconfig {file} is not valid YAML: {exc}") from exc
        if not isinstance(doc, dict):
            raise KubeError(f"kubeconfig {file} is not a mapping")
        return _from_document(doc, file, context)

    @classmethod
    def auto(cls, kubeconfig: str | Path | None = None, context: str | None = None) -> KubeConfig:
        """The first that exists of: `kubeconfig`, `$KUBECONFIG` (first file), in-cluster."""
        if kubeconfig is not None:
            return cls.from_kubeconfig(kubeconfig, context)
        env = os.environ.get("KUBECONFIG", "")
        for candidate in (p for p in env.split(os.pathsep) if p):
            if Path(candidate).expanduser().is_file():
                return cls.from_kubeconfig(candidate, context)
        try:
            return cls.in_cluster()
        except KubeError:
            pass
        default = Path("~/.kube/config").expanduser()
        if default.is_file():
            return cls.from_kubeconfig(default, context)
        raise KubeError(
            "no Kubernetes configuration found: pass a kubeconfig path, set KUBECONFIG to a "
            "kubeconfig file, or run inside a pod with a service account "
            f"(KUBERNETES_SERVICE_HOST and {SERVICE_ACCOUNT_DIR}/token)"
        )


def _named(doc: dict[str, Any], key: str, name: str, file: Path) -> dict[str, Any]:
    for item in doc.get(key) or []:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(key[:-1]) or {}
            if isinstance(value, dict):
                return value
    raise KubeError(f"kubeconfig {file}: {key[:-1]} {name!r} is not defined")


def _pem(data: Any, file: Path, what: str) -> str | None:
    if not data:
        return None
    try:
        return base64.b64decode(str(data)).decode()
    except ValueError as exc:
        raise KubeError(f"kubeconfig {file}: {what} is not valid base64") from exc


def _relative(value: Any, file: Path) -> str | None:
    # kubectl resolves relative file references against the kubeconfig's own folder.
    if not value:
        return None
    return str((file.parent / Path(str(value)).expanduser()).resolve())


def _from_document(doc: dict[str, Any], file: Path, context: str | None) -> KubeConfig:
    name = context or doc.get("current-context")
    if not name:
        raise KubeError(f"kubeconfig {file} has no current-context; name a context")
    ctx = _named(doc, "contexts", str(name), file)
    cluster = _named(doc, "clusters", str(ctx.get("cluster", "")), file)
    user = _named(doc, "users", str(ctx["user"]), file) if ctx.get("user") else {}
    if "exec" in user or "auth-provider" in user:
        raise KubeError(
            f"kubeconfig {file}: user {ctx.get('user')!r} uses a credential plugin (exec or "
            "auth-provider), which hotload does not run; use a token or client certificate"
        )
    server = cluster.get("server")
    if not server:
        raise KubeError(f"kubeconfig {file}: cluster {ctx.get('cluster')!r} has no server")
    return KubeConfig(
        server=str(server).rstrip("/"),
        namespace=str(ctx.get("namespace") or "default"),
        ca_data=_pem(cluster.get("certificate-authority-data"), file, "certificate-authority"),
        ca_file=_relative(cluster.get("certificate-authority"), file),
        insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify", False)),
        token=str(user["token"]) if user.get("token") else None,
        token_file=_relative(user.get("tokenFile"), file),
        client_cert_data=_pem(user.get("client-certificate-data"), file, "client-certificate"),
        client_cert_file=_relative(user.get("client-certificate"), file),
        client_key_data=_pem(user.get("client-key-data"), file, "client-key"),
        client_key_file=_relative(user.get("client-key"), file),
        source=f"kubeconfig {file} (context {name})",
    )
