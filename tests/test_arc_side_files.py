"""Side files a delta inherits from its parent (issue 38): tokenizer files the step left alone
are not shipped again with every delta (a Llama-3 tokenizer.json is ~9 MB); the delta records
their sha256 in `hotload.inherited.json` and a decoder takes the parent's copy after checking it.

Real snapshot folders, the real codec, and a real bucket (SeaweedFS) under the loader's
`Materializer`; every expected byte comes from the folders the test wrote.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from pathlib import Path

import pytest
from safetensors.numpy import load_file as load

from hotload.arc import decode, encode
from hotload.arc.chain import decode_chain
from hotload.arc.files import changed_side_files
from hotload.arc.patch import check_delta_files
from hotload.bucket import open_bucket
from hotload.errors import ChecksumMismatchError, CorruptDeltaError
from hotload.ledger import Ledger
from hotload.sdk import publish_folder, publish_folder_async
from hotload.snapshot import Snapshot, layout
from hotload_sidecar.engines import make_adapter
from hotload_sidecar.materialize import Materializer
from hotload_sidecar.sparse import Prepared, SparseLoads
from hotload_sidecar.weights import WeightsFolder
from support.seaweedfs import BUCKET, SeaweedFS
from support.snapshots import full, nudged, weights

TOKENIZER = json.dumps({"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(2000)}}})


def _step(path: Path, step: int, side: dict[str, str]) -> Path:
    """A full snapshot of training step `step` with the side files `side` (name -> text)."""
    full(path, nudged(weights(0), step) if step else weights(0))
    for name, text in side.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def _delta(parent: Path, current: Path, out: Path) -> Path:
    encode(parent, current, out, parent_identity=parent.name, identity=out.name, threads=1)
    return out


def _sha(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _files(folder: Path) -> dict[str, bytes]:
    """Every file but the shards, by relative name."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.suffix != ".safetensors"
    }


def _tensors(folder: Path) -> dict[str, bytes]:
    return {
        k: v.tobytes() for f in sorted(folder.glob("*.safetensors")) for k, v in load(f).items()
    }


SIDE = {"tokenizer.json": TOKENIZER, "vocab.txt": "a\nb\n", "nested/chat_template.jinja": "{{x}}"}


def test_a_delta_ships_only_the_side_files_that_changed_and_records_the_rest(
    tmp_path: Path,
) -> None:
    prev = _step(tmp_path / "step-000", 0, SIDE)
    cur = _step(tmp_path / "step-001", 1, {**SIDE, "vocab.txt": "a\nb\nc\n"})
    d = _delta(prev, cur, tmp_path / "d" / "step-001")

    shipped = _files(d)
    assert "tokenizer.json" not in shipped and "nested/chat_template.jinja" not in shipped
    assert shipped["vocab.txt"] == (cur / "vocab.txt").read_bytes()
    assert shipped[layout.CONFIG_FILE] == (cur / layout.CONFIG_FILE).read_bytes()
    record = json.loads(shipped[layout.INHERITED_FILE])
    assert record["from_parent"] == {
        "nested/chat_template.jinja": _sha(prev / "nested/chat_template.jinja"),
        "tokenizer.json": _sha(prev / "tokenizer.json"),
    }

    out = tmp_path / "out" / "step-001"
    decode(prev, d, out, threads=1)
    assert _files(out) == _files(cur)  # the record is not part of the full snapshot
    assert _tensors(out) == _tensors(cur)


def test_config_json_is_shipped_even_when_unchanged(tmp_path: Path) -> None:
    prev = _step(tmp_path / "step-000", 0, SIDE)
    cur = _step(tmp_path / "step-001", 1, SIDE)
    assert (prev / layout.CONFIG_FILE).read_bytes() == (cur / layout.CONFIG_FILE).read_bytes()
    d = _delta(prev, cur, tmp_path / "d" / "step-001")
    assert (d / layout.CONFIG_FILE).read_bytes() == (cur / layout.CONFIG_FILE).read_bytes()
    assert (
        layout.CONFIG_FILE not in json.loads((d / layout.INHERITED_FILE).read_text())["from_parent"]
    )


def test_a_chain_gives_each_step_its_own_side_files(tmp_path: Path) -> None:
    # step 1 inherits everything, step 2 changes the tokenizer and drops vocab.txt, step 3
    # inherits step 2's tokenizer: what each full snapshot held, whichever way it is rebuilt.
    sides = [
        SIDE,
        SIDE,
        {"tokenizer.json": TOKENIZER.replace("t1", "u1"), "nested/chat_template.jinja": "{{x}}"},
        {"tokenizer.json": TOKENIZER.replace("t1", "u1"), "nested/chat_template.jinja": "{{x}}"},
    ]
    fulls = [_step(tmp_path / "f" / f"step-00{i}", i, s) for i, s in enumerate(sides)]
    deltas = [_delta(fulls[i - 1], fulls[i], tmp_path / "d" / f"step-00{i}") for i in range(1, 4)]
    assert "tokenizer.json" in _files(deltas[1]) and "tokenizer.json" not in _files(deltas[2])

    out = tmp_path / "chain" / "step-003"
    decode_chain(fulls[0], deltas, out, threads=1)
    assert _files(out) == _files(fulls[3])
    assert "vocab.txt" not in _files(out)

    prev = fulls[0]
    for i, d in enumerate(deltas, start=1):
        step = tmp_path / "one-by-one" / f"step-00{i}"
        decode(prev, d, step, threads=1)
        assert _files(step) == _files(fulls[i])
        prev = step


def test_a_parent_whose_inherited_file_rotted_is_a_checksum_mismatch_naming_it(
    tmp_path: Path,
) -> None:
    prev = _step(tmp_path / "step-000", 0, SIDE)
    cur = _step(tmp_path / "step-001", 1, SIDE)
    d = _delta(prev, cur, tmp_path / "d" / "step-001")
    good = (prev / "tokenizer.json").read_bytes()
    (prev / "tokenizer.json").write_bytes(good.replace(b"t1", b"t7", 1))

    out = tmp_path / "out" / "step-001"
    for rebuild in (
        lambda: decode(prev, d, out, threads=1),
        lambda: decode(prev, d, None, threads=1),
        lambda: decode_chain(prev, [d], out, threads=1),
    ):
        with pytest.raises(ChecksumMismatchError) as err:
            rebuild()
        assert "'tokenizer.json'" in str(err.value)
        assert layout.INHERITED_FILE in str(err.value)
        assert not out.exists()

    (prev / "tokenizer.json").write_bytes(good)
    (prev / "vocab.txt").unlink()
    with pytest.raises(ChecksumMismatchError, match=r"'vocab.txt' from its parent, which has no"):
        decode(prev, d, out, threads=1)


@pytest.mark.parametrize(
    ("record", "words"),
    [
        (b"{not json", "is not JSON"),
        (b'{"files": {}}', 'has no "from_parent" object'),
        (b'{"from_parent": {"../escape": "sha256:' + b"0" * 64 + b'"}}', "'../escape'"),
        (b'{"from_parent": {"/etc/passwd": "sha256:' + b"0" * 64 + b'"}}', "'/etc/passwd'"),
        (b'{"from_parent": {"config.json": "sha256:' + b"0" * 64 + b'"}}', "'config.json'"),
        (
            b'{"from_parent": {"model-00001-of-00001.safetensors": "sha256:' + b"0" * 64 + b'"}}',
            "no delta may inherit",
        ),
        (b'{"from_parent": {"tokenizer.json": "md5:abc"}}', "not sha256:<64 hex digits>"),
    ],
)
def test_a_malformed_record_is_refused_naming_it_before_anything_is_written(
    tmp_path: Path, record: bytes, words: str
) -> None:
    prev = _step(tmp_path / "step-000", 0, SIDE)
    cur = _step(tmp_path / "step-001", 1, SIDE)
    d = _delta(prev, cur, tmp_path / "d" / "step-001")
    (d / layout.INHERITED_FILE).write_bytes(record)

    out = tmp_path / "out" / "step-001"
    with pytest.raises(CorruptDeltaError) as err:
        decode(prev, d, out, threads=1)
    assert words in str(err.value) and layout.INHERITED_FILE in str(err.value)
    assert not out.exists()
    with pytest.raises(CorruptDeltaError, match=layout.INHERITED_FILE.replace(".", r"\.")):
        check_delta_files(d)


def test_a_loader_builds_the_side_files_of_a_delta_that_did_not_ship_them_from_the_bucket(
    s3_env: SeaweedFS, tmp_path: Path
) -> None:
    prefix = f"side-{uuid.uuid4().hex[:12]}"
    ledger = Ledger(open_bucket(f"s3://{BUCKET}/{prefix}"), "policy")
    fulls = [
        _step(tmp_path / "f" / "step-000", 0, SIDE),
        _step(tmp_path / "f" / "step-001", 1, SIDE),
        _step(tmp_path / "f" / "step-002", 2, {**SIDE, "tokenizer.json": TOKENIZER + " "}),
    ]
    publish_folder(ledger, fulls[0])
    for i in (1, 2):
        publish_folder(ledger, _delta(fulls[i - 1], fulls[i], tmp_path / "d" / f"step-00{i}"))

    keys = {i: {o.key.split("/", 1)[1] for o in ledger.bucket.list(f"step-00{i}")} for i in (1, 2)}
    assert "tokenizer.json" not in keys[1] and layout.INHERITED_FILE in keys[1]
    assert "tokenizer.json" in keys[2]

    folder = WeightsFolder(tmp_path / "weights")
    folder.prepare()
    built = asyncio.run(
        Materializer(ledger.bucket, folder, threads=1).build(ledger.read().document)
    )
    assert built.identity == "step-002"
    assert _files(built.path) == _files(fulls[2])
    assert _tensors(built.path) == _tensors(fulls[2])


def test_changed_side_files_are_those_a_recording_delta_ships_besides_config(
    tmp_path: Path,
) -> None:
    prev = _step(tmp_path / "step-000", 0, SIDE)
    cur = _step(tmp_path / "step-001", 1, {**SIDE, "nested/chat_template.jinja": "{{y}}"})
    same = _step(tmp_path / "step-002", 2, {**SIDE, "nested/chat_template.jinja": "{{y}}"})
    changed = _delta(prev, cur, tmp_path / "d" / "step-001")
    shards = Snapshot(changed).shard_files
    assert changed_side_files(changed, shards) == ["nested/chat_template.jinja"]
    assert changed_side_files(_delta(cur, same, tmp_path / "d" / "step-002"), shards) == []
    # A delta that records nothing ships every side file (an older publisher): none is
    # taken for a change.
    (changed / layout.INHERITED_FILE).unlink()
    assert changed_side_files(changed, shards) == []


@pytest.mark.asyncio
async def test_the_sparse_path_says_when_a_delta_changes_what_the_engine_keeps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A patch replaces weights only: a delta that changes the chat template is patched in, and
    the loader says the engine keeps the template it started with (a delta that changes no side
    file says nothing)."""
    prev = _step(tmp_path / "f" / "step-000", 0, SIDE)
    cur = _step(tmp_path / "f" / "step-001", 1, {**SIDE, "nested/chat_template.jinja": "{{y}}"})
    same = _step(tmp_path / "f" / "step-002", 2, {**SIDE, "nested/chat_template.jinja": "{{y}}"})
    ledger = Ledger(open_bucket(str(tmp_path / "bucket")), "policy")
    await publish_folder_async(ledger, prev)
    await publish_folder_async(ledger, _delta(prev, cur, tmp_path / "d" / "step-001"))
    await publish_folder_async(ledger, _delta(cur, same, tmp_path / "d" / "step-002"))
    document = (await ledger.read_async()).document
    local = WeightsFolder(tmp_path / "weights")
    local.prepare()
    adapter = make_adapter("reference", "http://127.0.0.1:9")  # only `prepare` is called
    loads = SparseLoads(ledger.bucket, local, adapter, max_changed=0.5, threads=1)
    said: dict[str, list[str]] = {}
    for ident in ("step-001", "step-002"):
        entry = document.find(ident)
        assert entry is not None
        caplog.clear()
        with caplog.at_level("WARNING", logger="hotload_sidecar.sparse"):
            ready = await loads.prepare([entry])
        assert isinstance(ready, Prepared), ready
        ready.discard()
        # The sparse path's own logger: not another test's late asyncio warning.
        said[ident] = [r.getMessage() for r in caplog.records if r.name == "hotload_sidecar.sparse"]
    assert len(said["step-001"]) == 1, said
    assert "step-001 changes nested/chat_template.jinja" in said["step-001"][0]
    assert "restart the pod" in said["step-001"][0]
    assert said["step-002"] == []
