"""LoRA adapters from a mirror (issue 35): a mirrored copy of an adapter that fails verification
is never loaded; it is counted and reported, and the adapter comes from the origin at once (not
after the adapter retry backoff). Real SeaweedFS for the origin and the mirror, a real loader
process with the reference engine."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import publish_folder
from support.fleet import Replica, Trainer, wait_for
from support.regional_cache import write_credentials
from support.seaweedfs import SeaweedFS
from support.tiny_llm import build_tiny_llm, tiny_adapter

WEIGHTS = "adapter_model.safetensors"


def test_a_poisoned_mirrored_adapter_is_rejected_and_loads_from_the_origin_at_once(
    tmp_path: Path, s3_env: SeaweedFS, plain_mirror: SeaweedFS
) -> None:
    tiny = build_tiny_llm(tmp_path / "tiny", 1)
    adapter = tiny_adapter(tmp_path / "lora-0", tiny.config, seed=0)
    url = s3_env.url(f"lora-mirror-{uuid.uuid4().hex[:8]}")
    ledger = Ledger(open_bucket(url), "policy")
    Trainer(ledger, tiny.snapshots, tmp_path / "trainer").publish(0)
    publish_folder(ledger, adapter, identity="lora-0")
    # The mirror holds the adapter with one data byte flipped: its header (and so the ledger's
    # digest over it) agrees, only the tensor's checksum can tell.
    creds = write_credentials(
        tmp_path / "mirror", {**s3_env.env, "AWS_ENDPOINT_URL": plain_mirror.endpoint}
    )
    mirror = open_bucket(url, credentials_dir=creds)
    copied = []
    # The base too: a mirror that lacks an object is skipped for a while, adapters included.
    for info in [*ledger.bucket.list("step-000"), *ledger.bucket.list("lora-0")]:
        data = bytearray(ledger.bucket.get(info.key).data)
        if info.key.endswith(WEIGHTS):
            data[-5] ^= 0x10
        mirror.put(info.key, bytes(data))
        copied.append(info.key)
    assert f"lora-0/{WEIGHTS}" in copied

    env = {**os.environ, **s3_env.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # A failed adapter is retried after 600 s: loading within the wait below means the origin
    # was read right after the rejection, not on a retry.
    args = [
        "--max-adapters",
        "1",
        "--retry-seconds",
        "600",
        "--mirror",
        f"{url},credentials={creds}",
    ]
    replica = Replica("r0", tmp_path / "r0", f"{url}/policy", env, args)
    try:
        replica.start()
        replica.wait_serving("step-000")
        wait_for(
            "lora-0 loaded",
            lambda: (
                [(a["identity"], a["status"]) for a in replica.status()["adapters"]]
                == [("lora-0", "loaded")]
            ),
            90,
        )
        events = replica.status()["events"]
        reasons = [e["reason"] for e in events]
        assert "AdapterLoadFailed" not in reasons, events
        rejected = [e for e in events if e["reason"] == "MirrorCopyRejected"]
        assert rejected and "lora-0" in rejected[0]["message"], events
        counted = [
            line
            for line in replica.metrics().splitlines()
            if line.startswith("hotload_loader_mirror_rejected_total{")
        ]
        assert any(float(line.rsplit(" ", 1)[1]) >= 1 for line in counted), counted
        # What the engine loaded is the origin's adapter, bit for bit.
        loaded = replica.weights / "adapters" / "lora-0"
        assert loaded.is_dir()
        assert (adapter / WEIGHTS).read_bytes() == ledger.bucket.get(f"lora-0/{WEIGHTS}").data
    except BaseException:
        print(replica.logs())
        raise
    finally:
        replica.stop()
