"""`hotload publish` and `hotload ledger ...` against a real local folder and a real S3 server,
including an S3 server killed in the middle of an upload."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hotload.bucket import RetryPolicy, download_snapshot, open_bucket, snapshot_present
from hotload.cli.main import main
from hotload.ledger import Ledger
from hotload.ledger.hints import read_hint_async
from hotload.sdk import publish_folder
from hotload.snapshot import describe_snapshot, write_snapshot
from support import snapshots
from support.fleet import run_on_a_terminal
from support.seaweedfs import HTTPProxy, SeaweedFS


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
    assert code == 0 and "already in the bucket" in out, err

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


def _fulls(root: Path, count: int) -> list[Path]:
    """Full snapshot folders f0..fN-1 of one model, each a training step after the one before."""
    states = [snapshots.weights(0)]
    for step in range(1, count):
        states.append(snapshots.nudged(states[-1], step))
    return [snapshots.full(root / f"f{i}", w) for i, w in enumerate(states)]


def _served(bucket_url: str, ledger: str, root: Path) -> dict[str, bytes]:
    """What a replica rebuilds from the ledger head: tensor name -> bytes."""
    import asyncio

    from hotload.snapshot import Snapshot
    from hotload_sidecar.materialize import Materializer
    from hotload_sidecar.weights import WeightsFolder

    led = Ledger(open_bucket(bucket_url), ledger)
    w = WeightsFolder(root)
    w.prepare()
    built = asyncio.run(Materializer(led.bucket, w, threads=1).build(led.read().document))
    return _tensors_of(Snapshot(built.path))


def _tensors_of(snap: Any) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for shard in snap.shard_files:
        with snap.open_shard(shard) as f:
            for name in f.tensors:
                out[name] = bytes(f.raw(name))
    return out


def test_full_folders_go_as_deltas_on_the_head(
    bucket_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A full folder becomes an arc_v2 delta against the ledger head (rebuilt from the bucket,
    or taken from --workdir), the ledger admits it and a replica rebuilds exactly the folder;
    --full keeps it full; a delta folder goes as it is."""
    from hotload.snapshot import Snapshot

    f = _fulls(tmp_path / "snaps", 6)
    code, out, err = publish(capsys, f[0], bucket_url, "-o", "json")
    assert code == 0, err
    assert json.loads(out)["entry"]["kind"] == "full"  # nothing to make a delta against
    # No workdir: the head is downloaded and rebuilt here, then the delta made against it.
    code, out, err = publish(capsys, f[1], bucket_url, "-o", "json")
    assert code == 0, err
    doc = json.loads(out)
    entry = doc["entry"]
    assert (entry["kind"], entry["previous"], entry["identity"]) == ("incremental", "f0", "f1")
    assert doc["uploaded"] and entry["shippedBytes"] * 4 < entry["fullBytes"]
    assert not list(f[1].parent.glob(".hotload-publish-*"))  # its scratch folder is gone
    # --workdir keeps the full copy: the next publish does not need the bucket's copy at all.
    work = tmp_path / "work"
    code, out, err = publish(capsys, f[2], bucket_url, "--workdir", str(work))
    assert code == 0, err
    assert "published f2 (incremental on top of f1)" in out
    if "://" not in bucket_url:  # a local bucket: make the head impossible to download
        for shard in (Path(bucket_url) / "f2").glob("model-*.safetensors"):
            shard.rename(shard.with_suffix(".moved"))
    code, out, err = publish(capsys, f[3], bucket_url, "--workdir", str(work))
    assert code == 0, err
    assert "published f3 (incremental on top of f2)" in out
    if "://" not in bucket_url:
        for shard in (Path(bucket_url) / "f2").glob("model-*.moved"):
            shard.rename(shard.with_suffix(".safetensors"))
    # --full forces a full snapshot; a delta folder is published as it is.
    code, out, err = publish(capsys, f[4], bucket_url, "--full")
    assert code == 0, err
    assert "published f4 (full)" in out
    as_is = snapshots.delta(f[4], f[5], tmp_path / "deltas" / "f5")
    code, out, err = publish(capsys, as_is, bucket_url, "-o", "json")
    assert code == 0, err
    assert json.loads(out)["entry"]["shippedBytes"] == describe_snapshot(as_is).shipped_bytes
    # Re-running a full folder published as a delta changes nothing; other weights under
    # that identity are refused.
    code, out, err = publish(capsys, f[1], bucket_url)
    assert code == 0 and "published f1 (incremental on top of f0)" in out, err
    assert "already in the bucket" in out
    code, out, err = publish(capsys, f[2], bucket_url, "--identity", "f1")
    assert code == 1 and "already published (an arc_v2 delta) with other weights" in err

    entries = Ledger(open_bucket(bucket_url), "policy").read().document.entries
    assert [(e.identity, e.kind) for e in entries] == [
        ("f0", "full"), ("f1", "incremental"), ("f2", "incremental"), ("f3", "incremental"),
        ("f4", "full"), ("f5", "incremental"),
    ]  # fmt: skip
    assert [e.previous for e in entries if e.kind == "incremental"] == ["f0", "f1", "f2", "f4"]
    assert _served(bucket_url, "policy", tmp_path / "replica") == _tensors_of(Snapshot(f[5]))
    # And the chain through the CLI-made deltas rebuilds f3 bit for bit.
    from hotload.bucket import download_snapshot

    for name in ("f0", "f1", "f2", "f3"):
        download_snapshot(open_bucket(bucket_url), name, tmp_path / "dl" / name)
    from hotload.arc import decode

    prev = tmp_path / "dl" / "f0"
    for name in ("f1", "f2", "f3"):
        decode(prev, tmp_path / "dl" / name, tmp_path / "rebuilt" / name, threads=1)
        prev = tmp_path / "rebuilt" / name
    assert _tensors_of(Snapshot(prev)) == _tensors_of(Snapshot(f[3]))


def test_a_full_folder_after_a_reset_goes_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = str(tmp_path / "bucket")
    f = _fulls(tmp_path / "snaps", 2)
    assert publish(capsys, f[0], bucket)[0] == 0
    assert run(capsys, "ledger", "reset", f"{bucket}/policy", "--reason", "new run")[0] == 0
    code, out, err = publish(capsys, f[1], bucket)
    assert code == 0, err
    assert "published f1 (full)" in out


def test_progress_bars_on_a_terminal(tmp_path: Path) -> None:
    """The CLI shows a byte progress bar on stderr when it is a terminal (and not with
    --no-progress); the SDK's Publisher does too by default."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bucket = str(tmp_path / "bucket")
    f = _fulls(tmp_path / "snaps", 3)
    cli = [sys.executable, "-m", "hotload", "publish"]
    code, out, tty = run_on_a_terminal([*cli, str(f[0]), "--bucket", bucket, "--ledger", "p"], env)
    assert code == 0, tty
    assert "published f0 (full)" in out
    assert "upload f0" in tty and "74.7 KiB" in tty  # the bar: name, bytes of the total
    code, _, tty = run_on_a_terminal(
        [*cli, str(f[1]), "--bucket", bucket, "--ledger", "p", "--no-progress"], env
    )
    assert code == 0 and "upload" not in tty and "KiB" not in tty, tty
    script = (
        "import sys; from hotload import Publisher\n"
        f"with Publisher({bucket!r}, ledger='p') as pub:\n"
        f"    print(pub.publish({str(f[2])!r}, step=1, identity='f2').kind)\n"
    )
    code, out, tty = run_on_a_terminal([sys.executable, "-c", script], env)
    assert code == 0, tty
    assert out.strip() == "full"  # a fresh publisher, no workdir: full
    assert "upload f2" in tty and "KiB" in tty


def test_no_kubernetes_credentials_is_a_clear_error(
    tmp_path: Path,
    chain: list[Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    code, out, err = run(capsys, "publish", chain[0], "--deployment", "fleet", "--no-progress")
    assert code == 1 and out == ""
    assert "no Kubernetes credentials" in err and "--kubeconfig" in err and "--ledger" in err


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


def test_a_failed_hint_write_does_not_fail_the_publish(
    s3_env: SeaweedFS, chain: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_env.url(f"t-{uuid.uuid4().hex[:12]}")
    with HTTPProxy(s3_env.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        # Every hint write fails (a bucket policy refusing that prefix would do the same).
        proxy.fail_next(1000, 503, lambda r: r.method == "PUT" and "/.hotload/hints/" in r.target)
        bucket = open_bucket(url, retry=RetryPolicy(attempts=2, initial_backoff=0.01))
        published = publish_folder(Ledger(bucket, "policy"), chain[0])
    assert published.entry.identity == "s0" and snapshot_present(bucket, "s0")


def test_server_killed_mid_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hotload publish` (the real path: Publisher, publish_folder_async, upload, ledger) with
    SeaweedFS killed while the shards are on their way: a clear error naming the object, no
    ledger entry, nothing committed; the same command succeeds once the server is back."""
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
        shards = [n for n in desc.files if n.endswith(".safetensors")]
        smallest = min((folder / n).stat().st_size for n in shards)
        assert len(shards) == 4 and smallest > 16 << 20

        # The command talks to SeaweedFS through a proxy that kills the server once 12 MiB of
        # request bodies have gone through: well into the shards' upload, yet less than any one
        # shard, so no shard has landed (config.json, sent beside the first shard, may have).
        killed_after = 12 << 20
        with HTTPProxy(server.endpoint) as proxy, monkeypatch.context() as env:
            env.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
            proxy.after_upload_bytes(killed_after, server.kill)
            code, out, err = publish(capsys, folder, url)
            assert server.process is not None and server.process.poll() is not None  # killed
            sent = [r for r in proxy.recorded() if r.method in ("PUT", "POST")]
        assert {r.target.split("?")[0].rsplit("/", 1)[-1] for r in sent} & set(shards)
        assert code == 1 and out == "", err
        # One line naming the object that failed and why: a file of the snapshot (a failed
        # hint rewrite never fails a publish: test_a_failed_hint_write_does_not_fail_the_publish).
        failed = r"big-0/[^/\s]+"
        assert re.fullmatch(
            rf"hotload: error: {re.escape(url)}/{failed}: "
            r"unreachable: PUT: gave up after \d+ attempt\(s\): .+\n",
            err,
        ), err

        server.restart()
        after = open_bucket(url)
        assert not Ledger(after, "policy").read().exists  # no ledger entry
        # Not committed: no commit manifest (nor any other manifest), so not present.
        keys = {i.key for i in after.list("big-0")}
        assert not keys & {f"big-0/{n}" for n in desc.manifest_files}
        assert not after.exists("big-0/model.safetensors.index.json")
        assert not snapshot_present(after, "big-0")
        # The early-fetch hint, written before the upload, never says complete.
        hint = asyncio.run(read_hint_async(after, "policy", "big-0"))
        assert hint is None or not hint.complete

        code, out, err = publish(capsys, folder, url)  # the same command, server back: succeeds
        assert code == 0, err
        assert "published big-0 (full)" in out
        doc = Ledger(after, "policy").read().document
        assert [(e.sequence, e.identity, e.kind) for e in doc.entries] == [(1, "big-0", "full")]
        download_snapshot(after, "big-0", tmp_path / "fetched")
        for name in desc.files:
            assert (tmp_path / "fetched" / name).read_bytes() == (folder / name).read_bytes()
    finally:
        server.stop()
