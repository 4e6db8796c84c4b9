"""A trainer's mistakes meet a `HotloadError` that names the cause and what to do, before any
byte moves and with nothing lost: a bucket URL typo, missing or half credentials, the same step
twice, a dtype change, no config.json, NaN or Inf weights, a step going back. Each expected
message is written from the input the test gives, never read from the code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hotload.bucket import open_bucket
from hotload.errors import HotloadError, MissingCredentialsError
from hotload.ledger import Ledger
from hotload.sdk import Publisher, PublishError
from support.snapshots import CONFIG, nudged, weights


def _ledger_identities(bucket: str, name: str = "policy") -> list[str]:
    return [e.identity for e in Ledger(open_bucket(bucket), name).read().document.entries]


def test_a_bucket_url_with_a_slash_missing_is_refused_not_made_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for typo, meant in (("s3:/rl/prod", "s3://rl/prod"), ("GS:bucket/x", "gs://bucket/x")):
        with pytest.raises(HotloadError) as info:
            Publisher(typo, ledger="policy", config=CONFIG)
        assert f"looks like the URL {meant} with a slash missing" in str(info.value)
        assert f"./{typo} for a local folder" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no folder named "s3:" appeared
    # Said explicitly, a folder of that name is one.
    with Publisher("./s3:/rl", ledger="policy", config=CONFIG) as pub:
        pub.publish(weights(0), step=0)
    assert (tmp_path / "s3:" / "rl" / "step-00000000").is_dir()


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hotload", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _s3_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An environment with an S3 endpoint and no credentials anywhere: a closed port for the
    endpoint and for the instance metadata service (so no cloud is asked)."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_") or name == "HOTLOAD_BUCKET_CREDENTIALS_DIR":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:1")
    return dict(os.environ)


def test_no_credentials_say_which_variables_and_secret_keys_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = _s3_env(monkeypatch)
    bucket = open_bucket("s3://rl/prod")
    with pytest.raises(MissingCredentialsError) as info:
        Ledger(bucket, "policy").read()
    text = str(info.value)
    assert text.startswith("s3://rl/prod/.hotload/ledgers/policy.json: no credentials: GET:")
    for needed in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "--credentials-dir",
        "spec.bucket.credentialsSecret",
        "docs/credentials.md",
    ):
        assert needed in text, needed
    # The CLI: the same words and exit code 1, no traceback.
    done = _cli("ledger", "show", "s3://rl/prod/policy", env=env)
    assert done.returncode == 1, done.stderr
    assert "no credentials" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
        ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"),
    ],
)
def test_half_a_key_pair_names_the_missing_half(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, given: str, missing: str
) -> None:
    env = _s3_env(monkeypatch)
    monkeypatch.setenv(given, "x")
    with pytest.raises(MissingCredentialsError) as info:
        open_bucket("s3://rl/prod")
    assert f"{given} is set (by the environment) but {missing} is not" in str(info.value)
    assert f"Set {missing} beside it" in str(info.value)
    done = _cli("ledger", "show", "s3://rl/prod/policy", env={**env, given: "x"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{given} is set (by the environment) but {missing} is not" in done.stderr
    # The same half in a credentials folder (a mounted Secret) names the folder.
    monkeypatch.delenv(given)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / given).write_text("x")
    with pytest.raises(MissingCredentialsError, match=f"{given} is set \\(by a file in {secret}"):
        open_bucket("s3://rl/prod", credentials_dir=secret)


def test_the_same_step_again_is_a_no_op_with_the_same_weights_and_refused_with_others(
    bucket_url: str, tmp_path: Path
) -> None:
    base = weights(0)
    with Publisher(bucket_url, ledger="policy", config=CONFIG, full_every=10) as pub:
        pub.publish(base, step=0)
        first = pub.publish(nudged(base, 1), step=1)
        again = pub.publish(nudged(base, 1), step=1)
        assert (again.identity, again.shipped_bytes, again.sequence) == (
            "step-00000001",
            0,
            first.entry.sequence if first.entry else None,
        )
        assert again.transfer is not None and again.transfer.already_present
        with pytest.raises(PublishError) as info:
            pub.publish(nudged(base, 2), step=1)
    assert "'step-00000001' is already in ledger 'policy' (sequence 2) with other weights" in str(
        info.value
    )
    assert "publish this step under a new identity" in str(info.value).lower()
    # A restarted trainer with an empty workdir: the bucket's headers alone tell.
    with Publisher(bucket_url, ledger="policy", config=CONFIG, full_every=10) as fresh:
        assert fresh.publish(nudged(base, 1), step=1).shipped_bytes == 0
        assert fresh.publish(base, step=0).shipped_bytes == 0  # a full one too
        with pytest.raises(PublishError, match="with other weights"):
            fresh.publish(weights(5), step=0)
    assert _ledger_identities(bucket_url) == ["step-00000000", "step-00000001"]


def test_a_dtype_change_says_what_to_do(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    base = weights(0)
    with Publisher(bucket, ledger="policy", config=CONFIG, full_every=10) as pub:
        pub.publish(base, step=0)
        changed = dict(base)
        changed["model.layers.1.mlp.weight"] = base["model.layers.1.mlp.weight"].astype(np.float16)
        with pytest.raises(HotloadError) as info:
            pub.publish(changed, step=1)
        text = str(info.value)
        assert "tensor_map.model.layers.1.mlp.weight.dtype: changed from F32 to F16" in text
        assert "full=True" in text and "cast='BF16'" in text
        # What it says works: a full snapshot takes the new dtype.
        assert pub.publish(changed, step=1, full=True).kind == "full"
    assert _ledger_identities(bucket) == ["step-00000000", "step-00000001"]


def test_a_missing_config_is_refused_when_the_publisher_is_made(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(PublishError) as info:
        Publisher(str(tmp_path / "b"), ledger="policy", side_files_from=model)
    assert f"side_files_from: {model / 'config.json'} does not exist" in str(info.value)
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(PublishError, match="holds a JSON list, not an object"):
        Publisher(str(tmp_path / "b"), ledger="policy", side_files_from=model)
    (model / "config.json").write_text(json.dumps(CONFIG))
    Publisher(str(tmp_path / "b"), ledger="policy", side_files_from=model).close()
    # Neither given: a publisher of folders or adapters needs none, so tensors are refused at
    # their first publish, before any is written.
    with (
        Publisher(str(tmp_path / "b"), ledger="policy", workdir=tmp_path / "w") as pub,
        pytest.raises(PublishError, match=r"a snapshot of tensors needs a config\.json"),
    ):
        pub.publish(weights(0), step=0)
    assert not (tmp_path / "w" / "full").exists()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_weights_are_refused_unless_allowed(tmp_path: Path, bad: float) -> None:
    bucket = str(tmp_path / "bucket")
    base = weights(0)
    diverged = nudged(base, 1)
    diverged["model.layers.2.mlp.weight"][3, 5] = bad
    nan, inf = (1, 0) if np.isnan(bad) else (0, 1)
    with Publisher(bucket, ledger="policy", config=CONFIG, full_every=2, cast="BF16") as pub:
        with pytest.raises(HotloadError) as info:
            pub.publish(diverged, step=0)  # a full snapshot
        text = str(info.value)
        assert "model.layers.2.mlp.weight" in text
        assert f"holds {nan} NaN and {inf} Inf value(s) among its 4096" in text
        assert f"the first at flat index {3 * 64 + 5}" in text and "allow_nonfinite=True" in text
        pub.publish(base, step=0)
        with pytest.raises(HotloadError, match=r"model\.layers\.2\.mlp\.weight"):
            pub.publish(diverged, step=1)  # a delta
    assert _ledger_identities(bucket) == ["step-00000000"]
    with Publisher(bucket, ledger="policy", config=CONFIG, allow_nonfinite=True) as pub:
        assert pub.publish(diverged, step=1).identity == "step-00000001"


def test_a_step_going_back_is_refused_unless_asked_for(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    work = tmp_path / "trainer"
    base = weights(0)
    with Publisher(bucket, ledger="policy", config=CONFIG, workdir=work) as pub:
        pub.publish(base, step=5)
        with pytest.raises(PublishError) as info:
            pub.publish(nudged(base, 1), step=3)
    assert "step 3 is before step 5, the last this publisher published to ledger 'policy'" in str(
        info.value
    )
    assert "allow_step_back=True" in str(info.value) and "spec.pin" in str(info.value)
    # A restart with the same workdir remembers the step.
    with (
        Publisher(bucket, ledger="policy", config=CONFIG, workdir=work) as pub,
        pytest.raises(PublishError, match="step 3 is before step 5"),
    ):
        pub.publish(nudged(base, 1), step=3)
    with Publisher(
        bucket, ledger="policy", config=CONFIG, workdir=work, allow_step_back=True
    ) as pub:
        assert pub.publish(nudged(base, 1), step=3).identity == "step-00000003"
    assert _ledger_identities(bucket) == ["step-00000005", "step-00000003"]
