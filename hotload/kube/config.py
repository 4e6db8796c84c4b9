"""Where the Kubernetes API is and how to authenticate: kubeconfig files and in-cluster accounts.

Reading kubeconfigs and getting credentials is left to `kubernetes_asyncio.config`, the asyncio
port of the official Python client's loader (the official `kubernetes` package now ships the
same code as `kubernetes.aio`):

- `KUBECONFIG` with several files joined by `os.pathsep` is merged as kubectl merges it
  (`KubeConfigMerger`: the first file to name a cluster, user or context wins; hotload also takes
  `current-context` from the first file that sets it, as kubectl does, where the library takes
  the last);
- `exec` credential plugins (`aws eks get-token`, `gke-gcloud-auth-plugin`, `kubelogin`, OIDC
  helpers) run through its `ExecProvider`, an asyncio subprocess that never blocks the event
  loop; a plugin may return a token or a client certificate and key;
- `auth-provider` users (oidc, gcp) go through its `KubeConfigLoader`.

In a pod (the operator, loaders, routers), the service account is read by hotload itself
(`KubeConfig.in_cluster`): the library's config module imports its generated API client,
39 MiB and 0.9 s per process here, which every loader sidecar would pay for what is a host,
a CA file and a token file, and its in-cluster loader re-reads a rotated token only every
minute. The library is imported only when a kubeconfig is read.

hotload keeps what the library lacks: a plugin's credential is cached until its
`expirationTimestamp` (the library re-runs a plugin that returned a certificate on every call)
and shared by concurrent requests; after a 401 it is dropped, so that `KubeClient` runs the
plugin once more and retries; token files (bound service-account tokens rotate about hourly)
are re-read as soon as they change; errors name the kubeconfig, the user and the plugin's
command line with its stderr or its `installHint`.

Why kubernetes_asyncio rather than the synchronous `kubernetes` package: it runs plugins without
blocking the event loop and raises their failures (the synchronous loader logs them and goes on
unauthenticated), and next to aiohttp, which hotload uses already, it adds five small
pure-Python packages (certifi, python-dateutil, six, tzdata, urllib3) where `kubernetes` adds
requests, oauthlib, websocket-client, aiohttp-retry and 75 MB of its own.

Not supported: username and password, `provideClusterInfo`, `tls-server-name`, `proxy-url`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import os
import shlex
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hotload.errors import KubeError

if TYPE_CHECKING:
    from kubernetes_asyncio.config.kube_config import ConfigNode, KubeConfigMerger

#: Where Kubernetes mounts a pod's service-account credentials.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: A token file is read again at least this often, changed or not.
TOKEN_REREAD_SECONDS = 60.0
#: A plugin's credential is renewed this long before its `expirationTimestamp`, so that no
#: request sets out with a token that expires on the way.
EXPIRY_MARGIN_SECONDS = 10.0


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Credentials:
    """What authenticates requests now: a bearer token and/or a client certificate and key
    (PEM) from a credential plugin, and when they expire (None: when the server refuses them)."""

    token: str | None = None
    client_cert_data: str | None = None
    client_key_data: str | None = None
    expires: datetime.datetime | None = None

    def expired(self) -> bool:
        """Whether these are at, or within `EXPIRY_MARGIN_SECONDS` of, their expiry."""
        if self.expires is None:
            return False
        return _now() >= self.expires - datetime.timedelta(seconds=EXPIRY_MARGIN_SECONDS)


class CredentialPlugin:
    """A kubeconfig user's credential plugin (`exec` or `auth-provider`): its credentials are
    cached until they expire or the server refuses them, and one run serves every request that
    waits for it."""

    def __init__(self, fetch: Callable[[], Awaitable[Credentials]], description: str) -> None:
        self._fetch = fetch
        #: What the plugin is, for messages: the kubeconfig, the user, the command line.
        self.description = description
        #: How many times the plugin ran.
        self.runs = 0
        self._lock = threading.Lock()
        self._cached: Credentials | None = None
        # The run in progress, with the event loop it runs on (a client per loop may share us).
        self._pending: tuple[asyncio.AbstractEventLoop, asyncio.Task[Credentials]] | None = None

    def cached(self) -> Credentials | None:
        """The cached credentials, or None when there are none or they expired."""
        with self._lock:
            cached = self._cached
        return None if cached is None or cached.expired() else cached

    async def credentials_async(self) -> Credentials:
        """The cached credentials, or new ones from a run of the plugin (an asyncio subprocess
        that every concurrent caller on this event loop waits for)."""
        cached = self.cached()
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        pending = self._pending
        if pending is None or pending[0] is not loop or pending[1].done():
            task = loop.create_task(self._run())
            task.add_done_callback(self._finished)
            pending = self._pending = (loop, task)
        # A cancelled caller must not cancel the run the others wait for.
        return await asyncio.shield(pending[1])

    def credentials(self) -> Credentials:
        """`credentials_async` for synchronous callers (kopf's login runs in a worker thread):
        the plugin runs on a private event loop, in a helper thread when this one runs a loop."""
        cached = self.cached()
        if cached is not None:
            return cached
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._run())
        with ThreadPoolExecutor(1, thread_name_prefix="hotload-credentials") as pool:
            return pool.submit(asyncio.run, self._run()).result()

    def invalidate(self, refused: Credentials) -> None:
        """Forget `refused` (the server answered 401): the next request runs the plugin again.
        Credentials that a newer run cached meanwhile are kept."""
        with self._lock:
            if self._cached is refused:
                self._cached = None

    async def _run(self) -> Credentials:
        credentials = await self._fetch()
        with self._lock:
            self._cached = credentials
            self.runs += 1
        return credentials

    def _finished(self, task: asyncio.Task[Credentials]) -> None:
        pending = self._pending
        if pending is not None and pending[1] is task:
            self._pending = None
        if not task.cancelled():
            task.exception()  # retrieved: the waiters, if any are left, raise it themselves


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
    #: The user's `exec` or `auth-provider` plugin; it supplies the token (or client
    #: certificate) in place of the fields above.
    plugin: CredentialPlugin | None = field(default=None, repr=False, compare=False)

    def credentials(self) -> Credentials:
        """What to authenticate with now; a plugin whose credentials expired runs first (in a
        helper thread when called on an event loop: async code awaits `credentials_async`)."""
        if self.plugin is not None:
            return self.plugin.credentials()
        return Credentials(token=self._static_token())

    async def credentials_async(self) -> Credentials:
        """`credentials` without blocking the event loop while a plugin runs."""
        if self.plugin is not None:
            return await self.plugin.credentials_async()
        return Credentials(token=self._static_token())

    def bearer_token(self) -> str | None:
        """The token to send now: the inline one, the token file's current content, or the
        plugin's (see `credentials`)."""
        return self.credentials().token

    def refresh_credentials(self, refused: Credentials) -> bool:
        """After the server answered 401 to `refused`: drop what may be stale; whether the next
        attempt may authenticate differently (a plugin runs again, a token file changed)."""
        if self.plugin is not None:
            self.plugin.invalidate(refused)
            return True
        if self.token_file is not None:
            self._token_cache = None
            return self._static_token() != refused.token
        return False

    def _static_token(self) -> str | None:
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
        # Read here, without kubernetes_asyncio (the module docstring says why).
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
        """The settings of `context` (default: the current context) in a kubeconfig file, or in
        several merged as kubectl merges them (`path` joined with `os.pathsep`, as in
        `KUBECONFIG`; files that do not exist are skipped)."""
        files = [os.path.expanduser(p) for p in str(path).split(os.pathsep) if p]
        existing = [f for f in files if os.path.exists(f)]
        if not existing:
            raise KubeError(f"cannot read kubeconfig {path}: no such file")
        return _from_files(existing, context)

    @classmethod
    def auto(cls, kubeconfig: str | Path | None = None, context: str | None = None) -> KubeConfig:
        """The first that exists of: `kubeconfig`, `$KUBECONFIG` (its files merged),
        in-cluster, `~/.kube/config`."""
        if kubeconfig is not None:
            return cls.from_kubeconfig(kubeconfig, context)
        env = os.environ.get("KUBECONFIG", "")
        if any(Path(p).expanduser().is_file() for p in env.split(os.pathsep) if p):
            return cls.from_kubeconfig(env, context)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
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


def _merge(files: list[str]) -> KubeConfigMerger:
    from kubernetes_asyncio.config.config_exception import ConfigException
    from kubernetes_asyncio.config.kube_config import KubeConfigMerger

    label = os.pathsep.join(files)
    for file in files:
        # The merger takes a YAML document that is not a mapping for a broken merge.
        try:
            doc = yaml.safe_load(Path(file).read_text())
        except OSError as exc:
            raise KubeError(f"cannot read kubeconfig {file}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise KubeError(f"kubeconfig {file} is not valid YAML: {exc}") from exc
        if not isinstance(doc, dict):
            raise KubeError(f"kubeconfig {file} is not a mapping")
    try:
        return KubeConfigMerger(label)
    except (ConfigException, OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise KubeError(f"kubeconfig {label}: {exc}") from exc


def _named(merged: ConfigNode, key: str, name: str, label: str) -> tuple[dict[str, Any], Path]:
    """The `key[:-1]` entry called `name` of the merged kubeconfig and the file it came from."""
    from kubernetes_asyncio.config.config_exception import ConfigException

    try:
        node = merged[key].get_with_name(name, safe=True)
    except (ConfigException, KeyError, TypeError) as exc:
        raise KubeError(f"kubeconfig {label}: {exc}") from exc
    value = node.value.get(key[:-1]) if node is not None else None
    if node is None or not isinstance(value, dict):
        raise KubeError(f"kubeconfig {label}: {key[:-1]} {name!r} is not defined")
    return value, Path(node.path or label)


def _pem(data: Any, file: Path, what: str) -> str | None:
    if not data:
        return None
    try:
        return base64.b64decode(str(data)).decode()
    except ValueError as exc:
        raise KubeError(f"kubeconfig {file}: {what} is not valid base64") from exc


def _relative(value: Any, file: Path) -> str | None:
    # kubectl resolves relative file references against the folder of the file that made them.
    if not value:
        return None
    return str((file.parent / Path(str(value)).expanduser()).resolve())


def _from_files(files: list[str], context: str | None) -> KubeConfig:
    merger = _merge(files)
    label = os.pathsep.join(files)
    merged = merger.config
    assert merged is not None  # at least one file exists
    # kubectl: the first file that sets current-context wins (the merger keeps the last).
    current = next(
        (merger.config_files[f]["current-context"] for f in merger.paths
         if merger.config_files[f].get("current-context")),
        None,
    )  # fmt: skip
    name = context or current
    if not name:
        raise KubeError(f"kubeconfig {label} has no current-context; name a context")
    ctx, _ = _named(merged, "contexts", str(name), label)
    cluster, cluster_file = _named(merged, "clusters", str(ctx.get("cluster", "")), label)
    user_name = str(ctx["user"]) if ctx.get("user") else None
    user, user_file = _named(merged, "users", user_name, label) if user_name else ({}, Path())
    server = cluster.get("server")
    if not server:
        raise KubeError(f"kubeconfig {cluster_file}: cluster {ctx.get('cluster')!r} has no server")
    where = f"kubeconfig {user_file}: user {user_name!r}"
    plugin = None
    if isinstance(user.get("exec"), dict):
        plugin = _exec_plugin(user["exec"], user_file, where)
    elif isinstance(user.get("auth-provider"), dict):
        plugin = _auth_provider(merged, str(name), user["auth-provider"], where)
    return KubeConfig(
        server=str(server).rstrip("/"),
        namespace=str(ctx.get("namespace") or "default"),
        ca_data=_pem(
            cluster.get("certificate-authority-data"), cluster_file, "certificate-authority"
        ),
        ca_file=_relative(cluster.get("certificate-authority"), cluster_file),
        insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify", False)),
        token=str(user["token"]) if user.get("token") else None,
        token_file=_relative(user.get("tokenFile"), user_file),
        client_cert_data=_pem(user.get("client-certificate-data"), user_file, "client-certificate"),
        client_cert_file=_relative(user.get("client-certificate"), user_file),
        client_key_data=_pem(user.get("client-key-data"), user_file, "client-key"),
        client_key_file=_relative(user.get("client-key"), user_file),
        source=f"kubeconfig {label} (context {name})",
        plugin=plugin,
    )


def _exec_plugin(spec: dict[str, Any], file: Path, where: str) -> CredentialPlugin:
    """The user's `exec` plugin, run by kubernetes_asyncio's `ExecProvider`."""
    from kubernetes_asyncio.config.config_exception import ConfigException
    from kubernetes_asyncio.config.exec_provider import ExecProvider
    from kubernetes_asyncio.config.kube_config import ConfigNode

    spec = dict(spec)
    command = str(spec.get("command") or "")
    # As kubectl does: a relative command with a path in it is relative to the kubeconfig.
    if os.sep in command and not os.path.isabs(command):
        spec["command"] = command = str(file.parent / command)
    args = spec.get("args")
    line = shlex.join([command, *map(str, args if isinstance(args, list) else [])])
    what = f"{where}: credential plugin `{line}`"
    hint = str(spec.get("installHint") or "").strip()

    async def fetch() -> Credentials:
        try:
            status = await ExecProvider(ConfigNode("exec", spec, str(file))).run()
        except FileNotFoundError as exc:
            raise KubeError(
                f"{what}: {command} is not installed (not found on PATH)"
                + (f". {hint}" if hint else "")
            ) from exc
        except OSError as exc:
            raise KubeError(f"{what}: cannot run it: {exc}") from exc
        except (ConfigException, KeyError, TypeError, ValueError) as exc:
            # The library's words: "exec: process returned 1. <stderr>", "exec: failed to
            # decode process output: ...", "exec: plugin api version ... does not match ...".
            raise KubeError(f"{what} failed: {str(exc).removeprefix('exec: ')}") from exc
        return _exec_credentials(status, what)

    return CredentialPlugin(fetch, what)


def _exec_credentials(status: Any, what: str) -> Credentials:
    """The `status` of an ExecCredential as `Credentials`."""
    from kubernetes_asyncio.config.dateutil import parse_rfc3339

    if not isinstance(status, dict):
        raise KubeError(f"{what} returned an ExecCredential without a status")
    token = status.get("token") or None
    cert = status.get("clientCertificateData") or None
    key = status.get("clientKeyData") or None
    if not token and not (cert and key):
        raise KubeError(
            f"{what} returned neither a token nor a client certificate and key "
            "(status.token, status.clientCertificateData and status.clientKeyData)"
        )
    expires = None
    if status.get("expirationTimestamp"):
        try:
            expires = parse_rfc3339(str(status["expirationTimestamp"]))
        except ValueError as exc:
            raise KubeError(f"{what} returned a bad expirationTimestamp: {exc}") from exc
    return Credentials(
        token=str(token) if token else None,
        client_cert_data=str(cert) if cert else None,
        client_key_data=str(key) if key else None,
        expires=expires,
    )


def _auth_provider(
    merged: ConfigNode, context: str, provider: dict[str, Any], where: str
) -> CredentialPlugin:
    """The user's `auth-provider` (oidc, gcp), run by kubernetes_asyncio's `KubeConfigLoader`:
    its token is kept until the server refuses it (the loader refreshes an expired one)."""
    from kubernetes_asyncio.client import Configuration
    from kubernetes_asyncio.config.kube_config import KubeConfigLoader

    what = f"{where}: auth-provider {provider.get('name')!r}"

    async def fetch() -> Credentials:
        settings = Configuration()
        try:
            loader = KubeConfigLoader(merged, active_context=context, config_base_path=None)
            await loader.load_and_set(settings)
        except ImportError as exc:
            raise KubeError(
                f"{what} needs a package that is not installed ({exc}); the gcp provider needs "
                "google-auth, or use gke-gcloud-auth-plugin (an exec plugin)"
            ) from exc
        except Exception as exc:  # the loader raises whatever its provider raised
            raise KubeError(f"{what} failed: {exc}") from exc
        value = str(settings.api_key.get("BearerToken") or "")
        if not value:
            raise KubeError(f"{what} gave no token")
        return Credentials(token=value.removeprefix("Bearer ").strip())

    return CredentialPlugin(fetch, what)
