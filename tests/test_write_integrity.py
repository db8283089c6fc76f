"""A turn is stored exactly as sent, once, or not at all: retries of any age, replays that must
match, values that cannot jam a conversation, and tail reads that never skip."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import random
import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, BulkWriteError, DuplicateKeyError

from agent_store import (
    AgentMessage,
    AgentMessageLogger,
    AssistantMessage,
    Conflict,
    ConversationStore,
    InvalidInput,
    LoggedTurn,
    SteeringInbox,
    StorageUnavailable,
    TurnRecord,
    TurnRules,
)
from agent_store.core import DENIED_RESULT
from agent_store.store import CONVERSATIONS, MAX_TURN_NAMED_CALLS, MESSAGES, PENDING_CALLS_KEPT
from agent_store.store._logger import Corrected, OtherContent
from tests.api_harness import auth_headers, reserved_insert_lost, serve
from tests.conftest import COUNTED, Backend, StoreClocks

CID = "conv-integrity"
MAX_SAFE = 2**53 - 1


def turn(text: str, *, usage: int = 1) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"{text}?"},
        {
            "role": "assistant",
            "content": f"{text}!",
            "token_usage": {"input_tokens": usage, "output_tokens": usage},
        },
    ]


async def digest(db: Any) -> str:
    hasher = hashlib.sha256()
    for name in sorted(await db.list_collection_names()):
        docs = await db[name].find({}).sort("_id", 1).to_list(None)
        hasher.update(name.encode() + json.dumps(docs, sort_keys=True, default=str).encode())
    return hasher.hexdigest()


async def check_conversation(db: Any, cid: str = CID, *, gaps: bool = False) -> dict[str, Any]:
    """An independent checker: gapless seq, no duplicate, counters equal to what is stored.
    With `gaps`, a `seq` no message holds must be one no turn holds (`popped_seqs`)."""
    messages = await db[MESSAGES].find({"conversation_id": cid}).sort("seq", 1).to_list(None)
    conversation = await db[CONVERSATIONS].find_one({"_id": cid})
    assert conversation is not None
    seqs = [m["seq"] for m in messages]
    popped = sorted(conversation.get("popped_seqs") or ()) if gaps else []
    assert not set(seqs) & set(popped), f"a gap holds a message: {seqs}, {popped}"
    assert sorted([*seqs, *popped]) == list(range(conversation["message_count"])), (
        f"holes or duplicates in seq: {seqs}, gaps {popped}"
    )
    assert len({m["_id"] for m in messages}) == len(messages)
    by_turn: dict[str, list[str]] = {}
    for message in messages:
        by_turn.setdefault(message["turn_id"], []).append(message["role"])
    starts = sum(
        1
        for roles in by_turn.values()
        for previous, role in zip([None, *roles], roles, strict=False)
        if role in ("user", "system") and previous not in ("user", "system")
    )
    assert conversation["turn_count"] == starts
    used = [m["token_usage"] for m in messages if m.get("token_usage")]
    assert conversation["usage"] == {
        "input_tokens": min(sum(u["input_tokens"] for u in used), MAX_SAFE),
        "output_tokens": min(sum(u["output_tokens"] for u in used), MAX_SAFE),
    }
    return conversation


# -- 1. replays of any age ---------------------------------------------------------------


# The conversation keeps the records of its last `turns_recorded` turns; these tests keep
# four and log six later turns, so the retried turn's record is gone when it comes back.
FEW_RECORDS = TurnRules(turns_recorded=4)
LATER_TURNS = 6


async def _first_record_dropped(db: Any) -> bool:
    """Whether the record of the turn stored at `seq` 0 is gone from the conversation."""
    conversation = await db[CONVERSATIONS].find_one({"_id": CID})
    return 0 not in {record.get("f") for record in conversation.get("turns", [])}


async def test_a_retry_after_more_later_turns_than_the_records_keep_is_recognised_as_a_replay(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db, rules=FEW_RECORDS)
    await logger.ensure_indexes()
    await logger.log_messages(CID, turn("first"), turn_id="t-first")
    for n in range(LATER_TURNS):
        await logger.log_messages(CID, turn(f"later {n}"), turn_id=f"t-{n}")
    assert await _first_record_dropped(backend.db)

    retried = await logger.log_messages(CID, turn("first"), turn_id="t-first")

    assert retried.replayed
    assert [m.seq for m in retried.messages] == [0, 1]
    conversation = await check_conversation(backend.db)
    assert (conversation["turn_count"], conversation["message_count"]) == (7, 14)


async def test_a_turn_whose_insert_never_happened_is_stored_in_its_own_block_while_recorded(
    backend: Backend,
) -> None:
    """A crash between the two writes, and a retry only after as many later turns as the
    records keep but one: no hole. (One more, and the record is gone: RELIABILITY.md.)"""
    logger = AgentMessageLogger(backend.db, rules=FEW_RECORDS)
    await logger.ensure_indexes()
    await logger.log_messages(CID, turn("lost"), turn_id="t-lost")
    await backend.db[MESSAGES].delete_many({"turn_id": "t-lost"})  # as if never inserted
    kept_but_one = FEW_RECORDS.turns_recorded - 1
    for n in range(kept_but_one):
        await logger.log_messages(CID, turn(f"later {n}"), turn_id=f"t-{n}")

    retried = await logger.log_messages(CID, turn("lost"), turn_id="t-lost")

    assert retried.replayed
    assert [m.seq for m in retried.messages] == [0, 1]
    conversation = await check_conversation(backend.db)
    assert conversation["turn_count"] == kept_but_one + 1


# -- 2. a replay must match --------------------------------------------------------------


@pytest.mark.parametrize("age", [0, LATER_TURNS], ids=["recent", "record-dropped"])
async def test_a_retry_with_other_content_is_a_conflict_and_writes_nothing(
    backend: Backend, age: int
) -> None:
    logger = AgentMessageLogger(backend.db, rules=FEW_RECORDS)
    await logger.log_messages(CID, turn("original"), turn_id="t1")
    for n in range(age):
        await logger.log_messages(CID, turn(f"later {n}"), turn_id=f"t-{n}")
    assert await _first_record_dropped(backend.db) == (age > 0)
    before = await digest(backend.db)

    with pytest.raises(Conflict, match="turn 't1' was logged with other content"):
        await logger.log_messages(CID, turn("changed"), turn_id="t1")

    assert await digest(backend.db) == before


async def test_a_replay_answers_with_the_stored_messages_not_the_retrys_timestamps(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    first = await logger.log_messages(CID, turn("hello"), turn_id="t1")
    await asyncio.sleep(0.01)  # the retry's messages get later default timestamps
    retried = await logger.log_messages(CID, turn("hello"), turn_id="t1")

    assert retried.replayed
    assert [m.created_at for m in retried.messages] == [m.created_at for m in first.messages]


async def test_a_stored_message_of_other_content_under_the_turns_ids_is_no_replay_and_gives_way(
    backend: Backend,
) -> None:
    """A message left under the ids a new turn derives (its conversation document gone, the
    message not) is not an earlier attempt of that turn: it is no conversation's any more,
    and the new conversation, which records the turn, stores the turn in its place. The
    answer shows nothing of the stored message."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [{"role": "user", "content": "someone's secret"}],
                              user_id="user-ada", turn_id="t1")  # fmt: skip
    await backend.db[CONVERSATIONS].delete_many({})

    logged = await logger.log_messages(CID, [{"role": "user", "content": "hello"}],
                                       user_id="user-mallory", turn_id="t1")  # fmt: skip

    assert not logged.replayed
    assert [m.content for m in logged.messages] == ["hello"]
    stored = await backend.db[MESSAGES].find({"conversation_id": CID}).to_list(None)
    assert [(m["content"], m["user_id"]) for m in stored] == [("hello", "user-mallory")]


async def test_two_attempts_of_one_turn_racing_to_insert_answer_with_the_same_messages(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One attempt reserves, the other replays and inserts first: the first attempt's insert
    collides with messages of the same content, its own turn's, and answers with them."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    insert_many, reserved, go = logger._messages.insert_many, asyncio.Event(), asyncio.Event()

    async def wait_for_the_replay(*args: Any, **kwargs: Any) -> Any:
        if not reserved.is_set():
            reserved.set()
            await go.wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(logger._messages, "insert_many", wait_for_the_replay)
    first = asyncio.create_task(logger.log_messages(CID, turn("hello"), turn_id="t1"))
    await reserved.wait()
    replay = await logger.log_messages(CID, turn("hello"), turn_id="t1")
    go.set()
    fresh = await first

    assert replay.replayed
    assert not fresh.replayed
    assert [m.id for m in fresh.messages] == [m.id for m in replay.messages]
    assert [m.created_at for m in fresh.messages] == [m.created_at for m in replay.messages]
    await check_conversation(backend.db)


async def test_a_second_attempt_past_the_kept_records_never_replaces_the_first_ones_messages(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt's insert stalls while later turns push its record out of the kept
    ones; the second attempt, with other content, finds no record nor stored message and
    reserves a new block; the first then lands and is acknowledged. The second collides with
    the first's messages: with records dropped they cannot be told from an earlier
    conversation's, so the second is refused and the first's stay. Refused after its
    reservation counted it, it gives its block back: the conversation counts what is stored,
    and no `seq` waits for a turn that will never store it."""
    rules = TurnRules(turns_recorded=1)
    logger, second = (
        AgentMessageLogger(backend.db, rules=rules),
        AgentMessageLogger(backend.db, rules=rules),
    )
    await logger.ensure_indexes()
    insert_many, reserved, go = logger._messages.insert_many, asyncio.Event(), asyncio.Event()

    then, other_reserved, calls = asyncio.Event(), asyncio.Event(), []

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)  # 1: the first attempt, 2: "t2", 3: the second attempt
        if len(calls) in (1, 3):
            (reserved if len(calls) == 1 else other_reserved).set()
            await (go if len(calls) == 1 else then).wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(logger._messages, "insert_many", stalled)
    monkeypatch.setattr(second._messages, "insert_many", stalled)
    first = asyncio.create_task(logger.log_messages(CID, turn("first"), turn_id="t1"))
    await reserved.wait()
    await second.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped
    other = asyncio.create_task(second.log_messages(CID, turn("other"), turn_id="t1"))
    await other_reserved.wait()  # reserved a new block; its insert waits
    go.set()
    acknowledged = await first
    then.set()

    with pytest.raises(Conflict):
        await other
    stored = await backend.db[MESSAGES].find({"turn_id": "t1"}).sort("seq").to_list(None)
    assert [(m["seq"], m["content"]) for m in stored] == [
        (m.seq, m.content) for m in acknowledged.messages
    ]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 2)
    await _followed_to_the_end(backend, rules)


# -- 3. message ids are the store's --------------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [pytest.param(["m-1", "m-2"], id="chosen"), pytest.param(["m-1", "m-1"], id="twice")],
)
async def test_message_ids_from_callers_are_refused_before_any_write(
    backend: Backend, ids: list[str]
) -> None:
    logger = AgentMessageLogger(backend.db)
    before = await digest(backend.db)
    messages = [{**m, "_id": i} for m, i in zip(turn("hi"), ids, strict=True)]

    with pytest.raises(InvalidInput, match="message ids are the store's"):
        await logger.log_messages(CID, messages, turn_id="t1")

    assert await digest(backend.db) == before


async def test_a_truncated_map_is_the_stores_to_set(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    message = {"role": "user", "content": "short", "truncated": {"content": 999}}

    with pytest.raises(InvalidInput, match="`truncated` is the store's"):
        await logger.log_messages(CID, [message], turn_id="t1")


@pytest.mark.parametrize(("field", "value"), [("turn_id", "turn-B"), ("user_id", "user-ada")])
async def test_a_message_naming_another_turn_or_user_than_its_own_is_refused_naming_it(
    backend: Backend, field: str, value: str
) -> None:
    """A message's `turn_id` or `user_id` is the store's to set: one naming another turn than
    the one logged, or another user than the one the turn is logged for, is refused before
    any write (was: stored under the turn and user of the call, without a word); the same
    values as the store sets (a message read back and sent again) are accepted."""
    logger = AgentMessageLogger(backend.db)
    before = await digest(backend.db)
    said = {"role": "user", "content": "hi", field: value}

    with pytest.raises(InvalidInput, match=f"message 0 carries `{field}` {value!r}"):
        await logger.log_messages(CID, [said], turn_id="turn-A", user_id="user-grace")
    assert await digest(backend.db) == before

    again = {"role": "user", "content": "hi", "turn_id": "turn-A", "user_id": "user-grace"}
    logged = await logger.log_messages(CID, [again], turn_id="turn-A", user_id="user-grace")
    assert (logged.messages[0].turn_id, logged.messages[0].user_id) == ("turn-A", "user-grace")


async def test_the_api_refuses_a_message_naming_another_turn_or_user_with_422(
    backend: Backend,
) -> None:
    async with serve(backend.db, seeded=False) as api:
        url = f"/v1/conversations/{CID}/turns"
        for field, value in [("turn_id", "turn-B"), ("user_id", "user-ada")]:
            message = {"role": "user", "content": "hi", field: value}
            body = {"turn_id": "turn-A", "messages": [message]}
            answer = await api.http.post(url, json=body, headers=auth_headers(user="user-grace"))
            assert answer.status_code == 422, answer.text
            assert f"carries `{field}`" in answer.text
    assert await backend.db.agent_messages.count_documents({}) == 0


# -- 5. and 6. every check before the first write; counters that cannot jam -------------------


BAD_TURNS = [
    pytest.param([{"role": "user", "content": "x", "latency_ms": 2**63}], "latency_ms", id="int64"),
    pytest.param(
        [{"role": "assistant", "content": "x", "token_usage": {"input_tokens": 2**53}}],
        "input_tokens",
        id="beyond-js-safe",
    ),
    pytest.param([{"role": "user", "content": "a \ud800"}], "surrogate", id="lone-surrogate"),
    pytest.param([None], "message 0", id="none-item"),
    pytest.param([42], "message 0", id="int-item"),
    pytest.param(["hello"], "message 0", id="str-item"),
    pytest.param(
        [{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": {"when": datetime.now(UTC)}}}]}],
        "arguments",
        id="datetime-in-arguments",
    ),
    pytest.param(
        [{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": {"raw": b"\x00"}}}]}],
        "arguments",
        id="bytes-in-arguments",
    ),
    pytest.param(
        [{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": {"s": {1, 2}}}}]}],
        "arguments",
        id="set-in-arguments",
    ),
    pytest.param(
        [{"role": "assistant", "content": "ok?",
          "hitl_action": {"action": "a", "request_id": "r", "params": {"k\x00ey": 1}}}],
        "params",
        id="nul-in-key",
    ),
    pytest.param(
        [{"role": "assistant", "content": "x",
          "native": {"format": "langchain", "set": {"count": 2**70}}}],
        "native",
        id="wide-int-in-native",
    ),
    pytest.param(
        [{"role": "user", "content": "x", "created_at": datetime(9999, 1, 1, tzinfo=UTC)}],
        "created_at",
        id="year-9999",
    ),
    pytest.param(
        [{"role": "user", "content": "x",
          "created_at": datetime(1, 1, 1, tzinfo=UTC).replace(tzinfo=None)}],
        "created_at",
        id="year-1",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "named"), BAD_TURNS)
async def test_a_malformed_turn_is_refused_with_invalid_input_naming_the_problem(
    backend: Backend, messages: list[Any], named: str
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    before = await digest(backend.db)

    with pytest.raises(InvalidInput, match=named):
        await logger.log_messages(CID, messages, turn_id="t1")

    assert await digest(backend.db) == before


@pytest.mark.parametrize("name", [5, "bad \udfff name", ["list"]], ids=["int", "surrogate", "list"])
async def test_a_malformed_name_is_refused_with_invalid_input(backend: Backend, name: Any) -> None:
    logger = AgentMessageLogger(backend.db)
    with pytest.raises(InvalidInput, match="name"):
        await logger.log_messages(CID, turn("hi"), turn_id="t1", name=name)
    assert await backend.db[CONVERSATIONS].count_documents({}) == 0


async def test_a_surrogate_pair_split_across_tokens_is_stored_joined(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    smile = "\ud83d\ude00"  # "😀" as a JavaScript runtime slices it: two UTF-16 halves

    logged = await logger.log_messages(CID, [{"role": "user", "content": smile}], turn_id="t1")

    assert logged.messages[0].content == "😀"
    assert (await ConversationStore(backend.db).transcript(CID))[0].content == "😀"


async def test_usage_saturates_so_one_huge_message_cannot_jam_later_turns(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, turn("big", usage=MAX_SAFE), turn_id="t1")
    await logger.log_messages(CID, turn("bigger", usage=MAX_SAFE), turn_id="t2")
    await logger.log_messages(CID, turn("small"), turn_id="t3")

    conversation = await check_conversation(backend.db)
    assert conversation["usage"]["input_tokens"] == MAX_SAFE


async def test_usage_saturates_within_one_turn_too(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, turn("big", usage=MAX_SAFE) * 2, turn_id="t1")

    conversation = await check_conversation(backend.db)
    assert conversation["usage"]["input_tokens"] == MAX_SAFE


@pytest.mark.parametrize("take_back", ["a pop", "a block given back"])
async def test_a_take_back_leaves_saturated_usage_at_what_the_stored_messages_hold(
    backend: Backend, take_back: str
) -> None:
    """RELIABILITY.md: usage saturates at 2**53 - 1. A turn logged past the cap added nothing
    to it, so taking that turn back (a pop of its message, or its empty block given back to a
    retry with other content) takes nothing off: usage stays what the stored messages hold."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    await logger.log_messages(CID, turn("huge", usage=MAX_SAFE), turn_id="t-huge")
    await logger.log_messages(CID, turn("small", usage=10), turn_id="t-small")
    if take_back == "a pop":
        assert await ConversationStore(backend.db).pop_last_message(CID) is not None
    else:
        await backend.db[MESSAGES].delete_many({"turn_id": "t-small"})  # as if never inserted
        await logger.log_messages(CID, turn("small, regenerated", usage=0), turn_id="t-small")

    conversation = await check_conversation(backend.db, gaps=True)
    assert conversation["usage"] == {"input_tokens": MAX_SAFE, "output_tokens": MAX_SAFE}


@pytest.mark.parametrize("turn_id", ["t-1", "fork-1", "fork-" + "0" * 31, "fork-" + "F" * 32])
async def test_a_callers_turn_named_like_a_forks_gets_its_empty_block_given_back(
    backend: Backend, turn_id: str
) -> None:
    """RELIABILITY.md: a retry with other content of a turn whose insert was lost, past
    `abandon_after`, gives the empty block back and is logged at the end, counted once,
    however the turn id is spelt: only a fork's own copies turn (`fork-` and 32 lowercase hex
    digits) settles other content its own way."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    await logger.log_messages(CID, turn("hello"), turn_id="t-0")
    await logger.log_messages(CID, turn("q"), turn_id=turn_id)
    await backend.db[MESSAGES].delete_many({"turn_id": turn_id})  # as if never inserted

    retried = await logger.log_messages(CID, turn("q, regenerated"), turn_id=turn_id)
    assert [m.seq for m in retried.messages] == [4, 5]
    conversation = await check_conversation(backend.db, gaps=True)
    assert conversation["turn_count"] == 2


# -- 4. tail reads that never skip ---------------------------------------------------------


class SlowInsert:
    """Holds a logger's insert until released: a writer whose second write is slow (or lost).
    `dies`: its process dies once the insert is applied (`landed`), never looking at what it
    stored (the call then hangs until cancelled)."""

    def __init__(self, logger: AgentMessageLogger, *, dies: bool = False) -> None:
        self.logger = logger
        self.reserved = asyncio.Event()
        self.release = asyncio.Event()
        self.landed = asyncio.Event()
        real = logger._messages  # the seam between the logger and the driver

        class Held:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            async def insert_many(inner, *args: Any, **kwargs: Any) -> Any:
                self.reserved.set()
                await self.release.wait()
                inserted = await real.insert_many(*args, **kwargs)
                self.landed.set()
                if dies:
                    await asyncio.Event().wait()
                return inserted

        logger._messages = Held()


async def test_a_tail_reader_never_skips_messages_committed_out_of_seq_order(
    backend: Backend,
) -> None:
    fast = AgentMessageLogger(backend.db)
    first = await fast.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    slow = AgentMessageLogger(backend.db)
    held = SlowInsert(slow)
    writer_a = asyncio.create_task(slow.log_messages(CID, turn("A"), turn_id="tA"))
    await held.reserved.wait()  # A holds seq 1-2
    await fast.log_messages(CID, [{"role": "user", "content": "B1"}], turn_id="tB")  # seq 3
    store = ConversationStore(backend.db)

    page = await store.messages_page(CID, after=first.messages[0].id, limit=10)
    assert page.data == []
    assert page.pending_seq == 1

    held.release.set()
    await writer_a
    page = await store.messages_page(CID, after=first.messages[0].id, limit=10)
    assert [m.content for m in page.data] == ["A?", "A!", "B1"]
    assert page.pending_seq is None


async def test_a_reader_paging_back_newest_first_never_skips_a_turn_still_being_written(
    backend: Backend,
) -> None:
    """A holds seq 1-2, its insert slow; B is stored at 3. Newest first, the page stops above
    the `seq`s A is writing and says where (`pending_seq`), as the ascending read does: read
    on once it landed, nothing is passed over."""
    fast = AgentMessageLogger(backend.db)
    await fast.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    slow = AgentMessageLogger(backend.db)
    held = SlowInsert(slow)
    writer_a = asyncio.create_task(slow.log_messages(CID, turn("A"), turn_id="tA"))
    await held.reserved.wait()
    await fast.log_messages(CID, [{"role": "user", "content": "B1"}], turn_id="tB")
    store = ConversationStore(backend.db)

    page = await store.messages_page(CID, order="desc", limit=10)
    assert [m.content for m in page.data] == ["B1"]
    assert (page.pending_seq, page.has_more) == (2, True)
    held.release.set()
    await writer_a
    older = await store.messages_page(CID, order="desc", limit=10, after=page.last_id)

    assert [m.content for m in older.data] == ["A!", "A?", "m0"]
    assert (older.pending_seq, older.has_more) == (None, False)


async def _a_held_below_b(
    backend: Backend,
) -> tuple[TurnRules, LoggedTurn, SlowInsert, asyncio.Task[Any]]:
    """`abandon_after` 2 s; `m0` logged at 0 (its turn returned), turn A reserved at 1-2 and
    held before its insert (its writer's task), B1 logged at 3."""
    rules = TurnRules(abandon_after=timedelta(seconds=2))
    fast = AgentMessageLogger(backend.db, rules=rules)
    first = await fast.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    held = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    writer_a = asyncio.create_task(held.logger.log_messages(CID, turn("A"), turn_id="tA"))
    await held.reserved.wait()
    await fast.log_messages(CID, [{"role": "user", "content": "B1"}], turn_id="tB")
    return rules, first, held, writer_a


@contextlib.contextmanager
def slow_between_reads(
    store: ConversationStore, held: SlowInsert, writer: asyncio.Task[Any], late: timedelta
) -> Iterator[None]:
    """A reader delayed between its read of the messages and its lookup of the conversation's
    blocks (`_gaps`), as a slow network or a wait for a pooled connection delays it: the
    turn `held` back lands meanwhile, well within its writer's margin, and the reader's clock
    reads `late` further on when it looks the blocks up."""
    looked_up = store._gaps
    with pytest.MonkeyPatch.context() as patch:

        async def lookup(conversation_id: str) -> Any:
            held.release.set()
            await writer
            later = datetime.now(UTC) + late
            patch.setattr("agent_store.store._reads.utc_now", lambda: later)
            return await looked_up(conversation_id)

        patch.setattr(store, "_gaps", lookup)
        yield


async def test_a_tail_reader_slower_than_abandon_after_between_its_reads_never_skips_a_turn(
    backend: Backend,
) -> None:
    """DESIGN.md §3: a block is passed only if it was older than `abandon_after` when the
    messages were read. A holds seq 1-2 and lands (within its margin) after the reader read
    B at 3 and before it looked the blocks up, the reader's clock then past `abandon_after`:
    the page stops at 1, and the follower reads A, then B."""
    rules, first, held, writer_a = await _a_held_below_b(backend)
    store = ConversationStore(backend.db, rules=rules)

    with slow_between_reads(store, held, writer_a, timedelta(seconds=3)):
        page = await store.messages_page(CID, after=first.messages[0].id, limit=10)
    seen = [m.content for m in page.data]
    after = page.last_id or first.messages[0].id
    seen += [m.content for m in (await store.messages_page(CID, after=after, limit=10)).data]

    assert (page.pending_seq, seen) == (1, ["A?", "A!", "B1"])


async def test_a_reader_paging_back_slower_than_abandon_after_between_its_reads_never_skips(
    backend: Backend,
) -> None:
    """As for the ascending read: newest first, a block A landed in while the reader was
    delayed between its reads past `abandon_after` stops the page above it, and the reader
    paging back reads A."""
    rules, _, held, writer_a = await _a_held_below_b(backend)
    store = ConversationStore(backend.db, rules=rules)

    with slow_between_reads(store, held, writer_a, timedelta(seconds=3)):
        page = await store.messages_page(CID, order="desc", limit=10)
    older = await store.messages_page(CID, order="desc", limit=10, after=page.last_id)
    seen = [m.content for m in [*page.data, *older.data]]

    assert (page.pending_seq, seen) == (2, ["B1", "A!", "A?", "m0"])


async def test_a_fork_slower_than_abandon_after_after_reading_never_leaves_out_a_turn_landed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a page: A holds seq 1-2 and lands after the fork at 3 read the messages (0 and
    3), the fork's clock then past `abandon_after` (2 s; faked 3 s on). It does not copy
    past the block as abandoned: it asks to be retried (StorageUnavailable), and the retry
    copies A."""
    from agent_store.store import _logger

    rules, _, held, writer_a = await _a_held_below_b(backend)
    fast = AgentMessageLogger(backend.db, rules=rules)
    read_fork = _logger.read_fork

    async def slow_read(*args: Any, **kwargs: Any) -> Any:
        read = await read_fork(*args, **kwargs)
        held.release.set()
        await writer_a
        later = datetime.now(UTC) + timedelta(seconds=3)
        monkeypatch.setattr(_logger, "utc_now", lambda: later)
        return read

    monkeypatch.setattr(_logger, "read_fork", slow_read)
    try:
        await fast.fork(CID, 3, "conv-fork")
    except StorageUnavailable:
        await fast.fork(CID, 3, "conv-fork")
    copied = await ConversationStore(backend.db).transcript("conv-fork")

    assert [m.content for m in copied] == ["m0", "A?", "A!", "B1"]


async def test_a_reservation_abandoned_for_longer_than_the_rules_allow_is_passed(
    backend: Backend,
) -> None:
    rules = TurnRules(abandon_after=timedelta(0))
    fast = AgentMessageLogger(backend.db, rules=rules)
    first = await fast.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    slow = AgentMessageLogger(backend.db, rules=rules)
    held = SlowInsert(slow)
    writer_a = asyncio.create_task(slow.log_messages(CID, turn("A"), turn_id="tA"))
    await held.reserved.wait()
    await fast.log_messages(CID, [{"role": "user", "content": "B1"}], turn_id="tB")

    page = await ConversationStore(backend.db, rules=rules).messages_page(
        CID, after=first.messages[0].id, limit=10
    )

    assert [m.content for m in page.data] == ["B1"]
    writer_a.cancel()


async def assert_the_late_turn_stored_once_past_the_gap(backend: Backend) -> None:
    """The late turn stored once, at `seq` 4-5 after the gap its first block left, and the
    conversation counting it once."""
    stored = await backend.db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    assert [(m["seq"], m["content"]) for m in stored] == [
        (0, "m0"), (3, "m3"), (4, "late?"), (5, "late!")
    ]  # fmt: skip
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 3)


async def test_a_turn_retried_after_readers_passed_its_empty_block_is_stored_after_them(
    backend: Backend,
) -> None:
    """An outbox logs again, later than `abandon_after` (0 here), a turn whose first attempt
    reserved seq 1-2 and died: readers following the tail have passed that block, so the turn
    takes a new one at the end (once, counted once) and the follower sees every message."""
    rules = TurnRules(abandon_after=timedelta(0))
    logger = AgentMessageLogger(backend.db, rules=rules)
    first = await logger.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    held = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    dead = asyncio.create_task(held.logger.log_messages(CID, turn("late"), turn_id="late"))
    await held.reserved.wait()
    dead.cancel()  # the process died between its two writes
    await logger.log_messages(CID, [{"role": "user", "content": "m3"}], turn_id="t3")
    reader = ConversationStore(backend.db, rules=rules)
    page = await reader.messages_page(CID, after=first.messages[0].id, limit=50)
    seen = [m.content for m in page.data]

    retried = await logger.log_messages(CID, turn("late"), turn_id="late")
    again = await logger.log_messages(CID, turn("late"), turn_id="late")
    page = await reader.messages_page(CID, after=page.last_id, limit=50)
    seen += [m.content for m in page.data]

    assert seen == ["m3", "late?", "late!"]
    assert [m.seq for m in retried.messages] == [m.seq for m in again.messages] == [4, 5]
    assert (retried.replayed, again.replayed) == (True, True)
    await assert_the_late_turn_stored_once_past_the_gap(backend)
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert conversation["usage"] == {"input_tokens": 1, "output_tokens": 1}


async def test_a_relocated_turn_is_last_so_the_preview_quotes_it(backend: Backend) -> None:
    """DESIGN.md §2: the preview is the text of the last user/assistant message. A turn moved
    to a new block at the end is the last one: the summary follows it there (preview and
    `updated_at`) as it follows a turn appended there, still counting it once."""
    rules = TurnRules(abandon_after=timedelta(0))
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    held = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    dead = asyncio.create_task(held.logger.log_messages(CID, turn("late"), turn_id="late"))
    await held.reserved.wait()
    dead.cancel()  # the process died between its two writes
    await logger.log_messages(CID, [{"role": "user", "content": "m3"}], turn_id="t3")

    retried = await logger.log_messages(CID, turn("late"), turn_id="late")

    stored = await backend.db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    assert [m["content"] for m in stored] == ["m0", "m3", "late?", "late!"]
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert conversation["last_message_preview"] == "late!"
    latest = max(m.created_at for m in retried.messages)
    assert conversation["updated_at"].replace(tzinfo=UTC) == latest
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 3)
    assert conversation["usage"] == {"input_tokens": 1, "output_tokens": 1}


async def _a_stalled_first_attempt(
    backend: Backend, rules: TurnRules
) -> tuple[AgentMessageLogger, SlowInsert, asyncio.Task[Any]]:
    """A turn "late" whose first attempt reserved seq 1-2 and stalls before its insert (the
    writer is alive, only slower than `abandon_after`): the logger, the held writer, its
    call."""
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    held = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    first = asyncio.create_task(held.logger.log_messages(CID, turn("late"), turn_id="late"))
    await held.reserved.wait()
    return logger, held, first


async def test_a_stalled_first_insert_landing_after_a_retry_moved_the_turn_is_where_it_is_stored(
    backend: Backend,
) -> None:
    """DESIGN.md §3: a turn's messages have stable ids. A retry moved the stalled turn to
    3-4 and stalls too; the first insert then lands in 1-2. Wherever its messages are stored,
    the turn is stored there: the first attempt, the moved retry and every later retry
    answer 1-2, and no retry moves it again. The moved retry undoes its move: `message_count`
    keeps the block the move took, 3-4, now gaps no turn holds, and 1-2 are gaps no more."""
    rules = TurnRules(abandon_after=timedelta(0))
    logger, held, first = await _a_stalled_first_attempt(backend, rules)
    mover = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    moved = asyncio.create_task(mover.logger.log_messages(CID, turn("late"), turn_id="late"))
    await mover.reserved.wait()  # moved to 3-4, its insert held
    held.release.set()
    landed = await first  # the first insert lands in 1-2
    mover.release.set()

    answers = [await moved] + [
        await logger.log_messages(CID, turn("late"), turn_id="late") for _ in range(3)
    ]

    assert [m.seq for m in landed.messages] == [1, 2]
    assert [[m.seq for m in a.messages] for a in answers] == [[1, 2]] * 4
    assert all(a.replayed for a in answers)
    stored = await backend.db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    assert [(m["seq"], m["content"]) for m in stored] == [(0, "m0"), (1, "late?"), (2, "late!")]
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert (conversation["message_count"], conversation["turn_count"]) == (5, 2)
    assert len(conversation["turns"]) == 3  # t0, the turn at 1-2, the block it gave back
    assert sorted(conversation["popped_seqs"]) == [3, 4]
    await check_conversation(backend.db, CID, gaps=True)
    page = await ConversationStore(backend.db, rules=rules).messages_page(CID, limit=10)
    assert [m.content for m in page.data] == ["m0", "late?", "late!"]


@pytest.mark.parametrize("found_by", ["lookup", "insert"])
async def test_a_retry_finding_the_turn_stored_in_the_block_a_dead_mover_left_undoes_the_move(
    backend: Backend, found_by: str
) -> None:
    """The same, the retry that moved the turn to 3-4 dying before its insert: the first
    insert lands in 1-2, and the next retry, finding the turn whole in the block the move
    left, answers 1-2 and undoes the move: 3-4 given back as gaps no turn holds, 1-2 gaps no
    more, the turn counted once (was: 1-2 listed as gaps, 3-4 neither stored nor a gap).
    The retry finds it by the lookup of its recorded block, passed (`abandon_after` 0), or,
    that block still young (the default 5 minutes), by its insert meeting the turn's ids."""
    rules = TurnRules(abandon_after=timedelta(0))
    _, held, first = await _a_stalled_first_attempt(backend, rules)
    logger = AgentMessageLogger(backend.db, rules=rules if found_by == "lookup" else TurnRules())
    mover = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    moved = asyncio.create_task(mover.logger.log_messages(CID, turn("late"), turn_id="late"))
    await mover.reserved.wait()  # moved to 3-4, its insert held
    moved.cancel()  # the mover dies before its insert
    with contextlib.suppress(asyncio.CancelledError):
        await moved
    held.release.set()
    landed = await first  # the first insert lands in 1-2

    answers = [await logger.log_messages(CID, turn("late"), turn_id="late") for _ in range(2)]

    assert [m.seq for m in landed.messages] == [1, 2]
    assert [[m.seq for m in a.messages] for a in answers] == [[1, 2]] * 2
    assert all(a.replayed for a in answers)
    conversation = await check_conversation(backend.db, CID, gaps=True)
    assert sorted(conversation["popped_seqs"]) == [3, 4]
    assert (conversation["message_count"], conversation["turn_count"]) == (5, 2)


async def test_a_stalled_first_insert_landing_after_its_retry_stored_the_turn_answers_it(
    backend: Backend,
) -> None:
    """The same with the retry's insert first: the turn is stored at 3-4 and the stalled
    first insert, colliding on every id, answers those messages (a replay, not a Conflict
    "already taken" for a turn that is stored)."""
    rules = TurnRules(abandon_after=timedelta(0))
    logger, held, first = await _a_stalled_first_attempt(backend, rules)
    retried = await logger.log_messages(CID, turn("late"), turn_id="late")  # moved, at 3-4
    held.release.set()

    landed = await first
    again = await logger.log_messages(CID, turn("late"), turn_id="late")

    assert [m.seq for m in retried.messages] == [3, 4]
    assert [m.seq for m in landed.messages] == [m.seq for m in again.messages] == [3, 4]
    assert [m.id for m in landed.messages] == [m.id for m in retried.messages]
    assert await backend.db[MESSAGES].count_documents({"conversation_id": CID}) == 3
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert conversation["message_count"] == 5


_GIVE_UP_AFTER = TurnRules(abandon_after=timedelta(seconds=0.4))
"""Rules under which a block reserved and not stored is passed 0.4 seconds on."""


async def _a_twin_gives_up_a_stalled_call_turn(
    backend: Backend, landing_rules: TurnRules, *, dies: bool = False
) -> tuple[AgentMessageLogger, SlowInsert, asyncio.Task[Any], LoggedTurn]:
    """Turn "t0" at 0-1, then "late" making "c-T" reserves 2-3 (its reservation lists the
    call) and its insert stalls between its writer's check and the server, longer than the
    margin. Another turn answers "c-T" as listed, at 4-5; past `abandon_after` the twin of
    "late" (its same content, sent again) finds 2-3 empty, its call answered later: refused
    `Unmovable`, the block given up (its `seq`s gaps, its count taken back). `landing_rules`:
    the stalled writer's (`dies`: its process dies once its insert is applied); t0 and the
    answer are logged under the default rules, so a slow machine never moves them past their
    own margin. Returns the twin's logger, the held writer, its call and the answer."""
    logger = AgentMessageLogger(backend.db, rules=_GIVE_UP_AFTER)
    answering = AgentMessageLogger(backend.db)
    await answering.log_messages(CID, turn("t0"), turn_id="t0")
    held = SlowInsert(AgentMessageLogger(backend.db, rules=landing_rules), dies=dies)
    first = asyncio.create_task(held.logger.log_messages(CID, call_turn(), turn_id="late"))
    await held.reserved.wait()
    (listed,) = await ConversationStore(backend.db).pending_calls(CID)
    result = {"role": "tool", "tool_call_id": "c-T", "content": "found"}
    answer = await answering.log_messages(
        CID,
        [result, {"role": "assistant", "content": "done"}],
        turn_id="answer",
        answers_to={"c-T": listed.message_id},
    )
    await asyncio.sleep(_GIVE_UP_AFTER.abandon_after.total_seconds() + 0.1)
    with pytest.raises(Conflict, match="cannot move to the end") as refused:
        await logger.log_messages(CID, call_turn(), turn_id="late")
    assert "an earlier send of it, still in the network" in str(refused.value)
    given_up = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert sorted(given_up["popped_seqs"]) == [2, 3]
    return logger, held, first, answer


async def _assert_the_give_up_undone(backend: Backend) -> None:
    """The turn stored at 2-3 is counted again, its `seq`s gaps no more, nothing pending."""
    conversation = await check_conversation(backend.db, CID, gaps=True)
    assert not set(conversation.get("popped_seqs") or ()) & {2, 3}
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 2)
    assert await ConversationStore(backend.db).pending_calls(CID) == []
    page = await ConversationStore(backend.db, rules=_GIVE_UP_AFTER).messages_page(CID, limit=10)
    assert [m.seq for m in page.data] == [0, 1, 2, 3, 4, 5]


async def test_a_stalled_insert_landing_in_the_block_its_twin_gave_up_undoes_the_give_up(
    backend: Backend,
) -> None:
    """DESIGN.md §3, "What remains": a writer stalled past the margin lands in a block its
    twin gave up for good (`Unmovable`), and is acknowledged there. Its own step after the
    insert finds the turn whole in the block the give-up recorded and undoes the give-up,
    one update: the block's `seq`s gaps no more (a stored message's `seq` is never one), the
    turn counted again (was: 2-3 listed in `popped_seqs` for good, `turn_count` one short)."""
    _, held, first, _ = await _a_twin_gives_up_a_stalled_call_turn(backend, _GIVE_UP_AFTER)
    held.release.set()

    landed = await first

    assert [m.seq for m in landed.messages] == [2, 3]
    await _assert_the_give_up_undone(backend)


async def test_a_retry_finding_the_turn_stored_whole_in_the_block_given_up_undoes_the_give_up(
    backend: Backend,
) -> None:
    """The same, the landing writer's step after its insert lost (it judged its insert in
    time, its `abandon_after` the default 5 minutes): the next retry of the turn finds it
    whole in the block its record names given up, answers it there and undoes the give-up.
    `check_turn` tells the twin's caller which it is, as the refusal says: refused again
    while nothing landed, passed (a replay) once the turn is stored."""
    logger, held, first, _ = await _a_twin_gives_up_a_stalled_call_turn(backend, TurnRules())
    with pytest.raises(Conflict, match="cannot move to the end"):
        await logger.check_turn(CID, call_turn(), turn_id="late")
    held.release.set()
    landed = await first
    await logger.check_turn(CID, call_turn(), turn_id="late")

    again = await logger.log_messages(CID, call_turn(), turn_id="late")

    assert [m.seq for m in landed.messages] == [m.seq for m in again.messages] == [2, 3]
    assert again.replayed
    await _assert_the_give_up_undone(backend)


@pytest.mark.parametrize("pops", [2, 3], ids=["answer-popped", "down-past-the-block"])
async def test_a_give_up_is_undone_only_while_its_block_lies_below_the_end_pops_left(
    backend: Backend, pops: int
) -> None:
    """The same give-up, then pops take the answer (5, 4), the end staying at 4 past the
    gaps at 2-3, and, with a third, t0's reply (1): the end then at 1, the block given up
    past it. The stalled insert landing in a block still below the end is the turn found
    whole there: counted again. One past the end the pops left is no such turn: its
    give-up stays, nothing counted, `turn_count` and usage those the pops left (was: the
    undo counted it, `turn_count` 2 beside a `message_count` of 1), and what it stored is
    taken back, its writer refused `Corrected`: the next turn is stored at 1-2 (was: the
    landing acknowledged and served past the end, the next turn refused `TurnConflict`)."""
    await AgentMessageLogger(backend.db).ensure_indexes()  # a `seq` holds one message
    _, held, first, _ = await _a_twin_gives_up_a_stalled_call_turn(backend, _GIVE_UP_AFTER)
    store = ConversationStore(backend.db, rules=_GIVE_UP_AFTER)
    for _ in range(pops):
        await store.pop_last_message(CID)
    before = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    held.release.set()

    if pops == 2:
        assert [m.seq for m in (await first).messages] == [2, 3]
    else:
        with pytest.raises(Corrected, match="pops passed that block since"):
            await first

    after = await check_conversation(backend.db, CID, gaps=True)
    counted = ("message_count", "turn_count")
    if pops == 2:
        assert [after[k] for k in counted] == [4, 2]
        assert not set(after.get("popped_seqs") or ()) & {2, 3}
    else:
        assert {k: after.get(k) for k in (*counted, "usage")} == {
            k: before.get(k) for k in (*counted, "usage")
        }
        next_turn = await AgentMessageLogger(backend.db).log_messages(CID, turn("next"))
        assert [m.seq for m in next_turn.messages] == [1, 2]


async def _a_dead_landing_past_the_end(backend: Backend) -> AgentMessageLogger:
    """`_a_twin_gives_up_a_stalled_call_turn`, then three pops (the answer, t0's reply: the
    end back at 1, past the block given up) and the stalled insert of "late" landing at 2-3,
    its writer dying before it looks: the messages of a turn given up for good, served past
    the end. Returns the twin's logger."""
    await AgentMessageLogger(backend.db).ensure_indexes()  # a `seq` holds one message
    twins, held, first, _ = await _a_twin_gives_up_a_stalled_call_turn(
        backend, _GIVE_UP_AFTER, dies=True
    )
    store = ConversationStore(backend.db, rules=_GIVE_UP_AFTER)
    for _ in range(3):
        await store.pop_last_message(CID)
    held.release.set()
    await held.landed.wait()  # "late" at 2-3, its writer dead
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    return twins


@pytest.mark.parametrize("next_turn", [2, 1], ids=["block-meets-the-landing", "block-short-of-it"])
async def test_a_dead_landing_past_the_end_pops_left_gives_way_whole_to_the_next_turns(
    backend: Backend, next_turn: int
) -> None:
    """DESIGN.md §3: the give-up of "late" at 2-3 passed by three pops (the end back at 1),
    its stalled insert lands there and its writer dies before it looks. The next turn's
    insert, meeting one of its messages (at 1-2), or that of the turn after it (one-message
    turns at 1, then at 2), takes every message of "late" away with the one in its way, by its
    turn id in this life: no message of the given-up turn is served after those turns (was:
    the next turn replaced only the `seq` it met, and the call "c-T" of "late" was served
    after the user's newest turn, a message past `message_count`, until a later block
    happened to cover it). Messages of "late" an earlier life of the id left stay."""
    twins = await _a_dead_landing_past_the_end(backend)
    store = ConversationStore(backend.db, rules=_GIVE_UP_AFTER)
    logger = AgentMessageLogger(backend.db)
    landed = await backend.db[MESSAGES].find({"turn_id": "late"}).to_list(None)
    earlier_life = [  # what a late insert of an earlier life under the id would have left
        {**m, "_id": f"{m['_id']}-earlier", "epoch": "an-earlier-life", "seq": 40 + m["seq"]}
        for m in landed
    ]
    await backend.db[MESSAGES].insert_many(earlier_life)

    questions = [turn("next")] if next_turn == 2 else [
        [{"role": "user", "content": "next?"}], [{"role": "user", "content": "then?"}]
    ]  # fmt: skip
    for n, messages in enumerate(questions):
        await logger.log_messages(CID, messages, turn_id=f"next-{n}")

    served = [(m.seq, m.content) for m in await store.transcript(CID)]
    last = "next!" if next_turn == 2 else "then?"
    assert served == [(0, "t0?"), (1, "next?"), (2, last)]
    assert await store.pending_calls(CID) == []
    left = await backend.db[MESSAGES].find({"turn_id": "late"}).to_list(None)
    assert sorted(m["_id"] for m in left) == sorted(m["_id"] for m in earlier_life)
    await backend.db[MESSAGES].delete_many({"epoch": "an-earlier-life"})
    await check_conversation(backend.db, CID, gaps=True)
    with pytest.raises(Corrected):
        await twins.log_messages(CID, call_turn(), turn_id="late")


def _refusing_calls(message: AgentMessage) -> Conflict | None:
    """A caller's check refusing a message that makes calls (as the Agents SDK session
    refuses a message of several items)."""
    calls = isinstance(message, AssistantMessage) and message.tool_calls
    return Conflict(f"seq {message.seq} makes calls") if calls else None


@pytest.mark.parametrize("after", ["the-landing", "a-one-message-turn", "a-refusing-caller"])
async def test_a_pop_after_a_dead_landing_past_the_end_pops_the_users_last_message(
    backend: Backend, after: str
) -> None:
    """RUNTIMES.md §pops: the give-up of "late" at 2-3 passed by three pops (the end back at
    1), its stalled insert lands there and its writer dies before it looks. A pop then
    removes the user's last message below the end the conversation records, "t0?" at 0 (or,
    after a one-message turn at 1, that message), and the next pops go on down; a caller's
    check of the message (`refuse`) is asked of that message alone. The landing, past
    `message_count`, is no message any mark lets a pop remove: it is passed, as a deleted
    conversation's late insert is (was: every pop read the call of "late" at 3 as the last
    message, its mark refused five times, StorageUnavailable "other pops or turns came
    first" with nothing else running, until a later insert happened to meet the landing;
    the refusing caller refused for the call of "late")."""
    await AgentMessageLogger(backend.db).ensure_indexes()  # a `seq` holds one message
    _, held, first, _ = await _a_twin_gives_up_a_stalled_call_turn(
        backend, _GIVE_UP_AFTER, dies=True
    )
    store = ConversationStore(backend.db, rules=_GIVE_UP_AFTER)
    for _ in range(3):
        await store.pop_last_message(CID)
    held.release.set()
    await held.landed.wait()  # "late" at 2-3, past the end at 1, its writer dead
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    expected = [(0, "t0?")]
    if after == "a-one-message-turn":
        await AgentMessageLogger(backend.db).log_messages(
            CID, [{"role": "user", "content": "next?"}], turn_id="next"
        )
        expected.insert(0, (1, "next?"))
    refuse = _refusing_calls if after == "a-refusing-caller" else None

    popped = [await store.pop_last_message(CID, refuse=refuse) for _ in expected]

    assert [(m.seq, m.content) for m in popped if m is not None] == expected
    assert await store.pop_last_message(CID) is None
    landed = await backend.db[MESSAGES].find({"turn_id": "late"}).to_list(None)
    assert sorted(m["seq"] for m in landed) == [2, 3]  # left to the next insert meeting it
    await backend.db[MESSAGES].delete_many({"turn_id": "late"})
    conversation = await check_conversation(backend.db, CID, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (0, 0)


@pytest.mark.parametrize("answer", ["result", "denial"])
async def test_an_answer_to_the_call_of_a_turn_given_up_for_good_is_invalid(
    backend: Backend, answer: str
) -> None:
    """DESIGN.md §3: none of a turn given up for good is ever its own to answer. "late" lands
    past the end after its give-up was passed by pops, its writer dead (its call "c-T" served
    there, unanswered); an answer to "c-T" naming that message in `answers_to` (a result or a
    denial, `check_turn` too) is `InvalidInput` ("does not make call"), nothing written, as
    for a call whose message was popped (was: accepted at 1-2, its own insert meeting "late"
    at 2 and taking it away whole, the message making "c-T" with it: an orphan answer for
    good). The next turn then takes "late" away: nothing of it served, nothing pending."""
    await _a_dead_landing_past_the_end(backend)
    store = ConversationStore(backend.db, rules=_GIVE_UP_AFTER)
    (made,) = [m for m in await store.transcript(CID) if m.tool_calls]
    assert await store.pending_calls(CID) == []
    body: dict[str, Any] = {"role": "tool", "tool_call_id": "c-T", "content": "found"}
    if answer == "denial":
        body |= {"content": DENIED_RESULT, "error": {"message": "tool call denied"}}
    messages = [body, {"role": "assistant", "content": "ok"}]
    logger = AgentMessageLogger(backend.db)
    before = await digest(backend.db)

    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(InvalidInput, match="does not make call 'c-T'"):
            await attempt(CID, messages, turn_id="ans", answers_to={"c-T": str(made.id)})

    assert await digest(backend.db) == before
    await logger.log_messages(CID, turn("next"), turn_id="next")
    served = [(m.seq, m.content) for m in await store.transcript(CID)]
    assert served == [(0, "t0?"), (1, "next?"), (2, "next!")]
    assert await store.pending_calls(CID) == []


@pytest.mark.parametrize("at", [2, 3])
async def test_a_fork_copies_nothing_of_a_turn_given_up_for_good(backend: Backend, at: int) -> None:
    """DESIGN.md §3: none of a turn given up for good is ever the conversation's to copy. A
    fork at a `seq` where "late" landed past the end (its give-up passed by pops, its writer
    dead) finds no message of the conversation there: `InvalidInput`, nothing made (was:
    the fork copied "late" for good, its call "c-T" pending there, while the original's next
    insert takes "late" away and its runtime was told "late" was not stored). A fork at the
    conversation's own last message copies that alone."""
    await _a_dead_landing_past_the_end(backend)
    logger = AgentMessageLogger(backend.db, rules=_GIVE_UP_AFTER)
    store = ConversationStore(backend.db, rules=_GIVE_UP_AFTER)

    with pytest.raises(InvalidInput, match=f"has no message with seq {at}"):
        await logger.fork(CID, at, "fk")

    assert await backend.db[CONVERSATIONS].find_one({"_id": "fk"}) is None
    await logger.fork(CID, 0, "fk")
    assert [(m.seq, m.content) for m in await store.transcript("fk")] == [(0, "t0?")]
    assert await store.pending_calls("fk") == []


CALL_A = {"id": "c-A", "function": {"name": "lookup", "arguments": "{}"}}


def _answer_to_a(text: str) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "tool_call_id": "c-A", "content": text},
        {"role": "assistant", "content": f"{text}!"},
    ]


async def _moved_undone_then_out_of_the_window(backend: Backend, rules: TurnRules) -> str:
    """t0 makes c-A; "late" answers it at 2-3, its insert held; t2 at 4; a retry moves
    "late" to 5-6 and dies; the held insert lands and the next retry undoes the move (the
    block it took kept as a given-up record under the moved key); t3 and t4 push "late"'s
    own record out of the window (`turns_recorded` 3), and three pops pass the taken block.
    The message making c-A."""
    logger = AgentMessageLogger(backend.db, rules=rules)
    made = [{"role": "user", "content": "m0"}, {"role": "assistant", "tool_calls": [CALL_A]}]
    maker = (await logger.log_messages(CID, made, turn_id="t0")).messages[1].id

    def late(writer: AgentMessageLogger) -> Any:
        answer = _answer_to_a("found")
        return writer.log_messages(CID, answer, turn_id="late", answers_to={"c-A": maker})

    held = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    first = asyncio.create_task(late(held.logger))
    await held.reserved.wait()
    await logger.log_messages(CID, [{"role": "user", "content": "t2"}], turn_id="t2")
    mover = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    moved = asyncio.create_task(late(mover.logger))
    await mover.reserved.wait()
    moved.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await moved
    held.release.set()
    await first
    await late(logger)
    for turn_id in ("t3", "t4"):
        await logger.log_messages(CID, [{"role": "user", "content": turn_id}], turn_id=turn_id)
    store = ConversationStore(backend.db, rules=rules)
    for _ in range(3):
        await store.pop_last_message(CID)
    return maker


async def test_a_turn_whose_own_record_the_window_dropped_is_never_judged_given_up(
    backend: Backend,
) -> None:
    """DESIGN.md §3 (a call's first answer is its answer): "late", standing at 2-3 with its
    answer to c-A, whose own record the window dropped while the given-up record of the
    block its undone move took stays, popped past, is still the conversation's: a second
    answer to c-A is `AnsweredBefore` (was: judged given up for good by that moved record
    alone, its answer unseen, the second answer stored: two results for one call)."""
    rules = TurnRules(abandon_after=timedelta(0), turns_recorded=3)
    maker = await _moved_undone_then_out_of_the_window(backend, rules)
    logger = AgentMessageLogger(backend.db, rules=rules)

    with pytest.raises(Conflict):
        await logger.log_messages(
            CID, _answer_to_a("again"), turn_id="dup", answers_to={"c-A": maker}
        )

    stored = await backend.db[MESSAGES].find({"tool_call_id": "c-A"}).to_list(None)
    assert [m["content"] for m in stored] == ["found"]


CALL_L = {"id": "c-L", "function": {"name": "lookup", "arguments": "{}"}}


def _later_call_turn() -> list[dict[str, Any]]:
    """A question and an answer making the call "c-L", left open: another turn than
    `call_turn`'s, of as many messages."""
    return [
        {"role": "user", "content": "look again?"},
        {"role": "assistant", "content": "looking again", "tool_calls": [CALL_L]},
    ]


_PASSED_AFTER = TurnRules(abandon_after=timedelta(seconds=10))
"""Rules under which a block reserved and not stored is passed 10 seconds on: the store's
clocks move past it (`clocks.wait`), while a slow machine never moves a held writer at its
own check, just before its insert."""


async def _given_up_twice_in_one_block(
    backend: Backend, clocks: StoreClocks, *, dies: bool
) -> tuple[AgentMessageLogger, SlowInsert, asyncio.Task[Any], SlowInsert, asyncio.Task[Any]]:
    """ "t0" at 0-1; "late" (making "c-T") reserves 2-3, its insert held; "c-T" is answered at
    4-5, and past `abandon_after` the twin of "late" is refused `Unmovable`, 2-3 given up.
    Pops take 5, 4 and 1: the end back at 1, the gaps given back, the record of "late"
    marked popped. "new" is logged at 1; "l" (making "c-L") reserves 2-3 again, its insert
    held; "c-L" is answered at 4-5, and the twin of "l" is refused: 2-3 gaps again, given up
    for "l". The twins' logger, then each held writer (`dies`: that of "late" dies once its
    insert is applied) and its call."""
    twins, answering = (
        AgentMessageLogger(backend.db, rules=_PASSED_AFTER),
        AgentMessageLogger(backend.db),
    )
    store = ConversationStore(backend.db, rules=_PASSED_AFTER)
    await answering.log_messages(CID, turn("t0"), turn_id="t0")
    calls: list[tuple[SlowInsert, asyncio.Task[Any]]] = []
    for made, turn_id, call in ((call_turn(), "late", "c-T"), (_later_call_turn(), "l", "c-L")):
        if calls:
            assert [(await store.pop_last_message(CID)).seq for _ in range(3)] == [5, 4, 1]
            await answering.log_messages(CID, [{"role": "user", "content": "new"}], turn_id="new")
        logger = AgentMessageLogger(backend.db, rules=_PASSED_AFTER)
        held = SlowInsert(logger, dies=dies and not calls)
        calls.append((held, asyncio.create_task(logger.log_messages(CID, made, turn_id=turn_id))))
        await held.reserved.wait()  # 2-3
        (listed,) = await store.pending_calls(CID)
        result = {"role": "tool", "tool_call_id": call, "content": f"found {turn_id}"}
        await answering.log_messages(
            CID,
            [result, {"role": "assistant", "content": f"done {turn_id}"}],
            turn_id=f"answer-{turn_id}",
            answers_to={call: listed.message_id},
        )
        clocks.wait(_PASSED_AFTER.abandon_after.total_seconds() + 1)
        with pytest.raises(Conflict, match="cannot move to the end"):
            await twins.log_messages(CID, made, turn_id=turn_id)
        given_up = await backend.db[CONVERSATIONS].find_one({"_id": CID})
        assert sorted(given_up["popped_seqs"]) == [2, 3]
    (held, first), (later, second) = calls
    return twins, held, first, later, second


@pytest.mark.parametrize("stale_writer", ["looks", "dies", "after-the-owner"])
async def test_a_landing_fills_only_the_block_its_own_reservation_was_given_up_for(
    backend: Backend, clocks: StoreClocks, stale_writer: str
) -> None:
    """DESIGN.md §3: the block of "late" given up at 2-3, pops passing it, and "l" given up
    there in turn (`_given_up_twice_in_one_block`). The stalled insert of "late" then lands
    in 2-3: its give-up, passed by the pops, is not undone, and the landing counts for
    nothing: its writer takes back what it stored and is refused `Corrected`, as every retry
    of "late" is; dead after its insert, what it stored gives way to the insert of "l";
    landing after "l", it stores nothing. "l" lands at 2-3 and its give-up is undone as
    documented: its `seq`s gaps no more, counted again, its call answered (was: "late"
    acknowledged at 2-3 inside gaps still listed, "l" refused `TurnConflict` for good, the
    answer to "c-L" a result with no call stored before it, `pending_calls` listing "c-T")."""
    await AgentMessageLogger(backend.db).ensure_indexes()  # a `seq` holds one message
    dies = stale_writer == "dies"
    twins, held, first, later, second = await _given_up_twice_in_one_block(
        backend, clocks, dies=dies
    )

    if stale_writer == "after-the-owner":
        later.release.set()
        landed = await second
    held.release.set()  # "late" lands at 2-3
    if dies:
        await held.landed.wait()
        first.cancel()
    refused = {"looks": Corrected, "dies": asyncio.CancelledError}.get(stale_writer, Conflict)
    with pytest.raises(refused):  # after the owner: its `seq`s taken, nothing stored
        await first
    if stale_writer != "after-the-owner":
        later.release.set()
        landed = await second

    assert [m.seq for m in landed.messages] == [2, 3]
    conversation = await check_conversation(backend.db, CID, gaps=True)
    assert not set(conversation.get("popped_seqs") or ()) & {2, 3}
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 3)
    store = ConversationStore(backend.db, rules=_PASSED_AFTER)
    assert await store.pending_calls(CID) == []
    served = [(m.seq, m.content) for m in await store.transcript(CID)]
    assert served == [
        (0, "t0?"),
        (1, "new"),
        (2, "look again?"),
        (3, "looking again"),
        (4, "found l"),
        (5, "done l"),
    ]
    for attempt in (twins.check_turn, twins.log_messages):  # every attempt alike
        with pytest.raises(Corrected):
            await attempt(CID, call_turn(), turn_id="late")


async def _a_stalled_first_insert_landing_after_pops(
    backend: Backend, pops: int, later: int = 0
) -> tuple[AgentMessageLogger, ConversationStore, asyncio.Task[Any]]:
    """Turn "late": its first attempt reserved 1-2 and stalls; its retry moves it to 3-4 and
    stores it; `pops` pops remove its last messages; `later` turns are logged after them
    (each record kept for 2 turns: 2 later turns drop the records of "late"); then the stalled
    insert lands in 1-2, where the ids of the popped messages are free again. The logger, a
    store, the first attempt's call (done)."""
    rules = TurnRules(abandon_after=timedelta(0), turns_recorded=2)
    logger, held, first = await _a_stalled_first_attempt(backend, rules)
    retried = await logger.log_messages(CID, turn("late"), turn_id="late")
    assert [m.seq for m in retried.messages] == [3, 4]  # moved
    store = ConversationStore(backend.db, rules=rules)
    for _ in range(pops):
        assert await store.pop_last_message(CID) is not None
    for n in range(later):
        await logger.log_messages(CID, turn(f"later{n}"), turn_id=f"later{n}")
    held.release.set()
    await asyncio.wait([first])
    return logger, store, first


async def _served(backend: Backend, store: ConversationStore) -> list[tuple[int, str]]:
    """The transcript as (seq, content), checked against every message stored."""
    served = [(m.seq, str(m.content)) for m in await store.transcript(CID)]
    stored = await backend.db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    assert [(m["seq"], m["content"]) for m in stored] == served
    return served


async def test_a_stalled_first_insert_landing_after_a_pop_of_the_moved_turn_brings_nothing_back(
    backend: Backend,
) -> None:
    """RELIABILITY.md: the retry moved the turn to 3-4 and a pop removed its answer. The
    stalled first insert then lands in 1-2, the block the turn left: the question collides
    with the one stored at 3, the popped answer's id is free. The first attempt takes back
    what it stored in the block its turn left, and answers the turn as stored where it
    moved: the popped answer is never served again, nor before its question."""
    logger, store, first = await _a_stalled_first_insert_landing_after_pops(backend, pops=1)

    landed = first.result()

    assert [(m.seq, m.content) for m in landed.messages] == [(3, "late?")]
    assert await _served(backend, store) == [(0, "m0"), (3, "late?")]
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert (conversation["message_count"], conversation["turn_count"]) == (4, 2)
    after = await logger.log_messages(CID, turn("next"), turn_id="next")
    assert [m.seq for m in after.messages] == [4, 5]
    assert await _served(backend, store) == [
        (0, "m0"), (3, "late?"), (4, "next?"), (5, "next!")
    ]  # fmt: skip
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 3)


async def test_a_stalled_first_insert_landing_after_pops_of_the_whole_moved_turn_stores_nothing(
    backend: Backend,
) -> None:
    """The same with two pops: the whole moved turn was removed, so the stalled insert stores
    both messages in 1-2. It takes both back, and is told the turn was corrected since (a
    Conflict, as a retry is): nothing of the turn is served again."""
    logger, store, first = await _a_stalled_first_insert_landing_after_pops(backend, pops=2)

    with pytest.raises(Conflict, match="corrected"):
        first.result()

    assert await _served(backend, store) == [(0, "m0")]
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert (conversation["message_count"], conversation["turn_count"]) == (3, 1)
    after = await logger.log_messages(CID, turn("next"), turn_id="next")
    assert [m.seq for m in after.messages] == [3, 4]
    assert await _served(backend, store) == [(0, "m0"), (3, "next?"), (4, "next!")]
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert (conversation["message_count"], conversation["turn_count"]) == (5, 2)


async def test_a_stalled_first_insert_landing_after_a_pop_past_the_kept_records_is_corrected(
    backend: Backend,
) -> None:
    """The first case, with two turns logged after the pop: the records of "late" are
    dropped, so nothing tells where it moved. The stalled insert meets its question stored at
    3 and the conversation listing its answer as popped: it is told the turn was corrected
    (`Corrected`, as a retry and `check_turn` are told), not that it is stored elsewhere,
    which a runtime could read as "log the rest". Nothing popped is served again."""
    logger, store, first = await _a_stalled_first_insert_landing_after_pops(
        backend, pops=1, later=2
    )

    with pytest.raises(Corrected):
        first.result()
    with pytest.raises(Corrected):
        await logger.check_turn(CID, turn("late"), turn_id="late")

    assert await _served(backend, store) == [
        (0, "m0"), (3, "late?"), (4, "later0?"), (5, "later0!"), (6, "later1?"), (7, "later1!")
    ]  # fmt: skip


async def test_two_attempts_racing_the_move_of_an_abandoned_block_both_answer_the_stored_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3: two attempts of one turn racing still answer with the stored messages.
    The turn's first attempt reserved 1-2 and died; "m3" was logged since. Attempt B reads
    the conversation (the turn at 1-2) and is held before it looks its block up; attempt A
    moves the turn to 4-5 and stores it there; B then finds the turn's messages at 4-5, a
    block the conversation it read does not record yet: it answers them, no Conflict."""
    rules = TurnRules(abandon_after=timedelta(0))
    logger, _, first = await _a_stalled_first_attempt(backend, rules)
    first.cancel()  # the process died between its two writes
    await logger.log_messages(CID, [{"role": "user", "content": "m3"}], turn_id="t3")
    b = AgentMessageLogger(backend.db, rules=rules)
    find, looking, go = b._messages.find, asyncio.Event(), asyncio.Event()

    def held_lookup(*args: Any, **kwargs: Any) -> Any:
        cursor = find(*args, **kwargs)
        if looking.is_set():
            return cursor

        class Held:
            async def to_list(self, length: int | None) -> Any:
                looking.set()
                await go.wait()
                return await cursor.to_list(length)

        return Held()

    monkeypatch.setattr(b._messages, "find", held_lookup)
    attempt_b = asyncio.create_task(b.log_messages(CID, turn("late"), turn_id="late"))
    await looking.wait()  # B read the conversation and is about to look its block up
    attempt_a = await logger.log_messages(CID, turn("late"), turn_id="late")  # moved, at 4-5
    go.set()

    answered = await attempt_b

    assert [m.seq for m in attempt_a.messages] == [m.seq for m in answered.messages] == [4, 5]
    assert [m.id for m in answered.messages] == [m.id for m in attempt_a.messages]
    assert answered.replayed
    await assert_the_late_turn_stored_once_past_the_gap(backend)


# -- a property: anything a caller sends is stored faithfully or refused whole ----------------


def _valid_turn(rng: random.Random) -> list[dict[str, Any]]:
    call = {"id": f"c{rng.randint(0, 9)}", "function": {"name": "f", "arguments": {"q": "x"}}}
    pool: list[list[dict[str, Any]]] = [
        turn("plain"),
        [{"role": "user", "content": "look", "upload": {"filename": "a.pdf", "file_type": "pdf",
                                                         "size": 10}}],
        [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": call["id"], "content": "{}"}],
        [{"role": "assistant", "content": "ok?", "hitl_action": {
            "action": "confirm", "request_id": "r1", "params": {"a": [1, {"b": 2}]}}}],
        [{"role": "system", "content": "boot"}],
    ]  # fmt: skip
    return json.loads(json.dumps(rng.choice(pool)))


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


BAD_VALUES: list[Any] = [
    None, 0, -1, 2**53, 2**63, 2**64, 1.5, float("nan"), True, "", "\ud800", "\udc00x",
    "a\x00b", b"bytes", {1, 2}, [], {}, [None], {"$set": 1}, {"a\x00": 1}, "x" * 70_000,
    datetime(9999, 12, 31, tzinfo=UTC), datetime(1, 1, 1), datetime.now(UTC), "2026-01-01",
    {"deep": _nested(40)},
    "msg-0123", {"content": 5}, ["role"],
]  # fmt: skip
BENIGN_VALUES: list[Any] = [
    "plain text", "\ud83d\ude00 joined", "$where", "{\"$gt\": 1}", "ünïcødé ✓", "x" * 70_000,
    None, 0, 12, {"input_tokens": 1, "output_tokens": 2},
]  # fmt: skip
FIELDS = [
    "role", "content", "tool_calls", "tool_call_id", "hitl_action", "error", "upload",
    "created_at", "token_usage", "latency_ms", "_id", "seq", "user_id", "turn_id",
    "search_text", "truncated", "conversation_id", "surprise", "$where",
]  # fmt: skip


def _malformed(rng: random.Random) -> list[Any]:
    """A valid turn with one to three values replaced by hostile ones, anywhere in it."""
    messages: list[Any] = _valid_turn(rng)
    for _ in range(1 if rng.random() < 0.6 else rng.randint(2, 3)):
        target = rng.randrange(len(messages))
        if rng.random() < 0.1:
            messages[target] = copy.deepcopy(rng.choice(BAD_VALUES))
            continue
        message = messages[target]
        if not isinstance(message, dict):
            continue
        holder = message
        nested = [v for v in message.values() if isinstance(v, dict)]
        if nested and rng.random() < 0.4:
            holder = rng.choice(nested)
            key = rng.choice([*holder, "extra"])
        else:
            key = rng.choice(FIELDS)
        values = BENIGN_VALUES if rng.random() < 0.6 else BAD_VALUES
        holder[key] = copy.deepcopy(rng.choice(values))
    return messages


def _visible(message: Any) -> dict[str, Any]:
    """What a caller sent that must come back as it was (what the store adds left out)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(mode="json", by_alias=True)
    dumped = message
    return {k: dumped.get(k) for k in ("role", "content", "tool_call_id", "upload", "error")}


async def test_a_thousand_malformed_turns_are_stored_faithfully_or_refused_whole(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, turn("existing"), turn_id="t-existing", user_id="owner")
    store = ConversationStore(backend.db)
    rng = random.Random(2026)
    refused = stored = 0
    before = await digest(backend.db)
    for number in range(1000):
        messages = _malformed(rng)
        target = CID if number % 2 else f"conv-fresh-{number}"
        try:
            logged = await logger.log_messages(target, messages, turn_id=f"t{number}")
        except InvalidInput as error:
            message = error.message
            refused += 1
            assert message.startswith("invalid"), message
            assert await digest(backend.db) == before, f"example {number} wrote: {messages!r}"
            continue  # nothing changed: `before` is still the database's digest
        transcript = await store.transcript(target)
        assert [_visible(m) for m in transcript[-len(logged.messages) :]] == [
            _visible(m) for m in logged.messages
        ]
        stored += 1
        if target != CID:  # keep the database small, so every digest stays cheap
            await backend.db[MESSAGES].delete_many({"conversation_id": target})
            await backend.db[CONVERSATIONS].delete_one({"_id": target})
        before = await digest(backend.db)
    await check_conversation(backend.db)
    assert refused > 400, (refused, stored)
    assert stored > 60, (refused, stored)  # both outcomes exercised


# -- past the kept turn records ----------------------------------------------------------------


async def test_past_the_kept_records_a_retry_is_still_recognised_by_its_stored_messages(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=4))
    for n in range(10):
        await logger.log_messages(CID, turn(f"turn {n}"), turn_id=f"t{n}")

    retried = await logger.log_messages(CID, turn("turn 1"), turn_id="t1")
    await logger.log_messages(CID, turn("turn 10"), turn_id="t10")

    assert retried.replayed
    assert [m.seq for m in retried.messages] == [2, 3]
    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, turn("changed"), turn_id="t2")
    conversation = await check_conversation(backend.db)
    assert conversation["turns_dropped"] == 7
    assert len(conversation["turns"]) == 4


async def test_past_the_kept_records_a_retry_is_recognised_whatever_order_the_server_returns(
    backend: Backend,
) -> None:
    """A turn whose question was stored after its answer (an attempt moved it into the block
    the turn is stored in) comes back from an unsorted read answer first on these backends:
    the retry is still recognised, every time, as the turn is read in `seq` order."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=1))
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    stored = await logger.log_messages(CID, turn("same"), turn_id="t1")
    question = await backend.db[MESSAGES].find_one({"turn_id": "t1", "seq": 2})
    await backend.db[MESSAGES].delete_one({"_id": question["_id"]})
    await backend.db[MESSAGES].insert_one(question)  # stored again, after the answer
    await logger.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped

    for _ in range(3):
        retried = await logger.log_messages(CID, turn("same"), turn_id="t1")
        assert retried.replayed
        assert [(m.id, m.seq) for m in retried.messages] == [(m.id, m.seq) for m in stored.messages]
    conversation = await check_conversation(backend.db)
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 3)


async def test_past_the_kept_records_a_retry_must_match_every_stored_message(
    backend: Backend,
) -> None:
    """With no record left, the stored messages are the only evidence of the turn: a retry
    sending more messages than were stored writes nothing (it could fill another turn's
    empty block), one sending fewer is not the turn either; a block cut short by a crash is
    refused, not completed."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=4))
    await logger.log_messages(CID, turn("first"), turn_id="t-a")
    for n in range(10):
        await logger.log_messages(CID, turn(f"turn {n}"), turn_id=f"t{n}")
    before = await digest(backend.db)

    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, [*turn("first"), {"role": "assistant", "content": "+"}],
                                  turn_id="t-a")  # fmt: skip
    assert await digest(backend.db) == before
    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, turn("first")[:1], turn_id="t-a")
    assert await digest(backend.db) == before
    await backend.db.agent_messages.delete_one({"turn_id": "t-a", "seq": 1})
    with pytest.raises(Conflict, match="has 1 of the 2 messages this retry sends stored"):
        await logger.log_messages(CID, turn("first"), turn_id="t-a")

    assert await backend.db.agent_messages.count_documents({}) == 21


@pytest.mark.parametrize("later", [0, 6], ids=["record-kept", "record-dropped"])
async def test_a_retry_sending_one_message_more_is_other_content_however_old_its_record(
    backend: Backend, later: int
) -> None:
    """LIBRARY.md: a retry with other content raises `Conflict` and writes nothing. A retry of
    a turn stored as 2 messages sending them and one more is the same refusal
    (`OtherContent`, with its advice) while the turn's record is kept and after it is
    dropped, when the 3 `seq`s its block would span run into the next turn: the block's
    first messages are the turn's own, so the turn was logged with other content."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=4))
    await logger.log_messages(CID, turn("first"), turn_id="t-a")
    for n in range(later):
        await logger.log_messages(CID, [{"role": "user", "content": f"later {n}"}],
                                  turn_id=f"t{n}")  # fmt: skip
    longer = [*turn("first"), {"role": "assistant", "content": "regenerated"}]
    before = await digest(backend.db)
    advice = (
        "turn 't-a' was logged with other content (3 messages now); a retry must send the "
        "same messages. Use a new turn_id for a new turn"
    )

    for call in (logger.check_turn, logger.log_messages):
        with pytest.raises(OtherContent, match=re.escape(advice)):
            await call(CID, longer, turn_id="t-a")
    assert await digest(backend.db) == before


@pytest.mark.parametrize("later", [3, 4], ids=["turns_recorded-1", "turns_recorded"])
async def test_a_first_attempt_that_stored_nothing_is_counted_again_from_turns_recorded_later_turns(
    backend: Backend, later: int
) -> None:
    """DESIGN.md §3, the case left uncovered: a turn whose first attempt reserved and stored
    nothing is stored in its own block, counted once, while its record is kept, that is while
    fewer than `turns_recorded` (4) later turns followed. From `turns_recorded` later turns on
    its record is dropped (the records kept are the later turns'): the retry is stored in a new
    block and the turn counted again, its first block left reserved and empty."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=4))
    await logger.log_messages(CID, turn("lost"), turn_id="t-lost")
    await backend.db[MESSAGES].delete_many({"turn_id": "t-lost"})  # as if never inserted
    for n in range(later):
        await logger.log_messages(CID, turn(f"later {n}"), turn_id=f"t{n}")

    retried = await logger.log_messages(CID, turn("lost"), turn_id="t-lost")

    if later < 4:
        assert [m.seq for m in retried.messages] == [0, 1]
        conversation = await check_conversation(backend.db)
        assert conversation["turn_count"] == later + 1
    else:
        assert [m.seq for m in retried.messages] == [10, 11]
        conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
        assert (conversation["turn_count"], conversation["usage"]["input_tokens"]) == (6, 6)
        assert await backend.db[MESSAGES].count_documents({"seq": {"$lt": 2}}) == 0


CALL_T = {"id": "c-T", "function": {"name": "lookup", "arguments": "{}"}}


def call_turn(*, prompt: bool = False) -> list[dict[str, Any]]:
    """A question and an answer making the call "c-T", left open (held by the prompt "req-T"
    with `prompt`), 2 tokens each way, at one time: a retry derives the same ids without a
    turn id too."""
    made: list[dict[str, Any]] = [
        {"role": "user", "content": "look it up?"},
        {
            "role": "assistant",
            "content": "looking",
            "tool_calls": [CALL_T],
            "token_usage": {"input_tokens": 2, "output_tokens": 2},
        },
    ]
    if prompt:
        action = {"action": "approve", "request_id": "req-T", "tool_call_ids": ["c-T"]}
        made.append({"role": "assistant", "content": "ok?", "hitl_action": action})
    return [{**m, "created_at": "2026-01-01T12:00:00Z"} for m in made]


async def _call_turn_counted_again(
    backend: Backend, turn_id: str | None, rules: TurnRules, *, prompt: bool = False
) -> LoggedTurn:
    """Turn "t0", then a turn making "c-T" whose reservation listed the call and whose insert
    was lost, then `turns_recorded` (3) later turns answering none: its retry, logged under
    `turn_id` (None: its digest), is stored in a new block and counted again."""
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("t0"), turn_id="t0")
    lost = call_turn(prompt=prompt)
    await reserved_insert_lost(logger, partial(logger.log_messages, CID, lost, turn_id=turn_id))
    listed = await ConversationStore(backend.db).pending_calls(CID)
    assert [c.tool_call_id for c in listed] == ["c-T"]  # listed by the lost reservation
    for n in range(3):
        await logger.log_messages(CID, turn(f"later {n}"), turn_id=f"l{n}")
    return await logger.log_messages(CID, call_turn(prompt=prompt), turn_id=turn_id)


@pytest.mark.parametrize(
    ("turn_id", "abandon_after"),
    [("t-T", None), ("t-T", timedelta(0)), (None, None), (None, timedelta(0))],
    ids=["explicit id", "explicit id past abandon_after", "digest id", "digest id past"],
)
async def test_a_call_of_a_turn_counted_again_after_a_lost_insert_is_pending_once(
    backend: Backend, turn_id: str | None, abandon_after: timedelta | None
) -> None:
    """DESIGN.md §3: a turn whose first reservation listed its call, its insert lost, retried
    after `turns_recorded` later turns, is stored in a new block and counted again; its call
    is listed once (same id, same making message), where the turn now stands, and a client
    answering each call `pending_calls` lists is stored."""
    rules = TurnRules(turns_recorded=3)
    if abandon_after is not None:
        rules = TurnRules(turns_recorded=3, abandon_after=abandon_after)
    retried = await _call_turn_counted_again(backend, turn_id, rules)

    maker = retried.messages[1]
    assert [m.seq for m in retried.messages] == [10, 11]
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    stored = [(c["tool_call_id"], c["message_id"], c["seq"]) for c in conversation["pending_calls"]]
    assert stored == [("c-T", maker.id, 11)]
    store = ConversationStore(backend.db)
    listed = await store.pending_calls(CID)
    assert [(c.tool_call_id, c.message_id) for c in listed] == [("c-T", maker.id)]
    # Counted again (DESIGN.md §3): the lost block's turn start, messages and tokens stay.
    assert (conversation["turn_count"], conversation["message_count"]) == (6, 12)
    assert conversation["usage"] == {"input_tokens": 4 + 4, "output_tokens": 4 + 4}

    answers = [{"role": "tool", "tool_call_id": c.tool_call_id, "content": "found"} for c in listed]
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(
        CID,
        [*answers, {"role": "assistant", "content": "done"}],
        turn_id="answer",
        answers_to={c.tool_call_id: c.message_id for c in listed},
    )
    assert await store.pending_calls(CID) == []


async def test_a_held_call_of_a_turn_counted_again_is_pending_once_under_its_prompt(
    backend: Backend,
) -> None:
    """The same with a prompt holding the call: listed once, under its prompt; resolving the
    prompt with the calls listed, then answering the call, leaves nothing pending."""
    retried = await _call_turn_counted_again(
        backend, "t-T", TurnRules(turns_recorded=3), prompt=True
    )
    store = ConversationStore(backend.db)
    listed = await store.pending_calls(CID)
    assert [(c.tool_call_id, c.message_id, c.request_id) for c in listed] == [
        ("c-T", retried.messages[1].id, "req-T")
    ]

    await store.resolve_hitl(CID, "req-T", calls=listed)
    answer = {"role": "tool", "tool_call_id": "c-T", "content": "found"}
    await AgentMessageLogger(backend.db).log_messages(
        CID, [answer], turn_id="answer", answers_to={"c-T": retried.messages[1].id}
    )
    assert await store.pending_calls(CID) == []
    assert await store.pending_hitl(CID) is None


async def test_a_turn_counted_again_pushes_no_held_call_off_for_its_own_call_listed_before(
    backend: Backend,
) -> None:
    """A retry stored in a new block lists its call once: it is not counted twice against the
    bound of `pending_calls`, so a call a prompt holds, oldest of a full list, is not pushed
    off (the retry was refused `HeldOff`, as though the list held one call more)."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=3))
    held = {"id": "c-H", "function": {"name": "book", "arguments": "{}"}}
    action = {"action": "approve", "request_id": "req-H", "tool_call_ids": ["c-H"]}
    await logger.log_messages(
        CID,
        [
            {"role": "user", "content": "book it?"},
            {"role": "assistant", "tool_calls": [held]},
            {"role": "assistant", "content": "ok?", "hitl_action": action},
        ],
        turn_id="t0",
    )
    lost = call_turn()
    await reserved_insert_lost(logger, partial(logger.log_messages, CID, lost, turn_id="t-T"))
    more = PENDING_CALLS_KEPT - 2  # the list full: c-H, c-T and these
    many = [{"id": f"m{i}", "function": {"name": "f", "arguments": "{}"}} for i in range(more)]
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "all"}, {"role": "assistant", "tool_calls": many}],
        turn_id="l0",
    )
    for n in range(1, 3):
        await logger.log_messages(CID, turn(f"later {n}"), turn_id=f"l{n}")

    retried = await logger.log_messages(CID, call_turn(), turn_id="t-T")

    listed = await ConversationStore(backend.db).pending_calls(CID)
    assert len(listed) == PENDING_CALLS_KEPT
    assert (listed[0].tool_call_id, listed[0].request_id) == ("c-H", "req-H")
    assert [(c.tool_call_id, c.message_id) for c in listed if c.tool_call_id == "c-T"] == [
        ("c-T", retried.messages[1].id)
    ]


async def test_a_turn_moved_many_times_never_pushes_another_turns_record_out(
    backend: Backend,
) -> None:
    """DESIGN.md §2, `turns` holds one record per logged turn: the records a turn leaves by
    moving to a new block (its insert lost, retried past `abandon_after`) never push another
    turn's record out of the `turns_recorded` (4) kept. With one later turn moved six times,
    an earlier turn that reserved and stored nothing is still recorded: its retry is stored
    once and counted once. The document stays bounded: at most `turns_recorded` records of
    turns and as many of the blocks left."""
    logger = AgentMessageLogger(
        backend.db, rules=TurnRules(turns_recorded=4, abandon_after=timedelta(0))
    )
    await logger.log_messages(CID, turn("a"), turn_id="t-a")
    await logger.log_messages(CID, turn("lost"), turn_id="t-lost")
    await backend.db[MESSAGES].delete_many({"turn_id": "t-lost"})  # as if never inserted
    await logger.log_messages(CID, turn("moved"), turn_id="t-moved")
    for _ in range(6):
        await backend.db[MESSAGES].delete_many({"turn_id": "t-moved"})  # its insert lost again
        await logger.log_messages(CID, turn("moved"), turn_id="t-moved")  # moves to the end

    retried = await logger.log_messages(CID, turn("lost"), turn_id="t-lost")

    assert [m.content for m in retried.messages] == ["lost?", "lost!"]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["turn_count"], conversation["usage"]["input_tokens"]) == (3, 3)
    assert len(conversation["turns"]) <= 2 * 4


async def test_turn_records_kept_before_they_carried_their_order_still_pass_out_of_the_window(
    backend: Backend,
) -> None:
    """Records kept before records said their order and whether they name a turn (no `o`,
    no `m`) count as turns' own and as the oldest: later turns push them out as before, the
    window then `turns_recorded` (4) records long again."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=4))
    for n in range(4):
        await logger.log_messages(CID, turn(f"old {n}"), turn_id=f"old-{n}")
    found = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert found is not None
    unmarked = [{k: v for k, v in r.items() if k not in ("o", "m")} for r in found["turns"]]
    await backend.db[CONVERSATIONS].update_one({"_id": CID}, {"$set": {"turns": unmarked}})

    for n in range(5):
        await logger.log_messages(CID, turn(f"new {n}"), turn_id=f"new-{n}")

    conversation = await check_conversation(backend.db)
    assert [r["f"] for r in conversation["turns"]] == [10, 12, 14, 16]
    assert conversation["turns_dropped"] == 5
    replayed = await logger.log_messages(CID, turn("old 0"), turn_id="old-0")
    assert replayed.replayed


REBUILT_RECORD_KEYS = ("k", "f", "d", "a", "p", "g", "u")
"""The fields of a turn record the migration rebuilds from its messages (`stored_turn_record`)."""


@pytest.mark.parametrize(
    "written_by",
    ["the migration's rebuild", "an earlier release's pop"],
)
async def test_turn_records_written_by_any_path_stay_records_through_pops_and_turns(
    backend: Backend, written_by: str
) -> None:
    """Turn records as the migration rebuilds them (the fields a record said before `o`,
    `m`, `l`, `c`, `h`, `n` left out), or as an earlier release's pop rewrote those (each
    null), are read as records kept before records said so: every message of the turns is
    popped, each pop by a store of its own, and a turn is logged after; each record a pop
    or a turn writes is whole, every field it lacked at its default, never a flag null."""
    logger = AgentMessageLogger(backend.db)
    for n in range(2):
        await logger.log_messages(CID, turn(f"turn {n}"), turn_id=f"t{n}")
    found = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert found is not None
    blank = dict.fromkeys(("o", "m", "l", "c", "h", "n")) if "pop" in written_by else {}
    rebuilt = [{k: r[k] for k in REBUILT_RECORD_KEYS} | blank for r in found["turns"]]
    await backend.db[CONVERSATIONS].update_one({"_id": CID}, {"$set": {"turns": rebuilt}})

    popped = [(await ConversationStore(backend.db).pop_last_message(CID)) for _ in range(3)]
    await logger.log_messages(CID, turn("after"), turn_id="after")

    assert [m.content for m in popped if m is not None] == ["turn 1!", "turn 1?", "turn 0!"]
    conversation = await check_conversation(backend.db, gaps=True)
    records = conversation["turns"]
    assert [TurnRecord.model_validate(r).popped for r in records] == [True, True, False]
    whole = {field.alias for field in TurnRecord.model_fields.values()}
    assert [set(r) for r in records] == [whole] * 3
    assert all(isinstance(r[flag], bool) for r in records for flag in ("p", "g", "m", "u"))


async def test_past_the_kept_records_a_fork_or_delivery_refused_by_its_condition_says_why(
    backend: Backend,
) -> None:
    """A fork into an existing id is a Conflict and a delivery into a closed inbox answers
    False, however many turn records the conversation has dropped; nothing is written."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=2))
    await logger.log_messages("conv-source", turn("source"), turn_id="s1")
    for n in range(4):
        await logger.log_messages(CID, turn(f"turn {n}"), turn_id=f"t{n}")
    before = await digest(backend.db)

    with pytest.raises(Conflict, match="exists already"):
        await logger.fork("conv-source", 1, CID)
    never_opened = SteeringInbox(logger).try_deliver(CID, "run-9", {"role": "user", "content": "+"})
    assert await never_opened is False
    assert await digest(backend.db) == before


async def test_past_the_kept_records_a_new_turn_costs_one_lookup_more(
    wire_backend: Backend,
) -> None:
    assert wire_backend.commands is not None
    rules = TurnRules(turns_recorded=2, claim_grace=COUNTED.claim_grace)
    logger = AgentMessageLogger(wire_backend.db, rules=rules)
    for n in range(3):
        await logger.log_messages(CID, turn(f"turn {n}"), turn_id=f"t{n}")
    wire_backend.commands.clear()

    await logger.log_messages(CID, turn("turn 3"), turn_id="t3")

    assert wire_backend.commands.names == [
        "findAndModify", "find", "find", "findAndModify", "insert",
    ]  # fmt: skip


async def _followed_to_the_end(backend: Backend, rules: TurnRules) -> None:
    """A turn logged now is read by a follower of the tail at once: no `seq` before it waits
    for a turn that will never store it."""
    logger = AgentMessageLogger(backend.db, rules=rules)
    last = await logger.log_messages(CID, turn("next"), turn_id="next")
    page = await ConversationStore(backend.db, rules=rules).messages_page(CID, limit=200)
    assert page.pending_seq is None
    assert [m.id for m in page.data][-2:] == [m.id for m in last.messages]
    await check_conversation(backend.db, gaps=True)


async def _popped_whole_then_past_the_records(
    backend: Backend, rules: TurnRules, logger: AgentMessageLogger
) -> None:
    """Turn "T", stored last, popped whole; then more turns than `turns_recorded`, so its
    record is dropped."""
    store = ConversationStore(backend.db, rules=rules)
    assert await store.pop_last_message(CID) is not None
    assert await store.pop_last_message(CID) is not None
    for n in range(rules.turns_recorded + 1):
        await logger.log_messages(CID, turn(f"turn {n}"), turn_id=f"n{n}")


@pytest.mark.parametrize(
    "grace", [pytest.param(timedelta(minutes=10), id="fast"), pytest.param(timedelta(0), id="slow")]
)
async def test_past_the_kept_records_a_turn_popped_whole_is_stored_as_new_however_slow(
    backend: Backend, grace: timedelta
) -> None:
    """RUNTIMES.md: a turn popped whole whose record was dropped leaves no evidence, and its
    retry is stored as a new turn. Whatever the time from its reservation to its insert
    (slower than `claim_grace`, the insert is followed by a lookup of the conversation):
    one outcome, counted once, no `seq` left for followers to wait at."""
    rules = TurnRules(turns_recorded=4, claim_grace=grace)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("first"), turn_id="first")
    await logger.log_messages(CID, turn("T"), turn_id="T")
    await _popped_whole_then_past_the_records(backend, rules, logger)

    retried = await logger.log_messages(CID, turn("T"), turn_id="T")

    assert not retried.replayed
    assert [(m.seq, m.content) for m in retried.messages] == [(12, "T?"), (13, "T!")]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (14, 7)
    await _followed_to_the_end(backend, rules)


async def test_past_the_kept_records_a_moved_turn_popped_whole_is_stored_as_new_however_slow(
    backend: Backend,
) -> None:
    """The same for a turn a late retry moved to a new block (its first attempt died before
    its insert), popped whole since: `abandon_after` 0 makes every insert slow."""
    rules = TurnRules(turns_recorded=4, abandon_after=timedelta(0))
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, [{"role": "user", "content": "m0"}], turn_id="t0")
    held = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    dead = asyncio.create_task(held.logger.log_messages(CID, turn("T"), turn_id="T"))
    await held.reserved.wait()
    dead.cancel()  # the process died between its two writes
    moved = await logger.log_messages(CID, turn("T"), turn_id="T")
    assert [m.seq for m in moved.messages] == [3, 4]
    await _popped_whole_then_past_the_records(backend, rules, logger)

    retried = await logger.log_messages(CID, turn("T"), turn_id="T")

    assert not retried.replayed
    assert [m.content for m in retried.messages] == ["T?", "T!"]
    conversation = await check_conversation(backend.db, gaps=True)
    assert conversation["turn_count"] == 7
    await _followed_to_the_end(backend, rules)


@pytest.mark.parametrize("landing", ["first attempt first", "second attempt first"])
async def test_past_the_kept_records_two_attempts_that_both_reserved_store_the_turn_once(
    backend: Backend, landing: str
) -> None:
    """RELIABILITY.md: the same turn sent twice at the same moment is stored once and counted
    once. With more than `turns_recorded` turns reserved between the two reservations, the
    second finds neither the first's record (dropped) nor its messages (not inserted yet) and
    reserves a block of its own. Whichever insert lands first stores the turn; the other
    attempt finds it there, gives its own block back (its turn and tokens taken back, its
    `seq`s gaps no turn holds) and answers the stored messages, as a replay."""
    rules = TurnRules(turns_recorded=1)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    first = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    second = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    a = asyncio.create_task(first.logger.log_messages(CID, turn("same"), turn_id="t1"))
    await first.reserved.wait()  # seq 2-3, its insert held
    await logger.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped
    b = asyncio.create_task(second.logger.log_messages(CID, turn("same"), turn_id="t1"))
    await second.reserved.wait()  # seq 6-7: a second block for the turn, its insert held
    held = [(first, a), (second, b)]
    if landing == "second attempt first":
        held.reverse()
    answers = []
    for writer, call in held:
        writer.release.set()
        answers.append(await call)

    assert [(m.id, m.seq) for m in answers[0].messages] == [
        (m.id, m.seq) for m in answers[1].messages
    ]
    assert [a.replayed for a in answers] == [False, True]
    assert answers[0].messages[0].seq == (2 if landing == "first attempt first" else 6)
    again = await logger.log_messages(CID, turn("same"), turn_id="t1")
    assert [(m.id, m.seq) for m in again.messages] == [(m.id, m.seq) for m in answers[0].messages]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (8, 3)
    await _followed_to_the_end(backend, rules)


async def _a_first_attempt_held_past_the_records(
    backend: Backend, rules: TurnRules
) -> tuple[AgentMessageLogger, SlowInsert, asyncio.Task[LoggedTurn]]:
    """A first attempt of "t1" (after "t0") reserves seq 2-3 and is held before its insert;
    "t2" is logged meanwhile, which drops t1's record (`turns_recorded=1`). A logger of its
    own, the held attempt, and its task."""
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    first = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    a = asyncio.create_task(first.logger.log_messages(CID, turn("same"), turn_id="t1"))
    await first.reserved.wait()  # seq 2-3, its insert held
    await logger.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped
    return logger, first, a


async def _an_edited_attempt_held_past_the_records(
    backend: Backend, rules: TurnRules
) -> tuple[SlowInsert, asyncio.Task[LoggedTurn]]:
    """Past the kept records: a first attempt of "t1" reserves seq 2-3 and is held; "t2"
    drops its record; a second attempt sending an edited answer finds neither record nor
    message and reserves 6-7, held; the first lands at 2-3. The second, still held."""
    _, first, a = await _a_first_attempt_held_past_the_records(backend, rules)
    second = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    b = asyncio.create_task(second.logger.log_messages(CID, turn("edited"), turn_id="t1"))
    await second.reserved.wait()  # seq 6-7, its insert held
    first.release.set()
    assert [m.seq for m in (await a).messages] == [2, 3]
    return second, b


async def test_a_block_given_back_leaves_the_preview_and_time_of_the_last_stored_message(
    backend: Backend,
) -> None:
    """DESIGN.md: the preview is the text of the last user or assistant message. An attempt
    refused after its reservation set the preview and `updated_at` gives its block back: the
    conversation then shows what its last stored message says, as if it never reserved."""
    rules = TurnRules(turns_recorded=1)
    second, b = await _an_edited_attempt_held_past_the_records(backend, rules)
    second.release.set()
    with pytest.raises(Conflict):
        await b
    conversation = await check_conversation(backend.db, gaps=True)
    last = await backend.db[MESSAGES].find_one({"conversation_id": CID}, sort=[("seq", -1)])
    assert (last["seq"], last["content"]) == (5, "later!")
    assert {6, 7} <= set(conversation["popped_seqs"])
    assert conversation["last_message_preview"] == "later!"
    assert conversation["updated_at"] == last["created_at"]
    served = await ConversationStore(backend.db, rules=rules).get_conversation(CID)
    assert served.last_message_preview == "later!"


async def test_a_block_given_back_leaves_updated_at_as_logging_the_stored_messages_would(
    backend: Backend,
) -> None:
    """The same, with times out of `seq` order (clocks skew between pods): `updated_at` is
    taken back to the latest time of the messages stored, as a pop takes its message's back,
    not to the time of the one last by `seq`."""
    rules = TurnRules(turns_recorded=1)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, at(NOON, turn("before")), turn_id="t0")  # seq 0-1
    first = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    a = asyncio.create_task(
        first.logger.log_messages(CID, at(NOON - timedelta(hours=1), turn("same")), turn_id="t1")
    )
    await first.reserved.wait()  # seq 2-3, its insert held
    later = at(NOON - timedelta(hours=2), turn("later"))
    await logger.log_messages(CID, later, turn_id="t2")  # seq 4-5, t1's record dropped
    second = SlowInsert(AgentMessageLogger(backend.db, rules=rules))
    edited = at(NOON + timedelta(hours=1), turn("edited"))
    b = asyncio.create_task(second.logger.log_messages(CID, edited, turn_id="t1"))
    await second.reserved.wait()  # seq 6-7, its insert held
    first.release.set()
    await a
    second.release.set()
    with pytest.raises(Conflict):
        await b

    conversation = await check_conversation(backend.db, gaps=True)
    stored = await backend.db[MESSAGES].find({"conversation_id": CID}).to_list(None)
    assert conversation["last_message_preview"] == "later!"
    assert conversation["updated_at"].replace(tzinfo=UTC) == NOON
    assert max(m["created_at"] for m in stored).replace(tzinfo=UTC) == NOON


async def test_a_retry_of_the_stored_content_is_a_replay_whatever_the_record_says(
    backend: Backend,
) -> None:
    """RELIABILITY.md: a retry of the same messages is a replay. The stored messages of a
    turn are the truth: while an attempt with an edited answer holds the turn's record (its
    block reserved past the kept records, not filled), a retry sending what is stored is
    answered with the stored messages, checked first and logged alike; the edited attempt is
    refused and gives its block back."""
    rules = TurnRules(turns_recorded=1)
    second, b = await _an_edited_attempt_held_past_the_records(backend, rules)
    retry = AgentMessageLogger(backend.db, rules=rules)
    await retry.check_turn(CID, turn("same"), turn_id="t1")
    again = await retry.log_messages(CID, turn("same"), turn_id="t1")
    assert again.replayed
    assert [(m.seq, m.content) for m in again.messages] == [(2, "same?"), (3, "same!")]
    second.release.set()
    with pytest.raises(Conflict):
        await b
    later = await retry.log_messages(CID, turn("same"), turn_id="t1")
    assert later.replayed
    assert [m.id for m in later.messages] == [m.id for m in again.messages]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (8, 3)


class Unreachable:
    """Makes one of a logger's collections fail `method` as a dropped connection does (the
    driver's `AutoReconnect`): a write lost on its way, or its reply lost."""

    def __init__(self, logger: AgentMessageLogger, collection: str, method: str) -> None:
        real = getattr(logger, collection)

        class Dropped:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        async def dropped(*args: Any, **kwargs: Any) -> Any:
            raise AutoReconnect("connection dropped")

        setattr(Dropped, method, staticmethod(dropped))
        setattr(logger, collection, Dropped())


@pytest.mark.parametrize("late", [False, True], ids=["recent", "past-abandon_after"])
@pytest.mark.parametrize("second", ["died before its insert", "lost its give-back"])
async def test_past_the_kept_records_a_retry_whose_block_is_empty_answers_the_turn_stored_elsewhere(
    backend: Backend, second: str, late: bool
) -> None:
    """RELIABILITY.md: a retry of any age stores nothing twice. Past the kept records a first
    attempt reserves (seq 2-3) and stalls before its insert; a second attempt of the turn
    reserves a block of its own (6-7) and never fills it: its insert is lost, or it meets the
    first's copy and the update giving its block back is lost (`StorageUnavailable`). The
    first lands at 2-3. A retry finds the record naming 6-7, empty, while the turn is stored
    whole one block away: it gives that block back (a gap no turn holds, the turn and tokens
    counted once) and answers 2-3 as a replay, recent or past `abandon_after`; so does every
    later retry, taking nothing back twice."""
    rules = TurnRules(
        turns_recorded=1, abandon_after=timedelta(0) if late else timedelta(minutes=5)
    )
    logger, first, a = await _a_first_attempt_held_past_the_records(backend, rules)
    other = AgentMessageLogger(backend.db, rules=rules)
    if second == "died before its insert":
        Unreachable(other, "_messages", "insert_many")
        with pytest.raises(StorageUnavailable):
            await other.log_messages(CID, turn("same"), turn_id="t1")  # seq 6-7, never filled
        first.release.set()
    else:
        held = SlowInsert(other)
        b = asyncio.create_task(other.log_messages(CID, turn("same"), turn_id="t1"))
        await held.reserved.wait()  # seq 6-7
        first.release.set()
        await a
        Unreachable(other, "_conversations", "update_one")
        held.release.set()
        with pytest.raises(StorageUnavailable, match="take back what the turn counted"):
            await b
    stored = await a
    assert [m.seq for m in stored.messages] == [2, 3]

    for _ in range(2):
        again = await logger.log_messages(CID, turn("same"), turn_id="t1")
        assert again.replayed
        assert [(m.id, m.seq) for m in again.messages] == [(m.id, m.seq) for m in stored.messages]
        conversation = await check_conversation(backend.db, gaps=True)
        assert (conversation["message_count"], conversation["turn_count"]) == (8, 3)
        assert {6, 7} <= set(conversation["popped_seqs"])
    await _followed_to_the_end(backend, rules)


@pytest.mark.parametrize(
    ("reserved_at", "now", "listed"),
    [(5, 5, 0), (5, 6, 1), (5, 8, 3), (5, 9, 3), (5, 104, 3), (None, 9, 3)],
)
def test_an_insert_weighs_only_the_pops_since_its_reservation_however_many_the_list_kept(
    reserved_at: int | None, now: int, listed: int
) -> None:
    """The pops finished since a turn reserved are the last entries of `popped_messages`
    (each pop lists its message last); more pops than it keeps (the newest 100) are all
    it keeps, never fewer; a reservation that did not read `pops` weighs every entry."""
    from agent_store.store._logger import _popped_after

    entries = [{"s": seq, "i": f"m{seq}"} for seq in range(3)]
    conversation = {"pops": now, "popped_messages": entries}
    assert _popped_after(conversation, reserved_at) == entries[len(entries) - listed :]


@pytest.mark.parametrize("late", [False, True], ids=["recent", "past-abandon_after"])
async def test_past_the_kept_records_a_popped_turn_sent_again_is_logged_anew_at_once(
    backend: Backend, late: bool
) -> None:
    """RELIABILITY.md: past the kept records, a turn popped whole is logged anew when sent
    again. Turn t7 is popped whole; t20 is logged, dropping t7's record, and popped whole; t7
    is sent again as first sent and lands where it first stood (seq 2-3). It is logged there,
    as `check_turn` said, recent or past `abandon_after`: the pops before its reservation are
    not pops of what it stored, so nothing it wrote is taken back, no `seq` is left a gap,
    and the same call once more is its replay."""
    rules = TurnRules(
        turns_recorded=1, abandon_after=timedelta(0) if late else timedelta(minutes=5)
    )
    logger, store = AgentMessageLogger(backend.db, rules=rules), ConversationStore(backend.db)
    await logger.log_messages(CID, turn("one"), turn_id="t1")
    for turn_id, text in (("t7", "seven"), ("t20", "twenty")):
        await logger.log_messages(CID, turn(text), turn_id=turn_id)
        for _ in range(2):
            await store.pop_last_message(CID)

    await logger.check_turn(CID, turn("seven"), turn_id="t7")
    logged = await logger.log_messages(CID, turn("seven"), turn_id="t7")
    assert [m.seq for m in logged.messages] == [2, 3]
    again = await logger.log_messages(CID, turn("seven"), turn_id="t7")
    assert again.replayed
    assert [(m.id, m.seq) for m in again.messages] == [(m.id, m.seq) for m in logged.messages]
    conversation = await check_conversation(backend.db)
    assert (conversation["message_count"], conversation["turn_count"]) == (4, 2)
    assert [m.content for m in await store.transcript(CID)] == ["one?", "one!", "seven?", "seven!"]


async def test_past_the_kept_records_a_lost_give_back_of_the_lower_block_is_finished_by_its_retry(
    backend: Backend,
) -> None:
    """RELIABILITY.md: a retry of any age stores nothing twice and counts the turn once. Past
    the kept records a first attempt reserves seq 2-3 and stalls before its insert; a second
    attempt finds neither record nor message and stores the turn at 6-7. The first's insert
    lands, meets the turn one block away, and the update giving its block back is lost
    (`StorageUnavailable`): no record names 2-3 any more. Its retry finishes that give-back
    (2-3 gaps no turn holds, the turn and its tokens counted once) and answers 6-7 as a
    replay; every later retry alike, taking nothing back twice; a follower reads on at once."""
    rules = TurnRules(turns_recorded=1)
    _, first, a = await _a_first_attempt_held_past_the_records(backend, rules)
    other = AgentMessageLogger(backend.db, rules=rules)
    stored = await other.log_messages(CID, turn("same"), turn_id="t1")
    assert [m.seq for m in stored.messages] == [6, 7]
    connected = first.logger._conversations
    Unreachable(first.logger, "_conversations", "update_one")
    first.release.set()
    with pytest.raises(StorageUnavailable, match="take back what the turn counted"):
        await a
    first.logger._conversations = connected  # the connection is back

    for _ in range(2):
        again = await first.logger.log_messages(CID, turn("same"), turn_id="t1")
        assert again.replayed
        assert [(m.id, m.seq) for m in again.messages] == [(m.id, m.seq) for m in stored.messages]
        conversation = await check_conversation(backend.db, gaps=True)
        assert (conversation["message_count"], conversation["turn_count"]) == (8, 3)
        assert {2, 3} <= set(conversation["popped_seqs"])
    await _followed_to_the_end(backend, rules)


async def _stored_once_in_the_lower_block(
    backend: Backend, rules: TurnRules, answers: Sequence[LoggedTurn]
) -> None:
    """Both attempts of "t1" answer seq 2-3, the first as its own insert, the second as a
    replay; the turn is stored there once and the conversation counts it once."""
    assert [[m.seq for m in x.messages] for x in answers] == [[2, 3], [2, 3]]
    assert [x.replayed for x in answers] == [False, True]
    stored = await backend.db[MESSAGES].find({"turn_id": "t1"}).sort("seq").to_list(None)
    assert [(m["seq"], m["content"]) for m in stored] == [(2, "same?"), (3, "same!")]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (8, 3)
    await _followed_to_the_end(backend, rules)


class OneByOne:
    """Makes a logger's first insert store its messages one at a time, each waiting for an
    event first: two attempts' inserts interleaved message by message, as an unordered
    `insert_many` may be. Raises as the driver does for the messages already stored."""

    def __init__(
        self,
        logger: AgentMessageLogger,
        waits: list[asyncio.Event | None],
        *,
        before_answering: asyncio.Event | None = None,
    ) -> None:
        self.reserved, self.done = asyncio.Event(), [asyncio.Event() for _ in waits]
        real, events, calls = logger._messages, waits, []
        outer = self

        class Interleaved:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            async def insert_many(self, documents: list[Any], **kwargs: Any) -> Any:
                calls.append(None)
                if len(calls) > 1:
                    return await real.insert_many(documents, **kwargs)
                outer.reserved.set()
                errors = []
                for index, (document, event) in enumerate(zip(documents, events, strict=True)):
                    if event is not None:
                        await event.wait()
                    try:
                        await real.insert_one(document)
                    except DuplicateKeyError as exc:
                        errors.append({"index": index, "code": 11000, "errmsg": str(exc)})
                    outer.done[index].set()
                if before_answering is not None:  # its reply held back
                    await before_answering.wait()
                if errors:
                    raise BulkWriteError({"writeErrors": errors, "nInserted": 0})
                return None

        logger._messages = Interleaved()


async def test_past_the_kept_records_two_inserts_each_storing_part_of_the_turn_store_it_once(
    backend: Backend,
) -> None:
    """The same two attempts, their inserts interleaved: the first stores the question in its
    block (seq 2), the second the answer in its own (seq 7), each meeting the other's copy.
    The turn is stored in one block, the lower: each attempt moves what the other block holds
    there, the second gives its block back, and both answer seq 2-3."""
    rules = TurnRules(turns_recorded=1)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    question, answer = asyncio.Event(), asyncio.Event()
    first_logger = AgentMessageLogger(backend.db, rules=rules)
    second_logger = AgentMessageLogger(backend.db, rules=rules)
    first = OneByOne(first_logger, [question, answer])
    a = asyncio.create_task(first_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await first.reserved.wait()  # seq 2-3, its insert held
    await logger.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped
    second = OneByOne(second_logger, [first.done[0], None])
    b = asyncio.create_task(second_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await second.reserved.wait()  # seq 6-7, its insert held until the first's question
    question.set()  # the first stores the question at 2; the second then its answer at 7
    await second.done[1].wait()
    answer.set()

    answers = await asyncio.gather(a, b)

    await _stored_once_in_the_lower_block(backend, rules, answers)


class Step:
    """Holds one call of a logger's collection method (`method`, its `call`-th) until `wait`
    is set, telling `entered` it was reached, and sets `then` once it returned: a step of one
    attempt placed between two of another's."""

    def __init__(
        self,
        logger: AgentMessageLogger,
        collection: str,
        method: str,
        *,
        call: int = 1,
        entered: asyncio.Event | None = None,
        wait: asyncio.Event | None = None,
        then: asyncio.Event | None = None,
    ) -> None:
        real, calls = getattr(logger, collection), []

        class Stepped:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        async def stepped(*args: Any, **kwargs: Any) -> Any:
            calls.append(None)
            if len(calls) != call:
                return await getattr(real, method)(*args, **kwargs)
            if entered is not None:
                entered.set()
            if wait is not None:
                await wait.wait()
            result = await getattr(real, method)(*args, **kwargs)
            if then is not None:
                then.set()
            return result

        setattr(Stepped, method, staticmethod(stepped))
        setattr(logger, collection, Stepped())


async def test_past_the_kept_records_a_message_the_other_attempt_moves_into_the_block_is_the_turns(
    backend: Backend,
) -> None:
    """As above, with the second attempt's move of the answer (from seq 7 to 3) straddling
    the first's looks: the first meets the answer at 7, finds it nowhere (deleted there, not
    yet inserted at 3), then at 3 as it reads its block. What it finds there is the turn's own
    message, with its content, in its own block: the turn stored, not a stray in the way."""
    rules = TurnRules(turns_recorded=1)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    question, answer = asyncio.Event(), asyncio.Event()
    deleted, looked, moved = asyncio.Event(), asyncio.Event(), asyncio.Event()
    first_logger = AgentMessageLogger(backend.db, rules=rules)
    second_logger = AgentMessageLogger(backend.db, rules=rules)
    first = OneByOne(first_logger, [question, answer], before_answering=deleted)
    # Its looks for the answer made, it reads its block only after the move.
    Step(first_logger, "_conversations", "find_one", entered=looked, wait=moved)
    a = asyncio.create_task(first_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await first.reserved.wait()  # seq 2-3, its insert held
    await logger.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped
    second = OneByOne(second_logger, [first.done[0], None])
    Step(second_logger, "_messages", "delete_many", wait=first.done[1], then=deleted)
    Step(second_logger, "_messages", "insert_many", call=2, wait=looked, then=moved)
    b = asyncio.create_task(second_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await second.reserved.wait()  # seq 6-7
    question.set()
    await second.done[1].wait()
    answer.set()  # the first meets the answer at 7 as the second starts moving it

    answers = await asyncio.gather(a, b)

    await _stored_once_in_the_lower_block(backend, rules, answers)


async def test_past_the_kept_records_an_answer_both_attempts_store_in_the_block_is_the_turns(
    backend: Backend,
) -> None:
    """As above, the first reading its block before the second's move and inserting after
    it: both store the answer at seq 3, and the first's insert meets the second's copy, with
    the turn's id, `seq` and content. That is the turn stored, not a message in the way."""
    rules = TurnRules(turns_recorded=1)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    question, answer = asyncio.Event(), asyncio.Event()
    deleted, inserting, moved = asyncio.Event(), asyncio.Event(), asyncio.Event()
    first_logger = AgentMessageLogger(backend.db, rules=rules)
    second_logger = AgentMessageLogger(backend.db, rules=rules)
    first = OneByOne(first_logger, [question, answer], before_answering=deleted)
    # Its block read (seq 3 empty), its insert there waits for the second's.
    Step(first_logger, "_messages", "insert_many", call=2, entered=inserting, wait=moved)
    a = asyncio.create_task(first_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await first.reserved.wait()  # seq 2-3, its insert held
    await logger.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped
    second = OneByOne(second_logger, [first.done[0], None])
    Step(second_logger, "_messages", "delete_many", wait=first.done[1], then=deleted)
    Step(second_logger, "_messages", "insert_many", call=2, wait=inserting, then=moved)
    b = asyncio.create_task(second_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await second.reserved.wait()  # seq 6-7
    question.set()
    await second.done[1].wait()
    answer.set()  # the first meets the answer at 7 as the second starts moving it

    answers = await asyncio.wait_for(asyncio.gather(a, b), timeout=30)

    await _stored_once_in_the_lower_block(backend, rules, answers)


class DiesAfterFirst:
    """Makes a logger's insert store the turn's first message only, then lose its connection:
    an attempt whose process died part-way through its insert, held until `go`."""

    def __init__(self, logger: AgentMessageLogger) -> None:
        self.reserved, self.go = asyncio.Event(), asyncio.Event()
        real, outer = logger._messages, self

        class Dying:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            async def insert_many(self, documents: list[Any], **kwargs: Any) -> Any:
                outer.reserved.set()
                await outer.go.wait()
                await real.insert_many(documents[:1], **kwargs)
                raise AutoReconnect("the process died after its first message")

        logger._messages = Dying()


async def test_past_the_kept_records_the_block_of_an_attempt_that_died_part_way_is_given_back(
    backend: Backend,
) -> None:
    """Two attempts of one turn both reserved (2-3 and 6-7); the second stores the question in
    its block and dies, its record then dropped by a later turn; the first's insert lands,
    meets the question at 6 and moves it into its block. The emptied block 6-7 is given back
    by the first attempt (a gap, the turn counted once), and every retry answers 2-3."""
    rules = TurnRules(turns_recorded=1)
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, turn("before"), turn_id="t0")
    first_logger = AgentMessageLogger(backend.db, rules=rules)
    second_logger = AgentMessageLogger(backend.db, rules=rules)
    first = SlowInsert(first_logger)
    a = asyncio.create_task(first_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await first.reserved.wait()  # seq 2-3
    await logger.log_messages(CID, turn("later"), turn_id="t2")  # t1's record dropped
    second = DiesAfterFirst(second_logger)
    b = asyncio.create_task(second_logger.log_messages(CID, turn("same"), turn_id="t1"))
    await second.reserved.wait()  # seq 6-7
    second.go.set()
    with pytest.raises(StorageUnavailable):
        await b
    await logger.log_messages(CID, turn("last"), turn_id="t3")  # the second's record dropped
    first.release.set()

    stored = await a

    assert [m.seq for m in stored.messages] == [2, 3]
    for _ in range(2):
        again = await logger.log_messages(CID, turn("same"), turn_id="t1")
        assert again.replayed
        assert [m.seq for m in again.messages] == [2, 3]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (10, 4)
    assert {6, 7} <= set(conversation["popped_seqs"])
    await _followed_to_the_end(backend, rules)


async def test_a_retry_that_stores_later_times_than_its_first_attempt_moves_updated_at(
    backend: Backend,
) -> None:
    """The first attempt reserved with times of 10 minutes ago and crashed before its
    insert; the retry regenerates its times: the conversation follows what is stored."""
    from datetime import UTC, datetime, timedelta

    logger = AgentMessageLogger(backend.db)
    earlier = datetime.now(UTC) - timedelta(minutes=10)
    first = [{**m, "created_at": earlier} for m in turn("hello")]
    await logger.log_messages(CID, first, turn_id="t-1")
    await backend.db.agent_messages.delete_many({})  # as a crash before the insert leaves it

    retried = await logger.log_messages(CID, turn("hello"), turn_id="t-1")

    assert retried.replayed
    conversation = await check_conversation(backend.db)
    latest = max(m.created_at for m in retried.messages)
    assert conversation["updated_at"].replace(tzinfo=UTC) == latest


NOON = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(when: datetime, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "created_at": when} for m in messages]


async def reserved_then_died(logger: AgentMessageLogger, messages: list[dict[str, Any]]) -> None:
    """A first attempt that reserves the turn "t-1" and dies before its insert."""

    async def died(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the process died after reserving")

    insert_many = logger._messages.insert_many
    logger._messages.insert_many = died  # type: ignore[method-assign]
    try:
        with pytest.raises(ConnectionError):
            await logger.log_messages(CID, messages, turn_id="t-1")
    finally:
        logger._messages.insert_many = insert_many  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("below", "shown"),
    [
        (NOON - timedelta(days=1), NOON - timedelta(minutes=5)),
        (NOON - timedelta(minutes=2), NOON - timedelta(minutes=2)),
    ],
    ids=["its own time", "the later time of the message below"],
)
async def test_a_retry_that_stores_earlier_times_than_its_first_attempt_takes_updated_at_back(
    backend: Backend, below: datetime, shown: datetime
) -> None:
    """The first attempt reserved with its messages' times (noon) and died; the retry, from a
    pod whose clock is 5 minutes behind, stores its own. `updated_at` is no time of the first
    attempt's, which no stored message has: it is what a pop of the turn and its append again
    would leave, the later of the turn's time and the message's below it (DESIGN.md §2)."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    await logger.log_messages(CID, at(below, turn("earlier")), turn_id="t-0")
    await reserved_then_died(logger, at(NOON, turn("hello")))

    retried = await logger.log_messages(
        CID, at(NOON - timedelta(minutes=5), turn("hello")), turn_id="t-1"
    )

    assert retried.replayed
    conversation = await check_conversation(backend.db)
    assert conversation["updated_at"].replace(tzinfo=UTC) == shown
    listed = await ConversationStore(backend.db).get_conversation(CID)
    assert listed.updated_at == shown


async def test_a_retry_taking_updated_at_back_takes_it_to_the_latest_time_stored_below(
    backend: Backend,
) -> None:
    """The same, with the messages below out of time order: the latest of them (11:58) is
    deeper than the one just below the turn (a day before): `updated_at` is the latest time
    stored, as a pop of the turn and its append again leave it (was: 11:55)."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    await logger.log_messages(CID, at(NOON - timedelta(minutes=2), turn("deep")), turn_id="t-00")
    await logger.log_messages(CID, at(NOON - timedelta(days=1), turn("earlier")), turn_id="t-0")
    await reserved_then_died(logger, at(NOON, turn("hello")))

    await logger.log_messages(CID, at(NOON - timedelta(minutes=5), turn("hello")), turn_id="t-1")

    conversation = await check_conversation(backend.db)
    assert conversation["updated_at"].replace(tzinfo=UTC) == NOON - timedelta(minutes=2)


async def test_a_turn_reserving_past_a_retry_that_stores_earlier_times_keeps_its_own_time(
    backend: Backend,
) -> None:
    """While the retry inserts, a later turn (12:10) reserves past it: `updated_at` is that
    turn's, never taken back to the retry's time (the correction is guarded: no turn reserved
    past the retry's, `updated_at` as the retry read it)."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    other = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, at(NOON - timedelta(days=1), turn("earlier")), turn_id="t-0")
    await reserved_then_died(logger, at(NOON, turn("hello")))
    insert_many = logger._messages.insert_many

    async def a_later_turn_first(*args: Any, **kwargs: Any) -> Any:
        await other.log_messages(CID, at(NOON + timedelta(minutes=10), turn("later")),
                                 turn_id="t-2")  # fmt: skip
        return await insert_many(*args, **kwargs)

    logger._messages.insert_many = a_later_turn_first  # type: ignore[method-assign]
    await logger.log_messages(CID, at(NOON - timedelta(minutes=5), turn("hello")), turn_id="t-1")

    conversation = await check_conversation(backend.db)
    assert conversation["updated_at"].replace(tzinfo=UTC) == NOON + timedelta(minutes=10)


def calls_turn(messages: int, calls_each: int, prefix: str = "c") -> list[dict[str, Any]]:
    """A question and `messages` assistant messages of `calls_each` calls each, their ids and
    names as long as a message takes (200 and 256 characters)."""

    def call(m: int, c: int) -> dict[str, Any]:
        named = f"{prefix}{m}-{c}-".ljust(200, "x")
        return {"id": named, "function": {"name": "n" * 256, "arguments": "{}"}}

    made = [
        {"role": "assistant", "tool_calls": [call(m, c) for c in range(calls_each)]}
        for m in range(messages)
    ]
    return [{"role": "user", "content": "run them all"}, *made]


async def test_a_turn_making_the_most_calls_a_turn_may_is_stored_and_one_more_is_refused(
    backend: Backend,
) -> None:
    """Every call a turn makes is named by its reservation, one command of 16 MiB at most:
    `MAX_TURN_TOOL_CALLS` with the longest ids and names fit; one call more is refused before
    any write, saying what to change (it was a 'document is too large' after 14,000)."""
    logger = AgentMessageLogger(backend.db)

    logged = await logger.log_messages(CID, calls_turn(10, 1000), user_id="u-1", turn_id="t-1")
    assert len(logged.messages) == 11
    with pytest.raises(InvalidInput, match=r"10,001 tool calls; one turn makes at most 10,000"):
        await logger.log_messages(
            CID, [*calls_turn(10, 1000), calls_turn(1, 1, "d")[1]], user_id="u-1", turn_id="t-2"
        )

    conversation = await check_conversation(backend.db)
    assert conversation["message_count"] == 11
    assert len(conversation["pending_calls"]) == PENDING_CALLS_KEPT


async def test_a_turn_whose_prompts_name_the_most_earlier_calls_it_may_is_stored_one_more_refused(
    backend: Backend,
) -> None:
    """Every call of an earlier turn a turn's prompts name is named by its reservation, one
    command of 16 MiB at most: `MAX_TURN_NAMED_CALLS` names with the longest ids and request
    ids fit, and hold the calls they name; one name more is refused before any write, saying
    what to change (7,000 were a 'document is too large', 6,500 a 15.7 MiB command)."""
    from scripts.reservation_bounds import long_id, naming_prompts

    logger = AgentMessageLogger(backend.db)
    made = [
        {"id": long_id("earlier", i), "function": {"name": "t", "arguments": "{}"}}
        for i in range(3)
    ]
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": made}],
        user_id="u-1",
        turn_id="t-1",
    )

    prompts = naming_prompts(MAX_TURN_NAMED_CALLS)
    await logger.log_messages(
        CID, [{"role": "user", "content": "ask"}, *prompts], user_id="u-1", turn_id="t-2"
    )
    pending = await ConversationStore(backend.db).pending_calls(CID)
    assert [(c.tool_call_id, c.request_id) for c in pending] == [
        (long_id("earlier", i), long_id("r", 0)) for i in range(3)
    ]
    one_more = {
        "role": "assistant",
        "hitl_action": {
            "action": "confirm",
            "request_id": "r-x",
            "tool_call_ids": [long_id("earlier", 0)],
        },
    }
    with pytest.raises(
        InvalidInput,
        match=r"1,001 calls of earlier turns named by its prompts; one turn's prompts name at "
        r"most 1,000 \(log them over several turns\)",
    ):
        await logger.log_messages(
            CID,
            [{"role": "user", "content": "again"}, *prompts, one_more],
            user_id="u-1",
            turn_id="t-3",
        )

    conversation = await check_conversation(backend.db)
    assert conversation["message_count"] == 2 + 1 + len(prompts)


async def _edited_after_a_lost_insert(logger: AgentMessageLogger) -> list[dict[str, Any]]:
    """Turn "t0" stored at 0-1; turn "t-1" reserved 2-3 (a turn start, 3 tokens each way
    counted) and died before its insert. What its retry sends: a regenerated answer, 4 tokens."""
    await logger.log_messages(CID, turn("m0"), turn_id="t0")
    await reserved_then_died(logger, turn("first", usage=3))
    return turn("regenerated", usage=4)


async def test_a_retry_with_other_content_while_its_empty_block_may_still_be_written_is_retryable(
    backend: Backend,
) -> None:
    """Within `abandon_after` the first attempt may still insert into its block: a retry with
    other content is refused as retryable, saying nothing of the turn is stored yet, nothing
    written; the first attempt's own content is still stored in its block."""
    logger = AgentMessageLogger(backend.db)
    regenerated = await _edited_after_a_lost_insert(logger)
    before = await digest(backend.db)

    with pytest.raises(StorageUnavailable, match="nothing of turn 't-1' is stored yet"):
        await logger.log_messages(CID, regenerated, turn_id="t-1")

    assert await digest(backend.db) == before
    first = await logger.log_messages(CID, turn("first", usage=3), turn_id="t-1")
    assert [m.seq for m in first.messages] == [2, 3]
    await check_conversation(backend.db)


async def test_a_retry_with_other_content_past_its_empty_blocks_abandonment_gives_it_back(
    backend: Backend,
) -> None:
    """Past `abandon_after` the first attempt's empty block is given back (its turn start and
    tokens taken back, its `seq`s gaps tail readers pass) and the retry's content is logged
    under the turn id, once; the first attempt's content is then other content."""
    rules = TurnRules(abandon_after=timedelta(0))
    logger = AgentMessageLogger(backend.db, rules=rules)
    regenerated = await _edited_after_a_lost_insert(logger)

    logged = await logger.log_messages(CID, regenerated, turn_id="t-1")
    again = await logger.log_messages(CID, regenerated, turn_id="t-1")

    assert [m.seq for m in logged.messages] == [m.seq for m in again.messages] == [4, 5]
    conversation = await check_conversation(backend.db, gaps=True)
    assert (conversation["message_count"], conversation["turn_count"]) == (6, 2)
    assert conversation["usage"] == {"input_tokens": 5, "output_tokens": 5}
    page = await ConversationStore(backend.db, rules=rules).messages_page(CID, after=None)
    assert [m.content for m in page.data] == ["m0?", "m0!", "regenerated?", "regenerated!"]
    assert page.pending_seq is None
    with pytest.raises(Conflict, match="was logged with other content"):
        await logger.log_messages(CID, turn("first", usage=3), turn_id="t-1")


@pytest.mark.parametrize(
    ("regenerated", "preview"),
    [
        ([{"role": "assistant", "content": "regenerated!"}], "regenerated!"),
        ([{"role": "assistant", "tool_calls": [{"id": "k1", "function": {"name": "f"}}]}], "m0!"),
        ([{"role": "system", "content": "be brief"}], "m0!"),
    ],
    ids=["an answer", "a call, no text", "a system message"],
)
async def test_a_block_given_back_for_other_content_takes_its_preview_and_time_back(
    backend: Backend, regenerated: list[dict[str, Any]], preview: str
) -> None:
    """DESIGN.md: the preview and `updated_at` a reservation set are taken back with its
    block, whichever attempt gives it back. The first attempt reserved at noon with an answer
    and died before its insert; past `abandon_after` its retry sends other content, dated
    earlier (a pod whose clock is behind): the preview is what the stored messages say (the
    lost answer is stored nowhere), and `updated_at` their latest time, as for a conversation
    that logged them alone; the list ranks it below one updated later (an hour before
    noon)."""
    rules = TurnRules(abandon_after=timedelta(0))
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, at(NOON - timedelta(hours=2), turn("m0")), turn_id="t0")
    await reserved_then_died(logger, at(NOON, turn("never stored")))

    await logger.log_messages(CID, at(NOON - timedelta(hours=3), regenerated), turn_id="t-1")

    conversation = await check_conversation(backend.db, gaps=True)
    assert conversation["last_message_preview"] == preview
    assert conversation["updated_at"].replace(tzinfo=UTC) == NOON - timedelta(hours=2)
    await logger.log_messages("later", at(NOON - timedelta(hours=1), turn("other")), turn_id="o")
    listed = await ConversationStore(backend.db, rules=rules).recent_conversations()
    assert [c.id for c in listed.data] == ["later", CID]
    assert listed.data[1].last_message_preview == preview


async def test_over_http_a_retry_with_other_content_after_a_lost_insert_is_logged_once_abandoned(
    backend: Backend,
) -> None:
    """The same through the API: 503 (retry) while the first attempt may still write, then 201
    with the new content under the turn id, the conversation counting it alone."""
    async with serve(backend.db, seeded=False) as api:
        regenerated = await _edited_after_a_lost_insert(api.store.logger)
        post = partial(api.http.post, f"/v1/conversations/{CID}/turns", headers=auth_headers())

        waiting = await post(json={"messages": regenerated, "turn_id": "t-1"})
        conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
        turns = [
            {**record, "a": record["a"] - timedelta(hours=1)} for record in conversation["turns"]
        ]
        await backend.db[CONVERSATIONS].update_one({"_id": CID}, {"$set": {"turns": turns}})
        logged = await post(json={"messages": regenerated, "turn_id": "t-1"})
        summary = await api.http.get(f"/v1/conversations/{CID}", headers=auth_headers())
        page = await api.http.get(f"/v1/conversations/{CID}/messages", headers=auth_headers())

    assert waiting.status_code == 503
    assert "nothing of turn 't-1' is stored yet" in waiting.json()["error"]["message"]
    assert logged.status_code == 201, logged.text
    assert [m["seq"] for m in logged.json()["messages"]] == [4, 5]
    assert (summary.json()["turn_count"], summary.json()["usage"]) == (
        2, {"input_tokens": 5, "output_tokens": 5}
    )  # fmt: skip
    assert [m["seq"] for m in page.json()["data"]] == [0, 1, 4, 5]
    assert page.json().get("pending_seq") is None
