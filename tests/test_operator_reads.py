"""The store reads behind the viewer's landing page and paged transcripts, on every backend."""

from __future__ import annotations

import pytest
from pymongo.errors import OperationFailure

from agent_store.core import InvalidInput, Unsupported
from agent_store.legacy import LEGACY_TURNS, LegacyTurns
from agent_store.store import AgentMessageLogger, ConversationStore, storage_errors
from tests.conftest import Backend


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


async def test_legacy_turns_tell_which_conversations_have_some(backend: Backend) -> None:
    await backend.db[LEGACY_TURNS].insert_many(
        [{"conversation_id": "conv-old", "user_message": "hi"} for _ in range(2)]
    )
    legacy = LegacyTurns(backend.db)
    assert await legacy.with_turns(["conv-old", "conv-new"]) == {"conv-old"}
    assert await legacy.with_turns([]) == set()


def test_a_query_needing_a_missing_index_is_unsupported_not_a_failure() -> None:
    with pytest.raises(Unsupported, match="text index"), storage_errors("search messages"):
        raise OperationFailure("text index required for $text query", code=27)
