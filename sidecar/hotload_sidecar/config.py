"""Loader settings: every one a flag with an environment variable behind it.

Flags win over the environment, the environment over the defaults. `python -m hotload_sidecar
--help` lists them all; the operator's pod template sets them through the environment.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hotload.bucket.url import parse_bucket_url
from hotload.errors import HotloadError, InvalidBucketURLError, InvalidIdentityError
from hotload.logs import LOG_FORMATS
from hotload.snapshot.layout import validate_identity
from hotload_sidecar.engines import CACHE_POLICIES, ENGINE_KINDS, MODES, CachePolicy, Mode

ReportMode = Literal["kubernetes", "local"]
REPORT_MODES = ("kubernetes", "local")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(HotloadError):
    """A loader setting is missing or invalid; the message names the flag and variable."""


#: The environment variable the operator sets from spec.mirrors (a JSON array).
MIRRORS_ENV = "HOTLOAD_MIRRORS"
#: At most this many mirrors (spec.mirrors has the same cap).
MAX_MIRRORS = 8


@dataclass(frozen=True)
class MirrorSetting:
    """One mirror of the bucket: its URL (the origin's key layout) and its credentials folder."""

    url: str
    credentials_dir: Path | None = None


@dataclass(frozen=True)
class Settings:
    """Everything the loader needs; see `build_parser` for what each field means."""

    ledger_url: str
    weights_dir: Path
    engine_kind: str = "reference"
    engine_url: str = "http://127.0.0.1:8000"
    mode: Mode = "async"
    cache_policy: CachePolicy | None = None
    poll_seconds: float = 2.0
    poll_jitter: float = 0.2
    keep: int = 2
    max_adapters: int = 0
    prefetch: int = 2
    threads: int | None = None
    credentials_dir: Path | None = None
    listen: str = "0.0.0.0:8091"
    report: ReportMode = "local"
    pod_name: str | None = None
    namespace: str | None = None
    kubeconfig: Path | None = None
    engine_wait_seconds: float = 900.0
    retry_seconds: float = 30.0
    hint_ttl_seconds: float = 600.0
    sparse_max_changed: float = 0.1
    compact_fraction: float = 1.0
    load_timeout_seconds: float = 900.0
    log_level: str = "info"
    log_format: str = "text"
    pin: str | None = None
    pin_object: str | None = None
    #: The HotLoadDeployment whose HotLoadHead this loader watches (None: no handoff).
    deployment: str | None = None
    #: With a handoff: the origin safety-net poll (at least `poll_seconds`) and the age of
    #: the operator's checkedTime past which it runs.
    safety_poll_seconds: float = 30.0
    head_stale_seconds: float = 90.0
    #: Mirrors that snapshot files are read from first, in order (the origin is always last).
    mirrors: tuple[MirrorSetting, ...] = ()

    @property
    def listen_host(self) -> str:
        """Host part of `listen`."""
        return self.listen.rpartition(":")[0] or "0.0.0.0"

    @property
    def listen_port(self) -> int:
        """Port part of `listen`."""
        return int(self.listen.rpartition(":")[2])


# flag, env, type, default, help
_OPTIONS: list[tuple[str, str, Any, Any, str]] = [
    (
        "--ledger-url",
        "HOTLOAD_LEDGER_URL",
        str,
        None,
        "ledger to follow as BUCKET_URL/NAME, e.g. s3://rl-policies/prod/policy-a or "
        "/data/bucket/policy-a (required)",
    ),
    (
        "--weights-dir",
        "HOTLOAD_WEIGHTS_DIR",
        Path,
        None,
        "folder on the volume shared with the engine; the engine boots from WEIGHTS_DIR/current "
        "(required)",
    ),
    ("--engine", "HOTLOAD_ENGINE", str, "reference", f"engine kind: {', '.join(ENGINE_KINDS)}"),
    ("--engine-url", "HOTLOAD_ENGINE_URL", str, "http://127.0.0.1:8000", "engine base URL"),
    (
        "--mode",
        "HOTLOAD_TRANSITION_MODE",
        str,
        "async",
        "transition mode: async (in-flight requests pause and resume on the new weights) or "
        "sync (they finish on the old weights; new ones wait)",
    ),
    (
        "--cache-policy",
        "HOTLOAD_CACHE_POLICY",
        str,
        None,
        "prompt-cache policy for every load (all, none, new_session); default: the one each "
        "ledger entry records",
    ),
    ("--poll-seconds", "HOTLOAD_POLL_SECONDS", float, 2.0, "ledger poll interval"),
    (
        "--poll-jitter",
        "HOTLOAD_POLL_JITTER",
        float,
        0.2,
        "random spread of the poll interval, as a fraction (0.2 = +-20%%) so a fleet does not "
        "poll in lockstep",
    ),
    ("--keep", "HOTLOAD_KEEP", int, 2, "verified snapshots kept on disk, newest first (>= 1)"),
    (
        "--max-adapters",
        "HOTLOAD_MAX_ADAPTERS",
        int,
        0,
        "LoRA adapters kept loaded in the engine: the newest ones in the ledger, older ones "
        "are unloaded; 0 ignores adapter entries (the engine must be started with adapters on)",
    ),
    (
        "--prefetch",
        "HOTLOAD_PREFETCH",
        int,
        2,
        "snapshots downloaded ahead of the rebuild during a catch-up",
    ),
    ("--threads", "HOTLOAD_THREADS", int, None, "codec threads (default: all cores)"),
    (
        "--credentials-dir",
        "HOTLOAD_BUCKET_CREDENTIALS_DIR",
        Path,
        None,
        "mounted Secret with bucket credentials (files named like AWS_ACCESS_KEY_ID ...); "
        "otherwise AWS_*/GOOGLE_* environment variables",
    ),
    (
        "--listen",
        "HOTLOAD_LISTEN",
        str,
        "0.0.0.0:8091",
        "HOST:PORT of the loader's endpoints: /startup, /healthz, /status, /metrics",
    ),
    (
        "--report",
        "HOTLOAD_REPORT",
        str,
        "local",
        "where to report: local (status endpoint only) or kubernetes (patch this pod: "
        "annotation, labels, SnapshotLoaded condition; Events)",
    ),
    ("--pod-name", "POD_NAME", str, None, "this pod's name (downward API; kubernetes mode)"),
    ("--namespace", "POD_NAMESPACE", str, None, "this pod's namespace (kubernetes mode)"),
    (
        "--kubeconfig",
        "KUBECONFIG",
        Path,
        None,
        "kubeconfig for the API server (default: in-cluster service account)",
    ),
    (
        "--engine-wait-seconds",
        "HOTLOAD_ENGINE_WAIT_SECONDS",
        float,
        900.0,
        "how long to wait for the engine to become ready before reporting it down",
    ),
    (
        "--retry-seconds",
        "HOTLOAD_RETRY_SECONDS",
        float,
        30.0,
        "wait before retrying a snapshot whose rebuild or load failed (doubles, up to 10x)",
    ),
    (
        "--hint-ttl-seconds",
        "HOTLOAD_HINT_TTL_SECONDS",
        float,
        600.0,
        "early fetch: rebuild hinted snapshots before the ledger admits them, giving up on a "
        "hint not rewritten for this long; 0 turns early fetch off",
    ),
    (
        "--sparse-max-changed",
        "HOTLOAD_SPARSE_MAX_CHANGED",
        float,
        0.1,
        "sparse hot loads: a delta of the snapshot the engine serves is written into it in "
        "place when it changes at most this fraction of the elements (else the full snapshot "
        "is loaded); 0 turns sparse loads off",
    ),
    (
        "--compact-fraction",
        "HOTLOAD_COMPACT_FRACTION",
        float,
        1.0,
        "sparse loads keep each delta on the weights volume after the newest full snapshot; once "
        "they add up to this fraction of its bytes they are folded into a new full snapshot, in "
        "one pass, in the background; 0 never folds them",
    ),
    (
        "--load-timeout-seconds",
        "HOTLOAD_LOAD_TIMEOUT_SECONDS",
        float,
        900.0,
        "how long the engine may take to load one snapshot",
    ),
    (
        "--pin",
        "HOTLOAD_PIN",
        str,
        None,
        "serve exactly this snapshot identity instead of following the ledger head (a "
        "reference-policy fleet, or a rollback); its chain is rebuilt from the ledger's history",
    ),
    (
        "--pin-object",
        "HOTLOAD_PIN_OBJECT",
        str,
        None,
        "key (relative to the ledger's bucket) of a pin object polled beside the ledger: while it "
        "exists the loader serves the snapshot it names, when deleted it follows the head again "
        "(the operator maintains it from spec.pin)",
    ),
    (
        "--deployment",
        "HOTLOAD_DEPLOYMENT",
        str,
        None,
        "the HotLoadDeployment (in --namespace) whose head handoff, the HotLoadHead of the same "
        "name, the operator keeps: the loader watches it and takes the ledger's new "
        "entries, folder listings, upload hints and spec.pin from it, reading the origin only at "
        "start-up, when the handed entries do not reach back to its copy, for a changed pin, and "
        "as a safety net while the handoff is stale (needs --report kubernetes; the operator "
        "sets it)",
    ),
    (
        "--safety-poll-seconds",
        "HOTLOAD_SAFETY_POLL_SECONDS",
        float,
        30.0,
        "with --deployment: the origin poll (jittered, never under --poll-seconds) that runs "
        "only while the watch is down or the handoff is missing, malformed or stale",
    ),
    (
        "--head-stale-seconds",
        "HOTLOAD_HEAD_STALE_SECONDS",
        float,
        90.0,
        "with --deployment: a handoff whose checkedTime has not moved for this long (on the "
        "loader's own clock) means the operator is gone",
    ),
    (
        "--log-level",
        "HOTLOAD_LOG_LEVEL",
        str,
        "info",
        "debug, info, warning or error",
    ),
    (
        "--log-format",
        "HOTLOAD_LOG_FORMAT",
        str,
        "text",
        "text, or json: one JSON object per line (timestamp, severity, logger, message) for a "
        "cluster's log pipeline",
    ),
]

EPILOG = """\
Every flag can also be set by the environment variable shown in brackets; flags win.

On start-up the loader materialises the ledger head (latest full snapshot plus the deltas
after it) into WEIGHTS_DIR/snapshots/<identity>, points WEIGHTS_DIR/current at it and answers
200 on /startup (the pod's startup probe), so the engine boots from WEIGHTS_DIR/current. Then it
follows the ledger: each new head is fetched, rebuilt, verified, switched to and hot-loaded.
With a pin (--pin, or a --pin-object that exists) it serves the pinned snapshot instead and
never moves past it; a pin whose chain the ledger no longer holds is reported, not served.
Before all that, with --engine vllm, it copies its own hotload_patch package (vLLM's worker
extension for sparse loads) to WEIGHTS_DIR/.hotload/python, on the engine's PYTHONPATH (started
with --worker-extension-cls hotload_patch.vllm.HotloadWorkerExtension); an identical copy is
kept, and a volume it cannot write to ends the loader with code 1, naming the path.
Exit codes: 0 stopped by a signal, 1 a fatal error (message on stderr), 2 bad settings.
"""


def build_parser() -> argparse.ArgumentParser:
    """The `python -m hotload_sidecar` argument parser (every flag shows its variable)."""
    parser = argparse.ArgumentParser(
        prog="python -m hotload_sidecar",
        description="hotload loader sidecar: follow a ledger, rebuild and verify snapshots, "
        "hot-load them into the engine, report what is served.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, env, _type, default, text in _OPTIONS:
        shown = f" (default: {default})" if default is not None else ""
        parser.add_argument(flag, default=None, metavar=env, help=f"{text}{shown} [{env}]")
    parser.add_argument(
        "--mirror",
        action="append",
        default=None,
        metavar="URL[,credentials=DIR]",
        help="a mirror of the bucket (same key layout as the ledger's bucket URL, prefix "
        "included) that snapshot files are read from before the origin; repeat it, in order of "
        f"preference, at most {MAX_MIRRORS}; DIR: its credentials, files named like "
        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID ... A miss, error or timeout falls back to the next "
        "source and skips that mirror for a while; a copy that fails verification is never "
        "loaded and is read again from the origin; the ledger, pins and everything under "
        f".hotload/ always come from the origin [{MIRRORS_ENV}: a JSON array of "
        '{"url": ..., "credentialsDir": ...}]',
    )
    return parser


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Parse flags and environment into `Settings`; raise `ConfigError` naming what is wrong."""
    env = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    for flag, var, type_, default, _text in _OPTIONS:
        key = flag[2:].replace("-", "_")
        raw = args.get(key)
        source = flag
        if raw is None and env.get(var):
            raw, source = env[var], var
        if raw is None:
            values[key] = default
            continue
        try:
            values[key] = type_(raw)
        except ValueError:
            raise ConfigError(f"{source}: {raw!r} is not a valid {type_.__name__}") from None
    for key, flag, var in (
        ("ledger_url", "--ledger-url", "HOTLOAD_LEDGER_URL"),
        ("weights_dir", "--weights-dir", "HOTLOAD_WEIGHTS_DIR"),
    ):
        if not values[key]:
            raise ConfigError(f"{flag} (or {var}) is required")
    _choice(values, "engine", ENGINE_KINDS, "--engine")
    _choice(values, "mode", MODES, "--mode")
    _choice(values, "report", REPORT_MODES, "--report")
    _choice(values, "log_level", LOG_LEVELS, "--log-level")
    _choice(values, "log_format", LOG_FORMATS, "--log-format")
    if values["cache_policy"] is not None:
        _choice(values, "cache_policy", CACHE_POLICIES, "--cache-policy")
    for key, low in (("keep", 1), ("prefetch", 1), ("threads", 1), ("max_adapters", 0)):
        if values[key] is not None and values[key] < low:
            raise ConfigError(
                f"--{key.replace('_', '-')}: must be at least {low}, not {values[key]}"
            )
    for key in (
        "poll_seconds",
        "retry_seconds",
        "engine_wait_seconds",
        "load_timeout_seconds",
        "safety_poll_seconds",
        "head_stale_seconds",
    ):
        if values[key] <= 0:
            raise ConfigError(f"--{key.replace('_', '-')}: must be positive")
    if values["hint_ttl_seconds"] < 0:
        raise ConfigError("--hint-ttl-seconds: must be 0 (off) or positive")
    if not 0 <= values["sparse_max_changed"] <= 1:
        raise ConfigError("--sparse-max-changed: must be in [0, 1] (0 turns sparse loads off)")
    if values["compact_fraction"] < 0:
        raise ConfigError("--compact-fraction: must be 0 (never) or positive")
    if not 0 <= values["poll_jitter"] < 1:
        raise ConfigError("--poll-jitter: must be in [0, 1)")
    _host, sep, port = values["listen"].rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--listen: expected HOST:PORT, not {values['listen']!r}")
    if values["report"] == "kubernetes":
        for key, flag, var in (
            ("pod_name", "--pod-name", "POD_NAME"),
            ("namespace", "--namespace", "POD_NAMESPACE"),
        ):
            if not values[key]:
                raise ConfigError(
                    f"--report kubernetes needs {flag} (or {var}, from the downward API)"
                )
    if values["deployment"] and values["report"] != "kubernetes":
        raise ConfigError(
            "--deployment (HOTLOAD_DEPLOYMENT) needs --report kubernetes: the head is read "
            "from the deployment's HotLoadHead through the API server"
        )
    if values["pin"] is not None and values["pin_object"] is not None:
        raise ConfigError("--pin and --pin-object exclude each other: a pin is static or polled")
    if values["pin"] is not None:
        try:
            validate_identity(values["pin"])
        except InvalidIdentityError as err:
            raise ConfigError(f"--pin: {err}") from None
    values["engine_kind"] = values.pop("engine")
    values["credentials_dir"] = values["credentials_dir"] or None
    values["mirrors"] = parse_mirrors(args.get("mirror"), env.get(MIRRORS_ENV))
    return Settings(**values)


def parse_mirrors(flags: Sequence[str] | None, variable: str | None) -> tuple[MirrorSetting, ...]:
    """The mirrors from `--mirror URL[,credentials=DIR]` flags (they win) or the JSON array in
    HOTLOAD_MIRRORS; raise `ConfigError` naming the flag or the array item that is wrong."""
    mirrors: list[MirrorSetting] = []
    if flags:
        for text in flags:
            url, _, rest = text.partition(",")
            where = f"--mirror {text!r}"
            credentials: Path | None = None
            if rest:
                name, sep, value = rest.partition("=")
                if name.strip() != "credentials" or not sep or not value.strip():
                    raise ConfigError(f"{where}: expected URL or URL,credentials=DIR")
                credentials = Path(value.strip())
            mirrors.append(_mirror(url.strip(), credentials, where))
    elif variable and variable.strip():
        try:
            items = json.loads(variable)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{MIRRORS_ENV}: not valid JSON ({err})") from None
        if not isinstance(items, list):
            raise ConfigError(f"{MIRRORS_ENV}: expected a JSON array of mirrors")
        for i, item in enumerate(items):
            where = f"{MIRRORS_ENV}[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("url"), str):
                raise ConfigError(f'{where}: expected {{"url": "...", "credentialsDir": "..."}}')
            unknown = sorted(set(item) - {"url", "credentialsDir"})
            if unknown:
                raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
            folder = item.get("credentialsDir")
            if folder is not None and (not isinstance(folder, str) or not folder):
                raise ConfigError(f"{where}.credentialsDir: expected a folder path")
            mirrors.append(_mirror(item["url"], Path(folder) if folder else None, f"{where}.url"))
    if len(mirrors) > MAX_MIRRORS:
        raise ConfigError(f"--mirror: at most {MAX_MIRRORS} mirrors, not {len(mirrors)}")
    return tuple(mirrors)


def _mirror(url: str, credentials: Path | None, where: str) -> MirrorSetting:
    try:
        parse_bucket_url(url)
    except InvalidBucketURLError as err:
        raise ConfigError(f"{where}: {err}") from None
    return MirrorSetting(url, credentials)


def _choice(values: dict[str, Any], key: str, choices: Sequence[str], flag: str) -> None:
    if values[key] not in choices:
        raise ConfigError(f"{flag}: {values[key]!r} is not one of {', '.join(choices)}")
