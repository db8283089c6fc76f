"""Database round trips, counted with a command listener on the wire backends."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agent_store import AgentMessageLogger, ConversationStore, StorageUnavailable, TurnRules
from app.examples import example_turns
from tests.conftest import COUNTED, Backend
from tests.test_reliability import FailOnce

pytestmark = pytest.mark.wire

CID = "round-trips"


async def test_logging_a_turn_costs_two_round_trips(wire_backend: Backend) -> None:
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    await logger.ensure_indexes()
    for turn_id, messages in example_turns():
        wire_backend.commands.clear()
        await logger.log_messages(CID, messages, turn_id=turn_id)
        assert wire_backend.commands.names == ["findAndModify", "insert"]


async def test_a_turn_answering_an_earlier_call_on_time_costs_two_round_trips(
    wire_backend: Backend,
) -> None:
    """A turn naming the call it answers (`answers_to`), inserted on time: its reservation and
    its insert, nothing more. Only an insert slower than `claim_grace` (or `abandon_after`)
    looks up whether another answer to the call was stored meanwhile."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    await logger.ensure_indexes()
    asks = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "pay",
            "arguments": "{}"}}]}  # fmt: skip
    t0 = await logger.log_messages(CID, [{"role": "user", "content": "pay?"}, asks])
    answer = [{"role": "tool", "tool_call_id": "c1", "content": "paid"}]
    wire_backend.commands.clear()

    await logger.log_messages(CID, answer, turn_id="t1", answers_to={"c1": t0.messages[1].id})

    assert wire_backend.commands.names == ["findAndModify", "insert"]


async def _a_call_left_pending(wire_backend: Backend) -> AgentMessageLogger:
    """Turn t0 leaves call c1 pending, stored; the commands counted from here."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    await logger.ensure_indexes()
    asks = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "pay",
            "arguments": "{}"}}]}  # fmt: skip
    await logger.log_messages(CID, [{"role": "user", "content": "pay?"}, asks], turn_id="t0")
    wire_backend.commands.clear()
    return logger


async def _past_abandon_after(wire_backend: Backend) -> None:
    """Every block reserved so far dated ten minutes back, past `abandon_after`."""
    assert wire_backend.commands is not None
    long_ago = datetime.now(UTC) - timedelta(minutes=10)
    await wire_backend.db.agent_conversations.update_one(
        {"_id": CID}, {"$set": {"turns.$[].a": long_ago, "pending_blocks.$[].a": long_ago}}
    )
    wire_backend.commands.clear()


async def test_a_turn_passing_a_block_that_left_a_call_pending_reads_its_first_message_once(
    wire_backend: Backend,
) -> None:
    """While the turn leaving c1 pending is younger than `abandon_after`, a later turn costs
    its two round trips. The first turn reserving once it is older looks its block's first
    message up (one `find`, stored: nothing more); the turns after it do not again."""
    assert wire_backend.commands is not None
    logger = await _a_call_left_pending(wire_backend)
    hello = [{"role": "user", "content": "hello?"}]

    await logger.log_messages(CID, hello, turn_id="t1")
    assert wire_backend.commands.names == ["findAndModify", "insert"]
    await _past_abandon_after(wire_backend)
    await logger.log_messages(CID, hello, turn_id="t2")
    assert wire_backend.commands.names == ["findAndModify", "insert", "find"]
    wire_backend.commands.clear()
    await logger.log_messages(CID, hello, turn_id="t3")
    assert wire_backend.commands.names == ["findAndModify", "insert"]


async def test_a_turn_passing_the_block_of_a_turn_that_died_before_its_insert_folds_again(
    wire_backend: Backend,
) -> None:
    """The turn leaving c1 pending stored nothing (its writer died before its insert): the
    first turn reserving once its block is older than `abandon_after` finds its first
    message missing and folds the pending state from the stored messages (the conversation
    and its messages read, the fold written: three round trips more, on that path only)."""
    assert wire_backend.commands is not None
    logger = await _a_call_left_pending(wire_backend)
    await wire_backend.db.agent_messages.delete_many({})  # as a crash before the insert
    await _past_abandon_after(wire_backend)

    await logger.log_messages(CID, [{"role": "user", "content": "hello?"}], turn_id="t1")

    assert wire_backend.commands.names == [
        "findAndModify", "insert", "find", "find", "find", "update"
    ]  # fmt: skip
    assert await ConversationStore(wire_backend.db).pending_calls(CID) == []


async def test_a_300_message_transcript_is_read_at_once_with_its_conversation(
    wire_backend: Backend,
) -> None:
    """Its messages in one reply, and, sent with that read, the lookup of the conversation
    document that says whether they are a conversation's to serve: two commands, one wait."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db)
    await logger.ensure_indexes()
    exchange = [
        {"role": "user", "content": "question " + "x" * 200},
        {"role": "assistant", "content": "answer " + "y" * 400},
        {"role": "assistant", "content": "more " + "z" * 300},
    ]
    for n in range(3):  # 100 messages a turn: the read is what is counted
        await logger.log_messages(CID, exchange * 33 + exchange[:1], turn_id=f"t{n}")
    wire_backend.commands.clear()

    transcript = await ConversationStore(wire_backend.db).transcript(CID)

    assert len(transcript) == 300
    assert sorted(wire_backend.commands.names) == ["find", "find"]


async def test_a_retry_after_a_crash_costs_four_round_trips(wire_backend: Backend) -> None:
    """The retry path: a refused reservation, one read of the turn's record, the insert, and,
    the insert having stored messages in a block a delete may have found full and swept once
    only, a lookup of the conversation (still there: nothing more). The crashed attempt is
    older than `claim_grace` here, so the retry does not wait for it to land first."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    turn_id, messages = example_turns()[0]
    await logger.log_messages(CID, messages, turn_id=turn_id)
    await wire_backend.db.agent_messages.delete_many({})
    wire_backend.commands.clear()

    await logger.log_messages(CID, messages, turn_id=turn_id)

    assert wire_backend.commands.names == ["findAndModify", "find", "insert", "find"]


async def test_a_retry_storing_earlier_times_than_its_first_attempt_costs_two_more(
    wire_backend: Backend,
) -> None:
    """The retry path after a crash (four), then, its turn the conversation's last and dated
    before the `updated_at` its first attempt reserved with: the message below its block
    read, and `updated_at` set back (guarded)."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    noon = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    turn = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    earlier = [{**m, "created_at": noon - timedelta(days=1)} for m in turn]
    await logger.log_messages(CID, earlier, turn_id="t-0")
    await logger.log_messages(CID, [{**m, "created_at": noon} for m in turn], turn_id="t-1")
    await wire_backend.db.agent_messages.delete_many({"seq": {"$gte": 2}})  # a crash, as above
    wire_backend.commands.clear()

    behind = [{**m, "created_at": noon - timedelta(minutes=5)} for m in turn]
    await logger.log_messages(CID, behind, turn_id="t-1")

    assert wire_backend.commands.names == [
        "findAndModify", "find", "insert", "find", "find", "update"
    ]  # fmt: skip


async def test_a_replay_of_a_stored_turn_costs_four_round_trips(wire_backend: Backend) -> None:
    """A refused reservation, the record, the insert refused on every id, the stored messages."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    turn_id, messages = example_turns()[0]
    await logger.log_messages(CID, messages, turn_id=turn_id)
    wire_backend.commands.clear()

    await logger.log_messages(CID, messages, turn_id=turn_id)

    assert wire_backend.commands.names == ["findAndModify", "find", "insert", "find"]


async def test_checking_a_turn_costs_one_round_trip_and_a_retry_past_the_kept_records_three(
    wire_backend: Backend,
) -> None:
    """`check_turn` reads the conversation once, for a new turn and for a retry alike; once
    some records were dropped, a retry of a turn none names is looked up by its first
    message, then its block's messages are read (two lookups more, that path only)."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=TurnRules(turns_recorded=2))
    turns = example_turns()
    (turn_id, messages), (later_id, later) = turns[:2]
    await logger.log_messages(CID, messages, turn_id=turn_id)
    for checked_id, checked in ((turn_id, messages), (later_id, later)):
        wire_backend.commands.clear()
        await logger.check_turn(CID, checked, turn_id=checked_id)
        assert wire_backend.commands.names == ["find"], checked_id
    for n in range(3):
        await logger.log_messages(CID, later, turn_id=f"later-{n}")
    wire_backend.commands.clear()

    await logger.check_turn(CID, messages, turn_id=turn_id)

    assert wire_backend.commands.names == ["find", "find", "find"]


async def _a_turn_that_stored_nothing_long_ago(
    wire_backend: Backend,
) -> tuple[AgentMessageLogger, list[Any], list[Any]]:
    """Turn "t-lost" reserved its block ten minutes ago (past `abandon_after`) and stored
    nothing (as a crash before its insert); a later turn is stored after it. The commands
    counted from here."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    (_, messages), (later_id, later) = example_turns()[:2]
    await logger.log_messages(CID, messages, turn_id="t-lost")
    await wire_backend.db.agent_messages.delete_many({})  # as a crash before the insert
    await logger.log_messages(CID, later, turn_id=later_id)
    long_ago = datetime.now(UTC) - timedelta(minutes=10)
    await wire_backend.db.agent_conversations.update_one(
        {"_id": CID}, {"$set": {"turns.0.a": long_ago}}
    )
    wire_backend.commands.clear()
    return logger, messages, later


async def test_a_retry_later_than_abandon_after_of_a_turn_that_stored_nothing_costs_seven(
    wire_backend: Backend,
) -> None:
    """The rare relocation path: a refused reservation, the record, the empty block looked
    up (with any later answer to its calls), the move to a new block at the end (with the
    summary an appended turn sets), the insert, then the stored messages read and what they
    leave pending written (guarded: no turn reserved meanwhile). The crashed attempt's record
    is dated ten minutes back, past `abandon_after`; the retry itself is far faster than
    that: no lookup of the conversation follows its insert."""
    logger, messages, later = await _a_turn_that_stored_nothing_long_ago(wire_backend)

    retried = await logger.log_messages(CID, messages, turn_id="t-lost")

    assert retried.messages[0].seq == len(messages) + len(later)
    assert wire_backend.commands.names == [
        "findAndModify", "find", "find", "findAndModify", "insert", "find", "update"
    ]  # fmt: skip


async def test_checking_a_retry_later_than_abandon_after_costs_one_read_more(
    wire_backend: Backend,
) -> None:
    """`check_turn` of that retry reads the conversation, then looks its empty block up as
    the move does (with any later answer to its calls, which it would be refused for)."""
    logger, messages, _ = await _a_turn_that_stored_nothing_long_ago(wire_backend)

    await logger.check_turn(CID, messages, turn_id="t-lost")

    assert wire_backend.commands.names == ["find", "find"]


async def test_a_missing_conversation_is_looked_up_once(wire_backend: Backend) -> None:
    """A read that finds no conversation asks the database nothing more (no legacy wired)."""
    from agent_store import NotFound

    assert wire_backend.commands is not None
    store = ConversationStore(wire_backend.db)
    for read in (store.turn_count, store.pending_hitl, store.get_conversation):
        wire_backend.commands.clear()
        with pytest.raises(NotFound):
            await read("nobody-here")
        assert wire_backend.commands.names == ["find"], read.__name__


async def test_the_turn_that_assigns_an_unowned_conversation_costs_three_round_trips_more(
    wire_backend: Backend,
) -> None:
    """Once per conversation: a count of the messages before it, a lookup of the conversation
    (still the one it assigned, and its owner now), and the move of those messages to the
    owner. A turn of the owner's after it is back to two."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    await logger.ensure_indexes()
    (first_id, first), (second_id, second), (third_id, third) = example_turns()[:3]
    await logger.log_messages(CID, first, turn_id=first_id)
    wire_backend.commands.clear()

    await logger.log_messages(CID, second, turn_id=second_id, user_id="user-assigned")
    assigning = list(wire_backend.commands.names)
    wire_backend.commands.clear()
    await logger.log_messages(CID, third, turn_id=third_id, user_id="user-assigned")

    assert assigning == ["findAndModify", "insert", "aggregate", "find", "update"]
    assert wire_backend.commands.names == ["findAndModify", "insert"]


async def test_resolving_a_prompt_costs_two_round_trips_and_its_retry_three(
    wire_backend: Backend,
) -> None:
    """The lookup of the newest prompt of the id stored (`AnsweredPrompt.stored_below`), then
    the update; the retry (nothing matched) looks the conversation up once to tell it from a
    Conflict."""
    assert wire_backend.commands is not None
    logger, store = AgentMessageLogger(wire_backend.db), ConversationStore(wire_backend.db)
    for turn_id, messages in example_turns()[:2]:
        await logger.log_messages(CID, messages, turn_id=turn_id)
    for expected in (["find", "update"], ["find", "update", "find"]):
        wire_backend.commands.clear()
        await store.resolve_hitl(CID, "req-booking-1")
        assert wire_backend.commands.names == expected


async def test_deleting_a_conversation_costs_ten_round_trips(wire_backend: Backend) -> None:
    """Its lookup; the record of the deletion in progress (so that a repeated delete finishes
    one that failed once the document went); the mark on its document (no turn or pop writes
    to it from then); the documents beside it (one command per
    collection); a lookup that finds it still the conversation the first found, right before
    its messages go; its whole texts' files; its document; the sweep for a turn that reserved
    before it; the record's removal."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db)
    await logger.ensure_indexes()
    for turn_id, messages in example_turns():
        await logger.log_messages(CID, messages, turn_id=turn_id, user_id="user-deleting")
    wire_backend.commands.clear()

    await ConversationStore(wire_backend.db).delete(CID, user_id="user-deleting")

    assert wire_backend.commands.names == [
        "find", "insert", "update", "delete", "find", "delete", "find", "findAndModify", "find",
        "delete",
    ]  # fmt: skip


async def test_the_calls_before_a_page_are_read_in_one_round_trip(wire_backend: Backend) -> None:
    """What names the calls a page's first results answer (`calls_before`): one `find` down
    the `{conversation_id, seq}` index for the latest message making each call id, when
    other messages making them lie between (a provider reusing `call_0` every turn), sent
    with the lookup of the conversation document (one wait), and no round trip for no ids."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db)
    await logger.ensure_indexes()
    for n in range(30):
        tool = f"tool_{n}"
        call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": "{}"}}
        await logger.log_messages(
            CID,
            [{"role": "user", "content": f"step {n}"},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "content": f"result of {tool}"}],
            turn_id=f"t{n}",
        )  # fmt: skip
    store = ConversationStore(wire_backend.db)
    wire_backend.commands.clear()

    found = await store.calls_before(CID, {"call_0"}, before_seq=89)
    none = await store.calls_before(CID, set(), before_seq=89)

    assert [(m.seq, m.tool_calls[0].function.name) for m in found] == [(88, "tool_29")]
    assert none == []
    assert wire_backend.commands.names == ["find", "find"]
    wire_backend.commands.clear()
    assert await store.calls_before(CID, {"call_never_made"}, before_seq=89) == []
    assert wire_backend.commands.names == ["find", "find"]


async def test_a_turn_or_a_read_finding_a_pop_under_way_finishes_it_and_costs_more_only_then(
    wire_backend: Backend,
) -> None:
    """RELIABILITY.md (pops): a turn's reservation refused for a pop's mark reads the
    conversation, finishes the pop (its removal and its summary update) and reserves again:
    four round trips more; a read of the summary finding the mark finishes the pop and reads
    again: three more. With no mark, a turn and a read cost what they did."""
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    await logger.ensure_indexes()
    store = ConversationStore(wire_backend.db)
    question = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A!"}]

    async def marked(conversation_id: str) -> None:
        """A pop whose summary update is lost for good (its process died): its mark stands."""
        await logger.log_messages(conversation_id, question)
        dying = ConversationStore(wire_backend.db)
        dying._conversations = FailOnce(dying._conversations, "update_one",
                                        after_applying=False, skip=1)  # fmt: skip
        with pytest.raises(StorageUnavailable):
            await dying.pop_last_message(conversation_id)

    await marked(CID)
    wire_backend.commands.clear()
    await logger.log_messages(CID, question)
    assert wire_backend.commands.names == [
        "findAndModify", "find", "delete", "update", "findAndModify", "insert",
    ]  # fmt: skip

    await marked("round-trips-read")
    wire_backend.commands.clear()
    await store.get_conversation("round-trips-read")
    assert wire_backend.commands.names == ["find", "delete", "update", "find"]
    wire_backend.commands.clear()
    await store.pending_calls("round-trips-read")
    assert wire_backend.commands.names == ["find"]
