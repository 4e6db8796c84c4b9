"""A shard the step left alone is not shipped (docs/arc_v2.md §2.2): the delta names it with
the sha256 of the parent's shard header, and every reader takes the parent's shard.

Real snapshots and deltas (`hotload.arc.encode`) whose steps move one layer at a time; what is
expected comes from the full snapshots the test wrote (which shard files a step left byte for
byte), never from the codec. The loader's half runs real processes against SeaweedFS behind a
proxy that counts every request: an untouched shard costs no request, on the sparse path and on
a fresh replica's full rebuild of the chain.
"""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from hotload.arc import decode, encode, verify
from hotload.arc.chain import decode_chain
from hotload.arc.patch import check_delta_files, prepare_patch
from hotload.bucket import open_bucket
from hotload.errors import CorruptDeltaError, SnapshotValidationError, WrongParentError
from hotload.ledger import Ledger
from hotload.snapshot import Snapshot, layout, write_snapshot
from hotload_patch.format import PatchFile
from support.counting_proxy import CountingProxy
from support.fleet import PROMPT_IDS, Replica, Trainer, tokens
from support.seaweedfs import SeaweedFS
from support.snapshots import CONFIG, weights
from support.tiny_llm import build_tiny_llm, sparse_steps
from support.vllm_server import greedy_token_ids


def _layer(k: int) -> Callable[[str], bool]:
    return lambda name: f"layers.{k}." in name


def _one_layer_at_a_time(base: Path, root: Path, *, fraction: float) -> list[Path]:
    """`base` and three steps after it, each moving `fraction` of one layer: 0, then 1, then 0."""
    fulls = [base]
    for k, layer in enumerate((0, 1, 0), start=1):
        made, _ = sparse_steps(
            fulls[-1], root / f"s{k}", 1, fraction=fraction, seed=k, only=_layer(layer)
        )
        fulls.append(made[1])
    return fulls


def _stored_header(shard: Path) -> bytes:
    """A safetensors shard's 8-byte length and JSON header, as §2.2 hashes them."""
    data = shard.read_bytes()
    return data[: 8 + struct.unpack_from("<Q", data)[0]]


def _left_alone(parent: Path, child: Path) -> set[str]:
    """The shard files `child` holds byte for byte as `parent` does: those a step left alone."""
    return {
        p.name
        for p in child.glob("model-*.safetensors")
        if p.read_bytes() == (parent / p.name).read_bytes()
    }


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _steps(root: Path) -> tuple[list[Path], list[Path]]:
    """Full snapshots s0..s3, each step moving one layer (0, then 1, then 0), and their deltas."""
    w = weights(0, layers=3, width=64)
    base = write_snapshot(root / "base", w, config=CONFIG, cast="BF16", overwrite=True).path
    fulls = [base]
    for k, layer in enumerate((0, 1, 0), start=1):
        made, _ = sparse_steps(
            fulls[-1], root / f"s{k}", 1, fraction=0.05, seed=k, only=_layer(layer)
        )
        fulls.append(made[1])
    deltas = []
    for k in (1, 2, 3):
        out = root / "d" / f"step-{k}"
        encode(fulls[k - 1], fulls[k], out, parent_identity=fulls[k - 1].name, identity=f"step-{k}")
        deltas.append(out)
    return fulls, deltas


def test_a_delta_leaves_out_the_shards_its_step_did_not_touch(tmp_path: Path) -> None:
    fulls, deltas = _steps(tmp_path)
    for k, delta in enumerate(deltas, start=1):
        alone = _left_alone(fulls[k - 1], fulls[k])
        assert alone and len(alone) < len(Snapshot(fulls[k]).shard_files)
        record = json.loads((delta / layout.INHERITED_FILE).read_text())
        want = {
            s: "sha256:" + hashlib.sha256(_stored_header(fulls[k - 1] / s)).hexdigest()
            for s in alone
        }
        assert record["untouched_shards"] == want
        assert not any((delta / s).exists() for s in alone)
        shipped = {p.name for p in delta.glob("model-*.safetensors")}
        assert shipped == set(Snapshot(fulls[k]).shard_files) - alone
        # Rebuilt, checked without the parent and against it: the child's bytes, file for file.
        check_delta_files(delta)
        verify(delta, fulls[k - 1])
        decode(fulls[k - 1], delta, tmp_path / "out" / f"{k}", expected_parent=fulls[k - 1].name)
        assert _same_files(tmp_path / "out" / f"{k}", fulls[k])


def test_a_chain_follows_a_shard_through_the_deltas_that_left_it_alone(tmp_path: Path) -> None:
    fulls, deltas = _steps(tmp_path)
    decode_chain(fulls[0], deltas, tmp_path / "out")
    assert _same_files(tmp_path / "out", fulls[3])
    # A parent whose shard that no delta touches holds other weights: only the recorded sha256
    # of its header tells (nothing else of the chain reads that shard).
    never = sorted(set.intersection(*(_left_alone(fulls[k - 1], fulls[k]) for k in (1, 2, 3))))
    assert never
    other = write_snapshot(
        tmp_path / "other", weights(1, layers=3, width=64), config=CONFIG, cast="BF16"
    ).path
    rotten = tmp_path / "rotten"
    rotten.mkdir()
    for p in fulls[0].iterdir():
        (rotten / p.name).write_bytes(
            (other if p.name == never[0] else fulls[0]).joinpath(p.name).read_bytes()
        )
    for call in (
        lambda: decode_chain(rotten, deltas, tmp_path / "bad"),
        lambda: decode(rotten, deltas[0], tmp_path / "bad"),
    ):
        with pytest.raises(WrongParentError) as err:
            call()
        assert err.value.shard == never[0]
        assert not (tmp_path / "bad").exists()


def test_a_parent_whose_data_rotted_under_its_header_is_refused(tmp_path: Path) -> None:
    fulls, deltas = _steps(tmp_path)
    alone = sorted(_left_alone(fulls[0], fulls[1]))
    parent = tmp_path / "parent"
    parent.mkdir()
    for p in fulls[0].iterdir():
        (parent / p.name).write_bytes(p.read_bytes())
    data = bytearray((parent / alone[0]).read_bytes())
    data[-1] ^= 0x01  # the last tensor's last byte: the header (and its sha256) unchanged
    (parent / alone[0]).write_bytes(bytes(data))
    with pytest.raises(WrongParentError) as err:
        decode(parent, deltas[0], tmp_path / "out")
    assert err.value.shard == alone[0] and err.value.tensor is not None
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ([], "untouched_shards"),
        ({"weights.bin": "sha256:" + "0" * 64}, "weights.bin"),
        ({"model-00001-of-00005.safetensors": "md5:1"}, "md5:1"),
    ],
)
def test_a_malformed_untouched_record_is_a_corrupted_delta_naming_it(
    tmp_path: Path, record: object, words: str
) -> None:
    fulls, deltas = _steps(tmp_path)
    doc = {"from_parent": {}, "untouched_shards": record}
    (deltas[0] / layout.INHERITED_FILE).write_text(json.dumps(doc))
    for call in (
        lambda: decode(fulls[0], deltas[0], tmp_path / "out"),
        lambda: check_delta_files(deltas[0]),
        lambda: prepare_patch(None, deltas[0], tmp_path / "p.patch"),
    ):
        with pytest.raises(CorruptDeltaError) as err:
            call()
        assert layout.INHERITED_FILE in str(err.value) and words in str(err.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "p.patch").exists()


def test_a_shard_both_shipped_and_left_alone_or_missing_is_refused(tmp_path: Path) -> None:
    fulls, deltas = _steps(tmp_path)
    alone = sorted(_left_alone(fulls[0], fulls[1]))
    shipped = sorted(p.name for p in deltas[0].glob("model-*.safetensors"))
    (deltas[0] / alone[0]).write_bytes((deltas[0] / shipped[0]).read_bytes())
    with pytest.raises(SnapshotValidationError, match="is shipped, yet"):
        check_delta_files(deltas[0])
    (deltas[0] / alone[0]).unlink()
    (deltas[0] / shipped[0]).unlink()
    with pytest.raises(SnapshotValidationError, match="missing"):
        check_delta_files(deltas[0])


def test_a_patch_keeps_the_tensors_of_shards_every_delta_left_alone(tmp_path: Path) -> None:
    fulls, deltas = _steps(tmp_path)
    snap = Snapshot(fulls[0])
    # Deltas 1 and 2 move layers 0 and 1: the shards of neither (layer 2, embeddings, head)
    # are left alone by both.
    alone = _left_alone(fulls[0], fulls[2])
    kept_names = {t for s in alone for t in snap.tensors_of(s)}
    out = tmp_path / "p.patch"
    prepare_patch(None, deltas[:2], out)
    with PatchFile(out) as pf:
        assert set(pf.kept) == kept_names
        for name, (shape, dtype) in pf.kept.items():
            spec = snap.tensor_map[name]
            assert (shape, dtype) == (tuple(spec.shape), spec.dtype)
        assert {t.name for t in pf.tensors} == set(snap.tensor_map) - kept_names
        assert pf.identity == "step-2" and pf.parent == fulls[0].name


# --- the loader: an untouched shard costs no request --------------------------------------------


@pytest.fixture(scope="module")
def layer_steps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A tiny Llama and three steps, each moving one layer (0, 1, 0) by 1%."""
    root = tmp_path_factory.mktemp("untouched")
    fulls = [build_tiny_llm(root / "m", 0).snapshots[0]]
    for k, layer in enumerate((0, 1, 0), start=1):
        made, _ = sparse_steps(
            fulls[-1], root / f"s{k}", 1, fraction=0.01, seed=k, only=_layer(layer)
        )
        fulls.append(made[1])
    return fulls


def _gets(proxy: CountingProxy, identity: str) -> set[str]:
    """The files of snapshot `identity` that the proxy served by GET."""
    return {
        key.rsplit("/", 1)[-1]
        for key in proxy.keys(method="GET")
        if f"/{identity}/" in key and key.endswith(".safetensors")
    }


def test_a_loader_never_asks_the_bucket_for_an_untouched_shard(
    layer_steps: list[Path],
    tmp_path: Path,
    s3_env: SeaweedFS,
    env: dict[str, str],
    replicas: list[Replica],
) -> None:
    with CountingProxy(s3_env.endpoint) as proxy:
        env = {**env, **s3_env.env, "AWS_ENDPOINT_URL": proxy.endpoint}
        url = s3_env.url(f"untouched-{uuid.uuid4().hex[:8]}")
        trainer = Trainer(
            Ledger(open_bucket(url), "policy"), layer_steps, tmp_path / "trainer", full_every=100
        )
        trainer.publish(0)
        r0 = Replica("r0", tmp_path / "r0", f"{url}/policy", env)
        replicas.append(r0)
        r0.start()
        r0.wait_serving("step-000", timeout=180)
        every = set(Snapshot(layer_steps[0]).shard_files)
        for k in (1, 2, 3):
            trainer.publish(k)
            status = r0.wait_serving(Trainer.identity(k))
            assert status["last_load"]["method"] == "sparse", status
            alone = _left_alone(layer_steps[k - 1], layer_steps[k])
            assert alone
            # The delta's shipped shards were fetched; the ones the step left alone never were.
            assert _gets(proxy, Trainer.identity(k)) == every - alone
            assert tokens(r0) == (
                f"tiny@{Trainer.identity(k)}",
                greedy_token_ids(layer_steps[k], PROMPT_IDS, 8),
            )
        # A fresh replica rebuilds step-003 from step-000 through the three deltas.
        proxy.reset()
        r1 = Replica("r1", tmp_path / "r1", f"{url}/policy", env)
        replicas.append(r1)
        r1.start()
        r1.wait_serving("step-003", timeout=180)
        for k in (1, 2, 3):
            alone = _left_alone(layer_steps[k - 1], layer_steps[k])
            assert not _gets(proxy, Trainer.identity(k)) & alone
        assert tokens(r1) == ("tiny@step-003", greedy_token_ids(layer_steps[3], PROMPT_IDS, 8))
