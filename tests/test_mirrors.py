"""Snapshot bytes from mirrors (issue 35): real SeaweedFS for the origin, a plain mirror and a
regional read-through cache, every request counted at the doors (`support.counting_proxy`).

The origin is the session's SeaweedFS behind a counting proxy; a second SeaweedFS is a plain
mirror (objects copied into it, some poisoned or left out); a third is a regional cache that
remote-mounts the origin through its door. The loader's fetch path (`Materializer` over a
`MirroredBucket`, the bucket `app.build_loader` opens) and its polls (`Loader.step`) run
unchanged on top.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.numpy import load_file as load

from hotload.bucket import Bucket, MirroredBucket, open_bucket, open_mirrored
from hotload.ledger import Ledger
from hotload.ledger.hints import Hint, write_hint_async
from hotload.ledger.pins import Pin, pin_key, write_pin_async
from hotload_sidecar.config import Settings
from hotload_sidecar.engines import make_adapter
from hotload_sidecar.loader import Loader
from hotload_sidecar.materialize import BuildResult, Materializer
from hotload_sidecar.metrics import LoaderMetrics, SourceTally
from hotload_sidecar.status import LoadTimings, LocalReporter, ReplicaStatus
from hotload_sidecar.weights import WeightsFolder
from support.counting_proxy import CountingProxy
from support.fleet import Replica, Trainer, free_port
from support.regional_cache import RegionalCache, write_credentials
from support.seaweedfs import BUCKET, SeaweedFS
from support.snapshots import full, nudged, weights
from support.tiny_llm import build_tiny_llm


@pytest.fixture(scope="module")
def origin_door(seaweedfs: SeaweedFS) -> Iterator[CountingProxy]:
    """The counting proxy in front of the origin (the session's SeaweedFS)."""
    with CountingProxy(seaweedfs.endpoint) as door:
        yield door


@pytest.fixture(scope="module")
def mirror_door(plain_mirror: SeaweedFS) -> Iterator[CountingProxy]:
    """The counting proxy in front of the plain mirror."""
    with CountingProxy(plain_mirror.endpoint) as door:
        yield door


@pytest.fixture(scope="module")
def region(
    tmp_path_factory: pytest.TempPathFactory, origin_door: CountingProxy
) -> Iterator[RegionalCache]:
    """A regional cache reading through to the origin by way of its counting door."""
    cache = RegionalCache.start(tmp_path_factory.mktemp("region") / "data", origin_door.endpoint)
    try:
        yield cache
    finally:
        cache.stop()


@pytest.fixture
def origin_env(
    s3_env: SeaweedFS, origin_door: CountingProxy, monkeypatch: pytest.MonkeyPatch
) -> CountingProxy:
    """The AWS_* environment (the origin's settings) points at the origin's door."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", origin_door.endpoint)
    return origin_door


@pytest.fixture
def process_env(
    env: dict[str, str], plain_mirror: SeaweedFS, origin_env: CountingProxy
) -> dict[str, str]:
    """A loader process's environment: the origin's settings, its endpoint the origin's door."""
    return {**env, **plain_mirror.env, "AWS_ENDPOINT_URL": origin_env.endpoint}


def _trainer(root: Path, prefix: str, steps: int = 2, published: int = 2) -> Trainer:
    base, fulls = weights(0), []
    current = base
    for i in range(steps):
        current = nudged(current, i) if i else current
        fulls.append(full(root / "fulls" / f"f{i}", current))
    ledger = Ledger(open_bucket(f"s3://{BUCKET}/{prefix}"), "policy")
    trainer = Trainer(ledger, fulls, root / "trainer", full_every=4)
    for step in range(published):
        trainer.publish(step)
    return trainer


def _copy_snapshots(src: Bucket, dst: Bucket, identities: list[str]) -> list[str]:
    keys = []
    for identity in identities:
        for info in src.list(identity):
            dst.put(info.key, src.get(info.key).data)
            keys.append(info.key)
    return keys


def _mirror_creds(server: SeaweedFS, door: CountingProxy, tmp: Path, name: str) -> Path:
    return write_credentials(tmp / name, {**server.env, "AWS_ENDPOINT_URL": door.endpoint})


@dataclass
class _Mirrored:
    """Two steps published at the origin under a fresh prefix, copied to the plain mirror."""

    prefix: str
    url: str
    trainer: Trainer
    creds: Path
    mirror: Bucket
    keys: list[str]


def _published_and_mirrored(
    tmp_path: Path, server: SeaweedFS, door: CountingProxy, steps: int = 2
) -> _Mirrored:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    trainer = _trainer(tmp_path, prefix, steps=steps)
    url = f"s3://{BUCKET}/{prefix}"
    creds = _mirror_creds(server, door, tmp_path, "mirror")
    mirror = open_bucket(url, credentials_dir=creds)
    keys = _copy_snapshots(trainer.ledger.bucket, mirror, ["step-000", "step-001"])
    return _Mirrored(prefix, url, trainer, creds, mirror, keys)


def _label(door: CountingProxy) -> str:
    return f"127.0.0.1:{door.port}/{BUCKET}"


def _tensors(path: Path) -> dict[str, bytes]:
    """Every tensor's bytes in a snapshot folder, by name."""
    return {k: v.tobytes() for f in sorted(path.glob("*.safetensors")) for k, v in load(f).items()}


def _build(bucket: MirroredBucket, trainer: Trainer, weights_dir: Path) -> BuildResult:
    folder = WeightsFolder(weights_dir)
    folder.prepare()
    doc = trainer.ledger.read().document
    return asyncio.run(Materializer(bucket, folder, threads=1).build(doc))


def test_a_poisoned_mirror_object_is_never_served_and_the_update_completes_from_the_origin(
    origin_env: CountingProxy,
    plain_mirror: SeaweedFS,
    mirror_door: CountingProxy,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = _published_and_mirrored(tmp_path, plain_mirror, mirror_door)
    prefix, trainer, creds, mirror, keys = m.prefix, m.trainer, m.creds, m.mirror, m.keys
    # One shard of the full snapshot flipped at the mirror: same size, wrong bytes.
    poisoned = next(k for k in keys if k.startswith("step-000/") and k.endswith(".safetensors"))
    data = bytearray(mirror.get(poisoned).data)
    data[-3] ^= 0xFF
    mirror.put(poisoned, bytes(data))
    origin_env.reset()

    bucket = open_mirrored(open_bucket(m.url), [(m.url, str(creds))])
    with caplog.at_level(logging.WARNING):
        built = _build(bucket, trainer, tmp_path / "w")

    # The update completed, with the origin's bytes: exactly the published weights.
    assert built.identity == "step-001"
    assert _tensors(built.path) == _tensors(trainer.fulls[1])
    assert _tensors(tmp_path / "w" / "snapshots" / "step-000") == _tensors(trainer.fulls[0])
    # The poisoned object was read again from the origin, and counted against its mirror.
    assert origin_env.requests(method="GET", key_prefix=f"{prefix}/{poisoned}") >= 1
    label = _label(mirror_door)
    assert bucket.stats.sources[label].rejected >= 1
    assert bucket.stats.totals()["mirrorRejected"] >= 1
    assert built.mirror_rejected and label in built.mirror_rejected[0]
    assert any("failed verification" in r.getMessage() for r in caplog.records)
    # The delta still came from the mirror: only the bad snapshot went back to the origin.
    assert mirror_door.requests(method="GET", key_prefix=f"{prefix}/step-001/") >= 1
    assert origin_env.requests(method="GET", key_prefix=f"{prefix}/step-001/") == 0


def test_a_mirror_that_is_down_or_lacks_an_object_costs_no_update(
    origin_env: CountingProxy,
    plain_mirror: SeaweedFS,
    mirror_door: CountingProxy,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = _published_and_mirrored(tmp_path, plain_mirror, mirror_door)
    prefix, url, trainer, creds, keys = m.prefix, m.url, m.trainer, m.creds, m.keys
    lacking = next(k for k in keys if k.startswith("step-001/"))
    m.mirror.delete(lacking)
    # First in line, a mirror nobody listens on: it is down.
    nobody = f"http://127.0.0.1:{free_port()}"
    down = write_credentials(tmp_path / "down", {**plain_mirror.env, "AWS_ENDPOINT_URL": nobody})
    origin_env.reset()
    mirror_door.reset()

    bucket = open_mirrored(open_bucket(url), [(url, str(down)), (url, str(creds))])
    with caplog.at_level(logging.WARNING):
        built = _build(bucket, trainer, tmp_path / "w")

    assert built.identity == "step-001"
    assert _tensors(built.path) == _tensors(trainer.fulls[1])
    # The missing object came from the origin, the others from the mirror (or, while the
    # mirror was backed off after its miss, the origin): each read once, none twice.
    from_origin = [k for k in origin_env.keys(method="GET") if k.startswith(f"{prefix}/step-")]
    from_mirror = [
        s.key for s in mirror_door.served() if s.method == "GET" and s.status in (200, 206)
    ]
    assert f"{prefix}/{lacking}" in from_origin
    assert sorted(from_origin + from_mirror) == sorted(f"{prefix}/{k}" for k in keys)
    assert from_mirror, "the mirror served nothing"
    # The down mirror was warned about once and then skipped (backed off), not asked per file.
    down_label = next(iter(bucket.stats.sources.keys() - {"origin", _label(mirror_door)}))
    assert bucket.stats.sources[down_label].requests < len(keys)
    warnings = [r.getMessage() for r in caplog.records if r.name == "hotload.bucket.mirrors"]
    assert sum(down_label in w for w in warnings) == 1
    totals = bucket.stats.totals()
    assert totals["bytesFromMirrors"] > 0 and totals["bytesFromOrigin"] > 0
    assert totals["mirrorRejected"] == 0


def test_the_ledger_pins_and_hints_never_come_from_a_mirror(
    origin_env: CountingProxy,
    plain_mirror: SeaweedFS,
    mirror_door: CountingProxy,
    tmp_path: Path,
) -> None:
    m = _published_and_mirrored(tmp_path, plain_mirror, mirror_door, steps=3)
    prefix, url, trainer, creds, mirror = m.prefix, m.url, m.trainer, m.creds, m.mirror
    origin = trainer.ledger.bucket
    pin = pin_key("ns", "policy", "uid-1")
    asyncio.run(write_pin_async(origin, pin, Pin("step-001")))
    asyncio.run(write_hint_async(origin, "policy", Hint("step-002", previous="step-001")))
    # The mirror holds stale copies of every mutable object: a stale ledger, another pin.
    for key in (".hotload/ledgers/policy.json", ".hotload/hints/policy/step-002.json"):
        mirror.put(key, origin.get(key).data)
    asyncio.run(write_pin_async(mirror, pin, Pin("step-000")))
    mirror_door.reset()

    bucket = open_mirrored(open_bucket(url), [(url, str(creds))])
    settings = Settings(
        ledger_url=f"{url}/policy",
        weights_dir=tmp_path / "weights",
        engine_url=f"http://127.0.0.1:{free_port()}",  # the engine is down: polls only
        pin_object=pin,
    )
    loader = Loader(
        settings,
        ledger=Ledger(bucket, "policy"),
        adapter=make_adapter("reference", settings.engine_url),
        reporter=LocalReporter(),
    )
    loader.weights.prepare()
    trainer.publish(2)  # the origin moves on; the mirror's ledger copy says step-001

    async def poll_twice() -> None:
        try:
            await loader.step()
            await loader.step()
        finally:
            await loader.adapter.aclose()

    asyncio.run(poll_twice())
    assert loader.document is not None and loader.document.head is not None
    assert loader.document.head.identity == "step-002"
    assert loader.pin == "step-001"
    built = _build(bucket, trainer, tmp_path / "w2")
    assert built.identity == "step-002"
    # The loader's /metrics count both sources (the origin's include the ledger and pin polls).
    scraped = loader.metrics.render().decode()
    mirror_bytes = bucket.stats.sources[_label(mirror_door)].bytes
    assert mirror_bytes > 0
    assert (
        f'hotload_loader_source_bytes_total{{source="{_label(mirror_door)}"}} {float(mirror_bytes)}'
        in scraped
    )
    assert 'hotload_loader_source_requests_total{source="origin"}' in scraped

    seen = mirror_door.served()
    assert seen, "the mirror served nothing: the test did not exercise it"
    assert {s.key.split("/", 1)[1].split("/", 1)[0] for s in seen} <= {
        "step-000",
        "step-001",
        "step-002",
    }
    assert all(not s.key.startswith(f"{prefix}/.hotload") for s in seen)
    assert all(s.method in ("GET", "HEAD") and s.query == "" for s in seen)  # never a listing


def test_replicas_missing_the_same_object_at_once_cost_the_origin_about_one_read(
    origin_env: CountingProxy, region: RegionalCache, tmp_path: Path
) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    trainer = _trainer(tmp_path, prefix)
    url = f"s3://{BUCKET}/{prefix}"
    published = {
        i.key: i.size for s in ("step-000", "step-001") for i in trainer.ledger.bucket.list(s)
    }
    creds = region.credentials_dir(tmp_path / "region")
    replicas = [
        open_mirrored(open_bucket(url), [(region.url(prefix), str(creds))]) for _ in range(4)
    ]
    document = trainer.ledger.read().document
    tally = SourceTally(replicas[0], LoaderMetrics())
    origin_env.reset()

    async def fleet() -> list[str]:
        builds = []
        for i, bucket in enumerate(replicas):
            folder = WeightsFolder(tmp_path / f"w{i}")
            folder.prepare()
            builds.append(Materializer(bucket, folder, threads=1).build(document))
        return [b.identity for b in await asyncio.gather(*builds)]

    assert asyncio.run(fleet()) == ["step-001"] * 4
    # Every replica read every snapshot file from the regional cache...
    for bucket in replicas:
        totals = bucket.stats.totals()
        assert totals["bytesFromMirrors"] == sum(published.values())
        assert totals["bytesFromOrigin"] == 0
    # The loader's lastLoad report says the same (the listings were the origin's requests).
    last = ReplicaStatus(last_load=tally.stamp(LoadTimings())).to_annotation()["lastLoad"]
    assert last["bytesFromMirrors"] == sum(published.values())
    assert last["bytesFromOrigin"] == 0 and last["mirrorRejected"] == 0
    assert last["requestsToMirrors"] >= len(published) and last["requestsToOrigin"] == 2
    # ...and the origin served each of them about once (the cache's fills), not four times.
    served = origin_env.bytes_served(method="GET", key_prefix=f"{prefix}/step-")
    assert served <= 1.1 * sum(published.values()), (served, sum(published.values()))
    assert served >= sum(published.values())


def test_a_loader_process_reads_from_its_mirror_rejects_a_bad_copy_and_reports_it(
    process_env: dict[str, str],
    origin_door: CountingProxy,
    mirror_door: CountingProxy,
    tmp_path: Path,
    replicas: list[Replica],
) -> None:
    """`python -m hotload_sidecar --mirror URL,credentials=DIR` with a reference engine: the
    first snapshot comes from the mirror; the next one's payload is poisoned there, so that
    update is read again from the origin, and /status, its Events and /metrics say so."""
    tiny = build_tiny_llm(tmp_path / "tiny", 1, noise=0.01)
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{BUCKET}/{prefix}"
    trainer = Trainer(Ledger(open_bucket(url), "policy"), tiny.snapshots, tmp_path / "trainer")
    trainer.publish(0)
    # The test servers share their keys: the mirror's credentials differ in the endpoint.
    signing = {k: v for k, v in process_env.items() if k.startswith("AWS_")}
    creds = write_credentials(
        tmp_path / "mirror", {**signing, "AWS_ENDPOINT_URL": mirror_door.endpoint}
    )
    mirror = open_bucket(url, credentials_dir=creds)
    _copy_snapshots(trainer.ledger.bucket, mirror, ["step-000"])
    replica = Replica(
        "r0",
        tmp_path / "r0",
        f"{url}/policy",
        process_env,
        ["--mirror", f"{url},credentials={creds}", "--sparse-max-changed", "0"],
    )
    replicas.append(replica)
    replica.start(timeout=180)
    replica.wait_serving("step-000", timeout=180)

    replica.pause_loader()  # the mirror gets step-001 (poisoned) before the loader sees it
    trainer.publish(1)
    keys = _copy_snapshots(trainer.ledger.bucket, mirror, ["step-001"])
    payload = max(keys, key=lambda k: mirror.head(k).size)
    data = bytearray(mirror.get(payload).data)
    data[len(data) // 2] ^= 0xFF
    mirror.put(payload, bytes(data))
    mirror_door.reset()
    origin_door.reset()
    replica.resume_loader()
    served = replica.wait_serving("step-001", timeout=180)

    sources = served["last_load"]["sources"]
    assert sources["mirrorRejected"] >= 1
    assert sources["bytesFromMirrors"] > 0  # the copies, good and bad
    # The snapshot came again from the origin: at least the poisoned payload's bytes.
    assert sources["bytesFromOrigin"] >= len(data)
    assert origin_door.requests(method="GET", key_prefix=f"{prefix}/{payload}") >= 1
    events = [e for e in served["events"] if e["reason"] == "MirrorCopyRejected"]
    assert events and "step-001" in events[0]["message"], served["events"]
    label = _label(mirror_door)
    scraped = replica.metrics()
    assert f'hotload_loader_mirror_rejected_total{{source="{label}"}}' in scraped
    assert f'hotload_loader_mirror_rejected_total{{source="{label}"}} 0.0' not in scraped
    # The mirror was asked for snapshot files only: never the ledger, the pin or a listing.
    seen = mirror_door.served()
    assert seen and all(s.key.startswith(f"{prefix}/step-") and not s.query for s in seen)


def test_what_a_loader_remembers_of_its_mirrors_is_bounded() -> None:
    """Provenance and rejections are kept for the newest TRACKED_SNAPSHOTS snapshots only (a
    loader following a ledger for 10,000 steps must not keep every file it ever read), and a
    rejection of some files and then of the whole snapshot widens, never narrows."""
    from hotload.bucket.mirrors import TRACKED_SNAPSHOTS, _Provenance

    seen = _Provenance()
    steps = TRACKED_SNAPSHOTS + 10
    for step in range(steps):
        seen.served(f"step-{step}/model.safetensors", "cache")
        seen.origin_only(f"step-{step}", {f"step-{step}/model.safetensors"})
    assert seen.mirrored("step-0") == {}
    assert not seen.is_origin_only("step-0/model.safetensors")
    newest = f"step-{steps - 1}"
    assert seen.mirrored(newest) == {f"{newest}/model.safetensors": "cache"}
    assert seen.is_origin_only(f"{newest}/model.safetensors")
    assert not seen.is_origin_only(f"{newest}/config.json")
    seen.origin_only(newest, None)
    seen.origin_only(newest, {f"{newest}/other.safetensors"})
    assert seen.is_origin_only(f"{newest}/config.json")
    seen.cleared(f"{newest}/model.safetensors")
    assert seen.mirrored(newest) == {}
