"""The embedded default: with no MONGODB_URI, the service runs on a local wire server."""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import bson
import pytest
from bson import DatetimeMS, Int64
from pymongo import AsyncMongoClient, MongoClient

from agent_store import AgentMessageLogger, ConversationStore, embedded
from agent_store.embedded import embedded_mongodb
from app.api import create_app
from app.service import open_store
from app.settings import Settings
from tests.api_harness import SERVICE_TOKEN, auth_headers, serve
from tests.conftest import ReplyBatches

pytestmark = pytest.mark.wire


async def test_embedded_server_keeps_data_across_restarts(tmp_path: Path) -> None:
    settings = Settings(mongodb_uri=None, data_dir=tmp_path)
    async with open_store(settings) as store:
        await store.logger.log_messages("persisted", [{"role": "user", "content": "remember me"}])
    assert (tmp_path / "agent_store.sqlite3").exists()

    async with open_store(settings) as store:
        transcript = await store.conversations.transcript("persisted")

    assert [m.content for m in transcript] == ["remember me"]


def test_cursor_ids_go_out_as_int64_as_the_wire_protocol_defines_them(database: Any) -> None:
    # The official Node driver reads `cursor.id` only as a BSON int64; PyMongo decodes an
    # int64 as `Int64` and an int32 as a plain `int`, so the type seen here is the wire type.
    database.things.insert_many([{"_id": i} for i in range(5)])
    first = database.command({"find": "things", "batchSize": 2})
    assert type(first["cursor"]["id"]) is Int64
    assert first["cursor"]["id"] != 0
    rest = database.command({"getMore": first["cursor"]["id"], "collection": "things"})
    assert type(rest["cursor"]["id"]) is Int64
    assert [d["_id"] for d in first["cursor"]["firstBatch"] + rest["cursor"]["nextBatch"]] == [
        0, 1, 2, 3, 4,
    ]  # fmt: skip
    exhausted = database.command({"find": "things"})
    assert type(exhausted["cursor"]["id"]) is Int64
    assert exhausted["cursor"]["id"] == 0


def test_an_int64_cursor_id_continues_and_kills_a_cursor(database: Any) -> None:
    database.things.insert_many([{"_id": i} for i in range(5)])
    cursor_id = Int64(database.command({"find": "things", "batchSize": 1})["cursor"]["id"])
    more = database.command({"getMore": cursor_id, "collection": "things", "batchSize": 1})
    assert [d["_id"] for d in more["cursor"]["nextBatch"]] == [1]
    killed = database.command({"killCursors": "things", "cursors": [cursor_id]})
    assert killed["cursorsKilled"] == [cursor_id]
    assert all(type(i) is Int64 for i in killed["cursorsKilled"])


def test_a_reply_of_the_embedded_server_holds_at_most_16_mib_of_documents(
    wire_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MongoDB ends a reply batch at 16 MiB (`REPLY_BATCH_BYTES`, lowered here) and keeps the
    rest for `getMore`; mongoeco sent every document asked for in one reply, which past its own
    48 MB message size the driver refuses. A document past the bound goes alone."""
    monkeypatch.setattr(embedded, "REPLY_BATCH_BYTES", 50_000)
    replies = ReplyBatches()
    client: MongoClient[dict[str, Any]] = MongoClient(wire_uri, event_listeners=[replies])
    name = f"replies_{uuid.uuid4().hex[:10]}"
    things = client[name].things
    things.insert_many([{"_id": i, "text": "x" * 20_000} for i in range(10)])
    things.insert_one({"_id": 10, "text": "y" * 60_000})
    reads = [
        things.find().sort("_id", 1),
        things.find(batch_size=4).sort("_id", 1),
        things.aggregate([{"$sort": {"_id": 1}}]),
        things.aggregate([{"$sort": {"_id": 1}}], batchSize=3),
    ]
    assert [[d["_id"] for d in read] for read in reads] == [list(range(11))] * 4
    assert list(things.find().sort("_id", 1).limit(7)) == list(things.find({"_id": {"$lt": 7}}))
    client.drop_database(name)
    client.close()
    assert replies.past(50_000) == []
    assert max(len(batch) for batch in replies.batches) == 2


async def test_the_services_client_decodes_a_date_outside_pythons_range(wire_uri: str) -> None:
    """The service's client reads a legacy date Python's `datetime` cannot hold as a
    `DatetimeMS`: a conversation holding one stays readable."""
    async with open_store(Settings(mongodb_uri=wire_uri)) as store:
        options = store.db.codec_options
    decoded = bson.decode(bson.encode({"t": DatetimeMS(2**62)}), codec_options=options)
    assert decoded["t"] == DatetimeMS(2**62)


@pytest.mark.parametrize(
    ("query", "retry_writes"),
    [
        ("", False),
        ("?appName=svc", False),
        ("?retryWrites=true", True),
        ("?RETRYWRITES=false", False),
    ],
)
async def test_the_services_client_sends_no_write_twice_itself_unless_the_uri_says_so(
    wire_uri: str, query: str, retry_writes: bool
) -> None:
    """RELIABILITY.md: the service's client has PyMongo's retryable writes off (the driver's
    retry of a write a dropped connection lost kept clearing its paused pool under load),
    unless the connection string names `retryWrites`: the operator's word wins."""
    uri = wire_uri.partition("?")[0].rstrip("/") + "/" + query
    async with open_store(Settings(mongodb_uri=uri)) as store:
        assert store.db.client.options.retry_writes is retry_writes


def test_a_failure_while_the_embedded_server_runs_on_uvloop_is_the_error_raised() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def fail_while_serving() -> None:
        async with embedded_mongodb(None):
            raise OSError("address already in use")

    with pytest.raises(OSError, match="address already in use"):
        uvloop.run(fail_while_serving())


def test_the_embedded_server_closes_cleanly_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def open_and_close() -> str:
        async with embedded_mongodb(None) as uri:
            return uri

    assert uvloop.run(open_and_close()).startswith("mongodb://")


# The store on the embedded default's engine: mongoeco on a SQLite file, what `python -m app`
# runs with MONGODB_URI unset. That engine compares an int32 with an int64 by type, not value
# (`{seq: {$gt: 31}}` matched every stored `Int64` seq, `{seq: 5}` none); the store writes
# every integer as an Int64 and the embedded server widens the integers a query compares.

TURNS = 40
"""More one-message turns than a transcript's first batch (32) holds."""


@asynccontextmanager
async def opened(uri: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    name = f"embedded_{uuid.uuid4().hex[:10]}"
    try:
        yield client[name]
    finally:
        await client.drop_database(name)
        await client.close()


async def log_turns(logger: AgentMessageLogger, conversation_id: str, count: int) -> None:
    for n in range(count):
        message = {"role": "user", "content": f"hello {n}"}
        await logger.log_messages(conversation_id, [message], user_id="u1", turn_id=f"t{n}")


def seqs(messages: Any) -> list[int | None]:
    return [m.seq for m in messages]


async def a_session(db: Any) -> dict[str, Any]:
    """What a user sees of 40 turns, pages, a pop, a turn after it, a fork and an export."""
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    await logger.ensure_indexes()
    await log_turns(logger, "c", TURNS)
    seen: dict[str, Any] = {}
    seen["streamed"] = [m.seq async for batch in store.stream_transcript("c") for m in batch]
    seen["transcript"] = seqs(await store.transcript("c"))
    by_seq = {m.seq: m.id for m in await store.transcript("c")}
    after = await store.messages_page("c", after=by_seq[5], limit=3)
    before = await store.messages_page("c", after=by_seq[35], limit=3, order="desc")
    seen["pages"] = [seqs(after.data), seqs(before.data)]
    seen["by_seq"] = seqs(await store.messages_by_seq("c", start=35, stop=38))
    popped = await store.pop_last_message("c")
    seen["popped"] = popped.seq if popped else None
    logged = await logger.log_messages(
        "c", [{"role": "user", "content": "after the pop"}], user_id="u1", turn_id="t-after"
    )
    seen["logged after the pop"] = [m.seq for m in logged.messages]
    await logger.fork("c", 5, "f")
    seen["fork"] = seqs(await store.transcript("f"))
    seen["counts"] = {
        c: (found.message_count, found.turn_count)
        for c in ("c", "f")
        if (found := await store.get_conversation(c)) is not None
    }
    seen["export"] = {e.conversation.id: seqs(e.messages) async for e in store.export_user("u1")}
    return seen


async def test_the_store_answers_on_the_sqlite_file_as_on_the_in_memory_engine(
    wire_uri: str, sqlite_wire_uri: str
) -> None:
    async with opened(wire_uri) as memory, opened(sqlite_wire_uri) as sqlite:
        expected, answered = await a_session(memory), await a_session(sqlite)
    every = list(range(TURNS))
    assert expected["streamed"] == expected["transcript"] == every
    assert expected["pages"] == [[6, 7, 8], [34, 33, 32]]
    assert expected["by_seq"] == [35, 36, 37]
    assert (expected["popped"], expected["logged after the pop"]) == (39, [39])
    assert expected["fork"] == list(range(6))
    assert expected["counts"] == {"c": (TURNS, TURNS), "f": (6, 6)}  # the pop took a turn
    assert expected["export"] == {"c": every, "f": list(range(6))}
    assert answered == expected


def test_the_sqlite_servers_seam_widens_compared_integers_and_nothing_else() -> None:
    from mongoeco.core.bson_scalars import BsonInt64

    from agent_store.embedded import _widened_command

    command = {
        "find": "m",
        "filter": {"c": "x", "seq": {"$gt": 31, "$nin": [3]}, "on": True, "tags": {"$size": 2},
                   "$or": [{"n": 5}, {"k": {"$type": 16}}], "$expr": {"$gt": ["$n", 1]}},
        "sort": {"seq": 1}, "limit": 3, "batchSize": 32, "projection": {"seq": 1},
    }  # fmt: skip
    widened = _widened_command(command)
    assert widened["filter"] == {
        "c": "x", "seq": {"$gt": BsonInt64(31), "$nin": [BsonInt64(3)]}, "on": True,
        "tags": {"$size": 2}, "$or": [{"n": BsonInt64(5)}, {"k": {"$type": 16}}],
        "$expr": {"$gt": ["$n", 1]},
    }  # fmt: skip
    assert {k: widened[k] for k in ("sort", "limit", "batchSize", "projection")} == {
        "sort": {"seq": 1}, "limit": 3, "batchSize": 32, "projection": {"seq": 1},
    }  # fmt: skip
    update = {"update": "m", "updates": [{"q": {"n": 1}, "u": {"$inc": {"n": 1}}, "multi": False}]}
    assert _widened_command(update)["updates"] == [
        {"q": {"n": BsonInt64(1)}, "u": {"$inc": {"n": 1}}, "multi": False}
    ]
    pipeline = [{"$match": {"n": {"$lt": 4}}}, {"$limit": 2}]
    assert _widened_command({"aggregate": "m", "pipeline": pipeline})["pipeline"] == [
        {"$match": {"n": {"$lt": BsonInt64(4)}}},
        {"$limit": 2},
    ]
    assert command["filter"]["seq"] == {"$gt": 31, "$nin": [3]}  # the body sent is not changed


async def test_the_http_transcript_pages_fork_and_viewer_are_right_on_the_sqlite_file(
    sqlite_wire_uri: str,
) -> None:
    async with opened(sqlite_wire_uri) as db, serve(db, seeded=False) as api:
        await api.store.logger.ensure_indexes()
        await log_turns(api.store.logger, "c", TURNS)
        base, headers = "/v1/conversations/c", auth_headers()
        transcript = (await api.http.get(f"{base}/transcript", headers=headers)).json()["data"]
        assert [m["seq"] for m in transcript] == list(range(TURNS))
        fifth = transcript[5]["_id"]
        page = await api.http.get(f"{base}/messages?after={fifth}&limit=3", headers=headers)
        assert [m["seq"] for m in page.json()["data"]] == [6, 7, 8]
        fork = {"at_seq": 5, "new_conversation_id": "c-fork"}
        forked = await api.http.post(f"{base}/forks", json=fork, headers=headers)
        assert forked.status_code in (200, 201), forked.text
        copies = await api.http.get("/v1/conversations/c-fork/transcript", headers=headers)
        assert [m["seq"] for m in copies.json()["data"]] == list(range(6))
        origin = {"Origin": "http://test"}
        await api.http.post("/viewer/login", data={"token": SERVICE_TOKEN}, headers=origin)
        shown = await api.http.get("/viewer/conversations/c?from_seq=35")
        assert [int(s) for s in re.findall(r'data-seq="(\d+)"', shown.text)] == list(
            range(35, TURNS)
        )


def test_a_second_embedded_server_on_a_data_dir_in_use_is_refused_naming_mongodb_uri(
    tmp_path: Path,
) -> None:
    """Several workers (uvicorn or gunicorn `--workers`) without MONGODB_URI: the embedded
    server belongs to the process that started it, so a second one on its SQLite file is
    refused, saying so, never started beside it (a worker with a token of its own)."""
    first = embedded.ServerThread(tmp_path)
    uri = first.start()
    second = embedded.ServerThread(tmp_path)
    try:
        with pytest.raises(embedded.DataDirectoryInUse) as caught:
            second.start()
        said = str(caught.value)
        assert "MONGODB_URI" in said
        assert f"process {os.getpid()}" in said
        assert embedded.published_uri(tmp_path) == uri
    finally:
        second.stop()
        first.stop()
    again = embedded.ServerThread(tmp_path)  # the directory is free once its server stopped
    assert again.start()
    again.stop()


async def _started(app: Any) -> None:
    """What the app's server does as it starts and stops: its lifespan."""
    async with app.router.lifespan_context(app):
        pass


async def test_a_second_worker_on_a_data_dir_in_use_stops_without_logging_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`uvicorn --factory … --workers N` (or gunicorn's) without MONGODB_URI: a worker whose
    data directory another one's embedded server holds stops, and logs no development token
    (one that would never work, its worker gone); the worker that holds it logs its own."""
    for name in ("MONGODB_URI", "AGENT_STORE_SERVICE_TOKENS", "AGENT_STORE_NAMED_SERVICE_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("AGENT_STORE_DEMO_DATA", "false")
    monkeypatch.setattr("app.api.configure_logging", lambda level: None)  # caplog's handler stays
    caplog.set_level(logging.INFO)
    held = embedded.ServerThread(tmp_path)
    held.start()
    try:
        second = create_app()
        with pytest.raises(embedded.DataDirectoryInUse, match="MONGODB_URI"):
            await _started(second)
    finally:
        held.stop()
    assert not [r for r in caplog.records if "development token" in r.getMessage()]

    first = create_app()
    async with first.router.lifespan_context(first):
        [announced] = [r for r in caplog.records if "development token" in r.getMessage()]
    assert first.state.authenticator is not None
    assert "dev-" in announced.getMessage()


async def test_the_service_refuses_a_data_dir_whose_embedded_server_another_process_runs(
    tmp_path: Path,
) -> None:
    held = embedded.ServerThread(tmp_path)
    held.start()
    try:
        with pytest.raises(embedded.DataDirectoryInUse, match="MONGODB_URI"):
            async with open_store(Settings(mongodb_uri=None, data_dir=tmp_path)):
                pass
    finally:
        held.stop()


def test_a_published_uri_is_stale_once_nobody_holds_the_data_directory(tmp_path: Path) -> None:
    """A server stopped by SIGTERM leaves its URI file behind, and its process id may be
    another live process's by now: the lock, not the process id, tells it runs."""
    server = embedded.ServerThread(tmp_path)
    uri = server.start()
    left_behind = (tmp_path / embedded.URI_FILE).read_text()
    assert embedded.published_uri(tmp_path) == uri
    server.stop()
    (tmp_path / embedded.URI_FILE).write_text(left_behind.replace(str(os.getpid()), "1"))
    assert embedded.published_uri(tmp_path) is None
    (tmp_path / embedded.URI_FILE).write_text(left_behind)  # this live process's id
    assert embedded.published_uri(tmp_path) is None
