"""Buckets on a real local folder and a real S3 server (SeaweedFS): reads, writes, conditions,
parallel transfers, snapshot upload order, error messages and configuration."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hotload.bucket import (
    NotModified,
    ObjectData,
    RetryPolicy,
    download_snapshot,
    load_settings,
    open_bucket,
    parse_bucket_url,
    s3_config,
    snapshot_present,
    split_ledger_url,
    upload_snapshot,
)
from hotload.bucket.remote import MIN_UPLOAD_PART
from hotload.bucket.stores import gcs_config
from hotload.errors import (
    AccessDeniedError,
    BucketError,
    BucketUnreachableError,
    InvalidBucketURLError,
    MissingCredentialsError,
    ObjectExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from support import snapshots
from support.seaweedfs import ACCESS_KEY, SECRET_KEY, HTTPProxy, ProxiedRequest, SeaweedFS


class SimulatedCrashError(Exception):
    """Raised from a progress callback to stop an upload half-way."""


FAST_RETRY = RetryPolicy(attempts=2, initial_backoff=0.05, max_backoff=0.1)


@dataclass(frozen=True)
class CountingRetry(RetryPolicy):
    """A retry policy that notes every retry hotload makes (`retrying` asks `delay` for the
    back-off before each one) and keeps the back-off short so tests stay quick."""

    retries: list[int] = field(default_factory=list)

    def delay(self, attempt: int) -> float:
        self.retries.append(attempt)
        return 0.01


@pytest.fixture
def wire(bucket_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[HTTPProxy | None]:
    """On the S3 variant of `bucket_url`, a recording proxy between hotload and SeaweedFS, so a
    test can see the requests that really went over the wire; None on a local folder."""
    if "://" not in bucket_url:
        yield None
        return
    with HTTPProxy(os.environ["AWS_ENDPOINT_URL"]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield proxy


def _range(request: ProxiedRequest) -> tuple[int, int]:
    """The inclusive byte range of a ranged GET (`Range: bytes=START-END`)."""
    start, _, end = request.headers["range"].removeprefix("bytes=").partition("-")
    return int(start), int(end)


# --- plain objects -------------------------------------------------------------------------------


def test_put_get_head_list_delete(bucket_url: str) -> None:
    bucket = open_bucket(bucket_url)
    etag = bucket.put("snap/a.json", b'{"a": 1}')
    bucket.put("snap/sub/b.bin", b"x" * 1000)
    bucket.put("snapshot-other/c", b"c")

    got = bucket.get("snap/a.json")
    assert got.data == b'{"a": 1}'
    assert got.etag == etag
    info = bucket.head("snap/a.json")
    assert (info.key, info.size, info.etag) == ("snap/a.json", 8, etag)
    # A prefix is a folder: "snap" does not list "snapshot-other".
    assert [(i.key, i.size) for i in bucket.list("snap")] == [
        ("snap/a.json", 8),
        ("snap/sub/b.bin", 1000),
    ]
    assert {i.key for i in bucket.list()} == {"snap/a.json", "snap/sub/b.bin", "snapshot-other/c"}
    assert bucket.get_range("snap/sub/b.bin", 10, 20) == b"x" * 10

    bucket.delete("snap/a.json")
    bucket.delete("snap/a.json")  # deleting what is gone is fine
    assert not bucket.exists("snap/a.json")
    with pytest.raises(ObjectNotFoundError) as err:
        bucket.get("snap/a.json")
    message = str(err.value)
    assert bucket.url in message and "snap/a.json" in message and "not found" in message


def test_list_of_missing_prefix_is_empty(bucket_url: str) -> None:
    assert open_bucket(bucket_url).list("nothing/here") == []


def test_conditional_get_returns_not_modified(bucket_url: str) -> None:
    bucket = open_bucket(bucket_url)
    etag = bucket.put("ledger.json", b"v1")
    assert etag is not None
    unchanged = bucket.get_if_changed("ledger.json", etag)
    assert unchanged == NotModified("ledger.json", etag)

    new_etag = bucket.put("ledger.json", b"v2")
    changed = bucket.get_if_changed("ledger.json", etag)
    assert isinstance(changed, ObjectData)
    assert changed.data == b"v2"
    assert changed.etag == new_etag != etag


def test_create_only_and_if_match(bucket_url: str) -> None:
    bucket = open_bucket(bucket_url)
    first = bucket.put("doc", b"one", create_only=True)
    with pytest.raises(ObjectExistsError) as err:
        bucket.put("doc", b"two", create_only=True)
    assert isinstance(err.value, PreconditionFailedError)
    assert "doc" in str(err.value) and "already exists" in str(err.value)
    assert bucket.get("doc").data == b"one"

    assert first is not None
    second = bucket.put("doc", b"two", if_match=first)
    assert bucket.get("doc").data == b"two"
    with pytest.raises(PreconditionFailedError):
        bucket.put("doc", b"three", if_match=first)  # stale ETag
    assert bucket.get("doc").data == b"two"
    assert bucket.head("doc").etag == second
    with pytest.raises(PreconditionFailedError):
        bucket.put("missing", b"x", if_match=first)


def test_create_only_race_has_exactly_one_winner(bucket_url: str) -> None:
    bucket = open_bucket(bucket_url)
    barrier = threading.Barrier(6)
    outcomes: list[str] = []

    def contender(i: int) -> None:
        barrier.wait()
        try:
            bucket.put("claim", f"writer {i}".encode(), create_only=True)
            outcomes.append(f"won {i}")
        except ObjectExistsError:
            outcomes.append("lost")

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and len(outcomes) == 6
    assert bucket.get("claim").data == f"writer {winners[0].split()[1]}".encode()


def test_invalid_keys_are_refused(bucket_url: str) -> None:
    bucket = open_bucket(bucket_url)
    for key in ("../escape", "/absolute", "a//b", "a/./b", ""):
        with pytest.raises(BucketError):
            bucket.put(key, b"x")


# --- large files ---------------------------------------------------------------------------------


def test_large_file_multipart_upload_and_parallel_download(
    bucket_url: str, wire: HTTPProxy | None, tmp_path: Path
) -> None:
    part = 1 << 20
    bucket = open_bucket(bucket_url, part_size=part, concurrency=4)
    src = tmp_path / "shard.bin"
    payload = os.urandom(9 * part + 12345)  # not a multiple of the part size
    src.write_bytes(payload)

    sent: list[int] = []
    etag = bucket.upload_file(src, "big/shard.bin", progress=sent.append)
    assert sum(sent) == len(payload)
    assert bucket.head("big/shard.bin").size == len(payload)
    if wire is not None:
        # S3 refuses parts under 5 MiB (but the last), so hotload's parts are never smaller.
        upload_part = max(part, MIN_UPLOAD_PART)
        parts = [payload[i : i + upload_part] for i in range(0, len(payload), upload_part)]
        assert len(parts) == 2
        # S3's multipart ETag is the MD5 of the parts' MD5s plus "-<parts>": it proves the server
        # assembled exactly these parts, which one plain PUT (ETag = MD5 of the bytes) cannot fake.
        digest = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
        assert etag is not None and etag.strip('"') == f"{digest}-{len(parts)}"
        assert bucket.head("big/shard.bin").etag == etag
        calls = wire.recorded()
        part_puts = [r for r in calls if r.method == "PUT" and "partNumber=" in r.query]
        assert sorted(int(r.headers["content-length"]) for r in part_puts) == sorted(
            len(p) for p in parts
        )
        assert [r.method for r in calls if "uploads" in r.query.split("&")[0]] == ["POST"]
        assert not [r for r in calls if r.method == "PUT" and "partNumber=" not in r.query]

        # At the threshold itself a file still goes as one PUT: a plain MD5 ETag, no parts.
        wire.clear()
        edge = tmp_path / "edge.bin"
        edge.write_bytes(payload[:upload_part])
        single = bucket.upload_file(edge, "big/edge.bin")
        assert single is not None
        assert single.strip('"') == hashlib.md5(payload[:upload_part]).hexdigest()
        assert [(r.method, r.query) for r in wire.recorded()] == [("PUT", "")]
        wire.clear()

    got: list[int] = []
    dest = tmp_path / "out" / "shard.bin"
    assert bucket.download_file("big/shard.bin", dest, progress=got.append) == len(payload)
    assert dest.read_bytes() == payload
    assert sum(got) == len(payload)
    if wire is not None:
        gets = [r for r in wire.recorded() if r.method == "GET"]
        # Only ranged reads, one per part, covering every byte exactly once.
        assert all("range" in r.headers for r in gets)
        assert sorted(_range(r) for r in gets) == [
            (start, min(start + part, len(payload)) - 1) for start in range(0, len(payload), part)
        ]
        assert sorted(got) == sorted(end - start + 1 for start, end in map(_range, gets))
        # Each range is pinned to the revision it started with, so a replaced object fails.
        assert {r.headers.get("if-match") for r in gets} == {etag}
        # In parallel, but never more than `concurrency` at once.
        assert 2 <= wire.max_in_flight(gets) <= 4
    assert sorted(p.name for p in dest.parent.iterdir()) == ["shard.bin"]  # no temp files left


def test_local_download_to_another_filesystem(tmp_path: Path) -> None:
    # /dev/shm is a tmpfs: the copy cannot stay inside one filesystem there.
    shm = Path("/dev/shm")
    dest_root = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp_path / "elsewhere"
    try:
        bucket = open_bucket(str(tmp_path / "bucket"))
        payload = os.urandom(20 * 1024 * 1024 + 7)
        bucket.put("s/shard", payload)
        seen: list[int] = []
        assert bucket.download_file("s/shard", dest_root / "shard", progress=seen.append) == len(
            payload
        )
        assert (dest_root / "shard").read_bytes() == payload and sum(seen) == len(payload)
    finally:
        shutil.rmtree(dest_root, ignore_errors=True)


def test_failed_download_leaves_no_file(bucket_url: str, tmp_path: Path) -> None:
    bucket = open_bucket(bucket_url)
    dest = tmp_path / "out" / "missing.bin"
    with pytest.raises(ObjectNotFoundError):
        bucket.download_file("nope/missing.bin", dest)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


# --- snapshots -----------------------------------------------------------------------------------


def test_snapshot_upload_then_download(bucket_url: str, tmp_path: Path) -> None:
    s0, s1 = snapshots.chain(tmp_path / "src", 1)
    bucket = open_bucket(bucket_url)
    assert not snapshot_present(bucket, "s1")
    result = upload_snapshot(s1, bucket, "s1")
    assert not result.already_present
    assert snapshot_present(bucket, "s1")
    files = sorted(p.name for p in s1.iterdir())
    assert [i.key for i in bucket.list("s1")] == [f"s1/{n}" for n in files]

    out = tmp_path / "fetched" / "s1"
    fetched = download_snapshot(bucket, "s1", out)
    assert fetched.files == len(files)
    for name in files:
        assert (out / name).read_bytes() == (s1 / name).read_bytes()

    # Re-running the same upload is a no-op; another snapshot under the same identity is refused.
    assert upload_snapshot(s1, bucket, "s1").already_present
    with pytest.raises(ObjectExistsError, match="immutable"):
        upload_snapshot(s0, bucket, "s1")


def test_lora_adapter_roundtrip(bucket_url: str, tmp_path: Path) -> None:
    adapter = snapshots.lora(tmp_path / "adapter-1", seed=3)
    bucket = open_bucket(bucket_url)
    upload_snapshot(adapter, bucket, "adapter-1")
    assert snapshot_present(bucket, "adapter-1")
    out = tmp_path / "fetched"
    download_snapshot(bucket, "adapter-1", out)
    assert (out / "adapter_config.json").read_bytes() == (
        adapter / "adapter_config.json"
    ).read_bytes()


def test_interrupted_upload_is_never_visible(bucket_url: str, tmp_path: Path) -> None:
    (s0,) = snapshots.chain(tmp_path / "src", 0)
    bucket = open_bucket(bucket_url, retry=FAST_RETRY)
    total = sum(p.stat().st_size for p in s0.iterdir())
    seen = 0

    def crash_halfway(n: int) -> None:
        nonlocal seen
        seen += n
        if seen > total // 3:
            raise SimulatedCrashError("simulated crash mid-upload")

    with pytest.raises(SimulatedCrashError) as err:
        upload_snapshot(s0, bucket, "s0", progress=crash_halfway)
    assert "simulated crash" in str(err.value)
    assert not snapshot_present(bucket, "s0")
    names = {i.key.split("/", 1)[1] for i in bucket.list("s0")}
    assert not names & {"model.safetensors.index.json", "model.weight.spec.json"}
    with pytest.raises(ObjectNotFoundError, match="not present"):
        download_snapshot(bucket, "s0", tmp_path / "dl")

    upload_snapshot(s0, bucket, "s0")  # the retry finishes the job
    assert snapshot_present(bucket, "s0")


# --- errors and retries: permanent failures fail at once, transient ones are retried ------------


def test_missing_objects_fail_at_once(
    bucket_url: str, wire: HTTPProxy | None, tmp_path: Path
) -> None:
    policy = CountingRetry(attempts=4)
    bucket = open_bucket(bucket_url, retry=policy)
    bucket.put("present", b"x")  # the bucket exists: only the key is missing
    key = "gone/shard.bin"
    reads: dict[str, Callable[[], object]] = {
        "GET": lambda: bucket.get(key),
        "conditional GET": lambda: bucket.get_if_changed(key, '"some-etag"'),
        "HEAD": lambda: bucket.head(key),
        "GET range": lambda: bucket.get_range(key, 0, 10),
        "download": lambda: bucket.download_file(key, tmp_path / "dl" / "shard.bin"),
    }
    for what, read in reads.items():
        if wire is not None:
            wire.clear()
        with pytest.raises(ObjectNotFoundError) as err:
            read()
        assert str(err.value).startswith(f"{bucket.url}/{key}: not found: "), what
        assert policy.retries == [], what  # hotload did not retry it
        if wire is not None:  # nor did obstore: one request, answered 404
            assert [r.status for r in wire.recorded()] == [404], what
    assert not bucket.exists(key)
    assert policy.retries == []


def test_failed_conditions_are_not_retried(bucket_url: str, wire: HTTPProxy | None) -> None:
    policy = CountingRetry(attempts=4)
    bucket = open_bucket(bucket_url, retry=policy)
    stale = bucket.put("doc", b"one")
    assert stale is not None
    bucket.put("doc", b"two")
    writes: list[tuple[Callable[[], object], type[BucketError]]] = [
        (lambda: bucket.put("doc", b"three", create_only=True), ObjectExistsError),
        (lambda: bucket.put("doc", b"three", if_match=stale), PreconditionFailedError),
    ]
    for write, error in writes:
        if wire is not None:
            wire.clear()
        with pytest.raises(error) as err:
            write()
        assert str(err.value).startswith(f"{bucket.url}/doc: "), err.value
        assert policy.retries == []
        if wire is not None:
            assert [r.status for r in wire.recorded()] == [412]
    assert bucket.get("doc").data == b"two"


@pytest.mark.parametrize("credentials", ["wrong secret", "unknown access key"])
def test_access_denied_fails_at_once(
    s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch, credentials: str
) -> None:
    # The session's SeaweedFS has an identity (ACCESS_KEY/SECRET_KEY) and checks signatures.
    url = s3_env.url(f"t-{uuid.uuid4().hex[:12]}")
    open_bucket(url).put("some/object", b"x")  # exists, readable with the right credentials
    with HTTPProxy(s3_env.endpoint) as proxy, monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        if credentials == "wrong secret":
            env.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        else:
            env.setenv("AWS_ACCESS_KEY_ID", "nobody-we-know")
        policy = CountingRetry(attempts=4)
        bucket = open_bucket(url, retry=policy)
        calls: dict[str, tuple[str, Callable[[], object]]] = {
            "GET": ("some/object", lambda: bucket.get("some/object")),
            "HEAD": ("some/object", lambda: bucket.head("some/object")),
            "PUT": ("some/object", lambda: bucket.put("some/object", b"y")),
            "LIST": ("some", lambda: bucket.list("some")),
        }
        for what, (key, call) in calls.items():
            proxy.clear()
            with pytest.raises(AccessDeniedError) as err:
                call()
            assert str(err.value).startswith(f"{url}/{key}: access denied: {what}"), err.value
            assert policy.retries == [], what
            assert [r.status for r in proxy.recorded()] == [403], what
    assert open_bucket(url).get("some/object").data == b"x"  # the denied PUT changed nothing


@pytest.mark.parametrize("status", [503, 500, 429, 408])
def test_transient_errors_are_retried(
    s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    url = s3_env.url(f"t-{uuid.uuid4().hex[:12]}")
    with HTTPProxy(s3_env.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        policy = CountingRetry(attempts=3)
        bucket = open_bucket(url, retry=policy)
        bucket.put("doc", b"payload")
        # obstore retries each request a few times itself; failing that many requests in a row
        # fails one whole attempt, so only hotload's own retry can still succeed.
        per_attempt = 1 + policy.obstore_config()["max_retries"]

        def read() -> bytes:
            return bucket.get("doc").data

        def write() -> bytes:
            bucket.put("doc", b"written")
            return bucket.get("doc").data

        calls: dict[str, tuple[Callable[[], bytes], bytes]] = {
            "GET": (read, b"payload"),
            "PUT": (write, b"written"),
        }
        for what, (call, expected) in calls.items():
            proxy.clear()
            policy.retries.clear()
            proxy.fail_next(per_attempt, status)
            assert call() == expected, what
            assert policy.retries == [1], what
            # The failed requests, then the one that got through (for PUT, then the check's GET).
            seen = [(r.method, r.status) for r in proxy.recorded()]
            check = [("GET", 200)] if what == "PUT" else []
            assert seen == [(what, status)] * per_attempt + [(what, 200), *check], what

        # A failure that does not go away: every attempt the policy allows, then "unreachable".
        proxy.clear()
        policy.retries.clear()
        proxy.fail_next(100, status)
        with pytest.raises(BucketUnreachableError) as err:
            bucket.get("doc")
        assert str(err.value).startswith(
            f"{url}/doc: unreachable: GET: gave up after 3 attempt(s): HTTP {status}"
        )
        assert policy.retries == [1, 2]
        assert len(proxy.recorded()) == 3 * per_attempt


# --- S3 specifics --------------------------------------------------------------------------------


def test_missing_bucket_is_not_found(s3_env: SeaweedFS) -> None:
    bucket = open_bucket("s3://no-such-bucket-here/x", retry=FAST_RETRY)
    with pytest.raises(ObjectNotFoundError, match="NoSuchBucket"):
        bucket.get("a")


def test_unreachable_endpoint_retries_then_says_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    bucket = open_bucket("s3://b/p", retry=FAST_RETRY)
    with pytest.raises(BucketUnreachableError) as err:
        bucket.get("ledger.json")
    text = str(err.value)
    assert "s3://b/p/ledger.json" in text and "unreachable" in text and "2 attempt" in text


def test_credentials_from_a_mounted_secret(
    seaweedfs: SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    secret = tmp_path / "secret"
    secret.mkdir()
    # Kubernetes mounts each key as a file, through a hidden ..data symlink farm.
    (secret / "..data").mkdir()
    (secret / "AWS_ACCESS_KEY_ID").write_text(ACCESS_KEY + "\n")
    (secret / "AWS_SECRET_ACCESS_KEY").write_text(SECRET_KEY)
    (secret / "AWS_ENDPOINT_URL").write_text(seaweedfs.endpoint)
    (secret / "aws_region").write_text("us-east-1")

    bucket = open_bucket(seaweedfs.url("secret"), credentials_dir=secret)
    bucket.put("hello", b"from a secret")
    monkeypatch.setenv("HOTLOAD_BUCKET_CREDENTIALS_DIR", str(secret))
    assert open_bucket(seaweedfs.url("secret")).get("hello").data == b"from a secret"

    (secret / "AWS_SECRET_ACCESS_KEY").write_text("rotated-wrong")
    with pytest.raises(AccessDeniedError):
        open_bucket(seaweedfs.url("secret"), retry=FAST_RETRY).get("hello")
    (secret / "AWS_SECRET_ACCESS_KEY").unlink()
    with pytest.raises(MissingCredentialsError, match="AWS_SECRET_ACCESS_KEY is not"):
        open_bucket(seaweedfs.url("secret"))


# --- URLs and configuration (no server) ----------------------------------------------------------


def test_parse_bucket_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = parse_bucket_url("buckets/main")
    assert local.scheme == "file" and local.root == tmp_path / "buckets" / "main"
    assert str(local) == f"file://{tmp_path}/buckets/main"
    assert parse_bucket_url(f"file://{tmp_path}/b").root == tmp_path / "b"
    s3 = parse_bucket_url("s3://rl-weights/policies/llama/")
    assert (s3.scheme, s3.bucket, s3.prefix, str(s3)) == (
        "s3",
        "rl-weights",
        "policies/llama",
        "s3://rl-weights/policies/llama",
    )
    gs = parse_bucket_url("gs://bkt")
    assert (gs.scheme, gs.bucket, gs.prefix) == ("gs", "bkt", "")
    for bad in ("", "http://host/x", "s3://", "s3://b/../x", "file://host/x", "s3://b/p?x=1"):
        with pytest.raises(InvalidBucketURLError):
            parse_bucket_url(bad)


def test_split_ledger_urls() -> None:
    assert split_ledger_url("s3://b/prefix/policy") == ("s3://b/prefix", "policy")
    assert split_ledger_url("s3://b/policy/") == ("s3://b", "policy")
    assert split_ledger_url("./bucket/policy") == ("./bucket", "policy")
    assert split_ledger_url("/data/policy") == ("/data", "policy")
    for bad in ("policy", "s3://policy", "s3://b/"):
        with pytest.raises(InvalidBucketURLError):
            split_ledger_url(bad)


def test_s3_settings_env_and_secret(tmp_path: Path) -> None:
    env = {
        "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_ACCESS_KEY_ID": "env-key",
        "AWS_REGION": "eu-north1",
    }
    settings = load_settings(("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_REGION"), environ=env)
    config, allow_http = s3_config(settings)
    assert config == {"endpoint": "http://minio:9000", "region": "eu-north1"}
    assert allow_http  # an explicit http:// endpoint
    (tmp_path / "AWS_ACCESS_KEY_ID").write_text("file-key")
    (tmp_path / "unrelated").write_text("ignored")
    merged = load_settings(
        ("AWS_ACCESS_KEY_ID", "AWS_REGION"), credentials_dir=tmp_path, environ=env
    )
    assert merged.get("AWS_ACCESS_KEY_ID") == "file-key"  # the Secret wins
    assert merged.get("AWS_REGION") == "eu-north1"
    assert merged.from_files == {"AWS_ACCESS_KEY_ID"}
    https, allow = s3_config(
        load_settings(
            ("AWS_ENDPOINT_URL",),
            environ={"AWS_ENDPOINT_URL": "https://storage.eu-north1.nebius.cloud"},
        )
    )
    assert https["region"] == "us-east-1" and not allow
    with pytest.raises(InvalidBucketURLError, match="does not exist"):
        load_settings(("AWS_REGION",), credentials_dir=tmp_path / "missing", environ={})


def test_gcs_is_configured_without_contacting_google(tmp_path: Path) -> None:
    # No GCS server is available here: only configuration and construction are tested.
    key = tmp_path / "GOOGLE_SERVICE_ACCOUNT_KEY"
    key.write_text('{"type": "service_account"}')
    settings = load_settings(
        ("GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_BASE_URL"),
        credentials_dir=tmp_path,
        environ={"GOOGLE_BASE_URL": "http://fake-gcs:4443"},
    )
    assert gcs_config(settings) == {
        "service_account_key": '{"type": "service_account"}',
        "base_url": "http://fake-gcs:4443",
    }
    opened = open_bucket("gs://my-bucket/policies")
    assert opened.url == "gs://my-bucket/policies" and not opened.is_local


def test_local_bucket_hides_its_lock_and_temp_files(tmp_path: Path) -> None:
    bucket = open_bucket(str(tmp_path / "b"))
    bucket.put("x/doc", b"1", create_only=True)
    assert (tmp_path / "b" / "x" / ".doc.hotload-lock").exists()
    assert [i.key for i in bucket.list()] == ["x/doc"]
