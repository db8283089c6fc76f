"""Truncated, never lost: a message cut to bound its document keeps its full text in GridFS,
where the store, the API (`?full=true`) and the viewer fetch it; a retry writes it once; a
delete or an erasure removes it, and so does a pop; a message's whole text is always its own,
even under an id a deleted conversation's file held."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import gridfs
import mongomock
import pytest
from pymongo import MongoClient
from pymongo.errors import AutoReconnect

from agent_store import AgentMessageLogger, ConversationStore, Truncation
from agent_store.core import Conflict, StorageUnavailable, message_adapter, utc_now
from agent_store.store import BLOB_BUCKET, CONVERSATIONS, TurnRules, stored_turn_record
from agent_store.store._blobs import FullTextStore
from agent_store.store._truncation import FullText, blob_id, unscoped_blob_id
from migrations import full_texts
from migrations.bounds import Bounds
from tests.api_harness import (
    OTHER,
    SERVICE_TOKEN,
    Served,
    api_settings,
    auth_headers,
    mongomock_db,
    serve,
)
from tests.conftest import COUNTED, Backend

CID = "full-texts"
HUGE = "word " * 600_000  # 3 MB: three times the default bound of 1 MiB
FILES, CHUNKS = f"{BLOB_BUCKET}.files", f"{BLOB_BUCKET}.chunks"


def oversized_turn() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Summarise the log"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c-log", "function": {"name": "read_log", "arguments": {"path": HUGE}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c-log", "content": HUGE},
        {"role": "assistant", "content": "It is long."},
    ]


async def test_a_cut_message_says_where_its_full_text_is_and_the_store_fetches_it(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, oversized_turn(), user_id="user-f", turn_id="t-1")

    stored = await store.transcript(CID)
    cut = stored[2]
    assert cut.truncated is not None
    entry = cut.truncated["content"]
    assert isinstance(entry, Truncation)
    assert entry.length == len(HUGE)
    assert entry.blob_id
    assert cut.content is not None
    assert len(cut.content) < 1024 * 1024

    full = await store.with_full_texts(stored)
    assert full[2].content == HUGE
    assert full[2].truncated is None
    assert full[1].tool_calls is not None
    assert full[1].tool_calls[0].function.arguments == '{"path":"' + HUGE + '"}'
    assert full[0] == stored[0]


async def test_a_retried_turn_writes_its_full_text_once(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, oversized_turn(), turn_id="t-1")
    files = await backend.db[FILES].count_documents({})
    chunks = await backend.db[CHUNKS].count_documents({})
    await backend.db.agent_messages.delete_many({})  # as a crash before the insert leaves it

    await logger.log_messages(CID, oversized_turn(), turn_id="t-1")

    assert files == 2
    assert await backend.db[FILES].count_documents({}) == files
    assert await backend.db[CHUNKS].count_documents({}) == chunks
    assert await backend.db.agent_messages.count_documents({}) == 4


async def test_deleting_or_erasing_removes_the_full_texts(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, oversized_turn(), user_id="user-f", turn_id="t-1")
    await logger.log_messages("other", oversized_turn(), user_id="user-f", turn_id="t-1")
    assert await backend.db[FILES].count_documents({}) == 4

    await store.delete(CID)
    assert await backend.db[FILES].count_documents({}) == 2
    await store.erase_user("user-f")
    assert await backend.db[FILES].count_documents({}) == 0
    assert await backend.db[CHUNKS].count_documents({}) == 0


async def test_a_fork_keeps_full_texts_of_its_own_that_outlive_the_original(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, oversized_turn(), user_id="user-f", turn_id="t-1")

    forked = await logger.fork(CID, 3, "fork-of-full-texts", user_id="user-f")
    await store.delete(CID)

    cut = forked.messages[2]
    assert cut.truncated is not None
    entry = cut.truncated["content"]
    assert isinstance(entry, Truncation)
    assert entry.blob_id is not None
    assert cut.id is not None
    fork = await backend.db.agent_conversations.find_one({"_id": "fork-of-full-texts"})
    assert fork is not None
    assert entry.blob_id == blob_id(cut.id, "content", fork["epoch"])  # the fork's own file
    whole = await store.with_full_texts(await store.transcript("fork-of-full-texts"))
    assert whole[2].content == HUGE
    assert whole[1].tool_calls is not None
    assert whole[1].tool_calls[0].function.arguments == '{"path":"' + HUGE + '"}'


async def test_the_old_shape_of_truncated_is_still_read(backend: Backend) -> None:
    document = {
        "_id": "old-cut",
        "conversation_id": CID,
        "role": "user",
        "content": "abc\n…[truncated]",
        "seq": 0,
        "truncated": {"content": 3_000_000},
    }
    message = message_adapter.validate_python(document)
    assert message.truncated == {"content": 3_000_000}
    store = ConversationStore(backend.db)
    assert await store.with_full_texts([message]) == [message]


@pytest.mark.wire
async def test_the_full_text_is_a_gridfs_file_and_costs_its_turn_two_more_round_trips(
    wire_backend: Backend, wire_uri: str
) -> None:
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    await logger.ensure_indexes()
    wire_backend.commands.clear()

    logged = await logger.log_messages(CID, oversized_turn(), turn_id="t-1")

    # chunks, then the files documents, then the messages that name them
    assert wire_backend.commands.names == ["findAndModify", "insert", "insert", "insert"]
    tool = logged.messages[2]
    assert tool.truncated is not None
    entry = tool.truncated["content"]
    assert isinstance(entry, Truncation)
    client: MongoClient[dict[str, Any]] = MongoClient(wire_uri)
    try:
        bucket = gridfs.GridFSBucket(client[wire_backend.db.name], bucket_name=BLOB_BUCKET)
        assert bucket.open_download_stream(entry.blob_id).read().decode() == HUGE
    finally:
        client.close()


@pytest.mark.wire
async def test_a_replayed_cut_turn_compares_its_files_in_two_round_trips_more(
    wire_backend: Backend,
) -> None:
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    await logger.log_messages(CID, oversized_turn(), turn_id="t-1")
    wire_backend.commands.clear()

    await logger.log_messages(CID, oversized_turn(), turn_id="t-1")

    # the reservation and its record; chunks and files taken, read back (the same texts:
    # nothing replaced); the insert refused on every id, the stored messages
    assert wire_backend.commands.names == [
        "findAndModify", "find", "insert", "insert", "find", "find", "insert", "find"
    ]  # fmt: skip


@pytest.mark.wire
async def test_popping_a_cut_message_costs_four_round_trips_more(wire_backend: Backend) -> None:
    assert wire_backend.commands is not None
    logger, store = AgentMessageLogger(wire_backend.db), ConversationStore(wire_backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": HUGE}], turn_id="t-1")
    wire_backend.commands.clear()

    await store.pop_last_message(CID)

    # the last message, the one before it (none) and the conversation's creation time (for
    # `updated_at`), the LangGraph checkpoints referring to it (none), mark, remove, correct
    # the summary; then its whole text read back (files, chunks), and its chunks and its
    # files deleted
    assert wire_backend.commands.names == [
        "find", "find", "find", "find", "update", "delete", "update", "find", "find",
        "delete", "delete",
    ]  # fmt: skip
    assert await wire_backend.db[FILES].count_documents({}) == 0


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db()) as served:
        await served.store.logger.log_messages(CID, oversized_turn(), turn_id="t-1")
        yield served


SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


async def test_the_transcript_route_returns_full_texts_on_request(api: Served) -> None:
    cut = await api.http.get(f"/v1/conversations/{CID}/transcript", headers=SERVICE)
    full = await api.http.get(f"/v1/conversations/{CID}/transcript?full=true", headers=SERVICE)
    assert (cut.status_code, full.status_code) == (200, 200)
    assert cut.json()["data"][2]["truncated"]["content"]["length"] == len(HUGE)
    assert len(cut.json()["data"][2]["content"]) < len(HUGE)
    assert full.json()["data"][2]["content"] == HUGE
    assert full.json()["data"][2]["truncated"] is None


async def test_the_viewer_links_a_cut_message_to_its_full_text(api: Served) -> None:
    await api.http.post(
        "/viewer/login", data={"token": SERVICE_TOKEN}, headers={"Origin": "http://test"}
    )
    page = await api.http.get(f"/viewer/conversations/{CID}")
    assert page.status_code == 200
    link = re.search(
        rf'href="(/viewer/conversations/{CID}\?full=true&amp;from_seq=(\d+)#seq-(\d+))"', page.text
    )
    assert link, page.text
    assert link.group(2) == link.group(3)  # the full page at the message, its anchor
    full = await api.http.get(link.group(1).replace("&amp;", "&"))
    assert full.status_code == 200
    assert HUGE[:1000] in full.text
    assert "[truncated]" not in full.text


async def test_erasing_a_user_removes_the_full_texts_of_every_message_of_their_conversations(
    backend: Backend,
) -> None:
    """Messages logged before a turn assigned the conversation to the user, even one still
    naming no owner, are the user's: their full texts go with them."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, oversized_turn(), turn_id="t-1")
    await logger.log_messages(CID, [{"role": "user", "content": "mine"}], user_id="user-f")
    await backend.db.agent_messages.update_many(
        {"conversation_id": CID, "turn_id": "t-1"}, {"$set": {"user_id": None}}
    )

    await store.erase_user("user-f")

    assert await backend.db[FILES].count_documents({}) == 0
    assert await backend.db[CHUNKS].count_documents({}) == 0
    assert await backend.db.agent_messages.count_documents({}) == 0


async def test_a_file_left_under_a_taken_id_is_never_read_as_the_next_conversations_text(
    backend: Backend,
) -> None:
    """Message ids come from the conversation and turn ids, which a conversation id taken
    again reuses; file ids name the conversation's epoch too: a file a gone message left is
    under another id than the next conversation's, never served as its text, and goes with
    the id's next delete."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, oversized_turn(), user_id="user-f", turn_id="t-1")
    await backend.db.agent_messages.delete_many({})  # the messages gone, their files left
    await backend.db.agent_conversations.delete_many({})
    turn = oversized_turn()
    turn[2]["content"] = "other " * 600_000

    await logger.log_messages(CID, turn, user_id="user-g", turn_id="t-1")

    whole = await store.with_full_texts(await store.transcript(CID))
    assert whole[2].content == "other " * 600_000
    assert await backend.db[FILES].count_documents({}) == 4
    await store.delete(CID)
    assert await backend.db[FILES].count_documents({}) == 0


async def test_deleting_a_conversation_removes_the_files_no_message_names(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, oversized_turn(), user_id="user-f", turn_id="t-1")
    await backend.db.agent_messages.delete_many({})  # as a turn whose insert was lost

    await store.delete(CID)

    assert await backend.db[FILES].count_documents({}) == 0
    assert await backend.db[CHUNKS].count_documents({}) == 0


async def test_a_pop_answers_the_message_whole_and_removes_its_whole_texts(
    backend: Backend,
) -> None:
    """The popped message is the one logged, its cut fields read back whole before their
    files go: nothing else holds them once the pop is done."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, oversized_turn()[:3], user_id="user-f", turn_id="t-1")

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert (popped.content, popped.truncated) == (HUGE, None)
    assert await backend.db[FILES].count_documents({}) == 1  # the tool call's arguments
    call = await store.pop_last_message(CID)
    assert call is not None
    assert call.truncated is None
    assert call.tool_calls is not None
    assert json.loads(call.tool_calls[0].function.arguments) == {"path": HUGE}
    assert await backend.db[FILES].count_documents({}) == 0
    assert await backend.db[CHUNKS].count_documents({}) == 0


async def test_the_retry_of_a_pop_that_raised_before_reading_its_whole_texts_answers_it_whole(
    backend: Backend,
) -> None:
    """The pop removed the message, then its read of the whole texts was lost: its retry
    answers the message whole (its files are deleted only after that read)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": HUGE}], turn_id="t-1")
    original = store._full_texts.texts
    lost = {"once": True}

    async def read_lost(blob_ids: Any) -> dict[str, str]:
        if lost.pop("once", False):
            raise StorageUnavailable("the read of the whole texts was lost")
        return await original(blob_ids)

    store._full_texts.texts = read_lost  # type: ignore[method-assign]
    with pytest.raises(StorageUnavailable):
        await store.pop_last_message(CID)

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert (popped.content, popped.truncated) == (HUGE, None)
    assert await store.transcript(CID) == []


MALLORY = "user-mallory"
SMALL_BOUND = 4096
"""`max_message_bytes` for the tests below: a message of 8 KiB is cut and kept whole."""
GRACE_SECRET = "GRACE-PRIVATE-DIARY "
MALLORY_TEXT = "mallory writes her own words "


async def blobs_holding(api: Served, text: str) -> int:
    """How many GridFS chunks of the whole texts still hold `text`."""
    chunks = await api.db[CHUNKS].find({}).to_list(None)
    return sum(text.encode() in bytes(chunk["data"]) for chunk in chunks)


async def next_holder_reads(api: Served, conversation_id: str, turn_id: str) -> str:
    """Mallory takes the freed id with a cut message of her own under the same turn id, and
    reads her transcript whole (`?full=true`): the content she gets back."""
    mine = MALLORY_TEXT * 400
    logged = await api.http.post(
        f"/v1/conversations/{conversation_id}/turns",
        json={"turn_id": turn_id, "messages": [{"role": "user", "content": mine}]},
        headers=auth_headers(user=MALLORY),
    )
    assert logged.status_code == 201, logged.text
    read = await api.http.get(
        f"/v1/conversations/{conversation_id}/transcript",
        params={"full": "true"},
        headers=auth_headers(user=MALLORY),
    )
    assert read.status_code == 200, read.text
    content: str = read.json()["data"][0]["content"]
    assert content == mine, "the next holder was not served her own text"
    return content


async def test_the_whole_text_of_a_popped_message_does_not_outlive_its_users_erasure() -> None:
    """SECURITY.md: erasing a user deletes the whole texts of cut messages, and a user taking
    the freed id finds nothing of the erased user: not even the text of a message the
    erased user's runtime popped, under a turn id the next holder uses again."""
    async with serve(mongomock_db(), api_settings(max_message_bytes=SMALL_BOUND)) as api:
        grace = auth_headers(user=OTHER)
        logged = await api.http.post(
            "/v1/conversations/conv-freed/turns",
            json={
                "turn_id": "turn-1",
                "messages": [{"role": "user", "content": GRACE_SECRET * 400}],
            },
            headers=grace,
        )
        assert logged.status_code == 201, logged.text
        assert logged.json()["messages"][0]["truncated"], "the set-up needs a cut message"
        assert await api.store.conversations.pop_last_message("conv-freed", user_id=OTHER)
        erased = await api.http.delete(f"/v1/users/{OTHER}", headers=grace)
        assert erased.status_code == 200, erased.text

        assert await blobs_holding(api, GRACE_SECRET) == 0, "erasure left the user's whole text"
        assert GRACE_SECRET not in await next_holder_reads(api, "conv-freed", "turn-1")


async def test_the_whole_text_of_a_turn_whose_insert_failed_does_not_outlive_erasure() -> None:
    """A turn's whole texts are written before its messages: when the insert is lost and never
    retried, erasing the user still deletes them (found by conversation, not through
    messages), and the next holder of the id, logging a turn of the same id, reads her own."""
    async with serve(mongomock_db(), api_settings(max_message_bytes=SMALL_BOUND)) as api:
        logger = api.store.logger
        insert = logger._messages.insert_many

        async def connection_lost(*args: Any, **kwargs: Any) -> None:
            raise AutoReconnect("connection lost")

        logger._messages.insert_many = connection_lost
        with pytest.raises(StorageUnavailable):
            await logger.log_messages(
                "conv-lost",
                [{"role": "user", "content": GRACE_SECRET * 400}],
                user_id=OTHER,
                turn_id="turn-1",
                owner_only=True,
            )
        logger._messages.insert_many = insert
        erased = await api.http.delete(f"/v1/users/{OTHER}", headers=auth_headers(user=OTHER))
        assert erased.status_code == 200, erased.text

        assert await blobs_holding(api, GRACE_SECRET) == 0, "erasure left the user's whole text"
        assert GRACE_SECRET not in await next_holder_reads(api, "conv-lost", "turn-1")


# -- a retry of a cut turn is checked against its whole texts -----------------------------------

CUT = TurnRules(max_message_bytes=SMALL_BOUND)
LONG = "A" * 20_000


def read_it(ending: str) -> list[dict[str, Any]]:
    """A turn whose answer is cut to `CUT`: its `ending` lies past the cut."""
    return [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": LONG + ending},
    ]


def approve(amount: int) -> list[dict[str, Any]]:
    """A prompt whose params are cut to `CUT`: their `amount` lies past the cut."""
    params = {"blob": "C" * 20_000, "amount": amount}
    action = {"request_id": "r1", "action": "approve", "params": params}
    return [{"role": "assistant", "content": "approve?", "hitl_action": action}]


def keeps_counted(logger: AgentMessageLogger) -> list[int]:
    """How many whole texts each call of the logger's `FullTextStore.keep` was given."""
    calls: list[int] = []
    keep = logger._full_texts.keep

    async def counted(full_texts: Any) -> None:
        calls.append(len(full_texts))
        await keep(full_texts)

    logger._full_texts.keep = counted  # type: ignore[method-assign]
    return calls


async def test_a_cut_field_records_the_digest_of_its_whole_text(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db, rules=CUT)

    logged = await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")

    cut = logged.messages[1].truncated
    assert cut is not None
    entry = cut["content"]
    assert isinstance(entry, Truncation)
    whole = (LONG + "first-ending").encode()
    assert entry.sha256 == hashlib.sha256(whole).hexdigest()
    stored = await backend.db.agent_messages.find_one({"_id": logged.messages[1].id})
    assert stored is not None
    assert stored["truncated"]["content"]["sha256"] == entry.sha256


async def test_a_retry_of_a_cut_turn_with_other_text_past_the_cut_is_a_conflict(
    backend: Backend,
) -> None:
    """The stored message holds a prefix of the text: a retry differing only past it, of the
    same length, is another turn, refused before anything is written (its whole text
    would have replaced the stored one)."""
    logger, store = AgentMessageLogger(backend.db, rules=CUT), ConversationStore(backend.db)
    await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")
    keeps = keeps_counted(logger)

    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, read_it("other-ending"), turn_id="t-1")

    assert keeps == []
    whole = await store.with_full_texts(await store.transcript(CID))
    assert whole[1].content == LONG + "first-ending"
    replayed = await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")
    assert replayed.replayed


async def test_a_retry_with_other_hitl_params_past_the_cut_is_a_conflict(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db, rules=CUT), ConversationStore(backend.db)
    await logger.log_messages(CID, approve(10), turn_id="t-1")
    keeps = keeps_counted(logger)

    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, approve(99), turn_id="t-1")

    assert keeps == []
    whole = await store.with_full_texts(await store.transcript(CID))
    assert whole[0].hitl_action is not None
    assert whole[0].hitl_action.params["amount"] == 10


async def test_past_the_kept_records_a_retry_with_other_text_past_the_cut_is_a_conflict(
    backend: Backend,
) -> None:
    """With no record left, the stored messages are the evidence: their digests of the whole
    texts tell the retry apart."""
    rules = replace(CUT, turns_recorded=2)
    logger, store = AgentMessageLogger(backend.db, rules=rules), ConversationStore(backend.db)
    await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")
    for n in range(4):
        await logger.log_messages(CID, [{"role": "user", "content": f"turn {n}"}], turn_id=f"t{n}")
    keeps = keeps_counted(logger)

    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, read_it("other-ending"), turn_id="t-1")

    assert keeps == []
    whole = await store.with_full_texts(await store.transcript(CID))
    assert whole[1].content == LONG + "first-ending"
    assert (await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")).replayed


async def unscoped_file(backend: Backend, blob: str | None) -> str | None:
    """Move a file to the id it had before file ids named the conversation's epoch."""
    if blob is None:
        return None
    old = unscoped_blob_id(blob)
    files = await backend.db[FILES].find_one({"_id": blob})
    chunks = await backend.db[CHUNKS].find({"files_id": blob}).to_list(None)
    assert files is not None
    await FullTextStore(backend.db).forget_files([blob])
    await backend.db[CHUNKS].insert_many(
        [{**c, "_id": f"{old}:{c['n']}", "files_id": old} for c in chunks]
    )
    await backend.db[FILES].insert_one({**files, "_id": old})
    return old


async def as_logged_before_whole_text_digests(backend: Backend, turn_id: str) -> None:
    """Make a stored turn look as one logged before cut fields recorded the digest of their
    whole text: no `sha256` in its `truncated` entries, its record's digest taken so, and
    (as then) its files under ids that name no epoch."""
    for document in await backend.db.agent_messages.find({"turn_id": turn_id}).to_list(None):
        if document.get("truncated"):
            entries = {
                path: {k: v for k, v in entry.items() if k != "sha256"}
                | {"blob_id": await unscoped_file(backend, entry["blob_id"])}
                for path, entry in document["truncated"].items()
            }
            await backend.db.agent_messages.update_one(
                {"_id": document["_id"]}, {"$set": {"truncated": entries}}
            )
    stored = await backend.db.agent_messages.find({"turn_id": turn_id}).sort("seq", 1).to_list(None)
    record = stored_turn_record(stored)
    await backend.db.agent_conversations.update_one(
        {"_id": CID, "turns.k": record["k"]}, {"$set": {"turns.$.d": record["d"]}}
    )


async def test_a_cut_turn_logged_before_whole_text_digests_is_replayed_by_its_whole_texts(
    backend: Backend,
) -> None:
    """Its record covers the prefixes only: a retry is a replay when the whole texts kept in
    GridFS are the retry's, else a Conflict, nothing written."""
    logger, store = AgentMessageLogger(backend.db, rules=CUT), ConversationStore(backend.db)
    await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")
    await as_logged_before_whole_text_digests(backend, "t-1")
    keeps = keeps_counted(logger)

    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, read_it("other-ending"), turn_id="t-1")
    assert keeps == []

    replayed = await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")
    assert replayed.replayed
    whole = await store.with_full_texts(await store.transcript(CID))
    assert whole[1].content == LONG + "first-ending"


async def test_a_cut_turn_logged_before_whole_text_digests_without_its_file_is_refused(
    backend: Backend,
) -> None:
    """Nothing left tells the whole text of such a turn: a retry is refused, not taken."""
    logger = AgentMessageLogger(backend.db, rules=CUT)
    await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")
    await as_logged_before_whole_text_digests(backend, "t-1")
    await backend.db[CHUNKS].delete_many({})

    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, read_it("first-ending"), turn_id="t-1")


async def test_whole_texts_larger_together_than_one_reply_are_read_in_batches(
    wire_backend: Backend,
) -> None:
    """A server answers a read in replies of 16 MiB at most (the embedded one in one reply of
    any size, which the driver refuses past 48 MB): the chunks of many whole texts are read
    in batches that fit."""
    texts = FullTextStore(wire_backend.db)
    at = utc_now()
    wanted = {
        blob_id(f"m-{n}", "content"): f"{n:03d}" + "x" * 3_000_000 for n in range(18)
    }  # 54 MB of chunks
    await texts.keep(
        [FullText(b, "c-big", f"m-{n}", "content", text, at)
         for n, (b, text) in enumerate(wanted.items())]
    )  # fmt: skip

    assert await texts.texts(wanted) == wanted


# -- a whole text belongs to one conversation under an id ----------------------------------------

STALLED = TurnRules(max_message_bytes=SMALL_BOUND, claim_grace=timedelta(seconds=0.05))
B_TEXT, A_TEXT = "B-PRIVATE " * 2000, "A-PRIVATE " * 2000


def stalled(owner: Any, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Pause `owner._full_texts.<name>` until the first event is set; the second is set when a
    call reaches it."""
    gate, reached = asyncio.Event(), asyncio.Event()
    original = getattr(owner._full_texts, name)

    async def paused(*args: Any) -> Any:
        reached.set()
        await gate.wait()
        return await original(*args)

    setattr(owner._full_texts, name, paused)
    return gate, reached


async def test_a_stalled_writer_of_a_deleted_conversation_leaves_the_next_ones_whole_text(
    backend: Backend,
) -> None:
    """User B's turn stalls between its reservation and its whole texts; B deletes the
    conversation and user A starts one under the id with a turn of the same id (the same
    message ids). B's writer, resuming, is refused and writes nothing A reads: A's whole
    text stays A's, and nothing of B's text is left once B is erased."""
    store = ConversationStore(backend.db, rules=STALLED)
    logger_a = AgentMessageLogger(backend.db, rules=STALLED)
    logger_b = AgentMessageLogger(backend.db, rules=STALLED)
    gate, reached = stalled(logger_b, "keep")
    b_turn = asyncio.create_task(
        logger_b.log_messages(
            CID, [{"role": "user", "content": B_TEXT}], user_id="user-b", turn_id="t1"
        )
    )
    await reached.wait()
    await store.delete(CID, user_id="user-b")
    await logger_a.log_messages(
        CID, [{"role": "user", "content": A_TEXT}], user_id="user-a", turn_id="t1"
    )

    gate.set()
    with pytest.raises(Conflict, match="was deleted since"):
        await b_turn

    whole = await store.with_full_texts(await store.transcript(CID, user_id="user-a"))
    assert whole[0].content == A_TEXT
    await store.erase_user("user-b")
    chunks = await backend.db[CHUNKS].find({}).to_list(None)
    assert not any(b"B-PRIVATE" in bytes(chunk["data"]) for chunk in chunks)


async def test_a_stalled_pop_of_a_deleted_conversation_leaves_the_next_ones_whole_text(
    backend: Backend,
) -> None:
    """B's pop removes its message and stalls before deleting its whole text; B deletes the
    conversation and A starts one under the id with turns of the same ids. The pop, resuming,
    deletes B's whole text only: A's message is still read whole."""
    store = ConversationStore(backend.db, rules=STALLED)
    store_b = ConversationStore(backend.db, rules=STALLED)
    logger = AgentMessageLogger(backend.db, rules=STALLED)
    for user, text in (("user-b", B_TEXT), ("user-a", A_TEXT)):
        if user == "user-a":
            await store.delete(CID, user_id="user-b")
        await logger.log_messages(CID, [{"role": "user", "content": "hi"}], user_id=user,
                                  turn_id="t0")  # fmt: skip
        await logger.log_messages(CID, [{"role": "assistant", "content": text}], user_id=user,
                                  turn_id="t1")  # fmt: skip
        if user == "user-b":
            gate, reached = stalled(store_b, "forget_files")
            pop = asyncio.create_task(store_b.pop_last_message(CID, user_id="user-b"))
            await reached.wait()

    gate.set()
    assert await pop is not None

    whole = await store.with_full_texts(await store.transcript(CID, user_id="user-a"))
    assert whole[1].content == A_TEXT


async def test_a_whole_text_not_matching_its_messages_digest_is_not_served(
    backend: Backend,
) -> None:
    """A file holding another text than the one the message's `truncated` entry records the
    SHA-256 of (written under its id by anything else) is not the message's: the reader
    serves the message cut, never someone else's text."""
    logger, store = AgentMessageLogger(backend.db, rules=CUT), ConversationStore(backend.db)
    logged = await logger.log_messages(CID, read_it("mine"), turn_id="t-1")
    entry = (logged.messages[1].truncated or {})["content"]
    assert isinstance(entry, Truncation)
    assert entry.blob_id is not None
    other = FullText(entry.blob_id, CID, str(logged.messages[1].id), "content", "theirs", utc_now())
    await FullTextStore(backend.db).forget_files([entry.blob_id])
    await FullTextStore(backend.db).keep([other])

    whole = await store.with_full_texts(await store.transcript(CID))

    assert whole[1].content == logged.messages[1].content
    assert whole[1].truncated == logged.messages[1].truncated


def stalled_after(owner: Any, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Pause after `owner._full_texts.<name>` has run, until the first event is set; the second
    is set when a call has run it."""
    gate, reached = asyncio.Event(), asyncio.Event()
    original = getattr(owner._full_texts, name)

    async def paused(*args: Any) -> Any:
        done = await original(*args)
        reached.set()
        await gate.wait()
        return done

    setattr(owner._full_texts, name, paused)
    return gate, reached


async def a_turn_kept_and_not_inserted(logger: AgentMessageLogger) -> tuple[asyncio.Event, Any]:
    """User A's turn `t1` under the id, paused between the keep of its whole text and the insert
    of its message; the gate that lets it go on, and the turn."""
    gate, kept = stalled_after(logger, "keep")
    turn = asyncio.create_task(
        logger.log_messages(
            CID, [{"role": "user", "content": A_TEXT}], user_id="user-a", turn_id="t1"
        )
    )
    await kept.wait()
    return gate, turn


LATE_CLEANUPS: dict[str, Callable[[ConversationStore], Awaitable[object]]] = {
    "a repeated delete": lambda store: store.delete(CID, user_id="user-b"),
    "an erasure": lambda store: store.erase_user("user-b"),
}
"""What deletes user B's conversation and then cleans up its whole texts, late."""


@pytest.mark.parametrize("late_cleanup", LATE_CLEANUPS)
async def test_a_late_whole_text_cleanup_leaves_the_next_conversations_whole_text(
    backend: Backend, late_cleanup: str
) -> None:
    """B's delete repeated (a client's retry after a timeout), or B's erasure, deletes the
    messages of B's conversation and stalls before its whole-text cleanup; B's delete frees the
    id meanwhile, and A's turn there keeps its whole text. The cleanup, reaching the server
    before A's insert, takes the deleted conversation's files only: A's message is read whole,
    and nothing of B's text is left."""
    store, late = ConversationStore(backend.db), ConversationStore(backend.db)
    logger = AgentMessageLogger(backend.db, rules=STALLED)
    await logger.log_messages(
        CID, [{"role": "user", "content": B_TEXT}], user_id="user-b", turn_id="t1"
    )
    cleanup, reached = stalled(late, "forget_conversations")
    cleaning = asyncio.create_task(LATE_CLEANUPS[late_cleanup](late))
    await reached.wait()
    await store.delete(CID, user_id="user-b")
    insert, a_turn = await a_turn_kept_and_not_inserted(
        AgentMessageLogger(backend.db, rules=STALLED)
    )

    cleanup.set()
    await cleaning
    insert.set()
    await a_turn

    whole = await store.with_full_texts(await store.transcript(CID, user_id="user-a"))
    assert whole[0].content == A_TEXT
    chunks = await backend.db[CHUNKS].find({}).to_list(None)
    assert not any(b"B-PRIVATE" in bytes(chunk["data"]) for chunk in chunks)


def test_the_migrations_cleanup_of_a_removed_conversation_leaves_the_next_ones_whole_text() -> None:
    """The migration removes a conversation it made and stopped with no message, and forgets
    the whole texts kept under its id; a person started a conversation under the id meanwhile
    and kept a whole text there, its message not inserted yet. The cleanup takes the
    migration's file (no epoch) only."""
    db: Any = mongomock.MongoClient().db
    db[CONVERSATIONS].insert_one({"_id": CID, "epoch": "e-person"})
    at = utc_now()
    persons = FullText(blob_id("m1", "content", "e-person"), CID, "m1", "content", A_TEXT, at,
                       epoch="e-person")  # fmt: skip
    migrations = FullText(blob_id("m0", "content"), CID, "m0", "content", B_TEXT, at)
    full_texts.keep(db, [persons, migrations], Bounds())

    full_texts.forget_conversations(db, [CID])

    kept = full_texts.texts(db, [persons.blob_id, migrations.blob_id])
    assert kept == {persons.blob_id: A_TEXT}


async def test_a_full_stream_puts_whole_texts_back_a_part_at_a_time(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed transcript with `full` holds the whole texts of one part at once, at most
    `FULL_TEXT_PART_CHARS` characters (one message's at least), never those of its whole
    batch: 32 messages of 15 MiB each held 480 MiB per request."""
    from agent_store.store import _reads
    from agent_store.store._blobs import whole_text_chars

    monkeypatch.setattr(_reads, "FULL_TEXT_PART_CHARS", 150_000)
    logger = AgentMessageLogger(backend.db, rules=TurnRules(max_message_bytes=16 * 1024))
    said = [{"role": "user", "content": f"{n}" * 60_000} for n in range(5)]
    await logger.log_messages("c-full", said, turn_id="t-1")
    store = ConversationStore(backend.db)
    cut = await store.transcript("c-full")
    assert [whole_text_chars(m) for m in cut] == [60_000] * 5

    batches = [b async for b in store.stream_transcript("c-full", full=True)]

    assert [len(b) for b in batches] == [2, 2, 1]
    assert [m.content for b in batches for m in b] == [f"{n}" * 60_000 for n in range(5)]


def cut_prompt() -> list[dict[str, Any]]:
    """A turn raising a prompt whose question and params are both cut to `CUT`."""
    params = {"files": [f"/data/report-{i:06d}.csv" for i in range(2_000)], "amount": 10}
    action = {"request_id": "r-cut", "action": "delete_files", "params": params}
    return [
        {"role": "user", "content": "clean up"},
        {"role": "assistant", "content": LONG + "delete them?", "hitl_action": action},
    ]


async def test_a_pending_prompt_cut_to_bound_its_message_is_marked_and_read_back_whole(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db, rules=CUT), ConversationStore(backend.db)
    sent = cut_prompt()
    await logger.log_messages(CID, sent, turn_id="t-1")

    conversation = await store.get_conversation(CID)
    assert conversation is not None
    assert conversation.pending_hitl is not None
    summary = conversation.pending_hitl
    assert summary.truncated == ["params", "prompt"]
    assert "truncated_json" in summary.params

    pending = await store.pending_hitl(CID)
    assert pending is not None
    assert pending.params == sent[1]["hitl_action"]["params"]
    assert pending.prompt == LONG + "delete them?"
    assert pending.truncated is None
    assert pending.request_id == "r-cut"


@pytest.mark.wire
async def test_a_pending_prompt_is_read_in_one_lookup_and_a_cut_one_in_three_more(
    wire_backend: Backend,
) -> None:
    assert wire_backend.commands is not None
    logger, store = AgentMessageLogger(wire_backend.db), ConversationStore(wire_backend.db)
    await logger.log_messages(CID, approve(10), turn_id="t-1")
    await logger.log_messages("other", cut_prompt(), turn_id="t-1")
    cut = AgentMessageLogger(wire_backend.db, rules=CUT)
    await cut.log_messages("cut", cut_prompt(), turn_id="t-1")
    wire_backend.commands.clear()

    pending = await store.pending_hitl(CID)
    assert pending is not None
    assert pending.truncated is None
    assert pending.params == {"blob": "C" * 20_000, "amount": 10}
    assert wire_backend.commands.names == ["find"]
    wire_backend.commands.clear()

    # a cut one: the prompt's message, then the files and chunks of its whole texts
    whole = await store.pending_hitl("cut")
    assert whole is not None
    assert whole.params == cut_prompt()[1]["hitl_action"]["params"]
    assert wire_backend.commands.names == ["find", "find", "find", "find"]


async def test_the_hitl_route_serves_a_cut_prompts_whole_params() -> None:
    async with serve(mongomock_db()) as served:
        await served.store.logger.log_messages(CID, oversized_prompt(), turn_id="t-1")
        got = await served.http.get(f"/v1/conversations/{CID}/hitl", headers=SERVICE)
        summary = await served.http.get(f"/v1/conversations/{CID}", headers=SERVICE)
    assert got.status_code == 200
    assert got.json()["pending"]["params"] == {"body": HUGE}
    assert got.json()["pending"]["truncated"] is None
    assert summary.json()["pending_hitl"]["truncated"] == ["params"]


def oversized_prompt() -> list[dict[str, Any]]:
    action = {"request_id": "r-big", "action": "send", "params": {"body": HUGE}}
    return [{"role": "assistant", "content": "send it?", "hitl_action": action}]
