"""Backends as a fixture parameter: every storage test runs on each of them.

- `mongomock`: mongomock-motor, in-process (fast, default).
- `wire`: mongoeco's MongoDB wire server on a free port, through PyMongo's AsyncMongoClient.
- `wire-motor`: the same server through a Motor client, as existing runtimes hold.
- `uri`: the server at MONGODB_URI, only when that variable is set.
The embedded default's own engine (mongoeco on a SQLite file, what `python -m app` runs) is
not a backend of every test: `sqlite_wire_uri` serves it to the tests that check the store's
answers there (`tests/test_embedded.py`).
Wire backends need Python 3.13+ (mongoeco); `-m "not wire"` selects the fast suite.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import bson
import pytest
from pymongo import AsyncMongoClient, monitoring

from agent_store import TurnRules
from agent_store.core import utc_now

MONGODB_URI = os.environ.get("MONGODB_URI")

RETRY_WRITES = os.environ.get("RETRY_WRITES", "on")
"""Whether the wire backends' clients, and the clients the tests behind a faulty network build,
have PyMongo's retryable writes on (`on`, the driver's default, what a runtime's own client
has) or off (`off`, what the product's own client has: `client_options`). Every write of the
store is safe to send again without the driver's help: `RETRY_WRITES=off` runs the storage
tests so (docs/RELIABILITY.md)."""
WIRE_CLIENT_OPTIONS: dict[str, Any] = {"retryWrites": RETRY_WRITES == "on"}
"""The options of every wire client a storage test builds, beside its own."""


def _backend_params(*, wire_only: bool = False) -> list[Any]:
    """Every backend, wire ones marked `wire` (on Python 3.11, `-m "not wire"` leaves them out)."""
    params: list[Any] = [] if wire_only else ["mongomock"]
    params += [
        pytest.param("wire", marks=pytest.mark.wire),
        pytest.param("wire-motor", marks=[pytest.mark.wire, pytest.mark.motor]),
    ]
    if MONGODB_URI:
        params.append(pytest.param("uri", marks=pytest.mark.wire))
    return params


COUNTED = TurnRules(claim_grace=timedelta(minutes=10))
"""Rules for a test that counts a turn's round trips: a turn slower than `claim_grace` from its
reservation to its insert looks its conversation up once more, and on a loaded machine a turn
may take a second. No turn here takes ten minutes, so the count is the fast turn's, whatever the
machine's load. (Tests of that lookup set a short grace of their own.)"""


class CommandLog(monitoring.CommandListener):
    """Counts the commands a client sends: one per database round trip."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in ("hello", "ismaster", "isMaster", "ping", "endSessions"):
            self.names.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def clear(self) -> None:
        self.names.clear()


class ReplyBatches(monitoring.CommandListener):
    """The size in bytes of each document of each reply batch (`find`, `aggregate`,
    `getMore`) a client receives: what one reply of the server holds at once."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        cursor = event.reply.get("cursor")
        if isinstance(cursor, dict):
            batch = cursor.get("firstBatch", cursor.get("nextBatch")) or []
            self.batches.append([len(bson.encode(document)) for document in batch])

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def past(self, limit: int) -> list[list[int]]:
        """The batches holding more than `limit` bytes of documents, and more than one."""
        return [batch for batch in self.batches if len(batch) > 1 and sum(batch) > limit]


@dataclass
class Backend:
    name: str
    db: Any
    commands: CommandLog | None = None
    """Commands sent, on backends that speak the wire protocol."""
    lacks: dict[str, str] = field(default_factory=dict)
    """Features this backend does not have, with the reason."""

    def skip_if_lacking(self, feature: str) -> None:
        if feature in self.lacks:
            pytest.skip(f"{self.name}: {self.lacks[feature]}")


WIRE_FIXTURES = {"wire_uri", "sqlite_wire_uri", "database", "running", "big_database"}
"""Fixtures that need a wire server: a test using one is marked `wire` by itself."""


MOTOR_MATRIX = os.environ.get("MOTOR_MATRIX", "off")
"""Whether the storage tests run on `wire-motor` as well: `off` (the default, what `make test`
runs) or `all` (`make test-motor`, which CI runs after `make test`). Motor wraps PyMongo's
synchronous driver in threads, so a Motor handle sends the same commands as the `wire`
backend's client; what it can break is the calls (their names, what they return, how
cursors and GridFS are driven), and every storage test checks those through Motor in its own
run rather than doubling the time of every `make test`."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if MOTOR_MATRIX not in ("off", "all"):
        raise pytest.UsageError(f"MOTOR_MATRIX must be off or all, not {MOTOR_MATRIX!r}")
    if RETRY_WRITES not in ("on", "off"):
        raise pytest.UsageError(f"RETRY_WRITES must be on or off, not {RETRY_WRITES!r}")
    kept: list[pytest.Item] = []
    left: list[pytest.Item] = []
    for item in items:
        if WIRE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.wire)
        on_motor = item.get_closest_marker("motor") is not None
        (left if on_motor and MOTOR_MATRIX == "off" else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.fixture(scope="session")
def wire_uri() -> Iterator[str]:
    """mongoeco's wire server, in memory, for the whole test session."""
    from agent_store.embedded import ServerThread

    server = ServerThread()
    yield server.start()
    server.stop()


@pytest.fixture(scope="session")
def sqlite_wire_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """mongoeco's wire server on a SQLite file, as `python -m app` starts it by default."""
    from agent_store.embedded import ServerThread

    server = ServerThread(tmp_path_factory.mktemp("embedded"))
    yield server.start()
    server.stop()


@pytest.fixture
def database(wire_uri: str) -> Iterator[Any]:
    """A fresh database on the wire server through the synchronous driver (the migration's)."""
    from pymongo import MongoClient

    client: MongoClient[dict[str, Any]] = MongoClient(wire_uri, tz_aware=True)
    name = f"sync_{uuid.uuid4().hex[:10]}"
    yield client[name]
    client.drop_database(name)
    client.close()


@pytest.fixture(
    params=[
        pytest.param("AsyncMongoClient", marks=pytest.mark.wire),
        pytest.param("MongoClient", marks=pytest.mark.wire),
        pytest.param("AsyncIOMotorClient", marks=pytest.mark.wire),
    ]
)
def client(request: pytest.FixtureRequest, wire_uri: str) -> Iterator[Any]:
    """A client of the wire server (not a database): PyMongo's async and sync ones, Motor's."""
    from motor.motor_asyncio import AsyncIOMotorClient
    from pymongo import MongoClient

    kinds: dict[str, Any] = {
        "AsyncMongoClient": AsyncMongoClient,
        "MongoClient": MongoClient,
        "AsyncIOMotorClient": AsyncIOMotorClient,
    }
    opened = kinds[request.param](wire_uri)
    yield opened
    if isinstance(opened, MongoClient):
        opened.close()


async def _open(name: str, request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    db_name = f"test_{uuid.uuid4().hex[:12]}"
    if name == "mongomock":
        from mongomock_motor import AsyncMongoMockClient

        no_text = "mongomock does not implement $text"
        yield Backend(
            name,
            AsyncMongoMockClient(tz_aware=True)[db_name],
            lacks={"text_search": no_text, "text_ranking": no_text},
        )
        return
    uri = MONGODB_URI if name == "uri" else request.getfixturevalue("wire_uri")
    commands = CommandLog()
    lacks = {} if name == "uri" else {"text_ranking": "mongoeco sorts textScore lowest first"}
    if name == "wire-motor":
        from motor.motor_asyncio import AsyncIOMotorClient

        client: Any = AsyncIOMotorClient(
            uri, tz_aware=True, event_listeners=[commands], **WIRE_CLIENT_OPTIONS
        )
    else:
        client = AsyncMongoClient(
            uri, tz_aware=True, event_listeners=[commands], **WIRE_CLIENT_OPTIONS
        )
    try:
        yield Backend(name, client[db_name], commands, lacks)
    finally:
        await client.drop_database(db_name)
        result = client.close()
        if asyncio.iscoroutine(result):
            await result


@pytest.fixture(params=_backend_params())
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each storage test runs once per backend."""
    async for opened in _open(request.param, request):
        yield opened


@pytest.fixture(params=_backend_params(wire_only=True))
async def wire_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Backends that speak the wire protocol, where round trips can be counted."""
    async for opened in _open(request.param, request):
        yield opened


class StoreClocks:
    """Every clock the store reads (`utc_now()` and `time.monotonic()` in each of its modules)
    moved on at once by `wait(seconds)`: what a real wait that long does to its judgments
    (a block passing `abandon_after`, a writer stalled past its margin), without the wait.
    Default factories keep the real time: a message's `created_at` when the caller gives none,
    and a fork's `read_at` (`ForkRead`), which judges blocks: a test forking after the time
    passed waits for it instead."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.ahead = 0.0
        clocks = self

        class _Time:
            """The `time` module, its `monotonic()` moved on."""

            def __getattr__(self, name: str) -> Any:
                return getattr(time, name)

            @staticmethod
            def monotonic() -> float:
                return time.monotonic() + clocks.ahead

        def now() -> datetime:
            return utc_now() + timedelta(seconds=clocks.ahead)

        for name, module in list(sys.modules.items()):
            if name.split(".")[0] != "agent_store":
                continue
            if getattr(module, "utc_now", None) is utc_now:
                patch.setattr(module, "utc_now", now)
            if getattr(module, "time", None) is time:
                patch.setattr(module, "time", _Time())

    def wait(self, seconds: float) -> None:
        """Let `seconds` pass on every clock of the store."""
        self.ahead += seconds


@pytest.fixture
def clocks() -> Iterator[StoreClocks]:
    """The store's clocks, moved on by `clocks.wait(seconds)` instead of sleeping; patched apart
    from `monkeypatch`, so a test's `monkeypatch.undo()` keeps the time that passed."""
    with pytest.MonkeyPatch.context() as patch:
        yield StoreClocks(patch)


def count_documents_read(monkeypatch: pytest.MonkeyPatch, collection: Any) -> list[int]:
    """How many documents each `find(...).to_list()` on `collection` returns, in order, from
    now on: what a bounded read holds at once."""
    read: list[int] = []
    real_find = collection.find

    def counted(*args: Any, **kwargs: Any) -> Any:
        cursor = real_find(*args, **kwargs)
        real_to_list = cursor.to_list

        async def to_list(length: Any = None) -> list[Any]:
            docs = await real_to_list(length)
            read.append(len(docs))
            return docs

        cursor.to_list = to_list
        return cursor

    monkeypatch.setattr(collection, "find", counted)
    return read


def after_its_first_batch(
    monkeypatch: pytest.MonkeyPatch, store: Any, change: Callable[[str], Awaitable[Any]]
) -> None:
    """Run `change(conversation_id)` once, as the first streamed read (`stream_transcript`)
    read on past its first batch is asked for its next: where an export has paired that batch
    with the conversation's summary, and sent both."""
    read, pending = store.stream_transcript, [change]

    def hooked(conversation_id: str, **kwargs: Any) -> Any:
        async def batches() -> Any:
            stream = read(conversation_id, **kwargs)
            try:
                yield await anext(stream)
                if pending:
                    await pending.pop()(conversation_id)
                async for batch in stream:
                    yield batch
            finally:
                await stream.aclose()

        return batches()

    monkeypatch.setattr(store, "stream_transcript", hooked)
