"""The snapshot format: Hugging Face safetensors folders with hotload's manifests."""

from hotload.snapshot.layout import (
    CONFIG_FILE,
    INDEX_FILE,
    MANIFEST_FILES,
    SPEC_FILE,
    layer_of,
    shard_name,
    validate_identity,
)
from hotload.snapshot.manifests import TensorSpec
from hotload.snapshot.reader import (
    Snapshot,
    SnapshotDescription,
    SnapshotKind,
    describe_snapshot,
)
from hotload.snapshot.safetensors_io import RawTensor, SafetensorsFile
from hotload.snapshot.validate import (
    check_config,
    validate_adapter,
    validate_snapshot,
    validate_transition,
)
from hotload.snapshot.writer import (
    SnapshotWriter,
    WrittenSnapshot,
    build_from_folder,
    iter_model_folder,
    write_snapshot,
)

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "MANIFEST_FILES",
    "SPEC_FILE",
    "RawTensor",
    "SafetensorsFile",
    "Snapshot",
    "SnapshotDescription",
    "SnapshotKind",
    "SnapshotWriter",
    "TensorSpec",
    "WrittenSnapshot",
    "build_from_folder",
    "check_config",
    "describe_snapshot",
    "iter_model_folder",
    "layer_of",
    "shard_name",
    "validate_adapter",
    "validate_identity",
    "validate_snapshot",
    "validate_transition",
    "write_snapshot",
]
