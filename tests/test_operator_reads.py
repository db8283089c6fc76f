"""The store reads behind the viewer's landing page and paged transcripts, on every backend."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from bson import ObjectId
from pymongo.errors import OperationFailure

from agent_store.core import InvalidInput, Unsupported, utc_now
from agent_store.legacy import LEGACY_TURNS, LegacyTurns
from agent_store.store import AgentMessageLogger, ConversationStore, storage_errors
from tests.api_harness import mongomock_db
from tests.conftest import Backend, count_documents_read


async def test_recent_conversations_span_every_user_most_recent_first(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.ensure_indexes()
    for n, user in enumerate(["user-a", "user-b", None, "user-a", "user-c"]):
        await logger.log_messages(f"conv-{n}", [{"role": "user", "content": "hi"}], user_id=user)
    first = await store.recent_conversations(limit=3)
    assert [c.id for c in first.data] == ["conv-4", "conv-3", "conv-2"]
    assert first.next_cursor is not None
    rest = await store.recent_conversations(limit=3, cursor=first.next_cursor)
    assert [c.id for c in rest.data] == ["conv-1", "conv-0"]
    assert (rest.has_more, rest.next_cursor) == (False, None)


async def test_messages_by_seq_stops_at_the_limit(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    messages = [{"role": "user", "content": f"m{n}"} for n in range(7)]
    await logger.log_messages("conv-seq", messages, turn_id="t-1")
    page = await store.messages_by_seq("conv-seq", start=2, limit=3)
    assert [m.seq for m in page] == [2, 3, 4]
    with pytest.raises(InvalidInput, match="limit"):
        await store.messages_by_seq("conv-seq", limit=0)


BULKY = "x" * 9_000


async def test_a_page_by_seq_ends_before_the_message_that_passes_page_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`seq_page`, what a viewer page of a transcript reads: bounded by bytes as every page is
    (`PAGE_BYTES`, one message at least), saying when more follow, read in batches sized by
    the room left, never `limit` messages at once whatever they hold."""
    # Each message takes about 18.6 KB (its text, and again as its `search_text`): five fit.
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 95_000)
    monkeypatch.setattr("agent_store.store._reads.PAGE_FIRST_BATCH", 3)
    db = mongomock_db()
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    turn = [{"role": "user", "content": f"{n} {BULKY}"} for n in range(12)]
    await logger.log_messages("conv-bulky", turn, turn_id="t-1")
    read = count_documents_read(monkeypatch, store._messages)
    first = await store.seq_page("conv-bulky", limit=100)
    assert ([m.seq for m in first.data], first.has_more) == ([0, 1, 2, 3, 4], True)
    assert read == [3, 3]  # three, then the room left for two and one to tell it is full
    second = await store.seq_page("conv-bulky", start=5, limit=100)
    assert ([m.seq for m in second.data], second.has_more) == ([5, 6, 7, 8, 9], True)
    last = await store.seq_page("conv-bulky", start=10, limit=100)
    assert ([m.seq for m in last.data], last.has_more) == ([10, 11], False)
    assert (await store.seq_page("conv-bulky", start=2, limit=2)).has_more
    with pytest.raises(InvalidInput, match="limit"):
        await store.seq_page("conv-bulky", limit=0)


async def test_a_page_of_legacy_turns_ends_before_the_turn_that_passes_page_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`LegacyTurns.turns_page`, what the viewer's legacy comparison reads: oldest first from
    a position, bounded by bytes as every page is, in batches sized by the room left."""
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 46_000)  # five turns of 9.1 KB
    monkeypatch.setattr("agent_store.store._reads.PAGE_FIRST_BATCH", 3)
    db = mongomock_db()
    start = datetime(2024, 1, 1, tzinfo=UTC)
    await db[LEGACY_TURNS].insert_many(
        [
            {"_id": f"t-{n:02d}", "conversation_id": "conv-old", "user_message": BULKY,
             "created_at": start.replace(minute=n)}
            for n in range(12)
        ]
    )  # fmt: skip
    legacy = LegacyTurns(db)
    read = count_documents_read(monkeypatch, legacy._turns)
    turns, more = await legacy.turns_page("conv-old", limit=2000)
    assert ([t["_id"] for t in turns], more) == ([f"t-{n:02d}" for n in range(5)], True)
    assert read == [3, 3]
    turns, more = await legacy.turns_page("conv-old", skip=10, limit=2000)
    assert ([t["_id"] for t in turns], more) == (["t-10", "t-11"], False)


async def test_legacy_turns_tell_which_conversations_have_some(backend: Backend) -> None:
    await backend.db[LEGACY_TURNS].insert_many(
        [{"conversation_id": "conv-old", "user_message": "hi"} for _ in range(2)]
    )
    legacy = LegacyTurns(backend.db)
    assert await legacy.with_turns(["conv-old", "conv-new"]) == {"conv-old"}
    assert await legacy.with_turns([]) == set()


async def test_legacy_turns_are_found_by_the_id_the_store_knows_them_by(backend: Backend) -> None:
    """As the read fallback finds them (`_turns_of`): an ObjectId or a number the legacy turns
    name is the id as text, and a turn naming none is its `legacy-turn-` id."""
    oid = ObjectId("65a1b2c3d4e5f60718293a4b")
    earlier = datetime(2024, 1, 1, tzinfo=UTC)
    await backend.db[LEGACY_TURNS].insert_many(
        [
            {"_id": "t-2", "conversation_id": oid, "created_at": utc_now(), "user_message": "b"},
            {"_id": "t-1", "conversation_id": oid, "created_at": earlier, "user_message": "a"},
            {"_id": "t-3", "conversation_id": 424242, "user_message": "c"},
            {"_id": "t-4", "user_message": "d"},
        ]
    )
    legacy = LegacyTurns(backend.db)
    ids = [str(oid), "424242", "legacy-turn-t-4", "legacy-turn-t-5"]
    assert await legacy.with_turns(ids) == set(ids[:3])
    assert [t["_id"] for t in await legacy.turns(str(oid), limit=10)] == ["t-1", "t-2"]
    assert [t["_id"] for t in await legacy.turns(str(oid), limit=1)] == ["t-1"]
    assert [t["_id"] for t in await legacy.turns("legacy-turn-t-4", limit=10)] == ["t-4"]


def test_a_query_needing_a_missing_index_is_unsupported_not_a_failure() -> None:
    with pytest.raises(Unsupported, match="text index"), storage_errors("search messages"):
        raise OperationFailure("text index required for $text query", code=27)
