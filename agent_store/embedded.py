"""The embedded default: a local MongoDB-compatible server on a SQLite file.

With `MONGODB_URI` unset, the service starts mongoeco's wire-protocol server
and talks to it with the real driver over TCP, so it runs on a machine with
nothing else installed. It is for development and demos: it is single-process,
slow on large collections, and its full-text ranking differs from MongoDB's. Its
SQLite engine compares integers of different widths by type; the store writes every
integer as an int64, and `_Int64Comparisons` sends the integers its queries compare as
int64s too, so they compare by value (an int32 another client stored does not match).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from bson import BSON, Int64

from agent_store.core import Unsupported

if sys.platform != "win32":
    import fcntl

DATABASE_FILE = "agent_store.sqlite3"
"""The embedded server's SQLite file, in its data directory."""
URI_FILE = "embedded-mongodb.json"
"""Where a running embedded server publishes its URI (and its process id), in its data
directory, so other processes (`python -m migrations`) reach the same data. A server started
for one command (`embedded_mongodb(publish=False)`: a migration's own) publishes none: it ends
with that command, under whoever would use it."""


LOCK_FILE = "embedded-mongodb.lock"
"""Locked by the embedded server running on its data directory, for as long as it runs: a
second one (another worker of `uvicorn --workers`, gunicorn's) is refused."""


class DataDirectoryInUse(RuntimeError):
    """Another process runs the embedded server on the data directory: it belongs to one."""

    def __init__(self, data_dir: Path, holder: str) -> None:
        super().__init__(
            f"the data directory {data_dir}/ is held by process {holder}, another "
            "process running its embedded server (a running service, a migration, a second "
            "`make run`): stop it or let it end, or give this one another data directory "
            "(AGENT_STORE_DATA_DIR, or the migration's --data-dir), or a MongoDB server in "
            "MONGODB_URI (which several worker processes, uvicorn or gunicorn --workers, need)"
        )
        self.holder = holder


@contextmanager
def _data_directory_held(data_dir: Path) -> Iterator[None]:
    """Hold `data_dir` for one embedded server (an exclusive `flock` of `LOCK_FILE`, which
    the system releases when its process ends, however it ends); DataDirectoryInUse when
    another server holds it. Where there is no `flock` (Windows), nothing is held."""
    if sys.platform == "win32":
        yield
        return
    with ExitStack() as held:
        try:
            lock = held.enter_context(_locked(data_dir))
        except BlockingIOError:
            holder = (data_dir / LOCK_FILE).read_text().strip() or "unknown"
            raise DataDirectoryInUse(data_dir, holder) from None
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        yield


@contextmanager
def _locked(data_dir: Path) -> Iterator[IO[str]]:
    """The data directory's lock file, locked (`flock`, exclusive, without waiting: a
    `BlockingIOError` when another process holds it) until the block ends."""
    with (data_dir / LOCK_FILE).open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield lock
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _held_by_a_server(data_dir: Path, pid: int) -> bool:
    """Whether an embedded server runs on `data_dir`: its lock is held (taken here, without
    waiting, and released at once, when nobody holds it). Where there is no `flock`
    (Windows), whether the process `pid` that published its URI is alive."""
    if sys.platform == "win32":
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, under another user
        return True
    try:
        with _locked(data_dir):
            return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def published_uri(data_dir: Path) -> str | None:
    """The URI a running embedded server published in `data_dir`; None when there is none or
    it is stale: nobody holds the data directory's lock (a server stopped by a signal leaves
    its file behind, and its process id may be another process's by now)."""
    try:
        published = json.loads((data_dir / URI_FILE).read_text())
        uri, pid = str(published["uri"]), int(published["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return uri if _held_by_a_server(data_dir, pid) else None


def _publish(data_dir: Path, uri: str) -> None:
    (data_dir / URI_FILE).write_text(json.dumps({"uri": uri, "pid": os.getpid()}))


def _withdraw(data_dir: Path, uri: str) -> None:
    with suppress(OSError, ValueError, KeyError):
        if json.loads((data_dir / URI_FILE).read_text())["uri"] == uri:
            (data_dir / URI_FILE).unlink()


_CURSOR_ID_LISTS = ("cursorsKilled", "cursorsNotFound", "cursorsAlive", "cursorsUnknown")


def _plain_cursor_id(value: Any) -> Any:
    """A cursor id a client sent, as the int mongoeco's cursor store keys cursors by."""
    return getattr(value, "value", value)  # mongoeco decodes a BSON int64 to `BsonInt64(value)`


def _int64(value: Any) -> Any:
    return Int64(value) if isinstance(value, int) and not isinstance(value, bool) else value


class _Int64CursorIds:
    """mongoeco's command executor, with cursor ids as the wire protocol defines them: int64.

    mongoeco numbers cursors with plain Python ints, which BSON writes as int32
    when they fit; MongoDB sends every cursor id as an int64, and the official
    Node.js driver reads `cursor.id` only as one (an int32 there fails every
    `find`, `aggregate` and `listCollections` with "BSON element "id" is
    missing"). PyMongo accepts either and echoes what it got, so it never
    noticed. In turn a client sends `getMore` and `killCursors` ids as int64,
    which mongoeco's validation refuses; they are narrowed to plain ints here.
    """

    def __init__(self, executor: Any) -> None:
        self._executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    def _build_request_context(self, body: dict[str, Any], **options: Any) -> Any:
        body = dict(body)
        if "getMore" in body:
            body["getMore"] = _plain_cursor_id(body["getMore"])
        if "killCursors" in body and isinstance(body.get("cursors"), list):
            body["cursors"] = [_plain_cursor_id(i) for i in body["cursors"]]
        return self._executor._build_request_context(body, **options)

    async def execute_prepared(self, context: Any) -> Any:
        reply = await self._executor.execute_prepared(context)
        cursor = reply.get("cursor") if isinstance(reply, dict) else None
        if isinstance(cursor, dict) and "id" in cursor:
            cursor["id"] = _int64(cursor["id"])
        for key in _CURSOR_ID_LISTS:
            if isinstance(reply, dict) and isinstance(reply.get(key), list):
                reply[key] = [_int64(i) for i in reply[key]]
        return reply


REPLY_BATCH_BYTES = 16 * 1024 * 1024
"""The most bytes of documents one reply of the embedded server holds, MongoDB's rule: a
batch ends before the document that would take it past 16 MiB (its first document always
goes), so a reply stays far under the server's `maxMessageSizeBytes` (48 MB)."""


def _documents_within_bytes(batch: list[Any]) -> int:
    """How many of `batch`'s first documents one reply holds (`REPLY_BATCH_BYTES`), sized as
    mongoeco encodes them; at least one."""
    from mongoeco.wire.bson_bridge import encode_wire_value

    held = 0
    for count, document in enumerate(batch):
        held += len(BSON.encode(encode_wire_value(document)))
        if count and held > REPLY_BATCH_BYTES:
            return count
    return len(batch)


def _cap_reply_batches(server: Any) -> None:
    """Give mongoeco's cursor store MongoDB's bound on a reply batch, in bytes.

    mongoeco answers a `find`, an `aggregate` or a `getMore` with every document asked for
    (all of them when no `batchSize` is given) in one reply: past 48 MB, more than the
    `maxMessageSizeBytes` it advertises, the driver refuses the reply ("Message length … is
    larger than server max message size"), however the caller reads the cursor. MongoDB ends
    a batch at 16 MiB and keeps the rest for the next `getMore`; so does this store. The one
    store is shared by the server, its executor and their handlers: its class is swapped in
    place (a third seam into mongoeco's internals, beside the executor and the listener)."""
    from mongoeco.wire.cursors import WireCursorStore

    class _RepliesWithinBytes(WireCursorStore):
        def materialize_command_result(
            self, command_document: dict[str, Any], result: dict[str, Any], **options: Any
        ) -> dict[str, Any]:
            cursor = result.get("cursor")
            batch = cursor.get("firstBatch") if isinstance(cursor, dict) else None
            if not isinstance(batch, list) or len(batch) < 2:
                return super().materialize_command_result(command_document, result, **options)
            asked = self._resolve_batch_size(command_document) or len(batch)
            held = _documents_within_bytes(batch[: min(asked, len(batch))])
            if held >= len(batch):
                return super().materialize_command_result(command_document, result, **options)
            # The store keeps what is past `batchSize` for the `getMore`s: ask it for `held`.
            capped = {**command_document, "batchSize": held}
            return super().materialize_command_result(capped, result, **options)

        def get_more(self, command_document: dict[str, Any], **options: Any) -> dict[str, Any]:
            cursor_id = command_document.get("getMore")
            state = self._state.get(cursor_id) if isinstance(cursor_id, int) else None
            if state is None:
                return super().get_more(command_document, **options)
            asked = command_document.get("batchSize") or len(state.remaining_batch)
            held = _documents_within_bytes(state.remaining_batch[:asked])
            return super().get_more({**command_document, "batchSize": held}, **options)

    server._cursor_store.__class__ = _RepliesWithinBytes


_COMPARED = frozenset({"$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$all"})
"""Query operators whose operand is a value compared with the stored one."""
_FILTERS = frozenset({"$and", "$or", "$nor"})
_FILTER_KEYS = {
    "find": ("filter",),
    "count": ("query",),
    "distinct": ("query",),
    "findAndModify": ("query",),
    "findandmodify": ("query",),
}
_STATEMENTS = {"update": "updates", "delete": "deletes"}
_NESTED_PIPELINES = {"$lookup": "pipeline", "$unionWith": "pipeline"}


class _Int64Comparisons(_Int64CursorIds):
    """The executor for mongoeco's SQLite engine, with every integer a query compares as an
    int64.

    mongoeco 4.11's SQLite engine compares an int32 with an int64 by their types, not their
    values: on `seq` stored as an Int64, `{seq: 5}` (PyMongo sends a Python int as an int32)
    matched nothing and `{seq: {$gt: 31}}` everything. The store writes every integer as an
    Int64 (`tests/test_stored_shapes.py`), so widening the operands its filters compare (in
    `find`, `count`, `distinct`, `findAndModify`, the statements of `update` and `delete`, and
    `$match` stages) makes them compare by value. Nothing else is touched: limits, batch
    sizes, sorts, projections, `$size`, `$type`, `$mod`, `$expr` (which the engine evaluates
    by value) and booleans stay what they were. The in-memory engine compares by value and is
    left alone.
    """

    def _build_request_context(self, body: dict[str, Any], **options: Any) -> Any:
        return super()._build_request_context(_widened_command(body), **options)


def _widened_command(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with the integers its filters compare as int64s (`_Int64Comparisons`)."""
    if not body:
        return body
    name = next(iter(body))
    body = dict(body)
    for key in _FILTER_KEYS.get(name, ()):
        if isinstance(body.get(key), dict):
            body[key] = _widened_filter(body[key])
    statements = _STATEMENTS.get(name)
    if statements is not None and isinstance(body.get(statements), list):
        body[statements] = [_widened_statement(s) for s in body[statements]]
    if name == "aggregate" and isinstance(body.get("pipeline"), list):
        body["pipeline"] = _widened_pipeline(body["pipeline"])
    return body


def _widened_statement(statement: Any) -> Any:
    if isinstance(statement, dict) and isinstance(statement.get("q"), dict):
        return {**statement, "q": _widened_filter(statement["q"])}
    return statement


def _widened_pipeline(pipeline: list[Any]) -> list[Any]:
    stages = []
    for stage in pipeline:
        if isinstance(stage, dict) and isinstance(stage.get("$match"), dict):
            stage = {**stage, "$match": _widened_filter(stage["$match"])}
        for name, key in _NESTED_PIPELINES.items():
            nested = stage.get(name) if isinstance(stage, dict) else None
            if isinstance(nested, dict) and isinstance(nested.get(key), list):
                stage = {**stage, name: {**nested, key: _widened_pipeline(nested[key])}}
        stages.append(stage)
    return stages


def _widened_filter(query: dict[str, Any]) -> dict[str, Any]:
    """A filter document: `$and`/`$or`/`$nor` hold filters, a field holds a value or its
    operators; every other top-level operator (`$expr`, `$text`, …) is left as it is."""
    widened: dict[str, Any] = {}
    for key, value in query.items():
        if key in _FILTERS and isinstance(value, list):
            widened[key] = [_widened_filter(q) if isinstance(q, dict) else q for q in value]
        elif key.startswith("$"):
            widened[key] = value
        else:
            widened[key] = _widened_condition(value)
    return widened


def _widened_condition(condition: Any) -> Any:
    """A field's condition: a value to equal, or a document of operators."""
    if not _operators(condition):
        return _widened_value(condition)
    widened: dict[str, Any] = {}
    for operator, operand in condition.items():
        if operator in _COMPARED:
            widened[operator] = _widened_value(operand)
        elif operator == "$not" and isinstance(operand, dict):
            widened[operator] = _widened_condition(operand)
        elif operator == "$elemMatch" and isinstance(operand, dict):
            # Of documents, a filter (`{a: 1}`, `{$or: …}`); of values, their operators.
            within = operand.keys() & _FILTERS
            widened[operator] = (
                _widened_condition(operand)
                if _operators(operand) and not within
                else _widened_filter(operand)
            )
        else:
            widened[operator] = operand
    return widened


def _operators(condition: Any) -> bool:
    """Whether a field's condition is a document of query operators (`{$gt: 3}`), not a
    value to equal."""
    return (
        isinstance(condition, dict)
        and bool(condition)
        and all(str(key).startswith("$") for key in condition)
    )


def _widened_value(value: Any) -> Any:
    """A value compared as it is stored: each integer in it an int64."""
    from mongoeco.core.bson_scalars import BsonInt64  # the embedded extra's

    if isinstance(value, int) and not isinstance(value, bool):
        return BsonInt64(value)
    if isinstance(value, list):
        return [_widened_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _widened_value(item) for key, item in value.items()}
    return value


class _ListenerWithoutAbort:
    """uvloop's listening server, given the `abort_clients` mongoeco calls when it closes.

    asyncio's server has it (Python 3.13); uvloop's has not, so closing the embedded server
    on uvloop raised AttributeError, replacing whatever had stopped the service (a port in
    use, an unreachable host). Nothing is lost by skipping it: closing cancels each
    connection's handler next, and every handler closes its connection.
    """

    def __init__(self, server: Any) -> None:
        self._server = server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def abort_clients(self) -> None:
        """Nothing to do: the handlers close their connections."""


@asynccontextmanager
async def embedded_mongodb(data_dir: Path | None, *, publish: bool = True) -> AsyncIterator[str]:
    """Start the embedded server for as long as the context lasts; yields its URI.

    `data_dir` holds its SQLite file and, while it runs and `publish` says so, the published
    URI (`URI_FILE`); None keeps everything in memory (tests). Unpublished, the server is the
    caller's alone: another process finds the data directory held, and nothing to use.
    """
    try:
        from mongoeco.engines.memory import MemoryEngine
        from mongoeco.engines.sqlite import SQLiteEngine
        from mongoeco.wire.proxy import AsyncMongoEcoProxyServer  # noqa: F401 - `_served`'s
    except ImportError as exc:
        raise Unsupported(
            "the embedded server needs Python 3.13+ with the `embedded` extra "
            "(pip install 'agent-conversation-store[embedded]'); or set MONGODB_URI"
        ) from exc
    engine: object
    async with AsyncExitStack() as held:
        if data_dir is None:
            engine = MemoryEngine()
        else:
            data_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, at start-up
            held.enter_context(_data_directory_held(data_dir))
            engine = SQLiteEngine(str(data_dir / DATABASE_FILE))
        async with _served(engine, data_dir, published_in=data_dir if publish else None) as uri:
            yield uri


@asynccontextmanager
async def _served(
    engine: Any, data_dir: Path | None, *, published_in: Path | None
) -> AsyncIterator[str]:
    """mongoeco's wire server on `engine` (the SQLite file of `data_dir`, else in memory),
    published in `published_in` (when given) while it runs."""
    from mongoeco.wire.proxy import AsyncMongoEcoProxyServer

    server = AsyncMongoEcoProxyServer(
        engine=engine,
        host="127.0.0.1",
        port=0,
        mongodb_dialect="7.0",
        pymongo_profile="auto-installed",
    )
    # One seam into mongoeco's internals: the executor its connections call.
    wrapper = _Int64CursorIds if data_dir is None else _Int64Comparisons
    server._executor = wrapper(server._executor)  # type: ignore[assignment]
    _cap_reply_batches(server)
    address = await server.start()
    # The second seam: the listener mongoeco closes (see _ListenerWithoutAbort).
    if not hasattr(server._server, "abort_clients"):
        server._server = _ListenerWithoutAbort(server._server)  # type: ignore[assignment]
    uri = f"mongodb://{address.host}:{address.port}/?directConnection=true"
    try:
        if published_in is not None:
            _publish(published_in, uri)  # a few bytes, once, at start-up
        yield uri
    except BaseException as stopped:
        with _unclosed_noted(stopped):
            await _close(server, published_in, uri)
        raise
    else:
        await _close(server, published_in, uri)


@contextmanager
def _unclosed_noted(stopped: BaseException) -> Iterator[None]:
    """Closing the server while `stopped` ends its caller (a signal, a port in use): a failure
    to close (mongoeco's cleanup raises an `ExceptionGroup` of what failed in it, a connection
    cut mid-command) is a note on `stopped`, never in its place."""
    try:
        yield
    except Exception as unclosed:
        stopped.add_note(f"the embedded server did not close cleanly: {unclosed!r}")


async def _close(server: Any, published_in: Path | None, uri: str) -> None:
    if published_in is not None:
        _withdraw(published_in, uri)
    await server.close()


class ServerThread:
    """The embedded server on an event loop of its own, in a daemon thread.

    For callers that have no loop running all the time (tests, scripts): the
    server answers whatever the calling thread is doing. `data_dir` None keeps
    the data in memory; `publish` as `embedded_mongodb` takes it. As a context manager
    (`with ServerThread(...) as uri`), it is stopped however the block ends, and a failure
    to stop never takes the place of what ended the block (`_unclosed_noted`).
    """

    def __init__(self, data_dir: Path | None = None, *, publish: bool = True) -> None:
        self._data_dir = data_dir
        self._publish = publish
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stack = AsyncExitStack()
        self.uri = ""

    def start(self) -> str:
        """Start the server; returns its URI."""
        self._thread.start()
        self.uri = asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(60)
        return self.uri

    async def _open(self) -> str:
        served = embedded_mongodb(self._data_dir, publish=self._publish)
        return await self._stack.enter_async_context(served)

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, ended: BaseException | None, traceback: Any
    ) -> None:
        if ended is None:
            self.stop()
            return
        with _unclosed_noted(ended):
            self.stop()

    def stop(self) -> None:
        """Stop the server and its thread; when closing the server fails, the thread is
        stopped all the same (never left running into the interpreter's shutdown), then the
        failure raised."""
        try:
            asyncio.run_coroutine_threadsafe(self._stack.aclose(), self._loop).result(60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
