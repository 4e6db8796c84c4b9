"""Bucket URLs and where their configuration comes from (environment or a mounted Secret)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from hotload.errors import InvalidBucketURLError

Scheme = Literal["file", "s3", "gs"]

#: Environment variable naming a directory of credential files (a mounted Kubernetes Secret).
CREDENTIALS_DIR_ENV = "HOTLOAD_BUCKET_CREDENTIALS_DIR"

#: Settings read for `s3://` buckets, from the environment or from same-named Secret files.
S3_SETTINGS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP",
    "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
    "AWS_SKIP_SIGNATURE",
)

#: Settings read for `gs://` buckets.
GCS_SETTINGS = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_BASE_URL",
    "GOOGLE_SKIP_SIGNATURE",
)

_TRUE = {"1", "true", "yes", "on"}

#: A scheme and a colon without its two slashes (`s3:/rl/prod`, `gs:bucket`): a typo that would
#: otherwise publish into a local folder named `s3:`. A path starting `./` or `/` is a folder.
_SCHEME_TYPO = re.compile(r"^(s3|gs|gcs|file|https?|az|abfss?):/?(?!/)", re.IGNORECASE)


@dataclass(frozen=True)
class BucketURL:
    """A parsed bucket URL: the scheme, the bucket (or local root) and the key prefix inside it."""

    scheme: Scheme
    bucket: str
    prefix: str = ""
    root: Path | None = None

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.root}"
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{self.scheme}://{self.bucket}{tail}"


@dataclass(frozen=True)
class StoreSettings:
    """Configuration for one remote store, merged from the environment and a Secret directory."""

    values: Mapping[str, str] = field(default_factory=dict)
    credentials_dir: Path | None = None
    #: Settings that came from files in `credentials_dir` (these are re-read on rotation).
    from_files: frozenset[str] = frozenset()

    def get(self, name: str) -> str | None:
        """Return one setting, or None when neither the Secret nor the environment sets it."""
        value = self.values.get(name)
        return value if value else None

    def flag(self, name: str) -> bool:
        """Return a boolean setting (`true`, `1`, `yes`, `on` are true)."""
        value = self.get(name)
        return value is not None and value.strip().lower() in _TRUE


def parse_bucket_url(url: str) -> BucketURL:
    """Parse a folder path, `file:///abs/path`, `s3://bucket/prefix` or `gs://bucket/prefix`."""
    text = url.strip()
    if not text:
        raise InvalidBucketURLError("empty bucket URL", url=url)
    if "://" not in text:
        typo = _SCHEME_TYPO.match(text)
        if typo:
            scheme = typo.group(1).lower()
            rest = text[typo.end() :].lstrip("/")
            meant = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
            raise InvalidBucketURLError(
                f"this looks like the URL {meant} with a slash missing, not a folder: write "
                f"{meant} (or ./{text} for a local folder of that name)",
                url=url,
            )
        return _local(Path(text).expanduser(), url)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise InvalidBucketURLError(
            "query strings and fragments are not supported; configure endpoints through "
            "AWS_ENDPOINT_URL or a credentials directory",
            url=url,
        )
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidBucketURLError(
                f"file URLs must be absolute (file:///path), not on host {parts.netloc!r}", url=url
            )
        return _local(Path(unquote(parts.path)), url)
    if scheme in ("s3", "gs"):
        bucket = parts.netloc
        if not bucket:
            raise InvalidBucketURLError(
                f"missing bucket name: expected {scheme}://BUCKET/PREFIX", url=url
            )
        segments = [s for s in unquote(parts.path).split("/") if s]
        for seg in segments:
            if seg in (".", ".."):
                raise InvalidBucketURLError(f"prefix segment {seg!r} is not allowed", url=url)
        return BucketURL(
            scheme="s3" if scheme == "s3" else "gs", bucket=bucket, prefix="/".join(segments)
        )
    raise InvalidBucketURLError(
        f"unsupported scheme {parts.scheme!r}: use a folder path, file:///path, s3://bucket/prefix "
        "or gs://bucket/prefix",
        url=url,
    )


def split_ledger_url(url: str) -> tuple[str, str]:
    """Split `BUCKET_URL/NAME` into the bucket URL and the ledger name (the last path segment)."""
    text = url.strip().rstrip("/")
    head, sep, name = text.rpartition("/")
    if not sep or not name or head.endswith((":/", "://")):
        raise InvalidBucketURLError(
            "expected BUCKET_URL/LEDGER_NAME, e.g. s3://bucket/prefix/policy or ./bucket/policy",
            url=url,
        )
    return (head or "/"), name


def load_settings(
    names: tuple[str, ...],
    *,
    credentials_dir: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> StoreSettings:
    """Merge settings from the environment with files in a Secret directory (files win).

    The directory comes from `credentials_dir` or `$HOTLOAD_BUCKET_CREDENTIALS_DIR`; each file is
    named like the environment variable it replaces (e.g. `AWS_SECRET_ACCESS_KEY`).
    """
    env = os.environ if environ is None else environ
    values = {name: env[name] for name in names if env.get(name)}
    directory = credentials_dir if credentials_dir is not None else env.get(CREDENTIALS_DIR_ENV)
    if not directory:
        return StoreSettings(values=values)
    path = Path(directory)
    if not path.is_dir():
        raise InvalidBucketURLError(
            f"credentials directory {path} does not exist or is not a directory",
            url=str(path),
        )
    files = read_secret_dir(path, names)
    values.update(files)
    return StoreSettings(values=values, credentials_dir=path, from_files=frozenset(files))


def read_secret_dir(path: Path, names: tuple[str, ...]) -> dict[str, str]:
    """Read the files of a mounted Secret whose names (any case) are among `names`."""
    wanted = {n.upper(): n for n in names}
    found: dict[str, str] = {}
    for entry in sorted(path.iterdir()):
        # Kubernetes projects Secrets through `..data` symlinks; only the top-level names count.
        if entry.name.startswith(".") or not entry.is_file():
            continue
        name = wanted.get(entry.name.upper())
        if name is not None:
            found[name] = entry.read_text(encoding="utf-8").strip()
    return found


def _local(path: Path, url: str) -> BucketURL:
    if not path.is_absolute():
        path = Path.cwd() / path
    root = Path(os.path.normpath(path))
    try:
        not_a_folder = root.exists() and not root.is_dir()
    except OSError:  # not ours to see (EACCES): each operation says so as a BucketError
        not_a_folder = False
    if not_a_folder:
        raise InvalidBucketURLError(f"{root} exists and is not a folder", url=url)
    return BucketURL(scheme="file", bucket=str(root), root=root)
