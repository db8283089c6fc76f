"""The end of a conversation: reading its last messages, and removing the last one."""

from __future__ import annotations

from typing import Any

import pytest

from agent_store import AgentMessageLogger, Conflict, ConversationStore, InvalidInput
from tests.conftest import Backend

CID = "conv-tail"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def answer(text: str, tokens: int = 0) -> dict[str, Any]:
    usage = {"input_tokens": tokens, "output_tokens": tokens} if tokens else None
    return {"role": "assistant", "content": text, "token_usage": usage}


async def log_two_turns(backend: Backend) -> tuple[AgentMessageLogger, ConversationStore]:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("first question"), answer("first answer", 10)])
    await logger.log_messages(CID, [user("second question"), answer("second answer", 5)])
    return logger, ConversationStore(backend.db)


async def test_recent_messages_are_the_last_ones_in_seq_order(backend: Backend) -> None:
    _, store = await log_two_turns(backend)

    last_three = await store.recent_messages(CID, limit=3)
    everything = await store.recent_messages(CID)

    assert [m.content for m in last_three] == ["first answer", "second question", "second answer"]
    assert [m.seq for m in everything] == [0, 1, 2, 3]
    assert await store.recent_messages("conv-never-written", limit=5) == []
    with pytest.raises(InvalidInput, match="at least 1"):
        await store.recent_messages(CID, limit=0)


async def test_popping_the_last_message_leaves_the_summary_as_if_it_was_never_logged(
    backend: Backend,
) -> None:
    logger, store = await log_two_turns(backend)
    await logger.log_messages(CID, [user("third question")])
    before_third = await store.get_conversation(CID)

    popped_question = await store.pop_last_message(CID)
    popped_answer = await store.pop_last_message(CID)

    assert popped_question is not None
    assert popped_question.content == "third question"
    assert popped_answer is not None
    assert popped_answer.content == "second answer"
    conversation = await store.get_conversation(CID)
    assert conversation.message_count == 3  # the next free seq: both seqs were given back
    assert conversation.turn_count == 2 == before_third.turn_count - 1
    assert conversation.usage.input_tokens == 10
    assert conversation.last_message_preview == "second question"
    assert [m.content for m in await store.transcript(CID)] == [
        "first question", "first answer", "second question",
    ]  # fmt: skip
    again = await logger.log_messages(CID, [answer("a new second answer")])
    assert again.messages[0].seq == 3


async def test_popping_while_another_turn_has_reserved_past_it_gives_no_seq_back(
    backend: Backend,
) -> None:
    logger, store = await log_two_turns(backend)
    # Another writer's turn reserved seq 4-5 and has not inserted yet.
    await backend.db.agent_conversations.update_one({"_id": CID}, {"$inc": {"message_count": 2}})

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.seq == 3
    assert (await store.get_conversation(CID)).message_count == 6
    later = await logger.log_messages(CID, [user("later question")])
    assert later.messages[0].seq == 6


async def test_a_retry_of_a_turn_a_pop_corrected_is_a_conflict_and_brings_nothing_back(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RUNTIMES.md "pop_item and the counters": the turn's record stays, and a retry of the
    turn is a Conflict, whatever it sends. Here turn V reserved past the popped message (so
    its `seq` is not given back and the block of T still looks whole from the records)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.ensure_indexes()
    t_turn = [user("T?"), answer("T!", 10)]
    await logger.log_messages(CID, t_turn, turn_id="T")

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("V reserved seq 2-3 and died before its insert")

    monkeypatch.setattr(logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await logger.log_messages(CID, [user("V?"), answer("V!", 100)], turn_id="V")
    monkeypatch.undo()
    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.content == "T!"

    for retry in (t_turn, [user("T?")]):
        with pytest.raises(Conflict, match="corrected"):
            await logger.log_messages(CID, retry, turn_id="T")
    await logger.log_messages(CID, [user("V?"), answer("V!", 100)], turn_id="V")

    assert [m.content for m in await store.transcript(CID)] == ["T?", "V?", "V!"]
    assert (await store.get_conversation(CID)).usage.input_tokens == 100


async def test_popping_the_prompt_that_is_pending_clears_it(backend: Backend) -> None:
    logger, store = await log_two_turns(backend)
    hitl = {"action": "confirm", "params": {}, "request_id": "req-1"}
    await logger.log_messages(CID, [{"role": "assistant", "content": "Sure?", "hitl_action": hitl}])
    assert await store.pending_hitl(CID) is not None

    await store.pop_last_message(CID)

    assert await store.pending_hitl(CID) is None


async def test_popping_an_empty_or_unknown_conversation_returns_none(backend: Backend) -> None:
    _, store = await log_two_turns(backend)
    for _ in range(4):
        assert await store.pop_last_message(CID) is not None

    assert await store.pop_last_message(CID) is None
    assert await store.pop_last_message("conv-never-written") is None
    conversation = await store.get_conversation(CID)
    assert (conversation.message_count, conversation.turn_count) == (0, 0)
    assert conversation.last_message_preview == ""
    assert conversation.usage.input_tokens == conversation.usage.output_tokens == 0


async def test_reading_the_last_messages_costs_one_round_trip(wire_backend: Backend) -> None:
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db)
    await logger.log_messages(CID, [user(f"message {n}") for n in range(150)])
    store = ConversationStore(wire_backend.db)

    wire_backend.commands.clear()
    last = await store.recent_messages(CID, limit=120)
    assert wire_backend.commands.names == ["find"]
    assert [m.seq for m in last] == list(range(30, 150))

    wire_backend.commands.clear()
    everything = await store.recent_messages(CID)
    assert wire_backend.commands.names == ["find"]
    assert len(everything) == 150


async def test_popping_costs_four_round_trips_and_one_more_per_read_of_the_messages_before(
    wire_backend: Backend,
) -> None:
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db)
    call = {"id": "call_1", "function": {"name": "lookup", "arguments": "{}"}}
    await logger.log_messages(
        CID, [user("look it up"), {"role": "assistant", "tool_calls": [call]}]
    )
    answered = {"role": "tool", "tool_call_id": "call_1", "content": "found"}
    await logger.log_messages(CID, [answered, user("never mind")])
    store = ConversationStore(wire_backend.db)

    wire_backend.commands.clear()
    await store.pop_last_message(CID)  # the user message: it started a turn and is the preview
    # The last message, the two before it, then mark, remove, correct the summary.
    assert wire_backend.commands.names == ["find", "find", "find", "update", "delete", "update"]

    wire_backend.commands.clear()
    await store.pop_last_message(CID)  # the answer: its call comes back as listed before it
    assert wire_backend.commands.names == ["find", "find", "update", "delete", "update"]

    wire_backend.commands.clear()
    await store.pop_last_message(CID)  # the tool call: it leaves the list, nothing is read
    assert wire_backend.commands.names == ["find", "update", "delete", "update"]


async def test_a_pop_racing_a_new_turn_leaves_the_new_turns_preview(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new turn reserves between the pop's removal and its summary update."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [user("first"), {"role": "assistant", "content": "one"}])
    await logger.log_messages(CID, [user("second")], turn_id="t-2")
    conversations = store._conversations
    update_one = conversations.update_one

    async def a_turn_first(*args: Any, **kwargs: Any) -> Any:
        await logger.log_messages(CID, [user("racing")], turn_id="t-race")
        return await update_one(*args, **kwargs)

    monkeypatch.setattr(conversations, "update_one", a_turn_first)

    await store.pop_last_message(CID)

    conversation = await store.get_conversation(CID)
    assert conversation.last_message_preview == "racing"
