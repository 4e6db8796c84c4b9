"""`hotload publish` and `hotload ledger ...` against a real local folder and a real S3 server,
including an S3 server killed in the middle of an upload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hotload.bucket import (
    RetryPolicy,
    download_snapshot,
    open_bucket,
    snapshot_present,
    upload_snapshot,
)
from hotload.cli.main import main
from hotload.errors import BucketUnreachableError
from hotload.ledger import Ledger, NewEntry
from hotload.snapshot import describe_snapshot, write_snapshot
from support import snapshots
from support.seaweedfs import SeaweedFS


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Snapshot folders s0 (full), s1, s2, s3 (deltas, each on the one before)."""
    return snapshots.chain(tmp_path_factory.mktemp("snapshots"), 3)


def run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


def publish(
    capsys: pytest.CaptureFixture[str], folder: Path, bucket: str, *extra: str
) -> tuple[int, str, str]:
    return run(
        capsys, "publish", folder, "--bucket", bucket, "--ledger", "policy", "--no-progress", *extra
    )


def test_publish_full_then_deltas_and_show(
    bucket_url: str, chain: list[Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    s0, s1, s2, _ = chain
    code, out, err = publish(capsys, s0, bucket_url)
    assert code == 0, err
    assert "published s0 (full)" in out and "sequence 1" in out
    code, out, err = publish(capsys, s1, bucket_url, "--prompt-cache", "new_session", "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["entry"]["kind"] == "incremental" and doc["entry"]["previous"] == "s0"
    assert doc["entry"]["promptCache"] == "new_session" and doc["uploaded"] is True
    assert publish(capsys, s2, bucket_url)[0] == 0

    bucket = open_bucket(bucket_url)
    for identity in ("s0", "s1", "s2"):
        assert snapshot_present(bucket, identity)
    desc = describe_snapshot(s1)
    entry = Ledger(bucket, "policy").read().document.find("s1")
    assert entry is not None
    assert (entry.manifest_digest, entry.shipped_bytes, entry.full_bytes) == (
        desc.manifest_digest,
        desc.shipped_bytes,
        desc.full_bytes,
    )

    code, out, _ = run(capsys, "ledger", "show", f"{bucket_url}/policy")
    assert code == 0
    for text in (
        "SEQ",
        "IDENTITY",
        "PARENT",
        "SHIPPED",
        "s0",
        "s1",
        "s2",
        "incremental",
        "new_session",
    ):
        assert text in out, text
    assert "head: s2" in out
    code, out, _ = run(capsys, "ledger", "show", f"{bucket_url}/policy", "-o", "json")
    shown = json.loads(out)
    assert shown["formatVersion"] == 1 and [e["sequence"] for e in shown["entries"]] == [1, 2, 3]
    assert shown["etag"]

    # Re-publishing the same folder is a harmless no-op.
    code, out, _ = publish(capsys, s2, bucket_url)
    assert code == 0 and "already in the bucket" in out

    # What a replica fetches, from the CLI and for real.
    code, out, _ = run(
        capsys, "ledger", "resolve", f"{bucket_url}/policy", "--current", "s1", "-o", "json"
    )
    assert [e["identity"] for e in json.loads(out)["fetch"]] == ["s2"]
    code, out, _ = run(capsys, "ledger", "resolve", f"{bucket_url}/policy")
    assert "fetch 3 snapshot(s)" in out
    download_snapshot(bucket, "s2", tmp_path / "replica" / "s2")
    assert (tmp_path / "replica" / "s2" / "model.safetensors.index.json").is_file()


def test_delta_after_reset_is_refused_before_uploading(
    bucket_url: str, chain: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    s0, s1, s2, _ = chain
    assert publish(capsys, s0, bucket_url)[0] == 0
    assert publish(capsys, s1, bucket_url)[0] == 0
    code, out, err = run(
        capsys, "ledger", "reset", f"{bucket_url}/policy", "--reason", "rolled back to step 0"
    )
    assert code == 0, err
    assert "sequence 3" in out and "next entry must be a full snapshot" in out
    code, _, err = publish(capsys, s2, bucket_url)
    assert code == 1
    assert "reset at sequence 3" in err and "must be a full snapshot" in err
    assert not snapshot_present(open_bucket(bucket_url), "s2")  # refused before any upload
    code, out, _ = run(capsys, "ledger", "show", f"{bucket_url}/policy")
    assert "rolled back to step 0" in out


def test_delta_with_a_wrong_parent_is_refused(
    bucket_url: str, chain: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    s0, _, s2, _ = chain
    assert publish(capsys, s0, bucket_url)[0] == 0
    code, _, err = publish(capsys, s2, bucket_url)  # s2 was made on top of s1, not s0
    assert code == 1 and "'s1'" in err and "the head is 's0'" in err


def test_compact_from_the_cli(
    bucket_url: str, chain: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    s3 = chain[-1]
    for folder in chain:
        assert publish(capsys, folder, bucket_url)[0] == 0
    code, out, _ = run(capsys, "ledger", "compact", f"{bucket_url}/policy", "--keep", "1")
    assert code == 0 and "dropped 0" in out  # all of it is the chain from the latest full
    ledger = Ledger(open_bucket(bucket_url), "policy")
    ledger.reset("new run")
    full_again = snapshots.full(s3.parent / "fresh", snapshots.weights(7))
    assert publish(capsys, full_again, bucket_url)[0] == 0
    code, out, _ = run(
        capsys, "ledger", "compact", f"{bucket_url}/policy", "--keep", "2", "-o", "json"
    )
    doc = json.loads(out)
    assert doc["dropped"] == 3
    assert [e["identity"] for e in doc["ledger"]["entries"]] == ["s3", "fresh"]
    assert doc["ledger"]["sequence"] == 6


def test_cli_errors_are_clear(
    tmp_path: Path, chain: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "ledger", "show", f"{tmp_path}/bucket/missing")
    assert code == 1 and "no such ledger" in err and "missing" in err
    code, _, err = run(capsys, "ledger", "reset", f"{tmp_path}/bucket/typo", "--reason", "x")
    assert code == 1 and "no such ledger" in err
    assert not (tmp_path / "bucket" / ".hotload").exists()  # nothing created by mistake
    code, _, err = run(capsys, "ledger", "show", "ftp://host/x/policy")
    assert code == 1 and "unsupported scheme" in err
    code, _, err = publish(capsys, tmp_path / "nope", str(tmp_path / "bucket"))
    assert code == 1 and "not a folder" in err
    code, _, err = publish(capsys, chain[0], str(tmp_path / "bucket"), "--identity", "bad/identity")
    assert code == 1 and "not a valid snapshot identity" in err
    code, _, err = run(capsys, "ledger", "reset", f"{tmp_path}/bucket/policy")
    assert code == 2 and "--reason" in err


@pytest.mark.parametrize(
    "args",
    [
        ("publish", "--help"),
        ("ledger", "--help"),
        ("ledger", "show", "--help"),
        ("ledger", "reset", "--help"),
        ("ledger", "compact", "--help"),
        ("ledger", "resolve", "--help"),
    ],
)
def test_help(args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *args)
    assert code == 0 and "usage: hotload" in out and len(out) > 300


def test_server_killed_mid_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its own server: this test kills it.
    server = SeaweedFS.start(tmp_path / "weed")
    try:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        url = server.url("crash")
        rng = np.random.default_rng(5)
        layers = {
            f"model.layers.{i}.w": rng.standard_normal((2048, 2048), dtype=np.float32)
            for i in range(4)
        }
        folder = write_snapshot(tmp_path / "big-0", layers, config=snapshots.CONFIG).path
        desc = describe_snapshot(folder)
        assert desc.shipped_bytes > 60 << 20

        bucket = open_bucket(
            url,
            retry=RetryPolicy(attempts=2, initial_backoff=0.1, max_backoff=0.2),
            part_size=8 << 20,
            concurrency=2,
        )
        sent = 0

        def kill_midway(n: int) -> None:
            nonlocal sent
            sent += n
            if sent > 24 << 20 and server.process is not None and server.process.poll() is None:
                server.kill()

        # The publish steps as the CLI runs them: upload, and only then the ledger.
        with pytest.raises(BucketUnreachableError) as err:
            upload_snapshot(
                folder,
                bucket,
                "big-0",
                files=desc.files,
                manifest_files=desc.manifest_files,
                progress=kill_midway,
            )
            Ledger(bucket, "policy").append(NewEntry("big-0", "full", desc.manifest_digest, 1, 1))
        message = str(err.value)
        assert "unreachable" in message and url in message and "big-0/" in message

        server.restart()
        after = open_bucket(url)
        assert not Ledger(after, "policy").read().exists  # no ledger entry
        assert not snapshot_present(after, "big-0")  # and nothing visible as a snapshot

        code, _, err_text = publish(capsys, folder, url)  # the retry succeeds
        assert code == 0, err_text
        doc = Ledger(after, "policy").read().document
        assert [(e.sequence, e.identity) for e in doc.entries] == [(1, "big-0")]
        download_snapshot(after, "big-0", tmp_path / "fetched")
        for name in desc.files:
            assert (tmp_path / "fetched" / name).read_bytes() == (folder / name).read_bytes()
    finally:
        server.stop()
