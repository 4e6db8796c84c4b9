"""Turning object-store failures into hotload errors, and retrying only the transient ones."""

from __future__ import annotations

import asyncio
import errno
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    GenericError,
    InvalidPathError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from hotload.errors import (
    AccessDeniedError,
    BucketError,
    BucketUnreachableError,
    MissingCredentialsError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
)

if TYPE_CHECKING:
    from obstore.store import RetryConfig

T = TypeVar("T")

_STATUS = re.compile(r"status code: (\d{3})")
_S3_CODE = re.compile(r"<Code>([^<]+)</Code>")
_S3_MESSAGE = re.compile(r"<Message>([^<]+)</Message>")
# Failures without an HTTP status that still mean "the network or server had a hiccup".
_NETWORK_HINTS = (
    "error sending request",
    "connect",
    "connection",
    "timed out",
    "timeout",
    "broken pipe",
    "reset by peer",
    "body",
    "decode",
    "incomplete",
    "unexpected eof",
    "dns",
)
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
#: A request to the instance metadata service (169.254.169.254, or AWS_METADATA_ENDPOINT),
#: which an S3 client without configured credentials asks for a role's last.
_IMDS = re.compile(r"https?://\S+/latest/(api/token|meta-data/)")
#: What to do when a bucket has no credentials (docs/credentials.md says it at length).
S3_CREDENTIALS_FIX = (
    "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: in the environment, as files of those "
    "names in --credentials-dir ($HOTLOAD_BUCKET_CREDENTIALS_DIR), or, for the operator and "
    "the replicas, as keys of the Secret spec.bucket.credentialsSecret names; or run where a "
    "role provides them (AWS_WEB_IDENTITY_TOKEN_FILE, an instance role). See "
    "docs/credentials.md"
)
# obstore reports a key it cannot use as a ValueError with one of these phrases.
_PATH_ERRORS = ("Could not parse path", "illegal character", "path segment")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry transient failures: exponential backoff, full jitter."""

    attempts: int = 4
    initial_backoff: float = 0.25
    max_backoff: float = 4.0
    multiplier: float = 2.0
    #: Retries obstore makes itself inside each attempt. A gated bucket (the operator's) sets
    #: 0: obstore's retries happen where no gate can ask the lease, so every try must be one of
    #: this policy's attempts.
    inner_retries: int = 2

    def delay(self, attempt: int) -> float:
        """Seconds to sleep before retry number `attempt` (1-based): full jitter over the cap."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return random.uniform(0, cap)

    def obstore_config(self) -> RetryConfig:
        """The per-request retry settings handed to obstore (kept short: we retry around it)."""
        return {
            "max_retries": self.inner_retries,
            "retry_timeout": timedelta(seconds=max(5.0, self.max_backoff * 4)),
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(seconds=1),
                "base": 2,
            },
        }


def describe(exc: BaseException) -> str:
    """A one-line summary of a store error: S3 error code and message when present."""
    if isinstance(exc, OSError) and not isinstance(exc, BaseError) and exc.strerror:
        return exc.strerror.lower()
    text = str(exc)
    code = _S3_CODE.search(text)
    message = _S3_MESSAGE.search(text)
    status = _STATUS.search(text)
    if code:
        detail = code.group(1) + (f" ({message.group(1)})" if message else "")
        return f"HTTP {status.group(1)} {detail}" if status else detail
    first = text.split("\n", 1)[0].strip()
    first = first.split("Debug source:", 1)[0].strip()
    if len(first) > 300:
        first = first[:297] + "..."
    return first or type(exc).__name__


def translate(exc: BaseException, *, url: str, key: str | None, op: str) -> BucketError | None:
    """Map an obstore or OS exception onto the hotload error that names `url`/`key` and why.

    The result is a `BucketUnreachableError` (the only kind `retrying` retries) exactly for
    failures that may go away on their own: connection trouble, 5xx, throttling, timeouts.
    Anything that is not a store failure (a bug, or an exception raised by the caller's own
    progress callback) gives None: it should travel on unchanged.
    """
    if isinstance(exc, BucketError):
        return exc
    if isinstance(exc, ValueError) and not any(m in str(exc) for m in _PATH_ERRORS):
        return None
    if not isinstance(exc, BaseError | OSError | ValueError | NotImplementedError):
        return None
    what = f"{op}: {describe(exc)}"
    if _IMDS.search(str(exc)):
        # No credentials were configured, so the client asked the instance metadata service
        # for a role's: refused (or absent) off a cloud VM. The cause is "no credentials".
        return MissingCredentialsError(
            f"{op}: no S3 credentials were found, and the instance metadata service gave none "
            f"({describe(exc)}). {S3_CREDENTIALS_FIX}",
            url=url,
            key=key,
        )
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(what, url=url, key=key)
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError | PermissionError):
        return AccessDeniedError(what, url=url, key=key)
    if isinstance(exc, AlreadyExistsError):
        return ObjectExistsError(what, url=url, key=key)
    if isinstance(exc, PreconditionError):
        return PreconditionFailedError(what, url=url, key=key)
    if isinstance(exc, InvalidPathError | ValueError):
        return BucketError(f"{op}: invalid object key: {describe(exc)}", url=url, key=key)
    if isinstance(exc, NotSupportedError | NotImplementedError):
        return BucketError(f"{op}: not supported by this store: {describe(exc)}", url=url, key=key)
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOENT:
            return ObjectNotFoundError(what, url=url, key=key)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return AccessDeniedError(what, url=url, key=key)
        return BucketError(what, url=url, key=key)
    status_match = _STATUS.search(str(exc))
    status = int(status_match.group(1)) if status_match else None
    if status == 404:
        return ObjectNotFoundError(what, url=url, key=key)
    if status in (401, 403):
        return AccessDeniedError(what, url=url, key=key)
    if status == 412:
        return PreconditionFailedError(what, url=url, key=key)
    if status in _TRANSIENT_STATUS:
        return BucketUnreachableError(what, url=url, key=key)
    if status is None and isinstance(exc, GenericError):
        lowered = str(exc).lower()
        if any(hint in lowered for hint in _NETWORK_HINTS):
            return BucketUnreachableError(what, url=url, key=key)
    return BucketError(what, url=url, key=key)


async def retrying(
    policy: RetryPolicy,
    operation: Callable[[], Awaitable[T]],
    *,
    url: str,
    key: str | None,
    op: str,
) -> T:
    """Run `operation`, retrying transient failures with backoff; raise a hotload `BucketError`.

    `operation` is a factory so that every attempt starts afresh (new request, new body).
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await operation()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = translate(exc, url=url, key=key, op=op)
            if error is None:
                raise
            if not isinstance(error, BucketUnreachableError):
                raise error from exc
            if attempt >= policy.attempts:
                raise BucketUnreachableError(
                    f"{op}: gave up after {attempt} attempt(s): {describe(exc)}", url=url, key=key
                ) from exc
            await asyncio.sleep(policy.delay(attempt))
