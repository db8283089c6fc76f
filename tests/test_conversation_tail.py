"""The end of a conversation: reading its last messages, and removing the last one."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    NotFound,
    RetryPolicy,
    SteeringInbox,
    StorageUnavailable,
    StoreError,
    TurnRules,
    with_retries,
)
from agent_store.store import CONVERSATIONS, MESSAGES
from agent_store.store._logger import OtherContent
from tests.conftest import Backend, StoreClocks
from tests.test_write_integrity import SlowInsert, check_conversation
from tests.test_write_integrity import turn as exchange

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


async def life_two_under_a_late_insert_of_life_one(backend: Backend) -> ConversationStore:
    """CID deleted after three turns (seq 0-5) and started again with one (seq 0-1), then the
    late insert of its first life's last two turns (their writer reserved them before the
    delete and died after the insert landed): four messages of another `epoch` at seq 2-5,
    above the new life's, until the delete's sweep."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    for n in range(3):
        await logger.log_messages(CID, [user(f"old q{n}"), answer(f"old a{n}")], turn_id=f"o{n}")
    late = (
        await backend.db[MESSAGES].find({"conversation_id": CID, "seq": {"$gte": 2}}).to_list(None)
    )
    store = ConversationStore(backend.db)
    await store.delete(CID)
    await logger.log_messages(CID, [user("new q"), answer("new a")], turn_id="n0")
    await backend.db[MESSAGES].insert_many(late)
    return store


async def test_the_last_messages_of_a_life_are_its_own_past_a_late_insert_of_another(
    backend: Backend,
) -> None:
    """RELIABILITY.md: a late insert of a life a delete ended is never served; a window of the
    last messages (`recent_messages(limit)`, a page newest first) holds the last of this
    life's, never fewer because the other life's lie above them, and a page that says more
    follow names where to read on."""
    store = await life_two_under_a_late_insert_of_life_one(backend)

    recent = {n: [m.content for m in await store.recent_messages(CID, limit=n)] for n in (1, 2, 3)}
    newest = await store.messages_page(CID, order="desc", limit=1)
    below = await store.messages_page(CID, order="desc", limit=1, after=newest.last_id)
    whole = await store.messages_page(CID, order="desc", limit=2)

    assert recent == {1: ["new a"], 2: ["new q", "new a"], 3: ["new q", "new a"]}
    assert ([m.content for m in newest.data], newest.has_more) == (["new a"], True)
    assert ([m.content for m in below.data], below.has_more) == (["new q"], False)
    assert ([m.content for m in whole.data], whole.has_more) == (["new a", "new q"], False)


async def test_an_agents_sessions_window_is_its_lifes_last_items_past_a_late_insert_of_another(
    backend: Backend,
) -> None:
    """RUNTIMES.md: the last `limit` items are the last `limit` messages, of this life: the
    Agents SDK session's window past another life's late insert is not empty."""
    from agent_store.integrations.openai_agents import ConversationSession

    await life_two_under_a_late_insert_of_life_one(backend)
    session = ConversationSession(CID, backend.db)

    window = await session.get_items(limit=2)

    said = [item.get("content") for item in window]
    assert said == ["new q", [{"type": "output_text", "text": "new a", "annotations": []}]]


def calling(tool: str, call_id: str) -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": tool, "arguments": "{}"}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


async def test_the_calls_before_a_page_are_its_lifes_past_a_batch_of_another_lifes_late_insert(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md: a late insert of a life a delete ended is never served, nor does it
    take a page's results: `calls_before` pairs them with this life's calls, also when more
    than a batch of the other life's messages making the same call id lie below the page
    (the scan reads on with the life's `epoch` in its query, never stops at theirs)."""
    monkeypatch.setattr("agent_store.store._reads.PAGE_FIRST_BATCH", 3)
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    for n in range(6):
        await logger.log_messages(CID, [calling(f"old_{n}", "call_0")], turn_id=f"o{n}")
    late = (
        await backend.db[MESSAGES].find({"conversation_id": CID, "seq": {"$gte": 2}}).to_list(None)
    )
    store = ConversationStore(backend.db)
    await store.delete(CID)
    await logger.log_messages(CID, [user("new q"), calling("new", "call_0")], turn_id="n0")
    await backend.db[MESSAGES].insert_many(late)  # four calls of call_0 at seq 2-5

    found = await store.calls_before(CID, ["call_0"], before_seq=6)

    assert [(m.seq, m.tool_calls[0].function.name) for m in found if m.tool_calls] == [(1, "new")]
    assert len(found) == 1


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


async def test_popping_the_last_message_puts_updated_at_back_on_the_last_that_remains(
    backend: Backend,
) -> None:
    """`updated_at` is the last message's time: after a pop, the time of the one before it
    (the latest that remains, here), or the conversation's creation when none remains, so
    the list no longer sorts by the popped one."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    start = datetime(2025, 1, 1, tzinfo=UTC)
    await logger.log_messages(CID, [{**user("hi"), "created_at": start}], turn_id="t0")
    later = {**user("oops"), "created_at": start + timedelta(hours=5)}
    await logger.log_messages(CID, [later], turn_id="t1")

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "oops"
    conversation = await store.get_conversation(CID)
    assert (conversation.last_message_preview, conversation.updated_at) == ("hi", start)
    await store.pop_last_message(CID)
    emptied = await store.get_conversation(CID)
    assert emptied.updated_at == emptied.created_at


@pytest.mark.parametrize(
    "hours",
    [[3, 1, 2], [3, 1, 0, 5], [1, 3, 2], [0, 1, 2], [2, 2, 1, 2]],
    ids=["latest-first", "latest-deep-below", "below-the-latest", "in-order", "ties"],
)
async def test_a_pop_leaves_updated_at_as_logging_the_messages_that_remain_would(
    backend: Backend, hours: list[int]
) -> None:
    """DESIGN.md: `updated_at` is the last message's time, which a turn keeps as the latest
    time logged (clocks skew between pods, runtimes send their own `created_at`). A pop
    leaves what logging the messages that remain would set: the latest of their times,
    whatever their `seq` order, so the newest-first list orders the popped conversation by
    the messages it holds."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    start = datetime(2026, 6, 1, tzinfo=UTC)

    async def logged(conversation_id: str, times: list[int]) -> None:
        for n, hour in enumerate(times):
            message = {
                **user(f"{conversation_id} {n}"),
                "created_at": start + timedelta(hours=hour),
            }
            await logger.log_messages(conversation_id, [message], turn_id=f"t{n}", user_id="u1")

    await logged("conv-popped", hours)
    await logged("conv-logged", hours[:-1])
    await logged("conv-between", [max(hours[:-1]) - 1])

    await store.pop_last_message("conv-popped")

    popped = await store.get_conversation("conv-popped")
    kept = await store.get_conversation("conv-logged")
    assert popped.updated_at == kept.updated_at == start + timedelta(hours=max(hours[:-1]))
    listed = [c.id for c in (await store.list_conversations("u1", limit=10)).data]
    assert listed.index("conv-popped") < listed.index("conv-between")
    for _ in hours[:-1]:
        await store.pop_last_message("conv-popped")
    emptied = await store.get_conversation("conv-popped")
    assert emptied.updated_at == emptied.created_at


async def test_a_pop_never_takes_updated_at_before_the_conversations_creation(
    backend: Backend,
) -> None:
    """A conversation created before its messages' times (`upsert_conversation`, then turns
    a runtime dates earlier) has its creation time as `updated_at`, as an empty one does: a
    pop leaves it there, as logging the messages that remain would."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    created = await logger.upsert_conversation(CID, user_id="u1")
    start = created.created_at - timedelta(days=1)
    for n, hour in enumerate([3, 1, 2]):
        message = {**user(f"turn {n}"), "created_at": start + timedelta(hours=hour)}
        await logger.log_messages(CID, [message], turn_id=f"t{n}", user_id="u1")
    assert (await store.get_conversation(CID)).updated_at == created.created_at

    await store.pop_last_message(CID)

    assert (await store.get_conversation(CID)).updated_at == created.created_at


def at(seconds: int, message: dict[str, Any]) -> dict[str, Any]:
    """`message` dated `seconds` after 2026-01-01 (a runtime's own time)."""
    return {**message, "created_at": datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)}


async def lost(backend: Backend, conversation_id: str, messages: list[dict[str, Any]]) -> None:
    """Turn "lost" reserves its block and its process dies before the insert."""
    held = SlowInsert(AgentMessageLogger(backend.db))
    dead = asyncio.create_task(held.logger.log_messages(conversation_id, messages, turn_id="lost"))
    await held.reserved.wait()
    dead.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await dead


async def updated_at_and_latest(store: ConversationStore, conversation_id: str) -> Any:
    """The conversation's `updated_at`, and what DESIGN.md says it is: the latest time of
    the messages it keeps (its `created_at` when later)."""
    conversation = await store.get_conversation(conversation_id)
    times = [m.created_at for m in await store.transcript(conversation_id)]
    return conversation.updated_at, max([conversation.created_at, *times])


@pytest.mark.parametrize("changed", [False, True], ids=["same-content", "changed-content"])
@pytest.mark.parametrize("forked", [False, True], ids=["conversation", "fork"])
async def test_a_pop_above_the_gap_a_moved_turn_left_sets_updated_at_from_the_messages_below(
    backend: Backend, changed: bool, forked: bool
) -> None:
    """DESIGN.md: `updated_at` is the latest message time. Turn "lost" reserved seq 2 at
    17 s and its insert was lost; its retry past `abandon_after` moves it to seq 3, leaving
    seq 2 a gap no turn holds (`popped_seqs`), which no turn will ever fill. Popping the
    moved turn sets `updated_at` to the latest time stored below it (2 s), as with no gap:
    only a turn still being written under the message keeps it. The same on a fork."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    first = [at(1, user("first question")), at(2, answer("first answer"))]
    conversation_id = CID
    if forked:
        await logger.log_messages("conv-source", first, turn_id="t1")
        await logger.fork("conv-source", 1, CID)
    else:
        await logger.log_messages(CID, first, turn_id="t1")
    sent = [at(17, user("lost question"))]
    await lost(backend, conversation_id, sent)
    patient = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    retried = sent + ([at(18, answer("regenerated"))] if changed else [])
    moved = await patient.log_messages(conversation_id, retried, turn_id="lost")
    assert moved.messages[0].seq == 3
    store = ConversationStore(backend.db)

    for _ in retried:
        await store.pop_last_message(conversation_id)

    updated_at, latest = await updated_at_and_latest(store, conversation_id)
    assert updated_at == latest == first[1]["created_at"]


async def test_pops_down_past_a_moved_turns_gap_and_forks_above_it_keep_updated_at_right(
    backend: Backend,
) -> None:
    """Turn "lost" (seq 2-3, 17-18 s) lost its insert, turn "mid" was stored at seq 4 (20 s)
    and the lost turn's retry moved it to seq 5-6. A fork cut at "mid", just above the gap,
    shows its copies' latest time, and so does each pop down to the first turn, on the fork
    and on the conversation: no message time is kept past the pop that removed it."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    first = [at(1, user("first question")), at(2, answer("first answer"))]
    await logger.log_messages(CID, first, turn_id="t1")
    sent = [at(17, user("lost question")), at(18, answer("lost answer"))]
    await lost(backend, CID, sent)
    await logger.log_messages(CID, [at(20, user("mid question"))], turn_id="mid")
    patient = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    moved = await patient.log_messages(CID, sent, turn_id="lost")
    assert [m.seq for m in moved.messages] == [5, 6]
    store = ConversationStore(backend.db)
    await logger.fork(CID, 4, "conv-fork")

    for conversation_id in (CID, "conv-fork"):
        while await store.transcript(conversation_id):
            updated_at, latest = await updated_at_and_latest(store, conversation_id)
            assert updated_at == latest, conversation_id
            await store.pop_last_message(conversation_id)
        updated_at, latest = await updated_at_and_latest(store, conversation_id)
        assert updated_at == latest, conversation_id


@pytest.mark.parametrize("abandoned", [True, False], ids=["abandoned", "young"])
@pytest.mark.parametrize("role", ["user", "assistant"])
async def test_a_pop_above_a_block_its_turn_abandoned_sets_updated_at_from_the_messages_below(
    backend: Backend, role: str, abandoned: bool
) -> None:
    """A block reserved (17 s) and never inserted, older than `abandon_after`, is passed
    as tail readers pass it: popping the message above it (20 s) sets `updated_at` to the
    latest time stored below (2 s). While the block is younger, a pop of a tool call (no
    text, read from nothing below) keeps `updated_at` (the turn may still land a later time
    there), and a pop of a prompt waits."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    first = [at(1, user("first question")), at(2, answer("first answer"))]
    await logger.log_messages(CID, first, turn_id="t1")
    await lost(backend, CID, [at(17, user("lost question"))])
    call = {"id": "call_1", "function": {"name": "lookup", "arguments": "{}"}}
    above = at(20, user("above") if role == "user" else {"role": role, "tool_calls": [call]})
    await logger.log_messages(CID, [above], turn_id="above")
    rules = TurnRules(abandon_after=timedelta(0) if abandoned else timedelta(minutes=5))
    store = ConversationStore(backend.db, rules=rules)

    if role == "user" and not abandoned:
        with pytest.raises(StorageUnavailable, match="still being written at seq 2"):
            await store.pop_last_message(CID)
        assert await stored_seqs(backend) == [0, 1, 3]  # the pop removed nothing
        return
    assert await store.pop_last_message(CID) is not None

    updated_at, latest = await updated_at_and_latest(store, CID)
    assert latest == first[1]["created_at"]
    assert updated_at == (latest if abandoned else above["created_at"])


async def test_popping_past_a_block_abandoned_by_its_turn_gives_no_seq_back(
    backend: Backend,
) -> None:
    """A turn reserved seq 4-5 and never inserted. While it is younger than `abandon_after`
    the pop waits for it (StorageUnavailable); past that, the pop passes its block as tail
    readers do, removes seq 3, and gives no `seq` back: the turn's retry may still come."""
    logger, store = await log_two_turns(backend)
    await backend.db.agent_conversations.update_one({"_id": CID}, {"$inc": {"message_count": 2}})
    with pytest.raises(StorageUnavailable, match="still being written"):
        await store.pop_last_message(CID)
    store = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(0)))

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
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    t_turn = [user("T?"), answer("T!", 10)]
    await logger.log_messages(CID, t_turn, turn_id="T")

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("V reserved seq 2-3 and died before its insert")

    monkeypatch.setattr(logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await logger.log_messages(CID, [user("V?"), answer("V!", 100)], turn_id="V")
    monkeypatch.undo()
    # V's block is passed once older than `abandon_after` (0 for this store).
    store = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
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
    """The messages, and the conversation document read with them (two commands, one wait)."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db)
    await logger.log_messages(CID, [user(f"message {n}") for n in range(150)])
    store = ConversationStore(wire_backend.db)

    wire_backend.commands.clear()
    last = await store.recent_messages(CID, limit=120)
    assert wire_backend.commands.names == ["find", "find"]
    assert [m.seq for m in last] == list(range(30, 150))

    wire_backend.commands.clear()
    everything = await store.recent_messages(CID)
    assert wire_backend.commands.names == ["find", "find"]
    assert len(everything) == 150


POP_COMMANDS = ["find", "find", "find", "find", "update", "delete", "update"]
"""A pop's commands: the last message, the one before it, the preview's window, the LangGraph
checkpoints referring to it, then mark, remove, correct the summary."""


async def test_popping_costs_six_round_trips_and_one_more_per_read_of_the_messages_before(
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
    # The one before it is read for its time (`updated_at` now); no checkpoint refers to it.
    assert wire_backend.commands.names == POP_COMMANDS

    wire_backend.commands.clear()
    await store.pop_last_message(CID)  # the answer: its call comes back as listed before it
    assert wire_backend.commands.names == POP_COMMANDS

    wire_backend.commands.clear()
    await store.pop_last_message(CID)  # the tool call: it leaves the list, one read before it
    assert wire_backend.commands.names == ["find", "find", "find", "update", "delete", "update"]


async def test_a_turn_logged_while_a_pop_is_under_way_finishes_the_pop_first(
    backend: Backend,
) -> None:
    """RELIABILITY.md (pops): no write decides on a summary a pop under way has not corrected
    yet. A new turn logged between the pop's removal and its summary update finds the pop's
    mark, finishes the pop, and reserves on the corrected summary: it takes the `seq` given
    back, and the pop's own update, finding its mark cleared, changes nothing."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("first"), {"role": "assistant", "content": "one"}])
    await logger.log_messages(CID, [user("second")], turn_id="t-2")
    store = ConversationStore(backend.db)

    async def a_turn() -> None:
        logged = await logger.log_messages(CID, [user("racing")], turn_id="t-race")
        assert [m.seq for m in logged.messages] == [2]

    racing_the_summary_update(store, a_turn)
    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "second"
    conversation = await store.get_conversation(CID)
    assert conversation.last_message_preview == "racing"
    assert (conversation.message_count, conversation.turn_count) == (3, 2)
    assert [m.content for m in await store.transcript(CID)] == ["first", "one", "racing"]


async def test_a_pop_racing_a_turn_of_an_older_writer_leaves_the_new_turns_preview(
    backend: Backend,
) -> None:
    """A turn of a writer that reserves past a pop under way (one from before turns finished
    it, in a rolling upgrade) between the pop's removal and its summary update: the removed
    `seq` stays a gap, and the preview is the new turn's."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("first"), {"role": "assistant", "content": "one"}])
    await logger.log_messages(CID, [user("second")], turn_id="t-2")
    store = ConversationStore(backend.db)
    older = an_older_writer(backend)

    async def a_turn() -> None:
        await older.log_messages(CID, [user("racing")], turn_id="t-race")

    racing_the_summary_update(store, a_turn)
    await store.pop_last_message(CID)

    conversation = await store.get_conversation(CID)
    assert conversation.last_message_preview == "racing"
    assert conversation.message_count == 4  # seq 2 is not given back: the new turn holds 3


def an_older_writer(backend: Backend) -> AgentMessageLogger:
    """A logger whose turns reserve while a pop is under way, as writers did before a turn
    finished the pop first: its reservation's filter does not ask for no pop's mark."""
    logger = AgentMessageLogger(backend.db)
    logger._conversations = _Unmarked(logger._conversations)  # type: ignore[assignment]
    return logger


class _Unmarked:
    """A conversations collection whose `find_one_and_update` filters drop `popping`."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name != "find_one_and_update":
            return real

        async def reserve(query: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            return await real({k: v for k, v in query.items() if k != "popping"}, *args, **kwargs)

        return reserve


class BeforeCall:
    """A collection that runs `hook` before its call number `number` (from 0) of `method`."""

    def __init__(self, collection: Any, method: str, number: int, hook: Any) -> None:
        self._collection, self._method = collection, method
        self._number, self._hook = number, hook

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name != self._method:
            return real

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self._number == 0:
                await self._hook()
            self._number -= 1
            return await real(*args, **kwargs)

        return call


def racing_the_summary_update(store: ConversationStore, turn: Any) -> None:
    """A turn logged (reserved and inserted) while the pop removed its message and had not
    corrected the summary: between the pop's mark and its last update."""
    store._conversations = BeforeCall(store._conversations, "update_one", 1, turn)  # type: ignore[assignment]


async def test_pops_after_one_that_raced_a_turn_still_correct_the_preview_and_give_seqs_back(
    backend: Backend,
) -> None:
    """RUNTIMES.md (pop_item): the summary is corrected as if the message had never been
    logged. A pop that raced a turn of an older writer (`an_older_writer`) leaves its `seq` as
    a gap; later pops, with no writer anywhere, still recompute the preview and give their
    `seq`s back, the gap with them."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("a"), answer("A-answer")], turn_id="a")
    await logger.log_messages(CID, [user("b"), answer("B-answer")], turn_id="b")
    racing = ConversationStore(backend.db)
    older = an_older_writer(backend)

    async def a_turn() -> None:
        await older.log_messages(CID, [user("c")], turn_id="c")

    racing_the_summary_update(racing, a_turn)
    popped = [await racing.pop_last_message(CID)]  # B-answer: seq 3 stays a gap

    store = ConversationStore(backend.db)  # from here on one caller, nothing else running
    popped += [await store.pop_last_message(CID), await store.pop_last_message(CID)]

    assert [m.content if m else None for m in popped] == ["B-answer", "c", "b"]

    assert [m.content for m in await store.transcript(CID)] == ["a", "A-answer"]
    conversation = await store.get_conversation(CID)
    assert conversation.last_message_preview == "A-answer"
    assert conversation.message_count == 2
    later = await logger.log_messages(CID, [user("d")], turn_id="d")
    assert later.messages[0].seq == 2


async def test_a_pop_racing_a_turn_without_text_leaves_no_preview_of_the_removed_message(
    backend: Backend,
) -> None:
    """DESIGN §2: the preview is the text of the last user/assistant message. A turn without
    text (a call and its result) logged while the pop ran, by an older writer that reserves
    past a pop under way (`an_older_writer`), sets no preview of its own: the preview is then
    the last text that remains, never the removed message's."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("hello"), answer("SECRET")], turn_id="a")
    store = ConversationStore(backend.db)
    older = an_older_writer(backend)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}

    async def a_turn_without_text() -> None:
        await older.log_messages(
            CID,
            [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'}],
            turn_id="b",
        )  # fmt: skip

    racing_the_summary_update(store, a_turn_without_text)
    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "SECRET"
    assert "SECRET" not in [m.content for m in await store.transcript(CID)]
    assert (await store.get_conversation(CID)).last_message_preview == "hello"


async def test_a_pop_while_a_turn_is_between_its_writes_waits_for_it(backend: Backend) -> None:
    """RUNTIMES.md: `pop_item` removes the last message (by `seq`). A turn that reserved
    seq 2-3 and has not inserted yet holds the last messages: the pop raises
    StorageUnavailable (retry in a moment) and removes nothing; once the turn is stored,
    the pop removes its last message."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("a?"), answer("a!")], turn_id="a")
    held = SlowInsert(AgentMessageLogger(backend.db))
    writing = asyncio.create_task(
        held.logger.log_messages(CID, [user("b?"), answer("b!")], turn_id="b")
    )
    await held.reserved.wait()  # turn b holds seq 2-3
    store = ConversationStore(backend.db)

    with pytest.raises(StorageUnavailable, match="still being written"):
        await store.pop_last_message(CID)
    assert [m.content for m in await store.transcript(CID)] == ["a?", "a!"]

    held.release.set()
    await writing
    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.seq == 3
    assert [m.seq for m in await store.transcript(CID)] == [0, 1, 2]


async def test_a_turn_stored_between_a_pops_read_and_its_mark_is_the_one_popped(
    backend: Backend,
) -> None:
    """The pop removes the message that is last when it takes effect (its mark), not one a
    turn logged meanwhile has put in the middle."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("a?"), answer("a!")], turn_id="a")
    store = ConversationStore(backend.db)

    async def a_turn() -> None:
        await logger.log_messages(CID, [user("b?")], turn_id="b")

    store._conversations = BeforeCall(store._conversations, "update_one", 0, a_turn)  # type: ignore[assignment]
    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "b?"
    assert [m.content for m in await store.transcript(CID)] == ["a?", "a!"]
    assert (await store.get_conversation(CID)).message_count == 2


def call(call_id: str) -> dict[str, Any]:
    function = {"name": "lookup", "arguments": "{}"}
    return {"role": "assistant", "tool_calls": [{"id": call_id, "function": function}]}


def result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": '{"ok": true}'}


async def holding(backend: Backend, messages: list[dict[str, Any]], turn_id: str) -> Any:
    """A turn that has reserved its block and not inserted yet: (task, SlowInsert)."""
    held = SlowInsert(AgentMessageLogger(backend.db))
    task = asyncio.create_task(held.logger.log_messages(CID, messages, turn_id=turn_id))
    await held.reserved.wait()
    return task, held


async def test_a_pop_waits_for_an_earlier_turn_still_inserting_then_previews_its_text(
    backend: Backend,
) -> None:
    """RUNTIMES.md: the preview is recomputed from the last earlier message with text. Turn
    b holds seq 2 (reserved, inserting) and turn c is stored at seq 3: what the messages
    before c leave is not known yet, so the pop raises StorageUnavailable and removes
    nothing; once b is stored, the pop leaves b's text as the preview."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("A?"), answer("A!")], turn_id="a")
    writing, held = await holding(backend, [answer("B, inserted late")], "b")
    await logger.log_messages(CID, [answer("C, popped")], turn_id="c")
    store = ConversationStore(backend.db)

    with pytest.raises(StorageUnavailable, match="still being written at seq 2"):
        await store.pop_last_message(CID)
    held.release.set()
    await writing
    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "C, popped"
    assert [m.content for m in await store.transcript(CID)] == ["A?", "A!", "B, inserted late"]
    assert (await store.get_conversation(CID)).last_message_preview == "B, inserted late"


async def test_a_pop_of_a_conversation_whose_only_turn_is_still_inserting_waits_for_it(
    backend: Backend,
) -> None:
    """RELIABILITY.md: a pop racing a turn between its two writes past the last message is
    StorageUnavailable, also when no message is stored yet: never "no message" (None), which
    a runtime takes for an empty session and does not retry; once the turn is stored, the pop
    removes its last message."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.upsert_conversation(CID)
    writing, held = await holding(backend, [user("A?"), answer("A!")], "a")
    store = ConversationStore(backend.db)

    with pytest.raises(StorageUnavailable, match="still being written at seq 0"):
        await store.pop_last_message(CID)
    held.release.set()
    await writing
    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "A!"
    assert await store.pop_last_message(CID) is not None
    assert await store.pop_last_message(CID) is None  # nothing in flight, nothing left


async def stored_seqs(backend: Backend) -> list[int]:
    """The `seq`s of the messages stored, a turn still being written below one or not (the
    transcript stops before such a turn)."""
    found = backend.db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1)
    return [int(m["seq"]) for m in await found.to_list(None)]


async def test_popping_an_answer_to_a_call_of_a_turn_still_inserting_waits_and_lists_it_again(
    backend: Backend,
) -> None:
    """RUNTIMES.md: the call a popped answer took is pending again. Turn b (seq 2) made
    call c1 and is still inserting; turn c (seq 3) answered it: the pop waits for b (it
    raises StorageUnavailable, removing nothing), then lists c1 as pending again."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("A?"), answer("A!")], turn_id="a")
    writing, held = await holding(backend, [call("c1")], "b")
    await logger.log_messages(CID, [result("c1")], turn_id="c")
    store = ConversationStore(backend.db)

    with pytest.raises(StorageUnavailable, match="still being written at seq 2"):
        await store.pop_last_message(CID)
    assert await stored_seqs(backend) == [0, 1, 3]  # the pop removed nothing
    held.release.set()
    await writing
    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.role == "tool"
    assert [m.role for m in await store.transcript(CID)] == ["user", "assistant", "assistant"]
    assert [c.tool_call_id for c in await store.pending_calls(CID)] == ["c1"]


async def test_a_pop_passes_a_hole_below_the_message_that_a_pop_left_or_a_turn_abandoned(
    backend: Backend,
) -> None:
    """Only a turn still being written below the message makes a pop wait: a block older
    than `abandon_after` is passed, and the preview comes from the text before it."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("A?"), answer("A!")], turn_id="a")
    writing, held = await holding(backend, [answer("B, inserted late")], "b")
    await logger.log_messages(CID, [answer("C, popped")], turn_id="c")
    store = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(0)))

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "C, popped"
    assert (await store.get_conversation(CID)).last_message_preview == "A!"
    held.release.set()
    with contextlib.suppress(StoreError):
        await writing


async def test_a_tail_follower_whose_last_read_message_was_popped_reads_what_came_after(
    backend: Backend,
) -> None:
    """DESIGN §3 "Tail reads never skip": a follower asks again with the same `after`. The
    runtime rewinds its last message (pop_item) and logs a corrected one: a follower that
    had read the removed message gets the correction, at the `seq` given back."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("Q?"), answer("draft answer")], turn_id="t1")
    store = ConversationStore(backend.db)
    page = await store.messages_page(CID)
    assert [m.content for m in page.data] == ["Q?", "draft answer"]

    await store.pop_last_message(CID)
    waiting = await store.messages_page(CID, after=page.last_id)
    await logger.log_messages(CID, [answer("corrected answer")], turn_id="t2")
    followed = await store.messages_page(CID, after=page.last_id)
    backwards = await store.messages_page(CID, after=page.last_id, order="desc")

    assert waiting.data == []
    assert [m.content for m in followed.data] == ["corrected answer"]
    assert [m.content for m in backwards.data] == ["Q?"]
    with pytest.raises(NotFound, match="not found"):  # another user's: as without `after`
        await store.messages_page(CID, after=page.last_id, user_id="someone-else")


async def test_a_tail_follower_reading_while_its_last_read_message_is_popped_reads_on(
    backend: Backend,
) -> None:
    """RELIABILITY.md (pops): a tail reader's `after` naming a message a pop removed reads on
    from there, also while the pop is under way: between its removal and its summary update,
    the pop's mark names the message and its `seq`."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("Q?"), answer("draft answer")], turn_id="t1")
    reader = ConversationStore(backend.db)
    page = await reader.messages_page(CID)
    during: list[Any] = []

    async def a_read() -> None:
        during.append(await reader.messages_page(CID, after=page.last_id))

    popping = ConversationStore(backend.db)
    racing_the_summary_update(popping, a_read)
    popped = await popping.pop_last_message(CID)

    assert popped is not None
    assert popped.id == page.last_id
    assert [m.content for m in during[0].data] == []
    assert during[0].pending_seq is None
    await logger.log_messages(CID, [answer("corrected answer")], turn_id="t2")
    followed = await reader.messages_page(CID, after=page.last_id)
    assert [m.content for m in followed.data] == ["corrected answer"]


async def test_a_tail_follower_reads_a_regenerated_turn_whose_pops_went_below_its_cursor(
    backend: Backend,
) -> None:
    """DESIGN §3 "Tail reads never skip": the runtime regenerates a whole turn, popping its
    answer and then its question, and logs a new one at the `seq`s given back. A follower that
    had read the popped answer gets the whole new turn: every `seq` given back by a pop after
    its message's was filled after the follower read."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("Q1?"), answer("A1")], turn_id="t1")
    await logger.log_messages(CID, [user("Q2?"), answer("A2 draft")], turn_id="t2")
    store = ConversationStore(backend.db)
    page = await store.messages_page(CID)

    await store.pop_last_message(CID)
    await store.pop_last_message(CID)
    await logger.log_messages(CID, [user("Q2, asked again?"), answer("A2")], turn_id="t2-again")
    followed = await store.messages_page(CID, after=page.last_id)

    assert [m.content for m in followed.data] == ["Q2, asked again?", "A2"]
    assert not followed.has_more


async def test_a_tail_follower_whose_message_was_popped_twice_reads_on_from_its_first_removal(
    backend: Backend,
) -> None:
    """DESIGN §3 "Tail reads never skip": a turn popped whole, retried past its record, is
    stored as a new turn at the end under the same message ids, and can be popped again. A
    follower that read its answer before the first pop reads on from what that pop gave back:
    every turn logged since, and the turn's question stored again."""
    rules = TurnRules(turns_recorded=4)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.ensure_indexes()
    store = ConversationStore(backend.db, rules=rules)
    await logger.log_messages(CID, [user("QA?"), answer("A")], turn_id="a")
    await logger.log_messages(CID, [user("QT?"), answer("T")], turn_id="t")
    page = await store.messages_page(CID)
    await store.pop_last_message(CID)
    await store.pop_last_message(CID)
    for turn in "bcdef":
        await logger.log_messages(CID, [user(f"Q{turn}?"), answer(turn)], turn_id=turn)
    again = await logger.log_messages(CID, [user("QT?"), answer("T")], turn_id="t")
    assert page.last_id in [m.id for m in again.messages]
    await store.pop_last_message(CID)

    followed = await store.messages_page(CID, after=page.last_id, limit=50)

    stored = [m.content for m in await store.transcript(CID)]
    assert [m.content for m in followed.data] == stored[2:]
    assert len(followed.data) == 11
    assert not followed.has_more


async def test_a_tail_follower_is_not_served_again_what_a_pop_under_way_has_not_removed(
    backend: Backend,
) -> None:
    """DESIGN §3: an `after` naming a popped message reads on from the lowest `seq` that pop
    and the pops after it gave back. A later pop under way (its mark set, its message not
    deleted yet) has given nothing back: the follower, which read that message, is not served
    it again; once the pop is done, what is logged at its `seq` is served."""
    logger, store = await log_two_turns(backend)
    page = await store.messages_page(CID)
    await store.pop_last_message(CID)
    during: list[Any] = []

    async def a_read() -> None:
        during.append(await store.messages_page(CID, after=page.last_id))

    popping = ConversationStore(backend.db)
    popping._messages = BeforeCall(popping._messages, "delete_one", 0, a_read)  # type: ignore[assignment]
    popped = await popping.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "second question"
    assert [m.content for m in during[0].data] == []
    await logger.log_messages(CID, [user("second question, asked again")], turn_id="t3")
    followed = await store.messages_page(CID, after=page.last_id)
    assert [m.content for m in followed.data] == ["second question, asked again"]


async def test_a_pop_of_the_message_that_named_the_conversation_takes_its_automatic_name_back(
    backend: Backend,
) -> None:
    """The automatic name is the popped message's text: without the message, the
    conversation has none, and the next turn names it as it would name a new conversation."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("oops my password is hunter2"), answer("noted")])
    store = ConversationStore(backend.db)

    await store.pop_last_message(CID)  # the answer: the name's message stays
    kept = await store.get_conversation(CID)
    await store.pop_last_message(CID)  # the message the name was taken from
    unnamed = await store.get_conversation(CID)
    await logger.log_messages(CID, [user("what is the weather")])
    named = await store.get_conversation(CID)

    assert (kept.name, kept.name_source) == ("oops my password is hunter2", "auto")
    assert (unnamed.name, unnamed.name_source) == (None, None)
    assert (named.name, named.name_source) == ("what is the weather", "auto")
    stored = await backend.db.agent_conversations.find_one({"_id": CID})
    assert "hunter2" not in str(stored)


async def test_a_pop_of_a_later_message_of_the_same_text_keeps_the_automatic_name(
    backend: Backend,
) -> None:
    """The name's message is told by its id, not its text: a later message saying the same
    is not the one the name came from."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("hello"), answer("hi")])
    await logger.log_messages(CID, [user("hello")])
    store = ConversationStore(backend.db)

    await store.pop_last_message(CID)

    conversation = await store.get_conversation(CID)
    assert (conversation.name, conversation.name_source) == ("hello", "auto")


@pytest.mark.parametrize("given_by", ["runtime", "person"])
async def test_a_pop_of_the_first_message_keeps_a_name_a_runtime_or_a_person_gave(
    backend: Backend, given_by: str
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    runtime_name = "Trip plan" if given_by == "runtime" else None
    await logger.log_messages(CID, [user("plan my trip")], name=runtime_name)
    store = ConversationStore(backend.db)
    if given_by == "person":
        await store.rename(CID, "Paris weekend")

    await store.pop_last_message(CID)

    conversation = await store.get_conversation(CID)
    expected = ("Trip plan", "runtime") if given_by == "runtime" else ("Paris weekend", "set")
    assert (conversation.name, conversation.name_source) == expected


async def test_a_fork_before_the_naming_message_is_unnamed_and_a_forks_pop_takes_its_name_back(
    backend: Backend,
) -> None:
    """A fork names itself from the copies it holds: none before the name's message. A fork
    holding a copy of it is named by the copy, which a pop of the copy takes back."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [answer("Welcome! Ask me anything.")])
    await logger.log_messages(CID, [user("plan my trip"), answer("where to?")])
    store = ConversationStore(backend.db)

    await logger.fork(CID, 0, "fork-early")
    await logger.fork(CID, 2, "fork-late")
    early = await store.get_conversation("fork-early")
    late = await store.get_conversation("fork-late")
    await store.pop_last_message("fork-late")
    await store.pop_last_message("fork-late")
    popped = await store.get_conversation("fork-late")
    await logger.log_messages("fork-late", [user("book a hotel")])
    renamed = await store.get_conversation("fork-late")

    assert (early.name, early.name_source) == (None, None)
    assert (late.name, late.name_source) == ("plan my trip", "auto")
    assert (popped.name, popped.name_source) == (None, None)
    assert (renamed.name, renamed.name_source) == ("book a hotel", "auto")
    original = await store.get_conversation(CID)
    assert (original.name, original.name_source) == ("plan my trip", "auto")


async def test_a_pop_takes_back_an_automatic_name_stored_without_its_message(
    backend: Backend,
) -> None:
    """A conversation named before the store recorded which message its automatic name came
    from: a pop of a message giving that very name takes it back."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [user("hello there"), answer("hi")])
    await logger.log_messages(CID, [user("something else")])
    await backend.db.agent_conversations.update_one(
        {"_id": CID}, {"$unset": {"name_message_id": ""}}
    )
    store = ConversationStore(backend.db)

    await store.pop_last_message(CID)  # "something else" gave no name
    kept = await store.get_conversation(CID)
    await store.pop_last_message(CID)
    await store.pop_last_message(CID)  # "hello there": the name's text
    unnamed = await store.get_conversation(CID)

    assert (kept.name, kept.name_source) == ("hello there", "auto")
    assert (unnamed.name, unnamed.name_source) == (None, None)


def stall_after_reserving(logger: AgentMessageLogger, released: asyncio.Event) -> asyncio.Event:
    """The logger's first reservation returns, then the writer stalls until `released` is set
    before going on (alive but slow: a pause, a throttled CPU): the event returned is set once
    it has reserved."""
    reserved, real = asyncio.Event(), logger._conversations
    reserve = real.find_one_and_update

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        doc = await reserve(*args, **kwargs)
        if not reserved.is_set():
            reserved.set()
            await released.wait()
        return doc

    real.find_one_and_update = stalled  # type: ignore[method-assign]
    return reserved


async def test_a_writer_slower_than_abandon_after_stores_its_turn_past_what_readers_passed(
    backend: Backend, clocks: StoreClocks
) -> None:
    """DESIGN §3 "Tail reads never skip": a block older than `abandon_after` is passed by tail
    readers and never written. A live writer that stalls that long between its reservation and
    its insert does not insert into its block: it moves the turn to a new block at the end, as
    a late retry does, and is answered with the `seq`s its messages are at; a follower reads
    them."""
    rules = TurnRules(abandon_after=timedelta(seconds=0.3))
    fast = AgentMessageLogger(backend.db)  # never slower than its `abandon_after`, however loaded
    await fast.ensure_indexes()
    store = ConversationStore(backend.db, rules=rules)
    await fast.log_messages(CID, [user("t0?"), answer("t0!")], turn_id="t0")
    page = await store.messages_page(CID)
    seen, after = [m.seq for m in page.data], page.last_id
    slow = AgentMessageLogger(backend.db, rules=rules)
    released = asyncio.Event()
    reserved = stall_after_reserving(slow, released)

    writer = asyncio.create_task(slow.log_messages(CID, [user("t1?"), answer("t1!")], turn_id="t1"))
    await reserved.wait()  # t1 holds seq 2-3
    clocks.wait(0.4)
    await fast.log_messages(CID, [user("t2?"), answer("t2!")], turn_id="t2")  # seq 4-5
    page = await store.messages_page(CID, after=after)  # passes 2-3, older than abandon_after
    seen += [m.seq for m in page.data]
    after = page.last_id or after
    released.set()  # the stalled writer goes on, past its `abandon_after`
    logged = await writer
    page = await store.messages_page(CID, after=after)
    seen += [m.seq for m in page.data]

    stored = await store.transcript(CID)
    assert [m.content for m in stored] == ["t0?", "t0!", "t2?", "t2!", "t1?", "t1!"]
    assert [m.seq for m in logged.messages] == [m.seq for m in stored[4:]] == [6, 7]
    assert not logged.replayed
    assert seen == [m.seq for m in stored]
    conversation = await store.get_conversation(CID)
    assert (conversation.turn_count, conversation.last_message_preview) == (3, "t1!")


async def test_a_late_turn_whose_move_keeps_losing_to_busy_writers_is_sent_again_as_it_is(
    backend: Backend, clocks: StoreClocks
) -> None:
    """A writer slower than `abandon_after` moves its turn to the end (above), guarded by the
    conversation as it read it. Another writer logging a turn before each of its moves (a busy
    conversation) makes every move lose: nothing of the turn is written, and the refusal is
    one to send it again as it is (`StorageUnavailable`, 503, as a reservation that lost every
    race), which `with_retries` retries, never a failure a caller drops the turn on. Sent
    again, it is stored once, at the end."""
    rules = TurnRules(abandon_after=timedelta(seconds=0.3))
    fast = AgentMessageLogger(backend.db)  # never slower than its `abandon_after`, however loaded
    await fast.log_messages(CID, [user("t0?"), answer("t0!")], turn_id="t0")
    slow = AgentMessageLogger(backend.db, rules=rules)
    command, commands = slow._conversations.find_one_and_update, 0

    async def busy(*args: Any, **kwargs: Any) -> Any:
        nonlocal commands
        commands += 1
        if commands == 1:  # its reservation's reply comes back past `abandon_after`
            reserved = await command(*args, **kwargs)
            clocks.wait(0.4)
            return reserved
        if commands <= 5:  # each move: another writer logged a turn just before it
            turn = [user(f"o{commands}?"), answer(f"o{commands}!")]
            await fast.log_messages(CID, turn, turn_id=f"o{commands}")
        return await command(*args, **kwargs)

    slow._conversations.find_one_and_update = busy  # type: ignore[method-assign]
    late = [user("x?"), answer("x!")]

    with pytest.raises(StorageUnavailable, match="send the turn again as it is") as refused:
        await slow.log_messages(CID, late, turn_id="x")
    assert (refused.value.status, refused.value.code) == (503, "storage_unavailable")
    assert "x?" not in [m.content for m in await ConversationStore(backend.db).transcript(CID)]

    policy = RetryPolicy(first_delay=0.01)
    logged = await with_retries(lambda: slow.log_messages(CID, late, turn_id="x"), policy=policy)

    stored = await ConversationStore(backend.db).transcript(CID)
    assert [m.content for m in stored[-2:]] == ["x?", "x!"]
    assert [m.seq for m in logged.messages] == [m.seq for m in stored[-2:]]
    assert [m.content for m in stored].count("x?") == 1


async def test_a_first_attempt_whose_neighbouring_record_the_window_dropped_is_stored_as_sent(
    backend: Backend, clocks: StoreClocks
) -> None:
    """DESIGN.md §2, `turns`: a record says how many `seq`s its turn reserved (`l`), so the
    turn's block is known exactly whatever records the window dropped. Turn "x" reserves 2-3
    and stalls past `abandon_after`; two later turns are each moved once (their insert lost,
    retried late), and the record the first move left right after x's is dropped
    (`turns_recorded` 3; x's is kept as a turn's own). x's first attempt, too slow now to
    insert where it reserved, is stored at the end with its own content, never refused as
    other content; sent again it is a replay, and with other content it is refused."""
    patient = TurnRules(turns_recorded=3)
    passing = TurnRules(turns_recorded=3, abandon_after=timedelta(0))  # every block aged
    fast, late = (
        AgentMessageLogger(backend.db, rules=patient),
        AgentMessageLogger(backend.db, rules=passing),
    )
    await fast.ensure_indexes()
    await fast.log_messages(CID, exchange("a"), turn_id="t-a")
    slow = AgentMessageLogger(
        backend.db, rules=TurnRules(turns_recorded=3, abandon_after=timedelta(seconds=0.3))
    )
    released = asyncio.Event()
    reserved = stall_after_reserving(slow, released)
    first = asyncio.create_task(slow.log_messages(CID, exchange("x"), turn_id="t-x"))
    await reserved.wait()  # x holds seq 2-3
    for tag in ("y", "w"):
        await fast.log_messages(CID, exchange(tag), turn_id=f"t-{tag}")
        await backend.db[MESSAGES].delete_many({"turn_id": f"t-{tag}"})  # its insert lost
        await late.log_messages(CID, exchange(tag), turn_id=f"t-{tag}")  # moved to the end
    found = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert found is not None
    kept = [(r["f"], r["m"]) for r in found["turns"]]
    assert kept == [(2, False), (6, False), (8, True), (10, False)]  # the move's at 4 dropped

    clocks.wait(0.3)
    released.set()  # x goes on, older than its `abandon_after`
    logged = await first

    assert [(m.seq, m.content) for m in logged.messages] == [(12, "x?"), (13, "x!")]
    again = await fast.log_messages(CID, exchange("x"), turn_id="t-x")
    assert again.replayed
    assert [m.seq for m in again.messages] == [12, 13]
    with pytest.raises(OtherContent):
        await fast.log_messages(CID, exchange("x", usage=2), turn_id="t-x")
    conversation = await check_conversation(backend.db, CID, gaps=True)
    assert (conversation["turn_count"], conversation["usage"]["input_tokens"]) == (4, 4)


async def test_a_delivery_slower_than_abandon_after_is_stored_past_what_readers_passed(
    backend: Backend, clocks: StoreClocks
) -> None:
    """As a turn (above): a steering delivery whose sender stalls past `abandon_after` after
    reserving its `seq` moves to the end before its insert; the inbox follows it there, and a
    follower and the runtime draining the inbox both read it."""
    rules = TurnRules(abandon_after=timedelta(seconds=0.3))
    fast = AgentMessageLogger(backend.db)  # never slower than its `abandon_after`, however loaded
    await fast.ensure_indexes()
    store = ConversationStore(backend.db, rules=rules)
    await fast.log_messages(CID, [user("start")], turn_id="t0")  # seq 0
    runtime = SteeringInbox(fast)
    await runtime.open_turn(CID, "t-running")
    page = await store.messages_page(CID)
    seen, after = [m.seq for m in page.data], page.last_id
    slow = AgentMessageLogger(backend.db, rules=rules)
    released = asyncio.Event()
    reserved = stall_after_reserving(slow, released)

    steer = {"role": "user", "content": "in metric, please"}
    sender = asyncio.create_task(SteeringInbox(slow).try_deliver(CID, "t-running", steer))
    await reserved.wait()  # the delivery holds seq 1
    clocks.wait(0.4)
    await fast.log_messages(CID, [user("elsewhere?"), answer("there")], turn_id="t2")  # seq 2-3
    page = await store.messages_page(CID, after=after)  # passes seq 1
    seen += [m.seq for m in page.data]
    after = page.last_id or after
    released.set()  # the stalled writer goes on, past its `abandon_after`
    assert await sender
    page = await store.messages_page(CID, after=after)
    seen += [m.seq for m in page.data]

    stored = await store.transcript(CID)
    assert [m.content for m in stored] == ["start", "elsewhere?", "there", "in metric, please"]
    assert seen == [m.seq for m in stored]
    assert [(m.seq, m.content) for m in await runtime.drain(CID, "t-running")] == [
        (stored[-1].seq, "in metric, please")
    ]


@pytest.mark.parametrize("leaves_a_call", [False, True], ids=["plain", "open-call"])
async def test_a_move_whose_turn_its_stalled_first_attempt_stored_meanwhile_is_undone(
    backend: Backend, leaves_a_call: bool
) -> None:
    """DESIGN §3: a block a turn's reservation took and the turn does not fill, stored
    elsewhere, is given back, its `seq`s gaps no turn holds; a stored message's `seq` is never
    one. Turn x's first attempt reserves 1-2, passes its check and stalls inside its insert;
    its twin, past `abandon_after` less a tenth, moves x to 3-4 and stalls inside its own; the
    first insert lands in 1-2. The twin's insert meets x there and undoes its move: 1-2 are
    gaps no more, 3-4 are, and x stays counted once. Both attempts answer 1-2; a follower is
    served the later turns at once (was: 1-2 listed as gaps, 3-4 never written nor a gap, and
    followers held at `pending_seq` 3 for a whole `abandon_after`)."""
    rules = TurnRules(abandon_after=timedelta(seconds=1))
    fast = AgentMessageLogger(backend.db)  # never slower than its `abandon_after`, however loaded
    await fast.ensure_indexes()
    store = ConversationStore(backend.db, rules=rules)
    first = await fast.log_messages(CID, [user("t0?")], turn_id="t0")  # seq 0
    x = [user("x?"), calling("remote", "c1") if leaves_a_call else answer("x!", tokens=3)]
    stalled = SlowInsert(AgentMessageLogger(backend.db))  # its own check always passes
    passing = TurnRules(abandon_after=timedelta(0))  # x's block past it at once: the twin moves
    twin = SlowInsert(AgentMessageLogger(backend.db, rules=passing))

    writer = asyncio.create_task(stalled.logger.log_messages(CID, x, turn_id="x"))
    await stalled.reserved.wait()  # x holds 1-2, its check passed, its insert in flight
    retry = asyncio.create_task(twin.logger.log_messages(CID, x, turn_id="x"))
    await twin.reserved.wait()  # the twin moved x to 3-4, its insert in flight
    stalled.release.set()
    landed = await writer  # in 1-2
    twin.release.set()
    replayed = await retry

    assert [m.seq for m in landed.messages] == [m.seq for m in replayed.messages] == [1, 2]
    assert replayed.replayed
    conversation = await check_conversation(backend.db, CID, gaps=True)
    end = conversation["message_count"]
    assert end == 5
    assert sorted(conversation["popped_seqs"]) == list(range(3, end))
    if leaves_a_call:
        assert [c.tool_call_id for c in await store.pending_calls(CID)] == ["c1"]
        result = {"role": "tool", "tool_call_id": "c1", "content": "r"}
        later = [result, answer("done")]
        await fast.log_messages(CID, later, turn_id="r", answers_to={"c1": landed.messages[1].id})
    else:
        await fast.log_messages(CID, [user("t9?")], turn_id="t9")
    page = await store.messages_page(CID, after=first.messages[0].id)
    assert page.pending_seq is None
    assert [m.seq for m in page.data] == [1, 2, *range(end, end + (2 if leaves_a_call else 1))]
    again = await fast.log_messages(CID, x, turn_id="x")
    assert again.replayed
    assert [m.seq for m in again.messages] == [1, 2]
    await check_conversation(backend.db, CID, gaps=True)
