"""Names of the files in a snapshot folder, shard naming, layer detection and identities."""

from __future__ import annotations

import re

INDEX_FILE = "model.safetensors.index.json"
SPEC_FILE = "model.weight.spec.json"
CONFIG_FILE = "config.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_INDEX_FILE = "adapter_model.safetensors.index.json"

# Files copied along with the weights when they exist next to them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
)

# The manifests name what a snapshot holds; they are written (and uploaded) last.
MANIFEST_FILES = (INDEX_FILE, SPEC_FILE)

# A delta's record of the side files it does not ship because its parent holds the same bytes
# (name -> "sha256:<hex>"); a decoder takes the parent's copy after checking it (docs/arc_v2.md
# §2.2). Never part of a full snapshot.
INHERITED_FILE = "hotload.inherited.json"

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3

SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
ADAPTER_SHARD_RE = re.compile(r"^adapter_model(-\d{5}-of-\d{5})?\.safetensors$")

# "model.layers.3.mlp.up_proj.weight" -> "model.layers.3"; also BERT's "encoder.layer.3",
# GPT-2's "h.3" and "blocks.3". Two stacks (a vision tower and a decoder) get distinct keys.
_LAYER_RE = re.compile(r"^((?:.*\.)?(?:layers|layer|h|blocks|block)\.\d+)(?:\.|$)")

IDENTITY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def shard_name(index: int, total: int) -> str:
    """Return the file name of shard `index` (1-based) of `total`."""
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def layer_of(tensor_name: str) -> str | None:
    """Return the layer a tensor belongs to (its name prefix up to the layer number), or None."""
    m = _LAYER_RE.match(tensor_name)
    return m.group(1) if m else None


def validate_identity(identity: object) -> str:
    """Return `identity` if it is one safe path segment, else raise `InvalidIdentityError`."""
    from hotload.errors import InvalidIdentityError

    if (
        not isinstance(identity, str)
        or not IDENTITY_RE.fullmatch(identity)
        or identity in {".", ".."}
    ):
        raise InvalidIdentityError(
            f"{identity!r} is not a valid snapshot identity: use 1-128 characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit (one path segment, no '/')",
            field="identity",
        )
    return identity
