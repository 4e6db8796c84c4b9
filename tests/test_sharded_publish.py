"""A model sharded with FSDP2 over 2 processes (gloo, CPU) publishes through `ShardedPublisher`.

Real parts: two spawned processes, a gloo process group, `fully_shard`, AdamW steps, a bucket
(local folder and SeaweedFS), the ledger and the sidecar's `Materializer` rebuilding the chain.
The only thing that gathers the whole model is the test itself (rank 0 saves the unsharded state
dict to compare against), outside of `publish`.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException, spawn

from hotload.arc.container import MAGIC
from hotload.bucket import open_bucket
from hotload.ledger import Ledger
from hotload.sdk import sharded
from hotload.sdk.sharded import plan_shards
from hotload.snapshot import Snapshot, layout, write_snapshot
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.weights import WeightsFolder

WORLD = 2
LAYERS = 4
HIDDEN = 32
VOCAB = 64
STEPS = 3  # published: step 0 (full), steps 1 and 2 (deltas)
FROZEN = 2  # a layer no step trains: its shard is left out of every delta
CONFIG = {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS}
TOKENIZER_CONFIG = '{"chat_template": "{{ messages }}"}'
TOKENIZER_CONFIG_NEW = '{"chat_template": "{{ messages }} v2"}'


class Block(nn.Module):
    """One decoder-like layer."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
        # An odd first dimension: the two ranks hold 3 and 2 rows (uneven sharding).
        self.odd = nn.Parameter(torch.randn(5, HIDDEN))
        self.down_proj = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q_proj(self.input_layernorm(x)) + self.odd.sum(0) * 0.01
        out: torch.Tensor = x + self.down_proj(torch.relu(self.up_proj(h)))
        return out


class Inner(nn.Module):
    """Embedding, layers, final norm: `model.layers.N....` names make shards layer-pure."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)


class Llama(nn.Module):
    """A small Llama-shaped causal LM."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        out: torch.Tensor = self.lm_head(self.model.norm(x))
        return out


def _sharded_model(frozen: int | None = None) -> Llama:
    """The same initial weights on every rank, layer `frozen` left untrained, then FSDP2 over
    the default group."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Llama()
    if frozen is not None:
        model.model.layers[frozen].requires_grad_(False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


@contextlib.contextmanager
def _group(rank: int, out: str) -> Iterator[None]:
    """This rank in a gloo group of `WORLD` (rendezvous in `out`); a crash of the process dumps
    its Python stack into `out/rank-N.err`, which `_spawn` shows. Every rank waits for the others
    before the group is torn down, so none exits while a peer still talks to it. A rank whose
    work and teardown succeeded leaves at once (`os._exit(0)`, its results already on disk),
    skipping the interpreter's finalization: on a loaded machine a rank once died there with
    SIGABRT and no Python frame ("terminate called without an active exception"), the sign of
    gloo's worker threads meeting that finalization (pytorch/pytorch#179291), which is torch's
    teardown, not what these tests check."""
    import torch.distributed as dist

    err = open(f"{out}/rank-{rank}.err", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(file=err, all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=WORLD
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    faulthandler.disable()
    err.close()
    os._exit(0)


def _spawn(fn: Callable[..., None], out: Path, *args: Any) -> None:
    """Run `fn(rank, *args)` on `WORLD` processes; a rank that dies fails the test with what
    each rank's crash log holds."""
    try:
        spawn(fn, args=args, nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]
    except ProcessExitedException as exc:
        logs = {p.name: p.read_text()[-4000:] for p in sorted(out.glob("rank-*.err"))}
        pytest.fail(f"{exc}\n" + "\n".join(f"--- {n}\n{t}" for n, t in logs.items()))


def _rank(rank: int, bucket_url: str, out: str, env: dict[str, str]) -> None:
    """One trainer rank: FSDP2-shard the model, train, publish every step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    os.environ.update(env)
    with _group(rank, out):
        model = _sharded_model(FROZEN)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pub = sharded.ShardedPublisher(
            bucket_url,
            ledger="policy",
            config=CONFIG,
            side_files_from=f"{out}/tokenizer",
            workdir=f"{out}/work",
            threads=1,
        )
        gen = torch.Generator().manual_seed(rank)
        for step in range(STEPS):
            if step == STEPS - 1 and rank == 0:  # the last step changes the chat template
                Path(f"{out}/tokenizer/tokenizer_config.json").write_text(TOKENIZER_CONFIG_NEW)
            if step:
                tokens = torch.randint(0, VOCAB, (4, 8), generator=gen)
                loss = torch.nn.functional.cross_entropy(
                    model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
                )
                loss.backward()  # type: ignore[no-untyped-call]
                optim.step()
                optim.zero_grad()
            handle = pub.publish(model, step=step)
            report = pub.last_report
            Path(f"{out}/report-{rank}-{step}.json").write_text(
                json.dumps(
                    {
                        "kind": handle.kind,
                        "previous": handle.previous,
                        "shards": report.shards,
                        "untouched": report.untouched,
                        "peak": report.peak_gathered_bytes,
                        "gathered": report.gathered_bytes,
                    }
                )
            )
            # TEST ONLY: the unsharded weights to compare the replica's rebuild with. This
            # gathers the whole model (which `publish` never does), after publishing.
            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if rank == 0:
                torch.save(full, f"{out}/expected-{step}.pt")
            del full
        pub.close()


def _tensors(path: Path) -> dict[str, Any]:
    snap = Snapshot(path)
    out: dict[str, Any] = {}
    for shard in snap.shard_files:
        with snap.open_shard(shard) as f:
            for name, info in f.tensors.items():
                out[name] = (info.dtype, tuple(info.shape), bytes(f.raw(name)))
    return out


def _as_stored(state: dict[str, Any]) -> dict[str, Any]:
    return {
        name: ("F32", tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
        for name, t in state.items()
    }


@pytest.mark.slow
def test_fsdp_ranks_publish_their_layers_and_a_replica_rebuilds_the_unsharded_model(
    bucket_url: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    vocab = json.dumps({"model": {"vocab": {f"t{i}": i for i in range(VOCAB)}}})
    (tokenizer / "tokenizer.json").write_text(vocab)
    (tokenizer / "tokenizer_config.json").write_text(TOKENIZER_CONFIG)
    _spawn(_rank, tmp_path, bucket_url, str(tmp_path), env)

    ledger = Ledger(open_bucket(bucket_url), "policy")
    document = ledger.read().document
    entries = [(e.identity, e.kind, e.previous) for e in document.entries]
    assert entries == [
        ("step-00000000", "full", None),
        ("step-00000001", "incremental", "step-00000000"),
        ("step-00000002", "incremental", "step-00000001"),
    ]

    expected = [torch.load(tmp_path / f"expected-{s}.pt") for s in range(STEPS)]
    plan = plan_shards(
        [(n, tuple(t.shape), "F32") for n, t in expected[0].items()], world_size=WORLD
    )
    # One shard for the embedding, one per layer, one for the final norm and the head.
    assert len(plan.shards) == LAYERS + 2
    layer_bytes = max(s.nbytes for s in plan.shards if s.tensors[0].startswith("model.layers."))
    total_bytes = plan.total_bytes
    (frozen,) = [s for s in plan.shards if s.tensors[0].startswith(f"model.layers.{FROZEN}.")]
    # The frozen layer's weights are those of step 0 at every step; every other shard changed.
    for name in frozen.tensors:
        assert all(torch.equal(expected[s][name], expected[0][name]) for s in range(STEPS))
    changed = [n for n in expected[0] if n not in frozen.tensors]
    assert all(not torch.equal(expected[1][n], expected[0][n]) for n in changed)
    for step in range(STEPS):
        reports = [
            json.loads((tmp_path / f"report-{r}-{step}.json").read_text()) for r in range(WORLD)
        ]
        assert {r["kind"] for r in reports} == {"full" if step == 0 else "incremental"}
        # Each rank wrote and uploaded exactly the shards the plan gives it, but for a delta
        # the frozen layer's, which its owner records as untouched; both worked.
        for rank, report in enumerate(reports):
            owned = sorted(s.name for s in plan.owned_by(rank))
            left = [frozen.name] if step and frozen.owner == rank else []
            assert report["untouched"] == left
            assert report["shards"] == [n for n in owned if n not in left]
            assert report["shards"]
            # Nobody held the whole model: at most one layer's full tensors at a time.
            assert 0 < report["peak"] <= layer_bytes < total_bytes
        assert sum(r["gathered"] for r in reports) == total_bytes

    # Every shard of every step is in the bucket: full safetensors at step 0, arc_v2 after,
    # but for the frozen layer's, which no delta ships.
    bucket = open_bucket(bucket_url)
    for step in range(STEPS):
        for shard in plan.shards:
            key = f"step-0000000{step}/{shard.name}"
            if step and shard is frozen:
                assert not bucket.exists(key)
                continue
            head = bucket.get_range(key, 0, len(MAGIC))
            assert (head == MAGIC) is (step > 0), (step, shard.name)

    # The committed layout is the single-process writer's, byte for byte: the same manifests
    # (so the same ledger digest) and, for the full step, the same shard files.
    original = tmp_path / "tokenizer-0"
    original.mkdir()
    (original / "tokenizer.json").write_text(vocab)
    (original / "tokenizer_config.json").write_text(TOKENIZER_CONFIG)
    single = write_snapshot(
        tmp_path / "single", expected[0], config=CONFIG, side_files_from=original
    ).path
    for name in sorted(p.name for p in single.iterdir()):
        assert bucket.get(f"step-00000000/{name}").data == (single / name).read_bytes(), name

    # The deltas ship config.json and what changed of the tokenizer; what did not change is
    # recorded as inherited (docs/arc_v2.md §2.2), with the sha256 of the file it stands for.
    def sha(text: str) -> str:
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    def record(step: int) -> dict[str, Any]:
        got: dict[str, Any] = json.loads(
            bucket.get(f"step-0000000{step}/{layout.INHERITED_FILE}").data
        )
        return got

    def inherited(step: int) -> dict[str, str]:
        return dict(record(step)["from_parent"])

    # The frozen layer's shard is recorded with the sha256 of its header as stored at step 0
    # (8-byte length, then the JSON): the same file at every step, so the same digest.
    stored = bucket.get(f"step-00000000/{frozen.name}").data
    header = stored[: 8 + int.from_bytes(stored[:8], "little")]
    digest = "sha256:" + hashlib.sha256(header).hexdigest()
    assert record(1)["untouched_shards"] == record(2)["untouched_shards"] == {frozen.name: digest}

    def shipped(step: int, name: str) -> bool:
        return bool(bucket.exists(f"step-0000000{step}/{name}"))

    assert inherited(1) == {
        "tokenizer.json": sha(vocab),
        "tokenizer_config.json": sha(TOKENIZER_CONFIG),
    }
    assert not shipped(1, "tokenizer.json") and not shipped(1, "tokenizer_config.json")
    assert inherited(2) == {"tokenizer.json": sha(vocab)}
    assert bucket.get("step-00000002/tokenizer_config.json").data == TOKENIZER_CONFIG_NEW.encode()
    assert all(shipped(s, "config.json") for s in range(STEPS))
    # The entry's full size still counts the files a full snapshot would hold.
    assert document.entries[1].full_bytes == document.entries[0].full_bytes
    assert document.entries[1].shipped_bytes < document.entries[0].shipped_bytes

    # A replica rebuilds step 1 and then step 2 from the ledger: bit for bit the unsharded model.
    weights = WeightsFolder(tmp_path / "replica")
    weights.prepare()
    materializer = Materializer(bucket, weights, threads=1)
    built = asyncio.run(materializer.build(document, "step-00000001"))
    assert built.applied == ["step-00000000", "step-00000001"]
    assert _tensors(built.path) == _as_stored(expected[1])
    built = asyncio.run(materializer.build(document))
    assert built.identity == "step-00000002" and built.applied == ["step-00000002"]
    assert _tensors(built.path) == _as_stored(expected[2])
    assert _tensors(built.path) != _as_stored(expected[0])  # the training steps changed it
    assert (built.path / "tokenizer.json").read_text() == vocab
    assert (built.path / "tokenizer_config.json").read_text() == TOKENIZER_CONFIG_NEW


def _failing_rank(rank: int, bucket_url: str, out: str) -> None:
    """Rank 1's disk fails while writing its first shard; then both ranks publish again."""
    with _group(rank, out):
        model = _sharded_model()
        pub = sharded.ShardedPublisher(
            bucket_url, ledger="policy", config=CONFIG, workdir=f"{out}/work", threads=1
        )
        real_write = sharded.write_shard_file  # type: ignore[attr-defined]

        def full_disk(path: Any, tensors: Any) -> int:
            raise OSError(28, "No space left on device")

        if rank == 1:  # fault injection: this rank alone cannot write
            sharded.write_shard_file = full_disk  # type: ignore[attr-defined]
        try:
            pub.publish(model, step=5)
        except sharded.ShardedPublishError as exc:
            Path(f"{out}/error-{rank}.txt").write_text(str(exc))
        sharded.write_shard_file = real_write  # type: ignore[attr-defined]
        kinds = [pub.publish(model, step=s).kind for s in (5, 6)]
        Path(f"{out}/kinds-{rank}.json").write_text(json.dumps(kinds))
        pub.close()


@pytest.mark.slow
def test_a_failing_rank_stops_the_commit_on_every_rank_and_the_retry_publishes(
    tmp_path: Path,
) -> None:
    bucket_url = str(tmp_path / "bucket")
    _spawn(_failing_rank, tmp_path, bucket_url, str(tmp_path))
    # Both ranks raised the same error, naming the rank and its cause; neither hung.
    errors = {(tmp_path / f"error-{r}.txt").read_text() for r in range(WORLD)}
    assert len(errors) == 1
    (error,) = errors
    assert "nothing was committed" in error and "rank 1: OSError" in error
    assert "No space left on device" in error
    # The failed attempt committed nothing; the retry of the same step did, then a delta.
    for r in range(WORLD):
        assert json.loads((tmp_path / f"kinds-{r}.json").read_text()) == ["full", "incremental"]
    document = Ledger(open_bucket(bucket_url), "policy").read().document
    assert [(e.identity, e.kind) for e in document.entries] == [
        ("step-00000005", "full"),
        ("step-00000006", "incremental"),
    ]
    # Step 6 publishes the weights of step 5 again: every shard is untouched, and the delta
    # ships the plan's first alone (a delta ships one at least; its header names the parent).
    bucket = open_bucket(bucket_url)
    index = json.loads(bucket.get(f"step-00000005/{layout.INDEX_FILE}").data)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    listed = {o.key.split("/", 1)[1] for o in bucket.list("step-00000006")}
    assert sorted(n for n in listed if n.endswith(".safetensors")) == shards[:1]
    record = json.loads(bucket.get(f"step-00000006/{layout.INHERITED_FILE}").data)
    assert sorted(record["untouched_shards"]) == shards[1:]
    # A replica rebuilds it: the weights of step 5, bit for bit.
    weights = WeightsFolder(tmp_path / "replica")
    weights.prepare()
    materializer = Materializer(bucket, weights, threads=1)
    five = _tensors(asyncio.run(materializer.build(document, "step-00000005")).path)
    built = asyncio.run(materializer.build(document))
    assert built.identity == "step-00000006" and built.applied == ["step-00000006"]
    assert _tensors(built.path) == five


def _retaining_rank(rank: int, bucket_url: str, out: str) -> None:
    """Both ranks publish steps 0-4 with a full snapshot every 2 and `retain=1`."""
    with _group(rank, out):
        model = _sharded_model()
        pub = sharded.ShardedPublisher(
            bucket_url,
            ledger="policy",
            config=CONFIG,
            workdir=f"{out}/work",
            threads=1,
            full_every=2,
            retain=1,
            retain_grace=timedelta(0),  # no loader lags here: deleted at once
        )
        for step in range(5):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)  # a new policy each step
            pub.publish(model, step=step)
        pub.close()


@pytest.mark.slow
def test_retain_deletes_what_the_newest_full_snapshot_made_unneeded(tmp_path: Path) -> None:
    bucket_url = str(tmp_path / "bucket")
    _spawn(_retaining_rank, tmp_path, bucket_url, str(tmp_path))
    # Steps 0 (full), 1 (delta), 2 (full), 3 (delta), 4 (full). With retain=1, after step 4 only
    # the chain of the newest full snapshot and the last entry are needed: step 4 alone. Steps
    # 0-1 were unneeded from step 2 on, 2-3 from step 4 on.
    folders = {p.name for p in (tmp_path / "bucket").iterdir() if p.name.startswith("step-")}
    assert folders == {"step-00000004"}
    document = Ledger(open_bucket(bucket_url), "policy").read().document
    assert document.head is not None and document.head.identity == "step-00000004"


def test_every_rank_computes_the_same_layer_pure_balanced_plan() -> None:
    tensors: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (64, 32), "BF16")
    ]
    for i in range(5):
        tensors += [
            (f"model.layers.{i}.mlp.up_proj.weight", (64, 32), "BF16"),
            (f"model.layers.{i}.mlp.down_proj.weight", (32, 64), "BF16"),
        ]
    tensors += [("model.norm.weight", (32,), "F32"), ("lm_head.weight", (64, 32), "BF16")]
    plan = plan_shards(tensors, world_size=3)
    assert plan == plan_shards(list(tensors), world_size=3)
    assert [s.name for s in plan.shards] == [
        f"model-{i:05d}-of-00007.safetensors" for i in (1, 2, 3, 4, 5, 6, 7)
    ]
    assert all(
        len({n.split(".")[2] for n in s.tensors}) == 1 for s in plan.shards[1:6]
    )  # one layer per shard
    assert [s.owner for s in plan.shards] == [0, 1, 2, 0, 1, 2, 0]
    assert plan.spec["model.norm.weight"] == {"shape": [32], "dtype": "F32"}
    assert plan.digest != plan_shards(tensors, world_size=2).digest
    # The size limit splits a layer into several shards, never two layers into one.
    small = plan_shards(tensors, world_size=2, max_shard_bytes=4096)
    assert len(small.shards) == 1 + 10 + 2


class TiedLlama(Llama):
    """The Llama above with its output head tied to the embeddings (Llama 3.2, Qwen2.5 0.5B)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head.weight = self.model.embed_tokens.weight


TIED_CONFIG = {**CONFIG, "tie_word_embeddings": True}


def _fleet_rank(rank: int, ns: str, out: str) -> None:
    """Both ranks publish to HotLoadDeployment `fleet` (bucket, ledger and namespace from the
    deployment and the context), wait for the fleet, then meet a NaN and a step going back."""
    from torch.distributed.fsdp import fully_shard

    with _group(rank, out):
        torch.manual_seed(0)
        model = TiedLlama()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        pub = sharded.ShardedPublisher(
            deployment="fleet", config=TIED_CONFIG, workdir=f"{out}/work", threads=1
        )
        seen: dict[str, Any] = {"namespace": pub.namespace, "ledger": pub.ledger.name}
        handle = pub.publish(model, step=3)
        report = pub.wait_ready(handle.identity, timeout=120)
        seen["ready"] = [report.identity, report.replicas, report.loaded]
        with torch.no_grad():  # each rank poisons the first element of its slice: WORLD NaNs
            model.model.layers[1].q_proj.weight.to_local().view(-1)[0] = float("nan")
        try:
            pub.publish(model, step=4)
        except sharded.ShardedPublishError as exc:
            seen["nan"] = str(exc)
        try:
            pub.publish(model, step=2)
        except sharded.PublishError as exc:
            seen["back"] = str(exc)
        try:
            pub.wait_ready("step-00000099", timeout=1)
        except sharded.PublishError as exc:
            seen["unknown"] = [type(exc).__name__, str(exc)]
        Path(f"{out}/fleet-{rank}.json").write_text(json.dumps(seen))
        pub.close()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_sharded_trainer_waits_for_the_fleet_and_refuses_what_a_publisher_refuses(
    kube_api: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real operator: rank 0 resolves the deployment (no bucket, ledger or
    namespace given) and waits, every rank gets the answer; the tied head is published once,
    as `save_pretrained` writes it; NaN weights and a step going back are refused on every
    rank, naming the tensor and the step."""
    from support.cluster import install_crds, namespaced_kubeconfig
    from support.operator import (
        create_fleet,
        loaders_follow_the_ledger,
        running_operator,
    )

    ns = kube_api.namespace
    kubeconfig = namespaced_kubeconfig(kube_api.kubeconfig, ns, tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))  # inherited by the spawned ranks
    monkeypatch.setenv("HOTLOAD_ROLLUP_INTERVAL", "0.5")
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    async with kube_api.client() as kube:
        await install_crds(kube)
        async with running_operator(kube_api):
            pods = await create_fleet(kube, ns, bucket, replicas=2)
            playing = asyncio.create_task(loaders_follow_the_ledger(kube, ns, bucket, pods))
            try:
                await asyncio.to_thread(_spawn, _fleet_rank, tmp_path, ns, str(tmp_path))
            finally:
                playing.cancel()
    seen = [json.loads((tmp_path / f"fleet-{r}.json").read_text()) for r in range(WORLD)]
    assert seen[0] == seen[1], seen
    got = seen[0]
    assert (got["namespace"], got["ledger"]) == (ns, "fleet")
    assert got["ready"] == ["step-00000003", 2, 2]
    assert "model.layers.1.q_proj.weight" in got["nan"] and f"{WORLD} NaN and 0 Inf" in got["nan"]
    assert "nothing was committed" in got["nan"]
    assert "step 2 is before step 3" in got["back"]
    assert got["unknown"] == [
        "PublishError",
        f"no Snapshot object {ns}/fleet-step-00000099: 'step-00000099' was not published to "
        "HotLoadDeployment fleet (or its object was deleted: spec.snapshotHistory keeps the "
        "newest ones)",
    ]
    document = (await Ledger(open_bucket(str(bucket)), "fleet").read_async()).document
    assert [e.identity for e in document.entries] == ["step-00000003"]
    index = json.loads((bucket / "step-00000003" / layout.INDEX_FILE).read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert "model.embed_tokens.weight" in index["weight_map"]
