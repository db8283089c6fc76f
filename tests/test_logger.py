"""The write path: what a logged turn stores, and that retries never duplicate it."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    NotFound,
    StorageFailure,
    StoreError,
    TranscriptMoved,
    Truncation,
    VersionMismatch,
)
from agent_store.core import MAX_JSON_VALUES, message_adapter
from agent_store.store import TurnRules, _turns, blob_id, parse_messages
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns
from tests.api_harness import digest
from tests.conftest import Backend

CID = "conv-1"


async def log_example(logger: AgentMessageLogger) -> None:
    for turn_id, messages in example_turns():
        await logger.log_messages(
            EXAMPLE_CONVERSATION_ID, messages, user_id=EXAMPLE_USER_ID, turn_id=turn_id
        )


def expected_example() -> list[dict[str, Any]]:
    """The example's messages as they must read back: validated, with runtime context removed."""
    flat = [m for _, messages in example_turns() for m in messages]
    expected = [
        message_adapter.validate_python(m).model_dump(exclude={"id", "seq", "search_text"})
        for m in flat
    ]
    expected[0]["content"] = "What's the weather in Paris and in Lyon?"
    return expected


async def test_example_conversation_is_stored_and_read_back_exactly(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.ensure_indexes()
    await log_example(logger)

    transcript = await store.transcript(EXAMPLE_CONVERSATION_ID)

    assert len(transcript) == 12
    assert [m.seq for m in transcript] == list(range(12))
    expected = expected_example()
    for index, message in enumerate(transcript):
        assert message.model_dump(exclude={"id", "seq", "search_text"}) | {
            "conversation_id": None,
            "user_id": None,
            "turn_id": None,
        } == expected[index] | {"conversation_id": None, "user_id": None, "turn_id": None}
        assert message.conversation_id == EXAMPLE_CONVERSATION_ID
        assert message.user_id == EXAMPLE_USER_ID
    conversation = await store.get_conversation(EXAMPLE_CONVERSATION_ID)
    assert conversation.turn_count == 4
    assert conversation.message_count == 12
    assert conversation.usage.input_tokens == 120 + 190 + 240 + 300
    assert conversation.usage.output_tokens == 31 + 18 + 25 + 22
    assert conversation.pending_hitl is None  # raised in turn 2, cleared by the upload of turn 3
    assert conversation.last_message_preview == "Booking service unavailable (HTTP 503)"
    assert conversation.updated_at == transcript[-1].created_at


async def test_stored_documents_hold_exactly_the_contract_fields(backend: Backend) -> None:
    await log_example(AgentMessageLogger(backend.db))
    message = await backend.db.agent_messages.find_one({"seq": 0})
    assert set(message) == {
        "_id", "conversation_id", "role", "content", "tool_calls", "tool_call_id",
        "hitl_action", "error", "upload", "created_at", "token_usage", "latency_ms",
        "seq", "user_id", "turn_id", "search_text", "truncated", "native", "epoch",
    }  # fmt: skip
    conversation = await backend.db.agent_conversations.find_one()
    assert set(conversation) == {
        "_id", "conversation_id", "user_id", "name", "name_source", "created_at", "updated_at",
        "turn_count", "last_message_preview", "message_count", "pending_hitl", "pending_calls",
        "usage", "forked_from", "legacy_conversation_id", "legacy_user_id", "turns",
        "turns_dropped", "epoch", "epoch_marks",
        "name_message_id",  # the example's first question names it
        "pending_blocks",  # its booking question listed pending state (none left now)
    }  # fmt: skip
    assert message["epoch"] == conversation["epoch"]
    assert conversation["epoch_marks"] is True  # created since checkpoints named epochs


async def test_hidden_runtime_context_is_never_stored(backend: Backend) -> None:
    await log_example(AgentMessageLogger(backend.db))
    raw = [d async for d in backend.db.agent_messages.find()]
    assert raw
    assert not [d for d in raw if "RUNTIME CONTEXT" in str(d)]
    conversation = await backend.db.agent_conversations.find_one()
    assert "RUNTIME CONTEXT" not in str(conversation)


async def test_retrying_a_logged_turn_stores_nothing_twice(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    turn_id, messages = example_turns()[0]
    first = await logger.log_messages(CID, messages, user_id="u1", turn_id=turn_id)
    again = await logger.log_messages(CID, messages, user_id="u1", turn_id=turn_id)

    assert not first.replayed
    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in first.messages]
    assert await backend.db.agent_messages.count_documents({}) == len(messages)
    assert (await ConversationStore(backend.db).get_conversation(CID)).turn_count == 1


async def test_retry_without_turn_id_is_recognised_by_its_content(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    _, messages = example_turns()[1]
    await logger.log_messages(CID, messages)
    again = await logger.log_messages(CID, messages)
    assert again.replayed
    assert await backend.db.agent_messages.count_documents({}) == len(messages)


class CrashBeforeInsert(Exception):
    pass


async def test_retry_after_crash_between_the_two_writes_stores_each_message_once(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = AgentMessageLogger(backend.db)
    turn_id, messages = example_turns()[0]

    async def crash(self: AgentMessageLogger, *step: object) -> None:
        raise CrashBeforeInsert

    with monkeypatch.context() as patch:
        patch.setattr(AgentMessageLogger, "_store", crash)
        with pytest.raises(CrashBeforeInsert):
            await logger.log_messages(CID, messages, turn_id=turn_id)
    assert await backend.db.agent_messages.count_documents({}) == 0

    retried = await logger.log_messages(CID, messages, turn_id=turn_id)

    assert retried.replayed
    stored = await ConversationStore(backend.db).transcript(CID)
    assert [m.seq for m in stored] == list(range(len(messages)))
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    assert conversation.turn_count == 1
    assert conversation.message_count == len(messages)


async def test_retry_after_a_partial_insert_adds_only_the_missing_messages(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    turn_id, messages = example_turns()[0]
    first = await logger.log_messages(CID, messages, turn_id=turn_id)
    # As if the crash had come after the first two documents reached the server.
    await backend.db.agent_messages.delete_many({"seq": {"$gte": 2}})

    await logger.log_messages(CID, messages, turn_id=turn_id)

    stored = await ConversationStore(backend.db).transcript(CID)
    assert [m.id for m in stored] == [m.id for m in first.messages]


async def test_turn_id_reused_for_different_messages_is_a_conflict(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], turn_id="t1")
    with pytest.raises(Conflict, match=re.escape("turn 't1' was logged with other content")):
        await logger.log_messages(
            CID,
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            turn_id="t1",
        )


def _keyed(
    kind: str, keys: list[str], text: str = "ok?", *, days: float = 2
) -> list[dict[str, Any]]:
    """A turn whose one JSON object (`kind`: a native form's value, a call's arguments given
    as an object, a prompt's params) lists `keys` in that order, as a client serialising a
    hash map may on each attempt, with a number `days` deep in it."""
    values = {"city": "Paris", "units": "metric", "days": [{"b": 1, "a": days}]}
    obj = {key: values[key] for key in keys}
    when = "2026-01-01T00:00:00Z"
    if kind == "native":
        native = {"format": "openai-agents", "set": {"extra": obj}}
        return [{"role": "assistant", "content": text, "created_at": when, "native": native}]
    if kind == "arguments":
        call = {"id": "call_1", "function": {"name": "weather", "arguments": obj}}
        return [{"role": "assistant", "content": text, "created_at": when, "tool_calls": [call]}]
    prompt = {"request_id": "q1", "action": "confirm", "params": obj}
    return [{"role": "assistant", "content": text, "created_at": when, "hitl_action": prompt}]


KEYED = ["native", "arguments", "hitl params"]
IN_ORDER, REORDERED = ["city", "units", "days"], ["days", "units", "city"]


@pytest.mark.parametrize("turn_id", ["run-1", None], ids=["named", "derived"])
@pytest.mark.parametrize("kind", KEYED)
async def test_a_retry_whose_json_objects_list_their_keys_in_another_order_is_the_same_turn(
    backend: Backend, kind: str, turn_id: str | None
) -> None:
    """JSON objects are equal whatever their key order: a retry sending one with its keys
    (at any depth) in another order is a replay, named or not, never another turn."""
    logger = AgentMessageLogger(backend.db)
    first = await logger.log_messages(CID, _keyed(kind, IN_ORDER), turn_id=turn_id)
    again = await logger.log_messages(CID, _keyed(kind, REORDERED), turn_id=turn_id)

    assert again.replayed
    assert again.turn_id == first.turn_id
    assert await backend.db.agent_messages.count_documents({}) == 1
    assert (await ConversationStore(backend.db).get_conversation(CID)).message_count == 1
    with pytest.raises(Conflict, match="logged with other content"):
        await logger.log_messages(CID, _keyed(kind, REORDERED, "no?"), turn_id=first.turn_id)


@pytest.mark.parametrize("turn_id", ["run-1", None], ids=["named", "derived"])
@pytest.mark.parametrize("kind", KEYED)
async def test_a_retry_spelling_a_whole_number_with_or_without_a_fraction_is_the_same_turn(
    backend: Backend, kind: str, turn_id: str | None
) -> None:
    """`2.0` and `2` are one JSON number (a JavaScript client cannot tell them apart): a
    retry spelling it the other way is a replay, named or not; `2.5` is another value."""
    logger = AgentMessageLogger(backend.db)
    first = await logger.log_messages(CID, _keyed(kind, IN_ORDER, days=2.0), turn_id=turn_id)
    again = await logger.log_messages(CID, _keyed(kind, REORDERED, days=2), turn_id=turn_id)

    assert again.replayed
    assert again.turn_id == first.turn_id
    assert await backend.db.agent_messages.count_documents({}) == 1
    with pytest.raises(Conflict, match="logged with other content"):
        await logger.log_messages(CID, _keyed(kind, IN_ORDER, days=2.5), turn_id=first.turn_id)


@pytest.mark.parametrize("turn_id", ["run-1", None], ids=["named", "derived"])
@pytest.mark.parametrize("kind", ["arguments", "hitl params"])
@pytest.mark.parametrize(
    ("sent", "retried"),
    [(2**64, 18446744073709552000), (1e300, 10**300), (10**19, 1e19)],
    ids=["exact-then-shortest", "float-then-digits", "digits-then-float"],
)
async def test_a_retry_spelling_a_number_past_64_bits_as_other_digits_of_it_is_the_same_turn(
    backend: Backend, kind: str, turn_id: str | None, sent: float, retried: float
) -> None:
    """A double past 64 bits has more than one spelling: its exact digits (Python's), its
    shortest digits (JavaScript's), an exponent. A retry spelling it another way is a
    replay, named or not."""
    logger = AgentMessageLogger(backend.db)
    first = await logger.log_messages(CID, _keyed(kind, IN_ORDER, days=sent), turn_id=turn_id)
    again = await logger.log_messages(CID, _keyed(kind, IN_ORDER, days=retried), turn_id=turn_id)

    assert again.replayed
    assert again.turn_id == first.turn_id
    assert await backend.db.agent_messages.count_documents({}) == 1


@pytest.mark.parametrize("turn_id", ["run-1", None], ids=["named", "derived"])
@pytest.mark.parametrize(
    "arguments",
    [lambda n: {"n": n}, lambda n: [n], lambda n: {"n": [n]}],
    ids=["one key", "a list", "a list under one key"],
)
@pytest.mark.parametrize(
    ("sent", "retried"),
    [(2**64, 18446744073709552000), (1.8446744073709552e19, 18446744073709552000)],
    ids=["exact-then-shortest", "float-then-shortest"],
)
async def test_arguments_holding_nothing_but_a_number_past_64_bits_replay_however_it_is_spelt(
    backend: Backend,
    turn_id: str | None,
    arguments: Callable[[float], object],
    sent: float,
    retried: float,
) -> None:
    """The same rule for arguments with no second key or fraction anywhere in them (one key,
    a list): a retry spelling the number another way is a replay."""

    def called(n: float) -> list[dict[str, Any]]:
        call = {"id": "call_1", "function": {"name": "pay", "arguments": arguments(n)}}
        return [{"role": "assistant", "created_at": "2026-01-01T00:00:00Z", "tool_calls": [call]}]

    logger = AgentMessageLogger(backend.db)
    first = await logger.log_messages(CID, called(sent), turn_id=turn_id)
    again = await logger.log_messages(CID, called(retried), turn_id=turn_id)

    assert again.replayed
    assert again.turn_id == first.turn_id
    assert await backend.db.agent_messages.count_documents({}) == 1


def test_arguments_count_as_the_json_value_when_spelt_as_the_store_writes_an_object() -> None:
    """Arguments given as an object are kept as compact JSON text: their digest is that of the
    value, keys in any order (so is a caller's text spelt exactly so: stored alike, it cannot
    be told apart). A caller's text spelt otherwise (spaced, not JSON) is content as it is."""
    from agent_store.store._turns import content_digest

    def digest(arguments: object) -> int:
        call = {"id": "c1", "function": {"name": "f", "arguments": arguments}}
        message = {"role": "assistant", "tool_calls": [call]}
        return content_digest([message_adapter.dump_python(
            message_adapter.validate_python(message), by_alias=True)])  # fmt: skip

    assert digest({"b": 1, "a": {"d": 2, "c": 3}}) == digest({"a": {"c": 3, "d": 2}, "b": 1})
    assert digest({"b": 1, "a": 2}) == digest('{"b":1,"a":2}') == digest('{"a":2,"b":1}')
    assert digest('{"b": 1, "a": 2}') != digest('{"a": 2, "b": 1}')
    assert digest("{b:1,a:2}") != digest("{a:2,b:1}")


def _as_logged_before(patch: pytest.MonkeyPatch) -> None:
    """Log as the store did before key order stopped counting: free-form objects digested
    (and turn ids derived) with their keys in the order given."""
    from agent_store.store import _turns

    patch.setattr(_turns, "_in_key_order", lambda document: document, raising=False)


@pytest.mark.parametrize("turn_id", ["run-1", None], ids=["named", "derived"])
@pytest.mark.parametrize("kind", KEYED)
@pytest.mark.parametrize("case", ["recorded", "past the kept records", "insert lost"])
async def test_a_retry_of_a_turn_recorded_before_key_order_stopped_counting_is_a_replay(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    turn_id: str | None,
    case: str,
) -> None:
    """A turn recorded by a store that digested (and derived its id from) objects with their
    keys in the order given, retried across the upgrade with the very messages it sent then:
    its record's digest (the old form) and its derived id (the old derivation, looked up
    where a turn id is) still recognise it, stored once."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(turns_recorded=1))
    messages = _keyed(kind, REORDERED)
    with monkeypatch.context() as patch:
        _as_logged_before(patch)
        if case == "insert lost":

            async def crash(self: AgentMessageLogger, *step: object) -> None:
                raise CrashBeforeInsert

            patch.setattr(AgentMessageLogger, "_store", crash)
            with pytest.raises(CrashBeforeInsert):
                await logger.log_messages(CID, messages, turn_id=turn_id)
        else:
            first = await logger.log_messages(CID, messages, turn_id=turn_id)
            assert not first.replayed
    if case == "past the kept records":
        await logger.log_messages(CID, _said("later"), turn_id="later")

    await logger.check_turn(CID, messages, turn_id=turn_id)
    again = await logger.log_messages(CID, messages, turn_id=turn_id)

    assert again.replayed
    stored = await ConversationStore(backend.db).transcript(CID)
    assert [m.turn_id for m in stored if m.content == "ok?"] == [again.turn_id]
    if turn_id is None and case != "insert lost":
        assert again.turn_id == first.turn_id
    later = 1 if case == "past the kept records" else 0
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    assert conversation.message_count == len(stored) == 1 + later


async def test_concurrent_turns_get_unique_increasing_seq_and_exact_turn_count(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()

    async def turn(n: int) -> None:
        await logger.log_messages(
            CID,
            [
                {"role": "user", "content": f"question {n}"},
                {"role": "assistant", "content": f"answer {n}"},
            ],
            turn_id=f"turn-{n}",
        )

    await asyncio.gather(*(turn(n) for n in range(20)))

    stored = await ConversationStore(backend.db).transcript(CID)
    assert [m.seq for m in stored] == list(range(40))
    # Each turn's two messages are adjacent and in order.
    for user, assistant in zip(stored[::2], stored[1::2], strict=True):
        assert user.turn_id == assistant.turn_id
        assert (user.role, assistant.role) == ("user", "assistant")
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    assert conversation.turn_count == 20


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        pytest.param(
            [{"role": "tool", "content": "42"}],
            "a tool message needs `tool_call_id`",
            id="tool-without-call-id",
        ),
        pytest.param(
            [{"role": "user", "content": "hi", "token_usage": {"input_tokens": 1}}],
            "`token_usage` is not allowed on a user message",
            id="usage-on-user",
        ),
        pytest.param(
            [{"role": "narrator", "content": "hi"}],
            "'role' must be one of 'system', 'user', 'assistant', 'tool', not 'narrator'",
            id="unknown-role",
        ),
        pytest.param(
            [
                {"role": "tool", "tool_call_id": "c1", "content": "early"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
            ],
            "answers tool call 'c1' before the assistant message that makes it",
            id="result-before-call",
        ),
        pytest.param(
            [
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "g"}}]},
            ],
            "tool call id 'c1' is used twice",
            id="repeated-call-id",
        ),
        pytest.param([], "a turn needs at least one message", id="empty"),
        pytest.param(
            [{"role": "user", "content": "hi", "created_at": "yesterday"}],
            "created_at",
            id="bad-date",
        ),
    ],
)
async def test_invalid_turn_raises_a_clear_error_and_writes_nothing(
    backend: Backend, messages: list[dict[str, Any]], error: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape(error)):
        await AgentMessageLogger(backend.db).log_messages(CID, messages)
    assert await backend.db.agent_messages.count_documents({}) == 0
    assert await backend.db.agent_conversations.count_documents({}) == 0


async def test_hostile_conversation_id_is_refused(backend: Backend) -> None:
    with pytest.raises(InvalidInput, match="conversation_id"):
        await AgentMessageLogger(backend.db).log_messages(
            {"$ne": None},  # type: ignore[arg-type]
            [{"role": "user", "content": "hi"}],
        )
    assert await backend.db.agent_conversations.count_documents({}) == 0


SYNC_REFUSED = "needs an async database handle (PyMongo's AsyncMongoClient, or Motor)"


@pytest.mark.parametrize("kind", [AgentMessageLogger, ConversationStore])
def test_a_synchronous_pymongo_database_is_refused_before_anything_is_written(
    database: Any, kind: type[Any]
) -> None:
    with pytest.raises(TypeError, match=re.escape(SYNC_REFUSED)):
        kind(database)
    assert database.list_collection_names() == []


@pytest.mark.parametrize("kind", [AgentMessageLogger, ConversationStore])
def test_a_client_given_for_a_database_is_refused_saying_to_pass_a_database(
    client: Any, kind: type[Any]
) -> None:
    with pytest.raises(TypeError, match=re.escape("pass a database, client[name]")):
        kind(client)


async def test_a_closed_client_is_named_as_the_cause_not_the_database(wire_uri: str) -> None:
    """A client the application closed (at shutdown, while a runtime still logs) refused
    nothing at the database: the error says the client was closed."""
    from pymongo import AsyncMongoClient

    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri)
    logger = AgentMessageLogger(client["closed_client"])
    await client.close()

    with pytest.raises(StorageFailure, match="the database client was closed") as refused:
        await logger.log_messages(CID, [{"role": "user", "content": "hi"}])
    assert "refused" not in str(refused.value)


async def test_oversize_message_is_truncated_marked_and_stored(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    huge = "word " * 4_000_000  # 20 MB: larger than MongoDB's 16 MiB document limit
    logged = await logger.log_messages(
        CID, [{"role": "user", "content": huge}, {"role": "assistant", "content": "ok"}]
    )
    stored = (await ConversationStore(backend.db).transcript(CID))[0]
    conversation = await backend.db.agent_conversations.find_one({"_id": CID})
    assert conversation is not None
    assert stored.truncated is not None
    assert stored.truncated["content"] == Truncation(
        length=len(huge),
        blob_id=blob_id(logged.messages[0].id or "", "content", conversation["epoch"]),
        sha256=hashlib.sha256(huge.encode()).hexdigest(),
    )
    assert stored.content is not None
    assert len(stored.content.encode()) < logger.rules.max_message_bytes
    assert stored.content.endswith("[truncated]")
    assert len(logged.messages) == 2


async def test_a_prompt_whose_params_are_many_small_values_keeps_its_question(
    backend: Backend,
) -> None:
    """Params of many small values take more BSON than their JSON text: the cut is sized by
    what cutting each field saves, so the params are cut and the person's question, short,
    is kept whole, in the message and in the pending prompt."""
    rules = TurnRules(max_message_bytes=64 * 1024)
    logger, store = AgentMessageLogger(backend.db, rules=rules), ConversationStore(backend.db)
    params = {"items": [{} for _ in range(40_000)]}  # ~0.5 MB of BSON, 0.16 MB of JSON
    ask = {"action": "pay", "params": params, "request_id": "r1"}
    said = [{"role": "assistant", "content": "Shall I pay 120 EUR?", "hitl_action": ask}]

    logged = await logger.log_messages(CID, said, turn_id="t1")

    [stored] = await store.transcript(CID)
    assert stored.content == logged.messages[0].content == "Shall I pay 120 EUR?"
    assert stored.truncated is not None
    assert list(stored.truncated) == ["hitl_action.params"]
    pending = await store.pending_hitl(CID)
    assert pending is not None
    assert pending.prompt == "Shall I pay 120 EUR?"
    [whole] = await store.with_full_texts([stored])
    assert whole.hitl_action is not None
    assert whole.hitl_action.params == params


async def test_pending_hitl_is_set_by_the_prompt_and_cleared_by_an_upload(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    turns = example_turns()
    for turn_id, messages in turns[:2]:
        await logger.log_messages(CID, messages, turn_id=turn_id)
    pending = await store.pending_hitl(CID)
    assert pending is not None
    assert (pending.request_id, pending.action) == ("req-booking-1", "confirm_booking")
    assert pending.prompt is not None
    assert pending.prompt.startswith("The 09:04 TGV")

    await logger.log_messages(CID, turns[2][1], turn_id=turns[2][0])

    assert await store.pending_hitl(CID) is None


async def test_conversation_owner_is_stamped_on_every_message(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation(CID, user_id="owner")
    logged = await logger.log_messages(CID, [{"role": "user", "content": "hi"}])
    assert {m.user_id for m in logged.messages} == {"owner"}


async def test_a_service_turn_naming_another_user_than_the_owner_is_a_conflict(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation(CID, user_id="owner")
    with pytest.raises(Conflict, match="belongs to another user than 'someone'"):
        await logger.log_messages(CID, [{"role": "user", "content": "hi"}], user_id="someone")
    assert await backend.db.agent_messages.count_documents({}) == 0


async def test_owner_only_logging_refuses_another_users_conversation(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation(CID, user_id="owner")
    with pytest.raises(Exception, match="not found"):
        await logger.log_messages(
            CID, [{"role": "user", "content": "hi"}], user_id="intruder", owner_only=True
        )
    assert await backend.db.agent_messages.count_documents({}) == 0


async def test_owner_only_answers_in_a_missing_conversation_are_not_found_as_in_a_hidden_one(
    backend: Backend,
) -> None:
    """A turn naming the calls its answers answer (`answers_to`) never creates its
    conversation: to a user token a missing one is the NotFound another user's is, with the
    same message; a service is told it does not exist."""
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation(CID, user_id="owner")
    answer = [{"role": "tool", "tool_call_id": "c-1", "content": "x"}]
    refused = []
    for conversation_id in (CID, "conv-nowhere"):
        with pytest.raises(StoreError) as caught:
            await logger.log_messages(conversation_id, answer, user_id="intruder",
                                      owner_only=True, answers_to={"c-1": "m-0"})  # fmt: skip
        refused.append((type(caught.value), str(caught.value).replace(conversation_id, "<id>")))
    assert refused == [(NotFound, "conversation '<id>' was not found")] * 2
    with pytest.raises(Conflict, match="which holds none: it does not exist"):
        await logger.log_messages("conv-nowhere", answer, answers_to={"c-1": "m-0"})
    assert await backend.db.agent_messages.count_documents({}) == 0


async def test_upsert_conversation_refuses_to_change_the_owner(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation(CID, user_id="owner", name="Trip")
    with pytest.raises(Conflict, match="belongs to another user"):
        await logger.upsert_conversation(CID, user_id="intruder")
    conversation = await logger.upsert_conversation(CID)
    assert (conversation.user_id, conversation.name) == ("owner", "Trip")


@pytest.mark.parametrize("there", [None, "owner", "intruder"])
async def test_upsert_conversation_create_only_refuses_any_conversation_there(
    backend: Backend, there: str | None
) -> None:
    """`create_only`: a conversation under the id, unowned, the user's or another's, is a
    Conflict and stays as it was; a new one is the conversation an upsert creates."""
    logger = AgentMessageLogger(backend.db)
    created = await logger.upsert_conversation(CID + "-new", user_id="owner", create_only=True)
    assert created == await ConversationStore(backend.db).get_conversation(CID + "-new")
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], user_id=there)
    before = await backend.db.agent_conversations.find_one({"_id": CID})
    with pytest.raises(Conflict, match="exists already"):
        await logger.upsert_conversation(CID, user_id="owner", create_only=True)
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == before


def _prompt_of(cents: float) -> list[dict[str, Any]]:
    ask = {"action": "pay", "request_id": "r1", "params": {"cents": [cents]}}
    return [{"role": "assistant", "hitl_action": ask}]


async def test_an_integer_past_64_bits_spelling_a_double_is_kept_as_that_double(
    backend: Backend,
) -> None:
    """BSON's integers are 64 bits: a wider one that spells a double (its exact value, or the
    shortest digits naming it, as JavaScript writes it) is that double, so `10**19` and
    `1e19` are one number and the retry spelling it the other way replays."""
    logger = AgentMessageLogger(backend.db)

    first = await logger.log_messages(CID, _prompt_of(1e19), turn_id="t1")
    again = await logger.log_messages(CID, _prompt_of(10**19), turn_id="t1")
    other = await logger.log_messages(CID + "-2", _prompt_of(9223372036854776000), turn_id="t1")

    assert again.replayed
    assert again.messages == first.messages
    stored = await backend.db.agent_messages.find_one({"conversation_id": CID + "-2"})
    assert stored is not None
    assert other.messages[0].hitl_action is not None
    assert other.messages[0].hitl_action.params == {"cents": [float(2**63)]}
    assert stored["hitl_action"]["params"] == {"cents": [float(2**63)]}


@pytest.mark.parametrize("wide", [2**63 + 1, 10**19 + 1, -(2**63) - 1])
async def test_an_integer_past_64_bits_no_double_holds_is_refused_and_nothing_is_written(
    backend: Backend, wide: int
) -> None:
    """Kept as the nearest double it would lose digits, silently: refused, naming it."""
    with pytest.raises(InvalidInput, match=r"hitl_action\.params.*cents\.0.*digits"):
        await AgentMessageLogger(backend.db).log_messages(CID, _prompt_of(wide))
    assert await backend.db.agent_messages.count_documents({}) == 0
    assert await backend.db.agent_conversations.count_documents({}) == 0


async def test_an_integer_past_every_double_is_refused_naming_it_and_nothing_is_written(
    backend: Backend,
) -> None:
    with pytest.raises(InvalidInput, match=r"hitl_action\.params.*cents\.0"):
        await AgentMessageLogger(backend.db).log_messages(CID, _prompt_of(10**400))
    assert await backend.db.agent_messages.count_documents({}) == 0
    assert await backend.db.agent_conversations.count_documents({}) == 0


async def test_a_live_turn_cannot_take_the_id_the_migration_gives_a_legacy_turn(
    backend: Backend,
) -> None:
    """Turn ids starting `legacy-` are the migration's: it tells its own messages by them."""
    logger = AgentMessageLogger(backend.db)

    with pytest.raises(InvalidInput, match="name migrated legacy turns"):
        await logger.log_messages("c-1", [{"role": "user", "content": "hi"}], turn_id="legacy-t1")

    assert await backend.db.agent_messages.count_documents({}) == 0


def test_a_prompt_naming_no_calls_digests_as_before_prompts_could_name_them() -> None:
    """A retry of a turn recorded before `tool_call_ids` existed is still a replay: a prompt
    naming none is digested without the key."""
    from agent_store.store._turns import content_digest, json_content_digest

    asks = {"role": "assistant", "content": "Sure?",
            "hitl_action": {"action": "confirm", "params": {}, "request_id": "r1"}}  # fmt: skip
    now = message_adapter.dump_python(message_adapter.validate_python(asks), by_alias=True)
    assert now["hitl_action"]["tool_call_ids"] is None
    before = {**now, "hitl_action": {"action": "confirm", "params": {}, "request_id": "r1"}}

    assert content_digest([now]) == content_digest([before])
    assert json_content_digest([now]) == json_content_digest([before])


def _said(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_a_turn_logged_at_a_seq_another_turn_took_is_refused_and_writes_nothing(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    first = await logger.log_messages(CID, _said("first"), turn_id="t-1", next_seq=0)
    await logger.log_messages(CID, _said("another writer"), turn_id="t-2", next_seq=1)

    with pytest.raises(TranscriptMoved, match=re.escape("its next seq is 2, not 1")) as moved:
        await logger.log_messages(CID, _said("late"), turn_id="t-3", next_seq=1)
    assert moved.value.next_seq == 2
    assert [m.content for m in await store.transcript(CID)] == ["first", "another writer"]
    # A retry of a logged turn is answered as always, wherever the conversation went on.
    again = await logger.log_messages(CID, _said("first"), turn_id="t-1", next_seq=0)
    assert again.replayed
    assert again.messages == first.messages
    logged = await logger.log_messages(CID, _said("late"), turn_id="t-3", next_seq=2)
    assert [m.seq for m in logged.messages] == [2]


async def test_a_turn_of_an_earlier_step_than_one_logged_is_refused_and_writes_nothing(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, _said("step b"), turn_id="t-b", step="b")

    for step in ("a", "b"):
        with pytest.raises(TranscriptMoved, match="logged step 'b', after") as behind:
            await logger.log_messages(CID, _said(f"step {step} again"), step=step)
        assert behind.value.later_step == "b"
    await logger.log_messages(CID, _said("step c"), step="c")
    assert [m.content for m in await store.transcript(CID)] == ["step b", "step c"]
    with pytest.raises(InvalidInput, match="invalid next_seq -1"):
        await logger.log_messages(CID, _said("nowhere"), next_seq=-1)
    with pytest.raises(InvalidInput, match="invalid next_seq"):
        await logger.log_messages(CID, _said("nowhere"), next_seq=2**63)
    for hostile in ("\ud800", "x" * 100_000, "a b"):
        with pytest.raises(InvalidInput, match="invalid step"):
            await logger.log_messages(CID, _said("nowhere"), step=hostile)


def _turn(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": text + "!"}]


async def _lost_after_a_later_turn(backend: Backend, logger: AgentMessageLogger) -> None:
    """`t-a` at 0-1 (step s0); `t-b` (next_seq 2, step s1) reserved 2-3 and its insert was
    lost; `t-x` (next_seq 4, step s2) logged at 4-5 after it."""
    await logger.log_messages(CID, _turn("a"), turn_id="t-a", next_seq=0, step="s0")
    await logger.log_messages(CID, _turn("b"), turn_id="t-b", next_seq=2, step="s1")
    await backend.db.agent_messages.delete_many({"turn_id": "t-b"})  # as if never inserted
    await logger.log_messages(CID, _turn("x"), turn_id="t-x", next_seq=4, step="s2")


_SAME_OR_REGENERATED = pytest.mark.parametrize("sent", ["b", "b regenerated"])


@_SAME_OR_REGENERATED
@pytest.mark.parametrize(
    ("next_seq", "step", "said"),
    [
        (2, "s1", "logged step 's2', after 's1'"),
        (None, "s1", "logged step 's2', after 's1'"),
        (2, None, "its next seq is 6, not 2"),
    ],
)
async def test_a_late_retry_moved_to_the_end_keeps_its_step_and_next_seq(
    backend: Backend, next_seq: int | None, step: str | None, said: str, sent: str
) -> None:
    """LIBRARY.md: a turn is logged only at `next_seq` and after every step logged before. A
    retry past `abandon_after` of a turn that stored nothing moves to the end only where those
    conditions still hold; else `TranscriptMoved`, nothing written, its block given back. So
    is its retry with other content (the runtime regenerated its answer), logged anew at the
    end once its empty block is given back."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    store = ConversationStore(backend.db)
    await _lost_after_a_later_turn(backend, logger)

    with pytest.raises(TranscriptMoved, match=re.escape(said)) as moved:
        await logger.log_messages(CID, _turn(sent), turn_id="t-b", next_seq=next_seq, step=step)
    assert moved.value.next_seq == 6
    assert [m.content for m in await store.transcript(CID)] == ["a", "a!", "x", "x!"]
    conversation = await store.get_conversation(CID)
    assert (conversation.turn_count, conversation.message_count) == (2, 6)
    assert (await backend.db.agent_conversations.find_one({"_id": CID}))["last_step"] == "s2"


async def test_a_late_retry_whose_step_is_still_the_latest_moves_to_the_end(
    backend: Backend,
) -> None:
    """Its own reservation logged its step: a turn of no step after it leaves that the latest,
    so the move keeps the step's order and the turn is stored at the end."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    await logger.log_messages(CID, _turn("a"), turn_id="t-a", step="s0")
    await logger.log_messages(CID, _turn("b"), turn_id="t-b", step="s1")
    await backend.db.agent_messages.delete_many({"turn_id": "t-b"})  # as if never inserted
    await logger.log_messages(CID, _turn("x"), turn_id="t-x")

    retried = await logger.log_messages(CID, _turn("b"), turn_id="t-b", step="s1")
    assert [m.seq for m in retried.messages] == [6, 7]
    with pytest.raises(TranscriptMoved, match="logged step 's1', after"):
        await logger.log_messages(CID, _said("behind"), step="s1")


@pytest.mark.parametrize("later", [False, True], ids=["alone", "after-a-stepless-turn"])
async def test_a_late_retry_with_other_content_whose_step_is_still_the_latest_is_logged(
    backend: Backend, later: bool
) -> None:
    """RELIABILITY.md: past `abandon_after` the empty block is given back and the new content
    logged at the end, counted once. The step its own reservation logged is no step logged
    before it: the retry is judged on the conversation the give-back leaves."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    store = ConversationStore(backend.db)
    await logger.log_messages(CID, _turn("a"), turn_id="t-a", step="s0")
    await logger.log_messages(CID, _turn("b"), turn_id="t-b", step="s1")
    await backend.db.agent_messages.delete_many({"turn_id": "t-b"})  # as if never inserted
    if later:
        await logger.log_messages(CID, _turn("x"), turn_id="t-x")

    retried = await logger.log_messages(CID, _turn("b regenerated"), turn_id="t-b", step="s1")
    assert [m.seq for m in retried.messages] == ([6, 7] if later else [4, 5])
    texts = [m.content for m in await store.transcript(CID)]
    assert texts == ["a", "a!", *(["x", "x!"] if later else []), "b regenerated", "b regenerated!"]
    assert (await store.get_conversation(CID)).turn_count == (3 if later else 2)
    with pytest.raises(TranscriptMoved, match=re.escape("logged step 's1', after 's1'")):
        await logger.log_messages(CID, _said("behind"), step="s1")


@_SAME_OR_REGENERATED
@pytest.mark.parametrize("step", [None, "s1"])
async def test_a_late_retry_whose_block_nothing_followed_keeps_its_first_attempts_next_seq(
    backend: Backend, step: str | None, sent: str
) -> None:
    """A retry sends its first attempt's arguments: its `next_seq` names the seq that attempt
    reserved at. Only its own empty block followed it, so the conversation did not move on:
    the turn is stored at the end (moved, or logged anew once that block is given back)."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    store = ConversationStore(backend.db)
    await logger.log_messages(CID, _turn("a"), turn_id="t-a", next_seq=0, step="s0")
    await logger.log_messages(CID, _turn("b"), turn_id="t-b", next_seq=2, step=step)
    await backend.db.agent_messages.delete_many({"turn_id": "t-b"})  # as if never inserted

    retried = await logger.log_messages(CID, _turn(sent), turn_id="t-b", next_seq=2, step=step)
    assert [m.seq for m in retried.messages] == [4, 5]
    assert [m.content for m in await store.transcript(CID)] == ["a", "a!", sent, sent + "!"]
    assert (await store.get_conversation(CID)).turn_count == 2
    with pytest.raises(TranscriptMoved, match=re.escape("its next seq is 6, not 2")):
        await logger.log_messages(CID, _said("behind"), next_seq=2)


@pytest.mark.parametrize(
    ("next_seq", "logged_at"), [(None, [6, 7]), (6, [6, 7]), (2, None)], ids=str
)
async def test_a_regenerated_retry_after_a_late_retry_was_refused_is_logged_anew(
    backend: Backend, next_seq: int | None, logged_at: list[int] | None
) -> None:
    """RELIABILITY.md: past `abandon_after` a retry with other content finds the empty block
    given back and is logged anew at the end. A late retry refused where it would land
    (`TranscriptMoved`) gave that block up already: the regenerated retry after it is a new
    turn all the same, logged, or refused by its own `next_seq`; never `Unreserved` on every
    attempt. `check_turn` raises what `log_messages` does."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    store = ConversationStore(backend.db)
    await _lost_after_a_later_turn(backend, logger)
    with pytest.raises(TranscriptMoved):
        await logger.log_messages(CID, _turn("b"), turn_id="t-b", next_seq=2, step="s1")

    arguments = {"turn_id": "t-b", "next_seq": next_seq}
    checked = await _outcome(logger.check_turn(CID, _turn("b regenerated"), **arguments))
    logged = await _outcome(logger.log_messages(CID, _turn("b regenerated"), **arguments))
    assert checked == logged
    if logged_at is None:
        assert logged is not None
        assert logged[0] is TranscriptMoved
        return
    assert logged is None
    retried = await logger.log_messages(CID, _turn("b regenerated"), turn_id="t-b")
    assert retried.replayed
    assert [m.seq for m in retried.messages] == logged_at
    texts = [m.content for m in await store.transcript(CID)]
    assert texts == ["a", "a!", "x", "x!", "b regenerated", "b regenerated!"]
    conversation = await store.get_conversation(CID)
    assert (conversation.turn_count, conversation.message_count) == (3, 8)


async def _outcome(call: Any) -> tuple[type[BaseException], str] | None:
    try:
        await call
    except StoreError as refused:
        return type(refused), str(refused)
    return None


@pytest.mark.parametrize(
    ("conversation", "turn_id", "sent", "next_seq", "step"),
    [
        (CID, "t-new", "new", 6, "s3"),
        (CID, "t-new", "new", 2, None),
        (CID, "t-new", "new", None, "s1"),
        (CID, "t-new", "new", 6, "s2"),
        (CID, "t-a", "a", 0, "s0"),
        (CID, "t-b", "b", 2, "s1"),
        (CID, "t-b", "b regenerated", 2, None),
        (CID, "t-b", "b", None, "s3"),
        ("conv-new", "t-new", "new", 0, "s0"),
        ("conv-new", "t-new", "new", 3, None),
    ],
)
async def test_checking_a_turn_with_next_seq_or_step_raises_what_logging_it_does(
    backend: Backend,
    conversation: str,
    turn_id: str,
    sent: str,
    next_seq: int | None,
    step: str | None,
) -> None:
    """LIBRARY.md: `check_turn` raises what `log_messages` refuses the same turn with, decided
    as it decides, writing nothing; its compare-and-sets (`next_seq`, `step`) included: a new
    turn behind the transcript's end or an earlier step, a retry of a logged turn (a replay),
    and a late retry moved to the end or refused where it would land."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    await _lost_after_a_later_turn(backend, logger)
    before = await digest(backend.db)
    arguments = {"turn_id": turn_id, "next_seq": next_seq, "step": step}

    checked = await _outcome(logger.check_turn(conversation, _turn(sent), **arguments))
    assert await digest(backend.db) == before
    logged = await _outcome(logger.log_messages(conversation, _turn(sent), **arguments))
    assert checked == logged


async def test_a_step_whose_messages_are_logged_is_claimed_only_at_the_transcripts_end(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, _said("said once"), turn_id="t-b", step="b")

    with pytest.raises(TranscriptMoved, match="its next seq is 1, not 0") as moved:
        await logger.claim_step(CID, step="c", next_seq=0)
    assert (moved.value.next_seq, moved.value.later_step) == (1, None)
    with pytest.raises(TranscriptMoved, match="logged step 'b', after") as behind:
        await logger.claim_step(CID, step="a", next_seq=1)
    assert behind.value.later_step == "b"
    await logger.claim_step(CID, step="c", next_seq=1)  # "c" said the same as "b"
    with pytest.raises(TranscriptMoved, match="logged step 'c', after"):
        await logger.log_messages(CID, _said("behind c"), step="b2")
    assert [m.content for m in await store.transcript(CID)] == ["said once"]


@pytest.mark.parametrize("named", ["its version", "a stale version", "no version"])
async def test_a_user_naming_a_version_of_another_users_conversation_is_told_it_is_not_found(
    backend: Backend, named: str
) -> None:
    """SECURITY.md: to a user (`owner_only`) another user's conversation is NotFound, as one
    that is not there, whatever version the turn names: a version never tells them apart."""
    logger = AgentMessageLogger(backend.db)
    said = [{"role": "user", "content": "hello"}]
    first = await logger.upsert_conversation("c-theirs", user_id="u-1")
    await logger.log_messages("c-theirs", said, user_id="u-1")
    version = {"its version": first.version, "a stale version": "0" * 16, "no version": None}
    sent = {"user_id": "u-2", "owner_only": True, "version": version[named]}

    with pytest.raises(NotFound) as theirs:
        await logger.log_messages("c-theirs", said, **sent)  # type: ignore[arg-type]
    assert str(theirs.value) == "conversation 'c-theirs' was not found"
    assert len(await ConversationStore(backend.db).transcript("c-theirs")) == 1
    if version[named] is not None:  # a version names a conversation: none there is NotFound
        with pytest.raises(NotFound) as missing:
            await logger.log_messages("c-nowhere", said, **sent)  # type: ignore[arg-type]
        assert str(missing.value) == "conversation 'c-nowhere' was not found"


async def test_a_turn_naming_a_version_is_logged_only_into_that_conversation(
    backend: Backend,
) -> None:
    """LIBRARY.md `log_messages`' `version`: the conversation it names, never one started
    again under the id, nor a new one where it went."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    said = [{"role": "user", "content": "hello"}]
    first = await logger.upsert_conversation("c-version", user_id="u-1")
    await logger.log_messages("c-version", said, user_id="u-1", version=first.version)
    await store.delete("c-version")

    with pytest.raises(NotFound):
        await logger.log_messages("c-version", said, user_id="u-1", version=first.version)
    with pytest.raises(NotFound):
        await store.get_conversation("c-version")
    await logger.upsert_conversation("c-version", user_id="u-1")
    with pytest.raises(VersionMismatch):
        await logger.log_messages("c-version", said, user_id="u-1", version=first.version)
    assert await store.transcript("c-version") == []


@pytest.mark.parametrize(
    "arguments",
    [
        "[" + ",".join(["{}"] * MAX_JSON_VALUES) + "]",
        "[" * 3_000 + "1,2" + "]" * 3_000,
    ],
    ids=["wide", "deep"],
)
async def test_arguments_past_the_bounds_of_json_the_store_walks_are_logged_as_written(
    backend: Backend, arguments: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library agrees with the service: arguments holding more JSON values than
    `MAX_JSON_VALUES`, or nested deeper than `MAX_PARAMS_DEPTH`, are logged as written and
    compared with a retry as written, never walked to sort their keys (nested 3,000 deep
    they raised a bare RecursionError)."""
    walked: list[object] = []
    normal = _turns._normal_json
    monkeypatch.setattr(_turns, "_normal_json", lambda v: walked.append(v) or normal(v))
    logger = AgentMessageLogger(backend.db)
    call = {"id": "c1", "function": {"name": "f", "arguments": arguments}}
    turn = [{"role": "assistant", "tool_calls": [call]}]
    first = await logger.log_messages(CID, turn, turn_id="t0")
    again = await logger.log_messages(CID, turn, turn_id="t0")

    assert again.replayed
    assert first.turn_id == again.turn_id
    assert len(walked) <= MAX_JSON_VALUES
    (stored,) = await ConversationStore(backend.db).transcript(CID)
    assert stored.tool_calls is not None
    assert stored.tool_calls[0].function.arguments == arguments


def test_a_native_json_text_of_more_values_than_the_bound_is_refused_naming_it() -> None:
    native = {"format": "langchain", "set": {"k": "[" + "0," * MAX_JSON_VALUES + "0]"}}
    with pytest.raises(InvalidInput, match=f"json_text names k, .*more than {MAX_JSON_VALUES}"):
        parse_messages([{"role": "user", "content": "x", "native": native | {"json_text": ["k"]}}])
