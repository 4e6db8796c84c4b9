"""A TCP relay that can be cut off from its server and healed again: a network partition between
one client (an operator replica) and the API server, with TCP's own semantics for what the
partition held.

`Partition(host, port)` relays every connection made to `partition.port` to the server, bytes
unchanged (TLS passes through, so the server's certificate still matches). `cut()` starts the
partition: from then on nothing reaches either side; what a side sends meanwhile is held, as a
sender's kernel holds unacknowledged bytes and retransmits them. `heal()` ends it: held bytes
are delivered, as TCP's retransmissions would, except on a connection its client reset (RST:
`SO_LINGER` 0, or a close with unread data), whose kernel dropped them. A client that merely
closed (FIN) still has its held bytes delivered first: a graceful close sends what was queued.

So a request written into a socket before the partition, and not aborted with a reset, reaches
the server when the partition heals, however late: the case a deposed leader must not allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml


@dataclass
class _Leg:
    """One direction of one relayed connection."""

    writer: asyncio.StreamWriter
    held: list[bytes] = field(default_factory=list)
    #: The sending side closed (FIN) while its bytes were held: close after delivering them.
    ended: bool = False


@dataclass
class _Link:
    """One relayed connection: client -> server and server -> client."""

    up: _Leg
    down: _Leg
    #: The client reset the connection: its held bytes never reach the server.
    reset: bool = False


class Partition:
    """A relay to `host:port` on a loopback port of its own (`port`), in a thread of its own;
    `cut()` and `heal()` from any thread (see the module doc)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.server_port = host, port
        self._loop = asyncio.new_event_loop()
        self._links: list[_Link] = []
        self._cut = False
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]
        #: Held bytes delivered and dropped at the last `heal()`.
        self.delivered = 0
        self.dropped = 0

    def _call(self, coro: object) -> asyncio.Server:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)  # type: ignore[arg-type]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.server_port)
        except OSError:
            writer.close()
            return
        link = _Link(up=_Leg(up_writer), down=_Leg(writer))
        self._links.append(link)
        await asyncio.gather(
            self._pump(reader, link.up, link, client=True),
            self._pump(up_reader, link.down, link, client=False),
            return_exceptions=True,
        )
        with contextlib.suppress(ValueError):
            self._links.remove(link)

    async def _pump(
        self, source: asyncio.StreamReader, leg: _Leg, link: _Link, *, client: bool
    ) -> None:
        while True:
            try:
                data = await source.read(65536)
            except ConnectionResetError:
                if client:
                    link.reset = True
                if not self._cut:
                    _abort(link.up.writer if client else link.down.writer)
                return
            if not data:
                if self._cut:
                    leg.ended = True
                else:
                    with contextlib.suppress(OSError):
                        leg.writer.write_eof()
                return
            if self._cut:
                leg.held.append(data)
            else:
                leg.writer.write(data)

    def cut(self) -> None:
        """Start the partition: nothing reaches either side until `heal()`."""
        self._loop.call_soon_threadsafe(setattr, self, "_cut", True)

    def heal(self) -> None:
        """End the partition: deliver what was held, except what reset connections sent."""

        async def heal() -> None:
            self._cut = False
            for link in list(self._links):
                for leg, lost in ((link.up, link.reset), (link.down, False)):
                    size = sum(len(b) for b in leg.held)
                    if lost:
                        self.dropped += size
                        _abort(leg.writer)
                    else:
                        self.delivered += size
                        for data in leg.held:
                            leg.writer.write(data)
                        if leg.ended:
                            with contextlib.suppress(OSError):
                                leg.writer.write_eof()
                    leg.held.clear()

        asyncio.run_coroutine_threadsafe(heal(), self._loop).result(30)

    def close(self) -> None:
        """Stop relaying and close every connection."""

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for link in self._links:
                _abort(link.up.writer)
                _abort(link.down.writer)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> Partition:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def partitioned_kubeconfig(kubeconfig: Path, into: Path) -> Partition:
    """A `Partition` in front of the API server `kubeconfig` names, and at `into` a copy of
    the kubeconfig whose server is the partition (for the replica to cut off)."""
    doc = yaml.safe_load(kubeconfig.read_text())
    server = urlsplit(doc["clusters"][0]["cluster"]["server"])
    partition = Partition(server.hostname or "127.0.0.1", server.port or 443)
    for cluster in doc["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{partition.port}"
    into.write_text(yaml.safe_dump(doc))
    return partition


def _abort(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.transport.abort()
