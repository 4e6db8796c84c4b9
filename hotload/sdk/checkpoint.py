"""A trainer's state dict under the names of the family's published checkpoint.

`model.state_dict()` and the checkpoint `save_pretrained` writes differ for some families: a
tied output head is one tensor under two names in the state dict and one name in the checkpoint
(Llama 3.2, Qwen2.5 0.5B, Qwen3 0.6B, Gemma), and since transformers 5 a mixture of experts
holds its experts stacked (`mlp.experts.gate_up_proj`) where the checkpoint has one tensor per
expert (`mlp.experts.3.gate_proj.weight`). A fleet that booted from the family's checkpoint
holds those names: vLLM refuses a reload whose tensors differ from the ones it holds, and a
delta needs its parent's names. So the publisher writes what `save_pretrained` would, with
transformers' own functions for it (tied duplicates left out, conversions reverted), when the
snapshot's `config.json` names a transformers architecture and the tensors are torch's; any
other state dict is published as it is, with a warning naming the file and the cause when that
config.json cannot be read or names an architecture transformers does not know.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("hotload.sdk.checkpoint")


def checkpoint_names(
    weights: Any,
    *,
    config: Mapping[str, Any] | None,
    side_files_from: str | Path | None,
) -> Any:
    """`weights` (a state dict) as `save_pretrained` saves it, for the architecture the config
    names (an explicit `config` wins over `side_files_from`'s config.json); `weights` unchanged
    when that does not apply (see the module docstring)."""
    if not isinstance(weights, Mapping) or not weights:
        return weights
    if not all(type(t).__module__.startswith("torch") for t in weights.values()):
        return weights
    doc, source = _config(config, side_files_from)
    architectures = doc.get("architectures") if doc else None
    if not architectures or not isinstance(architectures, list):
        return weights
    try:
        import torch
        import transformers
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # no transformers, or transformers 4 (it converts nothing)
        return weights
    cls = getattr(transformers, str(architectures[0]), None)
    if cls is None or not hasattr(cls, "config_class"):
        # A typo or a custom model: its tied names and conversions are unknown, and a fleet
        # booted from its checkpoint may refuse names that differ.
        log.warning(
            "publishing the state dict's own names: architecture %r (%s) is not one "
            "transformers %s knows, so its checkpoint names are unknown",
            architectures[0],
            source,
            transformers.__version__,
        )
        return weights
    try:
        skeleton = _skeleton(cls, json.dumps(doc, sort_keys=True), torch)
        state = remove_tied_weights_from_state_dict(dict(weights), skeleton)
        state = _drop_tied_copies(state, getattr(skeleton, "all_tied_weights_keys", None), torch)
        state = revert_weight_conversion(skeleton, state)
    except Exception as exc:  # e.g. a quantised model, whose conversions do not reverse
        log.warning(
            "publishing the state dict's own names: transformers could not give %s's "
            "checkpoint names (%s: %s)",
            architectures[0],
            type(exc).__name__,
            exc,
        )
        return weights
    if set(state) != set(weights):
        log.info(
            "publishing %d tensors under %s's checkpoint names (the state dict had %d)",
            len(state),
            architectures[0],
            len(weights),
        )
    return state


def _drop_tied_copies(state: dict[str, Any], tied: Any, torch: Any) -> dict[str, Any]:
    """Tied names whose tensors are separate but equal copies (a state dict gathered or moved
    to the CPU no longer shares storage between them): kept once, under the name
    `save_pretrained` keeps. Copies that differ stay, for the engines to refuse."""
    for name, source in dict(tied or {}).items():
        held, kept = state.get(name), state.get(source)
        if held is not None and kept is not None and torch.equal(held, kept):
            del state[name]
    return state


@functools.lru_cache(maxsize=4)
def _skeleton(cls: Any, doc: str, torch: Any) -> Any:
    """The model on the meta device (it allocates nothing): what transformers reads to know the
    tied names and the conversions. Built once per configuration (a large model's modules take
    a second or two)."""
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():
        return cls(cls.config_class.from_dict(json.loads(doc)))


def _config(
    config: Mapping[str, Any] | None, side_files_from: str | Path | None
) -> tuple[Mapping[str, Any] | None, str]:
    """The model's configuration and where it came from (for messages); a config.json that
    cannot be read is warned about, naming the file and why, and counts as none."""
    if config is not None:
        return config, "the config given"
    if side_files_from is None:
        return None, "no config"
    path = Path(side_files_from) / "config.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    else:
        if isinstance(doc, dict):
            return doc, str(path)
        why = f"it holds a JSON {type(doc).__name__}, not an object"
    log.warning(
        "publishing the state dict's own names: cannot read %s (%s), so the architecture and "
        "its checkpoint names are unknown",
        path,
        why,
    )
    return None, str(path)


#: The tied output head and the tensor it shares, in every family we publish whose config
#: ties them (Llama 3.2, Qwen2.5 0.5B, Qwen3 0.6B, Gemma): `save_pretrained` keeps the
#: embedding and leaves the head out.
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")


def drop_tied_head(
    pairs: list[tuple[str, Any]],
    config: Mapping[str, Any] | None,
    side_files_from: str | Path | None,
) -> list[tuple[str, Any]]:
    """`pairs` without `lm_head.weight` when the config says `tie_word_embeddings: true` and
    the embedding it shares is there too: what `save_pretrained` leaves out, decided from the
    names and the config alone, so every rank of a sharded publish decides the same with no
    exchange."""
    doc, _ = _config(config, side_files_from)
    head, embedding = TIED_HEAD
    names = {n for n, _ in pairs}
    if not doc or doc.get("tie_word_embeddings") is not True or not {head, embedding} <= names:
        return pairs
    return [(n, t) for n, t in pairs if n != head]
