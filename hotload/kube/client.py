"""A small typed async client for the Kubernetes REST API, on aiohttp.

Objects are plain JSON dicts. Errors map onto the `KubeError` family with the call's method,
path and the server's `Status` reason. Transient failures are retried with backoff: a refused
connection and 429 for every call (the server did not act on it), a dropped connection and 5xx
only for idempotent ones (GET, PUT, DELETE, and merge/strategic/apply patches). A 401 drops the
credentials that may have gone stale (a credential plugin's token, a rotated token file) and
sends the call once more with fresh ones. `benchmarks/RESULTS-kube-client.md` says why hotload
keeps this transport beside kubernetes_asyncio, which reads its configuration.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import os
import random
import ssl
import tempfile
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Literal, Self

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

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
from hotload.kube.config import Credentials, KubeConfig

log = logging.getLogger("hotload.kube")

PatchType = Literal["merge", "strategic", "json", "apply"]
#: The largest watch event read (one JSON line). aiohttp's default (512 KiB) is below what the
#: API server sends for a large object (etcd holds up to 1.5 MiB, requests up to 3 MiB).
MAX_WATCH_EVENT_BYTES = 16 * 1024 * 1024
JSON = dict[str, Any]

_PATCH_CONTENT_TYPES: dict[str, str] = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
    "apply": "application/apply-patch+yaml",
}
_ERRORS: dict[int, type[KubeError]] = {
    401: KubeForbiddenError,
    403: KubeForbiddenError,
    404: KubeNotFoundError,
    409: KubeConflictError,
    410: KubeGoneError,
    422: KubeInvalidError,
}


def resource_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The URL path of a collection or object, e.g. `/api/v1/namespaces/ns/pods/p/status`.

    `api_version` is `v1` for the core group, else `group/version` (`apps/v1`).
    """
    if subresource and not name:
        raise ValueError("a subresource needs an object name")
    parts = ["api", api_version] if "/" not in api_version else ["apis", api_version]
    if namespace:
        parts += ["namespaces", namespace]
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/" + "/".join(parts)


def error_from_status(
    status: int, method: str, path: str, body: Any, default_message: str = ""
) -> KubeError:
    """The `KubeError` subclass for an HTTP status, with a `Status` body's reason and message."""
    reason = None
    message = default_message
    causes: list[Any] = []
    if isinstance(body, dict) and body.get("kind") == "Status":
        reason = body.get("reason") or None
        message = str(body.get("message") or default_message)
        causes = list((body.get("details") or {}).get("causes") or [])
    conflicts = tuple(
        (str(c.get("field") or ""), str(c.get("message") or ""))
        for c in causes
        if isinstance(c, dict) and c.get("reason") == "FieldManagerConflict"
    )
    if status == 409 and conflicts:
        return KubeFieldConflictError(
            message, conflicts=conflicts, method=method, path=path, status=status, reason=reason
        )
    cls = _ERRORS.get(status, KubeUnavailableError if status >= 500 or status == 429 else KubeError)
    return cls(message or "request failed", method=method, path=path, status=status, reason=reason)


class KubeClient:
    """An async Kubernetes API client; use as `async with KubeClient(config) as kube: ...`."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.2,
        user_agent: str = "hotload",
        request_class: type[aiohttp.ClientRequest] = aiohttp.ClientRequest,
    ) -> None:
        self.config = config
        #: What sends each request (a subclass may refuse one just before it goes out).
        self.request_class = request_class
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None
        # The credential plugin's client certificate the session presents, if any.
        self._session_cert: tuple[str | None, str | None] = (None, None)
        # Sessions left behind when a plugin issued a new client certificate: requests still
        # running on them (watches) finish there; closed with the client.
        self._retired: builtins.list[aiohttp.ClientSession] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (the client can be used again afterwards)."""
        sessions, self._retired = self._retired, []
        if self._session is not None:
            sessions.append(self._session)
            self._session = None
        for session in sessions:
            await session.close()

    # --- calls -------------------------------------------------------------------------------

    async def get(self, path: str) -> JSON:
        """Read one object (or any GET path)."""
        return await self._call("GET", path)

    async def list(
        self,
        path: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
        *,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> JSON:
        """List a collection: the List object (`items`, `metadata.resourceVersion`). With
        `limit`, one page: `metadata.continue` names the next (pass it as `continue_token`)."""
        params = _selectors(label_selector, field_selector)
        if limit is not None:
            params["limit"] = str(limit)
        if continue_token:
            params["continue"] = continue_token
        return await self._call("GET", path, params=params)

    async def create(self, path: str, body: JSON) -> JSON:
        """POST `body` to a collection path and return the created object."""
        return await self._call("POST", path, body=body)

    async def replace(self, path: str, body: JSON) -> JSON:
        """PUT the whole object; a stale `metadata.resourceVersion` raises `KubeConflictError`."""
        return await self._call("PUT", path, body=body)

    async def patch(
        self,
        path: str,
        body: JSON | builtins.list[JSON],
        patch_type: PatchType = "merge",
        *,
        field_manager: str | None = None,
        force: bool = False,
    ) -> JSON:
        """PATCH an object; `apply` (server-side apply) needs `field_manager`."""
        if patch_type not in _PATCH_CONTENT_TYPES:
            raise ValueError(f"unknown patch type {patch_type!r}")
        params: dict[str, str] = {}
        if field_manager:
            params["fieldManager"] = field_manager
        if force:
            params["force"] = "true"
        return await self._call(
            "PATCH",
            path,
            body=body,
            params=params,
            content_type=_PATCH_CONTENT_TYPES[patch_type],
            idempotent=patch_type != "json",
        )

    async def delete(self, path: str, propagation_policy: str | None = None) -> JSON:
        """DELETE an object (`propagation_policy`: Background, Foreground or Orphan)."""
        body = {"propagationPolicy": propagation_policy} if propagation_policy else None
        return await self._call("DELETE", path, body=body)

    async def watch(
        self,
        path: str,
        *,
        resource_version: str | None = None,
        timeout_seconds: int | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        allow_bookmarks: bool = False,
    ) -> AsyncIterator[tuple[str, JSON]]:
        """Stream `(type, object)` events of a collection until the server ends the watch.

        Types are ADDED, MODIFIED, DELETED and BOOKMARK; a server ERROR event raises its
        `KubeError` (410 `KubeGoneError` means: list again and watch from the list's version).
        """
        params = _selectors(label_selector, field_selector)
        params["watch"] = "true"
        if resource_version is not None:
            params["resourceVersion"] = resource_version
        if timeout_seconds is not None:
            params["timeoutSeconds"] = str(timeout_seconds)
        if allow_bookmarks:
            params["allowWatchBookmarks"] = "true"
        # A watch is long-lived: only the connection and the server's own timeout bound it.
        total = None if timeout_seconds is None else timeout_seconds + self.timeout
        timeout = aiohttp.ClientTimeout(total=total, connect=self.timeout, sock_read=None)
        response = await self._send("GET", path, params=params, timeout=timeout, idempotent=True)
        async with response:
            if response.status >= 400:
                raise await self._error(response, "GET", path)
            while True:
                try:
                    line = await response.content.readline(max_line_length=MAX_WATCH_EVENT_BYTES)
                except aiohttp.ClientError as exc:
                    raise KubeUnavailableError(
                        f"watch stream broke: {exc}", method="GET", path=path
                    ) from exc
                except HttpProcessingError as exc:  # LineTooLong and other framing errors
                    raise KubeError(
                        f"watch event unreadable ({exc.message}): list again",
                        method="GET",
                        path=path,
                    ) from exc
                if not line:
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = str(event.get("type", ""))
                obj = event.get("object") or {}
                if kind == "ERROR":
                    code = int(obj.get("code") or 500)
                    raise error_from_status(code, "GET", path, obj, "watch failed")
                yield kind, obj

    # --- plumbing ----------------------------------------------------------------------------

    def _session_for(self, credentials: Credentials) -> aiohttp.ClientSession:
        cert = (credentials.client_cert_data, credentials.client_key_data)
        if self._session is not None and cert != self._session_cert:
            # A plugin issued a new client certificate: new connections present it.
            self._retired.append(self._session)
            self._session = None
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl_context(credentials))
            self._session = aiohttp.ClientSession(
                base_url=self.config.server + "/",
                connector=connector,
                headers={"User-Agent": self.user_agent, "Accept": "application/json"},
                request_class=self.request_class,
            )
            self._session_cert = cert
        return self._session

    def _ssl_context(self, credentials: Credentials) -> ssl.SSLContext | bool:
        cfg = self.config
        if not cfg.server.startswith("https://"):
            return False
        if cfg.insecure_skip_tls_verify:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            ctx = ssl.create_default_context(cafile=cfg.ca_file, cadata=cfg.ca_data)
        if credentials.client_cert_data:  # a plugin's certificate replaces the kubeconfig's
            _load_client_cert(
                ctx,
                (credentials.client_cert_data, None),
                (credentials.client_key_data, None),
                cfg.source,
            )
        elif cfg.client_cert_data or cfg.client_cert_file:
            _load_client_cert(
                ctx,
                (cfg.client_cert_data, cfg.client_cert_file),
                (cfg.client_key_data, cfg.client_key_file),
                cfg.source,
            )
        return ctx

    def _url(self, path: str) -> str:
        # base_url joins relative paths only: drop the leading slash of API paths.
        return path.lstrip("/")

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: aiohttp.ClientTimeout | None = None,
        idempotent: bool,
    ) -> aiohttp.ClientResponse:
        """One request with retries on transient failures; the caller reads and releases it."""
        data = None if body is None else json.dumps(body).encode()
        attempt = 0
        reauthenticated = False
        while True:
            credentials = await self.config.credentials_async()
            session = self._session_for(credentials)
            headers = {"Content-Type": content_type}
            if credentials.token:
                headers["Authorization"] = f"Bearer {credentials.token}"
            try:
                response = await session.request(
                    method,
                    self._url(path),
                    params=params,
                    data=data,
                    headers=headers,
                    timeout=timeout or aiohttp.ClientTimeout(total=self.timeout),
                )
            except (aiohttp.ClientConnectorError, aiohttp.ClientConnectionError) as exc:
                # Never connected: nothing reached the server, so any call may be repeated.
                never_sent = isinstance(exc, aiohttp.ClientConnectorError)
                if attempt < self.retries and (never_sent or idempotent):
                    attempt += 1
                    await self._sleep(attempt, None)
                    continue
                raise KubeUnavailableError(
                    f"cannot reach {self.config.server}: {exc}", method=method, path=path
                ) from exc
            except TimeoutError as exc:
                if attempt < self.retries and idempotent:
                    attempt += 1
                    await self._sleep(attempt, None)
                    continue
                raise KubeUnavailableError(
                    f"no answer from {self.config.server} within {self.timeout}s",
                    method=method,
                    path=path,
                ) from exc
            if (
                response.status == 401
                and not reauthenticated
                and self.config.refresh_credentials(credentials)
            ):
                # The server did not act on a request it could not authenticate: any call may
                # go again, once, with the plugin's next credentials or the rotated token.
                log.debug("401 from %s: sending it again with fresh credentials", path)
                response.release()
                reauthenticated = True
                continue
            transient = response.status == 429 or (response.status >= 500 and idempotent)
            if transient and attempt < self.retries:
                retry_after = response.headers.get("Retry-After")
                response.release()
                attempt += 1
                await self._sleep(attempt, retry_after)
                continue
            return response

    async def _sleep(self, attempt: int, retry_after: str | None) -> None:
        delay = self.backoff * 2 ** (attempt - 1) * (0.5 + random.random())
        if retry_after and retry_after.isdigit():
            delay = max(delay, min(float(retry_after), 10.0))
        log.debug("retrying a Kubernetes API call in %.2fs (attempt %d)", delay, attempt + 1)
        await asyncio.sleep(delay)

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        idempotent: bool | None = None,
    ) -> JSON:
        if idempotent is None:
            idempotent = method in ("GET", "PUT", "DELETE")
        response = await self._send(
            method,
            path,
            params=params,
            body=body,
            content_type=content_type,
            idempotent=idempotent,
        )
        async with response:
            if response.status >= 400:
                raise await self._error(response, method, path)
            try:
                result = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise KubeUnavailableError(
                    f"the answer broke off: {exc}", method=method, path=path
                ) from exc
            except ValueError as exc:
                raise KubeError(
                    f"the server answered {response.status} with a body that is not JSON",
                    method=method,
                    path=path,
                    status=response.status,
                ) from exc
        if not isinstance(result, dict):
            raise KubeError(
                "the server answered with JSON that is not an object",
                method=method,
                path=path,
                status=response.status,
            )
        return result

    async def _error(self, response: aiohttp.ClientResponse, method: str, path: str) -> KubeError:
        text = await response.text()
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        return error_from_status(
            response.status, method, path, body, text.strip()[:200] or response.reason or ""
        )


def _selectors(label_selector: str | None, field_selector: str | None) -> dict[str, str]:
    params: dict[str, str] = {}
    if label_selector:
        params["labelSelector"] = label_selector
    if field_selector:
        params["fieldSelector"] = field_selector
    return params


def _load_client_cert(
    ctx: ssl.SSLContext,
    cert: tuple[str | None, str | None],
    key: tuple[str | None, str | None],
    source: str,
) -> None:
    """Load the client certificate and key; inline PEM goes through private temporary files
    because `ssl` only loads certificate chains from files. `cert` and `key` are (PEM, file)."""
    (cert_data, cert_file), (key_data, key_file) = cert, key
    if cert_file and not cert_data and not key_data:
        ctx.load_cert_chain(cert_file, key_file)
        return
    with tempfile.TemporaryDirectory(prefix="hotload-kube-") as tmp:
        os.chmod(tmp, 0o700)

        def materialise(data: str | None, file: str | None, name: str) -> str | None:
            if data is None:
                return file
            target = os.path.join(tmp, name)
            with open(os.open(target, os.O_WRONLY | os.O_CREAT, 0o600), "w") as out:
                out.write(data)
            return target

        cert_path = materialise(cert_data, cert_file, "cert.pem")
        key_path = materialise(key_data, key_file, "key.pem")
        if cert_path is None:
            raise KubeError(f"{source}: a client key without a client certificate")
        ctx.load_cert_chain(cert_path, key_path)
