"""The embedded default: with no MONGODB_URI, the service runs on a local wire server."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import bson
import pytest
from bson import DatetimeMS, Int64
from pymongo import MongoClient

from agent_store import embedded
from agent_store.embedded import embedded_mongodb
from app.service import open_store
from app.settings import Settings
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
