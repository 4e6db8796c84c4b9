"""The real API server's audit log (JSON lines, `support.cluster.AUDIT_POLICY` or a policy of a
benchmark's own): who sent which request when, read on from where the last read stopped."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

JSON = dict[str, Any]


class AuditLog:
    """One audit log file; `read()` returns the events appended since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.events: list[JSON] = []

    def read(self) -> list[JSON]:
        """Events appended since the last read (every one is also kept in `events`)."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        new = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        self.events.extend(new)
        return new

    def skip(self) -> None:
        """Forget what is in the log so far (a test reads only its own requests)."""
        self.read()
        self.events.clear()


def seconds(event: JSON, key: str = "requestReceivedTimestamp") -> float:
    """An audit timestamp as seconds since the epoch."""
    return datetime.fromisoformat(str(event[key]).replace("Z", "+00:00")).timestamp()


def kind(event: JSON) -> str:
    """`verb resource[/subresource]` of a request."""
    ref = event.get("objectRef") or {}
    resource = ref.get("resource") or str(event.get("requestURI", "?")).split("?")[0]
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return f"{event.get('verb', '?')} {resource}"


def sender(event: JSON) -> str:
    """Which operator replica sent a request (its identity, from the user agent
    `hotload-operator (IDENTITY)`), else the user agent's product ("kopf", "hotload", ...)."""
    agent = str(event.get("userAgent") or "")
    found = re.match(r"hotload-operator \((.+)\)", agent)
    return found.group(1) if found else agent.split("/", maxsplit=1)[0] or "?"


def namespace(event: JSON) -> str:
    """The namespace of the object a request was about ("" when none)."""
    return str((event.get("objectRef") or {}).get("namespace") or "")


def is_status_write(event: JSON) -> bool:
    """Whether the request wrote a HotLoadDeployment's or a Snapshot's status."""
    ref = event.get("objectRef") or {}
    return (
        event.get("verb") in ("patch", "update")
        and ref.get("subresource") == "status"
        and ref.get("resource") in ("hotloaddeployments", "snapshots")
    )


#: Verbs that change something on the server.
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")


def is_write(event: JSON) -> bool:
    """Whether the request asked the server to change something (whatever its answer)."""
    return event.get("verb") in WRITE_VERBS


def code(event: JSON) -> int:
    """The HTTP status the server answered (0 when the log has none)."""
    return int((event.get("responseStatus") or {}).get("code") or 0)


def replica(event: JSON) -> str:
    """Which operator replica sent a request, its own or its kopf's (the identity in
    `hotload-operator (IDENTITY)` anywhere in the user agent); "" for anyone else."""
    found = re.search(r"hotload-operator \(([^()]+)\)", str(event.get("userAgent") or ""))
    return found.group(1) if found else ""
