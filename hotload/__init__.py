"""hotload: keep a fleet of inference replicas on the freshest policy.

The trainer's entry point is `hotload.Publisher`; the building blocks live in the subpackages
(`snapshot`, `arc`, `bucket`, `ledger`, `sdk`, `engine`, `kube`, `api`). Names are imported on
first use so that `import hotload` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hotload.errors import HotloadError
    from hotload.sdk import Publisher, PublishHandle, ReadyReport

__all__ = ["HotloadError", "PublishHandle", "Publisher", "ReadyReport", "__version__"]


def __getattr__(name: str) -> Any:
    if name in {"Publisher", "PublishHandle", "ReadyReport"}:
        import hotload.sdk

        return getattr(hotload.sdk, name)
    if name == "HotloadError":
        from hotload.errors import HotloadError

        return HotloadError
    raise AttributeError(f"module 'hotload' has no attribute {name!r}")
