"""A trainer's `model.state_dict()` published under its family's checkpoint names: what
`save_pretrained` writes, bit for bit (a tied output head once; a transformers 5 mixture of
experts' stacked experts as one tensor per expert), so the fleet that booted from the family's
checkpoint can load it. The whole path, on both engines, is `tests/test_families.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hotload.sdk import Publisher
from hotload.sdk.checkpoint import checkpoint_names
from support.families import FAMILIES, copy_tokenizer
from support.patch_models import read_checkpoint


def _published(
    tmp_path: Path, state: dict[str, torch.Tensor], side: Path
) -> dict[str, torch.Tensor]:
    """Publish `state` as a full snapshot to a local bucket; its tensors as written."""
    bucket = tmp_path / "bucket"
    pub = Publisher(
        str(bucket), ledger="policy", cast="BF16", side_files_from=side,
        workdir=tmp_path / "work", progress=False,
    )  # fmt: skip
    handle = pub.publish(state, step=0)
    pub.close()
    return read_checkpoint(bucket / handle.identity)


@pytest.mark.parametrize("name", ["llama3.2", "qwen3-moe", "llama3", "phi3"])
def test_a_state_dict_goes_out_as_save_pretrained_writes_it(tmp_path: Path, name: str) -> None:
    model = FAMILIES[name].model(seed=2)
    saved = tmp_path / "saved"
    model.to(torch.bfloat16).save_pretrained(saved)
    copy_tokenizer(saved)
    want = read_checkpoint(saved)
    got = _published(tmp_path, model.state_dict(), saved)
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    state = model.state_dict()
    if name in ("llama3.2", "qwen3-moe"):
        assert set(state) != set(want)  # the case this is for: the names differ


def test_other_state_dicts_go_out_as_they_are(tmp_path: Path) -> None:
    model = FAMILIES["llama3.2"].model(seed=2)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    # Copies (gathered, or moved to the CPU): equal, the head goes as save_pretrained leaves it;
    # different (not tied after all, whatever the config says), both go, for engines to refuse.
    copies = {k: v.clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" not in checkpoint_names(copies, config=None, side_files_from=saved)
    copies["lm_head.weight"] += 1
    assert "lm_head.weight" in checkpoint_names(copies, config=None, side_files_from=saved)
    # No architecture transformers knows, numpy arrays, no config: as given.
    state = model.state_dict()
    toy = {"model_type": "toy", "architectures": ["NoSuchModel"]}
    assert checkpoint_names(state, config=toy, side_files_from=None) is state
    assert checkpoint_names(state, config=None, side_files_from=None) is state
    arrays = {k: v.numpy() for k, v in state.items()}
    assert checkpoint_names(arrays, config=None, side_files_from=saved) is arrays


@pytest.mark.parametrize(
    ("config_json", "cause"),
    [
        (None, "FileNotFoundError"),
        ("{not json", "JSONDecodeError"),
        ('["LlamaForCausalLM"]', "it holds a JSON list, not an object"),
        ('{"architectures": ["NoSuchModel"]}', "architecture 'NoSuchModel'"),
    ],
    ids=["missing", "corrupt", "not-an-object", "unknown-architecture"],
)
def test_names_left_as_they_are_for_want_of_a_config_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, config_json: str | None, cause: str
) -> None:
    """A config.json that cannot be read, or an architecture transformers does not know: the
    state dict goes out under its own names, and the log says which file and why."""
    if config_json is not None:
        (tmp_path / "config.json").write_text(config_json)
    state = {"model.embed_tokens.weight": torch.zeros(4, 2)}
    with caplog.at_level("WARNING", logger="hotload.sdk.checkpoint"):
        assert checkpoint_names(state, config=None, side_files_from=tmp_path) is state
    (record,) = [r for r in caplog.records if r.name == "hotload.sdk.checkpoint"]
    assert record.levelname == "WARNING"
    assert "publishing the state dict's own names" in record.getMessage()
    assert str(tmp_path / "config.json") in record.getMessage()
    assert cause in record.getMessage()
