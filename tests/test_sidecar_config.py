"""Loader settings for mirrors: `--mirror URL[,credentials=DIR]` and HOTLOAD_MIRRORS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hotload_sidecar.config import ConfigError, MirrorSetting, build_parser, load_settings

REQUIRED = ["--ledger-url", "s3://origin/prod/policy", "--weights-dir", "/tmp/w"]


def test_mirror_flags_keep_their_order_and_credentials() -> None:
    settings = load_settings(
        [
            *REQUIRED,
            "--mirror",
            "s3://cache-eu/prod,credentials=/run/m0",
            "--mirror",
            "s3://b/prod",
        ],
        {},
    )
    assert settings.mirrors == (
        MirrorSetting("s3://cache-eu/prod", Path("/run/m0")),
        MirrorSetting("s3://b/prod", None),
    )


def test_the_operators_json_sets_mirrors_and_flags_win_over_it() -> None:
    env = {
        "HOTLOAD_MIRRORS": json.dumps(
            [
                {"url": "s3://a/p", "credentialsDir": "/var/run/hotload/mirrors/0"},
                {"url": "s3://b/p"},
            ]
        )
    }
    assert load_settings(REQUIRED, env).mirrors == (
        MirrorSetting("s3://a/p", Path("/var/run/hotload/mirrors/0")),
        MirrorSetting("s3://b/p", None),
    )
    assert load_settings([*REQUIRED, "--mirror", "s3://c/p"], env).mirrors == (
        MirrorSetting("s3://c/p", None),
    )
    assert load_settings(REQUIRED, {}).mirrors == ()


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--mirror", "http://cache/x"], {}, "--mirror 'http://cache/x'"),
        (["--mirror", "s3://a/p,creds=/x"], {}, "--mirror 's3://a/p,creds=/x'"),
        ([], {"HOTLOAD_MIRRORS": "[{url: 1}"}, "HOTLOAD_MIRRORS: not valid JSON"),
        ([], {"HOTLOAD_MIRRORS": '{"url": "s3://a"}'}, "HOTLOAD_MIRRORS: expected a JSON array"),
        ([], {"HOTLOAD_MIRRORS": '[{"url": "ftp://a/p"}]'}, "HOTLOAD_MIRRORS[0].url"),
        (
            [],
            {"HOTLOAD_MIRRORS": '[{"url": "s3://a", "secret": "x"}]'},
            "HOTLOAD_MIRRORS[0]: unknown",
        ),
        ([], {"HOTLOAD_MIRRORS": '[{"url": "s3://a", "credentialsDir": 3}]'}, "credentialsDir"),
        (
            [],
            {"HOTLOAD_MIRRORS": json.dumps([{"url": f"s3://m{i}"} for i in range(9)])},
            "at most 8",
        ),
    ],
)
def test_a_bad_mirror_names_the_field(argv: list[str], env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings([*REQUIRED, *argv], env)
    assert names in str(caught.value)


def test_help_explains_mirrors() -> None:
    text = build_parser().format_help()
    assert "--mirror URL[,credentials=DIR]" in text and "HOTLOAD_MIRRORS" in text
