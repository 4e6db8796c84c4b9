"""The engine front's serving gate: the loader's answer to "may the engine answer inference?"
(`GET /serving` on the loader), read every second and kept between reads.

The loader closes it while its engine restarted on weights older than the replica served
before and has not been patched forward yet (`hotload_sidecar.serving_gate`). A loader that
cannot be read (restarting) leaves the last answer in force: its restart says nothing about
the engine's weights, and inference must not stop with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

log = logging.getLogger("hotload.front")


class ServingGate:
    """Polls `url` every `period` seconds; `open` and `reason` are the last answer."""

    def __init__(self, url: str, period: float = 1.0, timeout: float = 2.0) -> None:
        self.url = url
        self.period = period
        self.timeout = timeout
        self.open = True
        self.reason = ""
        self._readable = True
        self._client: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read the gate once, then keep reading it in the background."""
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout), trust_env=False
        )
        await self.poll()
        self._task = asyncio.create_task(self._run(), name="serving-gate")

    async def aclose(self) -> None:
        """Stop reading."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.poll()

    async def poll(self) -> None:
        """Read the gate once: 200 opens it, 503 closes it with the loader's reason; anything
        else keeps the last answer."""
        assert self._client is not None, "ServingGate.start() was not called"
        try:
            async with self._client.get(self.url) as resp:
                status = resp.status
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            self._unreadable(f"{type(exc).__name__}: {exc}")
            return
        if status == 200:
            self._set(True, "")
        elif status == 503 and isinstance(body, dict) and body.get("serve") is False:
            self._set(False, str(body.get("reason") or "the loader holds the engine"))
        else:
            self._unreadable(f"HTTP {status}: {str(body)[:200]}")
            return
        if not self._readable:
            log.info("the serving gate at %s answers again", self.url)
            self._readable = True

    def _unreadable(self, why: str) -> None:
        if self._readable:
            state = "open" if self.open else f"closed ({self.reason})"
            log.warning(
                "cannot read the serving gate at %s (%s); it stays %s until the loader answers",
                self.url,
                why,
                state,
            )
            self._readable = False

    def _set(self, open_: bool, reason: str) -> None:
        if open_ != self.open:
            if open_:
                log.info("the loader lets the engine answer again: inference passes")
            else:
                log.warning("inference held: %s", reason)
        self.open, self.reason = open_, reason
