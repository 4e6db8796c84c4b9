"""Opening a bucket from its URL: a local folder, or an obstore S3 or GCS store configured from
the environment and a mounted credentials Secret (re-read, so a rotated Secret takes effect)."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from obstore.exceptions import BaseError
from obstore.store import GCSStore, S3Store

from hotload.bucket.core import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, Bucket
from hotload.bucket.retry import RetryPolicy, describe
from hotload.bucket.url import (
    GCS_SETTINGS,
    S3_SETTINGS,
    BucketURL,
    StoreSettings,
    load_settings,
    parse_bucket_url,
    read_secret_dir,
)
from hotload.errors import InvalidBucketURLError, MissingCredentialsError

if TYPE_CHECKING:
    from obstore.store import ClientConfig, GCSConfig, S3Config, S3Credential

# Secret-file credentials are re-read this often, so a rotated Kubernetes Secret takes effect.
_CREDENTIAL_REFRESH = timedelta(minutes=5)


def open_bucket(
    url: str,
    *,
    credentials_dir: str | os.PathLike[str] | None = None,
    retry: RetryPolicy | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    concurrency: int = DEFAULT_CONCURRENCY,
    user_agent: str | None = None,
) -> Bucket:
    """Open a bucket from a URL: a folder path or `file:///path` (default), `s3://` or `gs://`.

    S3 endpoint, region and credentials come from `AWS_*` environment variables or from files of
    the same names in `credentials_dir` (default `$HOTLOAD_BUCKET_CREDENTIALS_DIR`, a mounted
    Kubernetes Secret), the files winning. `user_agent` names the client in the store's access
    logs (the operator's says which replica wrote).
    """
    location = parse_bucket_url(url)
    policy = retry or RetryPolicy()
    if location.scheme == "file":
        return Bucket(location, retry=policy, part_size=part_size, concurrency=concurrency)
    store: S3Store | GCSStore
    if location.scheme == "s3":
        settings = load_settings(S3_SETTINGS, credentials_dir=credentials_dir)
        store = _s3_store(location, settings, policy, user_agent)
    else:
        settings = load_settings(GCS_SETTINGS, credentials_dir=credentials_dir)
        store = GCSStore(
            location.bucket,
            prefix=location.prefix or None,
            config=gcs_config(settings),
            client_options=_client_options(False, user_agent),
            retry_config=policy.obstore_config(),
        )
    return Bucket(location, store=store, retry=policy, part_size=part_size, concurrency=concurrency)


def s3_config(settings: StoreSettings) -> tuple[S3Config, bool]:
    """Build the obstore S3 configuration (credentials aside) and whether plain HTTP is allowed."""
    config: S3Config = {}
    endpoint = settings.get("AWS_ENDPOINT_URL_S3") or settings.get("AWS_ENDPOINT_URL")
    region = settings.get("AWS_REGION") or settings.get("AWS_DEFAULT_REGION")
    if endpoint:
        config["endpoint"] = endpoint
    if region:
        config["region"] = region
    elif endpoint:
        # S3-compatible servers ignore the region, but request signing still needs one.
        config["region"] = "us-east-1"
    if settings.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST") is not None:
        config["virtual_hosted_style_request"] = settings.flag("AWS_VIRTUAL_HOSTED_STYLE_REQUEST")
    if settings.flag("AWS_SKIP_SIGNATURE"):
        config["skip_signature"] = True
    # An explicit http:// endpoint is consent enough to talk plain HTTP.
    allow_http = settings.flag("AWS_ALLOW_HTTP") or bool(
        endpoint and endpoint.startswith("http://")
    )
    return config, allow_http


def gcs_config(settings: StoreSettings) -> GCSConfig:
    """Build the obstore GCS configuration from the merged settings."""
    config: GCSConfig = {}
    account = (
        settings.get("GOOGLE_SERVICE_ACCOUNT")
        or settings.get("GOOGLE_SERVICE_ACCOUNT_PATH")
        or settings.get("GOOGLE_APPLICATION_CREDENTIALS")
    )
    if settings.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        config["service_account_key"] = settings.values["GOOGLE_SERVICE_ACCOUNT_KEY"]
    elif account:
        config["service_account"] = account
    if settings.get("GOOGLE_BASE_URL"):
        config["base_url"] = settings.values["GOOGLE_BASE_URL"]
    if settings.flag("GOOGLE_SKIP_SIGNATURE"):
        config["skip_signature"] = True
    return config


class SecretFileCredentials:
    """S3 credentials read from a mounted Secret directory, re-read every few minutes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __call__(self) -> S3Credential:
        """Return the current access key, secret and session token from the Secret's files."""
        values = read_secret_dir(self.directory, S3_SETTINGS)
        key, secret = values.get("AWS_ACCESS_KEY_ID"), values.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            missing = "AWS_SECRET_ACCESS_KEY" if key else "AWS_ACCESS_KEY_ID"
            raise MissingCredentialsError(
                f"the credentials directory has no {missing} file: it needs both an "
                "AWS_ACCESS_KEY_ID and an AWS_SECRET_ACCESS_KEY file (keys of the bucket "
                "Secret). See docs/credentials.md",
                url=str(self.directory),
            )
        return {
            "access_key_id": key,
            "secret_access_key": secret,
            "token": values.get("AWS_SESSION_TOKEN"),
            "expires_at": datetime.now(UTC) + _CREDENTIAL_REFRESH,
        }


def _s3_store(
    location: BucketURL, settings: StoreSettings, policy: RetryPolicy, user_agent: str | None
) -> S3Store:
    config, allow_http = s3_config(settings)
    common: dict[str, Any] = {
        "prefix": location.prefix or None,
        "config": config,
        "client_options": _client_options(allow_http, user_agent),
        "retry_config": policy.obstore_config(),
    }
    _check_key_pair(location, settings)
    if settings.credentials_dir is not None and "AWS_ACCESS_KEY_ID" in settings.from_files:
        provider = SecretFileCredentials(settings.credentials_dir)
        provider()  # fail now, with a clear message, if the Secret is incomplete
        return S3Store(location.bucket, credential_provider=provider, **common)
    for name, option in (
        ("AWS_ACCESS_KEY_ID", "access_key_id"),
        ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
        ("AWS_SESSION_TOKEN", "session_token"),
    ):
        value = settings.get(name)
        if value:
            config[option] = value  # type: ignore[literal-required]
    try:
        return S3Store(location.bucket, **common)
    except BaseError as exc:  # a setting obstore refuses: say which bucket and why
        raise InvalidBucketURLError(
            f"the S3 settings cannot be used: {describe(exc)}", url=str(location)
        ) from exc


def _check_key_pair(location: BucketURL, settings: StoreSettings) -> None:
    """Refuse half a key pair, naming the half that is missing and where the other came from
    (obstore's own refusal names neither)."""
    key, secret = settings.get("AWS_ACCESS_KEY_ID"), settings.get("AWS_SECRET_ACCESS_KEY")
    if bool(key) == bool(secret):
        return
    given, missing = (
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        if key
        else ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID")
    )
    source = (
        f"a file in {settings.credentials_dir}"
        if given in settings.from_files
        else "the environment"
    )
    raise MissingCredentialsError(
        f"{given} is set (by {source}) but {missing} is not: an access key needs both halves. "
        f"Set {missing} beside it, or unset {given} to use a role's credentials. "
        "See docs/credentials.md",
        url=str(location),
    )


#: Idle connections kept per host, and for how long: without a cap the HTTP pool keeps every
#: connection a burst of parallel ranged reads opened (reqwest keeps them 90 s, uncapped), so a
#: long-running loader's sockets follow its busiest moment instead of its steady state.
POOL_MAX_IDLE_PER_HOST = 16
POOL_IDLE_TIMEOUT = "20s"


def _client_options(allow_http: bool, user_agent: str | None = None) -> ClientConfig:
    options: ClientConfig = {
        "allow_http": allow_http,
        "connect_timeout": "5s",
        "timeout": "120s",
        "pool_max_idle_per_host": str(POOL_MAX_IDLE_PER_HOST),
        "pool_idle_timeout": POOL_IDLE_TIMEOUT,
    }
    if user_agent:
        options["user_agent"] = user_agent
    return options
