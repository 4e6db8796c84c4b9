"""Kubernetes credentials as managed clusters hand them out: exec credential plugins (a script
issuing real, expiring service-account tokens, as `aws eks get-token` or `kubelogin` issue
theirs), a KUBECONFIG split over several files, an OIDC auth-provider, a plugin's client
certificate; and `hotload status`, the `Publisher` and the operator's kopf login on them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

import hotload.kube.config as kube_config
from hotload.errors import KubeError, KubeForbiddenError
from hotload.kube import KubeClient, KubeConfig, resource_path
from hotload.sdk import Publisher
from support.cli import hotload
from support.cluster import install_crds
from support.kubeapi import KubeAPI, write_kubeconfig
from support.operator import (
    create_fleet,
    eventually,
    hld_path,
    loaders_follow_the_ledger,
    running_operator,
)
from support.snapshots import CONFIG, weights

EXEC_API = "client.authentication.k8s.io/v1"
REPO_ROOT = Path(__file__).resolve().parent.parent

PLUGIN = """#!{python}
# A credential plugin as kubectl runs one: ExecCredential JSON on stdout. Its folder holds what
# it hands out: `tokens` (one a line; all but the last are handed out once each), `lifetime`
# (seconds until expirationTimestamp), `mode` (token, cert, fail, garbage, empty); every run
# appends KUBERNETES_EXEC_INFO to `calls`.
import datetime, json, os, sys
from pathlib import Path

here = Path(__file__).parent
with open(here / "calls", "a") as calls:
    calls.write(os.environ.get("KUBERNETES_EXEC_INFO", "") + "\\n")
mode = (here / "mode").read_text().strip() if (here / "mode").exists() else "token"
if mode == "fail":
    print("error: the SSO session has expired; run 'cloud sso login'", file=sys.stderr)
    sys.exit(3)
if mode == "garbage":
    print("Welcome to the cloud CLI, version 2!")
    sys.exit(0)
lifetime = int((here / "lifetime").read_text()) if (here / "lifetime").exists() else 600
expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=lifetime)
status = {{"expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}}
if mode == "cert":
    status["clientCertificateData"] = (here / "cert.pem").read_text()
    status["clientKeyData"] = (here / "key.pem").read_text()
elif mode == "token":
    tokens = (here / "tokens").read_text().split()
    if len(tokens) > 1:
        (here / "tokens").write_text("\\n".join(tokens[1:]))
    status["token"] = tokens[0]
print(json.dumps({{"apiVersion": "{api}", "kind": "ExecCredential", "status": status}}))
"""


class Plugin:
    """A credential plugin script in a folder of its own, and what it was asked."""

    def __init__(self, folder: Path, tokens: list[str] | None = None, lifetime: int = 600) -> None:
        folder.mkdir(parents=True)
        self.folder = folder
        self.command = folder / "plugin.py"
        self.command.write_text(PLUGIN.format(python=sys.executable, api=EXEC_API))
        self.command.chmod(0o755)
        self.set(tokens=tokens or ["unused"], lifetime=lifetime)

    def set(
        self,
        *,
        tokens: list[str] | None = None,
        lifetime: int | None = None,
        mode: str | None = None,
    ) -> None:
        """Change what the next runs hand out."""
        if tokens is not None:
            (self.folder / "tokens").write_text("\n".join(tokens))
        if lifetime is not None:
            (self.folder / "lifetime").write_text(str(lifetime))
        if mode is not None:
            (self.folder / "mode").write_text(mode)

    @property
    def calls(self) -> int:
        """How many times it ran."""
        path = self.folder / "calls"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def user(self, **extra: Any) -> dict[str, Any]:
        """The kubeconfig `user` that runs it."""
        return {"exec": {"apiVersion": EXEC_API, "command": str(self.command), **extra}}


def exec_kubeconfig(path: Path, api: KubeAPI, user: dict[str, Any]) -> Path:
    """A copy of the fixture's kubeconfig whose user is `user` (e.g. a plugin's)."""
    doc = yaml.safe_load(api.kubeconfig.read_text())
    current = doc["current-context"]
    context = next(c["context"] for c in doc["contexts"] if c["name"] == current)
    context["namespace"] = api.namespace
    for entry in doc["users"]:
        if entry["name"] == context["user"]:
            entry["user"] = user
    path.write_text(yaml.safe_dump(doc))
    return path


async def service_account_token(
    api: KubeAPI, account: str, *, rules: list[dict[str, Any]] | None = None
) -> str:
    """A real token of a new service account (TokenRequest, 10 minutes: the API server's
    shortest), once RBAC lets it do what `rules` say (default: the `view` role)."""
    rbac = "rbac.authorization.k8s.io/v1"
    ns = api.namespace
    async with api.client() as admin:
        role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"}
        if rules is not None:
            await admin.create(
                resource_path(rbac, "roles", ns),
                {"metadata": {"name": account}, "rules": rules},
            )
            role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account}
        await admin.create(
            resource_path(rbac, "rolebindings", ns),
            {
                "metadata": {"name": account},
                "roleRef": role_ref,
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}],
            },
        )
    config = await api.service_account_config(account, expiration_seconds=600)
    await _allowed(config, resource_path("v1", "pods", ns))
    assert config.token is not None
    return config.token


async def _allowed(config: KubeConfig, path: str) -> None:
    """Wait until the server's RBAC caches let `config` list `path`."""
    async with KubeClient(config, retries=0) as kube:

        async def lists() -> bool:
            try:
                await kube.list(path)
            except KubeForbiddenError:
                return False
            return True

        await eventually(f"RBAC to allow listing {path}", lists)


def _clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Move hotload's credential clock `seconds` ahead of the real one."""
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    monkeypatch.setattr(kube_config, "_now", lambda: later)


# --- exec plugins on a real API server -------------------------------------------------------


@pytest.mark.asyncio
async def test_an_exec_plugin_token_is_reused_until_it_expires_and_renewed_after_a_401(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = real_kube_api
    token = await service_account_token(api, "reader")
    plugin = Plugin(tmp_path / "plugin", [token], lifetime=600)
    kubeconfig = exec_kubeconfig(tmp_path / "kubeconfig", api, plugin.user())
    config = KubeConfig.from_kubeconfig(kubeconfig)
    pods = resource_path("v1", "pods", api.namespace)
    async with KubeClient(config, retries=0) as kube:
        # Concurrent requests wait for one run; later ones reuse its token.
        await asyncio.gather(*(kube.list(pods) for _ in range(5)))
        await kube.list(pods)
        assert plugin.calls == 1
        info = json.loads((plugin.folder / "calls").read_text().splitlines()[0])
        assert info["kind"] == "ExecCredential" and info["apiVersion"] == EXEC_API
        cached = config.credentials()
        assert cached.token == token and cached.expires is not None
        assert 500 < (cached.expires - datetime.datetime.now(datetime.UTC)).total_seconds() <= 600

        # Ten minutes on, the token has expired: the plugin runs again.
        plugin.set(lifetime=3600)
        _clock(monkeypatch, 601)
        await kube.list(pods)
        await kube.list(pods)
        assert plugin.calls == 2

        # The next token is one the server refuses (401): the plugin runs once more and the
        # request goes through with the token after it.
        plugin.set(tokens=["revoked-token", token], lifetime=7200)
        _clock(monkeypatch, 3601)
        assert (await kube.list(pods))["kind"] == "PodList"
        assert plugin.calls == 4
        await kube.list(pods)
        assert plugin.calls == 4

        # A plugin that hands out only refused tokens: one retry, then the server's 401.
        plugin.set(tokens=["revoked-1", "revoked-2"])
        _clock(monkeypatch, 7201)
        with pytest.raises(KubeForbiddenError) as refused:
            await kube.list(pods)
        assert refused.value.status == 401 and plugin.calls == 6


@pytest.mark.asyncio
async def test_a_split_kubeconfig_is_merged_as_kubectl_merges_it(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The context in one file, the cluster in another, the user in a third (each with a path
    relative to its own file), and a later file whose same-named entries and current-context
    lose, joined with os.pathsep as in KUBECONFIG."""
    api = real_kube_api
    admin = yaml.safe_load(api.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]["server"]
    token = admin["users"][0]["user"]["token"]
    folders = {name: tmp_path / name for name in ("contexts", "clusters", "users", "later")}
    for folder in folders.values():
        folder.mkdir()
    cluster: dict[str, Any] = {"server": server}
    # The shared control plane's serving certificate (chain with its CA): TLS is verified.
    assert api.lane is not None and api.lane.kubeconfig is not None
    served = api.lane.kubeconfig.parent / "certs" / "apiserver.crt"  # cluster.sh's --cert-dir
    assert served.is_file() or os.environ.get("HOTLOAD_E2E_KUBECONFIG")  # else a cluster of yours
    if served.is_file():
        shutil.copy(served, folders["clusters"] / "ca.crt")
        cluster["certificate-authority"] = "ca.crt"
    else:
        cluster["insecure-skip-tls-verify"] = True
    (folders["users"] / "token").write_text(token + "\n")
    documents = {
        "contexts": {
            "current-context": "work",
            "contexts": [
                {"name": "work", "context": {"cluster": "k8s", "user": "me",
                                             "namespace": api.namespace}},
            ],
        },
        "clusters": {"clusters": [{"name": "k8s", "cluster": cluster}]},
        "users": {"users": [{"name": "me", "user": {"tokenFile": "token"}}]},
        "later": {
            "current-context": "elsewhere",
            "contexts": [{"name": "elsewhere", "context": {"cluster": "k8s", "user": "me"}}],
            "clusters": [{"name": "k8s", "cluster": {"server": "http://127.0.0.1:9"}}],
            "users": [{"name": "me", "user": {"token": "not-this-one"}}],
        },
    }  # fmt: skip
    paths = []
    for name, doc in documents.items():
        path = folders[name] / "config"
        path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", **doc}))
        paths.append(str(path))
    paths.insert(1, str(tmp_path / "missing"))  # kubectl skips files that do not exist
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join(paths))

    config = KubeConfig.auto()
    assert (config.server, config.namespace) == (server, api.namespace)
    assert config.token_file == str(folders["users"] / "token")
    if served.is_file():
        assert config.ca_file == str(folders["clusters"] / "ca.crt")
    async with KubeClient(config) as kube:
        found = await kube.get(resource_path("v1", "namespaces", name=api.namespace))
        assert found["metadata"]["name"] == api.namespace
    assert KubeConfig.auto(context="elsewhere").namespace == "default"


@contextlib.asynccontextmanager
async def _cluster_admin(api: KubeAPI, account: str) -> AsyncIterator[str]:
    """A real token of a service account bound to cluster-admin (the binding is deleted
    afterwards): the in-process operator creates cluster-scoped admission policies."""
    name = f"{api.namespace}-{account}"
    path = resource_path("rbac.authorization.k8s.io/v1", "clusterrolebindings")
    async with api.client() as admin:
        await admin.create(
            path,
            {
                "metadata": {"name": name},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [{"kind": "ServiceAccount", "name": account,
                              "namespace": api.namespace}],
            },
        )  # fmt: skip
        try:
            config = await api.service_account_config(account, expiration_seconds=600)
            await _allowed(config, resource_path("v1", "pods", api.namespace))
            assert config.token is not None
            yield config.token
        finally:
            with contextlib.suppress(KubeError):
                await admin.delete(f"{path}/{name}")


@pytest.mark.asyncio
async def test_status_publisher_and_operator_on_exec_plugin_kubeconfigs(
    real_kube_api: KubeAPI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The operator logs in through a plugin whose first token the server refuses (its client,
    the first to ask, logs in again and gets the next one; kopf logs in through the same
    plugin); a trainer's Publisher and `hotload status` authenticate through another plugin, as
    a namespaced service account."""
    caplog.set_level(logging.INFO, logger="kopf")
    api = real_kube_api
    ns = api.namespace
    trainer_token = await service_account_token(
        api,
        "trainer",
        rules=[
            {"apiGroups": ["hotload.dev"], "resources": ["*"], "verbs": ["*"]},
            {"apiGroups": [""], "resources": ["pods", "events"],
             "verbs": ["get", "list", "watch"]},
        ],
    )  # fmt: skip
    trainer = Plugin(tmp_path / "trainer-plugin", [trainer_token])
    trainer_kubeconfig = exec_kubeconfig(tmp_path / "trainer", api, trainer.user())
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    bucket_dir = tmp_path / "bucket"
    bucket_dir.mkdir()
    async with api.client() as kube, _cluster_admin(api, "operator") as operator_token:
        await install_crds(kube)
        operator = Plugin(tmp_path / "operator-plugin", ["refused-token", operator_token])
        monkeypatch.setenv(
            "KUBECONFIG", str(exec_kubeconfig(tmp_path / "operator", api, operator.user()))
        )
        async with running_operator(api):
            pods = await create_fleet(kube, ns, bucket_dir)
            assert operator.calls >= 2
            assert "Activity 'login' succeeded" in caplog.text  # kopf's, through the plugin
            pub = Publisher(
                str(bucket_dir),
                deployment="fleet",
                namespace=ns,
                kubeconfig=trainer_kubeconfig,
                full_every=10,
                config=CONFIG,
            )
            playing = asyncio.create_task(loaders_follow_the_ledger(kube, ns, bucket_dir, pods))
            try:
                handle = await pub.publish_async(weights(0), step=0)
                report = await pub.wait_ready_async(handle.identity, timeout=60)
                assert (report.loaded, report.replicas) == (2, 2)
                # One run for the publisher's whole life: its token lasts ten minutes.
                assert trainer.calls == 1

                async def rolled_up() -> bool:
                    obj = await kube.get(hld_path(ns, "fleet"))
                    return (obj.get("status") or {}).get("currentSnapshot") == handle.identity

                await eventually("the roll-up", rolled_up)
                env = {**os.environ, "KUBECONFIG": str(trainer_kubeconfig)}
                code, out, err = await hotload(
                    "status", "fleet", "-n", ns, "--check", "-o", "json", env=env
                )
                assert code == 0, err
                doc = json.loads(out)
                assert doc["deployments"][0]["status"]["currentSnapshot"] == handle.identity
                assert trainer.calls == 2
            finally:
                playing.cancel()
                pub.close()


@pytest.mark.asyncio
async def test_kopf_login_hands_kopf_the_plugin_token_and_its_expiry(
    real_kube_api: KubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hotload_operator.handlers import login

    token = await service_account_token(real_kube_api, "reader")
    plugin = Plugin(tmp_path / "plugin", [token], lifetime=900)
    kubeconfig = exec_kubeconfig(tmp_path / "kubeconfig", real_kube_api, plugin.user())
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    info = await asyncio.to_thread(login)  # kopf runs a synchronous handler in a thread
    assert (info.scheme, info.token, info.default_namespace) == (
        "Bearer",
        token,
        real_kube_api.namespace,
    )
    assert info.expiration is not None
    left = (info.expiration - datetime.datetime.now(datetime.UTC)).total_seconds()
    assert 800 < left <= 900
    # Each login (kopf's re-login after a 401 or the expiry) runs the plugin again.
    await asyncio.to_thread(login)
    assert plugin.calls == 2


# --- plugin failures -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_plugin_failures_name_the_command_and_what_it_said(tmp_path: Path) -> None:
    plugin = Plugin(tmp_path / "plugin")
    path = tmp_path / "kubeconfig"

    def config(user: dict[str, Any]) -> KubeConfig:
        write_kubeconfig(path, "http://127.0.0.1:9", "ns", None)
        doc = yaml.safe_load(path.read_text())
        doc["users"][0]["user"] = user
        path.write_text(yaml.safe_dump(doc))
        return KubeConfig.from_kubeconfig(path)

    prefix = f"kubeconfig {path}: user 'test': credential plugin `{plugin.command} --region eu`"
    plugin.set(mode="fail")
    failing = config(plugin.user(args=["--region", "eu"]))
    async with KubeClient(failing, retries=0) as kube:
        with pytest.raises(KubeError) as err:
            await kube.get("/version")  # the plugin runs before anything is sent
    assert str(err.value) == (
        f"{prefix} failed: process returned 3. error: the SSO session has expired; run "
        "'cloud sso login'"
    )

    plugin.set(mode="garbage")
    with pytest.raises(KubeError) as err:
        await config(plugin.user(args=["--region", "eu"])).credentials_async()
    assert str(err.value).startswith(f"{prefix} failed: failed to decode process output")

    plugin.set(mode="empty")
    with pytest.raises(KubeError, match="returned neither a token nor a client certificate"):
        config(plugin.user()).bearer_token()  # the synchronous path (kopf's login)

    missing = {
        "exec": {
            "apiVersion": EXEC_API,
            "command": "aws-iam-authenticator-missing",
            "args": ["token", "-i", "prod"],
            "installHint": "Install aws-iam-authenticator: https://example.invalid/install\n",
        }
    }
    with pytest.raises(KubeError) as err:
        await config(missing).credentials_async()
    assert str(err.value) == (
        f"kubeconfig {path}: user 'test': credential plugin `aws-iam-authenticator-missing "
        "token -i prod`: aws-iam-authenticator-missing is not installed (not found on PATH). "
        "Install aws-iam-authenticator: https://example.invalid/install"
    )


# --- other credentials -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_oidc_auth_provider_token_is_sent(kube_emulator: KubeAPI, tmp_path: Path) -> None:
    """`auth-provider: oidc` (kubectl's older OIDC support): the id-token is sent while its JWT
    has not expired (kubernetes_asyncio refreshes an expired one with the refresh-token)."""
    claims = base64.b64encode(json.dumps({"exp": int(time.time()) + 3600}).encode()).decode()
    id_token = f"eyJhbGciOiJub25lIn0.{claims.rstrip('=')}.c2ln"
    assert kube_emulator.emulator is not None
    kube_emulator.emulator.tokens = {id_token}
    path = write_kubeconfig(tmp_path / "kc", kube_emulator.url, kube_emulator.namespace, None)
    doc = yaml.safe_load(path.read_text())
    doc["users"][0]["user"] = {
        "auth-provider": {
            "name": "oidc",
            "config": {
                "client-id": "kubectl",
                "idp-issuer-url": "https://issuer.invalid",
                "id-token": id_token,
            },
        }
    }
    path.write_text(yaml.safe_dump(doc))
    async with KubeClient(KubeConfig.from_kubeconfig(path), retries=0) as kube:
        found = await kube.get(resource_path("v1", "namespaces", name=kube_emulator.namespace))
    assert found["metadata"]["name"] == kube_emulator.namespace


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.asyncio
async def test_a_client_certificate_from_an_exec_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin may return a client certificate and key instead of a token; a renewed one is
    presented on new connections. The server: aiohttp over TLS, requiring client
    certificates (the shared control plane trusts none)."""
    if shutil.which("openssl") is None:
        pytest.fail("needs the openssl command to make certificates: apt-get install openssl")
    server_cert, server_key = _self_signed(tmp_path, "server")
    first = _self_signed(tmp_path, "first-user")
    renewed = _self_signed(tmp_path, "renewed-user")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(server_cert, server_key)
    tls.verify_mode = ssl.CERT_REQUIRED
    for cert, _ in (first, renewed):
        tls.load_verify_locations(cert)

    async def whoami(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(pair[0] for pair in (peer or {}).get("subject", ()))
        return web.json_response({"kind": "Whoami", "user": subject.get("commonName")})

    app = web.Application()
    app.router.add_get("/version", whoami)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = runner.addresses[0][1]
    try:
        plugin = Plugin(tmp_path / "plugin")
        plugin.set(mode="cert", lifetime=600)
        shutil.copy(first[0], plugin.folder / "cert.pem")
        shutil.copy(first[1], plugin.folder / "key.pem")
        path = write_kubeconfig(
            tmp_path / "kc", f"https://127.0.0.1:{port}", "ns", None, ca_file="server.pem"
        )
        doc = yaml.safe_load(path.read_text())
        doc["users"][0]["user"] = plugin.user()
        path.write_text(yaml.safe_dump(doc))
        async with KubeClient(KubeConfig.from_kubeconfig(path), retries=0) as kube:
            assert (await kube.get("/version"))["user"] == "first-user"
            assert (await kube.get("/version"))["user"] == "first-user"
            assert plugin.calls == 1
            shutil.copy(renewed[0], plugin.folder / "cert.pem")
            shutil.copy(renewed[1], plugin.folder / "key.pem")
            _clock(monkeypatch, 601)
            assert (await kube.get("/version"))["user"] == "renewed-user"
            assert plugin.calls == 2
    finally:
        await runner.cleanup()


def test_in_cluster_settings_do_not_load_the_library(tmp_path: Path) -> None:
    """Loader sidecars and routers read their service account without kubernetes_asyncio,
    whose import costs each process about 39 MiB and 0.9 s (hotload/kube/config.py)."""
    (tmp_path / "token").write_text("t\n")
    (tmp_path / "ca.crt").write_text("PEM")
    script = (
        "import sys; from hotload.kube import KubeClient, KubeConfig; "
        f"c = KubeConfig.in_cluster({str(tmp_path)!r}); KubeClient(c); "
        f"assert c.ca_file == {str(tmp_path / 'ca.crt')!r}, c; "
        "print(sorted(m for m in sys.modules if m.startswith('kubernetes_asyncio')))"
    )
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
        cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.stdout.strip() == "[]"
