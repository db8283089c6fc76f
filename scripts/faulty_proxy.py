"""A fake network at the edge: a TCP proxy in front of a MongoDB server that drops connections.

It reads the wire protocol's message frames, so it can drop a connection at a
chosen point of an exchange:
- `before`: the request never reaches the server (nothing applied);
- `during`: the server applies the request, its reply is lost;
- `after`: the reply arrives, then the connection dies (the next request fails).
Decisions come from a seeded generator, so a run can be repeated.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

Fault = Literal["before", "during", "after"]
FAULTS: tuple[Fault, ...] = ("before", "during", "after")
_MORE_TO_COME = 0x2
_OP_MSG = 2013


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(16)
    length = int.from_bytes(header[:4], "little")
    return header + await reader.readexactly(length - 16)


def _more_to_come(message: bytes) -> bool:
    opcode = int.from_bytes(message[12:16], "little")
    return opcode == _OP_MSG and bool(int.from_bytes(message[16:20], "little") & _MORE_TO_COME)


def _command_name(message: bytes) -> str | None:
    """The command an OP_MSG request sends (its body's first key), None for any other message."""
    if int.from_bytes(message[12:16], "little") != _OP_MSG or message[20] != 0:
        return None
    name_starts = 21 + 4 + 1  # the body section's kind, its document's length, the type byte
    return message[name_starts : message.index(0, name_starts)].decode()


@dataclass
class FaultyProxy:
    """Forwards to `upstream` ("host:port"), dropping a connection on a share of requests."""

    upstream: str
    drop_rate: float = 0.0
    seed: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    requests: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._server: asyncio.Server | None = None
        self._forced: list[tuple[str, Fault]] = []

    def drop_next(self, command: str, fault: Fault = "during") -> None:
        """Drop the connection of the next request for `command` (`"findAndModify"`), whichever
        connection sends it, at `fault`, whatever `drop_rate` says: one dropped connection,
        exactly, and never a monitor's (`hello`)."""
        self._forced.append((command, fault))

    async def start(self) -> str:
        """Listen on a free local port; returns a connection string for the proxy."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"mongodb://127.0.0.1:{port}/?directConnection=true"

    async def close(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
            self._server.close_clients()
            await self._server.wait_closed()

    def _fault(self, request: bytes) -> Fault | None:
        self.requests += 1
        if self._forced and self._forced[0][0] == _command_name(request):
            return self._forced.pop(0)[1]
        if self._rng.random() >= self.drop_rate:
            return None
        return self._rng.choice(FAULTS)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        host, port = self.upstream.split(":")
        server_r, server_w = await asyncio.open_connection(host, int(port))
        try:
            while True:
                request = await _read_message(client_r)
                fault = self._fault(request)
                if fault == "before":
                    self.dropped[fault] += 1
                    return
                server_w.write(request)
                await server_w.drain()
                if _more_to_come(request):
                    continue
                while True:
                    reply = await _read_message(server_r)
                    if fault == "during":
                        self.dropped[fault] += 1
                        return
                    client_w.write(reply)
                    await client_w.drain()
                    if not _more_to_come(reply):
                        break
                if fault == "after":
                    self.dropped[fault] += 1
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            for writer in (client_w, server_w):
                writer.close()
