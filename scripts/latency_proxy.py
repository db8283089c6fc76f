"""A network in a box: a TCP proxy in front of a MongoDB server that adds round-trip latency.

Benchmarks on the embedded stand-in say little about a deployment: there the
database answers in milliseconds and the client is on the same host, where a
deployment pays a network hop per round trip and a server that answers in well
under a millisecond. This proxy runs in a process of its own (its CPU is not
the client's), reads the wire protocol's message frames and holds every reply
for the configured latency before passing it on, so each round trip costs what
it costs on a network. Per command it also records how long the server took
(request forwarded to reply received): a benchmark can then subtract the
stand-in's own time and see the wall time of a client facing a fast server
across that network.

Threads, not asyncio: asyncio's timers wait in whole milliseconds (epoll), too
coarse for a 0.2 ms round trip. A reply is held with a sleep, then a short spin.
`hello` exchanges (the driver's monitoring) are delayed too but not counted.
"""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from typing import Any

_OP_MSG = 2013
_MORE_TO_COME = 0x2
_SPIN_SECONDS = 0.0002
_NOT_COUNTED = frozenset({b"hello", b"ismaster", b"isMaster", b"endSessions"})


@dataclass(frozen=True)
class ProxyStats:
    """What passed through the proxy since the last reset (monitoring excluded)."""

    commands: int
    """Requests that got a reply: round trips."""
    server_seconds: float
    """Time during which at least one of them was at the server (loopback included): their
    server times summed when they come one at a time, overlaps counted once."""
    added_seconds: float
    """Latency the proxy actually added to them, summed."""

    def __sub__(self, other: ProxyStats) -> ProxyStats:
        return ProxyStats(
            self.commands - other.commands,
            self.server_seconds - other.server_seconds,
            self.added_seconds - other.added_seconds,
        )


def _read_frame(sock: socket.socket) -> bytes:
    header = _read_exactly(sock, 16)
    length = int.from_bytes(header[:4], "little")
    return header + _read_exactly(sock, length - 16)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, missing = [], size
    while missing:
        chunk = sock.recv(min(missing, 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _more_to_come(frame: bytes) -> bool:
    opcode = int.from_bytes(frame[12:16], "little")
    return opcode == _OP_MSG and bool(int.from_bytes(frame[16:20], "little") & _MORE_TO_COME)


def _command_name(frame: bytes) -> bytes:
    """The command of an OP_MSG request: the first key of its body (section kind 0)."""
    if int.from_bytes(frame[12:16], "little") != _OP_MSG or frame[20] != 0:
        return b""
    start = 21 + 4 + 1  # section kind, document length, element type
    return frame[start : frame.index(b"\0", start)]


def _hold_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > _SPIN_SECONDS:
        time.sleep(remaining - _SPIN_SECONDS)
    while time.perf_counter() < deadline:
        pass


class _Shared:
    """Counters shared with the parent process."""

    def __init__(self, context: Any) -> None:
        self.latency: Synchronized[float] = context.Value("d", 0.0)
        self.commands: Synchronized[int] = context.Value("q", 0)
        self.server_seconds: Synchronized[float] = context.Value("d", 0.0)
        self.added_seconds: Synchronized[float] = context.Value("d", 0.0)
        self._in_flight = 0
        self._busy_since = 0.0

    def forwarded(self, at: float) -> None:
        """A counted request reached the server."""
        with self.commands.get_lock():
            if self._in_flight == 0:
                self._busy_since = at
            self._in_flight += 1

    def answered(self, at: float) -> None:
        """Its reply came back: the time any command was at the server is added once, so
        commands sent side by side (from several threads) are not counted twice."""
        with self.commands.get_lock():
            self._in_flight -= 1
            if self._in_flight == 0:
                self.server_seconds.value += at - self._busy_since

    def record(self, added: float) -> None:
        with self.commands.get_lock():
            self.commands.value += 1
            self.added_seconds.value += added


def _pump(client: socket.socket, upstream: tuple[str, int], shared: _Shared) -> None:
    server = socket.create_connection(upstream)
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            request = _read_frame(client)
            counted = _command_name(request) not in _NOT_COUNTED
            if _more_to_come(request):
                server.sendall(request)
                continue
            if counted:
                shared.forwarded(time.perf_counter())
            server.sendall(request)
            while True:
                reply = _read_frame(server)
                received = time.perf_counter()
                if counted:
                    shared.answered(received)
                _hold_until(received + shared.latency.value)
                if counted:  # recorded before the reply leaves: the client sees it counted
                    shared.record(time.perf_counter() - received)
                    counted = False
                client.sendall(reply)
                if not _more_to_come(reply):
                    break
    except (ConnectionError, OSError):
        return
    finally:
        client.close()
        server.close()


def _serve(upstream: str, shared: _Shared, ports: Any) -> None:
    host, port = upstream.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    ports.send(listener.getsockname()[1])
    while True:
        client, _ = listener.accept()
        threading.Thread(
            target=_pump, args=(client, (host, int(port)), shared), daemon=True
        ).start()


class LatencyProxy:
    """Starts the proxy process in front of `upstream` ("host:port"); `uri` connects through it."""

    def __init__(self, upstream: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._shared = _Shared(context)
        receiver, sender = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_serve, args=(upstream, self._shared, sender), daemon=True
        )
        self._process.start()
        port = receiver.recv()
        self.uri = f"mongodb://127.0.0.1:{port}/?directConnection=true"

    @property
    def latency_ms(self) -> float:
        return self._shared.latency.value * 1e3

    @latency_ms.setter
    def latency_ms(self, value: float) -> None:
        self._shared.latency.value = value / 1e3

    def stats(self) -> ProxyStats:
        shared = self._shared
        with shared.commands.get_lock():
            return ProxyStats(
                shared.commands.value, shared.server_seconds.value, shared.added_seconds.value
            )

    def close(self) -> None:
        self._process.terminate()
        self._process.join(10)


def check(latencies: tuple[float, ...] = (0.0, 0.2, 1.0, 5.0), calls: int = 50) -> None:
    """Print what the proxy adds in front of the embedded wire server: per setting, the
    latency it measured itself adding and the median round trip of a `find_one`."""
    import statistics

    from pymongo import MongoClient

    from scripts.wire_server import start_wire_server

    server, uri = start_wire_server()
    proxy = LatencyProxy(uri.split("//", 1)[1].split("/", 1)[0])
    client: MongoClient[dict[str, Any]] = MongoClient(proxy.uri)
    try:
        client.proxy_check.probe.insert_one({"a": 1})
        for latency in latencies:
            proxy.latency_ms = latency
            before, walls = proxy.stats(), []
            for _ in range(calls):
                started = time.perf_counter()
                client.proxy_check.probe.find_one({"a": 1})
                walls.append(time.perf_counter() - started)
            seen = proxy.stats() - before
            print(
                f"set {latency:g} ms: added {seen.added_seconds / seen.commands * 1e3:.3f} ms, "
                f"server {seen.server_seconds / seen.commands * 1e3:.3f} ms, find_one "
                f"{statistics.median(walls) * 1e3:.3f} ms (median of {calls})"
            )
        client.drop_database("proxy_check")
    finally:
        client.close()
        proxy.close()
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)


if __name__ == "__main__":
    check()
