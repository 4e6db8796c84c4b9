"""Readiness without a cluster: each loader's own `/status` endpoint says what it serves."""

from __future__ import annotations

from typing import Any

import aiohttp

from hotload.sdk.outcomes import PublishError


async def loaders_ready(
    replicas: list[str], identity: str, min_fraction: float | None, last: dict[str, Any]
) -> dict[str, Any] | None:
    """{"replicas", "loaded", "loads"} once every loader (or `min_fraction` of them) serves
    `identity`, else None; what was seen goes into `last` (loaders that failed to load it are
    listed in its "failures")."""
    if not replicas:
        raise PublishError("wait_ready without a cluster needs replicas=[loader URLs]")
    loaded, failures, loads = 0, [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for url in replicas:
            try:
                async with http.get(url.rstrip("/") + "/status") as resp:
                    doc = await resp.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            if doc.get("identity") == identity:
                loaded += 1
                last_load = doc.get("last_load") or {}
                loads.append({"pod": url, "totalSeconds": last_load.get("total_seconds")})
            elif doc.get("state") == "failed" and doc.get("target_identity") == identity:
                failures.append({"pod": url, "message": doc.get("last_error", "")})
    total = len(replicas)
    last.update(replicas=total, loaded=loaded, failures=failures)
    need = total if min_fraction is None else min_fraction * total
    return {"replicas": total, "loaded": loaded, "loads": loads} if loaded >= need else None
