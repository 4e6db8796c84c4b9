"""A compact delta (`sparse_exp` chunks, whose positions follow the parent's exponents) after
deltas is patched in place: the loader rebuilds each such chunk's parent values from the
volume's snapshot through the deltas after it, instead of falling back to a full load.

Real processes (`python -m hotload_sidecar`, `python -m hotload serve`), a real bucket on
SeaweedFS, a tiny Llama whose steps move 1% of its elements; what each step must serve comes
from the trainer's full snapshots (greedy tokens and every tensor's bytes).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from hotload.arc.container import read_header
from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.snapshot import Snapshot
from support.fleet import PROMPT_IDS, Replica, Trainer, http_json, tokens
from support.metrics import metric
from support.seaweedfs import SeaweedFS
from support.tiny_llm import adam_steps, build_tiny_llm
from support.vllm_server import greedy_token_ids


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A tiny Llama in bf16 and four Adam-like steps."""
    root = tmp_path_factory.mktemp("compact")
    base = build_tiny_llm(root / "m", 0, cast="BF16").snapshots[0]
    return adam_steps(base, root / "a", 4, seed=4)


def _encodings(delta: Path) -> set[str]:
    return {
        c["encoding"]
        for shard in Snapshot(delta).shipped_shards
        for t in read_header(delta / shard).fields["tensors"]
        for c in t["chunks"]
    }


def test_compact_deltas_after_a_delta_are_patched_not_reloaded(
    steps: list[Path],
    tmp_path: Path,
    s3_env: SeaweedFS,
    env: dict[str, str],
    replicas: list[Replica],
) -> None:
    env = {**env, **s3_env.env}
    url = s3_env.url(f"compact-{uuid.uuid4().hex[:8]}")
    trainer = Trainer(Ledger(open_bucket(url), "policy"), steps, tmp_path / "t", full_every=100)
    trainer.publish(0)
    r = Replica("r0", tmp_path / "r0", f"{url}/policy", env)
    replicas.append(r)
    r.start()
    r.wait_serving("step-000", timeout=180)
    trainer.publish(1)  # a plain delta: the engine then serves step-000 plus it
    assert r.wait_serving("step-001")["last_load"]["method"] == "sparse"
    for k in (2, 3, 4):
        delta = trainer.publish(k, compact=True)
        assert "sparse_exp" in _encodings(delta), k
        status = r.wait_serving(Trainer.identity(k))
        assert status["last_load"]["method"] == "sparse", status
        assert tokens(r) == (
            f"tiny@{Trainer.identity(k)}",
            greedy_token_ids(steps[k], PROMPT_IDS, 8),
        )
    metrics = r.metrics()
    assert metric(metrics, 'hotload_loader_loads_total{method="sparse"}') == 4
    assert metric(metrics, 'hotload_loader_loads_total{method="full"}') == 0  # no fallback
    # Bit for bit: the patched engine's parameters against an engine that loaded step-004 whole.
    fresh = Replica("r1", tmp_path / "r1", f"{url}/policy", env)
    replicas.append(fresh)
    fresh.start()
    fresh.wait_serving("step-004", timeout=180)  # built from step-000 through the four deltas
    assert _checksums(r) == _checksums(fresh)


def _checksums(r: Replica) -> dict[str, str]:
    code, body = http_json("GET", r.full_api_url + "/hotload/v1/checksums")
    assert code == 200, body
    return dict(body["checksums"])
